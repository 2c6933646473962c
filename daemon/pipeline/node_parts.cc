#include "daemon/pipeline/node_parts.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <vector>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/safetensors.h"
#include "common/io/fs.h"
#include "common/io/shm.h"

namespace flashckpt {

namespace {

constexpr std::string_view kSafetensors = ".safetensors";

bool IsSafetensors(const std::string& name) {
  return name.size() > kSafetensors.size() &&
         name.compare(name.size() - kSafetensors.size(), kSafetensors.size(), kSafetensors) == 0;
}

uint64_t BytesOf(const RankPart& r) {
  uint64_t bytes = 256;
  for (const RenderedFile& f : r.files) {
    bytes += 256;
    for (const auto& [key, text] : f.tensors) bytes += key.size() + text.size();
  }
  return bytes;
}

}  // namespace

std::string NewNodePartToken() {
  auto token = RandomToken();
  if (token.ok()) return *token;
  return std::to_string(::getpid()) + "x" +
         std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
}

Result<SignalIdentity> SignalIdentityOf(const std::string& path, IoEnv* io) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path, io));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat", path);
  return SignalIdentity{static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
                        static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                        static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec};
}

NodeParts::NodeParts(IoEnv* io, std::string token) : io_(io), name_(NodePartFileName(token)) {}

void NodeParts::NoteRank(const std::string& dir, const std::string& job, const Signal& signal) {
  auto part = std::make_shared<RankPart>();
  part->rank = signal.rank;
  part->written_us = signal.written_us;
  std::map<std::string, const SignalHeader*> headers;
  for (const SignalHeader& h : signal.headers) headers.emplace(h.file, &h);
  for (const std::string& name : signal.files) {
    if (!IsSafetensors(name)) continue;
    auto it = headers.find(name);
    if (it == headers.end()) return;  // not recorded (too large for the signal): the completion reads it
    const SignalHeader& h = *it->second;
    auto header = ParseSafetensorsHeader(h.json, h.header_bytes, h.file_bytes);
    Result<RenderedFile> file = header.ok() ? RenderFile(dir + "/" + name, name, *header) : header.status();
    if (!file.ok() || file->job != job || file->step != signal.step) {
      Logger("catalog")->warn("rank {} of job={} step={}: file {} is not held for the completion ({})", signal.rank,
                              job, signal.step, name, file.ok() ? "another job or step" : file.status().ToString());
      return;
    }
    part->files.push_back(std::move(*file));
  }
  auto identity = SignalIdentityOf(dir + "/" + SignalFileName(signal.rank), io_);
  if (!identity.ok()) return;
  part->signal = *identity;
  const uint64_t bytes = BytesOf(*part);
  MutexLock lock(&mu_);
  const Key key{job, signal.step};
  auto it = steps_.find(key);
  if (it != steps_.end() && it->second.attempt != signal.attempt()) {
    EraseLocked(it);  // an earlier attempt's: never mixed with this one's
    it = steps_.end();
  }
  if (it == steps_.end()) {
    // At most kStepsPerJob steps of a job: the oldest go (a step that never completes, say).
    std::vector<int64_t> held;
    for (auto s = steps_.lower_bound(Key{job, INT64_MIN}); s != steps_.end() && s->first.first == job; ++s) {
      held.push_back(s->first.second);
    }
    for (size_t i = 0; i + kStepsPerJob <= held.size(); ++i) EraseLocked(steps_.find(Key{job, held[i]}));
    it = steps_.emplace(key, Step{}).first;
    it->second.seq = next_seq_++;
    it->second.attempt = signal.attempt();
  }
  Step& step = it->second;
  auto old = step.ranks.find(signal.rank);
  if (old != step.ranks.end()) {
    const uint64_t was = BytesOf(*old->second);
    step.bytes -= was;
    bytes_ -= was;
    step.ranks.erase(old);
  }
  // Over the bound, the steps held longest go (of any job: steps another daemon completed are not
  // dropped otherwise); a rank that still does not fit is not held (its signal is read).
  while (bytes_ + bytes > kMaxBytes) {
    auto oldest = steps_.end();
    for (auto s = steps_.begin(); s != steps_.end(); ++s) {
      if (s != it && (oldest == steps_.end() || s->second.seq < oldest->second.seq)) oldest = s;
    }
    if (oldest == steps_.end()) return;
    EraseLocked(oldest);
  }
  step.bytes += bytes;
  bytes_ += bytes;
  step.ranks.emplace(signal.rank, std::move(part));
}

void NodeParts::ForgetRank(const std::string& dir, const std::string& job, int64_t step, uint32_t rank) {
  bool remove = false;
  {
    MutexLock lock(&mu_);
    auto it = steps_.find(Key{job, step});
    if (it == steps_.end()) return;
    Step& s = it->second;
    ++s.generation;
    auto r = s.ranks.find(rank);
    if (r != s.ranks.end()) {
      const uint64_t was = BytesOf(*r->second);
      s.bytes -= was;
      bytes_ -= was;
      s.ranks.erase(r);
    }
    remove = s.published;
    s.published = false;
  }
  if (remove && io_->Unlink(dir + "/" + name_) != 0 && errno != ENOENT) {
    Logger("catalog")->warn("could not remove node part {}/{}: {}", dir, name_, std::strerror(errno));
  }
}

void NodeParts::Publish(const std::string& dir, const std::string& job, int64_t step, const Attempt& attempt) {
  NodePart part;
  part.job = job;
  part.step = step;
  part.attempt = attempt;
  uint64_t generation = 0;
  std::vector<std::shared_ptr<const RankPart>> held;  // kept alive while encoded, not copied
  {
    MutexLock lock(&mu_);
    auto it = steps_.find(Key{job, step});
    if (it == steps_.end() || it->second.attempt != attempt || it->second.ranks.empty()) return;
    generation = it->second.generation;
    for (const auto& [rank, r] : it->second.ranks) held.push_back(r);
  }
  std::vector<const RankPart*> ranks;
  ranks.reserve(held.size());
  for (const auto& r : held) ranks.push_back(r.get());
  Status written = WriteFileDurably(dir, name_, EncodeNodePart(part, &ranks), nullptr, io_);
  if (!written.ok()) {
    Logger("catalog")->warn("node part of job={} step={} not written ({}): the completion reads those ranks' signals",
                            job, step, written.ToString());
    return;
  }
  bool raced = false;
  {
    MutexLock lock(&mu_);
    auto it = steps_.find(Key{job, step});
    raced = it == steps_.end() || it->second.generation != generation;
    if (!raced) it->second.published = true;
  }
  // A rank was written again (or the step dropped) while this part was made: it may describe files
  // that were being replaced, so it goes. So does one that landed after another daemon completed
  // the step (which removes the parts it saw).
  struct stat st {};
  if (!raced) raced = io_->Stat(dir + "/metadata.json", &st) == 0;
  if (raced) (void)io_->Unlink(dir + "/" + name_);
}

std::map<uint32_t, std::shared_ptr<const RankPart>> NodeParts::Held(const std::string& job, int64_t step,
                                                                    const Attempt& attempt) const {
  MutexLock lock(&mu_);
  auto it = steps_.find(Key{job, step});
  if (it == steps_.end() || it->second.attempt != attempt) return {};
  return it->second.ranks;
}

void NodeParts::Drop(const std::string& job, int64_t step) {
  MutexLock lock(&mu_);
  auto it = steps_.find(Key{job, step});
  if (it != steps_.end()) EraseLocked(it);
}

void NodeParts::EraseLocked(std::map<Key, Step>::iterator it) {
  bytes_ -= it->second.bytes;
  steps_.erase(it);
}

}  // namespace flashckpt
