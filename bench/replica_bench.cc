// replica_bench: pushing a replica to a peer daemon's replica listener (daemon/replica/) against a
// plain TCP stream of the same bytes, over the same loopback interface, in the same run.
//
//   tcp stream (limit)   one connection; the sender writes the source in --part pieces, the
//                        receiver reads each piece into a buffer and copies it into a mapping of
//                        the whole size, as the replica store does with a part
//   replica push         PushReplica into a ReplicaServer in this process (no TLS): every part
//                        hashed by the sender, checked by the receiver, copied into the store's
//                        mapping, the replica held at the end. Two pushes of the rank go first
//                        and are shown apart ("first pushes"): they fill fresh memory, which the
//                        kernel zeroes as it is touched; from the third on the store reuses the
//                        memory of the replica each push replaces, as it does for a rank that
//                        takes memory checkpoints step after step
//   replica fetch        FetchReplica of the replica just pushed, into the limit's destination: every
//                        part checked by the server before it is sent and by the fetcher as it is
//                        copied in (a rank on a fresh node getting its replica back)
//
//   tls stream (--tls)   with --tls the listener and the channel use mutual TLS (certificates made
//                        by openssl in a temporary directory), and each round also times one TLS
//                        stream of the same bytes with OpenSSL on the socket (bench/tls_stream.h):
//                        what a TLS channel could reach on this machine. `replica_push_ratio` stays
//                        the push over the plain stream; `RESULT replica_tls_stream_ratio=R` is the
//                        push over the TLS stream
//
// Rows alternate (limit, push, fetch, limit, push ...) for --repeat rounds; with --push-only a round is
// the limit and the push (pushes follow each other, as a daemon's do step after step); medians and best are printed,
// the ratios are of medians (`RESULT replica_push_ratio=R`: the push's rate over the stream's;
// `RESULT replica_fetch_ratio=R`, the fetch's). GB/s is replica bytes over the seconds from the first byte sent to the
// receiver holding the last. The allocator is set as flashckptd sets it (KeepMessageBuffersInHeap,
// common/base/allocator.h) unless --malloc-defaults.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "bench/loopback.h"
#include "bench/summary.h"
#include "bench/tls_stream.h"
#include "common/base/allocator.h"
#include "common/base/names.h"
#include "daemon/replica/replica_client.h"
#include "daemon/replica/replica_server.h"
#include "tests/daemon/certificates.h"  // header only: openssl in a temporary directory

namespace flashckpt {
namespace {

int Main(int argc, char** argv) {
  CLI::App app{"replica_bench: a replica push to a peer daemon against a plain TCP stream of the same bytes"};
  std::string size_text = "1GiB";
  uint64_t part = 1u << 20;
  int repeat = 5;
  bool malloc_defaults = false;
  bool push_only = false;
  bool tls = false;
  app.add_option("--bytes", size_text, "replica size, e.g. 1GiB")->capture_default_str();
  app.add_option("--part", part, "bytes per part (64 KiB to 4 MiB)")->capture_default_str();
  app.add_option("--repeat", repeat, "rounds (limit then push, each round)")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_flag("--malloc-defaults", malloc_defaults,
               "keep glibc's allocator defaults instead of flashckptd's KeepMessageBuffersInHeap");
  app.add_flag("--push-only", push_only,
               "rounds of limit and push without the fetch: pushes back to back, as a daemon pushes step after step");
  app.add_flag("--tls", tls,
               "mutual TLS between the pusher and the listener, and a TLS stream (OpenSSL on the socket) timed "
               "beside the plain one");
  CLI11_PARSE(app, argc, argv);
  if (!malloc_defaults) {
    const AllocatorSetting a = KeepMessageBuffersInHeap();
    std::printf("allocator: flashckptd's thresholds for large messages %s\n", AllocatorSettingName(a));
  } else {
    std::printf("allocator: glibc's defaults (--malloc-defaults)\n");
  }
  const auto bytes = ParseByteSize(size_text);
  if (!bytes || *bytes == 0) {
    std::fprintf(stderr, "--bytes %s: not a positive size\n", size_text.c_str());
    return 2;
  }
  if (part < kMinReplicaPartBytes || part > kMaxReplicaPartBytes) {
    std::fprintf(stderr, "--part must be from 64 KiB to 4 MiB\n");
    return 2;
  }
  // The source, written once (a slot a trainer filled), and the limit's destination, also touched once.
  std::vector<char> src(*bytes);
  for (uint64_t i = 0; i < src.size(); i += 4096) src[i] = static_cast<char>(i / 4096);
  std::vector<char> dst(*bytes, 1);

  ReplicaStore store(HostMemory{[](uint64_t, const std::string&) { return Status::OK(); }, [](uint64_t) {}}, 0);
  std::optional<Certificates> certs;
  ReplicaListenConfig config;
  ReplicaPeer peer;
  TlsFiles server_files, client_files;
  if (tls) {
    certs.emplace();
    if (!certs->ok()) {
      std::fprintf(stderr, "--tls: openssl could not make the certificates\n");
      return 1;
    }
    config = certs->Listener("node-a");
    peer = {"", certs->cert("node-b"), certs->key("node-b"), certs->cert("ca"), ""};
    server_files = {certs->cert("node-a"), certs->key("node-a"), certs->cert("ca")};
    client_files = {peer.tls_cert, peer.tls_key, peer.tls_ca};
  }
  config.listen = "127.0.0.1:0";
  ReplicaServer server(&store, config);
  if (Status started = server.Start(); !started.ok()) {
    std::fprintf(stderr, "replica listener: %s\n", started.ToString().c_str());
    return 1;
  }
  peer.target = "127.0.0.1:" + std::to_string(server.port());
  auto channel = ReplicaChannel(peer);
  if (!channel.ok()) {
    std::fprintf(stderr, "replica channel: %s\n", channel.status().ToString().c_str());
    return 1;
  }

  std::printf("replica_bench: %s in parts of %s, loopback%s, %d rounds\n", FormatBytes(*bytes).c_str(),
              FormatBytes(part).c_str(), tls ? ", mutual TLS" : "", repeat);
  std::vector<double> limit, tls_limit, push, fetch, first;
  const auto meta_of = [&](int64_t step) {
    ReplicaMeta meta;
    meta.job = "bench";
    meta.rank = 0;
    meta.world_size = 1;
    meta.step = step;
    meta.attempt = 1;
    meta.bytes = *bytes;
    meta.part_bytes = part;
    return meta;
  };
  for (int64_t step = 1; step <= 2; ++step) {
    const auto start = std::chrono::steady_clock::now();
    Status pushed = PushReplica(channel->get(), meta_of(step), src.data(),
                                std::chrono::system_clock::now() + std::chrono::minutes(10));
    if (!pushed.ok()) {
      std::fprintf(stderr, "replica push: %s\n", pushed.ToString().c_str());
      return 1;
    }
    first.push_back(Seconds(start));
    std::printf("first push %lld: %.3f s (%.2f GB/s), into fresh memory\n", static_cast<long long>(step), first.back(),
                *bytes / first.back() / 1e9);
  }
  for (int round = 0; round < repeat; ++round) {
    const double tcp = TcpStream(src.data(), *bytes, part, dst.data());
    if (tcp <= 0) {
      std::fprintf(stderr, "the plain TCP stream failed\n");
      return 1;
    }
    limit.push_back(tcp);
    if (tls) {
      const double stream = TlsStream(src.data(), *bytes, part, dst.data(), server_files, client_files);
      if (stream <= 0) {
        std::fprintf(stderr, "the TLS stream failed\n");
        return 1;
      }
      tls_limit.push_back(stream);
      std::printf("round %d: tls stream %.3f s (%.2f GB/s)\n", round + 1, stream, *bytes / stream / 1e9);
    }
    const ReplicaMeta meta = meta_of(round + 3);
    const auto start = std::chrono::steady_clock::now();
    Status pushed = PushReplica(channel->get(), meta, src.data(), std::chrono::system_clock::now() + std::chrono::minutes(10));
    const double secs = Seconds(start);
    if (!pushed.ok()) {
      std::fprintf(stderr, "replica push: %s\n", pushed.ToString().c_str());
      return 1;
    }
    push.push_back(secs);
    if (push_only) {
      std::printf("round %d: tcp stream %.3f s (%.2f GB/s), replica push %.3f s (%.2f GB/s)\n", round + 1, tcp,
                  *bytes / tcp / 1e9, secs, *bytes / secs / 1e9);
      continue;
    }
    const auto fetch_start = std::chrono::steady_clock::now();
    auto fetched = FetchReplica(
        channel->get(), "bench-node", "bench", 0, meta.step, *bytes,
        [&](const ReplicaMeta&) -> Result<char*> { return dst.data(); },
        std::chrono::system_clock::now() + std::chrono::minutes(10));
    const double fetch_secs = Seconds(fetch_start);
    if (!fetched.ok()) {
      std::fprintf(stderr, "replica fetch: %s\n", fetched.status().ToString().c_str());
      return 1;
    }
    if (std::memcmp(dst.data(), src.data(), src.size()) != 0) {
      std::fprintf(stderr, "replica fetch: the bytes fetched are not the bytes pushed\n");
      return 1;
    }
    fetch.push_back(fetch_secs);
    std::printf("round %d: tcp stream %.3f s (%.2f GB/s), replica push %.3f s (%.2f GB/s), fetch %.3f s (%.2f GB/s)\n",
                round + 1, tcp, *bytes / tcp / 1e9, secs, *bytes / secs / 1e9, fetch_secs, *bytes / fetch_secs / 1e9);
  }
  if (push_only) {
    // What the pushes left is checked once, off the clock: the last replica fetched back.
    auto fetched = FetchReplica(
        channel->get(), "bench-node", "bench", 0, 0, *bytes, [&](const ReplicaMeta&) -> Result<char*> { return dst.data(); },
        std::chrono::system_clock::now() + std::chrono::minutes(10));
    if (!fetched.ok() || std::memcmp(dst.data(), src.data(), src.size()) != 0) {
      std::fprintf(stderr, "replica fetch after the pushes: %s\n",
                   fetched.ok() ? "the bytes fetched are not the bytes pushed" : fetched.status().ToString().c_str());
      return 1;
    }
  }
  const double tcp_median = Median(limit), push_median = Median(push);
  std::printf("\n%-28s %10s %10s %12s\n", "row", "median s", "best s", "median GB/s");
  std::printf("%-28s %10.3f %10.3f %12.2f\n", "tcp stream (limit)", tcp_median,
              *std::min_element(limit.begin(), limit.end()), *bytes / tcp_median / 1e9);
  if (tls) {
    std::printf("%-28s %10.3f %10.3f %12.2f\n", "tls stream (OpenSSL)", Median(tls_limit),
                *std::min_element(tls_limit.begin(), tls_limit.end()), *bytes / Median(tls_limit) / 1e9);
  }
  std::printf("%-28s %10.3f %10.3f %12.2f\n", "first pushes (fresh memory)", Median(first),
              *std::min_element(first.begin(), first.end()), *bytes / Median(first) / 1e9);
  std::printf("%-28s %10.3f %10.3f %12.2f\n", "replica push", push_median, *std::min_element(push.begin(), push.end()),
              *bytes / push_median / 1e9);
  const double fetch_median = push_only ? 0 : Median(fetch);
  if (!push_only) {
    std::printf("%-28s %10.3f %10.3f %12.2f\n", "replica fetch", fetch_median,
                *std::min_element(fetch.begin(), fetch.end()), *bytes / fetch_median / 1e9);
  }
  const double ratio = tcp_median / push_median;
  std::printf("\nRESULT replica_push_gbps=%.3f\nRESULT replica_limit_gbps=%.3f\nRESULT replica_push_ratio=%.3f\n",
              *bytes / push_median / 1e9, *bytes / tcp_median / 1e9, ratio);
  bench::SummaryRow(tls ? "replica push (mutual TLS) vs plain TCP stream (loopback)"
                        : "replica push vs plain TCP stream (loopback)",
                    ratio);
  if (tls) {
    const double tls_ratio = Median(tls_limit) / push_median;
    std::printf("RESULT replica_tls_limit_gbps=%.3f\nRESULT replica_tls_stream_ratio=%.3f\n",
                *bytes / Median(tls_limit) / 1e9, tls_ratio);
    bench::SummaryRow("replica push (mutual TLS) vs a TLS stream (loopback)", tls_ratio);
  }
  if (!push_only) {
    const double fetch_ratio = tcp_median / fetch_median;
    std::printf("RESULT replica_fetch_gbps=%.3f\nRESULT replica_fetch_ratio=%.3f\n", *bytes / fetch_median / 1e9,
                fetch_ratio);
    bench::SummaryRow("replica fetch vs plain TCP stream (loopback)", fetch_ratio);
  }
  server.Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

}  // namespace
}  // namespace flashckpt

int main(int argc, char** argv) { return flashckpt::Main(argc, argv); }
