#include "launcher.h"

#include <grpcpp/grpcpp.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "control_secret.h"
#include "flags.h"
#include "moe/comm/rendezvous.h"
#include "moe/comm/tcp_socket.h"
#include "moe/comm/topology.h"
#include "moe/core/status.h"
#include "moe/scheduler/frontend.h"
#include "moe/worker/remote_executor.h"
#include "moeserve/v1/worker.grpc.pb.h"
#include "shm_arenas.h"
#if MOE_COMM_HAS_NCCL
#include "moe/comm/nccl_communicator.h"
#endif

namespace moe::deploy {
namespace {

namespace pb = ::moeserve::v1;
using Clock = std::chrono::steady_clock;

// SIGTERM and SIGINT received: the first drains, a second ends the drain at once.
std::atomic<int> g_signals{0};
void OnSignal(int) { g_signals.fetch_add(1); }
bool Stopping() { return g_signals.load() > 0; }

void Log(const std::string& line) { std::cerr << "moeserve serve: " << line << std::endl; }

// A `moeserve worker` child: started with its cores, killed with the launcher (PR_SET_PDEATHSIG).
class WorkerProcess {
 public:
  // Starts the worker listening on `listen` and waits for the port it reports. kUnavailable when
  // it exits or says nothing within 60 s.
  static absl::StatusOr<std::unique_ptr<WorkerProcess>> Start(const std::string& program, const std::string& listen,
                                                              const std::vector<int>& cpus, int rank,
                                                              const std::string& secret,
                                                              const scheduler::TlsFiles& tls) {
    // Everything the child needs is made before fork: between fork and exec a child of this
    // threaded process may only make async-signal-safe calls (no allocation).
    std::vector<std::string> args = {program, "worker", "--listen", listen, "--rank", std::to_string(rank)};
    if (tls.enabled()) {
      for (const std::string& a : {std::string("--tls-cert"), tls.cert_file, std::string("--tls-key"), tls.key_file,
                                   std::string("--tls-ca"), tls.client_ca_file}) {
        args.push_back(a);
      }
    }
    // The secret goes in the environment, not on the command line, where any user's ps reads it.
    std::vector<std::string> env = {absl::StrCat(kControlSecretEnv, "=", secret)};
    for (char** e = environ; *e != nullptr; ++e) {
      if (!absl::StartsWith(*e, absl::StrCat(kControlSecretEnv, "="))) env.emplace_back(*e);
    }
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out[2];
    if (pipe(out) != 0) return absl::InternalError("pipe failed");
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      if (!cpus.empty()) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c : cpus) CPU_SET(c, &set);
        sched_setaffinity(0, sizeof(set), &set);
      }
      execve(program.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    close(out[1]);
    auto w = std::unique_ptr<WorkerProcess>(new WorkerProcess(pid, rank));
    // "worker listening on port N"
    FILE* f = fdopen(out[0], "r");
    char line[256];
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < deadline && f != nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
      const std::string text(line);
      const std::string tag = "worker listening on port ";
      if (absl::StartsWith(text, tag) &&
          absl::SimpleAtoi(absl::StripTrailingAsciiWhitespace(text.substr(tag.size())), &w->port_)) {
        break;
      }
    }
    if (f != nullptr) std::fclose(f);
    if (w->port_ == 0) return absl::UnavailableError(absl::StrCat("worker ", rank, " did not start (", program, ")"));
    return w;
  }

  ~WorkerProcess() { Kill(); }
  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  int rank() const { return rank_; }
  // True once the process has ended (reaped); `why` says how.
  bool Exited(std::string* why) {
    if (pid_ <= 0) return true;
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == 0) return false;
    *why = WIFSIGNALED(status) ? absl::StrCat("killed by signal ", WTERMSIG(status))
                               : absl::StrCat("exited with code ", WEXITSTATUS(status));
    pid_ = -1;
    return true;
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  WorkerProcess(pid_t pid, int rank) : pid_(pid), rank_(rank) {}
  pid_t pid_;
  int rank_;
  int port_ = 0;
};

// The cores this process may use, split into `parts` contiguous shares.
std::vector<std::vector<int>> SplitCores(int parts) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cores;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cores.push_back(c);
    }
  }
  std::vector<std::vector<int>> shares(parts);
  if (cores.empty() || parts <= 0) return shares;
  for (int p = 0; p < parts; ++p) {
    const size_t begin = cores.size() * p / parts, end = std::max(begin + 1, cores.size() * (p + 1) / parts);
    for (size_t i = begin; i < end && i < cores.size(); ++i) shares[p].push_back(cores[i]);
  }
  return shares;
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(what, ": ", s.error_message()));
}

// The shared expert arena's name for a rank: one per host for a tensor split (every rank attaches
// to all the experts); one per stage for a layer split (each holds its own layers). Without a
// name in the cluster file it is derived from the model's path and files (DerivedArenaName).
std::string ArenaName(const ClusterConfig& c, int rank) {
  const std::string base =
      c.expert_shm.empty() ? DerivedArenaName(c.model, c.expert_format, c.expert_group) : c.expert_shm;
  return c.mode == runtime::ParallelMode::kLayer ? absl::StrCat(base, "-s", rank) : base;
}

// kUnavailable when `listen` (HOST:PORT, a fixed port) cannot be bound now: another process has it.
absl::Status CheckListenPortFree(const std::string& listen) {
  auto address = comm::ParseHostPort(listen, "server.listen");
  if (!address.ok() || address->port == 0) return absl::OkStatus();  // the server reports its own errors
  int bound = 0;
  auto probe = comm::ListenTcp(address->host, address->port, &bound);
  if (probe.ok() || probe.status().code() != absl::StatusCode::kUnavailable) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("server.listen: cannot listen on ", listen,
                                             ": the address is in use; nothing was started (free the port, or "
                                             "choose another)"));
}

// Whether the workers keep routed experts in the CPU pool (and so in a shared arena).
bool UsesExpertPool(const ClusterConfig& c) {
  return !c.gpu() || c.cpu_moe || c.n_cpu_moe > 0 || !c.override_tensor.empty();
}

// The arenas a deployment derives (none when the cluster file names one: a named arena outlives
// its deployment), named once at start, claimed while the launcher lives and removed when it
// returns, whichever way.
class DerivedArenas {
 public:
  explicit DerivedArenas(const ClusterConfig& c) {
    if (!c.expert_shm.empty() || !UsesExpertPool(c)) return;
    for (int rank = 0; rank < c.ranks; ++rank) {
      const std::string name = ArenaName(c, rank);
      if (std::find(names_.begin(), names_.end(), name) == names_.end()) names_.push_back(name);
    }
  }
  ~DerivedArenas() { ReleaseArenas(names_); }
  DerivedArenas(const DerivedArenas&) = delete;
  DerivedArenas& operator=(const DerivedArenas&) = delete;

  // Removes the arenas earlier launchers left (their owner gone, no process mapping them), then
  // claims this deployment's.
  void CleanUpAndClaim() {
    for (const RemovedArena& r : RemoveOrphanArenas(names_)) {
      Log(absl::StrFormat("removed the expert arena /dev/shm/%s (%.1f MiB) that a launcher which is gone left behind",
                          r.name, static_cast<double>(r.bytes) / (1 << 20)));
    }
    ClaimArenas(names_);
    for (const std::string& name : names_) Log(absl::StrCat("expert arena: /dev/shm/", name));
  }

 private:
  std::vector<std::string> names_;
};

// One generation of the deployment's workers, from node 0: this node's processes, every rank's
// address, and what their loads reported.
struct WorkerGroup {
  int generation = 0;
  std::vector<std::unique_ptr<WorkerProcess>> local;  // node 0's
  std::vector<std::string> addresses;                 // every rank's
  runtime::KvCapacity kv;
  runtime::ModelInfo info;
  std::string description;
  int attached = 0;  // ranks whose routed experts came from the shared arena
};

class Launcher {
 public:
  Launcher(const ClusterConfig& c, const LaunchOptions& o)
      : c_(c),
        o_(o),
        secret_(o.control_secret.empty() ? NewControlSecret() : o.control_secret),
        tls_{c.control_tls_cert, c.control_tls_key, c.control_tls_ca},
        credentials_(scheduler::GrpcClientCredentials(tls_).value_or(grpc::InsecureChannelCredentials())) {}

  int Run();
  // The rendezvous store (CPU workers of several ranks), then the workers of `generation`.
  absl::Status StartStore();
  absl::StatusOr<std::unique_ptr<WorkerGroup>> StartGroup(int generation);
  worker::RemoteExecutor::Options ExecutorOptions(const WorkerGroup& g) const {
    worker::RemoteExecutor::Options eo;
    eo.workers = g.addresses;
    eo.logits_rank = runtime::ParallelConfig::AnsweringRank(c_.mode, c_.ranks);
    eo.kv = g.kv;
    eo.info = g.info;
    eo.description = g.description;
    eo.call_metadata = {{kControlSecretMetadata, secret_}};
    eo.step_timeout = absl::Milliseconds(c_.step_timeout_ms);
    eo.credentials = credentials_;
    return eo;
  }

 private:
  pb::InitRequest InitFor(int rank, int generation, const std::string& nccl_id, const std::vector<int>& cpus) const;
  absl::Status InitAll(WorkerGroup& g, const std::string& nccl_id, const std::vector<std::vector<int>>& cpus);
  absl::Status LoadAll(WorkerGroup& g);
  void StopGroup(WorkerGroup* g);
  // Whether a worker of the group has exited (and why).
  bool AnyExited(WorkerGroup& g, std::string* why);
  int RunOtherNode();
  // What links this node's GPUs (peer access, NVLink or PCIe), and a warning for each pair that NCCL
  // will have to reach through host memory.
  void CheckTopology(int node) const;

  const ClusterConfig& c_;
  const LaunchOptions& o_;
  const std::string secret_;       // the control plane's
  const scheduler::TlsFiles tls_;  // mutual TLS on the workers' control service (comm.tls)
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::unique_ptr<comm::RendezvousServer> store_;
  std::atomic<int64_t> restarts_{0};
};

pb::InitRequest Launcher::InitFor(int rank, int generation, const std::string& nccl_id,
                                  const std::vector<int>& cpus) const {
  pb::InitRequest r;
  pb::ParallelPlan* p = r.mutable_parallel();
  p->set_world_size(c_.ranks);
  p->set_rank(rank);
  p->set_mode(c_.mode == runtime::ParallelMode::kTensor  ? pb::ParallelPlan::TENSOR
              : c_.mode == runtime::ParallelMode::kLayer ? pb::ParallelPlan::LAYER
                                                         : pb::ParallelPlan::MODE_UNSPECIFIED);
  pb::CommBootstrap* comm = r.mutable_comm();
  comm->set_timeout_ms(c_.comm_timeout_ms);
  comm->set_prefix(absl::StrCat("moe/gen", generation));
  if (c_.gpu()) {
    comm->set_backend(pb::CommBootstrap::NCCL);
    comm->set_nccl_unique_id(nccl_id);
  } else {
    comm->set_backend(pb::CommBootstrap::GLOO);
    if (store_ != nullptr) comm->set_rendezvous(store_->address());
  }
  int node = 0;
  while (node + 1 < static_cast<int>(c_.nodes.size()) && c_.FirstRankOn(node + 1) <= rank) ++node;
  comm->set_host(c_.nodes.size() > 1 ? c_.nodes[node].host : "127.0.0.1");
  pb::ModelPlacement* pl = r.mutable_placement();
  pl->set_model_dir(c_.model);
  pl->set_device(c_.gpu() ? absl::StrCat("cuda:", c_.nodes[node].gpus[rank - c_.FirstRankOn(node)]) : "cpu");
  pl->set_threads(static_cast<int32_t>(cpus.size()));
  pl->mutable_cpus()->Add(cpus.begin(), cpus.end());
  pl->set_expert_format(c_.expert_format);
  pl->set_expert_group(c_.expert_group);
  pl->set_expert_threads(c_.expert_threads > 0 ? c_.expert_threads : static_cast<int32_t>(cpus.size()));
  if (UsesExpertPool(c_)) pl->set_expert_shm(ArenaName(c_, rank));
  pl->set_cpu_moe(c_.cpu_moe);
  pl->set_n_cpu_moe(c_.n_cpu_moe);
  for (const std::string& rule : c_.override_tensor) pl->add_override_tensor(rule);
  pl->set_max_step_tokens(c_.max_batch_tokens);
  pl->set_max_logit_rows(MaxLogitRows(c_.max_seqs, c_.max_batch_tokens, c_.speculative));
  pl->set_max_context(static_cast<int32_t>(c_.ctx.value_or(0)));
  pl->set_graphs(true);
  pl->set_kv_cache_dtype(c_.kv_cache_dtype);
  pl->set_kv_cache_bytes(c_.kv_cache_mb << 20);
  pl->set_kv_block_size(16);
  pl->set_defer_experts(c_.defer_experts);
  pl->set_gpu_experts_per_layer(c_.gpu_experts_per_layer);
  pl->set_gpu_experts_refresh_steps(c_.gpu_experts_refresh_steps);
  pl->set_expert_profile(c_.expert_profile);
  return r;
}

absl::Status Launcher::InitAll(WorkerGroup& g, const std::string& nccl_id, const std::vector<std::vector<int>>& cpus) {
  // Every rank at once: they rendezvous with each other.
  std::vector<absl::Status> results(g.addresses.size());
  std::vector<std::thread> threads;
  for (size_t rank = 0; rank < g.addresses.size(); ++rank) {
    threads.emplace_back([&, rank] {
      auto channel = grpc::CreateChannel(g.addresses[rank], credentials_);
      if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(60))) {
        results[rank] =
            absl::UnavailableError(absl::StrCat("worker ", rank, " at ", g.addresses[rank], " cannot be reached"));
        return;
      }
      auto stub = pb::Worker::NewStub(channel);
      grpc::ClientContext ctx;
      ctx.AddMetadata(kControlSecretMetadata, secret_);
      pb::InitResponse response;
      const std::vector<int> mine = rank < cpus.size() ? cpus[rank] : std::vector<int>{};
      const grpc::Status s = stub->Init(&ctx, InitFor(static_cast<int>(rank), g.generation, nccl_id, mine), &response);
      results[rank] = s.ok() ? absl::OkStatus() : FromGrpc(s, absl::StrCat("worker ", rank, " Init"));
      if (s.ok()) Log(absl::StrCat("worker ", rank, " at ", g.addresses[rank], ": ", response.description()));
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) MOE_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::Status Launcher::LoadAll(WorkerGroup& g) {
  const int ranks = static_cast<int>(g.addresses.size());
  std::vector<absl::Status> results(ranks);
  std::vector<pb::LoadProgress> done(ranks);
  auto load = [&](int rank) {
    auto stub = pb::Worker::NewStub(grpc::CreateChannel(g.addresses[rank], credentials_));
    grpc::ClientContext ctx;
    ctx.AddMetadata(kControlSecretMetadata, secret_);
    auto reader = stub->Load(&ctx, pb::LoadRequest{});
    pb::LoadProgress progress;
    while (reader->Read(&progress)) {
      if (progress.done()) done[rank] = progress;
    }
    const grpc::Status s = reader->Finish();
    results[rank] = s.ok() ? absl::OkStatus() : FromGrpc(s, absl::StrCat("worker ", rank, " Load"));
    if (s.ok()) Log(absl::StrCat("worker ", rank, ": ", done[rank].message()));
  };
  // The first rank of each node fills the node's shared expert arena; the others then attach.
  std::vector<int> first, rest;
  for (int n = 0; n < static_cast<int>(c_.nodes.size()); ++n) {
    for (int i = 0; i < c_.WorkersOn(n); ++i) {
      (i == 0 || c_.mode == runtime::ParallelMode::kLayer ? first : rest).push_back(c_.FirstRankOn(n) + i);
    }
  }
  for (const std::vector<int>* wave : {&first, &rest}) {
    std::vector<std::thread> threads;
    for (int rank : *wave) threads.emplace_back(load, rank);
    for (std::thread& t : threads) t.join();
  }
  for (const absl::Status& s : results) MOE_RETURN_IF_ERROR(s);
  const int logits_rank = runtime::ParallelConfig::AnsweringRank(c_.mode, ranks);
  g.kv = runtime::KvCapacity{done[0].kv_blocks(), done[0].kv_block_size()};
  for (const pb::LoadProgress& d : done) {
    g.kv.num_blocks = std::min(g.kv.num_blocks, d.kv_blocks());  // available memory: the minimum over ranks
    g.attached += d.attached_experts();
  }
  const pb::LoadProgress& l = done[logits_rank];
  g.info.architecture = l.model_type();
  g.info.vocab_size = l.vocab_size();
  g.info.max_position_embeddings = l.max_position_embeddings();
  g.info.eos_token_ids.assign(l.eos_token_ids().begin(), l.eos_token_ids().end());
  g.info.num_experts = l.num_experts();
  g.info.experts_per_token = l.experts_per_token();
  g.description = absl::StrCat(ranks, " workers (", runtime::ParallelModeName(c_.mode), " split", ", ",
                               c_.gpu() ? "NCCL" : "Gloo", "); rank ", logits_rank, ": ", l.description());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WorkerGroup>> Launcher::StartGroup(int generation) {
  auto g = std::make_unique<WorkerGroup>();
  g->generation = generation;
  const int here = c_.WorkersOn(0);
  // Node 0's ranks come first; the others' (empty here) are pinned by their own launchers.
  const std::vector<std::vector<int>> cpus = c_.gpu() ? std::vector<std::vector<int>>(here) : SplitCores(here);
  for (int i = 0; i < here; ++i) {
    const ClusterNode& node = c_.nodes[0];
    const std::string listen =
        c_.nodes.size() > 1 ? comm::FormatHostPort(node.host, node.port > 0 ? node.port + i : 0) : "127.0.0.1:0";
    MOE_ASSIGN_OR_RETURN(auto w, WorkerProcess::Start(o_.program, listen, cpus[i], i, secret_, tls_));
    g->addresses.push_back(comm::FormatHostPort(c_.nodes.size() > 1 ? node.host : "127.0.0.1", w->port()));
    Log(absl::StrCat("worker ", i, " started (pid ", w->pid(), ") on ", g->addresses.back(),
                     cpus[i].empty() ? "" : absl::StrCat(", ", cpus[i].size(), " cores")));
    g->local.push_back(std::move(w));
  }
  for (int n = 1; n < static_cast<int>(c_.nodes.size()); ++n) {
    for (int i = 0; i < c_.WorkersOn(n); ++i)
      g->addresses.push_back(comm::FormatHostPort(c_.nodes[n].host, c_.nodes[n].port + i));
  }
  std::string nccl_id;
  if (c_.gpu() && c_.ranks > 1) {
#if MOE_COMM_HAS_NCCL
    MOE_ASSIGN_OR_RETURN(nccl_id, comm::NcclUniqueId());
#else
    return absl::FailedPreconditionError("this moeserve was built without NCCL: GPU workers need it");
#endif
  }
  MOE_RETURN_IF_ERROR(InitAll(*g, nccl_id, cpus));
  MOE_RETURN_IF_ERROR(LoadAll(*g));
  return g;
}

absl::Status Launcher::StartStore() {
  if (c_.gpu() || c_.ranks == 1) return absl::OkStatus();
  comm::RendezvousServerOptions so;
  so.secret = secret_;
  if (!c_.rendezvous.empty()) {
    MOE_ASSIGN_OR_RETURN(const comm::HostPort hp, comm::ParseHostPort(c_.rendezvous, "comm.rendezvous"));
    so.host = hp.host;
    so.port = hp.port;
  }
  MOE_ASSIGN_OR_RETURN(store_, comm::RendezvousServer::Start(so));
  Log(absl::StrCat("rendezvous store on ", store_->address(), " (connections must hold the control-plane secret)"));
  return absl::OkStatus();
}

bool Launcher::AnyExited(WorkerGroup& g, std::string* why) {
  for (auto& w : g.local) {
    std::string how;
    if (w->Exited(&how)) {
      *why = absl::StrCat("worker ", w->rank(), " ", how);
      return true;
    }
  }
  return false;
}

void Launcher::StopGroup(WorkerGroup* g) {
  if (g == nullptr) return;
  // Workers on other nodes end themselves on Shutdown; their launchers start new ones.
  for (size_t rank = g->local.size(); rank < g->addresses.size(); ++rank) {
    auto stub = pb::Worker::NewStub(grpc::CreateChannel(g->addresses[rank], credentials_));
    grpc::ClientContext ctx;
    ctx.AddMetadata(kControlSecretMetadata, secret_);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    pb::ShutdownResponse response;
    (void)stub->Shutdown(&ctx, pb::ShutdownRequest{}, &response);
  }
  g->local.clear();  // kills this node's
}

void Launcher::CheckTopology(int node) const {
  const std::vector<int>& gpus = c_.nodes[node].gpus;
  if (gpus.size() < 2) return;
  auto topology = comm::ProbeTopology(gpus);
  if (!topology.ok()) {
    Log(absl::StrCat("warning: the GPUs' topology could not be read: ", topology.status().message()));
    return;
  }
  for (absl::string_view line : absl::StrSplit(topology->ToString(), '\n', absl::SkipEmpty())) {
    Log(absl::StrCat("topology: ", line));
  }
  for (const std::string& warning : topology->Warnings()) Log(absl::StrCat("warning: ", warning));
}

int Launcher::RunOtherNode() {
  // Node N > 0: this node's workers on their fixed ports, restarted whenever one exits; node 0
  // drives them.
  const int n = o_.node, here = c_.WorkersOn(n);
  CheckTopology(n);
  const std::vector<std::vector<int>> cores = c_.gpu() ? std::vector<std::vector<int>>(here) : SplitCores(here);
  std::vector<std::unique_ptr<WorkerProcess>> workers(here);
  int backoff_ms = c_.restart_backoff_ms;
  while (!Stopping()) {
    for (int i = 0; i < here; ++i) {
      std::string why;
      if (workers[i] != nullptr && !workers[i]->Exited(&why)) continue;
      if (workers[i] != nullptr) Log(absl::StrCat("worker ", c_.FirstRankOn(n) + i, " ", why, "; starting it again"));
      auto w = WorkerProcess::Start(o_.program, comm::FormatHostPort(c_.nodes[n].host, c_.nodes[n].port + i), cores[i],
                                    c_.FirstRankOn(n) + i, secret_, tls_);
      if (!w.ok()) {
        Log(std::string(w.status().message()));
        std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
        backoff_ms = std::min(2 * backoff_ms, 30000);
        continue;
      }
      workers[i] = std::move(*w);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return 0;
}

int Launcher::Run() {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  if (o_.node != 0) return RunOtherNode();
  CheckTopology(0);

  scheduler::FrontendOptions fo;
  fo.listen = c_.listen;
  fo.http_listen = c_.http == "off" ? "" : c_.http;
  fo.request_log = o_.request_log;
  fo.model_dir = c_.model;
  fo.served_model_name = c_.served_model_name;
  if (!c_.api_key_file.empty()) {
    auto keys = scheduler::ApiKeys::Load(c_.api_key_file);
    if (!keys.ok()) return FailCommand("serve", keys.status(), 2);
    fo.api_keys = std::make_shared<const scheduler::ApiKeys>(std::move(*keys));
    Log(absl::StrCat(fo.api_keys->size(), " API keys from ", c_.api_key_file));
  }
  fo.protect_metrics = c_.api_key_protect_metrics;
  fo.tls = {c_.tls_cert, c_.tls_key, c_.tls_client_ca};
  fo.max_request_bytes = c_.max_request_bytes;
  fo.chat_template_file = c_.chat_template_file;
  fo.tokenizer_dir = c_.tokenizer;
  fo.tool_call_parser = c_.tool_call_parser;
  fo.reasoning_parser = c_.reasoning_parser;
  fo.allowed_origins = c_.allowed_origins;
  auto frontend = scheduler::Frontend::Create(fo);
  if (!frontend.ok()) {
    return FailCommand("serve", frontend.status(),
                       frontend.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  }
  if ((*frontend)->http_port() != 0) {
    Log(absl::StrCat("HTTP on port ", (*frontend)->http_port(), fo.tls.enabled() ? " over TLS" : ""));
  }
  // The gRPC port binds once the workers have loaded: a port taken now fails before any starts.
  if (absl::Status st = CheckListenPortFree(c_.listen); !st.ok()) return FailCommand("serve", st);
  if (absl::Status st = StartStore(); !st.ok()) return FailCommand("serve", st);
  DerivedArenas arenas(c_);
  arenas.CleanUpAndClaim();
  Log(absl::StrCat("starting ", c_.ranks, " workers for ", c_.model, " (", runtime::ParallelModeName(c_.mode),
                   " split) from ", c_.path));
  auto group = StartGroup(1);
  if (!group.ok()) return FailCommand("serve", group.status());
  if (const std::string shm = ShmUsage(); !shm.empty() && UsesExpertPool(c_)) Log(shm);

  const worker::RemoteExecutor::Options eo = ExecutorOptions(**group);
  auto executor = worker::RemoteExecutor::Connect(eo);
  if (!executor.ok()) return FailCommand("serve", executor.status());
  worker::RemoteExecutor* remote = executor->get();

  scheduler::SchedulerConfig sc;
  sc.max_seqs = c_.max_seqs;
  sc.max_queue = c_.max_queue;
  sc.max_batch_tokens = c_.max_batch_tokens;
  sc.prefix_cache = c_.prefix_cache;
  sc.prefix_cache_salt = scheduler::PrefixCacheSalt(c_.kv_cache_dtype);
  // The frontend drafts (n-grams) and plans the verify rows; every worker runs them as any rows.
  sc.max_draft = c_.speculative.max_draft();
  sc.draft_type = c_.speculative.type;
  sc.draft_adaptive = c_.speculative.adaptive;
  const int64_t positions = int64_t{eo.kv.num_blocks} * eo.kv.block_size;
  sc.context = static_cast<int>(std::min<int64_t>(
      {c_.ctx.value_or(eo.info.max_position_embeddings), eo.info.max_position_embeddings, positions}));
  sc.max_prompt_tokens = std::min(sc.context, c_.max_prompt_tokens.value_or(sc.context));
  (*frontend)->set_scheduler(sc, eo.description);
  if (absl::Status s = (*frontend)->Serve(std::move(*executor)); !s.ok()) return FailCommand("serve", s);
  (*frontend)->set_extra_metrics([this] {
    return absl::StrCat(
        "# HELP moeserve_worker_restarts_total Times the worker group was restarted after a worker was lost.\n"
        "# TYPE moeserve_worker_restarts_total counter\nmoeserve_worker_restarts_total ",
        restarts_.load(), "\n");
  });
  Log(absl::StrCat(eo.description, "; KV cache ", eo.kv.num_blocks, " blocks of ", eo.kv.block_size,
                   " positions; context ", sc.context));
  std::cout << "serving on port " << (*frontend)->port() << std::endl;

  // Supervision: a lost worker fails the steps in flight at once (MarkBroken), then the group
  // starts again under a new generation; restarts in a row back off.
  std::unique_ptr<WorkerGroup> current = std::move(*group);
  int backoff_ms = c_.restart_backoff_ms, in_a_row = 0;
  Clock::time_point healthy_since = Clock::now();
  while (!Stopping()) {
    std::string why;
    bool lost = AnyExited(*current, &why);
    if (!lost && !remote->healthy()) {
      // A control stream broke: name the worker whose process ended, if one did.
      lost = true;
      const auto until = Clock::now() + std::chrono::milliseconds(500);
      while (why.empty() && Clock::now() < until && !AnyExited(*current, &why)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    if (!lost) {
      if (in_a_row > 0 && Clock::now() - healthy_since > std::chrono::minutes(1)) {
        in_a_row = 0;
        backoff_ms = c_.restart_backoff_ms;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (why.empty()) why = remote->broken_reason();
    if (why.empty()) why = "a worker's control stream broke";
    remote->MarkBroken(why);
    (*frontend)->SetWorkersReady(false);
    Log(absl::StrCat(why, ": the steps in flight fail with UNAVAILABLE; restarting the group"));
    StopGroup(current.get());
    if (++in_a_row > c_.max_restarts) {
      Log(absl::StrCat(in_a_row - 1, " restarts in a row (supervisor.max_restarts): giving up"));
      (*frontend)->Drain(std::chrono::seconds(0));
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    backoff_ms = std::min(2 * std::max(backoff_ms, 1), 30000);
    const int generation = current->generation + 1;
    auto next = StartGroup(generation);
    if (!next.ok()) {
      // An empty group of the failed generation: the next try takes a new one (and new store keys).
      Log(absl::StrCat("restart failed: ", next.status().message()));
      current = std::make_unique<WorkerGroup>();
      current->generation = generation;
      continue;
    }
    if (absl::Status s = remote->Reattach((*next)->addresses); !s.ok()) {
      Log(absl::StrCat("restart failed: ", s.message()));
      current = std::move(*next);
      continue;
    }
    current = std::move(*next);
    restarts_.fetch_add(1);
    // The store keeps only the live generation's keys.
    if (store_ != nullptr) {
      for (int g = 1; g < current->generation; ++g) store_->DropKeys(absl::StrCat("moe/gen", g, "/"));
    }
    healthy_since = Clock::now();
    (*frontend)->SetWorkersReady(true);
    Log(absl::StrCat("group restarted (generation ", current->generation, "); ", current->attached, " of ", c_.ranks,
                     " workers attached the shared expert arena instead of reloading the experts"));
  }
  Log(absl::StrFormat("draining: running requests have up to %d s to finish", c_.drain_seconds));
  const int cut = (*frontend)->Drain(std::chrono::seconds(c_.drain_seconds), [] { return g_signals.load() > 1; });
  if (g_signals.load() > 1) Log("a second signal: the drain ended at once");
  StopGroup(current.get());
  if (store_ != nullptr) store_->Stop();
  // The arenas this deployment derived go with it (~DerivedArenas), on this path as on the errors'.
  Log(absl::StrFormat("stopped (%d requests cut off by the drain's end)", cut));
  return 0;
}

class LocalWorkersImpl final : public LocalWorkers {
 public:
  LocalWorkersImpl(const ClusterConfig& c, const LaunchOptions& o)
      : config_(c), options_(o), launcher_(config_, options_) {}
  absl::Status Start() {
    MOE_RETURN_IF_ERROR(launcher_.StartStore());
    MOE_ASSIGN_OR_RETURN(group_, launcher_.StartGroup(1));
    return absl::OkStatus();
  }
  worker::RemoteExecutor::Options executor_options() const override { return launcher_.ExecutorOptions(*group_); }

 private:
  const ClusterConfig config_;
  const LaunchOptions options_;
  Launcher launcher_;
  std::unique_ptr<WorkerGroup> group_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LocalWorkers>> StartLocalWorkers(const ClusterConfig& config,
                                                                const LaunchOptions& options) {
  auto workers = std::make_unique<LocalWorkersImpl>(config, options);
  MOE_RETURN_IF_ERROR(workers->Start());
  return std::unique_ptr<LocalWorkers>(std::move(workers));
}

int RunCluster(const ClusterConfig& config, const LaunchOptions& options) {
  Launcher launcher(config, options);
  return launcher.Run();
}

}  // namespace moe::deploy
