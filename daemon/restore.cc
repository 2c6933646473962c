#include "daemon/restore.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "common/checksum.h"
#include "common/dtype.h"
#include "common/fs.h"
#include "common/reshard.h"
#include "common/log.h"
#include "common/names.h"
#include "daemon/daemon.h"
#include "daemon/writer.h"

namespace flashckpt {
namespace {

struct PlannedRead {
  const Piece* piece;
  char* dest;
};

// A part of a saved piece that goes to a different place in the new layout.
struct Scatter {
  uint64_t file_offset;
  char* dest;
  uint64_t bytes;
};

constexpr uint64_t kStreamChunk = 8u << 20;

// Reads a whole saved piece through a bounded buffer, checking its checksum, and copies the parts
// the new layout needs. The slot's bytes are only trusted once every piece has verified.
Status StreamPiece(int fd, const std::string& path, const Piece& p, std::vector<Scatter>& parts,
                   std::vector<char>& buffer, Xxh3Stream& hash) {
  std::sort(parts.begin(), parts.end(), [](const Scatter& a, const Scatter& b) { return a.file_offset < b.file_offset; });
  hash.Reset();
  size_t next = 0;
  for (uint64_t pos = p.begin; pos < p.end; pos += kStreamChunk) {
    uint64_t n = std::min(kStreamChunk, p.end - pos);
    RETURN_IF_ERROR(PreadFull(fd, buffer.data(), n, pos, path));
    hash.Update(buffer.data(), n);
    // Parts do not overlap (each needed element is read once), so sorted by offset they also end in
    // order: skip those that ended before this chunk, copy those that intersect it.
    while (next < parts.size() && parts[next].file_offset + parts[next].bytes <= pos) ++next;
    for (size_t k = next; k < parts.size() && parts[k].file_offset < pos + n; ++k) {
      uint64_t lo = std::max(parts[k].file_offset, pos);
      uint64_t hi = std::min(parts[k].file_offset + parts[k].bytes, pos + n);
      if (lo < hi) std::memcpy(parts[k].dest + (lo - parts[k].file_offset), buffer.data() + (lo - pos), hi - lo);
    }
  }
  if (hash.Digest() != p.xxh3) {
    return Corruption(path + ": tensor '" + p.key + "' has checksum " + ChecksumHex(hash.Digest()) +
                      ", metadata says " + ChecksumHex(p.xxh3));
  }
  return Status::OK();
}

bool SameGeometry(const TensorSpec& t, const Piece& p) {
  if (t.kind != p.kind || t.dtype != p.dtype || t.global_shape != p.global_shape || t.box_offset != p.box_offset ||
      t.box_shape != p.box_shape || t.flat_range.has_value() != p.flat_range.has_value()) {
    return false;
  }
  return !t.flat_range || (t.flat_range->begin == p.flat_range->begin && t.flat_range->end == p.flat_range->end);
}

}  // namespace

Result<RestoreStats> FillSlotFromCheckpoint(const std::string& dir, const CheckpointMetadata& meta,
                                            const RankLayout& layout, char* slot) {
  std::multimap<std::string, const Piece*> by_key;
  for (const auto& p : meta.pieces) by_key.emplace(p.key, &p);

  std::vector<PlannedRead> plan;                 // same layout: whole pieces straight into place
  std::map<const Piece*, std::vector<Scatter>> reshard;  // other layouts: parts of saved pieces
  RestoreStats stats;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const TensorSpec& t = layout.tensors[i];
    char* dest = slot + layout.placements[i].slot_offset;
    stats.bytes_needed += layout.placements[i].bytes;
    auto [lo, hi] = by_key.equal_range(t.name);
    std::vector<const Piece*> candidates;
    const Piece* match = nullptr;
    for (auto it = lo; it != hi; ++it) {
      if (it->second->kind != t.kind) continue;  // e.g. the EMA twin of a model weight
      candidates.push_back(it->second);
      if (match == nullptr && SameGeometry(t, *it->second)) match = it->second;
    }
    if (candidates.empty()) {
      return NotFound("tensor '" + t.name + "' (" + std::string(TensorKindName(t.kind)) +
                      ") is not in the checkpoint " + dir);
    }
    if (match != nullptr) {
      plan.push_back({match, dest});
      continue;
    }
    // A different layout: plan the reads by intersecting this rank's piece with the saved ones.
    auto planned = PlanPieceReads(t, candidates);
    if (!planned.ok()) {
      // The rank's specs were validated at registration: a refused plan means the checkpoint does
      // not hold what this rank asks for (another dtype or global shape), not a malformed request.
      Status s = planned.status();
      if (s.code() == StatusCode::kInvalidArgument) s = FailedPrecondition(s.message());
      return s.WithContext("restoring into a different layout");
    }
    for (const ReadRun& run : planned->runs) {
      reshard[candidates[run.piece]].push_back({run.file_offset, dest + run.dest_offset, run.bytes});
    }
  }
  std::sort(plan.begin(), plan.end(), [](const PlannedRead& a, const PlannedRead& b) {
    return a.piece->file != b.piece->file ? a.piece->file < b.piece->file : a.piece->begin < b.piece->begin;
  });

  std::map<std::string, UniqueFd> files;
  for (size_t i = 0; i < plan.size();) {
    // Merge the run of reads that are adjacent in the file and in the slot.
    size_t j = i + 1;
    uint64_t end = plan[i].piece->end;
    while (j < plan.size() && plan[j].piece->file == plan[i].piece->file && plan[j].piece->begin == end &&
           plan[j].dest == plan[i].dest + (end - plan[i].piece->begin)) {
      end = plan[j].piece->end;
      ++j;
    }
    const std::string path = dir + "/" + plan[i].piece->file;
    auto fd = files.find(plan[i].piece->file);
    if (fd == files.end()) {
      ASSIGN_OR_RETURN(UniqueFd opened, OpenForRead(path));
      fd = files.emplace(plan[i].piece->file, std::move(opened)).first;
    }
    uint64_t bytes = end - plan[i].piece->begin;
    RETURN_IF_ERROR(PreadFull(fd->second.get(), plan[i].dest, bytes, plan[i].piece->begin, path));
    stats.bytes_read += bytes;
    stats.reads += 1;
    for (size_t k = i; k < j; ++k) {
      const Piece& p = *plan[k].piece;
      uint64_t got = Xxh3(plan[k].dest, p.end - p.begin);
      if (got != p.xxh3) {
        return Corruption(path + ": tensor '" + p.key + "' has checksum " + ChecksumHex(got) + ", metadata says " +
                          ChecksumHex(p.xxh3));
      }
    }
    i = j;
  }
  if (!reshard.empty()) {
    std::vector<char> buffer(kStreamChunk);
    Xxh3Stream hash;
    for (auto& [piece, parts] : reshard) {
      const std::string path = dir + "/" + piece->file;
      auto fd = files.find(piece->file);
      if (fd == files.end()) {
        ASSIGN_OR_RETURN(UniqueFd opened, OpenForRead(path));
        fd = files.emplace(piece->file, std::move(opened)).first;
      }
      RETURN_IF_ERROR(StreamPiece(fd->second.get(), path, *piece, parts, buffer, hash));
      stats.bytes_read += piece->end - piece->begin;
      stats.reads += 1;
    }
  }
  return stats;
}

// Loads the checkpoint's EMA into the rank's EMA segment, so the average continues from the
// restored step. A checkpoint saved without EMA leaves the EMA uninitialised (the next update
// starts it afresh).
Status LoadEma(const std::string& dir, const CheckpointMetadata& meta, RankEma* ema) {
  std::lock_guard<std::mutex> lock(ema->mu());
  EmaSegmentHeader* h = ema->header();
  if (!meta.ema) {
    h->initialized = 0;
    h->updates_applied = 0;
    h->updates_skipped = 0;
    h->last_step = -1;
    Logger("restore")->warn("checkpoint {} has no EMA; the EMA starts afresh", dir);
    return Status::OK();
  }
  auto filled = FillSlotFromCheckpoint(dir, meta, ema->plan().layout, ema->base());
  if (!filled.ok()) return filled.status().WithContext("loading the EMA");
  h->initialized = meta.ema->updates_applied > 0 ? 1 : 0;
  h->updates_applied = meta.ema->updates_applied;
  h->updates_skipped = meta.ema->updates_skipped;
  h->last_step = meta.ema->updates_applied > 0 ? meta.ema->last_step : -1;
  return Status::OK();
}

// Daemon::Restore: pick the checkpoint, take a slot, fill it without holding the lock, hand it over.

Result<RestoreOutcome> Daemon::Restore(const std::string& session_id, int64_t step,
                                       std::chrono::milliseconds timeout) {
  if (step < 0) return InvalidArgument("restore step must be non-negative (0 = latest)");
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string job;
  uint32_t rank_id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ASSIGN_OR_RETURN(RankState * rank, RankOf(session_id, true));
    (void)rank;
    job = sessions_[session_id].job;
    rank_id = sessions_[session_id].rank;
  }
  RestoreOutcome out;
  // Retention must not delete the checkpoint while it is read: mark the step in use first, then
  // check that it is (still) complete. Until the slot is filled, `in_use` keeps it.
  const int64_t requested = step;
  StepInUse in_use;
  for (int attempt = 0;; ++attempt) {
    if (requested == 0) {
      auto latest = catalog_.LatestComplete(job);
      if (!latest) return out;  // found = false
      step = *latest;
    }
    in_use = catalog_.Use(job, step);
    if (catalog_.IsComplete(job, step)) break;
    // The latest was deleted between the look-up and the registration (a newer one completed
    // meanwhile): look again.
    if (requested != 0 || attempt >= 8) {
      return NotFound("checkpoint-" + std::to_string(step) + " of job '" + job +
                      "' does not exist or is incomplete (no metadata.json)");
    }
  }
  std::string dir = catalog_.CheckpointDir(job, step);
  ASSIGN_OR_RETURN(CheckpointMetadata meta, ReadMetadataFile(dir));
  if (meta.job != job || meta.step != step) {
    return Corruption(dir + "/metadata.json describes job '" + meta.job + "' step " + std::to_string(meta.step));
  }

  ASSIGN_OR_RETURN(LoadingSlot loading,
                   AcquireLoadingSlot(session_id, step, /*need_ema=*/false, deadline, timeout, "the restore"));
  const std::shared_ptr<RankSegment>& segment = loading.segment;
  const SlotTicket ticket = loading.ticket;

  auto start = std::chrono::steady_clock::now();
  auto filled = FillSlotFromCheckpoint(dir, meta, segment->layout, segment->Slot(ticket.slot));
  if (filled.ok() && segment->ema) {
    Status loaded = LoadEma(dir, meta, segment->ema.get());
    if (!loaded.ok()) filled = loaded;
  }
  std::string extra;
  Status extra_status;
  if (filled.ok()) {
    std::string path = dir + "/" + ExtraFileName(rank_id);
    if (PathExists(path)) {
      auto text = ReadSmallFile(path, 16u << 20);
      auto decoded = text.ok() ? DecodeExtra(*text) : Result<std::string>(text.status());
      if (decoded.ok()) extra = std::move(decoded).value();
      else extra_status = decoded.status().WithContext(path);
    }
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::lock_guard<std::mutex> lock(mu_);
  Status failure = !filled.ok() ? filled.status() : extra_status;
  if (!failure.ok()) {
    Logger("restore")->error("restore failed job={} rank={} step={} error=\"{}\"", job, rank_id, step,
                             failure.ToString());
  }
  RETURN_IF_ERROR(FinishLoadingSlotLocked(session_id, loading, failure));
  Logger("restore")->info("restored job={} rank={} step={} bytes={} read={} read_ratio={:.2f} reads={} secs={:.3f}",
                          job, rank_id, step, FormatBytes(filled->bytes_needed), FormatBytes(filled->bytes_read),
                          filled->bytes_needed ? double(filled->bytes_read) / double(filled->bytes_needed) : 0.0,
                          filled->reads, secs);
  jobs_[job].ranks[rank_id].resumed_from = step;
  out.found = true;
  out.step = step;
  out.ticket = ticket;
  out.extra = std::move(extra);
  out.bytes_read = filled->bytes_read;
  return out;
}

Result<Daemon::LoadingSlot> Daemon::AcquireLoadingSlot(const std::string& session_id, std::optional<int64_t> step,
                                                       bool need_ema, std::chrono::steady_clock::time_point deadline,
                                                       std::chrono::milliseconds timeout, const char* purpose) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ASSIGN_OR_RETURN(RankState * rank, RankOf(session_id, true));
    if (need_ema && !rank->segment->ema) {
      return FailedPrecondition("this rank has no EMA: the job registered without ema_decay, or all its "
                                "weights are replicas persisted by another rank");
    }
    if (rank->segment->ema_pending == 0) {
      if (auto t = rank->segment->slots.Acquire(SlotState::kRestoring, step.value_or(rank->last_committed))) {
        LoadingSlot slot{rank->segment, *t};
        slot.segment->slots.SetLoading(t->slot, true);
        slot.segment->Mirror(t->slot);
        return slot;
      }
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      return DeadlineExceeded(std::string("no slot became free for ") + purpose + " within " +
                              std::to_string(timeout.count()) + " ms");
    }
  }
}

Status Daemon::FinishLoadingSlotLocked(const std::string& session_id, const LoadingSlot& slot, const Status& failure) {
  RankSegment& segment = *slot.segment;
  segment.slots.SetLoading(slot.ticket.slot, false);
  auto live = sessions_.find(session_id);
  bool alive = live != sessions_.end() && jobs_[live->second.job].ranks[live->second.rank].session_id == session_id;
  if (failure.ok() && alive) {
    segment.Mirror(slot.ticket.slot);
    return Status::OK();
  }
  (void)segment.slots.Release(slot.ticket, SlotState::kRestoring);  // nobody will read it
  segment.Mirror(slot.ticket.slot);
  cv_.notify_all();
  return failure.ok() ? Cancelled("the session ended while its slot was being filled") : failure;
}

Result<Daemon::EmaCopy> Daemon::GetEma(const std::string& session_id, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  // The copy is as of the last commit: AcquireLoadingSlot waits for committed snapshots to reach the EMA.
  ASSIGN_OR_RETURN(LoadingSlot loading,
                   AcquireLoadingSlot(session_id, std::nullopt, /*need_ema=*/true, deadline, timeout, "the EMA copy"));
  EmaCopy out;
  out.ticket = loading.ticket;
  {
    RankEma& ema = *loading.segment->ema;
    std::lock_guard<std::mutex> lock(ema.mu());
    const FileImage& image = ema.plan().layout.files[0];
    const uint64_t data = image.slot_offset + image.header.size();
    std::memcpy(loading.segment->SlotEmaBase(loading.ticket.slot) + data, ema.base() + data, image.data_bytes);
    out.initialized = ema.header()->initialized.load() != 0;
    out.step = ema.header()->last_step.load();
  }
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(FinishLoadingSlotLocked(session_id, loading, Status::OK()));
  return out;
}

Status Daemon::ReleaseSlot(const std::string& session_id, const SlotTicket& ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  ASSIGN_OR_RETURN(RankState * rank, RankOf(session_id, true));
  RETURN_IF_ERROR(rank->segment->slots.Release(ticket, SlotState::kRestoring));
  rank->segment->Mirror(ticket.slot);
  cv_.notify_all();
  return Status::OK();
}

}  // namespace flashckpt
