#include "daemon/replica/replica_server.h"

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/io/net.h"
#include "daemon/observe/metrics.h"
#include "daemon/replica/certificates.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_wire.h"
#include "proto/convert.h"

namespace flashckpt {

Status CheckReplicaConfig(const ReplicaListenConfig& c) {
  const int tls_files = !c.tls_cert.empty() + !c.tls_key.empty() + !c.tls_ca.empty();
  if (tls_files != 0 && tls_files != 3) {
    return InvalidArgument("--replica-tls-cert, --replica-tls-key and --replica-tls-ca go together: mutual TLS needs "
                           "this daemon's certificate and key and the CA of its peers' certificates");
  }
  if (c.listen.empty() && c.replicate_to.empty() && tls_files > 0) {
    return InvalidArgument("--replica-tls-* need --replica-listen or --replicate-to");
  }
  if (c.listen.empty() && !c.allow_names.empty()) return InvalidArgument("--replica-allow-name needs --replica-listen");
  if (c.replicate_to.empty() && c.max_rate > 0) return InvalidArgument("--replicate-max-rate needs --replicate-to");
  if (c.max_rate > 0 && c.max_rate < kMinReplicateRate) {
    return InvalidArgument("--replicate-max-rate " + FormatBytes(c.max_rate) + " per second is under " +
                           FormatBytes(kMinReplicateRate) + ": a peer cancels a push that sends no part (1 MiB) for " +
                           std::to_string(kReplicaStallTimeout.count()) + " s");
  }
  std::vector<std::string> targets;
  for (const auto& text : c.replicate_to) {
    ASSIGN_OR_RETURN(ListenAddress peer, ParseListenAddress(text, "--replicate-to"));
    if (std::find(targets.begin(), targets.end(), peer.Target()) != targets.end()) {
      return InvalidArgument("--replicate-to " + peer.Target() + " is given twice");
    }
    targets.push_back(peer.Target());
    if (tls_files == 0 && !peer.loopback) {
      return InvalidArgument("--replicate-to " + peer.Target() + " is not a loopback address: between nodes the "
                             "replica channel needs mutual TLS (--replica-tls-cert, --replica-tls-key, "
                             "--replica-tls-ca)");
    }
  }
  if (c.listen.empty()) return Status::OK();
  ASSIGN_OR_RETURN(ListenAddress address, ParseListenAddress(c.listen, "--replica-listen"));
  if (address.port != 0 && std::find(targets.begin(), targets.end(), address.Target()) != targets.end()) {
    return InvalidArgument("--replicate-to " + address.Target() + " is this daemon's own --replica-listen");
  }
  if (tls_files == 3 && c.allow_names.empty()) {
    return InvalidArgument("--replica-tls-* needs at least one --replica-allow-name: the certificate names of the "
                           "peers that may push and fetch replicas");
  }
  for (const auto& name : c.allow_names) {
    if (Status valid = ValidateNodeName(name); !valid.ok()) {
      return InvalidArgument("--replica-allow-name '" + Clip(name) + "': " + valid.message());
    }
  }
  if (tls_files == 0 && !c.allow_names.empty()) {
    return InvalidArgument("--replica-allow-name needs --replica-tls-cert, --replica-tls-key and --replica-tls-ca "
                           "(names are those of the peers' certificates)");
  }
  if (tls_files == 0 && !address.loopback) {
    return InvalidArgument("--replica-listen " + address.Target() + " is not a loopback address: between nodes the "
                           "replica channel needs mutual TLS (--replica-tls-cert, --replica-tls-key, "
                           "--replica-tls-ca, --replica-allow-name)");
  }
  return Status::OK();
}

ReplicaService::ReplicaService(ReplicaStore* store, std::vector<std::string> allow_names,
                               std::chrono::milliseconds stall_timeout)
    : store_(store),
      allow_names_(std::move(allow_names)),
      watchdog_("replica", "replica push", stall_timeout),
      fetch_watchdog_("replica", "replica fetch", stall_timeout) {
  // Push is method 0 of flashckpt.v1.Replica (the order of replica.proto). Marked "streamed", a
  // method takes the handler given here; the server treats it as bidirectional, which to a
  // client-streaming handler only means no request is read before it runs.
  MarkMethodStreamed(0, new grpc::internal::ClientStreamingHandler<ReplicaService, grpc::ByteBuffer,
                                                                   v1::PushReplicaResponse>(
                            [](ReplicaService* service, grpc::ServerContext* ctx,
                               grpc::ServerReader<grpc::ByteBuffer>* reader, v1::PushReplicaResponse* response) {
                              return service->RawPush(ctx, reader, response);
                            },
                            this));
  // Fetch is method 2: its one request read first, then the parts written.
  MarkMethodStreamed(2, new grpc::internal::SplitServerStreamingHandler<v1::FetchReplicaRequest, grpc::ByteBuffer>(
                            [this](grpc::ServerContext* ctx,
                                   grpc::ServerSplitStreamer<v1::FetchReplicaRequest, grpc::ByteBuffer>* stream) {
                              return RawFetch(ctx, stream);
                            }));
}

std::vector<std::string> PresentedNames(grpc::ServerContext* ctx) {
  std::vector<std::string> presented;
  auto auth = ctx->auth_context();
  if (!auth) return presented;
  for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
    for (const auto& value : auth->FindPropertyValues(property)) presented.emplace_back(value.data(), value.size());
  }
  return presented;
}

std::string NamesText(const std::vector<std::string>& names) {
  std::string shown;
  for (const auto& name : names) shown += (shown.empty() ? "" : ", ") + Clip(name);
  return shown;
}

grpc::Status AllowedPeer(grpc::ServerContext* ctx, const std::vector<std::string>& allow_names, std::string* name) {
  name->clear();
  if (allow_names.empty()) return grpc::Status::OK;  // loopback without TLS (CheckReplicaConfig)
  const std::vector<std::string> presented = PresentedNames(ctx);
  for (const auto& p : presented) {
    if (std::find(allow_names.begin(), allow_names.end(), p) != allow_names.end()) {
      *name = p;
      return grpc::Status::OK;
    }
  }
  const std::string shown = NamesText(presented);
  Logger("replica")->warn("replica call refused peer={} names=[{}]: not among --replica-allow-name", ctx->peer(),
                          shown);
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      "the peer's certificate names [" + shown + "] are not among this daemon's --replica-allow-name");
}

grpc::Status ReplicaService::Peer(grpc::ServerContext* ctx, std::string* name) {
  grpc::Status allowed = AllowedPeer(ctx, allow_names_, name);
  if (!allowed.ok()) refused_.fetch_add(1);
  return allowed;
}

grpc::Status ReplicaService::Actor(const std::string& peer, const std::string& node, std::string* actor) {
  if (!peer.empty()) {
    *actor = peer;  // what its certificate proves, whatever it says
    return grpc::Status::OK;
  }
  if (!node.empty() && !ValidateNodeName(node).ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the request's node name '" + Clip(node) +
                                                                "' is not a node name");
  }
  *actor = node;
  return grpc::Status::OK;
}

grpc::Status ReplicaService::RawPush(grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
                                     v1::PushReplicaResponse* response) {
  std::string peer;
  if (grpc::Status allowed = Peer(ctx, &peer); !allowed.ok()) return allowed;
  // Every push of an allowed peer that is not held counts as failed, whatever the reason.
  struct Outcome {
    std::atomic<uint64_t>* failed;
    bool held = false;
    ~Outcome() {
      if (!held) failed->fetch_add(1);
    }
  } outcome{&refused_pushes_};
  if (ctx->deadline() > std::chrono::system_clock::now() + kMaxReplicaCall) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "a replica push must carry a deadline, at most " + std::to_string(kMaxReplicaCall.count()) +
                            " minutes away");
  }
  // Each push in flight holds its replica's bytes from its header on: a few at a time.
  struct InFlight {
    std::atomic<int>* n;
    ~InFlight() { n->fetch_sub(1); }
  } in_flight{&pushes_};
  if (pushes_.fetch_add(1) >= kMaxPushesInFlight) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        std::to_string(kMaxPushesInFlight) + " replica pushes are in flight here; try again");
  }
  grpc::Status received = Receive(ctx, reader, peer, response);
  outcome.held = received.ok();
  return received;
}

grpc::Status ReplicaService::Receive(grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
                                     const std::string& peer, v1::PushReplicaResponse* response) {
  // Watched from here to the return: a push that stops sending is cancelled (watchdog_).
  StallWatchdog::Watched watched(&watchdog_, ctx);
  const auto stalled = [&] {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        "the push was cancelled: nothing arrived for " + std::to_string(watchdog_.timeout().count()) +
                            " ms (a stalled push holds no memory here)");
  };
  const auto refused = [&](const Status& why) {
    Logger("replica")->warn("replica refused from={} error=\"{}\"", ctx->peer(), why.ToString());
    return ToGrpc(why);
  };
  grpc::ByteBuffer buffer;
  if (!reader->Read(&buffer)) {
    if (watched.Stalled()) return stalled();
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a replica push begins with its header");
  }
  watched.Progress();
  ReceivedPart part;
  if (Status read = part.Read(&buffer); !read.ok()) return refused(read);
  if (!part.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a replica push begins with its header");
  }
  ReplicaMeta meta = ReplicaMetaOf(part.header());
  meta.from_peer = peer;
  auto incoming = store_->Begin(std::move(meta));
  if (!incoming.ok()) return refused(incoming.status());
  while (reader->Read(&buffer)) {
    watched.Progress();
    if (Status read = part.Read(&buffer); !read.ok()) return refused(read);
    if (part.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a replica push has one header");
    }
    if (Status appended = (*incoming)->Append(part.data(), part.xxh3()); !appended.ok()) return refused(appended);
  }
  if (watched.Stalled()) return stalled();
  if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "the push was cancelled");
  const int64_t step = (*incoming)->meta().step;
  const uint64_t bytes = (*incoming)->meta().bytes;
  if (Status held = store_->Finish(std::move(*incoming)); !held.ok()) {
    Logger("replica")->warn("replica refused from={} error=\"{}\"", ctx->peer(), held.ToString());
    return ToGrpc(held);
  }
  received_.fetch_add(1);
  response->set_step(step);
  response->set_bytes(bytes);
  return grpc::Status::OK;
}

grpc::Status ReplicaService::List(grpc::ServerContext* ctx, const v1::ListReplicasRequest* request,
                                  v1::ListReplicasResponse* response) {
  std::string peer;
  if (grpc::Status allowed = Peer(ctx, &peer); !allowed.ok()) return allowed;
  for (const ReplicaMeta& m : store_->List(request->job())) {
    v1::ReplicaInfo* info = response->add_replicas();
    info->set_job(m.job);
    info->set_rank(m.rank);
    info->set_step(m.step);
    info->set_attempt(m.attempt);
    info->set_world_size(m.world_size);
    info->set_bytes(m.bytes);
    info->set_origin_node(m.origin_node);
    info->set_from_peer(m.from_peer);
    info->set_run_id(m.run_id);
    info->set_resumed_from(m.resumed_from);
  }
  return grpc::Status::OK;
}

grpc::Status ReplicaService::RawFetch(grpc::ServerContext* ctx,
                                      grpc::ServerSplitStreamer<v1::FetchReplicaRequest, grpc::ByteBuffer>* stream) {
  std::string peer;
  if (grpc::Status allowed = Peer(ctx, &peer); !allowed.ok()) return allowed;
  if (ctx->deadline() > std::chrono::system_clock::now() + kMaxReplicaCall) {
    // A fetch keeps its replica, and its memory, for as long as it runs.
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a replica fetch must carry a deadline, at most " +
                                                                std::to_string(kMaxReplicaCall.count()) +
                                                                " minutes away");
  }
  v1::FetchReplicaRequest request;
  if (!stream->Read(&request)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a replica fetch begins with its request");
  }
  std::string actor;
  if (grpc::Status named = Actor(peer, request.node(), &actor); !named.ok()) return named;
  auto found = store_->Find(request.job(), request.rank(), request.step(), request.origin());
  if (!found.ok()) return ToGrpc(found.status());
  const Replica& replica = **found;
  // Watched from here to the return: a fetch whose reader stops taking parts is cancelled.
  StallWatchdog::Watched watched(&fetch_watchdog_, ctx);
  v1::ReplicaPart header;
  ReplicaHeaderOf(replica.meta(), header.mutable_header());
  if (!stream->Write(MessageBuffer(header))) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the fetching peer went away");
  }
  for (uint64_t i = 0; i < replica.parts(); ++i) {
    auto bytes = replica.VerifiedPart(i);
    if (!bytes.ok()) {
      // Memory here no longer holds what arrived: the replica is of no use to anyone.
      Logger("replica")->error("replica dropped job={} rank={} step={} error=\"{}\"", replica.meta().job,
                               replica.meta().rank, replica.meta().step, bytes.status().ToString());
      store_->Drop(&replica);
      return ToGrpc(bytes.status());
    }
    // Sent from the replica's memory; each part keeps the replica alive until gRPC lets go of it.
    if (!stream->Write(DataPartBuffer(SliceOwnedBy(bytes->first, bytes->second, *found), replica.part_sum(i)))) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          watched.Stalled() ? "the fetching peer took no part for " +
                                                  std::to_string(fetch_watchdog_.timeout().count()) + " ms"
                                            : std::string("the fetching peer went away"));
    }
    watched.Progress();
  }
  store_->NoteFetched(replica.meta().job, replica.meta().rank, actor, OriginOf(replica.meta()));
  return grpc::Status::OK;
}

grpc::Status ReplicaService::Retract(grpc::ServerContext* ctx, const v1::RetractReplicaRequest* request,
                                     v1::RetractReplicaResponse* response) {
  std::string peer;
  if (grpc::Status allowed = Peer(ctx, &peer); !allowed.ok()) return allowed;
  std::string actor;
  if (grpc::Status named = Actor(peer, request->node(), &actor); !named.ok()) return named;
  auto dropped = store_->Retract(request->job(), request->rank(), request->step(), request->attempt(), actor);
  if (!dropped.ok()) return ToGrpc(dropped.status());
  if (*dropped > 0) {
    Logger("replica")->info("replica retracted job={} rank={} step={}: the rank was restored to step={} by={}",
                            request->job(), request->rank(), *dropped, request->step(), actor);
  }
  response->set_dropped_step(*dropped);
  return grpc::Status::OK;
}

std::string RenderReplicaMetrics(const ReplicaStore& store, const ReplicaService& service) {
  std::string out;
  MetricHeader(&out, "flashckpt_replicas_held", "gauge", "Ranks whose replica this daemon holds for its peers.");
  MetricSample(&out, "flashckpt_replicas_held", "", static_cast<double>(store.count()));
  MetricHeader(&out, "flashckpt_replica_held_bytes", "gauge",
               "Bytes of the replicas held for peers (their layout and extra state not counted).");
  MetricSample(&out, "flashckpt_replica_held_bytes", "", static_cast<double>(store.held_bytes()));
  MetricHeader(&out, "flashckpt_replica_kept_bytes", "gauge",
               "Memory of replaced replicas kept for the next push of their rank (MADV_FREE, outside the budget).");
  MetricSample(&out, "flashckpt_replica_kept_bytes", "", static_cast<double>(store.kept_bytes()));
  MetricHeader(&out, "flashckpt_replicas_received_total", "counter", "Replica pushes received whole and held.");
  MetricSample(&out, "flashckpt_replicas_received_total", "", static_cast<double>(service.received()));
  MetricHeader(&out, "flashckpt_replica_pushes_failed_total", "counter",
               "Replica pushes of allowed peers not held: refused (no deadline, too many in flight, bad header, no "
               "memory, bad part, not newer than the one held) or broken off.");
  MetricSample(&out, "flashckpt_replica_pushes_failed_total", "", static_cast<double>(service.refused_pushes()));
  MetricHeader(&out, "flashckpt_replica_pushes_stalled_total", "counter",
               "Replica pushes cancelled because nothing arrived for the stall timeout (their memory given back).");
  MetricSample(&out, "flashckpt_replica_pushes_stalled_total", "", static_cast<double>(service.stalled_pushes()));
  MetricHeader(&out, "flashckpt_replicas_evicted_total", "counter",
               "Replicas evicted to keep one peer within its share (count and bytes) or the store within its size.");
  MetricSample(&out, "flashckpt_replicas_evicted_total", "", static_cast<double>(store.evicted()));
  MetricHeader(&out, "flashckpt_replica_calls_refused_total", "counter",
               "Replica calls refused because the peer's certificate name is not allowed.");
  MetricSample(&out, "flashckpt_replica_calls_refused_total", "", static_cast<double>(service.refused_calls()));
  return out;
}

ReplicaServer::ReplicaServer(ReplicaStore* store, ReplicaListenConfig config)
    : config_(std::move(config)), service_(store, config_.allow_names, config_.stall_timeout) {}

ReplicaServer::~ReplicaServer() { Shutdown(std::chrono::system_clock::now()); }

Status ReplicaServer::Start() {
  RETURN_IF_ERROR(CheckReplicaConfig(config_));
  ASSIGN_OR_RETURN(ListenAddress address, ParseListenAddress(config_.listen, "--replica-listen"));
  const bool tls = !config_.tls_cert.empty();
  if (tls) RETURN_IF_ERROR(CheckCertificateFiles(config_.tls_cert, config_.tls_key, config_.tls_ca, "--replica-tls"));
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls) {
    grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(config_.tls_cert, "--replica-tls-cert", "-----BEGIN CERTIFICATE-----",
                                              "certificate"));
    ASSIGN_OR_RETURN(pair.private_key, ReadPem(config_.tls_key, "--replica-tls-key", "PRIVATE KEY-----",
                                               "private key"));
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem(config_.tls_ca, "--replica-tls-ca", "-----BEGIN CERTIFICATE-----",
                                                 "CA certificate"));
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    credentials = grpc::SslServerCredentials(ssl);
  }
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use is an error, not shared
  // A peer whose node died mid-push leaves a half-open connection: keepalive pings find it, and the
  // push fails and gives its memory back.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // A header with its layout and extra state, or one part: a little over the larger.
  builder.SetMaxReceiveMessageSize(static_cast<int>(2 * kMaxReplicaMetaBytes + (1u << 20)));
  builder.RegisterService(&service_);
  for (grpc::Service* extra : extra_services_) builder.RegisterService(extra);
  builder.AddListeningPort(address.Target(), credentials, &port_);
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
    return FailedPrecondition("--replica-listen " + address.Target() + ": could not listen there (is the port in " +
                              "use or the address not one of this host's?" +
                              (tls ? " do --replica-tls-cert and --replica-tls-key hold a matching certificate and key?"
                                   : "") +
                              ")");
  }
  ListenAddress bound = address;
  bound.port = static_cast<uint16_t>(port_);
  std::string allowed;
  for (const auto& name : config_.allow_names) allowed += (allowed.empty() ? "" : ",") + name;
  Logger("replica")->info("listening replica={} tls={} allow=[{}]", bound.Target(), tls ? "mutual" : "off", allowed);
  return Status::OK();
}

void ReplicaServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (!server_) return;
  server_->Shutdown(deadline);
  server_->Wait();
  server_.reset();
}

}  // namespace flashckpt
