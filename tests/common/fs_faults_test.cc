// The durable writes under injected faults (tests/support/fault_injecting_io.h): a write that fails with
// ENOSPC or EIO on any one of its calls, writes that come back short or make no progress, and a
// failing fdatasync, rename or directory fsync. What a caller relies on: the error's code tells a
// full disk from a failing one and its message names the call, the file and the errno text; no
// temporary is left behind; nothing is under its final name unless the caller is told (`renamed`);
// a file that was there before is untouched; short writes still give byte-exact files.
//
// Each test runs on /dev/shm (tmpfs: buffered writes) and /var/tmp (a disk: O_DIRECT where allowed).
#include <stdlib.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/base/thread_pool.h"
#include "support/fault_injecting_io.h"
#include "common/io/fs.h"
#include "testing.h"

namespace flashckpt {
namespace {

using Op = FaultInjectingIo::Op;

// Page-aligned anonymous memory filled with a pattern that differs per byte offset.
class Pages {
 public:
  explicit Pages(uint64_t bytes, int seed) : bytes_((bytes + 4095) / 4096 * 4096) {
    void* mem = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = mem == MAP_FAILED ? nullptr : static_cast<char*>(mem);
    for (uint64_t i = 0; data_ != nullptr && i < bytes_; ++i) data_[i] = static_cast<char>((i * 131 + seed) >> 3);
  }
  ~Pages() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  Pages(const Pages&) = delete;
  Pages& operator=(const Pages&) = delete;
  char* data() const { return data_; }
  uint64_t padded() const { return bytes_; }

 private:
  uint64_t bytes_;
  char* data_;
};

class FsFaultsTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::string tmpl = std::string(GetParam()) + "/flashckpt-fs-faults-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << GetParam() << ": " << std::strerror(errno);
    dir_ = tmpl;
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // The names in the directory, sorted.
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }
  bool FileEquals(const std::string& name, const char* data, uint64_t bytes) const {
    auto back = ReadSmallFile(dir_ + "/" + name, 1ull << 30);
    return back.ok() && back->size() == bytes && std::memcmp(back->data(), data, bytes) == 0;
  }

  // Two images as the writer lays them out (a 4 KiB head written last, regions cut at unaligned
  // offsets, 1 MiB pieces): 2 + 4 piece writes and 1 + 1 head writes when nothing is short.
  std::vector<ImageWrite> TwoImages(const Pages& a, const Pages& b) const {
    std::vector<ImageWrite> images(2);
    images[0] = ImageWrite{"image0", a.data(), (3u << 20) + 1234, 4096, {4096, 5000, (2u << 20) + 7}, 1u << 20};
    images[1] = ImageWrite{"image1", b.data(), 5 * 4096 + 11, 4096, {4096}, 1u << 20};
    return images;
  }

  // The message of a write error: the call, a temporary of `name` in this directory, the errno text.
  void ExpectNamesCallFileAndErrno(const Status& s, const std::string& call, const std::string& name, int err) const {
    const std::string& m = s.message();
    EXPECT_NE(m.find(call + " " + dir_ + "/" + name), std::string::npos) << m;
    EXPECT_NE(m.find(std::strerror(err)), std::string::npos) << m;
    EXPECT_NE(m.find("(errno " + std::to_string(err) + ")"), std::string::npos) << m;
  }

  std::string dir_;
};

// Every write of WriteImagesDurably, with three threads writing at once, failing in turn: the
// write's errno decides the code, and nothing is left in the directory.
TEST_P(FsFaultsTest, AnyFailingWriteOfImagesLeavesNothingAndSaysWhy) {
  Pages a(4u << 20, 1), b(8 * 4096, 2);
  const std::vector<ImageWrite> images = TwoImages(a, b);
  ParallelLoop loop(2);
  FaultInjectingIo io;
  std::vector<std::string> renamed;
  ASSERT_OK(WriteImagesDurably(dir_, images, &loop, ImageWriteHooks{}, &renamed, &io));  // counts the writes
  const uint64_t writes = io.calls(Op::kWrite);
  ASSERT_GE(writes, 6u);
  std::filesystem::remove_all(dir_);
  std::filesystem::create_directory(dir_);

  uint64_t failed = 0;
  for (int err : {ENOSPC, EIO}) {
    for (uint64_t n = 1; n <= writes; ++n) {
      SCOPED_TRACE("errno " + std::to_string(err) + ", write " + std::to_string(n) + " of " + std::to_string(writes));
      io.FailNth(Op::kWrite, n, err);
      renamed.clear();
      Status s = WriteImagesDurably(dir_, images, &loop, ImageWriteHooks{}, &renamed, &io);
      ASSERT_FALSE(s.ok());
      ++failed;
      EXPECT_EQ(s.code(), err == ENOSPC ? StatusCode::kResourceExhausted : StatusCode::kIOError) << s.ToString();
      ExpectNamesCallFileAndErrno(s, "write", "image", err);
      EXPECT_NE(s.message().find(".tmp."), std::string::npos) << s.message();
      EXPECT_TRUE(renamed.empty());
      EXPECT_TRUE(Entries().empty()) << ::testing::PrintToString(Entries());
    }
  }
  EXPECT_EQ(io.failures_injected(), failed);
  std::printf("[ faults   ] %s: %llu write faults injected over %llu writes per save\n", GetParam(),
              static_cast<unsigned long long>(failed), static_cast<unsigned long long>(writes));
  // Faults off: the same call writes both images whole.
  ASSERT_OK(WriteImagesDurably(dir_, images, &loop, ImageWriteHooks{}, &renamed, &io));
  EXPECT_TRUE(FileEquals("image0", a.data(), images[0].bytes));
  EXPECT_TRUE(FileEquals("image1", b.data(), images[1].bytes));
}

// A failing write of a small file (WriteFileDurably) or of a single image (WriteImageDurably) over
// an existing file: the error names it, the old contents stay, no temporary is left.
TEST_P(FsFaultsTest, FailingWriteKeepsThePreviousFileAndLeavesNoTemporary) {
  ASSERT_OK(WriteFileDurably(dir_, "LATEST", "7\n"));
  Pages image((1u << 20) + 4096, 3);
  ASSERT_OK(WriteImageDurably(dir_, "image", image.data(), 1u << 20, image.padded()));
  FaultInjectingIo io;
  for (int err : {ENOSPC, EIO}) {
    const StatusCode want = err == ENOSPC ? StatusCode::kResourceExhausted : StatusCode::kIOError;
    io.FailNth(Op::kWrite, 1, err);
    bool renamed = true;
    Status s = WriteFileDurably(dir_, "LATEST", "8\n", &renamed, &io);
    EXPECT_EQ(s.code(), want) << s.ToString();
    ExpectNamesCallFileAndErrno(s, "write", "LATEST.tmp.", err);
    EXPECT_FALSE(renamed);

    io.FailNth(Op::kWrite, 1, err);
    Pages other((1u << 20) + 4096, 4);
    s = WriteImageDurably(dir_, "image", other.data(), 1u << 20, other.padded(), &renamed, &io);
    EXPECT_EQ(s.code(), want) << s.ToString();
    ExpectNamesCallFileAndErrno(s, "write", "image.tmp.", err);
    EXPECT_FALSE(renamed);

    EXPECT_EQ(Entries(), (std::vector<std::string>{"LATEST", "image"}));
    EXPECT_EQ(ReadSmallFile(dir_ + "/LATEST", 100).value(), "7\n");
    EXPECT_TRUE(FileEquals("image", image.data(), 1u << 20));
  }
  EXPECT_EQ(io.failures_injected(), 4u);
}

// Writes that come back short (as pwrite may, and a direct write does in whole pages) are continued
// where they stopped: the files are byte-exact.
TEST_P(FsFaultsTest, ShortWritesStillGiveByteExactFiles) {
  Pages a(4u << 20, 5), b(8 * 4096, 6);
  const std::vector<ImageWrite> images = TwoImages(a, b);
  ParallelLoop loop(2);
  FaultInjectingIo io;
  io.ShortWrites(3 * 4096 + 1000);  // buffered: 13288 bytes a call; O_DIRECT: 3 pages
  std::vector<std::string> renamed;
  ASSERT_OK(WriteImagesDurably(dir_, images, &loop, ImageWriteHooks{}, &renamed, &io));
  EXPECT_TRUE(FileEquals("image0", a.data(), images[0].bytes));
  EXPECT_TRUE(FileEquals("image1", b.data(), images[1].bytes));

  Pages c((2u << 20) + 4096, 7);
  ASSERT_OK(WriteImageDurably(dir_, "single", c.data(), (2u << 20) + 77, c.padded(), nullptr, &io));
  EXPECT_TRUE(FileEquals("single", c.data(), (2u << 20) + 77));

  io.ShortWrites(1);  // one byte a call
  const std::string text(10000, 'x');
  ASSERT_OK(WriteFileDurably(dir_, "text", text + "end", nullptr, &io));
  EXPECT_EQ(ReadSmallFile(dir_ + "/text", 1 << 20).value(), text + "end");

  EXPECT_GT(io.short_writes(), 100u);
  EXPECT_EQ(Entries(), (std::vector<std::string>{"image0", "image1", "single", "text"}));
}

// A write that returns 0 without an error makes no progress: a clean IO_ERROR naming the file, not
// a loop forever.
TEST_P(FsFaultsTest, AWriteThatMakesNoProgressIsAnErrorNotAHang) {
  Pages a(4u << 20, 8), b(8 * 4096, 9);
  ParallelLoop loop(2);
  FaultInjectingIo io;
  io.ShortWrites(0);
  Status s = WriteImagesDurably(dir_, TwoImages(a, b), &loop, ImageWriteHooks{}, nullptr, &io);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("write " + dir_ + "/image"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("wrote 0 of"), std::string::npos) << s.message();
  s = WriteFileDurably(dir_, "small", "contents", nullptr, &io);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_TRUE(Entries().empty()) << ::testing::PrintToString(Entries());
}

// fdatasync failing (ENOSPC is what a thin-provisioned or NFS disk reports there) and ftruncate of
// the padded tail failing: nothing is renamed, nothing is left.
TEST_P(FsFaultsTest, FailingSyncOrTruncateRenamesNothing) {
  Pages a(4u << 20, 10), b(8 * 4096, 11);
  ParallelLoop loop(2);
  FaultInjectingIo io;
  struct Case {
    Op op;
    int err;
    const char* call;
    StatusCode code;
  };
  for (const Case& c : {Case{Op::kDataSync, ENOSPC, "fdatasync", StatusCode::kResourceExhausted},
                        Case{Op::kDataSync, EIO, "fdatasync", StatusCode::kIOError},
                        Case{Op::kTruncate, EIO, "ftruncate", StatusCode::kIOError}}) {
    SCOPED_TRACE(c.call);
    io.Clear();
    io.FailEvery(c.op, c.err);
    std::vector<std::string> renamed;
    Status s = WriteImagesDurably(dir_, TwoImages(a, b), &loop, ImageWriteHooks{}, &renamed, &io);
    EXPECT_EQ(s.code(), c.code) << s.ToString();
    ExpectNamesCallFileAndErrno(s, c.call, "image", c.err);
    EXPECT_TRUE(renamed.empty());
    if (c.op == Op::kDataSync) {
      bool moved = true;
      s = WriteFileDurably(dir_, "small", "contents", &moved, &io);
      EXPECT_EQ(s.code(), c.code) << s.ToString();
      ExpectNamesCallFileAndErrno(s, c.call, "small.tmp.", c.err);
      EXPECT_FALSE(moved);
    }
    EXPECT_TRUE(Entries().empty()) << ::testing::PrintToString(Entries());
  }
}

// A failing rename: the images renamed before it are reported in `renamed` (the caller removes
// them: the writer does), the others' temporaries are gone. A failing fsync of the directory after
// the renames: every file is reported renamed, so the caller can undo them too.
TEST_P(FsFaultsTest, RenameAndDirectorySyncFailuresReportWhatIsInPlace) {
  Pages a(4u << 20, 12), b(8 * 4096, 13);
  FaultInjectingIo io;
  io.FailNth(Op::kRename, 2, EIO);
  std::vector<std::string> renamed;
  Status s = WriteImagesDurably(dir_, TwoImages(a, b), nullptr, ImageWriteHooks{}, &renamed, &io);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  ExpectNamesCallFileAndErrno(s, "rename", "image1.tmp.", EIO);
  EXPECT_EQ(renamed, (std::vector<std::string>{"image0"}));
  EXPECT_EQ(Entries(), (std::vector<std::string>{"image0"})) << "only what `renamed` lists";
  std::filesystem::remove(dir_ + "/image0");

  io.FailNth(Op::kRename, 1, ENOSPC);
  bool moved = true;
  s = WriteFileDurably(dir_, "small", "contents", &moved, &io);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  ExpectNamesCallFileAndErrno(s, "rename", "small.tmp.", ENOSPC);
  EXPECT_FALSE(moved);
  EXPECT_TRUE(Entries().empty()) << ::testing::PrintToString(Entries());

  io.FailEvery(Op::kDirSync, EIO);
  renamed.clear();
  s = WriteImagesDurably(dir_, TwoImages(a, b), nullptr, ImageWriteHooks{}, &renamed, &io);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("fsync directory " + dir_), std::string::npos) << s.message();
  EXPECT_EQ(renamed, (std::vector<std::string>{"image0", "image1"}));
  s = WriteFileDurably(dir_, "small", "contents", &moved, &io);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_TRUE(moved);
  EXPECT_EQ(Entries(), (std::vector<std::string>{"image0", "image1", "small"})) << "no temporary left";
  EXPECT_EQ(io.failures_injected(), 4u);
}

INSTANTIATE_TEST_SUITE_P(TmpfsAndDisk, FsFaultsTest, ::testing::Values("/dev/shm", "/var/tmp"),
                         [](const ::testing::TestParamInfo<const char*>& param) {
                           return std::string(param.param) == "/dev/shm" ? "Tmpfs" : "Disk";
                         });

}  // namespace
}  // namespace flashckpt
