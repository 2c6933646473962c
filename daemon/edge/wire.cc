#include "daemon/edge/wire.h"

#include "proto/convert.h"

namespace flashckpt {
namespace {

void ToProto(const TensorLocation& t, v1::TensorPlacement* p) {
  p->set_name(t.name);
  p->set_file(t.file);
  p->set_slot_offset(t.slot_offset);
  p->set_bytes(t.bytes);
  p->set_ema_source(t.ema_source);
  if (t.kind != TensorKind::kEma) p->set_kind(TensorKindToProto(t.kind));
}

v1::Event::Kind KindToProto(DaemonEvent::Kind kind) {
  switch (kind) {
    case DaemonEvent::Kind::kSnapshotCommitted: return v1::Event::SNAPSHOT_COMMITTED;
    case DaemonEvent::Kind::kSnapshotSkipped: return v1::Event::SNAPSHOT_SKIPPED;
    case DaemonEvent::Kind::kEmaUpdated: return v1::Event::EMA_UPDATED;
    case DaemonEvent::Kind::kPersisted: return v1::Event::PERSISTED;
    case DaemonEvent::Kind::kPersistFailed: return v1::Event::PERSIST_FAILED;
    case DaemonEvent::Kind::kCheckpointComplete: return v1::Event::CHECKPOINT_COMPLETE;
    case DaemonEvent::Kind::kCheckpointDeleted: return v1::Event::CHECKPOINT_DELETED;
    case DaemonEvent::Kind::kEventsLost: return v1::Event::EVENTS_LOST;
    case DaemonEvent::Kind::kPersistAbandoned: return v1::Event::PERSIST_ABANDONED;
    case DaemonEvent::Kind::kJobReleased: return v1::Event::JOB_RELEASED;
    case DaemonEvent::Kind::kSplitAttempt: return v1::Event::SPLIT_ATTEMPT;
    case DaemonEvent::Kind::kMemoryFallback: return v1::Event::MEMORY_FALLBACK;
    case DaemonEvent::Kind::kReplicaSent: return v1::Event::REPLICA_SENT;
    case DaemonEvent::Kind::kReplicaFailed: return v1::Event::REPLICA_FAILED;
    case DaemonEvent::Kind::kParitySent: return v1::Event::PARITY_SENT;
    case DaemonEvent::Kind::kParityFailed: return v1::Event::PARITY_FAILED;
    case DaemonEvent::Kind::kParityRebuilt: return v1::Event::PARITY_REBUILT;
    case DaemonEvent::Kind::kUnknown: break;
  }
  return v1::Event::KIND_UNSPECIFIED;
}

}  // namespace

v1::RegisterResponse ToProto(const RegisterReply& reply) {
  v1::RegisterResponse out;
  out.set_segment_name(reply.segment_name);
  out.set_segment_bytes(reply.segment_bytes);
  out.set_slot_count(reply.slot_count);
  out.set_slot_offset(reply.slot_offset);
  out.set_slot_stride(reply.slot_stride);
  for (const TensorLocation& t : reply.placements) ToProto(t, out.add_placements());
  for (const TensorLocation& t : reply.ema_placements) ToProto(t, out.add_ema_placements());
  out.set_run_id(reply.run_id);
  return out;
}

v1::StatusResponse ToProto(const DaemonStatus& status) {
  v1::StatusResponse out;
  out.set_version(status.version);
  out.set_uptime_seconds(status.uptime_seconds);
  out.set_host_memory_used(status.host_memory_used);
  out.set_host_memory_budget(status.host_memory_budget);
  out.set_root(status.root);
  out.set_node_name(status.node_name);
  out.set_cuda_compiled(status.cuda_compiled);
  out.set_cuda_devices(status.cuda_devices);
  out.set_replica_listening(status.replica_listening);
  out.set_replicas_held(status.replicas_held);
  out.set_replica_held_bytes(status.replica_held_bytes);
  out.set_ec_group(status.ec_group);
  out.set_ec_member(status.ec_member);
  out.set_ec_members(status.ec_members);
  out.set_ec_parity(status.ec_parity);
  out.set_parity_shares_held(status.parity_shares_held);
  out.set_parity_held_bytes(status.parity_held_bytes);
  out.set_parity_sent(status.parity_sent);
  out.set_parity_failed(status.parity_failed);
  out.set_parity_step(status.parity_step);
  for (const ReplicaPeerStatus& peer : status.replica_peers) {
    v1::ReplicaPeerStatus* p = out.add_replica_peers();
    p->set_target(peer.target);
    p->set_pushed(peer.pushed);
    p->set_failed(peer.failed);
    p->set_bytes(peer.bytes);
    p->set_queued(peer.queued);
    p->set_lag_steps(peer.lag_steps);
    p->set_last_gbps(peer.last_gbps);
    p->set_last_error(peer.last_error);
  }
  for (const JobStatus& job : status.jobs) {
    v1::JobStatus* j = out.add_jobs();
    j->set_job(job.job);
    j->set_world_size(job.world_size);
    j->set_last_complete_step(job.last_complete_step);
    j->set_catalog_error(job.catalog_error);
    j->set_split_attempts(job.split_attempts);
    j->set_split(job.split);
    for (const RankStatus& rank : job.ranks) {
      v1::RankStatus* r = j->add_ranks();
      r->set_rank(rank.rank);
      r->set_connected(rank.connected);
      r->set_segment_bytes(rank.segment_bytes);
      r->set_last_committed_step(rank.last_committed_step);
      r->set_last_persisted_step(rank.last_persisted_step);
      r->set_last_error(rank.last_error);
      r->set_snapshots(rank.snapshots);
      r->set_persists(rank.persists);
      r->set_failures(rank.failures);
      r->set_skipped(rank.skipped);
      for (const SlotStatus& slot : rank.slots) {
        v1::SlotStatus* s = r->add_slots();
        s->set_index(slot.index);
        s->set_state(slot.state);
        s->set_step(slot.step);
        s->set_filling_seconds(slot.filling_seconds);
      }
      r->set_ema_enabled(rank.ema_enabled);
      r->set_ema_bytes(rank.ema_bytes);
      r->set_ema_last_step(rank.ema_last_step);
      r->set_ema_updates_applied(rank.ema_updates_applied);
      r->set_ema_updates_skipped(rank.ema_updates_skipped);
      r->set_ema_decay(rank.ema_decay);
      r->set_oldest_write_seconds(rank.oldest_write_seconds);
      r->set_last_persist_gbps(rank.last_persist_gbps);
      r->set_run_id(rank.run_id);
      r->set_resumed_from(rank.resumed_from);
      r->set_memory_step(rank.memory_step);
      r->set_memory_checkpoints(rank.memory_checkpoints);
      r->set_memory_bytes(rank.memory_bytes);
    }
  }
  return out;
}

v1::Event ToProto(const DaemonEvent& event) {
  v1::Event out;
  out.set_kind(KindToProto(event.kind));
  out.set_unix_seconds(event.unix_seconds);
  out.set_job(event.job);
  out.set_rank(event.rank);
  out.set_step(event.step);
  out.set_bytes(event.bytes);
  out.set_seconds(event.seconds);
  out.set_reason(event.reason);
  out.set_lost(event.lost);
  out.set_code(event.code);
  out.set_peer(event.peer);
  return out;
}

v1::RegisterRequest RegistrationRecord(const Registration& registration) {
  v1::RegisterRequest out;
  TopologyToProto(registration.topology, out.mutable_topology());
  for (const TensorSpec& spec : registration.tensors) TensorSpecToProto(spec, out.add_tensors());
  out.set_backpressure(registration.policy == Backpressure::kSkip ? v1::BACKPRESSURE_SKIP : v1::BACKPRESSURE_WAIT);
  const EmaConfig& ema = registration.ema;
  if (ema.enabled) {
    EmaToProto(ema.decay, ema.interval, ema.init_zeros, ema.all_float_params, ema.loss_threshold, out.mutable_ema());
  }
  out.set_fatal_persist_errors(registration.fatal_persist_errors);
  out.set_memory_checkpoints(registration.memory_checkpoints);
  return out;
}

}  // namespace flashckpt
