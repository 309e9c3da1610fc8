// A group of ranks as child processes of this one, with a RendezvousServer in this process: how
// the communicator tests and `moeserve bench comm` run several ranks on one host. (Serving does
// not use it: the launcher starts worker processes with exec.)
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe::comm {

struct LocalRanksOptions {
  int ranks = 2;
  // Children still running then are killed (SIGKILL).
  absl::Duration deadline = absl::Seconds(60);
};

// One rank's work: given its rank and the rendezvous server's "HOST:PORT", a line of text for the
// parent, or an error.
using RankBody = std::function<absl::StatusOr<std::string>(int rank, const std::string& store_address)>;

// Forks options.ranks children, then starts a RendezvousServer on 127.0.0.1 and tells each child
// its address; each child runs `body` and leaves with _exit, its result coming back over a socket.
// Returns one entry per rank: the body's text or error; kUnavailable for a child that died (by a
// signal, or without a result); kDeadlineExceeded for one killed at the deadline. The calling
// process must run no other thread (a test, a command before it starts any): a child of a
// threaded process could find a lock held for ever. Errors: kInternal when fork or the server
// fails.
absl::StatusOr<std::vector<absl::StatusOr<std::string>>> RunLocalRanks(const LocalRanksOptions& options,
                                                                       const RankBody& body);

}  // namespace moe::comm
