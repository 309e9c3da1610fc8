// GlooCommunicator: a Communicator over host memory, on Gloo's TCP transport (ring all-reduce and
// all-gather, tree broadcast, dissemination barrier). Pointers are host memory; every call blocks
// until the operation is done on this rank.
//
// The ranks find each other through a RendezvousServer (rendezvous.h): each rank publishes the
// addresses it listens on under `prefix`, then connects to every other rank (a full mesh of TCP
// connections). A group that restarts (a worker died and came back) rendezvouses under a new
// prefix ("moe/gen2") on the same server, so that stale keys of the old group are never read.
//
// Failures: a peer that exits or is killed closes its connections; the operations that wait on it
// fail at once with kUnavailable naming that rank, and this rank then drops all its own
// connections, so that every rank of the group fails promptly rather than at the timeout (in a
// ring, a rank may wait on a live neighbour that itself waits on the dead one). After any error
// the communicator is broken: later calls fail with kUnavailable at once. An operation that makes
// no progress for `timeout` fails with kDeadlineExceeded. Creating a GlooCommunicator makes the
// process ignore SIGPIPE if nothing else handles it (Gloo writes to sockets whose peer may be
// gone, which would otherwise kill the process).
//
// Thread-safety: as Communicator: operations one at a time; Abort() and the accessors from any
// thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/comm/communicator.h"

namespace moe::comm {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // The RendezvousServer's "HOST:PORT" ("[IPV6]:PORT").
  std::string store_address;
  // The store's secret (RendezvousServerOptions::secret), when it has one.
  std::string store_secret;
  // The address this rank listens on for its peers: an IP address or a host name that they can
  // reach. 127.0.0.1 serves the ranks of one host.
  std::string host = "127.0.0.1";
  // A network interface ("eth0") to listen on instead of `host`, when set.
  std::string interface;
  // Every rendezvous key of this group starts with it: a new group on the same server (a restart)
  // takes a new prefix.
  std::string prefix = "moe";
  // The rendezvous, and any one operation's wait for progress, end with kDeadlineExceeded after
  // this long.
  absl::Duration timeout = absl::Seconds(30);
};

class GlooCommunicator final : public Communicator {
 public:
  // Rendezvouses with the other options.size - 1 ranks and connects to each; returns when all are
  // connected. kInvalidArgument for bad options (rank outside [0, size), a malformed store
  // address, a host that does not resolve); kDeadlineExceeded when a rank does not show up within
  // the timeout; kUnavailable when the store or a peer cannot be reached.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(const GlooOptions& options);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduceSum(void* data, int64_t count, core::DType dtype) override;
  absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) override;
  absl::Status Broadcast(void* data, int64_t bytes, int root) override;
  absl::Status Send(const void* data, int64_t bytes, int peer) override;
  absl::Status Recv(void* data, int64_t bytes, int peer) override;
  absl::Status SendRecv(const void* send, int send_peer, void* recv, int recv_peer, int64_t bytes) override;
  absl::Status Barrier() override;
  void Abort() override;
  absl::Status AsyncError() const override;
  std::string Describe() const override;

 private:
  class Context;
  GlooCommunicator(const GlooOptions& options, std::shared_ptr<Context> context,
                   std::vector<std::vector<std::string>> peer_addresses);

  // Runs one Gloo operation under op_mu_, turning Gloo's exceptions into a Status; any failure
  // breaks the communicator and drops this rank's connections. `peer` names the rank of a
  // point-to-point operation (-1 for a collective).
  template <typename Body>
  absl::Status Run(const char* op, int peer, Body&& body);
  absl::Status CheckUsable(const char* op, int peer) const;
  absl::Status ErrorFromGloo(const char* op, int peer, const std::string& what, bool io_error) const;
  // Marks the communicator broken with `status` (the first one wins) and fails every pending
  // transfer of this rank, closing its connections.
  void Break(const absl::Status& status);
  std::string Where(const char* op, int peer) const;

  const int rank_;
  const int size_;
  const std::string host_;
  const std::string store_address_;
  const std::string prefix_;
  const absl::Duration timeout_;
  const std::shared_ptr<Context> context_;
  // peer_addresses_[r]: the addresses under which Gloo's errors name rank r ("[127.0.0.1]:41234");
  // how an error names the lost rank.
  const std::vector<std::vector<std::string>> peer_addresses_;

  absl::Mutex op_mu_;  // one operation at a time
  mutable absl::Mutex state_mu_;
  absl::Status broken_ ABSL_GUARDED_BY(state_mu_);
};

}  // namespace moe::comm
