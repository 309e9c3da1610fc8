#include "moe/scheduler/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe::scheduler {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::Render(const std::string& name, const std::string& help, std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    absl::StrAppend(out, name, "_bucket{le=\"", absl::StrFormat("%g", bounds_[i]), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, name, "_bucket{le=\"+Inf\"} ", count_, "\n", name, "_sum ", absl::StrFormat("%.9g", sum_), "\n",
                  name, "_count ", count_, "\n");
}

namespace {
std::vector<double> LatencyBounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}
}  // namespace

Metrics::Metrics()
    : queue_seconds(LatencyBounds()),
      first_token_seconds(LatencyBounds()),
      inter_token_seconds(LatencyBounds()),
      request_seconds(LatencyBounds()),
      step_seconds(LatencyBounds()) {}

void Metrics::CountRejected(absl::StatusCode code) {
  const int i = static_cast<int>(code);
  if (i >= 0 && i < kCodes) ++rejected_[i];
}

std::string Metrics::Render(const SchedulerStats& stats) const {
  std::string out;
  auto gauge = [&](const char* name, const char* help, double v) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " gauge\n", name, " ", v, "\n");
  };
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n", name, " ", v, "\n");
  };
  gauge("moeserve_requests_running", "Sequences in the running batch.", stats.running);
  gauge("moeserve_requests_waiting", "Requests waiting to start.", stats.waiting);
  gauge("moeserve_kv_blocks_used", "KV cache blocks held by sequences.", stats.blocks_used);
  gauge("moeserve_kv_blocks_free", "KV cache blocks free.", stats.blocks_free);
  counter("moeserve_preemptions_total", "Sequences preempted for lack of KV blocks.", stats.preemptions);
  counter("moeserve_prompt_tokens_total", "Prompt tokens of finished requests.", prompt_tokens.load());
  counter("moeserve_generated_tokens_total", "Tokens generated.", generated_tokens.load());
  counter("moeserve_requests_finished_total", "Requests that ended normally.", requests_finished.load());
  counter("moeserve_requests_aborted_total", "Requests aborted or past their deadline.", requests_aborted.load());
  counter("moeserve_requests_failed_total", "Requests that ended in an error.", requests_failed.load());
  absl::StrAppend(&out,
                  "# HELP moeserve_requests_rejected_total Requests refused before they ran, by status code.\n"
                  "# TYPE moeserve_requests_rejected_total counter\n");
  for (int i = 1; i < kCodes; ++i) {
    absl::StrAppend(&out, "moeserve_requests_rejected_total{code=\"",
                    absl::StatusCodeToString(static_cast<absl::StatusCode>(i)), "\"} ", rejected_[i].load(), "\n");
  }
  queue_seconds.Render("moeserve_queue_seconds", "Arrival to the first step working on the request.", &out);
  first_token_seconds.Render("moeserve_time_to_first_token_seconds", "Arrival to the first token.", &out);
  inter_token_seconds.Render("moeserve_inter_token_seconds", "Time between tokens of a request.", &out);
  request_seconds.Render("moeserve_request_seconds", "Arrival to the end of a request.", &out);
  step_seconds.Render("moeserve_step_seconds", "Time of one scheduler step.", &out);
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen,
                                                                    std::function<std::string()> render) {
  const size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", listen, "' is not HOST:PORT"));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const std::string host = listen.substr(0, colon) == "localhost" ? "127.0.0.1" : listen.substr(0, colon);
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", listen, "': host must be an IPv4 address"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(server->fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (server->fd_ < 0 || ::bind(server->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(server->fd_, 16) != 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", listen, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(server->fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  server->port_ = ntohs(addr.sin_port);
  server->render_ = std::move(render);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
}

void MetricsServer::Loop() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    timeval tv{1, 0};
    ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[4096];
    const ssize_t n = ::recv(client, buf, sizeof(buf) - 1, 0);
    std::string response;
    if (n > 0 && std::string_view(buf, n).rfind("GET /metrics", 0) == 0) {
      const std::string body = render_();
      response = absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: ",
                              body.size(), "\r\nConnection: close\r\n\r\n", body);
    } else {
      response = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    }
    for (size_t sent = 0; sent < response.size();) {
      const ssize_t w = ::send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (w <= 0) break;
      sent += static_cast<size_t>(w);
    }
    ::close(client);
  }
}

}  // namespace moe::scheduler
