// The launcher of a deployment (`moeserve serve --config FILE [--node N]`): starts this node's
// worker processes (`moeserve worker`, one per GPU or CPU share), and on node 0 the frontend too:
// the rendezvous store, each rank's Init and Load, and a RemoteExecutor over their control
// streams behind the client APIs. It supervises what it started: a worker that exits (killed,
// crashed, or broken by a lost peer) fails the steps in flight with UNAVAILABLE at once, then the
// group is restarted (new processes, a new communicator, the shared expert arena attached again
// rather than reloaded) while the frontend keeps its queue; restarts in a row back off, and are
// counted in /metrics.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cluster_config.h"
#include "moe/worker/remote_executor.h"

namespace moe::deploy {

struct LaunchOptions {
  int node = 0;
  std::string program;  // this binary, which the workers run as `PROGRAM worker`
  bool request_log = true;
  // The control plane's secret (control_secret.h), handed to the workers and checked on every
  // call to them and every store connection; empty: a new one for this launch.
  std::string control_secret;
};

// Node 0's workers of a deployment, started, joined and loaded (one generation, not supervised):
// what the launcher starts, for a benchmark or a test of the control plane. Destroying it kills
// the workers.
class LocalWorkers {
 public:
  virtual ~LocalWorkers() = default;
  // What a RemoteExecutor over them needs.
  virtual worker::RemoteExecutor::Options executor_options() const = 0;
};
absl::StatusOr<std::unique_ptr<LocalWorkers>> StartLocalWorkers(const ClusterConfig& config,
                                                                const LaunchOptions& options);

// Runs until SIGINT or SIGTERM (then drains, as serve does) or until the restarts run out.
// Returns the process exit code.
int RunCluster(const ClusterConfig& config, const LaunchOptions& options);

}  // namespace moe::deploy
