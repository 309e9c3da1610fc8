// A key-value store over TCP where the ranks of a group find each other. The frontend of a
// deployment runs a RendezvousServer; each worker's GlooCommunicator (and anything else that must
// exchange a few bytes before the group exists, such as an NCCL unique id) talks to it through a
// RendezvousClient. Gloo's own stores do not fit: HashStore lives in one process and FileStore
// needs a filesystem that every host shares.
//
// Wire protocol: one TCP connection per client, one request at a time, each answered before the
// next is read. Integers are unsigned 32-bit, big-endian.
//   request:  magic "MOER" (0x4d4f4552) | op | timeout_ms | key_len | value_len | key | value
//             op 1 SET key=value (overwrites)
//             op 2 GET key: waits until the key is set or timeout_ms pass, answers its value
//             op 3 WAIT key: as GET, without the value
//             op 4 AUTH value=the store's secret: a store started with a secret answers nothing
//                  else until a connection has sent it (UNAUTHENTICATED, then it closes)
//   response: code | len | payload
//             code 0 OK (payload: the value for GET, else empty); 1 TIMEOUT (the key was not set
//             in time); 2 BAD_REQUEST and 3 TOO_LARGE (payload: the reason; the server closes the
//             connection after it, since the stream cannot be trusted); 4 FULL (the store holds
//             its limit of bytes); 5 UNAUTHENTICATED (no AUTH, or a wrong secret).
// Keys are 1 to 1 KiB (kMaxKeyBytes), values at most 4 MiB (kMaxValueBytes): anything larger is
// refused from its header, before a byte of it is read. A client that disconnects, even in the
// middle of a frame, only loses its own connection. With a secret (a deployment's control-plane
// secret), a connection must AUTH first; the secret is compared in constant time. The secret is
// not encrypted on the wire: across hosts the store belongs on a private network.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/comm/tcp_socket.h"

namespace moe::comm {

inline constexpr uint32_t kRendezvousMagic = 0x4d4f4552;  // "MOER"
inline constexpr int64_t kMaxKeyBytes = 1024;
inline constexpr int64_t kMaxValueBytes = 4 << 20;

struct RendezvousServerOptions {
  std::string host = "127.0.0.1";       // an address of this host, or "0.0.0.0" for every interface
  int port = 0;                         // 0: a free port, reported by port()
  int64_t max_store_bytes = 256 << 20;  // keys and values held in all; a SET beyond answers FULL
  int max_connections = 1024;           // more wait in the kernel's backlog
  std::string secret;                   // non-empty: every connection must AUTH with it first
};

// Serves the store on one background thread (poll(2) over every connection; waiting requests
// hold no thread). Thread-safety: port(), address() and Stop() may be called from any thread.
class RendezvousServer {
 public:
  // kUnavailable when the port is taken, kInvalidArgument for a host that does not resolve.
  static absl::StatusOr<std::unique_ptr<RendezvousServer>> Start(const RendezvousServerOptions& options);
  ~RendezvousServer();  // Stop()s
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  int port() const { return port_; }
  // "HOST:PORT", what RendezvousClient::Connect and GlooOptions::store_address take.
  std::string address() const;

  // Closes every connection (waiting clients get kUnavailable) and the listener, and joins the
  // thread. Idempotent.
  void Stop();

  // Removes every key that starts with `prefix` (an old generation's), at the loop's next turn.
  // Clients waiting for such a key go on waiting.
  void DropKeys(std::string prefix);

 private:
  RendezvousServer(std::string host, int port, TcpSocket listener, int wake_read, int wake_write,
                   const RendezvousServerOptions& options);
  class Loop;

  const std::string host_;
  const int port_;
  int wake_write_ = -1;  // a byte here wakes the loop to stop
  std::unique_ptr<Loop> loop_;
  std::atomic<bool> stop_requested_{false};
  std::thread thread_;
  absl::Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
};

// One connection to a RendezvousServer. Thread-safety: calls are serialized (one request at a
// time on the connection). A failed connection is reopened by the next call.
class RendezvousClient {
 public:
  // Connects to "HOST:PORT", retrying until `connect_timeout` passes (the server may start after
  // the worker): kDeadlineExceeded then; kInvalidArgument for a malformed address. With a
  // `secret`, each connection AUTHs with it first: kUnauthenticated when the store refuses it.
  static absl::StatusOr<std::unique_ptr<RendezvousClient>> Connect(std::string_view address,
                                                                   absl::Duration connect_timeout,
                                                                   std::string secret = "");

  // kInvalidArgument for an empty or oversize key or an oversize value (nothing is sent);
  // kResourceExhausted when the store is full; kUnavailable when the server is gone.
  absl::Status Set(std::string_view key, std::string_view value);
  // Waits for the key to be set: kDeadlineExceeded after `timeout`.
  absl::StatusOr<std::string> Get(std::string_view key, absl::Duration timeout);
  // Waits for every key to be set, `timeout` for all of them together.
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout);

  const std::string& address() const { return address_; }

 private:
  RendezvousClient(std::string address, HostPort server, TcpSocket socket, absl::Duration connect_timeout,
                   std::string secret);

  struct Reply {
    uint32_t code = 0;
    std::string payload;
  };
  absl::StatusOr<Reply> Call(uint32_t op, std::string_view key, std::string_view value, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One request and its reply on the open connection.
  absl::StatusOr<Reply> Exchange(uint32_t op, std::string_view key, std::string_view value, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens the connection if it is closed, and AUTHs on a new one.
  absl::Status EnsureConnected() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::string> Request(uint32_t op, std::string_view key, std::string_view value,
                                      absl::Duration timeout);
  absl::Status NotSet(std::string_view key, absl::Duration timeout) const;

  const std::string address_;
  const HostPort server_;
  const absl::Duration connect_timeout_;
  const std::string secret_;
  absl::Mutex mu_;
  TcpSocket socket_ ABSL_GUARDED_BY(mu_);
  bool authenticated_ ABSL_GUARDED_BY(mu_) = false;  // this connection sent the secret
};

}  // namespace moe::comm
