// The gRPC edge's translation between the daemon core's types (daemon/core/core_types.h,
// daemon/edge/registration.h) and the flashckpt.v1 messages. daemon/edge/service.cc uses it; the core never
// does, except for the state directory's records (RegistrationRecord).
#pragma once

#include "daemon/core/core_types.h"
#include "daemon/edge/registration.h"
#include "flashckpt.pb.h"

namespace flashckpt {

v1::RegisterResponse ToProto(const RegisterReply& reply);
v1::StatusResponse ToProto(const DaemonStatus& status);
v1::Event ToProto(const DaemonEvent& event);

// A registration as the request that would make it (without session id or resumed_from): what a
// segment's record keeps, so that the next daemon's ParseRegistration gives the same registration.
v1::RegisterRequest RegistrationRecord(const Registration& registration);

}  // namespace flashckpt
