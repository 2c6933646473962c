// What the network benchmarks (replica_bench, parity_bench) measure their limit with: one plain TCP
// stream over loopback, in the same run, and the small helpers around it.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace flashckpt {

inline double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// A socket listening on a free loopback port, its address in `addr`; -1 when a socket call failed.
inline int LoopbackListener(sockaddr_in* addr) {
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  *addr = sockaddr_in{};
  addr->sin_family = AF_INET;
  addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof *addr;
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(addr), sizeof *addr) != 0 ||
      ::listen(listener, 1) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr*>(addr), &len) != 0) {
    if (listener >= 0) ::close(listener);
    return -1;
  }
  return listener;
}

// The receiving side of a stream: `bytes` bytes read with `read` (as recv: the count, <= 0 at the end
// or on an error) into a buffer of `part` bytes, each piece then copied to its place in `dst`, as
// the replica store copies a part. Whether all of them arrived.
template <typename Read>
bool ReceivePieces(Read read, uint64_t bytes, uint64_t part, char* dst) {
  std::vector<char> piece(part);
  uint64_t at = 0;
  while (at < bytes) {
    const uint64_t want = std::min(part, bytes - at);
    uint64_t got = 0;
    while (got < want) {
      const int64_t n = read(piece.data() + got, want - got);
      if (n <= 0) return false;
      got += static_cast<uint64_t>(n);
    }
    std::memcpy(dst + at, piece.data(), want);
    at += want;
  }
  return true;
}

// One plain TCP stream of `bytes` over loopback; seconds until the receiver has copied the last byte.
// A negative value when a socket call failed.
inline double TcpStream(const char* src, uint64_t bytes, uint64_t part, char* dst) {
  sockaddr_in addr{};
  const int listener = LoopbackListener(&addr);
  if (listener < 0) return -1;
  bool received = false;
  std::thread receiver([&] {
    int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    received = ReceivePieces([&](char* to, uint64_t n) { return static_cast<int64_t>(::recv(fd, to, n, 0)); }, bytes,
                             part, dst);
    ::close(fd);
  });
  const auto start = std::chrono::steady_clock::now();
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool sent = fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  for (uint64_t at = 0; sent && at < bytes;) {
    ssize_t n = ::send(fd, src + at, std::min(part, bytes - at), MSG_NOSIGNAL);
    if (n <= 0) sent = false;
    at += n > 0 ? static_cast<uint64_t>(n) : 0;
  }
  if (fd >= 0) ::close(fd);
  receiver.join();
  const double secs = Seconds(start);
  ::close(listener);
  return sent && received ? secs : -1;
}

}  // namespace flashckpt
