// libflashckpt, operator side: what a flashckptd says about itself (status, checkpoints, events,
// health) and the deletion of checkpoints through it, as plain C++ structs. The `flashckpt`
// command is built on it; trainers use client.h.
//
//   auto admin = flashckpt::AdminClient::Open({.socket_path = "/run/flashckpt/flashckptd.sock"});
//   if (!admin.ok()) return admin.status();
//   auto status = admin.value()->Status();
//   for (const flashckpt::JobStatus& job : status->jobs) ...
//
// Endpoint: the daemon's UNIX socket, or its TCP listener (flashckptd --listen HOST:PORT), over TLS
// when a CA is given. Over TCP the daemon answers Status, List, Watch and Health; Delete and Gc only
// (and Release) when it runs with --tcp-allow-writes (else they fail, naming that flag).
// No session: an AdminClient registers nothing and may come and go while trainers run. It does not
// wait for a daemon that is down: a call fails at once with kUnavailable, and the next call tries
// again.
// Thread safety: an AdminClient may be used from several threads at once.
// Blocking: every unary call has a deadline (AdminOptions::rpc_timeout; Delete and Gc:
// delete_timeout). Watch() runs until its handler, its limits or the daemon end it.
// Errors: a Status whose message can be shown to an operator as it is:
//   kUnavailable       "daemon not reachable at /run/flashckpt/flashckptd.sock (UNAVAILABLE: <gRPC's reason>)"
//   kDeadlineExceeded  "GetStatus got no answer from 10.0.0.5:7070 (TLS) within 10 s (DEADLINE_EXCEEDED)"
//   any other code     "DeleteCheckpoints failed: FAILED_PRECONDITION (gRPC code 9): <the daemon's reason>"
// The code is the one the daemon sent, mapped as for the trainer client; gRPC codes flashckpt has no
// code for (PERMISSION_DENIED from a read-only TCP listener, UNIMPLEMENTED) are kInternal, and the
// message names them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "flashckpt/daemon_types.h"
#include "flashckpt/export.h"
#include "flashckpt/status.h"

namespace flashckpt {

struct AdminOptions {
  std::string socket_path;  // the daemon's UNIX socket (flashckptd --socket); used when `address` is empty
  std::string address;      // HOST:PORT or [IPV6]:PORT of the daemon's TCP listener (flashckptd --listen)
  std::string tls_ca_file;  // with `address`: PEM file of the CA that signed the daemon's --tls-cert;
                            // empty: plain TCP. Read by Open().
  std::chrono::milliseconds rpc_timeout{10000};      // deadline of Status, List and Health
  std::chrono::milliseconds delete_timeout{300000};  // of Delete and Gc, which remove directory trees
};

// What Release gave back.
struct ReleaseResult {
  uint32_t ranks = 0;  // ranks the daemon knew of the job
  uint64_t bytes = 0;  // shared memory freed (slot and EMA segments)
  // Memory checkpoints newer than the newest complete one on disk (`disk_step`, -1: none): the
  // newest was written before the release (`written_step`, -1: none), or with force dropped.
  int64_t disk_step = -1;
  int64_t written_step = -1;
  std::vector<int64_t> dropped_steps;  // newest first
};

// grpc.health.v1 serving states; the names are gRPC's.
enum class HealthState { kUnknown, kServing, kNotServing, kServiceUnknown };
// "UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN".
FLASHCKPT_API std::string_view HealthStateName(HealthState state);

struct WatchOptions {
  std::string job;  // empty: every job
  // Watch() returns OK once this much time has passed; 0: no limit.
  std::chrono::milliseconds duration{0};
  // Watch() returns OK after this many events; 0: no limit.
  uint64_t max_events = 0;
  // Called once, before any event: with true once the daemon has subscribed the watcher (every
  // event from then on is seen), with false when the call failed before that (Watch() then returns
  // its error). So a caller that waits for it is never left waiting.
  std::function<void(bool subscribed)> on_subscribed;
};

class FLASHCKPT_API AdminClient {
 public:
  // Prepares the channel to the daemon; connects at the first call. Fails only when the TLS CA
  // file cannot be read.
  static Result<std::unique_ptr<AdminClient>> Open(const AdminOptions& options);
  ~AdminClient();

  AdminClient(const AdminClient&) = delete;
  AdminClient& operator=(const AdminClient&) = delete;

  // Where the daemon is, as messages name it: "/run/flashckpt/flashckptd.sock",
  // "10.0.0.5:7070 (TLS)", "127.0.0.1:7070 (plain TCP)".
  const std::string& endpoint() const;

  // The daemon's version, memory budget and use, and every job and rank it knows (GetStatus).
  Result<DaemonStatus> Status();
  // The checkpoint directories of `job`, or (empty) of every job under the daemon's root.
  Result<std::vector<CheckpointInfo>> List(const std::string& job);
  // Calls `on_event` on this thread for each event as the daemon reports it, until `on_event`
  // returns false or a limit of `options` is reached (then OK), or the stream ends: OK when the
  // daemon ends it cleanly, else its error: kUnavailable when the daemon cannot be reached, and
  // kUnavailable saying "the daemon at ... stopped" when it stops (or dies) after subscribing.
  flashckpt::Status Watch(const WatchOptions& options, const std::function<bool(const DaemonEvent&)>& on_event);
  // Deletes the checkpoint `step` of `job` (complete or not). Never one in use (kFailedPrecondition);
  // the newest complete one only with `force` (LATEST then moves back to the newest one left).
  // `dry_run`: deletes nothing and says what would be deleted.
  Result<DeleteResult> Delete(const std::string& job, int64_t step, bool force, bool dry_run);
  // Keeps the newest `keep` (>= 1) complete checkpoints of `job` and deletes older ones, and
  // incomplete directories older than the oldest kept one, as flashckptd --keep does; steps in use
  // are skipped.
  Result<DeleteResult> Gc(const std::string& job, uint32_t keep, bool dry_run);
  // Gives back the shared memory of `job` and makes the daemon forget it, as flashckptd
  // --idle-release does once the job has been idle that long. kFailedPrecondition while a rank of
  // the job is connected or a snapshot of it is still to be written; kNotFound when the daemon
  // holds no such job.
  // Writes the job's memory checkpoint newer than the disk first (FAILED_PRECONDITION, the job
  // kept, when it cannot); `force` drops it instead. Deadline: delete_timeout (it may write).
  Result<ReleaseResult> Release(const std::string& job, bool force = false);
  // grpc.health.v1.Health/Check of the daemon as a whole: kServing, or kNotServing while it stops.
  Result<HealthState> Health();

 private:
  struct FLASHCKPT_HIDDEN Impl;
  explicit AdminClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashckpt
