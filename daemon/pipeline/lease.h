// Leases on checkpoint steps, kept in the shared root so that every daemon writing there sees them:
// a daemon that reads a step (a restore) or writes one holds a lease, and every deletion path of
// every daemon (retention, `flashckpt delete`, `gc`, overwrite) skips a step with a live lease.
//
// A lease is the file "<root>/<job>/.leases/checkpoint-<step>.<node>.<pid>.<n>", one line of JSON
// {"step", "node", "pid", "expires_unix_ms"}. The holder rewrites it every ttl/3 while the operation
// runs and removes it at the end; a lease of a node that died expires after `ttl` (the nodes' clocks
// must agree to well within it), and the next deletion that finds it removes it. The `.leases`
// directory exists only while a lease does.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/io/io_env.h"

namespace flashckpt {

class Leases {
 public:
  // `ttl` 0: leases off (Take returns "", LiveHolder finds none). `io` not owned.
  Leases(std::string root, std::string node, std::chrono::milliseconds ttl, IoEnv* io = IoEnv::Default());
  ~Leases();  // stops the refresher; leases still held are removed
  Leases(const Leases&) = delete;
  Leases& operator=(const Leases&) = delete;

  // Writes a lease on `step` of `job` and keeps it fresh until Drop; returns its path, or "" when
  // leases are off or the write failed (logged: the operation goes on, protected on this node only).
  std::string Take(const std::string& job, int64_t step) EXCLUDES(mu_);
  void Drop(const std::string& path) EXCLUDES(mu_);

  // "node N pid P, expires in S s" of a live lease on `step` of `job` (any holder, this daemon
  // included), or nullopt. Expired leases of the step it reads are removed.
  Result<std::optional<std::string>> LiveHolder(const std::string& job, int64_t step) const;

  std::chrono::milliseconds ttl() const { return ttl_; }

 private:
  Status Write(const std::string& path, int64_t step) const;
  void RefreshLoop() EXCLUDES(mu_);

  const std::string root_, node_;
  const std::chrono::milliseconds ttl_;
  IoEnv* const io_;
  Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t next_ GUARDED_BY(mu_) = 0;
  std::set<std::pair<std::string, int64_t>> held_ GUARDED_BY(mu_);  // (path, step)
  std::thread refresher_;
};

}  // namespace flashckpt
