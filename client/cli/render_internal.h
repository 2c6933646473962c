// What the render_*.cc files of `flashckpt`'s output share: the text table and a few formats of
// numbers. Not part of render.h: tests and commands use the rendering functions only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace flashckpt::cli {

using ordered_json = nlohmann::ordered_json;

// Columns padded to their widest cell; numeric columns align right so digits line up.
class TextTable {
 public:
  TextTable(std::vector<std::string> header, std::vector<bool> right_aligned) : right_(std::move(right_aligned)) {
    rows_.push_back(std::move(header));
  }
  void AddRow(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

  std::string Render(const std::string& indent) const {
    std::vector<size_t> width(rows_.front().size(), 0);
    for (const auto& row : rows_) {
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) width[c] = std::max(width[c], row[c].size());
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line = indent;
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        if (c > 0) line += "  ";
        std::string pad(width[c] - row[c].size(), ' ');
        bool last = c + 1 == row.size();
        if (c < right_.size() && right_[c])
          line += pad + row[c];
        else
          line += last ? row[c] : row[c] + pad;  // no trailing blanks
      }
      out += line + "\n";
    }
    return out;
  }

 private:
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// null for a step that has not happened yet (negative), else the step.
ordered_json StepJson(int64_t step);
// Decay as typed: 0.999, 0.9999, 0.99995 (enough digits to tell configurations apart).
std::string DecayText(double decay);
// `v` with `digits` digits after the point.
std::string Fixed(double v, int digits);
// "12.4GiB": FormatBytes without its space, so that key=value fields split on blanks.
std::string CompactBytes(uint64_t bytes);

}  // namespace flashckpt::cli
