#include "moe/comm/topology.h"

#include "gtest/gtest.h"

namespace moe::comm {
namespace {

TEST(TopologyTest, ProbesWhatThisMachineHasWithoutError) {
  auto topology = ProbeTopology();
  ASSERT_TRUE(topology.ok()) << topology.status();
  // No GPU (CI): empty. One GPU: one entry, no pair. More: every pair once.
  const size_t n = topology->gpus.size();
  EXPECT_EQ(topology->pairs.size(), n * (n - (n > 0)) / 2);
  if (n == 0) {
    EXPECT_EQ(topology->ToString(), "no GPU visible");
  }
  for (const GpuPair& p : topology->pairs) EXPECT_LT(p.a, p.b);
}

TEST(TopologyTest, AGpuThatIsNotVisibleIsAnError) {
  auto topology = ProbeTopology({4096});
  EXPECT_EQ(topology.status().code(), absl::StatusCode::kInvalidArgument) << topology.status();
  EXPECT_NE(topology.status().message().find("GPU 4096 is not visible"), std::string::npos) << topology.status();
}

TEST(TopologyTest, APairWithoutPeerAccessIsWarnedAbout) {
  Topology t;
  t.gpus = {{0, "NVIDIA H200", "0000:19:00.0"}, {1, "NVIDIA H200", "0000:3b:00.0"}, {2, "NVIDIA H200", "0000:4c:00.0"}};
  t.pairs = {{0, 1, true, true, 0, GpuLink::kNvLink},
             {0, 2, false, false, -1, GpuLink::kNone},
             {1, 2, true, false, 1, GpuLink::kPcie}};
  const std::vector<std::string> warnings = t.Warnings();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("GPU 0 and GPU 2 have no peer-to-peer access"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("shared memory or sockets"), std::string::npos) << warnings[0];
  const std::string text = t.ToString();
  EXPECT_NE(text.find("GPU 0: NVIDIA H200 (0000:19:00.0)"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU 0 <-> GPU 1: NVLink (peer access, native atomics"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU 0 <-> GPU 2: no peer access"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU 1 <-> GPU 2: PCIe"), std::string::npos) << text;
}

}  // namespace
}  // namespace moe::comm
