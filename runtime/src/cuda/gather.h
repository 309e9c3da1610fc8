// Small kernels of the CUDA backend's own: row gathers of any element type, and the non-finite
// check of logits. Launchers only enqueue on `stream`, as in ops.h.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace moe::runtime::cuda {

// dst[i] = src[rows[i]] for i < n, rows of `row_bytes` bytes.
void GatherRowsBytes(const void* src, int64_t row_bytes, const int32_t* rows, int n, void* dst, cudaStream_t stream);

// dst[i] = bf16(src[i]) for i < n (round to nearest even).
void F32ToBf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream);

// dst [rows x cols] = src [rows x src_cols] columns [0, cols) (+ bias [cols] when not null), as
// fp32 or bf16: the output of a Linear whose weight rows were padded to a multiple of 8.
void NarrowColumns(const float* src, int rows, int src_cols, int cols, const float* bias, void* dst, bool dst_f32,
                   cudaStream_t stream);

// Keeps the stream busy for about `ns` nanoseconds (one thread spinning on the global timer), so
// that the operations queued behind it start back to back: the op timing of eager steps.
void HoldStream(int64_t ns, cudaStream_t stream);

// Hybrid execution: a MoE layer's inputs for the host, in one kernel: x bf16 [rows x hidden] to
// host_x fp32, ids int32 and weights fp32 [rows x top_k] to host_ids and host_weights. The host_*
// pointers are pinned, mapped host memory (written over PCIe).
void PackHostExpertInputs(const uint16_t* x, int rows, int hidden, const int32_t* ids, const float* weights, int top_k,
                          float* host_x, int32_t* host_ids, float* host_weights, cudaStream_t stream);

// Hybrid execution's hand-off through mapped pinned memory, for a host thread that polls it: the
// GPU posts a request (the next sequence number of `counter`, a device word, with the layer and
// row count), and later waits until the host has answered that number in `done`. Each word on its
// own cache line.
struct HostMailbox {
  alignas(64) uint32_t request;
  int32_t layer;
  int64_t rows;
  alignas(64) uint32_t done;
};
void PostHostRequest(uint32_t* counter, HostMailbox* mailbox, int layer, int64_t rows, cudaStream_t stream);
void WaitHostDone(const uint32_t* counter, const HostMailbox* mailbox, cudaStream_t stream);

// first[r] = index of the first NaN or infinity in row r of x [rows x cols], or -1.
void FirstNonFinite(const float* x, int rows, int64_t cols, int32_t* first, cudaStream_t stream);

}  // namespace moe::runtime::cuda
