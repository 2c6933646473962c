// The daemons' agreement on the step a job's ranks restore: see resume_agreement.h.

#include "daemon/core/resume_agreement.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/format/checksum.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

using nlohmann::json;

constexpr const char* kViewPrefix = "view-";
constexpr const char* kPlanPrefix = "plan-";
constexpr const char* kSuffix = ".json";

bool HasForm(const std::string& name, const std::string& prefix) {
  return name.size() > prefix.size() + 5 && name.compare(0, prefix.size(), prefix) == 0 &&
         name.compare(name.size() - 5, 5, kSuffix) == 0;
}

// A token or daemon name: what a file name and a JSON string may hold without escaping.
bool ValidToken(const std::string& t) {
  if (t.empty() || t.size() > 64) return false;
  return std::all_of(t.begin(), t.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == ':' || c == '-' ||
           c == '_';
  });
}

struct View {
  int64_t written_ms = 0;
  int64_t disk = 0;
  std::vector<RankView> ranks;
};

// A view of a job of `world` ranks, or nullopt for anything else (another world, a malformed file).
std::optional<View> ParseView(const std::string& text, uint32_t world) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  auto world_it = j.find("world");
  auto written = j.find("written_ms");
  auto disk = j.find("disk");
  auto ranks = j.find("ranks");
  if (world_it == j.end() || !world_it->is_number_unsigned() || world_it->get<uint64_t>() != world ||
      written == j.end() || !written->is_number_integer() || disk == j.end() || !disk->is_number_integer() ||
      disk->get<int64_t>() < 0 || ranks == j.end() || !ranks->is_array() || ranks->size() > world) {
    return std::nullopt;
  }
  View v;
  v.written_ms = written->get<int64_t>();
  if (v.written_ms < 0) return std::nullopt;
  v.disk = disk->get<int64_t>();
  for (const json& r : *ranks) {
    if (!r.is_object()) return std::nullopt;
    auto rank = r.find("rank");
    auto token = r.find("token");
    auto steps = r.find("steps");
    if (rank == r.end() || !rank->is_number_unsigned() || rank->get<uint64_t>() >= world || token == r.end() ||
        !token->is_string() || !ValidToken(token->get<std::string>()) || steps == r.end() || !steps->is_array() ||
        steps->size() > ResumeAgreement::kMaxSteps) {
      return std::nullopt;
    }
    RankView rv;
    rv.rank = static_cast<uint32_t>(rank->get<uint64_t>());
    rv.token = token->get<std::string>();
    for (const json& s : *steps) {
      if (!s.is_number_integer() || s.get<int64_t>() <= 0) return std::nullopt;
      rv.steps.push_back(s.get<int64_t>());
    }
    v.ranks.push_back(std::move(rv));
  }
  return v;
}

// The tokens a plan was made for, and its decision; nullopt for a malformed file or another world.
std::optional<std::pair<std::map<uint32_t, std::string>, AgreedPlan>> ParsePlan(const std::string& text,
                                                                                uint32_t world) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  auto world_it = j.find("world");
  auto found = j.find("found");
  auto step = j.find("step");
  auto tier = j.find("tier");
  auto ranks = j.find("ranks");
  if (world_it == j.end() || !world_it->is_number_unsigned() || world_it->get<uint64_t>() != world ||
      found == j.end() || !found->is_boolean() || step == j.end() || !step->is_number_integer() ||
      step->get<int64_t>() < 0 || tier == j.end() || !tier->is_string() || ranks == j.end() || !ranks->is_object() ||
      ranks->size() != world) {
    return std::nullopt;
  }
  AgreedPlan plan;
  plan.found = found->get<bool>();
  plan.step = step->get<int64_t>();
  const std::string t = tier->get<std::string>();
  if (t != "memory" && t != "disk") return std::nullopt;
  plan.memory = t == "memory";
  if (plan.found != (plan.step > 0) || (plan.memory && !plan.found)) return std::nullopt;
  std::map<uint32_t, std::string> tokens;
  for (const auto& [key, value] : ranks->items()) {
    char* end = nullptr;
    const unsigned long r = std::strtoul(key.c_str(), &end, 10);
    if (key.empty() || *end != '\0' || r >= world || !value.is_string() || !ValidToken(value.get<std::string>())) {
      return std::nullopt;
    }
    tokens[static_cast<uint32_t>(r)] = value.get<std::string>();
  }
  if (tokens.size() != world) return std::nullopt;
  return std::make_pair(std::move(tokens), plan);
}

std::string Hex16(uint64_t v) {
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(v));
  return out;
}

}  // namespace

ResumeAgreement::ResumeAgreement(std::string dir, std::string daemon, IoEnv* io, const Clock& clock)
    : dir_(std::move(dir)), daemon_(std::move(daemon)), io_(io), clock_(clock) {}

Status ResumeAgreement::PublishView(uint32_t world, const std::vector<RankView>& mine, int64_t disk) {
  if (!ValidToken(daemon_)) return InvalidArgument("daemon name '" + daemon_ + "' cannot name a view file");
  json ranks = json::array();
  for (const RankView& r : mine) {
    if (r.rank >= world || !ValidToken(r.token)) {
      return InvalidArgument("rank " + std::to_string(r.rank) + " of a world of " + std::to_string(world) +
                             " with token '" + r.token + "' cannot be published");
    }
    std::vector<int64_t> steps = r.steps;
    if (steps.size() > kMaxSteps) steps.resize(kMaxSteps);  // newest first: the oldest go
    ranks.push_back({{"rank", r.rank}, {"token", r.token}, {"steps", steps}});
  }
  const std::string body = ranks.dump() + "|" + std::to_string(disk);
  // Rewritten when it changes, and often enough to stay fresh while this daemon waits.
  const auto now = clock_.Now();
  if (body == last_view_ && now - last_written_ < kViewRefresh) return Status::OK();
  json view = {{"world", world}, {"written_ms", clock_.WallMs()}, {"disk", disk}, {"ranks", std::move(ranks)}};
  RETURN_IF_ERROR(MakeDirs(dir_, 0755, io_));
  RETURN_IF_ERROR(WriteFileDurably(dir_, kViewPrefix + daemon_ + kSuffix, view.dump(), nullptr, io_));
  last_view_ = body;
  last_written_ = now;
  return Status::OK();
}

Result<std::optional<AgreedPlan>> ResumeAgreement::FindPlan(uint32_t world, const std::vector<RankView>& mine) {
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(dir_, io_));
  if (!names) return std::optional<AgreedPlan>();
  for (const std::string& name : *names) {
    if (!HasForm(name, kPlanPrefix)) continue;
    auto text = ReadSmallFile(dir_ + "/" + name, kMaxFileBytes, io_);
    if (!text.ok()) continue;  // removed meanwhile, or being written: the next round reads it
    auto parsed = ParsePlan(*text, world);
    if (!parsed) continue;
    const auto& tokens = parsed->first;
    bool ours = !mine.empty();
    for (const RankView& r : mine) {
      auto it = tokens.find(r.rank);
      ours = ours && it != tokens.end() && it->second == r.token;
    }
    if (!ours) continue;
    AgreedPlan plan = parsed->second;
    plan.file = dir_ + "/" + name;
    return std::optional<AgreedPlan>(plan);
  }
  return std::optional<AgreedPlan>();
}

Result<std::optional<AgreedPlan>> ResumeAgreement::Round(uint32_t world, const std::vector<RankView>& mine,
                                                         int64_t disk) {
  if (world == 0 || world > kMaxWorld) return InvalidArgument("a world of " + std::to_string(world) + " ranks");
  RETURN_IF_ERROR(PublishView(world, mine, disk));
  ASSIGN_OR_RETURN(std::optional<AgreedPlan> made, FindPlan(world, mine));
  if (made) return made;

  // Every rank's newest fresh entry, from every daemon's view.
  struct Entry {
    int64_t written_ms = -1;
    const RankView* view = nullptr;
  };
  std::vector<View> views;
  ASSIGN_OR_RETURN(auto names, ListDirIfExists(dir_, io_));
  const int64_t now_ms = clock_.WallMs();
  if (names) {
    for (const std::string& name : *names) {
      if (!HasForm(name, kViewPrefix)) continue;
      auto text = ReadSmallFile(dir_ + "/" + name, kMaxFileBytes, io_);
      if (!text.ok()) continue;
      auto view = ParseView(*text, world);
      // Another world, a resume that is over, or a time ahead of this clock by more than it may be.
      if (!view || now_ms - view->written_ms > kViewFresh.count() || view->written_ms - now_ms > kViewFresh.count()) {
        continue;
      }
      views.push_back(std::move(*view));
    }
  }
  std::vector<Entry> entries(world);
  int64_t newest_disk = disk;
  for (const View& v : views) {
    newest_disk = std::max(newest_disk, v.disk);
    for (const RankView& r : v.ranks) {
      if (v.written_ms > entries[r.rank].written_ms) entries[r.rank] = Entry{v.written_ms, &r};
    }
  }
  missing_.clear();
  for (uint32_t r = 0; r < world; ++r) {
    if (entries[r].view == nullptr) missing_.push_back(r);
  }
  if (!missing_.empty()) return std::optional<AgreedPlan>();

  // The decision: the newest memory step every rank holds, unless the disk has a newer one.
  std::vector<int64_t> common = entries[0].view->steps;
  std::sort(common.begin(), common.end());
  for (uint32_t r = 1; r < world && !common.empty(); ++r) {
    std::vector<int64_t> held = entries[r].view->steps;
    std::sort(held.begin(), held.end());
    std::vector<int64_t> both;
    std::set_intersection(common.begin(), common.end(), held.begin(), held.end(), std::back_inserter(both));
    common = std::move(both);
  }
  AgreedPlan plan;
  if (!common.empty() && common.back() >= newest_disk) {
    plan = AgreedPlan{true, common.back(), true, ""};
  } else if (newest_disk > 0) {
    plan = AgreedPlan{true, newest_disk, false, ""};
  }
  json tokens = json::object();
  std::string key;
  for (uint32_t r = 0; r < world; ++r) {
    tokens[std::to_string(r)] = entries[r].view->token;
    key += std::to_string(r) + "=" + entries[r].view->token + ";";
  }
  const json doc = {{"world", world},
                    {"found", plan.found},
                    {"step", plan.step},
                    {"tier", plan.memory ? "memory" : "disk"},
                    {"made_by", daemon_},
                    {"made_ms", now_ms},
                    {"ranks", std::move(tokens)}};
  const std::string text = doc.dump();
  plan.file = dir_ + "/" + kPlanPrefix + Hex16(Xxh3(key.data(), key.size())) + kSuffix;
  // Written whole under a name of this daemon's, then linked to the plan's name: the first daemon
  // to link it decides, one that finds the name taken reads that decision; no reader sees half a
  // plan, and a daemon that dies while writing leaves only its temporary.
  const std::string tmp = dir_ + "/.tmp." + daemon_ + "." + Hex16(Xxh3(key.data(), key.size()));
  {
    const int fd = io_->Open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus("create", tmp);
    UniqueFd owned(fd);
    Status written = PwriteFull(fd, text.data(), text.size(), 0, tmp, io_);
    if (written.ok() && io_->Fsync(fd) != 0) written = ErrnoStatus("fsync", tmp);
    if (!written.ok()) {
      (void)io_->Unlink(tmp);
      return written;
    }
  }
  const int linked = ::link(tmp.c_str(), plan.file.c_str());
  const int link_errno = errno;
  (void)io_->Unlink(tmp);
  if (linked != 0 && link_errno == EEXIST) return FindPlan(world, mine);
  if (linked != 0) return ErrnoStatus("link " + tmp + " to", plan.file, link_errno);
  RETURN_IF_ERROR(FsyncDir(dir_, io_));
  return std::optional<AgreedPlan>(plan);
}

void ResumeAgreement::Withdraw(std::chrono::milliseconds keep) {
  (void)io_->Unlink(dir_ + "/" + kViewPrefix + daemon_ + kSuffix);
  last_view_.clear();
  auto names = ListDirIfExists(dir_, io_);
  if (!names.ok() || !*names) return;
  const int64_t now_ms = clock_.WallMs();
  for (const std::string& name : **names) {
    const std::string path = dir_ + "/" + name;
    if (name.find(".tmp.") != std::string::npos) {
      // A temporary of a plan or view whose writer died before it renamed or linked it.
      struct stat st {};
      if (io_->Stat(path, &st) == 0 && S_ISREG(st.st_mode) &&
          now_ms - static_cast<int64_t>(st.st_mtime) * 1000 > keep.count()) {
        (void)io_->Unlink(path);
      }
      continue;
    }
    // Plans, and views their daemons left behind (they died waiting), after `keep`.
    const bool plan = HasForm(name, kPlanPrefix);
    if (!plan && !HasForm(name, kViewPrefix)) continue;
    auto text = ReadSmallFile(path, kMaxFileBytes, io_);
    if (!text.ok()) continue;
    json j = json::parse(*text, nullptr, false);
    auto when = j.is_object() ? j.find(plan ? "made_ms" : "written_ms") : j.end();
    int64_t at = -1;
    if (when != j.end() && when->is_number_integer()) {
      at = when->get<int64_t>();
    } else if (struct stat st{}; io_->Stat(path, &st) == 0) {
      at = static_cast<int64_t>(st.st_mtime) * 1000;  // a file that says no time: its own
    }
    if (at >= 0 && now_ms - at > keep.count()) (void)io_->Unlink(path);
  }
}

}  // namespace flashckpt
