// The daemon's settings (flashckptd's flags, daemon/edge/config.cc), read by the core and cut into each
// worker's own options.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/base/clock.h"
#include "common/format/layout.h"
#include "common/io/io_env.h"
#include "daemon/core/registration.h"

namespace flashckpt {

class StateRecordCodec;  // daemon/core/state_dir.h

struct DaemonConfig {
  std::string socket_path;
  // Records for adopting slot segments after a crash (daemon/core/state_dir.h). Empty:
  // "<socket_path>.state"; no records at all when socket_path is empty too.
  std::string state_dir;
  std::string root;
  // The node this daemon runs on, recorded in every signal it writes and shown by status, list and
  // inspect ([A-Za-z0-9._:-]{1,253}); empty: the host name (DefaultNodeName).
  std::string node_name;
  uint32_t slots = 2;
  uint64_t max_host_memory = 0;  // bytes of shared memory all segments together may use
  unsigned writer_threads = 2;
  unsigned ema_threads = 0;                         // 0: min(hardware threads, 8)
  unsigned restore_threads = 4;                     // reader threads of one restore
  unsigned io_threads = 4;                          // writes in flight per writer thread
  uint64_t checksum_chunk = kDefaultChecksumChunk;  // per-chunk checksums of saved tensors (layout.h)
  unsigned segment_mode = 0600;
  // Retention: after a checkpoint completes, keep the newest `keep` complete checkpoints of its job
  // and delete older ones (and incomplete directories older than those). 0 keeps everything.
  uint32_t keep = 0;
  // Peers allowed on the socket (SO_PEERCRED): these uids, members of these gids, the daemon's own
  // uid and root.
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  std::string log_level = "info";
  std::string log_file;  // empty: stderr (common/base/log.h)
  // After SIGTERM, seconds until the daemon exits: writes in flight finish until then (less a
  // moment to close the listeners), the rest is abandoned for the next daemon (Stop).
  uint32_t stop_timeout_s = 60;
  // At a stop, each job's newest memory checkpoint that every rank of it here holds is written
  // (within the stop's deadline) when no complete checkpoint on disk is as new (--persist-on-stop):
  // a preempted node loses nothing that reached memory.
  bool persist_on_stop = true;
  // The writer's file-system calls (not owned; must outlive the daemon). Tests inject faults here.
  IoEnv* io_env = IoEnv::Default();
  // The writes and removals of the state directory's records (the same terms): tests hold a
  // registration or fail it there, apart from the root's calls.
  IoEnv* state_io_env = IoEnv::Default();
  // Where the daemon and its workers read the time (not owned; must outlive the daemon). Tests move
  // it ahead (tests/support/offset_clock.h).
  const Clock* clock = &Clock::Real();
  // Slot segments are created 0660 and given to this group (--shm-group), so trainers of another
  // user in it can map them; unset: 0600, the daemon's user only. EMA segments stay segment_mode.
  std::optional<uint32_t> shm_group;
  // Optional replica listener (daemon/replica/replica_server.h): empty `replica_listen` means none.
  std::string replica_listen;
  std::string replica_tls_cert, replica_tls_key, replica_tls_ca;
  std::vector<std::string> replica_allow_names;
  // The most bytes one peer's replicas may take (its oldest evicted to make room); 0: no cap but
  // max_host_memory. At most kMaxReplicasPerOrigin replicas per peer in any case.
  uint64_t replica_max_bytes_per_peer = 0;
  // Optional peers each kept memory checkpoint of a local rank is sent to (daemon/replica/
  // replica_sender.h), at most `replicate_max_rate` bytes per second to each (0: no cap). Their TLS
  // credentials are the replica_tls_* files.
  std::vector<std::string> replicate_to;
  uint64_t replicate_max_rate = 0;
  // Optional parity group (daemon/parity): every member's --replica-listen, in the same order on
  // each member, and how many members' loss it survives (--ec-parity, default 1).
  std::vector<std::string> ec_group;
  uint32_t ec_parity = 0;  // 0: not given (1 with a group)
  // Optional TCP listener (daemon/edge/tcp_listener.h, its address common/io/net.h): empty `listen` means none. Read-only RPCs unless
  // tcp_allow_writes; TLS when both tls_cert and tls_key are given.
  std::string listen;
  bool tcp_allow_writes = false;
  std::string tls_cert, tls_key;
  // Request limits (daemon/edge/limits.h, daemon/core/registration.h): tensors of one registration, and bytes of one rank's tensors
  // (0: only max_host_memory bounds them).
  uint32_t max_tensors_per_rank = kDefaultMaxTensorsPerRank;
  uint64_t max_rank_bytes = 0;
  // Prometheus scrape endpoint (daemon/observe/metrics_http.h): empty means none.
  std::string metrics_listen;
  // How long the writer and the EMA stage wait for a trainer's device copies into a slot whose
  // commit it sent before they completed (a streaming commit): then the save fails.
  std::chrono::milliseconds copy_timeout{120000};
  // A job none of whose ranks has been connected for this long, with nothing of it left to write,
  // gives its shared memory back (ReleaseJob); 0 never does.
  std::chrono::seconds idle_release{300};
  // A rank that names no run joins the newest launch of its job in the root (daemon/pipeline/
  // launches.h) only if that launch has no process of the rank yet and began less than this long ago
  // (or a rank of its run is live here).
  std::chrono::seconds launch_join_window{300};
  // How often the daemon re-checks the newest incomplete steps of its jobs and completes those whose
  // signals are all there (Catalog::CompleteSignalledSteps: signals written by daemons of other
  // nodes on a shared root); also once at start. 0: never.
  std::chrono::milliseconds sweep_interval{10000};
  // A step this daemon reads (a restore) or writes holds a lease in the root for as long, refreshed
  // every third of this; every deletion of every daemon on the root skips a step with a live lease,
  // and a lease of a daemon that died expires after this (daemon/pipeline/lease.h). 0: no leases.
  std::chrono::milliseconds lease_ttl{60000};
  // How the state directory's records are encoded (not owned): needed with a state directory. The
  // daemon's is the edge's ProtoStateRecords() (daemon/edge/state_records.h).
  const StateRecordCodec* state_records = nullptr;
};


}  // namespace flashckpt
