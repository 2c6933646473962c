// The durable image write: O_DIRECT from aligned memory where the file system allows it, buffered
// where it does not (tmpfs), exact size either way.
#include "common/fs.h"

#include <stdlib.h>
#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "testing.h"

namespace flashckpt {
namespace {

void WriteAndReadBack(const std::string& base) {
  char tmpl[256];
  std::snprintf(tmpl, sizeof tmpl, "%s/flashckpt-fs-test-XXXXXX", base.c_str());
  ASSERT_NE(::mkdtemp(tmpl), nullptr) << base;
  const std::string dir = tmpl;
  const uint64_t bytes = (40u << 20) + 1234, padded = (bytes + 4095) / 4096 * 4096;  // 3 chunks, ragged tail
  void* mem = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* data = static_cast<char*>(mem);
  for (uint64_t i = 0; i < padded; ++i) data[i] = static_cast<char>((i * 131) >> 3);
  bool renamed = false;
  ASSERT_OK(WriteImageDurably(dir, "image.safetensors", data, bytes, padded, &renamed));
  EXPECT_TRUE(renamed);
  auto back = ReadSmallFile(dir + "/image.safetensors", 1ull << 30);
  ASSERT_OK(back.status());
  ASSERT_EQ(back->size(), bytes);
  EXPECT_EQ(std::memcmp(back->data(), data, bytes), 0);
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename(), "image.safetensors") << "no temporary left behind";
  }
  EXPECT_EQ(WriteImageDurably(dir, "bad", data + 1, 10, 4096).code(), StatusCode::kInternal);
  ::munmap(mem, padded);
  std::filesystem::remove_all(dir);
}

TEST(WriteImageDurably, DirectIoOnADiskFileSystem) { WriteAndReadBack("/var/tmp"); }

TEST(WriteImageDurably, BufferedFallbackOnTmpfs) { WriteAndReadBack("/dev/shm"); }

}  // namespace
}  // namespace flashckpt
