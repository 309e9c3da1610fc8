#include "moe/comm/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "deadline.h"
#include "moe/core/logging.h"
#include "moe/core/status.h"

namespace moe::comm {
namespace {

enum Op : uint32_t { kSet = 1, kGet = 2, kWait = 3, kAuth = 4 };
enum Code : uint32_t { kOk = 0, kTimeout = 1, kBadRequest = 2, kTooLarge = 3, kFull = 4, kUnauthenticated = 5 };

constexpr size_t kRequestHeaderBytes = 20;  // magic, op, timeout_ms, key_len, value_len
constexpr size_t kReplyHeaderBytes = 8;     // code, len
constexpr size_t kMaxRequestBytes = kRequestHeaderBytes + kMaxKeyBytes + kMaxValueBytes;
// Replies carry a value or a short reason.
constexpr size_t kMaxReplyPayloadBytes = kMaxValueBytes + 4096;
// How long past its own timeout a client waits for the server's answer before it gives up on the
// connection (a server that is gone or stuck).
constexpr absl::Duration kReplyGrace = absl::Seconds(10);

void PutU32(std::string& out, uint32_t v) {
  const uint32_t be = htonl(v);
  out.append(reinterpret_cast<const char*>(&be), 4);
}

uint32_t GetU32(const char* p) {
  uint32_t be;
  std::memcpy(&be, p, 4);
  return ntohl(be);
}

// Bytes of the request at the front of `in` once all of it has arrived, else 0. A header whose
// sizes are over the limits counts as whole: it is refused without waiting for the rest.
size_t WholeRequestBytes(const std::string& in) {
  if (in.size() < kRequestHeaderBytes) return 0;
  const uint32_t key_len = GetU32(in.data() + 12), value_len = GetU32(in.data() + 16);
  if (key_len > kMaxKeyBytes || value_len > kMaxValueBytes) return kRequestHeaderBytes;
  const size_t frame = kRequestHeaderBytes + key_len + value_len;
  return in.size() >= frame ? frame : 0;
}

uint32_t TimeoutMs(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1)));
  return static_cast<uint32_t>(std::min<int64_t>(ms, UINT32_MAX));
}

std::string PeerName(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "a client";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return FormatHostPort(host, port);
}

// Equality in time that does not depend on where the two differ.
bool SecretsEqual(std::string_view a, std::string_view b) {
  if (a.empty() || b.empty()) return false;
  uint8_t diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) diff |= static_cast<uint8_t>(a[i % a.size()] ^ b[i]);
  return diff == 0;
}

}  // namespace

// The server's state, touched only by its thread.
class RendezvousServer::Loop {
 public:
  Loop(TcpSocket listener, int wake_read, const RendezvousServerOptions& options)
      : listener_(std::move(listener)), wake_read_(wake_read), options_(options) {}
  ~Loop() { ::close(wake_read_); }

  // Serves until Stop(): a byte on the wake pipe with `stop` set.
  void Run(const std::atomic<bool>& stop);
  // Keys to drop at the next turn (from any thread).
  void QueueDrop(std::string prefix) {
    absl::MutexLock lock(&drops_mu_);
    drops_.push_back(std::move(prefix));
  }

 private:
  struct Connection {
    TcpSocket socket;
    std::string peer;      // for messages
    std::string in;        // received, not yet served
    std::string out;       // the answer being sent
    size_t out_sent = 0;   // of `out`
    bool closing = false;  // close once `out` is sent: the stream cannot be trusted
    bool dead = false;
    bool waiting = false;  // a GET or WAIT for a key not set yet
    bool authenticated = false;  // sent the store's secret (or the store has none)
    uint32_t wait_op = 0;
    std::string wait_key;
    absl::Time wait_deadline;
  };

  void Accept();
  void Read(Connection& c);
  void Flush(Connection& c);
  // Serves the complete requests in c.in, one at a time, while nothing else is pending.
  void Serve(Connection& c);
  bool Serviceable(const Connection& c) const {
    return !c.dead && !c.closing && !c.waiting && c.out.empty() && WholeRequestBytes(c.in) > 0;
  }
  void Answer(Connection& c, uint32_t code, std::string_view payload);
  void Refuse(Connection& c, uint32_t code, const std::string& reason);
  void HandleSet(Connection& c, std::string key, std::string value);
  void AnswerWait(Connection& c, uint32_t op, const std::string& value);
  void WakeWaiters(const std::string& key);
  void ExpireWaits();
  absl::Time NextDeadline() const;

  TcpSocket listener_;
  const int wake_read_;
  const RendezvousServerOptions options_;
  std::vector<std::unique_ptr<Connection>> connections_;
  absl::flat_hash_map<std::string, std::string> store_;
  int64_t store_bytes_ = 0;
  absl::Mutex drops_mu_;
  std::vector<std::string> drops_ ABSL_GUARDED_BY(drops_mu_);
  void ApplyDrops();
};

void RendezvousServer::Loop::ApplyDrops() {
  std::vector<std::string> drops;
  {
    absl::MutexLock lock(&drops_mu_);
    drops.swap(drops_);
  }
  for (const std::string& prefix : drops) {
    for (auto it = store_.begin(); it != store_.end();) {
      if (it->first.rfind(prefix, 0) == 0) {
        store_bytes_ -= static_cast<int64_t>(it->first.size() + it->second.size());
        store_.erase(it++);
      } else {
        ++it;
      }
    }
  }
}

void RendezvousServer::Loop::Run(const std::atomic<bool>& stop) {
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    const bool room = static_cast<int>(connections_.size()) < options_.max_connections;
    fds.push_back({room ? listener_.fd() : -1, POLLIN, 0});
    bool ready_now = false;
    for (const auto& c : connections_) {
      short events = 0;
      if (!c->closing && c->in.size() < kMaxRequestBytes) events |= POLLIN;
      if (!c->out.empty()) events |= POLLOUT;
      fds.push_back({c->socket.fd(), events, 0});
      ready_now = ready_now || Serviceable(*c);
    }
    const int timeout = ready_now ? 0 : internal::PollTimeoutMs(NextDeadline());
    const int rc = ::poll(fds.data(), fds.size(), timeout);
    if (rc < 0 && errno != EINTR) {
      MOE_LOG(kError) << "rendezvous store: poll failed: " << std::strerror(errno) << "; the store stops";
      return;
    }
    if (rc > 0 && fds[0].revents != 0) {
      char bytes[64];
      while (::read(wake_read_, bytes, sizeof(bytes)) > 0) {
      }
      if (stop.load()) return;  // Stop()
      ApplyDrops();
    }
    if (rc > 0 && (fds[1].revents & POLLIN)) Accept();
    for (size_t i = 0; rc > 0 && i + 2 < fds.size() && i < connections_.size(); ++i) {
      Connection& c = *connections_[i];
      const short revents = fds[i + 2].revents;
      if (revents & (POLLIN | POLLHUP | POLLERR)) Read(c);
      if (!c.dead && (revents & POLLOUT)) Flush(c);
    }
    // A SET may answer another connection's wait, which may then serve its next request.
    for (bool progress = true; progress;) {
      progress = false;
      for (const auto& c : connections_) {
        if (Serviceable(*c)) {
          Serve(*c);
          progress = true;
        }
        if (!c->dead && !c->out.empty()) Flush(*c);
      }
    }
    ExpireWaits();
    for (const auto& c : connections_) {
      if (!c->dead && !c->out.empty()) Flush(*c);
    }
    std::erase_if(connections_, [](const std::unique_ptr<Connection>& c) { return c->dead; });
  }
}

void RendezvousServer::Loop::Accept() {
  while (static_cast<int>(connections_.size()) < options_.max_connections) {
    const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        MOE_LOG(kWarning) << "rendezvous store: accept: " << std::strerror(errno);
      }
      return;
    }
    auto c = std::make_unique<Connection>();
    c->socket = TcpSocket(fd);
    c->peer = PeerName(fd);
    connections_.push_back(std::move(c));
  }
}

void RendezvousServer::Loop::Read(Connection& c) {
  if (c.closing) {  // only a hang-up or an error gets here: the client is gone
    c.dead = true;
    return;
  }
  char buffer[64 << 10];
  while (c.in.size() < kMaxRequestBytes) {
    const size_t want = std::min(sizeof(buffer), kMaxRequestBytes - c.in.size());
    const ssize_t n = ::recv(c.socket.fd(), buffer, want, 0);
    if (n > 0) {
      c.in.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // Closed (n == 0) or reset: a client that leaves mid-frame or mid-wait only loses itself.
    c.dead = true;
    return;
  }
}

void RendezvousServer::Loop::Flush(Connection& c) {
  while (c.out_sent < c.out.size()) {
    const ssize_t n =
        ::send(c.socket.fd(), c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out_sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    c.dead = true;
    return;
  }
  c.out.clear();
  c.out_sent = 0;
  if (c.closing) c.dead = true;
}

void RendezvousServer::Loop::Answer(Connection& c, uint32_t code, std::string_view payload) {
  PutU32(c.out, code);
  PutU32(c.out, static_cast<uint32_t>(payload.size()));
  c.out.append(payload);
}

void RendezvousServer::Loop::Refuse(Connection& c, uint32_t code, const std::string& reason) {
  MOE_LOG(kWarning) << "rendezvous store: " << c.peer << ": " << reason << "; closing that connection";
  Answer(c, code, reason);
  c.closing = true;
  c.in.clear();
}

void RendezvousServer::Loop::Serve(Connection& c) {
  while (Serviceable(c)) {
    const char* h = c.in.data();
    const uint32_t magic = GetU32(h), op = GetU32(h + 4), timeout_ms = GetU32(h + 8);
    const uint32_t key_len = GetU32(h + 12), value_len = GetU32(h + 16);
    if (magic != kRendezvousMagic) {
      return Refuse(
          c, kBadRequest,
          absl::StrFormat("not a rendezvous request (magic 0x%08x, expected 0x%08x)", magic, kRendezvousMagic));
    }
    if (op != kSet && op != kGet && op != kWait && op != kAuth) {
      return Refuse(c, kBadRequest, absl::StrCat("unknown op ", op, " (1 SET, 2 GET, 3 WAIT, 4 AUTH)"));
    }
    if (op != kAuth && !c.authenticated && !options_.secret.empty()) {
      return Refuse(c, kUnauthenticated, "this store needs the deployment's control-plane secret: AUTH with it first");
    }
    if (key_len == 0) return Refuse(c, kBadRequest, "empty key");
    if (key_len > kMaxKeyBytes) {
      return Refuse(c, kTooLarge, absl::StrCat("key of ", key_len, " bytes is over the limit of ", kMaxKeyBytes));
    }
    if (value_len > kMaxValueBytes) {
      return Refuse(c, kTooLarge, absl::StrCat("value of ", value_len, " bytes is over the limit of ", kMaxValueBytes));
    }
    if (op != kSet && op != kAuth && value_len != 0) return Refuse(c, kBadRequest, "GET and WAIT carry no value");
    const size_t frame = kRequestHeaderBytes + key_len + value_len;
    if (c.in.size() < frame) return;  // the rest is still on its way
    std::string key = c.in.substr(kRequestHeaderBytes, key_len);
    std::string value = c.in.substr(kRequestHeaderBytes + key_len, value_len);
    c.in.erase(0, frame);
    if (op == kAuth) {
      if (!options_.secret.empty() && !SecretsEqual(value, options_.secret)) {
        return Refuse(c, kUnauthenticated, "wrong control-plane secret");
      }
      c.authenticated = true;
      Answer(c, kOk, "");
      continue;
    }
    if (op == kSet) {
      HandleSet(c, std::move(key), std::move(value));
      continue;
    }
    if (auto it = store_.find(key); it != store_.end()) {
      AnswerWait(c, op, it->second);
    } else if (timeout_ms == 0) {
      Answer(c, kTimeout, "");
    } else {
      c.waiting = true;
      c.wait_op = op;
      c.wait_key = std::move(key);
      c.wait_deadline = absl::Now() + absl::Milliseconds(timeout_ms);
    }
  }
}

void RendezvousServer::Loop::HandleSet(Connection& c, std::string key, std::string value) {
  auto it = store_.find(key);
  const int64_t added = it == store_.end()
                            ? static_cast<int64_t>(key.size() + value.size())
                            : static_cast<int64_t>(value.size()) - static_cast<int64_t>(it->second.size());
  if (store_bytes_ + added > options_.max_store_bytes) {
    Answer(c, kFull,
           absl::StrCat("the store holds ", store_bytes_, " bytes; setting '", key, "' would pass its limit of ",
                        options_.max_store_bytes, " (restart the server, or raise max_store_bytes)"));
    return;
  }
  store_bytes_ += added;
  if (it == store_.end()) {
    store_.emplace(key, std::move(value));
  } else {
    it->second = std::move(value);
  }
  Answer(c, kOk, "");
  WakeWaiters(key);
}

void RendezvousServer::Loop::AnswerWait(Connection& c, uint32_t op, const std::string& value) {
  Answer(c, kOk, op == kGet ? std::string_view(value) : std::string_view());
}

void RendezvousServer::Loop::WakeWaiters(const std::string& key) {
  const std::string& value = store_.at(key);
  for (const auto& c : connections_) {
    if (c->dead || !c->waiting || c->wait_key != key) continue;
    c->waiting = false;
    AnswerWait(*c, c->wait_op, value);
  }
}

void RendezvousServer::Loop::ExpireWaits() {
  const absl::Time now = absl::Now();
  for (const auto& c : connections_) {
    if (c->dead || !c->waiting || c->wait_deadline > now) continue;
    c->waiting = false;
    Answer(*c, kTimeout, "");
  }
}

absl::Time RendezvousServer::Loop::NextDeadline() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& c : connections_) {
    if (c->waiting) next = std::min(next, c->wait_deadline);
  }
  return next;
}

RendezvousServer::RendezvousServer(std::string host, int port, TcpSocket listener, int wake_read, int wake_write,
                                   const RendezvousServerOptions& options)
    : host_(std::move(host)),
      port_(port),
      wake_write_(wake_write),
      loop_(std::make_unique<Loop>(std::move(listener), wake_read, options)) {
  thread_ = std::thread([this] { loop_->Run(stop_requested_); });
}

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::Start(const RendezvousServerOptions& options) {
  if (options.max_connections < 1 || options.max_store_bytes < 1) {
    return absl::InvalidArgumentError("rendezvous store: max_connections and max_store_bytes must be positive");
  }
  int port = 0;
  auto listener = ListenTcp(options.host, options.port, &port);
  if (!listener.ok()) return core::Annotate(listener.status(), "rendezvous store");
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("rendezvous store: pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<RendezvousServer>(
      new RendezvousServer(options.host, port, *std::move(listener), wake[0], wake[1], options));
}

RendezvousServer::~RendezvousServer() { Stop(); }

std::string RendezvousServer::address() const { return FormatHostPort(host_, port_); }

void RendezvousServer::DropKeys(std::string prefix) {
  absl::MutexLock lock(&stop_mu_);
  if (stopped_) return;
  loop_->QueueDrop(std::move(prefix));
  const char byte = 2;
  while (::write(wake_write_, &byte, 1) < 0 && errno == EINTR) {
  }
}

void RendezvousServer::Stop() {
  absl::MutexLock lock(&stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  stop_requested_.store(true);
  const char byte = 1;
  while (::write(wake_write_, &byte, 1) < 0 && errno == EINTR) {
  }
  if (thread_.joinable()) thread_.join();
  loop_.reset();  // closes the listener and every connection
  ::close(wake_write_);
  wake_write_ = -1;
}

RendezvousClient::RendezvousClient(std::string address, HostPort server, TcpSocket socket,
                                   absl::Duration connect_timeout, std::string secret)
    : address_(std::move(address)),
      server_(std::move(server)),
      connect_timeout_(connect_timeout),
      secret_(std::move(secret)),
      socket_(std::move(socket)) {}

absl::StatusOr<std::unique_ptr<RendezvousClient>> RendezvousClient::Connect(std::string_view address,
                                                                            absl::Duration connect_timeout,
                                                                            std::string secret) {
  MOE_ASSIGN_OR_RETURN(HostPort server, ParseHostPort(address, "rendezvous store address"));
  auto socket = ConnectTcp(server.host, server.port, absl::Now() + connect_timeout);
  if (!socket.ok()) return core::Annotate(socket.status(), "rendezvous store");
  std::unique_ptr<RendezvousClient> client(new RendezvousClient(
      std::string(address), std::move(server), *std::move(socket), connect_timeout, std::move(secret)));
  absl::MutexLock lock(&client->mu_);
  if (absl::Status s = client->EnsureConnected(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("rendezvous store at ", client->address_, ": ", s.message()));
  }
  return client;
}

absl::Status RendezvousClient::EnsureConnected() {
  if (!socket_.valid()) {
    MOE_ASSIGN_OR_RETURN(socket_, ConnectTcp(server_.host, server_.port, absl::Now() + connect_timeout_));
    authenticated_ = false;
  }
  if (secret_.empty() || authenticated_) return absl::OkStatus();
  MOE_ASSIGN_OR_RETURN(const Reply reply, Exchange(kAuth, "auth", secret_, absl::ZeroDuration()));
  if (reply.code != kOk) {
    socket_.Close();
    return absl::UnauthenticatedError(absl::StrCat("the store refused this client's secret: ", reply.payload));
  }
  authenticated_ = true;
  return absl::OkStatus();
}

absl::StatusOr<RendezvousClient::Reply> RendezvousClient::Call(uint32_t op, std::string_view key,
                                                               std::string_view value, absl::Duration timeout) {
  MOE_RETURN_IF_ERROR(EnsureConnected());
  return Exchange(op, key, value, timeout);
}

absl::StatusOr<RendezvousClient::Reply> RendezvousClient::Exchange(uint32_t op, std::string_view key,
                                                                   std::string_view value, absl::Duration timeout) {
  std::string frame;
  frame.reserve(kRequestHeaderBytes + key.size() + value.size());
  PutU32(frame, kRendezvousMagic);
  PutU32(frame, op);
  PutU32(frame, TimeoutMs(timeout));
  PutU32(frame, static_cast<uint32_t>(key.size()));
  PutU32(frame, static_cast<uint32_t>(value.size()));
  frame.append(key);
  frame.append(value);
  const absl::Time deadline = absl::Now() + std::max(timeout, absl::ZeroDuration()) + kReplyGrace;
  Reply reply;
  char header[kReplyHeaderBytes];
  absl::Status status = SendAll(socket_, frame.data(), frame.size(), deadline, "request");
  if (status.ok()) status = RecvAll(socket_, header, sizeof(header), deadline, "reply");
  if (status.ok()) {
    reply.code = GetU32(header);
    const uint32_t len = GetU32(header + 4);
    if (len > kMaxReplyPayloadBytes) {
      status = absl::InternalError(absl::StrCat("reply of ", len, " bytes: not a rendezvous store"));
    } else {
      reply.payload.resize(len);
      status = RecvAll(socket_, reply.payload.data(), len, deadline, "reply");
    }
  }
  if (!status.ok() || reply.code == kBadRequest || reply.code == kTooLarge || reply.code == kUnauthenticated) {
    socket_.Close();
  }
  if (!status.ok()) return status;
  return reply;
}

absl::StatusOr<std::string> RendezvousClient::Request(uint32_t op, std::string_view key, std::string_view value,
                                                      absl::Duration timeout) {
  const std::string where = absl::StrCat("rendezvous store at ", address_, ": ");
  if (key.empty() || static_cast<int64_t>(key.size()) > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "a key has 1 to ", kMaxKeyBytes, " bytes; this one has ", key.size()));
  }
  if (static_cast<int64_t>(value.size()) > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, "the value of '", std::string(key), "' has ", value.size(),
                                                   " bytes, over the store's limit of ", kMaxValueBytes));
  }
  absl::StatusOr<Reply> reply;
  {
    absl::MutexLock lock(&mu_);
    reply = Call(op, key, value, timeout);
  }
  if (!reply.ok()) {
    return absl::Status(reply.status().code(), absl::StrCat(where, reply.status().message()));
  }
  switch (reply->code) {
    case kOk:
      return std::move(reply->payload);
    case kTimeout:
      return NotSet(key, timeout);
    case kBadRequest:
    case kTooLarge:
      return absl::InvalidArgumentError(absl::StrCat(where, "refused: ", reply->payload));
    case kFull:
      return absl::ResourceExhaustedError(absl::StrCat(where, reply->payload));
    case kUnauthenticated:
      return absl::UnauthenticatedError(absl::StrCat(where, "refused: ", reply->payload));
    default:
      return absl::InternalError(absl::StrCat(where, "unknown reply code ", reply->code));
  }
}

absl::Status RendezvousClient::Set(std::string_view key, std::string_view value) {
  return Request(kSet, key, value, absl::ZeroDuration()).status();
}

absl::StatusOr<std::string> RendezvousClient::Get(std::string_view key, absl::Duration timeout) {
  return Request(kGet, key, "", timeout);
}

absl::Status RendezvousClient::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (const std::string& key : keys) {
    const absl::Status s = Request(kWait, key, "", std::max(deadline - absl::Now(), absl::ZeroDuration())).status();
    if (s.code() == absl::StatusCode::kDeadlineExceeded) return NotSet(key, timeout);  // the whole wait's timeout
    MOE_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

absl::Status RendezvousClient::NotSet(std::string_view key, absl::Duration timeout) const {
  return absl::DeadlineExceededError(absl::StrCat("rendezvous store at ", address_, ": key '", std::string(key),
                                                  "' was not set within ", absl::FormatDuration(timeout),
                                                  " (has every rank started, with the same store address and "
                                                  "prefix?)"));
}

}  // namespace moe::comm
