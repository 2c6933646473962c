#include "common/format/layout.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/base/names.h"

namespace flashckpt {
namespace {

uint64_t AlignUp(uint64_t v) { return (v + kPageSize - 1) / kPageSize * kPageSize; }

Status SlotTooLarge(uint32_t rank) {
  return InvalidArgument("tensors: the state of rank " + std::to_string(rank) + " would span more than " +
                         std::to_string(kMaxSlotBytes) + " bytes (256 TiB), the most one slot may hold");
}

// offset + bytes, rounded up to a page; refused past kMaxSlotBytes, so that no later sum can wrap.
Status Advance(uint64_t* offset, uint64_t bytes, uint32_t rank) {
  uint64_t end;
  if (__builtin_add_overflow(*offset, bytes, &end) || end > kMaxSlotBytes) return SlotTooLarge(rank);
  *offset = AlignUp(end);
  return Status::OK();
}

Status HeaderTooLarge(const char* kind, uint32_t rank, uint64_t bytes) {
  return InvalidArgument("the " + std::string(kind) + " file header of rank " + std::to_string(rank) + " would be " +
                         std::to_string(bytes) + " bytes, above the safetensors limit of " +
                         std::to_string(kMaxHeaderJsonBytes) + ": use a larger checksum chunk");
}

std::string ShapeJson(const std::vector<uint64_t>& v) { return nlohmann::json(v).dump(); }

const char* FileKindOf(TensorKind kind) {
  switch (kind) {
    case TensorKind::kModel: return "model_state";
    case TensorKind::kEma: return "ema";
    default: return "optimizer";
  }
}

Result<uint64_t> Numel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return InvalidArgument("element count overflows 64 bits");
  }
  return n;
}

}  // namespace

std::string TensorMetaKey(const std::string& name, const char* what) { return name + "@" + what; }

int RankLayout::Find(const std::string& name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

Status ValidateChecksumChunk(uint64_t bytes) {
  if (bytes < kMinChecksumChunk || bytes > kMaxChecksumChunk || (bytes & (bytes - 1)) != 0) {
    return InvalidArgument("checksum chunk of " + std::to_string(bytes) + " bytes: it must be a power of two from " +
                           std::to_string(kMinChecksumChunk) + " to " + std::to_string(kMaxChecksumChunk));
  }
  return Status::OK();
}

Status ValidateTopology(const Topology& t, uint32_t rank) {
  if (t.tp_degree == 0 || t.pp_degree == 0 || t.shard_degree == 0 || t.world_size == 0) {
    return InvalidArgument("topology degrees and world_size must be at least 1");
  }
  uint64_t product = 0;
  if (__builtin_mul_overflow(uint64_t{t.tp_degree} * t.pp_degree, uint64_t{t.shard_degree}, &product)) {
    // Three 32-bit degrees can pass 2^64: wrapped, the product could equal world_size.
    return InvalidArgument("tp_degree*pp_degree*shard_degree overflows 64 bits; it must equal world_size " +
                           std::to_string(t.world_size));
  }
  if (product != t.world_size) {
    return InvalidArgument("world_size " + std::to_string(t.world_size) +
                           " != tp_degree*pp_degree*shard_degree = " + std::to_string(product));
  }
  if (t.tp_rank >= t.tp_degree || t.pp_rank >= t.pp_degree || t.shard_rank >= t.shard_degree) {
    return InvalidArgument("tp_rank, pp_rank and shard_rank must be below their degrees, got (" +
                           std::to_string(t.tp_rank) + ", " + std::to_string(t.pp_rank) + ", " +
                           std::to_string(t.shard_rank) + ") of (" + std::to_string(t.tp_degree) + ", " +
                           std::to_string(t.pp_degree) + ", " + std::to_string(t.shard_degree) + ")");
  }
  if (rank >= t.world_size) {
    return InvalidArgument("rank " + std::to_string(rank) + " (of the session) is not below world_size " +
                           std::to_string(t.world_size));
  }
  return Status::OK();
}

Result<TensorSpec> NormalizeTensorSpec(const TensorSpec& in) {
  TensorSpec s = in;
  RETURN_IF_ERROR(ValidateTensorName(s.name));
  auto fail = [&](const std::string& why) { return InvalidArgument("tensor '" + s.name + "': " + why); };
  if (!s.param.empty()) {
    Status param = ValidateTensorName(s.param);  // it names the EMA tensor of a master weight
    if (!param.ok()) return fail("param: " + param.message());
  }
  if (s.shape.size() > kMaxTensorRank) {
    return fail("shape has " + std::to_string(s.shape.size()) + " dimensions, above 8");
  }
  if (s.box_shape.empty()) {
    if (s.flat_range) return fail("a flat range needs box_shape");
    s.box_shape = s.shape;
  }
  if (s.global_shape.empty()) s.global_shape = s.box_shape;
  if (s.box_offset.empty()) s.box_offset.assign(s.global_shape.size(), 0);
  if (s.box_shape.size() != s.global_shape.size() || s.box_offset.size() != s.global_shape.size()) {
    return fail("global_shape, box_offset and box_shape must have the same rank");
  }
  if (s.global_shape.size() > kMaxTensorRank) {
    return fail("global_shape has " + std::to_string(s.global_shape.size()) + " dimensions, above 8");
  }
  for (size_t d = 0; d < s.global_shape.size(); ++d) {
    uint64_t end;
    if (__builtin_add_overflow(s.box_offset[d], s.box_shape[d], &end) || end > s.global_shape[d]) {
      return fail("box_offset + box_shape [" + std::to_string(s.box_offset[d]) + ", +" +
                  std::to_string(s.box_shape[d]) + ") leaves dimension " + std::to_string(d) +
                  " of global_shape, of size " + std::to_string(s.global_shape[d]));
    }
  }
  auto local = Numel(s.shape);
  if (!local.ok()) return fail("the element count of shape overflows 64 bits");
  auto box = Numel(s.box_shape);
  if (!box.ok()) return fail("the element count of box_shape overflows 64 bits");
  if (s.flat_range) {
    if (s.flat_range->begin > s.flat_range->end || s.flat_range->end > *box) {
      return fail("flat range [flat_begin, flat_end) = [" + std::to_string(s.flat_range->begin) + ", " +
                  std::to_string(s.flat_range->end) + ") is not inside the box of " + std::to_string(*box) +
                  " elements");
    }
    if (s.flat_range->end - s.flat_range->begin != *local) {
      return fail("flat range has " + std::to_string(s.flat_range->end - s.flat_range->begin) +
                  " elements but the local shape has " + std::to_string(*local));
    }
  } else if (s.shape != s.box_shape) {
    return fail("local shape differs from box_shape and no flat range is given");
  }
  auto bytes = TensorBytes(s.dtype, s.shape);
  if (!bytes.ok()) return fail("the byte size of shape overflows 64 bits");
  if (*bytes > kMaxSlotBytes) {
    return fail("shape holds " + std::to_string(*bytes) + " bytes, above the " + std::to_string(kMaxSlotBytes) +
                " bytes (256 TiB) a slot may hold");
  }
  return s;
}

namespace {

// Normalizes `specs` into layout->tensors, in order; refuses a duplicate name and a global tensor
// of more than 2^64 bytes.
Status AddTensors(const std::vector<TensorSpec>& specs, RankLayout* layout) {
  std::map<std::string, size_t> seen;
  for (const auto& spec : specs) {
    ASSIGN_OR_RETURN(TensorSpec s, NormalizeTensorSpec(spec));
    // What is saved must be readable back: the restore planner and verify refuse pieces whose
    // global tensor has more than 2^64 bytes, so such a tensor is refused here, not at restore.
    if (!TensorBytes(s.dtype, s.global_shape).ok()) {
      return InvalidArgument("tensor '" + s.name + "': the byte size of global_shape overflows 64 bits");
    }
    if (!seen.emplace(s.name, layout->tensors.size()).second) {
      return InvalidArgument("tensor name '" + s.name + "' is registered twice; names must be unique");
    }
    layout->tensors.push_back(std::move(s));
  }
  return Status::OK();
}

// The tensors (not replicas) that go into the file of `kind`, in data order: largest element
// first, then by name.
std::vector<size_t> FileMembers(const RankLayout& layout, const char* kind) {
  std::vector<size_t> members;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const auto& t = layout.tensors[i];
    if (!t.replica && std::string(FileKindOf(t.kind)) == kind) members.push_back(i);
  }
  std::sort(members.begin(), members.end(), [&](size_t a, size_t b) {
    size_t ea = DTypeSize(layout.tensors[a].dtype), eb = DTypeSize(layout.tensors[b].dtype);
    if (ea != eb) return ea > eb;
    return layout.tensors[a].name < layout.tensors[b].name;
  });
  return members;
}

// The ids, in a file's header builder, of the fixed-width fields written at save time.
struct HeaderFieldIds {
  size_t step = 0;
  std::vector<size_t> extra;                           // LayoutExtras::fixed_fields, in order
  std::vector<size_t> checksums;                       // one per member tensor
  std::vector<std::optional<size_t>> chunk_checksums;  // one per member tensor; none for one chunk
};

// Adds the file-wide metadata of the file of `kind` to `builder`: format, job, rank, topology, the
// step field, the checksum chunk and the extras.
void AddFileMetadata(const RankLayout& layout, const char* kind, const LayoutExtras& extras,
                     SafetensorsHeaderBuilder* builder, HeaderFieldIds* ids) {
  const Topology& topology = layout.topology;
  builder->AddMetadata("format", "flashckpt");
  builder->AddMetadata("format_version", std::to_string(kFormatVersion));
  builder->AddMetadata("job", layout.job);
  builder->AddMetadata("rank", std::to_string(layout.rank));
  builder->AddMetadata("file", kind);
  builder->AddMetadata("world_size", std::to_string(topology.world_size));
  builder->AddMetadata("tp_rank", std::to_string(topology.tp_rank));
  builder->AddMetadata("tp_degree", std::to_string(topology.tp_degree));
  builder->AddMetadata("pp_rank", std::to_string(topology.pp_rank));
  builder->AddMetadata("pp_degree", std::to_string(topology.pp_degree));
  builder->AddMetadata("shard_rank", std::to_string(topology.shard_rank));
  builder->AddMetadata("shard_degree", std::to_string(topology.shard_degree));
  ids->step = builder->AddFixedWidthMetadata("step", kStepFieldWidth);
  builder->AddMetadata("checksum_chunk", std::to_string(extras.checksum_chunk));
  for (const auto& [key, value] : extras.metadata) builder->AddMetadata(key, value);
  for (const auto& [key, width] : extras.fixed_fields) ids->extra.push_back(builder->AddFixedWidthMetadata(key, width));
}

// Adds the member tensors of the file of `kind` to `builder` with their metadata and checksum
// fields, and sets their placements' sizes and offsets (from the data start); returns the data
// bytes. Refuses a slot past kMaxSlotBytes and checksum digits past the header limit.
Result<uint64_t> AddFileTensors(const char* kind, const std::vector<size_t>& members, const LayoutExtras& extras,
                                RankLayout* layout, SafetensorsHeaderBuilder* builder, HeaderFieldIds* ids) {
  const uint32_t rank = layout->rank;
  uint64_t data = 0;
  uint64_t chunk_digits = 0;  // header bytes of the per-chunk checksum fields so far
  for (size_t i : members) {
    const auto& t = layout->tensors[i];
    uint64_t bytes = TensorBytes(t.dtype, t.shape).value();  // NormalizeTensorSpec: at most kMaxSlotBytes
    uint64_t end;
    if (__builtin_add_overflow(data, bytes, &end) || end > kMaxSlotBytes) return SlotTooLarge(rank);
    const uint64_t chunks = ChunkCount(bytes, extras.checksum_chunk);
    // A huge tensor with a small chunk asks for terabytes of checksum digits: refuse before the
    // builder allocates them. (chunks <= 2^36 here, so neither product nor sum can wrap.)
    if (chunks > 1) chunk_digits += chunks * kChecksumFieldWidth;
    if (chunk_digits > kMaxHeaderJsonBytes) return HeaderTooLarge(kind, rank, chunk_digits);
    builder->AddTensor(t.name, t.dtype, t.shape, data, end);
    builder->AddMetadata(TensorMetaKey(t.name, "kind"), std::string(TensorKindName(t.kind)));
    builder->AddMetadata(TensorMetaKey(t.name, "global_shape"), ShapeJson(t.global_shape));
    builder->AddMetadata(TensorMetaKey(t.name, "box_offset"), ShapeJson(t.box_offset));
    builder->AddMetadata(TensorMetaKey(t.name, "box_shape"), ShapeJson(t.box_shape));
    if (t.flat_range) {
      builder->AddMetadata(TensorMetaKey(t.name, "flat_range"), ShapeJson({t.flat_range->begin, t.flat_range->end}));
    }
    ids->checksums.push_back(builder->AddFixedWidthMetadata(TensorMetaKey(t.name, "xxh3"), kChecksumFieldWidth));
    ids->chunk_checksums.push_back(chunks > 1 ? std::optional(builder->AddFixedWidthMetadata(
                                                    TensorMetaKey(t.name, "xxh3_chunks"), chunks * kChecksumFieldWidth))
                                              : std::nullopt);
    layout->placements[i].bytes = bytes;
    layout->placements[i].slot_offset = data;  // relative to the data start for now
    data = end;
  }
  return data;
}

// Builds the image of the file of `kind` at `*offset` in the slot, appends it to layout->files with
// its tensors placed, and advances `*offset` past it. A kind with no tensors adds nothing.
Status AddFileImage(const char* kind, const LayoutExtras& extras, RankLayout* layout, uint64_t* offset) {
  const std::vector<size_t> members = FileMembers(*layout, kind);
  if (members.empty()) return Status::OK();
  const Topology& topology = layout->topology;

  FileImage image;
  image.kind = kind;
  image.stem = FileStem(kind, topology.tp_rank, topology.pp_rank, topology.shard_rank);
  image.tensors = members;

  SafetensorsHeaderBuilder builder;
  HeaderFieldIds ids;
  AddFileMetadata(*layout, kind, extras, &builder, &ids);
  ASSIGN_OR_RETURN(uint64_t data, AddFileTensors(kind, members, extras, layout, &builder, &ids));
  ASSIGN_OR_RETURN(auto built, builder.Build());
  if (built.bytes.size() - 8 > kMaxHeaderJsonBytes) return HeaderTooLarge(kind, layout->rank, built.bytes.size());
  image.header = std::move(built.bytes);
  image.step_field = built.field_offsets[ids.step];
  for (size_t id : ids.extra) image.extra_fields.push_back(built.field_offsets[id]);
  image.data_bytes = data;
  image.slot_offset = *offset;
  int file_index = static_cast<int>(layout->files.size());
  for (size_t k = 0; k < members.size(); ++k) {
    auto& p = layout->placements[members[k]];
    p.file = file_index;
    p.slot_offset += *offset + image.header.size();
    p.checksum_field = *offset + built.field_offsets[ids.checksums[k]];
    if (ids.chunk_checksums[k]) {
      p.chunks_field = *offset + built.field_offsets[*ids.chunk_checksums[k]];
      p.checksum_chunk = extras.checksum_chunk;
    }
  }
  RETURN_IF_ERROR(Advance(offset, image.file_bytes(), layout->rank));
  layout->files.push_back(std::move(image));
  return Status::OK();
}

// Places the replica tensors one after another from `*offset`, and advances `*offset` past them.
Status PlaceReplicas(RankLayout* layout, uint64_t* offset) {
  for (size_t i = 0; i < layout->tensors.size(); ++i) {
    if (!layout->tensors[i].replica) continue;
    auto& p = layout->placements[i];
    p.bytes = TensorBytes(layout->tensors[i].dtype, layout->tensors[i].shape).value();
    p.slot_offset = *offset;
    RETURN_IF_ERROR(Advance(offset, p.bytes, layout->rank));
  }
  return Status::OK();
}

}  // namespace

Result<RankLayout> BuildRankLayout(const std::string& job, uint32_t rank, const Topology& topology,
                                   const std::vector<TensorSpec>& specs, const LayoutExtras& extras) {
  RETURN_IF_ERROR(ValidateJobName(job));
  RETURN_IF_ERROR(ValidateTopology(topology, rank));
  if (specs.empty()) return InvalidArgument("tensors: a rank must register at least one tensor");
  if (specs.size() > kMaxTensorsPerRank) {
    return InvalidArgument("tensors: " + std::to_string(specs.size()) + " tensors, above the limit of " +
                           std::to_string(kMaxTensorsPerRank) + " per rank");
  }
  RETURN_IF_ERROR(ValidateChecksumChunk(extras.checksum_chunk));

  RankLayout layout;
  layout.job = job;
  layout.rank = rank;
  layout.topology = topology;
  layout.checksum_chunk = extras.checksum_chunk;
  RETURN_IF_ERROR(AddTensors(specs, &layout));
  layout.placements.resize(layout.tensors.size());

  uint64_t offset = kPageSize;  // the slot header page
  for (const char* kind : {"model_state", "optimizer", "ema"}) {
    RETURN_IF_ERROR(AddFileImage(kind, extras, &layout, &offset));
  }
  layout.replica_offset = offset;
  RETURN_IF_ERROR(PlaceReplicas(&layout, &offset));
  layout.slot_bytes = offset;  // page-aligned by Advance (or the header page alone)
  return layout;
}

}  // namespace flashckpt
