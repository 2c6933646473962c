// The gRPC edge's translation (daemon/edge/wire.*): a registration survives its record, every event
// kind and every status field reaches the message the service sends.
#include <gtest/gtest.h>

#include <set>

#include "daemon/edge/registration.h"
#include "daemon/edge/wire.h"
#include "testing.h"

namespace flashckpt {
namespace {

TEST(Wire, ARegistrationRecordParsesBackToTheSameRegistration) {
  Registration r;
  r.topology = Topology{8, 1, 2, 1, 2, 1, 2};
  TensorSpec w;
  w.name = "layers.0.w";
  w.kind = TensorKind::kModel;
  w.dtype = DType::kBF16;
  w.shape = {64, 32};
  w.global_shape = {128, 32};
  w.box_offset = {64, 0};
  w.replica = true;
  TensorSpec master;
  master.name = "layers.0.w.master";
  master.kind = TensorKind::kMasterWeight;
  master.dtype = DType::kF32;
  master.shape = {1024};
  master.global_shape = {128, 32};
  master.box_offset = {64, 0};
  master.box_shape = {64, 32};
  master.flat_range = FlatRange{1024, 2048};
  master.param = "layers.0.w";
  TensorSpec moment = master;
  moment.name = "layers.0.w.exp_avg";
  moment.kind = TensorKind::kOptimizer;
  moment.param.clear();
  r.tensors = {w, master, moment};
  r.policy = Backpressure::kSkip;
  r.ema.enabled = true;
  r.ema.decay = 0.999;
  r.ema.interval = 4;
  r.ema.init_zeros = true;
  r.ema.all_float_params = true;
  r.ema.loss_threshold = 7.5;
  r.resumed_from = 300;  // per session: not part of the record
  r.fatal_persist_errors = true;

  v1::RegisterRequest record = RegistrationRecord(r);
  EXPECT_EQ(record.resumed_from(), 0);
  EXPECT_TRUE(record.session_id().empty());
  auto back = ParseRegistration(record);
  ASSERT_OK(back.status());
  const Registration& b = *back;
  EXPECT_EQ(b.topology.world_size, 8u);
  EXPECT_EQ(b.topology.tp_degree, 2u);
  EXPECT_EQ(b.topology.pp_degree, 2u);
  EXPECT_EQ(b.topology.shard_rank, 1u);
  ASSERT_EQ(b.tensors.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(r.tensors[i].name);
    EXPECT_EQ(b.tensors[i].name, r.tensors[i].name);
    EXPECT_EQ(b.tensors[i].kind, r.tensors[i].kind);
    EXPECT_EQ(b.tensors[i].dtype, r.tensors[i].dtype);
    EXPECT_EQ(b.tensors[i].shape, r.tensors[i].shape);
    EXPECT_EQ(b.tensors[i].global_shape, r.tensors[i].global_shape);
    EXPECT_EQ(b.tensors[i].box_offset, r.tensors[i].box_offset);
    EXPECT_EQ(b.tensors[i].box_shape, r.tensors[i].box_shape);
    EXPECT_EQ(b.tensors[i].flat_range.has_value(), r.tensors[i].flat_range.has_value());
    if (b.tensors[i].flat_range && r.tensors[i].flat_range) {
      EXPECT_EQ(b.tensors[i].flat_range->begin, r.tensors[i].flat_range->begin);
      EXPECT_EQ(b.tensors[i].flat_range->end, r.tensors[i].flat_range->end);
    }
    EXPECT_EQ(b.tensors[i].replica, r.tensors[i].replica);
    EXPECT_EQ(b.tensors[i].param, r.tensors[i].param);
  }
  EXPECT_EQ(b.policy, Backpressure::kSkip);
  EXPECT_TRUE(b.ema.enabled);
  EXPECT_EQ(b.ema.decay, 0.999);
  EXPECT_EQ(b.ema.interval, 4u);
  EXPECT_TRUE(b.ema.init_zeros);
  EXPECT_TRUE(b.ema.all_float_params);
  ASSERT_TRUE(b.ema.loss_threshold.has_value());
  EXPECT_EQ(*b.ema.loss_threshold, 7.5);
  EXPECT_EQ(b.resumed_from, 0);
  EXPECT_TRUE(b.fatal_persist_errors);

  // Without EMA, the record has none either.
  r.ema = EmaConfig{};
  auto plain = ParseRegistration(RegistrationRecord(r));
  ASSERT_OK(plain.status());
  EXPECT_FALSE(plain->ema.enabled);
}

TEST(Wire, EveryEventKindHasItsOwnMessageKind) {
  const DaemonEvent::Kind kinds[] = {DaemonEvent::Kind::kSnapshotCommitted, DaemonEvent::Kind::kSnapshotSkipped,
                               DaemonEvent::Kind::kEmaUpdated,        DaemonEvent::Kind::kPersisted,
                               DaemonEvent::Kind::kPersistFailed,     DaemonEvent::Kind::kCheckpointComplete,
                               DaemonEvent::Kind::kCheckpointDeleted, DaemonEvent::Kind::kEventsLost,
                               DaemonEvent::Kind::kPersistAbandoned,  DaemonEvent::Kind::kJobReleased};
  std::set<int> seen;
  for (DaemonEvent::Kind kind : kinds) {
    DaemonEvent e;
    e.kind = kind;
    const v1::Event m = ToProto(e);
    EXPECT_NE(m.kind(), v1::Event::KIND_UNSPECIFIED);
    seen.insert(m.kind());
  }
  EXPECT_EQ(seen.size(), std::size(kinds));

  DaemonEvent e;
  e.kind = DaemonEvent::Kind::kPersistFailed;
  e.unix_seconds = 1.8e9;
  e.job = "llama";
  e.rank = 3;
  e.step = 40;
  e.bytes = 1 << 20;
  e.seconds = 0.25;
  e.reason = "No space left on device";
  e.lost = 2;
  e.code = "RESOURCE_EXHAUSTED";
  const v1::Event m = ToProto(e);
  EXPECT_EQ(m.kind(), v1::Event::PERSIST_FAILED);
  EXPECT_EQ(m.unix_seconds(), 1.8e9);
  EXPECT_EQ(m.job(), "llama");
  EXPECT_EQ(m.rank(), 3u);
  EXPECT_EQ(m.step(), 40);
  EXPECT_EQ(m.bytes(), 1u << 20);
  EXPECT_EQ(m.seconds(), 0.25);
  EXPECT_EQ(m.reason(), "No space left on device");
  EXPECT_EQ(m.lost(), 2u);
  EXPECT_EQ(m.code(), "RESOURCE_EXHAUSTED");
}

TEST(Wire, StatusAndRegisterReplyReachTheirMessages) {
  DaemonStatus s;
  s.version = "1.2.3";
  s.uptime_seconds = 12;
  s.host_memory_used = 100;
  s.host_memory_budget = 200;
  s.root = "/ckpt";
  s.cuda_compiled = true;
  s.cuda_devices = 8;
  JobStatus& j = s.jobs.emplace_back();
  j.job = "llama";
  j.world_size = 2;
  j.last_complete_step = 30;
  j.catalog_error = "IO_ERROR: stat";
  RankStatus& r = j.ranks.emplace_back();
  r.rank = 1;
  r.connected = true;
  r.segment_bytes = 4096;
  r.last_committed_step = 31;
  r.last_persisted_step = 30;
  r.last_error = "disk full";
  r.snapshots = 5;
  r.persists = 4;
  r.failures = 1;
  r.skipped = 2;
  r.slots = {{0, "free", -1}, {1, "persisting", 31}};
  r.ema_enabled = true;
  r.ema_bytes = 512;
  r.ema_last_step = 31;
  r.ema_updates_applied = 6;
  r.ema_updates_skipped = 1;
  r.ema_decay = 0.99;
  r.oldest_write_seconds = 1.5;
  r.last_persist_gbps = 2.5;
  const v1::StatusResponse m = ToProto(s);
  EXPECT_EQ(m.version(), "1.2.3");
  EXPECT_EQ(m.uptime_seconds(), 12);
  EXPECT_EQ(m.host_memory_used(), 100u);
  EXPECT_EQ(m.host_memory_budget(), 200u);
  EXPECT_EQ(m.root(), "/ckpt");
  EXPECT_TRUE(m.cuda_compiled());
  EXPECT_EQ(m.cuda_devices(), 8);
  ASSERT_EQ(m.jobs_size(), 1);
  EXPECT_EQ(m.jobs(0).job(), "llama");
  EXPECT_EQ(m.jobs(0).world_size(), 2u);
  EXPECT_EQ(m.jobs(0).last_complete_step(), 30);
  EXPECT_EQ(m.jobs(0).catalog_error(), "IO_ERROR: stat");
  ASSERT_EQ(m.jobs(0).ranks_size(), 1);
  const v1::RankStatus& mr = m.jobs(0).ranks(0);
  EXPECT_EQ(mr.rank(), 1u);
  EXPECT_TRUE(mr.connected());
  EXPECT_EQ(mr.segment_bytes(), 4096u);
  EXPECT_EQ(mr.last_committed_step(), 31);
  EXPECT_EQ(mr.last_persisted_step(), 30);
  EXPECT_EQ(mr.last_error(), "disk full");
  EXPECT_EQ(mr.snapshots(), 5u);
  EXPECT_EQ(mr.persists(), 4u);
  EXPECT_EQ(mr.failures(), 1u);
  EXPECT_EQ(mr.skipped(), 2u);
  ASSERT_EQ(mr.slots_size(), 2);
  EXPECT_EQ(mr.slots(1).index(), 1u);
  EXPECT_EQ(mr.slots(1).state(), "persisting");
  EXPECT_EQ(mr.slots(1).step(), 31);
  EXPECT_TRUE(mr.ema_enabled());
  EXPECT_EQ(mr.ema_bytes(), 512u);
  EXPECT_EQ(mr.ema_last_step(), 31);
  EXPECT_EQ(mr.ema_updates_applied(), 6u);
  EXPECT_EQ(mr.ema_updates_skipped(), 1u);
  EXPECT_EQ(mr.ema_decay(), 0.99);
  EXPECT_EQ(mr.oldest_write_seconds(), 1.5);
  EXPECT_EQ(mr.last_persist_gbps(), 2.5);

  RegisterReply reply;
  reply.segment_name = "flashckpt.llama.1.abc";
  reply.segment_bytes = 1 << 20;
  reply.slot_count = 2;
  reply.slot_offset = 4096;
  reply.slot_stride = 8192;
  reply.placements = {{"w", "model_state.tp00_pp00_shard00", 4096, 128, true}};
  reply.ema_placements = {{"w", "ema.tp00_pp00_shard00", 6000, 256, false}};
  const v1::RegisterResponse rm = ToProto(reply);
  EXPECT_EQ(rm.segment_name(), "flashckpt.llama.1.abc");
  EXPECT_EQ(rm.segment_bytes(), 1u << 20);
  EXPECT_EQ(rm.slot_count(), 2u);
  EXPECT_EQ(rm.slot_offset(), 4096u);
  EXPECT_EQ(rm.slot_stride(), 8192u);
  ASSERT_EQ(rm.placements_size(), 1);
  EXPECT_EQ(rm.placements(0).file(), "model_state.tp00_pp00_shard00");
  EXPECT_EQ(rm.placements(0).slot_offset(), 4096u);
  EXPECT_EQ(rm.placements(0).bytes(), 128u);
  EXPECT_TRUE(rm.placements(0).ema_source());
  ASSERT_EQ(rm.ema_placements_size(), 1);
  EXPECT_EQ(rm.ema_placements(0).slot_offset(), 6000u);
}

}  // namespace
}  // namespace flashckpt
