// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a counter-based
// generator. The same (key, counter) gives the same four words on any machine, host or GPU, so
// a token drawn from it depends only on the request's seed, its sequence and its position, not on
// which process samples it or what it sampled before.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOE_HOST_DEVICE inline
#endif

namespace moe::core {

struct Philox4x32 {
  uint32_t v[4];
};

MOE_HOST_DEVICE void PhiloxMulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Ten rounds over counter c with key (k0, k1).
MOE_HOST_DEVICE Philox4x32 Philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    PhiloxMulHiLo(0xD2511F53u, c0, &hi0, &lo0);
    PhiloxMulHiLo(0xCD9E8D57u, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// A uniform draw in the open interval (0, 1) from one 32-bit word: 23 bits and a half, so the
// sum is exact in a float and never rounds up to 1.
MOE_HOST_DEVICE float UniformFromBits(uint32_t bits) {
  return (static_cast<float>(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

// The sampler's draw for vocabulary entry `token` of the row at (seed, sequence, position).
MOE_HOST_DEVICE float SamplingUniform(uint64_t seed, uint32_t sequence, uint32_t position, uint32_t token) {
  const Philox4x32 r = Philox(position, sequence, token, 0u, static_cast<uint32_t>(seed),
                              static_cast<uint32_t>(seed >> 32));
  return UniformFromBits(r.v[0]);
}

}  // namespace moe::core
