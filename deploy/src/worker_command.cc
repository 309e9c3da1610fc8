// `moeserve worker`: one rank of a deployment, serving the control plane (worker.proto) that the
// launcher's frontend drives. The launcher starts it; it prints "worker listening on port N" on
// stdout once it serves, and ends on Shutdown, SIGTERM or SIGINT.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "control_secret.h"
#include "moe/scheduler/security.h"
#include "worker_service.h"

namespace moe::deploy {
namespace {

std::atomic<bool> g_worker_stop{false};
void OnWorkerSignal(int) { g_worker_stop.store(true); }

struct WorkerFlags {
  std::string listen = "127.0.0.1:0";
  int rank = -1;
  std::string tls_cert, tls_key, tls_ca;  // mutual TLS on the control service
};

int RunWorker(const WorkerFlags& flags) {
  const std::string who = flags.rank >= 0 ? absl::StrCat("worker ", flags.rank) : "worker";
  if (absl::Status s = CheckListenAddress(flags.listen, "listen"); !s.ok()) return FailCommand(who, s, 2);
  // The control plane's secret, from the launcher; gone from the environment once read.
  const char* env = std::getenv(kControlSecretEnv);
  const std::string secret = env != nullptr ? env : "";
  ::unsetenv(kControlSecretEnv);
  if (secret.size() < 16) {
    return FailCommand(
        who,
        absl::InvalidArgumentError(absl::StrCat(kControlSecretEnv,
                                                " is not set (or shorter than 16 characters): a worker serves only the "
                                                "launcher that holds the control plane's secret; start it with serve "
                                                "--config")),
        2);
  }
  std::atomic<bool> shutdown{false};
  WorkerService service([&shutdown] { shutdown.store(true); }, secret);
  auto credentials = scheduler::GrpcServerCredentials({flags.tls_cert, flags.tls_key, flags.tls_ca});
  if (!credentials.ok()) return FailCommand(who, credentials.status(), 2);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, *credentials, &port);
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return FailCommand(who, absl::UnavailableError(absl::StrCat("cannot listen on ", flags.listen)), 1);
  }
  std::signal(SIGINT, OnWorkerSignal);
  std::signal(SIGTERM, OnWorkerSignal);
  std::cout << "worker listening on port " << port << std::endl;
  while (!shutdown.load() && !g_worker_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace

void AddWorkerCommand(CLI::App& root, CommandRun* selected) {
  auto f = std::make_shared<WorkerFlags>();
  CLI::App* app = AddCommand(
      root, "worker", "one rank of a deployment (started by serve --config; not for direct use)",
      "Serves the control plane (moeserve.v1.Worker) for a frontend: Init joins the group's communicator,\n"
      "Load loads this rank's share of the model, Execute runs the step plans it streams. Started and\n"
      "supervised by `moeserve serve --config FILE`; prints \"worker listening on port N\" once it serves.",
      [f] { return RunWorker(*f); }, selected);
  app->add_option("--listen", f->listen, "HOST:PORT to serve on (port 0 picks a free one)")->capture_default_str();
  app->add_option("--rank", f->rank, "the rank the launcher started it as (names it in its error messages)");
  app->add_option("--tls-cert", f->tls_cert, "PEM certificate of this node (mutual TLS on the control service)");
  app->add_option("--tls-key", f->tls_key, "PEM private key of --tls-cert");
  app->add_option("--tls-ca", f->tls_ca, "PEM CA that signs the launchers' certificates (required of every caller)");
}

}  // namespace moe::deploy
