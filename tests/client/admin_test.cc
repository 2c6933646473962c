// The operator client (flashckpt/admin.h) against a real daemon in this process, on a temporary
// socket (and its read-only TCP listener): status, list, watch, delete, gc and health as structs, and
// the errors an operator sees for an unreachable daemon and for a refused call.
#include <filesystem>
#include <future>
#include <optional>
#include <thread>

#include "common/base/version.h"
#include "daemon/in_process_daemon.h"
#include "flashckpt/admin.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

bool Contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

class AdminTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK(d_.Start([](DaemonConfig& c) { c.listen = "127.0.0.1:0"; }));  // TCP: read-only
  }

  std::unique_ptr<AdminClient> Admin(const AdminOptions& options) {
    auto admin = AdminClient::Open(options);
    EXPECT_TRUE(admin.ok()) << admin.status().ToString();
    return admin.ok() ? std::move(admin).value() : nullptr;
  }
  std::unique_ptr<AdminClient> OverTheSocket() {
    AdminOptions o;
    o.socket_path = d_.socket();
    o.rpc_timeout = 5s;
    return Admin(o);
  }
  std::unique_ptr<AdminClient> OverTcp() {
    AdminOptions o;
    o.address = "127.0.0.1:" + std::to_string(d_.server()->tcp_port());
    o.rpc_timeout = 5s;
    return Admin(o);
  }

  // Rank 0 of `job` saves each of `steps` and waits until it is durable.
  void Save(const std::string& job, const std::vector<int64_t>& steps) {
    auto c = d_.Connect(job, 0);
    ASSERT_TRUE(c);
    ASSERT_OK(c->Register(Topology{}, ModelAndMomentSpecs(256)));
    std::vector<float> w(256, 1.f), m(256, 2.f);
    std::vector<TensorBuffer> bufs = {{"w", w.data(), 1024}, {"w.exp_avg", m.data(), 1024}};
    for (int64_t step : steps) {
      ASSERT_OK(c->Snapshot(step, bufs, {}).status());
      ASSERT_OK(c->WaitPersisted(step, 10s));
    }
  }
  std::string StepDir(const std::string& job, int64_t step) const {
    return d_.root() + "/" + job + "/checkpoint-" + std::to_string(step);
  }

  InProcessDaemon d_{"flashckpt-admin-test"};
};

TEST_F(AdminTest, StatusNamesTheDaemonAndEveryRank) {
  auto admin = OverTheSocket();
  ASSERT_TRUE(admin);
  EXPECT_EQ(admin->endpoint(), d_.socket());
  auto empty = admin->Status();
  ASSERT_OK(empty.status());
  EXPECT_EQ(empty->version, kVersion);
  EXPECT_EQ(empty->root, d_.root());
  EXPECT_EQ(empty->host_memory_budget, 64ull << 20);
  EXPECT_EQ(empty->host_memory_used, 0u);
  EXPECT_TRUE(empty->jobs.empty());

  auto c = d_.Connect("llama", 0);
  ASSERT_TRUE(c);
  ASSERT_OK(c->Register(Topology{}, ModelAndMomentSpecs(256)));
  std::vector<float> w(256), m(256);
  std::vector<TensorBuffer> bufs = {{"w", w.data(), 1024}, {"w.exp_avg", m.data(), 1024}};
  ASSERT_OK(c->Snapshot(5, bufs, {}).status());
  ASSERT_OK(c->WaitPersisted(5, 10s));

  auto status = admin->Status();
  ASSERT_OK(status.status());
  EXPECT_GT(status->host_memory_used, 0u);
  ASSERT_EQ(status->jobs.size(), 1u);
  const JobStatus& job = status->jobs[0];
  EXPECT_EQ(job.job, "llama");
  EXPECT_EQ(job.world_size, 1u);
  EXPECT_EQ(job.last_complete_step, 5);
  EXPECT_TRUE(job.catalog_error.empty()) << job.catalog_error;
  ASSERT_EQ(job.ranks.size(), 1u);
  const RankStatus& rank = job.ranks[0];
  EXPECT_EQ(rank.rank, 0u);
  EXPECT_TRUE(rank.connected);
  EXPECT_GT(rank.segment_bytes, 0u);
  EXPECT_EQ(rank.last_committed_step, 5);
  EXPECT_EQ(rank.last_persisted_step, 5);
  EXPECT_EQ(rank.snapshots, 1u);
  EXPECT_EQ(rank.persists, 1u);
  EXPECT_EQ(rank.failures, 0u);
  ASSERT_EQ(rank.slots.size(), 2u);
  EXPECT_EQ(rank.slots[0].state, "free");
  EXPECT_FALSE(rank.ema_enabled);

  c.reset();  // the session ends: the rank stays known, disconnected
  for (auto deadline = std::chrono::steady_clock::now() + 5s; std::chrono::steady_clock::now() < deadline;) {
    status = admin->Status();
    ASSERT_OK(status.status());
    if (!status->jobs[0].ranks[0].connected) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_FALSE(status->jobs[0].ranks[0].connected);
}

TEST_F(AdminTest, ListGivesEveryCheckpointDirectory) {
  Save("llama", {1, 2, 3});
  Save("gpt", {7});
  auto admin = OverTheSocket();
  ASSERT_TRUE(admin);
  auto list = admin->List("llama");
  ASSERT_OK(list.status());
  ASSERT_EQ(list->size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const CheckpointInfo& c = (*list)[i];
    EXPECT_EQ(c.job, "llama");
    EXPECT_EQ(c.step, static_cast<int64_t>(i + 1));
    EXPECT_TRUE(c.complete);
    EXPECT_EQ(c.signals, 1u);
    EXPECT_EQ(c.world_size, 1u);
    EXPECT_GT(c.bytes, 2048u);
    EXPECT_EQ(std::filesystem::path(c.path), std::filesystem::path(StepDir("llama", c.step)));
    EXPECT_EQ(c.latest, c.step == 3) << c.step;
  }
  auto all = admin->List("");
  ASSERT_OK(all.status());
  EXPECT_EQ(all->size(), 4u);
  auto none = admin->List("nobody");
  ASSERT_OK(none.status());
  EXPECT_TRUE(none->empty());
  auto bad = admin->List("../etc");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().ToString();
  EXPECT_TRUE(Contains(bad.status().message(), "ListCheckpoints failed: INVALID_ARGUMENT (gRPC code 3): "))
      << bad.status().message();
}

TEST_F(AdminTest, DeleteAndGcSayWhatTheyDeletedAndTheLatestLeft) {
  Save("llama", {1, 2, 3, 4});
  auto admin = OverTheSocket();
  ASSERT_TRUE(admin);

  auto one = admin->Delete("llama", 1, /*force=*/false, /*dry_run=*/false);
  ASSERT_OK(one.status());
  EXPECT_EQ(one->deleted, std::vector<int64_t>{1});
  EXPECT_TRUE(one->skipped.empty());
  EXPECT_EQ(one->latest, 4);
  EXPECT_FALSE(std::filesystem::exists(StepDir("llama", 1)));

  // The newest complete checkpoint needs force.
  auto newest = admin->Delete("llama", 4, /*force=*/false, /*dry_run=*/false);
  EXPECT_EQ(newest.status().code(), StatusCode::kFailedPrecondition) << newest.status().ToString();
  EXPECT_TRUE(Contains(newest.status().message(), "DeleteCheckpoints failed: FAILED_PRECONDITION (gRPC code 9): "))
      << newest.status().message();
  EXPECT_TRUE(Contains(newest.status().message(), "--force")) << newest.status().message();
  EXPECT_TRUE(std::filesystem::exists(StepDir("llama", 4)));

  auto missing = admin->Delete("llama", 99, false, false);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();

  auto dry = admin->Gc("llama", 1, /*dry_run=*/true);
  ASSERT_OK(dry.status());
  EXPECT_EQ(dry->deleted, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(dry->latest, 4);
  EXPECT_TRUE(std::filesystem::exists(StepDir("llama", 2)));

  auto gc = admin->Gc("llama", 1, /*dry_run=*/false);
  ASSERT_OK(gc.status());
  EXPECT_EQ(gc->deleted, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(gc->latest, 4);
  EXPECT_FALSE(std::filesystem::exists(StepDir("llama", 2)));
  EXPECT_FALSE(std::filesystem::exists(StepDir("llama", 3)));

  auto forced = admin->Delete("llama", 4, /*force=*/true, /*dry_run=*/false);
  ASSERT_OK(forced.status());
  EXPECT_EQ(forced->deleted, std::vector<int64_t>{4});
  EXPECT_LT(forced->latest, 0);  // none left
  auto list = admin->List("llama");
  ASSERT_OK(list.status());
  EXPECT_TRUE(list->empty());
}

TEST_F(AdminTest, HealthIsServingUntilTheDaemonStops) {
  auto admin = OverTheSocket();
  ASSERT_TRUE(admin);
  auto health = admin->Health();
  ASSERT_OK(health.status());
  EXPECT_EQ(*health, HealthState::kServing);
  EXPECT_EQ(HealthStateName(*health), "SERVING");
  d_.server()->SetServing(false);
  health = admin->Health();
  ASSERT_OK(health.status());
  EXPECT_EQ(*health, HealthState::kNotServing);
  EXPECT_EQ(HealthStateName(*health), "NOT_SERVING");
}

TEST_F(AdminTest, WatchSeesASaveFromCommitToCompleteCheckpoint) {
  auto admin = OverTheSocket();
  ASSERT_TRUE(admin);
  std::promise<void> subscribed;
  std::vector<DaemonEvent> events;
  WatchOptions options;
  options.job = "llama";
  options.duration = 20s;  // a bound in case the save never completes
  options.on_subscribed = [&](bool) { subscribed.set_value(); };
  Status watched;
  std::thread watcher([&] {
    watched = admin->Watch(options, [&](const DaemonEvent& e) {
      events.push_back(e);
      return e.kind != DaemonEvent::Kind::kCheckpointComplete;  // stop there
    });
  });
  subscribed.get_future().wait();
  Save("llama", {3});
  watcher.join();
  EXPECT_OK(watched);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front().kind, DaemonEvent::Kind::kSnapshotCommitted);
  EXPECT_EQ(events.back().kind, DaemonEvent::Kind::kCheckpointComplete);
  for (const DaemonEvent& e : events) {
    EXPECT_EQ(e.job, "llama");
    EXPECT_EQ(e.step, 3);
    EXPECT_GT(e.unix_seconds, 0);
  }
  EXPECT_GT(events.front().bytes, 0u);

  // A duration with nothing happening ends the watch with OK; so does max_events.
  WatchOptions quiet;
  quiet.job = "nobody";
  quiet.duration = 200ms;
  EXPECT_OK(admin->Watch(quiet, [](const DaemonEvent&) { return true; }));
}

TEST_F(AdminTest, AWatchWhoseDaemonStopsSaysItStoppedNotThatItIsUnreachable) {
  auto admin = OverTheSocket();
  ASSERT_TRUE(admin);
  std::promise<bool> subscribed;
  WatchOptions options;
  options.duration = 20s;  // a bound in case the stop is never seen
  options.on_subscribed = [&](bool ok) { subscribed.set_value(ok); };
  Status watched;
  std::thread watcher([&] { watched = admin->Watch(options, [](const DaemonEvent&) { return true; }); });
  const bool ok = subscribed.get_future().get();
  d_.Stop();
  watcher.join();
  ASSERT_TRUE(ok);
  EXPECT_EQ(watched.code(), StatusCode::kUnavailable) << watched.ToString();
  EXPECT_EQ(watched.message(), "the daemon at " + d_.socket() + " stopped (UNAVAILABLE: the daemon is stopping)");
}

TEST_F(AdminTest, TcpListenerAnswersStatusAndRefusesDeleteNamingTheFlag) {
  Save("llama", {1, 2});
  auto admin = OverTcp();
  ASSERT_TRUE(admin);
  EXPECT_EQ(admin->endpoint(), "127.0.0.1:" + std::to_string(d_.server()->tcp_port()) + " (plain TCP)");
  auto status = admin->Status();
  ASSERT_OK(status.status());
  ASSERT_EQ(status->jobs.size(), 1u);
  auto list = admin->List("llama");
  ASSERT_OK(list.status());
  EXPECT_EQ(list->size(), 2u);
  auto refused = admin->Delete("llama", 1, false, false);
  ASSERT_FALSE(refused.ok());
  // gRPC's PERMISSION_DENIED has no flashckpt code: the message names it.
  EXPECT_EQ(refused.status().code(), StatusCode::kInternal);
  EXPECT_TRUE(Contains(refused.status().message(), "DeleteCheckpoints failed: PERMISSION_DENIED (gRPC code 7): "))
      << refused.status().message();
  EXPECT_TRUE(Contains(refused.status().message(), "--tcp-allow-writes")) << refused.status().message();
  EXPECT_TRUE(std::filesystem::exists(StepDir("llama", 1)));
}

TEST_F(AdminTest, AnUnreachableDaemonIsUnavailableNamingTheSocket) {
  const std::string socket = d_.dir() + "/nobody-listens.sock";
  AdminOptions o;
  o.socket_path = socket;
  auto admin = Admin(o);  // opening does not connect
  ASSERT_TRUE(admin);
  const std::string expected = "daemon not reachable at " + socket + " (UNAVAILABLE: ";
  auto status = admin->Status();
  EXPECT_EQ(status.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(status.status().message().rfind(expected, 0), 0u) << status.status().message();
  EXPECT_EQ(admin->List("").status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(admin->Health().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(admin->Gc("llama", 1, true).status().code(), StatusCode::kUnavailable);
  std::optional<bool> subscribed;
  WatchOptions w;
  w.on_subscribed = [&](bool ok) { subscribed = ok; };
  Status watched = admin->Watch(w, [](const DaemonEvent&) { return true; });
  EXPECT_EQ(watched.code(), StatusCode::kUnavailable);
  EXPECT_EQ(watched.message().rfind(expected, 0), 0u) << watched.message();
  EXPECT_EQ(subscribed, false);  // told before the error, as documented

  // The daemon's own socket, once it has stopped.
  auto live = OverTheSocket();
  ASSERT_TRUE(live);
  ASSERT_OK(live->Status().status());
  d_.Stop();
  auto gone = live->Status();
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable) << gone.status().ToString();
  EXPECT_TRUE(Contains(gone.status().message(), "daemon not reachable at " + d_.socket())) << gone.status().message();
}

TEST_F(AdminTest, AnUnreadableCaFileFailsOpenNotTheCall) {
  AdminOptions o;
  o.address = "127.0.0.1:1";
  o.tls_ca_file = d_.dir() + "/no-such-ca.pem";
  auto admin = AdminClient::Open(o);
  ASSERT_FALSE(admin.ok());
  EXPECT_NE(admin.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(admin.status().message(), "no-such-ca.pem")) << admin.status().message();
}

}  // namespace
}  // namespace flashckpt
