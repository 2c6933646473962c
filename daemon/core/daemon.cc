#include "daemon/core/daemon.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "common/base/cuda_info.h"
#include "common/base/log.h"
#include "common/base/names.h"
#include "common/base/version.h"
#include "common/format/checksum.h"
#include "common/io/fs.h"
#include "common/io/net.h"
#include "daemon/core/texts.h"
#include "daemon/replica/replica_sender.h"

namespace flashckpt {
namespace {

// How old the last complete step that status shows may be: this daemon's own completions and
// deletions update it at once; what other daemons write to a shared root shows within this.
constexpr auto kStatusRefresh = std::chrono::seconds(30);

DaemonConfig WithDefaultNodeName(DaemonConfig config) {
  if (config.node_name.empty()) config.node_name = DefaultNodeName();
  return config;
}

WriterOptions WriterOptionsOf(const DaemonConfig& config, const Clock& clock) {
  WriterOptions options;
  options.threads = config.writer_threads;
  options.io_threads = config.io_threads;
  options.env = config.io_env != nullptr ? config.io_env : IoEnv::Default();
  options.clock = &clock;
  return options;
}

EmaStageOptions EmaStageOptionsOf(const DaemonConfig& config, const Clock& clock) {
  EmaStageOptions options;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  options.threads = config.ema_threads != 0 ? config.ema_threads : std::min(hw, 8u);
  options.copy_timeout = config.copy_timeout;
  options.clock = &clock;
  return options;
}

}  // namespace

Daemon::Daemon(DaemonConfig config)
    : config_(WithDefaultNodeName(std::move(config))),
      clock_(config_.clock != nullptr ? *config_.clock : Clock::Real()),
      started_(clock_.Now()),
      catalog_(config_.root, config_.keep, RootIo()),
      launches_(config_.root, config_.launch_join_window),
      leases_(config_.root, config_.node_name, config_.lease_ttl) {
  catalog_.SetLeases(&leases_);
  catalog_.SetListener([this](CatalogChange change, const std::string& job, int64_t step, std::string_view reason) {
    DaemonEvent event;
    event.kind = change == CatalogChange::kCompleted ? DaemonEvent::Kind::kCheckpointComplete
                                                     : DaemonEvent::Kind::kCheckpointDeleted;
    event.job = job;
    event.step = step;
    event.reason = std::string(reason);
    Emit(std::move(event));
  });
}

void Daemon::Emit(DaemonEvent event) {
  event.unix_seconds = UnixSeconds();
  metrics_.Observe(event);
  events_.Publish(std::move(event));
}

std::string Daemon::RenderMetrics() const {
  const DaemonStatus status = GetStatus();
  return metrics_.Render(status, events_.dropped());
}

Daemon::~Daemon() {
  Stop();
  sender_.reset();  // what it still holds goes before the segments' state directory
}

Status Daemon::ReserveHostMemory(uint64_t bytes, const std::string& what) {
  MutexLock lock(&mu_);
  const uint64_t used = host_memory_used_.load() + registering_bytes_;
  if (bytes > config_.max_host_memory || used + bytes > config_.max_host_memory) {
    return ResourceExhausted(what + " needs " + FormatBytes(bytes) + " of host memory, budget is " +
                             FormatBytes(config_.max_host_memory) + " with " + FormatBytes(used) +
                             " in use (--max-host-memory)" + ReplicaText(replica_memory_used_.load()));
  }
  host_memory_used_ += bytes;
  replica_memory_used_ += bytes;
  return Status::OK();
}

void Daemon::ReleaseHostMemory(uint64_t bytes) {
  replica_memory_used_ -= bytes;
  host_memory_used_ -= bytes;
}

Status Daemon::Start() {
  if (config_.slots == 0 || config_.slots > 64) return InvalidArgument("--slots must be between 1 and 64");
  if (config_.max_host_memory == 0) return InvalidArgument("--max-host-memory must be positive");
  RETURN_IF_ERROR(ValidateNodeName(config_.node_name).WithContext("--node-name"));
  std::string state_dir = config_.state_dir;
  if (state_dir.empty() && !config_.socket_path.empty()) state_dir = config_.socket_path + ".state";
  if (!state_dir.empty()) {
    // Before anything is read, adopted or deleted: one daemon per state directory.
    IoEnv* state_io = config_.state_io_env != nullptr ? config_.state_io_env : IoEnv::Default();
    ASSIGN_OR_RETURN(state_, StateDir::Open(state_dir, state_io));
    ASSIGN_OR_RETURN(state_lock_, StateDirLock::Acquire(state_dir));
  }
  RETURN_IF_ERROR(MakeDirs(config_.root, 0755));
  {
    // The same for every start of this daemon (its state directory), another for any other daemon.
    std::error_code ec;
    const std::string where = state_dir.empty() ? config_.root : state_dir;
    const std::string canonical = std::filesystem::weakly_canonical(where, ec).string();
    const std::string& key = ec ? where : canonical;
    ema_scope_ = ChecksumHex(Xxh3(key.data(), key.size()));
  }
  writer_ = std::make_unique<Writer>(&catalog_, WriterOptionsOf(config_, clock_));
  RETURN_IF_ERROR(writer_->Start());
  ema_stage_ = std::make_unique<EmaStage>(EmaStageOptionsOf(config_, clock_), [this](EmaJob job, bool applied, double seconds) {
    OnEmaApplied(std::move(job), applied, seconds);
  });
  RETURN_IF_ERROR(ema_stage_->Start());
  if (!config_.replicate_to.empty()) {
    ReplicaSender::Options options;
    options.max_rate = config_.replicate_max_rate;
    options.node_name = config_.node_name;
    options.clock = &clock_;
    options.on_event = [this](DaemonEvent event) { Emit(std::move(event)); };
    for (const std::string& text : config_.replicate_to) {
      ASSIGN_OR_RETURN(ListenAddress address, ParseListenAddress(text, "--replicate-to"));
      options.peers.push_back(
          {address.Target(), config_.replica_tls_cert, config_.replica_tls_key, config_.replica_tls_ca, ""});
    }
    sender_ = std::make_unique<ReplicaSender>(std::move(options));
    RETURN_IF_ERROR(sender_->Start());
    Logger("replica")->info("replicating memory checkpoints to peers={} max_rate={}", config_.replicate_to.size(),
                            config_.replicate_max_rate == 0 ? "none" : FormatBytes(config_.replicate_max_rate) + "/s");
  }
  Logger("rpc")->info("started root={} slots={} max_host_memory={} writer_threads={} keep={} state_dir={}",
                      config_.root, config_.slots, FormatBytes(config_.max_host_memory), config_.writer_threads,
                      config_.keep, state_dir);
  RETURN_IF_ERROR(AdoptSegments());
  {
    std::vector<StateDir::KeptEma> kept = state_.LoadKeptEmas();
    MutexLock lock(&mu_);
    for (StateDir::KeptEma& k : kept) {
      kept_emas_[k.segment] = KeptEma{std::move(k.job), clock_.Now()};
    }
  }
  HousekeeperOptions housekeeping;
  if (const auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(config_.idle_release); idle.count() > 0) {
    // Checked a few times per idle period, at least every 10 s: a job goes at most that late.
    const auto period = std::clamp(idle / 4, std::chrono::milliseconds(100), std::chrono::milliseconds(10000));
    housekeeping.chores.push_back({period, /*at_start=*/false, [this] { ReleaseIdleJobs(); }});
  }
  housekeeping.chores.push_back({config_.sweep_interval, /*at_start=*/true, [this] { SweepSignalledSteps(); }});
  housekeeper_ = std::make_unique<Housekeeper>(std::move(housekeeping));
  return housekeeper_->Start();
}

void Daemon::SweepSignalledSteps() {
  // The newest step directories of a job each sweep looks at: one listing of the job directory and
  // at most this many stats (and signal reads of incomplete ones), however long the run.
  constexpr size_t kSweepSteps = 16;
  // Each job with its ranks' current attempts (also of ranks that have exited since their last
  // save): only their steps are completed, never one of an attempt that a rank has left.
  std::vector<std::pair<std::string, std::vector<Attempt>>> jobs;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    for (const auto& [name, job] : jobs_) {
      std::vector<Attempt> attempts;
      for (const auto& [r, rank] : job.ranks) {
        if (!rank.run_id.empty() && std::find(attempts.begin(), attempts.end(), rank.attempt()) == attempts.end()) {
          attempts.push_back(rank.attempt());
        }
      }
      if (!attempts.empty()) jobs.emplace_back(name, std::move(attempts));
    }
  }
  for (const auto& [job, attempts] : jobs) {
    {
      MutexLock check(&mu_);  // a stop does not wait for the rest of a sweep of a slow root
      if (stopping_) break;
    }
    auto completed = catalog_.CompleteSignalledSteps(job, attempts, kSweepSteps);
    if (!completed.ok()) {
      Logger("catalog")->warn("sweep job={} error=\"{}\"", job, completed.status().ToString());
      continue;
    }
    for (int64_t step : *completed) {
      Logger("catalog")->info("sweep found job={} step={} complete: its signals were all there (written by more "
                              "than one daemon, or seen late)", job, step);
    }
  }
}

void Daemon::Stop(std::chrono::steady_clock::time_point deadline) {
  const auto begun = clock_.Now();
  {
    MutexLock lock(&mu_);
    if (stopping_ && !writer_) return;
    stopping_ = true;
  }
  cv_.NotifyAll();
  if (housekeeper_) housekeeper_->Stop(deadline);
  if (sender_) sender_->Stop(deadline);  // replicas are a bonus: the pushes in flight are cancelled
  // Drains the EMA stage into the writer until the deadline. The snapshots it did not reach are
  // like a crash for the data, but tidy: their commit records and segments stay for the next
  // daemon, which replays them.
  std::vector<EmaJob> unreached;
  if (ema_stage_) unreached = ema_stage_->Stop(deadline);
  {
    MutexLock lock(&mu_);
    for (EmaJob& job : unreached) {
      if (job.resident && !job.persist) continue;  // a memory checkpoint not yet checksummed: not kept, nothing to write
      job.segment->shm->KeepName();
      stop_abandoned_ += 1;
      NoteAbandonedLocked(job.job, job.rank, job.step);
      Logger("writer")->warn("abandoned job={} step={} rank={} stage=ema: committed, left to the next daemon", job.job,
                             job.step, job.rank);
      DaemonEvent event;
      event.kind = DaemonEvent::Kind::kPersistAbandoned;
      event.job = job.job;
      event.rank = job.rank;
      event.step = job.step;
      event.reason = "not reached by the EMA stage before the stop timeout";
      Emit(std::move(event));
    }
  }
  // The newest memory checkpoints not on disk yet join the writes (--persist-on-stop).
  if (config_.persist_on_stop && writer_) PersistMemoryOnStop();
  // Finishes the writes in flight until the deadline; abandons the rest (OnPersisted, kCancelled).
  // Either way no half-written file is left behind under a final name.
  if (writer_) writer_->Stop(deadline);
  // EMA segments stay in /dev/shm for the next daemon. Those of jobs with no rank connected get a
  // record, so that the next daemon unlinks them if the job does not come back.
  std::vector<std::pair<std::string, std::string>> kept;  // EMA segment, job
  {
    MutexLock lock(&mu_);
    if (writer_) {
      Logger("rpc")->info("stopped finished={} abandoned={} secs={:.3f}", stop_finished_, stop_abandoned_,
                          std::chrono::duration<double>(clock_.Now() - begun).count());
    }
    for (const auto& [name, job] : jobs_) {
      const bool connected = std::any_of(job.ranks.begin(), job.ranks.end(),
                                         [](const auto& entry) { return !entry.second.session_id.empty(); });
      if (connected) continue;
      for (const auto& [r, rank] : job.ranks) {
        if (rank.segment && rank.segment->ema) kept.emplace_back(rank.segment->ema->segment_name(), name);
      }
    }
    // The writes are over: what each connected rank got stays for the WaitPersisted calls still
    // waiting, which wake after the job table is gone (without the segments).
    for (const auto& [id, who] : sessions_) {
      auto jit = jobs_.find(who.job);
      if (jit == jobs_.end()) continue;
      auto rit = jit->second.ranks.find(who.rank);
      if (rit == jit->second.ranks.end() || rit->second.session_id != id) continue;
      RankState& kept_rank = stopped_ranks_[id] = rit->second;
      kept_rank.segment.reset();
    }
    jobs_.clear();  // unmaps every segment, and unlinks those no abandoned snapshot is left in
    writer_.reset();
    events_.Close();  // after the last writes' events: watchers see how the stop ended
  }
  cv_.NotifyAll();
  for (const auto& [segment, job] : kept) {
    if (Status s = state_.SaveKeptEma(segment, job); !s.ok()) {
      Logger("shm")->error("no record of the EMA segment {} left for the next daemon: {}", segment, s.ToString());
    }
  }
}

void Daemon::NoteAbandonedLocked(const std::string& job, uint32_t rank, int64_t step) {
  auto jit = jobs_.find(job);
  if (jit == jobs_.end()) return;
  auto rit = jit->second.ranks.find(rank);
  if (rit == jit->second.ranks.end()) return;
  rit->second.abandoned.insert(step);
  cv_.NotifyAll();
}

Result<std::vector<CheckpointInfo>> Daemon::List(const std::string& job) const { return catalog_.List(job); }

Result<DeletionOutcome> Daemon::DeleteCheckpoints(const std::string& job, int64_t step, uint32_t keep, bool force,
                                                  bool dry_run) {
  RETURN_IF_ERROR(ValidateJobName(job));
  if (step < 0) return InvalidArgument("step must be non-negative, got " + std::to_string(step));
  if ((step > 0) == (keep > 0)) {
    return InvalidArgument("give either a step to delete or keep >= 1 (gc), not " +
                           std::string(step > 0 ? "both" : "neither"));
  }
  std::set<int64_t> busy;  // steps a save of this daemon has in a slot
  {
    MutexLock lock(&mu_);
    // Once stopping, the slots that show which steps are busy go away while abandoned writes are
    // left to the next daemon: nothing may be deleted under them.
    if (stopping_) return Unavailable(kStoppingMessage);
    busy = BusyStepsLocked(job);
  }
  if (step > 0) return catalog_.DeleteCheckpoint(job, step, force, busy, dry_run);
  return catalog_.CollectGarbage(job, keep, busy, dry_run);
}

std::set<int64_t> Daemon::BusyStepsLocked(const std::string& job) const {
  std::set<int64_t> busy;
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return busy;
  for (const auto& [r, rank] : it->second.ranks) {
    if (!rank.segment) continue;
    for (uint32_t i = 0; i < Slots(*rank.segment).size(); ++i) {
      const SlotInfo& slot = Slots(*rank.segment).at(i);
      if (slot.state == SlotState::kFilling || slot.state == SlotState::kCommitted ||
          slot.state == SlotState::kPersisting) {
        busy.insert(slot.step);
      }
    }
  }
  return busy;
}

std::string Daemon::EmaSegmentName(const std::string& job, uint32_t rank) const {
  return flashckpt::EmaSegmentName(job, rank, ema_scope_);
}

DaemonStatus Daemon::GetStatus() const {
  DaemonStatus out;
  out.version = kVersion;
  out.uptime_seconds = std::chrono::duration<double>(clock_.Now() - started_).count();
  out.host_memory_used = host_memory_used_.load();
  out.host_memory_budget = config_.max_host_memory;
  out.root = config_.root;
  out.node_name = config_.node_name;
  const CudaInfo& cuda = GetCudaInfo();
  out.cuda_compiled = cuda.compiled;
  out.cuda_devices = cuda.devices;
  FillJobsStatus(&out);
  if (sender_) out.replica_peers = sender_->PeerStatus();
  // The checkpoints on disk, read without the daemon's lock: a slow or failing filesystem must not
  // hold up the trainers' snapshots.
  for (JobStatus& j : out.jobs) {
    auto latest = catalog_.KnownLatest(j.job, kStatusRefresh);
    j.last_complete_step = latest.ok() && *latest ? **latest : -1;
    if (!latest.ok()) j.catalog_error = latest.status().ToString();
  }
  return out;
}

void Daemon::FillJobsStatus(DaemonStatus* out) const {
  MutexLock lock(&mu_);
  const auto now = clock_.Now();
  const std::vector<WriteInFlight> writing = writer_ ? writer_->InFlight() : std::vector<WriteInFlight>{};
  for (const auto& [name, job] : jobs_) {
    JobStatus* j = &out->jobs.emplace_back();
    j->job = name;
    j->world_size = job.topology.world_size;
    j->split_attempts = job.split_attempts;
    j->split = job.split;
    for (const auto& [r, rank] : job.ranks) {
      RankStatus* rs = &j->ranks.emplace_back();
      rs->rank = r;
      rs->connected = !rank.session_id.empty();
      rs->segment_bytes = rank.segment ? rank.segment->shm->size() : 0;
      rs->last_committed_step = rank.last_committed;
      rs->last_persisted_step = rank.last_persisted;
      rs->last_error = rank.last_error;
      rs->snapshots = rank.snapshots;
      rs->persists = rank.persists;
      rs->failures = rank.failures;
      rs->skipped = rank.skipped;
      rs->last_persist_gbps = rank.last_persist_gbps;
      rs->run_id = rank.run_id;
      rs->resumed_from = rank.resumed_from;
      if (rank.segment) {
        const std::vector<int64_t> kept = Slots(*rank.segment).ResidentSteps();  // newest first
        rs->memory_step = kept.empty() ? -1 : kept.front();
        rs->memory_checkpoints = static_cast<uint32_t>(kept.size());
        rs->memory_bytes = kept.size() * rank.segment->layout.slot_bytes;
      }
      double oldest = 0;  // seconds the rank's oldest persist being written has been running
      for (const WriteInFlight& w : writing) {
        if (w.job != name || w.rank != r) continue;
        oldest = std::max(oldest, std::chrono::duration<double>(now - w.started).count());
      }
      rs->oldest_write_seconds = oldest;
      if (rank.segment) {
        for (uint32_t i = 0; i < Slots(*rank.segment).size(); ++i) {
          SlotStatus* s = &rs->slots.emplace_back();
          s->index = i;
          s->state = SlotStateName(Slots(*rank.segment).at(i).state);
          s->step = Slots(*rank.segment).at(i).step;
          // A FREE slot may hold a memory checkpoint (it is given up only for a newer snapshot).
          if (const auto held = Slots(*rank.segment).ResidentIn(i);
              held && Slots(*rank.segment).at(i).state == SlotState::kFree) {
            s->state = "memory";
            s->step = held->step;
          }
          if (Slots(*rank.segment).at(i).state == SlotState::kFilling) {
            s->filling_seconds = std::chrono::duration<double>(now - Slots(*rank.segment).at(i).handed_out).count();
          }
        }
        if (const RankEma* ema = rank.segment->ema.get()) {
          const EmaState state = ema->state();
          rs->ema_enabled = true;
          rs->ema_bytes = ema->plan().image_bytes();
          rs->ema_last_step = state.last_step;
          rs->ema_updates_applied = state.updates_applied;
          rs->ema_updates_skipped = state.updates_skipped;
          rs->ema_decay = ema->config().decay;
        }
      }
    }
  }
}

}  // namespace flashckpt
