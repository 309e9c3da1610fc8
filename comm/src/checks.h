// Argument checks shared by the communicators: every one answers kInvalidArgument, prefixed with
// `where` ("all-reduce on gloo rank 0 of 2"), and leaves the communicator usable.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/core/dtype.h"

namespace moe::comm::internal {

// `count` elements of `element_bytes` at `data`: not negative, not null unless empty, and a byte
// count that fits in 63 bits.
absl::Status CheckBuffer(std::string_view where, const void* data, int64_t count, int64_t element_bytes);

// AllReduceSum adds floats of 32 and 16 bits and integers; fp8 sums would round away too much and
// are refused.
absl::Status CheckSummable(std::string_view where, core::DType dtype);

// `rank` names a rank of a group of `size` (the peer of a Send, the root of a Broadcast: `role`).
absl::Status CheckRank(std::string_view where, std::string_view role, int rank, int size);

// Send and Recv name another rank: a rank waiting for itself would never return.
absl::Status CheckPeer(std::string_view where, int peer, int self, int size);

// AllGather's buffers; true when `send` is this rank's slot of `recv` (in place).
absl::StatusOr<bool> CheckAllGather(std::string_view where, const void* send, const void* recv, int64_t bytes_per_rank,
                                    int rank, int size);

// SendRecv's buffers and peers: a rank that sends to itself also receives from itself.
absl::Status CheckSendRecv(std::string_view where, const void* send, int send_peer, const void* recv, int recv_peer,
                           int64_t bytes, int rank, int size);

}  // namespace moe::comm::internal
