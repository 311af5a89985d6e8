// What qmm_torch.cpp (the torch op, compiled once) and the level files (qmm_level.cpp and layer_level.cpp, compiled
// once per instruction-set level) share. Each level is the same sources built with other compiler flags; the op
// picks one at run time.
//
// The inline rule: the linker keeps one copy of a function with vague linkage (an inline function or a template
// with external linkage, the standard library's included), maybe the copy built for a wider level than the CPU
// has. So every function and template defined in a header the level files include lies in an anonymous namespace
// (each file keeps its own copy, built with its own flags), and the level files include no standard-library header;
// tests/model/test_kernel_rules.py checks that no level's object defines such a symbol.
#pragma once

#include <stdint.h>

// The two lists of the library, one table each. qmm.py reads them from this file's text (it needs the flags
// before there is a library to ask, and the types where no compiler is): literals and names only.
//
// GGML's types that the kernels run: X(name, GGML id, values per block, bytes per block). A weight tensor is its
// GGUF blocks, row by row, as the file holds them.
#define QMM_TYPES(X)      \
  X(Q4_0, 2, 32, 18)      \
  X(Q4_1, 3, 32, 20)      \
  X(Q5_0, 6, 32, 22)      \
  X(Q5_1, 7, 32, 24)      \
  X(Q8_0, 8, 32, 34)      \
  X(Q4_K, 12, 256, 144)   \
  X(Q5_K, 13, 256, 176)   \
  X(Q6_K, 14, 256, 210)

// The instruction-set levels, best first: X(symbol, name, label, base, flags, cpu). symbol names it in C++
// (qmm::avx512_vnni, attend_avx512_vnni), name in PAGEDCHAT_KERNEL, label for people. A level is its base's
// compiler flags and CPU flags and more: flags, the compiler's, and cpu, /proc/cpuinfo's. portable, the base of
// all, is plain C++ for any architecture; the others are x86-64's.
#define QMM_LEVELS(X)                                                                                            \
  X(amx, "amx", "AMX + AVX-512 VNNI", avx512_vnni, "-mamx-tile -mamx-int8", "amx_tile amx_int8")                \
  X(avx512_vnni, "avx512-vnni", "AVX-512 VNNI", avx512, "-mavx512vnni", "avx512_vnni")                           \
  X(avx512, "avx512", "AVX-512", avx2, "-mavx512f -mavx512bw -mavx512vl -mavx512dq",                             \
    "avx512f avx512bw avx512vl avx512dq")                                                                        \
  X(avx2_vnni, "avx2-vnni", "AVX2 VNNI", avx2, "-mavxvnni", "avx_vnni")                                          \
  X(avx2, "avx2", "AVX2", portable, "-mavx2 -mfma -mf16c", "avx2 fma f16c")                                      \
  X(portable, "portable", "portable C++", none, "", "")

namespace qmm {

#define QMM_TYPE_ENUM(name, id, values, bytes) name = id,
enum Type : int { QMM_TYPES(QMM_TYPE_ENUM) };
#undef QMM_TYPE_ENUM

namespace {
// f(Tag<T>{}) for a type id: the one switch over the types, for every entry point.
template <int T>
struct Tag {
  static constexpr int type = T;
};

template <class F>
void by_type(int type, F f) {
#define QMM_TYPE_CASE(name, id, values, bytes) \
  case name:                                   \
    f(Tag<name>{});                            \
    break;
  switch (type) {
    QMM_TYPES(QMM_TYPE_CASE)
    default: break;
  }
#undef QMM_TYPE_CASE
}

// A type's block: its values and bytes ({0, 0} where the type is not one of Type's).
struct BlockShape {
  int64_t values, bytes;
};
constexpr BlockShape block_shape(int type) {
#define QMM_TYPE_SHAPE(name, id, values, bytes) \
  if (type == name) return {values, bytes};
  QMM_TYPES(QMM_TYPE_SHAPE)
#undef QMM_TYPE_SHAPE
  return {0, 0};
}

constexpr bool k_type(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
}  // namespace

// Every type is held in panels of PANEL_ROWS weight rows (pack() in qmm_torch.cpp), laid out so that a SIMD
// level reads 4 bytes of every row of the panel in one load, the layout of llama.cpp's repacked x86 kernels,
// with nothing rearranged per call. A panel's bytes are its rows' blocks reordered, so the weights keep the
// file's size. Per file block (32 inputs, 256 for the K types) a panel holds PanelBlock<T>::BYTES, 16 blocks'
// worth, each field of the file's block in one of these forms:
//  - bytes in chunks of 64: chunk c holds bytes 4c..4c+3 of the field of every row, row r's at 4r: the codes (at
//    0), Q5_K's fifth bits and Q6_K's high bits (at HIGH_AT), the K types' sub-block scales (at SCALES_AT);
//  - f16 values, 16 of them, row r's at 2r: the scale d (at D_AT), the minimum or dmin (at M_AT);
//  - Q5_0 and Q5_1's fifth bits (32 a block) in one chunk at HIGH_AT, reordered: in row r's dword, bit d of
//    byte b is the fifth bit of the code whose low bits dword d of the nibbles holds in byte b (code 4 d + b).
// Rows after the last whole panel keep the file's layout.
constexpr int64_t PANEL_ROWS = 16;

namespace {
template <int T>
struct PanelBlock {
  static constexpr bool K = k_type(T);
  static constexpr bool MIN = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K;
  static constexpr bool FIFTH = T == Q5_0 || T == Q5_1;  // the reordered fifth bits
  // Bytes per row and file block of each field.
  static constexpr int64_t CODES = T == Q8_0 ? 32 : K ? 128 : 16;
  static constexpr int64_t HIGH = FIFTH ? 4 : T == Q5_K ? 32 : T == Q6_K ? 64 : 0;
  static constexpr int64_t SCALES = T == Q6_K ? 16 : K ? 12 : 0;
  static constexpr int64_t HIGH_AT = PANEL_ROWS * CODES, SCALES_AT = HIGH_AT + PANEL_ROWS * HIGH,
                           D_AT = SCALES_AT + PANEL_ROWS * SCALES, M_AT = D_AT + 2 * PANEL_ROWS,
                           BYTES = M_AT + (MIN ? 2 * PANEL_ROWS : 0);
};
}  // namespace

// Activation rows quantized per 32 inputs, as llama.cpp's Q8_0 does: int8 codes q, the block's scale d, and d *
// (sum of the codes) per 16 inputs, which turns a weight's per-block offset into one multiply (s32 the same per
// 32, for weights with one offset per block). Everything is stored block by block, the rows of a block side by
// side: a tile's rows then lie at fixed offsets from one address, which a tile of many rows needs to keep its
// sums in registers (with a pointer per row, the addresses spilled), and one load holds a block's sums for
// several rows.
//
// Rows that meet only K-type weights may be quantized per 256 inputs instead (group 256, llama.cpp's q8_K), on the
// levels whose panels apply those types' sub-block scales in integers (Level::k_group): one scale per 256, which
// d32 then repeats for each of its blocks, so that every kernel reads such rows as it reads the others. The
// panels that sum in integers read d256 and the codes' sums as int16 pairs: sums2 those of blocks 2p and 2p + 1
// (against Q4_K and Q5_K's minimums), sums16 those of block j's two halves (against Q6_K's scales).
//
// At every group, o16 holds -32 times the codes' sums per 16 inputs: Q6_K's offset, -32 times a unit's scale, is
// exact in integers, so the panels add it to a unit's dot before its one multiply-add.
struct Activations {
  const int8_t* q;    // [k / 32][m][32]
  const float* d32;   // [k / 32][m]
  const float* s16;   // [k / 16][m]
  const float* s32;   // [k / 32][m]
  int64_t k, m;
  int64_t group;         // inputs per scale: 32, or 256
  const float* d256;     // [k / 256][m], group 256 only
  const int32_t* sums2;   // [k / 64][m], group 256 only
  const int32_t* sums16;  // [k / 32][m], group 256 only
  const int32_t* o16;     // [k / 16][m]
};

namespace {
// Bytes from a row's codes of a block to the next row's (a block's 32 codes): the stride of a tile of rows.
constexpr int64_t CODES_STRIDE = 32;
// Row i's codes of block j, and their scale.
inline const int8_t* codes_at(const Activations& x, int64_t i, int64_t j) {
  return x.q + CODES_STRIDE * (j * x.m + i);
}
inline const float* scale_at(const Activations& x, int64_t i, int64_t j) { return x.d32 + j * x.m + i; }
}  // namespace

// The KV pages' element types (kernels/kv_pages.py). An int8 row of a token's KV head is head_dim codes, then its
// float32 scale's 4 bytes.
enum PageType : int { PAGE_F32 = 0, PAGE_BF16 = 1, PAGE_INT8 = 2 };
constexpr int64_t PAGE_SCALE_BYTES = 4;
// The widest head whose keys rope_write turns into pages other than float32's (through a row on the stack).
constexpr int64_t MAX_ENCODED_DIM = 1024;

// One decode step's attention over paged K/V (layer_level.cpp): q [batch][heads][head_dim] float32, the caches
// [pages][block_size][kv_heads][row] of PageType page (row: head_dim, and an int8 row's scale), out like q.
struct AttendArgs {
  const float* q;
  const void* k;
  const void* v;
  int page;  // PageType
  const int32_t* block_tables;  // [batch][table_stride]
  int64_t table_stride;
  const int32_t* context_lens;  // [batch]: the keys each sequence attends to, its new one included
  int64_t heads, kv_heads, head_dim, block_size;
  float scale;
  int64_t window;  // a query sees its last `window` keys only; 0: all of them
  float* out;
  int64_t max_keys;  // the most keys any sequence attends to (its window's, or its context)
  int64_t batch;     // the sequences
  int64_t chunk;     // the sequences a unit takes: consecutive ones, each with the unit's KV head
  int64_t parts;     // the runs of a group's query heads a unit takes one of (1: the whole group)
};

// One step's rotary turn of q and k, with k and v written into the caches (layer_level.cpp).
struct RopeArgs {
  const float* qkv;     // [tokens][(heads + 2 * kv_heads) * head_dim]: q, k, v side by side
  const float* cos;     // [tokens][rot], sin's first half negated (the model's rope_table)
  const float* sin;
  int64_t rot;          // the rotary dims: the leading rot of each head turn, the rest are copied
  const int64_t* slots; // [tokens]: page * block_size + offset
  void* k_cache;        // [slots][kv_heads][row] of PageType page, as AttendArgs' caches
  void* v_cache;
  int page;             // PageType
  int64_t heads, kv_heads, head_dim;
  float* q;             // [tokens][heads][head_dim], turned
};

namespace {
// The first key a sequence of len keys attends to: its window's first, or its first.
inline int64_t first_key(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

// A sequence's scratch for attend, in floats: its scores per query head of a group, each row rounded up to whole
// vectors of 8, then a float per head. A task needs a chunk's worth.
inline int64_t attend_scratch_row(const AttendArgs& a) { return (a.max_keys + 7) / 8 * 8; }
inline int64_t attend_scratch(const AttendArgs& a) { return (attend_scratch_row(a) + 1) * (a.heads / a.kv_heads); }
}  // namespace

// A name local to the level being compiled: attend_avx2, ...
#define QMM_JOIN2(a, b) a##_##b
#define QMM_JOIN(a, b) QMM_JOIN2(a, b)
#define QMM_LOCAL(name) QMM_JOIN(name, QMM_SYMBOL)

// A level's entry points. Its name and CPU check are its row of QMM_LEVELS, in qmm_torch.cpp.
struct Level {
  // Rows [i0, i1) of x [m][k] float32 -> the Activations arrays, a scale per group inputs (d256, sums2 and
  // sums16 only for group 256, o16 for every group).
  void (*quantize)(const float* x, int64_t i0, int64_t i1, int64_t m, int64_t k, int64_t group, int8_t* q,
                   float* d32, float* s16, float* s32, float* d256, int32_t* sums2, int32_t* sums16, int32_t* o16);
  // y[i * ldy + n] = x_i . W_n for weight rows n in [n0, n1) and every activation row i. scratch holds
  // scratch_bytes(k) bytes: one weight row decoded (the portable level; the SIMD levels need none).
  void (*matmul)(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Activations& x,
                 int64_t m, float* y, int64_t ldy, uint8_t* scratch);
  // matmul for weight rows [n0, n1) held in panels (PANEL_ROWS divides n0 and n1), w the whole packed weight;
  // null on the portable level, which reads each row back in the file's layout. matmul itself serves weights in
  // the file's layout: the rows after the last whole panel.
  void (*matmul_panels)(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                        const Activations& x, int64_t m, float* y, int64_t ldy);
  // rows weight rows, dequantized exactly (the file's d * q + m in float32) into out [rows][k].
  void (*dequantize)(int type, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t rows, float* out,
                     uint8_t* scratch);
  // Units [u0, u1) of (chunk of a.chunk sequences, KV head), unit = chunk * kv_heads + head, each sequence with
  // every query head of its group. scratch: a.chunk * attend_scratch(a) floats.
  void (*attend)(const AttendArgs& a, int64_t u0, int64_t u1, float* scratch);
  // Rows [r0, r1) of x [rows][h]: x / sqrt(mean(x^2) + eps) * w.
  void (*norm)(const float* x, const float* w, int64_t h, float eps, int64_t r0, int64_t r1, float* out);
  // Rows [r0, r1) of gate_up [rows][2 n]: silu(gate) * up, into out [rows][n].
  void (*silu_mul)(const float* gate_up, int64_t n, int64_t r0, int64_t r1, float* out);
  // Tokens [t0, t1) of a step (RopeArgs).
  void (*rope_write)(const RopeArgs& a, int64_t t0, int64_t t1);
  // Rows [r0, r1) of x [rows][n]: each row's first index of its largest value, a NaN above every number (the
  // index torch's max gives).
  void (*argmax)(const float* x, int64_t n, int64_t r0, int64_t r1, int64_t* out);
  // The activations' group for rows that meet only K-type weights: 256 where the panels sum the K types with
  // integer sub-block scales, else 32.
  int64_t k_group;
};

namespace {
inline int64_t scratch_bytes(int64_t k) { return 2 * k + 128; }
}  // namespace

}  // namespace qmm
