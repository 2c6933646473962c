// The limit of a mutual-TLS replica channel: one TLS stream over loopback, OpenSSL on the socket
// itself (no gRPC, no memory BIOs), the same certificates and the same cipher OpenSSL negotiates for
// gRPC (TLS 1.3, AES-GCM), the receiver copying each piece into place as TcpStream's does.
#pragma once

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <memory>
#include <string>

#include "bench/loopback.h"

namespace flashckpt {

struct TlsFiles {
  std::string cert, key, ca;
};

namespace tls_stream_detail {

struct CtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
struct SslFree {
  void operator()(SSL* s) const { SSL_free(s); }
};
using Ctx = std::unique_ptr<SSL_CTX, CtxFree>;
using Ssl = std::unique_ptr<SSL, SslFree>;

// A context that presents `files` and requires a peer certificate signed by their CA.
inline Ctx Context(const TlsFiles& files, bool server) {
  Ctx ctx(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()));
  if (!ctx || SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx.get(), files.key.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_load_verify_locations(ctx.get(), files.ca.c_str(), nullptr) != 1) {
    return nullptr;
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  return ctx;
}

}  // namespace tls_stream_detail

// One mutual-TLS stream of `bytes` over loopback, after the handshake (a replica channel keeps its
// connection from push to push); seconds until the receiver has copied the last byte. A negative
// value when a socket or TLS call failed.
inline double TlsStream(const char* src, uint64_t bytes, uint64_t part, char* dst, const TlsFiles& server,
                        const TlsFiles& client) {
  using namespace tls_stream_detail;
  Ctx server_ctx = Context(server, true), client_ctx = Context(client, false);
  if (!server_ctx || !client_ctx) return -1;
  sockaddr_in addr{};
  const int listener = LoopbackListener(&addr);
  if (listener < 0) return -1;
  bool received = false;
  std::thread receiver([&] {
    int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    Ssl ssl(SSL_new(server_ctx.get()));
    if (ssl && SSL_set_fd(ssl.get(), fd) == 1 && SSL_accept(ssl.get()) == 1) {
      received = ReceivePieces(
          [&](char* to, uint64_t n) { return static_cast<int64_t>(SSL_read(ssl.get(), to, static_cast<int>(n))); },
          bytes, part, dst);
      SSL_shutdown(ssl.get());
    }
    ::close(fd);
  });
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  Ssl ssl(client_ctx ? SSL_new(client_ctx.get()) : nullptr);
  bool sent = fd >= 0 && ssl && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
              SSL_set_fd(ssl.get(), fd) == 1 && SSL_connect(ssl.get()) == 1;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t at = 0; sent && at < bytes;) {
    const int n = SSL_write(ssl.get(), src + at, static_cast<int>(std::min(part, bytes - at)));
    if (n <= 0) sent = false;
    at += n > 0 ? static_cast<uint64_t>(n) : 0;
  }
  if (!sent) ERR_clear_error();
  if (fd >= 0) ::shutdown(fd, SHUT_WR);  // the receiver sees the end, had the sender stopped short
  ::shutdown(listener, SHUT_RDWR);       // and an accept still waiting (no connection came) returns
  receiver.join();
  const double secs = Seconds(start);
  ssl.reset();
  if (fd >= 0) ::close(fd);
  ::close(listener);
  return sent && received ? secs : -1;
}

}  // namespace flashckpt
