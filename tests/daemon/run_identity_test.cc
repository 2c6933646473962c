// Runs and attempts:
// - a run has an identity (given, or drawn by the daemon and shared by the job's live ranks) that
//   signals, metadata.json, the EMA and status carry;
// - a fresh run never continues another run's EMA, and may not save into a job with another run's
//   complete checkpoints unless it asks to start a new lineage (overwrite);
// - a step that the ranks saved in different attempts is an error everyone sees (status, metrics,
//   an event, WaitComplete), and WaitComplete waits for the whole checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "client/cli/render.h"
#include "common/format/metadata.h"
#include "common/format/signal.h"
#include "in_process_daemon.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

std::string JobName(const std::string& base) { return base + "-" + std::to_string(::getpid()); }

// Waits (5 s at most) until no rank of `job` is connected: a client's session ends in the daemon
// when its stream closes, a moment after the client is gone.
void WaitDisconnected(const InProcessDaemon& d, const std::string& job) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    bool connected = false;
    for (const auto& j : d.daemon()->GetStatus().jobs) {
      for (const auto& r : j.ranks) connected = connected || (j.job == job && r.connected);
    }
    if (!connected) return;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "a rank of " << job << " is still connected";
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The daemon draws the run id: what a trainer that gives none gets.
void DrawnRun(ClientOptions& o) { o.run_id.clear(); }

// One rank of a job with an fp32 weight `w` of n floats and an EMA (decay 0.5, the first update
// copies the weights).
struct EmaRank {
  std::unique_ptr<Client> client;
  std::vector<float> w;
  Status Save(int64_t step, float value) {
    std::fill(w.begin(), w.end(), value);
    auto snap = client->Snapshot(step, {{"w", w.data(), w.size() * 4}}, {});
    if (!snap.ok()) return snap.status();
    return client->WaitPersisted(step, 10s);
  }
  // A snapshot for the EMA alone (persist=false): no checkpoint, so a later process of the run
  // may carry on without restoring (with a complete checkpoint it would be a fresh start).
  Status Update(int64_t step, float value) {
    std::fill(w.begin(), w.end(), value);
    SnapshotOptions only_ema;
    only_ema.persist = false;
    return client->Snapshot(step, {{"w", w.data(), w.size() * 4}}, only_ema).status();
  }
  // The daemon's EMA, element 0 (all elements are equal here).
  Result<float> Ema() {
    std::vector<float> got(w.size(), -1.f);
    ASSIGN_OR_RETURN(EmaResult r, client->Ema({{"w", got.data(), got.size() * 4}}, 5s));
    if (!r.initialized) return FailedPrecondition("no EMA yet");
    return got[0];
  }
};

EmaRank StartEmaRank(const InProcessDaemon& d, const std::string& job,
                     const std::function<void(ClientOptions&)>& tweak) {
  EmaRank r;
  r.client = d.Connect(job, 0, tweak);
  if (!r.client) return r;
  TensorSpec w;
  w.name = "w";
  w.shape = {256};
  EmaOptions ema;
  ema.decay = 0.5;
  EXPECT_OK(r.client->Register(Topology{}, {w}, ema));
  r.w.resize(256);
  return r;
}

nlohmann::json ReadJson(const std::string& path) {
  auto text = ReadSmallFile(path, 1u << 20);
  EXPECT_OK(text.status());
  return nlohmann::json::parse(text.ok() ? *text : "{}", nullptr, false);
}

// Two daemons on one host (two roots, two sockets, two state directories) that serve a job of the
// same name: each keeps its own average. Under one /dev/shm name for both, the second daemon adopted
// the first one's segment and each update of one moved the other's average.
TEST(RunTest, TwoDaemonsOnOneHostKeepTheirOwnEmaForAJobOfTheSameName) {
  const std::string job = JobName("ema-two");
  InProcessDaemon d1("flashckpt-run"), d2("flashckpt-run");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start());
  EXPECT_NE(d1.daemon()->EmaSegmentName(job, 0), d2.daemon()->EmaSegmentName(job, 0));
  {
    EmaRank a = StartEmaRank(d1, job, DrawnRun);
    EmaRank b = StartEmaRank(d2, job, DrawnRun);
    ASSERT_TRUE(a.client);
    ASSERT_TRUE(b.client);
    ASSERT_OK(a.Save(1, 1.f));
    ASSERT_OK(b.Save(1, 3.f));
    ASSERT_OK(a.Save(2, 1.f));
    ASSERT_OK(b.Save(2, 3.f));
    auto ema_a = a.Ema(), ema_b = b.Ema();
    ASSERT_OK(ema_a.status());
    ASSERT_OK(ema_b.status());
    EXPECT_EQ(*ema_a, 1.f) << "daemon 1's average moved with daemon 2's updates";
    EXPECT_EQ(*ema_b, 3.f) << "daemon 2's average moved with daemon 1's updates";
    EXPECT_EQ(EmaSegmentsOf(job).size(), 2u);
  }
  d1.Stop();
  d2.Stop();
  UnlinkEmaSegments(job);
}

// An upgrade: the daemon's predecessor, of a release that named EMA segments without a scope, kept
// "flashckpt.<job>.<rank>.ema" with a record in the state directory. The upgraded daemon adopts it
// under its own name, and the run's average carries on.
TEST(RunTest, AnEmaSegmentKeptUnderTheUnscopedNameByThePredecessorIsAdopted) {
  const std::string job = JobName("ema-upgrade");
  auto same_run = [](ClientOptions& o) { o.run_id = "upgrade-run"; };
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string scoped = d.daemon()->EmaSegmentName(job, 0), unscoped = "flashckpt." + job + ".0.ema";
  {
    EmaRank a = StartEmaRank(d, job, same_run);
    ASSERT_TRUE(a.client);
    ASSERT_OK(a.Update(1, 1.f));
  }
  WaitDisconnected(d, job);
  d.Stop();  // keeps the EMA segment, with a record, for its successor
  const std::string state = d.socket() + ".state";
  ASSERT_TRUE(std::filesystem::exists(state + "/" + scoped + ".kept"));
  // What the older release left: the same segment and record under the unscoped name.
  std::filesystem::rename("/dev/shm/" + scoped, "/dev/shm/" + unscoped);
  std::filesystem::rename(state + "/" + scoped + ".kept", state + "/" + unscoped + ".kept");

  ASSERT_OK(d.Start());
  {
    EmaRank b = StartEmaRank(d, job, same_run);
    ASSERT_TRUE(b.client);
    ASSERT_OK(b.Save(2, 3.f));
    auto ema = b.Ema();
    ASSERT_OK(ema.status());
    EXPECT_EQ(*ema, 2.f) << "0.5 * 1 + 0.5 * 3 when the kept average was adopted, 3 when it started afresh";
  }
  EXPECT_TRUE(std::filesystem::exists("/dev/shm/" + scoped)) << "not renamed to this daemon's name";
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + unscoped)) << "renamed, not copied or left behind";
  EXPECT_FALSE(std::filesystem::exists(state + "/" + unscoped + ".kept")) << "the old name's record stayed";
  d.Stop();
  UnlinkEmaSegments(job);
}

// An upgrade where the predecessor stopped while its trainer was connected: no record keeps the
// segment, but its average is of the run the rank registers in, so it is this daemon's; it is
// adopted and renamed to this daemon's name.
TEST(RunTest, AnUnscopedEmaSegmentOfTheRegisteringRunIsAdoptedAndRenamed) {
  const std::string job = JobName("ema-run-match");
  auto same_run = [](ClientOptions& o) { o.run_id = "match-run"; };
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string scoped = d.daemon()->EmaSegmentName(job, 0), unscoped = "flashckpt." + job + ".0.ema";
  {
    EmaRank a = StartEmaRank(d, job, same_run);
    ASSERT_TRUE(a.client);
    ASSERT_OK(a.Update(1, 1.f));
    d.Stop();  // the trainer is still connected: no kept-EMA record
  }
  const std::string state = d.socket() + ".state";
  ASSERT_FALSE(std::filesystem::exists(state + "/" + scoped + ".kept"));
  std::filesystem::rename("/dev/shm/" + scoped, "/dev/shm/" + unscoped);  // as the older release named it

  ASSERT_OK(d.Start());
  {
    EmaRank b = StartEmaRank(d, job, same_run);
    ASSERT_TRUE(b.client);
    ASSERT_OK(b.Save(2, 3.f));
    auto ema = b.Ema();
    ASSERT_OK(ema.status());
    EXPECT_EQ(*ema, 2.f) << "0.5 * 1 + 0.5 * 3 when the average was adopted, 3 when it started afresh";
  }
  EXPECT_TRUE(std::filesystem::exists("/dev/shm/" + scoped));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + unscoped)) << "renamed, not copied or left behind";
  d.Stop();
  UnlinkEmaSegments(job);
}

// Without a record of it and of another run, a segment under the unscoped name may be another
// daemon's: it is left alone, and the rank's average starts afresh under this daemon's name.
TEST(RunTest, AnUnscopedEmaSegmentThatNoRecordKeepsIsNotAdopted) {
  const std::string job = JobName("ema-stray");
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string scoped = d.daemon()->EmaSegmentName(job, 0), unscoped = "flashckpt." + job + ".0.ema";
  {
    EmaRank a = StartEmaRank(d, job, [](ClientOptions& o) { o.run_id = "stray-run"; });
    ASSERT_TRUE(a.client);
    ASSERT_OK(a.Save(1, 1.f));
  }
  d.Stop();
  const std::string state = d.socket() + ".state";
  std::filesystem::rename("/dev/shm/" + scoped, "/dev/shm/" + unscoped);
  std::filesystem::remove(state + "/" + scoped + ".kept");

  ASSERT_OK(d.Start());
  {
    EmaRank b = StartEmaRank(d, job, [](ClientOptions& o) {
      o.run_id = "another-run";
      o.overwrite = true;  // a new lineage of the job
    });
    ASSERT_TRUE(b.client);
    ASSERT_OK(b.Save(2, 3.f));
    auto ema = b.Ema();
    ASSERT_OK(ema.status());
    EXPECT_EQ(*ema, 3.f) << "an average nothing says is this daemon's was adopted";
  }
  EXPECT_TRUE(std::filesystem::exists("/dev/shm/" + unscoped)) << "another daemon's segment was touched";
  EXPECT_TRUE(std::filesystem::exists("/dev/shm/" + scoped));
  d.Stop();
  UnlinkEmaSegments(job);
}

// Which node wrote a rank's part is in its signal (with the layout's world size, so a listing can
// name the ranks a step still lacks), in status and in the listing.
TEST(RunTest, SignalsRecordTheDaemonsNodeAndTheWorldSize) {
  const std::string job = JobName("node");
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start([](DaemonConfig& c) { c.node_name = "gpu-node-7"; }));
  EmaRank a = StartEmaRank(d, job, DrawnRun);
  ASSERT_TRUE(a.client);
  ASSERT_OK(a.Save(1, 1.f));
  auto signal = ReadJson(d.StepDir(job, 1) + "/saved_signal_0");
  EXPECT_EQ(signal["node"], "gpu-node-7");
  EXPECT_EQ(signal["world_size"], 1);
  EXPECT_EQ(d.daemon()->GetStatus().node_name, "gpu-node-7");
  auto list = d.daemon()->List(job);
  ASSERT_OK(list.status());
  ASSERT_EQ(list->size(), 1u);
  ASSERT_EQ(list->at(0).signalled.size(), 1u);
  EXPECT_EQ(list->at(0).signalled[0].node, "gpu-node-7");
  a.client.reset();
  d.Stop();
  UnlinkEmaSegments(job);

  InProcessDaemon bad("flashckpt-run");
  Status s = bad.Start([](DaemonConfig& c) { c.node_name = "a/b"; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

// The daemon is the same one (its state directory, so its EMA segments' names), its root a new one:
// the old run's average is there to adopt by name, and the run id is what refuses it.
TEST(RunTest, AFreshRunOfAJobNameUsedBeforeStartsAFreshEmaEvenUnderANewDaemonAndRoot) {
  const std::string job = JobName("ema-run");
  InProcessDaemon state("flashckpt-run-state");  // holds the state directory both daemons use
  auto same_state = [&](DaemonConfig& c) { c.state_dir = state.dir() + "/state"; };
  std::string first_run, ema_segment;
  {
    InProcessDaemon d("flashckpt-run");
    ASSERT_OK(d.Start(same_state));
    ema_segment = d.daemon()->EmaSegmentName(job, 0);
    EmaRank a = StartEmaRank(d, job, DrawnRun);
    ASSERT_TRUE(a.client);
    first_run = a.client->RunId();
    EXPECT_EQ(first_run.size(), 16u) << "drawn by the daemon: " << first_run;
    ASSERT_OK(a.Save(1, 1.f));
    ASSERT_OK(a.Save(2, 1.f));
    EXPECT_EQ(*a.Ema(), 1.f);
    // The run is in the signal, metadata.json and status.
    EXPECT_EQ(ReadJson(d.StepDir(job, 2) + "/saved_signal_0")["run_id"], first_run);
    EXPECT_EQ(ReadJson(d.StepDir(job, 2) + "/metadata.json")["run_id"], first_run);
    EXPECT_EQ(d.daemon()->GetStatus().jobs.at(0).ranks.at(0).run_id, first_run);
  }  // the daemon stops; the EMA segment stays in /dev/shm for a successor
  ASSERT_TRUE(std::filesystem::exists("/dev/shm/" + ema_segment));

  // Another run of the same job name, under a new daemon with a new root: its average starts from
  // its own first snapshot (3.0), not from the old run's (which would give 0.5 * 1 + 0.5 * 3 = 2).
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start(same_state));
  ASSERT_EQ(d.daemon()->EmaSegmentName(job, 0), ema_segment);
  EmaRank b = StartEmaRank(d, job, DrawnRun);
  ASSERT_TRUE(b.client);
  EXPECT_NE(b.client->RunId(), first_run);
  ASSERT_OK(b.Save(5, 3.f));
  auto ema = b.Ema();
  ASSERT_OK(ema.status());
  EXPECT_EQ(*ema, 3.f);
  auto meta = ReadMetadataFile(d.StepDir(job, 5));
  ASSERT_OK(meta.status());
  ASSERT_TRUE(meta->ema.has_value());
  EXPECT_EQ(meta->ema->updates_applied, 1u) << "one snapshot, one update";
  EXPECT_EQ(meta->run_id, b.client->RunId());
  b.client.reset();
  UnlinkEmaSegments(job);
}

TEST(RunTest, AFreshStartIntoAJobWithAnotherRunsCheckpointsIsRefusedUnlessItOverwrites) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("lineage");
  {
    TestTrainer old = d.StartTrainer(job, 256, [](ClientOptions& o) { o.run_id = "old-run"; });
    ASSERT_TRUE(old.client);
    ASSERT_OK(old.Save(10));
    ASSERT_OK(old.Save(20));
    // The same process carries on across a daemon restart: its client re-attaches, and the new
    // daemon's first snapshot of the session finds the run's own checkpoints.
    d.Stop();
    ASSERT_OK(d.Start());
    ASSERT_OK(old.Save(30));
  }
  // A new process that reuses the run id without restoring is a fresh start: refused, naming the
  // run's checkpoint and the ways out; overwrite does not change that (it deletes other runs only).
  for (bool overwrite : {false, true}) {
    TestTrainer again = d.StartTrainer(job, 256, [&](ClientOptions& o) {
      o.run_id = "old-run";
      o.overwrite = overwrite;
    });
    ASSERT_TRUE(again.client);
    auto reused = again.Snapshot(40);
    ASSERT_EQ(reused.status().code(), StatusCode::kFailedPrecondition) << reused.status().ToString();
    for (const char* word : {"already has complete checkpoints of run old-run", "step 30", "earlier process",
                             "restore", "overwrite"}) {
      EXPECT_TRUE(Contains(reused.status().message(), word)) << "'" << word << "' in " << reused.status().ToString();
    }
    EXPECT_FALSE(std::filesystem::exists(d.StepDir(job, 40)));
  }
  for (int64_t step : {10, 20, 30}) EXPECT_TRUE(std::filesystem::exists(d.StepDir(job, step))) << step;
  // A fresh run is refused at its first snapshot, with the ways out named.
  TestTrainer fresh = d.StartTrainer(job, 256, DrawnRun);
  ASSERT_TRUE(fresh.client);
  auto refused = fresh.Snapshot(40);
  ASSERT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  for (const char* word : {"already has complete checkpoints", "step 30", "old-run", "restore", "another job name",
                           "overwrite"}) {
    EXPECT_TRUE(Contains(refused.status().message(), word)) << "'" << word << "' in " << refused.status().ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(d.StepDir(job, 40)));
  // After a restore it continues that lineage.
  auto restored = fresh.client->Restore(std::nullopt, fresh.bufs, 10s);
  ASSERT_OK(restored.status());
  EXPECT_EQ(restored->step, 30);
  ASSERT_OK(fresh.Save(40));
  EXPECT_EQ(ReadJson(d.StepDir(job, 40) + "/metadata.json")["resumed_from"], 30);
  fresh.client.reset();

  // overwrite starts a new lineage: the job's checkpoints of other runs go at its first snapshot.
  TestTrainer over = d.StartTrainer(job, 256, [](ClientOptions& o) {
    o.run_id = "new-run";
    o.overwrite = true;
  });
  ASSERT_TRUE(over.client);
  ASSERT_OK(over.Save(5));
  ASSERT_OK(over.client->WaitComplete(5, 10s));
  for (int64_t step : {10, 20, 30, 40}) EXPECT_FALSE(std::filesystem::exists(d.StepDir(job, step))) << step;
  auto latest = ReadSmallFile(d.JobDir(job) + "/LATEST", 100);
  ASSERT_OK(latest.status());
  EXPECT_EQ(*latest, "5\n");
  EXPECT_EQ(ReadJson(d.StepDir(job, 5) + "/metadata.json")["run_id"], "new-run");
}

// The lineage is what is on disk, not what LATEST says: with LATEST gone (or naming no checkpoint),
// a fresh run is still refused while another run's complete checkpoint exists, so it can never
// save steps that a later sweep would rank below the other run's, nor resume them.
TEST(RunTest, AFreshStartIsRefusedByAnotherRunsCheckpointEvenWithoutLatest) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("nolatest");
  {
    TestTrainer a = d.StartTrainer(job, 256, [](ClientOptions& o) { o.run_id = "run-a"; });
    ASSERT_TRUE(a.client);
    ASSERT_OK(a.Save(100));
    ASSERT_OK(a.Save(200));
  }
  ASSERT_TRUE(std::filesystem::remove(d.JobDir(job) + "/LATEST"));
  TestTrainer b = d.StartTrainer(job, 256, [](ClientOptions& o) { o.run_id = "run-b"; });
  ASSERT_TRUE(b.client);
  auto refused = b.Snapshot(10);
  ASSERT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  for (const char* word : {"already has complete checkpoints", "step 200", "run-a"}) {
    EXPECT_TRUE(Contains(refused.status().message(), word)) << "'" << word << "' in " << refused.status().ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(d.StepDir(job, 10)));
  b.client.reset();
  // LATEST naming a step that is gone changes nothing either.
  ASSERT_OK(WriteFileDurably(d.JobDir(job), "LATEST", "150\n"));
  TestTrainer c = d.StartTrainer(job, 256, [](ClientOptions& o) { o.run_id = "run-c"; });
  ASSERT_TRUE(c.client);
  auto again = c.Snapshot(10);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition) << again.status().ToString();
  EXPECT_TRUE(Contains(again.status().message(), "step 200")) << again.status().ToString();
}

TEST(RunTest, RanksThatGiveNoRunJoinTheLiveRunAndAnotherNamedRunIsRefused) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("join");
  auto register_rank = [&](uint32_t rank, const std::function<void(ClientOptions&)>& tweak) {
    auto c = d.Connect(job, rank, tweak);
    if (!c) return c;
    TensorSpec w;
    w.name = "w";
    w.shape = {16};
    w.global_shape = {32};
    w.box_offset = {rank * 16u};
    w.box_shape = {16};
    Topology t;
    t.world_size = 2;
    t.tp_degree = 2;
    t.tp_rank = rank;
    Status s = c->Register(t, {w});
    if (!s.ok()) {
      ADD_FAILURE() << s.ToString();
      return std::unique_ptr<Client>();
    }
    return c;
  };
  auto r0 = register_rank(0, DrawnRun);
  ASSERT_TRUE(r0);
  auto r1 = register_rank(1, DrawnRun);
  ASSERT_TRUE(r1);
  EXPECT_FALSE(r0->RunId().empty());
  EXPECT_EQ(r1->RunId(), r0->RunId()) << "the second rank joins the live run";
  r1.reset();
  // A rank naming another run is refused while rank 0 of the live run is connected.
  // (The daemon waits 5 s for the live rank to go first: the call's deadline must be longer.)
  auto other = d.Connect(job, 1, [](ClientOptions& o) {
    o.run_id = "someone-else";
    o.rpc_timeout = 20s;
  });
  ASSERT_TRUE(other);
  TensorSpec w;
  w.name = "w";
  w.shape = {16};
  w.global_shape = {32};
  w.box_offset = {16};
  w.box_shape = {16};
  Topology t;
  t.world_size = 2;
  t.tp_degree = 2;
  t.tp_rank = 1;
  Status refused = other->Register(t, {w});
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
  EXPECT_TRUE(Contains(refused.message(), "run " + r0->RunId())) << refused.ToString();
  EXPECT_TRUE(Contains(refused.message(), "someone-else")) << refused.ToString();
}

TEST(RunTest, WaitPersistedOfANewProcessIsNotAnsweredByItsPredecessorsSteps) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start([](DaemonConfig& c) { c.max_host_memory = 1ull << 30; }));
  const std::string job = JobName("successor");
  constexpr uint64_t n = 8u << 20;  // 32 MiB per tensor: a write that takes a while
  {
    TestTrainer first = d.StartTrainer(job, n);
    ASSERT_TRUE(first.client);
    ASSERT_OK(first.Save(50));
    ASSERT_OK(first.Save(100));
  }
  // The next process of the run goes back to step 50 and saves step 60: its wait ends only once
  // step 60 is written, though the rank once persisted step 100.
  TestTrainer next = d.StartTrainer(job, n);
  ASSERT_TRUE(next.client);
  ASSERT_OK(next.client->Restore(50, next.bufs, 30s).status());
  ASSERT_OK(next.Snapshot(60).status());
  ASSERT_OK(next.client->WaitPersisted(60, 30s));
  EXPECT_TRUE(std::filesystem::exists(d.StepDir(job, 60) + "/saved_signal_0"))
      << "WaitPersisted(60) returned before step 60 was written";
}

TEST(RunTest, AResumedRunSavesAStepOlderThanEveryStepTheDaemonTracks) {
  // The daemon remembers the attempts of a bounded window of recent steps; a run that goes back
  // further saves a step older than all of them (under AddressSanitizer in CI: no use after free).
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("window");
  {
    TestTrainer first = d.StartTrainer(job, 64);
    ASSERT_TRUE(first.client);
    for (int64_t step = 10; step <= 700; step += 10) ASSERT_OK(first.Snapshot(step).status());
    ASSERT_OK(first.client->WaitPersisted(700, 30s));
  }
  TestTrainer next = d.StartTrainer(job, 64);
  ASSERT_TRUE(next.client);
  ASSERT_OK(next.client->Restore(10, next.bufs, 10s).status());
  ASSERT_OK(next.Save(15));
  ASSERT_OK(next.client->WaitComplete(15, 10s));
  ASSERT_OK(next.Save(25));
}

// Two tp ranks of a job, each holding half of "w".
struct TwoRanks {
  std::vector<std::unique_ptr<Client>> ranks;
  std::vector<std::vector<float>> halves;
  std::vector<TensorBuffer> Bufs(uint32_t r) { return {{"w", halves[r].data(), halves[r].size() * 4}}; }
};

TwoRanks RegisterTwoRanks(const InProcessDaemon& d, const std::string& job, uint64_t n) {
  TwoRanks two;
  for (uint32_t r = 0; r < 2; ++r) {
    auto c = d.Connect(job, r);
    if (!c) return {};
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
    EXPECT_OK(c->Register(t, {w}));
    two.ranks.push_back(std::move(c));
    two.halves.emplace_back(n, static_cast<float>(r + 1));
  }
  return two;
}

// Rank `r` of a 2-rank tp job connected with no run id, registered.
std::unique_ptr<Client> UnnamedRank(const InProcessDaemon& d, const std::string& job, uint32_t r,
                                    const std::string& run = "") {
  auto c = d.Connect(job, r, [&](ClientOptions& o) { o.run_id = run; });
  if (!c) return nullptr;
  TensorSpec w;
  w.name = "w";
  w.shape = {16};
  w.global_shape = {32};
  w.box_offset = {r * 16};
  w.box_shape = {16};
  Topology t;
  t.world_size = 2;
  t.tp_degree = 2;
  t.tp_rank = r;
  Status registered = c->Register(t, {w});
  EXPECT_OK(registered);
  return registered.ok() ? std::move(c) : nullptr;
}

// Ranks a and b (one on each of two daemons) restore the latest at once, as a job's ranks do: their
// daemons agree on the step through the root, once both have asked.
void RestoreLatestTogether(Client& a, std::vector<float>& wa, Client& b, std::vector<float>& wb) {
  Status by_b;
  std::thread other([&] { by_b = b.Restore(std::nullopt, {{"w", wb.data(), 64}}, 10s).status(); });
  Status by_a = a.Restore(std::nullopt, {{"w", wa.data(), 64}}, 10s).status();
  other.join();
  EXPECT_OK(by_a);
  EXPECT_OK(by_b);
}

// Two daemons on one root, one rank of a job on each, neither naming a run: they agree on the run
// through the root's launches, and a relaunch is a new run, again the same on both.
TEST(RunTest, RanksOnTwoDaemonsThatNameNoRunShareTheLaunchsRun) {
  InProcessDaemon d1("flashckpt-run"), d2("flashckpt-run");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start([&](DaemonConfig& c) { c.root = d1.root(); }));
  const std::string job = JobName("launch");
  std::string first;
  for (int launch = 0; launch < 3; ++launch) {
    auto a = UnnamedRank(d1, job, 0);
    auto b = UnnamedRank(d2, job, 1);
    ASSERT_TRUE(a && b);
    EXPECT_EQ(a->RunId(), b->RunId()) << "launch " << launch;
    if (launch == 0) first = a->RunId();
    if (launch > 0) {
      EXPECT_NE(a->RunId(), first) << "a relaunch joined the first launch's run";
    }
    std::vector<float> wa(16, 1.f), wb(16, 2.f);
    const int64_t step = 10 * (launch + 1);
    if (launch > 0) RestoreLatestTogether(*a, wa, *b, wb);  // a relaunch resumes (a fresh start would be refused)
    ASSERT_OK(a->Snapshot(step, {{"w", wa.data(), 64}}, {}).status());
    ASSERT_OK(b->Snapshot(step, {{"w", wb.data(), 64}}, {}).status());
    ASSERT_OK(a->WaitComplete(step, 10s));
    ASSERT_OK(b->WaitComplete(step, 10s));
  }
}

// The job's split events on `d` within `wait` (0: none seen).
std::vector<DaemonEvent> SplitEvents(EventHub::Subscription& events, std::chrono::milliseconds wait) {
  std::vector<DaemonEvent> out;
  const auto deadline = std::chrono::steady_clock::now() + wait;
  DaemonEvent event;
  while (events.Next(&event, deadline) == EventHub::Wait::kEvent) {
    if (event.kind == DaemonEvent::Kind::kSplitAttempt) out.push_back(event);
  }
  return out;
}

// Two runs of one job on two daemons (each sees only its own rank, so neither can refuse the other
// at registration): the daemon that writes a step's last part finds the parts of different
// attempts, both committed while both ran, and says so at once: the event, the counter, and its
// rank's wait and next snapshot fail naming the split (before: the wait ran to its deadline).
TEST(RunTest, ASplitAcrossDaemonsIsFoundByTheDaemonThatWritesTheLastPart) {
  InProcessDaemon d1("flashckpt-run"), d2("flashckpt-run");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start([&](DaemonConfig& c) { c.root = d1.root(); }));
  const std::string job = JobName("xsplit");
  auto events = d2.daemon()->events().Subscribe(job);
  ASSERT_OK(events.status());
  auto a = UnnamedRank(d1, job, 0, "run-a");
  auto b = UnnamedRank(d2, job, 1, "run-b");
  ASSERT_TRUE(a && b);
  // Both attempts began well before either commits (a part counts as committed while the other
  // attempt ran only when it came over a second after that attempt began).
  std::this_thread::sleep_for(1100ms);
  std::vector<float> wa(16, 1.f), wb(16, 2.f);
  ASSERT_OK(a->Snapshot(10, {{"w", wa.data(), 64}}, {}).status());
  ASSERT_OK(a->WaitPersisted(10, 10s));
  ASSERT_OK(b->Snapshot(10, {{"w", wb.data(), 64}}, {}).status());
  // Known before the write is reported: the wait for it already names the split.
  Status persisted = b->WaitPersisted(10, 10s);
  EXPECT_EQ(persisted.code(), StatusCode::kFailedPrecondition) << persisted.ToString();
  EXPECT_TRUE(Contains(persisted.message(), "split")) << persisted.ToString();
  const auto split = SplitEvents(*events, 5s);
  ASSERT_EQ(split.size(), 1u) << "the daemon that wrote the last part said nothing";
  EXPECT_EQ(split[0].step, 10);
  for (const char* word : {"step 10", "rank 0 in run run-a", "rank 1 in run run-b"}) {
    EXPECT_TRUE(Contains(split[0].reason, word)) << "'" << word << "' in " << split[0].reason;
  }
  EXPECT_TRUE(Contains(d2.daemon()->RenderMetrics(), "flashckpt_split_steps_total{job=\"" + job + "\"} 1"))
      << d2.daemon()->RenderMetrics();
  const auto begun = std::chrono::steady_clock::now();
  Status waited = b->WaitComplete(10, 20s);
  EXPECT_EQ(waited.code(), StatusCode::kFailedPrecondition) << waited.ToString();
  EXPECT_TRUE(Contains(waited.message(), "split")) << waited.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - begun, 10s) << "the wait ran on towards its deadline";
  auto next = b->Snapshot(20, {{"w", wb.data(), 64}}, {});
  EXPECT_EQ(next.status().code(), StatusCode::kFailedPrecondition) << next.status().ToString();
  EXPECT_TRUE(Contains(next.status().message(), "split")) << next.status().ToString();
}

// The other case of a step with parts of two attempts: an earlier attempt's part, left by a rank
// that stopped before the relaunch began. The relaunch's rank on the other daemon writes its part
// next to it; that is no split (the relaunch's rank 0 saves the step again), and the step completes.
TEST(RunTest, AnEarlierAttemptsPartOnAnotherDaemonIsNoSplit) {
  InProcessDaemon d1("flashckpt-run"), d2("flashckpt-run");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start([&](DaemonConfig& c) { c.root = d1.root(); }));
  const std::string job = JobName("xleft");
  auto events = d2.daemon()->events().Subscribe(job);
  ASSERT_OK(events.status());
  std::vector<float> wa(16, 1.f), wb(16, 2.f);
  {
    auto a = UnnamedRank(d1, job, 0, "old-run");
    auto b = UnnamedRank(d2, job, 1, "old-run");
    ASSERT_TRUE(a && b);
    ASSERT_OK(a->Snapshot(10, {{"w", wa.data(), 64}}, {}).status());
    ASSERT_OK(b->Snapshot(10, {{"w", wb.data(), 64}}, {}).status());
    ASSERT_OK(a->WaitComplete(10, 10s));
    ASSERT_OK(a->Snapshot(20, {{"w", wa.data(), 64}}, {}).status());  // rank 1 stops before step 20
    ASSERT_OK(a->WaitPersisted(20, 10s));
  }
  std::this_thread::sleep_for(5ms);  // the relaunch begins after (a ms clock)
  auto a = UnnamedRank(d1, job, 0, "new-run");
  auto b = UnnamedRank(d2, job, 1, "new-run");
  ASSERT_TRUE(a && b);
  RestoreLatestTogether(*a, wa, *b, wb);
  ASSERT_OK(b->Snapshot(20, {{"w", wb.data(), 64}}, {}).status());
  ASSERT_OK(b->WaitPersisted(20, 10s));  // beside rank 0's part of the old run: every part present
  ASSERT_OK(a->Snapshot(20, {{"w", wa.data(), 64}}, {}).status());
  ASSERT_OK(a->WaitComplete(20, 10s));
  ASSERT_OK(b->WaitComplete(20, 10s));
  EXPECT_TRUE(SplitEvents(*events, 200ms).empty());
  EXPECT_FALSE(Contains(d2.daemon()->RenderMetrics(), "flashckpt_split_steps_total{job=\"" + job + "\"} 1"));
  ASSERT_OK(b->Snapshot(30, {{"w", wb.data(), 64}}, {}).status());
}

// A partial launch (rank 1 never came) and a relaunch within the join window whose rank 1 starts
// first: it takes the free place in the old launch, and rank 0, finding its place there taken,
// begins a new launch. Rank 1 is then in no run with its job's other ranks: its first snapshot is
// refused, naming the newer launch and the fix (before, it saved, and no step ever completed).
TEST(RunTest, ARankThatJoinedAPartialLaunchOvertakenByARelaunchIsRefusedAtItsFirstSnapshot) {
  InProcessDaemon d1("flashckpt-run"), d2("flashckpt-run");
  ASSERT_OK(d1.Start());
  ASSERT_OK(d2.Start([&](DaemonConfig& c) { c.root = d1.root(); }));
  const std::string job = JobName("partial");
  {
    auto a = UnnamedRank(d1, job, 0);  // launch 1, whose rank 1 never comes; the process stops
    ASSERT_TRUE(a);
  }
  WaitDisconnected(d1, job);
  auto b = UnnamedRank(d2, job, 1);  // the relaunch's rank 1: launch 1's free place
  auto a = UnnamedRank(d1, job, 0);  // its place in launch 1 is taken: launch 2
  ASSERT_TRUE(a && b);
  ASSERT_NE(a->RunId(), b->RunId());
  std::vector<float> w(16, 1.f);
  auto refused = b->Snapshot(10, {{"w", w.data(), 64}}, {});
  ASSERT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  for (const char* word : {"joined launch 1", "launch 2 has begun since", "restart every rank", "FLASHCKPT_RUN_ID"}) {
    EXPECT_TRUE(Contains(refused.status().message(), word)) << "'" << word << "' in " << refused.status().ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(d1.StepDir(job, 10)));
  // The rank of the newest launch is not held back by it.
  ASSERT_OK(a->Snapshot(10, {{"w", w.data(), 64}}, {}).status());
}

// A rank that names no run and cannot agree on one through the root (here its launches folder is a
// file) registers, but its first snapshot is refused, naming the fix: never a run that might not
// be its job's other ranks'.
TEST(RunTest, ARankThatCannotAgreeOnARunIsRefusedAtItsFirstSnapshot) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("noagree");
  ASSERT_OK(MakeDirs(d.JobDir(job)));
  ASSERT_OK(WriteFileDurably(d.JobDir(job), ".launches", "not a folder\n"));
  auto a = UnnamedRank(d, job, 0);
  ASSERT_TRUE(a);
  std::vector<float> w(16, 1.f);
  auto refused = a->Snapshot(1, {{"w", w.data(), 64}}, {});
  ASSERT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  for (const char* word : {"no run shared", "FLASHCKPT_RUN_ID", ".launches"}) {
    EXPECT_TRUE(Contains(refused.status().message(), word)) << "'" << word << "' in " << refused.status().ToString();
  }
}

TEST(RunTest, WaitCompleteWaitsForEveryRankAndNamesTheMissingOnes) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("complete");
  TwoRanks two = RegisterTwoRanks(d, job, 64);
  ASSERT_EQ(two.ranks.size(), 2u);
  ASSERT_OK(two.ranks[0]->Snapshot(3, two.Bufs(0), {}).status());
  ASSERT_OK(two.ranks[0]->WaitPersisted(3, 10s));  // this rank's part is durable, the checkpoint is not
  Status early = two.ranks[0]->WaitComplete(3, 300ms);
  EXPECT_EQ(early.code(), StatusCode::kDeadlineExceeded) << early.ToString();
  EXPECT_TRUE(Contains(early.message(), "1 of 2 ranks")) << early.ToString();
  EXPECT_TRUE(Contains(early.message(), "waiting for rank(s) 1")) << early.ToString();
  // Rank 1 saves while rank 0 waits: the wait ends when the checkpoint is complete.
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    EXPECT_OK(two.ranks[1]->Snapshot(3, two.Bufs(1), {}).status());
  });
  EXPECT_OK(two.ranks[0]->WaitComplete(3, 10s));
  late.join();
  EXPECT_TRUE(std::filesystem::exists(d.StepDir(job, 3) + "/metadata.json"));
  EXPECT_OK(two.ranks[1]->WaitComplete(3, 10s));
  // A step this rank never saved (it went from 3 to 6) says so at once, not at the deadline.
  ASSERT_OK(two.ranks[0]->Snapshot(6, two.Bufs(0), {}).status());
  ASSERT_OK(two.ranks[0]->WaitPersisted(6, 10s));
  const auto begun = std::chrono::steady_clock::now();
  Status skipped = two.ranks[0]->WaitComplete(5, 30s);
  EXPECT_EQ(skipped.code(), StatusCode::kFailedPrecondition) << skipped.ToString();
  EXPECT_TRUE(Contains(skipped.message(), "holds no part of rank 0")) << skipped.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - begun, 10s);
}

TEST(RunTest, TheRunIdComesFromTheEnvironmentWhenTheTrainerGivesNone) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("env");
  auto run_of = [&](uint32_t rank) {
    TestTrainer t = d.StartTrainer(job, 16, [rank](ClientOptions& o) {
      o.run_id.clear();
      o.rank = rank;
    });
    return t.client ? t.client->RunId() : std::string("(no client)");
  };
  ::setenv("FLASHCKPT_RUN_ID", "nightly run/7", 1);  // characters outside [A-Za-z0-9._:-] become '-'
  EXPECT_EQ(run_of(0), "nightly-run-7");
  ::unsetenv("FLASHCKPT_RUN_ID");
  ::setenv("SLURM_JOB_ID", "4242", 1);
  ::setenv("SLURM_RESTART_COUNT", "2", 1);
  EXPECT_EQ(run_of(0), "slurm-4242.2");
  ::setenv("TORCHELASTIC_RUN_ID", "none", 1);  // torchrun's default: not an id, Slurm's is taken
  EXPECT_EQ(run_of(0), "slurm-4242.2");
  ::setenv("TORCHELASTIC_RUN_ID", "rdzv-9", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
  EXPECT_EQ(run_of(0), "torchelastic-rdzv-9.3");
  for (const char* name : {"SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"}) {
    ::unsetenv(name);
  }
  // Open MPI and PMIx launchers, and a Kubernetes JobSet (its labels through the downward API).
  ::setenv("JOBSET_NAME", "llama", 1);
  ::setenv("JOBSET_RESTART_ATTEMPT", "1", 1);
  EXPECT_EQ(run_of(0), "jobset-llama.1");
  ::setenv("OMPI_MCA_orte_ess_jobid", "31457", 1);
  EXPECT_EQ(run_of(0), "ompi-31457");
  ::setenv("PMIX_NAMESPACE", "prterun-node1-4242@1", 1);
  EXPECT_EQ(run_of(0), "pmix-prterun-node1-4242-1");
  for (const char* name : {"JOBSET_NAME", "JOBSET_RESTART_ATTEMPT", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE"}) {
    ::unsetenv(name);
  }
  EXPECT_EQ(run_of(0).size(), 16u) << "drawn by the daemon";
}

TEST(RunTest, AStepSavedInDifferentAttemptsIsAnErrorEveryoneSees) {
  InProcessDaemon d("flashckpt-run");
  ASSERT_OK(d.Start());
  const std::string job = JobName("split");
  TwoRanks two = RegisterTwoRanks(d, job, 64);
  ASSERT_EQ(two.ranks.size(), 2u);
  for (uint32_t r = 0; r < 2; ++r) ASSERT_OK(two.ranks[r]->Snapshot(5, two.Bufs(r), {}).status());
  for (uint32_t r = 0; r < 2; ++r) ASSERT_OK(two.ranks[r]->WaitComplete(5, 10s));
  auto events = d.daemon()->events().Subscribe(job);
  ASSERT_OK(events.status());

  // Rank 1 restores in the middle of the run; rank 0 keeps its session and goes on.
  auto restored = two.ranks[1]->Restore(std::nullopt, two.Bufs(1), 10s);
  ASSERT_OK(restored.status());
  ASSERT_EQ(restored->step, 5);
  for (uint32_t r = 0; r < 2; ++r) ASSERT_OK(two.ranks[r]->Snapshot(10, two.Bufs(r), {}).status());
  // Each rank's own part is written, but the wait says the step is split (known at the second commit).
  for (uint32_t r = 0; r < 2; ++r) {
    const std::string signal = d.StepDir(job, 10) + "/saved_signal_" + std::to_string(r);
    for (int i = 0; i < 1000 && !std::filesystem::exists(signal); ++i) std::this_thread::sleep_for(10ms);
    EXPECT_TRUE(std::filesystem::exists(signal)) << signal;
    Status waited = two.ranks[r]->WaitPersisted(10, 10s);
    EXPECT_EQ(waited.code(), StatusCode::kFailedPrecondition) << waited.ToString();
    EXPECT_TRUE(Contains(waited.message(), "is split")) << waited.ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(d.StepDir(job, 10) + "/metadata.json"));

  // The wait for the checkpoint says at once that it never completes, and why.
  for (uint32_t r = 0; r < 2; ++r) {
    const auto begun = std::chrono::steady_clock::now();
    Status split = two.ranks[r]->WaitComplete(10, 30s);
    EXPECT_EQ(split.code(), StatusCode::kFailedPrecondition) << split.ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - begun, 10s) << "not a timeout";
    for (const char* word : {"checkpoint-10", "is split", "can never complete", "rank 0 in run", "(fresh)", "rank 1 in run",
                             "resumed from step 5"}) {
      EXPECT_TRUE(Contains(split.message(), word)) << "'" << word << "' in " << split.ToString();
    }
  }
  // Status, the CLI's rendering of it, metrics and an event show it too.
  const DaemonStatus status = d.daemon()->GetStatus();
  ASSERT_EQ(status.jobs.size(), 1u);
  EXPECT_EQ(status.jobs[0].split_attempts, 1u);
  EXPECT_TRUE(Contains(status.jobs[0].split, "step 10:")) << status.jobs[0].split;
  EXPECT_EQ(status.jobs[0].ranks[1].resumed_from, 5);
  EXPECT_EQ(status.jobs[0].ranks[0].resumed_from, 0);
  EXPECT_TRUE(Contains(cli::StatusText(status), "SPLIT ATTEMPT: 1 step(s)")) << cli::StatusText(status);
  EXPECT_TRUE(Contains(d.daemon()->RenderMetrics(), "flashckpt_split_steps_total{job=\"" + job + "\"} 1"))
      << d.daemon()->RenderMetrics();
  bool seen = false;
  DaemonEvent event;
  while (!seen && events->Next(&event, std::chrono::steady_clock::now() + 5s) == EventHub::Wait::kEvent) {
    if (event.kind != DaemonEvent::Kind::kSplitAttempt) continue;
    seen = true;
    EXPECT_EQ(event.step, 10);
    EXPECT_TRUE(Contains(event.reason, "resumed from step 5")) << event.reason;
    EXPECT_TRUE(Contains(cli::EventText(event), "split-attempt")) << cli::EventText(event);
  }
  EXPECT_TRUE(seen) << "no split event";
  // Every later save of these processes fails, saying why (the Python Checkpointer raises it).
  for (uint32_t r = 0; r < 2; ++r) {
    auto next = two.ranks[r]->Snapshot(15, two.Bufs(r), {});
    EXPECT_EQ(next.status().code(), StatusCode::kFailedPrecondition) << next.status().ToString();
    EXPECT_TRUE(Contains(next.status().message(), "is split")) << next.status().ToString();
  }
}

}  // namespace
}  // namespace flashckpt
