#include "cuda/linear.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cuda/cuda_status.h"
#include "cuda/linear_kernels.h"
#include "moe/core/status.h"

namespace moe::runtime::cuda {
namespace {

// cuBLASLt errors become a Status with the call, file and line, like CudaStatus. An execution
// failure carries the CUDA error behind it, which is read (and so cleared) here.
absl::Status CublasStatus(cublasStatus_t status, const char* call, const char* file, int line) {
  std::string message = absl::StrCat(call, " failed at ", file, ":", line, ": ", cublasLtGetStatusName(status), ": ",
                                     cublasLtGetStatusString(status));
  if (status == CUBLAS_STATUS_EXECUTION_FAILED) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) absl::StrAppend(&message, " (", cudaGetErrorName(err), ": ", cudaGetErrorString(err), ")");
  }
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  if (status == CUBLAS_STATUS_NOT_INITIALIZED) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

#define MOE_CUBLAS_RETURN_IF_ERROR(call)                                  \
  do {                                                                    \
    cublasStatus_t moe_cublas_status_ = (call);                           \
    if (moe_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                    \
      return CublasStatus(moe_cublas_status_, #call, __FILE__, __LINE__); \
    }                                                                     \
  } while (0)

struct HandleDestroy {
  void operator()(cublasLtHandle_t h) const noexcept { (void)cublasLtDestroy(h); }
};
struct DescDestroy {
  void operator()(cublasLtMatmulDesc_t d) const noexcept { (void)cublasLtMatmulDescDestroy(d); }
};
struct LayoutDestroy {
  void operator()(cublasLtMatrixLayout_t l) const noexcept { (void)cublasLtMatrixLayoutDestroy(l); }
};
struct PreferenceDestroy {
  void operator()(cublasLtMatmulPreference_t p) const noexcept { (void)cublasLtMatmulPreferenceDestroy(p); }
};
using Handle = std::unique_ptr<cublasLtContext, HandleDestroy>;
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDestroy>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDestroy>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDestroy>;

// The alignment of a pointer in bytes, capped at 256 (cuBLASLt's default assumption); 0 for null.
uint32_t Alignment(const void* p) {
  if (p == nullptr) return 0;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return static_cast<uint32_t>(std::min<uintptr_t>(a & (~a + 1), 256));
}

std::string Address(const void* p) { return absl::StrFormat("%p", p); }

// A call shape. The heuristic's algorithm may rely on the operands' alignment, so the
// alignments are part of the shape: a pointer less aligned than at planning time gets its own
// plan instead of an algorithm that might read past what it may.
struct PlanKey {
  int m, n, k;
  bool out_f32, has_bias;
  uint32_t align_x, align_w, align_out, align_bias;

  bool operator==(const PlanKey& o) const {
    return m == o.m && n == o.n && k == o.k && out_f32 == o.out_f32 && has_bias == o.has_bias && align_x == o.align_x &&
           align_w == o.align_w && align_out == o.align_out && align_bias == o.align_bias;
  }
  template <typename H>
  friend H AbslHashValue(H h, const PlanKey& key) {
    return H::combine(std::move(h), key.m, key.n, key.k, key.out_f32, key.has_bias, key.align_x, key.align_w,
                      key.align_out, key.align_bias);
  }
};

enum class PlanKind { kGemv, kCublasLt };

struct Plan {
  PlanKind kind = PlanKind::kGemv;
  bool bias_in_epilogue = false;  // cuBLASLt adds the fp32 bias before the output conversion
  bool bias_kernel = false;       // AddBiasBf16 runs after the matmul
  MatmulDesc desc;
  Layout a, b, d;
  cublasLtMatmulAlgo_t algo{};
};

}  // namespace

struct Linear::Impl {
  Options options;
  Handle handle;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  int sm_count = 1;
  absl::flat_hash_map<PlanKey, std::unique_ptr<Plan>> plans;

  absl::StatusOr<std::unique_ptr<Plan>> MakePlan(const PlanKey& key, const float* bias) const;
  // Fills plan->desc, a, b, d for the shape, with the fp32 bias epilogue when `bias` is given.
  absl::Status Describe(const PlanKey& key, const float* bias, Plan* plan) const;
  // The heuristic's first algorithm; kNotFound when it has none for this description.
  absl::Status PickAlgorithm(const PlanKey& key, Plan* plan) const;
};

absl::Status Linear::Impl::Describe(const PlanKey& key, const float* bias, Plan* plan) const {
  cublasLtMatmulDesc_t desc = nullptr;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  plan->desc.reset(desc);
  // cuBLASLt is column-major: row-major out [M x N] is column-major out^T [N x M] = op(A) . op(B)
  // with A = w (row-major [N x K] is column-major [K x N], so TRANSA = T makes it [N x K]) and
  // B = x (row-major [M x K] is column-major [K x M], used as is).
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = CUDA_R_32F;
    MOE_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    MOE_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    // The heuristic reads the pointer's value for its alignment; Run sets each call's pointer.
    MOE_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  cublasLtMatrixLayout_t layout = nullptr;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, key.k, key.n, key.k));
  plan->a.reset(layout);
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, key.k, key.m, key.k));
  plan->b.reset(layout);
  MOE_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&layout, key.out_f32 ? CUDA_R_32F : CUDA_R_16BF, key.n, key.m, key.n));
  plan->d.reset(layout);
  return absl::OkStatus();
}

absl::Status Linear::Impl::PickAlgorithm(const PlanKey& key, Plan* plan) const {
  cublasLtMatmulPreference_t raw = nullptr;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&raw));
  Preference preference(raw);
  const uint64_t max_workspace = static_cast<uint64_t>(workspace_bytes);
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                  &max_workspace, sizeof(max_workspace)));
  // A is w, B is x, C and D are out.
  const uint32_t alignments[4] = {key.align_w, key.align_x, key.align_out, key.align_out};
  const cublasLtMatmulPreferenceAttributes_t attributes[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    MOE_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulPreferenceSetAttribute(raw, attributes[i], &alignments[i], sizeof(alignments[i])));
  }
  constexpr int kRequested = 8;
  cublasLtMatmulHeuristicResult_t results[kRequested] = {};
  int returned = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle.get(), plan->desc.get(), plan->a.get(), plan->b.get(), plan->d.get(),
                                     plan->d.get(), raw, kRequested, results, &returned);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    returned = 0;
  } else if (status != CUBLAS_STATUS_SUCCESS) {
    return CublasStatus(status, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  }
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= max_workspace) {
      plan->algo = results[i].algo;
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(absl::StrCat("cublasLtMatmulAlgoGetHeuristic has no algorithm for m=", key.m, " n=", key.n,
                                          " k=", key.k, key.out_f32 ? " fp32" : " bf16", " out",
                                          key.has_bias ? " with bias" : "", " in ", workspace_bytes,
                                          " bytes of workspace"));
}

absl::StatusOr<std::unique_ptr<Plan>> Linear::Impl::MakePlan(const PlanKey& key, const float* bias) const {
  auto plan = std::make_unique<Plan>();
  if (options.gemv_for_small_m && key.m <= kMaxGemvRows) {
    plan->kind = PlanKind::kGemv;
    return plan;
  }
  plan->kind = PlanKind::kCublasLt;
  // An fp32 bias is cuBLASLt's own type for an fp32 output. For a bf16 output it is outside
  // what the documentation promises (the bias type follows the output's), so it is asked for
  // and, where refused, the bias goes to a kernel after the matmul.
  const bool try_epilogue = bias != nullptr && (key.out_f32 || options.f32_bias_in_bf16_epilogue);
  if (try_epilogue) {
    absl::Status described = Describe(key, bias, plan.get());
    absl::Status picked = described.ok() ? PickAlgorithm(key, plan.get()) : described;
    if (picked.ok()) {
      plan->bias_in_epilogue = true;
      return plan;
    }
    if (key.out_f32) return picked;
  }
  MOE_RETURN_IF_ERROR(Describe(key, nullptr, plan.get()));
  MOE_RETURN_IF_ERROR(PickAlgorithm(key, plan.get()));
  plan->bias_kernel = bias != nullptr;
  return plan;
}

absl::Status Linear::Create(void* workspace, int64_t workspace_bytes, Linear** out) {
  return Create(workspace, workspace_bytes, Options(), out);
}

absl::Status Linear::Create(void* workspace, int64_t workspace_bytes, const Options& options, Linear** out) {
  *out = nullptr;
  if (workspace_bytes < 0 || (workspace == nullptr && workspace_bytes > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("Linear::Create: workspace of ", workspace_bytes, " bytes at ",
                                                   Address(workspace), " is not usable"));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->workspace = workspace;
  impl->workspace_bytes = workspace_bytes;
  int device = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, device));
  cublasLtHandle_t handle = nullptr;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle));
  impl->handle.reset(handle);
  std::unique_ptr<Linear> linear(new Linear());
  linear->impl_ = std::move(impl);
  *out = linear.release();
  return absl::OkStatus();
}

Linear::~Linear() = default;

absl::Status Linear::Run(const uint16_t* x, int m, const uint16_t* w, int n, int k, const float* bias, void* out,
                         bool out_f32, cudaStream_t stream) {
  if (m <= 0 || n <= 0 || k <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Linear::Run: shape m=", m, " n=", n, " k=", k, " must be positive"));
  }
  if (n % 8 != 0 || k % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Linear::Run: n=", n, " and k=", k,
                                                   " must be multiples of 8 (cuBLASLt needs 16-byte aligned rows)"));
  }
  const PlanKey key{m, n, k, out_f32, bias != nullptr, Alignment(x), Alignment(w), Alignment(out), Alignment(bias)};
  if (key.align_x < 16 || key.align_w < 16 || key.align_out < 16 || (bias != nullptr && key.align_bias < 16)) {
    return absl::InvalidArgumentError(absl::StrCat("Linear::Run: x=", Address(x), " w=", Address(w),
                                                   " out=", Address(out), " bias=", Address(bias),
                                                   " must be non-null and 16-byte aligned"));
  }
  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end()) {
    absl::StatusOr<std::unique_ptr<Plan>> plan = impl_->MakePlan(key, bias);
    if (!plan.ok()) return plan.status();
    it = impl_->plans.emplace(key, *std::move(plan)).first;
  }
  const Plan& plan = *it->second;
  if (plan.kind == PlanKind::kGemv) {
    internal::LaunchGemv(x, m, w, n, k, bias, out, out_f32, impl_->sm_count, stream);
    return absl::OkStatus();
  }
  if (plan.bias_in_epilogue) {
    MOE_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  const float alpha = 1.0f, beta = 0.0f;
  MOE_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(impl_->handle.get(), plan.desc.get(), &alpha, w, plan.a.get(), x,
                                            plan.b.get(), &beta, out, plan.d.get(), out, plan.d.get(), &plan.algo,
                                            impl_->workspace, static_cast<size_t>(impl_->workspace_bytes), stream));
  if (plan.bias_kernel) internal::LaunchAddBiasBf16(static_cast<uint16_t*>(out), m, n, bias, stream);
  return absl::OkStatus();
}

std::string Linear::PlanName(int m, int n, int k, bool has_bias, bool out_f32) const {
  const PlanKey key{m, n, k, out_f32, has_bias, 256, 256, 256, has_bias ? 256u : 0u};
  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end()) return "not planned";
  const Plan& plan = *it->second;
  if (plan.kind == PlanKind::kGemv) return "gemv";
  if (plan.bias_in_epilogue) return "cublaslt+f32 bias epilogue";
  if (plan.bias_kernel) return "cublaslt+bias kernel";
  return "cublaslt";
}

}  // namespace moe::runtime::cuda
