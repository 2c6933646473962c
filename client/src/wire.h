// The client library's side of the wire: conversions between its own types (the public ones of
// client.h and admin.h, and the trainer client's data path below) and the flashckpt.v1 protobuf
// messages; the rest of the library only hands the messages to the gRPC stub. The mapping from
// gRPC status codes to flashckpt's is proto/convert.h's (FromGrpc), and so is the daemon's side of
// it (ToGrpc): IO_ERROR, which gRPC has no code for, travels as INTERNAL with "IO_ERROR" in the
// status details.
#pragma once

#include <grpcpp/support/status.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flashckpt.pb.h"
#include "flashckpt/admin.h"
#include "flashckpt/client.h"
#include "flashckpt/status.h"
#include "proto/convert.h"

namespace flashckpt {

// --- trainer client ---
// Register's request (without the session id and resumed_from, which each attempt sets).
v1::RegisterRequest RegisterRequestOf(const Topology& topology, const std::vector<TensorSpec>& tensors,
                                      const EmaOptions& ema, const ClientOptions& options);
// GetStatus's answer in protobuf's JSON mapping with the proto field names (Client::StatusJson).
Result<std::string> StatusResponseJson(const v1::StatusResponse& status);

// --- trainer client: the data path (client.cc) ---
// The requests take the session id of the attempt that sends them: a re-attach between two attempts
// (Client::Impl::WithSession) gives the next one a new session.

// A slot the daemon lent: to fill (BeginSnapshot), given back with Commit or AbortSnapshot; or to
// read (Restore, GetEma), given back with ReleaseSlot.
struct SlotLoan {
  uint32_t slot = 0;
  uint64_t generation = 0;
};

// The commit of a filled slot.
struct SlotCommit {
  std::string session_id;  // of the session that began the snapshot
  SlotLoan slot;
  int64_t step = 0;
  bool persist = true;
  std::optional<double> loss;
  std::string extra;
};

// GetEma's answer: the slot the daemon copied the EMA into.
struct EmaHandover {
  SlotLoan slot;
  bool initialized = false;  // false: no update applied yet
  int64_t step = 0;          // of the last update
};

// The XXH3-64 of each chunk of one tensor of a memory checkpoint handed over for the client to
// verify, counted from its first byte at `slot_offset` in the slot.
struct TensorChunkSums {
  uint64_t slot_offset = 0;
  uint64_t bytes = 0;
  std::vector<uint64_t> sums;
};

// Restore's answer.
struct RestoreHandover {
  bool found = false;  // false: the job has no complete checkpoint (not an error)
  int64_t step = 0;
  SlotLoan slot;
  std::string extra;
  Tier tier = Tier::kDisk;
  // Not verified by the daemon: the client checks each chunk against `chunk_sums` as it copies.
  bool verify_in_client = false;
  uint64_t chunk_bytes = 0;
  std::vector<TensorChunkSums> chunk_sums;
};

v1::BeginSnapshotRequest BeginSnapshotRequestOf(const std::string& session_id, int64_t step,
                                                std::chrono::milliseconds slot_timeout, Tier tier);
SlotLoan SlotLoanOf(const v1::BeginSnapshotResponse& resp);
v1::CommitRequest CommitRequestOf(const SlotCommit& commit);
v1::AbortSnapshotRequest AbortSnapshotRequestOf(const std::string& session_id, const SlotLoan& slot);
// `corrupt`: what the client's verification of the memory checkpoint in the slot found (the first
// 1024 bytes are sent).
v1::ReleaseSlotRequest ReleaseSlotRequestOf(const std::string& session_id, const SlotLoan& slot,
                                            const std::string& corrupt);
v1::WaitPersistedRequest WaitPersistedRequestOf(const std::string& session_id, int64_t step,
                                                std::chrono::milliseconds timeout);
v1::WaitCompleteRequest WaitCompleteRequestOf(const std::string& session_id, int64_t step,
                                              std::chrono::milliseconds timeout);
v1::RestorableRequest RestorableRequestOf(const std::string& session_id, std::optional<int64_t> extra_of,
                                          std::chrono::milliseconds timeout, bool verify);
RestorableSteps RestorableStepsOf(const v1::RestorableResponse& resp);
v1::GetEmaRequest GetEmaRequestOf(const std::string& session_id, std::chrono::milliseconds timeout);
EmaHandover EmaHandoverOf(const v1::GetEmaResponse& resp);
// `step` nullopt: the latest complete checkpoint. The caller has checked options.kinds (no kEma).
v1::RestoreRequest RestoreRequestOf(const std::string& session_id, std::optional<int64_t> step,
                                    const RestoreOptions& options, std::chrono::milliseconds timeout,
                                    bool verify_in_client);
RestoreHandover RestoreHandoverOf(const v1::RestoreResponse& resp);

// --- operator client (admin.h) ---
DaemonStatus DaemonStatusFromProto(const v1::StatusResponse& status);
std::vector<CheckpointInfo> CheckpointsFromProto(const v1::ListCheckpointsResponse& list);
DaemonEvent EventFromProto(const v1::Event& event);
DeleteResult DeleteResultFromProto(const v1::DeleteCheckpointsResponse& resp);

}  // namespace flashckpt
