#include "client/src/wire.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>

#include "common/base/dtype.h"
#include "proto/convert.h"

namespace flashckpt {

v1::RegisterRequest RegisterRequestOf(const Topology& topology, const std::vector<TensorSpec>& tensors,
                                      const EmaOptions& ema, const ClientOptions& options) {
  v1::RegisterRequest req;
  TopologyToProto(topology, req.mutable_topology());
  req.set_backpressure(options.skip_when_busy ? v1::BACKPRESSURE_SKIP : v1::BACKPRESSURE_WAIT);
  req.set_fatal_persist_errors(options.fatal_persist_errors);
  req.set_run_id(options.run_id);
  req.set_overwrite(options.overwrite);
  req.set_memory_checkpoints(options.memory_checkpoints);
  if (ema.decay) {
    EmaToProto(*ema.decay, ema.interval, ema.init_zeros, ema.all_float_params, ema.loss_threshold, req.mutable_ema());
  }
  for (const TensorSpec& spec : tensors) TensorSpecToProto(spec, req.add_tensors());
  return req;
}

Result<std::string> StatusResponseJson(const v1::StatusResponse& status) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  auto converted = google::protobuf::util::MessageToJsonString(status, &json, options);
  if (!converted.ok()) return Internal("cannot render the daemon status as JSON: " + converted.ToString());
  return json;
}

namespace {

// A wait the daemon bounds (never 0: that is no time at all).
uint32_t TimeoutMs(std::chrono::milliseconds timeout) {
  return static_cast<uint32_t>(std::max<int64_t>(1, timeout.count()));
}

}  // namespace

v1::BeginSnapshotRequest BeginSnapshotRequestOf(const std::string& session_id, int64_t step,
                                                std::chrono::milliseconds slot_timeout, Tier tier) {
  v1::BeginSnapshotRequest req;
  req.set_session_id(session_id);
  req.set_step(step);
  req.set_timeout_ms(static_cast<uint32_t>(slot_timeout.count()));
  req.set_tier(tier == Tier::kMemory ? v1::TIER_MEMORY : v1::TIER_DISK);
  return req;
}

SlotLoan SlotLoanOf(const v1::BeginSnapshotResponse& resp) { return {resp.slot(), resp.generation()}; }

v1::CommitRequest CommitRequestOf(const SlotCommit& commit) {
  v1::CommitRequest req;
  req.set_session_id(commit.session_id);
  req.set_slot(commit.slot.slot);
  req.set_generation(commit.slot.generation);
  req.set_step(commit.step);
  req.set_persist(commit.persist);
  if (commit.loss) {
    req.set_has_loss(true);
    req.set_loss(*commit.loss);
  }
  req.set_extra(commit.extra);
  return req;
}

v1::AbortSnapshotRequest AbortSnapshotRequestOf(const std::string& session_id, const SlotLoan& slot) {
  v1::AbortSnapshotRequest req;
  req.set_session_id(session_id);
  req.set_slot(slot.slot);
  req.set_generation(slot.generation);
  return req;
}

v1::ReleaseSlotRequest ReleaseSlotRequestOf(const std::string& session_id, const SlotLoan& slot,
                                            const std::string& corrupt) {
  v1::ReleaseSlotRequest req;
  req.set_session_id(session_id);
  req.set_slot(slot.slot);
  req.set_generation(slot.generation);
  req.set_corrupt(corrupt.substr(0, 1024));
  return req;
}

v1::WaitPersistedRequest WaitPersistedRequestOf(const std::string& session_id, int64_t step,
                                                std::chrono::milliseconds timeout) {
  v1::WaitPersistedRequest req;
  req.set_session_id(session_id);
  req.set_step(step);
  req.set_timeout_ms(TimeoutMs(timeout));
  return req;
}

v1::WaitCompleteRequest WaitCompleteRequestOf(const std::string& session_id, int64_t step,
                                              std::chrono::milliseconds timeout) {
  v1::WaitCompleteRequest req;
  req.set_session_id(session_id);
  req.set_step(step);
  req.set_timeout_ms(TimeoutMs(timeout));
  return req;
}

v1::RestorableRequest RestorableRequestOf(const std::string& session_id, std::optional<int64_t> extra_of,
                                          std::chrono::milliseconds timeout, bool verify) {
  v1::RestorableRequest req;
  req.set_session_id(session_id);
  if (extra_of) req.set_extra_of(*extra_of);
  req.set_unverified(!verify);
  req.set_timeout_ms(TimeoutMs(timeout));
  return req;
}

RestorableSteps RestorableStepsOf(const v1::RestorableResponse& resp) {
  RestorableSteps out;
  out.memory_steps.assign(resp.memory_steps().begin(), resp.memory_steps().end());
  if (resp.disk_step() > 0) out.disk_step = resp.disk_step();
  out.extra = resp.extra();
  return out;
}

v1::GetEmaRequest GetEmaRequestOf(const std::string& session_id, std::chrono::milliseconds timeout) {
  v1::GetEmaRequest req;
  req.set_session_id(session_id);
  req.set_timeout_ms(TimeoutMs(timeout));
  return req;
}

EmaHandover EmaHandoverOf(const v1::GetEmaResponse& resp) {
  return {{resp.slot(), resp.generation()}, resp.initialized(), resp.step()};
}

v1::RestoreRequest RestoreRequestOf(const std::string& session_id, std::optional<int64_t> step,
                                    const RestoreOptions& options, std::chrono::milliseconds timeout,
                                    bool verify_in_client) {
  v1::RestoreRequest req;
  req.set_session_id(session_id);
  req.set_step(step.value_or(0));
  req.set_convert_dtype(options.convert_dtype);
  for (TensorKind kind : options.kinds) req.add_kinds(TensorKindToProto(kind));
  req.set_source_job(options.source_job);
  req.set_timeout_ms(TimeoutMs(timeout));
  req.set_verify_in_client(verify_in_client);
  return req;
}

RestoreHandover RestoreHandoverOf(const v1::RestoreResponse& resp) {
  RestoreHandover out;
  out.found = resp.found();
  out.step = resp.step();
  out.slot = {resp.slot(), resp.generation()};
  out.extra = resp.extra();
  out.tier = resp.tier() == v1::TIER_MEMORY ? Tier::kMemory
             : resp.tier() == v1::TIER_PEER ? Tier::kPeer
             : resp.tier() == v1::TIER_PARITY ? Tier::kParity
                                            : Tier::kDisk;
  out.verify_in_client = resp.tier() != v1::TIER_DISK && resp.chunk_bytes() > 0;
  out.chunk_bytes = resp.chunk_bytes();
  out.chunk_sums.reserve(static_cast<size_t>(resp.chunk_sums_size()));
  for (const v1::TensorChunkSums& t : resp.chunk_sums()) {
    out.chunk_sums.push_back({t.slot_offset(), t.bytes(), {t.sums().begin(), t.sums().end()}});
  }
  return out;
}

DaemonStatus DaemonStatusFromProto(const v1::StatusResponse& status) {
  DaemonStatus out;
  out.version = status.version();
  out.uptime_seconds = status.uptime_seconds();
  out.host_memory_used = status.host_memory_used();
  out.host_memory_budget = status.host_memory_budget();
  out.root = status.root();
  out.node_name = status.node_name();
  out.cuda_compiled = status.cuda_compiled();
  out.cuda_devices = status.cuda_devices();
  out.replica_listening = status.replica_listening();
  out.replicas_held = status.replicas_held();
  out.replica_held_bytes = status.replica_held_bytes();
  out.ec_group = status.ec_group();
  out.ec_member = status.ec_member();
  out.ec_members = status.ec_members();
  out.ec_parity = status.ec_parity();
  out.parity_shares_held = status.parity_shares_held();
  out.parity_held_bytes = status.parity_held_bytes();
  out.parity_sent = status.parity_sent();
  out.parity_failed = status.parity_failed();
  out.parity_step = status.parity_step();
  for (const v1::ReplicaPeerStatus& p : status.replica_peers()) {
    ReplicaPeerStatus peer;
    peer.target = p.target();
    peer.pushed = p.pushed();
    peer.failed = p.failed();
    peer.bytes = p.bytes();
    peer.queued = p.queued();
    peer.lag_steps = p.lag_steps();
    peer.last_gbps = p.last_gbps();
    peer.last_error = p.last_error();
    out.replica_peers.push_back(std::move(peer));
  }
  out.jobs.reserve(static_cast<size_t>(status.jobs_size()));
  for (const v1::JobStatus& j : status.jobs()) {
    JobStatus job;
    job.job = j.job();
    job.world_size = j.world_size();
    job.last_complete_step = j.last_complete_step();
    job.catalog_error = j.catalog_error();
    job.split_attempts = j.split_attempts();
    job.split = j.split();
    job.ranks.reserve(static_cast<size_t>(j.ranks_size()));
    for (const v1::RankStatus& r : j.ranks()) {
      RankStatus rank;
      rank.rank = r.rank();
      rank.connected = r.connected();
      rank.segment_bytes = r.segment_bytes();
      rank.last_committed_step = r.last_committed_step();
      rank.last_persisted_step = r.last_persisted_step();
      rank.last_error = r.last_error();
      rank.snapshots = r.snapshots();
      rank.persists = r.persists();
      rank.failures = r.failures();
      rank.skipped = r.skipped();
      for (const v1::SlotStatus& s : r.slots()) {
        rank.slots.push_back({s.index(), s.state(), s.step(), s.filling_seconds()});
      }
      rank.oldest_write_seconds = r.oldest_write_seconds();
      rank.last_persist_gbps = r.last_persist_gbps();
      rank.run_id = r.run_id();
      rank.resumed_from = r.resumed_from();
      rank.memory_step = r.memory_checkpoints() > 0 ? r.memory_step() : -1;
      rank.memory_checkpoints = r.memory_checkpoints();
      rank.memory_bytes = r.memory_bytes();
      rank.ema_enabled = r.ema_enabled();
      rank.ema_decay = r.ema_decay();
      rank.ema_last_step = r.ema_last_step();
      rank.ema_updates_applied = r.ema_updates_applied();
      rank.ema_updates_skipped = r.ema_updates_skipped();
      rank.ema_bytes = r.ema_bytes();
      job.ranks.push_back(std::move(rank));
    }
    out.jobs.push_back(std::move(job));
  }
  return out;
}

std::vector<CheckpointInfo> CheckpointsFromProto(const v1::ListCheckpointsResponse& list) {
  std::vector<CheckpointInfo> out;
  out.reserve(static_cast<size_t>(list.checkpoints_size()));
  for (const v1::CheckpointInfo& c : list.checkpoints()) {
    CheckpointInfo info{c.job(), c.step(), c.complete(), c.signals(), c.world_size(), c.bytes(), c.path(), c.latest(), {}};
    for (const v1::SignalledRank& r : c.signalled()) {
      info.signalled.push_back({r.rank(), r.node(), r.run_id(), r.resumed_from()});
    }
    out.push_back(std::move(info));
  }
  return out;
}

namespace {

DaemonEvent::Kind EventKindFromProto(v1::Event::Kind kind) {
  switch (kind) {
    case v1::Event::SNAPSHOT_COMMITTED: return DaemonEvent::Kind::kSnapshotCommitted;
    case v1::Event::SNAPSHOT_SKIPPED: return DaemonEvent::Kind::kSnapshotSkipped;
    case v1::Event::EMA_UPDATED: return DaemonEvent::Kind::kEmaUpdated;
    case v1::Event::PERSISTED: return DaemonEvent::Kind::kPersisted;
    case v1::Event::PERSIST_FAILED: return DaemonEvent::Kind::kPersistFailed;
    case v1::Event::CHECKPOINT_COMPLETE: return DaemonEvent::Kind::kCheckpointComplete;
    case v1::Event::CHECKPOINT_DELETED: return DaemonEvent::Kind::kCheckpointDeleted;
    case v1::Event::EVENTS_LOST: return DaemonEvent::Kind::kEventsLost;
    case v1::Event::PERSIST_ABANDONED: return DaemonEvent::Kind::kPersistAbandoned;
    case v1::Event::JOB_RELEASED: return DaemonEvent::Kind::kJobReleased;
    case v1::Event::SPLIT_ATTEMPT: return DaemonEvent::Kind::kSplitAttempt;
    case v1::Event::MEMORY_FALLBACK: return DaemonEvent::Kind::kMemoryFallback;
    case v1::Event::REPLICA_SENT: return DaemonEvent::Kind::kReplicaSent;
    case v1::Event::REPLICA_FAILED: return DaemonEvent::Kind::kReplicaFailed;
    case v1::Event::PARITY_SENT: return DaemonEvent::Kind::kParitySent;
    case v1::Event::PARITY_FAILED: return DaemonEvent::Kind::kParityFailed;
    case v1::Event::PARITY_REBUILT: return DaemonEvent::Kind::kParityRebuilt;
    default: return DaemonEvent::Kind::kUnknown;
  }
}

}  // namespace

DaemonEvent EventFromProto(const v1::Event& event) {
  DaemonEvent out;
  out.kind = EventKindFromProto(event.kind());
  out.unix_seconds = event.unix_seconds();
  out.job = event.job();
  out.rank = event.rank();
  out.step = event.step();
  out.bytes = event.bytes();
  out.seconds = event.seconds();
  out.reason = event.reason();
  out.lost = event.lost();
  out.code = event.code();
  out.peer = event.peer();
  return out;
}

DeleteResult DeleteResultFromProto(const v1::DeleteCheckpointsResponse& resp) {
  DeleteResult out;
  out.deleted.assign(resp.deleted().begin(), resp.deleted().end());
  for (const v1::SkippedCheckpoint& s : resp.skipped()) out.skipped.push_back({s.step(), s.reason()});
  out.latest = resp.latest();
  return out;
}

}  // namespace flashckpt
