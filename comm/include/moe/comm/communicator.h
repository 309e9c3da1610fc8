// Communicator: a group of size() ranks, this process one of them (rank()), that sums, gathers,
// broadcasts and exchanges buffers. Two implementations:
//
// - GlooCommunicator (gloo_communicator.h): host memory over TCP. Every pointer is host memory
//   and every call blocks until the operation is done on this rank (the data is in place when it
//   returns). For CPU workers, CI, and a control group beside NCCL.
// - NcclCommunicator (nccl_communicator.h, built with CUDA and NCCL: MOE_COMM_HAS_NCCL): device
//   memory on one GPU. Every pointer is device memory of that GPU; a call queues the operation on
//   the CUDA stream given to NcclCommunicator::Create and returns (Barrier alone waits for the
//   stream). Errors of queued work surface later, through AsyncError() and the next call.
//
// Every rank makes the same collective calls in the same order with the same sizes (dtype,
// count, root); a mismatch hangs or corrupts data, as it does in NCCL and Gloo. Send and Recv
// pair up in program order per peer; a rank that only sends to a peer that only sends too waits
// forever (use SendRecv to exchange in one step, as a ring does).
//
// Errors (absl::Status; no exception leaves this module, nothing exits the process):
//   kInvalidArgument   a bad argument (negative count, peer out of range, null buffer); the
//                      communicator stays usable.
//   kUnavailable       a lost peer (it exited, was killed, or aborted), or an aborted or broken
//                      communicator; the message names the operation and, where known, the peer
//                      rank. Every later call fails the same way: make a new communicator (a new
//                      rendezvous prefix or NCCL unique id) with the ranks that are left.
//   kDeadlineExceeded  the operation made no progress within the communicator's timeout; the
//                      communicator is aborted, as for kUnavailable.
//   kInternal          a fault inside Gloo, NCCL or CUDA.
//
// Thread-safety: operations run one at a time (calls from several threads are serialized, which
// only makes sense where the caller orders them the same way on every rank). Abort(),
// AsyncError(), Describe(), rank() and size() may be called from any thread at any time.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "moe/core/dtype.h"

namespace moe::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Sums `count` elements of `dtype` across the ranks, in place: every rank ends with the sum.
  // Every DType is summed (kBF16 and kF16 in their own precision at each step, as NCCL does;
  // integers wrap).
  virtual absl::Status AllReduceSum(void* data, int64_t count, core::DType dtype) = 0;

  // `recv` (size() * bytes_per_rank bytes) gets every rank's `send` in rank order. `send` may be
  // recv + rank() * bytes_per_rank (in place); otherwise the two must not overlap.
  virtual absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) = 0;

  // Copies `bytes` at `data` of rank `root` to `data` of every rank.
  virtual absl::Status Broadcast(void* data, int64_t bytes, int root) = 0;

  // Point to point, matched in order with the peer's Recv / Send of the same size. A rank may
  // not Send or Recv to itself (it would wait for itself): SendRecv does that.
  virtual absl::Status Send(const void* data, int64_t bytes, int peer) = 0;
  virtual absl::Status Recv(void* data, int64_t bytes, int peer) = 0;

  // Sends `bytes` at `send` to `send_peer` and receives as many from `recv_peer` into `recv`, both
  // in flight at once (one step of a ring: send to rank+1, receive from rank-1). Either peer may be
  // this rank. `send` and `recv` must not overlap.
  virtual absl::Status SendRecv(const void* send, int send_peer, void* recv, int recv_peer, int64_t bytes) = 0;

  // Returns once every rank has called Barrier (for NcclCommunicator: once the barrier and all
  // work queued before it on the stream are done).
  virtual absl::Status Barrier() = 0;

  // Fails the operation in flight (on any thread) and every later one with kUnavailable, and
  // drops this rank's connections so that its peers' operations fail too. Idempotent; never
  // kills the process. The communicator must still be destroyed as usual.
  virtual void Abort() = 0;

  // The error that broke the communicator (an operation's failure, a fault NCCL found in queued
  // work, a timeout, Abort), or OK while it is healthy.
  virtual absl::Status AsyncError() const = 0;

  // One line for logs, e.g. "gloo tcp: rank 0 of 2 via 127.0.0.1".
  virtual std::string Describe() const = 0;
};

}  // namespace moe::comm
