// The replica listener of flashckptd (--replica-listen HOST:PORT): a grpc::Server of its own that
// serves flashckpt.v1.Replica (proto/flashckpt/v1/replica.proto) over a ReplicaStore and, with
// --ec-group, flashckpt.v1.Parity (daemon/parity/parity_service.h). A peer can push and fetch
// replicas and parity there, nothing else: no checkpoint, no slot, no other RPC.
//
// Between nodes the channel is mutual TLS: --replica-tls-cert/--replica-tls-key are this daemon's
// certificate, --replica-tls-ca the CA that signed its peers' (a client without a certificate from
// it fails the handshake), and every call's peer must present a certificate whose common name or a
// subject alternative name is one of --replica-allow-name (PERMISSION_DENIED otherwise). Without
// TLS the listener binds loopback addresses only (CheckReplicaConfig).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "daemon/replica/replica_store.h"
#include "daemon/replica/stall_watchdog.h"
#include "replica.grpc.pb.h"

namespace flashckpt {

// The longest a replica push may last (its deadline must be nearer), and how many may be in flight.
constexpr std::chrono::minutes kMaxReplicaCall{30};
constexpr int kMaxPushesInFlight = 8;
// A push whose header or next part has not arrived for this long is cancelled, and the memory it
// reserved given back: a peer that stalls holds no budget (a part is at most kMaxReplicaPartBytes;
// a peer that cannot send 4 MiB in this time is of no use as a replica's origin anyway).
constexpr std::chrono::seconds kReplicaStallTimeout{10};
// The slowest --replicate-max-rate: a part (ReplicaSender's, 1 MiB) well within the stall timeout.
constexpr uint64_t kMinReplicateRate = 1u << 20;

struct ReplicaListenConfig {
  std::string listen;  // HOST:PORT
  std::string tls_cert, tls_key, tls_ca;
  std::vector<std::string> allow_names;
  std::vector<std::string> replicate_to;  // the peers this daemon sends to (HOST:PORT each)
  uint64_t max_rate = 0;                  // bytes per second to each of them; 0: no cap
  std::chrono::milliseconds stall_timeout = kReplicaStallTimeout;  // tests set it short
};

// The flags' rules, for --check-config and Start: TLS files all three or none, for a listener or
// peers to send to; a listener with TLS needs at least one allowed name, and allowed names need
// it; without TLS, loopback addresses only (listening and sending); no peer twice, and not this
// daemon's own listener; a rate cap needs a peer.
Status CheckReplicaConfig(const ReplicaListenConfig& config);

// The name in the calling peer's certificate that `allow_names` (--replica-allow-name) allows; ""
// when `allow_names` is empty (loopback without TLS). PERMISSION_DENIED, naming what the
// certificate presented, otherwise. Every service of the replica listener checks its calls so.
grpc::Status AllowedPeer(grpc::ServerContext* ctx, const std::vector<std::string>& allow_names, std::string* name);

// Every name the calling peer's certificate presents (its common name and subject alternative
// names, IP addresses as text); none without TLS.
std::vector<std::string> PresentedNames(grpc::ServerContext* ctx);
// Those names as a log line or an error shows them: "a, b", each clipped.
std::string NamesText(const std::vector<std::string>& names);

class ReplicaService final : public v1::Replica::Service {
 public:
  // Starts the watchdog that cancels stalled pushes (`stall_timeout`); the destructor stops it.
  ReplicaService(ReplicaStore* store, std::vector<std::string> allow_names,
                 std::chrono::milliseconds stall_timeout = kReplicaStallTimeout);
  ~ReplicaService() override = default;
  ReplicaService(const ReplicaService&) = delete;
  ReplicaService& operator=(const ReplicaService&) = delete;

  // Push, bound in place of the generated method's message reader: the parts arrive as byte buffers
  // whose data is copied once, from the received slices into the replica (replica_wire.h).
  grpc::Status RawPush(grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
                       v1::PushReplicaResponse* response);
  grpc::Status List(grpc::ServerContext* ctx, const v1::ListReplicasRequest* request,
                    v1::ListReplicasResponse* response) override;
  // Fetch, bound as Push is: each part is handed to gRPC in place, a slice of the replica's memory.
  grpc::Status RawFetch(grpc::ServerContext* ctx,
                        grpc::ServerSplitStreamer<v1::FetchReplicaRequest, grpc::ByteBuffer>* stream);
  grpc::Status Retract(grpc::ServerContext* ctx, const v1::RetractReplicaRequest* request,
                       v1::RetractReplicaResponse* response) override;

  uint64_t refused_calls() const { return refused_.load(); }
  uint64_t received() const { return received_.load(); }  // pushes held
  uint64_t refused_pushes() const { return refused_pushes_.load(); }  // pushes of allowed peers not held
  uint64_t stalled_pushes() const { return watchdog_.stalled(); }  // cancelled by the watchdog

 private:
  // The part of Push after its admission: receives the header and the parts into the store, watched
  // for stalls throughout; OK once the replica is held.
  grpc::Status Receive(grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
                       const std::string& peer, v1::PushReplicaResponse* response);

  // The peer's certificate name that --replica-allow-name allows ("" without TLS), or PERMISSION_DENIED.
  grpc::Status Peer(grpc::ServerContext* ctx, std::string* name);
  // Who makes a fetch or a retraction, for the store's rules: the certificate name `peer` (Peer),
  // or without TLS the node name the request gives. INVALID_ARGUMENT for a malformed name.
  static grpc::Status Actor(const std::string& peer, const std::string& node, std::string* actor);

  ReplicaStore* store_;
  const std::vector<std::string> allow_names_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<int> pushes_{0};
  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> refused_pushes_{0};
  StallWatchdog watchdog_;  // the pushes under way
  // The fetches under way: one whose reader takes nothing for the stall timeout is cancelled, and
  // lets go of its replica (which may have been replaced and still hold its memory).
  StallWatchdog fetch_watchdog_;
};

// The replica listener's metrics, in the text exposition format, for the daemon's /metrics:
// flashckpt_replicas_held, flashckpt_replica_held_bytes, flashckpt_replica_kept_bytes,
// flashckpt_replicas_received_total,
// flashckpt_replica_pushes_failed_total, flashckpt_replica_pushes_stalled_total,
// flashckpt_replicas_evicted_total and flashckpt_replica_calls_refused_total.
std::string RenderReplicaMetrics(const ReplicaStore& store, const ReplicaService& service);

class ReplicaServer {
 public:
  ReplicaServer(ReplicaStore* store, ReplicaListenConfig config);
  ~ReplicaServer();

  // Checks the config, reads the TLS files, binds and starts serving.
  Status Start();
  void Shutdown(std::chrono::system_clock::time_point deadline);
  int port() const { return port_; }  // the bound port, after Start
  const ReplicaService& service() const { return service_; }
  // Serves `service` (not owned; it must outlive the server) on the same listener, with the same
  // TLS. Before Start.
  void AddService(grpc::Service* service) { extra_services_.push_back(service); }

 private:
  const ReplicaListenConfig config_;
  ReplicaService service_;
  std::vector<grpc::Service*> extra_services_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace flashckpt
