#include "common/base/thread_pool.h"

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "testing.h"

namespace flashckpt {
namespace {

TEST(ParallelLoop, RunsEveryIndexExactlyOnce) {
  ParallelLoop loop(3);
  EXPECT_EQ(loop.threads(), 4u);
  for (size_t count : {0, 1, 2, 5, 1000}) {
    std::vector<std::atomic<int>> calls(count);
    loop.Run(count, [&](size_t i) { calls[i].fetch_add(1); });
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(calls[i].load(), 1) << "count " << count << " index " << i;
  }
}

// What the loop's users rely on: writes made by the bodies are visible to the caller once Run
// returns, without any synchronisation of their own (plain, non-atomic stores).
TEST(ParallelLoop, TheBodiesWritesAreVisibleWhenRunReturns) {
  ParallelLoop loop(3);
  std::vector<uint64_t> out(4096);
  for (uint64_t round = 1; round <= 50; ++round) {
    loop.Run(out.size(), [&](size_t i) { out[i] = i * round; });
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], i * round);
  }
}

TEST(ParallelLoop, UsesItsHelperThreadsAndTheCaller) {
  ParallelLoop loop(2);
  std::vector<std::thread::id> ran(3);
  // Each body waits until three distinct threads have started one, so the loop cannot finish on
  // fewer threads than it has.
  std::atomic<int> started{0};
  loop.Run(3, [&](size_t i) {
    ran[i] = std::this_thread::get_id();
    started.fetch_add(1);
    while (started.load() < 3) std::this_thread::yield();
  });
  EXPECT_NE(ran[0], ran[1]);
  EXPECT_NE(ran[1], ran[2]);
  EXPECT_NE(ran[0], ran[2]);
}

TEST(ParallelLoop, SeveralLoopsTakeTurnsOnOnePoolWhenTheirCallersSerialize) {
  ParallelLoop loop(2);
  std::mutex mu;  // "One loop at a time: callers serialize."
  std::vector<std::thread> callers;
  std::atomic<uint64_t> total{0};
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 20; ++round) {
        std::lock_guard<std::mutex> lock(mu);
        loop.Run(100, [&](size_t i) { total.fetch_add(i); });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 3u * 20u * (99u * 100u / 2));
}

TEST(ParallelLoop, ANoThreadLoopRunsOnTheCaller) {
  ParallelLoop loop(0);
  EXPECT_EQ(loop.threads(), 1u);
  const auto caller = std::this_thread::get_id();
  bool all_on_caller = true;
  loop.Run(10, [&](size_t) { all_on_caller = all_on_caller && std::this_thread::get_id() == caller; });
  EXPECT_TRUE(all_on_caller);
}

}  // namespace
}  // namespace flashckpt
