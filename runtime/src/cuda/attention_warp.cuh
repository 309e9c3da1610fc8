// Warp-level building blocks of the attention kernels (attention.cu): asynchronous global to
// shared copies, ldmatrix and the bf16 tensor-core MMA, each a thin wrapper over one PTX
// instruction (sm_80 and later). Private to the CUDA backend.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and
// t = lane % 4; each 32-bit register holds two bf16, the lower column (or k) in the low half:
//   A (16 x 16, row-major):  a0 = A[g][2t..2t+1],   a1 = A[g+8][2t..2t+1],
//                            a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9]
//   B (16 x 8, k x n):       b0 = B[2t..2t+1][g],   b1 = B[2t+8..2t+9][g]
//   C, D (16 x 8, fp32):     c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moe::runtime::cuda::internal {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The dynamic shared memory of the running kernel, 16-byte aligned.
template <typename T>
__device__ __forceinline__ T* DynamicSmem() {
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  return reinterpret_cast<T*>(dynamic_smem);
}

// Copies 16 bytes from global to shared memory without passing through registers; when `valid`
// is false nothing is read and the 16 bytes are zero-filled (so a key past the end of a sequence
// holds zeros, never stale values that could be NaN). Cached in L2 only: K and V are streamed.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
}

// As CpAsync16 for 4 bytes (an fp8 cache's per-key scale), cached in L1 and L2.
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SharedAddress(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices from shared memory: lanes 8i..8i+7 give the addresses of matrix i's
// rows (16 bytes each); r[i] receives row g, columns 2t..2t+1 of matrix i.
__device__ __forceinline__ void LdMatrixX4(const __nv_bfloat16* smem_row, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem_row)));
}

// As LdMatrixX4, transposed: r[i] receives rows 2t..2t+1 of column g of matrix i.
__device__ __forceinline__ void LdMatrixX4Trans(const __nv_bfloat16* smem_row, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem_row)));
}

// d += A (16x16 bf16) * B (16x8 bf16), fp32 accumulation, one warp.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace moe::runtime::cuda::internal
