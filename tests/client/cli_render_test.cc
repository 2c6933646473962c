// What `flashckpt status`, `inspect`, `delete`/`gc` and the reshard progress line show operators
// and scripts, from hand-built answers (the structs of flashckpt/admin.h) and metadata.
#include <gtest/gtest.h>

#include <string>

#include "client/cli/render.h"

namespace flashckpt::cli {
namespace {

// Job "llama": rank 0 keeps an EMA, rank 1 holds only replicas (no EMA tensors).
DaemonStatus TwoRankStatus() {
  DaemonStatus s;
  s.version = "0.1.0";
  s.uptime_seconds = 75;
  s.host_memory_used = 3ull << 30;
  s.host_memory_budget = 8ull << 30;
  s.root = "/var/lib/flashckpt";
  JobStatus& job = s.jobs.emplace_back();
  job.job = "llama";
  job.world_size = 2;
  job.last_complete_step = 1200;
  RankStatus& r0 = job.ranks.emplace_back();
  r0.rank = 0;
  r0.connected = true;
  r0.last_committed_step = 1250;
  r0.last_persisted_step = 1200;
  r0.ema_enabled = true;
  r0.ema_decay = 0.9999;
  r0.ema_last_step = 1250;
  r0.ema_updates_applied = 117;
  r0.ema_updates_skipped = 8;
  r0.ema_bytes = 48ull << 20;
  RankStatus& r1 = job.ranks.emplace_back();
  r1.rank = 1;
  r1.connected = true;
  r1.last_committed_step = -1;
  r1.last_persisted_step = -1;
  r1.ema_last_step = -1;
  return s;
}

TEST(StatusText, OneLinePerJobWithLagRateAndFailures) {
  DaemonStatus s = TwoRankStatus();
  s.jobs[0].ranks[0].last_persist_gbps = 4.0;
  s.jobs[0].ranks[1].last_persist_gbps = 2.5;
  s.jobs[0].ranks[1].failures = 3;
  std::string text = StatusText(s);
  EXPECT_NE(text.find("JOB    RANKS  COMMITTED  DURABLE  LAG  PERSIST GB/s  EMA  FAILURES\n"
                      "llama    2/2       1250     1200   50          3.25  on          3\n"),
            std::string::npos)
      << text;
  auto j = StatusJson(s);
  EXPECT_EQ(j["jobs"][0]["last_committed_step"], 1250);
  EXPECT_DOUBLE_EQ(j["jobs"][0]["ranks"][1]["last_persist_gbps"].get<double>(), 2.5);
}

TEST(StatusText, ShowsEachRanksMemoryCheckpointsOnlyWhenKept) {
  DaemonStatus s = TwoRankStatus();
  EXPECT_EQ(StatusText(s).find("memory checkpoints"), std::string::npos) << StatusText(s);
  EXPECT_TRUE(StatusJson(s)["jobs"][0]["ranks"][0]["memory_step"].is_null());
  s.jobs[0].ranks[0].memory_step = 1249;
  s.jobs[0].ranks[0].memory_checkpoints = 2;
  s.jobs[0].ranks[0].memory_bytes = 3ull << 20;
  const std::string text = StatusText(s);
  EXPECT_NE(text.find("  memory checkpoints: rank 0 step 1249 (2 kept, 3.0MiB)\n"), std::string::npos) << text;
  auto j = StatusJson(s);
  EXPECT_EQ(j["jobs"][0]["ranks"][0]["memory_step"], 1249);
  EXPECT_EQ(j["jobs"][0]["ranks"][0]["memory_checkpoints"], 2);
  EXPECT_EQ(j["jobs"][0]["ranks"][0]["memory_bytes"], 3u << 20);
}

TEST(StatusText, JobLineBeforeAnyCommit) {
  DaemonStatus s = TwoRankStatus();
  s.jobs[0].last_complete_step = -1;
  s.jobs[0].ranks[0].last_committed_step = -1;
  std::string text = StatusText(s);
  EXPECT_NE(text.find("llama    2/2          -        -    -             -  on          0\n"), std::string::npos)
      << text;
}

TEST(EventText, OneLinePerEventWithItsFields) {
  DaemonEvent e;
  e.kind = DaemonEvent::Kind::kPersisted;
  e.unix_seconds = 1795396354.805;  // 2026-11-23T01:12:34.805Z
  e.job = "llama";
  e.step = 1200;
  e.rank = 3;
  e.bytes = 4000000000;
  e.seconds = 2.0;
  EXPECT_EQ(EventText(e),
            "2026-11-23T01:12:34.805Z persisted   job=llama step=1200 rank=3 bytes=3.7GiB secs=2.00 gbps=2.00");
  EXPECT_DOUBLE_EQ(EventJson(e)["gbps"].get<double>(), 2.0);
  e.kind = DaemonEvent::Kind::kPersistFailed;
  e.code = "IO_ERROR";
  e.reason = "write x: Input/output error (errno 5)";
  EXPECT_EQ(EventText(e),
            "2026-11-23T01:12:34.805Z failed      job=llama step=1200 rank=3 code=IO_ERROR "
            "error=\"write x: Input/output error (errno 5)\"");
  EXPECT_EQ(EventJson(e)["code"], "IO_ERROR");
  e.kind = DaemonEvent::Kind::kMemoryFallback;
  e.code.clear();
  e.reason = "chunk 0 of w: checksum mismatch";
  EXPECT_EQ(EventText(e), "2026-11-23T01:12:34.805Z memory-fallback job=llama step=1200 rank=3 "
                          "reason=\"chunk 0 of w: checksum mismatch\"");
  DaemonEvent lost;
  lost.kind = DaemonEvent::Kind::kEventsLost;
  lost.unix_seconds = 1795396354.805;
  lost.lost = 6;
  EXPECT_EQ(EventText(lost), "2026-11-23T01:12:34.805Z lost        6 event(s) dropped: this watcher fell behind");
}

TEST(StatusText, ShowsTheEmaOfEachRank) {
  std::string text = StatusText(TwoRankStatus());
  EXPECT_NE(text.find("  ema on for 1 of 2 rank(s) here, decay 0.9999\n"), std::string::npos) << text;
  EXPECT_NE(text.find("  RANK  EMA   DECAY  EMA STEP  APPLIED  SKIPPED  EMA SIZE\n"), std::string::npos) << text;
  EXPECT_NE(text.find("   0  on   0.9999      1250      117        8  48.0 MiB\n"), std::string::npos) << text;
  EXPECT_NE(text.find("   1  off       -         -        -        -         -\n"), std::string::npos) << text;
}

TEST(StatusText, JobWithoutEmaSaysOffAndHasNoEmaTable) {
  DaemonStatus s = TwoRankStatus();
  s.jobs[0].ranks[0].ema_enabled = false;
  std::string text = StatusText(s);
  EXPECT_NE(text.find("  ema off\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("EMA STEP"), std::string::npos) << text;
}

TEST(StatusText, EmaWithoutUpdateYetShowsDash) {
  DaemonStatus s = TwoRankStatus();
  RankStatus& r0 = s.jobs[0].ranks[0];
  r0.ema_last_step = -1;
  r0.ema_updates_applied = 0;
  r0.ema_updates_skipped = 0;
  std::string text = StatusText(s);
  EXPECT_NE(text.find("   0  on   0.9999         -        0        0  48.0 MiB\n"), std::string::npos) << text;
}

// OLDEST WRITE: how long the rank's oldest persist in flight has run; "-" when none (0).
TEST(StatusText, ShowsHowLongTheOldestWriteHasRun) {
  DaemonStatus s = TwoRankStatus();
  s.jobs[0].ranks[0].oldest_write_seconds = 2.34;
  std::string text = StatusText(s);
  EXPECT_NE(text.find("  RANK  CONNECTED  MEMORY  COMMITTED  PERSISTED  SLOTS  OLDEST WRITE  SNAPSHOTS  PERSISTS  "
                      "FAILURES  SKIPPED  LAST ERROR\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("     0  yes           0 B       1250       1200  -              2.3s          0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("     1  yes           0 B          -          -  -                 -          0"),
            std::string::npos)
      << text;
  s.jobs[0].ranks[0].oldest_write_seconds = 125;  // a stuck disk: minutes
  text = StatusText(s);
  EXPECT_NE(text.find("  -            2m 05s          0"), std::string::npos) << text;
}

TEST(StatusText, SaysWhetherTheDaemonHasCuda) {
  DaemonStatus s = TwoRankStatus();
  EXPECT_NE(StatusText(s).find("\ncuda    not compiled in\n"), std::string::npos) << StatusText(s);
  s.cuda_compiled = true;
  EXPECT_NE(StatusText(s).find("\ncuda    compiled in, no device\n"), std::string::npos) << StatusText(s);
  s.cuda_devices = 8;
  EXPECT_NE(StatusText(s).find("\ncuda    compiled in, 8 devices\n"), std::string::npos) << StatusText(s);
  auto j = StatusJson(s);
  EXPECT_TRUE(j["cuda_compiled"].get<bool>());
  EXPECT_EQ(j["cuda_devices"].get<int>(), 8);
}

TEST(StatusJson, OldestWriteSecondsIsZeroWhenNothingIsBeingWritten) {
  DaemonStatus s = TwoRankStatus();
  s.jobs[0].ranks[0].oldest_write_seconds = 2.5;
  auto j = StatusJson(s);
  EXPECT_DOUBLE_EQ(j["jobs"][0]["ranks"][0]["oldest_write_seconds"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(j["jobs"][0]["ranks"][1]["oldest_write_seconds"].get<double>(), 0.0);
}

TEST(StatusJson, EveryRankHasAnEmaObjectWithTheSameKeys) {
  auto j = StatusJson(TwoRankStatus());
  const auto& ranks = j["jobs"][0]["ranks"];
  ASSERT_EQ(ranks.size(), 2u);
  const auto& on = ranks[0]["ema"];
  EXPECT_EQ(on["enabled"], true);
  EXPECT_DOUBLE_EQ(on["decay"].get<double>(), 0.9999);
  EXPECT_EQ(on["last_step"], 1250);
  EXPECT_EQ(on["updates_applied"], 117);
  EXPECT_EQ(on["updates_skipped"], 8);
  EXPECT_EQ(on["bytes"], 48ull << 20);
  const auto& off = ranks[1]["ema"];
  EXPECT_EQ(off["enabled"], false);
  EXPECT_TRUE(off["decay"].is_null());
  EXPECT_TRUE(off["last_step"].is_null());
  EXPECT_EQ(off["updates_applied"], 0);
  EXPECT_EQ(off["bytes"], 0);
  std::vector<std::string> keys_on, keys_off;
  for (const auto& [k, v] : on.items()) keys_on.push_back(k);
  for (const auto& [k, v] : off.items()) keys_off.push_back(k);
  EXPECT_EQ(keys_on, keys_off);
}

TEST(StatusJson, EmaWithoutUpdateYetHasNullLastStep) {
  DaemonStatus s = TwoRankStatus();
  s.jobs[0].ranks[0].ema_last_step = -1;
  auto j = StatusJson(s);
  EXPECT_TRUE(j["jobs"][0]["ranks"][0]["ema"]["last_step"].is_null());
  EXPECT_EQ(j["jobs"][0]["ranks"][0]["ema"]["enabled"], true);
}

// A (tp 2) checkpoint: one weight cut in two row blocks with its EMA, one optimizer state.
CheckpointMetadata TwoRankMetadata() {
  CheckpointMetadata m;
  m.job = "llama";
  m.step = 1200;
  m.topology.world_size = 2;
  m.topology.tp_degree = 2;
  for (uint32_t r = 0; r < 2; ++r) {
    m.files.push_back({"model_state.tp0" + std::to_string(r) + "_pp00_shard00.safetensors", r, r, 0, 0, 20480});
    Piece w;
    w.key = "w";
    w.kind = TensorKind::kModel;
    w.dtype = DType::kBF16;
    w.shape = {64, 64};
    w.global_shape = {128, 64};
    w.box_offset = {64ull * r, 0};
    w.box_shape = {64, 64};
    w.file = m.files.back().name;
    w.begin = 4096;
    w.end = 4096 + 64 * 64 * 2;
    m.pieces.push_back(w);
    Piece e = w;
    e.kind = TensorKind::kEma;
    e.dtype = DType::kF32;
    e.file = "ema.tp0" + std::to_string(r) + "_pp00_shard00.safetensors";
    e.end = 4096 + 64 * 64 * 4;
    m.pieces.push_back(e);
  }
  Piece o;
  o.key = "w.exp_avg";
  o.kind = TensorKind::kOptimizer;
  o.dtype = DType::kF32;
  o.shape = {100};
  o.global_shape = {128, 64};
  o.box_offset = {0, 0};
  o.box_shape = {64, 64};
  o.flat_range = FlatRange{0, 100};
  o.file = "optimizer.tp00_pp00_shard00.safetensors";
  o.begin = 4096;
  o.end = 4496;
  m.pieces.push_back(o);
  EmaRecord ema;
  ema.decay = 0.9999;
  ema.interval = 10;
  ema.init = "first";
  ema.model_params = "all";
  ema.updates_applied = 120;
  ema.last_step = 1200;
  m.ema = ema;
  return m;
}

// An incomplete step names the ranks that have not signalled and the node each wrote from last;
// a complete one the nodes that wrote it.
TEST(ListText, NamesTheMissingRanksAndTheirLastNodes) {
  std::vector<CheckpointInfo> list(2);
  list[0].job = list[1].job = "llama";
  list[0].step = 10;
  list[0].complete = true;
  list[0].latest = true;
  list[0].world_size = 3;
  list[0].signals = 3;
  list[0].signalled = {{0, "gpu-a", "r1", 0}, {1, "gpu-a", "r1", 0}, {2, "gpu-b", "r1", 0}};
  list[1].step = 20;
  list[1].world_size = 3;
  list[1].signals = 1;
  list[1].signalled = {{1, "gpu-a", "r1", 0}};
  const std::string text = ListText(list);
  std::string row10, row20;
  for (size_t at = 0, end; at < text.size(); at = end + 1) {
    end = text.find('\n', at);
    const std::string line = text.substr(at, end - at);
    if (line.rfind("llama", 0) == 0 && line.find(" 10 ") != std::string::npos) row10 = line;
    if (line.rfind("llama", 0) == 0 && line.find(" 20 ") != std::string::npos) row20 = line;
  }
  EXPECT_NE(row10.find("gpu-a,gpu-b"), std::string::npos) << text;
  EXPECT_NE(row20.find("1/3"), std::string::npos) << text;
  EXPECT_NE(row20.find("0@gpu-a,2@gpu-b"), std::string::npos) << text;
  auto j = ListJson(list);
  EXPECT_EQ(j[1]["missing"].size(), 2u);
  EXPECT_EQ(j[1]["missing"][1]["rank"], 2);
  EXPECT_EQ(j[1]["missing"][1]["last_node"], "gpu-b");
  EXPECT_TRUE(j[0]["missing"].empty());
  EXPECT_NE(row10.find("r1 (fresh)"), std::string::npos) << text;
  EXPECT_FALSE(j[0]["split"].get<bool>());
}

// A step every rank signalled, in different attempts, is split: it never completes, and the list
// says so with the runs and their ranks.
TEST(ListText, NamesASplitStepWithItsRunsAndRanks) {
  std::vector<CheckpointInfo> list(1);
  list[0].job = "llama";
  list[0].step = 30;
  list[0].world_size = 3;
  list[0].signals = 3;
  list[0].signalled = {{0, "gpu-a", "a1", 0}, {1, "gpu-a", "a1", 0}, {2, "gpu-b", "b2", 20}};
  const std::string text = ListText(list);
  EXPECT_NE(text.find("no (split)"), std::string::npos) << text;
  EXPECT_NE(text.find("split: a1 (fresh) ranks 0-1; b2 (resumed from 20) ranks 2"), std::string::npos) << text;
  auto j = ListJson(list);
  EXPECT_TRUE(j[0]["split"].get<bool>());
  ASSERT_EQ(j[0]["runs"].size(), 2u);
  EXPECT_EQ(j[0]["runs"][1]["run_id"], "b2");
  EXPECT_EQ(j[0]["runs"][1]["resumed_from"], 20);
  EXPECT_EQ(j[0]["runs"][0]["ranks"], nlohmann::ordered_json({0, 1}));
  // Not every rank yet: not a split (the rest may still be saving it in the same attempt).
  list[0].signalled.pop_back();
  list[0].signals = 2;
  EXPECT_EQ(ListText(list).find("split"), std::string::npos) << ListText(list);
}

TEST(InspectText, ShowsTopologyEmaFilesAndOneRowPerTensorAndKind) {
  std::string text = InspectText("/ck/llama/checkpoint-1200", TwoRankMetadata(), {{0, "gpu-a", "r1", 0}, {1, "gpu-b", "r1", 0}});
  EXPECT_NE(text.find("nodes       gpu-a (rank 0), gpu-b (rank 1)\n"), std::string::npos) << text;
  EXPECT_NE(text.find("topology    world size 2: tp 2 x pp 1 x shard 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("run         (no run id) (fresh)\n"), std::string::npos) << text;
  CheckpointMetadata resumed = TwoRankMetadata();
  resumed.run_id = "r7";
  resumed.resumed_from = 100;
  const std::string text2 = InspectText("/ck/llama/checkpoint-1200", resumed, {});
  EXPECT_NE(text2.find("run         r7 (resumed from 100)\n"), std::string::npos) << text2;
  EXPECT_EQ(InspectJson("d", resumed, {})["run"]["run_id"], "r7");
  EXPECT_NE(text.find("ema         decay 0.9999, interval 10, init first, model params all; 120 updates applied, 0 "
                      "skipped, last at step 1200\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("size        2 files, 40.0 KiB; 3 tensors in 5 pieces\n"), std::string::npos) << text;
  EXPECT_NE(text.find("model_state.tp01_pp00_shard00.safetensors     1   1   0      0  gpu-b  20.0 KiB\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("TENSOR     KIND       DTYPE  GLOBAL SHAPE  PIECES     BYTES\n"), std::string::npos) << text;
  EXPECT_NE(text.find("w          model      BF16   [128, 64]          2  16.0 KiB\n"), std::string::npos) << text;
  EXPECT_NE(text.find("w.exp_avg  optimizer  F32    [128, 64]          1     400 B\n"), std::string::npos) << text;
  EXPECT_NE(text.find("w          ema        F32    [128, 64]          2  32.0 KiB\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("disagree"), std::string::npos) << text;
}

TEST(InspectText, FlagsPiecesThatDisagreeOnDtype) {
  CheckpointMetadata m = TwoRankMetadata();
  m.pieces[2].dtype = DType::kF16;  // rank 1's piece of w
  std::string text = InspectText("d", m, {});
  EXPECT_NE(text.find("nodes       not recorded\n"), std::string::npos) << text;
  EXPECT_NE(text.find("w          model      BF16*"), std::string::npos) << text;
  EXPECT_NE(text.find("* pieces disagree on dtype or global shape"), std::string::npos) << text;
}

TEST(InspectJson, CountsTensorsPiecesAndBytes) {
  auto j = InspectJson("d", TwoRankMetadata(), {{0, "gpu-a", "r1", 0}, {1, "", "r1", 0}});
  EXPECT_EQ(j["signalled"][0]["node"], "gpu-a");
  EXPECT_TRUE(j["signalled"][1]["node"].is_null());
  EXPECT_EQ(j["topology"]["world_size"], 2);
  EXPECT_EQ(j["topology"]["tp_degree"], 2);
  EXPECT_EQ(j["tensors"].size(), 3u);
  EXPECT_EQ(j["totals"]["tensors"], 3);
  EXPECT_EQ(j["totals"]["pieces"], 5);
  EXPECT_EQ(j["totals"]["file_bytes"], 40960);
  EXPECT_EQ(j["totals"]["tensor_bytes"], 2 * 8192 + 2 * 16384 + 400);
  EXPECT_DOUBLE_EQ(j["ema"]["decay"].get<double>(), 0.9999);
  EXPECT_TRUE(j["ema"]["loss_threshold"].is_null());
  const auto& opt = j["tensors"][1];
  EXPECT_EQ(opt["name"], "w.exp_avg");
  EXPECT_EQ(opt["pieces"][0]["flat_range"], nlohmann::ordered_json({0, 100}));
  EXPECT_TRUE(j["tensors"][0]["pieces"][0]["flat_range"].is_null());
  CheckpointMetadata no_ema = TwoRankMetadata();
  no_ema.ema.reset();
  EXPECT_TRUE(InspectJson("d", no_ema, {})["ema"].is_null());
}

TEST(DeleteText, NamesDeletedAndSkippedStepsAndTheLatest) {
  DeleteResult r;
  r.deleted = {100, 200};
  r.skipped.push_back({300, "in use (a restore reading it or a save writing it)"});
  r.latest = 500;
  EXPECT_EQ(DeleteText("llama", r, false),
            "deleted llama/checkpoint-100\ndeleted llama/checkpoint-200\n"
            "skipped llama/checkpoint-300: in use (a restore reading it or a save writing it)\n"
            "latest  checkpoint-500\n");
  EXPECT_EQ(DeleteText("llama", r, true).rfind("would delete llama/checkpoint-100\n", 0), 0u);
  DeleteResult none;
  none.latest = -1;
  EXPECT_EQ(DeleteText("j", none, false), "deleted nothing of job j\nlatest  none (no complete checkpoint left)\n");
  auto j = DeleteJson("j", none, false);
  EXPECT_TRUE(j["latest"].is_null());
  EXPECT_TRUE(j["deleted"].empty());
}

TEST(ProgressText, ShowsBytesRateAndEta) {
  EXPECT_EQ(ProgressText(0, 4ull << 30, 0.5), "0 B of 4.0 GiB (0%)");
  EXPECT_EQ(ProgressText(1ull << 30, 4ull << 30, 1.0), "1.0 GiB of 4.0 GiB (25%), 1.07 GB/s, ETA 3s");
  EXPECT_EQ(ProgressText(5ull << 30, 4ull << 30, 2.0), "4.0 GiB of 4.0 GiB (100%), 2.15 GB/s");
}

}  // namespace
}  // namespace flashckpt::cli
