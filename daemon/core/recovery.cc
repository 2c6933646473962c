// Crash recovery: a daemon killed with SIGKILL leaves its slot segments in /dev/shm and their
// records in the state directory (daemon/core/state_dir.h). The next daemon on the same socket adopts
// them before it serves anyone:
//   - each segment's layout is rebuilt from its registration record and checked against the
//     segment's own header; the rank's EMA segment is adopted as usual (daemon/pipeline/ema.h);
//   - every slot with a commit record holds a snapshot the old daemon acknowledged: it is
//     COMMITTED again and sent down the pipeline once more (SavePath::SendOnLocked): through the
//     EMA stage unless the slot's header says the old stage was done with it (as a replay: a step
//     the EMA has already seen is not applied twice), and to the writer, unless its files were
//     already durable (its signal is in place, or the checkpoint is complete), in which case only
//     completion is checked;
//   - every slot whose header still says it holds the memory checkpoint its memory record
//     describes holds it again, with the recorded checksums (verified when a restore hands it over);
//   - temporaries the dead writer left in the job's checkpoint directories are removed.
// The trainers re-attach on their own (a new session, the same registration: the adopted segment
// is reused, so the client's mapping stays valid).
#include <set>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/io/fs.h"
#include "daemon/core/memory_tier.h"
#include "daemon/core/recovery.h"
#include "daemon/core/registrar.h"
#include "daemon/core/save_path.h"

namespace flashckpt {

Status Recovery::AdoptSegments() {
  std::vector<StateDir::Adoptable> records = c_.state_.Load();
  std::set<std::string> jobs;
  for (const auto& r : records) {
    if (ValidateJobName(r.segment.job).ok()) jobs.insert(r.segment.job);
  }
  // Before any persist is queued: the temporaries of this process are not among them.
  for (const auto& job : jobs) RemoveStaleTemporaries(job);
  size_t adopted = 0, snapshots = 0;
  for (const auto& r : records) {
    Status s = AdoptSegment(r);
    if (!s.ok()) {
      // Without a usable record the segment's snapshots cannot be written: free its memory.
      Logger("shm")->error("not adopted segment={} job={} rank={} committed_snapshots={}: {}", r.segment.segment_name,
                           r.segment.job, r.segment.rank, r.commits.size(), s.ToString());
      if (r.segment.segment_name.rfind("flashckpt.", 0) == 0) SharedSegment::Unlink(r.segment.segment_name);
      c_.state_.RemoveSegment(r.segment.segment_name);
      continue;
    }
    adopted += 1;
    snapshots += r.commits.size();
  }
  if (!records.empty()) {
    Logger("shm")->info("recovery segments={} adopted={} committed_snapshots={}", records.size(), adopted, snapshots);
  }
  return Status::OK();
}

// A committed snapshot of an adopted segment, to be replayed: through the EMA stage, or to the writer.
struct AdoptedCommit {
  EmaJob job;
  bool ema_done = false;  // the old daemon's EMA stage had finished with it
};

// Whether the EMA stage of the daemon that handed `ticket` out was done with it (the slot's
// SlotHeader::ema_done), its EMA image for `step` in the slot. A segment of an older release says
// so by its mirror alone: that daemon mirrored a slot PERSISTING only once its stage was done.
bool EmaDoneWith(const SlotHeader& header, const SlotTicket& ticket, int64_t step) {
  const uint64_t done = header.ema_done.load(std::memory_order_acquire);
  if (done != 0) return done == ticket.generation;
  return header.state.load() == static_cast<uint32_t>(SlotState::kPersisting) && header.step.load() == step &&
         header.generation.load() == ticket.generation;
}

Status Recovery::AdoptSegment(const StateDir::Adoptable& record) {
  const SegmentRecord& rec = record.segment;
  const std::string& job = rec.job;
  const uint32_t rank_id = rec.rank;
  RETURN_IF_ERROR(ValidateJobName(job));
  const std::string prefix = "flashckpt." + job + "." + std::to_string(rank_id) + ".";
  if (rec.segment_name.rfind(prefix, 0) != 0) {
    return InvalidArgument("segment name '" + rec.segment_name + "' does not belong to job '" + job + "' rank " +
                           std::to_string(rank_id));
  }
  if (rec.slot_count == 0 || rec.slot_count > 64) {
    return InvalidArgument("slot count " + std::to_string(rec.slot_count) + " is out of range");
  }
  RETURN_IF_ERROR(ValidateChecksumChunk(rec.checksum_chunk));
  ASSIGN_OR_RETURN(Registration reg, c_.state_.RegistrationOf(rec));
  LayoutExtras extras;
  extras.checksum_chunk = rec.checksum_chunk;
  ASSIGN_OR_RETURN(RankLayout layout, BuildRankLayout(job, rank_id, reg.topology, reg.tensors, extras));
  std::optional<EmaPlan> ema_plan;
  if (reg.ema.enabled) {
    ASSIGN_OR_RETURN(EmaPlan plan, PlanEma(layout, reg.ema));
    if (!plan.layout.files.empty()) ema_plan = std::move(plan);
  }
  ASSIGN_OR_RETURN(std::shared_ptr<RankSegment> segment,
                   c_.registrar->CreateSegment(job, rank_id, std::move(layout), std::move(ema_plan), reg.ema, rec.slot_count,
                                 rec.segment_name, /*adopt=*/true));

  ASSIGN_OR_RETURN(std::vector<AdoptedCommit> pending, AdoptCommits(record, reg, segment));
  // Memory checkpoints: each slot whose header still says it holds the recorded step holds it (the
  // record is written before the header says so, and a slot reused or dropped says so no longer).
  // Their bytes are verified against the recorded checksums when a restore hands them over.
  const std::vector<int64_t> memory_steps = AdoptMemoryRecords(record, reg, segment);
  PublishAdopted(record, reg, segment, std::move(pending), memory_steps);
  return Status::OK();
}

Result<std::vector<AdoptedCommit>> Recovery::AdoptCommits(const StateDir::Adoptable& record, const Registration& reg,
                                                        const std::shared_ptr<RankSegment>& segment) {
  const SegmentRecord& rec = record.segment;
  const std::string& job = rec.job;
  const uint32_t rank_id = rec.rank;
  std::vector<AdoptedCommit> adopted;
  std::vector<AdoptedCommit>* pending = &adopted;
  for (const CommitRecord& c : record.commits) {
    const SlotTicket ticket{c.slot, c.generation};
    if (c.step < 0 || c.world_size != reg.topology.world_size || c.resumed_from < 0 ||
        (!c.run_id.empty() && !ValidateRunId(c.run_id).ok())) {
      Logger("shm")->warn("dropping commit record segment={} slot={}: step {} world size {}", rec.segment_name,
                          c.slot, c.step, c.world_size);
      c_.state_.RemoveCommit(rec.segment_name, c.slot);
      continue;
    }
    RETURN_IF_ERROR(c_.UnpublishedSlots(*segment).Adopt(ticket, c.step));
    AdoptedCommit p;
    p.ema_done = EmaDoneWith(*reinterpret_cast<const SlotHeader*>(segment->Slot(c.slot)), ticket, c.step);
    c_.MirrorUnpublished(*segment, c.slot);
    EmaJob& j = p.job;
    j.step = c.step;
    j.loss = c.loss;
    j.persist = c.persist;
    j.job = job;
    j.rank = rank_id;
    j.replay = true;
    PointEmaJobAt(segment, ticket, &j);
    if (j.persist) {
      // Signals are written last: one in place with this attempt means the files are durable.
      // When the disk cannot tell (EIO, ESTALE), the snapshot is written again: the slot holds the
      // bytes of this very step and attempt, so what is written is what was (or was to be) there.
      const Attempt attempt{c.run_id, c.resumed_from};
      auto signalled = c_.catalog_.HasSignal(job, rank_id, c.step, attempt);
      auto is_complete = c_.catalog_.IsComplete(job, c.step);
      if (!signalled.ok() || !is_complete.ok()) {
        Logger("shm")->error("recovery job={} rank={} step={}: cannot tell whether it is durable, writing it again: {}",
                             job, rank_id, c.step,
                             (!signalled.ok() ? signalled.status() : is_complete.status()).ToString());
      }
      const bool written = signalled.ok() && *signalled;
      if (written || (is_complete.ok() && *is_complete)) {
        if (written) {
          auto complete = c_.catalog_.MaybeComplete(job, c.step, c.world_size, attempt);
          if (!complete.ok()) Logger("catalog")->error("completion after recovery: {}", complete.status().ToString());
        }
        (void)c_.UnpublishedSlots(*segment).Release(ticket, SlotState::kCommitted);
        c_.MirrorUnpublished(*segment, c.slot);
        c_.state_.RemoveCommit(rec.segment_name, c.slot);
        Logger("shm")->info("recovered job={} rank={} step={}: already durable", job, rank_id, c.step);
        continue;
      }
      j.request = c_.save->MakePersistRequest(job, rank_id, /*session_id=*/"", /*process=*/0, c.world_size, attempt, segment,
                                     ticket, c.step, c.extra);
    }
    pending->push_back(std::move(p));
  }

  return adopted;
}

std::vector<int64_t> Recovery::AdoptMemoryRecords(const StateDir::Adoptable& record, const Registration& reg,
                                                const std::shared_ptr<RankSegment>& segment) {
  const SegmentRecord& rec = record.segment;
  const std::string& job = rec.job;
  const uint32_t rank_id = rec.rank;
  std::vector<int64_t> memory_steps;  // memory-only steps: not the disk snapshots kept once written
  for (const MemoryRecord& m : record.memory) {
    std::string why;
    const auto* mirror = m.slot < rec.slot_count ? reinterpret_cast<const SlotHeader*>(segment->Slot(m.slot))
                                                     : nullptr;
    if (mirror == nullptr) {
      why = "no such slot";
    } else if (mirror->resident.load() != 1 || mirror->step.load() != m.step) {
      why = "the slot no longer holds it";
    } else if (m.step < 0 || m.world_size != reg.topology.world_size || m.resumed_from < 0 ||
               (!m.run_id.empty() && !ValidateRunId(m.run_id).ok()) || m.extra.size() > (4u << 20)) {
      why = "the record is not valid";
    }
    auto resident = std::make_shared<ResidentCheckpoint>();
    if (why.empty()) {
      resident->step = m.step;
      resident->attempt = Attempt{m.run_id, m.resumed_from};
      resident->world_size = m.world_size;
      resident->extra = m.extra;
      resident->sums.chunk_bytes = m.checksum_chunk;
      resident->sums.first.assign(m.first_chunk.begin(), m.first_chunk.end());
      resident->sums.sums.assign(m.sums.begin(), m.sums.end());
      if (Status fit = CheckSlotChecksumsFit(segment->layout, resident->sums); !fit.ok()) why = fit.message();
    }
    if (why.empty() && segment->ema) {
      // The EMA of the step goes with it: a rank restored from it continues the average from there.
      if (!m.ema || m.ema->last_seen > m.step || m.ema->last_step > m.ema->last_seen) {
        why = "the record holds no EMA of the step";
      } else if (Status fit = CheckSlotChecksumsFit(segment->ema->plan().layout, m.ema_sums); !fit.ok()) {
        why = "its EMA: " + fit.message();
      } else {
        resident->ema = m.ema;
        resident->ema_sums = m.ema_sums;
      }
    }
    if (why.empty()) {
      const SlotTicket ticket{m.slot, mirror->generation.load()};
      if (Status s = c_.UnpublishedSlots(*segment).AdoptResident(ticket, std::move(resident)); !s.ok()) why = s.message();
    }
    if (!why.empty()) {
      Logger("shm")->info("memory checkpoint not adopted segment={} slot={} step={}: {}", rec.segment_name, m.slot,
                          m.step, why);
      c_.state_.RemoveMemory(rec.segment_name, m.slot);
      continue;
    }
    c_.MirrorUnpublished(*segment, m.slot);
    Logger("shm")->info("recovered job={} rank={} step={} tier=memory: kept before the restart{}", job, rank_id,
                        m.step, m.written ? " (also on disk)" : "");
    if (!m.written) memory_steps.push_back(m.step);
  }
  // Slots the old daemon mirrored as holding a memory checkpoint without a record here: not held.
  for (uint32_t i = 0; i < rec.slot_count; ++i) {
    const SlotInfo& slot = c_.UnpublishedSlots(*segment).at(i);
    if (slot.state == SlotState::kFree && slot.resident == nullptr) c_.MirrorUnpublished(*segment, i);
  }

  return memory_steps;
}

void Recovery::PublishAdopted(const StateDir::Adoptable& record, const Registration& reg,
                            const std::shared_ptr<RankSegment>& segment, std::vector<AdoptedCommit> pending,
                            const std::vector<int64_t>& memory_steps) {
  const SegmentRecord& rec = record.segment;
  const std::string& job = rec.job;
  const uint32_t rank_id = rec.rank;
  MutexLock lock(&c_.mu_);
  JobState& job_state = c_.jobs_[job];
  RankState& rank = job_state.ranks[rank_id];
  if (rank.session_id.empty()) rank.gone_since = c_.clock_.Now();  // idle from here
  if (!rank.segment) {
    rank.segment = segment;
    rank.topology = reg.topology;
    rank.policy = reg.policy;
    rank.memory_checkpoints = reg.memory_checkpoints && c_.memory->DiskSnapshotsHoldEverything(*segment);
    job_state.topology = reg.topology;
  }  // else another record of the rank was adopted first: this one lives until its snapshots are written
  for (int64_t step : memory_steps) {
    if (rank.segment != segment) continue;  // the rank's other segment is its own
    rank.last_committed = std::max(rank.last_committed, step);
    rank.memory_steps.insert(step);
  }
  for (AdoptedCommit& p : pending) {
    rank.last_committed = std::max(rank.last_committed, p.job.step);
    Logger("shm")->info("recovered job={} rank={} step={} persist={}: committed before the restart", job, rank_id,
                        p.job.step, p.job.persist);
    if (p.ema_done) p.job.ema = nullptr;  // its EMA image (if persisted) is in the slot already
    if (!p.job.persist && p.job.ema == nullptr) {
      (void)c_.Slots(*segment).Release(p.job.ticket, SlotState::kCommitted);
      c_.Mirror(*segment, p.job.ticket.slot);
      c_.state_.RemoveCommit(rec.segment_name, p.job.ticket.slot);
      continue;
    }
    // In step order (the records are sorted), as the EMA wants them.
    Status s = SavePath::SendOnLocked(c_, std::move(p.job));
    if (!s.ok()) Logger("shm")->error("recovered snapshot not queued: {}", s.ToString());
  }
  c_.cv_.NotifyAll();
}

void Recovery::RemoveStaleTemporaries(const std::string& job) {
  const std::string job_dir = c_.catalog_.JobDir(job);
  auto dirs = ListDir(job_dir, c_.RootIo());
  if (!dirs.ok()) {
    if (dirs.status().code() != StatusCode::kNotFound) {
      Logger("writer")->error("recovery job={}: cannot look for stale temporaries: {}", job, dirs.status().ToString());
    }
    return;
  }
  size_t removed = 0;
  auto sweep = [&](const std::string& dir, const std::vector<std::string>& names) {
    for (const auto& path : flashckpt::RemoveStaleTemporaries(dir, names, c_.RootIo())) {
      removed += 1;
      Logger("writer")->info("removed stale temporary {}", path);
    }
  };
  sweep(job_dir, *dirs);  // LATEST.tmp.*
  for (const auto& d : *dirs) {
    if (!ParseCheckpointDirName(d)) continue;
    auto names = ListDir(job_dir + "/" + d, c_.RootIo());
    if (names.ok()) sweep(job_dir + "/" + d, *names);
  }
  if (removed > 0) Logger("writer")->info("recovery job={} stale_temporaries_removed={}", job, removed);
}

}  // namespace flashckpt
