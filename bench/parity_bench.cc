// parity_bench: erasure-coded peer memory (daemon/parity/) against the limits of the same run: a
// plain TCP stream of the same bytes over loopback, and memcpy.
//
// G members (--members, --parity M) run in this process, each a ParityStore served on a replica
// listener of its own (loopback, no TLS), each with one rank's image of --bytes.
//
//   memcpy (limit)     one image copied into memory already touched
//   tcp stream (limit) one image over one loopback connection (bench/loopback.h)
//   encode             member 0's blocks pushed to their stripes' holders, which add each part into
//                      their shares as it arrives (ISA-L): M x the image crosses the link. Rate: the
//                      bytes sent over the seconds until the last holder has added its last part.
//                      The other members' blocks are pushed first, so each push completes shares.
//   begin              those other members' blocks, pushed one member after the other: they begin
//                      the step's shares on the holders, in the memory of the step before last's
//                      (kept from round 3 on) or fresh memory (rounds 1 and 2). Rate: (G-1) x M x
//                      the image sent over the seconds.
//   rebuild            member 0 lost: its image rebuilt from the others (listing, K pieces per
//                      stripe fetched, decoded). Rate: the image's bytes over the seconds; a
//                      Reed-Solomon rebuild moves K pieces per block, K x the image over the link,
//                      also shown.
//
// Rows alternate for --repeat rounds; medians are printed, ratios are of medians:
// `RESULT parity_encode_ratio=R` (encode's bytes sent per second over the stream's) and
// `RESULT parity_rebuild_ratio=R` (the image rebuilt per second over the stream's).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "bench/loopback.h"
#include "bench/parity_member.h"
#include "common/base/allocator.h"
#include "common/base/names.h"
#include "daemon/parity/parity_client.h"
#include "daemon/parity/parity_rebuild.h"
#include "daemon/parity/parity_service.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_server.h"

namespace flashckpt {
namespace {

// A member as its daemon serves it (bench/parity_member.h), with one rank's image.
struct Member : bench::ParityMember {
  Member(const ParityGroup& group, uint32_t index, uint64_t bytes)
      : ParityMember(group, index,
                     [this](const std::string&, uint32_t, int64_t, const std::string&, int64_t) -> Result<OwnImage> {
                       return OwnImage{nullptr, image.data(), image.size(), {}};
                     }),
        image(bytes) {
    for (uint64_t i = 0; i < bytes; i += 4096) image[i] = static_cast<char>(i / 4096 + index);
  }
  std::vector<char> image;
};

// Member `i`'s blocks of `step` pushed to every holder, one thread per holder (as ParitySender does).
Status PushAll(const ParityGroup& group, std::vector<std::unique_ptr<Member>>& members, uint32_t i, int64_t step,
               uint64_t part) {
  ReplicaMeta meta;
  meta.job = "bench";
  meta.rank = i;
  meta.world_size = group.members();
  meta.step = step;
  meta.attempt = 1;
  meta.bytes = members[i]->image.size();
  meta.part_bytes = part;
  meta.run_id = "bench-run";
  std::vector<Status> results(group.members());
  std::vector<std::thread> threads;
  for (uint32_t holder = 0; holder < group.members(); ++holder) {
    if (holder == i) continue;
    threads.emplace_back([&, holder] {
      for (uint32_t b = 0; b < group.data_blocks() && results[holder].ok(); ++b) {
        const uint32_t stripe = group.StripeOfBlock(i, b);
        if (!group.RowOf(stripe, holder)) continue;
        const ParityGroup::Range range = group.Block(meta.bytes, b);
        results[holder] = PushParityBlock(members[holder]->channel.get(), {i, stripe, 0, 1, meta},
                                          members[i]->image.data() + range.offset, range.bytes,
                                          std::chrono::system_clock::now() + std::chrono::minutes(10));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) RETURN_IF_ERROR(s);
  return Status::OK();
}

int Main(int argc, char** argv) {
  CLI::App app{"parity_bench: parity pushed and a lost member rebuilt, against a TCP stream and memcpy"};
  std::string size_text = "256MiB";
  uint32_t members_count = 4, parity = 1;
  uint64_t part = 1u << 20;
  int repeat = 3;
  app.add_option("--bytes", size_text, "each member's image, e.g. 256MiB")->capture_default_str();
  app.add_option("--members", members_count, "members of the group (G)")->capture_default_str();
  app.add_option("--parity", parity, "parity shares per stripe (M)")->capture_default_str();
  app.add_option("--part", part, "bytes per part")->capture_default_str();
  app.add_option("--repeat", repeat, "rounds")->check(CLI::Range(1, 100))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  (void)KeepMessageBuffersInHeap();
  const auto bytes = ParseByteSize(size_text);
  auto group = ParityGroup::Make(members_count, parity);
  if (!bytes || *bytes == 0 || !group.ok() || part < kMinReplicaPartBytes || part > kMaxReplicaPartBytes) {
    std::fprintf(stderr, "bad --bytes, --members/--parity or --part\n");
    return 2;
  }
  std::vector<std::unique_ptr<Member>> members;
  for (uint32_t i = 0; i < group->members(); ++i) {
    members.push_back(std::make_unique<Member>(*group, i, *bytes));
    if (Status s = members.back()->Start(); !s.ok()) {
      std::fprintf(stderr, "member %u: %s\n", i, s.ToString().c_str());
      return 1;
    }
  }
  std::printf("parity_bench: %u members, parity %u, %s per member in parts of %s, loopback, %d rounds\n",
              group->members(), group->parity(), FormatBytes(*bytes).c_str(), FormatBytes(part).c_str(), repeat);
  std::vector<char> dst(*bytes, 1);
  std::vector<char> rebuilt(*bytes, 1);
  std::vector<double> copy, tcp, begin, encode, rebuild;
  std::vector<ParityMember> survivors;
  for (uint32_t i = 1; i < group->members(); ++i) {
    survivors.push_back({i, "member " + std::to_string(i), members[i]->channel});
  }
  for (int round = 0; round < repeat; ++round) {
    const int64_t step = round + 1;
    auto start = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), members[0]->image.data(), *bytes);
    copy.push_back(Seconds(start));
    tcp.push_back(TcpStream(members[0]->image.data(), *bytes, part, dst.data()));
    start = std::chrono::steady_clock::now();
    for (uint32_t i = 1; i < group->members(); ++i) {
      if (Status s = PushAll(*group, members, i, step, part); !s.ok()) {
        std::fprintf(stderr, "push of member %u: %s\n", i, s.ToString().c_str());
        return 1;
      }
    }
    begin.push_back(Seconds(start));
    start = std::chrono::steady_clock::now();
    if (Status s = PushAll(*group, members, 0, step, part); !s.ok()) {
      std::fprintf(stderr, "push of member 0: %s\n", s.ToString().c_str());
      return 1;
    }
    encode.push_back(Seconds(start));
    start = std::chrono::steady_clock::now();
    const auto deadline = std::chrono::system_clock::now() + std::chrono::minutes(10);
    auto candidate = FindParityCandidate(*group, survivors, "bench", 0, 0, deadline, {});
    Status done = candidate.ok() ? RebuildFromParity(*group, survivors, *candidate, 0, rebuilt.data(), deadline)
                                 : candidate.status();
    rebuild.push_back(Seconds(start));
    if (!done.ok() || candidate->meta.step != step || std::memcmp(rebuilt.data(), members[0]->image.data(), *bytes)) {
      std::fprintf(stderr, "rebuild of member 0: %s\n", done.ok() ? "not the image pushed" : done.ToString().c_str());
      return 1;
    }
    const double wire = static_cast<double>(*bytes) * group->parity();
    std::printf("round %d: memcpy %.3f s, tcp stream %.3f s (%.2f GB/s), begin %.3f s (%.2f GB/s sent), "
                "encode %.3f s (%.2f GB/s sent), rebuild %.3f s (%.2f GB/s of image)\n",
                round + 1, copy.back(), tcp.back(), *bytes / tcp.back() / 1e9, begin.back(),
                wire * (group->members() - 1) / begin.back() / 1e9, encode.back(), wire / encode.back() / 1e9,
                rebuild.back(), *bytes / rebuild.back() / 1e9);
  }
  const double b = static_cast<double>(*bytes), k = group->data_blocks();
  const double m_copy = Median(copy), m_tcp = Median(tcp), m_encode = Median(encode), m_rebuild = Median(rebuild);
  const double m_begin = Median(begin), others = group->members() - 1;
  std::printf("\n%-34s %10s %12s\n", "medians", "seconds", "GB/s");
  std::printf("%-34s %10.3f %12.2f\n", "memcpy (limit)", m_copy, b / m_copy / 1e9);
  std::printf("%-34s %10.3f %12.2f\n", "tcp stream (limit)", m_tcp, b / m_tcp / 1e9);
  std::printf("%-34s %10.3f %12.2f\n", "begin: bytes sent ((G-1)M x image)", m_begin,
              b * group->parity() * others / m_begin / 1e9);
  std::printf("%-34s %10.3f %12.2f\n", "encode: bytes sent (M x image)", m_encode, b * group->parity() / m_encode / 1e9);
  std::printf("%-34s %10.3f %12.2f\n", "rebuild: image rebuilt", m_rebuild, b / m_rebuild / 1e9);
  std::printf("%-34s %10.3f %12.2f\n", "rebuild: bytes moved (K x image)", m_rebuild, b * k / m_rebuild / 1e9);
  std::printf("\nRESULT parity_encode_gbps=%.3f\nRESULT parity_rebuild_gbps=%.3f\nRESULT parity_tcp_gbps=%.3f\n",
              b * group->parity() / m_encode / 1e9, b / m_rebuild / 1e9, b / m_tcp / 1e9);
  std::printf("RESULT parity_encode_ratio=%.3f\nRESULT parity_rebuild_ratio=%.3f\nRESULT parity_rebuild_memcpy_ratio=%.3f\n",
              m_tcp / (m_encode / group->parity()), m_tcp / m_rebuild, m_copy / m_rebuild);
  std::printf("INFO parity_begin_ratio=%.3f\n", m_tcp / (m_begin / group->parity() / others));
  for (auto& m : members) m->server->Shutdown(std::chrono::system_clock::now());
  return 0;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }
