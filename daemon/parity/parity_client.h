// A member's calls to the others of its parity group (flashckpt.v1.Parity, parity_service.h): push
// a block of one of its ranks' images to a holder of its stripe, list the shares a member holds
// for a lost member, fetch a share, fetch another member's own block. Every part travels with its
// XXH3-64 and is checked on both ends.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "daemon/parity/parity_store.h"

namespace flashckpt {

// Streams `block_bytes` bytes at `data` (the block ParityGroup::Block says of the header's image)
// after the header, in parts of block.meta.part_bytes. `context`, when set, is called with the
// call's context as it starts and with nullptr when it ends (TryCancel in between cancels it).
// `still_held`, when set, is asked once every part is sent: false cancels the push before the holder
// counts the block (CANCELLED), so bytes that changed under it never complete a share. `owner` keeps
// `data` mapped while gRPC holds a part of it, should that outlast the call (SliceLoans).
Status PushParityBlock(grpc::Channel* channel, const ShareBlock& block, const char* data, uint64_t block_bytes,
                       std::chrono::system_clock::time_point deadline,
                       const std::function<void(grpc::ClientContext*)>& context = {},
                       const std::function<bool()>& still_held = {}, std::shared_ptr<const void> owner = nullptr);

// A complete share as its holder lists it.
struct ListedShare {
  int64_t step = 0;
  uint32_t position = 0;
  uint32_t stripe = 0;
  uint32_t row = 0;
  uint64_t bytes = 0;
  std::vector<std::pair<uint32_t, ParityShare::Contribution>> contributions;  // by data index
};
// The complete shares the member holds whose stripes have `member` as a data member. A listing
// that does not hold together (an index, row or stripe outside the group, a contribution longer
// than its share) is CORRUPTION.
Result<std::vector<ListedShare>> ListParityShares(grpc::Channel* channel, const ParityGroup& group,
                                                  const std::string& job, uint32_t member,
                                                  std::chrono::system_clock::time_point deadline);

// Where a fetch puts the parts of a piece (a share or a block) as they arrive. Place returns where
// the `n` bytes from offset `at` of the piece go (contiguous; it may wait for room), or an error that
// ends the fetch; Arrived is told after each part how many bytes from the piece's start have arrived
// and passed their checksums. Both are called on the fetching thread. Calling is told of the fetch's
// call when it starts and (nullptr) before it ends, so that a sink may cancel it from another thread
// (`grpc::ClientContext::TryCancel`) while the fetch waits in gRPC for a part.
class PartSink {
 public:
  virtual ~PartSink() = default;
  virtual Result<char*> Place(uint64_t at, uint64_t n) = 0;
  virtual void Arrived(uint64_t end) = 0;
  virtual void Calling(grpc::ClientContext* /*call*/) {}
};

// Fetches a complete share (`bytes` long, as listed), each part where `sink` places it; CORRUPTION
// for a part that fails its checksum, or a share of another length.
Status FetchParityShare(grpc::Channel* channel, const std::string& job, uint32_t position, uint32_t stripe,
                        int64_t step, PartSink* sink, uint64_t bytes, std::chrono::system_clock::time_point deadline);

// Fetches member's own block of `stripe` of (job, rank)'s memory checkpoint of `step` by the attempt
// (`run_id`, `resumed_from`) (`bytes` long, as the holders listed it) into `sink`. As FetchParityShare.
Status FetchParityBlock(grpc::Channel* channel, const std::string& job, uint32_t rank, int64_t step, uint32_t stripe,
                        const std::string& run_id, int64_t resumed_from, PartSink* sink, uint64_t bytes,
                        std::chrono::system_clock::time_point deadline);

}  // namespace flashckpt
