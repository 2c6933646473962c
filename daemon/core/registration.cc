// A rank's registration (daemon/core/registration.h): its bytes against --max-rank-bytes, its layout
// checked against the job's (the layout hold of a job that changed its layout), its segment made or
// reused off the lock and recorded in the state directory, and Register itself, the one place a
// rank's registration is decided.

#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/image.h"
#include "daemon/core/lineage.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/registrar.h"
#include "daemon/core/registration.h"
#include "daemon/core/texts.h"

namespace flashckpt {
namespace {

bool SameLayout(const RankLayout& a, const RankLayout& b) {
  if (a.slot_bytes != b.slot_bytes || a.files.size() != b.files.size() || a.tensors.size() != b.tensors.size()) {
    return false;
  }
  for (size_t i = 0; i < a.files.size(); ++i) {
    if (a.files[i].header != b.files[i].header || a.files[i].slot_offset != b.files[i].slot_offset) return false;
  }
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].name != b.tensors[i].name || a.placements[i].slot_offset != b.placements[i].slot_offset ||
        a.placements[i].bytes != b.placements[i].bytes || a.tensors[i].replica != b.tensors[i].replica) {
      return false;
    }
  }
  return true;
}

uint64_t PageAlign(uint64_t v) { return (v + kPageSize - 1) / kPageSize * kPageSize; }

// The EMA image header embeds the EMA configuration: equal headers mean the same EMA.
bool SameEma(const RankEma* current, const std::optional<EmaPlan>& wanted) {
  if (current == nullptr || !wanted) return current == nullptr && !wanted;
  return current->plan().layout.files[0].header == wanted->layout.files[0].header;
}

bool SameDegrees(const Topology& a, const Topology& b) {
  return a.world_size == b.world_size && a.tp_degree == b.tp_degree && a.pp_degree == b.pp_degree &&
         a.shard_degree == b.shard_degree;
}

std::string LayoutText(const Topology& t) {
  return "world size " + std::to_string(t.world_size) + " (tp " + std::to_string(t.tp_degree) + ", pp " +
         std::to_string(t.pp_degree) + ", shard " + std::to_string(t.shard_degree) + ")";
}

// What a session that has not restored is told when it may not save in the job's new layout.
Status LayoutHeld(const std::string& job, int64_t step, const Topology& before, const Topology& now,
                  const std::string& state) {
  return FailedPrecondition(
      "job '" + job + "' changed its layout to " + LayoutText(now) + " while checkpoint-" + std::to_string(step) +
      " of its previous layout, " + LayoutText(before) + ", " + state +
      "; a rank of the new layout saves only after it restores a checkpoint (Client::Restore, restore(): "
      "resharding it), or once checkpoint-" + std::to_string(step) + " is complete or deleted (`flashckpt delete --job " +
      job + " --step " + std::to_string(step) + " --force`)");
}

// What Register answers: the rank's segment and where each tensor (and EMA tensor) lies in a slot.
RegisterReply ReplyOf(const RankSegment& seg, uint32_t slot_count, const std::string& run_id) {
  RegisterReply reply;
  reply.run_id = run_id;
  reply.segment_name = seg.shm->name();
  reply.segment_bytes = seg.shm->size();
  reply.slot_count = slot_count;
  reply.slot_offset = kSegmentHeaderBytes;
  reply.slot_stride = seg.slot_stride;
  for (size_t i = 0; i < seg.layout.tensors.size(); ++i) {
    TensorLocation& p = reply.placements.emplace_back();
    p.name = seg.layout.tensors[i].name;
    int f = seg.layout.placements[i].file;
    p.file = f < 0 ? "" : seg.layout.files[static_cast<size_t>(f)].stem;
    p.slot_offset = seg.layout.placements[i].slot_offset;
    p.bytes = seg.layout.placements[i].bytes;
    p.kind = seg.layout.tensors[i].kind;
    if (seg.ema) {
      const auto& sources = seg.ema->plan().source;
      p.ema_source = std::find(sources.begin(), sources.end(), i) != sources.end();
    }
  }
  if (seg.ema) {
    const RankLayout& el = seg.ema->plan().layout;
    for (size_t i = 0; i < el.tensors.size(); ++i) {
      TensorLocation& p = reply.ema_placements.emplace_back();
      p.name = el.tensors[i].name;
      p.file = el.files[0].stem;
      p.slot_offset = seg.ema_area - el.files[0].slot_offset + el.placements[i].slot_offset;
      p.bytes = el.placements[i].bytes;
    }
  }
  return reply;
}

// Why a registration is refused when a live rank of the job holds another run or another layout.
Status ConflictRefusal(const std::string& job, uint32_t rank, const Registration& reg, const std::string& wanted,
                       uint32_t conflict_rank, const RankState& conflict, const std::string& conflict_run) {
  const Topology& topology = reg.topology;
  if (!conflict.registered || SameDegrees(conflict.topology, topology)) {
    return FailedPrecondition("registration of job '" + job + "' rank " + std::to_string(rank) +
                              " refused: the job is running as run " + conflict_run + " (live rank " +
                              std::to_string(conflict_rank) + "); this rank " +
                              (reg.run_id.empty() ? "joined run " + wanted + " (a new launch, agreed "
                                                    "through the root)"
                                                  : "asks for run " + wanted) +
                              ": two runs of one job cannot save at once; the ranks of a job share one run id "
                              "(or leave it empty to join the live run)");
  }
  return FailedPrecondition(
      "job '" + job + "' is registered with world size " + std::to_string(conflict.topology.world_size) + " (tp " +
      std::to_string(conflict.topology.tp_degree) + ", pp " + std::to_string(conflict.topology.pp_degree) +
      ", shard " + std::to_string(conflict.topology.shard_degree) + ") by live rank " +
      std::to_string(conflict_rank) + "; this rank asks for world size " + std::to_string(topology.world_size) +
      " (tp " + std::to_string(topology.tp_degree) + ", pp " + std::to_string(topology.pp_degree) + ", shard " +
      std::to_string(topology.shard_degree) + ")");
}

// What a registration sets in the rank's record once its run (rank->run_id) is chosen: `agreed_*`,
// the launch it joined through the root, if it asked.
void ApplyRegistration(const Registration& reg, const std::string& agreed_run, uint64_t agreed_launch,
                       const Status& agreed_error, RankState* rank) {
  rank->pending_run.clear();
  rank->run_agreed = reg.run_id.empty() && !agreed_run.empty() && rank->run_id == agreed_run;
  if (rank->run_agreed) rank->agreed_launch = agreed_launch;
  if (!agreed_error.ok() && !rank->run_agreed) rank->run_unagreed = agreed_error;
  rank->overwrite = reg.overwrite;
  rank->topology = reg.topology;
  rank->policy = reg.policy;
  if (reg.resumed_from > 0) rank->resumed_from = reg.resumed_from;
  rank->fatal_persist_errors = reg.fatal_persist_errors;
  rank->registered = true;
}

}  // namespace

Status CheckRankBytes(const RankLayout& layout, uint64_t limit) {
  if (limit == 0) return Status::OK();
  uint64_t total = 0;
  for (const Placement& p : layout.placements) {
    // BuildRankLayout bounds each tensor and their sum (kMaxSlotBytes): this cannot overflow.
    total += p.bytes;
  }
  if (total <= limit) return Status::OK();
  return ResourceExhausted("tensors: job '" + layout.job + "' rank " + std::to_string(layout.rank) + " registers " +
                           FormatBytes(total) + " (" + std::to_string(total) + " bytes) in " +
                           std::to_string(layout.tensors.size()) + " tensors, above the per-rank cap of " +
                           FormatBytes(limit) + " (--max-rank-bytes)");
}

Result<std::map<int64_t, Topology>> Registrar::LayoutHoldLocked(const Core& c_, const std::string& name, const RankState& rank) {
  auto jit = c_.jobs_.find(name);
  if (jit == c_.jobs_.end() || jit->second.held_steps.empty() || rank.resumed_from > 0) {
    return std::map<int64_t, Topology>{};
  }
  const JobState& job = jit->second;
  for (const auto& [r, other] : job.ranks) {
    if (!other.segment) continue;
    for (uint32_t i = 0; i < c_.Slots(*other.segment).size(); ++i) {
      const SlotInfo& slot = c_.Slots(*other.segment).at(i);
      auto held = job.held_steps.find(slot.step);
      if (held != job.held_steps.end() &&
          (slot.state == SlotState::kCommitted || slot.state == SlotState::kPersisting)) {
        return LayoutHeld(name, slot.step, held->second, rank.topology, "is still being written by this daemon");
      }
    }
  }
  return job.held_steps;
}

Status Registrar::CheckLayoutHold(const std::string& job, const Topology& now, const std::map<int64_t, Topology>& held) {
  std::vector<int64_t> done;
  for (const auto& [step, before] : held) {
    ASSIGN_OR_RETURN(bool exists, Exists(c_.catalog_.CheckpointDir(job, step), c_.RootIo()));
    ASSIGN_OR_RETURN(bool complete, c_.catalog_.IsComplete(job, step));
    if (exists && !complete) {
      return LayoutHeld(job, step, before, now, "is incomplete (its directory has no metadata.json)");
    }
    done.push_back(step);
  }
  MutexLock lock(&c_.mu_);
  if (auto jit = c_.jobs_.find(job); jit != c_.jobs_.end()) {
    for (int64_t step : done) jit->second.held_steps.erase(step);
  }
  return Status::OK();
}

Result<std::shared_ptr<RankSegment>> Registrar::CreateSegment(const std::string& job, uint32_t rank, RankLayout layout,
                                                           std::optional<EmaPlan> plan, const EmaConfig& config,
                                                           uint32_t slot_count, const std::string& name,
                                                           bool adopt, const std::string& run_id) {
  std::unique_ptr<RankEma> ema;
  if (plan) {
    // A segment under the name of releases before the scope is this daemon's when its predecessor
    // recorded it (the rank's slot segment is adopted, or the EMA was kept for the job) or when
    // its average is of the run this rank registers in.
    const std::string unscoped = UnscopedEmaSegmentName(job, rank);
    const bool recorded = adopt || c_.state_.HasKeptEma(unscoped);
    ASSIGN_OR_RETURN(ema, RankEma::Open(job, rank, c_.ema_scope_, std::move(*plan), config, c_.config_.segment_mode,
                                        recorded, run_id));
    if (ema->upgraded() || recorded) {
      // Renamed, or removed as unfit: the record of the old name goes (the next stop records the
      // scoped one), so that no later release of it unlinks a name that is no longer this daemon's.
      c_.state_.RemoveKeptEma(unscoped);
      MutexLock lock(&c_.mu_);
      c_.kept_emas_.erase(unscoped);
    }
  }
  const uint64_t ema_area = layout.slot_bytes;
  const uint64_t stride = ema_area + (ema ? PageAlign(ema->plan().image_bytes()) : 0);
  uint64_t bytes = SegmentBytes(stride, slot_count);
  std::unique_ptr<SharedSegment> shm;
  bool older_format = false;  // adopted from a daemon that wrote an older file format
  if (adopt) {
    // Mapped lazily, here and below: the daemon touches a slot's pages as it reads or fills them
    // (reads map 16 pages a fault), so neither a registration nor an adoption maps gigabytes first.
    ASSIGN_OR_RETURN(shm, SharedSegment::Open(name, bytes, SharedSegment::Mapping::kLazy));
    auto* header = reinterpret_cast<SegmentHeader*>(shm->data());
    older_format = header->format_version >= static_cast<uint32_t>(kOldestFormatVersion) &&
                   header->format_version < static_cast<uint32_t>(kFormatVersion);
    if (std::memcmp(header->magic, kSegmentMagic, sizeof kSegmentMagic) != 0 ||
        (header->format_version != kFormatVersion && !older_format) || header->slot_count != slot_count ||
        header->slot_bytes != stride ||
        header->segment_bytes != bytes || header->rank != rank ||
        std::string(header->job, strnlen(header->job, sizeof header->job)) != job) {
      return FailedPrecondition("segment " + name + " does not match its registration record");
    }
    if (older_format) header->format_version = kFormatVersion;  // its slot images are rewritten below
    shm->OwnName();
  } else {
    // With --shm-group the trainers of other users in the group map the slots; the EMA segment
    // above stays private (only the daemon maps it).
    const unsigned mode = c_.config_.shm_group ? 0660u : c_.config_.segment_mode;
    ASSIGN_OR_RETURN(shm, SharedSegment::Create(name, bytes, mode, c_.config_.shm_group, SharedSegment::Mapping::kLazy));
    auto* header = reinterpret_cast<SegmentHeader*>(shm->data());
    std::memcpy(header->magic, kSegmentMagic, sizeof kSegmentMagic);
    header->format_version = kFormatVersion;
    header->slot_count = slot_count;
    header->slot_bytes = stride;
    header->segment_bytes = bytes;
    header->rank = rank;
    std::snprintf(header->job, sizeof header->job, "%s", job.c_str());
  }
  auto segment = std::make_shared<RankSegment>(std::move(layout), std::move(shm), slot_count, std::move(ema), stride,
                                               ema_area, &c_.host_memory_used_, &c_.state_);
  if (!adopt) {
    for (uint32_t i = 0; i < slot_count; ++i) {
      InitSlotImages(segment->Slot(i), segment->layout);
      c_.MirrorUnpublished(*segment, i);
    }
  } else if (older_format) {
    // A daemon of an older release left it (an upgrade after a crash): the slots' file headers say
    // that release's format version, whose checksum rule this daemon does not write. The headers
    // are rewritten from this release's templates (the same layout, the same sizes); the trainers'
    // bytes and the committed snapshots are kept, and every checksum is stamped when a slot is written.
    for (uint32_t i = 0; i < slot_count; ++i) InitSlotImages(segment->Slot(i), segment->layout);
    Logger("shm")->warn("segment={} was written by an older release: its slot headers now use format version {}",
                        name, kFormatVersion);
  }
  Logger("shm")->info("{} segment={} bytes={} slots={} slot_bytes={} ema={}", adopt ? "adopted" : "created", name,
                      FormatBytes(bytes), slot_count, FormatBytes(stride), segment->ema != nullptr);
  return segment;
}

Result<std::shared_ptr<RankSegment>> Registrar::CreateRecordedSegment(const std::string& job, uint32_t rank,
                                                                   RankLayout layout, std::optional<EmaPlan> ema_plan,
                                                                   const EmaConfig& ema_config,
                                                                   const Registration& registration,
                                                                   const std::string& run_id) {
  ASSIGN_OR_RETURN(std::string token, RandomToken());
  const std::string name = "flashckpt." + job + "." + std::to_string(rank) + "." + token;
  const uint64_t ema_bytes = ema_plan ? PageAlign(ema_plan->image_bytes()) : 0;
  // What a restarted daemon needs to adopt the segment (daemon/core/recovery.cc). Written before the
  // segment exists: a daemon killed in between leaves a record whose segment is missing or blank,
  // which the next daemon drops (unlinking the segment), never a segment that no record names.
  SegmentRecord record;
  record.job = job;
  record.rank = rank;
  record.segment_name = name;
  record.segment_bytes = SegmentBytes(layout.slot_bytes + ema_bytes, c_.config_.slots);
  record.slot_count = c_.config_.slots;
  record.checksum_chunk = c_.config_.checksum_chunk;
  record.registration = c_.state_.EncodeRegistration(registration);
  if (Status saved = c_.state_.SaveSegment(record); !saved.ok()) {
    return saved.WithContext("saving the segment's record in the state directory");
  }
  auto created = CreateSegment(job, rank, std::move(layout), std::move(ema_plan), ema_config, c_.config_.slots, name,
                               /*adopt=*/false, run_id);
  if (!created.ok()) c_.state_.RemoveSegment(name);
  return created;
}

Result<RankState*> Registrar::WaitSlotsLoadedLocked(Core& c_, const std::string& session_id, MutexLock* lock,
                                                         std::chrono::steady_clock::time_point deadline) {
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, /*need_segment=*/false));
  while (rank->segment && c_.Slots(*rank->segment).AnyLoading()) {
    const bool woken = c_.clock_.WaitUntil(&c_.cv_, lock, deadline);
    ASSIGN_OR_RETURN(rank, c_.RankOf(session_id, /*need_segment=*/false));
    if (!woken) break;  // the segment is then replaced, as it would be anyway
  }
  return rank;
}

Result<Registrar::AgreedRun> Registrar::AgreeRunThroughRoot(const std::string& session_id, const Registration& reg,
                                                     const std::string& drawn_run) {
  AgreedRun agreed;
  if (!reg.run_id.empty()) return agreed;
  bool ask = false;
  std::set<std::string> live_runs;
  std::string job_name;
  uint32_t rank_id = 0;
  {
    MutexLock lock(&c_.mu_);
    ASSIGN_OR_RETURN(const RankState* rank, c_.RankOf(session_id, /*need_segment=*/false));
    job_name = c_.sessions_[session_id].job;
    rank_id = c_.sessions_[session_id].rank;
    ask = rank->run_id.empty() && rank->pending_run.empty() && !Lineage::NamedLiveRunLocked(c_, c_.jobs_[job_name], rank_id);
    for (const auto& [r, other] : c_.jobs_[job_name].ranks) {
      if (r != rank_id && !other.session_id.empty() && other.registered) live_runs.insert(other.run_id);
    }
  }
  if (!ask) return agreed;
  Result<LaunchChoice> joined = c_.launches_.Join(job_name, rank_id, reg.topology.world_size, drawn_run, live_runs);
  if (joined.ok()) {
    agreed.run = joined->run_id;
    agreed.launch = joined->launch;
  } else {
    agreed.error = joined.status();
    Logger("rpc")->error("run not agreed job={} rank={} error=\"{}\": its first snapshot is refused", job_name, rank_id,
                         agreed.error.ToString());
  }
  return agreed;
}

Result<RankState*> Registrar::AwaitNoConflictLocked(Core& c_, const std::string& session_id, const Registration& reg,
                                                 const std::string& wanted, MutexLock* lock) {
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, /*need_segment=*/false));
  const SessionInfo who = c_.sessions_[session_id];
  const auto deadline = c_.clock_.Now() + std::chrono::seconds(5);
  for (;;) {
    const JobState& job = c_.jobs_[who.job];
    const RankState* conflict = nullptr;
    uint32_t conflict_rank = 0;
    std::string conflict_run;
    for (const auto& [r, other] : job.ranks) {
      if (r == who.rank || other.session_id.empty()) continue;
      // A rank still registering (its segment being made) has chosen its run but not its layout yet.
      const std::string& other_run = other.registered ? other.run_id : other.pending_run;
      if (!other.registered && other_run.empty()) continue;
      if ((other.registered && !SameDegrees(other.topology, reg.topology)) ||
          (!wanted.empty() && other_run != wanted)) {
        conflict = &other;
        conflict_rank = r;
        conflict_run = other_run;
        break;
      }
    }
    if (conflict == nullptr) return rank;
    if (!c_.clock_.WaitUntil(&c_.cv_, lock, deadline)) {
      ASSIGN_OR_RETURN(rank, c_.RankOf(session_id, /*need_segment=*/false));  // not stopping: `conflict` is valid
      return ConflictRefusal(who.job, who.rank, reg, wanted, conflict_rank, *conflict, conflict_run);
    }
    ASSIGN_OR_RETURN(rank, c_.RankOf(session_id, /*need_segment=*/false));
  }
}

void Registrar::HoldPreviousLayoutLocked(Core& c_, const std::string& name, JobState* job, uint32_t rank, const Topology& topology) {
  // A checkpoint of the old layout may be in progress: its newest persisted step, and the steps
  // in its slots. Sessions of the new layout that do not restore may not save until it is done
  // (BeginSnapshot): their signals would be counted with the old layout's.
  const int64_t newest = job->newest_persisted;
  for (const auto& [r, other] : job->ranks) {
    if (!other.segment) continue;
    for (uint32_t i = 0; i < c_.Slots(*other.segment).size(); ++i) {
      const SlotInfo& slot = c_.Slots(*other.segment).at(i);
      if (slot.state == SlotState::kFilling || slot.state == SlotState::kCommitted ||
          slot.state == SlotState::kPersisting) {
        job->held_steps.emplace(slot.step, job->topology);
      }
    }
  }
  if (newest >= 0) job->held_steps.emplace(newest, job->topology);
  if (!job->held_steps.empty()) {
    Logger("rpc")->info("layout changed job={} from=\"{}\" to=\"{}\" held_steps={}: ranks that do not restore "
                        "save only once these are complete or deleted",
                        name, LayoutText(job->topology), LayoutText(topology), job->held_steps.size());
  }
  // The job runs in a new layout: segments of its gone ranks from the old one only hold memory.
  for (auto& [r, other] : job->ranks) {
    if (r != rank && other.session_id.empty() && other.segment) {
      // Its memory checkpoints go with it (a running persist keeps the segment, not them): the
      // mirror says so, so that a daemon restarted meanwhile does not adopt them.
      MemoryTier::DropMemoryFrom(c_, *other.segment, std::numeric_limits<int64_t>::min());
      other.segment.reset();
    }
  }
}

Result<Registrar::SegmentReservation> Registrar::ReserveSegmentLocked(Core& c_, const std::string& session_id, const RankLayout& layout,
                                                               const std::optional<EmaPlan>& ema_plan,
                                                               std::shared_ptr<RankSegment>* retired) {
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, /*need_segment=*/false));
  const SessionInfo who = c_.sessions_[session_id];
  const uint64_t ema_bytes = ema_plan ? PageAlign(ema_plan->image_bytes()) : 0;
  const uint64_t need =
      SegmentBytes(layout.slot_bytes + ema_bytes, c_.config_.slots) + (ema_plan ? ema_plan->layout.slot_bytes : 0);
  const uint64_t releasable = rank->segment && rank->segment.use_count() == 1 ? rank->segment->accounted() : 0;
  // Registrations creating their segments right now count with what they will take.
  const uint64_t used = c_.host_memory_used_.load() + c_.registering_bytes_ - releasable;
  if (need > c_.config_.max_host_memory || used + need > c_.config_.max_host_memory) {
    return ResourceExhausted("registration of job '" + who.job + "' rank " + std::to_string(who.rank) + " needs " +
                             FormatBytes(need) + " of host memory (" + std::to_string(c_.config_.slots) + " slots x " +
                             FormatBytes(layout.slot_bytes + ema_bytes) + (ema_plan ? " + EMA" : "") +
                             "), budget is " + FormatBytes(c_.config_.max_host_memory) + " with " + FormatBytes(used) +
                             " in use (--max-host-memory)" + DisconnectedText(c_.DisconnectedBytesLocked()) +
                             ReplicaText(c_.replica_memory_used_.load()));
  }
  // The old segment goes now (the writer keeps it alive if a persist is still running); the new
  // one is created without c_.mu_: allocating and populating gigabytes must not hold up the other
  // ranks' snapshots, status or the watchdog. Its bytes are reserved meanwhile.
  if (rank->segment) MemoryTier::DropMemoryFrom(c_, *rank->segment, std::numeric_limits<int64_t>::min());  // as above
  *retired = std::move(rank->segment);
  c_.registering_bytes_ += need;
  return SegmentReservation{need, ++rank->registrations};
}

Result<RankState*> Registrar::PublishSegmentLocked(Core& c_, const std::string& session_id, const SegmentReservation& reserved,
                                                Result<std::shared_ptr<RankSegment>> made,
                                                std::shared_ptr<RankSegment>* created) {
  c_.registering_bytes_ -= reserved.bytes;
  if (!made.ok()) return made.status();
  *created = std::move(made).value();
  // The session may have ended, or registered again, while the segment was made: then it is not
  // this call's to publish (it is released, with its records, after c_.mu_).
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, /*need_segment=*/false));
  if (rank->registrations != reserved.generation || rank->segment) {
    const SessionInfo who = c_.sessions_[session_id];
    return FailedPrecondition("registration of job '" + who.job + "' rank " + std::to_string(who.rank) +
                              " was overtaken by another registration of the rank; register again");
  }
  rank->segment = std::move(*created);
  return rank;
}

Status Registrar::StartEmaRun(const std::shared_ptr<RankSegment>& segment, const std::string& job, uint32_t rank,
                           const std::string& run_id) {
  // The EMA continues only its own run's average (one adopted by job name may be another run's).
  // Another run's snapshots still queued for it (a predecessor's commits, a restarted daemon's
  // replays) are applied first, so that none of them lands in the new average; the check and the
  // reset take the EMA's lock, not c_.mu_, as an update in progress holds it; the wait is the EMA
  // stage's.
  if (!segment->ema) return Status::OK();
  uint32_t pending = 0;
  if (segment->ema->run_id() != run_id &&
      !c_.ema_stage_->WaitDrained(segment.get(), c_.clock_.Now() + std::chrono::seconds(30), &pending)) {
    return Unavailable("registration of job '" + job + "' rank " + std::to_string(rank) + ": " +
                       std::to_string(pending) + " snapshot(s) of the previous run are still on their way to its "
                       "EMA after 30 s; register again");
  }
  if (segment->ema->StartRun(run_id)) {
    Logger("ema")->info("fresh EMA job={} rank={} run={}: the average in its segment was another run's", job, rank,
                        run_id);
  }
  return Status::OK();
}

Result<RegisterReply> Registrar::Register(const std::string& session_id, const Registration& reg) {
  const Topology& topology = reg.topology;
  // Segments leave the daemon only after c_.mu_ is released (declared before the lock, destroyed
  // after it): a segment's destructor removes its records and unlinks its memory.
  std::shared_ptr<RankSegment> retired, created;
  ASSIGN_OR_RETURN(const std::string drawn_run, RandomToken());  // the run, if this one starts it
  // A rank that names no run, of a job whose live ranks here named none either, joins its launch
  // through the root (file I/O: before c_.mu_), so that the ranks of one launch on every daemon of the
  // root share a run, and a new launch is a new run.
  ASSIGN_OR_RETURN(const AgreedRun agreed, AgreeRunThroughRoot(session_id, reg, drawn_run));
  MutexLock lock(&c_.mu_);
  ASSIGN_OR_RETURN(RankState * rank, c_.RankOf(session_id, /*need_segment=*/false));
  const SessionInfo who = c_.sessions_[session_id];
  RETURN_IF_ERROR(c_.lineage->CheckRunKept(*rank, reg));
  LayoutExtras extras;
  extras.checksum_chunk = c_.config_.checksum_chunk;
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(who.job, who.rank, topology, reg.tensors, extras));
  RETURN_IF_ERROR(CheckRankBytes(layout, c_.config_.max_rank_bytes));
  std::optional<EmaPlan> ema_plan;
  if (reg.ema.enabled) {
    ASSIGN_OR_RETURN(EmaPlan plan, PlanEma(layout, reg.ema));
    if (!plan.layout.files.empty()) ema_plan = std::move(plan);
  }
  // Memory checkpoints the rank cannot have whatever segment it ends up with are refused before
  // anything of the job changes (the exact check, with the segment it will use, is below).
  if (reg.memory_checkpoints) {
    const uint32_t most = std::max(c_.config_.slots, rank->segment ? c_.Slots(*rank->segment).size() : 0u);
    RETURN_IF_ERROR(MemoryCheckpointsFit(who, most, /*warn=*/false));
  }
  // A slot the daemon is reading (another rank's restore verifying this rank's memory checkpoint
  // for the job's plan, or a restore of a trainer that is gone) is busy for a moment: wait for it
  // (10 s at most, then the segment is replaced as it would be anyway), rather than give the
  // segment, and the memory checkpoints in it, up. Before the conflict wait, whose deadline is short.
  const auto loading_deadline = c_.clock_.Now() + std::chrono::seconds(10);
  RETURN_IF_ERROR(WaitSlotsLoadedLocked(c_, session_id, &lock, loading_deadline).status());
  // Every live rank of a job shares one layout, and one run when the request names it. Ranks of a
  // previous run that are exiting may still hold their sessions for a moment: wait a little for them.
  const std::string& wanted = reg.run_id.empty() ? agreed.run : reg.run_id;  // a run this rank must have
  ASSIGN_OR_RETURN(rank, AwaitNoConflictLocked(c_, session_id, reg, wanted, &lock));
  // The run is chosen now, in the hold of c_.mu_ that found no conflict: ranks registering from here on
  // join it (or, naming another, meet it as a conflict) while this one waits and makes its segment.
  rank->pending_run = Lineage::ChooseRunLocked(c_, c_.jobs_[who.job], who.rank, *rank, reg, agreed.run, drawn_run);
  rank->run_agreed = reg.run_id.empty() && !agreed.run.empty() && rank->pending_run == agreed.run;
  // Again: the conflict wait let the lock go, and a resume plan may have pinned a slot meanwhile.
  ASSIGN_OR_RETURN(rank, WaitSlotsLoadedLocked(c_, session_id, &lock, loading_deadline));
  JobState* job = &c_.jobs_[who.job];
  if (!SameDegrees(job->topology, topology)) HoldPreviousLayoutLocked(c_, who.job, job, who.rank, topology);
  const bool reuse = rank->segment && SameLayout(rank->segment->layout, layout) &&
                     SameEma(rank->segment->ema.get(), ema_plan) &&
                     c_.Slots(*rank->segment).CountIn(SlotState::kFilling) == 0 &&
                     c_.Slots(*rank->segment).CountIn(SlotState::kRestoring) == 0;
  if (reg.memory_checkpoints) {
    // The slots of the segment the rank will use: a reused one (adopted after a restart, perhaps
    // under another --slots) keeps its count.
    const uint32_t slots = reuse ? c_.Slots(*rank->segment).size() : c_.config_.slots;
    RETURN_IF_ERROR(MemoryCheckpointsFit(who, slots, /*warn=*/true));
  }
  if (!reuse) {
    const std::string run_id = Lineage::ChooseRunLocked(c_, *job, who.rank, *rank, reg, agreed.run, drawn_run);  // and again below
    ASSIGN_OR_RETURN(const SegmentReservation reserved, ReserveSegmentLocked(c_, session_id, layout, ema_plan, &retired));
    lock.Unlock();
    retired.reset();
    auto made = CreateRecordedSegment(who.job, who.rank, std::move(layout), std::move(ema_plan), reg.ema, reg, run_id);
    lock.Lock();
    ASSIGN_OR_RETURN(rank, PublishSegmentLocked(c_, session_id, reserved, std::move(made), &created));
    job = &c_.jobs_[who.job];
  }
  rank->run_id = Lineage::ChooseRunLocked(c_, *job, who.rank, *rank, reg, agreed.run, drawn_run);
  ApplyRegistration(reg, agreed.run, agreed.launch, agreed.error, rank);
  rank->memory_checkpoints = reg.memory_checkpoints && c_.memory->DiskSnapshotsHoldEverything(*rank->segment);
  rank->declares_memory_checkpoints = reg.memory_checkpoints;
  job->topology = topology;
  const RankSegment& seg = *rank->segment;
  RegisterReply reply = ReplyOf(seg, c_.Slots(seg).size(), rank->run_id);
  Logger("rpc")->info("registered job={} rank={} run={} resumed_from={} tensors={} slot_bytes={} ema_tensors={} "
                      "reused={}",
                      who.job, who.rank, rank->run_id, rank->resumed_from, seg.layout.tensors.size(),
                      FormatBytes(seg.slot_stride), seg.ema ? seg.ema->plan().layout.tensors.size() : 0, reuse);
  std::shared_ptr<RankSegment> segment = rank->segment;
  lock.Unlock();
  RETURN_IF_ERROR(StartEmaRun(segment, who.job, who.rank, reply.run_id));
  return reply;
}

Status Registrar::MemoryCheckpointsFit(const SessionInfo& who, uint32_t slots, bool warn) const {
  if (Status fits = c_.memory->MemoryTierFits(slots); !fits.ok()) {
    return FailedPrecondition("registration of job '" + who.job + "' rank " + std::to_string(who.rank) +
                              " with memory checkpoints: " + fits.message());
  }
  if (warn && slots == 2) {
    Logger("rpc")->warn("job={} rank={} takes memory checkpoints with 2 slots: while a disk snapshot of the rank "
                        "is written, its next snapshot waits for it (--slots 3 lets memory checkpoints go on)",
                        who.job, who.rank);
  }
  return Status::OK();
}

}  // namespace flashckpt
