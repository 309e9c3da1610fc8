// Measurements on the expert pool's own threads, for benchmarks: the host read bandwidth they
// reach, and how fast the kernels alone stream the arena's weights against it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe/experts/expert_pool.h"
#include "moe/experts/kernels.h"
#include "packed_experts.h"
#include "worker_crew.h"

namespace moe::experts::internal {

// ExpertPool::MeasureReadBandwidth on `threads` threads of `workers` (crew parked): GB/s, 0 if
// the buffer cannot be had.
double MeasureReadBandwidth(WorkerThreads& workers, int threads, size_t bytes, int repeats);

// ExpertPool::MeasureKernelStream with kernel `kind` over every expert of `experts` (crew
// parked), `tokens` >= 1. Zeros if the kernel cannot run on these threads.
ExpertPool::KernelStream MeasureKernelStream(WorkerThreads& workers, int threads, const ExpertShape& shape,
                                             const PackedExperts& experts, ExpertFormat format, KernelKind kind,
                                             int64_t tokens, int repeats);

}  // namespace moe::experts::internal
