// HttpServer: the one HTTP listener of a moeserve process (cpp-httplib underneath). It serves
// GET /metrics (Prometheus text), GET /health and GET /ready, and whatever routes later code adds
// with Handle() (the OpenAI API joins here), over plain TCP or TLS (mutual TLS with a client CA),
// with optional API keys checked on every route.
//
// Each open connection holds one worker thread (an idle keep-alive connection too, until
// keep_alive_timeout), and threads are added as connections arrive, up to max_connections, so
// idle or slow clients do not make a scrape wait for a thread.
//
// Thread-safety: Handle, Start and Stop from one thread; set_state, state and port from any
// thread; handlers run on the worker threads, many at once.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "moe/scheduler/security.h"

namespace moe::scheduler {

// What /health and /ready report.
// kRestarting: a deployment's workers are being restarted; requests still queue for them.
enum class ServingState { kLoading, kServing, kDraining, kRestarting };

struct HttpServerOptions {
  // HOST:PORT: an IPv4 address, [IPv6] in brackets ([::1], [::] for every address), or
  // localhost (127.0.0.1). Port 0 picks a free one (see HttpServer::port()).
  std::string listen = "127.0.0.1:0";
  TlsFiles tls;  // no cert_file: plain TCP
  // Not owned; must outlive the server. Null or empty: no key is asked for.
  const ApiKeys* api_keys = nullptr;
  // With API keys, ask for a key on /metrics, /health and /ready too (otherwise they are open, so
  // a scraper or a load balancer's probe needs no key).
  bool protect_metrics = false;
  size_t max_request_bytes = size_t{1} << 20;  // a larger body gets 413
  // Web pages (the Origin header) that may call this server from a browser: "https://app.example"
  // each, or "*" for any. None by default, as a local server should: a request that carries an
  // Origin not listed gets 403, and so does a CORS preflight (OPTIONS) for it; a listed one gets
  // Access-Control-Allow-Origin and its preflight is answered (204).
  std::vector<std::string> allowed_origins;
  // A client that sends or reads nothing for this long is cut off (per read or write).
  std::chrono::milliseconds read_timeout{5000};
  // A request's head (request line and headers) must arrive within this, from its first byte:
  // a client that trickles its headers is cut off (plain TCP; over TLS only the read timeout).
  std::chrono::milliseconds head_timeout{10000};
  std::chrono::milliseconds write_timeout{5000};
  // An idle keep-alive connection is closed after this; Stop() waits for it at most this long.
  std::chrono::seconds keep_alive_timeout{2};
  size_t max_requests_per_connection = 100;
  size_t max_connections = 256;                 // connections served at once; more wait for a thread
  std::function<std::string()> render_metrics;  // GET /metrics; none: no /metrics route
  ServingState initial_state = ServingState::kLoading;
};

class HttpServer {
 public:
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;

  HttpServer();
  ~HttpServer();  // Stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Adds a route before Start: `method` is GET, POST, PUT, PATCH, DELETE or OPTIONS, `pattern`
  // an ECMAScript regex matched against the whole path. The API-key check runs before `handler`.
  // kInvalidArgument for another method or a bad regex; kFailedPrecondition after Start.
  absl::Status Handle(std::string_view method, const std::string& pattern, Handler handler);

  // Binds the socket, then serves on a thread of its own; returns once the socket listens, so
  // every error comes back from here:
  //   kInvalidArgument: a bad address ("listen address 'X': ..."), bad options, bad TLS files;
  //   kUnavailable: "cannot listen on X: address already in use" (or why else bind failed);
  //   kFailedPrecondition: already started.
  absl::Status Start(const HttpServerOptions& options);

  // Stops accepting, then waits for the open connections' requests to end. Idempotent.
  void Stop();

  int port() const { return port_.load(); }  // the bound port; 0 before Start
  void set_state(ServingState state) { state_.store(state); }
  ServingState state() const { return state_.load(); }

 private:
  struct Route {
    std::string method, pattern;
    Handler handler;
  };
  bool Authorized(const httplib::Request& request) const;
  // Before any route: RFC 9112's framing rules, the Host of a loopback listener, the Origin and
  // CORS preflights. True when it answered the request itself.
  bool Screen(const httplib::Request& request, httplib::Response& response) const;
  bool loopback_ = false;  // the listener is on a loopback address
  Handler Guarded(Handler handler) const;
  void AddBuiltinRoutes();
  void OnError(const httplib::Request& request, httplib::Response& response) const;

  HttpServerOptions options_;
  std::vector<Route> routes_;
  std::unique_ptr<httplib::Server> server_;
  std::thread listener_;
  std::atomic<int> port_{0};
  std::atomic<ServingState> state_{ServingState::kLoading};
};

// The descriptor of the connection `request` came on (cpp-httplib 0.11 shows a handler none): the
// socket of this process whose peer and local port are the request's, or -1. For watching
// whether the client is still there, and for closing a connection that cannot be trusted.
int ConnectionSocketOf(const httplib::Request& request);

// Sets `response` to an error shaped as OpenAI's API shapes them:
// {"error": {"message": ..., "type": ..., "param": the field at fault or null, "code": status}}.
void SetJsonError(httplib::Response& response, int status, std::string_view message, std::string_view type,
                  std::string_view param = {});

}  // namespace moe::scheduler
