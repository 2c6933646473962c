// flashckptd's flags and config file.
#include "daemon/edge/config.h"

#include <grp.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/base/names.h"
#include "daemon/edge/limits.h"
#include "daemon/parity/parity_group.h"
#include "daemon/edge/tcp_listener.h"
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

// A temporary config file with `text`; removed with its directory by the destructor.
class ConfigFile {
 public:
  explicit ConfigFile(const std::string& text) {
    char tmpl[] = "/tmp/flashckpt-config-test-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) dir_ = tmpl;
    std::ofstream(path()) << text;
  }
  ~ConfigFile() { std::filesystem::remove_all(dir_); }
  std::string path() const { return dir_ + "/flashckptd.conf"; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

TEST(DaemonConfig, StopTimeoutAndLogFile) {
  auto d = Parse({"--socket", "s", "--root", "r"});
  ASSERT_OK(d.status());
  EXPECT_EQ(d->stop_timeout_s, 60u);
  EXPECT_EQ(d->log_file, "");
  auto c = Parse({"--socket", "s", "--root", "r", "--stop-timeout", "7", "--log-file", "/tmp/flashckptd-test.log"});
  ASSERT_OK(c.status());
  EXPECT_EQ(c->stop_timeout_s, 7u);
  EXPECT_EQ(c->log_file, "/tmp/flashckptd-test.log");
  EXPECT_EQ(Parse({"--socket", "s", "--root", "r", "--stop-timeout", "0"}).status().code(),
            StatusCode::kInvalidArgument);
  // --persist-on-stop: on unless turned off.
  EXPECT_TRUE(d->persist_on_stop);
  for (const char* off : {"--no-persist-on-stop", "--persist-on-stop=false"}) {
    auto o = Parse({"--socket", "s", "--root", "r", off});
    ASSERT_OK(o.status());
    EXPECT_FALSE(o->persist_on_stop) << off;
  }
  auto on = Parse({"--socket", "s", "--root", "r", "--persist-on-stop"});
  ASSERT_OK(on.status());
  EXPECT_TRUE(on->persist_on_stop);
  auto level = Parse({"--socket", "s", "--root", "r", "--log-level", "chatty"});
  EXPECT_EQ(level.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(level.status().message().find("--log-level"), std::string::npos) << level.status().message();
  auto file = Parse({"--socket", "s", "--root", "r", "--log-file", "/nonexistent-flashckpt-dir/x.log"});
  EXPECT_EQ(file.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(file.status().message().find("--log-file"), std::string::npos) << file.status().message();
}

TEST(DaemonConfig, AnUnknownConfigKeyIsRefusedByName) {
  ConfigFile f("socket = s\nroot = r\nslotz = 3\n");
  auto c = Parse({"--config", f.path()});
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("unknown key 'slotz'"), std::string::npos) << c.status().message();
}

// What `flashckptd --help` says of --config: TOML-style `key = value` lines, # comments, quoted
// values, a list for a repeatable flag, no sections.
TEST(DaemonConfig, TheConfigFileIsTheSyntaxItsHelpDescribes) {
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(Parse({"--help"}).status().code(), StatusCode::kCancelled);
  const std::string help = ::testing::internal::GetCapturedStdout();
  const size_t at = help.find("--config");
  ASSERT_NE(at, std::string::npos) << help;
  const std::string config_help = help.substr(at, help.find("\n  -", at) - at);
  EXPECT_NE(config_help.find("`key = value` lines (TOML style)"), std::string::npos) << config_help;
  EXPECT_EQ(config_help.find("INI"), std::string::npos) << "a [section] of an INI file is refused: " << config_help;

  ConfigFile f(
      "# the daemon of this node\n"
      "socket = \"/run/flash ckpt/flashckptd.sock\"  # quoted: it holds a space\n"
      "root = /var/lib/flashckpt\n"
      "allow-uid = [1000, 1001]\n"
      "listen = 127.0.0.1:7070\n"
      "tcp-allow-writes = true\n");
  auto c = Parse({"--config", f.path()});
  ASSERT_OK(c.status());
  EXPECT_EQ(c->socket_path, "/run/flash ckpt/flashckptd.sock");
  EXPECT_EQ(c->root, "/var/lib/flashckpt");
  EXPECT_EQ(c->allow_uids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_TRUE(c->tcp_allow_writes);

  ConfigFile sections("[flashckptd]\nsocket = s\nroot = r\n");
  EXPECT_EQ(Parse({"--config", sections.path()}).status().code(), StatusCode::kInvalidArgument);
}

TEST(DaemonConfig, TheFormattedSettingsReadBackAsTheSameSettings) {
  ConfigFile f(
      "socket = /run/flashckpt/flashckptd.sock\nroot = /var/lib/flashckpt\nslots = 3\nmax-host-memory = 1536MiB\n"
      "checksum-chunk = 64KiB\nkeep = 4\nstop-timeout = 9\nallow-uid = [1000, 1001]\nallow-gid = 50\n"
      "listen = 127.0.0.1:7070\ntcp-allow-writes = true\nmax-rank-bytes = 3GiB\nlog-level = warn\n");
  auto first = Parse({"--config", f.path()});
  ASSERT_OK(first.status());
  const std::string text = FormatDaemonConfig(*first);
  for (const char* line :
       {"slots = 3\n", "max-host-memory = 1536MiB\n", "checksum-chunk = 64KiB\n", "keep = 4\n", "stop-timeout = 9\n",
        "allow-uid = [1000, 1001]\n", "allow-gid = [50]\n", "listen = 127.0.0.1:7070\n", "tcp-allow-writes = true\n",
        "max-rank-bytes = 3GiB\n", "state-dir = /run/flashckpt/flashckptd.sock.state\n", "# log-file = (not set)\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " not in\n" << text;
  }
  ConfigFile again(text);
  auto second = Parse({"--config", again.path()});
  ASSERT_OK(second.status());
  EXPECT_EQ(FormatDaemonConfig(*second), text);
  EXPECT_EQ(second->allow_uids, first->allow_uids);
  EXPECT_EQ(second->max_host_memory, first->max_host_memory);
}

TEST(DaemonConfig, NodeNameDefaultsToTheHostNameAndIsChecked) {
  auto c = Parse({"--socket", "s", "--root", "r"});
  ASSERT_OK(c.status());
  EXPECT_EQ(c->node_name, DefaultNodeName());
  auto named = Parse({"--socket", "s", "--root", "r", "--node-name", "gpu-07.rack3"});
  ASSERT_OK(named.status());
  EXPECT_EQ(named->node_name, "gpu-07.rack3");
  EXPECT_NE(FormatDaemonConfig(*named).find("node-name = gpu-07.rack3\n"), std::string::npos)
      << FormatDaemonConfig(*named);
  auto bad = Parse({"--socket", "s", "--root", "r", "--node-name", "a/b"});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--node-name"), std::string::npos) << bad.status().ToString();
}

TEST(DaemonConfig, BadValuesAreRefused) {
  EXPECT_EQ(Parse({"--socket", "s", "--root", "r", "--max-host-memory", "lots"}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--socket", "s", "--root", "r", "--slots", "0"}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--root", "r"}).status().code(), StatusCode::kInvalidArgument);  // --socket is required
}

TEST(DaemonConfig, TcpTlsAndLimitFlags) {
  auto defaults = Parse({"--socket", "s", "--root", "r"});
  ASSERT_OK(defaults.status());
  EXPECT_TRUE(defaults->listen.empty()) << "no TCP listener unless asked for";
  EXPECT_FALSE(defaults->tcp_allow_writes);
  EXPECT_EQ(defaults->max_tensors_per_rank, kDefaultMaxTensorsPerRank);
  EXPECT_EQ(defaults->max_rank_bytes, 0u);
  EXPECT_FALSE(defaults->shm_group.has_value());

  auto c = Parse({"--socket", "s", "--root", "r", "--listen", "127.0.0.1:7070", "--tcp-allow-writes", "--tls-cert",
                  "c.pem", "--tls-key", "k.pem", "--max-tensors-per-rank", "100", "--max-rank-bytes", "2GiB"});
  ASSERT_OK(c.status());
  EXPECT_EQ(c->listen, "127.0.0.1:7070");
  EXPECT_TRUE(c->tcp_allow_writes);
  EXPECT_EQ(c->tls_cert, "c.pem");
  EXPECT_EQ(c->tls_key, "k.pem");
  EXPECT_EQ(c->max_tensors_per_rank, 100u);
  EXPECT_EQ(c->max_rank_bytes, 2ull << 30);
}

TEST(DaemonConfig, BadTcpAndLimitFlagsAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--listen", "127.0.0.1:1", "--tls-cert", "c.pem"}, "--tls-key"},
      {{"--listen", "127.0.0.1:1", "--tls-key", "k.pem"}, "--tls-cert"},
      {{"--tls-cert", "c.pem", "--tls-key", "k.pem"}, "--listen"},
      {{"--tcp-allow-writes"}, "--listen"},
      {{"--listen", "::1:7070"}, "brackets"},
      {{"--listen", "[::1]7070"}, "--listen"},
      {{"--listen", "1.2.3.4:99999"}, "port"},
      {{"--listen", "1.2.3.4:"}, "port"},
      {{"--listen", "1.2.3.4:-1"}, "port"},
      {{"--listen", "host_name:80"}, "--listen"},
      {{"--max-tensors-per-rank", "0"}, "--max-tensors-per-rank"},
      {{"--max-tensors-per-rank", "1048577"}, "--max-tensors-per-rank"},
      {{"--max-rank-bytes", "lots"}, "--max-rank-bytes"},
      {{"--shm-group", "no-such-group-flashckpt"}, "no such group"},
  };
  for (const auto& [flags, needle] : cases) {
    std::vector<std::string> args = {"--socket", "s", "--root", "r"};
    args.insert(args.end(), flags.begin(), flags.end());
    auto c = Parse(args);
    std::string shown = flags[0] + (flags.size() > 1 ? " " + flags[1] : "");
    ASSERT_FALSE(c.ok()) << shown << " was accepted";
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << shown;
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << shown << ": " << c.status().message();
  }
}

TEST(DaemonConfig, ShmGroupByNameOrGid) {
  // A group the test's user may hand segments to: any as root, else its own.
  const gid_t gid = ::geteuid() == 0 ? 100 : ::getegid();
  const group* entry = ::getgrgid(gid);
  if (entry != nullptr) {
    auto by_name = Parse({"--socket", "s", "--root", "r", "--shm-group", entry->gr_name});
    ASSERT_OK(by_name.status());
    EXPECT_EQ(by_name->shm_group, std::optional<uint32_t>(gid));
  }
  auto by_gid = Parse({"--socket", "s", "--root", "r", "--shm-group", std::to_string(gid)});
  ASSERT_OK(by_gid.status());
  EXPECT_EQ(by_gid->shm_group, std::optional<uint32_t>(gid));
  if (::geteuid() != 0 && ::getegid() != 0) {  // not root, not in group 0: it cannot give segments to it
    auto foreign = Parse({"--socket", "s", "--root", "r", "--shm-group", "0"});
    EXPECT_EQ(foreign.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(ListenAddress, LoopbackUnlessAHostIsGiven) {
  struct Case {
    const char* text;
    const char* target;
    bool loopback;
  };
  for (const Case& c :
       {Case{"7070", "127.0.0.1:7070", true}, Case{":0", "127.0.0.1:0", true}, Case{"127.3.2.1:1", "127.3.2.1:1", true},
        Case{"0.0.0.0:7070", "0.0.0.0:7070", false}, Case{"10.1.2.3:7070", "10.1.2.3:7070", false},
        Case{"[::1]:7070", "[::1]:7070", true}, Case{"[::]:7070", "[::]:7070", false},
        Case{"[::ffff:127.0.0.1]:1", "[::ffff:127.0.0.1]:1", true}, Case{"localhost:7070", "localhost:7070", true},
        Case{"node-7.example:7070", "node-7.example:7070", false},
        // One spelling per address, so that two spellings of one member compare equal.
        Case{"[0:0:0:0:0:0:0:1]:7070", "[::1]:7070", true}, Case{"[::FFFF:127.0.0.1]:1", "[::ffff:127.0.0.1]:1", true},
        Case{"[fe80:0::0:1]:2", "[fe80::1]:2", false}, Case{"Node-7.Example:7070", "node-7.example:7070", false}}) {
    auto a = ParseListenAddress(c.text);
    ASSERT_OK(a.status());
    EXPECT_EQ(a->Target(), c.target) << c.text;
    EXPECT_EQ(a->loopback, c.loopback) << c.text;
  }
  for (const char* bad : {"", ":", "[::1]", "[::1]:", "[nope]:1", "1.2.3.4:65536", "1.2.3.4:12345678", "a b:1", "1:2:3",
                          "1.2.3.4:0x10"}) {
    EXPECT_EQ(ParseListenAddress(bad).status().code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
}

// --ec-group and --ec-parity: the list names this daemon's own --replica-listen once, every member
// once, and a parity the group can code; each wrong list is refused saying what to change.
TEST(DaemonConfig, AParityGroupListsThisDaemonOnceAndCodesWhatItCan) {
  const std::vector<std::string> base = {"--socket", "s", "--root", "r", "--replica-listen", "127.0.0.1:7002"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return Parse(args);
  };
  auto ok = with({"--ec-group", "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004", "--ec-parity", "1"});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->ec_group.size(), 4u);
  auto group = ParseParityGroup(ok->ec_group, 1, ok->replica_listen, false);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EXPECT_EQ(group->self, 1u);
  EXPECT_EQ(group->others.size(), 3u);

  auto refused = [&](std::vector<std::string> more, const std::string& says) {
    auto c = with(std::move(more));
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << says;
    EXPECT_NE(c.status().message().find(says), std::string::npos) << c.status().ToString();
  };
  refused({"--ec-group", "127.0.0.1:7001,127.0.0.1:7003"}, "does not list this daemon's --replica-listen");
  refused({"--ec-group", "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7001"}, "twice");
  // Addresses compare as addresses, not as text: another spelling of a member is that member.
  auto v6 = Parse({"--socket", "s", "--root", "r", "--replica-listen", "[::1]:7002", "--ec-group",
                   "[0::1]:7001,[0:0:0:0:0:0:0:1]:7002,[::1]:7003", "--ec-parity", "1"});
  ASSERT_TRUE(v6.ok()) << v6.status().ToString();
  auto v6_group = ParseParityGroup(v6->ec_group, 1, v6->replica_listen, false);
  ASSERT_TRUE(v6_group.ok()) << v6_group.status().ToString();
  EXPECT_EQ(v6_group->self, 1u);
  auto twice = ParseParityGroup({"[::1]:7001", "[0:0::1]:7001", "[::1]:7002"}, 1, "[::1]:7002", false);
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("twice"), std::string::npos) << twice.status().ToString();
  refused({"--ec-group", "127.0.0.1:7001,127.0.0.1:7002", "--ec-parity", "2"}, "--ec-parity");
  refused({"--ec-parity", "1"}, "--ec-parity needs --ec-group");
  refused({"--ec-group", "10.1.2.3:7001,127.0.0.1:7002"}, "mutual TLS");
  refused({"--ec-group", "127.0.0.1:7001,not an address"}, "--ec-group");
  auto no_listener = Parse({"--socket", "s", "--root", "r", "--ec-group", "127.0.0.1:7001,127.0.0.1:7002"});
  EXPECT_EQ(no_listener.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_listener.status().message().find("--replica-listen"), std::string::npos);
}

}  // namespace
}  // namespace flashckpt
