// Plain TCP sockets with deadlines: what the rendezvous store speaks over, and what the comm
// benchmark measures its bound with. Sockets are non-blocking; every wait is a poll(2) bounded by
// a deadline, so nothing here can hang. Writes never raise SIGPIPE.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe::comm {

// A socket file descriptor, closed when the owner goes. Move-only.
class TcpSocket {
 public:
  TcpSocket() = default;
  explicit TcpSocket(int fd) : fd_(fd) {}
  ~TcpSocket();
  TcpSocket(TcpSocket&& other) noexcept : fd_(other.Release()) {}
  TcpSocket& operator=(TcpSocket&& other) noexcept;
  TcpSocket(const TcpSocket&) = delete;
  TcpSocket& operator=(const TcpSocket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release();
  void Close();

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  int port = 0;
};

// "HOST:PORT" or "[IPV6]:PORT" (port 0 to 65535); kInvalidArgument naming `what` otherwise.
absl::StatusOr<HostPort> ParseHostPort(std::string_view address, std::string_view what);
// The inverse: brackets around a host with a ':' in it.
std::string FormatHostPort(std::string_view host, int port);

// OK when `host` resolves to an address; kInvalidArgument naming it otherwise.
absl::Status CheckHostResolves(const std::string& host);

// A listening socket on host:port (port 0: the kernel picks a free one); `*bound_port` gets the
// port. kInvalidArgument for a host that does not resolve, kUnavailable when the port is taken.
absl::StatusOr<TcpSocket> ListenTcp(const std::string& host, int port, int* bound_port);

// The next connection on `listener`, or kDeadlineExceeded.
absl::StatusOr<TcpSocket> AcceptTcp(const TcpSocket& listener, absl::Time deadline);

// Connects to host:port, retrying a refused connection (the server may not be up yet) until
// the deadline: kDeadlineExceeded then, kInvalidArgument for a host that does not resolve.
absl::StatusOr<TcpSocket> ConnectTcp(const std::string& host, int port, absl::Time deadline);

// Writes / reads exactly n bytes. kDeadlineExceeded past the deadline; kUnavailable when the
// peer closes the connection or resets it. `what` names the transfer in messages.
absl::Status SendAll(const TcpSocket& socket, const void* data, size_t n, absl::Time deadline, std::string_view what);
absl::Status RecvAll(const TcpSocket& socket, void* data, size_t n, absl::Time deadline, std::string_view what);

}  // namespace moe::comm
