// How the state directory's records (daemon/core/state_dir.h) are encoded in their files: the
// messages of proto/flashckpt/v1/daemon_state.proto, the registration as the trainer's
// RegisterRequest (daemon/edge/wire.h), checked again when read back (ParseRegistration) exactly
// as a trainer's request is. The core holds this through DaemonConfig::state_records and never
// sees a protobuf type.
#pragma once

#include "daemon/core/state_dir.h"

namespace flashckpt {

// The codec every daemon uses (a stateless singleton: thread-safe).
const StateRecordCodec& ProtoStateRecords();

}  // namespace flashckpt
