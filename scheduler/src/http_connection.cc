#include "http_connection.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace moe::scheduler::internal {
namespace {

using Clock = std::chrono::steady_clock;

int MsUntil(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

void Address(const sockaddr_storage& addr, std::string* ip, int* port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    *port = ntohs(in->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    *port = ntohs(in6->sin6_port);
  }
  *ip = text;
}

// One connection's bytes, read ahead into a buffer that lives as long as the connection.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(socket_t sock, std::chrono::milliseconds read_timeout, std::chrono::milliseconds write_timeout,
                   std::chrono::milliseconds head_timeout)
      : sock_(sock), read_timeout_(read_timeout), write_timeout_(write_timeout), head_timeout_(head_timeout) {}

  // Waits up to `keep_alive` for the next request (bytes buffered, or readable), looking at
  // `listening` (the server's socket: invalid once it stops) every 100 ms. Then the head's
  // deadline starts.
  bool WaitForRequest(std::chrono::seconds keep_alive, const std::atomic<socket_t>& listening) {
    const Clock::time_point until = Clock::now() + keep_alive;
    while (buffered() == 0) {
      if (listening.load() == INVALID_SOCKET) return false;
      const int wait = std::min(MsUntil(until), 100);
      pollfd p{sock_, POLLIN, 0};
      const int rc = ::poll(&p, 1, wait);
      if (rc > 0) {
        if (Fill() <= 0) return false;
        break;
      }
      if (rc < 0 && errno != EINTR) return false;
      if (Clock::now() >= until) return false;
    }
    in_head_ = true;
    head_deadline_ = Clock::now() + head_timeout_;
    tail_ = 0;
    return true;
  }

  bool is_readable() const override {
    if (buffered() > 0) return true;
    pollfd p{sock_, POLLIN, 0};
    return ::poll(&p, 1, WaitMs()) > 0;
  }
  bool is_writable() const override {
    pollfd p{sock_, POLLOUT, 0};
    return ::poll(&p, 1, static_cast<int>(write_timeout_.count())) > 0;
  }

  ssize_t read(char* ptr, size_t size) override {
    if (buffered() == 0) {
      pollfd p{sock_, POLLIN, 0};
      int rc;
      while ((rc = ::poll(&p, 1, WaitMs())) < 0 && errno == EINTR) {
      }
      if (rc <= 0) return -1;  // the read timeout, or the head's deadline
      const ssize_t n = Fill();
      if (n <= 0) return n;
    }
    const size_t n = std::min(size, buffered());
    std::memcpy(ptr, buffer_.data() + offset_, n);
    offset_ += n;
    if (in_head_) WatchHead(ptr, n);
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    size_t sent = 0;
    while (sent < size) {
      if (!is_writable()) return sent > 0 ? static_cast<ssize_t>(sent) : -1;
      const ssize_t n = ::send(sock_, ptr + sent, size - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return sent > 0 ? static_cast<ssize_t>(sent) : -1;
      sent += static_cast<size_t>(n);
    }
    return static_cast<ssize_t>(sent);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::getpeername(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) Address(addr, &ip, &port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) Address(addr, &ip, &port);
  }
  socket_t socket() const override { return sock_; }

 private:
  size_t buffered() const { return buffer_.size() - offset_; }

  // The wait for more bytes: the read timeout, or what is left of the head's deadline.
  int WaitMs() const {
    const int read = static_cast<int>(read_timeout_.count());
    return in_head_ ? std::min(read, MsUntil(head_deadline_)) : read;
  }

  // Reads what has arrived (at most 64 KiB) after what is buffered.
  ssize_t Fill() {
    if (offset_ > 0) {
      buffer_.erase(0, offset_);
      offset_ = 0;
    }
    char chunk[64 << 10];
    ssize_t n;
    while ((n = ::recv(sock_, chunk, sizeof(chunk), 0)) < 0 && errno == EINTR) {
    }
    if (n > 0) buffer_.append(chunk, static_cast<size_t>(n));
    return n;
  }

  // The head ends at the first empty line: after it, the body reads under the read timeout only.
  void WatchHead(const char* data, size_t n) {
    for (size_t i = 0; i < n && in_head_; ++i) {
      tail_ = (tail_ << 8) | static_cast<uint8_t>(data[i]);
      if ((tail_ & 0xffffffffu) == 0x0d0a0d0au || (tail_ & 0xffffu) == 0x0a0au) in_head_ = false;
    }
  }

  const socket_t sock_;
  const std::chrono::milliseconds read_timeout_, write_timeout_, head_timeout_;
  std::string buffer_;
  size_t offset_ = 0;
  bool in_head_ = false;
  Clock::time_point head_deadline_;
  uint32_t tail_ = 0;  // the last bytes read of the head
};

}  // namespace

void PipelinedServer::MarkForClose(const httplib::Request& request) {
  absl::MutexLock lock(&mu_);
  marked_.insert({request.remote_addr, request.remote_port});
}

bool PipelinedServer::TakeMark(const std::string& ip, int port) {
  absl::MutexLock lock(&mu_);
  return marked_.erase({ip, port}) > 0;
}

bool PipelinedServer::process_and_close_socket(socket_t sock) {
  const auto ms = [](time_t sec, time_t usec) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::seconds(sec) +
                                                                 std::chrono::microseconds(usec));
  };
  ConnectionStream stream(sock, ms(read_timeout_sec_, read_timeout_usec_), ms(write_timeout_sec_, write_timeout_usec_),
                          head_timeout_);
  std::string ip;
  int port = 0;
  stream.get_remote_ip_and_port(ip, port);
  bool ok = false;
  for (size_t count = keep_alive_max_count_; count > 0; --count) {
    if (!stream.WaitForRequest(std::chrono::seconds(keep_alive_timeout_sec_), svr_sock_)) break;
    bool closed = false;
    ok = process_request(stream, /*close_connection=*/count == 1, closed, nullptr);
    if (TakeMark(ip, port) || !ok || closed) break;
  }
  TakeMark(ip, port);
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

}  // namespace moe::scheduler::internal
