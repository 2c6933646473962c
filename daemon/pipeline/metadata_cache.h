// The metadata of the checkpoints a daemon reads, kept so that its ranks read each part once:
//
// - the head of metadata.json (everything but the pieces: job, step, run, files, EMA record): the
//   lineage check at every registration reads LATEST's run. Read through metadata.index.json
//   (ReadMetadataFor with no tensor names); kept while the file stays the same.
// - the pieces of a set of tensors (ReadMetadataFor with those names), for the ranks that restore
//   the same tensors at once (a node's ranks of one pipeline stage hold the same names, in other
//   boxes): each tensor's list of pieces holds every rank's, so a list read per rank would cost a
//   job of N ranks N reads of it. Kept only while a caller holds it, so what a finished restore read
//   is freed with it.
//
// metadata.json grows with the job (about 250 bytes per saved tensor piece: 196 MiB and seconds of
// parsing for 4096 ranks of 300 tensors); a checkpoint without a usable index is parsed whole.
//
// An entry is keyed by the file's path and the names, and checked against the file's identity
// (inode, size, modification time) with one stat on every lookup: a checkpoint deleted and written
// again under the same step is read again. Loads are shared: callers that ask while one reads the
// file wait for its result instead of reading it too. Errors are not kept. At most `capacity`
// entries, the least recently used go first. Thread-safe; no lock is held across the file system
// calls.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/format/metadata.h"
#include "common/io/io_env.h"

namespace flashckpt {

class MetadataCache {
 public:
  // `io`: not owned, outlives the cache.
  MetadataCache(IoEnv* io, size_t capacity) : io_(io), capacity_(capacity == 0 ? 1 : capacity) {}

  // The head of the metadata of checkpoint directory `dir`, without pieces (ReadMetadataFor's
  // result and errors with no names; kNotFound when it has no metadata.json).
  Result<std::shared_ptr<const CheckpointMetadata>> Get(const std::string& dir) EXCLUDES(mu_) {
    return GetFor(dir, {});
  }
  // The metadata with the pieces of the tensors named in `names` (ReadMetadataFor's result and
  // errors). Empty `names`: Get.
  Result<std::shared_ptr<const CheckpointMetadata>> GetFor(const std::string& dir, std::vector<std::string> names)
      EXCLUDES(mu_);

  // Drops what is kept of `dir` (its checkpoint was deleted): memory, not correctness, as every
  // lookup checks the file's identity.
  void Forget(const std::string& dir) EXCLUDES(mu_);

  // Reads and parses done since the start (the lookups that missed), for tests and the bench.
  uint64_t loads() const EXCLUDES(mu_);

 private:
  struct Identity {
    ino_t ino = 0;
    off_t size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const Identity& o) const { return ino == o.ino && size == o.size && mtime_ns == o.mtime_ns; }
  };
  // One read of a version of a file: the callers that wait for it share its outcome, also an
  // error (which is not kept for later callers: the entry goes).
  struct Load {
    bool done = false;
    Status status;  // once done: the read's error, or OK with `meta` (a head) or `held` set
    std::shared_ptr<const CheckpointMetadata> meta;
    std::weak_ptr<const CheckpointMetadata> held;  // pieces: alive while a caller holds them
    std::shared_ptr<const CheckpointMetadata> Meta() const { return meta ? meta : held.lock(); }
  };
  struct Entry {
    std::string dir;
    Identity id;
    std::vector<std::string> names;  // sorted, each once; empty: the head
    std::shared_ptr<Load> load;
  };

  IoEnv* const io_;
  const size_t capacity_;
  mutable Mutex mu_;
  CondVar loaded_;                              // a load is done
  std::list<Entry> entries_ GUARDED_BY(mu_);    // most recently used first
  uint64_t loads_ GUARDED_BY(mu_) = 0;
};

}  // namespace flashckpt
