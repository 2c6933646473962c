// SlotChecksums (common/format/slot_checksums.h) in and out of the messages that carry one as the
// fields checksum_chunk, first_chunk and sums (replica.proto's ReplicaLayout and ReplicaEma,
// daemon_state.proto's MemoryEma), converted the same way for each.
#pragma once

#include "common/format/slot_checksums.h"

namespace flashckpt {

template <typename Message>
void SlotChecksumsToProto(const SlotChecksums& sums, Message* out) {
  out->set_checksum_chunk(sums.chunk_bytes);
  *out->mutable_first_chunk() = {sums.first.begin(), sums.first.end()};
  *out->mutable_sums() = {sums.sums.begin(), sums.sums.end()};
}

template <typename Message>
SlotChecksums SlotChecksumsFromProto(const Message& in) {
  SlotChecksums out;
  out.chunk_bytes = in.checksum_chunk();
  out.first.assign(in.first_chunk().begin(), in.first_chunk().end());
  out.sums.assign(in.sums().begin(), in.sums().end());
  return out;
}

}  // namespace flashckpt
