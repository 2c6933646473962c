#include "daemon/pipeline/metadata_cache.h"

#include <sys/stat.h>

#include <algorithm>
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
  std::shared_ptr<Load> load;
  {
    MutexLock lock(&mu_);
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.dir == dir && e.id == id; });
    if (it != entries_.end()) {
      entries_.splice(entries_.begin(), entries_, it);  // most recently used
      load = it->load;
      // Another caller reads this version: wait for its outcome, whatever it is.
      while (!load->done) loaded_.Wait(&lock);
      if (!load->status.ok()) return load->status;
      return load->meta;
    }
    // Ours to read. Older versions of the same file go now.
    entries_.remove_if([&](const Entry& e) { return e.dir == dir && e.load->done; });
    load = std::make_shared<Load>();
    entries_.push_front(Entry{dir, id, load});
    ++loads_;
  }
  auto meta = ReadMetadataFor(dir, {}, io_);
  MutexLock lock(&mu_);
  load->done = true;
  if (meta.ok()) {
    load->meta = std::make_shared<const CheckpointMetadata>(std::move(*meta));
  } else {
    load->status = meta.status();
    // Not kept: the next caller reads again (those waiting now get this error).
    entries_.remove_if([&](const Entry& e) { return e.load == load; });
  }
  // Beyond capacity the least recently used finished entries go (one being read stays).
  size_t kept = 0;
  for (auto e = entries_.begin(); e != entries_.end();) {
    if (e->load->done && ++kept > capacity_) {
      e = entries_.erase(e);
    } else {
      ++e;
    }
  }
  loaded_.NotifyAll();
  if (!load->status.ok()) return load->status;
  return load->meta;
}

void MetadataCache::Forget(const std::string& dir) {
  MutexLock lock(&mu_);
  entries_.remove_if([&](const Entry& e) { return e.dir == dir && e.load->done; });
}

}  // namespace flashckpt
