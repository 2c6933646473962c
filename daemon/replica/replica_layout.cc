#include "daemon/replica/replica_layout.h"

#include "proto/slot_checksums_proto.h"
#include "replica.pb.h"

namespace flashckpt {

ReplicaLayout ReplicaLayoutOf(const RankLayout& layout, uint64_t layout_fingerprint, uint64_t image_offset,
                              const SlotChecksums& sums, const std::string& run_id, int64_t resumed_from) {
  ReplicaLayout out;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    out.tensors.push_back({layout.tensors[i].name, layout.placements[i].slot_offset, layout.placements[i].bytes});
  }
  out.sums = sums;
  out.run_id = run_id;
  out.resumed_from = resumed_from;
  out.image_offset = image_offset;
  out.layout_fingerprint = layout_fingerprint;
  return out;
}

std::string EncodeReplicaLayout(const ReplicaLayout& layout) {
  v1::ReplicaLayout where;
  for (const ReplicaLayout::Tensor& tensor : layout.tensors) {
    v1::ReplicaLayout::Tensor* t = where.add_tensors();
    t->set_name(tensor.name);
    t->set_slot_offset(tensor.slot_offset);
    t->set_bytes(tensor.bytes);
  }
  SlotChecksumsToProto(layout.sums, &where);
  where.set_run_id(layout.run_id);
  where.set_resumed_from(layout.resumed_from);
  where.set_image_offset(layout.image_offset);
  where.set_layout_fingerprint(layout.layout_fingerprint);
  if (layout.ema) {
    v1::ReplicaEma* e = where.mutable_ema();
    e->set_image_offset(layout.ema->image_offset);
    e->set_image_bytes(layout.ema->image_bytes);
    e->set_layout_fingerprint(layout.ema->layout_fingerprint);
    SlotChecksumsToProto(layout.ema->sums, e);
    e->set_initialized(layout.ema->initialized);
    e->set_updates_applied(layout.ema->updates_applied);
    e->set_updates_skipped(layout.ema->updates_skipped);
    e->set_last_step(layout.ema->last_step);
    e->set_last_seen(layout.ema->last_seen);
  }
  return where.SerializeAsString();
}

Result<ReplicaLayout> DecodeReplicaLayout(const std::string& bytes) {
  v1::ReplicaLayout where;
  if (!where.ParseFromString(bytes)) return Corruption("its layout does not parse");
  ReplicaLayout out;
  for (const auto& t : where.tensors()) out.tensors.push_back({t.name(), t.slot_offset(), t.bytes()});
  out.sums = SlotChecksumsFromProto(where);
  out.run_id = where.run_id();
  out.resumed_from = where.resumed_from();
  out.image_offset = where.image_offset();
  out.layout_fingerprint = where.layout_fingerprint();
  if (where.has_ema()) {
    const v1::ReplicaEma& e = where.ema();
    ReplicaLayout::Ema ema;
    ema.image_offset = e.image_offset();
    ema.image_bytes = e.image_bytes();
    ema.layout_fingerprint = e.layout_fingerprint();
    ema.sums = SlotChecksumsFromProto(e);
    ema.initialized = e.initialized();
    ema.updates_applied = e.updates_applied();
    ema.updates_skipped = e.updates_skipped();
    ema.last_step = e.last_step();
    ema.last_seen = e.last_seen();
    out.ema = std::move(ema);
  }
  return out;
}

}  // namespace flashckpt
