// Status helpers shared by every module. Recoverable errors are absl::Status / absl::StatusOr;
// these macros propagate them (Abseil 2022 has no macros of its own).
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOE_STATUS_CONCAT_INNER(a, b) a##b
#define MOE_STATUS_CONCAT(a, b) MOE_STATUS_CONCAT_INNER(a, b)

// Returns from the current function if `expr` (an absl::Status) is not OK.
#define MOE_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::absl::Status moe_status_ = (expr);           \
    if (!moe_status_.ok()) return moe_status_;     \
  } while (0)

// `MOE_ASSIGN_OR_RETURN(auto x, F())` declares x from an absl::StatusOr, or returns its error.
#define MOE_ASSIGN_OR_RETURN(lhs, expr) \
  MOE_ASSIGN_OR_RETURN_IMPL(MOE_STATUS_CONCAT(moe_statusor_, __LINE__), lhs, expr)
#define MOE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return std::move(tmp).status();  \
  lhs = std::move(tmp).value()

namespace moe::core {

// Prefixes the message of a non-OK status with `context` ("loading layer 3: ...").
inline absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), std::string(context) + ": " + std::string(status.message()));
}

}  // namespace moe::core
