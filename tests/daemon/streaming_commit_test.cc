// Streaming commits: a trainer may commit a slot before its device copies have put every byte in
// place, and tell the daemon how far they got through the slot header's copied_until. The daemon
// hashes and writes nothing before it is in place, fails the save when the trainer marks its copies
// failed or they stall past the copy timeout, and starts every hand-out complete (copied_until 0).
// Driven with raw gRPC and the segment mapped by hand, as the client's CUDA path drives them.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>

#include "common/format/checksum.h"
#include "common/io/fs.h"
#include "common/io/shm.h"
#include "flashckpt.grpc.pb.h"
#include "in_process_daemon.h"
#include "raw_rpc.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kElements = 1u << 19;  // 2 MiB per tensor: several checksum chunks

class StreamingCommitTest : public ::testing::Test {
 protected:
  void Start(std::chrono::milliseconds copy_timeout, bool ema = false) {
    ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.copy_timeout = copy_timeout; }));
    stub_ = v1::Checkpoint::NewStub(grpc::CreateChannel("unix:" + d_.socket(), grpc::InsecureChannelCredentials()));
    session_ = std::make_unique<RawSession>(stub_.get(), "stream", 0);
    ASSERT_FALSE(session_->id().empty()) << session_->status().error_message();
    v1::RegisterRequest req = SmallRegistration(session_->id());
    req.clear_tensors();
    if (ema) {
      req.mutable_ema()->set_enabled(true);
      req.mutable_ema()->set_decay(0.9);
      req.mutable_ema()->set_interval(1);
    }
    for (const char* name : {"w", "w.exp_avg"}) {
      auto* t = req.add_tensors();
      t->set_name(name);
      t->set_kind(std::string(name) == "w" ? v1::TENSOR_KIND_MODEL : v1::TENSOR_KIND_OPTIMIZER);
      t->set_dtype("F32");
      t->add_shape(kElements);
    }
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    grpc::Status s = stub_->Register(&ctx, req, &reg_);
    ASSERT_TRUE(s.ok()) << s.error_message();
    auto shm = SharedSegment::Open(reg_.segment_name(), reg_.segment_bytes());
    ASSERT_TRUE(shm.ok()) << shm.status().ToString();
    shm_ = std::move(shm).value();
  }

  char* Slot(uint32_t i) const { return shm_->data() + reg_.slot_offset() + reg_.slot_stride() * i; }
  SlotHeader* Header(uint32_t i) const { return reinterpret_cast<SlotHeader*>(Slot(i)); }
  const v1::TensorPlacement& Placement(const std::string& name) const {
    for (const auto& p : reg_.placements()) {
      if (p.name() == name) return p;
    }
    ADD_FAILURE() << "no placement for " << name;
    return reg_.placements(0);
  }
  // The slot offset of the first tensor byte: where a trainer's copies begin.
  uint64_t FirstTensorByte() const {
    uint64_t first = ~0ull;
    for (const auto& p : reg_.placements()) first = std::min<uint64_t>(first, p.slot_offset());
    return first;
  }
  void Fill(uint32_t slot, char byte) const {
    for (const auto& p : reg_.placements()) std::memset(Slot(slot) + p.slot_offset(), byte, p.bytes());
  }

  v1::BeginSnapshotResponse Begin(int64_t step, v1::Tier tier = v1::TIER_DISK) {
    v1::BeginSnapshotRequest req;
    req.set_session_id(session_->id());
    req.set_step(step);
    req.set_tier(tier);
    req.set_timeout_ms(5000);
    v1::BeginSnapshotResponse resp;
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    grpc::Status s = stub_->BeginSnapshot(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }
  grpc::Status Commit(const v1::BeginSnapshotResponse& slot, int64_t step, bool persist = true) {
    v1::CommitRequest req;
    req.set_session_id(session_->id());
    req.set_slot(slot.slot());
    req.set_generation(slot.generation());
    req.set_step(step);
    req.set_persist(persist);
    v1::CommitResponse resp;
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    return stub_->Commit(&ctx, req, &resp);
  }
  grpc::Status WaitPersisted(int64_t step, std::chrono::milliseconds timeout) {
    v1::WaitPersistedRequest req;
    req.set_session_id(session_->id());
    req.set_step(step);
    req.set_timeout_ms(static_cast<uint32_t>(timeout.count()));
    v1::WaitPersistedResponse resp;
    grpc::ClientContext ctx;
    RawDeadline(&ctx, 30s);
    return stub_->WaitPersisted(&ctx, req, &resp);
  }
  // Restores `step` (0: the latest) and gives the slot back at once.
  grpc::Status Restore(int64_t step, std::chrono::milliseconds timeout, v1::RestoreResponse* resp) {
    v1::RestoreRequest req;
    req.set_session_id(session_->id());
    req.set_step(step);
    req.set_timeout_ms(static_cast<uint32_t>(timeout.count()));
    grpc::ClientContext ctx;
    RawDeadline(&ctx, 30s);
    grpc::Status s = stub_->Restore(&ctx, req, resp);
    if (!s.ok() || !resp->found()) return s;
    v1::ReleaseSlotRequest release;
    release.set_session_id(session_->id());
    release.set_slot(resp->slot());
    release.set_generation(resp->generation());
    v1::ReleaseSlotResponse released;
    grpc::ClientContext release_ctx;
    RawDeadline(&release_ctx);
    return stub_->ReleaseSlot(&release_ctx, release, &released);
  }
  // The trainer process ends (its session with it) and a new one registers the same tensors.
  void Restart() {
    session_.reset();
    session_ = std::make_unique<RawSession>(stub_.get(), "stream", 0);
    ASSERT_FALSE(session_->id().empty()) << session_->status().error_message();
    v1::RegisterRequest req = SmallRegistration(session_->id());
    req.clear_tensors();
    for (const char* name : {"w", "w.exp_avg"}) {
      auto* t = req.add_tensors();
      t->set_name(name);
      t->set_kind(std::string(name) == "w" ? v1::TENSOR_KIND_MODEL : v1::TENSOR_KIND_OPTIMIZER);
      t->set_dtype("F32");
      t->add_shape(kElements);
    }
    v1::RegisterResponse again;
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    grpc::Status s = stub_->Register(&ctx, req, &again);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(again.segment_name(), reg_.segment_name()) << "the same layout keeps its segment";
  }
  // A disk snapshot of `step`, every tensor byte `byte`, committed and persisted.
  void SaveToDisk(int64_t step, char byte) {
    auto slot = Begin(step);
    Fill(slot.slot(), byte);
    ASSERT_TRUE(Commit(slot, step).ok());
    ASSERT_TRUE(WaitPersisted(step, 10s).ok());
  }
  // Returns once the daemon, stopping on another thread, has begun to (it refuses deletions then),
  // and a moment more for the stop to reach the EMA stage.
  void StopBegun() {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (d_.daemon()->DeleteCheckpoints("stream", 0, 1, /*force=*/false, /*dry_run=*/true).ok()) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the daemon did not begin to stop";
      std::this_thread::sleep_for(10ms);
    }
    std::this_thread::sleep_for(200ms);
  }
  // The last `bytes` bytes of a file: the data of its one tensor.
  std::string Tail(const std::string& path, uint64_t bytes) const {
    std::ifstream in(path, std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return all.size() < bytes ? std::string() : all.substr(all.size() - bytes);
  }
  std::string CheckpointFile(int64_t step, const char* kind) const {
    return d_.root() + "/stream/checkpoint-" + std::to_string(step) + "/" + kind + ".tp00_pp00_shard00.safetensors";
  }

  // A daemon stopped with a snapshot in flight leaves its segment, and any daemon its EMA segment,
  // for a successor; there is none here, so the test removes them.
  void TearDown() override {
    const std::string ema = d_.daemon() != nullptr ? d_.daemon()->EmaSegmentName("stream", 0) : std::string();
    session_.reset();
    shm_.reset();
    d_.Stop();
    if (!reg_.segment_name().empty()) SharedSegment::Unlink(reg_.segment_name());
    if (!ema.empty()) SharedSegment::Unlink(ema);
  }

  InProcessDaemon d_{"fc-stream"};
  std::unique_ptr<v1::Checkpoint::Stub> stub_;
  std::unique_ptr<RawSession> session_;
  v1::RegisterResponse reg_;
  std::unique_ptr<SharedSegment> shm_;
};

// Committed with nothing in place: nothing is written until the copies arrive, and then what is
// written is what they brought, not what the slot held at the commit.
TEST_F(StreamingCommitTest, WritesOnlyWhatTheCopiesHavePutInPlace) {
  Start(30s);
  auto slot = Begin(1);
  EXPECT_EQ(Header(slot.slot())->copied_until.load(), 0u) << "a slot is handed out complete";
  Fill(slot.slot(), 'x');  // stale bytes that must never reach a file
  Header(slot.slot())->copied_until.store(FirstTensorByte());
  grpc::Status committed = Commit(slot, 1);
  ASSERT_TRUE(committed.ok()) << committed.error_message();
  grpc::Status early = WaitPersisted(1, 500ms);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << early.error_message();
  // The first tensor arrives, then the second.
  const auto& w = Placement("w");
  const auto& m = Placement("w.exp_avg");
  const auto& first = w.slot_offset() < m.slot_offset() ? w : m;
  const auto& second = w.slot_offset() < m.slot_offset() ? m : w;
  std::memset(Slot(slot.slot()) + first.slot_offset(), 'a', first.bytes());
  Header(slot.slot())->copied_until.store(second.slot_offset());
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(WaitPersisted(1, 10ms).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  std::memset(Slot(slot.slot()) + second.slot_offset(), 'b', second.bytes());
  Header(slot.slot())->copied_until.store(0);
  grpc::Status done = WaitPersisted(1, 10s);
  ASSERT_TRUE(done.ok()) << done.error_message();
  const bool w_first = &first == &w;
  EXPECT_EQ(Tail(CheckpointFile(1, "model_state"), w.bytes()), std::string(w.bytes(), w_first ? 'a' : 'b'));
  EXPECT_EQ(Tail(CheckpointFile(1, "optimizer"), m.bytes()), std::string(m.bytes(), w_first ? 'b' : 'a'));
}

TEST_F(StreamingCommitTest, CopiesMarkedFailedFailTheSave) {
  Start(30s);
  auto slot = Begin(1);
  Header(slot.slot())->copied_until.store(FirstTensorByte());
  ASSERT_TRUE(Commit(slot, 1).ok());
  Header(slot.slot())->copied_until.store(kSlotCopyFailed);
  grpc::Status s = WaitPersisted(1, 10s);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.error_message().find("copies into the slot failed"), std::string::npos) << s.error_message();
  EXPECT_FALSE(PathExists(CheckpointFile(1, "model_state")));
}

// Copies that stop half-way (a trainer killed mid-copy) fail the save after the copy timeout, and
// the next hand-out of the slot starts complete again.
TEST_F(StreamingCommitTest, StalledCopiesFailAfterTheCopyTimeout) {
  Start(300ms);
  auto slot = Begin(1);
  Header(slot.slot())->copied_until.store(FirstTensorByte() + 4096);
  ASSERT_TRUE(Commit(slot, 1).ok());
  grpc::Status s = WaitPersisted(1, 10s);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.error_message().find("did not reach byte"), std::string::npos) << s.error_message();
  EXPECT_FALSE(PathExists(CheckpointFile(1, "model_state")));

  for (int64_t step = 2; step <= 3; ++step) {  // both slots, one of them the stalled one
    auto next = Begin(step);
    EXPECT_EQ(Header(next.slot())->copied_until.load(), 0u);
    Fill(next.slot(), 'c');
    ASSERT_TRUE(Commit(next, step).ok());
    grpc::Status done = WaitPersisted(step, 10s);
    ASSERT_TRUE(done.ok()) << done.error_message();
  }
}

// A memory checkpoint committed before its copies finished, whose trainer then dies, is dropped at
// once: the copies never come, and a restore does not wait for them (nor for the copy timeout).
TEST_F(StreamingCommitTest, AMemoryCheckpointWhoseCopiesNeverFinishGoesWithItsTrainer) {
  Start(60s);
  auto slot = Begin(1, v1::TIER_MEMORY);
  Header(slot.slot())->copied_until.store(FirstTensorByte() + 4096);
  ASSERT_TRUE(Commit(slot, 1, /*persist=*/false).ok());
  std::this_thread::sleep_for(200ms);  // the EMA stage waits for the copies, to checksum them
  Restart();
  const auto start = std::chrono::steady_clock::now();
  v1::RestoreResponse resp;
  grpc::Status s = Restore(0, 10s, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(resp.found()) << "step " << resp.step() << " handed over";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "the restore waited for copies that never come";
}

// A restore of step 1 leaves every later step behind, also a memory checkpoint still queued for its
// checksums: it is not kept when its copies finish later, and the next restore takes step 1.
TEST_F(StreamingCommitTest, AMemoryCheckpointOfATimelineLeftWhileQueuedIsNotKept) {
  Start(60s);
  ASSERT_NO_FATAL_FAILURE(SaveToDisk(1, 'd'));
  auto memory = Begin(5, v1::TIER_MEMORY);
  Header(memory.slot())->copied_until.store(FirstTensorByte() + 4096);
  ASSERT_TRUE(Commit(memory, 5, /*persist=*/false).ok());
  v1::RestoreResponse back;
  grpc::Status s = Restore(1, 10s, &back);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(back.found());
  EXPECT_EQ(back.tier(), v1::TIER_DISK);
  Fill(memory.slot(), 'm');
  Header(memory.slot())->copied_until.store(0);  // step 5's copies finish after all
  Restart();
  v1::RestoreResponse again;
  s = Restore(0, 10s, &again);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(again.found());
  EXPECT_EQ(again.step(), 1);
  EXPECT_EQ(again.tier(), v1::TIER_DISK);
}

// --persist-on-stop (the default): a memory checkpoint whose copies are still coming when the stop
// begins is waited for (within the first half of the stop's time), checksummed and kept, and the
// stop writes it, not the step before it, which the trainer has moved past.
TEST_F(StreamingCommitTest, AMemoryCheckpointWhoseCopiesFinishDuringTheStopIsWrittenByTheStop) {
  Start(60s);
  ASSERT_NO_FATAL_FAILURE(SaveToDisk(1, 'd'));
  auto memory = Begin(2, v1::TIER_MEMORY);
  Fill(memory.slot(), 'm');
  Header(memory.slot())->copied_until.store(FirstTensorByte() + 4096);
  ASSERT_TRUE(Commit(memory, 2, /*persist=*/false).ok());
  std::this_thread::sleep_for(200ms);  // the EMA stage waits for the copies, to checksum them
  auto before = d_.daemon()->DeleteCheckpoints("stream", 0, 1, /*force=*/false, /*dry_run=*/true);
  ASSERT_TRUE(before.ok()) << "StopBegun would not see the stop begin: " << before.status().ToString();
  std::thread stop([&] { d_.daemon()->Stop(std::chrono::steady_clock::now() + 20s); });
  StopBegun();
  Header(memory.slot())->copied_until.store(0);  // the copies finish
  stop.join();
  const auto& w = Placement("w");
  ASSERT_TRUE(PathExists(CheckpointFile(2, "model_state"))) << "the stop did not write memory step 2";
  EXPECT_EQ(Tail(CheckpointFile(2, "model_state"), w.bytes()), std::string(w.bytes(), 'm'));
}

// ... but a trainer whose copies stall does not take the stop's time: past the first half of it the
// stalled checkpoint is dropped, and the stop writes the memory step before it.
TEST_F(StreamingCommitTest, AMemoryCheckpointWhoseCopiesStallAtTheStopLeavesTheStepBeforeToBeWritten) {
  Start(60s);
  ASSERT_NO_FATAL_FAILURE(SaveToDisk(1, 'd'));
  auto kept = Begin(2, v1::TIER_MEMORY);
  Fill(kept.slot(), 'k');
  ASSERT_TRUE(Commit(kept, 2, /*persist=*/false).ok());
  auto stalled = Begin(3, v1::TIER_MEMORY);
  ASSERT_NE(stalled.slot(), kept.slot());
  Fill(stalled.slot(), 's');
  Header(stalled.slot())->copied_until.store(FirstTensorByte() + 4096);
  ASSERT_TRUE(Commit(stalled, 3, /*persist=*/false).ok());
  std::this_thread::sleep_for(200ms);  // step 2 kept; the EMA stage waits for step 3's copies
  const auto start = std::chrono::steady_clock::now();
  d_.daemon()->Stop(start + 4s);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, 4s) << "the stop waited for the stalled copies until its deadline";
  EXPECT_FALSE(PathExists(CheckpointFile(3, "model_state")));
  const auto& w = Placement("w");
  ASSERT_TRUE(PathExists(CheckpointFile(2, "model_state"))) << "the stop did not write memory step 2";
  EXPECT_EQ(Tail(CheckpointFile(2, "model_state"), w.bytes()), std::string(w.bytes(), 'k'));
}

// A stop whose deadline passes while a trainer's copies stall (the trainer died mid-copy) does not
// wait out the copy timeout: the writer (and, with EMA, the EMA stage, which reads the whole slot
// first) give up at the deadline and leave the snapshot, record and segment, to the next daemon.
class StreamingCommitStopTest : public StreamingCommitTest, public ::testing::WithParamInterface<bool> {};

TEST_P(StreamingCommitStopTest, StopDoesNotWaitOutTheCopyTimeout) {
  Start(60s, /*ema=*/GetParam());
  auto slot = Begin(1);
  Header(slot.slot())->copied_until.store(FirstTensorByte() + 4096);
  ASSERT_TRUE(Commit(slot, 1).ok());
  std::this_thread::sleep_for(200ms);  // the writer (or the EMA stage) is waiting on the copies
  const auto start = std::chrono::steady_clock::now();
  d_.daemon()->Stop(start + 500ms);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, 20s) << "Stop waited for the 60 s copy timeout";
  EXPECT_FALSE(PathExists(CheckpointFile(1, "model_state")));
  // Abandoned, not failed: its commit record stays for the next daemon to adopt.
  auto names = ListDir(d_.socket() + ".state");
  ASSERT_TRUE(names.ok()) << names.status().ToString();
  bool record = false;
  for (const auto& name : *names) record = record || name.find(".slot") != std::string::npos;
  EXPECT_TRUE(record) << "the abandoned snapshot's commit record is gone";
  // A stopping daemon deletes nothing: its slots no longer say which steps are busy.
  auto deleted = d_.daemon()->DeleteCheckpoints("stream", 0, 1, /*force=*/false, /*dry_run=*/false);
  ASSERT_FALSE(deleted.ok());
  EXPECT_EQ(deleted.status().code(), StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(WriterAndEmaStage, StreamingCommitStopTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "Ema" : "NoEma"; });

// A snapshot the EMA stage never reached (the stop came while it waited for the copies) is left
// PERSISTING in its slot's mirror, but the slot's header does not say the stage was done with it
// (SlotHeader::ema_done): the next daemon passes it through the EMA stage before writing it, so the
// step's EMA file holds that step's average (the weights themselves, at the first update), not the
// empty room of the slot.
TEST_F(StreamingCommitTest, ASnapshotTheEmaStageNeverReachedGetsItsEmaFromTheNextDaemon) {
  Start(60s, /*ema=*/true);
  auto slot = Begin(1);
  Header(slot.slot())->copied_until.store(FirstTensorByte() + 4096);
  ASSERT_TRUE(Commit(slot, 1).ok());
  std::this_thread::sleep_for(200ms);  // the EMA stage is waiting on the copies
  d_.daemon()->Stop(std::chrono::steady_clock::now() + 500ms);
  ASSERT_EQ(Header(slot.slot())->state.load(), static_cast<uint32_t>(SlotState::kPersisting));
  ASSERT_EQ(Header(slot.slot())->ema_done.load(), kEmaNotDone);
  // The copies finish after all, and a new daemon on the same socket and state directory adopts it.
  Fill(slot.slot(), 'e');
  Header(slot.slot())->copied_until.store(0);
  session_.reset();
  d_.Stop();
  ASSERT_OK(d_.Start([&](DaemonConfig& c) { c.copy_timeout = 60s; }));
  const std::string done = d_.StepDir("stream", 1) + "/metadata.json";
  for (int i = 0; i < 200 && !PathExists(done); ++i) std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(PathExists(done)) << "the adopted snapshot was not written";
  const std::string weights = Tail(CheckpointFile(1, "model_state"), kElements * 4);
  ASSERT_EQ(weights, std::string(kElements * 4, 'e'));
  EXPECT_TRUE(Tail(CheckpointFile(1, "ema"), kElements * 4) == weights)
      << "the EMA file of step 1 does not hold the average of step 1";
}

// A client that verifies a memory checkpoint itself (RestoreRequest.verify_in_client) gets it with the
// checksums the daemon recorded at the commit, one per chunk of each tensor, and reports a chunk that
// does not match in ReleaseSlot; a client that does not ask gets it verified by the daemon.
class ClientVerificationTest : public StreamingCommitTest {
 protected:
  // Disk step 1 ('d' bytes) and memory step 2 ('m' bytes, checksummed), then a new trainer process.
  void SetUpSteps() {
    Start(60s);
    ASSERT_NO_FATAL_FAILURE(SaveToDisk(1, 'd'));
    auto memory = Begin(2, v1::TIER_MEMORY);
    memory_slot_ = memory.slot();
    Fill(memory_slot_, 'm');
    ASSERT_TRUE(Commit(memory, 2, /*persist=*/false).ok());
    Restart();
    v1::RestorableRequest req;  // waits for the checksums of the memory checkpoint
    req.set_session_id(session_->id());
    req.set_timeout_ms(10000);
    v1::RestorableResponse held;
    grpc::ClientContext ctx;
    RawDeadline(&ctx, 30s);
    grpc::Status s = stub_->Restorable(&ctx, req, &held);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(held.memory_steps_size(), 1);
    ASSERT_EQ(held.memory_steps(0), 2);
  }
  // Restores the latest and keeps the slot.
  grpc::Status RestoreHeld(bool verify_in_client, v1::RestoreResponse* resp) {
    v1::RestoreRequest req;
    req.set_session_id(session_->id());
    req.set_timeout_ms(10000);
    req.set_verify_in_client(verify_in_client);
    grpc::ClientContext ctx;
    RawDeadline(&ctx, 30s);
    return stub_->Restore(&ctx, req, resp);
  }
  grpc::Status Release(const v1::RestoreResponse& resp, const std::string& corrupt) {
    v1::ReleaseSlotRequest req;
    req.set_session_id(session_->id());
    req.set_slot(resp.slot());
    req.set_generation(resp.generation());
    req.set_corrupt(corrupt);
    v1::ReleaseSlotResponse released;
    grpc::ClientContext ctx;
    RawDeadline(&ctx);
    return stub_->ReleaseSlot(&ctx, req, &released);
  }
  uint32_t memory_slot_ = 0;
};

TEST_F(ClientVerificationTest, AClientThatVerifiesGetsEveryChunksChecksumAndAnOldClientAVerifiedSlot) {
  SetUpSteps();
  v1::RestoreResponse resp;
  grpc::Status s = RestoreHeld(/*verify_in_client=*/true, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(resp.found());
  EXPECT_EQ(resp.step(), 2);
  EXPECT_EQ(resp.tier(), v1::TIER_MEMORY);
  EXPECT_EQ(resp.slot(), memory_slot_);
  const uint64_t chunk = resp.chunk_bytes();
  ASSERT_GT(chunk, 0u);
  ASSERT_EQ(resp.chunk_sums_size(), reg_.placements_size());
  for (const v1::TensorChunkSums& t : resp.chunk_sums()) {
    bool placed = false;
    for (const auto& p : reg_.placements()) placed = placed || (p.slot_offset() == t.slot_offset() && p.bytes() == t.bytes());
    EXPECT_TRUE(placed) << "checksums for bytes " << t.slot_offset() << "+" << t.bytes() << " of no tensor";
    ASSERT_EQ(static_cast<uint64_t>(t.sums_size()), (t.bytes() + chunk - 1) / chunk);
    ASSERT_GT(t.sums_size(), 1) << "each tensor spans several chunks";
    for (int k = 0; k < t.sums_size(); ++k) {
      const uint64_t from = static_cast<uint64_t>(k) * chunk;
      EXPECT_EQ(t.sums(k), Xxh3(Slot(resp.slot()) + t.slot_offset() + from, std::min(chunk, t.bytes() - from)))
          << "chunk " << k;
    }
  }
  s = Release(resp, "");
  ASSERT_TRUE(s.ok()) << s.error_message();

  // A client that does not verify (an older one, or one restoring into device memory) gets the slot
  // verified by the daemon, and no checksums.
  v1::RestoreResponse plain;
  s = RestoreHeld(/*verify_in_client=*/false, &plain);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(plain.found());
  EXPECT_EQ(plain.tier(), v1::TIER_MEMORY);
  EXPECT_EQ(plain.chunk_bytes(), 0u);
  EXPECT_EQ(plain.chunk_sums_size(), 0);
  // A mismatch reported for a slot the daemon verified itself is not the client's to report: ignored.
  ASSERT_TRUE(Release(plain, "chunk 0 of tensor 'w' does not match").ok());
  v1::RestoreResponse kept;
  s = RestoreHeld(/*verify_in_client=*/true, &kept);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(kept.tier(), v1::TIER_MEMORY) << "a report about a daemon-verified slot dropped the checkpoint";
  ASSERT_TRUE(Release(kept, "").ok());
  // The daemon's verification still refuses a flipped byte: the restore reads the files instead.
  Slot(memory_slot_)[Placement("w").slot_offset() + 5] ^= 0x01;
  v1::RestoreResponse fallback;
  s = RestoreHeld(/*verify_in_client=*/false, &fallback);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(fallback.found());
  EXPECT_EQ(fallback.step(), 1);
  EXPECT_EQ(fallback.tier(), v1::TIER_DISK);
  EXPECT_EQ(fallback.chunk_sums_size(), 0);
  ASSERT_TRUE(Release(fallback, "").ok());
}

TEST_F(ClientVerificationTest, AMismatchTheClientReportsDropsTheMemoryCheckpointAndTheNextRestoreReadsTheFiles) {
  SetUpSteps();
  auto events = d_.daemon()->events().Subscribe("stream");
  v1::RestoreResponse resp;
  grpc::Status s = RestoreHeld(/*verify_in_client=*/true, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(resp.tier(), v1::TIER_MEMORY);
  // A report goes into the log and an event: its first 1024 bytes, with anything that could forge a
  // log line or a logged value made '?'.
  s = Release(resp, "chunk 1 of tensor 'w'\n\"forged\"=\\ " + std::string(2000, 'x'));
  ASSERT_TRUE(s.ok()) << s.error_message();

  DaemonEvent event;
  bool seen = false;
  while (!seen && events->Next(&event, std::chrono::steady_clock::now() + 5s) == EventHub::Wait::kEvent) {
    if (event.kind != DaemonEvent::Kind::kMemoryFallback) continue;
    seen = true;
    EXPECT_EQ(event.step, 2);
    EXPECT_NE(event.reason.find("found by the client"), std::string::npos) << event.reason;
    EXPECT_NE(event.reason.find("chunk 1 of tensor 'w'??forged?=? xxx"), std::string::npos) << event.reason;
    EXPECT_EQ(event.reason.find(std::string(1024, 'x')), std::string::npos) << "the report was not cut";
  }
  EXPECT_TRUE(seen) << "no memory-fallback event";
  EXPECT_NE(d_.daemon()->RenderMetrics().find("flashckpt_memory_fallbacks_total{job=\"stream\"} 1"), std::string::npos)
      << d_.daemon()->RenderMetrics();
  v1::RestoreResponse again;
  s = RestoreHeld(/*verify_in_client=*/true, &again);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(again.found());
  EXPECT_EQ(again.step(), 1);
  EXPECT_EQ(again.tier(), v1::TIER_DISK);
  EXPECT_EQ(again.chunk_sums_size(), 0);
  EXPECT_EQ(Slot(again.slot())[Placement("w").slot_offset()], 'd');
  ASSERT_TRUE(Release(again, "").ok());
}

}  // namespace
}  // namespace flashckpt
