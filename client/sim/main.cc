// flashckpt-sim: a simulated trainer rank (or, with --ranks-per-process N, N ranks on threads of
// one process, each with its own client session, so that a thousand ranks fit on one machine). It
// holds model and optimizer tensors laid out as a
// (tp, pp, shard) rank of a job, sets them to values defined by the step and the global element
// position, saves every K steps (and, with --memory-every M, takes a memory checkpoint every M
// steps) and, with --resume, restores and checks every element.
//
// Value at step s of element (i, j) of layer l: v = ((l*7919 + i*H + j) % 1000) / 1024 + s, exact
// in fp32 for s < 8192; exp_avg = v / 2, exp_avg_sq = v / 4.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "flashckpt/client.h"

namespace {

using flashckpt::Status;

struct Options {
  std::string socket, job;
  uint32_t rank = 0, ranks_per_process = 1, world_size = 1, tp_degree = 1, pp_degree = 1, shard_degree = 1;
  uint32_t layers = 4, hidden = 256;
  int64_t steps = 100, save_every = 10;
  std::optional<int64_t> memory_every;  // a memory checkpoint every M steps (not on save steps)
  std::optional<int64_t> hold_after;    // after this step's snapshot, wait to be killed
  bool resume = false;
  std::optional<int64_t> resume_step;  // restore this step instead of the latest
  bool tolerate_restarts = false;  // a save lost to a daemon restart is reported and training goes on
  uint32_t step_ms = 0;
  uint32_t wait_timeout_s = 120;
  int64_t first_step = 1;
  std::string run_id;
  bool fresh = false;
  bool wait_complete = true;  // at the end, wait for the last save's checkpoint to be complete
  std::optional<double> ema_decay;
  uint32_t ema_interval = 1;
  std::string ema_init = "first";
  std::optional<double> ema_loss_threshold;
  std::string dump_ema;
};

// The simulated loss: 1.0, with a spike of 10.0 on every 7th step (exercises the EMA loss gate).
double SimLoss(int64_t step) { return step % 7 == 0 ? 10.0 : 1.0; }

// One tensor of the simulated rank and its global geometry.
struct SimTensor {
  flashckpt::TensorSpec spec;
  uint32_t layer = 0;
  float scale = 1.0f;  // 1 for weights, 1/2 for exp_avg, 1/4 for exp_avg_sq
  std::vector<float> data;
};

class SimRank {
 public:
  explicit SimRank(const Options& o) : o_(o) {
    tp_ = o.rank % o.tp_degree;
    pp_ = (o.rank / o.tp_degree) % o.pp_degree;
    shard_ = o.rank / (o.tp_degree * o.pp_degree);
    // Row blocks of ceil(H/T) rows; the last tp rank's block may be shorter (uneven split).
    const uint64_t h = o.hidden, block = (h + o.tp_degree - 1) / o.tp_degree;
    const uint64_t first_row = tp_ * block, rows = std::min(block, h - first_row);
    for (uint32_t l = 0; l < o.layers; ++l) {
      if (l % o.pp_degree != pp_) continue;
      std::string base = "layers." + std::to_string(l) + ".weight";
      SimTensor w;
      w.layer = l;
      w.spec.name = base;
      w.spec.kind = flashckpt::TensorKind::kModel;
      w.spec.shape = {rows, h};
      w.spec.global_shape = {h, h};
      w.spec.box_offset = {first_row, 0};
      w.spec.box_shape = {rows, h};
      w.spec.replica = shard_ != 0;  // written to model_state by shard 0 only
      tensors_.push_back(std::move(w));
      const uint64_t n = rows * h, chunk = (n + o.shard_degree - 1) / o.shard_degree;
      const uint64_t begin = std::min<uint64_t>(n, shard_ * chunk), end = std::min<uint64_t>(n, begin + chunk);
      for (auto [suffix, scale] : {std::pair{".exp_avg", 0.5f}, std::pair{".exp_avg_sq", 0.25f}}) {
        SimTensor t;
        t.layer = l;
        t.scale = scale;
        t.spec.name = base + suffix;
        t.spec.kind = flashckpt::TensorKind::kOptimizer;
        t.spec.shape = {end - begin};
        t.spec.global_shape = {h, h};
        t.spec.box_offset = {first_row, 0};
        t.spec.box_shape = {rows, h};
        t.spec.flat_range = flashckpt::FlatRange{begin, end};
        tensors_.push_back(std::move(t));
      }
    }
    for (auto& t : tensors_) t.data.resize(Elements(t.spec));
  }

  flashckpt::Topology topology() const {
    return {o_.world_size, tp_, o_.tp_degree, pp_, o_.pp_degree, shard_, o_.shard_degree};
  }
  std::vector<flashckpt::TensorSpec> specs() const {
    std::vector<flashckpt::TensorSpec> out;
    for (const auto& t : tensors_) out.push_back(t.spec);
    return out;
  }
  std::vector<flashckpt::TensorBuffer> buffers() {
    std::vector<flashckpt::TensorBuffer> out;
    for (auto& t : tensors_) out.push_back({t.spec.name, t.data.data(), t.data.size() * sizeof(float)});
    return out;
  }

  void Fill(int64_t step) {
    for (auto& t : tensors_) {
      for (uint64_t k = 0; k < t.data.size(); ++k) t.data[k] = Expected(t, k, step);
    }
  }

  // Element count of the tensor an EMA tensor tracks (EMA tensors are named after it).
  uint64_t EmaElements(const std::string& name) const {
    for (const auto& t : tensors_) {
      if (t.spec.name == name) return t.data.size();
    }
    return 0;
  }

  // Number of elements equal bit for bit to the formula at `step`; prints the first mismatch.
  uint64_t Verify(int64_t step, bool* ok) const {
    uint64_t checked = 0;
    *ok = true;
    for (const auto& t : tensors_) {
      for (uint64_t k = 0; k < t.data.size(); ++k) {
        float want = Expected(t, k, step);
        if (std::memcmp(&want, &t.data[k], sizeof want) != 0) {
          std::fprintf(stderr, "mismatch rank=%u tensor=%s element=%" PRIu64 " got=%.9g want=%.9g\n", o_.rank,
                       t.spec.name.c_str(), k, static_cast<double>(t.data[k]), static_cast<double>(want));
          *ok = false;
          return checked;
        }
        ++checked;
      }
    }
    return checked;
  }

 private:
  static uint64_t Elements(const flashckpt::TensorSpec& s) {
    uint64_t n = 1;
    for (auto d : s.shape) n *= d;
    return n;
  }

  float Expected(const SimTensor& t, uint64_t k, int64_t step) const {
    const uint64_t h = o_.hidden;
    uint64_t flat = t.spec.flat_range ? t.spec.flat_range->begin + k : k;  // index within the box
    uint64_t i = t.spec.box_offset[0] + flat / h, j = flat % h;
    float v = static_cast<float>((uint64_t{t.layer} * 7919 + i * h + j) % 1000) / 1024.0f + static_cast<float>(step);
    return v * t.scale;
  }

  Options o_;
  uint32_t tp_ = 0, pp_ = 0, shard_ = 0;
  std::vector<SimTensor> tensors_;
};

// The errors a daemon restart causes: it is down (UNAVAILABLE), it forgot the slot it handed out
// (FAILED_PRECONDITION from a commit with a stale ticket), or a call was cut off.
bool IsDaemonLoss(const Status& s) {
  switch (s.code()) {
    case flashckpt::StatusCode::kUnavailable:
    case flashckpt::StatusCode::kCancelled:
    case flashckpt::StatusCode::kDeadlineExceeded:
    case flashckpt::StatusCode::kFailedPrecondition:
    case flashckpt::StatusCode::kInternal:
      return true;
    default:
      return false;
  }
}

// --hold-after: the state of `step` is taken; wait to be killed (a test kills every rank at the same
// step this way).
[[noreturn]] void Hold(int64_t step) {
  std::printf("holding step=%" PRId64 "\n", step);
  std::fflush(stdout);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

int Fail(const char* what, const Status& s) {
  std::fprintf(stderr, "flashckpt-sim: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

using Clock = std::chrono::steady_clock;

// What the training loop did: the time spent blocked in saves, the last save step (-1: none) and
// the number of saves.
struct TrainStats {
  Clock::duration blocked{};
  int64_t last_save = -1, saves = 0;
};

// Declares the command-line flags, which fill `o`.
void AddFlags(CLI::App& app, Options& o) {
  app.add_option("--socket", o.socket, "flashckptd socket")->required();
  app.add_option("--job", o.job, "job name")->required();
  app.add_option("--rank", o.rank, "rank (with --ranks-per-process N: the first of N)")->required();
  app.add_option("--ranks-per-process", o.ranks_per_process,
                 "run ranks --rank .. --rank+N-1 from this process, one thread and client session each")
      ->check(CLI::Range(1u, 4096u));
  app.add_option("--world-size", o.world_size, "world size")->required()->check(CLI::PositiveNumber);
  app.add_option("--tp-degree", o.tp_degree, "tensor-parallel degree")->check(CLI::PositiveNumber);
  app.add_option("--pp-degree", o.pp_degree, "pipeline-parallel degree")->check(CLI::PositiveNumber);
  app.add_option("--shard-degree", o.shard_degree, "optimizer sharding degree")->check(CLI::PositiveNumber);
  app.add_option("--layers", o.layers, "layers")->check(CLI::PositiveNumber);
  app.add_option("--hidden", o.hidden, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "last step")->check(CLI::Range(int64_t{1}, int64_t{8191}));
  app.add_option("--save-every", o.save_every, "save every K steps")->check(CLI::PositiveNumber);
  app.add_option("--memory-every", o.memory_every,
                 "take a memory checkpoint (kept by the daemon, not written) every M steps that are not save steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--hold-after", o.hold_after,
                 "after step S (and its snapshot, if any), print 'holding step=S' and wait to be killed")
      ->check(CLI::PositiveNumber);
  app.add_flag("--resume", o.resume, "restore the latest complete checkpoint first and verify it");
  app.add_option("--resume-step", o.resume_step, "restore this checkpoint instead of the latest (implies --resume)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--tolerate-daemon-restarts", o.tolerate_restarts,
               "a save that fails because the daemon is down or restarting is reported ('lost step=S') and "
               "training goes on; each acknowledged one is reported as 'committed step=S persist=0|1'");
  app.add_option("--step-ms", o.step_ms, "sleep per step, to stand in for compute");
  app.add_option("--wait-timeout", o.wait_timeout_s, "seconds to wait for the last save to be durable");
  app.add_option("--first-step", o.first_step, "first step when not resuming (a fresh start)")
      ->check(CLI::PositiveNumber);
  app.add_flag("!--no-wait-complete", o.wait_complete,
               "end once this rank's last save is durable, without waiting for the whole checkpoint to complete "
               "(for ranks whose peers are meant not to finish)");
  app.add_option("--run-id", o.run_id, "this run's id (the same on every rank; default: the daemon picks)");
  app.add_flag("--fresh", o.fresh,
               "start a new lineage of a job that has checkpoints of another run (they are deleted at the first "
               "save); without it such a start is refused unless --resume");
  app.add_option("--ema-decay", o.ema_decay, "keep an EMA of the weights with this decay");
  app.add_option("--ema-interval", o.ema_interval, "EMA update every I steps (persist=false snapshots between saves)");
  app.add_option("--ema-init", o.ema_init, "first or zeros")->check(CLI::IsMember({"first", "zeros"}));
  app.add_option("--ema-loss-threshold", o.ema_loss_threshold, "skip EMA updates whose loss is above it");
  app.add_option("--dump-ema", o.dump_ema, "at the end, write the daemon's current EMA as DIR/<tensor>.f32");
}

// Whether the degrees make up the world size with this rank in it and every tp rank gets a row;
// prints what is wrong otherwise.
bool CheckTopology(const Options& o) {
  if (uint64_t{o.tp_degree} * o.pp_degree * o.shard_degree != o.world_size ||
      uint64_t{o.rank} + o.ranks_per_process > o.world_size) {
    std::fprintf(stderr,
                 "flashckpt-sim: need world-size = tp*pp*shard degrees and rank + ranks-per-process <= world-size\n");
    return false;
  }
  if (uint64_t{o.tp_degree - 1} * ((o.hidden + o.tp_degree - 1) / o.tp_degree) >= o.hidden) {
    std::fprintf(stderr, "flashckpt-sim: --hidden is too small to give every tp rank at least one row\n");
    return false;
  }
  return true;
}

// The client's options from the flags.
flashckpt::ClientOptions ClientOptionsOf(const Options& o) {
  flashckpt::ClientOptions copts;
  copts.socket_path = o.socket;
  copts.job = o.job;
  copts.rank = o.rank;
  copts.run_id = o.run_id;
  copts.overwrite = o.fresh;
  copts.memory_checkpoints = o.memory_every.has_value();  // Register checks that the daemon can keep them
  return copts;
}

// The EMA options from the flags (--ema-*).
flashckpt::EmaOptions EmaOptionsOf(const Options& o) {
  flashckpt::EmaOptions ema;
  ema.decay = o.ema_decay;
  ema.interval = o.ema_interval;
  ema.init_zeros = o.ema_init == "zeros";
  ema.loss_threshold = o.ema_loss_threshold;
  return ema;
}

// --resume: restores the latest (or --resume-step) checkpoint, verifies every element and sets
// `*first` to the step after it. Returns the exit code of a failure, else 0.
int Resume(flashckpt::Client& c, SimRank& sim, const Options& o, int64_t* first) {
  auto restored = c.Restore(o.resume_step, sim.buffers(), std::chrono::seconds(o.wait_timeout_s));
  if (!restored.ok()) return Fail("restore", restored.status());
  if (!restored->found) {
    std::printf("resumed step=0 from=none verified_elements=0 (no complete checkpoint)\n");
  } else {
    bool ok = false;
    uint64_t n = sim.Verify(restored->step, &ok);
    if (!ok) return Fail("verify", flashckpt::Corruption("restored state differs from the formula"));
    std::printf("resumed step=%" PRId64 " from=%s verified_elements=%" PRIu64 " extra=%s\n", restored->step,
                restored->tier == flashckpt::Tier::kMemory ? "memory"
                : restored->tier == flashckpt::Tier::kPeer ? "peer"
                : restored->tier == flashckpt::Tier::kParity ? "parity"
                                                           : "disk",
                n, restored->extra.c_str());
    *first = restored->step + 1;
  }
  std::fflush(stdout);
  return 0;
}

// One training step: sets the state of `step` and takes the snapshot the step calls for (a save,
// a memory checkpoint or an EMA update), reporting it. Returns the exit code of a failure, else 0.
int RunStep(flashckpt::Client& c, SimRank& sim, const Options& o, int64_t step, TrainStats* stats) {
  sim.Fill(step);
  if (o.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.step_ms));
  bool save = step % o.save_every == 0;
  bool memory = !save && o.memory_every && step % *o.memory_every == 0;
  bool ema_step = o.ema_decay && step % o.ema_interval == 0;
  if (!save && !memory && !ema_step) {
    if (o.hold_after && step == *o.hold_after) Hold(step);
    return 0;
  }
  flashckpt::SnapshotOptions so;
  so.persist = save || memory;
  if (memory) so.tier = flashckpt::Tier::kMemory;
  so.loss = SimLoss(step);
  if (save || memory) so.extra = "{\"step\":" + std::to_string(step) + ",\"rank\":" + std::to_string(o.rank) + "}";
  auto t0 = Clock::now();
  auto snap = c.Snapshot(step, sim.buffers(), so);
  if (!snap.ok() && o.tolerate_restarts && IsDaemonLoss(snap.status())) {
    // A failed Commit may have reached the daemon's records before the daemon died: whether
    // that snapshot is kept is not known here.
    const bool uncertain = snap.status().message().rfind("Commit", 0) == 0;
    std::printf("lost step=%" PRId64 " persist=%d uncertain=%d code=%s\n", step, save ? 1 : 0, uncertain ? 1 : 0,
                std::string(flashckpt::StatusCodeName(snap.status().code())).c_str());
    std::fflush(stdout);
    return 0;
  }
  if (!snap.ok() && snap.status().message().find("is split") != std::string::npos) {
    std::printf("split step=%" PRId64 ": %s\n", step, snap.status().message().c_str());
    std::fflush(stdout);
  }
  if (!snap.ok()) return Fail("snapshot", snap.status());
  if (Status s = snap->WaitCopied(); !s.ok()) return Fail("copy", s);
  stats->blocked += Clock::now() - t0;
  if (o.tolerate_restarts) {
    std::printf("committed step=%" PRId64 " persist=%d\n", step, save ? 1 : 0);
    std::fflush(stdout);
  }
  if (memory) {
    std::printf("memory step=%" PRId64 "\n", step);
    std::fflush(stdout);
  }
  if (o.hold_after && step == *o.hold_after && !save) Hold(step);
  if (!save) return 0;
  stats->last_save = step;
  ++stats->saves;
  std::printf("saved step=%" PRId64 "\n", step);
  std::fflush(stdout);
  if (o.hold_after && step == *o.hold_after) Hold(step);
  return 0;
}

// Waits until the last save, `last_save`, is durable and (unless --no-wait-complete) its
// checkpoint complete. Returns the exit code of a failure, else 0.
int WaitLastSave(flashckpt::Client& c, const Options& o, int64_t last_save) {
  auto deadline = Clock::now() + std::chrono::seconds(o.wait_timeout_s);
  Status s = c.WaitPersisted(last_save, std::chrono::seconds(o.wait_timeout_s));
  while (!s.ok() && o.tolerate_restarts && IsDaemonLoss(s) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s = c.WaitPersisted(last_save, std::chrono::seconds(o.wait_timeout_s));
  }
  if (!s.ok() && s.message().find("is split") != std::string::npos) {
    std::printf("split step=%" PRId64 ": %s\n", last_save, s.message().c_str());
    std::fflush(stdout);
  }
  if (!s.ok()) return Fail("wait persisted", s);
  // The rank's part is durable; the checkpoint is complete once every rank's is, in one attempt.
  // A step that never can complete (ranks in different runs: a split) fails the rank, loudly.
  if (o.wait_complete) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    s = c.WaitComplete(last_save, std::max(left, std::chrono::milliseconds(1000)));
    if (!s.ok() && s.message().find("is split") != std::string::npos) {
      std::printf("split step=%" PRId64 ": %s\n", last_save, s.message().c_str());
      std::fflush(stdout);
      return Fail("wait complete (split)", s);
    }
    if (!s.ok()) return Fail("wait complete", s);
    std::printf("complete step=%" PRId64 "\n", last_save);
  }
  return 0;
}

// --dump-ema: writes the daemon's current EMA of each tensor as <dir>/<tensor>.f32. Returns the
// exit code of a failure, else 0.
int DumpEma(flashckpt::Client& c, const SimRank& sim, const Options& o) {
  if (c.EmaTensorNames().empty()) {
    // A rank whose weights are all replicas (shard rank > 0) holds no EMA: nothing to dump.
    std::printf("ema step=-1 tensors=0\n");
    return 0;
  }
  // The EMA of the last snapshot is applied asynchronously; a final persisted save orders it
  // before this read (WaitPersisted above), so callers dump after a save step.
  std::vector<std::string> names = c.EmaTensorNames();
  std::vector<std::vector<float>> storage(names.size());
  std::vector<flashckpt::TensorBuffer> bufs;
  for (size_t i = 0; i < names.size(); ++i) {
    storage[i].resize(sim.EmaElements(names[i]));
    bufs.push_back({names[i], storage[i].data(), storage[i].size() * sizeof(float)});
  }
  auto got = c.Ema(bufs, std::chrono::seconds(o.wait_timeout_s));
  if (!got.ok()) return Fail("ema", got.status());
  for (size_t i = 0; i < names.size(); ++i) {
    std::ofstream out(o.dump_ema + "/" + names[i] + ".f32", std::ios::binary);
    out.write(reinterpret_cast<const char*>(storage[i].data()),
              static_cast<std::streamsize>(storage[i].size() * sizeof(float)));
    if (!out) return Fail("dump ema", flashckpt::IOError("cannot write " + o.dump_ema + "/" + names[i] + ".f32"));
  }
  std::printf("ema step=%" PRId64 " tensors=%zu\n", got->step, names.size());
  return 0;
}

// One rank's whole run: register, resume if asked, train, wait for the last save. Returns its exit
// code.
int RunRank(const Options& o) {
  SimRank sim(o);
  auto client = flashckpt::Client::Connect(ClientOptionsOf(o));
  if (!client.ok()) return Fail("connect", client.status());
  flashckpt::Client& c = **client;
  if (Status s = c.Register(sim.topology(), sim.specs(), EmaOptionsOf(o)); !s.ok()) return Fail("register", s);

  int64_t first = o.first_step;
  if (o.resume || o.resume_step) {
    if (int rc = Resume(c, sim, o, &first); rc != 0) return rc;
  }

  TrainStats stats;
  for (int64_t step = first; step <= o.steps; ++step) {
    if (int rc = RunStep(c, sim, o, step, &stats); rc != 0) return rc;
  }
  if (stats.last_save > 0) {
    if (int rc = WaitLastSave(c, o, stats.last_save); rc != 0) return rc;
  }
  if (!o.dump_ema.empty()) {
    if (int rc = DumpEma(c, sim, o); rc != 0) return rc;
  }
  double blocked_ms = std::chrono::duration<double, std::milli>(stats.blocked).count();
  std::printf("done rank=%u last_step=%" PRId64 " saves=%" PRId64 " blocked_in_save_ms=%.3f\n", o.rank, o.steps,
              stats.saves, blocked_ms);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"flashckpt-sim: a simulated trainer rank that saves, resumes and checks its state"};
  AddFlags(app, o);
  CLI11_PARSE(app, argc, argv);
  if (!CheckTopology(o)) return 2;
  if (o.ranks_per_process > 1 && !o.dump_ema.empty()) {
    std::fprintf(stderr, "flashckpt-sim: --dump-ema writes one rank's EMA; it needs --ranks-per-process 1\n");
    return 2;
  }
  if (o.ranks_per_process == 1) return RunRank(o);

  // Each rank on a thread of its own, as the ranks of a node's processes would run; the process
  // fails when any rank does (each failure is printed by the rank that had it).
  std::vector<int> codes(o.ranks_per_process, 0);
  std::vector<std::thread> ranks;
  ranks.reserve(o.ranks_per_process);
  for (uint32_t k = 0; k < o.ranks_per_process; ++k) {
    Options mine = o;
    mine.rank = o.rank + k;
    ranks.emplace_back([mine, code = &codes[k]] { *code = RunRank(mine); });
  }
  for (std::thread& t : ranks) t.join();
  return *std::max_element(codes.begin(), codes.end());
}
