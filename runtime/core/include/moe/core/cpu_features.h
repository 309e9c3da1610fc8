// What the CPU this process runs on can do, read once with CPUID (and the OS's XSAVE state for
// AVX-512 and AMX). Kernels pick their variant from this at run time.
#pragma once

#include <string>

namespace moe::core {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_vnni = false;
  bool avx512_vbmi = false;  // byte permutes across a register pair (vpermi2b)
  bool avx512_bf16 = false;
  bool amx_tile = false;
  bool amx_int8 = false;
  bool amx_bf16 = false;

  // "avx2 fma avx512f ... amx_bf16"
  std::string ToString() const;
};

const CpuFeatures& GetCpuFeatures();

}  // namespace moe::core
