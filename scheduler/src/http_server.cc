#include "moe/scheduler/http_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <exception>
#include <iostream>
#include <regex>
#include <system_error>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "http_connection.h"
#include "moe/core/status.h"
#include "moe/scheduler/listen_address.h"
#include "nlohmann/json.hpp"

namespace moe::scheduler {
namespace {

// Worker threads for connections: one per open connection, made as connections arrive (up to
// `max_threads`) and kept for the next ones. httplib's own pool has a fixed size (8 threads on a
// small machine), so a few idle keep-alive connections made every other client wait.
//
// Thread-safety: enqueue from any thread (httplib's accept loop); shutdown once, from the thread
// that stops the server.
class ConnectionThreads final : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(size_t max_threads) : max_threads_(max_threads) {}

  void enqueue(std::function<void()> job) override {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(std::move(job));
    // After shutdown the threads being joined run what is left; a new one would never be joined.
    if (!shutdown_ && idle_ < jobs_.size() && threads_.size() < max_threads_) {
      try {
        threads_.emplace_back([this] { Work(); });
      } catch (const std::system_error& e) {
        // Out of threads: the job waits for a running one.
        std::cerr << "http: cannot start a connection thread (" << e.what() << "); the connection waits\n";
      }
    }
  }

  // Runs the queued jobs (each sees the listener closed and ends quickly), then joins.
  void shutdown() override {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      shutdown_ = true;
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  bool HasJobOrShutdown() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !jobs_.empty() || shutdown_; }

  void Work() {
    for (;;) {
      std::function<void()> job;
      {
        absl::MutexLock lock(&mu_);
        ++idle_;
        mu_.Await(absl::Condition(this, &ConnectionThreads::HasJobOrShutdown));
        --idle_;
        if (jobs_.empty()) return;  // shut down, nothing left
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  const size_t max_threads_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for a job
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

// SO_REUSEADDR (a restart binds while old connections sit in TIME_WAIT) but not httplib's default
// SO_REUSEPORT, with which a second server on a port in use would bind and share its traffic.
void ListenSocketOptions(socket_t sock) {
  const int yes = 1;
  ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

int NoPassword(char* /*buf*/, int /*size*/, int /*rwflag*/, void* /*u*/) { return 0; }

// 401 in OpenAI's error shape, with the challenge that names the scheme.
void SetUnauthorized(httplib::Response& response, std::string_view message) {
  SetJsonError(response, 401, message, "authentication_error");
  response.set_header("WWW-Authenticate", "Bearer");
}

// Configures the server's TLS context from files CheckTlsFiles has accepted. TLS 1.2 at least;
// with a client CA, a client without a certificate that CA signed fails the handshake.
bool SetUpTls(SSL_CTX& ctx, const TlsFiles& tls, std::string* error) {
  SSL_CTX_set_options(&ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_SESSION_RESUMPTION_ON_RENEGOTIATION);
  SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
  SSL_CTX_set_default_passwd_cb(&ctx, NoPassword);
  if (SSL_CTX_use_certificate_chain_file(&ctx, tls.cert_file.c_str()) != 1) {
    *error = absl::StrCat("TLS certificate file ", tls.cert_file, ": ", OpenSslError());
    return false;
  }
  if (SSL_CTX_use_PrivateKey_file(&ctx, tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(&ctx) != 1) {
    *error = absl::StrCat("TLS key file ", tls.key_file, ": ", OpenSslError());
    return false;
  }
  if (!tls.client_ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(&ctx, tls.client_ca_file.c_str(), nullptr) != 1) {
      *error = absl::StrCat("TLS client CA file ", tls.client_ca_file, ": ", OpenSslError());
      return false;
    }
    // Tells clients which CA to pick a certificate for.
    SSL_CTX_set_client_CA_list(&ctx, SSL_load_client_CA_file(tls.client_ca_file.c_str()));
    SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return true;
}

bool IsOpsPath(const std::string& path) { return path == "/metrics" || path == "/health" || path == "/ready"; }

std::string BindErrorText(int err) {
  switch (err) {
    case EADDRINUSE:
      return "address already in use";
    case EACCES:
      return "permission denied (ports below 1024 need privileges)";
    case EADDRNOTAVAIL:
      return "no such address on this machine";
    case 0:
      return "bind failed";
    default:
      return absl::AsciiStrToLower(std::strerror(err));
  }
}

}  // namespace

int ConnectionSocketOf(const httplib::Request& request) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (const dirent* e = ::readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(e->d_name, &fd) || fd < 0) continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_len = sizeof(peer), local_len = sizeof(local);
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0) {
      continue;
    }
    char host[INET6_ADDRSTRLEN] = {};
    int peer_port = 0, local_port = 0;
    if (peer.ss_family == AF_INET) {
      const auto* p = reinterpret_cast<const sockaddr_in*>(&peer);
      ::inet_ntop(AF_INET, &p->sin_addr, host, sizeof(host));
      peer_port = ntohs(p->sin_port);
      local_port = ntohs(reinterpret_cast<const sockaddr_in*>(&local)->sin_port);
    } else if (peer.ss_family == AF_INET6) {
      const auto* p = reinterpret_cast<const sockaddr_in6*>(&peer);
      ::inet_ntop(AF_INET6, &p->sin6_addr, host, sizeof(host));
      peer_port = ntohs(p->sin6_port);
      local_port = ntohs(reinterpret_cast<const sockaddr_in6*>(&local)->sin6_port);
    } else {
      continue;
    }
    if (peer_port == request.remote_port && host == request.remote_addr &&
        (request.local_port <= 0 || local_port == request.local_port)) {
      found = fd;
      break;
    }
  }
  ::closedir(dir);
  return found;
}

void SetJsonError(httplib::Response& response, int status, std::string_view message, std::string_view type,
                  std::string_view param) {
  const nlohmann::json body = {{"error",
                                {{"message", std::string(message)},
                                 {"type", std::string(type)},
                                 {"param", param.empty() ? nlohmann::json() : nlohmann::json(std::string(param))},
                                 {"code", status}}}};
  response.status = status;
  // A message may quote what a client sent, which need not be UTF-8: never a throw from dump().
  response.set_content(body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), "application/json");
}

HttpServer::HttpServer() = default;

HttpServer::~HttpServer() { Stop(); }

absl::Status HttpServer::Handle(std::string_view method_view, const std::string& pattern, Handler handler) {
  const std::string method(method_view);
  if (server_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("HTTP route ", method, " ", pattern, ": routes are added before Start"));
  }
  static const char* const kMethods[] = {"GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"};
  if (std::find(std::begin(kMethods), std::end(kMethods), method) == std::end(kMethods)) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP route ", method, " ", pattern, ": method must be GET, POST, PUT, PATCH, DELETE or OPTIONS"));
  }
  try {
    std::regex check(pattern);
  } catch (const std::regex_error& e) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP route ", method, " ", pattern, ": bad regex: ", e.what()));
  }
  routes_.push_back(Route{method, pattern, std::move(handler)});
  return absl::OkStatus();
}

namespace {

// Ends connection `fd` once the answer being written now has reached the client: after it is
// acknowledged (the send queue empty), what the client sent beyond it is discarded and the socket
// shut for reading, so the server's loop sees the end and closes it (a close with unread data
// would reset the connection, and the client could lose the answer). On a duplicate of `fd`, so
// that a descriptor closed and reused meanwhile is never touched; bounded to 2 s.
void CloseAfterTheAnswer(int fd) {
  const int mine = fd >= 0 ? ::dup(fd) : -1;
  if (mine < 0) return;
  std::thread([mine] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the answer is written meanwhile
    for (int i = 0; i < 200; ++i) {
      int unacked = 0;
      if (::ioctl(mine, SIOCOUTQ, &unacked) != 0 || unacked == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    char discard[4096];
    while (::recv(mine, discard, sizeof(discard), MSG_DONTWAIT) > 0) {
    }
    ::shutdown(mine, SHUT_RD);
    ::close(mine);
  }).detach();
}

// "host" of "host:port", "[v6]:port", "[v6]" or "host".
std::string HostOf(const std::string& authority) {
  if (!authority.empty() && authority[0] == '[') return authority.substr(0, authority.find(']') + 1);
  return authority.substr(0, authority.find(':'));
}

bool IsLoopbackName(const std::string& host) {
  const std::string h = absl::AsciiStrToLower(host);
  return h == "localhost" || h == "[::1]" || h.rfind("127.", 0) == 0 || absl::EndsWith(h, ".localhost");
}

}  // namespace

bool HttpServer::Screen(const httplib::Request& request, httplib::Response& response) const {
  const auto refuse = [&](int status, const std::string& message) {
    SetJsonError(response, status, message, "invalid_request_error");
    // What follows on this connection cannot be trusted: no more of it is read (cpp-httplib 0.11
    // keeps a connection by the request's headers alone, so its socket is shut for reading; the
    // answer still goes out).
    response.set_header("Connection", "close");
    if (auto* plain = dynamic_cast<internal::PipelinedServer*>(server_.get())) {
      plain->MarkForClose(request);
    } else {
      CloseAfterTheAnswer(ConnectionSocketOf(request));
    }
    return true;
  };
  // HTTP/1.0 closes after each response unless the client asked to keep the connection.
  if (request.version == "HTTP/1.0" && !absl::EqualsIgnoreCase(request.get_header_value("Connection"), "keep-alive")) {
    response.set_header("Connection", "close");
  }
  // RFC 9112 6.3: one length, and never a length beside a transfer coding (request smuggling).
  const size_t lengths = request.get_header_value_count("Content-Length");
  for (size_t i = 1; i < lengths; ++i) {
    if (request.get_header_value("Content-Length", i) != request.get_header_value("Content-Length", 0)) {
      return refuse(400, "conflicting Content-Length headers (RFC 9112 6.3): send one");
    }
  }
  if (lengths > 0 && request.has_header("Transfer-Encoding")) {
    return refuse(400, "Content-Length together with Transfer-Encoding (RFC 9112 6.1): send one of them");
  }
  // A loopback listener answers only loopback names: a web page whose name was rebound to
  // 127.0.0.1 (DNS rebinding) sends its own name as the Host.
  if (loopback_ && request.has_header("Host") && !IsLoopbackName(HostOf(request.get_header_value("Host")))) {
    return refuse(403, absl::StrCat("Host '", request.get_header_value("Host"),
                                    "' is not this server's: a loopback listener answers localhost, 127.0.0.1 and "
                                    "[::1] only"));
  }
  if (!request.has_header("Origin")) return false;  // not a browser's cross-site call
  const std::string origin = request.get_header_value("Origin");
  const auto& allowed = options_.allowed_origins;
  const bool ok = std::find(allowed.begin(), allowed.end(), "*") != allowed.end() ||
                  std::find(allowed.begin(), allowed.end(), origin) != allowed.end();
  if (!ok) {
    return refuse(403, absl::StrCat("Origin '", origin,
                                    "' may not call this server (start it with --allowed-origins to let a web page "
                                    "call it)"));
  }
  response.set_header("Access-Control-Allow-Origin", origin);
  response.set_header("Vary", "Origin");
  if (request.method == "OPTIONS") {  // a CORS preflight
    response.status = 204;
    response.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    response.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
    response.set_header("Access-Control-Max-Age", "600");
    return true;
  }
  return false;
}

bool HttpServer::Authorized(const httplib::Request& request) const {
  if (options_.api_keys == nullptr || options_.api_keys->empty()) return true;
  if (!options_.protect_metrics && IsOpsPath(request.path)) return true;
  return options_.api_keys->AcceptsAuthorization(request.get_header_value("Authorization"));
}

HttpServer::Handler HttpServer::Guarded(Handler handler) const {
  return [this, handler = std::move(handler)](const httplib::Request& request, httplib::Response& response) {
    if (!Authorized(request)) {
      const bool missing = !request.has_header("Authorization");
      SetUnauthorized(response, missing ? "missing API key: send the header 'Authorization: Bearer KEY'"
                                        : "invalid API key in the Authorization header");
      return;
    }
    handler(request, response);
  };
}

void HttpServer::AddBuiltinRoutes() {
  const auto state_route = [this](const char* ok_body) {
    return Guarded([this, ok_body](const httplib::Request&, httplib::Response& response) {
      switch (state()) {
        case ServingState::kServing:
          response.set_content(ok_body, "text/plain");
          return;
        case ServingState::kLoading:
          response.status = 503;
          response.set_content("loading\n", "text/plain");
          return;
        case ServingState::kDraining:
          response.status = 503;
          response.set_content("draining\n", "text/plain");
          return;
        case ServingState::kRestarting:
          response.status = 503;
          response.set_content("restarting\n", "text/plain");
          return;
      }
    });
  };
  server_->Get("/health", state_route("ok\n"));
  server_->Get("/ready", state_route("ready\n"));
  if (options_.render_metrics) {
    server_->Get("/metrics", Guarded([this](const httplib::Request&, httplib::Response& response) {
                   response.set_content(options_.render_metrics(), "text/plain; version=0.0.4; charset=utf-8");
                 }));
  }
}

// Gives the errors httplib answers by itself (bad request, no route, body too large) a JSON body;
// an unknown path asked for without a valid key gets 401, so paths cannot be probed without one.
void HttpServer::OnError(const httplib::Request& request, httplib::Response& response) const {
  if (!response.body.empty()) return;  // a handler's own answer
  switch (response.status) {
    case 404:
      if (!Authorized(request)) {
        SetUnauthorized(response, "missing or invalid API key: send the header 'Authorization: Bearer KEY'");
      } else {
        SetJsonError(response, 404, absl::StrCat("no route for ", request.method, " ", request.path),
                     "invalid_request_error");
      }
      return;
    case 413:
      SetJsonError(
          response, 413,
          absl::StrCat("request body is larger than this server's limit of ", options_.max_request_bytes, " bytes"),
          "invalid_request_error");
      return;
    case 400:
      SetJsonError(response, 400, "malformed HTTP request", "invalid_request_error");
      return;
    default:
      SetJsonError(response, response.status, absl::StrCat("HTTP error ", response.status), "invalid_request_error");
      return;
  }
}

absl::Status HttpServer::Start(const HttpServerOptions& options) {
  if (server_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("HTTP server already listening on port ", port()));
  }
  MOE_ASSIGN_OR_RETURN(const ListenAddress address, ParseListenAddress(options.listen));
  if (options.max_connections == 0 || options.max_requests_per_connection == 0) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP server on ", options.listen,
                                                   ": max_connections and max_requests_per_connection must be > 0"));
  }
  if (options.read_timeout.count() <= 0 || options.write_timeout.count() <= 0 ||
      options.keep_alive_timeout.count() <= 0 || options.head_timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP server on ", options.listen, ": read, write and keep-alive timeouts must be > 0"));
  }
  MOE_RETURN_IF_ERROR(CheckTlsFiles(options.tls));
  options_ = options;
  state_.store(options.initial_state);

  if (options_.tls.enabled()) {
    std::string error;
    auto tls_server =
        std::make_unique<httplib::SSLServer>([&](SSL_CTX& ctx) { return SetUpTls(ctx, options_.tls, &error); });
    if (!tls_server->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat("HTTP server on ", options.listen,
                                                     ": TLS setup failed: ", error.empty() ? OpenSslError() : error));
    }
    server_ = std::move(tls_server);
  } else {
    server_ = std::make_unique<internal::PipelinedServer>(options_.head_timeout);
  }
  httplib::Server& server = *server_;
  // httplib creates the listening socket inside bind_to_port; the socket-options hook is the one
  // place its descriptor shows, and it is needed below to lengthen the accept queue.
  socket_t listen_socket = INVALID_SOCKET;
  server.set_socket_options([&listen_socket](socket_t sock) {
    ListenSocketOptions(sock);
    listen_socket = sock;
  });
  server.set_tcp_nodelay(true);
  server.set_read_timeout(options_.read_timeout);
  server.set_write_timeout(options_.write_timeout);
  server.set_keep_alive_timeout(options_.keep_alive_timeout.count());
  server.set_keep_alive_max_count(options_.max_requests_per_connection);
  server.set_payload_max_length(options_.max_request_bytes);
  // httplib owns and deletes the queue it gets from this factory.
  const size_t max_connections = options_.max_connections;
  server.new_task_queue = [max_connections] { return new ConnectionThreads(max_connections); };
  server.set_error_handler(
      httplib::Server::HandlerWithResponse([this](const httplib::Request& request, httplib::Response& response) {
        OnError(request, response);
        return httplib::Server::HandlerResponse::Handled;
      }));
  server.set_exception_handler(
      [](const httplib::Request& request, httplib::Response& response, std::exception_ptr error) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        std::cerr << "http: " << request.method << " " << request.path << " failed: " << what << "\n";
        SetJsonError(response, 500, "internal error while serving the request", "server_error");
      });
  if (auto parsed = ParseListenAddress(options.listen); parsed.ok()) {
    loopback_ = IsLoopbackName(parsed->host) || parsed->host == "::1";
  }
  server.set_pre_routing_handler([this](const httplib::Request& request, httplib::Response& response) {
    return Screen(request, response) ? httplib::Server::HandlerResponse::Handled
                                     : httplib::Server::HandlerResponse::Unhandled;
  });
  AddBuiltinRoutes();
  for (Route& route : routes_) {
    Handler guarded = Guarded(std::move(route.handler));
    if (route.method == "GET") server.Get(route.pattern, std::move(guarded));
    if (route.method == "POST") server.Post(route.pattern, std::move(guarded));
    if (route.method == "PUT") server.Put(route.pattern, std::move(guarded));
    if (route.method == "PATCH") server.Patch(route.pattern, std::move(guarded));
    if (route.method == "DELETE") server.Delete(route.pattern, std::move(guarded));
    if (route.method == "OPTIONS") server.Options(route.pattern, std::move(guarded));
  }
  routes_.clear();

  errno = 0;
  int bound = address.port;
  if (address.port == 0) {
    bound = server.bind_to_any_port(address.host);
  } else if (!server.bind_to_port(address.host, address.port)) {
    bound = -1;
  }
  if (bound < 0) {
    const int err = errno;
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen, ": ", BindErrorText(err)));
  }
  port_.store(bound);
  // libcpp-httplib is built with a backlog of 5: a burst of connections beyond that waits for
  // the client's SYN retry (1 s, then 3 s). Listening again on the bound socket only changes
  // the backlog.
  if (listen_socket != INVALID_SOCKET) ::listen(listen_socket, SOMAXCONN);

  // httplib's stop() acts only once the accept loop runs, so Start waits for it: a Stop() right
  // after Start() then always closes the socket.
  auto listener_done = std::make_shared<std::atomic<bool>>(false);
  listener_ = std::thread([this, listener_done, listen = options.listen] {
    if (!server_->listen_after_bind() && port_.load() != 0) {
      std::cerr << "http: the listener on " << listen << " stopped: accept failed\n";
    }
    listener_done->store(true);
  });
  while (!server.is_running() && !listener_done->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return absl::OkStatus();
}

void HttpServer::Stop() {
  if (server_ == nullptr) return;
  port_.store(0);
  server_->stop();
  if (listener_.joinable()) listener_.join();
  server_.reset();
}

}  // namespace moe::scheduler
