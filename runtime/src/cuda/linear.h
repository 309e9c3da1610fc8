// Linear layers on the GPU: out [M x N] = x [M x K] . w^T (+ bias), bf16 inputs, fp32
// accumulation, through cuBLASLt, with a GEMV kernel of our own for decode-sized M.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

typedef struct CUstream_st* cudaStream_t;

namespace moe::runtime::cuda {

// out [M x N] = x [M x K] . w^T (+ bias): x and w bf16 (uint16_t in memory), w [N x K] row-major
// as checkpoints store it, bias fp32 [N] or null, out [M x N] row-major bf16 or fp32, fp32
// accumulation. Every pointer is device memory owned by the caller and must stay valid until the
// enqueued work has run; out must not overlap x, w or bias.
//
// Run picks, per call shape (M, N, K, output type, bias, operand alignment), a plan once and
// caches it: cuBLASLt's heuristic algorithm for the shape (host work only, no device work), or
// the GEMV kernel for M <= kMaxGemvRows. A call with a shape seen before does no host-side query,
// and no call enqueues anything but its kernels (the matmul, and where cuBLASLt cannot take an
// fp32 bias with a bf16 output, one bias kernel after it), so Run may be captured into a CUDA
// graph; a replay with new data in the same buffers computes the new result.
//
// Thread-safety: none. One Linear per stream: calls share the workspace, so two streams running
// one Linear's work at once would race on it. Launch errors of the kernels are not read here
// (the backend reads cudaGetLastError at Synchronize); cuBLASLt's own errors come back from Run.
class Linear {
 public:
  // Decode-sized batches (M up to this) go to the GEMV kernel when Options::gemv_for_small_m.
  // Measured on an H200: at M = 1 the GEMV matches cuBLASLt (6.4 against 7.0 us for a [4096 x
  // 2048] weight, 35 against 33 us for [32768 x 2048]); at M = 8 cuBLASLt is 1.4 to 1.6 times
  // faster, so from M = 2 on cuBLASLt runs.
  static constexpr int kMaxGemvRows = 1;

  struct Options {
    // M <= kMaxGemvRows runs a bandwidth-bound GEMV kernel instead of cuBLASLt: a GEMM tile
    // wastes most of its work at M = 1, and the GEMV streams the weight once at near-copy speed.
    bool gemv_for_small_m = true;
    // bf16 output with a bias: ask cuBLASLt for an fp32 bias in the epilogue (one rounding, as
    // the CPU reference); where it refuses, or when this is false, add the bias to the bf16
    // output in a small kernel after the matmul (a second rounding).
    bool f32_bias_in_bf16_epilogue = true;
  };

  // `workspace` (device memory of workspace_bytes, owned by the caller, 256-byte aligned as
  // cudaMalloc returns it; 32 MiB is typical) is cuBLASLt's scratch. Creates the cuBLASLt handle
  // on the current device, which must be current for every Run. *out is owned by the caller
  // (delete it). kInvalidArgument for a null workspace of non-zero size; kUnavailable,
  // kResourceExhausted or kInternal when the device or cuBLASLt cannot be set up.
  static absl::Status Create(void* workspace, int64_t workspace_bytes, Linear** out);
  static absl::Status Create(void* workspace, int64_t workspace_bytes, const Options& options, Linear** out);
  ~Linear();
  Linear(const Linear&) = delete;
  Linear& operator=(const Linear&) = delete;

  // Enqueues the product on `stream`. kInvalidArgument when m, n or k is not positive, when n
  // or k is not a multiple of 8 (cuBLASLt needs 16-byte aligned rows), or when x, w, out or bias
  // is null where needed or not 16-byte aligned; kInternal when cuBLASLt fails (the call named).
  absl::Status Run(const uint16_t* x, int m, const uint16_t* w, int n, int k, const float* bias, void* out,
                   bool out_f32, cudaStream_t stream);

  // How a call of this shape runs, for logs and benchmarks: "gemv", "cublaslt",
  // "cublaslt+f32 bias epilogue", "cublaslt+bias kernel", or "not planned" before its first Run
  // (pointers are taken as 256-byte aligned).
  std::string PlanName(int m, int n, int k, bool has_bias, bool out_f32) const;

 private:
  Linear() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::runtime::cuda
