#include "daemon/pipeline/writer.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <memory>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/extra.h"
#include "common/format/image.h"
#include "common/format/safetensors.h"
#include "common/format/signal.h"
#include "common/io/fs.h"

namespace flashckpt {

Writer::Writer(Catalog* catalog, WriterOptions options)
    : catalog_(catalog),
      threads_count_(std::max(1u, options.threads)),
      capacity_(options.queue_capacity),
      io_threads_(std::max(1u, options.io_threads)),
      clock_(options.clock != nullptr ? *options.clock : Clock::Real()),
      env_(options.env != nullptr ? options.env : IoEnv::Default()) {}

Status Writer::Start() {
  MutexLock lock(&mu_);
  if (stopping_) return Unavailable("the writer is stopping; the daemon is shutting down");
  if (!threads_.empty()) return Status::OK();
  for (unsigned i = 0; i < threads_count_; ++i) threads_.emplace_back([this] { Run(); });
  return Status::OK();
}

Writer::~Writer() { Stop(); }

Status Writer::Submit(PersistRequest request) {
  MutexLock lock(&mu_);
  if (stopping_) return Unavailable("the writer is stopping; the daemon is shutting down");
  if (queue_.size() >= capacity_) {
    return ResourceExhausted("the persist queue is full (" + std::to_string(capacity_) + " requests)");
  }
  ++pending_[{request.job, request.step}].count;
  queue_.push_back(std::move(request));
  cv_.NotifyOne();
  return Status::OK();
}

void Writer::Stop(std::chrono::steady_clock::time_point deadline) {
  std::deque<PersistRequest> dropped;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    cv_.NotifyAll();
    bool idle = queue_.empty() && in_flight_.empty();
    while (!idle && clock_.WaitUntil(&idle_cv_, &lock, deadline)) idle = queue_.empty() && in_flight_.empty();
    if (!(queue_.empty() && in_flight_.empty())) {
      // Out of time: the writes running now fail at their next call into env_ and clean up.
      env_.Cancel();
      dropped.swap(queue_);
      // Checks deferred to these are left to the sweep and the next daemon: this one is stopping.
      for (const PersistRequest& req : dropped) (void)LeavePendingLocked(req, /*wrote=*/false);
      for (const auto& [id, w] : in_flight_) {
        Logger("writer")->warn("abandoning job={} step={} rank={} secs={:.1f}: the stop timeout ran out", w.job, w.step,
                               w.rank,
                               std::chrono::duration<double>(clock_.Now() - w.started).count());
      }
    }
  }
  for (PersistRequest& req : dropped) {
    Logger("writer")->warn("abandoning job={} step={} rank={}: queued, not started", req.job, req.step, req.rank);
    if (req.done) req.done(Cancelled("abandoned before it started: the daemon stopped"), 0, 0);
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

std::vector<WriteInFlight> Writer::InFlight() const {
  MutexLock lock(&mu_);
  std::vector<WriteInFlight> out;
  out.reserve(in_flight_.size());
  for (const auto& [id, w] : in_flight_) out.push_back(w);
  return out;
}

void Writer::Run() {
  // This thread's writes: io_threads_ of them in flight, and as many threads again that hash the
  // next pieces meanwhile (WriteImagesDurably's max_writes_in_flight).
  ParallelLoop io(2 * io_threads_ - 1);
  for (;;) {
    PersistRequest req;
    uint64_t id;
    std::chrono::steady_clock::time_point start;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) cv_.Wait(&lock);
      if (queue_.empty()) return;  // stopping and drained
      req = std::move(queue_.front());
      queue_.pop_front();
      start = clock_.Now();
      id = taken_++;
      in_flight_[id] = WriteInFlight{req.job, req.rank, req.step, start};
    }
    auto written = PersistOne(req, &io, /*queued=*/true);
    double secs = std::chrono::duration<double>(clock_.Now() - start).count();
    {
      MutexLock lock(&mu_);
      in_flight_.erase(id);
    }
    idle_cv_.NotifyAll();
    if (req.done) req.done(written.status(), written.ok() ? *written : 0, secs);
  }
}

std::string Writer::DisposeAttemptFiles(const PersistRequest& req, const std::vector<std::string>& written) {
  if (written.empty()) return "no file of this rank was left in place";
  // The signal is written last: once it is in place, the attempt is published.
  const bool published = written.back() == SignalFileName(req.rank);
  if (published && !req.sole_writer) {
    Logger("writer")->warn("kept files of failed persist job={} step={} rank={} files={}: its signal was in place and "
                           "other daemons' ranks share the step, so one of them may be completing it with them",
                           req.job, req.step, req.rank, written.size());
    return "this rank's files of the step were kept (its signal was in place and other daemons' ranks share the "
           "step: one may complete it with them, or the sweep will)";
  }
  std::vector<std::string> newest_first(written.rbegin(), written.rend());
  auto removed = catalog_->RemoveUnlessComplete(req.job, req.step, newest_first);
  if (!removed.ok() || !removed->has_value()) {  // cannot tell, or complete: its files belong to a checkpoint
    const std::string why = removed.ok() ? "the step is complete" : removed.status().ToString();
    Logger("writer")->warn("kept files of failed persist job={} step={} rank={} reason=\"{}\"", req.job, req.step,
                           req.rank, why);
    return "this rank's files of the step were kept (" + why + ")";
  }
  Logger("writer")->warn("removed partial files job={} step={} rank={} files={}", req.job, req.step, req.rank,
                         **removed);
  return "this rank's partial files of the step were removed";
}

std::vector<Writer::Check> Writer::LeavePendingLocked(const PersistRequest& req, bool wrote) {
  Check own{req.attempt, req.world_size, req.mixed};
  auto it = pending_.find({req.job, req.step});
  if (it == pending_.end()) {  // not submitted (Persist called directly)
    if (!wrote) return {};
    return {std::move(own)};
  }
  Pending& p = it->second;
  if (wrote) {
    auto same = std::find_if(p.deferred.begin(), p.deferred.end(),
                             [&](const Check& c) { return c.attempt == own.attempt; });
    if (same == p.deferred.end()) {
      p.deferred.push_back(std::move(own));
    } else {
      *same = std::move(own);  // the newest request's world size and callback
    }
  }
  if (--p.count > 0) return {};
  std::vector<Check> checks = std::move(p.deferred);
  pending_.erase(it);
  return checks;
}

std::vector<Writer::Check> Writer::LeavePending(const PersistRequest& req, bool wrote) {
  MutexLock lock(&mu_);
  return LeavePendingLocked(req, wrote);
}

Result<uint64_t> Writer::PersistOne(const PersistRequest& req, ParallelLoop* io, bool queued) {
  const std::string dir = catalog_->CheckpointDir(req.job, req.step);
  std::vector<std::string> written;  // files of this attempt now under their final names, in order
  uint64_t bytes = 0;
  Status wrote;
  Result<bool> complete = false;
  std::string disposed;  // what became of a failed attempt's files
  {
    // Retention leaves the directory alone while this rank writes into it and until it has tried
    // to complete it: another step's completion would otherwise count it as an incomplete
    // directory older than the newest complete one, and delete it in between.
    StepInUse in_use = catalog_->Use(req.job, req.step);
    // No part of this daemon describes the rank's files while they are replaced.
    catalog_->parts().ForgetRank(dir, req.job, req.step, req.rank);
    Signal signal;
    wrote = WriteRankFiles(req, dir, io, &written, &bytes, &signal);
    // The rank's files, rendered now for the step's completion (here or on another daemon).
    if (wrote.ok()) catalog_->parts().NoteRank(dir, req.job, signal);
    std::vector<Check> checks;
    if (queued) {
      checks = LeavePending(req, wrote.ok());
    } else if (wrote.ok()) {
      checks.push_back(Check{req.attempt, req.world_size, req.mixed});
    }
    // A failed write's files go before any check could count them.
    if (!wrote.ok()) disposed = DisposeAttemptFiles(req, written);
    for (const Check& check : checks) {
      // The thread's I/O loop is idle now: it reads the other files' headers if this completes.
      std::map<uint32_t, Signal> mixed;
      Result<bool> done = catalog_->MaybeComplete(req.job, req.step, check.world_size, check.attempt, &mixed, io);
      if (done.ok() && !*done && !mixed.empty() && check.mixed) check.mixed(mixed);
      // Not complete yet: this daemon's ranks of the step go into its part, for whichever daemon
      // writes the last signal (one file per daemon per step).
      if (done.ok() && !*done) {
        catalog_->parts().Publish(dir, req.job, req.step, check.attempt);
      }
      if (wrote.ok() && check.attempt == req.attempt) {
        complete = std::move(done);
      } else if (!done.ok()) {
        Logger("writer")->error("completion check failed job={} step={} ({}) error=\"{}\"", req.job, req.step,
                                AttemptText(check.attempt), done.status().ToString());
      }
    }
  }
  if (!wrote.ok()) {
    // Only a failure the cancellation caused is an abandoned write (kept for the next daemon); a
    // full disk or a failed copy near the deadline is a failure like any other.
    if (env_.cancelled() && wrote.code() == StatusCode::kCancelled) {
      return Cancelled("abandoned at the daemon's stop timeout: " + wrote.message() + "; " + disposed);
    }
    return Status(wrote.code(), wrote.message() + "; " + disposed);
  }
  if (!complete.ok()) {
    disposed = DisposeAttemptFiles(req, written);
    return Status(complete.status().code(),
                  "completing checkpoint " + dir + ": " + complete.status().message() + "; " + disposed);
  }
  return bytes;
}

namespace {

// The signal of a persist, before its files are listed in it.
Signal SignalOf(const PersistRequest& req) {
  Signal signal;
  signal.rank = req.rank;
  signal.step = req.step;
  signal.resumed_from = req.attempt.resumed_from;
  signal.run_id = req.attempt.run_id;
  signal.node = req.node;
  signal.world_size = req.world_size;
  signal.committed_ms = req.committed_ms;
  return signal;
}

// One file image a persist writes: the image `file` of `layout`, whose offsets are relative to
// `base`; `stamp` when the writer stamps its checksums and step (not the EMA image, stamped already).
struct ImageSource {
  const RankLayout* layout;
  char* base;  // what the layout's offsets are relative to
  size_t file;
  bool stamp;
};

// The images of a persist: every file of the rank layout, then the EMA image if there is one.
std::vector<ImageSource> ImageSources(const PersistRequest& req) {
  const RankLayout& layout = *req.layout;
  std::vector<ImageSource> sources;
  for (size_t f = 0; f < layout.files.size(); ++f) sources.push_back({&layout, req.slot, f, true});
  if (req.ema_layout != nullptr) sources.push_back({req.ema_layout, req.ema_base, 0, false});
  return sources;
}

// The writes of `sources`, cut at their tensors and into pieces of whole checksum chunks of `chunk`
// bytes (about kWritePiece); lists each file in `signal` and adds its size to `*bytes`.
std::vector<ImageWrite> PlanImageWrites(const std::vector<ImageSource>& sources, uint64_t chunk, Signal* signal,
                                        uint64_t* bytes) {
  const uint64_t piece = std::max(chunk, (kWritePiece / chunk) * chunk);
  std::vector<ImageWrite> images;
  for (const ImageSource& s : sources) {
    const FileImage& image = s.layout->files[s.file];
    ImageWrite w;
    w.name = image.stem + ".safetensors";
    w.data = s.base + image.slot_offset;
    w.bytes = image.file_bytes();
    w.head = image.header.size();
    w.piece = piece;
    for (size_t t : image.tensors) {
      w.cuts.push_back(s.layout->placements[t].slot_offset - image.slot_offset);
    }
    if (w.cuts.empty()) w.cuts.push_back(w.head);
    images.push_back(std::move(w));
    signal->files.push_back(images.back().name);
    *bytes += image.file_bytes();
  }
  return images;
}

// The headers of `images`, written, as the signal records them, so that the completion need not
// open the files: each header's JSON without its padding. None when they exceed
// kSignalHeadersBudget together: the completion then reads them from the files.
std::vector<SignalHeader> RecordedHeaders(const std::vector<ImageWrite>& images) {
  std::vector<SignalHeader> headers;
  size_t total = 0;
  for (const ImageWrite& w : images) {
    if (w.bytes < 8) return {};
    auto n = ParseHeaderLength(reinterpret_cast<const unsigned char*>(w.data), w.bytes);
    if (!n.ok()) return {};
    std::string_view json(w.data + 8, *n);
    while (!json.empty() && json.back() == ' ') json.remove_suffix(1);
    total += json.size();
    if (total > kSignalHeadersBudget) return {};
    headers.push_back(SignalHeader{w.name, *n, w.bytes, std::string(json)});
  }
  return headers;
}

}  // namespace

Status Writer::WriteRankFiles(const PersistRequest& req, const std::string& dir, ParallelLoop* io,
                              std::vector<std::string>* written, uint64_t* bytes, Signal* out) {
  const RankLayout& layout = *req.layout;
  RETURN_IF_ERROR(MakeDirs(dir, 0755, &env_));
  Signal signal = SignalOf(req);

  // The file images go out with several writes in flight: each piece (16 MiB of whole checksum
  // chunks) of each tensor is a task that hashes its chunks and then writes its pages; while
  // io_threads_ pieces are being written, other threads hash the next ones. The whole-tensor
  // checksums of multi-chunk tensors are computed from their chunk checksums at the end. The
  // headers, which hold the step and the checksums, are written last. The EMA image was stamped by
  // the EMA stage; its tensors are only written.
  const std::vector<ImageSource> sources = ImageSources(req);
  const std::vector<ImageWrite> images = PlanImageWrites(sources, layout.checksum_chunk, &signal, bytes);
  ImageWriteHooks hooks;
  hooks.prepare = [&](size_t i, size_t r, uint64_t from, uint64_t to) {
    const ImageSource& s = sources[i];
    const FileImage& image = s.layout->files[s.file];
    if (!s.stamp || r >= image.tensors.size()) return;
    const size_t t = image.tensors[r];
    const uint64_t start = images[i].cuts[r];
    StampPieceChecksums(s.base, *s.layout, t, from - start, to - start);
  };
  hooks.max_writes_in_flight = io_threads_;
  // A streaming commit: nothing is hashed or written before the trainer's copies have put it in
  // place. Only the images of the rank layout come from the trainer; the EMA image is the daemon's.
  auto copied = [&](uint64_t slot_end) {
    return req.header == nullptr
               ? Status::OK()
               : WaitSlotCopied(*req.header, slot_end, req.copy_timeout, [this] { return env_.cancelled(); });
  };
  hooks.wait = [&](size_t i, uint64_t to) {
    const ImageSource& s = sources[i];
    return s.stamp ? copied(s.layout->files[s.file].slot_offset + to) : Status::OK();
  };
  // Every byte is hashed once, for its chunk, while it is in cache; a tensor of several chunks gets
  // its whole checksum from their checksums once all of them are stamped (format version 2).
  hooks.finish = [&](size_t i) {
    const ImageSource& s = sources[i];
    if (!s.stamp) return;
    StampDerivedChecksums(s.base, *s.layout, s.file);
    StampStep(s.base, *s.layout, s.file, req.step);
  };
  RETURN_IF_ERROR(WriteImagesDurably(dir, images, io, hooks, written, &env_));
  signal.headers = RecordedHeaders(images);

  auto write = [&](const std::string& name, const std::string& text) {
    bool renamed = false;
    Status s = WriteFileDurably(dir, name, text, &renamed, &env_);
    if (renamed) written->push_back(name);
    return s;
  };
  RETURN_IF_ERROR(write(ExtraFileName(req.rank), EncodeExtra(req.job, req.rank, req.step, req.extra)));
  signal.written_us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  RETURN_IF_ERROR(write(SignalFileName(req.rank), EncodeSignal(req.job, signal, *bytes)));
  *out = std::move(signal);
  return Status::OK();
}

}  // namespace flashckpt
