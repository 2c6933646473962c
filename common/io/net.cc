#include "common/io/net.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cctype>
#include <charconv>

#include "common/base/names.h"
#include "common/io/fs.h"

namespace flashckpt {
namespace {

constexpr uint64_t kMaxPemBytes = 1u << 20;

Status BadListen(std::string_view flag, std::string_view text, const std::string& why) {
  return InvalidArgument(std::string(flag) + " '" + Clip(text) + "': " + why +
                         " (expected HOST:PORT, [IPV6]:PORT or PORT, e.g. 127.0.0.1:7070)");
}

bool IsHostName(std::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  for (char c : host) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// One spelling per host, so that addresses compare as the hosts they name: an IP literal as inet_ntop
// writes it ("0:0::1" is "::1"), a host name in lower case (names are case-insensitive).
std::string CanonicalHost(std::string_view host, bool ipv6) {
  const std::string text(host);
  char out[INET6_ADDRSTRLEN] = {};
  if (ipv6) {
    in6_addr v6{};
    if (::inet_pton(AF_INET6, text.c_str(), &v6) == 1 && ::inet_ntop(AF_INET6, &v6, out, sizeof out) != nullptr) {
      return out;
    }
    return text;
  }
  in_addr v4{};
  if (::inet_pton(AF_INET, text.c_str(), &v4) == 1 && ::inet_ntop(AF_INET, &v4, out, sizeof out) != nullptr) {
    return out;
  }
  std::string lower = text;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower;
}

}  // namespace

Result<std::string> ReadPem(const std::string& path, const char* flag, std::string_view marker, const char* what) {
  auto text = ReadSmallFile(path, kMaxPemBytes);
  if (!text.ok())
    return InvalidArgument(std::string(flag) + " " + path + " is not readable: " + text.status().message());
  if (text->find(marker) == std::string::npos) {
    return InvalidArgument(std::string(flag) + " " + path + " holds no PEM " + what + " (no '" + std::string(marker) +
                           "' line)");
  }
  return std::move(text).value();
}

std::string ListenAddress::Target() const { return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port); }

Result<ListenAddress> ParseListenAddress(std::string_view text, std::string_view flag) {
  ListenAddress a;
  std::string_view host, port;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return BadListen(flag, text, "an IPv6 address in brackets must be followed by :PORT");
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    in6_addr v6{};
    if (::inet_pton(AF_INET6, std::string(host).c_str(), &v6) != 1) {
      return BadListen(flag, text, "'" + std::string(host) + "' is not an IPv6 address");
    }
    a.ipv6 = true;
    a.loopback = IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  } else {
    size_t colon = text.rfind(':');
    if (colon != std::string_view::npos) {
      host = text.substr(0, colon);
      port = text.substr(colon + 1);
    } else {
      port = text;
    }
    if (host.find(':') != std::string_view::npos) {
      return BadListen(flag, text, "put an IPv6 address in brackets, e.g. [::1]:7070");
    }
    in_addr v4{};
    if (host.empty()) {
      host = "127.0.0.1";  // no host given: loopback only
      a.loopback = true;
    } else if (::inet_pton(AF_INET, std::string(host).c_str(), &v4) == 1) {
      a.loopback = (ntohl(v4.s_addr) >> 24) == 127;
    } else if (IsHostName(host)) {
      a.loopback = host == "localhost";  // any other name may resolve anywhere
    } else {
      return BadListen(flag, text, "'" + Clip(host) + "' is neither an IP address nor a host name");
    }
  }
  unsigned value = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || port.size() > 5 || ec != std::errc() || end != port.data() + port.size() || value > 65535) {
    return BadListen(flag, text, "the port must be a number from 0 to 65535");
  }
  a.host = CanonicalHost(host, a.ipv6);
  a.port = static_cast<uint16_t>(value);
  return a;
}

}  // namespace flashckpt
