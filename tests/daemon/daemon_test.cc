// The daemon behind its real gRPC service on a temporary UNIX socket, driven by the real client
// library and, for requests the library never sends, by a raw stub.
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "common/base/log.h"
#include "common/format/metadata.h"
#include "common/format/safetensors.h"
#include "common/io/fs.h"
#include "common/read/verify.h"
#include "daemon/edge/server.h"
#include "flashckpt.grpc.pb.h"
#include "flashckpt/client.h"
#include "flashckpt/offline.h"
#include "in_process_daemon.h"
#include "raw_rpc.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon(64ull << 20); }

  void StartDaemon(uint64_t budget, std::vector<uint32_t> allow_uids = {}) {
    ASSERT_OK(d_.Start([&](DaemonConfig& c) {
      c.max_host_memory = budget;
      c.allow_uids = allow_uids;
    }));
  }
  void StopDaemon() { d_.Stop(); }

  std::string socket() const { return d_.socket(); }
  std::string root() const { return d_.root(); }
  std::unique_ptr<Client> Connect(const std::string& job, uint32_t rank) { return d_.Connect(job, rank); }
  // Two tp ranks of `job`, each holding half of "w" ([2n], rank r at offset r * n) filled with
  // r + 1, registered; both save `step` and wait until it is durable. Fewer ranks on a failure.
  struct TwoHalves {
    std::vector<std::unique_ptr<Client>> ranks;
    std::vector<std::vector<float>> halves;
  };
  TwoHalves SaveTwoHalves(const std::string& job, uint64_t n, int64_t step) {
    TwoHalves two;
    for (uint32_t r = 0; r < 2; ++r) {
      auto client = Connect(job, r);
      if (!client) return {};
      TensorSpec w;
      w.name = "w";
      w.shape = {n};
      w.global_shape = {2 * n};
      w.box_offset = {r * n};
      w.box_shape = {n};
      Topology t;
      t.world_size = 2;
      t.tp_degree = 2;
      t.tp_rank = r;
      Status registered = client->Register(t, {w});
      EXPECT_OK(registered);
      if (!registered.ok()) return {};
      two.ranks.push_back(std::move(client));
      two.halves.emplace_back(n, static_cast<float>(r + 1));
    }
    for (uint32_t r = 0; r < 2; ++r) {
      Status saved = two.ranks[r]->Snapshot(step, {{"w", two.halves[r].data(), n * 4}}, {}).status();
      EXPECT_OK(saved);
      if (!saved.ok()) return {};
    }
    for (uint32_t r = 0; r < 2; ++r) {
      Status waited = two.ranks[r]->WaitPersisted(step, 10s);
      EXPECT_OK(waited);
      if (!waited.ok()) return {};
    }
    return two;
  }

  std::unique_ptr<v1::Checkpoint::Stub> Stub() {
    return v1::Checkpoint::NewStub(grpc::CreateChannel("unix:" + socket(), grpc::InsecureChannelCredentials()));
  }

  static std::vector<TensorSpec> Specs(uint64_t n) { return ModelAndMomentSpecs(n); }

  InProcessDaemon d_{"flashckpt-daemon-test"};
};

TEST_F(DaemonTest, SaveWaitAndRestoreRoundTrip) {
  auto c = Connect("job1", 0);
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, Specs(1000)));
  std::vector<float> w(1000), m(1000);
  for (int i = 0; i < 1000; ++i) w[i] = static_cast<float>(i), m[i] = static_cast<float>(-i);
  std::vector<TensorBuffer> bufs = {{"w", w.data(), 4000}, {"w.exp_avg", m.data(), 4000}};
  SnapshotOptions so;
  so.extra = "{\"data_pos\":42}";
  auto snap = c->Snapshot(7, bufs, so);
  ASSERT_OK(snap.status());
  ASSERT_OK(snap->WaitCopied());
  ASSERT_OK(c->WaitPersisted(7, 10s));
  EXPECT_TRUE(PathExists(root() + "/job1/checkpoint-7/metadata.json"));
  auto latest = ReadSmallFile(root() + "/job1/LATEST", 100);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "7\n");

  std::fill(w.begin(), w.end(), 0.f);
  std::fill(m.begin(), m.end(), 0.f);
  auto r = c->Restore(std::nullopt, bufs, 10s);
  ASSERT_OK(r.status());
  ASSERT_TRUE(r->found);
  EXPECT_EQ(r->step, 7);
  EXPECT_EQ(r->extra, "{\"data_pos\":42}");
  for (int i = 0; i < 1000; ++i) {
    ASSERT_EQ(w[i], static_cast<float>(i));
    ASSERT_EQ(m[i], static_cast<float>(-i));
  }
}

// An empty tensor (a dimension of 0) is a tensor like any other: its rank saves, persists and
// restores, the files are valid safetensors (a 0-byte tensor sits at the offset of the next one), and
// export and import carry it.
TEST_F(DaemonTest, EmptyTensorsSaveRestoreExportAndImport) {
  auto c = Connect("empty1", 0);
  ASSERT_TRUE(c);
  TensorSpec a;
  a.name = "a";
  a.dtype = DType::kU8;
  a.shape = {3};
  TensorSpec b;
  b.name = "b";
  b.dtype = DType::kF32;
  b.shape = {0};
  TensorSpec e;
  e.name = "e";
  e.dtype = DType::kF32;
  e.shape = {4, 0};
  ASSERT_OK(c->Register(Topology{}, {a, b, e}));
  uint8_t bytes[3] = {7, 8, 9};
  float none = 0;
  std::vector<TensorBuffer> bufs = {{"a", bytes, 3}, {"b", &none, 0}, {"e", &none, 0}};
  for (int64_t step : {1, 2}) {
    auto snap = c->Snapshot(step, bufs, SnapshotOptions{});
    ASSERT_OK(snap.status());
    ASSERT_OK(snap->WaitCopied());
    ASSERT_OK(c->WaitPersisted(step, 10s));
  }
  const std::string ckpt = root() + "/empty1/checkpoint-2";
  ASSERT_TRUE(PathExists(ckpt + "/metadata.json"));
  VerifyReport verified;
  ASSERT_OK(VerifyCheckpointDir(ckpt, &verified));
  std::fill(std::begin(bytes), std::end(bytes), 0);
  auto r = c->Restore(std::nullopt, bufs, 10s);
  ASSERT_OK(r.status());
  ASSERT_TRUE(r->found);
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(bytes[0], 7);
  EXPECT_EQ(bytes[2], 9);

  const std::string hf = d_.dir() + "/hf-empty";
  ASSERT_OK(ExportCheckpoint(ckpt, hf, ExportOptions{}, nullptr));
  auto header = ReadSafetensorsHeader(hf + "/model.safetensors");
  ASSERT_OK(header.status());
  EXPECT_EQ(header->entries.size(), 3u);
  ImportOptions io;
  io.root = root();
  io.job = "empty1-imported";
  ASSERT_OK(ImportCheckpoint(hf, io, nullptr));
  ASSERT_OK(VerifyCheckpointDir(root() + "/empty1-imported/checkpoint-0", &verified));
}

TEST_F(DaemonTest, LargeTensorsAreCopiedInChunksOnSeveralThreadsBitExact) {
  StopDaemon();
  StartDaemon(512ull << 20);
  ClientOptions o;
  o.socket_path = socket();
  o.job = "large";
  o.copy_threads = 3;
  auto client = Client::Connect(o);
  ASSERT_OK(client.status());
  auto& c = **client;
  const uint64_t n = (40ull << 20) / 4 + 7;  // 40 MiB and a ragged tail: several 16 MiB chunks
  ASSERT_OK(c.Register(Topology{}, Specs(n)));
  std::vector<float> w(n), m(n);
  for (uint64_t i = 0; i < n; ++i) w[i] = static_cast<float>(i), m[i] = static_cast<float>(n - i);
  std::vector<TensorBuffer> bufs = {{"w", w.data(), n * 4}, {"w.exp_avg", m.data(), n * 4}};
  ASSERT_OK(c.Snapshot(1, bufs, {}).status());
  ASSERT_OK(c.WaitPersisted(1, 30s));
  std::vector<float> w2(n), m2(n);
  std::vector<TensorBuffer> out = {{"w", w2.data(), n * 4}, {"w.exp_avg", m2.data(), n * 4}};
  auto r = c.Restore(std::nullopt, out, 30s);
  ASSERT_OK(r.status());
  EXPECT_EQ(std::memcmp(w.data(), w2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(m.data(), m2.data(), n * 4), 0);
}

// The most bytes that one of this process's mappings of a file in /dev/shm whose name starts with
// `prefix` has in its page tables (smaps' Rss), and that file's size. (The daemon in this process
// maps the same segment, lazily too.)
struct ShmResidency {
  uint64_t resident = 0, file_bytes = 0;
};
ShmResidency MostResidentShm(const std::string& prefix) {
  ShmResidency most;
  std::ifstream smaps("/proc/self/smaps");
  std::optional<ShmResidency> mapping;  // of the current mapping, when it is one of those files
  for (std::string line; std::getline(smaps, line);) {
    const bool first_line = std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < line.find(' ');
    if (first_line) {  // range, perms, offset, dev, inode, path
      const size_t path = line.find(" /dev/shm/" + prefix);
      mapping.reset();
      std::error_code gone;  // a name unlinked since ("... (deleted)") has no size to read
      const uint64_t size = path == std::string::npos ? 0 : std::filesystem::file_size(line.substr(path + 1), gone);
      if (path != std::string::npos && !gone) mapping = ShmResidency{0, size};
    } else if (mapping && line.rfind("Rss:", 0) == 0) {
      mapping->resident = std::stoull(line.substr(4)) * 1024;  // "Rss:    1234 kB"
      if (mapping->resident >= most.resident) most = *mapping;
    }
  }
  return most;
}

// Populate() maps every slot's pages on a client thread, so a first snapshot some steps after the
// registration finds its slot faulted in. Registration alone maps lazily (the header page or so).
TEST_F(DaemonTest, PopulateMapsTheSlotsPagesInTheBackgroundAfterALazyRegistration) {
  auto c = Connect("populate", 0);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->Populate().code(), StatusCode::kFailedPrecondition);  // no slots before Register()
  const uint64_t n = (4ull << 20) / 4;                                // two 4 MiB tensors a slot
  ASSERT_OK(c->Register(Topology{}, Specs(n)));
  const ShmResidency lazy = MostResidentShm("flashckpt.populate.0.");
  ASSERT_GE(lazy.file_bytes, 2 * 2 * n * 4) << "two slots of two tensors expected";
  EXPECT_LT(lazy.resident, lazy.file_bytes / 8) << "the registration mapped the segment's pages";
  ASSERT_OK(c->Populate());
  ShmResidency now = lazy;
  for (auto until = std::chrono::steady_clock::now() + 20s;
       now.resident < now.file_bytes * 9 / 10 && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
    now = MostResidentShm("flashckpt.populate.0.");
  }
  EXPECT_GE(now.resident, now.file_bytes * 9 / 10) << "of " << now.file_bytes << " bytes";
  ASSERT_OK(c->Populate());  // again: it has run for this mapping
  // The populated slots take a snapshot as fresh ones do.
  std::vector<float> w(n, 1.f), m(n, -1.f);
  ASSERT_OK(c->Snapshot(3, {{"w", w.data(), n * 4}, {"w.exp_avg", m.data(), n * 4}}, {}).status());
  ASSERT_OK(c->WaitPersisted(3, 10s));
}

TEST_F(DaemonTest, RegistrationOverBudgetIsRefusedWithSizes) {
  auto c = Connect("big", 0);
  ASSERT_TRUE(c);
  Status s = c->Register(Topology{}, Specs(16ull << 20));  // 2 x 64 MiB per slot, budget 64 MiB
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("--max-host-memory"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("budget is 64.0 MiB"), std::string::npos) << s.message();
  // The daemon keeps serving: a small registration on the same session works.
  ASSERT_OK(c->Register(Topology{}, Specs(1000)));
}

TEST_F(DaemonTest, UnknownJobOnRestore) {
  auto c = Connect("never-saved", 0);
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, Specs(10)));
  std::vector<float> w(10), m(10);
  std::vector<TensorBuffer> bufs = {{"w", w.data(), 40}, {"w.exp_avg", m.data(), 40}};
  auto latest = c->Restore(std::nullopt, bufs, 5s);
  ASSERT_OK(latest.status());
  EXPECT_FALSE(latest->found);
  auto named = c->Restore(100, bufs, 5s);
  EXPECT_EQ(named.status().code(), StatusCode::kNotFound) << named.status().ToString();
  EXPECT_NE(named.status().message().find("never-saved"), std::string::npos);
}

TEST_F(DaemonTest, BadJobNamesAreRefusedAndTheDaemonKeepsServing) {
  for (const std::string& bad : std::vector<std::string>{"a/b", "..", "../etc", "", std::string(200, 'x')}) {
    ClientOptions o;
    o.socket_path = socket();
    o.job = bad;
    o.rpc_timeout = 5s;
    auto c = Client::Connect(o);
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << "job '" << bad << "': " << c.status().ToString();
  }
  EXPECT_FALSE(PathExists(d_.dir() + "/etc"));
  auto ok = Connect("good", 0);
  ASSERT_TRUE(ok);
  ASSERT_OK(ok->Register(Topology{}, Specs(10)));
}

TEST_F(DaemonTest, CommitOfASlotNotHandedOutAndDoubleCommitAreRefused) {
  auto stub = Stub();
  RawSession session(stub.get(), "raw", 0);
  ASSERT_FALSE(session.id().empty());
  {
    grpc::ClientContext ctx;
    v1::RegisterResponse resp;
    ASSERT_TRUE(stub->Register(&ctx, SmallRegistration(session.id()), &resp).ok());
  }
  auto commit = [&](uint32_t slot, uint64_t gen, int64_t step) {
    v1::CommitRequest req;
    req.set_session_id(session.id());
    req.set_slot(slot);
    req.set_generation(gen);
    req.set_step(step);
    req.set_persist(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::CommitResponse resp;
    return stub->Commit(&ctx, req, &resp);
  };
  grpc::Status never = commit(1, 1, 5);
  EXPECT_EQ(never.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << never.error_message();
  EXPECT_NE(never.error_message().find("not handed out"), std::string::npos) << never.error_message();
  EXPECT_EQ(commit(9, 1, 5).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::BeginSnapshotRequest begin;
  begin.set_session_id(session.id());
  begin.set_step(5);
  begin.set_timeout_ms(1000);
  v1::BeginSnapshotResponse slot;
  grpc::ClientContext bctx;
  ASSERT_TRUE(stub->BeginSnapshot(&bctx, begin, &slot).ok());
  ASSERT_TRUE(commit(slot.slot(), slot.generation(), 5).ok());
  grpc::Status twice = commit(slot.slot(), slot.generation(), 5);
  EXPECT_EQ(twice.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << twice.error_message();

  // A request naming a session that does not exist: UNAVAILABLE, the code on which a client
  // re-attaches (after a daemon restart every session id is unknown).
  v1::BeginSnapshotRequest forged = begin;
  forged.set_session_id("0123456789abcdef");
  grpc::ClientContext fctx;
  EXPECT_EQ(stub->BeginSnapshot(&fctx, forged, &slot).error_code(), grpc::StatusCode::UNAVAILABLE);

  // The daemon is still serving.
  grpc::ClientContext sctx;
  v1::StatusResponse status;
  ASSERT_TRUE(stub->GetStatus(&sctx, v1::StatusRequest(), &status).ok());
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).job(), "raw");
}

TEST_F(DaemonTest, MalformedTensorSpecsAreRefused) {
  auto stub = Stub();
  RawSession session(stub.get(), "specs", 0);
  auto reg = [&](v1::RegisterRequest req) {
    grpc::ClientContext ctx;
    v1::RegisterResponse resp;
    return stub->Register(&ctx, req, &resp);
  };
  auto unknown_dtype = SmallRegistration(session.id());
  unknown_dtype.mutable_tensors(0)->set_dtype("F8");
  EXPECT_EQ(reg(unknown_dtype).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto no_kind = SmallRegistration(session.id());
  no_kind.mutable_tensors(0)->set_kind(v1::TENSOR_KIND_UNSPECIFIED);
  EXPECT_EQ(reg(no_kind).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto huge = SmallRegistration(session.id());
  huge.mutable_tensors(0)->clear_shape();
  for (int i = 0; i < 4; ++i) huge.mutable_tensors(0)->add_shape(1ull << 20);  // 2^80 elements
  EXPECT_EQ(reg(huge).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto bad_topology = SmallRegistration(session.id());
  bad_topology.mutable_topology()->set_world_size(3);
  EXPECT_EQ(reg(bad_topology).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto bad_name = SmallRegistration(session.id());
  bad_name.mutable_tensors(0)->set_name("x\"y");
  EXPECT_EQ(reg(bad_name).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(reg(SmallRegistration(session.id())).ok());
}

TEST_F(DaemonTest, NoFreeSlotWaitsUntilItsDeadlineThenFails) {
  auto stub = Stub();
  RawSession session(stub.get(), "busy", 0);
  grpc::ClientContext rctx;
  v1::RegisterResponse resp;
  ASSERT_TRUE(stub->Register(&rctx, SmallRegistration(session.id()), &resp).ok());
  auto begin = [&](int64_t step) {
    v1::BeginSnapshotRequest req;
    req.set_session_id(session.id());
    req.set_step(step);
    req.set_timeout_ms(300);
    grpc::ClientContext ctx;
    v1::BeginSnapshotResponse slot;
    return stub->BeginSnapshot(&ctx, req, &slot);
  };
  ASSERT_TRUE(begin(1).ok());
  ASSERT_TRUE(begin(2).ok());
  auto start = std::chrono::steady_clock::now();
  grpc::Status third = begin(3);
  EXPECT_EQ(third.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << third.error_message();
  EXPECT_GE(std::chrono::steady_clock::now() - start, 250ms);
  EXPECT_EQ(begin(2).error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // steps must increase
}

TEST_F(DaemonTest, AClosedSessionGivesItsFillingSlotsBack) {
  auto stub = Stub();
  {
    RawSession session(stub.get(), "gone", 0);
    grpc::ClientContext rctx;
    v1::RegisterResponse resp;
    ASSERT_TRUE(stub->Register(&rctx, SmallRegistration(session.id()), &resp).ok());
    for (int64_t step : {1, 2}) {
      v1::BeginSnapshotRequest req;
      req.set_session_id(session.id());
      req.set_step(step);
      grpc::ClientContext ctx;
      v1::BeginSnapshotResponse slot;
      ASSERT_TRUE(stub->BeginSnapshot(&ctx, req, &slot).ok());
    }
  }  // the stream ends as if the trainer died
  bool freed = false;
  for (int i = 0; i < 100 && !freed; ++i) {
    auto st = d_.daemon()->GetStatus();
    freed = st.jobs.size() == 1 && st.jobs[0].ranks[0].slots.size() == 2 && !st.jobs[0].ranks[0].connected &&
            st.jobs[0].ranks[0].slots[0].state == "free" && st.jobs[0].ranks[0].slots[1].state == "free";
    if (!freed) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(freed);
}

TEST_F(DaemonTest, SegmentIsPrivateToTheDaemonUser) {
  auto c = Connect("perm", 0);
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, Specs(10)));
  int found = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    std::string name = e.path().filename().string();
    if (name.rfind("flashckpt.perm.0.", 0) != 0) continue;
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << name;
    EXPECT_EQ(name.size(), std::string("flashckpt.perm.0.").size() + 16) << "random token expected: " << name;
    ++found;
  }
  EXPECT_EQ(found, 1);
  struct stat sock {};
  ASSERT_EQ(::stat(socket().c_str(), &sock), 0);
  EXPECT_EQ(sock.st_mode & 0777, 0660u);
}

// --shm-group: slot segments 0660 and owned by the group, so trainers of other users in it can
// map them; the EMA segment stays private. Root can give a segment to any group; another user
// only to its own, so the test picks gid 100 (`users`) as root and its own gid otherwise.
TEST_F(DaemonTest, SegmentsGoToTheShmGroupWithMode0660) {
  const uint32_t gid = ::geteuid() == 0 ? 100u : static_cast<uint32_t>(::getegid());
  StopDaemon();
  UnlinkEmaSegments("group");  // a leftover of an earlier run would be adopted as it is
  ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.shm_group = gid; }));
  auto c = Connect("group", 0);
  ASSERT_TRUE(c);
  EmaOptions ema_options;
  ema_options.decay = 0.9;
  ASSERT_OK(c->Register(Topology{}, Specs(10), ema_options));
  int slots = 0, ema = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    std::string name = e.path().filename().string();
    if (name.rfind("flashckpt.group.0.", 0) != 0) continue;
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
    if (name == d_.daemon()->EmaSegmentName("group", 0)) {
      EXPECT_EQ(st.st_mode & 0777, 0600u) << "the EMA segment is the daemon's alone: " << name;
      ++ema;
      continue;
    }
    EXPECT_EQ(st.st_mode & 0777, 0660u) << name;
    EXPECT_EQ(st.st_gid, gid) << name;
    ++slots;
  }
  EXPECT_EQ(slots, 1);
  EXPECT_EQ(ema, 1);
  // The trainer maps it and saves through it as before.
  std::vector<float> w(10, 1.f), m(10, 2.f);
  std::vector<TensorBuffer> bufs = {{"w", w.data(), 40}, {"w.exp_avg", m.data(), 40}};
  ASSERT_OK(c->Snapshot(1, bufs, {}).status());
  ASSERT_OK(c->WaitPersisted(1, 10s));
  c.reset();
  UnlinkEmaSegments("group");  // EMA segments outlive the daemon on purpose
}

TEST_F(DaemonTest, ACompleteCheckpointIsNeverOverwritten) {
  auto c = Connect("once", 0);
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, Specs(10)));
  std::vector<float> w(10, 1.f), m(10, 2.f);
  std::vector<TensorBuffer> bufs = {{"w", w.data(), 40}, {"w.exp_avg", m.data(), 40}};
  ASSERT_OK(c->Snapshot(3, bufs, {}).status());
  ASSERT_OK(c->WaitPersisted(3, 10s));
  c.reset();
  auto again = Connect("once", 0);
  ASSERT_TRUE(again);
  ASSERT_OK(again->Register(Topology{}, Specs(10)));
  ASSERT_OK(again->Restore(std::nullopt, bufs, 10s).status());  // a new process carries on by restoring
  auto s = again->Snapshot(3, bufs, {});
  EXPECT_EQ(s.status().code(), StatusCode::kAlreadyExists) << s.status().ToString();
}

TEST_F(DaemonTest, ARestoreRefusesAMetadataJsonThatMisplacesPieces) {
  // Two tp ranks each hold half of "w" ([2n], rank r at offset r * n) and save it filled with r + 1.
  constexpr uint64_t n = 1000;
  TwoHalves two = SaveTwoHalves("misplaced", n, 5);
  ASSERT_EQ(two.ranks.size(), 2u);
  auto& ranks = two.ranks;
  const std::string dir = root() + "/misplaced/checkpoint-5";
  for (auto deadline = std::chrono::steady_clock::now() + 10s;
       !PathExists(dir + "/metadata.json") && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }

  // metadata.json swaps where the two halves go; their checksums still match the bytes on disk.
  auto meta = ReadMetadataFile(dir);
  ASSERT_OK(meta.status());
  ASSERT_EQ(meta->pieces.size(), 2u);
  std::swap(meta->pieces[0].box_offset, meta->pieces[1].box_offset);
  ASSERT_OK(WriteFileDurably(dir, "metadata.json", MetadataToJson(*meta)));

  std::vector<float> got(n, 0.f);
  auto restored = ranks[0]->Restore(std::nullopt, {{"w", got.data(), n * 4}}, 10s);
  ASSERT_FALSE(restored.ok()) << "restored rank 0 from a misplaced piece: w[0] = " << got[0];
  EXPECT_EQ(restored.status().code(), StatusCode::kCorruption) << restored.status().ToString();
  for (const char* word : {"tensor 'w'", "box offset", "model_state.tp01_pp00_shard00.safetensors"}) {
    EXPECT_NE(restored.status().message().find(word), std::string::npos)
        << "'" << word << "' in " << restored.status().ToString();
  }
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.f; })) << "bytes were handed over";
}

// A job whose layout changes (world size 2, tp 2 -> world size 1) while a checkpoint of the old
// layout is incomplete: a session of the new layout may register, but saves only after it restores
// (resharding the old layout's last complete checkpoint) or once the incomplete step is deleted;
// otherwise its signals would be counted with the old layout's in a checkpoint that never completes.
TEST_F(DaemonTest, ANewLayoutSavesOnlyAfterARestoreWhileTheOldLayoutsCheckpointIsIncomplete) {
  constexpr uint64_t n = 1000;
  {
    TwoHalves two = SaveTwoHalves("relayout", n, 5);
    ASSERT_EQ(two.ranks.size(), 2u);
    auto& ranks = two.ranks;
    auto& halves = two.halves;
    // Step 10: rank 0 saves, rank 1 exits first. checkpoint-10 stays at 1 of 2 signals.
    ASSERT_OK(ranks[0]->Snapshot(10, {{"w", halves[0].data(), n * 4}}, {}).status());
    ASSERT_OK(ranks[0]->WaitPersisted(10, 10s));
  }
  for (auto deadline = std::chrono::steady_clock::now() + 10s;
       !PathExists(root() + "/relayout/checkpoint-5/metadata.json") && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(PathExists(root() + "/relayout/checkpoint-5/metadata.json"));
  ASSERT_FALSE(PathExists(root() + "/relayout/checkpoint-10/metadata.json"));

  TensorSpec whole;
  whole.name = "w";
  whole.shape = {2 * n};
  std::vector<float> w(2 * n, 7.f);
  const std::vector<TensorBuffer> bufs = {{"w", w.data(), 2 * n * 4}};
  {
    auto c = Connect("relayout", 0);
    ASSERT_TRUE(c);
    ASSERT_OK(c->Register(Topology{}, {whole}));
    auto refused = c->Snapshot(20, bufs, {});
    ASSERT_FALSE(refused.ok()) << "a session of the new layout saved beside the old layout's checkpoint-10";
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
    for (const char* word : {"checkpoint-10", "world size 2 (tp 2", "world size 1", "restores", "flashckpt delete"}) {
      EXPECT_TRUE(Contains(refused.status().message(), word)) << "'" << word << "' in " << refused.status().ToString();
    }
    // A restore (the old layout's step 5, resharded) lifts it for this session.
    auto restored = c->Restore(std::nullopt, bufs, 10s);
    ASSERT_OK(restored.status());
    ASSERT_TRUE(restored->found);
    EXPECT_EQ(restored->step, 5);
    EXPECT_EQ(w[0], 1.f);
    EXPECT_EQ(w[2 * n - 1], 2.f);
    ASSERT_OK(c->Snapshot(20, bufs, {}).status());
    ASSERT_OK(c->WaitPersisted(20, 10s));
  }
  // A session that does not restore stays held until checkpoint-10 is gone.
  auto c = Connect("relayout", 0);
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, {whole}));
  auto held = c->Snapshot(30, bufs, {});
  EXPECT_EQ(held.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(held.status().message(), "checkpoint-10")) << held.status().ToString();
  ASSERT_OK(d_.daemon()->DeleteCheckpoints("relayout", 10, 0, /*force=*/true, /*dry_run=*/false).status());
  // The layout no longer holds it; as a new process it still carries on the run only by restoring.
  auto fresh = c->Snapshot(30, bufs, {});
  EXPECT_EQ(fresh.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(Contains(fresh.status().message(), "checkpoint-10")) << fresh.status().ToString();
  EXPECT_TRUE(Contains(fresh.status().message(), "earlier process")) << fresh.status().ToString();
  ASSERT_OK(c->Restore(std::nullopt, bufs, 10s).status());
  ASSERT_OK(c->Snapshot(30, bufs, {}).status());
  ASSERT_OK(c->WaitPersisted(30, 10s));
}

// Every request a handler refuses is in the daemon's log with the RPC, the code, the message and
// the caller's pid and uid (from the socket's SO_PEERCRED), so an operator can tell which process
// asked for what.
TEST_F(DaemonTest, RefusedRequestsAreLoggedWithThePeersPidAndUid) {
  StopDaemon();
  const std::string log = d_.dir() + "/flashckptd.log";
  ASSERT_EQ(SetLogFile(log), "");
  StartDaemon(64ull << 20);
  {
    auto c = Connect("logged", 0);
    ASSERT_TRUE(c);
    ASSERT_OK(c->Register(Topology{}, Specs(10)));
    EXPECT_EQ(c->WaitPersisted(50, 10s).code(), StatusCode::kFailedPrecondition);
    Topology other;
    other.world_size = 2;
    other.tp_degree = 2;
    other.tp_rank = 1;
    // Refused after the daemon's 5 s wait for exiting ranks of the other layout: a longer deadline.
    auto second = d_.Connect("logged", 1, [](ClientOptions& o) { o.rpc_timeout = 20s; });
    ASSERT_TRUE(second);
    EXPECT_EQ(second->Register(other, Specs(10)).code(), StatusCode::kFailedPrecondition);
    // A request whose refusal quotes it cannot write a line of its own into the log.
    grpc::ClientContext ctx;
    v1::DeleteCheckpointsRequest req;
    req.set_job("x\nforged line");
    req.set_step(1);
    v1::DeleteCheckpointsResponse resp;
    EXPECT_EQ(Stub()->DeleteCheckpoints(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  StopDaemon();
  ASSERT_EQ(SetLogFile(""), "");
  auto text = ReadSmallFile(log, 16u << 20);
  ASSERT_OK(text.status());
  const std::string who = "pid=" + std::to_string(::getpid()) + " uid=" + std::to_string(::getuid());
  for (const std::string& line : {"refused rpc=WaitPersisted code=FAILED_PRECONDITION " + who,
                                  "refused rpc=Register code=FAILED_PRECONDITION " + who}) {
    EXPECT_TRUE(Contains(*text, line)) << "'" << line << "' not in the log:\n" << *text;
  }
  EXPECT_TRUE(Contains(*text, "was never committed by this rank")) << *text;
  EXPECT_TRUE(Contains(*text, "is registered with world size 1")) << *text;
  EXPECT_TRUE(Contains(*text, "refused rpc=DeleteCheckpoints code=INVALID_ARGUMENT " + who)) << *text;
  EXPECT_TRUE(Contains(*text, "job name 'x\\x0aforged line'")) << *text;
  EXPECT_FALSE(Contains(*text, "\nforged line")) << *text;
  StartDaemon(64ull << 20);  // for TearDown
}

TEST_F(DaemonTest, WaitPersistedForAStepNeverCommittedFailsFast) {
  auto c = Connect("wait", 0);
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, Specs(10)));
  Status s = c->WaitPersisted(50, 10s);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
}

// Connects to `path` as `uid` in a child process (no gRPC there: only system calls after fork),
// sends the HTTP/2 client preface and an empty SETTINGS frame, and reports what came back:
// 0 the server answered (accepted), 1 the connection was closed (refused), 2 no connection.
int ProbeAs(uid_t uid, const std::string& path) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (uid != 0 && (::setgid(65534) != 0 || ::setuid(uid) != 0)) ::_exit(3);
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ::_exit(2);
    static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
    // The daemon may already have closed a refused connection: a failed send means refused too.
    if (::send(fd, kPreface, sizeof kPreface - 1, MSG_NOSIGNAL) < 0) ::_exit(1);
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) ::_exit(4);
    char buf[64];
    ::_exit(::read(fd, buf, sizeof buf) > 0 ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(DaemonTest, PeersOfOtherUsersAreRefusedUnlessAllowed) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  auto open_up = [&] {  // let uid 65534 reach the socket, so only the credential check stands
    ASSERT_EQ(::chmod(d_.dir().c_str(), 0755), 0);
    ASSERT_EQ(::chmod((d_.dir() + "/run").c_str(), 0755), 0);
    ASSERT_EQ(::chmod(socket().c_str(), 0666), 0);
  };
  open_up();
  EXPECT_EQ(ProbeAs(0, socket()), 0) << "root must be accepted";
  EXPECT_EQ(ProbeAs(65534, socket()), 1) << "uid 65534 must be refused";
  EXPECT_EQ(d_.server()->refused_peers(), 1u);
  // The daemon keeps serving the allowed peers.
  auto c = Connect("after-refusal", 0);
  ASSERT_TRUE(c);

  c.reset();
  StopDaemon();
  StartDaemon(64ull << 20, {65534});
  open_up();
  EXPECT_EQ(ProbeAs(65534, socket()), 0) << "--allow-uid 65534 must be accepted";
  EXPECT_EQ(d_.server()->refused_peers(), 0u);
}

TEST_F(DaemonTest, SocketIsNotReachableByOthersThroughItsMode) {
  struct stat st {};
  ASSERT_EQ(::stat(socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  ASSERT_EQ(::stat((d_.dir() + "/run").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0750u);
}

}  // namespace
}  // namespace flashckpt
