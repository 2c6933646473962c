// ExportCheckpoint and ImportCheckpoint (flashckpt/offline.h): a checkpoint's model or EMA weights
// as a Hugging Face style safetensors directory, and such a directory as a job's first checkpoint.
//
// Export:
// The plan comes from metadata.json alone: every tensor of the chosen kind, its full (global)
// shape, dtype and size after conversion, so the output files (in name order, cut at
// max_shard_size) and their headers are known before any data is read. Then each tensor is read on
// its own, as a one-tensor layout of degree (1, 1, 1), by the reader of a resharding restore
// (FillSlotFromCheckpoint: its tp boxes, pipeline stage and flat ranges merged, every chunk read
// verified), converted, and appended to its file. Only one tensor is in memory at a time.
//
// Import: every header of the input is parsed defensively first (the index, each file, every
// tensor's place in exactly one file); then one rank's layout of (1, 1, 1) is built from them, and
// each tensor is copied 16 MiB at a time from its source file into the model_state file, hashed per
// chunk and whole on the way; the header template gets the step and the checksums and is written
// last, then the file is synced and renamed, then saved_signal_0, metadata.json and LATEST.
#include "flashckpt/offline.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "common/base/dtype.h"
#include "common/base/names.h"
#include "common/base/thread_pool.h"
#include "common/format/checksum.h"
#include "common/format/hf.h"
#include "common/format/layout.h"
#include "common/format/metadata.h"
#include "common/format/safetensors.h"
#include "common/format/signal.h"
#include "common/io/fs.h"
#include "common/io/shm.h"
#include "common/read/checkpoint_read.h"
#include "common/read/header_check.h"

namespace flashckpt {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// The dtype an export converts floating-point tensors to: false for an unknown name; `*convert`
// false for "" (keep the saved dtypes).
bool ParseExportDType(const std::string& name, bool* convert, DType* to) {
  *convert = !name.empty();
  if (name.empty()) return true;
  if (name == "fp32" || name == "float32") *to = DType::kF32;
  else if (name == "bf16" || name == "bfloat16") *to = DType::kBF16;
  else if (name == "fp16" || name == "float16") *to = DType::kF16;
  else return false;
  return true;
}

bool IsFloat16Or32(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

struct OutTensor {
  std::string key;   // the name in the checkpoint
  std::string name;  // the name in the export
  DType saved = DType::kF32;
  DType out = DType::kF32;
  std::vector<uint64_t> shape;  // global
  uint64_t elements = 1;
  uint64_t out_bytes = 0;
  size_t file = 0;
  uint64_t begin = 0;  // in its file's data
};

// model.safetensors, or model-0000K-of-0000N.safetensors when there are several.
std::string ExportFileName(size_t i, size_t n_files) {
  if (n_files == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n_files);
  return buf;
}

// True when `inner` is `outer` or lies under it (both absolute and normal, symlinks resolved as far
// as they exist).
bool Within(const std::filesystem::path& inner, const std::filesystem::path& outer) {
  auto o = outer.begin(), i = inner.begin();
  for (; o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

// Where an export writes until it is complete: a new folder beside `out_dir`, renamed onto it at the
// end (rename(2) replaces an empty directory), so a failed export leaves `out_dir` as it was. Refuses
// an `out_dir` that is not empty, or that lies inside the checkpoint being read, inside any
// checkpoint folder (checkpoint-<step>: retention, delete and gc remove those, with what is in them),
// or inside the checkpoint's root (<root>/<job>/checkpoint-<step> where <job> holds LATEST: the
// daemon's --root, whose folders are jobs to it).
Result<std::string> StagingDirFor(const std::string& checkpoint_dir, const std::string& out_dir) {
  std::error_code ec;
  const std::filesystem::path out = std::filesystem::weakly_canonical(std::filesystem::absolute(out_dir), ec);
  if (ec) return InvalidArgument("export destination " + out_dir + ": " + ec.message());
  const std::filesystem::path ckpt = std::filesystem::weakly_canonical(std::filesystem::absolute(checkpoint_dir), ec);
  if (ec) return InvalidArgument("checkpoint " + checkpoint_dir + ": " + ec.message());
  std::string inside;
  if (Within(out, ckpt)) inside = "the checkpoint " + checkpoint_dir;
  for (const auto& part : out) {
    if (inside.empty() && ParseCheckpointDirName(part.string())) inside = "a checkpoint folder (" + part.string() + ")";
  }
  // A checkpoint in a daemon's root: <root>/<job>/checkpoint-<step>, its job folder holding LATEST (a
  // checkpoint folder copied elsewhere, without its job's LATEST, has no root).
  std::error_code latest_ec;
  if (inside.empty() && ParseCheckpointDirName(ckpt.filename().string()) &&
      std::filesystem::exists(ckpt.parent_path() / "LATEST", latest_ec)) {
    const std::filesystem::path root = ckpt.parent_path().parent_path();
    if (!root.empty() && root != root.root_path() && Within(out, root)) {
      inside = "the checkpoint's root " + root.string() + " (the daemon's --root: each folder in it is a job)";
    }
  }
  if (!inside.empty()) {
    return InvalidArgument("export destination " + out_dir + " is inside " + inside +
                           ": export to a folder outside the root and its checkpoint folders (retention, flashckpt "
                           "delete and gc remove a checkpoint folder with everything in it)");
  }
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(out.string()));
  if (names && !names->empty()) {
    return AlreadyExists(out_dir + " is not empty: the export needs a new or empty directory");
  }
  RETURN_IF_ERROR(MakeDirs(out.parent_path().string()));
  ASSIGN_OR_RETURN(std::string token, RandomToken());
  const std::string staging = (out.parent_path() / ("." + out.filename().string() + ".export-" + token)).string();
  if (::mkdir(staging.c_str(), 0755) != 0) return ErrnoStatus("mkdir", staging);
  return staging;
}

// Reads tensor `t` in full, verified, into `slot` (reused between calls, grown as needed) and
// returns where its bytes (in t.out, or t.saved when a widening is left to the caller) start.
Result<const char*> ReadTensor(const std::string& dir, const CheckpointMetadata& meta, const OutTensor& t, TensorKind kind,
                               ParallelLoop* loop, std::unique_ptr<char, FreeDeleter>* slot, uint64_t* slot_bytes,
                               DType* got) {
  // fp32 saved, 16-bit wanted: the reader narrows (round to nearest even). Otherwise it reads the
  // saved dtype and the caller converts.
  const bool narrow = t.saved == DType::kF32 && t.out != DType::kF32 && CanNarrowF32(t.out);
  TensorSpec spec;
  spec.name = t.key;
  spec.kind = kind;
  spec.dtype = narrow ? t.out : t.saved;
  spec.shape = t.shape;
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(meta.job, 0, Topology{}, {spec}));
  if (layout.slot_bytes > *slot_bytes) {
    slot->reset(static_cast<char*>(std::aligned_alloc(kPageSize, layout.slot_bytes)));
    if (!*slot) {
      *slot_bytes = 0;
      return ResourceExhausted("cannot allocate " + FormatBytes(layout.slot_bytes) + " for tensor '" + t.key + "'");
    }
    *slot_bytes = layout.slot_bytes;
  }
  FillOptions options;
  options.loop = loop;
  options.convert_dtype = narrow;
  options.headers_checked = true;  // all of them, once, by ExportCheckpoint
  RETURN_IF_ERROR(FillSlotFromCheckpoint(dir, meta, layout, slot->get(), options).status());
  *got = spec.dtype;
  return static_cast<const char*>(slot->get() + layout.placements[0].slot_offset);
}

// Writes one output file: <dir>/<name>.tmp.*, header then each tensor in order, fdatasync, rename.
// `direct` (the export): the bytes go through an aligned 16 MiB staging buffer and are written with
// O_DIRECT, bypassing the page cache (a buffered write of gigabytes stalls in the kernel's writeback
// throttling at a fraction of the disk's rate); on a file system that refuses O_DIRECT (tmpfs) the
// same writes are buffered. Only Append and Commit are used then.
class FileWriter {
 public:
  static constexpr uint64_t kStaging = 16ull << 20;
  static Result<FileWriter> Open(const std::string& dir, const std::string& name, const std::string& header,
                                 bool direct = false) {
    FileWriter w;
    w.final_ = dir + "/" + name;
    w.tmp_ = TemporaryPath(w.final_);
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
    w.fd_ = direct ? ::open(w.tmp_.c_str(), flags | O_DIRECT, 0644) : -1;
    if (w.fd_ < 0 && direct && errno == EINVAL) ::unlink(w.tmp_.c_str());  // created, then refused: buffered
    if (w.fd_ < 0) w.fd_ = ::open(w.tmp_.c_str(), flags, 0644);
    if (w.fd_ < 0) return ErrnoStatus("open", w.tmp_);
    if (direct) {
      w.staging_.reset(static_cast<char*>(std::aligned_alloc(kPageSize, kStaging)));
      if (!w.staging_) return ResourceExhausted("cannot allocate the export's 16 MiB staging buffer");
    }
    RETURN_IF_ERROR(w.Append(header.data(), header.size()));
    return w;
  }
  FileWriter() = default;
  FileWriter(FileWriter&& o) noexcept { *this = std::move(o); }
  FileWriter& operator=(FileWriter&& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(tmp_, o.tmp_);
    std::swap(final_, o.final_);
    std::swap(offset_, o.offset_);
    std::swap(staging_, o.staging_);
    std::swap(staged_, o.staged_);
    return *this;
  }
  ~FileWriter() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  Status Append(const void* data, uint64_t bytes) {
    if (!staging_) {
      RETURN_IF_ERROR(PwriteFull(fd_, data, bytes, offset_, tmp_));
      offset_ += bytes;
      return Status::OK();
    }
    const char* from = static_cast<const char*>(data);
    while (bytes > 0) {  // offset_ is where the staging buffer starts in the file
      const uint64_t n = std::min(bytes, kStaging - staged_);
      std::memcpy(staging_.get() + staged_, from, n);
      staged_ += n;
      from += n;
      bytes -= n;
      if (staged_ == kStaging) {
        RETURN_IF_ERROR(PwriteFull(fd_, staging_.get(), kStaging, offset_, tmp_));
        offset_ += kStaging;
        staged_ = 0;
      }
    }
    return Status::OK();
  }
  Status WriteAt(const void* data, uint64_t bytes, uint64_t offset) { return PwriteFull(fd_, data, bytes, offset, tmp_); }
  Status Truncate(uint64_t bytes) {
    if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return ErrnoStatus("ftruncate", tmp_);
    return Status::OK();
  }
  Status Commit() {
    if (staging_ && staged_ > 0) {  // the last block, padded to whole pages, then cut to its size
      const uint64_t padded = (staged_ + kPageSize - 1) / kPageSize * kPageSize;
      std::memset(staging_.get() + staged_, 0, padded - staged_);
      RETURN_IF_ERROR(PwriteFull(fd_, staging_.get(), padded, offset_, tmp_));
      if (::ftruncate(fd_, static_cast<off_t>(offset_ + staged_)) != 0) return ErrnoStatus("ftruncate", tmp_);
    }
    if (::fdatasync(fd_) != 0) return ErrnoStatus("fdatasync", tmp_);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      ::unlink(tmp_.c_str());
      return ErrnoStatus("close", tmp_);
    }
    if (::rename(tmp_.c_str(), final_.c_str()) != 0) {
      Status s = ErrnoStatus("rename", tmp_);
      ::unlink(tmp_.c_str());
      return s;
    }
    return Status::OK();
  }

 private:
  int fd_ = -1;
  std::string tmp_, final_;
  uint64_t offset_ = 0;
  std::unique_ptr<char, FreeDeleter> staging_;  // direct: the bytes not yet written, from offset_ on
  uint64_t staged_ = 0;
};

// --- import ----------------------------------------------------------------------------------

constexpr uint64_t kCopyPiece = 16ull << 20;

void PutDigits(std::string* head, uint64_t at, const std::string& digits) {
  head->replace(at, digits.size(), digits);
}

// Writes the export's files into out_dir (the staging folder) and, for several files, the index.
Status WriteExport(const std::string& dir, const CheckpointMetadata& meta, const std::vector<OutTensor>& tensors,
                   const std::vector<uint64_t>& file_bytes, uint64_t total, TensorKind kind,
                   const ExportOptions& options, const std::string& out_dir, ExportReport* report) {
  const size_t n_files = file_bytes.size();
  auto file_name = [&](size_t i) { return ExportFileName(i, n_files); };
  ParallelLoop loop(options.threads - 1);
  std::unique_ptr<char, FreeDeleter> slot;
  uint64_t slot_bytes = 0;
  std::vector<float> widened;
  std::vector<char> narrowed;
  uint64_t done = 0;
  size_t next = 0;
  for (size_t f = 0; f < n_files; ++f) {
    SafetensorsHeaderBuilder builder;
    builder.AddMetadata("format", "pt");
    builder.AddMetadata("flashckpt_job", meta.job);
    builder.AddMetadata("flashckpt_step", std::to_string(meta.step));
    builder.AddMetadata("flashckpt_weights", options.weights);
    size_t end = next;
    while (end < tensors.size() && tensors[end].file == f) {
      const OutTensor& t = tensors[end];
      builder.AddTensor(t.name, t.out, t.shape, t.begin, t.begin + t.out_bytes);
      ++end;
    }
    ASSIGN_OR_RETURN(auto header, builder.Build());
    ASSIGN_OR_RETURN(FileWriter writer, FileWriter::Open(out_dir, file_name(f), header.bytes, /*direct=*/true));
    for (; next < end; ++next) {
      const OutTensor& t = tensors[next];
      DType got = t.saved;
      ASSIGN_OR_RETURN(const char* data, ReadTensor(dir, meta, t, kind, &loop, &slot, &slot_bytes, &got));
      const char* bytes = data;
      if (got != t.out) {  // a 16-bit dtype to fp32, or to the other 16-bit dtype
        widened.resize(t.elements);
        WidenToF32(data, got, t.elements, widened.data());
        bytes = reinterpret_cast<const char*>(widened.data());
        if (t.out != DType::kF32) {
          narrowed.resize(t.out_bytes);
          NarrowF32(widened.data(), t.elements, t.out, narrowed.data());
          bytes = narrowed.data();
        }
      }
      RETURN_IF_ERROR(writer.Append(bytes, t.out_bytes));
      done += t.out_bytes;
      ++report->tensors;
      if (options.progress) options.progress(done, total);
    }
    RETURN_IF_ERROR(writer.Commit());
    report->files.push_back(file_name(f));
    // Large buffers are not kept past the tensor that needed them.
    std::vector<float>().swap(widened);
    std::vector<char>().swap(narrowed);
  }
  report->bytes = done;
  if (n_files > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    for (const OutTensor& t : tensors) map[t.name] = file_name(t.file);
    index["weight_map"] = std::move(map);
    RETURN_IF_ERROR(WriteFileDurably(out_dir, "model.safetensors.index.json", index.dump(2) + "\n"));
    report->index = true;
  } else {
    RETURN_IF_ERROR(FsyncDir(out_dir));
  }
  return Status::OK();
}

// The import's options checked, and its job new under an existing root (`job_dir`: its directory);
// returns the checksum chunk.
Result<uint64_t> CheckImport(const ImportOptions& options, const std::string& job_dir) {
  RETURN_IF_ERROR(ValidateJobName(options.job));
  if (options.step < 0 || options.step > kMaxStep) {
    return InvalidArgument("step must be 0 to " + std::to_string(kMaxStep) + ", got " + std::to_string(options.step));
  }
  const auto chunk = ParseByteSize(options.checksum_chunk);
  if (!chunk) return InvalidArgument("checksum chunk '" + options.checksum_chunk + "' is not a size like 1MiB");
  RETURN_IF_ERROR(ValidateChecksumChunk(*chunk));
  ASSIGN_OR_RETURN(auto root_names, ListDirIfExists(options.root));
  if (!root_names) return NotFound("the root " + options.root + " does not exist");
  ASSIGN_OR_RETURN(auto job_names, ListDirIfExists(job_dir));
  for (const std::string& name : job_names.value_or(std::vector<std::string>{})) {
    if (name == "LATEST" || ParseCheckpointDirName(name)) {
      return AlreadyExists("job '" + options.job + "' already has checkpoints (" + job_dir + "/" + name +
                           "): import starts a new job");
    }
  }
  return *chunk;
}

// One rank's layout (1, 1, 1) of every source tensor as a model weight, named with the prefix;
// `source_of` is set to where each comes from (by name in the checkpoint).
Result<RankLayout> ImportLayout(const std::string& hf_dir, const ImportOptions& options, uint64_t chunk,
                                const std::map<std::string, HfTensor>& sources,
                                std::map<std::string, const HfTensor*>* source_of) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, src] : sources) {
    TensorSpec spec;
    spec.name = options.add_prefix + name;
    spec.kind = TensorKind::kModel;
    spec.dtype = src.entry.dtype;
    spec.shape = src.entry.shape;
    (*source_of)[spec.name] = &src;
    specs.push_back(std::move(spec));
  }
  LayoutExtras extras;
  extras.checksum_chunk = chunk;
  auto built = BuildRankLayout(options.job, 0, Topology{}, specs, extras);
  if (!built.ok()) return built.status().WithContext("importing " + hf_dir);
  return built;
}

// Copies tensor `p` of `image` from `src` in the source file open as `in` (`in_path`) to its place
// in the file `writer` writes, through `buffer`, and puts its checksums into the file's header `head`.
Status CopyTensor(const Placement& p, const FileImage& image, const HfTensor& src, int in, const std::string& in_path,
                  uint64_t chunk, std::vector<char>* buffer, FileWriter* writer, std::string* head) {
  const uint64_t from = src.data_start + src.entry.begin, at = p.slot_offset - image.slot_offset;
  // Pieces of whole checksum chunks (a tensor of one chunk has no per-chunk checksums).
  const uint64_t piece = std::max(kCopyPiece, chunk) / chunk * chunk;
  // Each byte is hashed once: for its chunk, and the whole checksum of a tensor of several
  // chunks is computed from theirs (format version 2); a tensor of one chunk is hashed whole.
  Xxh3Stream whole;
  std::vector<uint64_t> chunk_sums;
  for (uint64_t pos = 0; pos < p.bytes; pos += piece) {
    const uint64_t n = std::min(piece, p.bytes - pos);
    for (uint64_t got = 0; got < n;) {
      const ssize_t r = ::pread(in, buffer->data() + got, n - got, static_cast<off_t>(from + pos + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return ErrnoStatus("pread", in_path);
      if (r == 0) return Corruption(in_path + ": tensor '" + src.entry.name + "' ends past the end of the file");
      got += static_cast<uint64_t>(r);
    }
    if (p.chunks_field != 0) {
      for (uint64_t c = 0; c < n; c += p.checksum_chunk) {  // p.checksum_chunk == chunk here
        const uint64_t k = (pos + c) / p.checksum_chunk;
        chunk_sums.push_back(Xxh3(buffer->data() + c, std::min(p.checksum_chunk, n - c)));
        PutDigits(head, p.chunks_field - image.slot_offset + k * kChecksumFieldWidth,
                  ChecksumHex(chunk_sums.back()));
      }
    } else {
      whole.Update(buffer->data(), n);
    }
    RETURN_IF_ERROR(writer->WriteAt(buffer->data(), n, at + pos));
  }
  const uint64_t whole_sum = p.chunks_field != 0
                                 ? CombineChunkChecksums(chunk_sums.data(), chunk_sums.size(), p.bytes)
                                 : whole.Digest();
  PutDigits(head, p.checksum_field - image.slot_offset, ChecksumHex(whole_sum));
  return Status::OK();
}

// The import's files are written (`names`, `file_bytes` in all): its directory synced, then its
// saved_signal_0 and metadata.json, which complete it.
Status CompleteImport(const std::string& dir, const ImportOptions& options, const std::vector<std::string>& names,
                      uint64_t file_bytes) {
  RETURN_IF_ERROR(FsyncDir(dir));
  Signal signal;
  signal.rank = 0;
  signal.step = options.step;
  signal.node = DefaultNodeName();  // the host that imported it
  signal.world_size = 1;
  signal.files = names;
  RETURN_IF_ERROR(WriteFileDurably(dir, SignalFileName(0), EncodeSignal(options.job, signal, file_bytes)));
  ASSIGN_OR_RETURN(CheckpointMetadata meta, BuildMetadataFromFiles(dir, names));
  return WriteMetadataFiles(dir, meta);
}

// The tensors of `kind` an export writes, in name order: one per key, from its first piece (the
// reader checks that every piece of a key agrees on dtype and global shape), named without
// `strip_prefix`; `convert`: fp16/bf16/fp32 ones become `to`.
Result<std::vector<OutTensor>> ExportedTensors(const std::string& dir, const CheckpointMetadata& meta, TensorKind kind,
                                               bool convert, DType to, const std::string& strip_prefix) {
  std::map<std::string, OutTensor> by_name;
  std::map<std::string, std::string> key_of_name;
  for (const Piece& p : meta.pieces) {
    if (p.kind != kind) continue;
    std::string name = p.key;
    if (!strip_prefix.empty() && name.rfind(strip_prefix, 0) == 0) {
      name = name.substr(strip_prefix.size());
      if (name.empty()) return InvalidArgument("stripping '" + strip_prefix + "' leaves tensor '" + p.key + "' no name");
    }
    auto [it, inserted] = key_of_name.emplace(name, p.key);
    if (!inserted) {
      if (it->second != p.key) {
        return InvalidArgument("tensors '" + it->second + "' and '" + p.key + "' are both '" + name + "' without '" +
                               strip_prefix + "'");
      }
      continue;
    }
    OutTensor t;
    t.key = p.key;
    t.name = name;
    t.saved = p.dtype;
    t.out = convert && IsFloat16Or32(p.dtype) ? to : p.dtype;
    t.shape = p.global_shape.empty() ? p.shape : p.global_shape;
    for (uint64_t d : t.shape) t.elements *= d;
    t.out_bytes = t.elements * DTypeSize(t.out);
    by_name.emplace(name, std::move(t));
  }
  if (by_name.empty()) {
    return InvalidArgument("checkpoint " + dir + " has no " + std::string(TensorKindName(kind)) + " tensors" +
                           (kind == TensorKind::kEma ? " (it was saved without an EMA)" : ""));
  }
  std::vector<OutTensor> tensors;
  for (auto& [name, t] : by_name) tensors.push_back(std::move(t));
  return tensors;
}

// The export's files: the tensors in order, a new file when the next would pass `max_shard`. Sets
// each tensor's file and offset; returns each file's bytes, and their sum in `*total`.
std::vector<uint64_t> AssignExportFiles(uint64_t max_shard, std::vector<OutTensor>* tensors, uint64_t* total) {
  std::vector<uint64_t> file_bytes;
  *total = 0;
  for (OutTensor& t : *tensors) {
    if (file_bytes.empty() || (file_bytes.back() > 0 && file_bytes.back() + t.out_bytes > max_shard)) {
      file_bytes.push_back(0);
    }
    t.file = file_bytes.size() - 1;
    t.begin = file_bytes.back();
    file_bytes.back() += t.out_bytes;
    *total += t.out_bytes;
  }
  return file_bytes;
}

}  // namespace

Status ImportCheckpoint(const std::string& hf_dir, const ImportOptions& options, ImportReport* report) {
  ImportReport local;
  if (report == nullptr) report = &local;
  *report = ImportReport{};
  const std::string job_dir = options.root + "/" + options.job;
  ASSIGN_OR_RETURN(const uint64_t chunk, CheckImport(options, job_dir));

  ASSIGN_OR_RETURN(auto sources, ReadHfDirectory(hf_dir, &report->source_files));
  std::map<std::string, const HfTensor*> source_of;  // by name in the checkpoint
  ASSIGN_OR_RETURN(const RankLayout layout, ImportLayout(hf_dir, options, chunk, sources, &source_of));
  uint64_t total = 0;
  for (const Placement& p : layout.placements) total += p.bytes;

  RETURN_IF_ERROR(MakeDirs(job_dir));
  const std::string dir = job_dir + "/" + CheckpointDirName(options.step);
  if (::mkdir(dir.c_str(), 0755) != 0) return ErrnoStatus("mkdir", dir);
  report->checkpoint_dir = dir;
  auto write_all = [&]() -> Status {
    std::map<std::string, UniqueFd> inputs;
    std::vector<char> buffer(std::max(kCopyPiece, chunk));
    std::vector<std::string> names;
    uint64_t file_bytes = 0, done = 0;
    for (const FileImage& image : layout.files) {
      std::string head = image.header;
      char step_digits[kStepFieldWidth + 1];
      std::snprintf(step_digits, sizeof step_digits, "%020lld", static_cast<long long>(options.step));
      PutDigits(&head, image.step_field, std::string(step_digits, kStepFieldWidth));
      const std::string name = image.stem + ".safetensors";
      ASSIGN_OR_RETURN(FileWriter writer, FileWriter::Open(dir, name, ""));
      for (size_t t : image.tensors) {
        const Placement& p = layout.placements[t];
        const HfTensor& src = *source_of.at(layout.tensors[t].name);
        const std::string in_path = hf_dir + "/" + src.file;
        auto in = inputs.find(src.file);
        if (in == inputs.end()) {
          ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(in_path));
          in = inputs.emplace(src.file, std::move(fd)).first;
        }
        RETURN_IF_ERROR(CopyTensor(p, image, src, in->second.get(), in_path, chunk, &buffer, &writer, &head));
        done += p.bytes;
        ++report->tensors;
        if (options.progress) options.progress(done, total);
      }
      RETURN_IF_ERROR(writer.WriteAt(head.data(), head.size(), 0));
      RETURN_IF_ERROR(writer.Truncate(image.file_bytes()));
      RETURN_IF_ERROR(writer.Commit());
      names.push_back(name);
      file_bytes += image.file_bytes();
    }
    RETURN_IF_ERROR(CompleteImport(dir, options, names, file_bytes));
    report->bytes = done;
    return WriteFileDurably(job_dir, "LATEST", std::to_string(options.step) + "\n");
  };
  Status s = write_all();
  if (!s.ok()) (void)RemoveTree(dir);  // nothing of a failed import stays to block the next one
  return s;
}

Status ExportCheckpoint(const std::string& dir, const std::string& out_dir, const ExportOptions& options,
                        ExportReport* report) {
  ExportReport local;
  if (report == nullptr) report = &local;
  *report = ExportReport{};
  if (options.weights != "model" && options.weights != "ema" && options.weights != "optimizer") {
    return InvalidArgument("weights must be 'model', 'ema' or 'optimizer', got '" + options.weights + "'");
  }
  const TensorKind kind = options.weights == "ema"         ? TensorKind::kEma
                          : options.weights == "optimizer" ? TensorKind::kOptimizer
                                                           : TensorKind::kModel;
  bool convert = false;
  DType to = DType::kF32;
  if (!ParseExportDType(options.dtype, &convert, &to)) return InvalidArgument("dtype must be fp32, bf16 or fp16, got '" + options.dtype + "'");
  const auto max_shard = ParseByteSize(options.max_shard_size);
  if (!max_shard || *max_shard == 0) {
    return InvalidArgument("max shard size '" + options.max_shard_size + "' is not a size like 5GB or 500MiB");
  }
  if (options.threads < 1 || options.threads > 64) return InvalidArgument("threads must be 1 to 64");

  ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(dir));
  RETURN_IF_ERROR(CheckFileHeaders(dir, meta));

  ASSIGN_OR_RETURN(std::vector<OutTensor> tensors, ExportedTensors(dir, meta, kind, convert, to, options.strip_prefix));
  uint64_t total = 0;
  const std::vector<uint64_t> file_bytes = AssignExportFiles(*max_shard, &tensors, &total);

  ASSIGN_OR_RETURN(const std::string staging, StagingDirFor(dir, out_dir));
  Status written = WriteExport(dir, meta, tensors, file_bytes, total, kind, options, staging, report);
  if (written.ok()) {
    // Onto out_dir, absent or empty: it appears whole or not at all.
    if (::rename(staging.c_str(), out_dir.c_str()) != 0) {
      written = ErrnoStatus("rename " + staging + " to", out_dir);
    } else {
      written = FsyncDir(std::filesystem::path(std::filesystem::absolute(out_dir)).parent_path().string());
      if (!written.ok()) return written;  // renamed: the export is there, its parent's sync failed
    }
  }
  if (!written.ok()) {
    (void)RemoveTree(staging);  // the error says what failed; what it wrote goes
    report->files.clear();
    report->index = false;
  }
  return written;
}

}  // namespace flashckpt
