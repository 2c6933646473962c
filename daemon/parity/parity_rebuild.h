// The rebuild of a lost member's rank from its parity group (--ec-group): a replacement daemon at
// the lost member's place in the group asks the other members which complete shares they hold of
// stripes its rank's blocks went into (FindParityCandidate), then, stripe by stripe, fetches as
// many pieces as the code needs (the other data members' own blocks and the holders' shares) at
// once, and decodes its block behind the fetches as their parts arrive (RebuildFromParity). The result is only what the
// pieces make of it: the caller checks every chunk against the checksums the rank's image came with
// (ReplicaMeta::layout) before anything uses it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "daemon/parity/parity_client.h"
#include "daemon/parity/parity_group.h"

namespace flashckpt {

// Another member of the group, as this daemon reaches it.
struct ParityMember {
  uint32_t index = 0;
  std::string target;  // HOST:PORT, for logs
  std::shared_ptr<grpc::Channel> channel;
};

// What the members hold of a rank of this member: its image's header as the holders listed it, and
// per block of the image, the shares listed of the block's stripe (with their holders).
struct ParityCandidate {
  ReplicaMeta meta;
  uint32_t position = 0;
  struct Held {
    const ParityMember* holder = nullptr;
    ListedShare share;
  };
  std::vector<std::vector<Held>> blocks;  // [block] -> shares of its stripe, one per holder that listed one
};

// The newest step (then the later attempt) of (job, rank) of member `self` whose every block is in
// a complete share some member lists. `*all`: every candidate found, newest first, for a caller that
// must skip some. NOT_FOUND when none is. `unreachable` is told of each member that could not be
// asked (and why).
Result<ParityCandidate> FindParityCandidate(const ParityGroup& group, const std::vector<ParityMember>& members,
                                            const std::string& job, uint32_t self, uint32_t rank,
                                            std::chrono::system_clock::time_point deadline,
                                            const std::function<void(const ParityMember&, const Status&)>& unreachable,
                                            std::vector<ParityCandidate>* all = nullptr);

// How a rebuild streams a stripe's pieces: each fetch runs at most `ring_bytes` ahead of the decode,
// which takes `window_bytes` at a time. The ring is a whole number of pages, and a part longer than
// ring_bytes - window_bytes fails its piece (members send 1 MiB parts). A piece whose fetch brings
// no part for `stall` while the decode waits on it (a member that hangs, or cannot be reached) is
// cancelled and replaced by the next source.
struct RebuildStreaming {
  uint64_t window_bytes = 4u << 20;
  uint64_t ring_bytes = 16u << 20;
  std::chrono::milliseconds stall{10000};
};

// Rebuilds the candidate's image (meta.bytes bytes) into `into`. FAILED_PRECONDITION when a stripe
// has fewer pieces left than the code needs (too many members lost, or pieces whose fetch failed),
// naming each failure; DEADLINE_EXCEEDED when `deadline` passed first; INVALID_ARGUMENT for listings
// that do not fit the stripe; the error of the system call when a ring cannot be made.
Status RebuildFromParity(const ParityGroup& group, const std::vector<ParityMember>& members,
                         const ParityCandidate& candidate, uint32_t self, char* into,
                         std::chrono::system_clock::time_point deadline, const RebuildStreaming& streaming = {});

}  // namespace flashckpt
