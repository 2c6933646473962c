#include "daemon/pipeline/launches.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <vector>

#include "common/base/log.h"
#include "common/base/names.h"
#include "common/io/fs.h"
#include "common/io/shm.h"

namespace flashckpt {
namespace {

// Rounds of "claim in the newest launch, else begin the next": each lost round means another process
// of the same rank claimed the launch just begun, which only a rank launched twice at once does.
constexpr int kRounds = 8;

std::optional<uint64_t> LaunchNumber(const std::string& name) {
  if (name.empty() || name.size() > 18 || name.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  return std::stoull(name);
}

// The launch's run id, world size and how long ago it began (the run file's mtime; it is written
// once). The file: "<run id> <world size>\n".
struct Begun {
  std::string run_id;
  uint32_t world_size = 0;
  std::chrono::seconds age{0};
};

Result<Begun> ReadLaunch(const std::string& folder) {
  const std::string path = folder + "/run";
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 256));
  const size_t space = text.find(' ');
  const std::string run = text.substr(0, space);
  const std::string size = space == std::string::npos ? "" : text.substr(space + 1, text.find('\n') - space - 1);
  if (Status valid = ValidateRunId(run); !valid.ok() || run.empty() || size.empty() || size.size() > 9 ||
                                           size.find_first_not_of("0123456789") != std::string::npos) {
    return Corruption(path + " does not hold a run id and a world size: '" + text.substr(0, 80) + "'");
  }
  Begun begun;
  begun.run_id = run;
  begun.world_size = static_cast<uint32_t>(std::stoul(size));
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus("stat", path);
  const auto began = std::chrono::system_clock::from_time_t(st.st_mtime);
  const auto age = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now() - began);
  begun.age = std::max(age, std::chrono::seconds(0));
  return begun;
}

// Claims rank `rank` in the launch folder: true when this call created the claim, false when it
// was there already.
Result<bool> Claim(const std::string& folder, uint32_t rank) {
  const std::string path = folder + "/rank-" + std::to_string(rank);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return false;
    return ErrnoStatus("create", path);
  }
  ::close(fd);
  return true;
}

}  // namespace

Launches::Launches(std::string root, std::chrono::seconds join_window)
    : root_(std::move(root)), join_window_(join_window) {}

Result<uint64_t> Launches::Newest(const std::string& job) const {
  RETURN_IF_ERROR(ValidateJobName(job));
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(root_ + "/" + job + "/" + kFolder));
  uint64_t newest = 0;
  if (names) {
    for (const std::string& name : *names) {
      if (auto n = LaunchNumber(name)) newest = std::max(newest, *n);
    }
  }
  return newest;
}

Result<LaunchChoice> Launches::Join(const std::string& job, uint32_t rank, uint32_t world_size,
                                    const std::string& drawn, const std::set<std::string>& live_runs) const {
  RETURN_IF_ERROR(ValidateJobName(job));
  const std::string dir = root_ + "/" + job + "/" + kFolder;
  RETURN_IF_ERROR(MakeDirs(dir));
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
  uint64_t newest = 0;
  for (const std::string& name : names) {
    if (auto n = LaunchNumber(name)) newest = std::max(newest, *n);
  }
  for (int round = 0; round < kRounds; ++round) {
    if (newest > 0) {
      const std::string folder = dir + "/" + std::to_string(newest);
      ASSIGN_OR_RETURN(Begun launch, ReadLaunch(folder));
      if (launch.world_size == world_size && (launch.age < join_window_ || live_runs.count(launch.run_id) != 0)) {
        ASSIGN_OR_RETURN(bool claimed, Claim(folder, rank));
        if (claimed) return LaunchChoice{newest, launch.run_id, false};
      }
    }
    // Begin the next launch: made aside, then renamed into place; a rename that finds the folder
    // there lost the race to another daemon (or process), whose launch this rank then joins.
    const uint64_t next = newest + 1;
    ASSIGN_OR_RETURN(std::string token, RandomToken());
    const std::string aside = dir + "/begin-" + token;
    if (::mkdir(aside.c_str(), 0755) != 0) return ErrnoStatus("mkdir", aside);
    Status written = WriteFileDurably(aside, "run", drawn + " " + std::to_string(world_size) + "\n");
    bool began = false;
    if (written.ok()) {
      const std::string target = dir + "/" + std::to_string(next);
      if (::rename(aside.c_str(), target.c_str()) == 0) {
        began = true;
        written = FsyncDir(dir);
      } else if (errno != EEXIST && errno != ENOTEMPTY) {
        written = ErrnoStatus("rename " + aside + " to", target);
      }
    }
    if (!began) (void)RemoveTree(aside);
    RETURN_IF_ERROR(written);
    const std::string folder = dir + "/" + std::to_string(next);
    ASSIGN_OR_RETURN(Begun launch, ReadLaunch(folder));
    if (launch.world_size != world_size) {  // begun by a rank of another layout at the same moment
      newest = next;
      continue;
    }
    ASSIGN_OR_RETURN(bool claimed, Claim(folder, rank));
    if (began && next > kKept) {
      // Old launches only cost a listing entry each; the newest few are kept for operators to read.
      for (const std::string& name : names) {
        auto n = LaunchNumber(name);
        if (n && *n + kKept <= next) (void)RemoveTree(dir + "/" + name);
      }
    }
    if (claimed) {
      if (began) Logger("rpc")->info("launch begun job={} launch={} run={} rank={}", job, next, launch.run_id, rank);
      return LaunchChoice{next, launch.run_id, began};
    }
    newest = next;  // another process of this rank claimed it first: the launch after it
  }
  return FailedPrecondition("rank " + std::to_string(rank) + " of job '" + job + "' found its place taken in " +
                            std::to_string(kRounds) + " launches in a row under " + dir +
                            ": several processes register as this rank at once");
}

}  // namespace flashckpt
