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
#include "daemon/parity/parity_sender.h"
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

WriterOptions WriterOptionsOf(const DaemonConfig& config, const Clock& clock, IoEnv* root_io) {
  WriterOptions options;
  options.threads = config.writer_threads;
  options.io_threads = config.io_threads;
  options.env = root_io;
  options.clock = &clock;
  return options;
}

EmaStageOptions EmaStageOptionsOf(const DaemonConfig& config, const Clock& clock) {
  EmaStageOptions options;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  options.threads = config.ema_threads != 0 ? config.ema_threads : std::min(hw, 8u);
  options.copy_timeout = config.copy_timeout;
  options.clock = &clock;
  options.keep_memory_on_stop = config.persist_on_stop;
  return options;
}

}  // namespace

Daemon::Daemon(DaemonConfig config) : c_(WithDefaultNodeName(std::move(config))) {
  c_.registrar = &registrar_;
  c_.lineage = &lineage_;
  c_.save = &save_;
  c_.memory = &memory_;
  c_.restorer = &restorer_;
  c_.releaser = &releaser_;
  c_.recovery = &recovery_;
}

std::string Daemon::RenderMetrics() const {
  const DaemonStatus status = GetStatus();
  std::string out = c_.metrics_.Render(status, c_.events_.dropped());
  // The calls on the checkpoint root (not the state directory, shared memory or the leases): what a
  // checkpoint costs the file system, which the scale bench reads per checkpoint.
  const IoCounts io = c_.RootIoCounts();
  MetricHeader(&out, "flashckpt_root_io_calls_total", "counter",
               "File-system calls this daemon made on its checkpoint root, by call");
  for (const auto& [call, n] : {std::pair{"open", io.opens}, {"stat", io.stats}, {"list", io.lists},
                                {"read", io.reads}, {"write", io.writes}, {"sync", io.syncs},
                                {"rename", io.renames}, {"unlink", io.unlinks}, {"mkdir", io.mkdirs},
                                {"truncate", io.truncates}}) {
    MetricSample(&out, "flashckpt_root_io_calls_total", std::string("call=\"") + call + "\"",
                 static_cast<double>(n));
  }
  MetricHeader(&out, "flashckpt_root_io_bytes_total", "counter",
               "Bytes this daemon read from and wrote to its checkpoint root, by direction");
  MetricSample(&out, "flashckpt_root_io_bytes_total", "direction=\"read\"", static_cast<double>(io.read_bytes));
  MetricSample(&out, "flashckpt_root_io_bytes_total", "direction=\"write\"", static_cast<double>(io.written_bytes));
  return out;
}

Daemon::~Daemon() {
  Stop();
  c_.sender_.reset();  // what it still holds goes before the segments' state directory
  c_.parity_.reset();
}

Status Daemon::ReserveHostMemory(uint64_t bytes, const std::string& what) {
  MutexLock lock(&c_.mu_);
  const uint64_t used = c_.host_memory_used_.load() + c_.registering_bytes_;
  if (bytes > c_.config_.max_host_memory || used + bytes > c_.config_.max_host_memory) {
    return ResourceExhausted(what + " needs " + FormatBytes(bytes) + " of host memory, budget is " +
                             FormatBytes(c_.config_.max_host_memory) + " with " + FormatBytes(used) +
                             " in use (--max-host-memory)" + ReplicaText(c_.replica_memory_used_.load()));
  }
  c_.host_memory_used_ += bytes;
  c_.replica_memory_used_ += bytes;
  return Status::OK();
}

Result<OwnImage> Daemon::OwnParityImage(const std::string& job, uint32_t rank, int64_t step,
                                       const std::string& run_id, int64_t resumed_from) {
  MutexLock lock(&c_.mu_);
  return MemoryTier::OwnImageLocked(c_, job, rank, step, Attempt{run_id, resumed_from});
}

void Daemon::ParityHeardOf(const std::string& job, int64_t step) {
  if (!c_.parity_) return;
  {
    MutexLock lock(&c_.mu_);
    auto jit = c_.jobs_.find(job);
    if (jit != c_.jobs_.end()) {
      for (const auto& [rank, state] : jit->second.ranks) {
        if (state.segment) return;  // its ranks' blocks tell their count
      }
    }
  }
  c_.parity_->OfferNoRanks(job, step);
}

void Daemon::ReleaseHostMemory(uint64_t bytes) {
  c_.replica_memory_used_ -= bytes;
  c_.host_memory_used_ -= bytes;
}

Status Daemon::Start() {
  if (c_.config_.slots == 0 || c_.config_.slots > 64) return InvalidArgument("--slots must be between 1 and 64");
  if (c_.config_.max_host_memory == 0) return InvalidArgument("--max-host-memory must be positive");
  RETURN_IF_ERROR(ValidateNodeName(c_.config_.node_name).WithContext("--node-name"));
  std::string state_dir = c_.config_.state_dir;
  if (state_dir.empty() && !c_.config_.socket_path.empty()) state_dir = c_.config_.socket_path + ".state";
  if (!state_dir.empty()) {
    // Before anything is read, adopted or deleted: one daemon per state directory.
    IoEnv* state_io = c_.config_.state_io_env != nullptr ? c_.config_.state_io_env : IoEnv::Default();
    ASSIGN_OR_RETURN(c_.state_, StateDir::Open(state_dir, c_.config_.state_records, state_io));
    ASSIGN_OR_RETURN(c_.state_lock_, StateDirLock::Acquire(state_dir));
  }
  RETURN_IF_ERROR(MakeDirs(c_.config_.root, 0755));
  {
    // The same for every start of this daemon (its state directory), another for any other daemon.
    std::error_code ec;
    const std::string where = state_dir.empty() ? c_.config_.root : state_dir;
    const std::string canonical = std::filesystem::weakly_canonical(where, ec).string();
    const std::string& key = ec ? where : canonical;
    c_.ema_scope_ = ChecksumHex(Xxh3(key.data(), key.size()));
  }
  ASSIGN_OR_RETURN(c_.instance_, RandomToken());
  c_.writer_ = std::make_unique<Writer>(&c_.catalog_, WriterOptionsOf(c_.config_, c_.clock_, c_.RootIo()));
  RETURN_IF_ERROR(c_.writer_->Start());
  EmaStageOptions ema_options = EmaStageOptionsOf(c_.config_, c_.clock_);
  ema_options.writer = c_.writer_.get();
  ema_options.on_event = [this](DaemonEvent event) { c_.Emit(std::move(event)); };
  c_.ema_stage_ = std::make_unique<EmaStage>(std::move(ema_options),
                                             [this](EmaJob job) { c_.save->OnStageDone(std::move(job)); });
  RETURN_IF_ERROR(c_.ema_stage_->Start());
  if (!c_.config_.replicate_to.empty()) {
    ReplicaSender::Options options;
    options.max_rate = c_.config_.replicate_max_rate;
    options.node_name = c_.config_.node_name;
    options.clock = &c_.clock_;
    options.on_event = [this](DaemonEvent event) { c_.Emit(std::move(event)); };
    for (const std::string& text : c_.config_.replicate_to) {
      ASSIGN_OR_RETURN(ListenAddress address, ParseListenAddress(text, "--replicate-to"));
      options.peers.push_back(
          {address.Target(), c_.config_.replica_tls_cert, c_.config_.replica_tls_key, c_.config_.replica_tls_ca, ""});
    }
    c_.sender_ = std::make_unique<ReplicaSender>(std::move(options));
    RETURN_IF_ERROR(c_.sender_->Start());
    Logger("replica")->info("replicating memory checkpoints to peers={} max_rate={}", c_.config_.replicate_to.size(),
                            c_.config_.replicate_max_rate == 0 ? "none" : FormatBytes(c_.config_.replicate_max_rate) + "/s");
  }
  if (!c_.config_.ec_group.empty()) {
    const bool tls = !c_.config_.replica_tls_cert.empty();
    const uint32_t parity = c_.config_.ec_parity == 0 ? 1 : c_.config_.ec_parity;
    ASSIGN_OR_RETURN(ParityGroupConfig group,
                     ParseParityGroup(c_.config_.ec_group, parity, c_.config_.replica_listen, tls));
    ParitySender::Options options{group.group, group.self, {}, 1u << 20, {}, group.hosts, {}};
    options.on_event = [this](DaemonEvent event) { c_.Emit(std::move(event)); };
    // A release word some holder has not heard yet outlives this daemon: the next one says it again.
    options.keep_word = [this](const std::string& job, bool pending) {
      if (!pending) {
        if (c_.state_.RemoveParityRelease(job)) {
          Logger("parity")->info("parity release word job={} no holder waits for any more: its record is removed", job);
        }
        return;
      }
      Status kept = c_.state_.SaveParityRelease(job);
      if (!kept.ok()) {
        Logger("parity")->warn("parity release of job={} not recorded (a daemon started after this one will not "
                               "tell the holders that missed it): {}", job, kept.ToString());
      }
    };
    for (const auto& [index, target] : group.others) {
      options.members.emplace_back(
          index, ReplicaPeer{target, c_.config_.replica_tls_cert, c_.config_.replica_tls_key, c_.config_.replica_tls_ca, ""});
    }
    c_.parity_ = std::make_unique<ParitySender>(std::move(options));
    RETURN_IF_ERROR(c_.parity_->Start());
    for (const std::string& job : c_.state_.LoadParityReleases()) {
      Logger("parity")->info("parity release of job={} not heard by every holder before the last stop: telling them",
                             job);
      c_.parity_->OfferReleased(job);
    }
    Logger("parity")->info("parity group member={} of {} parity={}: each member holds about {}/{} of its checkpoints' "
                           "bytes for the others",
                           group.self, group.group.members(), parity, parity, group.group.data_blocks());
  }
  Logger("rpc")->info("started root={} slots={} max_host_memory={} writer_threads={} keep={} state_dir={}",
                      c_.config_.root, c_.config_.slots, FormatBytes(c_.config_.max_host_memory), c_.config_.writer_threads,
                      c_.config_.keep, state_dir);
  RETURN_IF_ERROR(c_.recovery->AdoptSegments());
  {
    std::vector<StateDir::KeptEma> kept = c_.state_.LoadKeptEmas();
    MutexLock lock(&c_.mu_);
    for (StateDir::KeptEma& k : kept) {
      c_.kept_emas_[k.segment] = Core::KeptEma{std::move(k.job), c_.clock_.Now()};
    }
  }
  HousekeeperOptions housekeeping;
  if (const auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(c_.config_.idle_release); idle.count() > 0) {
    // Checked a few times per idle period, at least every 10 s: a job goes at most that late.
    const auto period = std::clamp(idle / 4, std::chrono::milliseconds(100), std::chrono::milliseconds(10000));
    housekeeping.chores.push_back({period, /*at_start=*/false, [this] { c_.releaser->ReleaseIdleJobs(); }});
  }
  housekeeping.chores.push_back({c_.config_.sweep_interval, /*at_start=*/true, [this] { c_.releaser->SweepSignalledSteps(); }});
  housekeeper_ = std::make_unique<Housekeeper>(std::move(housekeeping));
  return housekeeper_->Start();
}

void Daemon::Stop(std::chrono::steady_clock::time_point deadline) {
  const auto begun = c_.clock_.Now();
  {
    MutexLock lock(&c_.mu_);
    if (c_.stopping_ && !c_.writer_) return;
    c_.stopping_ = true;
  }
  c_.cv_.NotifyAll();
  if (housekeeper_) housekeeper_->Stop(deadline);
  if (c_.sender_) c_.sender_->Stop(deadline);  // replicas are a bonus: the pushes in flight are cancelled
  if (c_.parity_) c_.parity_->Stop();          // as is parity
  // Drains the EMA stage into the writer until the deadline. The snapshots it did not reach are
  // like a crash for the data, but tidy: their commit records and segments stay for the next
  // daemon, which replays them.
  std::vector<EmaJob> unreached;
  if (c_.ema_stage_) unreached = c_.ema_stage_->Stop(deadline);
  {
    MutexLock lock(&c_.mu_);
    for (EmaJob& job : unreached) {
      // A memory checkpoint not yet checksummed is not kept and has nothing to write; with the rank's
      // EMA its commit record stays, for the next daemon to apply it to the EMA.
      if (job.resident && !job.persist && job.ema == nullptr) continue;
      job.segment->shm->KeepName();
      c_.stop_abandoned_ += 1;
      c_.NoteAbandonedLocked(job.job, job.rank, job.step);
      Logger("writer")->warn("abandoned job={} step={} rank={} stage=ema: committed, left to the next daemon", job.job,
                             job.step, job.rank);
      DaemonEvent event;
      event.kind = DaemonEvent::Kind::kPersistAbandoned;
      event.job = job.job;
      event.rank = job.rank;
      event.step = job.step;
      event.reason = "not reached by the EMA stage before the stop timeout";
      c_.Emit(std::move(event));
    }
  }
  // The newest memory checkpoints not on disk yet join the writes (--persist-on-stop).
  if (c_.config_.persist_on_stop && c_.writer_) c_.memory->PersistMemoryOnStop();
  // Finishes the writes in flight until the deadline; abandons the rest (OnPersisted, kCancelled).
  // Either way no half-written file is left behind under a final name.
  if (c_.writer_) c_.writer_->Stop(deadline);
  // EMA segments stay in /dev/shm for the next daemon. Those of jobs with no rank connected get a
  // record, so that the next daemon unlinks them if the job does not come back.
  std::vector<std::pair<std::string, std::string>> kept;  // EMA segment, job
  {
    MutexLock lock(&c_.mu_);
    if (c_.writer_) {
      Logger("rpc")->info("stopped finished={} abandoned={} secs={:.3f}", c_.stop_finished_, c_.stop_abandoned_,
                          std::chrono::duration<double>(c_.clock_.Now() - begun).count());
    }
    for (const auto& [name, job] : c_.jobs_) {
      const bool connected = std::any_of(job.ranks.begin(), job.ranks.end(),
                                         [](const auto& entry) { return !entry.second.session_id.empty(); });
      if (connected) continue;
      for (const auto& [r, rank] : job.ranks) {
        if (rank.segment && rank.segment->ema) kept.emplace_back(rank.segment->ema->segment_name(), name);
      }
    }
    // The writes are over: what each connected rank got stays for the WaitPersisted calls still
    // waiting, which wake after the job table is gone (without the segments).
    for (const auto& [id, who] : c_.sessions_) {
      auto jit = c_.jobs_.find(who.job);
      if (jit == c_.jobs_.end()) continue;
      auto rit = jit->second.ranks.find(who.rank);
      if (rit == jit->second.ranks.end() || rit->second.session_id != id) continue;
      RankState& kept_rank = c_.stopped_ranks_[id] = rit->second;
      kept_rank.segment.reset();
    }
    c_.jobs_.clear();  // unmaps every segment, and unlinks those no abandoned snapshot is left in
    c_.writer_.reset();
    c_.events_.Close();  // after the last writes' events: watchers see how the stop ended
  }
  c_.cv_.NotifyAll();
  for (const auto& [segment, job] : kept) {
    if (Status s = c_.state_.SaveKeptEma(segment, job); !s.ok()) {
      Logger("shm")->error("no record of the EMA segment {} left for the next daemon: {}", segment, s.ToString());
    }
  }
}

Result<std::vector<CheckpointInfo>> Daemon::List(const std::string& job) const { return c_.catalog_.List(job); }

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
    MutexLock lock(&c_.mu_);
    // Once stopping, the slots that show which steps are busy go away while abandoned writes are
    // left to the next daemon: nothing may be deleted under them.
    if (c_.stopping_) return Unavailable(kStoppingMessage);
    busy = c_.BusyStepsLocked(job);
  }
  if (step > 0) return c_.catalog_.DeleteCheckpoint(job, step, force, busy, dry_run);
  return c_.catalog_.CollectGarbage(job, keep, busy, dry_run);
}

std::string Daemon::EmaSegmentName(const std::string& job, uint32_t rank) const {
  return flashckpt::EmaSegmentName(job, rank, c_.ema_scope_);
}

DaemonStatus Daemon::GetStatus() const {
  DaemonStatus out;
  out.version = kVersion;
  out.uptime_seconds = std::chrono::duration<double>(c_.clock_.Now() - c_.started_).count();
  out.host_memory_used = c_.host_memory_used_.load();
  out.host_memory_budget = c_.config_.max_host_memory;
  out.root = c_.config_.root;
  out.node_name = c_.config_.node_name;
  const CudaInfo& cuda = GetCudaInfo();
  out.cuda_compiled = cuda.compiled;
  out.cuda_devices = cuda.devices;
  FillJobsStatus(&out);
  if (c_.sender_) out.replica_peers = c_.sender_->PeerStatus();
  if (c_.parity_) {
    out.ec_group = true;
    out.ec_member = c_.parity_->self();
    out.ec_members = c_.parity_->group().members();
    out.ec_parity = c_.parity_->group().parity();
    for (const ParityMemberStatus& m : c_.parity_->MemberStatus()) {
      out.parity_sent += m.blocks_sent;
      out.parity_failed += m.pushes_failed;
    }
  }
  // The checkpoints on disk, read without the daemon's lock: a slow or failing filesystem must not
  // hold up the trainers' snapshots.
  for (JobStatus& j : out.jobs) {
    auto latest = c_.catalog_.KnownLatest(j.job, kStatusRefresh);
    j.last_complete_step = latest.ok() && *latest ? **latest : -1;
    if (!latest.ok()) j.catalog_error = latest.status().ToString();
  }
  return out;
}

void Daemon::FillJobsStatus(DaemonStatus* out) const {
  MutexLock lock(&c_.mu_);
  const auto now = c_.clock_.Now();
  const std::vector<WriteInFlight> writing = c_.writer_ ? c_.writer_->InFlight() : std::vector<WriteInFlight>{};
  for (const auto& [name, job] : c_.jobs_) {
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
        const std::vector<int64_t> kept = c_.Slots(*rank.segment).ResidentSteps();  // newest first
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
        for (uint32_t i = 0; i < c_.Slots(*rank.segment).size(); ++i) {
          SlotStatus* s = &rs->slots.emplace_back();
          s->index = i;
          s->state = SlotStateName(c_.Slots(*rank.segment).at(i).state);
          s->step = c_.Slots(*rank.segment).at(i).step;
          // A FREE slot may hold a memory checkpoint (it is given up only for a newer snapshot).
          if (const auto held = c_.Slots(*rank.segment).ResidentIn(i);
              held && c_.Slots(*rank.segment).at(i).state == SlotState::kFree) {
            s->state = "memory";
            s->step = held->step;
          }
          if (c_.Slots(*rank.segment).at(i).state == SlotState::kFilling) {
            s->filling_seconds = std::chrono::duration<double>(now - c_.Slots(*rank.segment).at(i).handed_out).count();
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

// The calls each unit answers.
Result<std::string> Daemon::OpenSession(const std::string& job, uint32_t rank, bool reattach) {
  return registrar_.OpenSession(job, rank, reattach);
}
void Daemon::CloseSession(const std::string& session_id) { registrar_.CloseSession(session_id); }
Result<RegisterReply> Daemon::Register(const std::string& session_id, const Registration& registration) {
  return registrar_.Register(session_id, registration);
}
SessionCounts Daemon::CountSessions() const { return registrar_.CountSessions(); }
Result<SlotTicket> Daemon::BeginSnapshot(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout,
                                         SlotTier tier) {
  return save_.BeginSnapshot(session_id, step, timeout, tier);
}
Status Daemon::Commit(const std::string& session_id, const SlotTicket& ticket, int64_t step, bool persist,
                      std::optional<double> loss, std::string extra) {
  return save_.Commit(session_id, ticket, step, persist, loss, std::move(extra));
}
Status Daemon::AbortSnapshot(const std::string& session_id, const SlotTicket& ticket) {
  return save_.AbortSnapshot(session_id, ticket);
}
Result<WaitResult> Daemon::WaitPersisted(const std::string& session_id, int64_t step,
                                         std::chrono::milliseconds timeout) {
  return save_.WaitPersisted(session_id, step, timeout);
}
Status Daemon::WaitComplete(const std::string& session_id, int64_t step, std::chrono::milliseconds timeout) {
  return lineage_.WaitComplete(session_id, step, timeout);
}
Result<RestoreOutcome> Daemon::Restore(const std::string& session_id, int64_t step, const RestoreWant& want,
                                       std::chrono::milliseconds timeout) {
  return restorer_.Restore(session_id, step, want, timeout);
}
Result<RestoreCandidates> Daemon::Restorable(const std::string& session_id, std::chrono::milliseconds timeout,
                                             int64_t extra_of, bool verify) {
  return restorer_.Restorable(session_id, timeout, extra_of, verify);
}
Result<RestoreCandidates> Daemon::DiskExtra(const std::string& session_id, int64_t step) {
  return restorer_.DiskExtra(session_id, step);
}
Result<EmaCopy> Daemon::GetEma(const std::string& session_id, std::chrono::milliseconds timeout) {
  return restorer_.GetEma(session_id, timeout);
}
Status Daemon::ReleaseSlot(const std::string& session_id, const SlotTicket& ticket, const std::string& corrupt) {
  return restorer_.ReleaseSlot(session_id, ticket, corrupt);
}
Result<ReleaseOutcome> Daemon::ReleaseJob(const std::string& job, const std::string& reason, bool force,
                                          std::chrono::milliseconds timeout) {
  return releaser_.ReleaseJob(job, reason, force, timeout);
}

}  // namespace flashckpt
