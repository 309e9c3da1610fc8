// The plain-TCP HTTP server's connection loop, in place of cpp-httplib 0.11's: one buffered stream
// for the whole connection, so that requests a client pipelines are all answered, in order
// (httplib's stream lived for one request, and dropped what it had read past it); a deadline for
// a request's whole head (request line and headers), so that a client that trickles its headers
// cannot hold a connection thread for long; and a connection a handler marked (ambiguous framing)
// ends after its answer.
//
// Thread-safety: each connection runs on one of the server's connection threads; MarkForClose
// may be called from any of them.
#pragma once

#include <httplib.h>

#include <chrono>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moe::scheduler::internal {

class PipelinedServer final : public httplib::Server {
 public:
  // `head_timeout`: the longest a request's head may take to arrive, from its first byte.
  explicit PipelinedServer(std::chrono::milliseconds head_timeout) : head_timeout_(head_timeout) {}

  // The connection of `request` ends once this request is answered.
  void MarkForClose(const httplib::Request& request);

 private:
  bool process_and_close_socket(socket_t sock) override;
  bool TakeMark(const std::string& ip, int port);

  const std::chrono::milliseconds head_timeout_;
  absl::Mutex mu_;
  std::set<std::pair<std::string, int>> marked_ ABSL_GUARDED_BY(mu_);  // peers whose connection ends
};

}  // namespace moe::scheduler::internal
