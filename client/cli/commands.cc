#include "client/cli/commands.h"

#include <grpcpp/grpcpp.h>

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "client/cli/render.h"
#include "common/base/names.h"
#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "common/read/relayout.h"
#include "common/read/verify.h"
#include "flashckpt.grpc.pb.h"
#include "health.grpc.pb.h"

namespace flashckpt::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

// Strings from the daemon or the disk may hold invalid UTF-8 (a path, an errno text); replace
// those bytes rather than let the JSON library throw.
void PrintJson(const ordered_json& j) {
  std::cout << j.dump(2, ' ', false, ordered_json::error_handler_t::replace) << "\n";
}

// The CA file is read here, not by gRPC, so that a missing file is reported as such rather than as an
// unreachable daemon.
Result<std::shared_ptr<grpc::Channel>> OpenChannel(const Endpoint& endpoint) {
  if (endpoint.address.empty()) {
    return grpc::CreateChannel("unix:" + endpoint.socket, grpc::InsecureChannelCredentials());
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!endpoint.tls_ca.empty()) {
    auto ca = ReadSmallFile(endpoint.tls_ca, 1u << 20);
    if (!ca.ok()) return ca.status().WithContext("--tls-ca");
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = std::move(ca).value();
    credentials = grpc::SslCredentials(ssl);
  }
  return grpc::CreateChannel(endpoint.address, credentials);
}

Result<std::unique_ptr<v1::Checkpoint::Stub>> Connect(const Endpoint& endpoint) {
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, OpenChannel(endpoint));
  return v1::Checkpoint::NewStub(channel);
}

void SetDeadline(grpc::ClientContext* ctx) { ctx->set_deadline(std::chrono::system_clock::now() + kRpcDeadline); }

const char* GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    default: return "UNRECOGNIZED";
  }
}

// Prints a failed RPC the way an operator can act on: unreachable daemon first, then the code.
int ReportRpcError(const grpc::Status& s, const Endpoint& endpoint, const char* rpc,
                   std::chrono::seconds deadline = kRpcDeadline) {
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::cerr << "flashckpt: daemon not reachable at " << endpoint.Describe() << " (UNAVAILABLE: " << s.error_message()
              << "); "
              << (endpoint.address.empty()
                      ? "is flashckptd running, and is --socket right?"
                      : "is flashckptd listening there (--listen), and does the connection match its TLS setting "
                        "(a daemon with --tls-cert needs --tls-ca, one without must not get it)?")
              << "\n";
  } else if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    std::cerr << "flashckpt: " << rpc << " got no answer from " << endpoint.Describe() << " within " << deadline.count()
              << " s (DEADLINE_EXCEEDED)\n";
  } else {
    std::cerr << "flashckpt: " << rpc << " failed: " << GrpcCodeName(s.error_code()) << " (gRPC code "
              << static_cast<int>(s.error_code()) << "): " << s.error_message() << "\n";
  }
  return kExitRpcFailed;
}

// Bytes this process has moved through read and write system calls so far (/proc/self/io: rchar +
// wchar, page-cache hits and O_DIRECT alike); nullopt where the kernel does not say.
std::optional<uint64_t> BytesMoved() {
  std::ifstream io("/proc/self/io");
  std::string key;
  uint64_t value = 0, total = 0;
  int found = 0;
  while (io >> key >> value) {
    if (key == "rchar:" || key == "wchar:") {
      total += value;
      ++found;
    }
  }
  if (found != 2) return std::nullopt;
  return total;
}

// Prints ProgressText(done(), total, elapsed) on stderr every second until destroyed, then once
// more. On a terminal the line is redrawn in place; elsewhere (--progress into a file) each is a
// line of its own.
class ProgressLine {
 public:
  ProgressLine(std::string what, uint64_t total, std::function<uint64_t()> done)
      : what_(std::move(what)), total_(total), done_(std::move(done)), tty_(::isatty(STDERR_FILENO) == 1) {
    thread_ = std::thread([this] { Run(); });
  }
  ~ProgressLine() { Stop(); }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Before other output on a terminal: clears the line being redrawn.
  void Clear() {
    std::lock_guard<std::mutex> lock(print_mu_);
    if (tty_) std::cerr << "\r\033[K" << std::flush;
  }
  // Stops the updates and prints the final line (`ok`: all of the total was done).
  void Finish(bool ok) {
    Stop();
    Print(ok ? total_ : done_(), true);
  }

 private:
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; })) Print(done_(), false);
  }
  void Print(uint64_t done, bool last) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::string line = what_ + " " + ProgressText(done, total_, secs);
    std::lock_guard<std::mutex> lock(print_mu_);
    if (tty_) {
      std::cerr << "\r\033[K" << line << (last ? "\n" : "") << std::flush;
    } else {
      std::cerr << line << "\n" << std::flush;
    }
  }

  const std::string what_;
  const uint64_t total_;
  const std::function<uint64_t()> done_;
  const bool tty_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;    // guarded by mu_
  std::mutex print_mu_;  // one line at a time on stderr
  std::thread thread_;
};

}  // namespace

std::string Endpoint::Describe() const {
  if (address.empty()) return socket;
  return address + (tls_ca.empty() ? " (plain TCP)" : " (TLS)");
}

int RunStatus(const Endpoint& endpoint, bool json) {
  auto stub = Connect(endpoint);
  if (!stub.ok()) {
    std::cerr << "flashckpt: " << stub.status().message() << "\n";
    return kExitRpcFailed;
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::StatusResponse resp;
  grpc::Status s = (*stub)->GetStatus(&ctx, v1::StatusRequest{}, &resp);
  if (!s.ok()) return ReportRpcError(s, endpoint, "GetStatus");
  if (json)
    PrintJson(StatusJson(resp));
  else
    std::cout << StatusText(resp);
  return kExitOk;
}

int RunList(const Endpoint& endpoint, const std::string& job, bool json) {
  auto stub = Connect(endpoint);
  if (!stub.ok()) {
    std::cerr << "flashckpt: " << stub.status().message() << "\n";
    return kExitRpcFailed;
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ListCheckpointsRequest req;
  req.set_job(job);
  v1::ListCheckpointsResponse resp;
  grpc::Status s = (*stub)->ListCheckpoints(&ctx, req, &resp);
  if (!s.ok()) return ReportRpcError(s, endpoint, "ListCheckpoints");
  if (json)
    PrintJson(ListJson(resp));
  else
    std::cout << ListText(resp);
  return kExitOk;
}

int RunWatch(const Endpoint& endpoint, const std::string& job, bool json, uint64_t count, double seconds) {
  auto stub = Connect(endpoint);
  if (!stub.ok()) {
    std::cerr << "flashckpt: " << stub.status().message() << "\n";
    return kExitRpcFailed;
  }
  grpc::ClientContext ctx;
  if (seconds > 0) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                                            std::chrono::duration<double>(seconds)));
  }
  v1::WatchEventsRequest req;
  req.set_job(job);
  auto reader = (*stub)->WatchEvents(&ctx, req);
  // The daemon sends its initial metadata once the watcher is subscribed: every event from here on
  // is seen. A call that failed returns here too, and Finish below reports it.
  reader->WaitForInitialMetadata();
  std::cerr << "flashckpt: watching events of " << (job.empty() ? "every job" : "job " + job) << " at "
            << endpoint.Describe() << "\n"
            << std::flush;
  v1::Event event;
  uint64_t seen = 0;
  while (reader->Read(&event)) {
    if (json)
      std::cout << EventJson(event).dump(-1, ' ', false, ordered_json::error_handler_t::replace) << "\n";
    else
      std::cout << EventText(event) << "\n";
    std::cout << std::flush;  // a line as soon as it happens, also into a pipe
    if (count > 0 && ++seen >= count) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (s.ok() || (count > 0 && seen >= count)) return kExitOk;
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && seconds > 0) return kExitOk;
  return ReportRpcError(s, endpoint, "WatchEvents");
}

int RunHealth(const Endpoint& endpoint) {
  auto channel = OpenChannel(endpoint);
  if (!channel.ok()) {
    std::cerr << "flashckpt: " << channel.status().message() << "\n";
    return kExitRpcFailed;
  }
  auto stub = grpc::health::v1::Health::NewStub(*channel);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  grpc::health::v1::HealthCheckRequest req;  // service "": the daemon as a whole
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return ReportRpcError(s, endpoint, "Health.Check");
  std::cout << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()) << "\n";
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk : kExitRpcFailed;
}

int RunVerify(const std::string& dir, bool json) {
  VerifyReport report;
  Status s = VerifyCheckpointDir(dir, &report);
  if (json) {
    ordered_json j = {{"dir", dir},           {"ok", s.ok()},          {"job", report.job},
                      {"step", report.step},  {"files", report.files}, {"tensors", report.tensors},
                      {"bytes", report.bytes}};
    if (!s.ok()) {
      j["code"] = std::string(StatusCodeName(s.code()));
      j["error"] = s.message();
    }
    PrintJson(j);
  }
  if (!s.ok()) {
    std::cerr << "flashckpt: verify " << dir << " failed: " << s.ToString() << "\n";
    return kExitVerifyFailed;
  }
  if (!json) {
    std::cout << "ok: " << report.files << " files, " << report.tensors << " tensors, " << report.bytes
              << " bytes verified (job " << report.job << ", step " << report.step << ")\n";
  }
  return kExitOk;
}

int RunReshard(const std::string& src, const std::string& dst, uint32_t tp, uint32_t pp, uint32_t shard,
               const std::string& checksum_chunk, unsigned threads, bool progress) {
  auto chunk = ParseByteSize(checksum_chunk);
  if (!chunk) {
    std::cerr << "flashckpt: --checksum-chunk '" << checksum_chunk << "' is not a size like 1MiB or 65536\n";
    return kExitFailed;
  }
  const auto start = std::chrono::steady_clock::now();
  ParallelLoop loop(threads > 0 ? threads - 1 : 0);
  RelayoutReport report;
  // The progress line counts the bytes this process reads and writes (/proc/self/io) against twice
  // the source's tensor bytes (each is read once and written once; the bytes that checksum chunks
  // make a reshard read beyond those are a fraction of a percent). Without /proc/self/io it
  // advances once per new rank, from the relayout's own counts.
  std::unique_ptr<ProgressLine> line;
  std::atomic<uint64_t> per_rank{0};
  if (progress) {
    auto meta = ReadMetadataFile(src);
    if (meta.ok()) {
      uint64_t tensor_bytes = 0;
      for (const auto& p : meta->pieces) tensor_bytes += p.end - p.begin;
      const std::optional<uint64_t> base = BytesMoved();
      std::function<uint64_t()> done = [&per_rank] { return per_rank.load(); };
      if (base) done = [b = *base] { return BytesMoved().value_or(b) - b; };
      line = std::make_unique<ProgressLine>("reshard", 2 * tensor_bytes, std::move(done));
    }  // else RelayoutCheckpoint reports the problem below
  }
  auto on_rank = [&](const NewRank& rank, const RelayoutReport& sofar) {
    per_rank = sofar.bytes_read + sofar.bytes_written;
    if (line) line->Clear();
    std::cout << "rank " << rank.rank << " (tp " << rank.topology.tp_rank << ", pp " << rank.topology.pp_rank
              << ", shard " << rank.topology.shard_rank << "): " << rank.tensors.size() + rank.ema.size()
              << " tensors; so far " << sofar.files << " files, " << FormatBytes(sofar.bytes_read) << " read, "
              << FormatBytes(sofar.bytes_written) << " written\n"
              << std::flush;
  };
  Status s = RelayoutCheckpoint(src, dst, Degrees{tp, pp, shard}, *chunk, &loop, &report, on_rank);
  if (line) line->Finish(s.ok());
  if (!s.ok()) {
    std::cerr << "flashckpt: reshard " << src << " -> " << dst << " failed: " << s.ToString() << "\n";
    return s.code() == StatusCode::kCorruption || s.code() == StatusCode::kNotFound ? kExitVerifyFailed : kExitFailed;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "ok: %s -> %s as (tp, pp, shard) = (%u, %u, %u): %u ranks wrote %u files, %s read, %s written in %.2f s\n",
      src.c_str(), dst.c_str(), tp, pp, shard, report.ranks, report.files, FormatBytes(report.bytes_read).c_str(),
      FormatBytes(report.bytes_written).c_str(), secs);
  return kExitOk;
}

int RunInspect(const std::string& dir, bool json) {
  if (!PathExists(dir)) {
    std::cerr << "flashckpt: inspect " << dir << ": no such directory\n";
    return kExitFailed;
  }
  auto meta = ReadMetadataFile(dir);
  if (!meta.ok()) {
    if (meta.status().code() == StatusCode::kNotFound) {
      uint32_t signals = 0;
      auto names = ListDir(dir);
      if (!names.ok()) {
        std::cerr << "flashckpt: inspect " << dir << ": " << names.status().ToString() << "\n";
        return kExitFailed;
      }
      for (const auto& n : *names) signals += n.rfind("saved_signal_", 0) == 0 ? 1 : 0;
      std::cerr << "flashckpt: inspect " << dir << ": the checkpoint is incomplete: no metadata.json (" << signals
                << " saved_signal file(s) present); a save in flight, or one that failed or was abandoned\n";
    } else {
      std::cerr << "flashckpt: inspect " << dir
                << ": metadata.json is unreadable or corrupt: " << meta.status().ToString() << "\n";
    }
    return kExitVerifyFailed;
  }
  if (json) {
    PrintJson(InspectJson(dir, *meta));
  } else {
    std::cout << InspectText(dir, *meta);
  }
  return kExitOk;
}

int RunDelete(const Endpoint& endpoint, const std::string& job, int64_t step, uint32_t keep, bool force, bool dry_run,
              bool json) {
  auto stub = Connect(endpoint);
  if (!stub.ok()) {
    std::cerr << "flashckpt: " << stub.status().message() << "\n";
    return kExitRpcFailed;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kDeleteDeadline);
  v1::DeleteCheckpointsRequest req;
  req.set_job(job);
  req.set_step(step);
  req.set_keep(keep);
  req.set_force(force);
  req.set_dry_run(dry_run);
  v1::DeleteCheckpointsResponse resp;
  grpc::Status s = (*stub)->DeleteCheckpoints(&ctx, req, &resp);
  if (!s.ok()) return ReportRpcError(s, endpoint, "DeleteCheckpoints", kDeleteDeadline);
  if (json)
    PrintJson(DeleteJson(job, resp, dry_run));
  else
    std::cout << DeleteText(job, resp, dry_run);
  return kExitOk;
}

}  // namespace flashckpt::cli
