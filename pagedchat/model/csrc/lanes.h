// Eight floats in GCC's (and Clang's) vector extension, shared by the levels' sources (qmm_level.cpp,
// layer_level.cpp): one AVX register on the x86 levels, two SSE or NEON registers elsewhere, the same IEEE
// operations in the same order everywhere. Everything here is internal to the including file (an anonymous
// namespace), so each level keeps its own copy, built with its own flags.
#pragma once

#include <stdint.h>

#if defined(__FMA__)
#include <immintrin.h>
#endif

namespace qmm {
namespace {

constexpr int LANES = 8;
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));

inline f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }

inline f8 load(const float* p) {
  f8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// a * b + c, fused (one rounding) where the level has FMA, as every x86 SIMD level does; the portable level
// multiplies, then adds.
inline f8 fma8(f8 a, f8 b, f8 c) {
#if defined(__FMA__)
  return reinterpret_cast<f8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

}  // namespace
}  // namespace qmm
