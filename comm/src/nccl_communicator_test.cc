// NcclCommunicator on the GPUs of this machine (label gpu; skipped where no GPU is visible). One
// rank on GPU 0 always; two ranks, one thread each, where two GPUs are visible (NCCL puts at most
// one rank on a GPU).
#include "moe/comm/nccl_communicator.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "cuda_status.h"
#include "gtest/gtest.h"
#include "moe/core/dtype.h"

namespace moe::comm {
namespace {

int VisibleGpus() { return internal::VisibleGpuCount(); }

// Device memory, freed at the end of the scope.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess); }
  ~DeviceBuffer() { (void)cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr = nullptr;
};

template <typename T>
void Upload(const std::vector<T>& host, const DeviceBuffer& device) {
  ASSERT_EQ(cudaMemcpy(device.ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}

template <typename T>
std::vector<T> Download(const DeviceBuffer& device, size_t count, cudaStream_t stream) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), device.ptr, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

class NcclOneRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible";
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // multicast stays off unless set
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    auto id = NcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(id->size(), 128u);
    auto comm = NcclCommunicator::Create(*id, 0, 1, 0, stream_, absl::Seconds(60));
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = *std::move(comm);
  }
  void TearDown() override {
    comm_.reset();
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<NcclCommunicator> comm_;
};

TEST_F(NcclOneRankTest, AllReduceOfOneRankLeavesTheValues) {
  EXPECT_EQ(comm_->Describe().rfind("nccl: rank 0 of 1 on GPU 0", 0), 0u) << comm_->Describe();
  std::vector<float> host(2048 * 4);
  for (size_t i = 0; i < host.size(); ++i) host[i] = 0.25f * static_cast<float>(i) - 100.0f;
  DeviceBuffer data(host.size() * sizeof(float));
  Upload(host, data);
  ASSERT_TRUE(comm_->AllReduceSum(data.ptr, static_cast<int64_t>(host.size()), core::DType::kF32).ok());
  EXPECT_EQ(Download<float>(data, host.size(), stream_), host);

  std::vector<uint16_t> bf16(2048);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = core::FloatToBf16(static_cast<float>(i % 64) - 32.0f);
  DeviceBuffer half(bf16.size() * 2);
  Upload(bf16, half);
  ASSERT_TRUE(comm_->AllReduceSum(half.ptr, static_cast<int64_t>(bf16.size()), core::DType::kBF16).ok());
  EXPECT_EQ(Download<uint16_t>(half, bf16.size(), stream_), bf16);
  // fp8 sums are refused before NCCL sees them, and the group goes on.
  EXPECT_EQ(comm_->AllReduceSum(half.ptr, 16, core::DType::kF8E4M3).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(comm_->AllReduceSum(half.ptr, static_cast<int64_t>(bf16.size()), core::DType::kBF16).ok());
  EXPECT_TRUE(comm_->AsyncError().ok());
}

TEST_F(NcclOneRankTest, AllGatherAndBroadcastOfOneRank) {
  std::vector<uint8_t> host(1001);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 7);
  DeviceBuffer send(host.size()), recv(host.size());
  Upload(host, send);
  ASSERT_TRUE(comm_->AllGather(send.ptr, recv.ptr, static_cast<int64_t>(host.size())).ok());
  EXPECT_EQ(Download<uint8_t>(recv, host.size(), stream_), host);
  ASSERT_TRUE(comm_->AllGather(recv.ptr, recv.ptr, static_cast<int64_t>(host.size())).ok());  // in place
  EXPECT_EQ(Download<uint8_t>(recv, host.size(), stream_), host);
  ASSERT_TRUE(comm_->Broadcast(send.ptr, static_cast<int64_t>(host.size()), 0).ok());
  EXPECT_EQ(Download<uint8_t>(send, host.size(), stream_), host);
}

TEST_F(NcclOneRankTest, SendRecvToItselfInOneGroup) {
  std::vector<float> host(2048);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.5f;
  DeviceBuffer send(host.size() * sizeof(float)), recv(host.size() * sizeof(float));
  Upload(host, send);
  ASSERT_EQ(cudaMemset(recv.ptr, 0, host.size() * sizeof(float)), cudaSuccess);
  const absl::Status s = comm_->SendRecv(send.ptr, 0, recv.ptr, 0, static_cast<int64_t>(host.size() * sizeof(float)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Download<float>(recv, host.size(), stream_), host);
  // Alone, a Send to itself would wait for itself: refused.
  EXPECT_EQ(comm_->Send(send.ptr, 4, 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(NcclOneRankTest, BarrierWaitsForTheStream) {
  const absl::Status s = comm_->Barrier();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(cudaStreamQuery(stream_), cudaSuccess);
}

TEST_F(NcclOneRankTest, AbortMakesEveryLaterCallUnavailable) {
  DeviceBuffer data(64);
  comm_->Abort();
  comm_->Abort();  // idempotent
  const absl::Status after = comm_->AllReduceSum(data.ptr, 16, core::DType::kF32);
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  EXPECT_NE(after.message().find("all-reduce"), std::string::npos) << after;
  EXPECT_EQ(comm_->Barrier().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(comm_->SendRecv(data.ptr, 0, static_cast<char*>(data.ptr) + 32, 0, 32).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(comm_->AsyncError().ok());
}

TEST(NcclCommunicatorTest, BadArgumentsAreInvalidArgument) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible";
  EXPECT_EQ(NcclCommunicator::Create("short", 0, 1, 0, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  auto id = NcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(NcclCommunicator::Create(*id, 1, 1, 0, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(*id, 0, 1, VisibleGpus(), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Two ranks in two threads, GPU 0 and GPU 1: an all-reduce sums, and a ring step exchanges.
TEST(NcclCommunicatorTest, TwoRanksOnTwoGpus) {
  if (VisibleGpus() < 2) GTEST_SKIP() << "needs two GPUs";
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  auto id = NcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  constexpr int64_t kCount = 2048 * 2048;
  std::vector<absl::Status> results(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      auto fail = [&](const std::string& what) { results[rank] = absl::InternalError(what); };
      if (cudaSetDevice(rank) != cudaSuccess) return fail("cudaSetDevice");
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return fail("stream");
      {
        auto comm = NcclCommunicator::Create(*id, rank, 2, rank, stream, absl::Seconds(60));
        if (!comm.ok()) return fail(comm.status().ToString());
        std::vector<float> host(kCount);
        for (int64_t i = 0; i < kCount; ++i) host[i] = static_cast<float>((rank + 1) * (i % 1000));
        DeviceBuffer data(kCount * sizeof(float)), other(kCount * sizeof(float));
        Upload(host, data);
        absl::Status s = (*comm)->AllReduceSum(data.ptr, kCount, core::DType::kF32);
        if (s.ok()) s = (*comm)->Barrier();
        if (!s.ok()) return fail(s.ToString());
        const std::vector<float> sum = Download<float>(data, kCount, stream);
        for (int64_t i = 0; i < kCount; ++i) {
          if (sum[i] != static_cast<float>(3 * (i % 1000))) return fail("sum at " + std::to_string(i));
        }
        s = (*comm)->SendRecv(data.ptr, 1 - rank, other.ptr, 1 - rank, 4096);
        if (s.ok()) s = (*comm)->Barrier();
        if (!s.ok()) return fail(s.ToString());
      }
      (void)cudaStreamDestroy(stream);
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int rank = 0; rank < 2; ++rank) EXPECT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank];
}

}  // namespace
}  // namespace moe::comm
