// pagedchat's quantized matmul as a torch op: y = x @ W.T for W held as its GGUF blocks (qmm_level.cpp does the
// arithmetic). It picks the instruction-set level the caller names among those this library was built with and
// this CPU runs, and splits the weight's rows over torch's own threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <algorithm>
#include <atomic>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "qmm.h"

namespace qmm {
// Each level's entry points, where the build compiled it (weak: a level this compiler could not build is null).
#define QMM_LEVEL_DECLARE(symbol, name, label, base, flags, cpu) \
  extern const Level symbol __attribute__((weak, visibility("hidden")));
QMM_LEVELS(QMM_LEVEL_DECLARE)
#undef QMM_LEVEL_DECLARE
}  // namespace qmm

namespace {

// Panels (qmm.h): one row's block and its place in a panel's block, copied one way or the other, field by
// field in the file's order.
template <int T>
void move_block(uint8_t* file, uint8_t* panel, int64_t r, bool pack) {
  using B = qmm::PanelBlock<T>;
  const auto copy = [pack](uint8_t* f, uint8_t* p, int64_t bytes) {
    pack ? std::memcpy(p, f, bytes) : std::memcpy(f, p, bytes);
  };
  const auto f16 = [&](int64_t at) {
    copy(file, panel + at + 2 * r, 2);
    file += 2;
  };
  const auto chunks = [&](int64_t at, int64_t bytes) {
    for (int64_t c = 0; c < bytes / 4; ++c) copy(file + 4 * c, panel + at + 64 * c + 4 * r, 4);
    file += bytes;
  };
  if constexpr (T == qmm::Q6_K) {
    chunks(0, B::CODES);
    chunks(B::HIGH_AT, B::HIGH);
    chunks(B::SCALES_AT, B::SCALES);
    f16(B::D_AT);
    return;
  }
  f16(B::D_AT);
  if (B::MIN) f16(B::M_AT);
  chunks(B::SCALES_AT, B::SCALES);
  if (B::FIFTH) {  // bit 4 d + b of the file's 32 is bit d of byte b in the panel's
    uint8_t* dword = panel + B::HIGH_AT + 4 * r;
    uint32_t bits = 0;
    if (pack) {
      std::memcpy(&bits, file, 4);
      for (int b = 0; b < 4; ++b) {
        uint8_t byte = 0;
        for (int d = 0; d < 8; ++d) byte |= uint8_t(((bits >> (4 * d + b)) & 1) << d);
        dword[b] = byte;
      }
    } else {
      for (int b = 0; b < 4; ++b)
        for (int d = 0; d < 8; ++d) bits |= uint32_t((dword[b] >> d) & 1) << (4 * d + b);
      std::memcpy(file, &bits, 4);
    }
    file += 4;
  } else {
    chunks(B::HIGH_AT, B::HIGH);
  }
  chunks(0, B::CODES);
}

// Rows [n0, n1) of a weight's panels between rows (the same rows in the file's layout) and panels (the whole
// packed weight), one way or the other.
template <int T>
void move_rows(uint8_t* rows, uint8_t* panels, int64_t row_bytes, int64_t n0, int64_t n1, bool pack) {
  const int64_t bytes = qmm::block_shape(T).bytes, nb = row_bytes / bytes;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t r = n % qmm::PANEL_ROWS;
    uint8_t* panel = panels + (n - r) * row_bytes;
    for (int64_t j = 0; j < nb; ++j)
      move_block<T>(rows + (n - n0) * row_bytes + bytes * j, panel + qmm::PanelBlock<T>::BYTES * j, r, pack);
  }
}

void move(int type, uint8_t* rows, uint8_t* panels, int64_t row_bytes, int64_t n0, int64_t n1, bool pack) {
  qmm::by_type(type, [&](auto t) { move_rows<decltype(t)::type>(rows, panels, row_bytes, n0, n1, pack); });
}

// Rows [n0, n1) of a packed weight w back in the file's layout, into rows.
void unpack_rows(int type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, uint8_t* rows) {
  move(type, rows, const_cast<uint8_t*>(w), row_bytes, n0, n1, false);
}

// The rows of a weight that lie in panels: its whole panels.
int64_t panel_rows(int64_t rows) { return rows / qmm::PANEL_ROWS * qmm::PANEL_ROWS; }

// A row of QMM_LEVELS (qmm.h).
struct Entry {
  const qmm::Level* level;  // null where the build left the level out
  const char* name;
  const char* symbol;
  const char* base;  // its symbol; "none" for the baseline
  const char* cpu;   // /proc/cpuinfo's flags it needs besides its base's
};

#define QMM_LEVEL_ENTRY(symbol, name, label, base, flags, cpu) {&qmm::symbol, name, #symbol, #base, cpu},
const Entry ENTRIES[] = {QMM_LEVELS(QMM_LEVEL_ENTRY)};
#undef QMM_LEVEL_ENTRY

// /proc/cpuinfo's flags: what Linux says this CPU has and supports (the library is built on Linux only).
std::vector<std::string> cpu_flags() {
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    return {std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
  }
  return {};
}

// Whether the CPU has every flag of the level and of its bases.
bool has_flags(const Entry& e, const std::vector<std::string>& flags) {
  std::istringstream words(e.cpu);
  for (std::string word; words >> word;)
    if (std::find(flags.begin(), flags.end(), word) == flags.end()) return false;
  for (const auto& base : ENTRIES)
    if (std::strcmp(base.symbol, e.base) == 0) return has_flags(base, flags);
  return true;
}

// AMX's tiles also need Linux's leave to use their state, which a process asks for once
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) before its first tile instruction.
bool tiles_granted() {
#if defined(__x86_64__)
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
  return false;
#endif
}

// The levels this library holds and this CPU runs, best first: the ops take an index into them. Asked once.
const std::vector<const Entry*>& runnable() {
  static const std::vector<const Entry*> runs = [] {
    const auto flags = cpu_flags();
    std::vector<const Entry*> out;
    for (const auto& e : ENTRIES) {
      const bool tiles = std::string(e.cpu).find("amx_tile") != std::string::npos;
      if (e.level != nullptr && has_flags(e, flags) && (!tiles || tiles_granted())) out.push_back(&e);
    }
    return out;
  }();
  return runs;
}

// Their names.
std::vector<std::string> levels() {
  std::vector<std::string> names;
  for (const Entry* e : runnable()) names.emplace_back(e->name);
  return names;
}

const qmm::Level& level_at(int64_t index) {
  TORCH_CHECK(index >= 0 && index < int64_t(runnable().size()), "no kernel level ", index, " on this CPU");
  return *runnable()[size_t(index)]->level;
}

int64_t check_weight(const at::Tensor& w, int64_t type) {
  const auto [values, bytes] = qmm::block_shape(int(type));
  TORCH_CHECK(values > 0, "GGML type ", type, " is not one this kernel runs");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % bytes == 0,
              "the weight must be its GGUF blocks: contiguous uint8 [rows, blocks * ", bytes, "]");
  return w.size(1) / bytes * values;  // k
}

// A task's scratch, left unset: the levels write every byte they read, and zeroing a panel's worth on every
// call would be work in the hot path for nothing.
std::unique_ptr<uint8_t[]> scratch_for(int64_t k) {
  return std::unique_ptr<uint8_t[]>(new uint8_t[qmm::scratch_bytes(k)]);
}

// Activation rows quantized once for every weight they meet (qmm.h's Activations), held in one allocation: a
// decode layer quantizes four times, and at one row a tensor apiece for the codes, the scales, the sums and the
// rows an op makes just before was a visible part of the layer's call (docs/bench.md#a-decode-layers-allocations).
struct Quantized {
  at::Tensor buffer;
  qmm::Activations acts;
};

// Rows a task quantizes: a few thousand inputs, enough that waking a thread pays.
int64_t quantize_grain(int64_t k) { return std::max<int64_t>(1, (1 << 12) / k); }

// The activations' group for rows that meet the weights of these types (qmm.h's Activations).
int64_t group_for(const qmm::Level& lv, at::IntArrayRef types, int64_t k) {
  const bool all_k = std::all_of(types.begin(), types.end(), [](int64_t t) { return qmm::k_type(int(t)); });
  return all_k && k % lv.k_group == 0 ? lv.k_group : 32;
}

// m rows of k floats quantized, a scale per group inputs: xs where given; else each task first makes its rows in
// the buffer (make(b0, b1, rows): a norm's or silu_mul's output, in decode_layer), so that the op before a matmul
// and its quantization share one parallel loop and the rows are still in the core's cache when quantized.
template <typename Make>
Quantized quantize_made(const float* xs, int64_t m, int64_t k, int64_t group, const at::TensorOptions& options,
                        const qmm::Level& lv, const Make& make) {
  const auto at64 = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t wide = group == 256 ? k / 256 + k / 64 + k / 32 : 0;  // d256, sums2 and sums16
  const int64_t floats = at64(4 * (k / 32 + k / 16 + k / 32 + k / 16 + wide) * m);
  const int64_t made = xs == nullptr ? at64(4 * m * k) : 0;
  Quantized a{at::empty({floats + made + m * k}, options.dtype(at::kByte)), {}};
  uint8_t* base = a.buffer.data_ptr<uint8_t>();
  float* ds = reinterpret_cast<float*>(base);
  float *ss = ds + k / 32 * m, *s2 = ss + k / 16 * m;
  int32_t* o16 = reinterpret_cast<int32_t*>(s2 + k / 32 * m);
  auto* d256 = reinterpret_cast<float*>(o16 + k / 16 * m);
  auto* sums2 = reinterpret_cast<int32_t*>(d256 + k / 256 * m);
  int32_t* sums16 = sums2 + k / 64 * m;
  float* rows = made > 0 ? reinterpret_cast<float*>(base + floats) : nullptr;
  int8_t* qs = reinterpret_cast<int8_t*>(base + floats + made);
  at::parallel_for(0, m, quantize_grain(k), [&](int64_t b0, int64_t b1) {
    if (rows != nullptr) make(b0, b1, rows);
    lv.quantize(rows != nullptr ? rows : xs, b0, b1, m, k, group, qs, ds, ss, s2, d256, sums2, sums16, o16);
  });
  const bool wide_sums = group == 256;
  a.acts = qmm::Activations{qs, ds, ss, s2, k, m, group, wide_sums ? d256 : nullptr, wide_sums ? sums2 : nullptr,
                            wide_sums ? sums16 : nullptr, o16};
  return a;
}

// x: contiguous float32 [m, k], m > 0, quantized for weights of these types.
Quantized quantize_rows(const at::Tensor& x, const qmm::Level& lv, at::IntArrayRef types) {
  return quantize_made(x.data_ptr<float>(), x.size(0), x.size(1), group_for(lv, types, x.size(1)), x.options(), lv,
                       [](int64_t, int64_t, float*) {});
}

// Tasks take whole units of UNIT weight rows, so the levels' panels of 8 or 16 rows always start at the same
// rows: which rows share a panel, and so every output's rounding, must not depend on how the work is split
// (it would change with the number of activation rows).
constexpr int64_t UNIT = 16;
static_assert(UNIT % qmm::PANEL_ROWS == 0, "a task's rows must be whole panels");

// ys[i * ldy + n] = x_i . W_n for activation rows i and weight rows [n0, n1) of w, n0 a multiple of UNIT.
void matmul_rows(const qmm::Activations& acts, const at::Tensor& w, int64_t type, const qmm::Level& lv,
                 int64_t n0, int64_t n1, float* ys, int64_t ldy, uint8_t* scratch) {
  const uint8_t* ws = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), m = acts.m, split = std::clamp(panel_rows(w.size(0)), n0, n1);
  if (lv.matmul_panels != nullptr) {
    if (split > n0) lv.matmul_panels(int(type), ws, row_bytes, n0, split, acts, m, ys, ldy);
  } else {  // the portable level reads rows in the file's layout: a panel at a time, put back
    std::vector<uint8_t> rows(qmm::PANEL_ROWS * row_bytes);
    for (int64_t p = n0; p < split; p += qmm::PANEL_ROWS) {
      unpack_rows(int(type), ws, row_bytes, p, p + qmm::PANEL_ROWS, rows.data());
      lv.matmul(int(type), rows.data(), row_bytes, 0, qmm::PANEL_ROWS, acts, m, ys + p, ldy, scratch);
    }
  }
  lv.matmul(int(type), ws, row_bytes, split, n1, acts, m, ys, ldy, scratch);
}

// f(b0, b1, scratch) over [0, units) on torch's threads: each thread first runs its own share of the first
// three quarters, then claims runs of the rest as it goes, half the remaining over the threads and at least
// grain, so that the runs shrink towards the end. A thread slowed by other work, or holding the costlier rows (a
// Q6_K v beside Q4_K q and k), leaves the rest to the others instead of making them wait at the loop's end; the
// shares keep the claims, each an atomic step, few. Which thread runs a unit changes no result (UNIT).
template <typename F>
void claimed_units(int64_t units, int64_t grain, int64_t k, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain);
  const int64_t share = units * 3 / 4 / std::max<int64_t>(1, threads);
  std::atomic<int64_t> next{share * threads};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    const auto scratch = scratch_for(k);
    if (share > 0) f(t0 * share, t1 * share, scratch.get());
    for (int64_t b0 = next.load(std::memory_order_relaxed), run;;) {
      if (b0 >= units) return;
      run = std::min(units - b0, std::max(grain, (units - b0) / (2 * threads)));
      if (next.compare_exchange_weak(b0, b0 + run, std::memory_order_relaxed)) f(b0, b0 + run, scratch.get());
    }
  });
}

// ys = x @ [W_0; W_1; ...].T, the weights' outputs side by side in rows of ldy floats: one parallel loop over
// every weight's units, so that q, k and v of different types (say) cost one wait for the slowest thread, not
// one each.
void matmul_parts(const Quantized& a, at::TensorList ws, at::IntArrayRef types, const qmm::Level& lv, float* ys,
                  int64_t ldy) {
  const int64_t k = a.acts.k, m = a.acts.m;
  std::vector<int64_t> first_unit{0};  // each weight's first unit among all of them, then the total
  for (const auto& w : ws) first_unit.push_back(first_unit.back() + (w.size(0) + UNIT - 1) / UNIT);
  // Units per run: enough work that a split across threads pays for waking them.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, k * m * UNIT));
  claimed_units(first_unit.back(), grain, k, [&](int64_t b0, int64_t b1, uint8_t* scratch) {
    int64_t col = 0;
    for (size_t i = 0; i < ws.size(); col += ws[i].size(0), ++i) {
      const int64_t u0 = std::max(b0, first_unit[i]), u1 = std::min(b1, first_unit[i + 1]);  // this weight's
      if (u0 < u1)
        matmul_rows(a.acts, ws[i], types[i], lv, (u0 - first_unit[i]) * UNIT,
                    std::min((u1 - first_unit[i]) * UNIT, ws[i].size(0)), ys + col, ldy, scratch);
    }
  });
}

int64_t check_parts(at::TensorList ws, at::IntArrayRef types, int64_t k) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "one type per weight");
  int64_t n = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const int64_t inputs = check_weight(ws[i], types[i]);
    TORCH_CHECK(inputs == k, "x must be [rows, ", inputs, "]");
    n += ws[i].size(0);
  }
  return n;
}

// The quantized rows times the weights side by side, as a new float32 [m, n] tensor.
at::Tensor project(const Quantized& a, at::TensorList ws, at::IntArrayRef types, const qmm::Level& lv,
                   const at::TensorOptions& options) {
  const int64_t n = check_parts(ws, types, a.acts.k);
  auto y = at::empty({a.acts.m, n}, options);
  if (n > 0) matmul_parts(a, ws, types, lv, y.data_ptr<float>(), n);
  return y;
}

// x @ [W_0; W_1; ...].T: the weights' outputs side by side, the activations quantized once for all of them
// (q, k and v of different types, say). Each output is the one matmul of its weight alone would give.
at::Tensor matmul_cat(const at::Tensor& x_in, at::TensorList ws, at::IntArrayRef types, int64_t level) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [rows, inputs]");
  const int64_t n = check_parts(ws, types, x_in.size(1));
  const qmm::Level& lv = level_at(level);
  const auto x = x_in.to(at::kFloat).contiguous();
  auto y = x.size(0) > 0 && n > 0 ? project(quantize_rows(x, lv, types), ws, types, lv, x.options())
                                  : at::empty({x.size(0), n}, x.options());
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// The inputs per activation scale of rows that meet weights of these types, k inputs wide, at this level.
int64_t activation_group(at::IntArrayRef types, int64_t k, int64_t level) {
  return group_for(level_at(level), types, k);
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t level) {
  return matmul_cat(x, {w}, {type}, level);
}

// The file's blocks [rows, row bytes] -> the library's layout: panels (qmm.h).
at::Tensor pack(const at::Tensor& blocks, int64_t type) {
  check_weight(blocks, type);
  auto out = at::empty_like(blocks);
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1), paneled = panel_rows(rows);
  uint8_t *from = blocks.data_ptr<uint8_t>(), *to = out.data_ptr<uint8_t>();
  at::parallel_for(0, paneled / qmm::PANEL_ROWS, 16, [&](int64_t a, int64_t b) {
    const int64_t n0 = a * qmm::PANEL_ROWS;
    move(int(type), from + n0 * row_bytes, to, row_bytes, n0, b * qmm::PANEL_ROWS, true);
  });
  if (rows > paneled) std::memcpy(to + paneled * row_bytes, from + paneled * row_bytes, (rows - paneled) * row_bytes);
  return out;
}

// Rows ids of a weight in the library's layout, back in the file's: what dequantize and the embedding read.
at::Tensor unpack(const at::Tensor& w, int64_t type, const at::Tensor& ids_in) {
  check_weight(w, type);
  const auto ids = ids_in.to(at::kLong).contiguous();
  const int64_t rows = w.size(0), row_bytes = w.size(1), paneled = panel_rows(rows), count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row ", id[i], " of ", rows);
  auto out = at::empty({count, row_bytes}, w.options());
  uint8_t *from = w.data_ptr<uint8_t>(), *to = out.data_ptr<uint8_t>();
  at::parallel_for(0, count, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (id[i] < paneled) {
        unpack_rows(int(type), from, row_bytes, id[i], id[i] + 1, to + i * row_bytes);
      } else {
        std::memcpy(to + i * row_bytes, from + id[i] * row_bytes, row_bytes);
      }
    }
  });
  return out;
}

at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t level) {
  const int64_t k = check_weight(w, type);
  const qmm::Level& lv = level_at(level);
  auto out = at::empty({w.size(0), k}, w.options().dtype(at::kFloat));
  const uint8_t* ws = w.data_ptr<uint8_t>();
  float* os = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, w.size(0), 16, [&](int64_t a, int64_t b) {
    const auto scratch = scratch_for(k);
    lv.dequantize(int(type), ws + a * row_bytes, row_bytes, k, b - a, os + a * k, scratch.get());
  });
  return out;
}

// The kernels index the caches with these numbers unchecked, so they are checked here, as torch's own indexing
// ops check theirs: every page a sequence reads lies in the pool, and every context fits its table.
// Returns the most keys a sequence attends to.
int64_t check_pages(const at::Tensor& tables, const at::Tensor& lens, int64_t pages, int64_t block_size,
                    int64_t window) {
  const int32_t *table = tables.data_ptr<int32_t>(), *len = lens.data_ptr<int32_t>();
  const int64_t stride = tables.size(1);
  int64_t most = 0;
  for (int64_t b = 0; b < tables.size(0); ++b, table += stride) {
    TORCH_CHECK(len[b] >= 0 && len[b] <= stride * block_size, "sequence ", b, "'s context of ", len[b],
                " tokens does not fit its block table");
    const int64_t first = qmm::first_key(len[b], window);
    most = std::max<int64_t>(most, len[b] - first);
    for (int64_t p = first / block_size; p * block_size < len[b]; ++p)
      TORCH_CHECK(table[p] >= 0 && table[p] < pages, "sequence ", b, " reads page ", table[p], " of a pool of ",
                  pages);
  }
  return most;
}

// The PageType of caches [..., kv_heads, row] for heads of d: float32 or bfloat16 rows of d, or int8 rows of d codes
// and their scale (kernels/kv_pages.py), both caches alike and contiguous.
qmm::PageType page_type(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t d) {
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(type == v_cache.scalar_type() && (type == at::kFloat || type == at::kBFloat16 || type == at::kChar) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches must be contiguous float32, bfloat16 or int8, both alike");
  const auto page = type == at::kChar ? qmm::PAGE_INT8 : type == at::kBFloat16 ? qmm::PAGE_BF16 : qmm::PAGE_F32;
  TORCH_CHECK(k_cache.size(-1) == d + (page == qmm::PAGE_INT8 ? qmm::PAGE_SCALE_BYTES : 0),
              "the caches' rows do not match q's heads of ", d);
  return page;
}

// One decode step's attention straight from the pages (layer_level.cpp): q [batch, heads, head_dim], the caches
// [pages, block_size, kv_heads, row] (page_type), each sequence's block table and context length.
at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
                  int64_t level) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be [batch, heads, head_dim] and the caches [pages, block_size, kv_heads, head_dim]");
  const int64_t batch = q_in.size(0), heads = q_in.size(1), d = q_in.size(2), kv_heads = k_cache.size(2);
  const qmm::PageType page = page_type(k_cache, v_cache, d);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "q's heads do not match the caches'");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  context_lens.scalar_type() == at::kInt && context_lens.numel() == batch,
              "block_tables must be int32 [batch, pages] and context_lens int32 [batch]");
  const auto q = q_in.to(at::kFloat).contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t max_keys = check_pages(tables, lens, k_cache.size(0), k_cache.size(1), window);
  auto out = at::empty({batch, heads, d}, q.options());
  if (batch == 0) return out;
  // A unit takes a chunk of sequences side by side with one KV head, which then read a page they share once
  // (layer_level.cpp): chunks of one size, and at least two units a thread.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = std::min<int64_t>(batch, (2 * threads + kv_heads - 1) / kv_heads);
  const int64_t chunk = std::min<int64_t>(16, (batch + chunks - 1) / chunks);
  // Fewer units than that (a chat or two on a model of few KV heads, as the default model is): a group's query
  // heads split into runs, a unit each, or one thread takes two KV heads' work while another waits for it. Per
  // head the arithmetic is the same; the runs read the group's keys and values once each.
  const int64_t units = (batch + chunk - 1) / chunk * kv_heads;
  const int64_t parts = std::min<int64_t>(heads / kv_heads, (2 * threads + units - 1) / units);
  const qmm::AttendArgs args{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                             page, tables.data_ptr<int32_t>(), tables.size(1),
                             lens.data_ptr<int32_t>(), heads, kv_heads, d, k_cache.size(1), float(scale), window,
                             out.data_ptr<float>(), max_keys, batch, chunk, parts};
  const qmm::Level& lv = level_at(level);
  at::parallel_for(0, units * parts, 1, [&](int64_t a, int64_t b) {
    std::unique_ptr<float[]> scratch(new float[chunk * qmm::attend_scratch(args)]);
    lv.attend(args, a, b, scratch.get());
  });
  return q_in.scalar_type() == at::kFloat ? out : out.to(q_in.scalar_type());
}

// Rows a task takes in the row-wise ops: enough values that waking a thread pays.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, width)); }

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), what,
              " must be contiguous float32 [rows, width]");
}

void check_norm_weight(const at::Tensor& w, int64_t h) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == h, "w must be float32 [", h, "]");
}

// x / sqrt(mean(x^2) + eps) * w, row by row (layer_level.cpp).
at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t level) {
  check_rows(x, "x");
  const int64_t h = x.size(1);
  check_norm_weight(w, h);
  auto out = at::empty_like(x);
  const qmm::Level& lv = level_at(level);
  const float *xs = x.data_ptr<float>(), *ws = w.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), row_grain(h), [&](int64_t a, int64_t b) { lv.norm(xs, ws, h, float(eps), a, b, os); });
  return out;
}

// silu(gate) * up for gate_up [rows, 2 n] -> [rows, n].
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t level) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up side by side");
  const int64_t n = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), n}, gate_up.options());
  const qmm::Level& lv = level_at(level);
  const float* gs = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), row_grain(n), [&](int64_t a, int64_t b) { lv.silu_mul(gs, n, a, b, os); });
  return out;
}

// Each row's first index of its largest value, a NaN above every number: torch's max indices, for greedy picks
// over a vocabulary, where torch's reduction took a visible part of a step.
at::Tensor argmax_rows(const at::Tensor& x, int64_t level) {
  check_rows(x, "x");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const qmm::Level& lv = level_at(level);
  const float* xs = x.data_ptr<float>();
  int64_t* os = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t a, int64_t b) { lv.argmax(xs, n, a, b, os); });
  return out;
}

// q and k turned by the rotary table's rows, k and v written into the caches at slots; returns q [T, heads, D].
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t heads, int64_t kv_heads,
                      int64_t level) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t t = qkv.size(0);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "qkv must be [tokens, (heads + 2 kv_heads) * head_dim]");
  const int64_t d = qkv.size(1) / (heads + 2 * kv_heads);
  const qmm::PageType page = page_type(k_cache, v_cache, d);
  TORCH_CHECK(page == qmm::PAGE_F32 || d <= qmm::MAX_ENCODED_DIM, "heads of ", d, " dims are wider than ",
              qmm::MAX_ENCODED_DIM, ", the widest written into bfloat16 or int8 pages");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == t && cos.size(1) <= d && cos.size(1) % 2 == 0,
              "cos and sin must be [tokens, rotary dims]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == t,
              "slots must be int64 [tokens]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(-2) == kv_heads,
              "the caches must be [..., kv_heads, row], both alike");
  const int64_t capacity = k_cache.numel() / (kv_heads * k_cache.size(-1)), *slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "slot ", slot[i], " lies outside a cache of ", capacity);
  auto q = at::empty({t, heads, d}, qkv.options());
  const qmm::RopeArgs args{qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1),
                           slots.data_ptr<int64_t>(), k_cache.data_ptr(), v_cache.data_ptr(), page,
                           heads, kv_heads, d, q.data_ptr<float>()};
  const qmm::Level& lv = level_at(level);
  // A few rows a task: a row's key and value go to a page anywhere in the pool, and those stores, not the
  // arithmetic, are most of its time, so threads pay at far fewer values than row_grain's.
  at::parallel_for(0, t, 4, [&](int64_t a, int64_t b) { lv.rope_write(args, a, b); });
  return q;
}

// The ops before a decode layer's matmuls, each fused with the quantization of its output (quantize_made): the
// same functions on the same rows, so the same numbers as norm, silu_mul and matmul_cat one after another.

// x += y for rows [b0, b1) of h floats: torch's float add, a + b rounded once.
void add_rows(float* xs, const float* ys, int64_t h, int64_t b0, int64_t b1) {
  for (int64_t i = b0 * h; i < b1 * h; ++i) xs[i] += ys[i];
}

// norm(x) * w quantized for weights of these types; where y is given, x += y in place first (add_rows).
Quantized normed(at::Tensor& x, const at::Tensor* y, const at::Tensor& w, double eps, const qmm::Level& lv,
                 at::IntArrayRef types) {
  const int64_t h = x.size(1);
  check_norm_weight(w, h);
  float* xs = x.data_ptr<float>();
  const float *ys = y != nullptr ? y->data_ptr<float>() : nullptr, *ws = w.data_ptr<float>();
  return quantize_made(nullptr, x.size(0), h, group_for(lv, types, h), x.options(), lv,
                       [&](int64_t b0, int64_t b1, float* out) {
    if (ys != nullptr) add_rows(xs, ys, h, b0, b1);
    lv.norm(xs, ws, h, float(eps), b0, b1, out);
  });
}

// silu(gate) * up quantized for weights of these types, for gate_up [rows, 2 n].
Quantized silu_quantized(const at::Tensor& gate_up, const qmm::Level& lv, at::IntArrayRef types) {
  const int64_t n = gate_up.size(1) / 2;
  const float* gs = gate_up.data_ptr<float>();
  return quantize_made(nullptr, gate_up.size(0), n, group_for(lv, types, n), gate_up.options(), lv,
                       [&](int64_t b0, int64_t b1, float* out) { lv.silu_mul(gs, n, b0, b1, out); });
}

// One decoder layer of a decode step, in llama's order, as one call (model/llama.py's fused layers): the same
// ops as the per-op path, so the same numbers, without a Python call and a dispatch per op, and with each op
// before a matmul sharing its quantization's parallel loop. x [T, hidden], the residual stream, is updated in
// place. weights: the two norms' weights, then the panels of qkv's, o's, gate_up's and down's parts; types: each
// part's GGML type, in the same order; parts: how many parts each projection has.
void decode_layer(at::Tensor& x, at::TensorList weights, at::IntArrayRef types, at::IntArrayRef parts, double eps,
                  const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, int64_t heads, int64_t kv_heads, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, double scale, int64_t window, int64_t level) {
  TORCH_CHECK(parts.size() == 4 && types.size() + 2 == weights.size(), "weights: two norms and the projections' "
              "parts; types: one per part; parts: the counts of qkv, o, gate_up and down");
  check_rows(x, "x");
  const qmm::Level& lv = level_at(level);
  size_t first[5] = {0};  // each projection's first part
  for (size_t i = 0; i < 4; ++i) {
    TORCH_CHECK(parts[i] > 0 && first[i] + size_t(parts[i]) <= types.size(), "parts do not add up to the weights");
    first[i + 1] = first[i] + size_t(parts[i]);
  }
  const auto types_of = [&](int64_t which) { return types.slice(first[which], size_t(parts[which])); };
  const auto times = [&](const Quantized& a, int64_t which) {
    return project(a, weights.slice(2 + first[which], size_t(parts[which])), types_of(which), lv, x.options());
  };
  const auto q = rope_write(times(normed(x, nullptr, weights[0], eps, lv, types_of(0)), 0), cos, sin, slots, k_cache,
                            v_cache, heads, kv_heads, level);
  const auto attn = attend(q, k_cache, v_cache, block_tables, context_lens, scale, window, level);
  const auto o = times(quantize_rows(attn.view({x.size(0), -1}), lv, types_of(1)), 1);
  const auto gate_up = times(normed(x, &o, weights[1], eps, lv, types_of(2)), 2);
  // The residual add in a loop of the library's: at one row, torch's add_ took longer than the step's norm there
  // (docs/bench.md#one-chats-layer-where-the-time-goes).
  const auto down = times(silu_quantized(gate_up, lv, types_of(3)), 3);
  float* xs = x.data_ptr<float>();
  const float* ds = down.data_ptr<float>();
  const int64_t h = x.size(1);
  at::parallel_for(0, x.size(0), row_grain(h), [&](int64_t b0, int64_t b1) { add_rows(xs, ds, h, b0, b1); });
}

}  // namespace

TORCH_LIBRARY(pagedchat_qmm, m) {
  m.def("levels() -> str[]", &levels);
  m.def("matmul(Tensor x, Tensor w, int type, int level) -> Tensor", &matmul);
  m.def("matmul_cat(Tensor x, Tensor[] ws, int[] types, int level) -> Tensor", &matmul_cat);
  m.def("activation_group(int[] types, int k, int level) -> int", &activation_group);
  m.def("pack(Tensor blocks, int type) -> Tensor", &pack);
  m.def("unpack(Tensor w, int type, Tensor ids) -> Tensor", &unpack);
  m.def("dequantize(Tensor w, int type, int level) -> Tensor", &dequantize);
  m.def("attend(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window, int level) -> Tensor",
        &attend);
  m.def("norm(Tensor x, Tensor w, float eps, int level) -> Tensor", &norm);
  m.def("silu_mul(Tensor gate_up, int level) -> Tensor", &silu_mul);
  m.def("argmax_rows(Tensor x, int level) -> Tensor", &argmax_rows);
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int heads, int kv_heads, int level) -> Tensor",
        &rope_write);
  m.def("decode_layer(Tensor(a!) x, Tensor[] weights, int[] types, int[] parts, float eps, Tensor cos, Tensor sin, "
        "Tensor slots, Tensor(b!) k_cache, Tensor(c!) v_cache, int heads, int kv_heads, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, int level) -> ()",
        &decode_layer);
}
