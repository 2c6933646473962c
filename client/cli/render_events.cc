// `flashckpt watch`: one line or JSON object per daemon event.
#include "client/cli/render.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <string>

#include "client/cli/render_internal.h"

namespace flashckpt::cli {
namespace {

// "2026-11-23T01:02:03.456Z"
std::string UtcText(double unix_seconds) {
  if (!std::isfinite(unix_seconds) || unix_seconds < 0) unix_seconds = 0;
  auto whole = static_cast<std::time_t>(unix_seconds);
  int millis = static_cast<int>((unix_seconds - static_cast<double>(whole)) * 1000);
  std::tm tm{};
  gmtime_r(&whole, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, std::min(millis, 999));
  return buf;
}

const char* EventKindText(DaemonEvent::Kind kind) {
  switch (kind) {
    case DaemonEvent::Kind::kSnapshotCommitted: return "committed";
    case DaemonEvent::Kind::kSnapshotSkipped: return "skipped";
    case DaemonEvent::Kind::kEmaUpdated: return "ema-updated";
    case DaemonEvent::Kind::kPersisted: return "persisted";
    case DaemonEvent::Kind::kPersistFailed: return "failed";
    case DaemonEvent::Kind::kCheckpointComplete: return "complete";
    case DaemonEvent::Kind::kCheckpointDeleted: return "deleted";
    case DaemonEvent::Kind::kEventsLost: return "lost";
    case DaemonEvent::Kind::kPersistAbandoned: return "abandoned";
    case DaemonEvent::Kind::kJobReleased: return "released";
    case DaemonEvent::Kind::kSplitAttempt: return "split-attempt";
    case DaemonEvent::Kind::kMemoryFallback: return "memory-fallback";
    case DaemonEvent::Kind::kReplicaSent: return "replica-sent";
    case DaemonEvent::Kind::kReplicaFailed: return "replica-failed";
    case DaemonEvent::Kind::kParitySent: return "parity-sent";
    case DaemonEvent::Kind::kParityFailed: return "parity-failed";
    case DaemonEvent::Kind::kParityRebuilt: return "parity-rebuilt";
    default: return "unknown";
  }
}

double Gbps(uint64_t bytes, double seconds) { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }

}  // namespace

std::string EventText(const DaemonEvent& e) {
  char kind[16];
  std::snprintf(kind, sizeof kind, "%-11s", EventKindText(e.kind));
  std::string out = UtcText(e.unix_seconds) + " " + kind;
  if (e.kind == DaemonEvent::Kind::kEventsLost) {
    return out + " " + std::to_string(e.lost) + " event(s) dropped: this watcher fell behind";
  }
  if (e.kind == DaemonEvent::Kind::kJobReleased) {
    // The memory checkpoint newer than disk it wrote first, or the newest one it dropped (--force).
    std::string memory;
    if (e.code == "written") memory = " written_step=" + std::to_string(e.step);
    if (e.code == "dropped") memory = " dropped_step=" + std::to_string(e.step);
    return out + " job=" + e.job + " bytes=" + CompactBytes(e.bytes) + " reason=" + e.reason + memory;
  }
  out += " job=" + e.job + " step=" + std::to_string(e.step);
  switch (e.kind) {
    case DaemonEvent::Kind::kCheckpointComplete: break;
    case DaemonEvent::Kind::kCheckpointDeleted: out += " reason=" + e.reason; break;
    case DaemonEvent::Kind::kSplitAttempt: out += " reason=\"" + e.reason + "\""; break;
    case DaemonEvent::Kind::kMemoryFallback:
      out += " rank=" + std::to_string(e.rank) + " reason=\"" + e.reason + "\"";
      break;
    case DaemonEvent::Kind::kReplicaSent:
    case DaemonEvent::Kind::kParitySent:
      out += " rank=" + std::to_string(e.rank) + " peer=" + e.peer + " bytes=" + CompactBytes(e.bytes) +
             " secs=" + Fixed(e.seconds, 3) + " gbps=" + Fixed(Gbps(e.bytes, e.seconds), 2);
      break;
    case DaemonEvent::Kind::kReplicaFailed:
    case DaemonEvent::Kind::kParityFailed:
      out += " rank=" + std::to_string(e.rank) + " peer=" + e.peer + " error=\"" + e.reason + "\"";
      break;
    case DaemonEvent::Kind::kParityRebuilt:
      out += " rank=" + std::to_string(e.rank) + " bytes=" + CompactBytes(e.bytes) + " secs=" + Fixed(e.seconds, 3) +
             " from=\"" + e.reason + "\"";
      break;
    case DaemonEvent::Kind::kSnapshotCommitted:
      out += " rank=" + std::to_string(e.rank) + " bytes=" + CompactBytes(e.bytes) + " for=" + e.reason;
      break;
    case DaemonEvent::Kind::kEmaUpdated: out += " rank=" + std::to_string(e.rank) + " secs=" + Fixed(e.seconds, 3); break;
    case DaemonEvent::Kind::kPersisted:
      out += " rank=" + std::to_string(e.rank) + " bytes=" + CompactBytes(e.bytes) +
             " secs=" + Fixed(e.seconds, 2) + " gbps=" + Fixed(Gbps(e.bytes, e.seconds), 2);
      break;
    case DaemonEvent::Kind::kPersistFailed:
      out += " rank=" + std::to_string(e.rank) + " code=" + e.code + " error=\"" + e.reason + "\"";
      break;
    case DaemonEvent::Kind::kSnapshotSkipped:
    case DaemonEvent::Kind::kPersistAbandoned:
      out += " rank=" + std::to_string(e.rank) + " reason=\"" + e.reason + "\"";
      break;
    default: break;
  }
  return out;
}

ordered_json EventJson(const DaemonEvent& e) {
  ordered_json j;
  j["time"] = UtcText(e.unix_seconds);
  j["unix_seconds"] = e.unix_seconds;
  j["event"] = EventKindText(e.kind);
  if (e.kind == DaemonEvent::Kind::kEventsLost) {
    j["lost"] = e.lost;
    return j;
  }
  j["job"] = e.job;
  j["step"] = e.step;
  j["rank"] = e.rank;
  j["bytes"] = e.bytes;
  j["seconds"] = e.seconds;
  if (e.kind == DaemonEvent::Kind::kPersisted || e.kind == DaemonEvent::Kind::kReplicaSent) {
    j["gbps"] = Gbps(e.bytes, e.seconds);
  }
  if (!e.peer.empty()) j["peer"] = e.peer;
  if (!e.code.empty()) j["code"] = e.code;
  if (!e.reason.empty()) j["reason"] = e.reason;
  return j;
}

}  // namespace flashckpt::cli
