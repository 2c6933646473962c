#include "common/base/names.h"

#include <unistd.h>

#include <charconv>
#include <cstring>
#include <cstdlib>
#include <cmath>
#include <cstdio>

namespace flashckpt {

Status ValidateJobName(std::string_view job) {
  if (job.empty() || job.size() > kMaxJobNameLength) {
    return InvalidArgument("job name must be 1 to 128 characters, got " + std::to_string(job.size()));
  }
  if (job == "." || job == "..") return InvalidArgument("job name may not be '.' or '..'");
  for (char c : job) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-';
    if (!ok) {
      return InvalidArgument("job name '" + std::string(job) +
                             "' has a character outside [A-Za-z0-9._-]; it becomes a directory name");
    }
  }
  return Status::OK();
}

namespace {

// Run ids and node names: [A-Za-z0-9._:-].
bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '-' || c == ':';
}

// `what` ("run id", "node name") of 1 to `max` characters of IsIdChar.
Status ValidateId(std::string_view what, std::string_view value, size_t max) {
  if (value.empty() || value.size() > max) {
    return InvalidArgument(std::string(what) + " must be 1 to " + std::to_string(max) + " characters, got " +
                           std::to_string(value.size()));
  }
  for (char c : value) {
    if (!IsIdChar(c)) {
      return InvalidArgument(std::string(what) + " '" + std::string(value) +
                             "' has a character outside [A-Za-z0-9._:-]");
    }
  }
  return Status::OK();
}

}  // namespace

Status ValidateNodeName(std::string_view node) { return ValidateId("node name", node, kMaxNodeNameLength); }

std::string DefaultNodeName() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') return "localhost";
  std::string name(host, ::strnlen(host, sizeof host - 1));
  if (name.size() > kMaxNodeNameLength) name.resize(kMaxNodeNameLength);
  for (char& c : name) {
    if (!IsIdChar(c)) c = '-';
  }
  return name;
}

Status ValidateRunId(std::string_view run_id) { return ValidateId("run id", run_id, kMaxRunIdLength); }

Status ValidateTensorName(std::string_view name) {
  if (name.empty() || name.size() > kMaxTensorNameLength) {
    return InvalidArgument("tensor name must be 1 to 512 characters");
  }
  if (name == "__metadata__") return InvalidArgument("tensor name '__metadata__' is reserved by safetensors");
  for (char c : name) {
    if (c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '@') {
      return InvalidArgument("tensor name '" + std::string(name) +
                             "' has a character that is not printable ASCII or is one of \" \\ @");
    }
  }
  return Status::OK();
}

std::string FileStem(std::string_view kind, uint32_t tp, uint32_t pp, uint32_t shard) {
  char buf[96];
  std::snprintf(buf, sizeof buf, ".tp%02u_pp%02u_shard%02u", tp, pp, shard);
  return std::string(kind) + buf;
}

std::string CheckpointDirName(int64_t step) { return "checkpoint-" + std::to_string(step); }

std::optional<int64_t> ParseCheckpointDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "checkpoint-";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  std::string_view digits = name.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  int64_t step = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (ec != std::errc() || ptr != digits.data() + digits.size() || step < 0) return std::nullopt;
  if (CheckpointDirName(step) != name) return std::nullopt;  // no leading zeros or signs
  return step;
}

std::string SignalFileName(uint32_t rank) { return "saved_signal_" + std::to_string(rank); }

std::optional<uint32_t> ParseSignalFileName(std::string_view name) {
  constexpr std::string_view kPrefix = "saved_signal_";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  std::string_view digits = name.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 10) return std::nullopt;
  uint32_t rank = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
  if (ec != std::errc() || ptr != digits.data() + digits.size()) return std::nullopt;
  if (SignalFileName(rank) != name) return std::nullopt;  // no leading zeros
  return rank;
}

std::string ExtraFileName(uint32_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "extra.rank%05u.json", rank);
  return buf;
}

std::optional<uint64_t> ParseByteSize(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  if (i == 0) return std::nullopt;
  std::string number(text.substr(0, i));
  char* end = nullptr;
  double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || !std::isfinite(value) || value < 0) return std::nullopt;
  std::string_view unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KiB" || unit == "KB") scale = 1024.0;
  else if (unit == "M" || unit == "MiB" || unit == "MB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB" || unit == "GB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TiB" || unit == "TB") scale = 1024.0 * 1024 * 1024 * 1024;
  else return std::nullopt;
  double bytes = value * scale;
  if (bytes >= 1.8e19) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

std::string FormatBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[48];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

std::string Clip(std::string_view text, size_t max) {
  if (text.size() <= max) return std::string(text);
  return std::string(text.substr(0, max)) + "...(" + std::to_string(text.size()) + " bytes)";
}

}  // namespace flashckpt
