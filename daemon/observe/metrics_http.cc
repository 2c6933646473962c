#include "daemon/observe/metrics_http.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>

#include "common/base/log.h"
#include "common/io/net.h"

namespace flashckpt {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

constexpr auto kConnectionDeadline = std::chrono::seconds(10);
constexpr uint32_t kMaxHeaderBytes = 8192;

// One scrape: read a request, write one response, close. Owns itself through shared_ptr while
// its asynchronous operations run.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, const std::function<std::string()>* render, std::atomic<int>* open)
      : stream_(std::move(socket)), render_(render), open_(open) {
    open_->fetch_add(1);
  }
  ~Connection() { open_->fetch_sub(1); }

  void Start() {
    parser_.header_limit(kMaxHeaderBytes);
    parser_.body_limit(0);
    stream_.expires_after(kConnectionDeadline);
    http::async_read(stream_, buffer_, parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

 private:
  void OnRead(beast::error_code ec) {
    if (ec) {
      // A bad request gets an answer; a peer that went away or timed out does not.
      if (ec != http::error::end_of_stream && ec != beast::error::timeout && ec != asio::error::operation_aborted &&
          ec != asio::error::connection_reset) {
        Reply(http::status::bad_request, "bad request: " + ec.message() + "\n", false);
      }
      return;
    }
    const auto& req = parser_.get();
    bool head = req.method() == http::verb::head;
    if (req.method() != http::verb::get && !head) {
      Reply(http::status::method_not_allowed, "only GET and HEAD\n", false);
      return;
    }
    std::string_view target(req.target().data(), req.target().size());
    std::string_view path = target.substr(0, target.find('?'));
    if (path != "/metrics") {
      Reply(http::status::not_found, "not found: the metrics are at /metrics\n", false);
      return;
    }
    Reply(http::status::ok, (*render_)(), head);
  }

  void Reply(http::status status, std::string body, bool head) {
    response_.result(status);
    response_.version(11);
    response_.set(http::field::server, "flashckptd");
    response_.set(http::field::content_type, status == http::status::ok ? "text/plain; version=0.0.4; charset=utf-8"
                                                                        : "text/plain; charset=utf-8");
    if (status == http::status::method_not_allowed) response_.set(http::field::allow, "GET, HEAD");
    response_.keep_alive(false);
    response_.body() = std::move(body);
    response_.prepare_payload();  // Content-Length of the body, also for HEAD
    if (head) response_.body().clear();
    response_serializer_.emplace(response_);
    http::async_write(stream_, *response_serializer_, [self = shared_from_this()](beast::error_code, size_t) {
      beast::error_code ignored;
      self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{kMaxHeaderBytes};
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> response_;
  std::optional<http::response_serializer<http::string_body>> response_serializer_;
  const std::function<std::string()>* render_;
  std::atomic<int>* open_;
};

}  // namespace

struct MetricsHttpServer::Impl {
  // Declared before io: connections still open when io is destroyed count down on `open`.
  std::atomic<int> open{0};
  const std::function<std::string()>* render = nullptr;
  asio::io_context io{1};
  tcp::acceptor acceptor{io};

  void Accept() {
    acceptor.async_accept(asio::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      if (!ec) {
        if (open.load() >= kMaxConnections) {
          beast::error_code ignored;
          socket.close(ignored);
        } else {
          std::make_shared<Connection>(std::move(socket), render, &open)->Start();
        }
      }
      Accept();
    });
  }
};

MetricsHttpServer::MetricsHttpServer(std::string address, std::function<std::string()> render)
    : address_(std::move(address)), render_(std::move(render)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

Status MetricsHttpServer::Start() {
  ASSIGN_OR_RETURN(ListenAddress where, ParseListenAddress(address_));
  impl_ = std::make_unique<Impl>();
  impl_->render = &render_;
  beast::error_code ec;
  tcp::resolver resolver(impl_->io);
  auto endpoints = resolver.resolve(where.host, std::to_string(where.port), tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return InvalidArgument("--metrics-listen " + address_ + ": cannot resolve '" + where.host + "': " + ec.message());
  }
  tcp::endpoint endpoint = endpoints.begin()->endpoint();
  auto fail = [&](const char* what) {
    return Unavailable("--metrics-listen " + address_ + ": " + what + " " + endpoint.address().to_string() + ":" +
                       std::to_string(where.port) + ": " + ec.message());
  };
  if (impl_->acceptor.open(endpoint.protocol(), ec); ec) return fail("open");
  if (impl_->acceptor.set_option(tcp::acceptor::reuse_address(true), ec); ec) return fail("SO_REUSEADDR");
  if (impl_->acceptor.bind(endpoint, ec); ec) return fail("bind");
  if (impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec); ec) return fail("listen");
  port_ = impl_->acceptor.local_endpoint(ec).port();
  impl_->Accept();
  thread_ = std::thread([this] { impl_->io.run(); });
  std::string host = endpoint.address().to_string();
  Logger("rpc")->info("metrics listening http={}:{}", endpoint.address().is_v6() ? "[" + host + "]" : host, port_);
  return Status::OK();
}

void MetricsHttpServer::Stop(Clock::TimePoint /*deadline*/) {
  if (!impl_) return;
  asio::post(impl_->io, [this] {
    beast::error_code ignored;
    impl_->acceptor.close(ignored);
  });
  impl_->io.stop();  // connections still open are destroyed with the io_context
  if (thread_.joinable()) thread_.join();
  impl_.reset();
}

}  // namespace flashckpt
