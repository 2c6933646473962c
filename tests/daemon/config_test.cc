// flashckptd's flags and config file.
#include "daemon/config.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "testing.h"

namespace flashckpt {
namespace {

Result<DaemonConfig> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "flashckptd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseDaemonFlags(static_cast<int>(argv.size()), argv.data());
}

TEST(DaemonConfig, FlagsWithSizeSuffixes) {
  auto c = Parse({"--socket", "/tmp/x.sock", "--root", "/tmp/r", "--slots", "3", "--max-host-memory", "1.5GiB"});
  ASSERT_OK(c.status());
  EXPECT_EQ(c->socket_path, "/tmp/x.sock");
  EXPECT_EQ(c->root, "/tmp/r");
  EXPECT_EQ(c->slots, 3u);
  EXPECT_EQ(c->max_host_memory, 3ull << 29);
  EXPECT_EQ(c->keep, 0u) << "retention is off unless asked for";
}

TEST(DaemonConfig, KeepFlag) {
  auto c = Parse({"--socket", "s", "--root", "r", "--keep", "3"});
  ASSERT_OK(c.status());
  EXPECT_EQ(c->keep, 3u);
  EXPECT_EQ(Parse({"--socket", "s", "--root", "r", "--keep", "-1"}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--socket", "s", "--root", "r", "--keep", "two"}).status().code(), StatusCode::kInvalidArgument);
}

TEST(DaemonConfig, ReadsAConfigFileWithTheFlagNames) {
  char tmpl[] = "/tmp/flashckpt-config-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string path = std::string(tmpl) + "/flashckptd.conf";
  std::ofstream(path) << "socket = /run/flashckpt/flashckptd.sock\nroot = /var/lib/flashckpt\nslots = 4\n"
                         "max-host-memory = 64GiB\nlog-level = debug\n";
  auto c = Parse({"--config", path});
  std::filesystem::remove_all(tmpl);
  ASSERT_OK(c.status());
  EXPECT_EQ(c->socket_path, "/run/flashckpt/flashckptd.sock");
  EXPECT_EQ(c->root, "/var/lib/flashckpt");
  EXPECT_EQ(c->slots, 4u);
  EXPECT_EQ(c->max_host_memory, 64ull << 30);
  EXPECT_EQ(c->log_level, "debug");
}

TEST(DaemonConfig, BadValuesAreRefused) {
  EXPECT_EQ(Parse({"--socket", "s", "--root", "r", "--max-host-memory", "lots"}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--socket", "s", "--root", "r", "--slots", "0"}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--root", "r"}).status().code(), StatusCode::kInvalidArgument);  // --socket is required
}

}  // namespace
}  // namespace flashckpt
