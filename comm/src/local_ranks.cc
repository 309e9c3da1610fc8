#include "moe/comm/local_ranks.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "deadline.h"
#include "moe/comm/rendezvous.h"
#include "moe/comm/tcp_socket.h"

namespace moe::comm {
namespace {

// The result a child sends: "OK\n" then its text, or "E<code>\n" then the error's message.
std::string EncodeResult(const absl::StatusOr<std::string>& result) {
  if (result.ok()) return absl::StrCat("OK\n", *result);
  return absl::StrCat("E", static_cast<int>(result.status().code()), "\n", result.status().message());
}

absl::StatusOr<std::string> DecodeResult(const std::string& bytes, int rank) {
  const size_t newline = bytes.find('\n');
  if (newline != std::string::npos && bytes.compare(0, newline, "OK") == 0) return bytes.substr(newline + 1);
  int code = 0;
  if (newline != std::string::npos && bytes[0] == 'E' && absl::SimpleAtoi(bytes.substr(1, newline - 1), &code)) {
    return absl::Status(static_cast<absl::StatusCode>(code), bytes.substr(newline + 1));
  }
  return absl::UnavailableError(absl::StrCat("rank ", rank, " sent no result"));
}

// The child's side: read the store address, run the body, send the result, leave.
[[noreturn]] void RunChild(int rank, TcpSocket parent, const RankBody& body) {
  std::string address;
  char c = 0;
  while (::recv(parent.fd(), &c, 1, 0) == 1 && c != '\n') address.push_back(c);
  if (c != '\n') _exit(3);  // the parent went away before the group started
  absl::StatusOr<std::string> result;
  try {
    result = body(rank, address);
  } catch (const std::exception& e) {
    result = absl::InternalError(absl::StrCat("rank ", rank, " threw: ", e.what()));
  }
  const std::string encoded = EncodeResult(result);
  (void)SendAll(parent, encoded.data(), encoded.size(), absl::InfiniteFuture(), "result");
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  _exit(0);
}

std::string DescribeExit(int status, int rank) {
  if (WIFSIGNALED(status)) {
    return absl::StrCat("rank ", rank, " died by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("rank ", rank, " exited with status ", WEXITSTATUS(status), " without a result");
}

}  // namespace

absl::StatusOr<std::vector<absl::StatusOr<std::string>>> RunLocalRanks(const LocalRanksOptions& options,
                                                                       const RankBody& body) {
  const int n = options.ranks;
  if (n < 1) return absl::InvalidArgumentError("RunLocalRanks: ranks must be at least 1");
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::vector<TcpSocket> children;  // the parent's end of each child's socket pair
  std::vector<pid_t> pids;
  auto kill_all = [&] {
    for (pid_t pid : pids) ::kill(pid, SIGKILL);
    for (pid_t pid : pids) ::waitpid(pid, nullptr, 0);
  };
  for (int rank = 0; rank < n; ++rank) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
      kill_all();
      return absl::InternalError(absl::StrCat("RunLocalRanks: socketpair: ", std::strerror(errno)));
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(pair[0]);
      ::close(pair[1]);
      kill_all();
      return absl::InternalError(absl::StrCat("RunLocalRanks: fork: ", std::strerror(errno)));
    }
    if (pid == 0) {
      for (TcpSocket& s : children) s.Close();  // the other children's ends: their EOF is theirs
      ::close(pair[0]);
      RunChild(rank, TcpSocket(pair[1]), body);
    }
    ::close(pair[1]);
    children.emplace_back(pair[0]);
    pids.push_back(pid);
  }

  auto server = RendezvousServer::Start({});
  if (!server.ok()) {
    kill_all();
    return absl::InternalError(absl::StrCat("RunLocalRanks: ", server.status().message()));
  }
  const std::string start = (*server)->address() + "\n";
  for (TcpSocket& child : children) (void)SendAll(child, start.data(), start.size(), absl::InfiniteFuture(), "start");

  // Collect every child's result until each closes its end, or the deadline.
  const absl::Time deadline = absl::Now() + options.deadline;
  std::vector<std::string> received(n);
  std::vector<bool> running(n, true);
  for (int left = n; left > 0;) {
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (int r = 0; r < n; ++r) {
      if (!running[r]) continue;
      fds.push_back({children[r].fd(), POLLIN, 0});
      ranks.push_back(r);
    }
    const int rc = ::poll(fds.data(), fds.size(), internal::PollTimeoutMs(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) break;  // the deadline
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t got = ::recv(fds[i].fd, buffer, sizeof(buffer), 0);
      if (got > 0) {
        received[ranks[i]].append(buffer, got);
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        running[ranks[i]] = false;
        --left;
      }
    }
  }

  std::vector<absl::StatusOr<std::string>> results;
  for (int r = 0; r < n; ++r) {
    if (running[r]) ::kill(pids[r], SIGKILL);
    int status = 0;
    while (::waitpid(pids[r], &status, 0) < 0 && errno == EINTR) {
    }
    if (running[r]) {
      results.push_back(absl::DeadlineExceededError(
          absl::StrCat("rank ", r, " did not finish within ", absl::FormatDuration(options.deadline), "; killed")));
    } else if (received[r].empty()) {
      results.push_back(absl::UnavailableError(DescribeExit(status, r)));
    } else {
      results.push_back(DecodeResult(received[r], r));
    }
  }
  return results;
}

}  // namespace moe::comm
