// The replica channel between daemons (daemon/replica/): the store of peers' replicas, its gRPC
// service on a real loopback port, and mutual TLS with certificates made here by openssl (a CA, this
// daemon's, an allowed peer's, a peer of a name not allowed, and one from another CA); and the
// sending side, between two in-process daemons: a trainer's memory checkpoints reach the peer.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/checksum.h"
#include "daemon/core/daemon.h"
#include "daemon/edge/config.h"
#include "daemon/edge/grpc_log.h"
#include "daemon/edge/tcp_listener.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_layout.h"
#include "daemon/replica/replica_server.h"
#include "daemon/replica/replica_store.h"
#include "daemon/replica/replica_wire.h"
#include "daemon/replica/replica_sender.h"
#include "certificates.h"
#include "in_process_daemon.h"
#include "replica.grpc.pb.h"
#include "replica.pb.h"
#include "testing.h"

namespace flashckpt {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kPart = 64u << 10;

std::vector<char> Bytes(uint64_t n, int seed) {
  std::vector<char> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + static_cast<uint64_t>(seed) * 7) % 251);
  return v;
}

ReplicaMeta Meta(const std::string& job, uint32_t rank, int64_t step, uint64_t bytes) {
  ReplicaMeta m;
  m.job = job;
  m.rank = rank;
  m.step = step;
  m.attempt = 1;
  m.world_size = 8;
  m.bytes = bytes;
  m.part_bytes = kPart;
  m.layout = "layout-of-rank-" + std::to_string(rank);
  m.extra = "{\"step\": " + std::to_string(step) + "}";
  m.origin_node = "node-b";
  return m;
}

// A budget the test can read: what the store holds must be given back.
struct CountedMemory {
  std::atomic<uint64_t> used{0};
  uint64_t budget = 64u << 20;
  HostMemory memory() {
    return HostMemory{[this](uint64_t bytes, const std::string& what) -> Status {
                        if (used.load() + bytes > budget) return ResourceExhausted(what + " does not fit");
                        used += bytes;
                        return Status::OK();
                      },
                      [this](uint64_t bytes) { used -= bytes; }};
  }
};

// What a replica takes from the budget: its bytes, layout and extra state.
uint64_t Accounted(const ReplicaMeta& m) { return m.bytes + m.layout.size() + m.extra.size(); }

Status Put(ReplicaStore* store, const ReplicaMeta& meta, const std::vector<char>& data) {
  ASSIGN_OR_RETURN(auto incoming, store->Begin(meta));
  for (uint64_t at = 0; at < meta.bytes; at += meta.part_bytes) {
    const uint64_t n = std::min(meta.part_bytes, meta.bytes - at);
    RETURN_IF_ERROR(incoming->Append(data.data() + at, n, Xxh3(data.data() + at, n)));
  }
  return store->Finish(std::move(incoming));
}

// A part lands with non-temporal stores in 64-byte steps from the first 16-byte-aligned byte of its
// destination: every alignment and every length around those steps, split into received slices of
// several sizes, must copy exactly its bytes (nothing before or after) and give the checksum of them.
TEST(ReplicaStoreTest, StreamHashedCopiesEveryAlignmentAndLengthExactlyAndHashesIt) {
  std::vector<char> source(4096 + 300);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<char>((i * 131 + 7) % 251);
  std::vector<char> dest(source.size() + 64);
  for (size_t length : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{63}, size_t{64}, size_t{65}, size_t{127},
                        size_t{200}, size_t{4096}, size_t{4096 + 129}}) {
    for (size_t dest_at = 0; dest_at < 32; ++dest_at) {
      for (size_t slice : {size_t{1}, size_t{17}, size_t{64}, size_t{1000}, length == 0 ? size_t{1} : length}) {
        const size_t source_at = (dest_at * 5) % 19;
        std::vector<ByteSpan> spans;
        for (size_t at = 0; at < length; at += slice) {
          spans.push_back({source.data() + source_at + at, std::min(slice, length - at)});
        }
        std::fill(dest.begin(), dest.end(), '\x5a');
        const uint64_t sum = StreamHashed(spans, dest.data() + dest_at);
        SCOPED_TRACE("length " + std::to_string(length) + " at " + std::to_string(dest_at) + " slices of " +
                     std::to_string(slice));
        EXPECT_EQ(sum, Xxh3(source.data() + source_at, length));
        ASSERT_EQ(std::memcmp(dest.data() + dest_at, source.data() + source_at, length), 0);
        for (size_t i = 0; i < dest.size(); ++i) {
          if (i < dest_at || i >= dest_at + length) {
            ASSERT_EQ(dest[i], '\x5a') << "byte " << i;
          }
        }
      }
    }
  }
}

TEST(ReplicaStoreTest, KeepsTheNewestCompleteReplicaPerRankAndGivesItsMemoryBack) {
  CountedMemory counted;
  {
    ReplicaStore store(counted.memory(), 0);
    const auto five = Bytes(3 * kPart + 100, 5), six = Bytes(3 * kPart + 100, 6);
    ASSERT_TRUE(Put(&store, Meta("job", 1, 5, five.size()), five).ok());
    // A newer one on its way in does not disturb the one held; both are counted meanwhile.
    auto incoming = store.Begin(Meta("job", 1, 6, six.size()));
    ASSERT_TRUE(incoming.ok()) << incoming.status().ToString();
    ASSERT_TRUE((*incoming)->Append(six.data(), kPart, Xxh3(six.data(), kPart)).ok());
    EXPECT_EQ(counted.used.load(), Accounted(Meta("job", 1, 5, five.size())) + Accounted(Meta("job", 1, 6, six.size())));
    auto held = store.Find("job", 1, 0);
    ASSERT_TRUE(held.ok());
    EXPECT_EQ((*held)->meta().step, 5);
    // Unfinished, it is not held.
    Status early = store.Finish(std::move(*incoming));
    EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition) << early.ToString();
    EXPECT_EQ((*store.Find("job", 1, 0))->meta().step, 5);
    held = Result<std::shared_ptr<const Replica>>(NotFound("dropped by the test"));
    EXPECT_EQ(counted.used.load(), Accounted(Meta("job", 1, 5, five.size())));

    ASSERT_TRUE(Put(&store, Meta("job", 1, 6, six.size()), six).ok());
    EXPECT_EQ((*store.Find("job", 1, 0))->meta().step, 6);
    EXPECT_EQ(counted.used.load(), Accounted(Meta("job", 1, 6, six.size())));  // step 5's memory went back
    // Its mapping is kept for the rank's next push, outside the budget, which that push takes.
    EXPECT_EQ(store.kept_bytes(), five.size());
    auto seventh = store.Begin(Meta("job", 1, 7, six.size()));
    ASSERT_TRUE(seventh.ok()) << seventh.status().ToString();
    EXPECT_EQ(store.kept_bytes(), 0u);
    EXPECT_EQ(counted.used.load(), Accounted(Meta("job", 1, 6, six.size())) + Accounted(Meta("job", 1, 7, six.size())));
    seventh = Result<std::unique_ptr<ReplicaStore::Incoming>>(NotFound("dropped by the test"));
    EXPECT_EQ(counted.used.load(), Accounted(Meta("job", 1, 6, six.size())));  // an unfinished push gives all back
    // An older step does not replace a newer one.
    Status older = Put(&store, Meta("job", 1, 5, five.size()), five);
    EXPECT_EQ(older.code(), StatusCode::kAlreadyExists) << older.ToString();
    EXPECT_EQ((*store.Find("job", 1, 0))->meta().step, 6);
    EXPECT_EQ(store.Find("job", 1, 5).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(store.Find("job", 2, 0).status().code(), StatusCode::kNotFound);
    ASSERT_TRUE(Put(&store, Meta("other", 0, 3, kPart), Bytes(kPart, 3)).ok());
    EXPECT_EQ(store.List("").size(), 2u);
    EXPECT_EQ(store.List("job").size(), 1u);
    EXPECT_EQ(store.held_bytes(), six.size() + kPart);

    // A later attempt (the job restarted from an older step) replaces a newer step of the old one.
    ReplicaMeta restarted = Meta("job", 1, 2, kPart);
    restarted.attempt = 2;
    ASSERT_TRUE(Put(&store, restarted, Bytes(kPart, 2)).ok());
    EXPECT_EQ((*store.Find("job", 1, 0))->meta().step, 2);
    // Another origin's push (here of the same attempt) is kept apart: it replaces nothing, and each
    // origin's copy is found by its origin.
    ReplicaMeta elsewhere = Meta("job", 1, 3, kPart);
    elsewhere.attempt = 2;
    elsewhere.from_peer = "node-x";
    ASSERT_OK(Put(&store, elsewhere, Bytes(kPart, 3)));
    EXPECT_EQ((*store.Find("job", 1, 0, OriginOf(restarted)))->meta().step, 2);
    EXPECT_EQ((*store.Find("job", 1, 0, "node-x"))->meta().step, 3);
    EXPECT_EQ(store.List("job").size(), 2u);
    EXPECT_EQ(store.Find("job", 1, 2, "node-x").status().code(), StatusCode::kNotFound);
    // A push of another run that is not newer than the origin's copy is not "held already".
    ReplicaMeta other_run = Meta("job", 1, 1, kPart);
    other_run.attempt = 2;
    other_run.run_id = "another-run";
    Status not_held = Put(&store, other_run, Bytes(kPart, 1));
    EXPECT_EQ(not_held.code(), StatusCode::kFailedPrecondition) << not_held.ToString();
  }
  EXPECT_EQ(counted.used.load(), 0u);
}

// Memory kept for a rank's next push is outside the budget (the kernel may take it back), so it
// never refuses another push; it goes when the rank's replica does.
TEST(ReplicaStoreTest, MemoryKeptForARanksNextPushIsOutsideTheBudgetAndGoesWithTheRank) {
  CountedMemory counted;
  const uint64_t bytes = 4 * kPart;
  const uint64_t meta_bytes = Accounted(Meta("job", 0, 1, bytes)) - bytes;
  counted.budget = 3 * (bytes + meta_bytes);  // two replicas held and one on its way
  {
    ReplicaStore store(counted.memory(), 0);
    ASSERT_OK(Put(&store, Meta("job", 0, 1, bytes), Bytes(bytes, 1)));
    ASSERT_OK(Put(&store, Meta("job", 0, 2, bytes), Bytes(bytes, 2)));
    EXPECT_EQ(store.kept_bytes(), bytes);
    EXPECT_EQ(counted.used.load(), bytes + meta_bytes);
    ASSERT_OK(Put(&store, Meta("job", 1, 1, bytes), Bytes(bytes, 3)));
    ASSERT_OK(Put(&store, Meta("job", 1, 2, bytes), Bytes(bytes, 4)));
    EXPECT_EQ(store.kept_bytes(), 2 * bytes);
    EXPECT_EQ(counted.used.load(), 2 * (bytes + meta_bytes));
    // Rank 0's next push writes into the kept memory: what arrives is what is held.
    const auto third = Bytes(bytes, 5);
    ASSERT_OK(Put(&store, Meta("job", 0, 3, bytes), third));
    auto held = store.Find("job", 0, 3);
    ASSERT_TRUE(held.ok());
    for (uint64_t i = 0; i < (*held)->parts(); ++i) {
      auto part = (*held)->VerifiedPart(i);
      ASSERT_TRUE(part.ok()) << part.status().ToString();
      EXPECT_EQ(std::memcmp(part->first, third.data() + i * kPart, part->second), 0);
    }
    held = Result<std::shared_ptr<const Replica>>(NotFound("dropped by the test"));
    store.Drop(store.Find("job", 1, 0)->get());
    EXPECT_EQ(store.kept_bytes(), bytes);  // rank 0's alone
    EXPECT_EQ(counted.used.load(), bytes + meta_bytes);
  }
  EXPECT_EQ(counted.used.load(), 0u);
}

TEST(ReplicaStoreTest, RefusesWhatDoesNotFitOrDoesNotArriveWhole) {
  CountedMemory counted;
  counted.budget = 4 * kPart;
  ReplicaStore store(counted.memory(), 0);
  Status big = Put(&store, Meta("job", 0, 1, 5 * kPart), Bytes(5 * kPart, 1));
  EXPECT_EQ(big.code(), StatusCode::kResourceExhausted) << big.ToString();
  EXPECT_NE(big.message().find("replica of job 'job' rank 0 step 1"), std::string::npos) << big.ToString();
  EXPECT_EQ(counted.used.load(), 0u);

  ReplicaStore capped(counted.memory(), 2 * kPart);
  Status over = Put(&capped, Meta("job", 0, 1, 3 * kPart), Bytes(3 * kPart, 1));
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over.ToString();

  const auto data = Bytes(2 * kPart, 2);
  auto incoming = store.Begin(Meta("job", 0, 2, data.size()));
  ASSERT_TRUE(incoming.ok());
  Status bad_sum = (*incoming)->Append(data.data(), kPart, Xxh3(data.data(), kPart) ^ 1);
  EXPECT_EQ(bad_sum.code(), StatusCode::kCorruption) << bad_sum.ToString();
  Status short_part = (*incoming)->Append(data.data(), kPart - 1, Xxh3(data.data(), kPart - 1));
  EXPECT_EQ(short_part.code(), StatusCode::kInvalidArgument) << short_part.ToString();
  incoming->reset();  // dropped unfinished: its memory goes back
  EXPECT_EQ(counted.used.load(), 0u);

  for (auto [field, meta] : std::vector<std::pair<const char*, ReplicaMeta>>{
           {"job", Meta("bad/job", 0, 1, kPart)}, {"rank", Meta("job", 8, 1, kPart)}, {"step", Meta("job", 0, 0, kPart)}}) {
    EXPECT_EQ(store.Begin(meta).status().code(), StatusCode::kInvalidArgument) << field;
  }
  ReplicaMeta tiny = Meta("job", 0, 1, kPart);
  tiny.part_bytes = 1024;
  EXPECT_EQ(store.Begin(tiny).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Begin(Meta("job", 0, 1, 0)).status().code(), StatusCode::kInvalidArgument);
  // Layout and extra state count too: a replica of few bytes and a large layout does not fit.
  ReplicaMeta wide = Meta("job", 0, 1, kPart);
  wide.layout.assign(4 * kPart, 'x');
  EXPECT_EQ(store.Begin(wide).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(counted.used.load(), 0u);
}

// Steps and attempts are bounded as everywhere else: a step past kMaxStep, or an attempt far ahead
// of this host's clock (attempts are numbered in wall-clock ms), is refused in a push and in a
// retraction, so that no retraction can use an attempt number that no real one ever passes.
TEST(ReplicaStoreTest, StepsAndAttemptsAreBounded) {
  CountedMemory counted;
  ReplicaStore store(counted.memory(), 0);
  const auto data = Bytes(kPart, 1);
  Status far_step = Put(&store, Meta("job", 0, std::numeric_limits<int64_t>::max(), kPart), data);
  EXPECT_EQ(far_step.code(), StatusCode::kInvalidArgument) << far_step.ToString();
  ReplicaMeta ahead = Meta("job", 0, 5, kPart);
  ahead.attempt = std::numeric_limits<uint64_t>::max();
  Status far_attempt = Put(&store, ahead, data);
  EXPECT_EQ(far_attempt.code(), StatusCode::kInvalidArgument) << far_attempt.ToString();
  EXPECT_NE(far_attempt.message().find("ahead of this host's clock"), std::string::npos) << far_attempt.ToString();
  EXPECT_EQ(counted.used.load(), 0u);

  ASSERT_OK(Put(&store, Meta("job", 0, 5, kPart), data));
  auto hostile = store.Retract("job", 0, 0, std::numeric_limits<uint64_t>::max(), "node-b");
  EXPECT_EQ(hostile.status().code(), StatusCode::kInvalidArgument) << hostile.status().ToString();
  EXPECT_EQ(store.Retract("job", 0, kMaxStep + 1, 2, "node-b").status().code(), StatusCode::kInvalidArgument);
  auto held = store.Find("job", 0, 0);
  ASSERT_OK(held.status());
  EXPECT_EQ((*held)->meta().step, 5);  // not dropped
  ASSERT_OK(Put(&store, Meta("job", 0, 6, kPart), data));  // and the rank's next push is held
  EXPECT_EQ((*store.Find("job", 0, 0))->meta().step, 6);
}

// A run's replicas of a rank are its origin's: another allowed peer cannot push a copy of that run
// (a forged one that would win by its attempt number), nor drop the origin's copies by a
// retraction; only a node that fetched the origin's copy here (it restored the rank from here) may
// retract it, and that does not block the origin's later pushes.
TEST(ReplicaStoreTest, ARunsReplicasAreItsOrigins) {
  CountedMemory counted;
  ReplicaStore store(counted.memory(), 0);
  auto of = [](const std::string& peer, const std::string& run, int64_t step, uint64_t attempt) {
    ReplicaMeta m = Meta("job", 0, step, kPart);
    m.from_peer = peer;  // as the name a certificate proves
    m.run_id = run;
    m.attempt = attempt;
    return m;
  };
  ASSERT_OK(Put(&store, of("alice", "run-a", 17, 5), Bytes(kPart, 17)));
  const uint64_t held = counted.used.load();

  // A forged copy of alice's run, with a later attempt and alice's node name in its header.
  ReplicaMeta forged = of("mallory", "run-a", 17, 6);
  forged.origin_node = "alice";
  Status begun = store.Begin(forged).status();
  EXPECT_EQ(begun.code(), StatusCode::kFailedPrecondition) << begun.ToString();
  EXPECT_NE(begun.message().find("run run-a of the rank is replicated here by 'alice'"), std::string::npos)
      << begun.ToString();
  EXPECT_EQ(counted.used.load(), held);  // refused before any memory was reserved
  ReplicaMeta later = of("mallory", "run-a", 18, 6);
  EXPECT_EQ(Put(&store, later, Bytes(kPart, 7)).code(), StatusCode::kFailedPrecondition);
  ASSERT_EQ(store.List("job").size(), 1u);
  EXPECT_EQ(store.List("job")[0].from_peer, "alice");
  // Its own run is kept apart, under its own name (the restoring daemon chooses by its lineage).
  ASSERT_OK(Put(&store, of("mallory", "run-m", 30, 6), Bytes(kPart, 30)));
  EXPECT_EQ((*store.Find("job", 0, 0, "alice"))->meta().step, 17);
  EXPECT_EQ((*store.Find("job", 0, 0, "mallory"))->meta().step, 30);

  // A retraction by a peer that never fetched alice's copy drops only the peer's own.
  auto hostile = store.Retract("job", 0, 0, 7, "mallory");
  ASSERT_OK(hostile.status());
  EXPECT_EQ(*hostile, 30);
  ASSERT_EQ(store.List("job").size(), 1u);
  EXPECT_EQ(store.List("job")[0].from_peer, "alice");
  ASSERT_OK(Put(&store, of("alice", "run-a", 18, 5), Bytes(kPart, 18)));  // alice's pushes go on

  // A node that restored the rank from here (it fetched alice's copy) retracts alice's later steps;
  // alice's later pushes are not blocked by it (a replica of the newer attempt wins by its number).
  store.NoteFetched("job", 0, "bob", "alice");
  auto restored = store.Retract("job", 0, 17, 8, "bob");
  ASSERT_OK(restored.status());
  EXPECT_EQ(*restored, 18);
  EXPECT_EQ(store.List("job").size(), 0u);
  ASSERT_OK(Put(&store, of("alice", "run-a", 19, 5), Bytes(kPart, 19)));
  ASSERT_OK(Put(&store, of("bob", "run-b", 20, 8), Bytes(kPart, 20)));
  EXPECT_EQ((*store.Find("job", 0, 0))->meta().from_peer, "bob");  // of the newest attempt
}

// One peer cannot take the room of the others: past its share of replicas (kMaxReplicasPerOrigin)
// its own oldest go, so thousands of tiny pushes to new job names leave every other peer's replicas
// and room in place; a full store evicts from the peer that holds the most.
TEST(ReplicaStoreTest, OnePeerCannotFillTheStore) {
  CountedMemory counted;
  counted.budget = 1u << 30;
  const std::vector<char> one_byte(1, 'x');
  auto tiny = [](const std::string& job, const std::string& peer) {
    ReplicaMeta m = Meta(job, 0, 1, 1);
    m.layout.clear();
    m.extra.clear();
    m.from_peer = peer;  // as the name a certificate proves
    return m;
  };
  {
    ReplicaStore store(counted.memory(), 0);
    ASSERT_OK(Put(&store, tiny("alice-job", "alice"), one_byte));
    for (int i = 0; i < 4094; ++i) ASSERT_OK(Put(&store, tiny("m" + std::to_string(i), "mallory"), one_byte));
    EXPECT_EQ(store.count(), 1 + kMaxReplicasPerOrigin);
    EXPECT_EQ(store.evicted(), 4094 - kMaxReplicasPerOrigin);
    EXPECT_TRUE(store.Find("alice-job", 0, 0).ok());
    EXPECT_FALSE(store.Find("m0", 0, 0).ok());  // mallory's oldest went
    EXPECT_TRUE(store.Find("m4093", 0, 0).ok());
    ASSERT_OK(Put(&store, tiny("bob-job", "bob"), one_byte));  // a new job of another peer still fits
    // Without TLS the origin is the node name the push gives.
    ReplicaMeta loopback = tiny("carol-job", "");
    loopback.origin_node = "carol";
    ASSERT_OK(Put(&store, loopback, one_byte));
    EXPECT_EQ(store.List("").size(), 3 + kMaxReplicasPerOrigin);
  }
  EXPECT_EQ(counted.used.load(), 0u);
  {
    // Where one peer may hold as many as the store, a full store evicts that peer's oldest.
    ReplicaStore store(counted.memory(), 0, ReplicaLimits{kMaxReplicasHeld, 0});
    ASSERT_OK(Put(&store, tiny("alice-job", "alice"), one_byte));
    for (size_t i = 0; i + 1 < kMaxReplicasHeld; ++i) {
      ASSERT_OK(Put(&store, tiny("m" + std::to_string(i), "mallory"), one_byte));
    }
    EXPECT_EQ(store.count(), kMaxReplicasHeld);
    ASSERT_OK(Put(&store, tiny("bob-job", "bob"), one_byte));
    EXPECT_EQ(store.count(), kMaxReplicasHeld);
    EXPECT_TRUE(store.Find("alice-job", 0, 0).ok());
    EXPECT_TRUE(store.Find("bob-job", 0, 0).ok());
    EXPECT_FALSE(store.Find("m0", 0, 0).ok());
  }
  EXPECT_EQ(counted.used.load(), 0u);
}

// --replica-max-bytes-per-peer: a peer over its bytes loses its oldest replica, never another
// peer's; one replica over the share alone is refused before its data.
TEST(ReplicaStoreTest, APeerOverItsBytesLosesItsOldestReplica) {
  CountedMemory counted;
  const uint64_t each = Accounted(Meta("a0", 0, 1, kPart));
  ReplicaStore store(counted.memory(), 0, ReplicaLimits{kMaxReplicasPerOrigin, 3 * each});
  const auto data = Bytes(kPart, 4);
  auto of = [](const std::string& job, const std::string& peer) {
    ReplicaMeta m = Meta(job, 0, 1, kPart);
    m.from_peer = peer;
    return m;
  };
  ASSERT_OK(Put(&store, of("b0", "b"), data));
  for (int i = 0; i < 3; ++i) ASSERT_OK(Put(&store, of("a" + std::to_string(i), "a"), data));
  EXPECT_EQ(store.count(), 4u);
  ASSERT_OK(Put(&store, of("a3", "a"), data));
  EXPECT_FALSE(store.Find("a0", 0, 0).ok());
  EXPECT_TRUE(store.Find("a1", 0, 0).ok());
  EXPECT_TRUE(store.Find("b0", 0, 0).ok());
  EXPECT_EQ(counted.used.load(), 4 * each);
  EXPECT_EQ(store.evicted(), 1u);
  ReplicaMeta big = of("a9", "a");
  big.bytes = 4 * kPart;
  Status over = store.Begin(big).status();
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over.ToString();
  EXPECT_EQ(store.count(), 4u);
  EXPECT_EQ(counted.used.load(), 4 * each);
}

// Pushes that begin together each fit the origin's bytes when they begin; each one that finishes
// makes room for itself, so the origin never holds more than its share.
TEST(ReplicaStoreTest, PushesThatBeganTogetherKeepTheOriginWithinItsBytes) {
  CountedMemory counted;
  const uint64_t each = Accounted(Meta("a0", 0, 1, kPart));
  ReplicaStore store(counted.memory(), 0, ReplicaLimits{kMaxReplicasPerOrigin, 2 * each});
  const auto data = Bytes(kPart, 4);
  std::vector<std::unique_ptr<ReplicaStore::Incoming>> incoming;
  for (int i = 0; i < 3; ++i) {
    auto in = store.Begin(Meta("a" + std::to_string(i), 0, 1, kPart));
    ASSERT_OK(in.status());
    ASSERT_OK((*in)->Append(data.data(), kPart, Xxh3(data.data(), kPart)));
    incoming.push_back(std::move(*in));
  }
  for (auto& in : incoming) ASSERT_OK(store.Finish(std::move(in)));
  EXPECT_EQ(store.count(), 2u);
  EXPECT_FALSE(store.Find("a0", 0, 0).ok());
  EXPECT_TRUE(store.Find("a2", 0, 0).ok());
  EXPECT_EQ(store.evicted(), 1u);
  EXPECT_EQ(counted.used.load(), 2 * each);
}

// A replica server over a store on a loopback port; TLS when `tls` is given.
struct ServedStore {
  CountedMemory counted;
  ReplicaStore store{counted.memory(), 0};
  std::unique_ptr<ReplicaServer> server;
  std::chrono::milliseconds stall_timeout = kReplicaStallTimeout;

  Status Start(ReplicaListenConfig config) {
    config.listen = "127.0.0.1:0";
    if (config.stall_timeout == kReplicaStallTimeout) config.stall_timeout = stall_timeout;
    server = std::make_unique<ReplicaServer>(&store, std::move(config));
    return server->Start();
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(server->port()); }
};

std::chrono::system_clock::time_point Deadline() { return std::chrono::system_clock::now() + 20s; }

// Fetches (job, rank 0) at `step` (0: the newest) from the peer as `node`, into `into`, sized to it.
Result<ReplicaMeta> FetchInto(grpc::Channel* channel, const std::string& node, const std::string& job, int64_t step,
                              std::vector<char>* into) {
  return FetchReplica(
      channel, node, job, 0, step, 1u << 30,
      [into](const ReplicaMeta& m) -> Result<char*> {
        into->resize(m.bytes);
        return into->data();
      },
      Deadline());
}

// A fetch whose reader stops taking parts is cancelled after the stall timeout, as a push that
// stops sending is: it no longer holds its replica (and the memory of one replaced meanwhile) until
// its deadline.
TEST(ReplicaServiceTest, AFetchWhoseReaderStopsIsCancelled) {
  ServedStore served;
  served.stall_timeout = 300ms;
  ASSERT_OK(served.Start({}));
  auto channel = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_OK(channel.status());
  const auto data = Bytes(32 << 20, 4);  // 512 parts of 64 KiB: more than the streams' windows
  ASSERT_OK(PushReplica(channel->get(), Meta("job", 0, 5, data.size()), data.data(), Deadline()));
  v1::Replica::Stub stub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::FetchReplicaRequest request;
  request.set_job("job");
  request.set_node("node-c");
  auto reader = stub.Fetch(&ctx, request);
  v1::ReplicaPart part;
  ASSERT_TRUE(reader->Read(&part));
  ASSERT_TRUE(part.has_header());
  std::this_thread::sleep_for(1500ms);  // takes nothing: the server's writes wait
  uint64_t parts = 0;
  while (reader->Read(&part)) ++parts;
  grpc::Status ended = reader->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::CANCELLED) << ended.error_message();
  EXPECT_LT(parts, data.size() / kPart) << "every part arrived: the stalled fetch was not cancelled";
}

TEST(ReplicaServiceTest, PushListAndFetchBitExactOverLoopback) {
  ServedStore served;
  ASSERT_TRUE(served.Start({}).ok());
  auto channel = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_TRUE(channel.ok());
  const auto data = Bytes(5 * kPart + 17, 9);
  ASSERT_TRUE(PushReplica(channel->get(), Meta("job", 3, 27, data.size()), data.data(), Deadline()).ok());

  auto listed = ListReplicas(channel->get(), "job", Deadline());
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].step, 27);
  EXPECT_EQ((*listed)[0].bytes, data.size());
  EXPECT_EQ((*listed)[0].origin_node, "node-b");

  std::vector<char> back;
  auto too_big = FetchReplica(channel->get(), "node-c", "job", 3, 0, data.size() - 1,
                              [&](const ReplicaMeta&) -> Result<char*> { return nullptr; }, Deadline());
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted) << too_big.status().ToString();
  auto fetched = FetchReplica(
      channel->get(), "node-c", "job", 3, 0, data.size(),
      [&](const ReplicaMeta& m) -> Result<char*> {
        back.resize(m.bytes);
        return back.data();
      },
      Deadline());
  ASSERT_TRUE(fetched.ok()) << fetched.status().ToString();
  EXPECT_EQ(fetched->step, 27);
  EXPECT_EQ(fetched->layout, "layout-of-rank-3");
  EXPECT_EQ(fetched->extra, "{\"step\": 27}");
  EXPECT_EQ(back, data);

  auto missing = FetchReplica(channel->get(), "node-c", "job", 4, 0, data.size(),
                              [&](const ReplicaMeta&) -> Result<char*> { return nullptr; }, Deadline());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
}

std::string Joined(const std::vector<ByteSpan>& spans) {
  std::string out;
  for (const ByteSpan& s : spans) out.append(s.data, s.size);
  return out;
}

grpc::ByteBuffer BufferOf(const std::string& text) {
  grpc::Slice slice(text.data(), text.size());
  return grpc::ByteBuffer(&slice, 1);
}

// The memory behind a lent slice stays mapped while gRPC holds the slice, also once the sender has
// stopped waiting for it and let go of everything else (its loans, its own reference to the owner).
TEST(ReplicaWireTest, ALentSliceKeepsItsOwnerAliveUntilGrpcLetsGo) {
  auto memory = std::make_shared<std::vector<char>>(Bytes(4096, 3));
  std::weak_ptr<std::vector<char>> mapped = memory;
  auto loans = SliceLoans::Make(memory);
  grpc::Slice lent = loans->Lend(memory->data(), memory->size());
  EXPECT_FALSE(loans->WaitReturned(std::chrono::steady_clock::now() + std::chrono::milliseconds(10)));
  loans.reset();
  memory.reset();
  ASSERT_FALSE(mapped.expired()) << "the owner went while gRPC held a slice of its memory";
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(lent.begin()), 16), std::string(Bytes(4096, 3).data(), 16));
  lent = grpc::Slice();  // gRPC lets go
  EXPECT_TRUE(mapped.expired());
}

// A data part goes out as slices of the sender's memory, lent until gRPC lets go of them, and comes
// in as spans of the received slices; every other encoding of a ReplicaPart is protobuf's to read.
TEST(ReplicaWireTest, ADataPartIsReadInPlaceAndEveryOtherEncodingThroughProtobuf) {
  const auto data = Bytes(300000, 5);
  const uint64_t sum = Xxh3(data.data(), data.size());
  auto loans = SliceLoans::Make();
  {
    grpc::ByteBuffer buffer = DataPartBuffer(loans->Lend(data.data(), data.size()), sum);
    EXPECT_EQ(loans->outstanding(), 1u);
    // What protobuf reads from it is the same part.
    grpc::Slice whole;
    ASSERT_TRUE(buffer.DumpToSingleSlice(&whole).ok());
    v1::ReplicaPart message;
    ASSERT_TRUE(message.ParseFromArray(whole.begin(), static_cast<int>(whole.size())));
    EXPECT_EQ(message.data(), std::string(data.begin(), data.end()));
    EXPECT_EQ(message.xxh3(), sum);
    ReceivedPart part;
    ASSERT_OK(part.Read(&buffer));
    EXPECT_TRUE(part.in_place());
    EXPECT_FALSE(part.has_header());
    EXPECT_EQ(part.data_bytes(), data.size());
    EXPECT_EQ(part.xxh3(), sum);
    EXPECT_EQ(Joined(part.data()), std::string(data.begin(), data.end()));
  }
  EXPECT_EQ(loans->outstanding(), 0u);  // the part dropped the last reference
  EXPECT_TRUE(loans->WaitReturned(std::chrono::steady_clock::now()));

  // The checksum before the data, as another encoder may write it: read by protobuf, same result.
  std::string reordered = std::string("\x19") + std::string(reinterpret_cast<const char*>(&sum), 8);
  v1::ReplicaPart data_only;
  data_only.set_data("abcdef");
  reordered += data_only.SerializeAsString();
  grpc::ByteBuffer buffer = BufferOf(reordered);
  ReceivedPart part;
  ASSERT_OK(part.Read(&buffer));
  EXPECT_FALSE(part.in_place());
  EXPECT_EQ(Joined(part.data()), "abcdef");
  EXPECT_EQ(part.xxh3(), sum);

  // A header, read into the same part.
  v1::ReplicaPart header;
  ReplicaHeaderOf(Meta("job", 2, 7, 100), header.mutable_header());
  buffer = MessageBuffer(header);
  ASSERT_OK(part.Read(&buffer));
  EXPECT_TRUE(part.has_header());
  EXPECT_EQ(part.header().step(), 7);
  EXPECT_EQ(part.data_bytes(), 0u);
  EXPECT_TRUE(part.data().empty());

  // A data field longer than the buffer, a length whose varint never ends, a checksum cut short:
  // refused.
  for (const std::string& bad : {std::string("\x12\x80\x80\x01" "abc", 7), "\x12" + std::string(11, '\x80'),
                                 std::string("\x12\x01z\x19\x01\x02", 6)}) {
    buffer = BufferOf(bad);
    EXPECT_EQ(part.Read(&buffer).code(), StatusCode::kInvalidArgument);
  }
}

// The wire is protobuf's: a sender that pushes ReplicaPart messages through the generated stub (a
// flashckptd before the parts were sent in place) is held as well. (Protobuf writes a data part's
// fields as DataPartBuffer does, so its parts are read in place too.)
// A peer that ends a Fetch with OK but sends nothing (not a flashckptd, or a broken one).
class SilentFetch final : public v1::Replica::Service {
 public:
  grpc::Status Fetch(grpc::ServerContext*, const v1::FetchReplicaRequest*,
                     grpc::ServerWriter<v1::ReplicaPart>*) override {
    return grpc::Status::OK;
  }
};

TEST(ReplicaServiceTest, AFetchThatEndsWithoutAHeaderIsAnError) {
  SilentFetch silent;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&silent);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel = ReplicaChannel({"127.0.0.1:" + std::to_string(port), "", "", "", ""});
  ASSERT_OK(channel.status());
  bool asked_for_memory = false;
  auto fetched = FetchReplica(
      channel->get(), "node-b", "job", 0, 0, 1u << 20,
      [&](const ReplicaMeta&) -> Result<char*> {
        asked_for_memory = true;
        return Internal("no memory was to be asked for");
      },
      std::chrono::system_clock::now() + std::chrono::seconds(10));
  ASSERT_FALSE(fetched.ok());
  EXPECT_EQ(fetched.status().code(), StatusCode::kCorruption) << fetched.status().ToString();
  EXPECT_FALSE(asked_for_memory);
  server->Shutdown();
}

TEST(ReplicaServiceTest, APushOfProtobufMessagesIsHeld) {
  ServedStore served;
  ASSERT_TRUE(served.Start({}).ok());
  auto channel = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_TRUE(channel.ok());
  const auto data = Bytes(3 * kPart + 5, 3);
  const ReplicaMeta meta = Meta("job", 1, 4, data.size());
  v1::Replica::Stub stub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::PushReplicaResponse response;
  auto writer = stub.Push(&ctx, &response);
  v1::ReplicaPart part;
  ReplicaHeaderOf(meta, part.mutable_header());
  ASSERT_TRUE(writer->Write(part));
  for (uint64_t at = 0; at < data.size(); at += kPart) {
    const uint64_t n = std::min<uint64_t>(kPart, data.size() - at);
    part.Clear();
    part.set_data(data.data() + at, n);
    part.set_xxh3(Xxh3(data.data() + at, n));
    ASSERT_TRUE(writer->Write(part));
  }
  ASSERT_TRUE(writer->WritesDone());
  grpc::Status done = writer->Finish();
  ASSERT_TRUE(done.ok()) << done.error_message();
  EXPECT_EQ(response.step(), 4);
  std::vector<char> back;
  auto fetched = FetchReplica(
      channel->get(), "node-c", "job", 1, 4, data.size(),
      [&](const ReplicaMeta& m) -> Result<char*> {
        back.resize(m.bytes);
        return back.data();
      },
      Deadline());
  ASSERT_TRUE(fetched.ok()) << fetched.status().ToString();
  EXPECT_EQ(back, data);
}

// A push that sends its header and then nothing holds the memory its header reserved only until
// the stall timeout: then it is cancelled, counted and its reservation given back.
TEST(ReplicaServiceTest, AStalledPushIsCancelledAndGivesItsMemoryBack) {
  ServedStore served;
  served.stall_timeout = 300ms;
  ASSERT_OK(served.Start({}));
  // (A rate cap so low that a sender's parts would look stalled is refused up front.)
  ReplicaListenConfig crawling;
  crawling.replicate_to = {"127.0.0.1:9"};
  crawling.max_rate = 512u << 10;
  EXPECT_EQ(CheckReplicaConfig(crawling).code(), StatusCode::kInvalidArgument);
  auto channel = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_OK(channel.status());
  v1::Replica::Stub stub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  v1::PushReplicaResponse response;
  auto writer = stub.Push(&ctx, &response);
  v1::ReplicaPart header;
  ReplicaHeaderOf(Meta("job", 0, 1, 8 * kPart), header.mutable_header());
  ASSERT_TRUE(writer->Write(header));
  const ReplicaMeta reserved = Meta("job", 0, 1, 8 * kPart);
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (served.counted.used.load() != Accounted(reserved) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(served.counted.used.load(), Accounted(reserved));  // the header reserved its bytes
  // Then nothing more arrives: well before the push's own deadline, the memory is back.
  while (served.counted.used.load() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(served.counted.used.load(), 0u);
  EXPECT_EQ(served.server->service().stalled_pushes(), 1u);
  writer->WritesDone();
  grpc::Status done = writer->Finish();
  EXPECT_FALSE(done.ok());
  EXPECT_EQ(served.store.count(), 0u);
  // A push that keeps sending is not disturbed, however long it takes in all.
  const auto data = Bytes(6 * kPart, 3);
  PushHooks slow;
  slow.after_part = [](uint64_t) {
    std::this_thread::sleep_for(100ms);
    return Status::OK();
  };
  ASSERT_OK(PushReplica(channel->get(), Meta("job", 0, 2, data.size()), data.data(), Deadline(), slow));
  EXPECT_EQ(served.server->service().stalled_pushes(), 1u);
}

// Retract drops only a replica of an older attempt and a later step than the one restored; its
// memory goes back to the budget; bad requests are refused.
TEST(ReplicaServiceTest, ARetractionDropsOnlyALaterStepOfAnOlderAttempt) {
  ServedStore served;
  ASSERT_TRUE(served.Start({}).ok());
  auto channel = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_TRUE(channel.ok());
  const auto data = Bytes(2 * kPart, 3);
  ASSERT_OK(PushReplica(channel->get(), Meta("job", 0, 27, data.size()), data.data(), Deadline()));  // attempt 1
  ASSERT_OK(PushReplica(channel->get(), Meta("job", 1, 20, data.size()), data.data(), Deadline()));
  const uint64_t held = served.counted.used.load();

  auto same_attempt = RetractReplica(channel->get(), "node-b", "job", 0, 20, 1, Deadline());
  ASSERT_OK(same_attempt.status());
  EXPECT_EQ(*same_attempt, 0);  // of the same attempt: not abandoned
  auto same_step = RetractReplica(channel->get(), "node-b", "job", 1, 20, 2, Deadline());
  ASSERT_OK(same_step.status());
  EXPECT_EQ(*same_step, 0);  // the step restored is the new attempt's state too
  auto rolled_back = RetractReplica(channel->get(), "node-b", "job", 0, 20, 2, Deadline());
  ASSERT_OK(rolled_back.status());
  EXPECT_EQ(*rolled_back, 27);
  auto listed = ListReplicas(channel->get(), "job", Deadline());
  ASSERT_OK(listed.status());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].rank, 1u);
  EXPECT_LT(served.counted.used.load(), held);
  auto none = RetractReplica(channel->get(), "node-b", "job", 0, 20, 3, Deadline());
  ASSERT_OK(none.status());
  EXPECT_EQ(*none, 0);

  // A push of the timeline left (an older attempt, a later step) is refused from then on; one of
  // the restored step itself is the same state and is held; once a replica of the new attempt is
  // held, the order of attempts refuses the old one's (ALREADY_EXISTS).
  const Status late = PushReplica(channel->get(), Meta("job", 0, 27, data.size()), data.data(), Deadline());
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late.ToString();
  EXPECT_NE(late.message().find("timeline the rank left"), std::string::npos) << late.ToString();
  ReplicaMeta same_state = Meta("job", 0, 20, data.size());  // the restored step itself: still the same state
  ASSERT_OK(PushReplica(channel->get(), same_state, data.data(), Deadline()));
  ReplicaMeta next = Meta("job", 0, 21, data.size());
  next.attempt = 3;
  ASSERT_OK(PushReplica(channel->get(), next, data.data(), Deadline()));
  const Status older = PushReplica(channel->get(), Meta("job", 0, 30, data.size()), data.data(), Deadline());
  EXPECT_EQ(older.code(), StatusCode::kAlreadyExists) << older.ToString();

  // Step 0 is a step a rank can restore; a negative one, attempt 0 and a bad job name are refused.
  auto at_zero = RetractReplica(channel->get(), "node-b", "other", 0, 0, 2, Deadline());
  ASSERT_OK(at_zero.status());
  EXPECT_EQ(*at_zero, 0);
  EXPECT_EQ(RetractReplica(channel->get(), "node-b", "../job", 0, 20, 2, Deadline()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RetractReplica(channel->get(), "node-b", "job", 0, -1, 2, Deadline()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RetractReplica(channel->get(), "node-b", "job", 0, 20, 0, Deadline()).status().code(), StatusCode::kInvalidArgument);
}

TEST(ReplicaServiceTest, AReplicaWithAFlippedByteIsRefusedAndDropped) {
  ServedStore served;
  ASSERT_TRUE(served.Start({}).ok());
  auto channel = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_TRUE(channel.ok());
  const auto data = Bytes(3 * kPart, 4);
  ASSERT_TRUE(PushReplica(channel->get(), Meta("job", 0, 12, data.size()), data.data(), Deadline()).ok());
  {
    auto held = served.store.Find("job", 0, 12);
    ASSERT_TRUE(held.ok());
    auto part = (*held)->VerifiedPart(1);
    ASSERT_TRUE(part.ok());
    const_cast<char*>(part->first)[100] ^= 0x10;  // memory of the peer goes bad after arrival
  }
  std::vector<char> back(data.size());
  auto fetched = FetchReplica(channel->get(), "node-c", "job", 0, 12, data.size(),
                              [&](const ReplicaMeta&) -> Result<char*> { return back.data(); }, Deadline());
  EXPECT_EQ(fetched.status().code(), StatusCode::kCorruption) << fetched.status().ToString();
  EXPECT_NE(fetched.status().message().find("part 1"), std::string::npos) << fetched.status().ToString();
  EXPECT_EQ(served.store.List("job").size(), 0u);  // dropped: no one gets it
  EXPECT_EQ(served.counted.used.load(), 0u);
}

TEST(ReplicaServiceTest, APushThatDoesNotFitIsRefusedBeforeItsData) {
  ServedStore served;
  served.counted.budget = 2 * kPart;
  ASSERT_TRUE(served.Start({}).ok());
  auto channel = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_TRUE(channel.ok());
  const auto data = Bytes(3 * kPart, 1);
  Status pushed = PushReplica(channel->get(), Meta("job", 0, 1, data.size()), data.data(), Deadline());
  EXPECT_EQ(pushed.code(), StatusCode::kResourceExhausted) << pushed.ToString();
  EXPECT_EQ(served.counted.used.load(), 0u);
}

TEST(ReplicaConfigTest, BetweenNodesTheChannelNeedsMutualTlsAndNames) {
  auto check = [](std::string listen, std::string cert, std::string key, std::string ca,
                  std::vector<std::string> names) {
    ReplicaListenConfig c;
    c.listen = std::move(listen);
    c.tls_cert = std::move(cert);
    c.tls_key = std::move(key);
    c.tls_ca = std::move(ca);
    c.allow_names = std::move(names);
    return CheckReplicaConfig(c);
  };
  EXPECT_TRUE(check("127.0.0.1:7000", "", "", "", {}).ok());
  Status open = check("0.0.0.0:7000", "", "", "", {});
  EXPECT_EQ(open.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(open.message().find("needs mutual TLS"), std::string::npos) << open.ToString();
  EXPECT_EQ(check("10.0.0.1:7000", "c.pem", "k.pem", "", {"node-b"}).code(), StatusCode::kInvalidArgument);
  Status nameless = check("10.0.0.1:7000", "c.pem", "k.pem", "ca.pem", {});
  EXPECT_NE(nameless.message().find("--replica-allow-name"), std::string::npos) << nameless.ToString();
  EXPECT_EQ(check("127.0.0.1:7000", "", "", "", {"node-b"}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(check("", "c.pem", "k.pem", "ca.pem", {"node-b"}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(check("localhost:7000", "", "", "", {}).ok());
  EXPECT_EQ(check("10.0.0.1:7000", "c.pem", "k.pem", "ca.pem", {""}).code(), StatusCode::kInvalidArgument);
  Status port = check("127.0.0.1:99999", "", "", "", {});
  EXPECT_NE(port.message().find("--replica-listen"), std::string::npos) << port.ToString();
  EXPECT_TRUE(check("10.0.0.1:7000", "c.pem", "k.pem", "ca.pem", {"node-b"}).ok());
  // Sending (--replicate-to): loopback peers without TLS, others only with it; no peer twice, not
  // this daemon's own listener; a rate cap needs a peer.
  auto sending = [](std::vector<std::string> to, bool tls, uint64_t rate = 0, std::string listen = "") {
    ReplicaListenConfig c;
    c.listen = std::move(listen);
    c.replicate_to = std::move(to);
    if (tls) c.tls_cert = "c.pem", c.tls_key = "k.pem", c.tls_ca = "ca.pem";
    c.max_rate = rate;
    return CheckReplicaConfig(c);
  };
  EXPECT_TRUE(sending({"127.0.0.1:7001", "127.0.0.1:7002"}, false, 100u << 20).ok());
  Status remote = sending({"10.0.0.2:7000"}, false);
  EXPECT_NE(remote.message().find("needs mutual TLS"), std::string::npos) << remote.ToString();
  EXPECT_TRUE(sending({"10.0.0.2:7000"}, true).ok());  // a sender alone needs no allowed names
  EXPECT_NE(sending({"127.0.0.1:7001", "127.0.0.1:7001"}, false).message().find("twice"), std::string::npos);
  EXPECT_NE(sending({"127.0.0.1:7001"}, false, 0, "127.0.0.1:7001").message().find("own"), std::string::npos);
  EXPECT_NE(sending({}, false, 1u << 20).message().find("--replicate-max-rate needs"), std::string::npos);
  EXPECT_EQ(sending({"127.0.0.1:99999"}, false).code(), StatusCode::kInvalidArgument);
}

TEST(ReplicaTlsTest, OnlyAPeerWithACertificateOfAnAllowedNameGetsIn) {
  if (::access("/usr/bin/openssl", X_OK) != 0) GTEST_SKIP() << "openssl is not installed: no certificates to test with";
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  ServedStore served;
  ASSERT_OK(served.Start(certs.Listener("node-a")));
  const auto data = Bytes(2 * kPart, 8);
  auto push_as = [&](const std::string& who, const std::string& ca) {
    ReplicaPeer peer{served.target(), who.empty() ? "" : certs.cert(who), who.empty() ? "" : certs.key(who),
                     certs.cert(ca), "node-a"};
    if (who.empty()) {  // TLS with the CA only: no client certificate
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = ReadPem(certs.cert(ca), "ca", "CERTIFICATE", "CA").value();
      grpc::ChannelArguments args;
      args.SetSslTargetNameOverride("node-a");
      auto channel = grpc::CreateCustomChannel(peer.target, grpc::SslCredentials(ssl), args);
      return PushReplica(channel.get(), Meta("job", 0, 1, data.size()), data.data(),
                         std::chrono::system_clock::now() + 5s);
    }
    auto channel = ReplicaChannel(peer);
    if (!channel.ok()) return channel.status();
    return PushReplica(channel->get(), Meta("job", 0, 1, data.size()), data.data(),
                       std::chrono::system_clock::now() + 5s);
  };
  Status allowed = push_as("node-b", "ca");
  EXPECT_TRUE(allowed.ok()) << allowed.ToString();
  auto held = served.store.Find("job", 0, 1);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ((*held)->meta().from_peer, "node-b");

  Status intruder = push_as("intruder", "ca");
  // A refusal of the sender's name: FAILED_PRECONDITION (not tried again by ReplicaSender), named.
  EXPECT_EQ(intruder.code(), StatusCode::kFailedPrecondition) << intruder.ToString();
  EXPECT_NE(intruder.message().find("PERMISSION_DENIED"), std::string::npos) << intruder.ToString();
  EXPECT_NE(intruder.message().find("not among this daemon's --replica-allow-name"), std::string::npos)
      << intruder.ToString();
  EXPECT_EQ(served.server->service().refused_calls(), 1u);

  Status no_certificate = push_as("", "ca");
  EXPECT_EQ(no_certificate.code(), StatusCode::kUnavailable) << no_certificate.ToString();
  Status other_ca = push_as("node-b-elsewhere", "ca");
  EXPECT_EQ(other_ca.code(), StatusCode::kUnavailable) << other_ca.ToString();
  // Plain TCP to the TLS port gets nowhere either.
  auto plain = ReplicaChannel({served.target(), "", "", "", ""});
  ASSERT_TRUE(plain.ok());
  Status in_clear = PushReplica(plain->get(), Meta("job", 0, 2, data.size()), data.data(),
                                std::chrono::system_clock::now() + 5s);
  EXPECT_EQ(in_clear.code(), StatusCode::kUnavailable) << in_clear.ToString();
  EXPECT_EQ(served.store.List("").size(), 1u);  // only node-b's push was held
}

// An allowed peer with a CA-signed certificate of its own name cannot replace another node's
// replica: it reads node-b's copy, sets every float to 777 and pushes it back as node-b's run with
// a later attempt and node-b's node name in the header: refused; nor does a retraction in node-b's
// name drop node-b's copy.
TEST(ReplicaTlsTest, AnAllowedPeerCannotForgeAnotherNodesReplica) {
  if (::access("/usr/bin/openssl", X_OK) != 0) GTEST_SKIP() << "openssl is not installed: no certificates to test with";
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  ServedStore served;
  ReplicaListenConfig listener = certs.Listener("node-a");
  listener.allow_names = {"node-b", "intruder"};
  ASSERT_OK(served.Start(listener));
  auto channel_of = [&](const std::string& who) {
    return ReplicaChannel({served.target(), certs.cert(who), certs.key(who), certs.cert("ca"), "node-a"});
  };
  auto node_b = channel_of("node-b");
  auto intruder = channel_of("intruder");
  ASSERT_OK(node_b.status());
  ASSERT_OK(intruder.status());
  std::vector<char> data(2 * kPart);
  for (size_t i = 0; i < data.size() / sizeof(float); ++i) {
    const float v = static_cast<float>(i);
    std::memcpy(data.data() + i * sizeof(float), &v, sizeof(float));
  }
  ReplicaMeta real = Meta("job", 0, 17, data.size());
  real.run_id = "run-b";
  real.attempt = 5;
  ASSERT_OK(PushReplica(node_b->get(), real, data.data(), Deadline()));
  // A retraction in a name it gives itself: the certificate's name is what counts, and it fetched
  // nothing here (a node that restored the rank from here may retract: ReplicaStoreTest).
  auto retracted = RetractReplica(intruder->get(), "node-b", "job", 0, 0, real.attempt + 1, Deadline());
  ASSERT_OK(retracted.status());
  EXPECT_EQ(*retracted, 0);
  ASSERT_EQ(served.store.List("job").size(), 1u);

  std::vector<char> copy;
  auto fetched = FetchInto(intruder->get(), "intruder", "job", 0, &copy);
  ASSERT_OK(fetched.status());
  const float forged_value = 777.0f;
  for (size_t i = 0; i < copy.size() / sizeof(float); ++i) {
    std::memcpy(copy.data() + i * sizeof(float), &forged_value, sizeof(float));
  }
  ReplicaMeta forged = *fetched;  // node-b's header: its run and node name
  forged.attempt += 1;
  const Status pushed = PushReplica(intruder->get(), forged, copy.data(), Deadline());
  EXPECT_EQ(pushed.code(), StatusCode::kFailedPrecondition) << pushed.ToString();
  EXPECT_NE(pushed.message().find("replicated here by 'node-b'"), std::string::npos) << pushed.ToString();

  ASSERT_EQ(served.store.List("job").size(), 1u);
  auto held = served.store.Find("job", 0, 0);
  ASSERT_OK(held.status());
  EXPECT_EQ((*held)->meta().from_peer, "node-b");
  EXPECT_EQ((*held)->meta().attempt, 5u);
  std::vector<char> back(data.size());
  auto again = FetchReplica(node_b->get(), "node-b", "job", 0, 0, 1u << 30,
                            [&](const ReplicaMeta&) -> Result<char*> { return back.data(); }, Deadline());
  ASSERT_OK(again.status());
  EXPECT_EQ(back, data);  // not a float of 777 in it
}

// A failed handshake reaches the daemon's log with its reason, once per reason however often the
// peer tries: a plaintext client on the TLS port, a client certificate of another CA.
TEST(ReplicaTlsTest, AFailedHandshakeIsLoggedOnceWithItsReason) {
  if (::access("/usr/bin/openssl", X_OK) != 0) GTEST_SKIP() << "openssl is not installed: no certificates to test with";
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  const std::string log = "/tmp/flashckpt-handshake-" + std::to_string(::getpid()) + ".log";
  ASSERT_EQ(SetLogFile(log), "");
  RouteGrpcLogsToDaemonLog();
  {
    ServedStore served;
    ASSERT_OK(served.Start(certs.Listener("node-a")));
    const auto data = Bytes(kPart, 8);
    for (int i = 0; i < 3; ++i) {
      auto plain = ReplicaChannel({served.target(), "", "", "", ""});
      ASSERT_OK(plain.status());
      EXPECT_EQ(PushReplica(plain->get(), Meta("job", 0, 1, data.size()), data.data(),
                            std::chrono::system_clock::now() + 5s)
                    .code(),
                StatusCode::kUnavailable);
      auto elsewhere = ReplicaChannel({served.target(), certs.cert("node-b-elsewhere"), certs.key("node-b-elsewhere"),
                                       certs.cert("ca"), "node-a"});
      ASSERT_OK(elsewhere.status());
      EXPECT_EQ(PushReplica(elsewhere->get(), Meta("job", 0, 1, data.size()), data.data(),
                            std::chrono::system_clock::now() + 5s)
                    .code(),
                StatusCode::kUnavailable);
    }
  }
  ASSERT_EQ(SetLogFile(""), "");
  std::ifstream in(log);
  std::vector<std::string> failures;
  for (std::string line; std::getline(in, line);) {
    if (line.find("tls handshake failed reason=") != std::string::npos) failures.push_back(line);
  }
  ::unlink(log.c_str());
  std::string all;
  for (const auto& f : failures) all += f + "\n";
  // One line per reason: the plaintext client's and the other CA's, however many attempts.
  EXPECT_GE(failures.size(), 2u) << all;
  EXPECT_LE(failures.size(), 4u) << all;
  EXPECT_NE(all.find("certificate verify failed"), std::string::npos) << all;
}

// A certificate that cannot work is refused when the flags are read (--check-config, and so the
// start), by name and reason, and by a replica listener started without them: expired, a key of
// another certificate, a CA that does not sign it. Before, each passed and every handshake failed.
TEST(ReplicaTlsTest, ACertificateThatCannotWorkIsRefusedUpFront) {
  if (::access("/usr/bin/openssl", X_OK) != 0) GTEST_SKIP() << "openssl is not installed: no certificates to test with";
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  auto check = [&](const std::string& cert, const std::string& key, const std::string& ca) {
    std::vector<std::string> args = {"flashckptd", "--socket", "/tmp/flashckpt-check.sock", "--root", "/tmp/r",
                                     "--replica-listen", "127.0.0.1:0", "--replica-tls-cert", cert,
                                     "--replica-tls-key", key, "--replica-tls-ca", ca, "--replica-allow-name",
                                     "node-b", "--check-config"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return ParseDaemonFlags(static_cast<int>(argv.size()), argv.data()).status();
  };
  Status good = check(certs.cert("node-a"), certs.key("node-a"), certs.cert("ca"));
  EXPECT_EQ(good.code(), StatusCode::kCancelled) << good.ToString();  // "config checked": accepted
  Status expired = check(certs.cert("node-a-expired"), certs.key("node-a-expired"), certs.cert("ca"));
  EXPECT_EQ(expired.code(), StatusCode::kInvalidArgument) << expired.ToString();
  EXPECT_NE(expired.message().find("--replica-tls-cert " + certs.cert("node-a-expired") + " expired on"),
            std::string::npos)
      << expired.ToString();
  Status other_key = check(certs.cert("node-a"), certs.key("node-b"), certs.cert("ca"));
  EXPECT_EQ(other_key.code(), StatusCode::kInvalidArgument) << other_key.ToString();
  EXPECT_NE(other_key.message().find("is not the key of the certificate"), std::string::npos) << other_key.ToString();
  Status other_ca = check(certs.cert("node-b-elsewhere"), certs.key("node-b-elsewhere"), certs.cert("ca"));
  EXPECT_EQ(other_ca.code(), StatusCode::kInvalidArgument) << other_ca.ToString();
  EXPECT_NE(other_ca.message().find("is not signed by the CA in --replica-tls-ca"), std::string::npos)
      << other_ca.ToString();

  ServedStore served;
  Status started = served.Start(certs.Listener("node-a-expired"));
  EXPECT_EQ(started.code(), StatusCode::kInvalidArgument) << started.ToString();
  EXPECT_NE(started.message().find("expired on"), std::string::npos) << started.ToString();
}

// The body of GET /metrics from 127.0.0.1:`port` ("" when it cannot be read).
std::string Scrape(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string text;
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) text.append(buf, static_cast<size_t>(n));
    }
  }
  if (fd >= 0) ::close(fd);
  return text;
}

TEST(ReplicaDaemonTest, FlashckptdServesReplicasCountedInItsHostMemoryBudget) {
  InProcessDaemon d("flashckpt-replica-daemon");
  ASSERT_TRUE(d.Start([](DaemonConfig& c) {
                 c.max_host_memory = 1u << 20;
                 c.replica_listen = "127.0.0.1:0";
                 c.metrics_listen = "127.0.0.1:0";
               }).ok());
  ASSERT_GT(d.server()->replica_port(), 0);
  auto channel = ReplicaChannel({"127.0.0.1:" + std::to_string(d.server()->replica_port()), "", "", "", ""});
  ASSERT_TRUE(channel.ok());
  const auto data = Bytes(12 * kPart, 1);
  ASSERT_TRUE(PushReplica(channel->get(), Meta("job", 0, 1, data.size()), data.data(), Deadline()).ok());
  const uint64_t held = Accounted(Meta("job", 0, 1, data.size()));
  EXPECT_EQ(d.daemon()->GetStatus().host_memory_used, held);
  // A trainer's registration that does not fit is told how much of the budget replicas hold.
  {
    auto local = d.Connect("local");
    ASSERT_NE(local, nullptr);
    Status refused = local->Register(Topology{}, ModelAndMomentSpecs(64u << 10));
    EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
    EXPECT_NE(refused.message().find(FormatBytes(held) + " of it holds replicas of peers' ranks"), std::string::npos)
        << refused.ToString();
  }
  const auto more = Bytes(8 * kPart, 2);
  Status over = PushReplica(channel->get(), Meta("job", 1, 1, more.size()), more.data(), Deadline());
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over.ToString();
  EXPECT_NE(over.message().find("--max-host-memory"), std::string::npos) << over.ToString();
  EXPECT_EQ(d.daemon()->GetStatus().host_memory_used, held);
  // A newer step of rank 0 fits beside the one it replaces only if both do: 12 + 12 parts do not.
  Status replacing = PushReplica(channel->get(), Meta("job", 0, 2, data.size()), data.data(), Deadline());
  EXPECT_EQ(replacing.code(), StatusCode::kResourceExhausted) << replacing.ToString();
  auto listed = ListReplicas(channel->get(), "", Deadline());
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].step, 1);
  // A push without a deadline counts too.
  {
    v1::Replica::Stub stub(*channel);
    grpc::ClientContext ctx;
    v1::PushReplicaResponse response;
    auto writer = stub.Push(&ctx, &response);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  ASSERT_GT(d.server()->metrics_port(), 0);
  const std::string metrics = Scrape(d.server()->metrics_port());
  EXPECT_EQ(metrics.rfind("HTTP/1.", 0), 0u) << metrics;
  EXPECT_NE(metrics.find(" 200 "), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("# TYPE flashckpt_replica_pushes_failed_total counter"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nflashckpt_replicas_held 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nflashckpt_replica_held_bytes " + std::to_string(data.size()) + "\n"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("\nflashckpt_replicas_received_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nflashckpt_replica_pushes_failed_total 3\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nflashckpt_replica_calls_refused_total 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nflashckpt_host_memory_used_bytes " + std::to_string(held) + "\n"), std::string::npos)
      << metrics;
}

// --- the sending side (flashckptd --replicate-to) --------------------------------------------------

// A loopback port nothing listens on (bound, then closed), for a peer the test starts later.
int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

// Whether `pred` holds within 30 s.
bool Eventually(const std::function<bool()>& pred) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

ReplicaPeerStatus PeerOf(const InProcessDaemon& d) {
  const DaemonStatus status = d.daemon()->GetStatus();
  return status.replica_peers.size() == 1 ? status.replica_peers[0] : ReplicaPeerStatus{};
}

// Whether the replica listener at `peer` holds (job, rank 0) at `step`. (A sender's lag is 0 also
// before its first offer.)
bool PeerHolds(const std::string& peer, const std::string& job, int64_t step) {
  auto channel = ReplicaChannel({peer, "", "", "", ""});
  if (!channel.ok()) return false;
  auto listed = ListReplicas(channel->get(), job, std::chrono::system_clock::now() + 5s);
  return listed.ok() && std::any_of(listed->begin(), listed->end(),
                                    [&](const ReplicaMeta& m) { return m.rank == 0 && m.step == step; });
}

// Fetches the peer's newest replica of (job, rank 0) and checks it against what the trainer saved at
// `step`: each tensor's bytes in the image where its layout says, and every chunk's checksum.
void ExpectReplicaOf(const std::string& peer, const std::string& job, int64_t step, uint64_t floats) {
  auto channel = ReplicaChannel({peer, "", "", "", ""});
  ASSERT_OK(channel.status());
  std::vector<char> image;
  auto got = FetchReplica(channel->get(), "node-c", job, 0, 0, 1u << 30,
                          [&](const ReplicaMeta& m) -> Result<char*> {
                            image.resize(m.bytes);
                            return image.data();
                          },
                          Deadline());
  ASSERT_OK(got.status());
  EXPECT_EQ(got->step, step);
  EXPECT_EQ(got->world_size, 1u);
  EXPECT_EQ(got->origin_node, "node-a");
  EXPECT_EQ(got->extra, "{\"step\":" + std::to_string(step) + "}");
  EXPECT_GT(got->attempt, 0u);
  v1::ReplicaLayout layout;
  ASSERT_TRUE(layout.ParseFromString(got->layout));
  ASSERT_EQ(layout.tensors_size(), 2);
  ASSERT_EQ(layout.first_chunk_size(), 2);
  for (int i = 0; i < 2; ++i) {
    const auto& t = layout.tensors(i);
    ASSERT_EQ(t.bytes(), floats * 4) << t.name();
    ASSERT_EQ(layout.image_offset(), kPageSize);
    ASSERT_GE(t.slot_offset(), layout.image_offset()) << t.name();
    const char* at = image.data() + (t.slot_offset() - layout.image_offset());
    ASSERT_LE(t.slot_offset() - layout.image_offset() + t.bytes(), image.size()) << t.name();
    std::vector<float> values(floats);
    std::memcpy(values.data(), at, t.bytes());
    const float want = t.name() == "w" ? static_cast<float>(step) : static_cast<float>(-step);
    EXPECT_TRUE(std::all_of(values.begin(), values.end(), [&](float v) { return v == want; })) << t.name();
    const uint64_t chunk = layout.checksum_chunk();
    ASSERT_GT(chunk, 0u);
    for (uint64_t c = 0; c * chunk < t.bytes(); ++c) {
      const uint64_t n = std::min(chunk, t.bytes() - c * chunk);
      EXPECT_EQ(layout.sums(static_cast<int>(layout.first_chunk(i) + c)),
                Xxh3(at + c * chunk, n))
          << t.name() << " chunk " << c;
    }
  }
}

// A daemon that replicates in plaintext to a peer that listens with TLS is told so in its status
// and log (the peer closes the connection at once, which says nothing by itself); one whose TLS
// handshake fails is told where the reason is.
TEST(ReplicaTlsTest, APlaintextSenderToATlsPeerIsToldWhy) {
  if (::access("/usr/bin/openssl", X_OK) != 0) GTEST_SKIP() << "openssl is not installed: no certificates to test with";
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  ServedStore served;
  ASSERT_OK(served.Start(certs.Listener("node-a")));
  InProcessDaemon origin("flashckpt-replica-plain");
  ASSERT_OK(origin.Start([&](DaemonConfig& c) {
    c.node_name = "node-b";
    c.replicate_to = {served.target()};
  }));
  TestTrainer t = origin.StartTrainer("plain", 4096);
  ASSERT_NE(t.client, nullptr);
  ASSERT_OK(t.Memory(1));
  ASSERT_TRUE(Eventually([&] { return PeerOf(origin).failed >= 1; }));
  const std::string error = PeerOf(origin).last_error;
  EXPECT_NE(error.find("UNAVAILABLE"), std::string::npos) << error;
  EXPECT_NE(error.find("a peer that listens with TLS closes a plaintext connection"), std::string::npos) << error;

  // With TLS, but of a CA neither side trusts: the handshake fails, and the status says where to look.
  InProcessDaemon foreign("flashckpt-replica-foreign");
  ASSERT_OK(foreign.Start([&](DaemonConfig& c) {
    c.node_name = "node-b";
    c.replicate_to = {served.target()};
    c.replica_tls_cert = certs.cert("node-b-elsewhere");
    c.replica_tls_key = certs.key("node-b-elsewhere");
    c.replica_tls_ca = certs.cert("other-ca");
  }));
  TestTrainer f = foreign.StartTrainer("plain", 4096);
  ASSERT_NE(f.client, nullptr);
  ASSERT_OK(f.Memory(1));
  ASSERT_TRUE(Eventually([&] { return PeerOf(foreign).failed >= 1; }));
  const std::string refused = PeerOf(foreign).last_error;
  EXPECT_NE(refused.find("the TLS handshake failed"), std::string::npos) << refused;
  EXPECT_EQ(served.store.count(), 0u);
}

// Every memory checkpoint a rank keeps reaches the peer, bit for bit with its chunk checksums; while
// the peer is down the saves go on, the failures and the lag show in status and metrics, and once it
// is up the newest checkpoint is tried again and gets there (the lag is gone), and so do the next.
TEST(ReplicaSenderTest, MemoryCheckpointsReachThePeerAndADownPeerHoldsUpNoSave) {
  constexpr uint64_t kFloats = 4096;
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon origin("flashckpt-replica-origin");
  ASSERT_OK(origin.Start([&](DaemonConfig& c) {
    c.node_name = "node-a";
    c.replicate_to = {peer};
  }));
  auto events = origin.daemon()->events().Subscribe("repl");
  TestTrainer t = origin.StartTrainer("repl", kFloats);
  ASSERT_NE(t.client, nullptr);
  for (int64_t step = 1; step <= 4; ++step) ASSERT_OK(t.Memory(step));  // nobody listens there
  // (Each is offered once its checksums are computed, after the commit.)
  ASSERT_TRUE(Eventually([&] { return PeerOf(origin).failed >= 1 && PeerOf(origin).lag_steps == 4; }));
  ReplicaPeerStatus down = PeerOf(origin);
  EXPECT_EQ(down.target, peer);
  EXPECT_EQ(down.pushed, 0u);
  EXPECT_EQ(down.lag_steps, 4);
  EXPECT_LE(down.queued, 1u);  // the newest, waiting to be tried again
  EXPECT_FALSE(down.last_error.empty());
  const std::string metrics = origin.daemon()->RenderMetrics();
  EXPECT_NE(metrics.find("\nflashckpt_replica_lag_steps{peer=\"" + peer + "\"} 4\n"), std::string::npos) << metrics;

  InProcessDaemon receiver("flashckpt-replica-peer");
  ASSERT_OK(receiver.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  // The newest checkpoint is tried again until the peer takes it: the lag recovers with no new save.
  ASSERT_TRUE(Eventually([&] { return PeerOf(origin).lag_steps == 0; })) << PeerOf(origin).last_error;
  ExpectReplicaOf(peer, "repl", 4, kFloats);
  ASSERT_OK(t.Memory(5));
  ASSERT_TRUE(Eventually([&] { return PeerOf(origin).lag_steps == 0 && PeerOf(origin).pushed == 2; }))
      << PeerOf(origin).last_error;
  // `flashckpt watch` sees the first failure (once, not per retry) and each push the peer took.
  std::vector<DaemonEvent> seen;
  DaemonEvent event;
  while (events->Next(&event, std::chrono::steady_clock::now() + 100ms) == EventHub::Wait::kEvent) {
    if (event.kind == DaemonEvent::Kind::kReplicaSent || event.kind == DaemonEvent::Kind::kReplicaFailed) {
      seen.push_back(event);
    }
  }
  ASSERT_GE(seen.size(), 3u);
  EXPECT_EQ(seen[0].kind, DaemonEvent::Kind::kReplicaFailed);
  EXPECT_EQ(seen[0].peer, peer);
  EXPECT_NE(seen[0].reason.find("UNAVAILABLE"), std::string::npos) << seen[0].reason;
  // (One failure per change of the peer's error: its wording may change once while it is down.)
  EXPECT_LE(seen.size(), 4u);
  std::vector<int64_t> sent;
  for (const DaemonEvent& e : seen) {
    if (e.kind != DaemonEvent::Kind::kReplicaSent) continue;
    sent.push_back(e.step);
    EXPECT_GT(e.bytes, 2 * kFloats * 4);
    EXPECT_EQ(e.peer, peer);
  }
  EXPECT_EQ(sent, (std::vector<int64_t>{4, 5}));
  ReplicaPeerStatus up = PeerOf(origin);
  EXPECT_GT(up.bytes, 2 * 2 * kFloats * 4);
  EXPECT_EQ(up.queued, 0u);
  EXPECT_TRUE(up.last_error.empty()) << up.last_error;
  ExpectReplicaOf(peer, "repl", 5, kFloats);
  EXPECT_NE(origin.daemon()->RenderMetrics().find("\nflashckpt_replicas_sent_total{peer=\"" + peer + "\"} 2\n"),
            std::string::npos);

  // The peer holds it in memory counted in its budget (the image, its layout and extra state).
  const uint64_t held = receiver.daemon()->GetStatus().host_memory_used;
  EXPECT_GE(held, up.bytes / 2);
  EXPECT_LT(held, up.bytes / 2 + (64u << 10));
}

// --replicate-max-rate: no push goes faster than the cap.
TEST(ReplicaSenderTest, TheRateCapHoldsEachPush) {
  constexpr uint64_t kFloats = 1u << 20;  // 4 MiB a tensor: 8 parts of 1 MiB a push
  constexpr uint64_t kRate = 16u << 20;
  InProcessDaemon receiver("flashckpt-replica-peer");
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  ASSERT_OK(receiver.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  InProcessDaemon origin("flashckpt-replica-origin");
  ASSERT_OK(origin.Start([&](DaemonConfig& c) {
    c.node_name = "node-a";
    c.replicate_to = {peer};
    c.replicate_max_rate = kRate;
  }));
  TestTrainer t = origin.StartTrainer("capped", kFloats);
  ASSERT_NE(t.client, nullptr);
  ASSERT_OK(t.Memory(1));
  ASSERT_TRUE(Eventually([&] { return PeerOf(origin).pushed == 1; })) << PeerOf(origin).last_error;
  const ReplicaPeerStatus sent = PeerOf(origin);
  EXPECT_GT(sent.bytes, 2 * kFloats * 4);
  EXPECT_LE(sent.last_gbps * 1e9, static_cast<double>(kRate)) << "bytes " << sent.bytes;
  EXPECT_GT(sent.last_gbps, 0);
  ExpectReplicaOf(peer, "capped", 1, kFloats);
}

// A push that the rate cap would stretch past the longest call a peer accepts can never finish: it
// is refused once, saying why, and not tried again (before: it ran until its deadline, failed and
// was tried again, forever).
TEST(ReplicaSenderTest, APushTheRateCapCannotFinishInTimeIsRefusedNotRetried) {
  constexpr uint64_t kFloats = 4096;  // 32 KiB of tensors: over half an hour at 16 bytes a second
  InProcessDaemon receiver("flashckpt-replica-peer");
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  ASSERT_OK(receiver.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  InProcessDaemon origin("flashckpt-replica-origin");
  ASSERT_OK(origin.Start([&](DaemonConfig& c) {
    c.node_name = "node-a";
    c.replicate_to = {peer};
    c.replicate_max_rate = 16;
  }));
  TestTrainer t = origin.StartTrainer("too-slow", kFloats);
  ASSERT_NE(t.client, nullptr);
  ASSERT_OK(t.Memory(1));
  ASSERT_TRUE(Eventually([&] { return PeerOf(origin).failed == 1; })) << PeerOf(origin).last_error;
  EXPECT_TRUE(Contains(PeerOf(origin).last_error, "raise the rate")) << PeerOf(origin).last_error;
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past the first retry's 1 s
  EXPECT_EQ(PeerOf(origin).failed, 1u);
  EXPECT_EQ(PeerOf(origin).pushed, 0u);
  EXPECT_FALSE(PeerHolds(peer, "too-slow", 1));
}

// A rank whose node is lost resumes on a fresh node from the peer's replica (tier peer), bit for bit;
// a replica whose bytes no longer match its chunk checksums is refused there and the next option,
// the disk checkpoint on the shared root, is used.
TEST(ReplicaSenderTest, ARankOnAFreshNodeResumesFromThePeersReplica) {
  constexpr uint64_t kFloats = 4096;
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon holder("flashckpt-replica-peer");
  ASSERT_OK(holder.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  const std::string root = holder.dir() + "/shared-root";  // the job's shared file system
  auto node = [&](const std::string& name) {
    return [=](DaemonConfig& c) {
      c.node_name = name;
      c.replicate_to = {peer};
      c.root = root;
      c.persist_on_stop = false;  // a lost node writes nothing more
    };
  };
  {
    InProcessDaemon lost("flashckpt-replica-lost");
    ASSERT_OK(lost.Start(node("node-a")));
    TestTrainer t = lost.StartTrainer("moved", kFloats);
    ASSERT_NE(t.client, nullptr);
    ASSERT_OK(t.Memory(1));
    ASSERT_OK(t.Save(2));
    ASSERT_OK(t.Memory(3));
    ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, "moved", 3); })) << PeerOf(lost).last_error;
  }  // the node is gone: its daemon, its shared memory

  {
    InProcessDaemon fresh("flashckpt-replica-fresh");
    ASSERT_OK(fresh.Start(node("node-c")));
    TestTrainer t = fresh.StartTrainer("moved", kFloats);
    ASSERT_NE(t.client, nullptr);
    auto candidates = t.client->Restorable(10s);
    ASSERT_OK(candidates.status());
    EXPECT_EQ(candidates->memory_steps, std::vector<int64_t>{3});
    EXPECT_EQ(candidates->disk_step, 2);
    auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
    ASSERT_OK(r.status());
    EXPECT_EQ(r->step, 3);
    EXPECT_EQ(r->tier, Tier::kPeer);
    EXPECT_EQ(r->extra, "{\"step\":3}");
    EXPECT_TRUE(t.All(3));
  }

  {
    // A rank of another layout (the same tensors, the same bytes, another shape): the replica is not
    // fetched for it, its candidates are the disk's only.
    InProcessDaemon other("flashckpt-replica-other");
    ASSERT_OK(other.Start(node("node-e")));
    auto client = other.Connect("moved", 0);
    ASSERT_NE(client, nullptr);
    std::vector<TensorSpec> specs = ModelAndMomentSpecs(kFloats);
    specs[0].shape = {kFloats / 2, 2};
    ASSERT_OK(client->Register(Topology{}, specs));
    auto candidates = client->Restorable(10s);
    ASSERT_OK(candidates.status());
    EXPECT_TRUE(candidates->memory_steps.empty());
    EXPECT_EQ(candidates->disk_step, 2);
  }

  // The peer's replica changes under it: a byte of a tensor flipped, the parts' own checksums made
  // to match (what arrives whole but is not what the rank saved), pushed as a newer step.
  auto channel = ReplicaChannel({peer, "", "", "", ""});
  ASSERT_OK(channel.status());
  std::vector<char> image;
  auto held = FetchReplica(channel->get(), "node-c", "moved", 0, 3, 1u << 30,
                           [&](const ReplicaMeta& m) -> Result<char*> {
                             image.resize(m.bytes);
                             return image.data();
                           },
                           Deadline());
  ASSERT_OK(held.status());
  v1::ReplicaLayout layout;
  ASSERT_TRUE(layout.ParseFromString(held->layout));
  image[layout.tensors(0).slot_offset() - layout.image_offset() + 100] ^= 0x10;
  ReplicaMeta bad = *held;
  bad.step = 4;
  // Of a later attempt: node-c's restore of step 3 told the peer to refuse the attempt it left.
  bad.attempt = held->attempt + 60 * 1000;  // a minute later (numbers are ms)
  bad.part_bytes = kPart;
  ASSERT_OK(PushReplica(channel->get(), bad, image.data(), Deadline()));

  InProcessDaemon fresh("flashckpt-replica-fresh");
  ASSERT_OK(fresh.Start(node("node-d")));
  TestTrainer t = fresh.StartTrainer("moved", kFloats);
  ASSERT_NE(t.client, nullptr);
  auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_TRUE(t.All(2));
}

// A rank with the daemon's EMA: its replicas carry the EMA of their step (its image, counters and
// checksums), so the rank restored from a peer's replica on a fresh node continues the average of
// that step. A replica whose EMA image was changed on the way (the parts' own checksums made to
// match) fails the EMA's checksums and the files serve the restore.
TEST(ReplicaSenderTest, ARankWithEmaRestoredFromAPeersReplicaGetsTheEmaOfItsStep) {
  constexpr uint64_t kFloats = 4096;
  const std::string job = "moved-ema";
  UnlinkEmaSegments(job);
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon holder("flashckpt-replica-peer");
  ASSERT_OK(holder.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  const std::string root = holder.dir() + "/shared-root";
  auto node = [&](const std::string& name) {
    return [=](DaemonConfig& c) {
      c.node_name = name;
      c.replicate_to = {peer};
      c.root = root;
      c.persist_on_stop = false;
    };
  };
  auto trainer = [&](InProcessDaemon& d) {
    TestTrainer t;
    t.client = d.Connect(job, 0, [](ClientOptions& o) { o.memory_checkpoints = true; });
    EmaOptions ema;
    ema.decay = 0.5;
    if (t.client) EXPECT_OK(t.client->Register(Topology{}, ModelAndMomentSpecs(kFloats), ema));
    t.w.resize(kFloats);
    t.m.resize(kFloats);
    t.bufs = {{"w", t.w.data(), kFloats * 4}, {"w.exp_avg", t.m.data(), kFloats * 4}};
    return t;
  };
  auto ema_of = [&](TestTrainer& t) -> std::pair<int64_t, float> {
    std::vector<float> ema(kFloats, -1.0f);
    auto got = t.client->Ema({{"w", ema.data(), kFloats * 4}}, 10s);
    EXPECT_OK(got.status());
    const bool alike = std::all_of(ema.begin(), ema.end(), [&](float x) { return x == ema[0]; });
    return {got.ok() ? got->step : -2, alike ? ema[0] : -1.0f};
  };
  {
    InProcessDaemon lost("flashckpt-replica-lost");
    ASSERT_OK(lost.Start(node("node-a")));
    TestTrainer t = trainer(lost);
    ASSERT_NE(t.client, nullptr);
    ASSERT_OK(t.Memory(1));  // EMA 1 (the first update copies)
    ASSERT_OK(t.Save(2));    // 0.5 * 1 + 0.5 * 2 = 1.5
    ASSERT_OK(t.Memory(3));  // 0.5 * 1.5 + 0.5 * 3 = 2.25
    ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, job, 3); })) << PeerOf(lost).last_error;
  }
  {
    InProcessDaemon fresh("flashckpt-replica-fresh");
    ASSERT_OK(fresh.Start(node("node-c")));
    TestTrainer t = trainer(fresh);
    ASSERT_NE(t.client, nullptr);
    auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
    ASSERT_OK(r.status());
    EXPECT_EQ(r->step, 3);
    EXPECT_EQ(r->tier, Tier::kPeer);
    EXPECT_TRUE(t.All(3));
    EXPECT_EQ(ema_of(t), std::make_pair(int64_t{3}, 2.25f)) << "the EMA of the peer's replica of step 3";
  }

  // The replica's EMA image changed on the way: a byte flipped, the parts' checksums made to match.
  auto channel = ReplicaChannel({peer, "", "", "", ""});
  ASSERT_OK(channel.status());
  std::vector<char> image;
  auto held = FetchReplica(channel->get(), "node-c", job, 0, 3, 1u << 30,
                           [&](const ReplicaMeta& m) -> Result<char*> {
                             image.resize(m.bytes);
                             return image.data();
                           },
                           Deadline());
  ASSERT_OK(held.status());
  v1::ReplicaLayout layout;
  ASSERT_TRUE(layout.ParseFromString(held->layout));
  ASSERT_TRUE(layout.has_ema());
  ASSERT_EQ(layout.ema().image_offset() + layout.ema().image_bytes() - layout.image_offset(), image.size());
  // Half way into the EMA image: past its header, in its tensor.
  image[layout.ema().image_offset() - layout.image_offset() + layout.ema().image_bytes() / 2] ^= 0x10;
  ReplicaMeta bad = *held;
  bad.step = 4;
  bad.attempt = held->attempt + 60 * 1000;
  bad.part_bytes = kPart;
  ASSERT_OK(PushReplica(channel->get(), bad, image.data(), Deadline()));
  InProcessDaemon fresh("flashckpt-replica-fresh");
  ASSERT_OK(fresh.Start(node("node-d")));
  TestTrainer t = trainer(fresh);
  ASSERT_NE(t.client, nullptr);
  auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_EQ(ema_of(t), std::make_pair(int64_t{2}, 1.5f)) << "the EMA of checkpoint-2 on disk";
  t.client.reset();
  fresh.Stop();
  UnlinkEmaSegments(job);
}

// A step asked for by number comes from a peer when this node does not hold it, also when the node
// holds newer ones: the peer's copy of the step is fetched, not its newest, and not passed over
// because the node has newer steps.
TEST(ReplicaSenderTest, AStepAskedForByNumberIsFetchedFromThePeer) {
  constexpr uint64_t kFloats = 4096;
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon holder("flashckpt-replica-peer");
  ASSERT_OK(holder.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  const std::string root = holder.dir() + "/shared-root";
  {
    InProcessDaemon lost("flashckpt-replica-lost");
    ASSERT_OK(lost.Start([&](DaemonConfig& c) {
      c.node_name = "node-a";
      c.replicate_to = {peer};
      c.root = root;
      c.persist_on_stop = false;
    }));
    TestTrainer t = lost.StartTrainer("asked", kFloats);
    ASSERT_NE(t.client, nullptr);
    // Memory checkpoints only: the replacement's trainer, a new process, may save before it
    // restores only while the job has no complete checkpoint on disk.
    ASSERT_OK(t.Memory(3));
    ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, "asked", 3); })) << PeerOf(lost).last_error;
  }
  // The replacement node takes memory checkpoints 4 and 5 before it is asked for step 3. Its pushes
  // are held to 2 KiB/s: a replica of ~33 KiB takes ~16 s, and the peer keeps step 3 until a newer
  // one has arrived whole. Three slots: 4 and 5 stay (the push in flight holds one of them, and the
  // newest is kept), and step 3 is fetched into the third.
  // It is configured as the node it replaces (its node name too): the trainer's run goes on, and only
  // the run's origin pushes its replicas.
  InProcessDaemon fresh("flashckpt-replica-fresh");
  ASSERT_OK(fresh.Start([&](DaemonConfig& c) {
    c.slots = 3;
    c.node_name = "node-a";
    c.replicate_to = {peer};
    c.replicate_max_rate = 2048;
    c.root = root;
    c.persist_on_stop = false;
  }));
  TestTrainer t = fresh.StartTrainer("asked", kFloats);
  ASSERT_NE(t.client, nullptr);
  ASSERT_OK(t.Memory(4));
  ASSERT_OK(t.Memory(5));
  auto r = t.client->Restore(int64_t{3}, t.bufs, 10s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 3);
  EXPECT_EQ(r->tier, Tier::kPeer);
  EXPECT_EQ(r->extra, "{\"step\":3}");
  EXPECT_TRUE(t.All(3));
}

// Starts `d` as a node named `name` that replicates to `peer`, its checkpoints under `root`.
Status StartReplicatingNode(InProcessDaemon& d, const std::string& name, const std::string& peer,
                            const std::string& root) {
  return d.Start([&](DaemonConfig& c) {
    c.node_name = name;
    c.replicate_to = {peer};
    c.root = root;
    c.persist_on_stop = false;
  });
}

// A trainer option: the run id.
std::function<void(ClientOptions&)> InRun(const std::string& id) {
  return [id](ClientOptions& o) { o.run_id = id; };
}

// Two unrelated jobs of one name (their own roots and runs, the same layout) on nodes A and B
// replicate to one peer. The peer keeps each origin's copy apart, so A's later push is held (before:
// ALREADY_EXISTS against B's, counted as sent); A's replacement node (A's root: checkpoint-10 of A's
// run on disk) does not resume B's step 30 (before: "resumed step=30 from=peer"): that replica is not
// used, said in an event, and A's own step 18 is fetched.
TEST(ReplicaSenderTest, AnotherJobOfTheSameNameIsNeverRestoredFromAPeer) {
  constexpr uint64_t kFloats = 4096;
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon holder("flashckpt-replica-peer");
  ASSERT_OK(holder.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  const std::string root_a = holder.dir() + "/root-a", root_b = holder.dir() + "/root-b";
  InProcessDaemon a("flashckpt-replica-a");
  ASSERT_OK(StartReplicatingNode(a, "node-a", peer, root_a));
  TestTrainer ta = a.StartTrainer("samename", kFloats, InRun("run-a"));
  ASSERT_NE(ta.client, nullptr);
  ASSERT_OK(ta.Save(10));
  ASSERT_OK(ta.Memory(17));
  ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, "samename", 17); })) << PeerOf(a).last_error;
  {
    InProcessDaemon b("flashckpt-replica-b");
    ASSERT_OK(StartReplicatingNode(b, "node-b", peer, root_b));
    TestTrainer tb = b.StartTrainer("samename", kFloats, InRun("run-b"));
    ASSERT_NE(tb.client, nullptr);
    ASSERT_OK(tb.Memory(30));
    ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, "samename", 30); })) << PeerOf(b).last_error;
  }
  // A's next push is held beside B's copy.
  ASSERT_OK(ta.Memory(18));
  ASSERT_TRUE(Eventually([&] { return PeerOf(a).pushed == 2; })) << PeerOf(a).last_error;
  EXPECT_EQ(PeerOf(a).failed, 0u) << PeerOf(a).last_error;
  ASSERT_TRUE(PeerHolds(peer, "samename", 18));
  ASSERT_TRUE(PeerHolds(peer, "samename", 30));
  ta.client.reset();
  a.Stop();

  InProcessDaemon replacement("flashckpt-replica-a2");
  ASSERT_OK(StartReplicatingNode(replacement, "node-a2", peer, root_a));
  auto events = replacement.daemon()->events().Subscribe("samename");
  ASSERT_OK(events.status());
  TestTrainer t = replacement.StartTrainer("samename", kFloats, InRun("run-a"));
  ASSERT_NE(t.client, nullptr);
  auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 18) << "not A's own newest (30 is another job's)";
  EXPECT_EQ(r->tier, Tier::kPeer);
  EXPECT_TRUE(t.All(18));
  bool said = false;
  DaemonEvent event;
  while (!said && events->Next(&event, std::chrono::steady_clock::now() + 2s) == EventHub::Wait::kEvent) {
    said = event.kind == DaemonEvent::Kind::kMemoryFallback && Contains(event.reason, "not used") &&
           Contains(event.reason, "run run-b") && Contains(event.reason, "run run-a, step 10 on disk");
    if (!said) continue;
    EXPECT_EQ(event.step, 30);
  }
  EXPECT_TRUE(said) << "no event said why the peer's replica was not used";
}

// Node A (a node of its own, run-a) saves step 10 to `root` and takes memory step 17 of `job`,
// which reaches `peer`; then node A is lost.
void NodeAReplicatesStep17(const std::string& peer, const std::string& root, const std::string& job) {
  constexpr uint64_t kFloats = 4096;
  InProcessDaemon a("flashckpt-replica-a");
  ASSERT_OK(StartReplicatingNode(a, "node-a", peer, root));
  TestTrainer t = a.StartTrainer(job, kFloats, InRun("run-a"));
  ASSERT_NE(t.client, nullptr);
  ASSERT_OK(t.Save(10));
  ASSERT_OK(t.Memory(17));
  ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, job, 17); })) << PeerOf(a).last_error;
}

// The flash path across two lost nodes: node A (run-a: disk step 10, memory step 17) is lost; its
// replacement resumes step 17 from the peer under a new run id (run-s) and takes memory step 20, and
// is lost too. The next replacement (disk: run-a's step 10) takes step 20: its attempt restored a
// step past the newest on disk, so it continues the job's lineage (run-s is not run-a).
TEST(ReplicaSenderTest, AReplicaOfARelaunchThatResumedFromMemoryContinuesTheLineage) {
  constexpr uint64_t kFloats = 4096;
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon holder("flashckpt-replica-peer");
  ASSERT_OK(holder.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  const std::string root = holder.dir() + "/shared-root";
  ASSERT_NO_FATAL_FAILURE(NodeAReplicatesStep17(peer, root, "relaunched"));
  {
    InProcessDaemon a2("flashckpt-replica-a2");
    ASSERT_OK(StartReplicatingNode(a2, "node-a2", peer, root));
    TestTrainer t = a2.StartTrainer("relaunched", kFloats, InRun("run-s"));
    ASSERT_NE(t.client, nullptr);
    auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
    ASSERT_OK(r.status());
    ASSERT_EQ(r->step, 17);
    ASSERT_EQ(r->tier, Tier::kPeer);
    ASSERT_OK(t.Memory(20));
    ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, "relaunched", 20); })) << PeerOf(a2).last_error;
  }
  InProcessDaemon a3("flashckpt-replica-a3");
  ASSERT_OK(StartReplicatingNode(a3, "node-a3", peer, root));
  TestTrainer t = a3.StartTrainer("relaunched", kFloats, InRun("run-t"));
  ASSERT_NE(t.client, nullptr);
  auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 20) << "the relaunch's replica was not taken for the job's lineage";
  EXPECT_EQ(r->tier, Tier::kPeer);
  EXPECT_TRUE(t.All(20));
}

// A replica whose header names a run of the job's lineage but whose layout (what the rank's memory
// checkpoint is kept as) names another run does not hold together: it is refused, and the disk's
// step is restored. Before, it was restored and kept as the layout's run, which then counted as the
// lineage's for later replicas.
TEST(ReplicaSenderTest, AReplicaWhoseHeaderAndLayoutNameOtherRunsIsRefused) {
  constexpr uint64_t kFloats = 4096;
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon holder("flashckpt-replica-peer");
  ASSERT_OK(holder.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  const std::string root = holder.dir() + "/shared-root";
  ASSERT_NO_FATAL_FAILURE(NodeAReplicatesStep17(peer, root, "mixed"));
  // Step 18 of a later attempt in node-a's name (without TLS a peer names itself): step 17's bytes
  // and checksums, the header's run run-a, its layout's run-x. It replaces node-a's 17.
  auto channel = ReplicaChannel({peer, "", "", "", ""});
  ASSERT_OK(channel.status());
  std::vector<char> image;
  auto fetched = FetchInto(channel->get(), "node-f", "mixed", 17, &image);
  ASSERT_OK(fetched.status());
  ReplicaMeta forged = *fetched;
  auto layout = DecodeReplicaLayout(forged.layout);
  ASSERT_OK(layout.status());
  ASSERT_EQ(layout->run_id, "run-a");
  layout->run_id = "run-x";
  forged.layout = EncodeReplicaLayout(*layout);
  forged.step = 18;
  forged.attempt += 1000;
  ASSERT_OK(PushReplica(channel->get(), forged, image.data(), Deadline()));

  InProcessDaemon a2("flashckpt-replica-a2");
  ASSERT_OK(StartReplicatingNode(a2, "node-a2", peer, root));
  TestTrainer t = a2.StartTrainer("mixed", kFloats, InRun("run-s"));
  ASSERT_NE(t.client, nullptr);
  auto r = t.client->Restore(std::nullopt, t.bufs, 10s);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 10) << "the replica whose layout names another run was restored";
  EXPECT_EQ(r->tier, Tier::kDisk);
  EXPECT_TRUE(t.All(10));
}

// A rollback reaches the peers: a rank that restores an older step here has the peer drop its
// replica of the later step (of the attempt the rank left), so a replacement node does not resume
// the abandoned timeline from it; the rank's next memory checkpoint is held there again.
TEST(ReplicaSenderTest, ARollbackIsToldToThePeers) {
  constexpr uint64_t kFloats = 4096;
  const std::string peer = "127.0.0.1:" + std::to_string(FreePort());
  InProcessDaemon holder("flashckpt-replica-peer");
  ASSERT_OK(holder.Start([&](DaemonConfig& c) { c.replica_listen = peer; }));
  InProcessDaemon origin("flashckpt-replica-origin");
  ASSERT_OK(origin.Start([&](DaemonConfig& c) {
    c.node_name = "node-a";
    c.replicate_to = {peer};
  }));
  TestTrainer t = origin.StartTrainer("rolled", kFloats);
  ASSERT_NE(t.client, nullptr);
  ASSERT_OK(t.Memory(2));
  ASSERT_OK(t.Memory(3));
  ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, "rolled", 3); })) << PeerOf(origin).last_error;

  auto r = t.client->Restore(int64_t{2}, t.bufs, 10s);  // from this node's memory
  ASSERT_OK(r.status());
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(r->tier, Tier::kMemory);
  ASSERT_TRUE(Eventually([&] {
    auto channel = ReplicaChannel({peer, "", "", "", ""});
    if (!channel.ok()) return false;
    auto listed = ListReplicas(channel->get(), "rolled", std::chrono::system_clock::now() + 5s);
    return listed.ok() && listed->empty();
  })) << PeerOf(origin).last_error;

  // The new timeline's checkpoints reach the peer as before (the session's steps go on increasing).
  ASSERT_OK(t.Memory(4));
  ASSERT_TRUE(Eventually([&] { return PeerHolds(peer, "rolled", 4); })) << PeerOf(origin).last_error;
  ExpectReplicaOf(peer, "rolled", 4, kFloats);
}

}  // namespace
}  // namespace flashckpt
