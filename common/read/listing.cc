#include "common/read/listing.h"

#include <sys/stat.h>

#include <algorithm>
#include <optional>

#include "common/base/names.h"
#include "common/format/metadata.h"
#include "common/format/signal.h"
#include "common/io/fs.h"

namespace flashckpt {
Result<std::optional<CheckpointInfo>> DescribeCheckpointDir(const std::string& job, int64_t step,
                                                            const std::string& path, IoEnv* io) {
  CheckpointInfo e;
  e.job = job;
  e.step = step;
  e.path = path;
  auto files = ListDirIfExists(path, io);
  if (!files.ok()) {
    struct stat st {};
    if (io->Stat(path, &st) == 0 && !S_ISDIR(st.st_mode)) return std::optional<CheckpointInfo>();  // not a step
    return files.status();
  }
  if (!*files) return std::optional<CheckpointInfo>();
  bool signals_agree = true;  // every signal read records the same world size
  for (const auto& f : **files) {
    struct stat st {};
    if (io->Stat(path + "/" + f, &st) == 0) e.bytes += static_cast<uint64_t>(st.st_size);
    if (f.rfind("saved_signal_", 0) != 0) continue;
    ++e.signals;
    // The listing shows what is there: a signal that cannot be read is counted, without a node.
    auto signal = ReadSignal(path + "/" + f, io);
    if (!signal.ok() || SignalFileName(signal->rank) != f || signal->step != step) continue;
    e.signalled.push_back({signal->rank, signal->node, signal->run_id, signal->resumed_from});
    if (e.world_size == 0) e.world_size = signal->world_size;
    if (signal->world_size != e.world_size) signals_agree = false;
  }
  std::sort(e.signalled.begin(), e.signalled.end(),
            [](const SignalledRank& a, const SignalledRank& b) { return a.rank < b.rank; });
  ASSIGN_OR_RETURN(e.complete, Exists(path + "/metadata.json", io));
  // A complete checkpoint's world size is its signals' when they all say it: metadata.json grows
  // with the job (hundreds of MiB at thousands of ranks) and is parsed only for older checkpoints
  // whose signals do not record it.
  const bool from_signals = signals_agree && e.world_size != 0 && e.signalled.size() == e.world_size;
  if (e.complete && !from_signals) {
    auto meta = ReadMetadataFile(path, io);
    if (!meta.ok()) {
      if (meta.status().code() == StatusCode::kNotFound) return std::optional<CheckpointInfo>();  // deleted
      return meta.status();
    }
    e.world_size = meta->topology.world_size;
  }
  return std::optional<CheckpointInfo>(std::move(e));
}

Result<std::vector<CheckpointInfo>> ListCheckpoints(const std::string& root, const std::string& job, IoEnv* io) {
  std::vector<std::string> jobs;
  if (!job.empty()) {
    RETURN_IF_ERROR(ValidateJobName(job));
    jobs.push_back(job);
  } else {
    ASSIGN_OR_RETURN(auto names, ListDir(root, io));
    for (const auto& n : names) {
      if (ValidateJobName(n).ok()) jobs.push_back(n);
    }
  }
  std::vector<CheckpointInfo> out;
  for (const auto& j : jobs) {
    const std::string job_dir = root + "/" + j;
    ASSIGN_OR_RETURN(auto names, ListDirIfExists(job_dir, io));
    if (!names) continue;
    const size_t first = out.size();
    for (const auto& n : *names) {
      auto step = ParseCheckpointDirName(n);
      if (!step) continue;
      ASSIGN_OR_RETURN(auto entry, DescribeCheckpointDir(j, *step, job_dir + "/" + n, io));
      if (entry) out.push_back(std::move(*entry));
    }
    // The newest complete checkpoint of the job is its latest.
    CheckpointInfo* newest = nullptr;
    for (size_t i = first; i < out.size(); ++i) {
      if (out[i].complete && (newest == nullptr || out[i].step > newest->step)) newest = &out[i];
    }
    if (newest != nullptr) newest->latest = true;
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.job != b.job ? a.job < b.job : a.step < b.step; });
  return out;
}

}  // namespace flashckpt
