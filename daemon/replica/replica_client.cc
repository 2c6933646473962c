#include "daemon/replica/replica_client.h"

#include <algorithm>
#include <cstring>

#include "common/format/checksum.h"
#include "common/base/log.h"
#include "common/io/net.h"
#include "daemon/replica/replica_wire.h"
#include "proto/convert.h"
#include "replica.grpc.pb.h"

namespace flashckpt {

Status PeerStatus(const grpc::Status& s, std::string_view rpc) {
  switch (s.error_code()) {
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::UNIMPLEMENTED:
      return FailedPrecondition(std::string(rpc) + ": the peer answered " + GrpcCodeName(s.error_code()) + ": " +
                                s.error_message());
    default:
      return FromGrpc(s, rpc);
  }
}

std::string ConnectionHint(const ReplicaPeer& peer, const Status& status) {
  if (status.code() != StatusCode::kUnavailable) return "";
  const std::string& m = status.message();
  const bool closed = m.find("Socket closed") != std::string::npos || m.find("Connection reset") != std::string::npos;
  const bool handshake = m.find("andshake") != std::string::npos || m.find("SSL") != std::string::npos;
  if (peer.tls_cert.empty() && closed) {
    return " (a peer that listens with TLS closes a plaintext connection at once like this: give this daemon "
           "--replica-tls-cert, --replica-tls-key and --replica-tls-ca as well)";
  }
  if (!peer.tls_cert.empty() && (closed || handshake)) {
    return " (the TLS handshake failed or the peer closed the connection in it: each daemon's certificate must be "
           "valid now and signed by the other's --replica-tls-ca, and the peer must listen with TLS; the reason is "
           "logged as 'tls handshake failed' by the daemon that refused)";
  }
  return "";
}

ReplicaMeta ReplicaMetaOf(const v1::ReplicaHeader& h) {
  ReplicaMeta m;
  m.job = h.job();
  m.rank = h.rank();
  m.step = h.step();
  m.attempt = h.attempt();
  m.world_size = h.world_size();
  m.bytes = h.bytes();
  m.part_bytes = h.part_bytes();
  m.layout = h.layout();
  m.extra = h.extra();
  m.origin_node = h.origin_node();
  m.run_id = h.run_id();
  m.resumed_from = h.resumed_from();
  return m;
}

void ReplicaHeaderOf(const ReplicaMeta& m, v1::ReplicaHeader* h) {
  h->set_job(m.job);
  h->set_rank(m.rank);
  h->set_step(m.step);
  h->set_attempt(m.attempt);
  h->set_world_size(m.world_size);
  h->set_bytes(m.bytes);
  h->set_part_bytes(m.part_bytes);
  h->set_layout(m.layout);
  h->set_extra(m.extra);
  h->set_origin_node(m.origin_node);
  h->set_run_id(m.run_id);
  h->set_resumed_from(m.resumed_from);
}

Result<std::shared_ptr<grpc::Channel>> ReplicaChannel(const ReplicaPeer& peer) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(2 * kMaxReplicaMetaBytes + (1u << 20)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 20000);  // a peer that died mid-call fails the call
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  // A peer that comes back is reconnected to within seconds (gRPC's default waits up to 2 minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  const int tls_files = !peer.tls_cert.empty() + !peer.tls_key.empty() + !peer.tls_ca.empty();
  if (tls_files == 0) return grpc::CreateCustomChannel(peer.target, grpc::InsecureChannelCredentials(), args);
  if (tls_files != 3) {
    return InvalidArgument("a replica peer over TLS needs this daemon's certificate, its key and the peers' CA");
  }
  grpc::SslCredentialsOptions ssl;
  ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                   ReadPem(peer.tls_cert, "--replica-tls-cert", "-----BEGIN CERTIFICATE-----", "certificate"));
  ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem(peer.tls_key, "--replica-tls-key", "PRIVATE KEY-----", "private key"));
  ASSIGN_OR_RETURN(ssl.pem_root_certs,
                   ReadPem(peer.tls_ca, "--replica-tls-ca", "-----BEGIN CERTIFICATE-----", "CA certificate"));
  if (!peer.server_name.empty()) args.SetSslTargetNameOverride(peer.server_name);
  return grpc::CreateCustomChannel(peer.target, grpc::SslCredentials(ssl), args);
}

Status PushReplica(grpc::Channel* channel, const ReplicaMeta& meta, const char* data,
                   std::chrono::system_clock::time_point deadline, const PushHooks& hooks) {
  if (meta.part_bytes == 0) return InvalidArgument("a replica's parts must have bytes");
  // The parts are lent to gRPC, not copied: this returns only once it has let go of every one, so
  // the caller may reuse `data` after it. Declared before the call's context, the wait comes after
  // the call is released (a failed call's unsent parts go with it); a dead call no longer reads
  // them, so the wait is bounded, and a slice given back later finds `loans` alive.
  auto loans = SliceLoans::Make(hooks.owner);
  LoansReturned returned(*loans, "replica", "replica push");
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  struct Published {
    const PushHooks& hooks;
    ~Published() {
      if (hooks.context) hooks.context(nullptr);
    }
  } published{hooks};
  if (hooks.context) hooks.context(&ctx);
  v1::PushReplicaResponse response;
  auto writer = OpenRawPush(channel, &ctx, &response);
  auto cancel = [&](Status why) {
    ctx.TryCancel();
    (void)writer->Finish();
    return why;
  };
  v1::ReplicaPart header;
  ReplicaHeaderOf(meta, header.mutable_header());
  bool open = writer->Write(MessageBuffer(header));
  for (uint64_t at = 0; open && at < meta.bytes; at += meta.part_bytes) {
    const uint64_t n = std::min(meta.part_bytes, meta.bytes - at);
    // Hashed where it lies: if these bytes change before gRPC has sent them, the peer refuses the
    // part (its checksum) and the push fails; `hooks` say whether they are still the checkpoint's.
    open = writer->Write(DataPartBuffer(loans->Lend(data + at, n), Xxh3(data + at, n)));
    if (open && hooks.after_part) {
      Status go_on = hooks.after_part(at + n);
      if (!go_on.ok()) return cancel(std::move(go_on));
    }
  }
  if (open && hooks.before_done) {
    Status done = hooks.before_done();
    if (!done.ok()) return cancel(std::move(done));
  }
  if (open) writer->WritesDone();
  Status finished = PeerStatus(writer->Finish(), "replica Push");  // the peer's reason when it closed the stream
  // A part the peer refused because it changed under the push: the hooks name the cause.
  if (!finished.ok() && finished.code() == StatusCode::kCorruption && hooks.before_done) {
    if (Status changed = hooks.before_done(); !changed.ok()) return changed;
  }
  return finished;
}

Result<int64_t> RetractReplica(grpc::Channel* channel, const std::string& node, const std::string& job, uint32_t rank,
                               int64_t step, uint64_t attempt, std::chrono::system_clock::time_point deadline,
                               const std::function<void(grpc::ClientContext*)>& context) {
  v1::Replica::Stub stub(std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  struct Published {
    const std::function<void(grpc::ClientContext*)>& context;
    ~Published() {
      if (context) context(nullptr);
    }
  } published{context};
  if (context) context(&ctx);
  v1::RetractReplicaRequest request;
  request.set_job(job);
  request.set_rank(rank);
  request.set_step(step);
  request.set_attempt(attempt);
  request.set_node(node);
  v1::RetractReplicaResponse response;
  RETURN_IF_ERROR(PeerStatus(stub.Retract(&ctx, request, &response), "replica Retract"));
  return response.dropped_step();
}

Result<std::vector<ReplicaMeta>> ListReplicas(grpc::Channel* channel, const std::string& job,
                                              std::chrono::system_clock::time_point deadline) {
  v1::Replica::Stub stub(std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  v1::ListReplicasRequest request;
  request.set_job(job);
  v1::ListReplicasResponse response;
  RETURN_IF_ERROR(PeerStatus(stub.List(&ctx, request, &response), "replica List"));
  std::vector<ReplicaMeta> out;
  for (const auto& info : response.replicas()) {
    ReplicaMeta m;
    m.job = info.job();
    m.rank = info.rank();
    m.step = info.step();
    m.attempt = info.attempt();
    m.world_size = info.world_size();
    m.bytes = info.bytes();
    m.origin_node = info.origin_node();
    m.from_peer = info.from_peer();
    m.run_id = info.run_id();
    m.resumed_from = info.resumed_from();
    out.push_back(std::move(m));
  }
  return out;
}

Result<ReplicaMeta> FetchReplica(grpc::Channel* channel, const std::string& node, const std::string& job, uint32_t rank,
                                 int64_t step, uint64_t max_bytes,
                                 const std::function<Result<char*>(const ReplicaMeta&)>& into,
                                 std::chrono::system_clock::time_point deadline, const std::string& origin) {
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  v1::FetchReplicaRequest request;
  request.set_job(job);
  request.set_rank(rank);
  request.set_step(step);
  request.set_origin(origin);
  request.set_node(node);
  auto reader = OpenRawFetch(channel, &ctx, request);
  auto fail = [&](Status why) {
    ctx.TryCancel();
    (void)reader->Finish();
    return why;
  };
  grpc::ByteBuffer buffer;
  if (!reader->Read(&buffer)) {
    Status ended = PeerStatus(reader->Finish(), "replica Fetch");
    if (ended.ok()) return Corruption("replica Fetch: the peer ended the call without sending the replica's header");
    return ended;
  }
  ReceivedPart part;
  if (Status read = part.Read(&buffer); !read.ok()) return fail(Corruption("replica Fetch: " + read.message()));
  if (!part.has_header()) return fail(Corruption("replica Fetch: the peer sent data before the header"));
  const ReplicaMeta meta = ReplicaMetaOf(part.header());
  if (meta.job != job || meta.rank != rank || (step != 0 && meta.step != step)) {
    return fail(Corruption("replica Fetch: asked for job '" + job + "' rank " + std::to_string(rank) +
                           ", the peer sent job '" + meta.job + "' rank " + std::to_string(meta.rank) + " step " +
                           std::to_string(meta.step)));
  }
  if (meta.part_bytes < kMinReplicaPartBytes || meta.part_bytes > kMaxReplicaPartBytes) {
    return fail(Corruption("replica Fetch: parts of " + std::to_string(meta.part_bytes) + " bytes"));
  }
  if (meta.bytes > max_bytes) {
    return fail(ResourceExhausted("replica Fetch: the peer's replica of job '" + job + "' rank " + std::to_string(rank) +
                                  " has " + std::to_string(meta.bytes) + " bytes, more than the " +
                                  std::to_string(max_bytes) + " expected"));
  }
  auto dest = into(meta);
  if (!dest.ok()) return fail(dest.status());
  uint64_t at = 0;
  // Each part is copied once, from the received slices to `dest`, and hashed there (the fetcher
  // verifies the whole slot next, while what it can of it is still in the cache).
  for (uint64_t i = 0; reader->Read(&buffer); ++i) {
    const uint64_t want = std::min(meta.part_bytes, meta.bytes - at);
    if (!part.Read(&buffer).ok() || part.has_header() || at >= meta.bytes || part.data_bytes() != want) {
      return fail(Corruption("replica Fetch: part " + std::to_string(i) + " does not fit the header's " +
                             std::to_string(meta.bytes) + " bytes in parts of " + std::to_string(meta.part_bytes)));
    }
    const uint64_t got = CopyHashed(part.data(), *dest + at);
    if (got != part.xxh3()) {
      return fail(Corruption("replica Fetch: part " + std::to_string(i) + " of job '" + job + "' rank " +
                             std::to_string(rank) + " step " + std::to_string(meta.step) + " has checksum " +
                             ChecksumHex(got) + ", it was " + ChecksumHex(part.xxh3()) + " when sent"));
    }
    at += want;
  }
  RETURN_IF_ERROR(PeerStatus(reader->Finish(), "replica Fetch"));
  if (at != meta.bytes) {
    return Corruption("replica Fetch: " + std::to_string(at) + " of " + std::to_string(meta.bytes) + " bytes arrived");
  }
  return meta;
}

}  // namespace flashckpt
