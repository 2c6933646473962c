// Texts of the core's refusals that more than one of its files gives (daemon/core/*.cc only).
#pragma once

#include <cstdint>
#include <string>

#include "common/base/names.h"

namespace flashckpt {

inline constexpr char kStoppingMessage[] =
    "the daemon is stopping: it takes no new sessions, registrations or snapshots while it finishes the writes in "
    "flight; connect again once it has restarted";

// The budget refusal's note on memory that jobs with no rank connected still hold.
inline std::string DisconnectedText(uint64_t bytes) {
  if (bytes == 0) return "";
  return "; " + FormatBytes(bytes) +
         " of it belongs to jobs with no rank connected, given back after --idle-release or at once by "
         "`flashckpt release --job JOB`";
}

// The budget refusal's note on memory that replicas held for peers take (ReserveHostMemory).
inline std::string ReplicaText(uint64_t bytes) {
  if (bytes == 0) return "";
  return "; " + FormatBytes(bytes) + " of it holds replicas of peers' ranks (--replica-listen)";
}

}  // namespace flashckpt
