// What qmm_torch.cpp (the torch op, compiled once) and qmm_level.cpp (compiled once per instruction-set level)
// share. Each level is the same source built with other compiler flags; the op picks one at run time.
#pragma once

#include <stdint.h>

namespace qmm {

// GGML's type ids: a weight tensor is its GGUF blocks, row by row, as the file holds them.
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Activation rows quantized per 32 inputs, as llama.cpp's Q8_0 does: int8 codes q, the block's scale d written
// 8 times (one per SIMD lane of the block), and d * (sum of the codes) per 16 inputs, which turns a weight's
// per-block offset into one multiply (s32 the same per 32, for weights with one offset per block). The sums are
// stored by column, so that one load holds a block's sums for several activation rows.
struct Activations {
  const int8_t* q;    // [m][k]
  const float* d8;    // [m][k / 4]
  const float* s16;   // [k / 16][m]
  const float* s32;   // [k / 32][m]
  int64_t k, m;
};

struct Level {
  const char* name;
  // Rows [i0, i1) of x [m][k] float32 -> the Activations arrays.
  void (*quantize)(const float* x, int64_t i0, int64_t i1, int64_t m, int64_t k, int8_t* q, float* d8, float* s16,
                   float* s32);
  // y[i * ldy + n] = x_i . W_n for weight rows n in [n0, n1) and every activation row i. scratch holds
  // scratch_bytes(k) bytes: one weight row decoded, or a panel of 8 or 16 (qmm_level.cpp).
  void (*matmul)(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x,
                 int64_t m, float* y, int64_t ldy, uint8_t* scratch);
  // rows weight rows, dequantized exactly (the file's d * q + m in float32) into out [rows][k].
  void (*dequantize)(int type, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t rows, float* out,
                     uint8_t* scratch);
};

inline int64_t scratch_bytes(int64_t k) { return 24 * k + 256; }

// 0 where the type is not one of Type's.
int64_t block_values(int type);
int64_t block_bytes(int type);

// One per level this library was built with (QMM_LEVEL_* in the build); portable is always there.
extern const Level portable;
extern const Level avx2;
extern const Level avx2_vnni;
extern const Level avx512;
extern const Level avx512_vnni;

}  // namespace qmm
