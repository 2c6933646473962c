// libflashckpt: what a trainer rank calls to checkpoint through the local flashckptd.
//
// One Client per rank. Connect() opens the rank's session with the daemon (its end, including the
// process dying, tells the daemon this rank is gone). Register() declares the rank's tensors once;
// the daemon answers with a shared-memory segment that the client maps. Snapshot() copies the
// tensors into a free slot of that segment and commits it; the daemon persists it in the background.
//
//   auto client = flashckpt::Client::Connect({.socket_path = "/run/flashckpt/flashckptd.sock",
//                                             .job = "llama", .rank = 3});
//   client.value()->Register(topology, specs);
//   auto snap = client.value()->Snapshot(1200, buffers, {});
//   snap->WaitCopied();            // before the optimizer mutates the tensors
//   client.value()->WaitPersisted(1200, std::chrono::seconds(600));
//
// Thread safety: a Client may be used from one thread at a time; distinct Clients are independent.
// Blocking: every call has a deadline (ClientOptions::rpc_timeout or the argument). Errors are
// returned as Status, never thrown.
// Daemon restarts: Connect() and Register() wait out a daemon that is down or restarting, at any
// point of the call, for up to ClientOptions::connect_timeout. After them, while the daemon is
// down, calls fail with kUnavailable (within 250 ms when the socket is gone) and training can go
// on. The next call re-attaches on its own: a new session and
// the same registration (and the step this process restored, so its saves stay in the same
// attempt). A restarted daemon has adopted the old segment and persists the snapshots it had
// acknowledged; a snapshot whose Commit failed may or may not be persisted.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flashckpt/export.h"
#include "flashckpt/status.h"
#include "flashckpt/tensor.h"

namespace flashckpt {

struct ClientOptions {
  std::string socket_path;
  std::string job;
  uint32_t rank = 0;
  // Deadline of each control RPC (not of WaitPersisted/Restore, which take their own).
  std::chrono::milliseconds rpc_timeout{30000};
  // How long Connect() and Register() wait for an unavailable daemon (not started yet, restarting,
  // or killed during the call) before they fail with kUnavailable. A daemon serves within a few
  // seconds of its start (docs/ARCHITECTURE.md, "Start-up"); the default leaves room for that.
  std::chrono::milliseconds connect_timeout{10000};
  // How long Snapshot() waits for a free slot when the job's policy is to wait.
  std::chrono::milliseconds slot_timeout{60000};
  // Threads used to copy large host tensors; 0 picks min(hardware threads, 8).
  unsigned copy_threads = 0;
  // When no slot is free: wait up to slot_timeout (false) or fail at once with kResourceExhausted.
  bool skip_when_busy = false;
  // When a save fails in the background (a full disk, an I/O error): false (the default) reports it
  // on WaitPersisted and in the daemon's status only, and training goes on; true also makes every
  // later Snapshot() of this client fail with that error (its code, and a message naming the step,
  // the file and the errno text), so a job stops instead of training on without checkpoints.
  // Sent with Register().
  bool fatal_persist_errors = false;
  // The run this process belongs to: [A-Za-z0-9._:-]{1,64}, the same on every rank of one attempt
  // and different for the next (a scheduler's job id with its restart count, say). Empty: taken
  // from the environment (FLASHCKPT_RUN_ID; TORCHELASTIC_RUN_ID with TORCHELASTIC_RESTART_COUNT;
  // SLURM_JOB_ID with SLURM_RESTART_COUNT), else the daemon picks: the run of the job's live ranks
  // on it, or a new one (RunId() says which). A job whose ranks use several daemons needs one of
  // the first two, as the daemons do not talk to each other. Signals, metadata.json, the EMA and
  // status carry it; an EMA another run left is not continued, and signals of two runs never
  // complete a checkpoint.
  std::string run_id;
  // A run that did not restore may not save into a job that has complete checkpoints of another run
  // (its first Snapshot() fails with kFailedPrecondition): restore, use another job name, or set
  // this to start a new lineage, which makes the first Snapshot() delete the job's checkpoints that
  // are not this run's.
  bool overwrite = false;
  // This rank takes memory checkpoints (SnapshotOptions::tier = kMemory). Sent with Register(), which
  // then fails with kFailedPrecondition when the daemon cannot keep them (--slots below 2), rather
  // than the first memory Snapshot() mid-run. A rank with EMA tensors gets the EMA of the step back
  // with a memory checkpoint.
  bool memory_checkpoints = false;
};

// Memory of one registered tensor: `bytes` must equal its registered size.
//
// `data` may be host memory or, in a build with CUDA (FLASHCKPT_WITH_CUDA), CUDA device memory:
// the client asks cudaPointerGetAttributes which it is, so `on_device` is optional there. Set it
// when `data` is device memory to have the client refuse it with a clear error (instead of
// reading it as host memory) where it cannot copy it: in a build without CUDA, or in a process
// that sees no CUDA device.
struct TensorBuffer {
  std::string name;
  void* data = nullptr;
  uint64_t bytes = 0;
  bool on_device = false;
};

// The job's exponential moving average of the weights, kept by the daemon on the CPU:
// ema = decay * ema + (1 - decay) * weights, in fp32, on every snapshot whose step is a multiple of
// `interval` (snapshots with persist=false count too). It covers every master_weight tensor and the
// fp32 model tensors without one (bf16/fp16 too with all_float_params), and each checkpoint carries
// it as ema.tpXX_ppYY_shardZZ.safetensors.
struct EmaOptions {
  std::optional<double> decay;  // 0 < decay < 1; nullopt: no EMA
  uint32_t interval = 1;
  bool init_zeros = false;      // false: the first update copies the weights
  bool all_float_params = false;
  std::optional<double> loss_threshold;  // skip (and count) updates whose snapshot loss is above it
};

struct EmaResult {
  bool initialized = false;  // false: no update applied yet; buffers untouched
  int64_t step = -1;         // step of the last update
};

// Where a snapshot goes. kDisk: written as checkpoint files in the background. kMemory: a memory
// checkpoint, kept in the daemon's shared memory and never written; it outlives this process (not
// the daemon's node) and a later Restore of its step, by this rank, is served from memory. The
// daemon keeps the rank's newest memory checkpoint until a newer one is kept, so it needs at least
// 2 slots; not yet for ranks with EMA.
// kPeer only says where a restore came from (RestoreResult::tier): a replica of the rank's memory
// checkpoint that its daemon fetched from a peer daemon (flashckptd --replicate-to). kParity the same:
// the rank's memory checkpoint rebuilt by its daemon from its parity group (flashckptd --ec-group).
enum class Tier : uint8_t { kDisk, kMemory, kPeer, kParity };

struct SnapshotOptions {
  bool persist = true;           // false: hand to the daemon (e.g. for the EMA) but do not write files
  Tier tier = Tier::kDisk;       // kMemory: every tensor, replicas included, kept in memory (persist must be true)
  std::optional<double> loss;    // passed to the daemon with the commit
  std::string extra;             // opaque trainer state (JSON or bytes), saved as extra.rankNNNNN.json
  // The cudaStream_t the caller computes the device tensors on (nullptr: the legacy default
  // stream). The device copies start after the work queued on it before Snapshot() is called, so
  // they see the tensors as of the call. Unused for host tensors and in builds without CUDA.
  void* cuda_stream = nullptr;
};

namespace detail {
struct SnapshotProgress;  // the state a device snapshot shares with the client's commit thread
}

// A snapshot in flight.
//
// Host tensors are copied and the snapshot committed before Snapshot() returns: both waits return
// at once. Device tensors are copied by cudaMemcpyAsync on the client's copy stream, in chunks; a
// client thread queues them, sends the commit once they are queued and tells the daemon (through
// the slot's header) how far the copies have come as each chunk completes, so the daemon
// checksums and writes the first chunks while later ones are in flight; a save whose copies fail
// or stall fails. Copyable; thread-safe.
class FLASHCKPT_API SnapshotHandle {
 public:
  int64_t step() const { return step_; }
  // Blocks until the tensors may be modified again (the device-to-host copies are complete) and
  // returns their error, if any. Call it before the optimizer step mutates the tensors; it does not
  // wait for the commit.
  Status WaitCopied() const;
  // Blocks until the daemon has acknowledged (or refused) the commit and returns its answer; with
  // device tensors the copies may still be in flight then. A refused snapshot gives its slot back
  // on its own; its step is not persisted.
  Status WaitCommitted() const;

 private:
  friend class Client;
  int64_t step_ = 0;
  std::shared_ptr<detail::SnapshotProgress> progress_;  // null: done before Snapshot() returned
};

struct RestoreOptions {
  // Fill bf16/fp16 tensors from the fp32 ones of the checkpoint (rounded to nearest, ties to even).
  // Without it a dtype that differs from the checkpoint's is kFailedPrecondition.
  bool convert_dtype = false;
  // The cudaStream_t that will use the device tensors (nullptr: the legacy default stream): the
  // copies into them wait for the work queued on it so far, and work queued on it after Restore()
  // returns sees the restored bytes. Restore() returns once the copies are complete.
  void* cuda_stream = nullptr;
  // Restore only the tensors of these kinds (empty: all); the buffers of other kinds are left as
  // they are, and the EMA is not loaded. E.g. {kModel}: pretrained weights with a fresh optimizer.
  // A kind the checkpoint holds no tensor of is kFailedPrecondition naming it.
  std::vector<TensorKind> kinds;
  // Read the checkpoint from this job under the daemon's root instead of the session's own (needs
  // `kinds`). It starts no attempt of this job: the session's saves stay those of a fresh start.
  std::string source_job;
};

struct RestoreResult {
  bool found = false;  // false: the job has no complete checkpoint yet; buffers are untouched
  int64_t step = 0;
  std::string extra;   // this rank's extra state of that checkpoint
  uint64_t bytes = 0;  // bytes copied into the caller's buffers
  Tier tier = Tier::kDisk;  // kMemory: from this rank's memory checkpoint of `step`, verified, no file read;
                            // kPeer: the same, from a replica its daemon fetched from a peer;
                            // kParity: the same, rebuilt by its daemon from its parity group
};

// What this rank can restore (Client::Restorable), for the ranks of its job to agree on one step.
struct RestorableSteps {
  std::vector<int64_t> memory_steps;  // its memory checkpoints on this node, verified, newest first
  std::optional<int64_t> disk_step;   // the job's newest complete checkpoint on disk, if any
  std::string extra;                  // with `extra_of`: that memory step's extra state
};

class FLASHCKPT_API Client {
 public:
  // Connects to the daemon and opens this rank's session.
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Declares the rank's tensors and maps the segment the daemon creates for them. Calling it again
  // with a different layout replaces the previous one.
  Status Register(const Topology& topology, const std::vector<TensorSpec>& tensors, const EmaOptions& ema = {});

  // Maps the pages of every slot for writing on a client thread, the first slot first, and returns
  // (at once, once a device snapshot's commit thread, if one runs, is done): the first-touch faults
  // (the kernel zeroing fresh shared memory) that the first snapshot into each slot would otherwise
  // take while the trainer waits. Call it after Register() when the
  // first snapshot is some steps away. Snapshot() and Restore() may run while it works; it runs once
  // per mapping (the first snapshot starts it when it has not run) and stops when the segment is
  // unmapped. FailedPrecondition before Register().
  Status Populate();

  // The run this client's session belongs to (ClientOptions::run_id, or the daemon's choice);
  // empty before Register().
  const std::string& RunId() const;

  // Names of the EMA tensors this rank holds (empty without EMA); each is fp32 with the shape of
  // the tensor it tracks.
  std::vector<std::string> EmaTensorNames() const;
  // Copies the daemon's current EMA into `buffers` (by EMA tensor name, all of them).
  Result<EmaResult> Ema(const std::vector<TensorBuffer>& buffers, std::chrono::milliseconds timeout);

  // Copies every non-replica registered tensor from `buffers` into a free slot and commits it as
  // `step`; the daemon persists it in the background. With host memory only, returns when the
  // copies are done and the commit acknowledged. With device memory (CUDA builds), returns once an
  // event is recorded on options.cuda_stream: a client thread queues the device-to-host copies on
  // the client's copy stream behind it, commits, and reports the copies' progress to the daemon
  // (SnapshotHandle); the handle's WaitCopied() tells when the tensors may change again. With device
  // tensors only (and skip_when_busy off) that thread also takes the slot (BeginSnapshot, waiting
  // for a free one), so the daemon's refusal of the snapshot (an already complete step, a stale
  // launch, a slot wait that timed out) is the handle's WaitCommitted() answer rather than this
  // call's error; with host tensors among them the slot is taken here. The next call on this
  // Client waits for that thread (the commit and the copies) first. The slots are pinned
  // (cudaHostRegister) by that thread at the first device copy after the segment is mapped, on the
  // device current at the call, and unpinned when it is unmapped.
  // With persist=false (EMA-only) only the tensors the EMA reads are copied (and required);
  // buffers of other tensors are accepted and ignored.
  Result<SnapshotHandle> Snapshot(int64_t step, const std::vector<TensorBuffer>& buffers,
                                  const SnapshotOptions& options);

  // Blocks until this rank's files of `step` (or a later step) are durable, the save of `step`
  // failed, or `timeout` passes (kDeadlineExceeded).
  Status WaitPersisted(int64_t step, std::chrono::milliseconds timeout);
  // Blocks until checkpoint `step` is complete: every rank's files are durable and metadata.json is
  // written, whichever daemon completed it. Fails with this rank's save error; kFailedPrecondition
  // when the step can never complete (its ranks saved it in different attempts: a rank restored
  // while the others went on; the message names the ranks and attempts); kDeadlineExceeded naming
  // the ranks whose part is missing when `timeout` passes.
  Status WaitComplete(int64_t step, std::chrono::milliseconds timeout);

  // Restores `step` (nullopt: the latest complete checkpoint) into `buffers`, which must name every
  // registered tensor. Checksums of a checkpoint read from files are verified by the daemon before
  // any byte reaches the buffers. When this rank holds a memory checkpoint of `step` (nullopt, in a
  // job of one rank: its newest, if not older than the latest complete checkpoint), that is
  // restored instead (result.tier); into host buffers this client checks each chunk right before it
  // copies it (device buffers: the daemon checks the whole slot first). One that fails its checksums
  // is never restored: it is dropped and the files are read, overwriting whatever of it was copied;
  // when there is no file to read, this fails with kCorruption instead of answering found=false.
  // The checkpoint may have been saved in another parallel layout: the daemon reads the parts of it
  // this rank's tensors cover. In a job of several ranks, nullopt restores the job's plan: the
  // newest memory step every rank holds (here or as a peer's replica), unless the disk has a newer
  // complete one, on every rank alike. In a job that takes memory checkpoints (ClientOptions::
  // memory_checkpoints) the ranks served by other daemons are agreed with through the root: every
  // rank of the job must then ask for the latest within `timeout` (else kDeadlineExceeded, naming
  // the ranks that did not).
  Result<RestoreResult> Restore(std::optional<int64_t> step, const std::vector<TensorBuffer>& buffers,
                                std::chrono::milliseconds timeout, const RestoreOptions& options = {});

  // This rank's candidates for the step its job restores: its memory checkpoints on this node (each
  // verified now; one that fails is dropped and not listed) and the job's newest complete checkpoint
  // on disk. The ranks of a job exchange these (e.g. through their process group), pick the newest
  // step every rank has in memory, else the disk's, and each Restore()s that step. Works before
  // Register(). `timeout` bounds the wait for the checksums of the last memory checkpoints.
  // `extra_of`: only that memory step is looked at (listed when held and verified), and its extra
  // state (SnapshotOptions::extra) is answered, e.g. to learn what to register before restoring it.
  // verify=false: the memory checkpoints held are listed without being read against their checksums,
  // for a caller that Restore()s one of them next, since a restore verifies what it hands over (this
  // client each chunk as it copies it into host buffers, the daemon before a copy to the device):
  // the checkpoint is then read once, not twice.
  Result<RestorableSteps> Restorable(std::chrono::milliseconds timeout, std::optional<int64_t> extra_of = std::nullopt,
                                     bool verify = true);
  // The extra state this rank saved with complete checkpoint `step` on disk (nullopt: the newest),
  // read from its files without reading a tensor or needing Register(): what a trainer learns the
  // checkpoint's structure from before it registers and restores it. `disk_step` is that step
  // (unset: no such complete checkpoint) and `extra` is empty when it holds no part of this rank
  // (a job of fewer ranks saved it). memory_steps stays empty.
  Result<RestorableSteps> DiskExtra(std::optional<int64_t> step, std::chrono::milliseconds timeout);

  // The daemon's status as JSON: its version, memory budget and use, and every job and rank it knows
  // (slots, last steps, errors, EMA), i.e. the GetStatus RPC's StatusResponse in protobuf's JSON
  // mapping with the proto field names (snake_case; 64-bit integers are JSON strings).
  Result<std::string> StatusJson();

  // Closes the session; later calls fail with kCancelled. Also done by the destructor.
  void Close();

 private:
  struct FLASHCKPT_HIDDEN Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashckpt
