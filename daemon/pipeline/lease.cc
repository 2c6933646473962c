#include "daemon/pipeline/lease.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string LeaseDir(const std::string& root, const std::string& job) { return root + "/" + job + "/.leases"; }

}  // namespace

Leases::Leases(std::string root, std::string node, std::chrono::milliseconds ttl, IoEnv* io)
    : root_(std::move(root)), node_(std::move(node)), ttl_(ttl), io_(io) {
  if (ttl_.count() > 0) refresher_ = std::thread([this] { RefreshLoop(); });
}

Leases::~Leases() {
  std::set<std::pair<std::string, int64_t>> held;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    held.swap(held_);
  }
  cv_.NotifyAll();
  if (refresher_.joinable()) refresher_.join();
  for (const auto& [path, step] : held) (void)io_->Unlink(path);
}

Status Leases::Write(const std::string& path, int64_t step) const {
  nlohmann::json j = {{"step", step}, {"node", node_}, {"pid", static_cast<int64_t>(::getpid())},
                      {"expires_unix_ms", UnixMs() + ttl_.count()}};
  const size_t slash = path.rfind('/');
  return WriteFileDurably(path.substr(0, slash), path.substr(slash + 1), j.dump() + "\n", nullptr, io_);
}

std::string Leases::Take(const std::string& job, int64_t step) {
  if (ttl_.count() <= 0) return "";
  uint64_t n = 0;
  {
    MutexLock lock(&mu_);
    n = next_++;
  }
  const std::string dir = LeaseDir(root_, job);
  const std::string path = dir + "/" + CheckpointDirName(step) + "." + node_ + "." + std::to_string(::getpid()) +
                           "." + std::to_string(n);
  // The directory exists only while a lease does (Drop removes it when it is empty), so another
  // daemon may remove it between MakeDirs and the write: then the write is tried again.
  // Only `.leases` is made: a job directory that does not exist holds nothing to protect (and a
  // restore of a missing step must not create one).
  Status s;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (io_->Mkdir(dir, 0755) != 0 && errno != EEXIST) {
      if (errno == ENOENT) return "";
      s = ErrnoStatus("mkdir", dir);
      break;
    }
    s = Write(path, step);
    if (s.ok() || s.code() != StatusCode::kNotFound) break;
  }
  if (!s.ok()) {
    Logger("catalog")->warn("lease job={} step={} not taken: {}; only this node knows the step is in use", job, step,
                            s.ToString());
    return "";
  }
  MutexLock lock(&mu_);
  held_.insert({path, step});
  return path;
}

void Leases::Drop(const std::string& path) {
  if (path.empty()) return;
  {
    MutexLock lock(&mu_);
    for (auto it = held_.begin(); it != held_.end(); ++it) {
      if (it->first == path) {
        held_.erase(it);
        break;
      }
    }
  }
  if (io_->Unlink(path) != 0 && errno != ENOENT) {
    Logger("catalog")->warn("lease {} not removed: {}; it expires in at most {} ms", path, std::strerror(errno),
                            ttl_.count());
    return;
  }
  // The last lease of the job takes the directory with it (it fails while others remain: fine), so
  // a job directory holds `.leases` only while something of it is in use.
  (void)::rmdir(path.substr(0, path.rfind('/')).c_str());
}

Result<std::optional<std::string>> Leases::LiveHolder(const std::string& job, int64_t step) const {
  std::optional<std::string> holder;
  if (ttl_.count() <= 0) return holder;
  const std::string dir = LeaseDir(root_, job);
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(dir, io_));
  if (!names) return holder;
  const std::string prefix = CheckpointDirName(step) + ".";
  const int64_t now = UnixMs();
  for (const auto& name : *names) {
    // A lease being written (WriteFileDurably's temporary) is not one yet: its holder renames it
    // into place, or removes it.
    if (name.rfind(prefix, 0) != 0 || TemporaryOwner(name).has_value()) continue;
    const std::string path = dir + "/" + name;
    auto text = ReadSmallFile(path, 4096, io_);
    if (!text.ok() && text.status().code() == StatusCode::kNotFound) continue;  // dropped meanwhile
    auto j = text.ok() ? nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false) : nlohmann::json();
    const bool valid = j.is_object() && j.contains("expires_unix_ms") && j["expires_unix_ms"].is_number_integer();
    if (!valid) {
      // Not a lease this release writes (unreadable, too large, not JSON): it protects nothing, and
      // goes once it is older than a TTL (never while it might be another writer's in progress).
      struct stat st {};
      if (io_->Stat(path, &st) == 0 && std::chrono::system_clock::from_time_t(st.st_mtime) + ttl_ <
                                           std::chrono::system_clock::now()) {
        Logger("catalog")->warn("lease file {} is not a lease: removed", path);
        (void)io_->Unlink(path);
      }
      continue;
    }
    const int64_t expires = j["expires_unix_ms"].get<int64_t>();
    if (expires <= now) {
      // Expired: its holder died, hung, or lost the root for a TTL; it protects nothing.
      Logger("catalog")->info("lease expired job={} step={} file={}: removed", job, step, name);
      if (io_->Unlink(path) == 0) (void)::rmdir(dir.c_str());
      continue;
    }
    std::string node = j.contains("node") && j["node"].is_string() ? j["node"].get<std::string>() : "?";
    if (!ValidateNodeName(node).ok()) node = "?";
    const std::string pid = j.contains("pid") && j["pid"].is_number_integer() ? std::to_string(j["pid"].get<int64_t>()) : "?";
    holder = "node " + node + " pid " + pid + ", expires in " + std::to_string((expires - now + 999) / 1000) + " s";
    return holder;
  }
  return holder;
}

void Leases::RefreshLoop() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    cv_.WaitFor(&lock, ttl_ / 3);
    if (stopping_) break;
    std::vector<std::pair<std::string, int64_t>> held(held_.begin(), held_.end());
    lock.Unlock();
    std::vector<std::string> rewritten;
    for (const auto& [path, step] : held) {
      Status s = Write(path, step);
      if (!s.ok()) {
        Logger("catalog")->warn("lease {} not refreshed: {}", path, s.ToString());
      } else {
        rewritten.push_back(path);
      }
    }
    lock.Lock();
    // A lease dropped while it was rewritten would be back: remove it again.
    std::vector<std::string> dropped;
    for (const std::string& path : rewritten) {
      bool still = false;
      for (const auto& h : held_) still = still || h.first == path;
      if (!still) dropped.push_back(path);
    }
    if (!dropped.empty()) {
      lock.Unlock();
      for (const std::string& path : dropped) (void)io_->Unlink(path);
      lock.Lock();
    }
  }
}

}  // namespace flashckpt
