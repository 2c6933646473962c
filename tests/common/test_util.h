// Helpers for the common/ tests: a temporary directory that removes itself, and tensor specs.
#pragma once

#include <fcntl.h>
#include <stdlib.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/io/fs.h"
#include "flashckpt/tensor.h"

namespace flashckpt::testing {

// A fresh directory under /tmp (mkdtemp), removed with everything in it when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = "/tmp/flashckpt-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    if (!path_.empty()) (void)RemoveTree(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Empty when mkdtemp failed; tests ASSERT on ok() first.
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A zeroed, 4 KiB-aligned buffer standing in for a slot of a shared-memory segment.
class SlotBuffer {
 public:
  explicit SlotBuffer(uint64_t bytes)
      : bytes_(bytes), data_(static_cast<char*>(std::aligned_alloc(4096, bytes)), &std::free) {
    if (data_) std::memset(data_.get(), 0, bytes);
  }
  char* data() const { return data_.get(); }
  uint64_t size() const { return bytes_; }

 private:
  uint64_t bytes_;
  std::unique_ptr<char, decltype(&std::free)> data_;
};

// Flips the lowest bit of the byte at `offset` of the file at `path` (a hex digit stays a character
// of the same kind: '0'..'9' <-> another digit, 'a'..'f' <-> '`'..'g').
inline Status FlipByte(const std::string& path, uint64_t offset) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus("open", path);
  char c = 0;
  RETURN_IF_ERROR(PreadFull(fd.get(), &c, 1, offset, path));
  c = static_cast<char>(c ^ 0x01);
  return PwriteFull(fd.get(), &c, 1, offset, path);
}

inline TensorSpec Spec(std::string name, TensorKind kind, DType dtype, std::vector<uint64_t> shape) {
  TensorSpec s;
  s.name = std::move(name);
  s.kind = kind;
  s.dtype = dtype;
  s.shape = std::move(shape);
  return s;
}

}  // namespace flashckpt::testing
