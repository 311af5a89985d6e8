// Eight floats in GCC's (and Clang's) vector extension, shared by the levels' sources (qmm_level.cpp,
// layer_level.cpp): one AVX register on the x86 levels, two SSE or NEON registers elsewhere, the same IEEE
// operations in the same order everywhere. Everything here is internal to the including file (an anonymous
// namespace: qmm.h's inline rule), so each level keeps its own copy, built with its own flags.
#pragma once

#include <stdint.h>

#if defined(__FMA__)
#include <immintrin.h>
#endif

// Lanes of two vectors picked by constant indices (8 and up: the second's): GCC's own builtin, which every GCC
// with the vector extension has (__builtin_shufflevector came in GCC 12), and Clang's.
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i8{__VA_ARGS__})
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

// The largest lane, halving the vector three times; for lanes without NaNs (their callers keep NaNs out), where
// the order does not change the result.
inline float top(f8 v) {
  v = v > SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3) ? v : SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5) ? v : SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v > SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6) ? v : SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

}  // namespace
}  // namespace qmm
