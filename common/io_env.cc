#include "common/io_env.h"

#include <stdio.h>
#include <unistd.h>

namespace flashckpt {
namespace {

class PosixIoEnv final : public IoEnv {
 public:
  ssize_t Pwrite(int fd, const void* buf, size_t bytes, uint64_t offset) override {
    return ::pwrite(fd, buf, bytes, static_cast<off_t>(offset));
  }
  int Ftruncate(int fd, uint64_t bytes) override { return ::ftruncate(fd, static_cast<off_t>(bytes)); }
  int Fdatasync(int fd) override { return ::fdatasync(fd); }
  int Fsync(int fd) override { return ::fsync(fd); }
  int Rename(const std::string& from, const std::string& to) override { return ::rename(from.c_str(), to.c_str()); }
};

}  // namespace

IoEnv* IoEnv::Default() {
  static PosixIoEnv env;  // stateless: a shared instance is no mutable global
  return &env;
}

}  // namespace flashckpt
