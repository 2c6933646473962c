#include "client/cli/commands.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "client/cli/render.h"
#include "common/base/mutex.h"
#include "common/base/names.h"
#include "common/base/status.h"
#include "common/base/thread_pool.h"
#include "common/format/metadata.h"
#include "common/io/fs.h"
#include "common/read/header_check.h"
#include "common/read/listing.h"
#include "common/read/relayout.h"
#include "common/read/verify.h"
#include "flashckpt/admin.h"
#include "flashckpt/offline.h"

namespace flashckpt::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

// Strings from the daemon or the disk may hold invalid UTF-8 (a path, an errno text); replace
// those bytes rather than let the JSON library throw.
void PrintJson(const ordered_json& j) {
  std::cout << j.dump(2, ' ', false, ordered_json::error_handler_t::replace) << "\n";
}

// The daemon at `endpoint`, with the CLI's deadlines; null after printing why it cannot be asked
// (an unreadable --tls-ca).
std::unique_ptr<AdminClient> OpenAdmin(const Endpoint& endpoint) {
  AdminOptions options;
  options.socket_path = endpoint.socket;
  options.address = endpoint.address;
  options.tls_ca_file = endpoint.tls_ca;
  options.rpc_timeout = kRpcDeadline;
  options.delete_timeout = kDeleteDeadline;
  auto admin = AdminClient::Open(options);
  if (!admin.ok()) {
    std::cerr << "flashckpt: " << admin.status().message() << "\n";
    return nullptr;
  }
  return std::move(admin).value();
}

// Prints a failed call the way an operator can act on: the operator client's message (unreachable
// daemon, no answer in time, or the code and the daemon's reason) and, for an unreachable daemon,
// which flags to check.
int ReportRpcError(const Status& s, const Endpoint& endpoint) {
  std::cerr << "flashckpt: " << s.message();
  if (s.code() == StatusCode::kUnavailable) {
    std::cerr << "; "
              << (endpoint.address.empty()
                      ? "is flashckptd running, and is --socket right?"
                      : "is flashckptd listening there (--listen), and does the connection match its TLS setting "
                        "(a daemon with --tls-cert needs --tls-ca, one without must not get it)?");
  }
  std::cerr << "\n";
  return kExitRpcFailed;
}

// The one rule of the offline commands (verify, inspect, reshard) for the directory they read: one
// that is missing or not a directory is a wrong argument, kExitFailed, like every other failure that
// is not about a checkpoint's contents; a directory whose checkpoint is incomplete or corrupt is
// kExitVerifyFailed. Returns why `dir` is not a directory to read, or OK.
Status CheckCheckpointDir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return errno == ENOENT ? NotFound("no such directory") : ErrnoStatus("stat", dir, errno);
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument("not a directory");
  return Status::OK();
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
  void Clear() EXCLUDES(print_mu_) {
    MutexLock lock(&print_mu_);
    if (tty_) std::cerr << "\r\033[K" << std::flush;
  }
  // Stops the updates and prints the final line (`ok`: all of the total was done).
  void Finish(bool ok) EXCLUDES(mu_, print_mu_) {
    Stop();
    Print(ok ? total_ : done_(), true);
  }

 private:
  void Stop() EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    if (thread_.joinable()) thread_.join();
  }

  // A line every second until stopped; the lock is let go while the line is printed.
  void Run() EXCLUDES(mu_, print_mu_) {
    MutexLock lock(&mu_);
    auto next = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!stop_) {
      if (cv_.WaitUntil(&lock, next)) continue;  // woken: look at stop_ again
      if (stop_) break;
      lock.Unlock();
      Print(done_(), false);
      lock.Lock();
      next = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    }
  }
  void Print(uint64_t done, bool last) EXCLUDES(print_mu_) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::string line = what_ + " " + ProgressText(done, total_, secs);
    MutexLock lock(&print_mu_);
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
  Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  Mutex print_mu_;  // one line at a time on stderr
  std::thread thread_;
};

}  // namespace

int RunStatus(const Endpoint& endpoint, bool json) {
  auto admin = OpenAdmin(endpoint);
  if (!admin) return kExitRpcFailed;
  auto status = admin->Status();
  if (!status.ok()) return ReportRpcError(status.status(), endpoint);
  if (json)
    PrintJson(StatusJson(*status));
  else
    std::cout << StatusText(*status);
  return kExitOk;
}

int RunList(const Endpoint& endpoint, const std::string& job, bool json) {
  auto admin = OpenAdmin(endpoint);
  if (!admin) return kExitRpcFailed;
  auto list = admin->List(job);
  if (!list.ok()) return ReportRpcError(list.status(), endpoint);
  if (json)
    PrintJson(ListJson(*list));
  else
    std::cout << ListText(*list);
  return kExitOk;
}

int RunListRoot(const std::string& root, const std::string& job, bool json) {
  struct stat st {};
  if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    std::cerr << "flashckpt: list --root " << root << ": not a directory\n";
    return kExitFailed;
  }
  auto list = ListCheckpoints(root, job);
  if (!list.ok()) {
    std::cerr << "flashckpt: list --root " << root << ": " << list.status().ToString() << "\n";
    return kExitFailed;
  }
  if (json)
    PrintJson(ListJson(*list));
  else
    std::cout << ListText(*list);
  return kExitOk;
}

int RunWatch(const Endpoint& endpoint, const std::string& job, bool json, uint64_t count, double seconds) {
  auto admin = OpenAdmin(endpoint);
  if (!admin) return kExitRpcFailed;
  WatchOptions options;
  options.job = job;
  options.max_events = count;
  if (seconds > 0) options.duration = std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(seconds));
  bool subscribed = false;
  options.on_subscribed = [&](bool ok) {
    subscribed = ok;
    if (!ok) return;  // the error follows
    std::cerr << "flashckpt: watching events of " << (job.empty() ? "every job" : "job " + job) << " at "
              << admin->endpoint() << "\n"
              << std::flush;
  };
  Status s = admin->Watch(options, [json](const DaemonEvent& event) {
    if (json)
      std::cout << EventJson(event).dump(-1, ' ', false, ordered_json::error_handler_t::replace) << "\n";
    else
      std::cout << EventText(event) << "\n";
    std::cout << std::flush;  // a line as soon as it happens, also into a pipe
    return true;
  });
  if (!s.ok() && subscribed && s.code() == StatusCode::kUnavailable) {
    // The watch was connected: the socket and the daemon were right, the daemon went away.
    std::cerr << "flashckpt: " << s.message() << "\n";
    return kExitRpcFailed;
  }
  if (!s.ok()) return ReportRpcError(s, endpoint);
  return kExitOk;
}

int RunHealth(const Endpoint& endpoint) {
  auto admin = OpenAdmin(endpoint);
  if (!admin) return kExitRpcFailed;
  auto health = admin->Health();
  if (!health.ok()) return ReportRpcError(health.status(), endpoint);
  std::cout << HealthStateName(*health) << "\n";
  return *health == HealthState::kServing ? kExitOk : kExitRpcFailed;
}

int RunVerify(const std::string& dir, bool json) {
  if (Status bad = CheckCheckpointDir(dir); !bad.ok()) {
    if (json) {
      PrintJson(ordered_json{{"dir", dir}, {"ok", false}, {"code", std::string(StatusCodeName(bad.code()))},
                             {"error", bad.message()}});
    }
    std::cerr << "flashckpt: verify " << dir << ": " << bad.message() << "\n";
    return kExitFailed;
  }
  VerifyReport report;
  Status s = VerifyCheckpointDir(dir, &report);
  if (json) {
    ordered_json j = {{"dir", dir},
                      {"ok", s.ok()},
                      {"job", report.job},
                      {"step", report.step},
                      {"files", report.files},
                      {"tensors", report.tensors},
                      {"pieces", report.pieces},
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
    std::cout << "ok: " << report.files << " files, " << report.tensors << " tensors in " << report.pieces
              << " pieces, " << report.bytes << " bytes verified (job " << report.job << ", step " << report.step
              << ")\n";
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
  if (Status bad = CheckCheckpointDir(src); !bad.ok()) {
    std::cerr << "flashckpt: reshard " << src << ": " << bad.message() << "\n";
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

int RunExport(const std::string& src, const std::string& dst, const std::string& weights, const std::string& dtype,
              const std::string& max_shard_size, const std::string& strip_prefix, unsigned threads, bool progress) {
  if (Status bad = CheckCheckpointDir(src); !bad.ok()) {
    std::cerr << "flashckpt: export " << src << ": " << bad.message() << "\n";
    return kExitFailed;
  }
  const auto start = std::chrono::steady_clock::now();
  std::atomic<uint64_t> done{0};
  std::unique_ptr<ProgressLine> line;
  ExportOptions options;
  options.weights = weights;
  options.dtype = dtype;
  options.max_shard_size = max_shard_size;
  options.strip_prefix = strip_prefix;
  options.threads = threads;
  options.progress = [&](uint64_t d, uint64_t t) {
    done = d;
    if (progress && !line) line = std::make_unique<ProgressLine>("export", t, [&done] { return done.load(); });
  };
  ExportReport report;
  Status s = ExportCheckpoint(src, dst, options, &report);
  if (line) line->Finish(s.ok());
  if (!s.ok()) {
    std::cerr << "flashckpt: export " << src << " -> " << dst << " failed: " << s.ToString() << "\n";
    return s.code() == StatusCode::kCorruption || s.code() == StatusCode::kNotFound ? kExitVerifyFailed : kExitFailed;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("ok: %s -> %s: %u %s tensors, %s in %zu file%s%s in %.2f s\n", src.c_str(), dst.c_str(), report.tensors,
              weights.c_str(), FormatBytes(report.bytes).c_str(), report.files.size(),
              report.files.size() == 1 ? "" : "s", report.index ? " + model.safetensors.index.json" : "", secs);
  return kExitOk;
}

int RunImport(const std::string& src, const std::string& root, const std::string& job, int64_t step,
              const std::string& add_prefix, const std::string& checksum_chunk, bool progress) {
  if (Status bad = CheckCheckpointDir(src); !bad.ok()) {
    std::cerr << "flashckpt: import " << src << ": " << bad.message() << "\n";
    return kExitFailed;
  }
  const auto start = std::chrono::steady_clock::now();
  std::atomic<uint64_t> done{0};
  std::unique_ptr<ProgressLine> line;
  ImportOptions options;
  options.root = root;
  options.job = job;
  options.step = step;
  options.add_prefix = add_prefix;
  options.checksum_chunk = checksum_chunk;
  options.progress = [&](uint64_t d, uint64_t t) {
    done = d;
    if (progress && !line) line = std::make_unique<ProgressLine>("import", t, [&done] { return done.load(); });
  };
  ImportReport report;
  Status s = ImportCheckpoint(src, options, &report);
  if (line) line->Finish(s.ok());
  if (!s.ok()) {
    std::cerr << "flashckpt: import " << src << " failed: " << s.ToString() << "\n";
    return s.code() == StatusCode::kCorruption || s.code() == StatusCode::kNotFound ? kExitVerifyFailed : kExitFailed;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("ok: %s -> %s: %u tensors, %s from %u file%s in %.2f s\n", src.c_str(), report.checkpoint_dir.c_str(),
              report.tensors, FormatBytes(report.bytes).c_str(), report.source_files,
              report.source_files == 1 ? "" : "s", secs);
  return kExitOk;
}

int RunInspect(const std::string& dir, bool json) {
  if (Status bad = CheckCheckpointDir(dir); !bad.ok()) {
    std::cerr << "flashckpt: inspect " << dir << ": " << bad.message() << "\n";
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
      // What its signals say: the runs its ranks saved it in, and whether it is split (never completes).
      const std::filesystem::path path = std::filesystem::path(dir).lexically_normal();
      const std::filesystem::path leaf = path.filename().empty() ? path.parent_path() : path;
      const auto step = ParseCheckpointDirName(leaf.filename().string());
      std::optional<CheckpointInfo> info;
      if (step) {
        if (auto entry = DescribeCheckpointDir(leaf.parent_path().filename().string(), *step, dir); entry.ok()) {
          info = *entry;
        }
      }
      if (info && IsSplit(*info)) {
        std::cerr << "flashckpt: inspect " << dir << ": the checkpoint is incomplete and split: every rank saved it ("
                  << signals << " saved_signal files), in different attempts (" << RunsText(info->signalled)
                  << "), so it never completes; restart every rank of the job from one checkpoint\n";
      } else {
        std::cerr << "flashckpt: inspect " << dir << ": the checkpoint is incomplete: no metadata.json (" << signals
                  << " saved_signal file(s) present" << (info && !info->signalled.empty() ? ", run " + RunsText(info->signalled) : "")
                  << "); a save in flight, or one that failed or was abandoned\n";
      }
    } else {
      std::cerr << "flashckpt: inspect " << dir
                << ": metadata.json is unreadable or corrupt: " << meta.status().ToString() << "\n";
    }
    return kExitVerifyFailed;
  }
  // What is shown is metadata.json; each file's header must agree with it (one small read per file).
  if (Status checked = CheckFileHeaders(dir, *meta); !checked.ok()) {
    std::cerr << "flashckpt: inspect " << dir << ": metadata.json disagrees with the checkpoint's files: "
              << checked.ToString() << "\n";
    return kExitVerifyFailed;
  }
  // Which node wrote each rank's part: its signal (a signal that cannot be read shows no node).
  std::vector<SignalledRank> signalled;
  if (auto entry = DescribeCheckpointDir(meta->job, meta->step, dir); entry.ok() && *entry) {
    signalled = (*entry)->signalled;
  }
  if (json) {
    PrintJson(InspectJson(dir, *meta, signalled));
  } else {
    std::cout << InspectText(dir, *meta, signalled);
  }
  return kExitOk;
}

int RunDelete(const Endpoint& endpoint, const std::string& job, int64_t step, uint32_t keep, bool force, bool dry_run,
              bool json) {
  auto admin = OpenAdmin(endpoint);
  if (!admin) return kExitRpcFailed;
  auto result = step > 0 ? admin->Delete(job, step, force, dry_run) : admin->Gc(job, keep, dry_run);
  if (!result.ok()) return ReportRpcError(result.status(), endpoint);
  if (json)
    PrintJson(DeleteJson(job, *result, dry_run));
  else
    std::cout << DeleteText(job, *result, dry_run);
  return kExitOk;
}

int RunRelease(const Endpoint& endpoint, const std::string& job, bool force, bool json) {
  auto admin = OpenAdmin(endpoint);
  if (!admin) return kExitRpcFailed;
  auto result = admin->Release(job, force);
  if (!result.ok()) return ReportRpcError(result.status(), endpoint);
  auto step_or_null = [](int64_t step) { return step >= 0 ? ordered_json(step) : ordered_json(nullptr); };
  if (json) {
    ordered_json j;
    j["job"] = job;
    j["ranks"] = result->ranks;
    j["bytes"] = result->bytes;
    j["disk_step"] = step_or_null(result->disk_step);
    j["written_step"] = step_or_null(result->written_step);
    j["dropped_steps"] = result->dropped_steps;
    PrintJson(j);
  } else {
    std::cout << "released job " << job << ": " << result->ranks << (result->ranks == 1 ? " rank, " : " ranks, ")
              << FormatBytes(result->bytes) << " of shared memory given back";
    const std::string disk = result->disk_step >= 0 ? "step " + std::to_string(result->disk_step) : "none";
    if (result->written_step >= 0) {
      std::cout << "; memory checkpoint step " << result->written_step << " (newer than the disk's " << disk
                << ") was written first";
    } else if (!result->dropped_steps.empty()) {
      std::cout << "; DROPPED memory checkpoint step(s)";
      for (size_t i = 0; i < result->dropped_steps.size(); ++i) std::cout << (i ? "," : " ") << result->dropped_steps[i];
      std::cout << " (newer than the disk's " << disk << ", --force)";
    } else {
      std::cout << "; nothing in memory was newer than the disk";
    }
    std::cout << "\n";
  }
  return kExitOk;
}

}  // namespace flashckpt::cli
