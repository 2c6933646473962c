#include "daemon/pipeline/metadata_cache.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

namespace flashckpt {

uint64_t MetadataCache::loads() const {
  MutexLock lock(&mu_);
  return loads_;
}

Result<std::shared_ptr<const CheckpointMetadata>> MetadataCache::GetFor(const std::string& dir,
                                                                        std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
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
    auto it = std::find_if(entries_.begin(), entries_.end(),
                           [&](const Entry& e) { return e.dir == dir && e.id == id && e.names == names; });
    if (it != entries_.end()) {
      entries_.splice(entries_.begin(), entries_, it);  // most recently used
      load = it->load;
      // Another caller reads this version: wait for its outcome, whatever it is.
      while (!load->done) loaded_.Wait(&lock);
      if (!load->status.ok()) return load->status;
      if (auto meta = load->Meta()) return meta;
      // Pieces whose callers are all done with them are gone: read again, below.
      entries_.remove_if([&](const Entry& e) { return e.load == load; });
    }
    // Ours to read. What was read of older versions of the file goes now.
    entries_.remove_if([&](const Entry& e) { return e.dir == dir && !(e.id == id) && e.load->done; });
    load = std::make_shared<Load>();
    entries_.push_front(Entry{dir, id, names, load});
    ++loads_;
  }
  auto read = ReadMetadataFor(dir, names, io_);
  std::shared_ptr<const CheckpointMetadata> meta;
  if (read.ok()) meta = std::make_shared<const CheckpointMetadata>(std::move(*read));
  MutexLock lock(&mu_);
  load->done = true;
  if (meta != nullptr && names.empty()) {
    load->meta = meta;
  } else if (meta != nullptr) {
    load->held = meta;
  } else {
    load->status = read.status();
    // Not kept: the next caller reads again (those waiting now get this error).
    entries_.remove_if([&](const Entry& e) { return e.load == load; });
  }
  // Beyond capacity the least recently used finished entries go (one being read stays), and
  // pieces no caller holds any more go at once.
  size_t kept = 0;
  for (auto e = entries_.begin(); e != entries_.end();) {
    const bool gone = e->load->done && e->load->status.ok() && e->load->Meta() == nullptr;
    if (gone || (e->load->done && ++kept > capacity_)) {
      e = entries_.erase(e);
    } else {
      ++e;
    }
  }
  loaded_.NotifyAll();
  if (!load->status.ok()) return load->status;
  return meta;
}

void MetadataCache::Forget(const std::string& dir) {
  MutexLock lock(&mu_);
  entries_.remove_if([&](const Entry& e) { return e.dir == dir && e.load->done; });
}

}  // namespace flashckpt
