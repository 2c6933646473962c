// The durable image write: O_DIRECT from aligned memory where the file system allows it, buffered
// where it does not (tmpfs), exact size either way.
#include "common/io/fs.h"

#include <stdlib.h>
#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

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

// Two images cut at unaligned offsets, written with 3 threads: every piece of every region is
// prepared exactly once, side tasks run, the head is written after `finish`, and the files equal
// memory.
void WriteImagesAndReadBack(const std::string& base) {
  char tmpl[256];
  std::snprintf(tmpl, sizeof tmpl, "%s/flashckpt-fs-test-XXXXXX", base.c_str());
  ASSERT_NE(::mkdtemp(tmpl), nullptr) << base;
  const std::string dir = tmpl;
  const uint64_t sizes[2] = {(9u << 20) + 4321, 3 * 4096};
  std::vector<char*> mems;
  std::vector<ImageWrite> images(2);
  for (int i = 0; i < 2; ++i) {
    const uint64_t padded = (sizes[i] + 4095) / 4096 * 4096;
    void* mem = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(mem, MAP_FAILED);
    mems.push_back(static_cast<char*>(mem));
    for (uint64_t k = 0; k < padded; ++k) mems[i][k] = static_cast<char>((k * 131 + i) >> 3);
    images[i].name = "image" + std::to_string(i);
    images[i].data = mems[i];
    images[i].bytes = sizes[i];
    images[i].head = 4096;
    images[i].piece = 1u << 20;
  }
  images[0].cuts = {4096, 4096 + 10, 5000, (3u << 20) + 7, (7u << 20) + 1};  // one empty-ish, ragged cuts
  images[1].cuts = {4096};
  std::mutex mu;
  std::map<std::pair<size_t, size_t>, uint64_t> prepared;  // bytes prepared per region
  bool bad_piece = false;
  int finished = 0, sides = 0;
  ImageWriteHooks hooks;
  hooks.prepare = [&](size_t i, size_t r, uint64_t from, uint64_t to) {
    std::lock_guard<std::mutex> lock(mu);
    if (to < from || to - from > images[i].piece || (from - images[i].cuts[r]) % images[i].piece != 0) bad_piece = true;
    prepared[{i, r}] += to - from;
  };
  hooks.side_count = 3;
  hooks.side = [&](size_t) {
    std::lock_guard<std::mutex> lock(mu);
    ++sides;
    return Status::OK();
  };
  hooks.finish = [&](size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    std::memcpy(mems[i], "HEAD", 4);  // must reach the file: the head is written after finish
    ++finished;
  };
  ParallelLoop loop(2);
  std::vector<std::string> renamed;
  ASSERT_OK(WriteImagesDurably(dir, images, &loop, hooks, &renamed));
  EXPECT_FALSE(bad_piece);
  EXPECT_EQ(finished, 2);
  EXPECT_EQ(sides, 3);
  EXPECT_EQ(renamed, (std::vector<std::string>{"image0", "image1"}));
  for (int i = 0; i < 2; ++i) {
    for (size_t r = 0; r < images[i].cuts.size(); ++r) {
      uint64_t end = r + 1 < images[i].cuts.size() ? images[i].cuts[r + 1] : sizes[i];
      EXPECT_EQ(prepared[std::make_pair(size_t(i), r)], end - images[i].cuts[r])
          << "image " << i << " region " << r << " prepared once in full";
    }
    auto back = ReadSmallFile(dir + "/image" + std::to_string(i), 1ull << 30);
    ASSERT_OK(back.status());
    ASSERT_EQ(back->size(), sizes[i]);
    EXPECT_EQ(back->substr(0, 4), "HEAD");
    EXPECT_EQ(std::memcmp(back->data(), mems[i], sizes[i]), 0) << "image " << i;
  }
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) entries += e.is_regular_file();
  EXPECT_EQ(entries, 2u) << "no temporary left behind";
  images[1].cuts = {0};  // a head that is not the first cut: refused before anything is created
  EXPECT_EQ(WriteImagesDurably(dir, images, &loop, hooks, nullptr).code(), StatusCode::kInternal);
  for (int i = 0; i < 2; ++i) ::munmap(mems[i], (sizes[i] + 4095) / 4096 * 4096);
  std::filesystem::remove_all(dir);
}

TEST(WriteImagesDurably, DirectIoOnADiskFileSystem) { WriteImagesAndReadBack("/var/tmp"); }

TEST(WriteImagesDurably, BufferedFallbackOnTmpfs) { WriteImagesAndReadBack("/dev/shm"); }

TEST(WriteImagesDurably, RemovesItsTemporariesOnFailure) {
  char tmpl[] = "/dev/shm/flashckpt-fs-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  void* mem = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  std::vector<ImageWrite> images(2);
  for (int i = 0; i < 2; ++i) {
    images[i].name = "image" + std::to_string(i);
    images[i].data = static_cast<char*>(mem);
    images[i].bytes = 8192;
    images[i].head = 4096;
    images[i].cuts = {4096};
  }
  images[1].name = "missing/image1";  // its directory does not exist: the create fails
  std::vector<std::string> renamed;
  Status s = WriteImagesDurably(dir, images, nullptr, ImageWriteHooks{}, &renamed);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_TRUE(renamed.empty());
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the first image's temporary was removed";
  ::munmap(mem, 8192);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace flashckpt
