// The form each weight takes on a backend, and what it costs there: one place instead of "a GPU
// keeps matrices in bf16 and vectors in fp32" written into the memory plan, placement and the
// --device auto fit check. A backend is made with a WeightPolicy (the CPU backend's packed Linears
// by role: --weight-format today, attention int8 and shared experts int4 tomorrow) and answers
// SupportsWeight / WeightBytes from it (backend.h); planning before any backend exists asks the
// functions here for a device kind.
//
// Plain values and functions: thread-compatible.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "moe/core/tensor.h"
#include "moe/experts/packed.h"
#include "moe/runtime/checkpoint.h"

namespace moe::runtime {

// How a weight is used, which decides the form the backend keeps it in.
enum class WeightUse {
  kMatrix,     // a Linear's [out x in] weight (bf16 on the GPU; as stored, or packed, on the CPU)
  kRouter,     // a router's weight: a Linear's, never packed below bf16 (that would flip experts)
  kEmbedding,  // [vocab x hidden], rows gathered by token id
  kVector,     // norms, biases, gates' vectors: fp32
};
// The use a tensor of `role` and `rank` is loaded for (what the loader asks for it).
WeightUse UseOf(TensorRole role, int rank);

struct WeightPolicy {
  // A Linear's matrix on a backend that packs (the CPU backend): by the role of the tensor, or
  // `matrices` for a role not listed. kBF16 keeps the checkpoint's bf16/f32 as stored (fp32
  // math: the reference); int8 (per output channel) or int4 (per `group` columns) are the expert
  // pool's formats, run by its kernels. Routers, embeddings and vectors are never packed.
  experts::ExpertFormat matrices = experts::ExpertFormat::kBF16;
  std::map<TensorRole, experts::ExpertFormat> by_role;
  int group = 32;

  // Every Linear in `format` (--weight-format).
  static WeightPolicy Uniform(experts::ExpertFormat format, int group = 32);
  experts::ExpertFormat MatrixFormat(TensorRole role) const;
  // Whether some Linear is packed.
  bool packs() const;
  // "bf16", "int8", "int8 (attention: int4)".
  std::string Describe() const;
};

// Where a backend keeps its weights: in host memory (the CPU backend) or on a GPU.
enum class WeightHome { kHost, kGpu };

// Whether a backend keeping weights at `home` reads a weight stored as `stored` for `use`: the
// loader converts on the host what it does not. Every backend reads bf16, f16 and f32; the CPU
// backend also keeps a Linear's GGUF blocks, and its fp8 codes with their block scales, as stored
// (PrepareStoredWeight).
bool SupportsStoredWeight(WeightHome home, const WeightFormat& stored, WeightUse use);
// The expert pool's fp8 group (128, 64 or 32) for fp8 weights stored with `stored`'s scale
// blocks: the largest that lies inside one block's columns; 0 when none does or `stored` is not fp8.
int Fp8Group(const WeightFormat& stored);

// Bytes a weight of `shape`, stored as `stored`, is read from on a backend at `home` with `policy`
// (what DeviceWeight::bytes() reports once it is prepared): on a GPU matrices, routers and
// embeddings in bf16 and vectors in fp32 (Linears' rows padded as the CUDA backend pads them are not
// counted: under 0.1% of a real model); on the CPU vectors in fp32, bf16 and f32 matrices as stored
// (read where they lie in the mapped checkpoint), GGUF Linears as stored (their blocks), f16 ones
// and other GGUF weights as fp32 copies, packed ones at their packed size.
int64_t DeviceWeightBytes(WeightHome home, const WeightPolicy& policy, const core::Shape& shape,
                          const WeightFormat& stored, WeightUse use, TensorRole role);

}  // namespace moe::runtime
