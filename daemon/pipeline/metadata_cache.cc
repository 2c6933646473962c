#include "daemon/pipeline/metadata_cache.h"

#include <sys/stat.h>

#include <cerrno>

namespace flashckpt {

uint64_t MetadataCache::loads() const {
  MutexLock lock(&mu_);
  return loads_;
}

Result<std::shared_ptr<const CheckpointMetadata>> MetadataCache::Get(const std::string& dir) {
  const std::string path = dir + "/metadata.json";
  struct stat st {};
  if (io_->Stat(path, &st) != 0) {
    if (errno == ENOENT) return NotFound(path + " does not exist: the checkpoint is not complete");
    return ErrnoStatus("stat", path);
  }
  const Identity id{st.st_ino, st.st_size, static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
  {
    MutexLock lock(&mu_);
    for (;;) {
      auto it = entries_.begin();
      while (it != entries_.end() && !(it->dir == dir && it->id == id)) ++it;
      if (it == entries_.end()) break;
      if (!it->loading) {
        entries_.splice(entries_.begin(), entries_, it);  // most recently used
        return it->meta;
      }
      loaded_.Wait(&lock);  // another caller reads this version: wait for it, then look again
    }
    // Ours to load. Older versions of the same file go now; the entry waiters find is this one.
    entries_.remove_if([&](const Entry& e) { return e.dir == dir && !e.loading; });
    entries_.push_front(Entry{dir, id, true, nullptr});
    ++loads_;
  }
  auto meta = ReadMetadataFile(dir, io_);
  MutexLock lock(&mu_);
  auto it = entries_.begin();
  while (it != entries_.end() && !(it->dir == dir && it->id == id && it->loading)) ++it;
  if (!meta.ok()) {
    if (it != entries_.end()) entries_.erase(it);  // errors are not kept: the next caller reads again
    loaded_.NotifyAll();
    return meta.status();
  }
  auto shared = std::make_shared<const CheckpointMetadata>(std::move(*meta));
  if (it != entries_.end()) {
    it->loading = false;
    it->meta = shared;
  }
  // Beyond capacity the least recently used loaded entries go (one being loaded stays).
  size_t loaded = 0;
  for (auto e = entries_.begin(); e != entries_.end();) {
    if (!e->loading && ++loaded > capacity_) {
      e = entries_.erase(e);
    } else {
      ++e;
    }
  }
  loaded_.NotifyAll();
  return shared;
}

}  // namespace flashckpt
