// libFuzzer target: the safetensors files of a checkpoint are read back (completion builds
// metadata.json from their headers; verify and reshard read them), so their bytes are untrusted. The
// input is a whole file, written to a temporary directory and read by BuildMetadataFromFiles, the
// daemon's own path: the length prefix, the JSON header (dtypes, shapes, offsets), the flashckpt
// metadata (job, step, topology, EMA record) and each tensor's piece description. Properties: no
// crash, every piece lies in the file's data region with a byte size that matches its dtype and
// shape, and the metadata.json written from an accepted file parses back to the same checkpoint.
// The same bytes also go through the reader of `flashckpt import` (common/format/hf.h): as the one
// file of a Hugging Face directory (every tensor it accepts lies in the file with a matching size)
// and as its index (every file it names is a plain name).
#include <fcntl.h>
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "common/format/hf.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "fuzz_check.h"

namespace {

using namespace flashckpt;

constexpr char kFileName[] = "model_state.tp00_pp00_shard00.safetensors";

// One directory per fuzzing process, removed at a normal exit (a crash leaves it, with the input).
// Allocated once and never freed, so that the exit handler never sees it destroyed.
const std::string& Dir() {
  static const std::string& dir = *new std::string([] {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/flashckpt-fuzz-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    std::atexit([] { (void)RemoveTree(Dir()); });
    return tmpl;
  }());
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = Dir();
  const std::string path = dir + "/" + kFileName;
  {
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    FUZZ_CHECK(fd.valid());
    FUZZ_CHECK(PwriteFull(fd.get(), data, size, 0, path).ok());
  }
  {
    static const std::string& hf = *new std::string(dir + "/hf");
    FUZZ_CHECK(MakeDirs(hf).ok());
    const std::string hf_path = hf + "/model.safetensors";
    UniqueFd fd(::open(hf_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    FUZZ_CHECK(fd.valid());
    FUZZ_CHECK(PwriteFull(fd.get(), data, size, 0, hf_path).ok());
    auto tensors = ReadHfDirectory(hf);
    if (tensors.ok()) {
      FUZZ_CHECK(!tensors->empty());
      for (const auto& [name, t] : *tensors) {
        FUZZ_CHECK(t.file == "model.safetensors" && t.entry.name == name);
        auto bytes = TensorBytes(t.entry.dtype, t.entry.shape);
        FUZZ_CHECK(bytes.ok() && *bytes == t.entry.end - t.entry.begin);
        FUZZ_CHECK(t.entry.begin <= t.entry.end && t.data_start + t.entry.end <= size);
      }
    }
    auto index = ParseHfIndex(std::string_view(reinterpret_cast<const char*>(data), size), "index");
    if (index.ok()) {
      FUZZ_CHECK(!index->empty());
      for (const auto& [name, file] : *index) {
        FUZZ_CHECK(!file.empty() && file != "." && file != ".." && file.find('/') == std::string::npos);
      }
    }
  }
  auto meta = BuildMetadataFromFiles(dir, {kFileName});
  if (!meta.ok()) return 0;
  FUZZ_CHECK(meta->files.size() == 1 && meta->files[0].bytes == size);
  for (const Piece& p : meta->pieces) {
    FUZZ_CHECK(p.file == kFileName);
    FUZZ_CHECK(8 < p.begin && p.begin <= p.end && p.end <= size);
    auto bytes = TensorBytes(p.dtype, p.shape);
    FUZZ_CHECK(bytes.ok() && *bytes == p.end - p.begin);
    if (!p.chunk_xxh3.empty()) FUZZ_CHECK(p.chunk_xxh3.size() == ChunkCount(p.end - p.begin, p.chunk_bytes));
  }
  const std::string written = MetadataToJson(*meta);
  auto again = ParseMetadataJson(written);
  if (!again.ok()) std::fprintf(stderr, "%s\n", again.status().ToString().c_str());
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(MetadataToJson(*again) == written);
  return 0;
}
