#include "moe/comm/gloo_communicator.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <cctype>
#include <chrono>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checks.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/address.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/types.h"
#include "moe/comm/rendezvous.h"
#include "moe/comm/tcp_socket.h"
#include "moe/core/status.h"

namespace moe::comm {
namespace {

// The slot of Send, Recv and SendRecv; Gloo's collectives use prefixes 0x01 to 0x08.
constexpr uint8_t kPointToPointSlotPrefix = 0x40;
// A slot nothing is ever sent on: DropAllConnections waits on it.
constexpr uint8_t kAbortSlotPrefix = 0x41;

// A store failure on its way through Gloo's rendezvous, which only knows exceptions.
class StoreError : public std::runtime_error {
 public:
  explicit StoreError(absl::Status status)
      : std::runtime_error(std::string(status.message())), status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Gloo's rendezvous over a RendezvousClient. Gloo expects a get to wait for the key.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(RendezvousClient& client, absl::Duration timeout) : client_(client), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    std::string value(data.begin(), data.end());
    ZeroAddressPadding(&value);
    Check(client_.Set(key, value));
  }

  // Gloo's TCP addresses go to the store as their whole sockaddr_storage (and sequence number),
  // of which getsockname filled only the address family's bytes: the rest is whatever the stack
  // held. A value that is a list of such addresses has that rest zeroed, so the store never holds
  // (nor sends any reader) a rank's uninitialised memory.
  static void ZeroAddressPadding(std::string* value) {
    constexpr size_t kAddress = sizeof(sockaddr_storage) + sizeof(ssize_t);  // gloo tcp Address::Impl
    if (value->empty() || value->size() % kAddress != 0) return;
    for (size_t at = 0; at < value->size(); at += kAddress) {
      sa_family_t family;
      std::memcpy(&family, value->data() + at, sizeof(family));
      const size_t used = family == AF_INET ? sizeof(sockaddr_in) : family == AF_INET6 ? sizeof(sockaddr_in6) : 0;
      if (used == 0) return;  // not a list of addresses
    }
    for (size_t at = 0; at < value->size(); at += kAddress) {
      sa_family_t family;
      std::memcpy(&family, value->data() + at, sizeof(family));
      const size_t used = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      std::memset(value->data() + at + used, 0, sizeof(sockaddr_storage) - used);
    }
  }
  std::vector<char> get(const std::string& key) override {
    auto value = client_.Get(key, timeout_);
    Check(value.status());
    return std::vector<char>(value->begin(), value->end());
  }
  void wait(const std::vector<std::string>& keys) override { Check(client_.Wait(keys, timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    Check(client_.Wait(keys, absl::FromChrono(timeout)));
  }

 private:
  static void Check(const absl::Status& status) {
    if (!status.ok()) throw StoreError(status);
  }
  RendezvousClient& client_;
  const absl::Duration timeout_;
};

// Gloo writes to sockets whose peer may be gone; without this a lost peer kills the process.
void IgnoreSigpipeUnlessHandled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

// Element-wise sums for Gloo's reduce function: out = a + b, n elements.
template <typename T>
void SumInts(void* out, const void* a, const void* b, size_t n) {
  using U = std::make_unsigned_t<T>;  // integers wrap, as NCCL's do
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<U>(x[i]) + static_cast<U>(y[i]));
}

void SumF32(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<float*>(out);
  const auto* x = static_cast<const float*>(a);
  const auto* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

void SumBf16(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<uint16_t*>(out);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = core::FloatToBf16(core::Bf16ToFloat(x[i]) + core::Bf16ToFloat(y[i]));
}

template <typename T>
void SetSum(gloo::AllreduceOptions& opts, void* data, int64_t count, gloo::AllreduceOptions::Func sum) {
  opts.setOutput(static_cast<T*>(data), static_cast<size_t>(count));
  opts.setReduceFunction(std::move(sum));
}

void SetSumOf(core::DType dtype, gloo::AllreduceOptions& opts, void* data, int64_t count) {
  switch (dtype) {
    case core::DType::kF32:
      return SetSum<float>(opts, data, count, &SumF32);
    case core::DType::kBF16:
      return SetSum<uint16_t>(opts, data, count, &SumBf16);
    case core::DType::kF16:
      return SetSum<gloo::float16>(
          opts, data, count, static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<gloo::float16>));
    case core::DType::kI8:
      return SetSum<int8_t>(opts, data, count, &SumInts<int8_t>);
    case core::DType::kI32:
      return SetSum<int32_t>(opts, data, count, &SumInts<int32_t>);
    case core::DType::kI64:
      return SetSum<int64_t>(opts, data, count, &SumInts<int64_t>);
    case core::DType::kF8E4M3:
      break;  // refused by CheckSummable
  }
}

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(absl::Ceil(d, absl::Milliseconds(1))));
}

}  // namespace

class GlooCommunicator::Context : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;

  // Fails every pending transfer of this rank and closes all its connections (its peers then see
  // it gone). Gloo does exactly this when a wait times out, since it cannot tell which peer is at
  // fault; so: a receive from a peer on a slot nobody sends on, waited for 1 ms. A connection that
  // has failed already refuses the receive at once, so each peer is tried until one times out.
  void DropAllConnections() {
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      try {
        char byte = 0;
        auto buffer = createUnboundBuffer(&byte, 1);
        buffer->recv(peer, gloo::Slot::build(kAbortSlotPrefix, 0));
        (void)buffer->waitRecv(std::chrono::milliseconds(1));
      } catch (const std::exception&) {
        // Timed out (every connection is now failed) or refused (this one was already).
      }
    }
  }

  // The addresses under which Gloo's errors may name each rank (none for this one). Gloo prints
  // the peer's address as the connection knows it: the address the peer published for it at the
  // rendezvous if this rank accepted the connection before it looked that up, else the far end
  // of the socket. The first is in the peer's rendezvous entry; the second, each rank publishes
  // here after connecting (its own end of every connection).
  absl::StatusOr<std::vector<std::vector<std::string>>> PeerAddresses(RendezvousClient& client,
                                                                      const std::string& prefix,
                                                                      absl::Duration timeout) {
    std::vector<std::string> mine(size);
    for (int r = 0; r < size; ++r) {
      if (r != rank) mine[r] = getPair(r)->address().str();
    }
    auto key = [&](int r) { return absl::StrCat(prefix, "/moe_connected_addresses/", r); };
    MOE_RETURN_IF_ERROR(client.Set(key(rank), absl::StrJoin(mine, "\n")));
    std::vector<std::vector<std::string>> peers(size);
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      MOE_ASSIGN_OR_RETURN(const std::string connected, client.Get(key(r), timeout));
      const std::vector<std::string> lines = absl::StrSplit(connected, '\n');
      if (static_cast<int>(lines.size()) != size) {
        return absl::InternalError(absl::StrCat("rank ", r, " published ", lines.size(), " addresses for a group of ",
                                                size, " (is another group using prefix '", prefix, "'?)"));
      }
      peers[r].push_back(lines[rank]);
      MOE_ASSIGN_OR_RETURN(const std::string published, client.Get(absl::StrCat(prefix, "/", r), timeout));
      try {
        std::vector<char> all(published.begin(), published.end());
        peers[r].push_back(gloo::transport::tcp::Address(extractAddress(all, r)).str());
      } catch (const std::exception&) {
        // Not a layout this code knows: errors then name the rank by the other address only.
      }
    }
    return peers;
  }
};

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(const GlooOptions& o) {
  const std::string where = absl::StrCat("gloo rank ", o.rank, " of ", o.size);
  if (o.size < 1) return absl::InvalidArgumentError(absl::StrCat(where, ": the group size must be at least 1"));
  if (o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the rank must be in [0, ", o.size - 1, "]"));
  }
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError(absl::StrCat(where, ": timeout <= 0"));
  if (o.prefix.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": the rendezvous prefix is empty"));
  IgnoreSigpipeUnlessHandled();

  auto client = RendezvousClient::Connect(o.store_address, o.timeout, o.store_secret);
  if (!client.ok()) return core::Annotate(client.status(), where);

  // Gloo's own lookup crashes on a host that does not resolve: check first.
  if (o.interface.empty()) {
    if (absl::Status s = CheckHostResolves(o.host); !s.ok()) return core::Annotate(s, where);
  }
  std::shared_ptr<gloo::transport::Device> device;
  try {
    gloo::transport::tcp::attr attr;
    if (!o.interface.empty()) {
      attr.iface = o.interface;
    } else {
      attr.hostname = o.host;
    }
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": cannot listen on ", o.interface.empty() ? "host '" + o.host : "interface '" + o.interface,
        "' (give an address or interface of this machine): ", e.what()));
  }

  auto context = std::make_shared<Context>(o.rank, o.size);
  context->setTimeout(Millis(o.timeout));
  GlooStore store(**client, o.timeout);
  gloo::rendezvous::PrefixStore prefixed(o.prefix, store);
  try {
    context->connectFullMesh(prefixed, device);
  } catch (const StoreError& e) {
    return core::Annotate(e.status(), absl::StrCat(where, ": rendezvous under prefix '", o.prefix, "'"));
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const std::string message =
        absl::StrCat(where, ": connecting to the other ranks (rendezvous prefix '", o.prefix, "'): ", what);
    if (what.find("imeout") != std::string::npos) return absl::DeadlineExceededError(message);
    return absl::UnavailableError(message);
  }
  auto peers = context->PeerAddresses(**client, o.prefix, o.timeout);
  if (!peers.ok()) return core::Annotate(peers.status(), where);
  return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(o, std::move(context), *std::move(peers)));
}

GlooCommunicator::GlooCommunicator(const GlooOptions& o, std::shared_ptr<Context> context,
                                   std::vector<std::vector<std::string>> peer_addresses)
    : rank_(o.rank),
      size_(o.size),
      host_(o.interface.empty() ? o.host : o.interface),
      store_address_(o.store_address),
      prefix_(o.prefix),
      timeout_(o.timeout),
      context_(std::move(context)),
      peer_addresses_(std::move(peer_addresses)) {}

GlooCommunicator::~GlooCommunicator() = default;

std::string GlooCommunicator::Where(const char* op, int peer) const {
  if (peer < 0) return absl::StrCat(op, " on gloo rank ", rank_, " of ", size_);
  return absl::StrCat(op, " with rank ", peer, " on gloo rank ", rank_, " of ", size_);
}

absl::Status GlooCommunicator::CheckUsable(const char* op, int peer) const {
  absl::MutexLock lock(&state_mu_);
  if (broken_.ok()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(Where(op, peer), ": the communicator is broken (", broken_.message(),
                                             "); create a new one under a new prefix"));
}

absl::Status GlooCommunicator::ErrorFromGloo(const char* op, int peer, const std::string& what, bool io_error) const {
  const std::string where = Where(op, peer);
  if (!io_error) return absl::InternalError(absl::StrCat(where, ": Gloo failed: ", what));
  if (what.find("Timed out waiting") != std::string::npos) {
    return absl::DeadlineExceededError(
        absl::StrCat(where, ": no progress within ", absl::FormatDuration(timeout_),
                     " (a peer is stuck, or far slower than this rank); the communicator is aborted: ", what));
  }
  // Gloo names the lost connection by the peer's address; which rank that is, the rendezvous said.
  auto names = [&what](const std::string& address) {
    for (size_t pos = address.empty() ? std::string::npos : what.find(address); pos != std::string::npos;
         pos = what.find(address, pos + 1)) {
      const size_t end = pos + address.size();  // "...:4123" must not match "...:41234"
      if (end == what.size() || !std::isdigit(static_cast<unsigned char>(what[end]))) return true;
    }
    return false;
  };
  int lost = -1;
  for (int r = 0; r < size_ && lost < 0; ++r) {
    for (const std::string& address : peer_addresses_[r]) {
      if (names(address)) lost = r;
    }
  }
  if (lost < 0) lost = peer;
  if (lost < 0) return absl::UnavailableError(absl::StrCat(where, ": lost a peer: ", what));
  return absl::UnavailableError(absl::StrCat(where, ": lost the connection to rank ", lost,
                                             " (it exited, was killed, or left the group after an error): ", what));
}

void GlooCommunicator::Break(const absl::Status& status) {
  {
    absl::MutexLock lock(&state_mu_);
    if (broken_.ok()) broken_ = status;
  }
  context_->DropAllConnections();
}

template <typename Body>
absl::Status GlooCommunicator::Run(const char* op, int peer, Body&& body) {
  absl::MutexLock lock(&op_mu_);
  MOE_RETURN_IF_ERROR(CheckUsable(op, peer));
  absl::Status status;
  try {
    body();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    status = ErrorFromGloo(op, peer, e.what(), /*io_error=*/true);
  } catch (const gloo::EnforceNotMet& e) {
    status = ErrorFromGloo(op, peer, e.what(), /*io_error=*/false);
  } catch (const std::exception& e) {
    status = ErrorFromGloo(op, peer, e.what(), /*io_error=*/false);
  } catch (...) {
    status = absl::InternalError(absl::StrCat(Where(op, peer), ": Gloo threw an unknown exception"));
  }
  {
    // An Abort() meanwhile is why this operation failed: say that instead.
    absl::MutexLock state_lock(&state_mu_);
    if (!broken_.ok()) status = absl::UnavailableError(absl::StrCat(Where(op, peer), ": ", broken_.message()));
  }
  Break(status);
  return status;
}

absl::Status GlooCommunicator::AllReduceSum(void* data, int64_t count, core::DType dtype) {
  MOE_RETURN_IF_ERROR(internal::CheckSummable(Where("all-reduce", -1), dtype));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(Where("all-reduce", -1), data, count, core::DTypeSize(dtype)));
  return Run("all-reduce", -1, [&] {
    if (count == 0) return;
    gloo::AllreduceOptions opts(context_);
    opts.setTimeout(Millis(timeout_));
    SetSumOf(dtype, opts, data, count);
    gloo::allreduce(opts);
  });
}

absl::Status GlooCommunicator::AllGather(const void* send, void* recv, int64_t bytes_per_rank) {
  MOE_ASSIGN_OR_RETURN(const bool in_place,
                       internal::CheckAllGather(Where("all-gather", -1), send, recv, bytes_per_rank, rank_, size_));
  return Run("all-gather", -1, [&] {
    if (bytes_per_rank == 0) return;
    gloo::AllgatherOptions opts(context_);
    opts.setTimeout(Millis(timeout_));
    if (!in_place) opts.setInput(static_cast<uint8_t*>(const_cast<void*>(send)), bytes_per_rank);
    opts.setOutput(static_cast<uint8_t*>(recv), bytes_per_rank * size_);
    gloo::allgather(opts);
  });
}

absl::Status GlooCommunicator::Broadcast(void* data, int64_t bytes, int root) {
  MOE_RETURN_IF_ERROR(internal::CheckRank(Where("broadcast", -1), "root", root, size_));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(Where("broadcast", -1), data, bytes, 1));
  return Run("broadcast", -1, [&] {
    if (bytes == 0) return;
    gloo::BroadcastOptions opts(context_);
    opts.setTimeout(Millis(timeout_));
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setRoot(root);
    gloo::broadcast(opts);
  });
}

absl::Status GlooCommunicator::Send(const void* data, int64_t bytes, int peer) {
  MOE_RETURN_IF_ERROR(internal::CheckPeer(Where("send", peer), peer, rank_, size_));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(Where("send", peer), data, bytes, 1));
  return Run("send", peer, [&] {
    auto buffer = context_->createUnboundBuffer(const_cast<void*>(data), bytes);
    buffer->send(peer, gloo::Slot::build(kPointToPointSlotPrefix, 0));
    (void)buffer->waitSend(Millis(timeout_));
  });
}

absl::Status GlooCommunicator::Recv(void* data, int64_t bytes, int peer) {
  MOE_RETURN_IF_ERROR(internal::CheckPeer(Where("recv", peer), peer, rank_, size_));
  MOE_RETURN_IF_ERROR(internal::CheckBuffer(Where("recv", peer), data, bytes, 1));
  return Run("recv", peer, [&] {
    auto buffer = context_->createUnboundBuffer(data, bytes);
    buffer->recv(peer, gloo::Slot::build(kPointToPointSlotPrefix, 0));
    (void)buffer->waitRecv(Millis(timeout_));
  });
}

absl::Status GlooCommunicator::SendRecv(const void* send, int send_peer, void* recv, int recv_peer, int64_t bytes) {
  MOE_RETURN_IF_ERROR(
      internal::CheckSendRecv(Where("send-recv", -1), send, send_peer, recv, recv_peer, bytes, rank_, size_));
  const int peer = send_peer == recv_peer ? send_peer : -1;
  return Run("send-recv", peer, [&] {
    if (send_peer == rank_) {
      if (bytes > 0) std::memcpy(recv, send, bytes);
      return;
    }
    const auto slot = gloo::Slot::build(kPointToPointSlotPrefix, 0);
    auto out = context_->createUnboundBuffer(const_cast<void*>(send), bytes);
    auto in = context_->createUnboundBuffer(recv, bytes);
    in->recv(recv_peer, slot);
    out->send(send_peer, slot);
    (void)in->waitRecv(Millis(timeout_));
    (void)out->waitSend(Millis(timeout_));
  });
}

absl::Status GlooCommunicator::Barrier() {
  return Run("barrier", -1, [&] {
    gloo::BarrierOptions opts(context_);
    opts.setTimeout(Millis(timeout_));
    gloo::barrier(opts);
  });
}

void GlooCommunicator::Abort() {
  Break(absl::UnavailableError(absl::StrCat("the communicator was aborted (Abort() on rank ", rank_, ")")));
}

absl::Status GlooCommunicator::AsyncError() const {
  absl::MutexLock lock(&state_mu_);
  return broken_;
}

std::string GlooCommunicator::Describe() const {
  return absl::StrCat("gloo tcp: rank ", rank_, " of ", size_, " via ", host_, " (store ", store_address_, ", prefix ",
                      prefix_, ")");
}

}  // namespace moe::comm
