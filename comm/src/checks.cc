#include "checks.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "moe/core/status.h"

namespace moe::comm::internal {
namespace {

absl::Status Invalid(std::string_view where, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(where), ": ", std::string(what)));
}

bool Overlap(const void* a, const void* b, int64_t a_bytes, int64_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + static_cast<uintptr_t>(b_bytes) && y < x + static_cast<uintptr_t>(a_bytes);
}

}  // namespace

absl::Status CheckBuffer(std::string_view where, const void* data, int64_t count, int64_t element_bytes) {
  if (count < 0) return Invalid(where, absl::StrCat("count ", count, " is negative"));
  if (count > std::numeric_limits<int64_t>::max() / element_bytes) {
    return Invalid(where, absl::StrCat("count ", count, " of ", element_bytes, "-byte elements overflows"));
  }
  if (count > 0 && data == nullptr) return Invalid(where, absl::StrCat("null buffer for ", count, " elements"));
  return absl::OkStatus();
}

absl::Status CheckSummable(std::string_view where, core::DType dtype) {
  if (dtype == core::DType::kF8E4M3) {
    return Invalid(where, absl::StrCat("cannot sum ", core::DTypeName(dtype), " (sum f32, bf16, f16 or integers)"));
  }
  return absl::OkStatus();
}

absl::Status CheckRank(std::string_view where, std::string_view role, int rank, int size) {
  if (rank < 0 || rank >= size) {
    return Invalid(where, absl::StrCat(std::string(role), " ", rank, " is not a rank of this group of ", size,
                                       " (0 to ", size - 1, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckPeer(std::string_view where, int peer, int self, int size) {
  MOE_RETURN_IF_ERROR(CheckRank(where, "peer", peer, size));
  if (peer == self) {
    return Invalid(where, "a rank cannot Send or Recv to itself (it would wait for itself); SendRecv can");
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> CheckAllGather(std::string_view where, const void* send, const void* recv, int64_t bytes_per_rank,
                                    int rank, int size) {
  MOE_RETURN_IF_ERROR(CheckBuffer(where, send, bytes_per_rank, 1));
  MOE_RETURN_IF_ERROR(CheckBuffer(where, recv, bytes_per_rank, size));
  const bool in_place = send == static_cast<const char*>(recv) + rank * bytes_per_rank;
  if (!in_place && bytes_per_rank > 0 && Overlap(send, recv, bytes_per_rank, bytes_per_rank * size)) {
    return Invalid(where, "send overlaps recv without being this rank's slot of it (recv + rank * bytes_per_rank)");
  }
  return in_place;
}

absl::Status CheckSendRecv(std::string_view where, const void* send, int send_peer, const void* recv, int recv_peer,
                           int64_t bytes, int rank, int size) {
  MOE_RETURN_IF_ERROR(CheckRank(where, "send peer", send_peer, size));
  MOE_RETURN_IF_ERROR(CheckRank(where, "recv peer", recv_peer, size));
  MOE_RETURN_IF_ERROR(CheckBuffer(where, send, bytes, 1));
  MOE_RETURN_IF_ERROR(CheckBuffer(where, recv, bytes, 1));
  if ((send_peer == rank) != (recv_peer == rank)) {
    return Invalid(where, absl::StrCat("rank ", rank, " sends to rank ", send_peer, " and receives from rank ",
                                       recv_peer, ": a rank that sends to itself must receive from itself"));
  }
  if (bytes > 0 && Overlap(send, recv, bytes, bytes)) return Invalid(where, "send and recv overlap");
  return absl::OkStatus();
}

}  // namespace moe::comm::internal
