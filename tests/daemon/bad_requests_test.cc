// Malformed requests sent straight over gRPC with the generated stub (the client library's own checks
// would hide the daemon's): bad job names, session ids, steps, timeouts, tensor counts and specs,
// shapes whose sizes overflow, unknown dtypes and enum values, duplicate names, stale slot tickets,
// oversized extra state. Each must be refused with the right code and a message naming the field
// (and the flag where one sets the limit), and the daemon must keep serving: a valid save works
// afterwards. The test prints how many malformed requests it sent and the codes they got.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <thread>
#include <vector>

#include "common/io/fs.h"
#include "daemon/edge/wire.h"
#include "in_process_daemon.h"
#include "raw_rpc.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;
using Code = grpc::StatusCode;

constexpr uint32_t kTensorLimit = 64;          // --max-tensors-per-rank of the test daemon
constexpr uint64_t kRankBytesLimit = 1 << 20;  // --max-rank-bytes of the test daemon

const char* CodeName(Code c) {
  switch (c) {
    case Code::OK: return "OK";
    case Code::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case Code::NOT_FOUND: return "NOT_FOUND";
    case Code::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case Code::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case Code::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case Code::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case Code::UNAVAILABLE: return "UNAVAILABLE";
    case Code::UNKNOWN: return "UNKNOWN";
    default: return "OTHER";
  }
}

v1::TensorSpec F32(const std::string& name, std::vector<uint64_t> shape) {
  v1::TensorSpec t;
  t.set_name(name);
  t.set_kind(v1::TENSOR_KIND_MODEL);
  t.set_dtype("F32");
  for (uint64_t d : shape) t.add_shape(d);
  return t;
}

class BadRequestsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK(d_.Start([](DaemonConfig& c) {
      c.max_tensors_per_rank = kTensorLimit;
      c.max_rank_bytes = kRankBytesLimit;
    }));
    stub_ = v1::Checkpoint::NewStub(grpc::CreateChannel("unix:" + d_.socket(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (tried_ == 0) return;
    std::printf("malformed requests tried: %d;", tried_);
    for (const auto& [code, n] : codes_) std::printf(" %s %d", CodeName(code), n);
    std::printf("\n");
  }

  // One malformed request: it must get `want` with `field` in the message.
  void Expect(const std::string& what, const grpc::Status& got, Code want, const std::string& field) {
    ++tried_;
    codes_[got.error_code()] += 1;
    EXPECT_EQ(got.error_code(), want) << what << ": got " << CodeName(got.error_code()) << ": " << got.error_message();
    EXPECT_NE(got.error_message().find(field), std::string::npos)
        << what << ": the message does not name '" << field << "': " << got.error_message();
  }

  grpc::Status Register(const v1::RegisterRequest& req) {
    grpc::ClientContext ctx;
    RawDeadline(&ctx, 30s);
    v1::RegisterResponse resp;
    return stub_->Register(&ctx, req, &resp);
  }
  grpc::Status Begin(const std::string& session, int64_t step, uint32_t timeout_ms, v1::BeginSnapshotResponse* out) {
    v1::BeginSnapshotRequest req;
    req.set_session_id(session);
    req.set_step(step);
    req.set_timeout_ms(timeout_ms);
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    return stub_->BeginSnapshot(&ctx, req, out);
  }
  grpc::Status Begin(const std::string& session, int64_t step, uint32_t timeout_ms = 500) {
    v1::BeginSnapshotResponse ignored;
    return Begin(session, step, timeout_ms, &ignored);
  }
  grpc::Status Commit(v1::CommitRequest req) {
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::CommitResponse resp;
    return stub_->Commit(&ctx, req, &resp);
  }
  static v1::CommitRequest CommitOf(const std::string& session, const v1::BeginSnapshotResponse& ticket, int64_t step) {
    v1::CommitRequest req;
    req.set_session_id(session);
    req.set_slot(ticket.slot());
    req.set_generation(ticket.generation());
    req.set_step(step);
    req.set_persist(true);
    return req;
  }
  grpc::Status Abort(const std::string& session, uint32_t slot, uint64_t generation) {
    v1::AbortSnapshotRequest req;
    req.set_session_id(session);
    req.set_slot(slot);
    req.set_generation(generation);
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::AbortSnapshotResponse resp;
    return stub_->AbortSnapshot(&ctx, req, &resp);
  }
  grpc::Status Release(const std::string& session, uint32_t slot, uint64_t generation) {
    v1::ReleaseSlotRequest req;
    req.set_session_id(session);
    req.set_slot(slot);
    req.set_generation(generation);
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::ReleaseSlotResponse resp;
    return stub_->ReleaseSlot(&ctx, req, &resp);
  }
  grpc::Status Wait(const std::string& session, int64_t step, uint32_t timeout_ms = 10000) {
    v1::WaitPersistedRequest req;
    req.set_session_id(session);
    req.set_step(step);
    req.set_timeout_ms(timeout_ms);
    grpc::ClientContext ctx;
    RawDeadline(&ctx, 30s);
    v1::WaitPersistedResponse resp;
    return stub_->WaitPersisted(&ctx, req, &resp);
  }
  grpc::Status Restore(const std::string& session, int64_t step, uint32_t timeout_ms = 5000,
                       std::vector<int> kinds = {}, const std::string& source_job = "") {
    v1::RestoreRequest req;
    req.set_session_id(session);
    req.set_step(step);
    req.set_timeout_ms(timeout_ms);
    for (int k : kinds) req.add_kinds(static_cast<v1::TensorKind>(k));
    req.set_source_job(source_job);
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::RestoreResponse resp;
    return stub_->Restore(&ctx, req, &resp);
  }
  grpc::Status Ema(const std::string& session, uint32_t timeout_ms) {
    v1::GetEmaRequest req;
    req.set_session_id(session);
    req.set_timeout_ms(timeout_ms);
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::GetEmaResponse resp;
    return stub_->GetEma(&ctx, req, &resp);
  }
  grpc::Status List(const std::string& job) {
    v1::ListCheckpointsRequest req;
    req.set_job(job);
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::ListCheckpointsResponse resp;
    return stub_->ListCheckpoints(&ctx, req, &resp);
  }

  // A registration of the session "bad"/0 with one tensor changed by `edit`.
  v1::RegisterRequest WithTensor(const std::string& session, const std::function<void(v1::TensorSpec*)>& edit) {
    v1::RegisterRequest req = SmallRegistration(session);
    edit(req.mutable_tensors(0));
    return req;
  }

  void SessionCases();
  void RegisterCases(const std::string& session);
  void SaveCases(const std::string& session);
  void ReadCases(const std::string& session);
  // A full save of `step` on a fresh session of a fresh job: the daemon still serves.
  void ValidSaveStillWorks(const std::string& job, int64_t step);

  InProcessDaemon d_{"flashckpt-bad-requests-test"};
  std::unique_ptr<v1::Checkpoint::Stub> stub_;
  int tried_ = 0;
  std::map<Code, int> codes_;
};

void BadRequestsTest::SessionCases() {
  const std::vector<std::pair<std::string, std::string>> jobs = {
      {"empty", ""},
      {"slash", "a/b"},
      {"dot-dot", ".."},
      {"traversal", "../etc"},
      {"dot", "."},
      {"200 chars", std::string(200, 'x')},
      {"space", "a b"},
      {"NUL", std::string("a\0b", 3)},
      {"newline", "a\nb"},
      {"UTF-8", "caf\xc3\xa9"},
      {"1 MiB", std::string(1 << 20, 'j')},
  };
  for (const auto& [what, job] : jobs) {
    RawSession s(stub_.get(), job, 0);
    EXPECT_TRUE(s.id().empty()) << "job " << what << " got a session";
    Expect("Session job " + what, s.status(), Code::INVALID_ARGUMENT, "job name");
  }
  EXPECT_FALSE(PathExists(d_.dir() + "/etc")) << "a job name became a path outside the root";
}

void BadRequestsTest::RegisterCases(const std::string& session) {
  const Code kInvalid = Code::INVALID_ARGUMENT;
  // session_id: malformed (INVALID_ARGUMENT) and well-formed but unknown (UNAVAILABLE: after a
  // daemon restart every session is unknown, and clients re-attach on that code).
  Expect("Register without session_id", Register(SmallRegistration("")), kInvalid, "session_id");
  Expect("Register session_id not hex", Register(SmallRegistration("zzzzzzzzzzzzzzzz")), kInvalid, "session_id");
  Expect("Register session_id 4 KiB", Register(SmallRegistration(std::string(4096, 'a'))), kInvalid, "session_id");
  Expect("Register session_id upper-case", Register(SmallRegistration(std::string(16, 'A'))), kInvalid, "session_id");
  Expect("Register unknown session_id", Register(SmallRegistration("0123456789abcdef")), Code::UNAVAILABLE,
         "session_id");

  // Tensor counts.
  v1::RegisterRequest none = SmallRegistration(session);
  none.clear_tensors();
  Expect("Register no tensors", Register(none), kInvalid, "tensors");
  for (uint64_t count : {uint64_t{kTensorLimit} + 1, uint64_t{200000}}) {
    v1::RegisterRequest many = SmallRegistration(session);
    many.clear_tensors();
    for (uint64_t i = 0; i < count; ++i) *many.add_tensors() = F32("t" + std::to_string(i), {1});
    Expect("Register " + std::to_string(count) + " tensors", Register(many), kInvalid, "--max-tensors-per-rank");
  }

  // Names.
  auto named = [&](const std::string& name) {
    return WithTensor(session, [&](v1::TensorSpec* t) { t->set_name(name); });
  };
  Expect("Register empty tensor name", Register(named("")), kInvalid, "name");
  Expect("Register 600-char tensor name", Register(named(std::string(600, 'n'))), kInvalid, "name");
  Expect("Register tensor name with a quote", Register(named("a\"b")), kInvalid, "name");
  Expect("Register tensor name with a backslash", Register(named("a\\b")), kInvalid, "name");
  Expect("Register tensor name with '@'", Register(named("w@kind")), kInvalid, "name");
  Expect("Register tensor name with a newline", Register(named("a\nb")), kInvalid, "name");
  Expect("Register tensor name __metadata__", Register(named("__metadata__")), kInvalid, "name");
  v1::RegisterRequest twice = SmallRegistration(session);
  *twice.add_tensors() = F32("w", {4});
  Expect("Register duplicate tensor names", Register(twice), kInvalid, "name 'w' is registered twice");
  Expect("Register bad param name",
         Register(WithTensor(session,
                             [](v1::TensorSpec* t) {
                               t->set_kind(v1::TENSOR_KIND_MASTER_WEIGHT);
                               t->set_param("p\"q");
                             })),
         kInvalid, "param");

  // Kinds, dtypes, enums.
  Expect("Register kind unspecified",
         Register(WithTensor(session, [](v1::TensorSpec* t) { t->set_kind(v1::TENSOR_KIND_UNSPECIFIED); })), kInvalid,
         "kind");
  Expect("Register unknown kind 99",
         Register(WithTensor(session, [](v1::TensorSpec* t) { t->set_kind(static_cast<v1::TensorKind>(99)); })),
         kInvalid, "kind 99");
  for (const std::string& dtype :
       std::vector<std::string>{"F8", "", "f32", "COMPLEX64", "F32 ", std::string(1000, 'D')}) {
    Expect("Register dtype '" + dtype.substr(0, 16) + "'",
           Register(WithTensor(session, [&](v1::TensorSpec* t) { t->set_dtype(dtype); })), kInvalid, "dtype");
  }
  v1::RegisterRequest backpressure = SmallRegistration(session);
  backpressure.set_backpressure(static_cast<v1::BackpressurePolicy>(7));
  Expect("Register backpressure 7", Register(backpressure), kInvalid, "backpressure");

  // Shapes and sizes.
  auto shaped = [&](std::vector<uint64_t> shape) {
    return WithTensor(session, [&](v1::TensorSpec* t) {
      t->clear_shape();
      for (uint64_t d : shape) t->add_shape(d);
    });
  };
  Expect("Register shape of 9 dimensions", Register(shaped({1, 1, 1, 1, 1, 1, 1, 1, 1})), kInvalid, "shape");
  Expect("Register shape of 2^80 elements", Register(shaped({1ull << 40, 1ull << 40})), kInvalid, "shape");
  Expect("Register shape of 2^64 bytes (F32 x 2^62)", Register(shaped({1ull << 62})), kInvalid, "shape");
  Expect("Register shape of 2^63 bytes (F32 x 2^61)", Register(shaped({1ull << 61})), kInvalid, "shape");
  Expect("Register shape of 2^64-1 elements", Register(shaped({~0ull})), kInvalid, "shape");
  v1::RegisterRequest replicas = SmallRegistration(session);  // each fits; the replica area would wrap
  for (int i = 0; i < 4; ++i) {
    v1::TensorSpec* r = replicas.add_tensors();
    *r = F32("rep" + std::to_string(i), {1ull << 45});  // 2^47 bytes each
    r->set_replica(true);
  }
  Expect("Register replicas summing past 2^48 bytes", Register(replicas), kInvalid, "tensors");
  v1::RegisterRequest one_huge_replica = SmallRegistration(session);
  *one_huge_replica.add_tensors() = F32("rep", {1ull << 46});  // 2^48 bytes: fits alone, not with "w"
  one_huge_replica.mutable_tensors(1)->set_replica(true);
  Expect("Register a replica filling the slot limit", Register(one_huge_replica), kInvalid, "tensors");
  Expect("Register 4 GiB (above --max-rank-bytes)", Register(shaped({1ull << 30})), Code::RESOURCE_EXHAUSTED,
         "--max-rank-bytes");
  Expect("Register 2 MiB (above --max-rank-bytes)", Register(shaped({1ull << 19})), Code::RESOURCE_EXHAUSTED,
         "--max-rank-bytes");
  Expect("Register chunk checksums beyond the header bound",
         Register(WithTensor(session,
                             [](v1::TensorSpec* t) {
                               t->clear_shape();
                               t->add_shape(1ull << 44);  // 64 TiB: 2^24 chunks of 1 MiB, 256 MiB of checksum digits
                               t->set_dtype("F32");
                             })),
         kInvalid, "header");

  // Boxes and flat ranges.
  Expect("Register global_shape of another rank",
         Register(WithTensor(session,
                             [](v1::TensorSpec* t) {
                               t->add_global_shape(16);
                               t->add_global_shape(2);
                             })),
         kInvalid, "global_shape");
  Expect("Register box_offset + box_shape wrapping",
         Register(WithTensor(session,
                             [](v1::TensorSpec* t) {
                               t->add_global_shape(32);
                               t->add_box_offset(~0ull);
                               t->add_box_shape(16);
                             })),
         kInvalid, "box_offset");
  Expect("Register box outside global_shape",
         Register(WithTensor(session,
                             [](v1::TensorSpec* t) {
                               t->add_global_shape(20);
                               t->add_box_offset(8);
                               t->add_box_shape(16);
                             })),
         kInvalid, "global_shape");
  Expect("Register global_shape of 2^66 bytes",
         Register(WithTensor(session,
                             [](v1::TensorSpec* t) {
                               t->clear_shape();
                               t->add_shape(1);
                               t->add_shape(1);
                               t->add_global_shape(1ull << 32);
                               t->add_global_shape(1ull << 32);
                               t->add_box_offset(0);
                               t->add_box_offset(0);
                               t->add_box_shape(1);
                               t->add_box_shape(1);
                             })),
         kInvalid, "global_shape");
  Expect("Register flat range without box_shape",
         Register(WithTensor(session,
                             [](v1::TensorSpec* t) {
                               t->set_has_flat_range(true);
                               t->set_flat_begin(0);
                               t->set_flat_end(16);
                             })),
         kInvalid, "box_shape");
  auto flat = [&](uint64_t begin, uint64_t end) {
    return WithTensor(session, [&](v1::TensorSpec* t) {
      t->add_box_shape(64);
      t->set_has_flat_range(true);
      t->set_flat_begin(begin);
      t->set_flat_end(end);
    });
  };
  Expect("Register flat range begin > end", Register(flat(20, 4)), kInvalid, "flat_begin, flat_end");
  Expect("Register flat range past the box", Register(flat(60, 76)), kInvalid, "flat_begin, flat_end");
  Expect("Register flat range of another size", Register(flat(0, 17)), kInvalid, "flat range");
  Expect("Register shape other than box_shape",
         Register(WithTensor(session, [](v1::TensorSpec* t) { t->add_box_shape(8); })), kInvalid, "box_shape");

  // Topology.
  auto topo = [&](uint32_t world, uint32_t tp, uint32_t pp, uint32_t shard, uint32_t tp_rank = 0) {
    v1::RegisterRequest req = SmallRegistration(session);
    auto* t = req.mutable_topology();
    t->set_world_size(world);
    t->set_tp_degree(tp);
    t->set_pp_degree(pp);
    t->set_shard_degree(shard);
    t->set_tp_rank(tp_rank);
    return req;
  };
  Expect("Register world_size 0", Register(topo(0, 1, 1, 1)), kInvalid, "world_size");
  Expect("Register degree 0", Register(topo(1, 0, 1, 1)), kInvalid, "world_size");
  Expect("Register world_size != product", Register(topo(3, 2, 1, 1)), kInvalid, "world_size");
  Expect("Register tp_rank >= tp_degree", Register(topo(2, 2, 1, 1, 2)), kInvalid, "tp_rank");
  // 2^31 * 3 * 2863311531 = 2^64 + 2^31: wrapped to 64 bits it equals world_size 2^31.
  Expect("Register degrees whose product wraps 2^64", Register(topo(1u << 31, 1u << 31, 3, 2863311531u)), kInvalid,
         "overflows");
  {
    RawSession high(stub_.get(), "bad", 5);
    ASSERT_FALSE(high.id().empty());
    Expect("Register rank 5 of world_size 1", Register(SmallRegistration(high.id())), kInvalid, "world_size");
  }

  // EMA options.
  auto ema = [&](const std::function<void(v1::EmaOptions*)>& edit) {
    v1::RegisterRequest req = SmallRegistration(session);
    req.mutable_ema()->set_enabled(true);
    req.mutable_ema()->set_decay(0.9);
    req.mutable_ema()->set_interval(1);
    edit(req.mutable_ema());
    return req;
  };
  for (double decay : {0.0, 1.0, -0.5, 2.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    Expect("Register ema decay " + std::to_string(decay),
           Register(ema([&](v1::EmaOptions* e) { e->set_decay(decay); })), kInvalid, "ema_decay");
  }
  Expect("Register ema interval 0", Register(ema([](v1::EmaOptions* e) { e->set_interval(0); })), kInvalid,
         "ema_interval");
  Expect("Register ema init 'ones'", Register(ema([](v1::EmaOptions* e) { e->set_init("ones"); })), kInvalid,
         "ema_init");
  grpc::Status long_init = Register(ema([](v1::EmaOptions* e) { e->set_init(std::string(1 << 20, 'i')); }));
  Expect("Register ema init of 1 MiB", long_init, kInvalid, "ema_init");
  EXPECT_LT(long_init.error_message().size(), 400u) << "an untrusted string is echoed whole";
  Expect("Register ema model_params 'some'", Register(ema([](v1::EmaOptions* e) { e->set_model_params("some"); })),
         kInvalid, "ema_model_params");
  Expect("Register ema loss_threshold NaN", Register(ema([](v1::EmaOptions* e) {
           e->set_has_loss_threshold(true);
           e->set_loss_threshold(std::nan(""));
         })),
         kInvalid, "ema_loss_threshold");
  v1::RegisterRequest ints = ema([](v1::EmaOptions*) {});
  ints.mutable_tensors(0)->set_dtype("I32");
  Expect("Register ema without float tensors", Register(ints), kInvalid, "EMA");
}

void BadRequestsTest::SaveCases(const std::string& session) {
  const Code kInvalid = Code::INVALID_ARGUMENT;
  // The rank registers its one tensor for real.
  ASSERT_TRUE(Register(SmallRegistration(session)).ok());

  Expect("BeginSnapshot step -1", Begin(session, -1), kInvalid, "step");
  Expect("BeginSnapshot step INT64_MAX", Begin(session, std::numeric_limits<int64_t>::max()), kInvalid, "step");
  Expect("BeginSnapshot step 10^18", Begin(session, 1'000'000'000'000'000'000), kInvalid, "step");
  Expect("BeginSnapshot timeout_ms UINT32_MAX", Begin(session, 1, std::numeric_limits<uint32_t>::max()), kInvalid,
         "timeout_ms");
  Expect("BeginSnapshot timeout_ms 24 h + 1", Begin(session, 1, 24u * 3600 * 1000 + 1), kInvalid, "timeout_ms");
  Expect("BeginSnapshot session_id garbage", Begin("../../../etc/passwd", 1), kInvalid, "session_id");
  Expect("BeginSnapshot unknown session_id", Begin("fedcba9876543210", 1), Code::UNAVAILABLE, "session");
  {
    v1::BeginSnapshotRequest req;
    req.set_session_id(session);
    req.set_step(1);
    req.set_timeout_ms(500);
    req.set_tier(static_cast<v1::Tier>(7));
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::BeginSnapshotResponse ignored;
    Expect("BeginSnapshot tier 7", stub_->BeginSnapshot(&ctx, req, &ignored), kInvalid, "tier");
  }
  {
    // A memory checkpoint's commit that asks for files is refused; the slot is aborted by the test below.
    v1::BeginSnapshotRequest req;
    req.set_session_id(session);
    req.set_step(5);
    req.set_timeout_ms(500);
    req.set_tier(v1::TIER_MEMORY);
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    v1::BeginSnapshotResponse memory;
    ASSERT_TRUE(stub_->BeginSnapshot(&ctx, req, &memory).ok());
    Expect("Commit of a memory checkpoint with persist", Commit(CommitOf(session, memory, 5)), kInvalid, "memory");
    v1::CommitRequest kept = CommitOf(session, memory, 5);
    kept.set_persist(false);
    Expect("Commit of a memory checkpoint", Commit(kept), Code::OK, "");
  }

  v1::BeginSnapshotResponse ticket;
  ASSERT_TRUE(Begin(session, 10, 500, &ticket).ok());
  v1::CommitRequest wrong = CommitOf(session, ticket, 10);
  wrong.set_slot(99);
  Expect("Commit slot 99", Commit(wrong), kInvalid, "slot 99");
  wrong = CommitOf(session, ticket, 10);
  wrong.set_generation(ticket.generation() + 7);
  Expect("Commit stale generation", Commit(wrong), Code::FAILED_PRECONDITION, "generation");
  Expect("Commit another step", Commit(CommitOf(session, ticket, 11)), kInvalid, "step");
  Expect("Commit step -3", Commit(CommitOf(session, ticket, -3)), kInvalid, "step");
  wrong = CommitOf(session, ticket, 10);
  wrong.set_extra(std::string((4u << 20) + 1, 'x'));
  Expect("Commit extra of 4 MiB + 1", Commit(wrong), kInvalid, "extra");
  wrong = CommitOf(session, ticket, 10);
  wrong.set_session_id("");
  Expect("Commit without session_id", Commit(wrong), kInvalid, "session_id");
  Expect("BeginSnapshot step 10 again (steps increase)", Begin(session, 10), kInvalid, "step");

  // The ticket is still good after all that: commit it for real.
  ASSERT_TRUE(Commit(CommitOf(session, ticket, 10)).ok());
  ASSERT_TRUE(Wait(session, 10).ok());
  Expect("Commit the same ticket twice", Commit(CommitOf(session, ticket, 10)), Code::FAILED_PRECONDITION, "slot");
  Expect("AbortSnapshot a stale ticket", Abort(session, ticket.slot(), ticket.generation()), Code::FAILED_PRECONDITION,
         "slot");
  Expect("AbortSnapshot slot 1000", Abort(session, 1000, 1), kInvalid, "slot 1000");
  Expect("ReleaseSlot of a slot never restoring", Release(session, ticket.slot(), ticket.generation()),
         Code::FAILED_PRECONDITION, "slot");
  Expect("ReleaseSlot slot UINT32_MAX", Release(session, std::numeric_limits<uint32_t>::max(), 0), kInvalid, "slot");

  Expect("WaitPersisted step -5", Wait(session, -5), kInvalid, "step");
  Expect("WaitPersisted step INT64_MAX", Wait(session, std::numeric_limits<int64_t>::max()), kInvalid, "step");
  Expect("WaitPersisted timeout_ms UINT32_MAX", Wait(session, 10, std::numeric_limits<uint32_t>::max()), kInvalid,
         "timeout_ms");
  Expect("WaitPersisted a step never committed", Wait(session, 50), Code::FAILED_PRECONDITION, "step 50");
}

void BadRequestsTest::ReadCases(const std::string& session) {
  const Code kInvalid = Code::INVALID_ARGUMENT;
  Expect("Restore step -1", Restore(session, -1), kInvalid, "step");
  Expect("Restore step INT64_MAX", Restore(session, std::numeric_limits<int64_t>::max()), kInvalid, "step");
  Expect("Restore timeout_ms UINT32_MAX", Restore(session, 0, std::numeric_limits<uint32_t>::max()), kInvalid,
         "timeout_ms");
  Expect("Restore a step never saved", Restore(session, 77), Code::NOT_FOUND, "checkpoint-77");
  Expect("Restore session_id of 17 digits", Restore("0123456789abcdef0", 0), kInvalid, "session_id");
  Expect("Restore kind 99", Restore(session, 0, 5000, {99}), kInvalid, "restore kind 99");
  Expect("Restore kind unspecified", Restore(session, 0, 5000, {0}), kInvalid, "restore kind 0");
  Expect("Restore source_job '../x'", Restore(session, 0, 5000, {1}, "../x"), kInvalid, "source_job");
  Expect("Restore source_job without kinds", Restore(session, 0, 5000, {}, "other"), kInvalid, "must name its kinds");
  Expect("Restore a source job with no checkpoint-5", Restore(session, 5, 5000, {1}, "other"), Code::NOT_FOUND,
         "job 'other'");
  Expect("GetEma timeout_ms UINT32_MAX", Ema(session, std::numeric_limits<uint32_t>::max()), kInvalid, "timeout_ms");
  Expect("GetEma without session_id", Ema("", 100), kInvalid, "session_id");
  Expect("ListCheckpoints job '../x'", List("../x"), kInvalid, "job name");
  Expect("ListCheckpoints job of 300 chars", List(std::string(300, 'j')), kInvalid, "job name");
}

void BadRequestsTest::ValidSaveStillWorks(const std::string& job, int64_t step) {
  RawSession s(stub_.get(), job, 0);
  ASSERT_FALSE(s.id().empty()) << s.status().error_message();
  ASSERT_TRUE(Register(SmallRegistration(s.id())).ok());
  v1::BeginSnapshotResponse ticket;
  ASSERT_TRUE(Begin(s.id(), step, 1000, &ticket).ok());
  grpc::Status committed = Commit(CommitOf(s.id(), ticket, step));
  ASSERT_TRUE(committed.ok()) << committed.error_message();
  grpc::Status persisted = Wait(s.id(), step);
  ASSERT_TRUE(persisted.ok()) << persisted.error_message();
  EXPECT_TRUE(PathExists(d_.root() + "/" + job + "/checkpoint-" + std::to_string(step) + "/metadata.json"));
  grpc::ClientContext ctx;
  RawDeadline(&ctx);
  v1::StatusResponse status;
  ASSERT_TRUE(stub_->GetStatus(&ctx, v1::StatusRequest{}, &status).ok());
}

TEST_F(BadRequestsTest, EveryMalformedRequestIsRefusedNamingItsFieldAndTheDaemonKeepsServing) {
  SessionCases();
  RawSession session(stub_.get(), "bad", 0);
  ASSERT_FALSE(session.id().empty()) << session.status().error_message();
  RegisterCases(session.id());
  SaveCases(session.id());
  ReadCases(session.id());
  EXPECT_EQ(codes_.count(Code::UNKNOWN), 0u) << "a handler failed in an unexpected way (an exception?)";
  EXPECT_GE(tried_, 90) << "a group of cases did not run";
  ValidSaveStillWorks("after-bad-requests", 3);
}

// A NaN or infinite loss is accepted with the snapshot (it is the trainer's state), but with an EMA
// loss threshold it never enters the average: `NaN > threshold` alone would have let it in.
TEST_F(BadRequestsTest, NonFiniteLossesSkipTheEmaUpdateUnderALossThreshold) {
  RawSession s(stub_.get(), "nanloss", 0);
  ASSERT_FALSE(s.id().empty());
  v1::RegisterRequest req = SmallRegistration(s.id());
  req.mutable_ema()->set_enabled(true);
  req.mutable_ema()->set_decay(0.5);
  req.mutable_ema()->set_interval(1);
  req.mutable_ema()->set_has_loss_threshold(true);
  req.mutable_ema()->set_loss_threshold(5.0);
  ASSERT_TRUE(Register(req).ok());
  int64_t step = 0;
  for (double loss :
       {std::nan(""), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(), 1.0}) {
    v1::BeginSnapshotResponse ticket;
    ASSERT_TRUE(Begin(s.id(), ++step, 1000, &ticket).ok());
    v1::CommitRequest commit = CommitOf(s.id(), ticket, step);
    commit.set_persist(false);
    commit.set_has_loss(true);
    commit.set_loss(loss);
    grpc::Status committed = Commit(commit);
    ASSERT_TRUE(committed.ok()) << "loss " << loss << ": " << committed.error_message();
  }
  bool settled = false;
  v1::RankStatus rank;
  for (int i = 0; i < 200 && !settled; ++i) {
    rank = ToProto(d_.daemon()->GetStatus()).jobs(0).ranks(0);
    settled = rank.ema_updates_applied() + rank.ema_updates_skipped() == 4;
    if (!settled) std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(settled) << rank.DebugString();
  EXPECT_EQ(rank.ema_updates_skipped(), 3u) << "NaN, +inf and -inf losses must be gated";
  EXPECT_EQ(rank.ema_updates_applied(), 1u);
  EXPECT_EQ(rank.ema_last_step(), 4);
  UnlinkEmaSegments("nanloss");
}

}  // namespace
}  // namespace flashckpt
