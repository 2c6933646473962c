#include "daemon/catalog.h"

#include <sys/stat.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <memory>

#include "common/fs.h"
#include "common/log.h"
#include "common/metadata.h"
#include "common/names.h"

namespace flashckpt {

std::string EncodeSignal(const std::string& job, const Signal& s, uint64_t bytes) {
  nlohmann::json j = {{"job", job},          {"rank", s.rank},   {"step", s.step},
                      {"resumed_from", s.resumed_from}, {"files", s.files}, {"bytes", bytes}};
  return j.dump() + "\n";
}

Result<Signal> ReadSignal(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 1u << 20));
  auto j = nlohmann::json::parse(text, nullptr, false);
  auto bad = [&] { return Corruption(path + " is not a flashckpt signal"); };
  if (j.is_discarded() || !j.is_object()) return bad();
  auto rank = j.find("rank");
  auto step = j.find("step");
  auto from = j.find("resumed_from");
  auto files = j.find("files");
  if (rank == j.end() || !rank->is_number_unsigned() || step == j.end() || !step->is_number_integer() ||
      from == j.end() || !from->is_number_integer() || files == j.end() || !files->is_array()) {
    return bad();
  }
  Signal s;
  s.rank = rank->get<uint32_t>();
  s.step = step->get<int64_t>();
  s.resumed_from = from->get<int64_t>();
  for (const auto& f : *files) {
    if (!f.is_string()) return bad();
    std::string name = f.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") return bad();
    s.files.push_back(std::move(name));
  }
  return s;
}

std::string Catalog::CheckpointDir(const std::string& job, int64_t step) const {
  return JobDir(job) + "/" + CheckpointDirName(step);
}

std::mutex& Catalog::JobMutex(const std::string& job) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& m = job_mu_[job];
  if (!m) m = std::make_unique<std::mutex>();
  return *m;
}

bool Catalog::IsComplete(const std::string& job, int64_t step) const {
  return PathExists(CheckpointDir(job, step) + "/metadata.json");
}

Result<bool> Catalog::MaybeComplete(const std::string& job, int64_t step, uint32_t world_size,
                                    int64_t resumed_from) {
  std::lock_guard<std::mutex> lock(JobMutex(job));
  std::string dir = CheckpointDir(job, step);
  if (PathExists(dir + "/metadata.json")) return true;
  std::vector<std::string> files;
  for (uint32_t r = 0; r < world_size; ++r) {
    auto signal = ReadSignal(dir + "/" + SignalFileName(r));
    if (!signal.ok()) return false;  // missing (not yet written) or unreadable: not complete
    if (signal->step != step || signal->resumed_from != resumed_from || signal->rank != r) return false;
    for (auto& f : signal->files) files.push_back(std::move(f));
  }
  ASSIGN_OR_RETURN(CheckpointMetadata meta, BuildMetadataFromFiles(dir, std::move(files)));
  if (meta.step != step || meta.job != job || meta.topology.world_size != world_size) {
    return Corruption(dir + ": files describe job '" + meta.job + "' step " + std::to_string(meta.step) +
                      " world size " + std::to_string(meta.topology.world_size) + ", expected '" + job + "' step " +
                      std::to_string(step) + " world size " + std::to_string(world_size));
  }
  RETURN_IF_ERROR(WriteFileDurably(dir, "metadata.json", MetadataToJson(meta)));
  auto latest = LatestComplete(job);
  if (latest && *latest <= step) {
    RETURN_IF_ERROR(WriteFileDurably(JobDir(job), "LATEST", std::to_string(step) + "\n"));
  }
  Logger("catalog")->info("complete job={} step={} files={} tensors={}", job, step, meta.files.size(),
                          meta.pieces.size());
  return true;
}

std::optional<int64_t> Catalog::LatestComplete(const std::string& job) const {
  auto names = ListDir(JobDir(job));
  if (!names.ok()) return std::nullopt;
  std::optional<int64_t> best;
  for (const auto& n : *names) {
    auto step = ParseCheckpointDirName(n);
    if (!step || (best && *step <= *best)) continue;
    if (IsComplete(job, *step)) best = step;
  }
  return best;
}

Result<std::vector<CheckpointEntry>> Catalog::List(const std::string& job) const {
  std::vector<std::string> jobs;
  if (!job.empty()) {
    RETURN_IF_ERROR(ValidateJobName(job));
    jobs.push_back(job);
  } else {
    auto names = ListDir(root_);
    if (!names.ok()) return names.status();
    for (const auto& n : *names) {
      if (ValidateJobName(n).ok()) jobs.push_back(n);
    }
  }
  std::vector<CheckpointEntry> out;
  for (const auto& j : jobs) {
    auto names = ListDir(JobDir(j));
    if (!names.ok()) {
      if (names.status().code() == StatusCode::kNotFound) continue;
      return names.status();
    }
    auto latest = LatestComplete(j);
    for (const auto& n : *names) {
      auto step = ParseCheckpointDirName(n);
      if (!step) continue;
      CheckpointEntry e;
      e.job = j;
      e.step = *step;
      e.path = CheckpointDir(j, *step);
      auto files = ListDir(e.path);
      if (files.ok()) {
        for (const auto& f : *files) {
          if (f.rfind("saved_signal_", 0) == 0) ++e.signals;
          struct stat st {};
          if (::stat((e.path + "/" + f).c_str(), &st) == 0) e.bytes += static_cast<uint64_t>(st.st_size);
        }
      }
      e.complete = IsComplete(j, *step);
      if (e.complete) {
        auto meta = ReadMetadataFile(e.path);
        if (meta.ok()) e.world_size = meta->topology.world_size;
      }
      e.latest = latest && *latest == *step;
      out.push_back(std::move(e));
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.job != b.job ? a.job < b.job : a.step < b.step;
  });
  return out;
}

}  // namespace flashckpt
