// y = x @ W.T for W in torch's CPU int4 packed layout: each weight tile dequantized once per call.
//
// It reads exactly what torch's `_weight_int4pack_mm_for_cpu` reads (the same packed tiles and bf16 scale/zero
// pairs: no second copy of the weights) and spends the work differently. torch's kernel unpacks and scales each
// weight tile again for every 4 rows. Here a tile's group of 32 inputs is dequantized once, (q - 8) * scale +
// zero in fp32 as torch computes it, into a buffer that stays in L1, and every row is multiplied against it with
// fp32 FMAs, 6 rows at a time. A doubled weight (Q8_0 as two int4 halves over [x | x]) has its halves summed
// there, so it costs one K-wide pass instead of two.
//
// Built on the user's machine (pagedchat/model/int4_kernel.py) with -march=native; without AVX-512 it is not
// built, and torch's kernel serves.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "this kernel needs AVX-512 F and BW"
#endif

namespace {

constexpr int64_t BLOCK = 64;  // output channels per packed tile (torch's layout with AVX-512)
constexpr int64_t GROUP = 32;  // inputs per scale and zero
constexpr int ROWS = 6;        // rows multiplied at once: 6 x 4 accumulators stay in registers

struct Group {
  alignas(64) float w[GROUP][BLOCK];  // one group of one tile, dequantized: [input][channel]
};

// tile: the tile's bytes at a group's first input ([GROUP][BLOCK / 2]: byte j has channel j's code in its low
// nibble and channel j + 32's in its high one). pairs: the group's [BLOCK][2] bf16 (scale, zero).
// add: sum into what w holds (a doubled weight's second half).
void dequantize(const uint8_t* tile, const uint16_t* pairs, Group& g, bool add) {
  __m512 scale[4], zero[4];
  for (int v = 0; v < 4; ++v) {  // each 32-bit lane: scale in the low half, zero in the high one
    __m512i sz = _mm512_loadu_si512(pairs + 32 * v);
    scale[v] = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
    zero[v] = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i eight = _mm512_set1_epi32(8);
  for (int64_t k = 0; k < GROUP; ++k) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + k * (BLOCK / 2)));
    __m256i low = _mm256_and_si256(raw, nibble), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    __m128i codes[4] = {_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1),
                        _mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)};
    for (int v = 0; v < 4; ++v) {
      __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes[v]), eight));
      __m512 w = _mm512_fmadd_ps(q, scale[v], zero[v]);
      float* out = g.w[k] + 16 * v;
      _mm512_store_ps(out, add ? _mm512_add_ps(_mm512_load_ps(out), w) : w);
    }
  }
}

// out[r][0..63] += sum over the group's inputs of x[r][k] * w[k][..] for R rows; x[r] points at the group's
// first input.
template <int R>
void multiply(const Group& g, const float* const* x, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_loadu_ps(out + r * BLOCK + 16 * v);
  for (int64_t k = 0; k < GROUP; ++k) {
    __m512 w[4];
    for (int v = 0; v < 4; ++v) w[v] = _mm512_load_ps(g.w[k] + 16 * v);
    for (int r = 0; r < R; ++r) {
      __m512 xk = _mm512_set1_ps(x[r][k]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(xk, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + r * BLOCK + 16 * v, acc[r][v]);
}

using Multiply = void (*)(const Group&, const float* const*, float*);
constexpr Multiply MULTIPLY[ROWS + 1] = {nullptr,     multiply<1>, multiply<2>, multiply<3>,
                                         multiply<4>, multiply<5>, multiply<6>};

// x: [M, Kx] bf16; packed: torch's int4 layout of W [N, K]; scale_zeros: [K / 32, N, 2] bf16. doubled: K = 2 Kx,
// and the weight's two halves are summed (the input would be [x | x]).
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zeros, bool doubled) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  TORCH_CHECK(scale_zeros.dim() == 3 && scale_zeros.size(2) == 2 && scale_zeros.scalar_type() == at::kBFloat16 &&
                  scale_zeros.is_contiguous(),
              "scale_zeros: contiguous bf16 [K / 32, N, 2]");
  const int64_t M = x.size(0), kx = x.size(1), groups = scale_zeros.size(0), N = scale_zeros.size(1);
  TORCH_CHECK(kx % GROUP == 0 && groups * GROUP == (doubled ? 2 * kx : kx), "x's width does not match the weight's");
  TORCH_CHECK(N % BLOCK == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == N * groups * GROUP / 2,
              "packed: torch's int4 layout of a [N, K] weight, N a multiple of 64");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;

  const auto xf = x.to(at::kFloat).contiguous();
  const float* xs = xf.data_ptr<float>();
  const int64_t K = groups * GROUP, x_groups = kx / GROUP;
  const auto* codes = packed.data_ptr<uint8_t>();
  const auto* pairs = reinterpret_cast<const uint16_t*>(scale_zeros.data_ptr<at::BFloat16>());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / BLOCK, 1, [&](int64_t first, int64_t last) {
    Group g;
    std::vector<float> out(M * BLOCK);
    const float* rows[ROWS];
    for (int64_t t = first; t < last; ++t) {
      std::fill(out.begin(), out.end(), 0.f);
      for (int64_t gx = 0; gx < x_groups; ++gx) {
        dequantize(codes + (t * K + gx * GROUP) * (BLOCK / 2), pairs + (gx * N + t * BLOCK) * 2, g, false);
        if (doubled) {
          const int64_t lo = gx + x_groups;
          dequantize(codes + (t * K + lo * GROUP) * (BLOCK / 2), pairs + (lo * N + t * BLOCK) * 2, g, true);
        }
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
          const int n = int(std::min<int64_t>(ROWS, M - m0));
          for (int r = 0; r < n; ++r) rows[r] = xs + (m0 + r) * kx + gx * GROUP;
          MULTIPLY[n](g, rows, out.data() + m0 * BLOCK);
        }
      }
      for (int64_t m = 0; m < M; ++m)  // to bf16, rounding to nearest even as torch does
        for (int64_t c = 0; c < BLOCK; ++c) {
          ys[m * N + t * BLOCK + c] = c10::BFloat16(out[m * BLOCK + c]).x;
        }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(pagedchat, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor scale_zeros, bool doubled) -> Tensor", &int4_mm);
}
