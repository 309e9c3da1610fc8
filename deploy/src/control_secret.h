// The control plane's secret: a random value each launch makes (or that every node of a
// deployment is given, through MOESERVE_CONTROL_SECRET or the cluster file's comm.secret_file),
// handed to the workers in their environment and checked on every call to a worker
// (moeserve.v1.Worker) and on every connection to the rendezvous store. Without it, any local user
// (or, over several nodes, the network) could shut workers down or read and fill the store.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace moe::deploy {

inline constexpr char kControlSecretEnv[] = "MOESERVE_CONTROL_SECRET";
inline constexpr char kControlSecretMetadata[] = "x-moeserve-control-secret";

// 32 random bytes from the kernel, in hex.
std::string NewControlSecret();

// The secret in `path` (its first line, 16 to 1024 printable characters). kInvalidArgument naming
// the file for anything else; the secret itself never appears in a message.
absl::StatusOr<std::string> ReadControlSecret(const std::string& path);

// Equality in time that does not depend on where the two differ.
bool SecretsMatch(std::string_view a, std::string_view b);

}  // namespace moe::deploy
