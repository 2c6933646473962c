#include "daemon/edge/state_records.h"

#include "daemon/edge/registration.h"
#include "daemon/edge/wire.h"
#include "daemon_state.pb.h"
#include "proto/slot_checksums_proto.h"

namespace flashckpt {
namespace {

class ProtoCodec final : public StateRecordCodec {
 public:
  std::string EncodeSegment(const SegmentRecord& in) const override {
    v1::SegmentRecord r;
    r.set_job(in.job);
    r.set_rank(in.rank);
    r.set_segment_name(in.segment_name);
    r.set_segment_bytes(in.segment_bytes);
    r.set_slot_count(in.slot_count);
    r.set_checksum_chunk(in.checksum_chunk);
    r.set_registration(in.registration);
    return r.SerializeAsString();
  }
  bool DecodeSegment(const std::string& bytes, SegmentRecord* out) const override {
    v1::SegmentRecord r;
    if (!r.ParseFromString(bytes)) return false;
    out->job = r.job();
    out->rank = r.rank();
    out->segment_name = r.segment_name();
    out->segment_bytes = r.segment_bytes();
    out->slot_count = r.slot_count();
    out->checksum_chunk = r.checksum_chunk();
    out->registration = r.registration();
    return true;
  }

  std::string EncodeCommit(const CommitRecord& in) const override {
    v1::CommitRecord r;
    r.set_slot(in.slot);
    r.set_generation(in.generation);
    r.set_step(in.step);
    r.set_persist(in.persist);
    r.set_resumed_from(in.resumed_from);
    r.set_run_id(in.run_id);
    r.set_world_size(in.world_size);
    r.set_has_loss(in.loss.has_value());
    r.set_loss(in.loss.value_or(0.0));
    r.set_extra(in.extra);
    return r.SerializeAsString();
  }
  bool DecodeCommit(const std::string& bytes, CommitRecord* out) const override {
    v1::CommitRecord r;
    if (!r.ParseFromString(bytes)) return false;
    out->slot = r.slot();
    out->generation = r.generation();
    out->step = r.step();
    out->persist = r.persist();
    out->resumed_from = r.resumed_from();
    out->run_id = r.run_id();
    out->world_size = r.world_size();
    out->loss = r.has_loss() ? std::optional<double>(r.loss()) : std::nullopt;
    out->extra = r.extra();
    return true;
  }

  std::string EncodeMemory(const MemoryRecord& in) const override {
    v1::MemoryRecord r;
    r.set_slot(in.slot);
    r.set_written(in.written);
    r.set_step(in.step);
    r.set_resumed_from(in.resumed_from);
    r.set_run_id(in.run_id);
    r.set_world_size(in.world_size);
    r.set_extra(in.extra);
    r.set_checksum_chunk(in.checksum_chunk);
    *r.mutable_first_chunk() = {in.first_chunk.begin(), in.first_chunk.end()};
    *r.mutable_sums() = {in.sums.begin(), in.sums.end()};
    if (in.ema) {
      v1::MemoryEma* e = r.mutable_ema();
      e->set_initialized(in.ema->initialized);
      e->set_updates_applied(in.ema->updates_applied);
      e->set_updates_skipped(in.ema->updates_skipped);
      e->set_last_step(in.ema->last_step);
      e->set_last_seen(in.ema->last_seen);
      SlotChecksumsToProto(in.ema_sums, e);
    }
    return r.SerializeAsString();
  }
  bool DecodeMemory(const std::string& bytes, MemoryRecord* out) const override {
    v1::MemoryRecord r;
    if (!r.ParseFromString(bytes)) return false;
    out->slot = r.slot();
    out->written = r.written();
    out->step = r.step();
    out->resumed_from = r.resumed_from();
    out->run_id = r.run_id();
    out->world_size = r.world_size();
    out->extra = r.extra();
    out->checksum_chunk = r.checksum_chunk();
    out->first_chunk.assign(r.first_chunk().begin(), r.first_chunk().end());
    out->sums.assign(r.sums().begin(), r.sums().end());
    if (r.has_ema()) {
      const v1::MemoryEma& e = r.ema();
      out->ema = EmaState{e.initialized(), e.updates_applied(), e.updates_skipped(), e.last_step(), e.last_seen()};
      out->ema_sums = SlotChecksumsFromProto(e);
    }
    return true;
  }

  std::string EncodeRegistration(const Registration& registration) const override {
    return RegistrationRecord(registration).SerializeAsString();
  }
  Result<Registration> DecodeRegistration(const std::string& bytes) const override {
    v1::RegisterRequest request;
    if (!request.ParseFromString(bytes)) return InvalidArgument("the registration is not a RegisterRequest");
    return ParseRegistration(request);
  }
};

}  // namespace

const StateRecordCodec& ProtoStateRecords() {
  static const ProtoCodec codec;
  return codec;
}

}  // namespace flashckpt
