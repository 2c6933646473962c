// Network helpers every layer uses: a listen or peer address as the flags give it, and a PEM file
// as a TLS flag names it. Plain parsing and reading, no gRPC.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/status.h"

namespace flashckpt {

// A parsed --listen value.
//   "9000" or ":9000"  -> 127.0.0.1:9000 (loopback unless a host is given explicitly)
//   "10.0.0.5:9000", "0.0.0.0:9000", "[::1]:9000", "[::]:9000", "localhost:9000", "node7:9000"
// Port 0 lets the kernel choose; the listener logs the port it bound.
struct ListenAddress {
  std::string host;  // without brackets; an IP literal as inet_ntop writes it, a name in lower case
  uint16_t port = 0;
  bool ipv6 = false;      // host is an IPv6 literal
  bool loopback = false;  // 127.0.0.0/8, ::1 (also v4-mapped) or "localhost"
  // "127.0.0.1:9000", "[::1]:9000": what gRPC binds.
  std::string Target() const;
};
// `flag` names the flag in the message of a value it refuses.
Result<ListenAddress> ParseListenAddress(std::string_view text, std::string_view flag = "--listen");

// Reads a PEM file given by a TLS flag (`flag`, for the message), which must hold a line with
// `marker` ("-----BEGIN CERTIFICATE-----", "PRIVATE KEY-----"): unreadable, oversized (1 MiB) or
// marker-less files are refused here, by name, rather than as an opaque gRPC failure to bind.
Result<std::string> ReadPem(const std::string& path, const char* flag, std::string_view marker, const char* what);

}  // namespace flashckpt
