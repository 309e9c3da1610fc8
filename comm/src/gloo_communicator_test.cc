// GlooCommunicator with 2 and 3 ranks as real processes on loopback (RunLocalRanks forks them),
// rendezvousing through a real RendezvousServer. A rank's checks run in its own process and come
// back as its result (an error names the first mismatch).
#include "moe/comm/gloo_communicator.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "moe/comm/local_ranks.h"
#include "moe/comm/rendezvous.h"
#include "moe/core/status.h"

namespace moe::comm {
namespace {

constexpr int64_t kHidden = 2048;

GlooOptions Options(int rank, int size, const std::string& store, absl::Duration timeout = absl::Seconds(30)) {
  GlooOptions o;
  o.rank = rank;
  o.size = size;
  o.store_address = store;
  o.prefix = "test";
  o.timeout = timeout;
  return o;
}

absl::Status Check(bool ok, const std::string& what) { return ok ? absl::OkStatus() : absl::InternalError(what); }

// Runs `body` on `ranks` processes and expects each to succeed.
void ExpectEveryRankOk(int ranks, const RankBody& body, absl::Duration deadline = absl::Seconds(50)) {
  auto results = RunLocalRanks({.ranks = ranks, .deadline = deadline}, body);
  ASSERT_TRUE(results.ok()) << results.status();
  for (int r = 0; r < ranks; ++r) EXPECT_TRUE((*results)[r].ok()) << "rank " << r << ": " << (*results)[r].status();
}

// A value in [-1, 1) that any rank can compute for any rank's element i.
float RandomValue(int rank, int64_t i) {
  uint64_t z = (static_cast<uint64_t>(rank) << 40) + static_cast<uint64_t>(i) + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// Integer-valued data (exact in fp32 and in the sums), then random data (within rounding), of
// `count` floats.
absl::Status CheckAllReduceF32(Communicator& comm, int64_t count) {
  const int n = comm.size(), rank = comm.rank();
  std::vector<float> data(count);
  for (int64_t i = 0; i < count; ++i) data[i] = static_cast<float>((rank + 1) * (i % 1000));
  MOE_RETURN_IF_ERROR(comm.AllReduceSum(data.data(), count, core::DType::kF32));
  for (int64_t i = 0; i < count; ++i) {
    const float want = static_cast<float>((i % 1000) * n * (n + 1) / 2);
    if (data[i] != want) return absl::InternalError(absl::StrCat(count, " floats: [", i, "] ", data[i], " != ", want));
  }
  for (int64_t i = 0; i < count; ++i) data[i] = RandomValue(rank, i);
  MOE_RETURN_IF_ERROR(comm.AllReduceSum(data.data(), count, core::DType::kF32));
  for (int64_t i = 0; i < count; ++i) {
    float want = 0;
    for (int r = 0; r < n; ++r) want += RandomValue(r, i);
    if (std::fabs(data[i] - want) > 1e-5f) {
      return absl::InternalError(absl::StrCat(count, " random floats: [", i, "] ", data[i], " != ", want));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAllReduceOtherTypes(Communicator& comm) {
  const int n = comm.size(), rank = comm.rank();
  std::vector<uint16_t> bf16(kHidden);  // small integers are exact in bf16
  for (int64_t i = 0; i < kHidden; ++i) bf16[i] = core::FloatToBf16(static_cast<float>((rank + 1) * (i % 16)));
  MOE_RETURN_IF_ERROR(comm.AllReduceSum(bf16.data(), kHidden, core::DType::kBF16));
  for (int64_t i = 0; i < kHidden; ++i) {
    MOE_RETURN_IF_ERROR(Check(core::Bf16ToFloat(bf16[i]) == static_cast<float>((i % 16) * n * (n + 1) / 2),
                              absl::StrCat("bf16 [", i, "] = ", core::Bf16ToFloat(bf16[i]))));
  }
  std::vector<int64_t> ints = {int64_t{1} << 40, -rank, rank};
  MOE_RETURN_IF_ERROR(comm.AllReduceSum(ints.data(), 3, core::DType::kI64));
  return Check(ints[0] == n * (int64_t{1} << 40) && ints[1] == -n * (n - 1) / 2 && ints[2] == n * (n - 1) / 2,
               absl::StrCat("i64 sums ", ints[0], " ", ints[1], " ", ints[2]));
}

absl::Status AllReduceEverySize(int rank, int size, const std::string& store) {
  MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(Options(rank, size, store)));
  MOE_RETURN_IF_ERROR(CheckAllReduceF32(*comm, 1));
  MOE_RETURN_IF_ERROR(CheckAllReduceF32(*comm, kHidden));            // one hidden-state row
  MOE_RETURN_IF_ERROR(CheckAllReduceF32(*comm, kHidden * kHidden));  // a 2048-token chunk
  MOE_RETURN_IF_ERROR(CheckAllReduceOtherTypes(*comm));
  return comm->AllReduceSum(nullptr, 0, core::DType::kF32);  // nothing to do, and fine
}

class GlooGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooGroupTest, AllReduceSumsOneRowAndAChunk) {
  ExpectEveryRankOk(GetParam(), [size = GetParam()](int rank, const std::string& store) -> absl::StatusOr<std::string> {
    MOE_RETURN_IF_ERROR(AllReduceEverySize(rank, size, store));
    return "";
  });
}

TEST_P(GlooGroupTest, AllGatherPutsEveryRankInOrder) {
  ExpectEveryRankOk(GetParam(), [size = GetParam()](int rank, const std::string& store) -> absl::StatusOr<std::string> {
    MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(Options(rank, size, store)));
    const int64_t bytes = 1001;  // odd, so chunks do not split evenly
    std::vector<uint8_t> send(bytes), recv(bytes * size, 0);
    for (int64_t i = 0; i < bytes; ++i) send[i] = static_cast<uint8_t>(rank * 31 + i);
    MOE_RETURN_IF_ERROR(comm->AllGather(send.data(), recv.data(), bytes));
    for (int r = 0; r < size; ++r) {
      for (int64_t i = 0; i < bytes; ++i) {
        MOE_RETURN_IF_ERROR(Check(recv[r * bytes + i] == static_cast<uint8_t>(r * 31 + i),
                                  absl::StrCat("slot of rank ", r, " byte ", i)));
      }
    }
    std::vector<uint8_t> in_place(bytes * size, 0);  // this rank's slot already holds its part
    std::memcpy(in_place.data() + rank * bytes, send.data(), bytes);
    MOE_RETURN_IF_ERROR(comm->AllGather(in_place.data() + rank * bytes, in_place.data(), bytes));
    MOE_RETURN_IF_ERROR(Check(in_place == recv, "the in-place all-gather differs"));
    return "";
  });
}

TEST_P(GlooGroupTest, BroadcastFromEachRoot) {
  ExpectEveryRankOk(GetParam(), [size = GetParam()](int rank, const std::string& store) -> absl::StatusOr<std::string> {
    MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(Options(rank, size, store)));
    for (int root = 0; root < size; ++root) {
      std::vector<float> data(kHidden, rank == root ? 0.0f : -1.0f);
      if (rank == root) {
        for (int64_t i = 0; i < kHidden; ++i) data[i] = RandomValue(root, i);
      }
      MOE_RETURN_IF_ERROR(comm->Broadcast(data.data(), kHidden * sizeof(float), root));
      for (int64_t i = 0; i < kHidden; ++i) {
        MOE_RETURN_IF_ERROR(Check(data[i] == RandomValue(root, i), absl::StrCat("root ", root, " element ", i)));
      }
    }
    return "";
  });
}

TEST_P(GlooGroupTest, SendAndRecvAroundTheRing) {
  ExpectEveryRankOk(GetParam(), [size = GetParam()](int rank, const std::string& store) -> absl::StatusOr<std::string> {
    MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(Options(rank, size, store)));
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    std::vector<float> mine(kHidden), got(kHidden, 0.0f);
    for (int64_t i = 0; i < kHidden; ++i) mine[i] = RandomValue(rank, i);
    auto check_from = [&](int from, const char* how) {
      for (int64_t i = 0; i < kHidden; ++i) {
        if (got[i] != RandomValue(from, i)) return absl::InternalError(absl::StrCat(how, ": element ", i));
      }
      return absl::OkStatus();
    };
    // One step of a ring, both directions in flight.
    MOE_RETURN_IF_ERROR(comm->SendRecv(mine.data(), next, got.data(), prev, kHidden * sizeof(float)));
    MOE_RETURN_IF_ERROR(check_from(prev, "send-recv"));
    // Blocking Send and Recv: even ranks send first, odd ranks receive first.
    std::fill(got.begin(), got.end(), 0.0f);
    if (rank % 2 == 0) {
      MOE_RETURN_IF_ERROR(comm->Send(mine.data(), kHidden * sizeof(float), next));
      MOE_RETURN_IF_ERROR(comm->Recv(got.data(), kHidden * sizeof(float), prev));
    } else {
      MOE_RETURN_IF_ERROR(comm->Recv(got.data(), kHidden * sizeof(float), prev));
      MOE_RETURN_IF_ERROR(comm->Send(mine.data(), kHidden * sizeof(float), next));
    }
    MOE_RETURN_IF_ERROR(check_from(prev, "send then recv"));
    std::fill(got.begin(), got.end(), 0.0f);  // to itself
    MOE_RETURN_IF_ERROR(comm->SendRecv(mine.data(), rank, got.data(), rank, kHidden * sizeof(float)));
    MOE_RETURN_IF_ERROR(check_from(rank, "send-recv to itself"));
    return "";
  });
}

TEST_P(GlooGroupTest, BarrierHoldsEveryRankUntilTheLastArrives) {
  ExpectEveryRankOk(GetParam(), [size = GetParam()](int rank, const std::string& store) -> absl::StatusOr<std::string> {
    MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(Options(rank, size, store)));
    MOE_ASSIGN_OR_RETURN(auto client, RendezvousClient::Connect(store, absl::Seconds(10)));
    const int last = size - 1;
    if (rank == last) {
      absl::SleepFor(absl::Milliseconds(200));
      MOE_RETURN_IF_ERROR(client->Set("before-barrier", "set"));
    }
    MOE_RETURN_IF_ERROR(comm->Barrier());
    // Whoever passed the barrier must see what the last rank did before it (no wait: timeout 0).
    return client->Get("before-barrier", absl::ZeroDuration()).status().ok()
               ? absl::StatusOr<std::string>("")
               : absl::InternalError("passed the barrier before the last rank reached it");
  });
}

TEST_P(GlooGroupTest, KilledPeerFailsEverySurvivorPromptly) {
  const int size = GetParam();
  const int victim = size - 1;
  auto results = RunLocalRanks(
      {.ranks = size, .deadline = absl::Seconds(50)},
      [&](int rank, const std::string& store) -> absl::StatusOr<std::string> {
        // A timeout far above "promptly": a failure must not wait for it.
        MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(Options(rank, size, store, absl::Seconds(60))));
        std::vector<float> row(kHidden, 1.0f);
        MOE_RETURN_IF_ERROR(comm->AllReduceSum(row.data(), kHidden, core::DType::kF32));
        if (rank == victim) {
          absl::SleepFor(absl::Milliseconds(300));  // the others are waiting by then
          ::raise(SIGKILL);
        }
        const absl::Time start = absl::Now();
        const absl::Status lost = comm->AllReduceSum(row.data(), kHidden, core::DType::kF32);
        const absl::Duration took = absl::Now() - start;
        const absl::Status next = comm->Barrier();
        return absl::StrFormat("%d|%s|%d|%s|%d", static_cast<int>(lost.code()), lost.message(),
                               static_cast<int>(absl::ToInt64Seconds(took)), next.message(),
                               static_cast<int>(next.code()));
      });
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[victim].status().code(), absl::StatusCode::kUnavailable) << (*results)[victim].status();
  EXPECT_NE((*results)[victim].status().message().find("signal 9"), std::string::npos);
  for (int r = 0; r < victim; ++r) {
    ASSERT_TRUE((*results)[r].ok()) << "rank " << r << ": " << (*results)[r].status();
    const std::vector<std::string> fields = absl::StrSplit(*(*results)[r], '|');
    ASSERT_EQ(fields.size(), 5u) << *(*results)[r];
    EXPECT_EQ(fields[0], std::to_string(static_cast<int>(absl::StatusCode::kUnavailable))) << fields[1];
    EXPECT_NE(fields[1].find("all-reduce"), std::string::npos) << fields[1];
    EXPECT_NE(fields[1].find("rank "), std::string::npos) << fields[1];
    EXPECT_NE(fields[1].find("lost the connection to rank"), std::string::npos) << fields[1];
    if (size == 2) {
      EXPECT_NE(fields[1].find("lost the connection to rank 1"), std::string::npos) << fields[1];
    }
    EXPECT_LT(std::stoi(fields[2]), 10) << "rank " << r << " waited " << fields[2] << " s for a dead peer";
    EXPECT_EQ(fields[4], std::to_string(static_cast<int>(absl::StatusCode::kUnavailable))) << fields[3];
    EXPECT_NE(fields[3].find("barrier"), std::string::npos) << fields[3];
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooGroupTest, ::testing::Values(2, 3), [](const ::testing::TestParamInfo<int>& info) {
  return info.param == 2 ? "TwoRanks" : "ThreeRanks";
});

TEST(GlooCommunicatorTest, AbortFromAnotherThreadEndsAPendingOperation) {
  auto results = RunLocalRanks(
      {.ranks = 2, .deadline = absl::Seconds(40)},
      [](int rank, const std::string& store) -> absl::StatusOr<std::string> {
        MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(Options(rank, 2, store, absl::Seconds(60))));
        std::vector<float> row(kHidden, 1.0f);
        if (rank == 1) {
          // Waits for a message rank 0 never sends: rank 0's Abort ends it.
          const absl::Status s = comm->Recv(row.data(), sizeof(float), 0);
          if (s.code() != absl::StatusCode::kUnavailable || s.message().find("rank 0") == std::string_view::npos) {
            return absl::InternalError(absl::StrCat("rank 1's recv: ", s.ToString()));
          }
          return "";
        }
        std::thread aborter([&] {
          absl::SleepFor(absl::Milliseconds(300));
          comm->Abort();
        });
        // Rank 1 never joins this all-reduce.
        const absl::Status pending = comm->AllReduceSum(row.data(), kHidden, core::DType::kF32);
        aborter.join();
        const absl::Status later = comm->Broadcast(row.data(), 4, 0);
        if (pending.code() != absl::StatusCode::kUnavailable ||
            pending.message().find("aborted") == std::string_view::npos ||
            pending.message().find("all-reduce") == std::string_view::npos) {
          return absl::InternalError(absl::StrCat("pending: ", pending.ToString()));
        }
        if (later.code() != absl::StatusCode::kUnavailable || comm->AsyncError().ok()) {
          return absl::InternalError(absl::StrCat("later: ", later.ToString()));
        }
        comm->Abort();  // idempotent
        return "";
      });
  ASSERT_TRUE(results.ok()) << results.status();
  for (int r = 0; r < 2; ++r) EXPECT_TRUE((*results)[r].ok()) << "rank " << r << ": " << (*results)[r].status();
}

TEST(GlooCommunicatorTest, NoProgressWithinTheTimeoutIsDeadlineExceeded) {
  auto results = RunLocalRanks({.ranks = 2, .deadline = absl::Seconds(40)},
                               [](int rank, const std::string& store) -> absl::StatusOr<std::string> {
                                 MOE_ASSIGN_OR_RETURN(
                                     auto comm, GlooCommunicator::Create(Options(rank, 2, store, absl::Seconds(2))));
                                 if (rank == 1) {  // alive, connected, and silent
                                   absl::SleepFor(absl::Seconds(4));
                                   return "";
                                 }
                                 float x = 0;
                                 const absl::Status s = comm->Recv(&x, sizeof(x), 1);
                                 if (s.code() != absl::StatusCode::kDeadlineExceeded) {
                                   return absl::InternalError(s.ToString());
                                 }
                                 const absl::Status later = comm->Recv(&x, sizeof(x), 1);
                                 if (later.code() != absl::StatusCode::kUnavailable) {
                                   return absl::InternalError(absl::StrCat("later: ", later.ToString()));
                                 }
                                 return "";
                               });
  ASSERT_TRUE(results.ok()) << results.status();
  for (int r = 0; r < 2; ++r) EXPECT_TRUE((*results)[r].ok()) << "rank " << r << ": " << (*results)[r].status();
}

TEST(GlooCommunicatorTest, ARestartedGroupRendezvousesUnderANewPrefix) {
  ExpectEveryRankOk(2, [](int rank, const std::string& store) -> absl::StatusOr<std::string> {
    for (const char* prefix : {"moe/gen1", "moe/gen2"}) {
      GlooOptions o = Options(rank, 2, store);
      o.prefix = prefix;
      MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(o));
      float x = 1.0f;
      MOE_RETURN_IF_ERROR(comm->AllReduceSum(&x, 1, core::DType::kF32));
      MOE_RETURN_IF_ERROR(Check(x == 2.0f, absl::StrCat(prefix, ": sum ", x)));
      MOE_RETURN_IF_ERROR(Check(comm->Describe().find("gloo tcp: rank ") == 0, comm->Describe()));
    }
    return "";
  });
}

// What the ranks leave in the store holds no uninitialised memory: each published Gloo address
// (its whole sockaddr_storage) is zero past the bytes of its address family.
TEST(GlooCommunicatorTest, TheStoresValuesHoldNoUninitialisedBytes) {
  ExpectEveryRankOk(2, [](int rank, const std::string& store) -> absl::StatusOr<std::string> {
    GlooOptions o = Options(rank, 2, store);
    o.prefix = "padding";
    MOE_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(o));
    MOE_RETURN_IF_ERROR(comm->Barrier());
    if (rank != 0) return "";
    MOE_ASSIGN_OR_RETURN(auto client, RendezvousClient::Connect(store, absl::Seconds(10)));
    constexpr size_t kAddress = sizeof(sockaddr_storage) + sizeof(ssize_t);
    for (int r = 0; r < 2; ++r) {
      MOE_ASSIGN_OR_RETURN(const std::string value, client->Get(absl::StrCat("padding/", r), absl::Seconds(10)));
      MOE_RETURN_IF_ERROR(Check(!value.empty() && value.size() % kAddress == 0,
                                absl::StrCat("rank ", r, " published ", value.size(), " bytes")));
      for (size_t at = 0; at < value.size(); at += kAddress) {
        sa_family_t family;
        std::memcpy(&family, value.data() + at, sizeof(family));
        const size_t used = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
        for (size_t i = used; i < sizeof(sockaddr_storage); ++i) {
          MOE_RETURN_IF_ERROR(Check(value[at + i] == 0, absl::StrCat("rank ", r, "'s address at ", at, ": byte ", i,
                                                                     " past the address is not zero")));
        }
      }
    }
    return "";
  });
}

// One rank, in this process: the arguments each call refuses, and the communicator goes on.
TEST(GlooCommunicatorTest, BadArgumentsAreRefusedAndLeaveItUsable) {
  auto server = RendezvousServer::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  {
    auto created = GlooCommunicator::Create(Options(0, 1, (*server)->address()));
    ASSERT_TRUE(created.ok()) << created.status();
    GlooCommunicator& comm = **created;
    EXPECT_EQ(comm.Describe().rfind("gloo tcp: rank 0 of 1 via 127.0.0.1", 0), 0u) << comm.Describe();
    float data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const absl::Status negative = comm.AllReduceSum(data, -1, core::DType::kF32);
    EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(negative.message().find("all-reduce on gloo rank 0 of 1: count -1"), std::string::npos) << negative;
    EXPECT_EQ(comm.AllReduceSum(nullptr, 4, core::DType::kF32).code(), absl::StatusCode::kInvalidArgument);
    const absl::Status fp8 = comm.AllReduceSum(data, 4, core::DType::kF8E4M3);
    EXPECT_EQ(fp8.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(fp8.message().find("cannot sum F8_E4M3"), std::string::npos) << fp8;
    EXPECT_EQ(comm.Broadcast(data, 4, 1).code(), absl::StatusCode::kInvalidArgument);
    const absl::Status self = comm.Send(data, 4, 0);
    EXPECT_EQ(self.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(self.message().find("SendRecv"), std::string::npos) << self;
    EXPECT_EQ(comm.Recv(data, 4, -1).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.AllGather(data + 1, data, 8).code(), absl::StatusCode::kInvalidArgument);  // overlapping
    EXPECT_EQ(comm.SendRecv(data, 0, data + 4, 0, 32).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(comm.AllReduceSum(data, 8, core::DType::kF32).ok());
    EXPECT_EQ(data[7], 8.0f);
    ASSERT_TRUE(comm.AllGather(data, data, 4 * sizeof(float)).ok());  // in place, one rank
    ASSERT_TRUE(comm.Barrier().ok());
    EXPECT_TRUE(comm.AsyncError().ok());
  }
  auto bad_rank = GlooCommunicator::Create(Options(2, 2, (*server)->address()));
  EXPECT_EQ(bad_rank.status().code(), absl::StatusCode::kInvalidArgument) << bad_rank.status();
  auto bad_store = GlooCommunicator::Create(Options(0, 1, "localhost"));
  EXPECT_EQ(bad_store.status().code(), absl::StatusCode::kInvalidArgument) << bad_store.status();
  GlooOptions bad_host = Options(0, 1, (*server)->address());
  bad_host.host = "no-such-host.invalid";
  EXPECT_EQ(GlooCommunicator::Create(bad_host).status().code(), absl::StatusCode::kInvalidArgument);
  GlooOptions by_interface = Options(0, 1, (*server)->address());
  by_interface.interface = "no-such-if0";
  const auto no_interface = GlooCommunicator::Create(by_interface);
  EXPECT_EQ(no_interface.status().code(), absl::StatusCode::kInvalidArgument) << no_interface.status();
  EXPECT_NE(no_interface.status().message().find("interface 'no-such-if0'"), std::string::npos)
      << no_interface.status();
  by_interface.interface = "lo";  // loopback, by name
  by_interface.prefix = "by-interface";
  const auto loopback = GlooCommunicator::Create(by_interface);
  ASSERT_TRUE(loopback.ok()) << loopback.status();
  EXPECT_NE((*loopback)->Describe().find("via lo"), std::string::npos) << (*loopback)->Describe();
  // A group whose other rank never comes: the rendezvous ends at the timeout.
  auto alone = GlooCommunicator::Create(Options(0, 2, (*server)->address(), absl::Milliseconds(300)));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded) << alone.status();
  EXPECT_NE(alone.status().message().find("key 'test/1' was not set within 300ms"), std::string::npos)
      << alone.status();
  (*server)->Stop();
}

}  // namespace
}  // namespace moe::comm
