// A rank's registration (daemon/core/registration.h) parsed from the RegisterRequest a trainer
// sends (daemon/edge/service.cc) or that a restarted daemon reads back from its state directory
// (daemon/core/recovery.cc): both go through ParseRegistration, so both are checked the same way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "daemon/core/registration.h"
#include "flashckpt.pb.h"

namespace flashckpt {

// Converts and checks the request's fields; the layout itself is checked by BuildRankLayout.
Result<Registration> ParseRegistration(const v1::RegisterRequest& request);

}  // namespace flashckpt
