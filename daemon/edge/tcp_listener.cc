#include "daemon/edge/tcp_listener.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <grpcpp/health_check_service_interface.h>

#include <charconv>

#include "common/base/log.h"
#include "common/io/fs.h"
#include "daemon/edge/limits.h"
#include "daemon/edge/request_log.h"

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
  a.host = std::string(host);
  a.port = static_cast<uint16_t>(value);
  return a;
}

TcpListener::TcpListener(CheckpointService* local, const DaemonConfig& config)
    : config_(config), service_(local, config.tcp_allow_writes) {}

TcpListener::~TcpListener() { Shutdown(std::chrono::system_clock::now()); }

Status TcpListener::Start() {
  ASSIGN_OR_RETURN(ListenAddress address, ParseListenAddress(config_.listen));
  const bool tls = !config_.tls_cert.empty();
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls) {
    grpc::SslServerCredentialsOptions ssl;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    ASSIGN_OR_RETURN(pair.cert_chain,
                     ReadPem(config_.tls_cert, "--tls-cert", "-----BEGIN CERTIFICATE-----", "certificate"));
    ASSIGN_OR_RETURN(pair.private_key, ReadPem(config_.tls_key, "--tls-key", "PRIVATE KEY-----", "private key"));
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    credentials = grpc::SslServerCredentials(ssl);
  }
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second daemon would then share the port and take half
  // of the connections instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Read-only, the listener takes only GetStatus, ListCheckpoints and WatchEvents requests, a few bytes each: an
  // unauthenticated caller gets no 16 MiB buffers out of it.
  builder.SetMaxReceiveMessageSize(config_.tcp_allow_writes ? kMaxRequestMessageBytes : kMaxReadOnlyRequestBytes);
  builder.RegisterService(&service_);
  // Refused calls are logged with the caller's address (no credentials on TCP).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<RefusalLogFactory>(nullptr));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.AddListeningPort(address.Target(), credentials, &port_);
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
    return FailedPrecondition("--listen " + address.Target() + ": could not listen there (is the port in use or the " +
                              "address not one of this host's?" +
                              (tls ? " do --tls-cert and --tls-key hold a matching certificate and key?" : "") + ")");
  }
  ListenAddress bound = address;
  bound.port = static_cast<uint16_t>(port_);  // the kernel's choice for port 0
  Logger("rpc")->info("listening tcp={} tls={} writes={}", bound.Target(), tls ? "on" : "off",
                      config_.tcp_allow_writes ? "allowed" : "refused");
  if (!address.loopback && !tls) {
    Logger("rpc")->warn(
        "tcp listener on {} is not loopback and has no TLS: calls and answers travel in clear text and any host "
        "that reaches the port can make them; give --tls-cert and --tls-key, or listen on 127.0.0.1",
        address.Target());
  }
  if (!address.loopback && config_.tcp_allow_writes) {
    Logger("rpc")->warn(
        "--tcp-allow-writes on the non-loopback address {}: TCP callers are not authenticated (TLS does not check "
        "clients), so any host that reaches the port can open sessions and register memory",
        address.Target());
  }
  return Status::OK();
}

void TcpListener::SetServing(bool serving) {
  if (server_ && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(serving);
  }
}

void TcpListener::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (!server_) return;
  server_->Shutdown(deadline);
  server_->Wait();
  server_.reset();
}

}  // namespace flashckpt
