// node_part_<token>.json: what one daemon wrote of a step, rendered for metadata.json before the
// step completes (docs/format.md, "Node parts"). A daemon writes it once its queued persists of the
// step are done and the step is not complete yet; the daemon that completes the step takes those
// ranks' files from it instead of reading a signal and parsing headers per rank, so the work left
// after the last signal grows with the daemons, not with the ranks. A part is a hint: a rank it
// does not cover, or a part that cannot be read, is read from its signal as before.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "common/format/metadata.h"
#include "common/format/signal.h"

namespace flashckpt {

// One rank's share of a node part: which signal file it stands for, and that signal's files, rendered.
// The completion uses it only while saved_signal_<rank> is still that file (same inode, size and
// modification time): a signal written again since is read instead.
struct SignalIdentity {
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const SignalIdentity& o) const {
    return inode == o.inode && size == o.size && mtime_ns == o.mtime_ns && ctime_ns == o.ctime_ns;
  }
};
struct RankPart {
  uint32_t rank = 0;
  int64_t written_us = 0;  // Signal::written_us of the rank's signal
  SignalIdentity signal;
  std::vector<RenderedFile> files;
};

struct NodePart {
  std::string job;
  int64_t step = 0;
  Attempt attempt;
  std::vector<RankPart> ranks;
};

// "node_part_<token>.json"; `token` is the writing daemon's (letters and digits).
std::string NodePartFileName(const std::string& token);
bool IsNodePartFileName(std::string_view name);
// The most a node part may hold; larger ones are refused when read.
inline constexpr uint64_t kMaxNodePartBytes = 512ull << 20;

// The part's JSON, then a line "xxh3 <16 hex digits>" of the JSON's bytes: a part damaged on disk
// is refused, never joined into metadata.json. `ranks` (when given) stands for part.ranks.
std::string EncodeNodePart(const NodePart& part, const std::vector<const RankPart*>* ranks = nullptr);
// Parses a node part. The input is untrusted: the checksum must match, every field is type- and
// range-checked, and file names must be plain names (as in a signal). Errors are kCorruption.
Result<NodePart> ParseNodePart(std::string_view text);

}  // namespace flashckpt
