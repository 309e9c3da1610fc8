// What links the GPUs of this host: peer-to-peer access between each pair, and whether the link
// looks like NVLink or PCIe. NCCL is fastest over NVLink; without peer access it moves data
// through host memory (shared memory or sockets), and an all-reduce of a tensor split is then
// several times slower. The launcher prints ToString() and logs Warnings() before it starts the
// workers of a node.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::comm {

struct GpuInfo {
  int index = 0;           // CUDA device index, as CUDA_VISIBLE_DEVICES leaves them
  std::string name;        // "NVIDIA H200"
  std::string pci_bus_id;  // "0000:19:00.0"
};

enum class GpuLink {
  kNone,    // no peer-to-peer access (one way or both)
  kPcie,    // peer access without native atomics over the link: PCIe (or a PCIe switch)
  kNvLink,  // peer access with native atomics over the link: NVLink or NVSwitch
};
const char* GpuLinkName(GpuLink link);

struct GpuPair {
  int a = 0, b = 0;             // GPU indexes, a < b
  bool peer_access = false;     // cudaDeviceCanAccessPeer, both ways
  bool native_atomics = false;  // cudaDevP2PAttrNativeAtomicSupported, both ways
  int performance_rank = -1;    // cudaDevP2PAttrPerformanceRank (lower is faster), -1 without access
  // Inferred from the two above: CUDA does not name the link. NVML would, at the price of a
  // library this build does not need.
  GpuLink link = GpuLink::kNone;
};

struct Topology {
  std::vector<GpuInfo> gpus;
  std::vector<GpuPair> pairs;  // every pair of `gpus`, in order
  // "GPU 0: NVIDIA H200 (0000:19:00.0)" lines, then "GPU 0 <-> GPU 1: NVLink (...)" lines; "no
  // GPU visible" when there is none.
  std::string ToString() const;
  // One line per pair without peer access, saying what NCCL does then and what to check.
  std::vector<std::string> Warnings() const;
};

// Probes the GPUs with these CUDA indexes (empty: every visible GPU). No GPU, no driver, or a
// build without CUDA give an empty Topology, not an error; kInvalidArgument for an index that is
// not visible.
absl::StatusOr<Topology> ProbeTopology(const std::vector<int>& gpus = {});

}  // namespace moe::comm
