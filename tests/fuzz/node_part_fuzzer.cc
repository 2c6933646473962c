// libFuzzer target: node_part_<token>.json files are read back from the checkpoint directory by the
// daemon that completes a step, so their bytes are untrusted. The input is a part's JSON: it is
// parsed as it is (no checksum line: refused) and with the right checksum line appended, so the
// JSON parser behind the checksum is what gets explored.
// Properties: the parser never crashes, every file name it accepts is a plain name, and what it
// accepts survives EncodeNodePart and a second parse unchanged, every value.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/format/checksum.h"
#include "common/format/node_part.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashckpt;
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  (void)ParseNodePart(json);
  const std::string file = std::string(json) + "\nxxh3 " + ChecksumHex(Xxh3(json.data(), json.size())) + "\n";
  auto part = ParseNodePart(file);
  if (!part.ok()) return 0;
  auto again = ParseNodePart(EncodeNodePart(*part));
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->job == part->job && again->step == part->step && again->attempt == part->attempt);
  FUZZ_CHECK(again->ranks.size() == part->ranks.size());
  for (size_t r = 0; r < part->ranks.size(); ++r) {
    const RankPart& a = part->ranks[r];
    const RankPart& b = again->ranks[r];
    FUZZ_CHECK(a.rank == b.rank && a.written_us == b.written_us && a.signal == b.signal);
    FUZZ_CHECK(a.files.size() == b.files.size());
    for (size_t f = 0; f < a.files.size(); ++f) {
      const std::string& name = a.files[f].file.name;
      FUZZ_CHECK(!name.empty() && name != "." && name != "..");
      FUZZ_CHECK(name.find('/') == std::string::npos && name.find('\0') == std::string::npos);
      FUZZ_CHECK(name == b.files[f].file.name && a.files[f].tensors == b.files[f].tensors);
      const RenderedFile& x = a.files[f];
      const RenderedFile& y = b.files[f];
      FUZZ_CHECK(x.kinds == y.kinds && x.pieces == y.pieces && x.format_version == y.format_version);
      FUZZ_CHECK(x.file.rank == y.file.rank && x.file.tp_rank == y.file.tp_rank && x.file.pp_rank == y.file.pp_rank &&
                 x.file.shard_rank == y.file.shard_rank && x.file.bytes == y.file.bytes);
      FUZZ_CHECK(x.topology.world_size == y.topology.world_size && x.topology.tp_degree == y.topology.tp_degree &&
                 x.topology.pp_degree == y.topology.pp_degree && x.topology.shard_degree == y.topology.shard_degree);
      FUZZ_CHECK(x.ema.has_value() == y.ema.has_value());
      if (x.ema && y.ema) {
        FUZZ_CHECK(x.ema->decay == y.ema->decay && x.ema->interval == y.ema->interval && x.ema->init == y.ema->init &&
                   x.ema->model_params == y.ema->model_params && x.ema->loss_threshold == y.ema->loss_threshold &&
                   x.ema->updates_applied == y.ema->updates_applied &&
                   x.ema->updates_skipped == y.ema->updates_skipped && x.ema->last_step == y.ema->last_step);
      }
    }
  }
  return 0;
}
