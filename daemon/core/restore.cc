#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <thread>

#include "common/base/dtype.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/extra.h"
#include "common/read/checkpoint_read.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/restorer.h"
#include "daemon/pipeline/writer.h"

namespace flashckpt {
namespace {

// Where a memory checkpoint came from, as the log says it.
const char* TierName(const ResidentCheckpoint& resident) {
  return resident.from_parity ? "parity" : resident.from_peer.empty() ? "memory" : "peer";
}

}  // namespace
// Loads the checkpoint's EMA into the rank's EMA segment, so the average continues from the
// restored step. A checkpoint saved without EMA leaves the EMA uninitialised (the next update
// starts it afresh).
Status LoadEma(const std::string& dir, const CheckpointMetadata& meta, RankEma* ema, const FillOptions& options) {
  if (!meta.ema) {
    ema->Reset();
    Logger("restore")->warn("checkpoint {} has no EMA; the EMA starts afresh", dir);
    return Status::OK();
  }
  EmaState state;
  state.initialized = meta.ema->updates_applied > 0;
  state.updates_applied = meta.ema->updates_applied;
  state.updates_skipped = meta.ema->updates_skipped;
  state.last_step = state.initialized ? meta.ema->last_step : -1;
  state.last_seen = state.last_step;
  // Filled into the spare image and published at once: a failed or interrupted load leaves the
  // previous average in place.
  Status loaded = ema->Load(
      [&](char* image_base) {
        return FillSlotFromCheckpoint(dir, meta, ema->plan().layout, image_base, options).status();
      },
      state);
  return loaded.ok() ? loaded : loaded.WithContext("loading the EMA");
}

// Daemon::Restore: pick the checkpoint, take a slot, fill it without holding the lock, hand it over.

namespace {

// The most chunk checksums a restore hands a client to verify (8 bytes each: 2 MiB, well inside the
// 4 MiB a gRPC client receives by default). A larger memory checkpoint is verified by the daemon.
constexpr size_t kMaxClientChunkSums = size_t{1} << 18;

// extra.rankNNNNN.json of `rank` in the checkpoint `dir`, checked to be that job's, rank's and
// step's. A checkpoint without one (none was saved) gives "" only while its metadata.json is
// still there: a file missing because the checkpoint is being deleted fails the restore.
Status ReadRestoreExtra(const std::string& dir, const std::string& job, uint32_t rank, int64_t step, IoEnv* io,
                        std::string* extra) {
  const std::string path = dir + "/" + ExtraFileName(rank);
  auto text = ReadSmallFile(path, 16u << 20, io);
  if (!text.ok()) {
    if (text.status().code() != StatusCode::kNotFound) return text.status();
    ASSIGN_OR_RETURN(bool listed, Exists(dir + "/metadata.json", io));
    if (!listed) return NotFound(dir + " was deleted during the restore (" + ExtraFileName(rank) + " is gone)");
    extra->clear();
    return Status::OK();
  }
  auto decoded = DecodeExtra(*text, job, rank, step);
  if (!decoded.ok()) return decoded.status().WithContext(path);
  *extra = std::move(decoded).value();
  return Status::OK();
}

// Marks `step` of `source` in use (`*in_use`) and checks that it is complete; step 0: the latest
// complete one. nullopt: the job has no checkpoint at all (found=false); a root that cannot be read
// is an error the trainer sees, never a start from scratch.
Result<std::optional<int64_t>> UseCompleteStep(Core& c_, const std::string& source, int64_t requested,
                                               StepInUse* in_use) {
  int64_t step = requested;
  for (int attempt = 0;; ++attempt) {
    if (requested == 0) {
      ASSIGN_OR_RETURN(std::optional<int64_t> latest, c_.catalog_.LatestComplete(source));
      if (!latest) return std::optional<int64_t>();
      step = *latest;
    }
    *in_use = c_.catalog_.Use(source, step);
    ASSIGN_OR_RETURN(bool complete, c_.catalog_.IsComplete(source, step));
    if (complete) return std::optional<int64_t>(step);
    // The latest was deleted between the look-up and the registration (a newer one completed
    // meanwhile): look again, 50 ms later. A step asked for by number is looked at again a few
    // times: another daemon's deletion that renamed it away puts it back once it finds this
    // restore's lease (the newest step too, rather than falling back to an older one at once).
    if ((requested != 0 && attempt >= 3) || attempt >= 8) {
      return NotFound("checkpoint-" + std::to_string(step) + " of job '" + source +
                      "' does not exist or is incomplete (no metadata.json)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// The names of the tensors rank `session_id` restores, its layout's and its EMA's: the restore reads
// only their pieces of metadata.json (Catalog::MetadataFor, shared by the ranks that restore the same
// tensors at once).
Result<std::vector<std::string>> NamesRestored(Core& c_, const std::string& session_id) EXCLUDES(c_.mu_) {
  MutexLock lock(&c_.mu_);
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
  std::vector<std::string> names;
  for (const TensorSpec& t : rank->segment->layout.tensors) names.push_back(t.name);
  if (rank->segment->ema) {
    for (const TensorSpec& t : rank->segment->ema->plan().layout.tensors) names.push_back(t.name);
  }
  return names;
}

// Every kind asked for that the rank holds must be in the checkpoint (an imported one holds model
// weights only). A full restore names the first missing tensor instead (FillSlotFromCheckpoint).
Status CheckKindsSaved(Core& c_, const std::string& session_id, const std::vector<TensorKind>& kinds,
                       const CheckpointMetadata& meta, const std::string& source, int64_t step) EXCLUDES(c_.mu_) {
  if (kinds.empty()) return Status::OK();
  MutexLock lock(&c_.mu_);
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
  const auto& tensors = rank->segment->layout.tensors;
  for (TensorKind kind : kinds) {
    const bool held = std::any_of(tensors.begin(), tensors.end(), [&](const TensorSpec& t) { return t.kind == kind; });
    if (held && !HoldsKind(meta, kind)) {
      return FailedPrecondition("checkpoint-" + std::to_string(step) + " of job '" + source + "' holds no " +
                                std::string(TensorKindName(kind)) + " tensors; restore only the kinds it has");
    }
  }
  return Status::OK();
}

// Reads checkpoint `dir` into `slot` of the segment as `want` says, and its EMA into the segment's
// (a full restore). `own_job` non-empty: the checkpoint is the rank's own job's, whose extra state
// it restores too (into `*extra`): read and checked before any tensor, so that a checkpoint deleted
// under the restore (by another daemon's retention on a shared root) fails it rather than hand over
// tensors without their extra state.
Result<FillStats> FillFromFiles(Core& c_, const std::string& dir, const CheckpointMetadata& meta, RankSegment& segment,
                                uint32_t slot, const RestoreWant& want, const std::string& own_job, uint32_t rank_id,
                                int64_t step, std::string* extra) {
  Status extra_status =
      own_job.empty() ? Status::OK() : ReadRestoreExtra(dir, own_job, rank_id, step, c_.RootIo(), extra);
  // Restores are rare and latency-bound: each gets its own reader threads.
  ParallelLoop readers(c_.config_.restore_threads > 0 ? c_.config_.restore_threads - 1 : 0);
  FillOptions options;
  options.loop = &readers;
  options.convert_dtype = want.convert_dtype;
  options.io = c_.RootIo();
  options.kinds = want.kinds;
  Result<FillStats> filled = !extra_status.ok()
                                 ? Result<FillStats>(extra_status)
                                 : FillSlotFromCheckpoint(dir, meta, segment.layout, segment.Slot(slot), options);
  if (filled.ok() && segment.ema && want.kinds.empty()) {  // a partial restore leaves the EMA as it is
    FillOptions ema_options;  // the EMA is fp32 and saved as fp32: never converted
    ema_options.loop = &readers;
    ema_options.io = c_.RootIo();
    Status loaded = LoadEma(dir, meta, segment.ema.get(), ema_options);
    if (!loaded.ok()) filled = loaded;
  }
  return filled;
}

// RestoreFromMemory's wait, until `deadline`, for the checksums of the rank's memory snapshots still
// queued (the last ones of the trainer that died): all of them for the newest, the step's own for a
// step asked for. One whose copies never finished was dropped when its session closed.
Status AwaitQueuedSumsLocked(Core& c_, const std::string& session_id, int64_t step,
                             std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout,
                             MutexLock* lock) REQUIRES(c_.mu_) {
  for (;;) {
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    const auto& pending = c_.MemoryPending(*rank->segment);
    if (std::none_of(pending.begin(), pending.end(), [&](const RankSegment::PendingMemory& p) {
          return (step == 0 || p.resident->step == step) && !p.resident->dropped.load();
        })) {
      return Status::OK();
    }
    if (!c_.clock_.WaitUntil(&c_.cv_, lock, deadline)) {
      return DeadlineExceeded("the checksums of this rank's last memory checkpoint were not computed within " +
                              std::to_string(timeout.count()) + " ms");
    }
  }
}

// Which of the memory checkpoints `held` (newest first) RestoreFromMemory hands over: `step`, or
// (0) the newest for a job of one rank when not older than its newest complete checkpoint on disk
// (read without the lock); -1: none, the files serve the restore.
Result<int64_t> ChooseHeldStep(Core& c_, const std::string& job, int64_t step, bool planned, uint32_t world_size,
                               const std::vector<int64_t>& held) EXCLUDES(c_.mu_) {
  // The job's plan chose a memory checkpoint this rank held, verified, moments ago. If it is gone
  // now, the other ranks may already train from it: this rank must not quietly restore another step.
  if (planned && std::find(held.begin(), held.end(), step) == held.end()) {
    MutexLock lock(&c_.mu_);
    return Restorer::PlanLostLocked(c_, job, step, StatusCode::kFailedPrecondition, "is no longer held");
  }
  if (held.empty()) return -1;
  if (step > 0) return std::find(held.begin(), held.end(), step) != held.end() ? step : -1;
  if (world_size != 1) return -1;  // all ranks of a larger job must restore the same step: they ask for it by number
  ASSIGN_OR_RETURN(std::optional<int64_t> latest, c_.catalog_.LatestComplete(job));
  return held.front() >= latest.value_or(-1) ? held.front() : -1;
}

// The memory checkpoint in `loading` checked against its checksums (`in_client`: the client checks
// the tensors as it copies them), and, for a rank with EMA, its EMA loaded into the rank's: the
// average continues from the restored step (the EMA stage is done with the rank's earlier
// snapshots: RestoreFromMemory waited for it).
Status VerifyAndLoadResident(Core& c_, const Restorer::LoadingSlot& loading, const ResidentCheckpoint& resident,
                             bool in_client) EXCLUDES(c_.mu_) {
  ParallelLoop verifiers(c_.config_.restore_threads > 0 ? c_.config_.restore_threads - 1 : 0);
  const RankSegment& segment = *loading.segment;
  RETURN_IF_ERROR(MemoryTier::VerifyResidentBytes(segment, loading.ticket.slot, resident, &verifiers, in_client));
  if (!segment.ema) return Status::OK();
  const char* image = segment.SlotEmaBase(loading.ticket.slot);
  const RankLayout& layout = segment.ema->plan().layout;
  return segment.ema->Load(
      [&](char* base) {
        for (const Placement& p : layout.placements) std::memcpy(base + p.slot_offset, image + p.slot_offset, p.bytes);
        return Status::OK();
      },
      *resident.ema);
}

// The verified memory checkpoint `chosen` in `loading` is the rank's restore: its newer memory
// checkpoints are dropped, and it is restored now, or (`verify_in_client`) once the client has
// checked every chunk against the sums put in `out` (ReleaseSlot).
void HandOverLocked(Core& c_, const std::string& job, uint32_t rank_id, int64_t chosen, bool planned,
                    const Restorer::LoadingSlot& loading, const ResidentCheckpoint& resident, bool verify_in_client,
                    double secs, RestoreOutcome* out) REQUIRES(c_.mu_) {
  MemoryTier::DropMemoryFrom(c_, *loading.segment, chosen + 1);
  RankState& restored = c_.jobs_[job].ranks[rank_id];
  restored.client_verifying.reset();
  if (!verify_in_client) {
    MemoryTier::RestoredLocked(c_, job, rank_id, restored, chosen);
    Logger("restore")->info("restored job={} rank={} step={} tier={} bytes={} verify_secs={:.3f}", job, rank_id,
                            chosen, TierName(resident),
                            FormatBytes(loading.segment->tensor_bytes), secs);
  } else {
    // Restored once the client has checked every chunk (ReleaseSlot).
    restored.client_verifying = RankState::ClientVerified{loading.ticket, chosen, planned};
    const RankLayout& layout = loading.segment->layout;
    out->chunk_bytes = resident.sums.chunk_bytes;
    out->tensor_sums.reserve(layout.placements.size());
    for (size_t t = 0; t < layout.placements.size(); ++t) {
      const uint64_t first = resident.sums.first[t];
      const uint64_t end = t + 1 < layout.placements.size() ? resident.sums.first[t + 1] : resident.sums.sums.size();
      out->tensor_sums.push_back({layout.placements[t].slot_offset, layout.placements[t].bytes,
                                 std::vector<uint64_t>(resident.sums.sums.begin() + static_cast<ptrdiff_t>(first),
                                                       resident.sums.sums.begin() + static_cast<ptrdiff_t>(end))});
    }
    Logger("restore")->info("restored job={} rank={} step={} tier={} bytes={} verify=client", job, rank_id, chosen,
                            TierName(resident), FormatBytes(loading.segment->tensor_bytes));
  }
}

}  // namespace

Result<RestoreOutcome> Restorer::Restore(const std::string& session_id, int64_t step, const RestoreWant& want,
                                       std::chrono::milliseconds timeout) {
  if (step < 0) return InvalidArgument("restore step must be non-negative (0 = latest)");
  auto deadline = c_.clock_.Now() + timeout;
  std::string job;
  uint32_t rank_id = 0;
  {
    MutexLock lock(&c_.mu_);
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    (void)rank;
    job = c_.sessions_[session_id].job;
    rank_id = c_.sessions_[session_id].rank;
  }
  // The job whose checkpoint is read: the session's own, or another one's (pretrained weights).
  const bool own = want.source_job.empty() || want.source_job == job;
  const std::string source = own ? job : want.source_job;
  if (own && want.kinds.empty() && !want.convert_dtype) {
    ASSIGN_OR_RETURN(RestoreOutcome memory, RestoreFromMemory(session_id, step, want.verify_in_client, deadline, timeout));
    if (memory.found || memory.none_decided) return memory;
    if (step == 0 && memory.step > 0) step = memory.step;  // the job's plan: this step from disk
  }
  RestoreOutcome out;
  // Retention must not delete the checkpoint while it is read: `in_use` keeps it until the slot is filled.
  StepInUse in_use;
  ASSIGN_OR_RETURN(std::optional<int64_t> complete, UseCompleteStep(c_, source, step, &in_use));
  if (!complete) return out;  // found = false
  step = *complete;
  std::string dir = c_.catalog_.CheckpointDir(source, step);
  // Only the pieces of the rank's tensors: in a job of thousands of ranks, a small part of the file.
  ASSIGN_OR_RETURN(std::vector<std::string> names, NamesRestored(c_, session_id));
  ASSIGN_OR_RETURN(const std::shared_ptr<const CheckpointMetadata> shared, c_.catalog_.MetadataFor(source, step, names));
  const CheckpointMetadata& meta = *shared;
  if (meta.job != source || meta.step != step) {
    return Corruption(dir + "/metadata.json describes job '" + meta.job + "' step " + std::to_string(meta.step));
  }
  RETURN_IF_ERROR(CheckKindsSaved(c_, session_id, want.kinds, meta, source, step));

  ASSIGN_OR_RETURN(LoadingSlot loading,
                   AcquireLoadingSlot(session_id, step, /*need_ema=*/false, deadline, timeout, "the restore"));
  const std::shared_ptr<RankSegment>& segment = loading.segment;
  const SlotTicket ticket = loading.ticket;

  auto start = c_.clock_.Now();
  std::string extra;
  Result<FillStats> filled = FillFromFiles(c_, dir, meta, *segment, ticket.slot, want, own ? job : "", rank_id, step, &extra);
  double secs = std::chrono::duration<double>(c_.clock_.Now() - start).count();

  MutexLock lock(&c_.mu_);
  Status failure = filled.status();
  if (!failure.ok()) {
    Logger("restore")->error("restore failed job={} rank={} step={} error=\"{}\"", job, rank_id, step,
                             failure.ToString());
  }
  RETURN_IF_ERROR(FinishLoadingSlotLocked(c_, session_id, loading, failure));
  Logger("restore")->info("restored job={} rank={} step={} bytes={} read={} read_ratio={:.2f} reads={} secs={:.3f}",
                          job, rank_id, step, FormatBytes(filled->bytes_needed), FormatBytes(filled->bytes_read),
                          filled->bytes_needed ? double(filled->bytes_read) / double(filled->bytes_needed) : 0.0,
                          filled->reads, secs);
  if (own) {
    MemoryTier::RestoredLocked(c_, job, rank_id, c_.jobs_[job].ranks[rank_id], step);
    // Memory checkpoints after the restored step are of a timeline the job has left.
    MemoryTier::DropMemoryFrom(c_, *segment, step + 1);
  }
  out.found = true;
  out.step = step;
  out.ticket = ticket;
  out.extra = std::move(extra);
  out.bytes_read = filled->bytes_read;
  return out;
}

Result<RestoreOutcome> Restorer::RestoreFromMemory(const std::string& session_id, int64_t step, bool verify_in_client,
                                                 std::chrono::steady_clock::time_point deadline,
                                                 std::chrono::milliseconds timeout) {
  RestoreOutcome out;  // found = false: the caller reads the files (out.step: that one)
  std::string job;
  uint32_t rank_id = 0, world_size = 1;
  std::vector<int64_t> held;
  std::shared_ptr<RankSegment> ema_segment;  // the rank's segment, when it has EMA
  bool planned = false;  // the step is the job's plan: every other rank restores it too
  {
    MutexLock lock(&c_.mu_);
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    planned = step == 0 && rank->topology.world_size != 1;
    job = c_.sessions_[session_id].job;
    rank_id = c_.sessions_[session_id].rank;
  }
  // A newer replica on a peer (or one of the step asked for) joins the rank's memory checkpoints.
  c_.memory->FetchPeerReplica(job, rank_id, deadline, planned ? 0 : step);
  if (planned) {
    // The ranks of a job must restore the same step: the job's plan says which, and where from.
    Result<ResumePlan> planned_step = ResumePlanFor(session_id, deadline, timeout);
    {
      // Its ask is answered: a view published later for the job (its next resume) must not show
      // this process as asking again before it does. (Only its own ask: a newer process's stays.)
      MutexLock lock(&c_.mu_);
      auto rank = c_.RankOf(session_id, true);
      auto it = c_.jobs_.find(job);
      if (rank.ok() && it != c_.jobs_.end()) {
        auto ask = it->second.plan_asks.find(rank_id);
        if (ask != it->second.plan_asks.end() && ask->second == (*rank)->process) it->second.plan_asks.erase(ask);
      }
    }
    ASSIGN_OR_RETURN(ResumePlan plan, std::move(planned_step));
    if (!plan.found || plan.tier == SlotTier::kDisk) {
      out.step = plan.step;
      out.none_decided = plan.decided && !plan.found;  // none: not looked for again, by any rank
      return out;
    }
    step = plan.step;
  }
  {
    MutexLock lock(&c_.mu_);
    RETURN_IF_ERROR(AwaitQueuedSumsLocked(c_, session_id, step, deadline, timeout, &lock));
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    held = c_.Slots(*rank->segment).ResidentSteps();
    if (rank->segment->ema) ema_segment = rank->segment;
    world_size = rank->topology.world_size;
    job = c_.sessions_[session_id].job;
    rank_id = c_.sessions_[session_id].rank;
  }
  ASSIGN_OR_RETURN(const int64_t chosen, ChooseHeldStep(c_, job, step, planned, world_size, held));
  if (chosen < 0) return out;
  // A rank with EMA loads the EMA of the step (VerifyAndLoadResident): the rank's snapshots still
  // on their way to the EMA go first, so that none of them lands on the loaded average.
  if (uint32_t queued = 0; ema_segment && !c_.ema_stage_->WaitDrained(ema_segment.get(), deadline, &queued)) {
    return DeadlineExceeded(std::to_string(queued) + " committed snapshot(s) of this rank did not reach its EMA within " +
                            std::to_string(timeout.count()) + " ms");
  }
  ema_segment.reset();  // not released under c_.mu_

  LoadingSlot loading;
  std::shared_ptr<const ResidentCheckpoint> resident;
  {
    MutexLock lock(&c_.mu_);
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    auto ticket = c_.Slots(*rank->segment).AcquireResident(chosen);
    if (!ticket && planned) return PlanLostLocked(c_, job, step, StatusCode::kFailedPrecondition, "is no longer held");
    if (!ticket) return out;  // no longer held (dropped meanwhile): the files
    loading = LoadingSlot{rank->segment, *ticket};
    resident = c_.Slots(*rank->segment).ResidentIn(ticket->slot);
    c_.Slots(*rank->segment).SetLoading(ticket->slot, true);
    c_.Mirror(*rank->segment, ticket->slot);
  }
  // Verified off the lock, while the slot is RESTORING and loading: nobody else can take it. A client
  // that checks each chunk as it copies it gets the checksums instead (only while they fit easily in
  // a reply: kMaxClientChunkSums): one pass over the bytes, the hash reading each chunk right before
  // the copy reads it from the cache.
  const auto start = c_.clock_.Now();
  verify_in_client = verify_in_client && resident->sums.sums.size() <= kMaxClientChunkSums;
  const Status verified = VerifyAndLoadResident(c_, loading, *resident, verify_in_client);
  const double secs = std::chrono::duration<double>(c_.clock_.Now() - start).count();

  MutexLock lock(&c_.mu_);
  if (!verified.ok()) {
    // Never handed over, and the restore goes to the files.
    MemoryTier::MemoryFailedLocked(c_, *loading.segment, job, rank_id, chosen, verified, "restoring from disk");
    (void)FinishLoadingSlotLocked(c_, session_id, loading, verified);  // frees the slot
    if (planned) {
      return PlanLostLocked(c_, job, step, StatusCode::kCorruption, "failed its checksums (" + verified.ToString() + ")");
    }
    return out;
  }
  RETURN_IF_ERROR(FinishLoadingSlotLocked(c_, session_id, loading, Status::OK()));
  HandOverLocked(c_, job, rank_id, chosen, planned, loading, *resident, verify_in_client, secs, &out);
  out.found = true;
  out.step = chosen;
  out.ticket = loading.ticket;
  out.extra = resident->extra;
  out.tier = SlotTier::kMemory;
  out.from_peer = resident->from_peer;
  out.from_parity = resident->from_parity;
  return out;
}

Result<RestoreCandidates> Restorer::Restorable(const std::string& session_id, std::chrono::milliseconds timeout,
                                             int64_t extra_of, bool verify) {
  const auto deadline = c_.clock_.Now() + timeout;
  RestoreCandidates out;
  std::string job;
  uint32_t rank_id = 0;
  std::shared_ptr<RankSegment> segment;
  std::vector<int64_t> held;
  std::string held_extra;  // unverified: the extra state of step extra_of, when held
  {
    MutexLock lock(&c_.mu_);
    RETURN_IF_ERROR(c_.RankOf(session_id, /*need_segment=*/false).status());
    job = c_.sessions_[session_id].job;
    rank_id = c_.sessions_[session_id].rank;
  }
  // A newer replica on a peer is a candidate too (or the one of the step whose extra state is asked for).
  c_.memory->FetchPeerReplica(job, rank_id, deadline, extra_of > 0 ? extra_of : 0);
  {
    MutexLock lock(&c_.mu_);
    for (;;) {
      ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, /*need_segment=*/false));
      job = c_.sessions_[session_id].job;
      rank_id = c_.sessions_[session_id].rank;
      segment = rank->segment;
      if (!segment) break;
      const auto& pending = c_.MemoryPending(*segment);
      if (std::none_of(pending.begin(), pending.end(),
                       [](const RankSegment::PendingMemory& p) { return !p.resident->dropped.load(); })) {
        held = c_.Slots(*segment).ResidentSteps();
        if (!verify && extra_of > 0) {
          auto resident = c_.Slots(*segment).ResidentOf(extra_of);
          if (resident != nullptr) held_extra = resident->extra;
        }
        break;
      }
      if (!c_.clock_.WaitUntil(&c_.cv_, &lock, deadline)) {
        return DeadlineExceeded("the checksums of this rank's last memory checkpoint were not computed within " +
                                std::to_string(timeout.count()) + " ms");
      }
    }
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> latest, c_.catalog_.LatestComplete(job));  // without the lock
  out.disk_step = latest.value_or(0);
  ParallelLoop verifiers(c_.config_.restore_threads > 0 ? c_.config_.restore_threads - 1 : 0);
  if (extra_of > 0) {
    const bool has = std::find(held.begin(), held.end(), extra_of) != held.end();
    held.assign(has ? 1 : 0, extra_of);
  }
  if (!verify) {
    out.memory_steps = std::move(held);
    if (extra_of > 0 && !out.memory_steps.empty()) out.extra = std::move(held_extra);
    return out;
  }
  for (int64_t step : held) {
    Status verified = c_.memory->VerifyResident(job, rank_id, segment, step, &verifiers,
                                     "offering none of the rank's memory checkpoints", extra_of > 0 ? &out.extra : nullptr);
    if (verified.ok()) out.memory_steps.push_back(step);
    if (!verified.ok() && verified.code() != StatusCode::kNotFound) {
      out.memory_steps.clear();  // all of them were dropped
      break;
    }
  }
  return out;
}

Result<RestoreCandidates> Restorer::DiskExtra(const std::string& session_id, int64_t step) {
  if (step < 0) return InvalidArgument("the step of a checkpoint's extra state must be non-negative (0 = latest)");
  std::string job;
  uint32_t rank_id = 0;
  {
    MutexLock lock(&c_.mu_);
    RETURN_IF_ERROR(c_.RankOf(session_id, /*need_segment=*/false).status());
    job = c_.sessions_[session_id].job;
    rank_id = c_.sessions_[session_id].rank;
  }
  RestoreCandidates out;
  StepInUse in_use;  // retention keeps it while its extra state is read
  ASSIGN_OR_RETURN(std::optional<int64_t> complete, UseCompleteStep(c_, job, step, &in_use));
  if (!complete) return out;
  const std::string dir = c_.catalog_.CheckpointDir(job, *complete);
  RETURN_IF_ERROR(ReadRestoreExtra(dir, job, rank_id, *complete, c_.RootIo(), &out.extra));
  out.disk_step = *complete;
  return out;
}

Result<Restorer::LoadingSlot> Restorer::AcquireLoadingSlot(const std::string& session_id, std::optional<int64_t> step,
                                                       bool need_ema, std::chrono::steady_clock::time_point deadline,
                                                       std::chrono::milliseconds timeout, const char* purpose) {
  std::shared_ptr<RankSegment> segment;
  {
    MutexLock lock(&c_.mu_);
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    if (need_ema && !rank->segment->ema) {
      return FailedPrecondition(
          "this rank has no EMA: the job registered without ema_decay, or all its "
          "weights are replicas persisted by another rank");
    }
    segment = rank->segment;
  }
  // The snapshots committed so far reach the EMA first: what the slot gets is as of the last commit.
  uint32_t queued = 0;
  if (segment->ema && !c_.ema_stage_->WaitDrained(segment.get(), deadline, &queued)) {
    return DeadlineExceeded(std::to_string(queued) + " committed snapshot(s) of this rank did not reach its EMA within " +
                            std::to_string(timeout.count()) + " ms");
  }
  segment.reset();  // not released under c_.mu_
  MutexLock lock(&c_.mu_);
  for (;;) {
    ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
    if (auto t = c_.Slots(*rank->segment).Acquire(SlotState::kRestoring, step.value_or(rank->last_committed))) {
      LoadingSlot slot{rank->segment, *t};
      c_.Slots(*slot.segment).SetLoading(t->slot, true);
      c_.Mirror(*slot.segment, t->slot);
      return slot;
    }
    if (!c_.clock_.WaitUntil(&c_.cv_, &lock, deadline)) {
      return DeadlineExceeded(std::string("no slot became free for ") + purpose + " within " +
                              std::to_string(timeout.count()) + " ms");
    }
  }
}

Status Restorer::FinishLoadingSlotLocked(Core& c_, const std::string& session_id, const LoadingSlot& slot, const Status& failure) {
  RankSegment& segment = *slot.segment;
  c_.Slots(segment).SetLoading(slot.ticket.slot, false);
  auto live = c_.sessions_.find(session_id);
  bool alive = live != c_.sessions_.end() && c_.jobs_[live->second.job].ranks[live->second.rank].session_id == session_id;
  if (failure.ok() && alive) {
    c_.Mirror(segment, slot.ticket.slot);
    c_.cv_.NotifyAll();  // a Register waiting for the rank's slots to stop loading
    return Status::OK();
  }
  (void)c_.Slots(segment).Release(slot.ticket, SlotState::kRestoring);  // nobody will read it
  c_.Mirror(segment, slot.ticket.slot);
  c_.cv_.NotifyAll();
  return failure.ok() ? Cancelled("the session ended while its slot was being filled") : failure;
}

Result<EmaCopy> Restorer::GetEma(const std::string& session_id, std::chrono::milliseconds timeout) {
  auto deadline = c_.clock_.Now() + timeout;
  // The copy is as of the last commit: AcquireLoadingSlot waits for committed snapshots to reach the EMA.
  ASSIGN_OR_RETURN(LoadingSlot loading,
                   AcquireLoadingSlot(session_id, std::nullopt, /*need_ema=*/true, deadline, timeout, "the EMA copy"));
  EmaCopy out;
  out.ticket = loading.ticket;
  const EmaState state = loading.segment->ema->CopyAverage(loading.segment->SlotEmaBase(loading.ticket.slot));
  out.initialized = state.initialized;
  out.step = state.last_step;
  MutexLock lock(&c_.mu_);
  RETURN_IF_ERROR(FinishLoadingSlotLocked(c_, session_id, loading, Status::OK()));
  return out;
}

Status Restorer::ReleaseSlot(const std::string& session_id, const SlotTicket& ticket, const std::string& corrupt) {
  MutexLock lock(&c_.mu_);
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, true));
  RETURN_IF_ERROR(c_.Slots(*rank->segment).Release(ticket, SlotState::kRestoring));
  c_.Mirror(*rank->segment, ticket.slot);
  c_.cv_.NotifyAll();
  std::optional<RankState::ClientVerified> handed;
  if (rank->client_verifying && rank->client_verifying->ticket.slot == ticket.slot &&
      rank->client_verifying->ticket.generation == ticket.generation) {
    handed = rank->client_verifying;
    rank->client_verifying.reset();
  }
  const std::string& job = c_.sessions_[session_id].job;
  const uint32_t rank_id = c_.sessions_[session_id].rank;
  if (!handed) {
    if (!corrupt.empty()) {
      Logger("restore")->warn("ignored a checksum mismatch reported for slot {} of job={} rank={}: no memory "
                              "checkpoint was handed over in it for the client to verify; report=\"{}\"",
                              ticket.slot, job, rank_id, corrupt);
    }
    return Status::OK();
  }
  if (corrupt.empty()) {
    MemoryTier::RestoredLocked(c_, job, rank_id, *rank, handed->step);  // every chunk checked: restored
    return Status::OK();
  }
  // The client found a chunk that does not match: the same as when the daemon's own verification
  // fails, and the restore never happened. (The checkpoint stays with its slot through Release.)
  const Status found = Corruption(corrupt + " (found by the client while copying)");
  MemoryTier::MemoryFailedLocked(c_, *rank->segment, job, rank_id, handed->step, found, "restoring from disk");
  if (handed->planned) {
    (void)PlanLostLocked(c_, job, handed->step, StatusCode::kCorruption,
                         "failed its checksums (" + found.ToString() + ")");
  }
  return Status::OK();
}

}  // namespace flashckpt
