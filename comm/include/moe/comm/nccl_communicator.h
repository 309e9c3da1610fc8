// NcclCommunicator: a Communicator over device memory of one GPU, on NCCL. Built only with CUDA
// and NCCL: moe::comm then defines MOE_COMM_HAS_NCCL=1 (0 otherwise), so callers write
// `#if MOE_COMM_HAS_NCCL`.
//
// Pointers are device memory of the communicator's GPU. A call queues its operation on the CUDA
// stream given to Create (a cudaStream_t passed as void*, so that this header needs no CUDA; the
// caller keeps the stream alive longer than the communicator; nullptr is the legacy default
// stream) and returns; the data is there once the stream reaches it. Barrier() alone waits, for
// the barrier and everything queued before it.
//
// Failures: the communicator is non-blocking (ncclConfig_t.blocking = 0): no call waits inside
// NCCL without bound. A watchdog thread polls ncclCommGetAsyncError and the completion of queued
// operations; on an asynchronous error, or when an operation has not completed `timeout` after it
// was queued (the stream's earlier work counts: give a timeout well above the longest step), it
// aborts the communicator (ncclCommAbort: the kernels waiting on a lost peer exit; the process
// lives). Queued operations then leave garbage in their buffers; AsyncError() says why, and every
// later call fails with kUnavailable. Errors from NCCL name the call, file and line.
//
// NCCL's multicast over NVLink (NVLS) stays as the environment sets it: this class never turns it
// on (the deployment scripts set NCCL_NVLS_ENABLE=0).
//
// Thread-safety: as Communicator: operations one at a time; Abort(), AsyncError() and the
// accessors from any thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "moe/comm/communicator.h"

namespace moe::comm {

// A new NCCL unique id (NCCL_UNIQUE_ID_BYTES = 128 bytes) as a string of bytes, made by one rank
// and sent to the others over the control plane (a RendezvousClient, the worker protocol).
// kUnavailable when NCCL finds no network interface for its bootstrap.
absl::StatusOr<std::string> NcclUniqueId();

class NcclCommunicator final : public Communicator {
 public:
  // Joins the group of `size` ranks named by `unique_id` as `rank`, on GPU `cuda_device`.
  // Returns once every rank has joined: kDeadlineExceeded after `timeout` (a rank did not start,
  // or started with another id); kInvalidArgument for an id that is not 128 bytes, a rank outside
  // [0, size), a GPU that is not visible.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(std::string_view unique_id, int rank, int size,
                                                                  int cuda_device, void* stream,
                                                                  absl::Duration timeout = absl::Minutes(5));
  // Finalizes and destroys the communicator (waiting for its queued work, at most `timeout`), or
  // aborts it if it is broken or the wait runs out. Never throws.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  int cuda_device() const;
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
  class Impl;  // holds the NCCL and CUDA handles
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::comm
