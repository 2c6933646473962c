// Test helpers shared by every gtest binary.
#pragma once

#include <gtest/gtest.h>

#include "flashckpt/status.h"

#define ASSERT_OK(expr)                                        \
  do {                                                         \
    const ::flashckpt::Status _fc_s = (expr);                  \
    ASSERT_TRUE(_fc_s.ok()) << #expr << " -> " << _fc_s.ToString(); \
  } while (0)

#define EXPECT_OK(expr)                                        \
  do {                                                         \
    const ::flashckpt::Status _fc_s = (expr);                  \
    EXPECT_TRUE(_fc_s.ok()) << #expr << " -> " << _fc_s.ToString(); \
  } while (0)

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace flashckpt {

// The EMA segments of `job` in /dev/shm ("flashckpt.<job>.<rank>[.<scope>].ema"), whichever daemon
// made them: a daemon leaves them for its successor, so a test that is done with the job removes
// them. Job names in tests are unique to the test.
inline std::vector<std::string> EmaSegmentsOf(const std::string& job) {
  std::vector<std::string> out;
  const std::string prefix = "flashckpt." + job + ".";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && name.size() > 4 && name.compare(name.size() - 4, 4, ".ema") == 0) {
      out.push_back(name);
    }
  }
  return out;
}

inline void UnlinkEmaSegments(const std::string& job) {
  for (const std::string& name : EmaSegmentsOf(job)) {
    std::error_code ec;
    std::filesystem::remove("/dev/shm/" + name, ec);
  }
}

}  // namespace flashckpt
