// Restore from a peer's replica (flashckptd --replicate-to): a rank whose memory checkpoints died
// with its node gets its newest one back from the peers it replicates to, the same peers the rank's
// old node replicated to when the replacement node is configured like the node it replaces.
//
// The replica is fetched into a free slot of the rank, checked, and kept there as one of the rank's
// memory checkpoints (marked as fetched from the peer), so everything after it is the memory path:
// the candidates a job agrees on, the resume plan, the verification and hand-over of Restore.
#include <algorithm>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/format/slot_checksums.h"
#include "daemon/core/memory_tier.h"
#include "daemon/replica/replica_layout.h"
#include "daemon/parity/parity_rebuild.h"
#include "daemon/parity/parity_sender.h"
#include "daemon/replica/replica_sender.h"

namespace flashckpt {
namespace {

// How long the look at the peers (List) may take: a peer that is down must not hold up a restore.
constexpr std::chrono::seconds kPeerListTimeout{5};

// gRPC's deadline (the system clock) for a deadline of `clock`.
std::chrono::system_clock::time_point SystemDeadline(const Clock& clock, std::chrono::steady_clock::time_point deadline) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - clock.Now());
}

// What a replica carries besides its bytes, checked against the rank: the chunk checksums of its
// tensors and, for a rank with EMA, the EMA of its step (its counters, its image's checksums).
struct ReplicaChecks {
  SlotChecksums sums;
  std::optional<EmaState> ema;
  SlotChecksums ema_sums;
};

// The bytes a replica of the segment's rank holds: its slot from kSlotImageOffset and, with EMA, the
// EMA image in the slot's EMA room, which follows the slot's tensors.
uint64_t ReplicaBytes(const RankSegment& segment) {
  return segment.layout.slot_bytes - kSlotImageOffset + (segment.ema ? segment.ema->plan().image_bytes() : 0);
}

// A replica's EMA (`where.ema`), checked against the rank's (`checks`: filled in): FAILED_PRECONDITION
// when one of them has none or they differ in layout or options, CORRUPTION when it does not hold
// together.
Status CheckReplicaEma(const ReplicaMeta& meta, const ReplicaLayout& where, const RankSegment& segment,
                       ReplicaChecks* checks) {
  if (where.ema.has_value() != (segment.ema != nullptr)) {
    return FailedPrecondition(segment.ema ? "it carries no EMA, and this rank has EMA tensors"
                                          : "it carries an EMA, and this rank has none");
  }
  if (!segment.ema) return Status::OK();
  const ReplicaLayout::Ema& e = *where.ema;
  if (e.image_offset != segment.ema_area || segment.ema_area != segment.layout.slot_bytes ||
      e.image_bytes != segment.ema->plan().image_bytes() || e.layout_fingerprint != segment.ema_fingerprint) {
    return FailedPrecondition("its EMA was taken with other EMA tensors or options than this rank's");
  }
  if (e.last_seen > meta.step || e.last_step > e.last_seen) {
    return Corruption("its EMA's counters (last step " + std::to_string(e.last_step) + ", last seen " +
                      std::to_string(e.last_seen) + ") do not fit its step " + std::to_string(meta.step));
  }
  RETURN_IF_ERROR(CheckSlotChecksumsFit(segment.ema->plan().layout, e.sums));
  checks->ema = EmaState{e.initialized, e.updates_applied, e.updates_skipped, e.last_step, e.last_seen};
  checks->ema_sums = e.sums;
  return Status::OK();
}

// The replica's own description of where its tensors lie, checked against the rank's layout, with
// its chunk checksums and its EMA (CheckReplicaEma). FAILED_PRECONDITION when the layouts differ
// (the job was reshaped: the files serve it), CORRUPTION when the description does not hold together.
Result<ReplicaChecks> ReplicaSums(const ReplicaMeta& meta, const RankSegment& segment) {
  const RankLayout& layout = segment.layout;
  ASSIGN_OR_RETURN(const ReplicaLayout where, DecodeReplicaLayout(meta.layout));
  // The lineage was checked on the header; the memory checkpoint is kept as the layout's attempt.
  if (where.run_id != meta.run_id || where.resumed_from != meta.resumed_from) {
    return Corruption("its header names run '" + meta.run_id + "' resumed from step " +
                      std::to_string(meta.resumed_from) + ", its layout run '" + where.run_id + "' resumed from step " +
                      std::to_string(where.resumed_from));
  }
  if (where.layout_fingerprint != segment.layout_fingerprint) {
    return FailedPrecondition("it was taken in another layout (its tensors, their shapes or places, or the "
                              "parallel layout differ from this rank's)");
  }
  ReplicaChecks checks;
  RETURN_IF_ERROR(CheckReplicaEma(meta, where, segment, &checks));
  if (where.image_offset != kSlotImageOffset || meta.bytes != ReplicaBytes(segment)) {
    return FailedPrecondition("it has " + std::to_string(meta.bytes) + " bytes from slot offset " +
                              std::to_string(where.image_offset) + ", this rank's replicas " +
                              std::to_string(ReplicaBytes(segment)) + " from " + std::to_string(kSlotImageOffset));
  }
  if (where.tensors.size() != layout.tensors.size()) {
    return FailedPrecondition("it holds " + std::to_string(where.tensors.size()) + " tensors, this rank " +
                              std::to_string(layout.tensors.size()));
  }
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const ReplicaLayout::Tensor& t = where.tensors[i];
    if (t.name != layout.tensors[i].name || t.slot_offset != layout.placements[i].slot_offset ||
        t.bytes != layout.placements[i].bytes) {
      return FailedPrecondition("its tensor " + std::to_string(i) + " is '" + t.name + "' (" +
                                std::to_string(t.bytes) + " bytes at " + std::to_string(t.slot_offset) +
                                "), this rank's '" + layout.tensors[i].name + "' (" +
                                std::to_string(layout.placements[i].bytes) + " bytes at " +
                                std::to_string(layout.placements[i].slot_offset) + ")");
    }
  }
  RETURN_IF_ERROR(CheckSlotChecksumsFit(layout, where.sums));
  checks.sums = where.sums;
  return checks;
}

// What the rank holds here, for FetchPeerReplica: its segment (null: none to fetch into), its newest
// memory step, whether it holds the step asked for, and the runs of its memory checkpoints.
struct RankHere {
  std::shared_ptr<RankSegment> segment;
  uint32_t world_size = 0;
  int64_t newest = 0;
  bool has_wanted = false;
  std::set<std::string> runs;
};

RankHere LookAtRank(Core& c_, const std::string& job, uint32_t rank_id, int64_t wanted) EXCLUDES(c_.mu_) {
  RankHere here;
  MutexLock lock(&c_.mu_);
  auto jit = c_.jobs_.find(job);
  if (jit == c_.jobs_.end()) return here;
  auto rit = jit->second.ranks.find(rank_id);
  if (rit == jit->second.ranks.end() || !rit->second.segment) return here;
  const std::shared_ptr<RankSegment>& segment = rit->second.segment;
  here.world_size = rit->second.topology.world_size;
  const std::vector<int64_t> held = c_.Slots(*segment).ResidentSteps();
  if (!held.empty()) here.newest = held.front();
  here.has_wanted = std::find(held.begin(), held.end(), wanted) != held.end();
  for (const auto& p : c_.MemoryPending(*segment)) {
    if (p.resident->dropped.load()) continue;  // its copies never finished
    here.newest = std::max(here.newest, p.resident->step);
    here.has_wanted = here.has_wanted || p.resident->step == wanted;
    here.runs.insert(p.resident->attempt.run_id);
  }
  for (uint32_t i = 0; i < c_.Slots(*segment).size(); ++i) {
    if (auto r = c_.Slots(*segment).ResidentIn(i)) here.runs.insert(r->attempt.run_id);
  }
  here.segment = segment;
  return here;
}

// Adds the run and step of the job's newest complete checkpoint on disk to `lineage` (read from
// the root, without the lock).
void AddDiskLineage(Core& c_, const std::string& job, uint32_t rank_id, MemoryTier::HeldLineage* lineage) {
  auto latest = c_.catalog_.LatestRun(job);
  if (latest.ok() && !*latest) latest = c_.catalog_.NewestComplete(job, "");
  if (!latest.ok()) {
    // The files may be what failed: the memory checkpoints' runs alone say the lineage then.
    Logger("restore")->warn("replicas of job={} rank={}: the job's checkpoints here cannot be read ({}); the "
                            "lineage is taken from the memory checkpoints alone",
                            job, rank_id, latest.status().ToString());
  } else if (*latest) {
    lineage->disk_step = (*latest)->step;
    lineage->disk_run = (*latest)->run_id;
    if (!(*latest)->run_id.empty()) lineage->runs.insert((*latest)->run_id);  // else written before run ids
  }
}

// A replica a peer listed.
struct ListedReplica {
  const ReplicaSender::PeerChannel* peer = nullptr;
  ReplicaMeta meta;
};

// The newest replica of the rank among the peers (the later attempt, then the later step), or of
// the step asked for (of the later attempt); one that does not continue `lineage` is logged with a
// MEMORY_FALLBACK event. `*highest_attempt`: of the rank's replicas on the peers, any step.
ListedReplica ChooseReplica(Core& c_, const std::string& job, uint32_t rank_id, uint32_t world_size, int64_t wanted,
                            const MemoryTier::HeldLineage& lineage, std::chrono::steady_clock::time_point deadline,
                            uint64_t* highest_attempt) {
  ListedReplica best;
  const auto list_by = std::min(deadline, c_.clock_.Now() + kPeerListTimeout);
  for (const ReplicaSender::PeerChannel& peer : c_.sender_->channels()) {
    auto listed = ListReplicas(peer.channel.get(), job, SystemDeadline(c_.clock_, list_by));
    if (!listed.ok()) {
      Logger("restore")->warn("replica peer={} not asked job={} rank={}: {}", peer.target, job, rank_id,
                              listed.status().ToString());
      continue;
    }
    for (ReplicaMeta& m : *listed) {
      if (m.rank != rank_id || m.world_size != world_size) continue;
      if (Status continues = c_.memory->ContinuesLineage(job, m, lineage); !continues.ok()) {
        const std::string why = "replica of job=" + job + " rank=" + std::to_string(rank_id) + " step=" +
                                std::to_string(m.step) + " on peer=" + peer.target + " origin=" + m.origin_node +
                                " not used: " + continues.message();
        Logger("restore")->warn("{}", why);
        DaemonEvent event;
        event.kind = DaemonEvent::Kind::kMemoryFallback;
        event.job = job;
        event.rank = rank_id;
        event.step = m.step;
        event.reason = why;
        c_.Emit(std::move(event));
        continue;
      }
      *highest_attempt = std::max(*highest_attempt, m.attempt);
      if (wanted > 0 && m.step != wanted) continue;
      if (best.peer == nullptr || std::make_pair(m.attempt, m.step) > std::make_pair(best.meta.attempt, best.meta.step)) {
        best = ListedReplica{&peer, std::move(m)};
      }
    }
  }
  return best;
}

// The rank's next attempt number goes above what its peers hold (a step asked for by number that
// is here too: the restore renumbers the attempt all the same).
void RaiseAttemptFloor(Core& c_, const std::string& job, uint32_t rank_id, uint64_t highest_attempt)
    EXCLUDES(c_.mu_) {
  MutexLock lock(&c_.mu_);
  auto jit = c_.jobs_.find(job);
  if (jit == c_.jobs_.end()) return;
  auto rit = jit->second.ranks.find(rank_id);
  if (rit != jit->second.ranks.end()) rit->second.attempt_floor = std::max(rit->second.attempt_floor, highest_attempt);
}

// Where a fetched memory checkpoint came from, for KeepFetched: a peer's replica (its HOST:PORT),
// or the parity group (the members it was rebuilt from).
struct FetchSource {
  std::string where;
  bool parity = false;
};

// The end of a fetch into `ticket` of the segment: the slot is freed when `checked` failed (one
// that fails its checksums also with a MEMORY_FALLBACK event), else it keeps the image as a memory
// checkpoint of the rank. Returns whether it was kept.
bool KeepFetched(Core& c_, const std::string& job, uint32_t rank_id, RankSegment& segment, SlotTicket ticket,
                 const FetchSource& source, const Status& checked, const ReplicaMeta& fetched, ReplicaChecks checks,
                 double secs) EXCLUDES(c_.mu_) {
  const int64_t step = fetched.step;
  const char* what = source.parity ? "parity rebuild" : "replica";
  MutexLock lock(&c_.mu_);
  c_.Slots(segment).SetLoading(ticket.slot, false);
  if (!checked.ok()) {
    (void)c_.Slots(segment).Release(ticket, SlotState::kRestoring);
    c_.Mirror(segment, ticket.slot);
    c_.cv_.NotifyAll();
    if (checked.code() != StatusCode::kCorruption) {
      // Not fetched (the peer went away, too slow, too many members lost) or of another layout.
      Logger("restore")->warn("{} of job={} rank={} step={} from {} not used: {}", what, job, rank_id, step,
                              source.where, checked.ToString());
      if (!source.parity) return false;
    } else {
      Logger("restore")->warn("{} of job={} rank={} step={} from {} refused: {}", what, job, rank_id, step,
                              source.where, checked.ToString());
    }
    DaemonEvent event;
    event.kind = DaemonEvent::Kind::kMemoryFallback;
    event.job = job;
    event.rank = rank_id;
    event.step = step;
    event.reason = std::string(what) + " from " + source.where + ": " + checked.ToString();
    c_.Emit(std::move(event));
    return false;
  }
  Result<ReplicaLayout> where = DecodeReplicaLayout(fetched.layout);  // decoded once already (ReplicaSums)
  if (!where.ok()) return false;
  auto resident = std::make_shared<ResidentCheckpoint>();
  resident->step = step;
  resident->attempt = Attempt{where->run_id, where->resumed_from};
  resident->world_size = fetched.world_size;
  resident->extra = fetched.extra;
  resident->sums = std::move(checks.sums);
  resident->ema = checks.ema;
  resident->ema_sums = std::move(checks.ema_sums);
  resident->from_peer = source.where;
  resident->from_parity = source.parity;
  Status kept = c_.Slots(segment).KeepFetched(ticket, std::move(resident));
  c_.Mirror(segment, ticket.slot);
  c_.cv_.NotifyAll();
  if (!kept.ok()) {
    Logger("restore")->error("{} of job={} rank={} step={} fetched but not kept: {}", what, job, rank_id, step,
                             kept.ToString());
    return false;
  }
  Logger("restore")->info("{} job={} rank={} step={} from={} origin={} bytes={} secs={:.3f}",
                          source.parity ? "parity rebuilt" : "replica fetched", job, rank_id, step, source.where,
                          fetched.origin_node, FormatBytes(fetched.bytes), secs);
  if (source.parity) {
    DaemonEvent event;
    event.kind = DaemonEvent::Kind::kParityRebuilt;
    event.job = job;
    event.rank = rank_id;
    event.step = step;
    event.bytes = fetched.bytes;
    event.seconds = secs;
    event.reason = source.where;
    c_.Emit(std::move(event));
  }
  return true;
}

// A fetched image's tensors (and, with EMA, its EMA image's) against their checksums; the EMA
// image's header is stamped as this daemon's own again.
Status VerifyFetched(Core& c_, RankSegment& segment, uint32_t slot, int64_t step, const ReplicaChecks& checks) {
  ParallelLoop verifiers(c_.config_.restore_threads > 0 ? c_.config_.restore_threads - 1 : 0);
  RETURN_IF_ERROR(VerifySlotChecksums(segment.Slot(slot), segment.layout, checks.sums, &verifiers));
  if (!segment.ema) return Status::OK();
  char* image = segment.SlotEmaBase(slot);
  Status checked = VerifySlotChecksums(image, segment.ema->plan().layout, checks.ema_sums, &verifiers);
  if (!checked.ok()) return checked.WithContext("the EMA image of step " + std::to_string(step));
  segment.ema->StampImage(image, step, *checks.ema, &verifiers);
  return Status::OK();
}

// Fetches replica `best` into a free slot of the rank's segment, checks every chunk against its
// checksum and keeps it (KeepFetched). Takes half the time left to `deadline` at most: the files
// must still be readable in time when the peer is slow.
bool FetchIntoSlot(Core& c_, const std::string& job, uint32_t rank_id, const std::shared_ptr<RankSegment>& segment,
                   const ListedReplica& best, std::chrono::steady_clock::time_point deadline) EXCLUDES(c_.mu_) {
  const int64_t step = best.meta.step;
  std::optional<SlotTicket> ticket;
  {
    MutexLock lock(&c_.mu_);
    ticket = c_.Slots(*segment).Acquire(SlotState::kRestoring, step, SlotTier::kMemory);
    if (!ticket) {
      Logger("restore")->warn("replica of job={} rank={} step={} on peer={} not fetched: no free slot", job, rank_id,
                              step, best.peer->target);
      return false;
    }
    c_.Slots(*segment).SetLoading(ticket->slot, true);
    c_.Mirror(*segment, ticket->slot);
  }
  const auto started = c_.clock_.Now();
  char* into = segment->Slot(ticket->slot) + kSlotImageOffset;
  ReplicaChecks checks;
  const auto fetch_by = c_.clock_.Now() + (deadline - c_.clock_.Now()) / 2;
  auto fetched = FetchReplica(
      best.peer->channel.get(), c_.config_.node_name, job, rank_id, step, ReplicaBytes(*segment),
      [&](const ReplicaMeta& meta) -> Result<char*> {
        // The one listed (and checked against the lineage), not one the peer holds in its place now.
        if (meta.run_id != best.meta.run_id || meta.resumed_from != best.meta.resumed_from ||
            meta.attempt != best.meta.attempt || meta.origin_node != best.meta.origin_node) {
          return FailedPrecondition("the peer's replica changed after it was listed");
        }
        ASSIGN_OR_RETURN(checks, ReplicaSums(meta, *segment));
        return into;
      },
      SystemDeadline(c_.clock_, fetch_by), OriginOf(best.meta));
  Status checked = fetched.status();
  if (checked.ok()) checked = VerifyFetched(c_, *segment, ticket->slot, step, checks);
  const double secs = std::chrono::duration<double>(c_.clock_.Now() - started).count();
  return KeepFetched(c_, job, rank_id, *segment, *ticket, FetchSource{best.peer->target, false}, checked,
                     fetched.ok() ? *fetched : best.meta, std::move(checks), secs);
}

// Rebuilds `candidate` into a free slot of the rank's, checks every chunk and keeps it (KeepFetched,
// which tells of a failure); true when kept. Takes half the time left to `deadline` at most.
bool RebuildCandidate(Core& c_, const std::string& job, uint32_t rank_id, const RankHere& here,
                      const ParityCandidate& candidate, std::chrono::steady_clock::time_point deadline)
    EXCLUDES(c_.mu_) {
  const ParitySender& parity = *c_.parity_;
  const int64_t step = candidate.meta.step;
  std::optional<SlotTicket> ticket;
  {
    MutexLock lock(&c_.mu_);
    ticket = c_.Slots(*here.segment).Acquire(SlotState::kRestoring, step, SlotTier::kMemory);
    if (!ticket) {
      Logger("restore")->warn("parity of job={} rank={} step={} not rebuilt: no free slot", job, rank_id, step);
      return false;
    }
    c_.Slots(*here.segment).SetLoading(ticket->slot, true);
    c_.Mirror(*here.segment, ticket->slot);
  }
  const auto started = c_.clock_.Now();
  std::string members;
  for (const ParityMember& m : parity.members()) members += (members.empty() ? "" : ",") + m.target;
  ReplicaChecks checks;
  Status checked;
  auto sums = ReplicaSums(candidate.meta, *here.segment);
  if (!sums.ok()) {
    checked = sums.status();
  } else {
    checks = std::move(*sums);
    const auto rebuild_by = c_.clock_.Now() + (deadline - c_.clock_.Now()) / 2;
    checked = RebuildFromParity(parity.group(), parity.members(), candidate, parity.self(),
                                here.segment->Slot(ticket->slot) + kSlotImageOffset, SystemDeadline(c_.clock_, rebuild_by));
    // A rebuild is only as good as every piece that went into it: each chunk against the origin's checksums.
    if (checked.ok()) checked = VerifyFetched(c_, *here.segment, ticket->slot, step, checks);
  }
  const double secs = std::chrono::duration<double>(c_.clock_.Now() - started).count();
  return KeepFetched(c_, job, rank_id, *here.segment, *ticket, FetchSource{"parity group " + members, true},
                     checked, candidate.meta, std::move(checks), secs);
}

// With --ec-group: rebuilds the rank's newest memory checkpoint (or `wanted`) that the group holds
// parity of, when it is newer than what is held here (as for a replica), into a free slot of the
// rank's; checks and keeps it as FetchIntoSlot does. Takes half the time left to `deadline` at most.
void RebuildFromGroup(Core& c_, const std::string& job, uint32_t rank_id, const RankHere& here,
                      const MemoryTier::HeldLineage& lineage, std::chrono::steady_clock::time_point deadline,
                      int64_t wanted) EXCLUDES(c_.mu_) {
  if (wanted > 0 && here.has_wanted) return;
  const ParitySender& parity = *c_.parity_;
  const auto list_by = std::min(deadline, c_.clock_.Now() + kPeerListTimeout);
  std::vector<ParityCandidate> candidates;
  auto newest = FindParityCandidate(
      parity.group(), parity.members(), job, parity.self(), rank_id, SystemDeadline(c_.clock_, list_by),
      [&](const ParityMember& member, const Status& why) {
        Logger("restore")->warn("parity member={} not asked job={} rank={}: {}", member.target, job, rank_id,
                                why.ToString());
      },
      &candidates);
  if (!newest.ok()) {
    // Nothing to rebuild from, or only what the members' listings disagree on (it says which).
    Logger("restore")->info("parity of job={} rank={} not rebuilt: {}", job, rank_id, newest.status().message());
    return;
  }
  // The candidates newest first; one whose rebuild fails (a piece gone or failing its checks) gives
  // way to the next, a few at most, within the time the restore leaves.
  constexpr int kMaxRebuildTries = 3;
  int tries = 0;
  for (const ParityCandidate& c : candidates) {
    if (tries == kMaxRebuildTries || c_.clock_.Now() >= deadline) break;
    if (c.meta.world_size != here.world_size) continue;
    if (wanted > 0 ? c.meta.step != wanted : c.meta.step <= here.newest || c.meta.step < lineage.disk_step) continue;
    if (Status continues = c_.memory->ContinuesLineage(job, c.meta, lineage); !continues.ok()) {
      Logger("restore")->warn("parity of job={} rank={} step={} not used: {}", job, rank_id, c.meta.step,
                              continues.message());
      continue;
    }
    ++tries;
    if (RebuildCandidate(c_, job, rank_id, here, c, deadline)) return;
  }
}

// With --replicate-to: fetches the rank's newest replica on the peers (or `wanted`) when it is
// newer than what is held here; true when one was fetched and kept.
bool FetchReplicaOfRank(Core& c_, const std::string& job, uint32_t rank_id, const RankHere& here,
                        const MemoryTier::HeldLineage& lineage, std::chrono::steady_clock::time_point deadline,
                        int64_t wanted) EXCLUDES(c_.mu_) {
  uint64_t highest_attempt = 0;  // of the rank's replicas on the peers, any step
  const ListedReplica best = ChooseReplica(c_, job, rank_id, here.world_size, wanted, lineage, deadline, &highest_attempt);
  if (highest_attempt > 0) RaiseAttemptFloor(c_, job, rank_id, highest_attempt);
  if (best.peer == nullptr ||
      (wanted == 0 ? best.meta.step <= here.newest || best.meta.step < lineage.disk_step : here.has_wanted)) {
    return false;  // a replica never beats a newer step of the lineage held here (the files or memory serve it)
  }
  // A step asked for by number: only of the rank's latest attempt among the peers. An older
  // attempt's copy of the step is of a timeline the job left when it restored an earlier step (a
  // peer that missed the later pushes and the retraction still holds it); the files serve that step.
  if (wanted > 0 && best.meta.attempt != highest_attempt) {
    Logger("restore")->info("replica of job={} rank={} step={} on peer={} not used: its attempt {} is older than "
                            "the rank's latest on the peers ({})",
                            job, rank_id, wanted, best.peer->target, best.meta.attempt, highest_attempt);
    return false;
  }
  return FetchIntoSlot(c_, job, rank_id, here.segment, best, deadline);
}

}  // namespace

Status MemoryTier::ContinuesLineage(const std::string& job, const ReplicaMeta& m, const HeldLineage& lineage) {
  // What the peer listed is untrusted: a run id and step as everywhere else.
  if ((!m.run_id.empty() && !ValidateRunId(m.run_id).ok()) || m.resumed_from < 0 || m.resumed_from > kMaxStep) {
    return FailedPrecondition("its run id or restored step is malformed");
  }
  if (lineage.runs.empty()) return Status::OK();  // nothing here to continue: no checkpoint on disk or in memory
  const Attempt attempt{m.run_id, m.resumed_from};
  if (m.run_id.empty()) return FailedPrecondition("it does not say which run took it (a peer of an older release)");
  if (lineage.runs.count(m.run_id) != 0) return Status::OK();
  // A later attempt that restored a checkpoint of this job: a complete one here (a relaunch under a
  // new run id), or one at or past the newest complete one here (restored from memory or a peer).
  if (m.resumed_from > 0) {
    if (m.resumed_from >= lineage.disk_step && lineage.disk_step > 0) return Status::OK();
    auto complete = c_.catalog_.IsComplete(job, m.resumed_from);
    if (complete.ok() && *complete) return Status::OK();
  }
  std::string here;
  if (!lineage.disk_run.empty()) {
    here = "run " + lineage.disk_run + ", step " + std::to_string(lineage.disk_step) + " on disk";
  }
  for (const std::string& run : lineage.runs) {
    if (run != lineage.disk_run) here += std::string(here.empty() ? "" : "; ") + "run " + run + " in memory";
  }
  return FailedPrecondition("it was taken by " + AttemptText(attempt) +
                            ", which does not continue this job's lineage here (" + here +
                            "): another job of the same name, or a timeline this job left");
}

void MemoryTier::FetchPeerReplica(const std::string& job, uint32_t rank_id, std::chrono::steady_clock::time_point deadline,
                                  int64_t wanted) {
  if (!c_.sender_ && !c_.parity_) return;
  // One at a time per rank: the rank's memory, and the peers' bandwidth, go to one fetch; a second
  // caller then finds what the first brought in (LookAtRank) and fetches nothing more.
  const std::pair<std::string, uint32_t> key{job, rank_id};
  {
    MutexLock lock(&fetching_mu_);
    while (fetching_.count(key) != 0) {
      if (c_.clock_.Now() >= deadline) return;  // the restore goes on without it
      fetching_cv_.WaitFor(&lock, std::chrono::milliseconds(50));
    }
    fetching_.insert(key);
  }
  struct Done {
    MemoryTier* tier;
    const std::pair<std::string, uint32_t>& key;
    ~Done() {
      {
        MutexLock lock(&tier->fetching_mu_);
        tier->fetching_.erase(key);
      }
      tier->fetching_cv_.NotifyAll();
    }
  } done{this, key};
  RankHere here = LookAtRank(c_, job, rank_id, wanted);
  if (!here.segment) return;
  // The lineage the job is on here: the run of its newest complete checkpoint on disk and the runs
  // of the rank's memory checkpoints. A replica is used only when it continues it (ContinuesLineage).
  HeldLineage lineage;
  lineage.runs = here.runs;
  AddDiskLineage(c_, job, rank_id, &lineage);
  if (c_.sender_ && FetchReplicaOfRank(c_, job, rank_id, here, lineage, deadline, wanted)) return;
  // A full replica is the cheaper way back; without one as new, the parity group's.
  if (c_.parity_) RebuildFromGroup(c_, job, rank_id, here, lineage, deadline, wanted);
}

}  // namespace flashckpt
