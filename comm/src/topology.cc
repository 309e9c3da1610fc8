#include "moe/comm/topology.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#if MOE_COMM_HAS_CUDA
#include <cuda_runtime.h>

#include "cuda_status.h"
#endif

namespace moe::comm {

const char* GpuLinkName(GpuLink link) {
  switch (link) {
    case GpuLink::kNone:
      return "no peer access";
    case GpuLink::kPcie:
      return "PCIe";
    case GpuLink::kNvLink:
      return "NVLink";
  }
  return "?";
}

std::string Topology::ToString() const {
  if (gpus.empty()) return "no GPU visible";
  std::vector<std::string> lines;
  for (const GpuInfo& g : gpus) lines.push_back(absl::StrCat("GPU ", g.index, ": ", g.name, " (", g.pci_bus_id, ")"));
  for (const GpuPair& p : pairs) {
    std::string line = absl::StrCat("GPU ", p.a, " <-> GPU ", p.b, ": ", GpuLinkName(p.link));
    if (p.peer_access) {
      absl::StrAppend(&line, " (peer access, ", p.native_atomics ? "native atomics" : "no native atomics",
                      ", performance rank ", p.performance_rank, ")");
    }
    lines.push_back(std::move(line));
  }
  return absl::StrJoin(lines, "\n");
}

std::vector<std::string> Topology::Warnings() const {
  std::vector<std::string> out;
  for (const GpuPair& p : pairs) {
    if (p.peer_access) continue;
    out.push_back(absl::StrCat(
        "GPU ", p.a, " and GPU ", p.b,
        " have no peer-to-peer access: NCCL moves their data through host memory (shared memory or sockets), so "
        "an all-reduce between them is several times slower; check the PCIe topology (nvidia-smi topo -m) and "
        "the IOMMU/ACS settings, or put the workers of a tensor split on GPUs that share NVLink or a PCIe switch"));
  }
  return out;
}

#if MOE_COMM_HAS_CUDA
namespace {

// A P2P attribute from one GPU to another (0 where CUDA does not answer).
int P2PAttribute(cudaDeviceP2PAttr attr, int from, int to) {
  int value = 0;
  if (cudaDeviceGetP2PAttribute(&value, attr, from, to) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return value;
}

}  // namespace

absl::StatusOr<Topology> ProbeTopology(const std::vector<int>& requested) {
  const int visible = internal::VisibleGpuCount();
  std::vector<int> indexes = requested;
  if (indexes.empty()) {
    for (int i = 0; i < visible; ++i) indexes.push_back(i);
  }
  Topology topology;
  for (int index : indexes) {
    if (index < 0 || index >= visible) {
      return absl::InvalidArgumentError(absl::StrCat("GPU ", index, " is not visible: this process sees ", visible,
                                                     " GPUs (check CUDA_VISIBLE_DEVICES)"));
    }
    cudaDeviceProp prop{};
    MOE_COMM_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, index));
    char bus[32] = "?";
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), index) != cudaSuccess) (void)cudaGetLastError();
    topology.gpus.push_back({index, prop.name, bus});
  }
  for (size_t i = 0; i < indexes.size(); ++i) {
    for (size_t j = i + 1; j < indexes.size(); ++j) {
      GpuPair pair;
      pair.a = indexes[i];
      pair.b = indexes[j];
      int ab = 0, ba = 0;
      MOE_COMM_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&ab, pair.a, pair.b));
      MOE_COMM_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&ba, pair.b, pair.a));
      pair.peer_access = ab != 0 && ba != 0;
      if (pair.peer_access) {
        pair.native_atomics = P2PAttribute(cudaDevP2PAttrNativeAtomicSupported, pair.a, pair.b) != 0 &&
                              P2PAttribute(cudaDevP2PAttrNativeAtomicSupported, pair.b, pair.a) != 0;
        pair.performance_rank = std::max(P2PAttribute(cudaDevP2PAttrPerformanceRank, pair.a, pair.b),
                                         P2PAttribute(cudaDevP2PAttrPerformanceRank, pair.b, pair.a));
        pair.link = pair.native_atomics ? GpuLink::kNvLink : GpuLink::kPcie;
      }
      topology.pairs.push_back(pair);
    }
  }
  return topology;
}

#else

absl::StatusOr<Topology> ProbeTopology(const std::vector<int>& requested) {
  if (!requested.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU ", requested.front(), " is not visible: this build has no CUDA (MOE_ENABLE_CUDA=OFF)"));
  }
  return Topology{};
}

#endif

}  // namespace moe::comm
