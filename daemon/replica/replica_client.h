// A daemon's calls to its replica peers (flashckpt.v1.Replica, daemon/replica/replica_server.h):
// push a replica, list what a peer holds, fetch one back. Every part travels with its XXH3-64 and is
// checked on both ends.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "daemon/replica/replica_store.h"
#include "replica.pb.h"

namespace flashckpt {

// A peer's answer as a Status. A refusal of this daemon (its certificate's name not allowed there:
// PERMISSION_DENIED, UNAUTHENTICATED) or of the call (a server that serves no replicas:
// UNIMPLEMENTED) is FAILED_PRECONDITION, named in the message: the peer's configuration must change
// before a call can succeed, so it is not tried again (ReplicaSender) as a peer that is down is.
Status PeerStatus(const grpc::Status& s, std::string_view rpc);

// A replica's header on the wire and back (both ends of Push and Fetch).
ReplicaMeta ReplicaMetaOf(const v1::ReplicaHeader& header);
void ReplicaHeaderOf(const ReplicaMeta& meta, v1::ReplicaHeader* header);

// How to reach a peer: its HOST:PORT, and for mutual TLS this daemon's certificate and key and the
// CA of the peers' certificates (all three, or none for a loopback peer). `server_name`: the name
// the peer's certificate must carry, when it is not the host of `target`.
struct ReplicaPeer {
  std::string target;
  std::string tls_cert, tls_key, tls_ca;
  std::string server_name;
};
Result<std::shared_ptr<grpc::Channel>> ReplicaChannel(const ReplicaPeer& peer);
// What a failed call to `peer` likely means when gRPC's message does not say it: a connection the
// peer closed at once (a plaintext daemon to a TLS listener, or a certificate the peer does not
// trust), a failed handshake. "" when there is nothing to add; else " (...)" to append.
std::string ConnectionHint(const ReplicaPeer& peer, const Status& status);

// What a push asks its caller as it goes: after each part (with the bytes sent so far), and once
// every part is sent, before the push is finished. An error from either cancels the push (the peer
// keeps what it held before) and is returned.
// `context` is called with the call's context when the push starts and with null before it ends:
// TryCancel on it from another thread in between cancels the push (a push blocked on a slow peer
// included).
struct PushHooks {
  std::function<Status(uint64_t sent)> after_part;
  std::function<Status()> before_done;
  std::function<void(grpc::ClientContext*)> context;
  // Keeps `data` mapped while gRPC holds a part of it, should that outlast the call (SliceLoans).
  std::shared_ptr<const void> owner;
};

// Streams `data` (meta.bytes of it) to the peer in parts of meta.part_bytes, each hashed in place
// and handed to gRPC without a copy (replica_wire.h); returns once gRPC has let go of all of them.
// Bytes that change under the push fail the peer's checksum and the push: the error is then what
// `hooks.before_done` says of them (whether they are still the checkpoint's), when it fails.
Status PushReplica(grpc::Channel* channel, const ReplicaMeta& meta, const char* data,
                   std::chrono::system_clock::time_point deadline, const PushHooks& hooks = {});

Result<std::vector<ReplicaMeta>> ListReplicas(grpc::Channel* channel, const std::string& job,
                                              std::chrono::system_clock::time_point deadline);

// Tells the peer that the rank was restored to `step` in attempt `attempt` (Replica.Retract), as
// the daemon `node` (its --node-name; a peer with TLS takes the certificate's name instead):
// returns the step of the replica it dropped, 0 when it held none of an older attempt and later step.
// The peer drops `node`'s own copies, and another origin's only when `node` fetched that one here.
// `context`, when set, is called with the call's context before it starts and with nullptr when it
// ended (to cancel it meanwhile, as PushHooks::context).
Result<int64_t> RetractReplica(grpc::Channel* channel, const std::string& node, const std::string& job, uint32_t rank,
                               int64_t step, uint64_t attempt, std::chrono::system_clock::time_point deadline,
                               const std::function<void(grpc::ClientContext*)>& context = {});

// Fetches, as the daemon `node` (as RetractReplica), the peer's replica of (job, rank) at `step` (0:
// the newest it holds), of `origin`'s copy (OriginOf of what List gave; empty: the newest of any
// origin's). A replica of more than `max_bytes` is refused (RESOURCE_EXHAUSTED) before `into` is
// called; `into` is called once with the replica's header and returns where its meta.bytes bytes
// go; every part is checked against its checksum as it is copied there (CORRUPTION names the first
// that is not).
Result<ReplicaMeta> FetchReplica(grpc::Channel* channel, const std::string& node, const std::string& job, uint32_t rank,
                                 int64_t step, uint64_t max_bytes,
                                 const std::function<Result<char*>(const ReplicaMeta&)>& into,
                                 std::chrono::system_clock::time_point deadline, const std::string& origin = "");

}  // namespace flashckpt
