// Anonymous private memory for the benchmarks: page aligned, unmapped on destruction.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <string>
#include <utility>

#include "common/base/status.h"

namespace flashckpt::bench {

class Mapping {
 public:
  static Result<Mapping> Make(uint64_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return ErrnoStatus("mmap", std::to_string(bytes) + " bytes");
    return Mapping(static_cast<char*>(p), bytes);
  }
  Mapping(Mapping&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  Mapping& operator=(Mapping&&) = delete;
  ~Mapping() {
    if (p_ != nullptr) ::munmap(p_, n_);
  }
  char* data() const { return p_; }

 private:
  Mapping(char* p, uint64_t n) : p_(p), n_(n) {}
  char* p_;
  uint64_t n_;
};

}  // namespace flashckpt::bench
