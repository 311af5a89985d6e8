// The decoder's per-step work besides its matmuls, one instruction-set level: built beside qmm_level.cpp with the
// same flags, into the same library (see pagedchat/model/qmm.py), and picked with it.
//
// Decode attention: each KV head of each sequence reads its keys and values straight from the pages its block table
// names, with every query head of its group at once: all the scores, one softmax per head, then the values' sums.
// Sequences side by side go through their pages together, so that a page they share is read from memory once.
// torch's path first gathers each sequence's pages into a padded batch, a copy
// of every key and value per layer and step, then runs SDPA: at one chat the gathers and the calls cost more
// than the arithmetic.
//
// RMS norm, the rotary turn with the cache write, and silu(gate) * up: a float32 step of packed weights runs
// each as one call where torch takes three to six, and at one chat those small calls, one after another on
// one core, were as long as a third of the step's matmuls.
//
// The loops run over eight floats at a time in a vector type the compiler maps onto whatever vectors the level
// has; the sums keep one order whatever the level, so every SIMD level gives the same numbers bit for bit
// (attention's multiply-adds are fused there, not on the portable level). qmm.h's inline rule holds here.

#include <stdint.h>

#include "lanes.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "qmm.h"

#ifndef QMM_SYMBOL
#error "build with -DQMM_SYMBOL=<level>"
#endif

namespace qmm {
namespace {

// f8, SHUFFLE and top are lanes.h's; bfloat16 keys and values arrive as eight halves.
typedef uint16_t h8 __attribute__((vector_size(16)));

// The widening loads, one instruction each where the level has AVX2: GCC builds __builtin_convertvector's eight
// lanes out of halves (bfloat16) or lane by lane through scalar registers (int8), which cost the scores' loop
// more than its multiply-adds. Either way the conversion is exact, so every level gets the same floats.
inline f8 load(const uint16_t* p) {  // bfloat16: the high half of a float32
#if defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<f8>(_mm256_slli_epi32(wide, 16));
#else
  h8 h;
  __builtin_memcpy(&h, p, sizeof h);
  return reinterpret_cast<f8>(__builtin_convertvector(h, u8) << 16);
#endif
}
typedef int8_t c8 __attribute__((vector_size(8)));
inline f8 load(const int8_t* p) {  // int8 codes, as floats (exactly)
#if defined(__AVX2__)
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<f8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
#else
  c8 c;
  __builtin_memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, f8);
#endif
}
inline void store(float* p, f8 v) { __builtin_memcpy(p, &v, sizeof v); }

inline float value(const float* p, int64_t i) { return p[i]; }
inline float value(const uint16_t* p, int64_t i) { return __builtin_bit_cast(float, uint32_t(p[i]) << 16); }
inline float value(const int8_t* p, int64_t i) { return float(p[i]); }

// A page element type's rows (kernels/kv_pages.py): an int8 row's codes are followed by the scale they are
// multiplied by; float32 and bfloat16 rows are the values themselves.
template <typename E>
constexpr bool scaled = false;
template <>
constexpr bool scaled<int8_t> = true;
template <typename E>
constexpr int64_t width(int64_t d) {  // elements from one row to the next
  return scaled<E> ? d + PAGE_SCALE_BYTES : d;
}
inline float row_scale(const int8_t* row, int64_t d) {
  float s;
  __builtin_memcpy(&s, row + d, sizeof s);
  return s;
}

// The lanes' sum, always in this order.
inline float sum(f8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

template <typename E>
inline float dot(const float* q, const E* k, int64_t d) {
  f8 acc = splat(0.f);
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) acc = fma8(load(q + i), load(k + i), acc);
  float s = sum(acc);
  for (; i < d; ++i) s += q[i] * value(k, i);
  if constexpr (scaled<E>) s *= row_scale(k, d);
  return s;
}

// Eight sums at once: lane j of the result is sum(v[j]), in sum's own order ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
// (l3 + l7)), from three rounds of shuffles and adds instead of eight reductions of one vector each. After the
// first round the shuffles stay within 128-bit halves: one instruction each on AVX.
__attribute__((always_inline)) inline f8 sums8(const f8* v) {
  f8 x[4], y[2];
  // Round one pairs (v[j], v[j + 4]): x[j] = [v[j]'s four sums of lanes l and l + 4, then v[j + 4]'s].
  for (int j = 0; j < 4; ++j)
    x[j] = SHUFFLE(v[j], v[j + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(v[j], v[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  // Round two adds lanes l and l + 2 within each half: y[0] = [v0's (0 + 2) and (1 + 3), v1's, v4's, v5's].
  for (int j = 0; j < 2; ++j)
    y[j] = SHUFFLE(x[2 * j], x[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           SHUFFLE(x[2 * j], x[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // Round three adds those two: v0 to v7 in order.
  return SHUFFLE(y[0], y[1], 0, 2, 8, 10, 4, 6, 12, 14) +
         SHUFFLE(y[0], y[1], 1, 3, 9, 11, 5, 7, 13, 15);
}

// A block of the work keeps every sum it holds in a vector register, so its size follows the level's registers
// and the block's heads: AVX-512's 32 hold three heads' sums of eight keys, or of eight vectors of values, and four
// heads' of four; AVX2's 16 (and the portable level's) three heads' of four and four heads' of two. A group of four
// heads (Llama's 32 over 8) is then one block, which loads each key and value once.
constexpr int HEADS = 4;  // query heads of a group in one block: each key or value loaded feeds all of them
#if defined(__AVX512F__)
constexpr int WIDE = 8;
#else
constexpr int WIDE = 4;
#endif
template <int M>
constexpr int KEYS = M < HEADS ? WIDE : WIDE / 2;  // keys a block of M heads scores at once
template <int M>
constexpr int VECTORS = KEYS<M>;  // vectors of values a block of M heads sums at once

template <int N>
struct Count {
  static constexpr int n = N;
};

// fn(Count<m>, e) for the group's heads [e, e + m), blocks of HEADS and then the rest.
template <typename Fn>
__attribute__((always_inline)) inline void by_heads(int64_t heads, Fn fn) {
  int64_t e = 0;
  for (; e + HEADS <= heads; e += HEADS) fn(Count<HEADS>{}, e);
  if (heads - e == 3) fn(Count<3>{}, e);
  if (heads - e == 2) fn(Count<2>{}, e);
  if (heads - e == 1) fn(Count<1>{}, e);
}

// K keys' scores for M query heads (q's rows, d apart) at once, s[m * stride + j] for head m and key j, each the
// same sum as dot's: its own chain of multiply-adds, then sum's order (sums8 reduces eight at a time).
template <int M, int K, typename E>
__attribute__((always_inline)) inline void scores(const float* q, const E* k, int64_t row, int64_t d, float scale,
                                                  float* s, int64_t stride) {
  f8 acc[M * K];  // head m's key j at m * K + j
  for (int n = 0; n < M * K; ++n) acc[n] = splat(0.f);
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES)
    for (int j = 0; j < K; ++j) {
      const f8 key = load(k + j * row + i);
      for (int m = 0; m < M; ++m) acc[m * K + j] = fma8(load(q + m * d + i), key, acc[m * K + j]);
    }
  float r[M * K];
  for (int n0 = 0; n0 < M * K; n0 += 8) {  // eight sums at a time, the last eight padded with zeros
    f8 v[8];
    for (int n = 0; n < 8; ++n) v[n] = n0 + n < M * K ? acc[n0 + n] : splat(0.f);
    float eight[8];
    store(eight, sums8(v));
    for (int n = 0; n < 8 && n0 + n < M * K; ++n) r[n0 + n] = eight[n];
  }
  for (; i < d; ++i)
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < K; ++j) r[m * K + j] += q[m * d + i] * value(k + j * row, i);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < K; ++j) {
      float x = r[m * K + j];
      if constexpr (scaled<E>) x *= row_scale(k + j * row, d);
      s[m * stride + j] = x * scale;
    }
}

// e^x to float32's precision (Cephes' expf polynomial), lane by lane, branch free. Below -87 (a masked slot's
// -inf included) it gives 0, far under any weight that counts beside a softmax maximum's 1; above 88 it stays
// at e^88 rather than overflowing.
inline f8 exp8(f8 x) {
  const f8 low = splat(-87.f), high = splat(88.f);
  const i8 gone = x < low;
  x = gone ? low : x;
  x = x > high ? high : x;
  const f8 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to a whole number
  const f8 n = (x * 1.44269504088896341f + magic) - magic;
  f8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i8 e = (__builtin_convertvector(n, i8) + 127) << 23;
  return gone ? splat(0.f) : p * reinterpret_cast<f8>(e);
}

// The sequences a unit attends for, [b0, b1), with one KV head h and its group's query heads [e0, e1).
struct Chunk {
  int64_t b0, b1, h, e0, e1;
};

// The pages the chunk's sequences read for its KV head, page index by page index: at index p, sequence b0's page
// p, then b0 + 1's, and so on, so that a page the sequences share (a common system prompt's) is read from memory
// once and from L1 by the others. fn(b, base, t0, t1, at) for each, base the offset of the page's row 0 for that
// head, [t0, t1) the keys it holds of b's range, `at` the first one's index in that range; per sequence the
// pages come in order.
//
// Just before fn takes a sequence's page, that sequence's next page of `ahead` is fetched: the pages lie anywhere
// in the pool, where the hardware's prefetchers cannot guess them. It goes to L2, not L1, since fn needs it only
// after the chunk's other sequences have had their turn. Fetching a whole index's pages into L1 at once, as this
// did before, left the arithmetic waiting on memory once the caches no longer held the pages
// (docs/bench.md#decode-attention-pages-fetched-into-l2).
template <typename E, typename Fn>
inline void for_pages(const AttendArgs& a, const Chunk& c, const E* ahead, Fn fn) {
  const int64_t bs = a.block_size, w = width<E>(a.head_dim), row = a.kv_heads * w;
  const int64_t lines = (w * int64_t(sizeof(E)) + 63) / 64;
  int64_t pages = 0;
  for (int64_t b = c.b0; b < c.b1; ++b) {
    const int64_t n = (a.context_lens[b] + bs - 1) / bs;
    pages = n > pages ? n : pages;
  }
  int64_t fetched = -1;  // sequences side by side often share their next page: fetch it once
  for (int64_t p = 0; p < pages; ++p)
    for (int64_t b = c.b0; b < c.b1; ++b) {
      const int64_t len = a.context_lens[b], first = first_key(len, a.window);
      const int64_t next = p + 1 < first / bs || (p + 1) * bs >= len ? -1 : a.block_tables[b * a.table_stride + p + 1];
      if (next >= 0 && next != fetched) {
        fetched = next;
        const char* lines0 = reinterpret_cast<const char*>(ahead + (next * bs * row + c.h * w));
        for (int64_t t = 0; t < bs; ++t)
          for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(lines0 + t * row * int64_t(sizeof(E)) + 64 * l, 0, 1);
      }
      if (p < first / bs || p * bs >= len) continue;
      const int64_t t0 = p * bs < first ? first - p * bs : 0, t1 = (p + 1) * bs > len ? len - p * bs : bs;
      fn(b, int64_t(a.block_tables[b * a.table_stride + p]) * bs * row + c.h * w, t0, t1,
         p * bs + t0 - first);
    }
}

// The query heads of one KV head's group share its keys and values: each page is read from memory once for all
// of them (or for a unit's run of them, where attend splits the groups) and then stays in L1, where a pass per
// head read every key and value from L2 (or further) once per head. Per head the arithmetic is unchanged, so the
// results are the same bits.
struct Group {
  int64_t first, size;  // the group's first query head of the sequence, and its heads
  int64_t stride;       // floats between the heads' scores (scratch)
  float* scratch;       // the sequence's own: a row of scores per head, then the heads' softmax sums
};

inline Group group_of(const AttendArgs& a, const Chunk& c, int64_t b, float* scratch) {
  const int64_t size = a.heads / a.kv_heads;
  return {b * a.heads + c.h * size + c.e0, c.e1 - c.e0, attend_scratch_row(a),
          scratch + (b - c.b0) * attend_scratch(a)};
}

// One block of add_values: V vectors of out from i for the M heads from e, over a page's keys [t0, t1).
template <int M, int V, typename E>
__attribute__((always_inline)) inline void add_values_block(const AttendArgs& a, const Group& g, const E* v,
                                                            int64_t base, int64_t t0, int64_t t1, int64_t at,
                                                            int64_t e, int64_t i) {
  const int64_t d = a.head_dim, row = a.kv_heads * width<E>(d);
  float* oe = a.out + (g.first + e) * d + i;
  const float* we = g.scratch + e * g.stride + at - t0;
  f8 o[M][V];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < V; ++j) o[m][j] = load(oe + m * d + j * LANES);
  for (int64_t t = t0; t < t1; ++t) {
    const E* vt = v + base + i + t * row;
    f8 wt[M];
    for (int m = 0; m < M; ++m) {
      float weight = we[m * g.stride + t];
      if constexpr (scaled<E>) weight *= row_scale(vt - i, d);
      wt[m] = splat(weight);
    }
    for (int j = 0; j < V; ++j) {
      const f8 x = load(vt + j * LANES);
      for (int m = 0; m < M; ++m) o[m][j] = fma8(wt[m], x, o[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < V; ++j) store(oe + m * d + j * LANES, o[m][j]);
}

// out_g = sum over the sequence's keys of w_g[key] * v[key] for each head g of each sequence's group: blocks of
// VECTORS<M> vectors of out for M heads, each value vector loaded once for all of them, one chain of adds per
// lane kept across the pages (held in out between them), so that independent sums hide each add's latency. Every
// block, and the vectors and values past the blocks, while the page is in L1: one walk over the pages.
template <typename E>
inline void add_values(const AttendArgs& a, const Chunk& c, float* scratch, const E* v) {
  const int64_t d = a.head_dim, row = a.kv_heads * width<E>(d), vectors = d / LANES * LANES;
  for (int64_t b = c.b0; b < c.b1; ++b) {  // the sums start at 0, and are held in out between the pages
    const Group g = group_of(a, c, b, scratch);
    for (int64_t l = 0; l < g.size * d; ++l) a.out[g.first * d + l] = 0.f;
  }
  for_pages(a, c, v, [&](int64_t b, int64_t base, int64_t t0, int64_t t1, int64_t at) {
    const Group g = group_of(a, c, b, scratch);
    by_heads(g.size, [&](auto heads, int64_t e) __attribute__((always_inline)) {
      constexpr int M = decltype(heads)::n, V = VECTORS<M>;
      int64_t i = 0;
      for (; i + V * LANES <= d; i += V * LANES) add_values_block<M, V>(a, g, v, base, t0, t1, at, e, i);
      for (; i < vectors; i += LANES) add_values_block<M, 1>(a, g, v, base, t0, t1, at, e, i);
    });
    for (int64_t i = vectors; i < d; ++i)
      for (int64_t e = 0; e < g.size; ++e) {
        float o = a.out[(g.first + e) * d + i];
        for (int64_t t = t0; t < t1; ++t) {
          float weight = g.scratch[e * g.stride + at + t - t0];
          if constexpr (scaled<E>) weight *= row_scale(v + base + t * row, d);
          o += weight * value(v + base + t * row, i);
        }
        a.out[(g.first + e) * d + i] = o;
      }
  });
}

// One unit: a chunk of sequences with one KV head, each with every query head of its group, in three passes over
// the keys: every score, one softmax per head, then the values' weighted sums. A running softmax a page at a time
// rescaled its sums on every page, which at a page of 16 keys cost as much as a fifth of the arithmetic.
// scratch: attend_scratch(a) floats per sequence of the chunk.
template <typename E>
void attend_unit(const AttendArgs& a, const Chunk& c, float* scratch) {
  const int64_t d = a.head_dim, row = a.kv_heads * width<E>(d);
  const E* keys = static_cast<const E*>(a.k);
  const E* values = static_cast<const E*>(a.v);
  for_pages(a, c, keys, [&](int64_t b, int64_t base, int64_t t0, int64_t t1, int64_t at) {
    const Group g = group_of(a, c, b, scratch);
    const float* q = a.q + g.first * d;
    // The keys' scores, then their weights, a row per head: KEYS<M> keys at a time meet a block of M of the
    // group's heads, while their lines are in L1.
    float* s = g.scratch + at - t0;
    by_heads(g.size, [&](auto heads, int64_t e) __attribute__((always_inline)) {
      constexpr int M = decltype(heads)::n, K = KEYS<M>;
      int64_t t = t0;
      for (; t + K <= t1; t += K)
        scores<M, K>(q + e * d, keys + base + t * row, row, d, a.scale, s + e * g.stride + t, g.stride);
      for (; t < t1; ++t)
        for (int m = 0; m < M; ++m)
          s[(e + m) * g.stride + t] = dot(q + (e + m) * d, keys + base + t * row, d) * a.scale;
    });
  });
  for (int64_t b = c.b0; b < c.b1; ++b) {
    const Group g = group_of(a, c, b, scratch);
    const int64_t len = a.context_lens[b];
    const int64_t n = len - first_key(len, a.window), padded = (n + LANES - 1) / LANES * LANES;
    float* mass = g.scratch + g.size * g.stride;
    for (int64_t e = 0; e < g.size; ++e) {
      float* s = g.scratch + e * g.stride;
      for (int64_t t = n; t < padded; ++t) s[t] = -__builtin_inff();
      f8 most = splat(-__builtin_inff());
      for (int64_t t = 0; t < padded; t += LANES) {
        const f8 v = load(s + t);
        most = v > most ? v : most;
      }
      const float high = top(most);
      f8 total = splat(0.f);
      for (int64_t t = 0; t < padded; t += LANES) {
        const f8 w = exp8(load(s + t) - high);
        total += w;
        store(s + t, w);
      }
      mass[e] = sum(total);
    }
  }
  add_values(a, c, scratch, values);
  for (int64_t b = c.b0; b < c.b1; ++b) {
    const Group g = group_of(a, c, b, scratch);
    const float* mass = g.scratch + g.size * g.stride;
    float* out = a.out + g.first * d;
    for (int64_t e = 0; e < g.size; ++e) {
      float* oe = out + e * d;
      if (!(mass[e] > 0.f)) {
        for (int64_t i = 0; i < d; ++i) oe[i] = 0.f;
        continue;
      }
      int64_t i = 0;
      for (; i + LANES <= d; i += LANES) store(oe + i, load(oe + i) / splat(mass[e]));
      for (; i < d; ++i) oe[i] /= mass[e];
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// The rest of a float32 step, row by row.

void norm_row(const float* x, const float* w, int64_t h, float eps, float* out) {
  f8 acc = splat(0.f);
  int64_t i = 0;
  for (; i + LANES <= h; i += LANES) {
    const f8 v = load(x + i);
    acc += v * v;
  }
  float squares = sum(acc);
  for (int64_t j = i; j < h; ++j) squares += x[j] * x[j];
  const float scale = 1.f / __builtin_sqrtf(squares / float(h) + eps);
  for (i = 0; i + LANES <= h; i += LANES) store(out + i, load(x + i) * scale * load(w + i));
  for (; i < h; ++i) out[i] = x[i] * scale * w[i];
}

void silu_mul_row(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const f8 g = load(gate + i);
    store(out + i, g / (1.f + exp8(-g)) * load(up + i));
  }
  for (; i < n; ++i) {  // the tail through the same vector code, one lane used
    f8 g = splat(gate[i]);
    out[i] = (g / (1.f + exp8(-g)))[0] * up[i];
  }
}

// dst = src turned by cos and sin (sin's first half negated: x * cos + rotate_half(x) * sin, as the model's
// apply_rope); dims past the rotary ones are copied.
void turn(const float* src, const float* cos, const float* sin, int64_t rot, int64_t d, float* dst) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * cos[i] + src[i + half] * sin[i];
  for (int64_t i = half; i < rot; ++i) dst[i] = src[i] * cos[i] + src[i - half] * sin[i];
  for (int64_t i = rot; i < d; ++i) dst[i] = src[i];
}

// Whether any lane is set: their bits ORed in 64-bit pieces (one test on AVX).
inline bool any(i8 mask) {
  uint64_t bits[4];
  __builtin_memcpy(bits, &mask, sizeof bits);
  return (bits[0] | bits[1] | bits[2] | bits[3]) != 0;
}

// One pass finds the largest value (or that there is a NaN), a second its first index: the comparisons are
// exact, so the index is the first of ties whatever the order of the first pass.
int64_t argmax_row(const float* x, int64_t n) {
  f8 most = splat(-__builtin_inff());
  i8 nan = i8{};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const f8 v = load(x + i);
    nan |= v != v;
    most = v > most ? v : most;
  }
  float high = top(most);
  bool seen_nan = any(nan);
  for (int64_t j = i; j < n; ++j) {
    seen_nan |= x[j] != x[j];
    high = x[j] > high ? x[j] : high;
  }
  for (i = 0; i + LANES <= n; i += LANES) {
    const f8 v = load(x + i);
    if (any(seen_nan ? v != v : v == high))
      for (int j = 0;; ++j)
        if (seen_nan ? v[j] != v[j] : v[j] == high) return i + j;
  }
  for (; i < n; ++i)
    if (seen_nan ? x[i] != x[i] : x[i] == high) return i;
  return 0;  // n == 0
}

// A row of d floats as pages of E hold it, at out (kernels/kv_pages.py's encode, bit for bit): bfloat16 rounded to
// nearest even (a NaN kept a NaN), as torch converts; int8 symmetric, codes round(x / scale) with scale = max |x|
// / 127 (any positive divisor for a row of zeros, whose codes are 0), then the scale.
inline void put(const float* x, int64_t d, float* out) { __builtin_memcpy(out, x, d * sizeof(float)); }
inline void put(const float* x, int64_t d, uint16_t* out) {
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t u = __builtin_bit_cast(uint32_t, x[i]);
    out[i] = x[i] != x[i] ? uint16_t(0x7fc0) : uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
}
inline void put(const float* x, int64_t d, int8_t* out) {
  float most = 0.f;
  for (int64_t i = 0; i < d; ++i) most = __builtin_fabsf(x[i]) > most ? __builtin_fabsf(x[i]) : most;
  const float scale = most / 127.f, divisor = scale > __FLT_MIN__ ? scale : __FLT_MIN__;
  for (int64_t i = 0; i < d; ++i) {
    const float code = __builtin_rintf(x[i] / divisor);
    out[i] = int8_t(code > 127.f ? 127.f : code < -127.f ? -127.f : code);
  }
  __builtin_memcpy(out + d, &scale, sizeof scale);
}

// Float32 pages take the turned key and the value in place; the others through a row of floats, then put.
template <typename E>
void rope_write_rows(const RopeArgs& a, int64_t t0, int64_t t1) {
  const int64_t d = a.head_dim, heads = a.heads, kv = a.kv_heads, width_qkv = (heads + 2 * kv) * d;
  const int64_t w = width<E>(d);
  float turned[MAX_ENCODED_DIM];
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = a.qkv + t * width_qkv;
    const float *cos = a.cos + t * a.rot, *sin = a.sin + t * a.rot;
    E* k = static_cast<E*>(a.k_cache) + a.slots[t] * kv * w;
    E* v = static_cast<E*>(a.v_cache) + a.slots[t] * kv * w;
    for (int64_t h = 0; h < heads; ++h) turn(row + h * d, cos, sin, a.rot, d, a.q + (t * heads + h) * d);
    for (int64_t h = 0; h < kv; ++h) {
      if constexpr (sizeof(E) == sizeof(float)) {
        turn(row + (heads + h) * d, cos, sin, a.rot, d, k + h * w);
      } else {
        turn(row + (heads + h) * d, cos, sin, a.rot, d, turned);
        put(turned, d, k + h * w);
      }
    }
    for (int64_t h = 0; h < kv; ++h) put(row + (heads + kv + h) * d, d, v + h * w);
  }
}

// f(E{}) for the element type E of PageType page's rows: the one switch over the page types.
template <class F>
void by_page(int page, const F& f) {
  if (page == PAGE_BF16)
    f(uint16_t{});
  else if (page == PAGE_INT8)
    f(int8_t{});
  else
    f(float{});
}

}  // namespace

void QMM_LOCAL(argmax)(const float* x, int64_t n, int64_t r0, int64_t r1, int64_t* out) {
  for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x + r * n, n);
}

void QMM_LOCAL(norm)(const float* x, const float* w, int64_t h, float eps, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) norm_row(x + r * h, w, h, eps, out + r * h);
}

void QMM_LOCAL(silu_mul)(const float* gate_up, int64_t n, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, n, out + r * n);
}

void QMM_LOCAL(rope_write)(const RopeArgs& a, int64_t t0, int64_t t1) {
  by_page(a.page, [&](auto e) { rope_write_rows<decltype(e)>(a, t0, t1); });
}

void QMM_LOCAL(attend)(const AttendArgs& a, int64_t unit0, int64_t unit1, float* scratch) {
  const int64_t size = a.heads / a.kv_heads;
  for (int64_t u = unit0; u < unit1; ++u) {
    const int64_t part = u % a.parts, group = u / a.parts;  // a group's runs side by side, often on one thread
    const int64_t b0 = group / a.kv_heads * a.chunk, b1 = b0 + a.chunk < a.batch ? b0 + a.chunk : a.batch;
    const Chunk c{b0, b1, group % a.kv_heads, part * size / a.parts, (part + 1) * size / a.parts};
    by_page(a.page, [&](auto e) { attend_unit<decltype(e)>(a, c, scratch); });
  }
}

}  // namespace qmm
