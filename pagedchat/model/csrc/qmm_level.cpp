// One instruction-set level of pagedchat's quantized matmul, built once per level with that level's flags
// (QMM_SYMBOL names it: a symbol of qmm.h's QMM_LEVELS), all levels in one library.
//
// The method is llama.cpp's (ggml-cpu quants.c): activations are quantized to int8 per 32 inputs, and each
// weight block meets them in integer dot products, its scale applied once per block. What differs is the
// shape of the loop. Every type's row is first decoded into one form (unsigned codes u, a scale a and an offset
// c per 16 weights: w = a u + c), once per weight row for all activation rows of the call. One dot kernel then
// serves every type, and a batch of chats pays for the unpacking once, not once per chat.
//
// qmm.h's inline rule holds here: nothing with vague linkage (an inline function or template shared with other
// levels); intrinsics are always inlined, and everything else is internal to this file.

#include "lanes.h"
#include "qmm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#ifndef QMM_SYMBOL
#error "build with -DQMM_SYMBOL=<level>"
#endif

namespace qmm {
namespace {

// Whether this level sums the K types with integer sub-block scales against rows quantized per 256
// (int_scales_rows): AVX2 without VNNI, whose widening madd takes the scales for free. The VNNI levels pay a
// multiply per unit and row for them, and their 16-row tiles ran slower so
// (docs/bench.md#the-k-types-at-avx-512-vnni-integer-scales-measured-and-not-kept); the AMX level must keep their
// bits. AVX-512 without VNNI ran slower in the tiles tried
// (docs/bench.md#the-k-types-at-avx2-integer-sub-block-scales).
#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(__AVXVNNI__)
#define QMM_INTEGER_K_SCALES 1
#else
#define QMM_INTEGER_K_SCALES 0
#endif

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// A tile's height, as by_rows passes it.
template <int R>
struct Rows {
  static constexpr int value = R;
};

// f(Rows<m>{}) for 0 < m <= MAX: a row count known at run time as the height a tile's loops are unrolled for.
template <int MAX, class F>
inline void by_rows(int64_t m, const F& f) {
  if constexpr (MAX > 0) {
    if (m == MAX) {
      f(Rows<MAX>{});
    } else {
      by_rows<MAX - 1>(m, f);
    }
  }
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: man * 2^-24
    const float f = float(man) * 5.9604644775390625e-08f;
    __builtin_memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
#endif
}

// ------------------------------------------------------------------------------------------------------------
// Decoding: one weight row -> u [k] (uint8, or int8 for Q8_0), a16 and c16 [k / 16]. The formulas are ggml's
// dequantize_row_* ones, regrouped as a u + c.

struct Decoded {
  uint8_t* u;
  float* a16;  // [k / 16]
  float* c16;  // [k / 16]
};

Decoded layout(uint8_t* scratch, int64_t k) {
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  Decoded d;
  d.u = base;
  d.a16 = reinterpret_cast<float*>(base + k);
  d.c16 = d.a16 + k / 16;
  return d;
}

void set32(const Decoded& d, int64_t j, float a, float c) {
  d.a16[2 * j] = d.a16[2 * j + 1] = a;
  d.c16[2 * j] = d.c16[2 * j + 1] = c;
}

// 16 bytes of nibbles -> 32 codes: the low nibbles are codes 0..15, the high ones 16..31 (ggml's order).
void nibbles(const uint8_t* qs, uint8_t* u) {
  for (int l = 0; l < 16; ++l) {
    u[l] = qs[l] & 0x0F;
    u[l + 16] = qs[l] >> 4;
  }
}

void fifth_bits(uint32_t qh, uint8_t* u) {
  for (int l = 0; l < 32; ++l) u[l] |= uint8_t(((qh >> l) & 1) << 4);
}

// Q4_K and Q5_K's 6-bit sub-block scales and mins (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, float* sc, float* mn) {
  if (j < 4) {
    *sc = float(q[j] & 63);
    *mn = float(q[j + 4] & 63);
  } else {
    *sc = float((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *mn = float((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void decode_k4_scales(const Decoded& d, const uint8_t* b, int64_t first_block) {
  const float dd = f16(b), dmin = f16(b + 2);
  for (int s = 0; s < 8; ++s) {
    float sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    set32(d, first_block + s, dd * sc, -dmin * mn);
  }
}

// Q4_0, Q4_1, Q5_0 and Q5_1's blocks of 32 weights: the scale d (f16), the minimum (f16) where the format has
// one, the fifth bits (u32) in Q5, then 16 bytes of nibbles. Without a stored minimum it is -d times half the
// range (8 in 4 bits, 16 in 5).
template <bool kMin, bool kFifth>
void decode_block32(const uint8_t* row, int64_t nb, const Decoded& d) {
  constexpr int head = 2 + (kMin ? 2 : 0) + (kFifth ? 4 : 0);
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* b = row + (head + 16) * j;
    nibbles(b + head, d.u + 32 * j);
    if (kFifth) fifth_bits(u32(b + head - 4), d.u + 32 * j);
    const float dd = f16(b);
    set32(d, j, dd, kMin ? f16(b + 2) : -(kFifth ? 16 : 8) * dd);
  }
}

void decode(int type, const uint8_t* row, int64_t k, const Decoded& d) {
  const int64_t nb = k / 32;
  switch (type) {
    case Q4_0:
      decode_block32<false, false>(row, nb, d);
      break;
    case Q4_1:
      decode_block32<true, false>(row, nb, d);
      break;
    case Q5_0:
      decode_block32<false, true>(row, nb, d);
      break;
    case Q5_1:
      decode_block32<true, true>(row, nb, d);
      break;
    case Q8_0:
      for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* b = row + 34 * j;
        for (int l = 0; l < 32; ++l) d.u[32 * j + l] = b[2 + l];
        set32(d, j, f16(b), 0.f);
      }
      break;
    case Q4_K:
      for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t* b = row + 144 * s;
        decode_k4_scales(d, b, 8 * s);
        for (int c = 0; c < 4; ++c) {
          const uint8_t* qs = b + 16 + 32 * c;
          uint8_t* u = d.u + 256 * s + 64 * c;
          for (int l = 0; l < 32; ++l) {
            u[l] = qs[l] & 0x0F;
            u[l + 32] = qs[l] >> 4;
          }
        }
      }
      break;
    case Q5_K:
      for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t* b = row + 176 * s;
        decode_k4_scales(d, b, 8 * s);
        const uint8_t* qh = b + 16;
        for (int c = 0; c < 4; ++c) {
          const uint8_t* ql = b + 48 + 32 * c;
          uint8_t* u = d.u + 256 * s + 64 * c;
          for (int l = 0; l < 32; ++l) {
            u[l] = uint8_t((ql[l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4));
            u[l + 32] = uint8_t((ql[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
          }
        }
      }
      break;
    case Q6_K:
      for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t* b = row + 210 * s;
        const float dd = f16(b + 208);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = b + 64 * h;
          const uint8_t* qh = b + 128 + 32 * h;
          const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h);
          uint8_t* u = d.u + 256 * s + 128 * h;
          for (int l = 0; l < 32; ++l) {
            u[l] = uint8_t((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
            u[l + 32] = uint8_t((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
            u[l + 64] = uint8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            u[l + 96] = uint8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
          }
          for (int g = 0; g < 8; ++g) {
            const float a = dd * float(sc[g]);
            d.a16[16 * s + 8 * h + g] = a;
            d.c16[16 * s + 8 * h + g] = -32 * a;
          }
        }
      }
      break;
  }
}

// ------------------------------------------------------------------------------------------------------------
// Activations: per 32 inputs, d = max |x| / 127 and q = round(x / d), rounded half away from zero as ggml does.

// In lanes.h's eight-lane vectors, the level's own: as scalar loops this was a visible part of a batched step
// (docs/bench.md#activation-quantization-in-vectors). Each lane does the scalar formula's operations in its
// order (no contraction: -ffp-contract=off), so the codes and scales are the same bits on every level; the
// largest magnitude and the codes' sums are exact whatever order they are reduced in.
typedef int8_t b8 __attribute__((vector_size(8)));
typedef int8_t b32 __attribute__((vector_size(32)));

inline int total(i8 v) {
  v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
}

// Four vectors of codes in [-127, 127] as 32 bytes in order. AVX2 narrows them with two rounds of packs (which
// interleave 128-bit halves, put back by one permute); a lane-by-lane conversion compiles to a byte at a time
// there.
inline b32 narrow(const i8 c[4]) {
#if defined(__AVX2__)
  const auto m = [](i8 v) { return reinterpret_cast<__m256i>(v); };
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(m(c[0]), m(c[1])), _mm256_packs_epi32(m(c[2]), m(c[3])));
  return reinterpret_cast<b32>(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  b32 out;
  for (int l = 0; l < 4; ++l) {
    const b8 bytes = __builtin_convertvector(c[l], b8);
    __builtin_memcpy(reinterpret_cast<int8_t*>(&out) + 8 * l, &bytes, sizeof bytes);
  }
  return out;
#endif
}

// The largest magnitude of n inputs (a multiple of 32).
__attribute__((always_inline)) inline float largest(const float* x, int64_t n) {
  f8 most = f8{};
  for (int64_t l = 0; l < n; l += 8) {
    const f8 a = reinterpret_cast<f8>(reinterpret_cast<u8>(load(x + l)) & 0x7FFFFFFFu);
    most = a > most ? a : most;
  }
  return top(most);
}

// One block of 32 inputs coded at the scale d = amax / 127 (id its inverse, 0 where d is): the codes into qb,
// their sums per 16 into sums.
__attribute__((always_inline)) inline void code_block(const float* xb, float id, int8_t* qb, int sums[2]) {
  i8 c[4];
  for (int l = 0; l < 4; ++l) {
    const f8 scaled = load(xb + 8 * l) * id;
    c[l] = __builtin_convertvector(scaled + (scaled < 0 ? f8{} - 0.5f : f8{} + 0.5f), i8);
  }
  const b32 bytes = narrow(c);
  __builtin_memcpy(qb, &bytes, sizeof bytes);
  sums[0] = total(c[0] + c[1]);
  sums[1] = total(c[2] + c[3]);
}

// Row i's inputs [32 j0, 32 j1), one group, coded at one scale d: the codes, d per block and its sums, and the
// codes' sums of each block's halves (halves[j - j0]).
__attribute__((always_inline)) inline void code_group(const float* x, int64_t i, int64_t j0, int64_t j1, int64_t m,
                                                      int64_t k, int8_t* q, float* d32, float* s16, float* s32,
                                                      int (*halves)[2]) {
  const float d = largest(x + i * k + 32 * j0, 32 * (j1 - j0)) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  for (int64_t j = j0; j < j1; ++j) {
    int* sums = halves[j - j0];
    code_block(x + i * k + 32 * j, id, q + CODES_STRIDE * (j * m + i), sums);
    d32[j * m + i] = d;
    s16[(2 * j) * m + i] = d * float(sums[0]);
    s16[(2 * j + 1) * m + i] = d * float(sums[1]);
    s32[j * m + i] = d * float(sums[0] + sums[1]);
  }
}

// Two codes' sums (each at most 32 codes') as the int16 pair a madd reads, the first in the low half.
inline int32_t int16_pair(int low, int high) {
  return int32_t(uint32_t(uint16_t(low)) | (uint32_t(uint16_t(high)) << 16));
}

void quantize(const float* x, int64_t i0, int64_t i1, int64_t m, int64_t k, int64_t group, int8_t* q, float* d32,
              float* s16, float* s32, float* d256, int32_t* sums2, int32_t* sums16, int32_t* o16) {
  // Sixteen rows block by block: the sums are stored by column, so rows side by side fill a line between them,
  // where one row at a time stored each sum into a line of its own.
  constexpr int64_t ROWS = 16;
  const int64_t blocks = group / 32;
  for (int64_t r0 = i0; r0 < i1; r0 += ROWS) {
    const int64_t r1 = r0 + ROWS < i1 ? r0 + ROWS : i1;
    for (int64_t j = 0; j < k / 32; j += blocks) {
      for (int64_t i = r0; i < r1; ++i) {
        int halves[8][2];
        code_group(x, i, j, j + blocks, m, k, q, d32, s16, s32, halves);
        for (int64_t t = 0; t < blocks; ++t)
          for (int h = 0; h < 2; ++h) o16[(2 * (j + t) + h) * m + i] = -32 * halves[t][h];
        if (group != 256) continue;
        d256[j / 8 * m + i] = d32[j * m + i];
        for (int p = 0; p < 4; ++p) {
          const int* a = halves[2 * p];
          const int* b = halves[2 * p + 1];
          sums2[(j / 2 + p) * m + i] = int16_pair(a[0] + a[1], b[0] + b[1]);
        }
        for (int t = 0; t < 8; ++t) sums16[(j + t) * m + i] = int16_pair(halves[t][0], halves[t][1]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// The dot kernel: for R activation rows, sum over blocks of (a (u . q)) d, lane by lane, plus the offsets.

#if defined(__AVX2__)

// The SIMD levels decode each block in registers and use it at once against up to ROWS activation rows: the
// codes never leave the registers, and a batch of chats pays for the unpacking once per ROWS rows.

inline __m256i dot256(__m256i u, __m256i q) {  // 8 int32 lanes, each the sum of 4 u8 x s8 products
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
#else
  // u <= 128 (Q8_0's codes made positive) and |q| <= 127: the pairs' sums fit in int16 without saturating.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block of 32 weights in registers: w = a u + c, a and c for each 16 (lanes 0-3 and 4-7 of a).
struct Block {
  __m256i u;
  __m256 a;
  float c0, c1;
};

inline __m256i nibbles256(const uint8_t* qs) {  // 16 bytes -> 32 codes in ggml's order
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

inline __m256i fifth_bits256(const uint8_t* qh) {  // bit l of 32 -> 0x10 in byte l (llama.cpp's bytes_from_bits_32)
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(u32(qh))), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

inline __m256i byte_shift_right(__m256i v, int n) {  // per byte, for n < 8, the caller masking the result
  return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n));
}

inline Block one_scale(__m256i u, float a, float c) { return {u, _mm256_set1_ps(a), c, c}; }

// Two adjacent f16 values (a block's d and m, or d and dmin) in one conversion.
inline void f16_pair(const uint8_t* p, float* first, float* second) {
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(int(u32(p))));
  *first = _mm_cvtss_f32(v);
  *second = _mm_cvtss_f32(_mm_movehdup_ps(v));
}

template <int T>
inline Block block(const uint8_t* row, int64_t j) {
  if constexpr (T == Q4_0) {
    const uint8_t* b = row + 18 * j;
    const float d = f16(b);
    return one_scale(nibbles256(b + 2), d, -8 * d);
  } else if constexpr (T == Q4_1) {
    const uint8_t* b = row + 20 * j;
    float d, m;
    f16_pair(b, &d, &m);
    return one_scale(nibbles256(b + 4), d, m);
  } else if constexpr (T == Q5_0) {
    const uint8_t* b = row + 22 * j;
    const float d = f16(b);
    return one_scale(_mm256_or_si256(nibbles256(b + 6), fifth_bits256(b + 2)), d, -16 * d);
  } else if constexpr (T == Q5_1) {
    const uint8_t* b = row + 24 * j;
    float d, m;
    f16_pair(b, &d, &m);
    return one_scale(_mm256_or_si256(nibbles256(b + 8), fifth_bits256(b + 4)), d, m);
  } else if constexpr (T == Q8_0) {
    const uint8_t* b = row + 34 * j;
    return one_scale(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), f16(b), 0.f);
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const int sub = int(j % 8);  // the 32-block within its super-block of 256
    const uint8_t* b = row + (T == Q4_K ? 144 : 176) * (j / 8);
    const uint8_t* qs = b + (T == Q4_K ? 16 : 48) + 32 * (sub / 2);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    __m256i u = _mm256_and_si256(byte_shift_right(raw, 4 * (sub & 1)), _mm256_set1_epi8(0x0F));
    if constexpr (T == Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i bit = _mm256_and_si256(byte_shift_right(qh, sub), _mm256_set1_epi8(1));
      u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
    }
    float sc, mn, d, dmin;
    scale_min_k4(sub, b + 4, &sc, &mn);
    f16_pair(b, &d, &dmin);
    return one_scale(u, d * sc, -dmin * mn);
  } else {  // Q6_K
    const int sub = int(j % 8), half = sub / 4, quarter = sub % 4;
    const uint8_t* b = row + 210 * (j / 8);
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (quarter & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    const __m256i low = _mm256_and_si256(byte_shift_right(ql, 4 * (quarter >> 1)), _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(byte_shift_right(qh, 2 * quarter), _mm256_set1_epi8(3));
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * half + 2 * quarter);
    const float d = f16(b + 208), a0 = d * float(sc[0]), a1 = d * float(sc[1]);
    return {_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set_m128(_mm_set1_ps(a1), _mm_set1_ps(a0)),
            -32 * a0, -32 * a1};
  }
}

// One weight row against R activation rows: each weight block is decoded once for the R rows. The offsets
// (c times the activations' sums) ride along as one vector over the R rows: s16 is stored by column, so one
// load holds a block's sums for every row of the tile.
template <int T>
constexpr bool SIGNED = T == Q8_0;  // maddubs and dpbusd take unsigned codes: the signs move onto q
template <int T>
constexpr bool OFFSET = T != Q8_0;
template <int T>
constexpr bool TWO_OFFSETS = T == Q6_K;  // one per 16; every other type has one per block of 32

template <int T, int R>
inline Block step256(const uint8_t* row, int64_t j, const Activations& x, int64_t i0, __m256* acc) {
  const Block b = block<T>(row, j);
  const __m256i u = SIGNED<T> ? _mm256_sign_epi8(b.u, b.u) : b.u;
  for (int r = 0; r < R; ++r) {
    const int64_t i = i0 + r;
    __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes_at(x, i, j)));
    if (SIGNED<T>) q = _mm256_sign_epi8(q, b.u);
    const __m256 p = _mm256_cvtepi32_ps(dot256(u, q));
    acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(b.a, _mm256_broadcast_ss(scale_at(x, i, j))), acc[r]);
  }
  return b;
}

template <int R>
void store(const float* partial, int64_t i0, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) y[(i0 + r) * ldy] = partial[r];
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)

constexpr int ROWS = 16;  // 16 accumulators and two blocks fit in AVX-512's 32 registers

// The panel's vectors on AVX-512: 16 weight rows, one per 32-bit lane. A pass takes up to TILE activation rows, an
// accumulator each beside a unit's code vectors; TILE_UNITS2 where the codes come from a buffer and a block has
// two scale units (Q6_K): such tiles ran slower at the full height (docs/bench.md).
struct PanelIsa {
  using I = __m512i;
  using F = __m512;
  static constexpr int ROWS = 16, TILE = 16, TILE_UNITS2 = 12;
#if defined(__AVX512VNNI__)
  static constexpr bool DPBUSD = true;
#else
  static constexpr bool DPBUSD = false;
#endif
  static I bcast4(const int8_t* q) { return _mm512_broadcastd_epi32(_mm_loadu_si32(q)); }
#if defined(__AVX512VNNI__)
  static I dpbusd(I sum, I u, I q) { return _mm512_dpbusd_epi32(sum, u, q); }
#endif
  static I maddubs(I u, I q) { return _mm512_maddubs_epi16(u, q); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I widen(I sum, I pairs) { return _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1))); }
  static I abs8(I w) { return _mm512_abs_epi8(w); }
  static I sign8(I q, I w) {  // q, negated where w < 0
    return _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(w), izero(), q);
  }
  static I izero() { return _mm512_setzero_si512(); }
  static I bcast32(const int32_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static F zero() { return _mm512_setzero_ps(); }
  static F bcastf(const float* p) { return _mm512_set1_ps(*p); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storei(uint8_t* p, I v) { _mm512_storeu_si512(p, v); }
  // For packed panels (qmm.h): a chunk of 16 rows' dwords, and 16 rows' f16 scales.
  static I loadu(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high4(I v) { return low4(_mm512_srli_epi16(v, 4)); }
  static I move_to4(I h, int from, char mask) {  // each byte's bits from `from` on moved to bit 4, masked
    const I v = from <= 4 ? _mm512_slli_epi16(h, unsigned(4 - from)) : _mm512_srli_epi16(h, unsigned(from - 4));
    return _mm512_and_si512(v, _mm512_set1_epi8(mask));
  }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  // 32-bit lanes, for the K types' scales.
  static I srl32(I v, int n) { return _mm512_srli_epi32(v, unsigned(n)); }
  static I sll32(I v, int n) { return _mm512_slli_epi32(v, unsigned(n)); }
  static I sra32(I v, int n) { return _mm512_srai_epi32(v, unsigned(n)); }
  static I and32(I v, int mask) { return _mm512_and_si512(v, _mm512_set1_epi32(mask)); }
  static I flip(I w) { return _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))); }
  static F halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F set1(float v) { return _mm512_set1_ps(v); }
};

inline __m512i dot512(__m512i u, __m512i q) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1));
#endif
}

// Two blocks a step: their codes fill 64 bytes, and the activations' codes and scales for them are contiguous.
template <int T, int R>
void tile(const uint8_t* row, const Activations& x, int64_t i0, float* y, int64_t ldy) {
  const int64_t k = x.k, m = x.m, nb = k / 32;
  const __mmask16 rows = __mmask16((1u << R) - 1);
  const float *s16 = x.s16 + i0, *s32 = x.s32 + i0;
  __m512 acc[R], off = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= nb; j += 2) {
    const Block b0 = block<T>(row, j), b1 = block<T>(row, j + 1);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(b0.u), b1.u, 1);
    const __m512 a = _mm512_insertf32x8(_mm512_castps256_ps512(b0.a), b1.a, 1);
    const __m512i u = SIGNED<T> ? _mm512_abs_epi8(w) : w;
    const __mmask64 negative = SIGNED<T> ? _mm512_movepi8_mask(w) : 0;
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      __m512i q = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes_at(x, i, j)))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes_at(x, i, j + 1))), 1);
      if (SIGNED<T>) q = _mm512_mask_sub_epi8(q, negative, _mm512_setzero_si512(), q);
      const __m512 p = _mm512_cvtepi32_ps(dot512(u, q));
      const __m512 d16 =  // the two blocks' scales, each over its 8 lanes
          _mm512_insertf32x8(_mm512_set1_ps(*scale_at(x, i, j)), _mm256_set1_ps(*scale_at(x, i, j + 1)), 1);
      acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(a, d16), acc[r]);
    }
    if (TWO_OFFSETS<T>) {
      const float c[4] = {b0.c0, b0.c1, b1.c0, b1.c1};
      for (int g = 0; g < 4; ++g)
        off = _mm512_fmadd_ps(_mm512_set1_ps(c[g]), _mm512_maskz_loadu_ps(rows, s16 + (2 * j + g) * m), off);
    } else if (OFFSET<T>) {
      off = _mm512_fmadd_ps(_mm512_set1_ps(b0.c0), _mm512_maskz_loadu_ps(rows, s32 + j * m), off);
      off = _mm512_fmadd_ps(_mm512_set1_ps(b1.c0), _mm512_maskz_loadu_ps(rows, s32 + (j + 1) * m), off);
    }
  }
  alignas(64) float partial[16];
  _mm512_store_ps(partial, off);
  for (int r = 0; r < R; ++r) partial[r] += _mm512_reduce_add_ps(acc[r]);
  if (j < nb) {  // an odd block count: the last block at half width
    __m256 tail[R];
    for (int r = 0; r < R; ++r) tail[r] = _mm256_setzero_ps();
    const Block b = step256<T, R>(row, j, x, i0, tail);
    for (int r = 0; r < R; ++r) {
      partial[r] += hsum256(tail[r]);
      if (OFFSET<T>) partial[r] += b.c0 * s16[2 * j * m + r] + b.c1 * s16[(2 * j + 1) * m + r];
    }
  }
  store<R>(partial, i0, y, ldy);
}

#else

constexpr int ROWS = 8;  // 8 accumulators and a block fit in AVX2's 16 registers

// The panel's vectors on AVX2: 8 weight rows, one per 32-bit lane; 8 activation rows a pass (an accumulator
// each, the unit's code vectors read back from the stack by the maddubs).
struct PanelIsa {
  using I = __m256i;
  using F = __m256;
  static constexpr int ROWS = 8, TILE = 8, TILE_UNITS2 = 8;
#if defined(__AVXVNNI__)
  static constexpr bool DPBUSD = true;
#else
  static constexpr bool DPBUSD = false;
#endif
  static I bcast4(const int8_t* q) { return _mm256_broadcastd_epi32(_mm_loadu_si32(q)); }
#if defined(__AVXVNNI__)
  static I dpbusd(I sum, I u, I q) { return _mm256_dpbusd_avx_epi32(sum, u, q); }
#endif
  static I maddubs(I u, I q) { return _mm256_maddubs_epi16(u, q); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen(I sum, I pairs) { return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))); }
  static I widen_by(I sum, I pairs, I scales) { return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, scales)); }
  static I bcast32(const int32_t* p) { return _mm256_set1_epi32(*p); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  // Each 32-bit lane's bytes lo and hi (0 to 3) as an int16 pair, lo's in the low half: unsigned ones moved into
  // their halves' low bytes, the high ones zeroed by the shuffle; signed ones into the high bytes, then shifted
  // down with their signs.
  template <bool SIGNED>
  __attribute__((always_inline)) static I pair_control(int lo, int hi) {
    const auto half = [](uint32_t at) { return SIGNED ? 0x80u | at << 8 : at | 0x80u << 8; };
    const auto pick = [&](int k) { return int(half(4 * k + lo) | half(4 * k + hi) << 16); };
    return _mm256_setr_epi32(pick(0), pick(1), pick(2), pick(3), pick(0), pick(1), pick(2), pick(3));
  }
  static I bytes_pair(I v, int lo, int hi) { return _mm256_shuffle_epi8(v, pair_control<false>(lo, hi)); }
  static I signed_bytes_pair(I v, int lo, int hi) {
    return _mm256_srai_epi16(_mm256_shuffle_epi8(v, pair_control<true>(lo, hi)), 8);
  }
  static I times16(I v, int f) { return _mm256_mullo_epi16(v, _mm256_set1_epi16(short(f))); }
  static I abs8(I w) { return _mm256_sign_epi8(w, w); }
  static I sign8(I q, I w) { return _mm256_sign_epi8(q, w); }  // q, negated where w < 0 (0 where w is)
  static I izero() { return _mm256_setzero_si256(); }
  static F zero() { return _mm256_setzero_ps(); }
  static F bcastf(const float* p) { return _mm256_broadcast_ss(p); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storei(uint8_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  // For packed panels (qmm.h): half a chunk (8 rows' dwords), and 8 rows' f16 scales.
  static I loadu(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high4(I v) { return low4(_mm256_srli_epi16(v, 4)); }
  static I move_to4(I h, int from, char mask) {  // each byte's bits from `from` on moved to bit 4, masked
    const I v = from <= 4 ? _mm256_slli_epi16(h, 4 - from) : _mm256_srli_epi16(h, from - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(mask));
  }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  // 32-bit lanes, for the K types' scales.
  static I srl32(I v, int n) { return _mm256_srli_epi32(v, n); }
  static I sll32(I v, int n) { return _mm256_slli_epi32(v, n); }
  static I sra32(I v, int n) { return _mm256_srai_epi32(v, n); }
  static I and32(I v, int mask) { return _mm256_and_si256(v, _mm256_set1_epi32(mask)); }
  static I flip(I w) { return _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80))); }
  static F halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F set1(float v) { return _mm256_set1_ps(v); }
};

template <int T, int R>
void tile(const uint8_t* row, const Activations& x, int64_t i0, float* y, int64_t ldy) {
  const int64_t m = x.m;
  const float *s16 = x.s16 + i0, *s32 = x.s32 + i0;
  const __m256i rows = _mm256_cmpgt_epi32(_mm256_set1_epi32(R), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 acc[R], off = _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < x.k / 32; ++j) {
    const Block b = step256<T, R>(row, j, x, i0, acc);
    if (TWO_OFFSETS<T>) {
      off = _mm256_fmadd_ps(_mm256_set1_ps(b.c0), _mm256_maskload_ps(s16 + 2 * j * m, rows), off);
      off = _mm256_fmadd_ps(_mm256_set1_ps(b.c1), _mm256_maskload_ps(s16 + (2 * j + 1) * m, rows), off);
    } else if (OFFSET<T>) {
      off = _mm256_fmadd_ps(_mm256_set1_ps(b.c0), _mm256_maskload_ps(s32 + j * m, rows), off);
    }
  }
  alignas(32) float partial[8];
  _mm256_store_ps(partial, off);
  for (int r = 0; r < R; ++r) partial[r] += hsum256(acc[r]);
  store<R>(partial, i0, y, ldy);
}

#endif

// Panels: the weights' codes lie so that each vector holds 4 codes of PanelIsa::ROWS weight rows (qmm.h; the
// layout of llama.cpp's repacked x86 GEMMs). A maddubs (or dpbusd) against 4 broadcast activation codes then
// gives every row's partial dot in its own lane: a block's sum stays in integer adds, and each conversion, scale
// and offset serves a lane per weight row where the per-row tiles spend them on one.

// A growing int16 sum of G maddubs results, held in a register at each step. Left free, GCC sums a unit's
// products as a tree and parks them on the stack, which AVX2's sixteen registers pay for in spills
// (docs/bench.md#many-rows-at-avx2-both-lane-groups-in-a-pass); with AVX-512's thirty-two, and for sums of two,
// the pin was slower. The integers are the same either way.
template <int G>
__attribute__((always_inline)) inline void hold(PanelIsa::I& sum) {
  if constexpr (G > 2 && PanelIsa::ROWS < PANEL_ROWS) __asm__("" : "+x"(sum));
}

// The dot of a unit's N code vectors with its activations (code vector d meets the 4 codes at q + 4d), in int32
// lanes. Without VNNI, G maddubs results are summed in int16 before widening, G the most whose sum cannot
// overflow (each maddubs lane is at most 2 * 127 times the largest code); signed codes move their signs onto
// the activations.
template <int N, int G, bool SIGNED_DOTS>
inline PanelIsa::I unit_dot(const PanelIsa::I* w, const int8_t* q) {
  using V = PanelIsa;
  V::I total = V::izero();
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
  for (int d = 0; d < N; ++d) total = V::dpbusd(total, w[d], V::bcast4(q + 4 * d));
#else
  for (int g = 0; g < N; g += G) {
    V::I pairs = V::izero();
    for (int d = g; d < g + G; ++d) {
      const V::I b = V::bcast4(q + 4 * d);
      const V::I p = SIGNED_DOTS ? V::maddubs(V::abs8(w[d]), V::sign8(b, w[d])) : V::maddubs(w[d], b);
      pairs = d == g ? p : V::add16(pairs, p);
      hold<G>(pairs);
    }
    total = V::widen(total, pairs);
  }
#endif
  return total;
}

// One group of PanelIsa::ROWS rows of a panel: each block's code vectors, a load, a mask and a shift or two
// away, with its scale and offset terms.
template <int T>
struct Packed {
  static constexpr int type = T;
  static constexpr int64_t AHEAD = 8192;
  using V = PanelIsa;
  using B = PanelBlock<T>;
  static constexpr int PER = B::K ? 8 : 1;                 // blocks of 32 per file block
  static constexpr int UNITS = TWO_OFFSETS<T> ? 2 : 1;     // scale units per block of 32
  static constexpr int N = 8 / UNITS;                      // code vectors per unit
  static constexpr int TILE = V::TILE;  // the most activation rows a pass takes
  static constexpr bool CROSS = false;  // Buffered's
  // Without VNNI, Q8_0's codes keep their signs, which move onto the activations (codes made unsigned reach
  // 255, whose maddubs pairs overflow int16); with it they are made unsigned, offset by -128 d.
  static constexpr bool SIGNED_DOTS = T == Q8_0 && !V::DPBUSD;
  // Q6_K's offset (c = -32 a) joins the dot in integers, as -32 times the unit's code sums (Activations::o16): a
  // unit then costs one multiply-add where the offset took another, at a scale per 16 inputs
  // (docs/bench.md#q6_k-offsets-in-integers).
  static constexpr bool INT_OFFSET = T == Q6_K;
  static constexpr bool OFFSET = !SIGNED_DOTS && !INT_OFFSET;
  // maddubs results summed in int16 (unit_dot): codes up to 15, 31, 63, and Q8_0's up to 128 in magnitude.
  static constexpr int G = (T == Q4_0 || T == Q4_1 || T == Q4_K) ? 8 : B::FIFTH || T == Q5_K ? 4 : T == Q6_K ? 2 : 1;
  const uint8_t* panel;
  int lanes;  // this group's byte offset in a chunk of dwords

  const uint8_t* file_block(int64_t j) const { return panel + B::BYTES * (j / PER); }
  // Block j's share of the panel's bytes, AHEAD bytes further on (docs/bench.md#panels-fetched-ahead-one-call-a-layer).
  // A step's weights and pages outgrow the caches, so every call streams its panels from memory, and the hardware's
  // prefetchers, which start over at each 4 KiB page, do not run far enough ahead of the first pass. The lines go
  // to L2, not L1: a fetch into L1 holds one of the core's few L1 miss buffers for its whole trip from memory, and
  // one chat streamed faster on Zen 4 with the lines in L2 (docs/bench.md#panels-fetched-into-l2).
  void fetch_ahead(int64_t j) const {
    const uint8_t* at = panel + B::BYTES * j / PER + AHEAD;
    for (int64_t l = 0; l < (B::BYTES / PER + 63) / 64; ++l) __builtin_prefetch(at + 64 * l, 0, 1);
  }
  V::I chunk(const uint8_t* at, int64_t c) const { return V::loadu(at + 64 * c + lanes); }
  V::F halves(const uint8_t* at) const { return V::halves(at + lanes / 2); }

  // Code vector d (codes 4d..4d+3 of every row) of block j.
  V::I code(int64_t j, int d) const {
    const uint8_t* b = file_block(j);
    const int sub = int(j % PER);
    if constexpr (T == Q8_0) {
      const V::I w = chunk(b, d);
      return SIGNED_DOTS ? w : V::flip(w);
    } else if constexpr (!B::K) {  // chunk d % 4: low nibbles codes 4d.., high ones 16 more
      const V::I c = chunk(b, d % 4);
      const V::I u = d < 4 ? V::low4(c) : V::high4(c);
      return B::FIFTH ? V::or_(u, V::move_to4(chunk(b + B::HIGH_AT, 0), d, 0x10)) : u;
    } else if constexpr (T == Q6_K) {  // low 4 bits from ql, a nibble of its bytes; 2 high bits from qh
      const int half = sub / 4, quarter = sub % 4;
      const V::I c = chunk(b, 16 * half + 8 * (quarter & 1) + d);
      const V::I low = quarter < 2 ? V::low4(c) : V::high4(c);
      return V::or_(low, V::move_to4(chunk(b + B::HIGH_AT, 8 * half + d), 2 * quarter, 0x30));
    } else {  // Q4_K, Q5_K: two blocks of 32 share 32 bytes, the first in the low nibbles
      const V::I c = chunk(b, 8 * (sub / 2) + d);
      const V::I u = sub % 2 ? V::high4(c) : V::low4(c);
      return T == Q5_K ? V::or_(u, V::move_to4(chunk(b + B::HIGH_AT, d), sub, 0x10)) : u;
    }
  }
  // Blocks decoded together (code_step): the blocks of 32 whose code vectors share their loads. Q4_K and Q5_K's
  // pairs share a chunk of nibbles; Q6_K's four blocks of a half share its high bits, and two its nibbles.
  static constexpr int STEP = T == Q6_K ? 4 : T == Q4_K || T == Q5_K ? 2 : 1;
  // Code vector d of blocks j..j + STEP - 1 (j a multiple of STEP) into w[t]: code(j + t, d), the blocks'
  // shared fields loaded once.
  void code_step(int64_t j, int d, V::I* w) const {
    const uint8_t* b = file_block(j);
    const int sub = int(j % PER);
    if constexpr (T == Q6_K) {  // the quarters: nibbles low, low, high, high of two chunks; 2 bits each of qh
      const int half = sub / 4;
      const V::I c0 = chunk(b, 16 * half + d), c1 = chunk(b, 16 * half + 8 + d);
      const V::I qh = chunk(b + B::HIGH_AT, 8 * half + d);
      w[0] = V::or_(V::low4(c0), V::move_to4(qh, 0, 0x30));
      w[1] = V::or_(V::low4(c1), V::move_to4(qh, 2, 0x30));
      w[2] = V::or_(V::high4(c0), V::move_to4(qh, 4, 0x30));
      w[3] = V::or_(V::high4(c1), V::move_to4(qh, 6, 0x30));
    } else if constexpr (STEP == 2) {
      const V::I c = chunk(b, 8 * (sub / 2) + d);
      w[0] = V::low4(c);
      w[1] = V::high4(c);
      if constexpr (T == Q5_K) {
        const V::I h = chunk(b + B::HIGH_AT, d);
        w[0] = V::or_(w[0], V::move_to4(h, sub, 0x10));
        w[1] = V::or_(w[1], V::move_to4(h, sub + 1, 0x10));
      }
    } else {
      w[0] = code(j, d);
    }
  }
  // Q4_K and Q5_K's 6-bit scale and minimum of block j (ggml's get_scale_min_k4, a row per lane).
  void k4_scale_min(int64_t j, V::I* sc, V::I* mn) const {
    const uint8_t* b = file_block(j) + B::SCALES_AT;
    const int sub = int(j % 8);
    const V::I q0 = chunk(b, 0), q1 = chunk(b, 1), q2 = chunk(b, 2);
    if (sub < 4) {
      *sc = V::and32(V::srl32(q0, 8 * sub), 63);
      *mn = V::and32(V::srl32(q1, 8 * sub), 63);
    } else {
      const int at = 8 * (sub - 4);
      *sc = V::or_(V::and32(V::srl32(q2, at), 0xF), V::sll32(V::and32(V::srl32(q0, at + 6), 3), 4));
      *mn = V::or_(V::and32(V::srl32(q2, at + 4), 0xF), V::sll32(V::and32(V::srl32(q1, at + 6), 3), 4));
    }
  }
  // Block j's scale unit h: w = a u + c, a row per lane.
  struct Terms {
    V::F a, c;
  };
  Terms terms(int64_t j, int h) const {
    const uint8_t* b = file_block(j);
    const V::F d = halves(b + B::D_AT);
    if constexpr (T == Q6_K) {  // the signed byte 2 (j % 8) + h of the block's 16; c = -32 a
      const int sub = int(j % 8), byte = 2 * (sub % 2) + h;
      const V::I sc = V::sra32(V::sll32(chunk(b + B::SCALES_AT, sub / 2), 24 - 8 * byte), 24);
      const V::F a = V::mul(d, V::cvt(sc));
      return {a, V::mul(a, V::set1(-32.f))};
    } else if constexpr (B::K) {  // c = -dmin times the minimum
      V::I sc, mn;
      k4_scale_min(j, &sc, &mn);
      return {V::mul(d, V::cvt(sc)), V::mul(V::mul(halves(b + B::M_AT), V::set1(-1.f)), V::cvt(mn))};
    } else if constexpr (B::MIN) {
      return {d, halves(b + B::M_AT)};
    } else {  // w = d (u - z): c = -z d, exact in float32 (z a power of two)
      return {d, V::mul(d, V::set1(T == Q4_0 ? -8.f : T == Q5_0 ? -16.f : -128.f))};
    }
  }
  static V::I dot(const V::I* w, const int8_t* q) { return unit_dot<N, G, SIGNED_DOTS>(w, q); }
};

// The blocks of 32 a buffer of decoded codes holds: whole file blocks of every type.
constexpr int64_t SPAN = 32;

// A lane group's blocks [j0, j1) decoded (Packed's codes and, where TERMS, its terms, as they are) into a buffer,
// for a call with more than one tile of activation rows: each tile then reads them where each decoded them again.
// Its code and terms are Packed's, so every sum is the same bits whichever a tile reads. The tiles that apply the
// scales in integers (int_scales_tile) read no terms.
template <int T, bool TERMS = true>
struct Buffered : Packed<T> {
  using V = PanelIsa;
  using P = Packed<T>;
  static constexpr int64_t VECTORS = 8 + (TERMS ? 2 * P::UNITS : 0);  // a block's: its code vectors, (a, c) per unit
  static constexpr int64_t BYTES = VECTORS * int64_t(sizeof(V::I)), SPAN_BYTES = SPAN * BYTES;
  uint8_t* buffer;
  int64_t j0;

  uint8_t* at(int64_t j, int v) const { return buffer + BYTES * (j - j0) + int64_t(sizeof(V::I)) * v; }
  static constexpr int STEP = 1;
  // Without VNNI a panel of two lane groups takes both in a pass, code vector by code vector (panel_tile), so that
  // each activation broadcast and code load serves more products; its int16 sums and both groups' accumulators
  // fill AVX2's registers at a few rows a pass (docs/bench.md#many-rows-at-avx2-both-lane-groups-in-a-pass).
  static constexpr bool CROSS = V::ROWS < PANEL_ROWS && !V::DPBUSD;
  static constexpr int CROSS_TILE = 4;
  // The most activation rows a pass takes.
  static constexpr int TILE = CROSS ? CROSS_TILE : P::UNITS == 2 ? V::TILE_UNITS2 : V::TILE;
  void fill(int64_t j1, bool fetch) const {
    for (int64_t j = j0; j < j1; j += P::STEP) {
      if (fetch)
        for (int t = 0; t < P::STEP; ++t) P::fetch_ahead(j + t);
      for (int d = 0; d < 8; ++d) {
        typename V::I w[P::STEP];
        P::code_step(j, d, w);
        for (int t = 0; t < P::STEP; ++t) V::storei(at(j + t, d), w[t]);
      }
      if constexpr (TERMS) {
        for (int t = 0; t < P::STEP; ++t) {
          for (int h = 0; h < P::UNITS; ++h) {
            const typename P::Terms terms = P::terms(j + t, h);
            V::store(reinterpret_cast<float*>(at(j + t, 8 + 2 * h)), terms.a);
            if constexpr (P::OFFSET) V::store(reinterpret_cast<float*>(at(j + t, 9 + 2 * h)), terms.c);
          }
        }
      }
    }
  }
  V::I code(int64_t j, int d) const { return V::loadu(at(j, d)); }
  void code_step(int64_t j, int d, V::I* w) const { w[0] = code(j, d); }
  typename P::Terms terms(int64_t j, int h) const {
    return {V::loadf(reinterpret_cast<const float*>(at(j, 8 + 2 * h))),
            P::OFFSET ? V::loadf(reinterpret_cast<const float*>(at(j, 9 + 2 * h))) : V::zero()};
  }
};

// acc[r] += activation row i0 + r's dots with block j's unit h (dot(r), in int32 lanes) times their scales, then
// the unit's offsets (Q6_K's added to the dots, in integers): the float part of every panel tile, the AMX tiles'
// too, so that their sums are the same bits.
template <int R, class S, class Dot>
__attribute__((always_inline)) inline void add_unit(PanelIsa::F* acc, const typename S::Terms& terms,
                                                    const Activations& x, int64_t i0, int64_t j, int h,
                                                    const Dot& dot) {
  using V = PanelIsa;
  const int64_t m = x.m;
  const int32_t* offsets = x.o16 + (2 * j + h) * m + i0;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    V::I dot_r = dot(r);
    if constexpr (S::INT_OFFSET) dot_r = V::add32(dot_r, V::bcast32(offsets + r));
    acc[r] = V::fmadd(V::cvt(dot_r), V::mul(terms.a, V::bcastf(scale_at(x, i0 + r, j))), acc[r]);
  }
  if constexpr (S::OFFSET) {
    const float* sums = x.s32 + j * m;  // a unit a block: Q6_K, whose units are halves, has INT_OFFSET
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = V::fmadd(terms.c, V::bcastf(sums + i0 + r), acc[r]);
  }
}

// The unit dots of blocks j..j + S::STEP - 1 with R activation rows and G lane groups (groups[g]), code vector by
// code vector (code_step), each summed as unit_dot sums it: dots[g][r][t][h] is S::dot of group g's block j + t's
// unit h with row i0 + r, the same integers. Each activation broadcast serves every group.
template <int R, int G, class S>
__attribute__((always_inline)) inline void step_dots(const S* groups, const Activations& x, int64_t i0, int64_t j,
                                                     PanelIsa::I (&dots)[G][R][S::STEP][S::UNITS]) {
  using V = PanelIsa;
#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
  V::I pairs[G][R][S::STEP];  // maddubs results summed in int16, S::G at a time
#endif
#pragma GCC unroll 8
  for (int d = 0; d < 8; ++d) {
    const int h = d / S::N, e = d % S::N;
    V::I w[G][S::STEP];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) groups[g].code_step(j, d, w[g]);
#pragma GCC unroll 4
    for (int t = 0; t < S::STEP; ++t)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const V::I b = V::bcast4(codes_at(x, i0 + r, j + t) + 4 * d);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
          dots[g][r][t][h] = V::dpbusd(e == 0 ? V::izero() : dots[g][r][t][h], w[g][t], b);
#else
          const V::I p = S::SIGNED_DOTS ? V::maddubs(V::abs8(w[g][t]), V::sign8(b, w[g][t])) : V::maddubs(w[g][t], b);
          pairs[g][r][t] = e % S::G == 0 ? p : V::add16(pairs[g][r][t], p);
          hold<S::G>(pairs[g][r][t]);
          if (e % S::G == S::G - 1)
            dots[g][r][t][h] = V::widen(e < S::G ? V::izero() : dots[g][r][t][h], pairs[g][r][t]);
#endif
        }
      }
  }
}

// R activation rows against G lane groups of a panel (groups[g] the weight rows of y's lanes from PanelIsa::ROWS
// g on), one weight row per lane, over blocks [j0, j1): y[(i0 + r) * ldy + PanelIsa::ROWS * g + lane], the sums
// carried on from y's where j0 > 0 (a float stored and read back is the same float: the same bits as one pass
// over every block). Each group's sums take the same operations in the same order whatever G is.
template <int R, int G, class S>
void panel_tile(const S* groups, const Activations& x, int64_t i0, float* y, int64_t ldy, int64_t j0, int64_t j1,
                bool fetch) {
  using V = PanelIsa;
  typename V::F acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = j0 > 0 ? V::loadf(y + (i0 + r) * ldy + V::ROWS * g) : V::zero();
  // Both loops over the lane groups are unrolled: left rolled, GCC keeps acc in memory, indexed by the group,
  // and every unit waits on its stores (docs/bench.md#few-rows-at-avx2-the-lane-groups-loop-unrolled).
  // Few rows, where the decoding's instructions show: the blocks that share fields take their dots together, in
  // registers (a group's at a time; counting every group's, so that they fit: AVX-512 VNNI's need no int16 sums
  // beside them, and two rows' fit). With VNNI only Q6_K's, whose four blocks share their high bits, read rows
  // faster this way (docs/bench.md#q6_k-at-avx-512-vnni-one-and-two-rows-four-blocks-at-once).
  constexpr int STEP_DOTS = PanelIsa::DPBUSD && PanelIsa::ROWS == PANEL_ROWS ? 16 : 8;
  if constexpr (S::STEP > 1 && G * R * S::STEP * S::UNITS <= STEP_DOTS && (!PanelIsa::DPBUSD || S::type == Q6_K)) {
    for (int64_t j = j0; j < j1; j += S::STEP) {
      if (fetch)
        for (int t = 0; t < S::STEP; ++t) groups[0].fetch_ahead(j + t);
      typename V::I dots[1][R][S::STEP][S::UNITS];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        step_dots<R, 1>(groups + g, x, i0, j, dots);
        for (int t = 0; t < S::STEP; ++t)
          for (int h = 0; h < S::UNITS; ++h)
            add_unit<R, S>(acc[g], groups[g].terms(j + t, h), x, i0, j + t, h,
                           [&](int r) { return dots[0][r][t][h]; });
      }
    }
  } else if constexpr (S::CROSS) {
    for (int64_t j = j0; j < j1; ++j) {
      typename V::I dots[G][R][1][S::UNITS];
      step_dots<R, G>(groups, x, i0, j, dots);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < S::UNITS; ++h)
          add_unit<R, S>(acc[g], groups[g].terms(j, h), x, i0, j, h, [&](int r) { return dots[g][r][0][h]; });
    }
  } else {
    for (int64_t j = j0; j < j1; ++j) {
      if (fetch) groups[0].fetch_ahead(j);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        // Unrolled: rolled, GCC walked Q6_K's two units with a pointer per activation row, and spilled them.
#pragma GCC unroll 2
        for (int h = 0; h < S::UNITS; ++h) {
          typename V::I w[S::N];  // the unit's code vectors, decoded once for the R rows
          for (int d = 0; d < S::N; ++d) w[d] = groups[g].code(j, S::N * h + d);
          add_unit<R, S>(acc[g], groups[g].terms(j, h), x, i0, j, h,
                         [&](int r) { return S::dot(w, codes_at(x, i0 + r, j) + 4 * S::N * h); });
        }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) V::store(y + (i0 + r) * ldy + V::ROWS * g, acc[g][r]);
}

// The activation rows a tile takes: m split into as few tiles of at most tile rows as can be, all but the last
// of one height (16 rows as 16, 20 as 10 and 10, not 16 and 4, a tile's decoding shared by few rows).
int64_t tile_height(int64_t m, int64_t tile) {
  const int64_t tiles = (m + tile - 1) / tile;
  return (m + tiles - 1) / tiles;
}

// The lane groups of the panel at weight row n of a packed weight, each reading the panel's codes as it goes.
template <int T>
void panel_groups(const uint8_t* w, int64_t row_bytes, int64_t n, Packed<T>* groups) {
  for (int g = 0; g < PANEL_ROWS / PanelIsa::ROWS; ++g)
    groups[g] = Packed<T>{w + n * row_bytes, 4 * PanelIsa::ROWS * g};
}

// Every whole panel of weight rows [n0, n1), SPAN blocks at a time, its lane groups' codes decoded once into a
// stack buffer (Buf, a Buffered) that L1 holds beside the tiles' activations, the first group's fill fetching
// ahead: f(groups, n, j0, j1) for each span, the groups reading the buffer.
template <class Buf, class F>
void buffered_spans(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb, const F& f) {
  constexpr int GROUPS = PANEL_ROWS / PanelIsa::ROWS;
  alignas(64) uint8_t buffer[GROUPS][Buf::SPAN_BYTES];
  for (int64_t n = n0; n < n1; n += PANEL_ROWS) {
    Packed<Buf::type> panel[GROUPS];
    panel_groups(w, row_bytes, n, panel);
    for (int64_t j0 = 0; j0 < nb; j0 += SPAN) {
      const int64_t j1 = j0 + SPAN < nb ? j0 + SPAN : nb;
      Buf groups[GROUPS];
      for (int g = 0; g < GROUPS; ++g) {
        groups[g] = Buf{panel[g], buffer[g], j0};
        groups[g].fill(j1, g == 0);
      }
      f(static_cast<const Buf*>(groups), n, j0, j1);
    }
  }
}

// Every tile of activation rows (tile_height) against a panel's lane groups (one source each, Packed or
// Buffered), over blocks [j0, j1), each pass taking the groups in turn (all at once where Buffered::CROSS); the
// first pass fetches ahead where asked.
template <class S>
void tile_passes(const S* groups, const Activations& x, int64_t m, float* y, int64_t ldy, int64_t j0, int64_t j1,
                 bool fetch) {
  constexpr int GROUPS = PANEL_ROWS / PanelIsa::ROWS, PASS = S::CROSS ? GROUPS : 1;  // groups a pass takes
  const int64_t height = tile_height(m, S::TILE);
  for (int64_t i = 0; i < m; i += height)
    for (int g = 0; g < GROUPS; g += PASS)
      by_rows<S::TILE>(m - i < height ? m - i : height, [&](auto rows) {
        panel_tile<decltype(rows)::value, PASS>(groups + g, x, i, y + PanelIsa::ROWS * g, ldy, j0, j1,
                                                fetch && i == 0 && g == 0);
      });
}

#if QMM_INTEGER_K_SCALES

// The K types against rows quantized per 256 (Activations::group), at QMM_INTEGER_K_SCALES: llama.cpp's
// arithmetic for them. The widening madd takes each scale unit's scale where it took ones, so a super-block's
// products, scaled, add up in int32 over the 256; the offsets meet the activations' integer sums in madd pairs;
// and the float part comes once per 256 inputs and row, where the per-32 arithmetic spends four operations on
// every unit and row (docs/bench.md#batched-matmuls-against-their-arithmetics-bound-measured-nothing-changed).
// The integers are exact whatever the loop's shape, and the float part is the same operations in the same order
// for every row count: a row's result does not depend on the rows beside it.

// A super-block's scales for int_scales_tile, a row per lane: each scale unit's (a block of 32 for Q4_K and
// Q5_K, 16 inputs for Q6_K) in both int16 halves (madd multiplies pairs), and the offsets' factors as int16
// pairs, against the activations' sums as pairs: Q4_K and Q5_K's minimums of blocks 2p and 2p + 1 (sums2, summed
// apart: dmin is not d), Q6_K's two scales of block p times its offset, -32 (sums16, added to the products).
template <int T>
struct SuperScales {
  static constexpr int UNITS = T == Q6_K ? 16 : 8, PAIRS = T == Q6_K ? 8 : 4;
  PanelIsa::I unit[UNITS], pair[PAIRS];
};

template <class S>
__attribute__((always_inline)) inline void super_scales(const S& group, int64_t j0, SuperScales<S::type>* out) {
  using V = PanelIsa;
  if constexpr (S::type == Q6_K) {
    const uint8_t* b = group.file_block(j0) + PanelBlock<Q6_K>::SCALES_AT;
    for (int c = 0; c < 4; ++c) {  // chunk c: the signed scales of units 4c..4c + 3, blocks 2c and 2c + 1
      const V::I bytes = group.chunk(b, c);
      for (int e = 0; e < 4; ++e) out->unit[4 * c + e] = V::signed_bytes_pair(bytes, e, e);
      for (int e = 0; e < 2; ++e)
        out->pair[2 * c + e] = V::times16(V::signed_bytes_pair(bytes, 2 * e, 2 * e + 1), -32);
    }
  } else {  // get_scale_min_k4's fields, four a lane at once as bytes (blocks 0-3, then 4-7), then shuffled apart
    const uint8_t* b = group.file_block(j0) + PanelBlock<S::type>::SCALES_AT;
    const V::I q0 = group.chunk(b, 0), q1 = group.chunk(b, 1), q2 = group.chunk(b, 2);
    const V::I sc[2] = {V::and32(q0, 0x3F3F3F3F),
                        V::or_(V::and32(q2, 0x0F0F0F0F), V::and32(V::srl32(q0, 2), 0x30303030))};
    const V::I mn[2] = {V::and32(q1, 0x3F3F3F3F),
                        V::or_(V::and32(V::srl32(q2, 4), 0x0F0F0F0F), V::and32(V::srl32(q1, 2), 0x30303030))};
    for (int t = 0; t < 8; ++t) out->unit[t] = V::bytes_pair(sc[t / 4], t % 4, t % 4);
    for (int p = 0; p < 4; ++p) out->pair[p] = V::bytes_pair(mn[p / 2], 2 * (p % 2), 2 * (p % 2) + 1);
  }
}

// A span's codes, as Buffered holds them without the float terms, and its super-blocks' scales after them: unpacked
// once by fill for every tile of activation rows that reads the span, not once a tile
// (docs/bench.md#the-k-types-scales-unpacked-once-a-span).
template <int T>
struct ScaledCodes : Buffered<T, false> {
  using Codes = Buffered<T, false>;
  static constexpr int64_t SPAN_BYTES = Codes::SPAN_BYTES + SPAN / 8 * int64_t(sizeof(SuperScales<T>));
  ScaledCodes() = default;
  ScaledCodes(const Packed<T>& panel, uint8_t* buffer, int64_t j0) : Codes{panel, buffer, j0} {}
  // The super-block at block s0's scales, after the span's codes.
  SuperScales<T>* supers(int64_t s0) const {
    return reinterpret_cast<SuperScales<T>*>(this->buffer + Codes::SPAN_BYTES) + (s0 - this->j0) / 8;
  }
  void fill(int64_t j1, bool fetch) const {
    Codes::fill(j1, fetch);
    for (int64_t s0 = this->j0; s0 < j1; s0 += 8) super_scales(*this, s0, supers(s0));
  }
};

// The scales of the super-block at block s0, for a tile: unpacked into own, or where a fill left them.
template <int T>
__attribute__((always_inline)) inline const SuperScales<T>* scales_of(const Packed<T>& group, int64_t s0,
                                                                       SuperScales<T>* own) {
  super_scales(group, s0, own);
  return own;
}

template <int T>
__attribute__((always_inline)) inline const SuperScales<T>* scales_of(const ScaledCodes<T>& group, int64_t s0,
                                                                       SuperScales<T>*) {
  return group.supers(s0);
}

// R activation rows from i0 against G lane groups of a panel (panel_tile's y) over blocks [j0, j1), whole
// super-blocks, the sums carried on from y's where j0 > 0, code vector by code vector, so that each activation
// broadcast serves every lane group. Each height is a function of its own: inlined into int_scales_rows beside
// the others, GCC spilled the tiles' int16 sums and addresses to the stack
// (docs/bench.md#the-k-types-scales-in-one-shuffle-each-and-a-tile-a-function).
template <int R, int G, class S>
__attribute__((noinline)) void int_scales_tile(const S* groups, const Activations& x, int64_t i0, float* y,
                                               int64_t ldy, int64_t j0, int64_t j1, bool fetch) {
  using V = PanelIsa;
  using B = PanelBlock<S::type>;
  using Scales = SuperScales<S::type>;
  constexpr bool SIX = S::type == Q6_K;
  constexpr int GS = S::G, N = S::N;  // maddubs results summed in int16 before widening; code vectors per unit
  // The blocks an iteration takes (those of the panel's own codes that share loads, but Q6_K's one past one row,
  // which ran faster so; a buffer's one), and those a pass over the code vectors takes: every block at one row, one
  // at more, whose int16 sums would otherwise outgrow AVX2's sixteen registers.
  constexpr int STEP = SIX && R > 1 ? 1 : S::STEP, PASS = R == 1 ? STEP : 1;
  const int64_t m = x.m;
  const int32_t* pair_sums = SIX ? x.sums16 : x.sums2;  // a super-block's Scales::PAIRS rows of them
  for (int64_t s0 = j0; s0 < j1; s0 += 8) {
    Scales own[G];
    const Scales* scales[G];
    for (int g = 0; g < G; ++g) scales[g] = scales_of(groups[g], s0, &own[g]);
    V::I sums[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) sums[g][r] = V::izero();
    for (int64_t j = s0; j < s0 + 8; j += STEP) {
      if (fetch)
        for (int t = 0; t < STEP; ++t) groups[0].fetch_ahead(j + t);
#pragma GCC unroll 4
      for (int t0 = 0; t0 < STEP; t0 += PASS) {
        // Row i0 + r's codes of block j + t0 + t lie at CODES_STRIDE (m t + r) from q. Addressed from x row by row,
        // the buffered tiles recomputed each address in the loop once their scales came through a pointer.
        const int8_t* q = codes_at(x, i0, j + t0);
        V::I pairs[G][R][PASS];
#pragma GCC unroll 8
        for (int d = 0; d < 8; ++d) {
          V::I w[G][STEP];  // GCC drops the codes of the blocks outside this pass
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) {
            if constexpr (STEP == S::STEP) {
              groups[g].code_step(j, d, w[g]);
            } else {
              w[g][0] = groups[g].code(j, d);
            }
          }
#pragma GCC unroll 4
          for (int t = 0; t < PASS; ++t)
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
              const V::I b = V::bcast4(q + CODES_STRIDE * (m * t + r) + 4 * d);
#pragma GCC unroll 4
              for (int g = 0; g < G; ++g) {
                const V::I p = V::maddubs(w[g][t0 + t], b);
                pairs[g][r][t] = d % GS == 0 ? p : V::add16(pairs[g][r][t], p);
                hold<GS>(pairs[g][r][t]);
                if (d % GS == GS - 1)
                  sums[g][r] = V::widen_by(sums[g][r], pairs[g][r][t],
                                           scales[g]->unit[S::UNITS * (j - s0 + t0 + t) + d / N]);
              }
            }
        }
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const uint8_t* b = groups[g].file_block(s0);
      const V::F d = groups[g].halves(b + B::D_AT);
      V::F dmin = V::zero();  // Q4_K and Q5_K's, negated; Q6_K has none
      if constexpr (!SIX) dmin = V::mul(groups[g].halves(b + B::M_AT), V::set1(-1.f));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        V::I offsets = SIX ? sums[g][r] : V::izero();
        for (int p = 0; p < Scales::PAIRS; ++p)
          offsets = V::widen_by(offsets, scales[g]->pair[p],
                                V::bcast32(pair_sums + (s0 / 8 * Scales::PAIRS + p) * m + i0 + r));
        const V::F scale = V::bcastf(x.d256 + s0 / 8 * m + i0 + r);
        float* out = y + (i0 + r) * ldy + V::ROWS * g;
        V::F acc = s0 == 0 ? V::zero() : V::loadf(out);
        if constexpr (SIX) {
          acc = V::fmadd(V::cvt(offsets), V::mul(d, scale), acc);
        } else {
          acc = V::fmadd(V::cvt(sums[g][r]), V::mul(d, scale), acc);
          acc = V::fmadd(V::cvt(offsets), V::mul(dmin, scale), acc);
        }
        V::store(out, acc);
      }
    }
  }
}

// int_scales_tile over weight rows [n0, n1), whole panels, in tiles of up to TILE rows (tile_height), every lane
// group in each pass. Up to PACKED_ROWS rows read the panel's codes as they go, the first tile fetching ahead and
// the others finding the panel in the cache; more read them from buffered_spans, as packed_rows does, with the
// super-blocks' scales in place of the float terms (ScaledCodes). The codes' decoding decides where the buffer
// starts to pay: Q6_K's costs the most, so a second tile of them already reads the buffer; Q4_K's, a mask and a
// shift, stays cheaper than the buffer's stores and loads up to four tiles, a batched decode step of 16 chats. A
// span is whole super-blocks.
template <int T>
void int_scales_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x, int64_t m,
                     float* y, int64_t ldy) {
  constexpr int GROUPS = PANEL_ROWS / PanelIsa::ROWS, TILE = 4;
  constexpr int PACKED_ROWS = T == Q6_K ? TILE : T == Q4_K ? 4 * TILE : 2 * TILE;
  const int64_t nb = x.k / 32, height = tile_height(m, TILE);
  const auto tiles = [&](const auto* groups, int64_t n, int64_t j0, int64_t j1, bool fetch) {
    for (int64_t i = 0; i < m; i += height)
      by_rows<TILE>(m - i < height ? m - i : height, [&](auto rows) {
        int_scales_tile<decltype(rows)::value, GROUPS>(groups, x, i, y + n, ldy, j0, j1, fetch && i == 0);
      });
  };
  if (m <= PACKED_ROWS) {
    for (int64_t n = n0; n < n1; n += PANEL_ROWS) {
      Packed<T> groups[GROUPS];
      panel_groups(w, row_bytes, n, groups);
      tiles(groups, n, 0, nb, true);
    }
    return;
  }
  using Codes = ScaledCodes<T>;
  buffered_spans<Codes>(w, row_bytes, n0, n1, nb, [&](const Codes* groups, int64_t n, int64_t j0, int64_t j1) {
    tiles(groups, n, j0, j1, false);
  });
}

#endif

// Weight rows [n0, n1) of a packed weight, whole panels, each as PANEL_ROWS / PanelIsa::ROWS lane groups, against
// every activation row, a tile of rows (tile_height) a pass. A pass takes each lane group in turn, so that the
// panel's outputs of those rows are written whole at once: a line of them written by one group and completed by
// the next a pass over every row later has left the cache by then, at a prompt's many rows. One tile decodes its
// codes in registers as it goes; more than one decode them once into a buffer, SPAN blocks at a time (a stack
// buffer L1 holds beside the tiles' activations), and every tile reads them there. Up to ONE_PASS_ROWS rows (a
// few chats' decode step, or one chat's with a draft) take every lane group in one pass, block by block: with a
// pass per group, the later groups re-read the panel from the cache while no fetch ran ahead, and the step waited
// on memory and on the arithmetic in turn. More rows would spill both groups' accumulators; buffered passes at
// the AVX2 level without VNNI take both groups, a few rows at a time (Buffered::CROSS).
template <int T>
void packed_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x, int64_t m,
                 float* y, int64_t ldy) {
  constexpr int GROUPS = PANEL_ROWS / PanelIsa::ROWS, ONE_PASS_ROWS = 4;
  const int64_t nb = x.k / 32;
#if QMM_INTEGER_K_SCALES
  if constexpr (PanelBlock<T>::K) {
    if (x.group == 256) return int_scales_rows<T>(w, row_bytes, n0, n1, x, m, y, ldy);
  }
#endif
  if (m <= Packed<T>::TILE || T == Q8_0) {  // the first pass fetches ahead; the later ones find the panel in L1
    for (int64_t n = n0; n < n1; n += PANEL_ROWS) {
      Packed<T> groups[GROUPS];
      panel_groups(w, row_bytes, n, groups);
      if (m <= ONE_PASS_ROWS) {
        by_rows<ONE_PASS_ROWS>(m, [&](auto rows) {
          panel_tile<decltype(rows)::value, GROUPS>(groups, x, 0, y + n, ldy, 0, nb, true);
        });
      } else {
        tile_passes(groups, x, m, y + n, ldy, 0, nb, true);
      }
    }
    return;
  }
  buffered_spans<Buffered<T>>(w, row_bytes, n0, n1, nb,
                              [&](const Buffered<T>* groups, int64_t n, int64_t j0, int64_t j1) {
                                tile_passes(groups, x, m, y + n, ldy, j0, j1, false);
                              });
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)

// AMX (the amx level: AVX-512 VNNI's code plus tiles). A panel's code vectors, as Buffered holds them, are the
// rows of an AMX B tile as they lie: code vector d holds codes 4d..4d+3 of each of the 16 weight rows, row n's at
// 4n. One TDPBSUD of a unit's activation codes (A: 16 activation rows of the unit's 32 or 16 bytes) against them
// gives every (activation row, weight row) unit dot in int32, exactly the integer unit_dot's dpbusds sum. The
// float part after it is panel_tile's, operation for operation, so every output is the VNNI level's to the bit
// whatever the row count: AMX only takes over the integer products, which dominate a batch's step.
constexpr int64_t AMX_MIN_ROWS = 16;  // fewer rows leave the tiles part empty: the VNNI tiles serve them
constexpr int AMX_TILE_ROWS = 16;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile 0: the dots (rows x 16 int32); 1: the activation codes (rows x unit bytes); 2: the weight codes.
void configure_tiles(int rows, int unit_bytes) {
  TileConfig c{};
  c.palette = 1;
  c.colsb[0] = 64;
  c.rows[0] = uint8_t(rows);
  c.colsb[1] = uint16_t(unit_bytes);
  c.rows[1] = uint8_t(rows);
  c.colsb[2] = 64;
  c.rows[2] = uint8_t(unit_bytes / 4);
  _tile_loadconfig(&c);
}

// R activation rows from i0 against one panel over blocks [j0, j1), as panel_tile: the dots of CHUNK blocks
// from the tiles first, then their float sums, so the tile unit and the vector units overlap.
template <int R, int T>
void amx_tile(const Buffered<T>& s, const Activations& x, int64_t i0, float* y, int64_t ldy, int64_t j0,
              int64_t j1) {
  using V = PanelIsa;
  using S = Buffered<T>;
  constexpr int64_t CHUNK = 8;
  constexpr int UNIT_BYTES = 4 * S::N;
  alignas(64) int32_t dots[CHUNK * S::UNITS][AMX_TILE_ROWS][16];
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = j0 > 0 ? V::loadf(y + (i0 + r) * ldy) : V::zero();
  for (int64_t c0 = j0; c0 < j1; c0 += CHUNK) {
    const int64_t c1 = c0 + CHUNK < j1 ? c0 + CHUNK : j1;
    for (int64_t j = c0; j < c1; ++j)
      for (int h = 0; h < S::UNITS; ++h) {
        _tile_zero(0);
        _tile_loadd(1, codes_at(x, i0, j) + UNIT_BYTES * h, CODES_STRIDE);
        _tile_loadd(2, s.at(j, S::N * h), 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, dots[(j - c0) * S::UNITS + h], 64);
      }
    for (int64_t j = c0; j < c1; ++j)
      for (int h = 0; h < S::UNITS; ++h) {
        const int32_t(*dot)[16] = dots[(j - c0) * S::UNITS + h];
        add_unit<R, S>(acc, s.terms(j, h), x, i0, j, h,
                       [&](int r) { return V::loadu(reinterpret_cast<const uint8_t*>(dot[r])); });
      }
  }
  for (int r = 0; r < R; ++r) V::store(y + (i0 + r) * ldy, acc[r]);
}

// packed_rows' buffered loop with AMX tiles: each panel's codes decoded once a span into the buffer the tiles
// load, then every 16 activation rows against them.
template <int T>
void amx_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x, int64_t m,
              float* y, int64_t ldy) {
  static_assert(PanelIsa::ROWS == PANEL_ROWS, "a panel is one lane group on AVX-512");
  const int64_t nb = x.k / 32;
  alignas(64) uint8_t buffer[Buffered<T>::SPAN_BYTES];
  int configured = 0;
  for (int64_t n = n0; n < n1; n += PANEL_ROWS) {
    for (int64_t j0 = 0; j0 < nb; j0 += SPAN) {
      const int64_t j1 = j0 + SPAN < nb ? j0 + SPAN : nb;
      const Buffered<T> s{Packed<T>{w + n * row_bytes, 0}, buffer, j0};
      s.fill(j1, true);
      for (int64_t i = 0; i < m; i += AMX_TILE_ROWS) {
        const int rows = int(m - i < AMX_TILE_ROWS ? m - i : AMX_TILE_ROWS);
        if (rows != configured) {
          configure_tiles(rows, 4 * Buffered<T>::N);
          configured = rows;
        }
        by_rows<AMX_TILE_ROWS>(rows, [&](auto r) { amx_tile<decltype(r)::value>(s, x, i, y + n, ldy, j0, j1); });
      }
    }
  }
  _tile_release();
}

void matmul_panels(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x,
                   int64_t m, float* y, int64_t ldy) {
  by_type(type, [&](auto t) {
    if (m >= AMX_MIN_ROWS) {
      amx_rows<decltype(t)::type>(w, row_bytes, n0, n1, x, m, y, ldy);
    } else {
      packed_rows<decltype(t)::type>(w, row_bytes, n0, n1, x, m, y, ldy);
    }
  });
}

#else

void matmul_panels(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x,
                   int64_t m, float* y, int64_t ldy) {
  by_type(type, [&](auto t) { packed_rows<decltype(t)::type>(w, row_bytes, n0, n1, x, m, y, ldy); });
}

#endif

// Weight rows in the file's layout (the rows after a weight's last whole panel): per-row tiles, at every row
// count, so that a row's result does not depend on how many rows share the step.
template <int T>
void matmul_of(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x, int64_t m,
               float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    int64_t i = 0;
    for (; i + ROWS <= m; i += ROWS) tile<T, ROWS>(row, x, i, y + n, ldy);
    by_rows<ROWS - 1>(m - i, [&](auto rows) { tile<T, decltype(rows)::value>(row, x, i, y + n, ldy); });
  }
}

void matmul(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x,
            int64_t m, float* y, int64_t ldy, uint8_t*) {
  by_type(type, [&](auto t) { matmul_of<decltype(t)::type>(w, row_bytes, n0, n1, x, m, y, ldy); });
}

#else  // the portable path: each weight row decoded into scratch (decode above), then the same sums in plain C++

// y[i * ldy] += sum over g of c16[g] * s16[g][i], for every activation row i: the weight row's offsets.
void add_offsets(const float* c16, const Activations& x, float* y, int64_t ldy) {
  for (int64_t i = 0; i < x.m; ++i) {
    float sum = 0.f;
    for (int64_t g = 0; g < x.k / 16; ++g) sum += c16[g] * x.s16[g * x.m + i];
    y[i * ldy] += sum;
  }
}

void dot_row(const Decoded& w, bool is_signed, const Activations& x, int64_t i, float* y) {
  const int64_t k = x.k;
  float sum = 0.f;
  for (int64_t g = 0; g < k / 16; ++g) {
    const int8_t* q = codes_at(x, i, g / 2) + 16 * (g % 2);
    int32_t dot = 0;
    for (int l = 0; l < 16; ++l) {
      const int32_t u = is_signed ? int32_t(int8_t(w.u[16 * g + l])) : int32_t(w.u[16 * g + l]);
      dot += u * int32_t(q[l]);
    }
    sum += w.a16[g] * float(dot) * *scale_at(x, i, g / 2);
  }
  *y = sum;
}

void matmul(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x,
            int64_t m, float* y, int64_t ldy, uint8_t* scratch) {
  const Decoded d = layout(scratch, x.k);
  for (int64_t n = n0; n < n1; ++n) {
    decode(type, w + n * row_bytes, x.k, d);
    for (int64_t i = 0; i < m; ++i) dot_row(d, type == Q8_0, x, i, y + i * ldy + n);
    add_offsets(d.c16, x, y + n, ldy);
  }
}

#endif

void dequantize(int type, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n, float* out,
                uint8_t* scratch) {
  // Where ggml's formula is d (q - z), so is this one: a u + c would round differently.
  const int zero = type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : 0;
  const Decoded d = layout(scratch, k);
  for (int64_t r = 0; r < n; ++r) {
    decode(type, w + r * row_bytes, k, d);
    float* o = out + r * k;
    for (int64_t l = 0; l < k; ++l) {
      const float a = d.a16[l / 16];
      if (type == Q8_0) {
        o[l] = a * float(int8_t(d.u[l]));
      } else if (zero) {
        o[l] = a * float(int(d.u[l]) - zero);
      } else {
        o[l] = a * float(d.u[l]) + d.c16[l / 16];
      }
    }
  }
}

}  // namespace

// layer_level.cpp
void QMM_LOCAL(attend)(const AttendArgs& a, int64_t u0, int64_t u1, float* scratch);
void QMM_LOCAL(norm)(const float* x, const float* w, int64_t h, float eps, int64_t r0, int64_t r1, float* out);
void QMM_LOCAL(silu_mul)(const float* gate_up, int64_t n, int64_t r0, int64_t r1, float* out);
void QMM_LOCAL(rope_write)(const RopeArgs& a, int64_t t0, int64_t t1);
void QMM_LOCAL(argmax)(const float* x, int64_t n, int64_t r0, int64_t r1, int64_t* out);

#if defined(__AVX2__)
constexpr auto PANELS = matmul_panels;
#else
constexpr decltype(Level::matmul_panels) PANELS = nullptr;
#endif

extern const Level QMM_SYMBOL = {quantize,          matmul,          PANELS,
                                 dequantize,        QMM_LOCAL(attend), QMM_LOCAL(norm), QMM_LOCAL(silu_mul),
                                 QMM_LOCAL(rope_write), QMM_LOCAL(argmax), QMM_INTEGER_K_SCALES ? 256 : 32};

}  // namespace qmm
