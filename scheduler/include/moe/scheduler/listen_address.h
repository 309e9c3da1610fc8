// The address a server listens on, HOST:PORT, as the gRPC and HTTP servers take it.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace moe::scheduler {

struct ListenAddress {
  std::string host;  // as getaddrinfo takes it: no brackets; localhost becomes 127.0.0.1
  int port = 0;      // 0: the system picks a free one
};

// An IPv4 address, [IPv6] in brackets, or localhost, then a port in 0..65535. kInvalidArgument
// "listen address 'X': <why>" otherwise (gRPC alone would take port 99999 as "any").
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& listen);

}  // namespace moe::scheduler
