// One line per headline ratio, for the table scripts/bench.sh prints after all benchmarks:
//   SUMMARY<TAB>row<TAB>ratio<TAB>target<TAB>verdict
// `target` is text like ">= 0.9x" (empty when the row has none); the verdict is met / NOT met / -.
#pragma once

#include <cstdio>
#include <string>

namespace flashckpt::bench {

inline void SummaryRow(const std::string& row, double ratio, const char* op = nullptr, double target = 0) {
  std::string goal = "", verdict = "-";
  if (op != nullptr) {
    char text[32];
    std::snprintf(text, sizeof text, "%s %.2fx", op, target);
    goal = text;
    const bool met = std::string(op) == "<=" ? ratio <= target : ratio >= target;
    verdict = met ? "met" : "NOT met";
  }
  std::printf("SUMMARY\t%s\t%.2fx\t%s\t%s\n", row.c_str(), ratio, goal.c_str(), verdict.c_str());
}

}  // namespace flashckpt::bench
