#include "moe/comm/tcp_socket.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "deadline.h"
#include "moe/core/status.h"

namespace moe::comm {
namespace {

struct AddrInfoFree {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfoList = std::unique_ptr<addrinfo, AddrInfoFree>;

absl::StatusOr<AddrInfoList> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host '", host, "' does not resolve: ", gai_strerror(rc), " (give an IP address or a host name)"));
  }
  return AddrInfoList(list);
}

void SetNoDelay(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Waits until `fd` is ready for `events` or the deadline passes (false then).
absl::StatusOr<bool> WaitReady(int fd, short events, absl::Time deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int rc = ::poll(&p, 1, internal::PollTimeoutMs(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
  }
}

// Sends or receives exactly n bytes at p, waiting (up to the deadline) whenever the socket would
// block.
absl::Status Transfer(const TcpSocket& socket, char* p, size_t n, absl::Time deadline, std::string_view what,
                      bool sending) {
  size_t done = 0;
  while (done < n) {
    const ssize_t rc =
        sending ? ::send(socket.fd(), p + done, n - done, MSG_NOSIGNAL) : ::recv(socket.fd(), p + done, n - done, 0);
    if (rc > 0) {
      done += static_cast<size_t>(rc);
      continue;
    }
    if (rc == 0) {
      return absl::UnavailableError(
          absl::StrCat(std::string(what), ": the peer closed the connection after ", done, " of ", n, " bytes"));
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      MOE_ASSIGN_OR_RETURN(const bool ready, WaitReady(socket.fd(), sending ? POLLOUT : POLLIN, deadline));
      if (!ready) {
        return absl::DeadlineExceededError(absl::StrCat(std::string(what), sending ? ": sent " : ": received ", done,
                                                        " of ", n, " bytes before the deadline"));
      }
      continue;
    }
    return absl::UnavailableError(absl::StrCat(std::string(what), ": the connection failed after ", done, " of ", n,
                                               " bytes: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

TcpSocket::~TcpSocket() { Close(); }

TcpSocket& TcpSocket::operator=(TcpSocket&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.Release();
  }
  return *this;
}

int TcpSocket::Release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void TcpSocket::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

absl::StatusOr<HostPort> ParseHostPort(std::string_view address, std::string_view what) {
  HostPort out;
  std::string_view port_text;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string_view::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(what), " '", std::string(address), "': expected [IPV6]:PORT"));
    }
    out.host = std::string(address.substr(1, close - 1));
    port_text = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(what), " '", std::string(address), "': expected HOST:PORT"));
    }
    out.host = std::string(address.substr(0, colon));
    if (out.host.find(':') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(std::string(what), " '", std::string(address),
                                                     "': an IPv6 host goes in brackets, e.g. [::1]:29500"));
    }
    port_text = address.substr(colon + 1);
  }
  if (out.host.empty())
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), " '", std::string(address), "': the host is empty"));
  if (!absl::SimpleAtoi(absl::string_view(port_text.data(), port_text.size()), &out.port) || out.port < 0 ||
      out.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), " '", std::string(address), "': the port must be an integer in [0, 65535]"));
  }
  return out;
}

std::string FormatHostPort(std::string_view host, int port) {
  if (host.find(':') != std::string_view::npos) return absl::StrCat("[", std::string(host), "]:", port);
  return absl::StrCat(std::string(host), ":", port);
}

absl::Status CheckHostResolves(const std::string& host) { return Resolve(host, 0, /*passive=*/false).status(); }

absl::StatusOr<TcpSocket> ListenTcp(const std::string& host, int port, int* bound_port) {
  auto list = Resolve(host, port, /*passive=*/true);
  if (!list.ok()) return list.status();
  std::string last_error = "no address";
  for (addrinfo* a = list->get(); a != nullptr; a = a->ai_next) {
    TcpSocket socket(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!socket.valid()) {
      last_error = absl::StrCat("socket: ", std::strerror(errno));
      continue;
    }
    int one = 1;
    (void)setsockopt(socket.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(socket.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(socket.fd(), 512) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      return absl::InternalError(absl::StrCat("getsockname: ", std::strerror(errno)));
    }
    *bound_port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                              : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return socket;
  }
  return absl::UnavailableError(absl::StrCat("cannot listen on ", FormatHostPort(host, port), ": ", last_error,
                                             " (is the port taken? port 0 picks a free one)"));
}

absl::StatusOr<TcpSocket> AcceptTcp(const TcpSocket& listener, absl::Time deadline) {
  for (;;) {
    const int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      SetNoDelay(fd);
      return TcpSocket(fd);
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return absl::InternalError(absl::StrCat("accept: ", std::strerror(errno)));
    }
    auto ready = WaitReady(listener.fd(), POLLIN, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("no connection came before the deadline");
  }
}

absl::StatusOr<TcpSocket> ConnectTcp(const std::string& host, int port, absl::Time deadline) {
  auto list = Resolve(host, port, /*passive=*/false);
  if (!list.ok()) return list.status();
  std::string last_error = "no address";
  for (;;) {
    for (addrinfo* a = list->get(); a != nullptr; a = a->ai_next) {
      TcpSocket socket(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
      if (!socket.valid()) {
        last_error = absl::StrCat("socket: ", std::strerror(errno));
        continue;
      }
      int err = 0;
      if (::connect(socket.fd(), a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          auto ready = WaitReady(socket.fd(), POLLOUT, deadline);
          if (!ready.ok()) return ready.status();
          if (!*ready) {
            err = ETIMEDOUT;
          } else {
            socklen_t len = sizeof(err);
            if (getsockopt(socket.fd(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          }
        }
      }
      if (err == 0) {
        SetNoDelay(socket.fd());
        return socket;
      }
      last_error = std::strerror(err);
    }
    // Refused or unreachable: the server may not be listening yet. Try again until the deadline.
    if (absl::Now() + absl::Milliseconds(50) >= deadline) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat("cannot connect to ", FormatHostPort(host, port),
                                                  " before the deadline: ", last_error,
                                                  " (is the server running and reachable?)"));
}

absl::Status SendAll(const TcpSocket& socket, const void* data, size_t n, absl::Time deadline, std::string_view what) {
  return Transfer(socket, const_cast<char*>(static_cast<const char*>(data)), n, deadline, what, /*sending=*/true);
}

absl::Status RecvAll(const TcpSocket& socket, void* data, size_t n, absl::Time deadline, std::string_view what) {
  return Transfer(socket, static_cast<char*>(data), n, deadline, what, /*sending=*/false);
}

}  // namespace moe::comm
