// wafer::w8a8_linear: y = (round(x / sx) @ Wq^T) * sx * sw with sx = max|x_row| / 127 per input
// row, float32 in and out, the same arithmetic as `DynamicInt8Linear`'s torch path, so every
// variant gives bit-identical results (the integer sums are exact in any order).
//
// The int8 weights come packed in panels (`quantize.pack_vnni`) of 64 output columns, each
// panel's bytes in k order, 4 input bytes of each column together:
// panel[p][k / 4][c][k % 4] = W[64 p + c][k]. A 64-byte AVX-512 vector holds 16 columns' 4 bytes,
// so one `vpdpbusd` adds 4 products into each of 16 column sums: the sums come out as vectors of
// outputs (no horizontal reductions), and a panel streams from memory in one linear pass. Columns
// past the weight's last row are zero weights, computed and never stored; input bytes past k are
// zero weights too.
//
// Variants (cpu_features.h), chosen at each call: avx512_vnni (below), avx2_vnni and avx2
// (w8a8_avx2.inc, the same panels as 8-column vectors), portable (plain C++ over the panels).
// In the AVX-512 variant up to 6 activation rows run against a panel's 4 column vectors at once
// (24 accumulators); more rows run in balanced blocks of at most 6 over the panel, held in cache,
// while the next panel is prefetched. Every variant splits the panels between the threads, except
// for one row, whose weights are cut into even ranges of k-quads (`row_split`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "step_parts.h"

#if WAFER_X86
#include <immintrin.h>
#endif

namespace {

using wafer::Isa;

constexpr int64_t kPanelCols = 64;        // 4 AVX-512 vectors of 16 output columns
constexpr int64_t kQuadBytes = 256;       // one k-quad of a panel: 64 columns x 4 input bytes
constexpr int64_t kMaxBlockRows = 6;      // 6 rows x 4 vectors: 24 of the 32 vector registers
// Software prefetch this far ahead in the panel being streamed (one block of rows per panel).
constexpr int64_t kPrefetchBytes = 4096;
// The variants, best first.
constexpr Isa kLevels[] = {wafer::kAvx512Vnni, wafer::kAvx2Vnni, wafer::kAvx2};

// Quantizes one row exactly as the torch path does: sx = max|x| / 127 (at least 1e-12), then
// round(x / sx) half to even, clamped to [-127, 127]. Returns sx. (The rounding mode is the
// default, round to nearest even, for std::nearbyint as for the vector instructions.)
float quantize_row_portable(const float* x, int64_t k, int8_t* out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float sx = std::max(amax / 127.0f, 1e-12f);
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / sx))));
  return sx;
}

// One row's integer sums over quads [g0, g1) of a panel, signed (`run_panel_portable`, `row_split`).
void row_part_portable(const int8_t* x, const int8_t* panel, int64_t g0, int64_t g1, int32_t* raw) {
  std::fill(raw, raw + kPanelCols, 0);
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* wq = panel + g * kQuadBytes;
    const int32_t x0 = x[4 * g], x1 = x[4 * g + 1], x2 = x[4 * g + 2], x3 = x[4 * g + 3];
    for (int64_t c = 0; c < kPanelCols; ++c)
      raw[c] += x0 * wq[4 * c] + x1 * wq[4 * c + 1] + x2 * wq[4 * c + 2] + x3 * wq[4 * c + 3];
  }
}

// The portable variant: all m rows (signed int8) against panel p.
void run_panel_portable(const int8_t* xq, int64_t kp, const float* sx, int64_t m, const int8_t* w, int64_t kq,
                        int64_t p, const float* ws, float* y, int64_t n) {
  const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, n - c0);
  int32_t acc[kPanelCols];
  for (int64_t i = 0; i < m; ++i) {
    row_part_portable(xq + i * kp, w + p * kq * kQuadBytes, 0, kq, acc);
    for (int64_t c = 0; c < cols; ++c) y[i * n + c0 + c] = static_cast<float>(acc[c]) * (sx[i] * ws[c0 + c]);
  }
}

#if WAFER_X86

namespace avx512 {

// quantize_row_portable with AVX-512.
__attribute__((target("avx512f,avx512bw"))) float quantize_row(const float* x, int64_t k, int8_t* out) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (int64_t j = i; j < k; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float sx = std::max(amax / 127.0f, 1e-12f);
  const __m512 vs = _mm512_set1_ps(sx), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (i = 0; i + 16 <= k; i += 16) {
    __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(hi, _mm512_max_ps(lo, q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
  }
  for (; i < k; ++i) out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / sx))));
  return sx;
}

// vpdpbusd multiplies unsigned by signed bytes: the activations go in as q + 128 and each output
// column subtracts 128 * (sum of its weights), which keeps the integer result exact. Writes the
// scaled float32 outputs of one panel (its first `cols` columns) for MR activation rows, using
// NB of the panel's 4 column vectors (starting at `panel`). Prefetches, while it runs: `ahead`,
// the panel's own bytes kPrefetchBytes ahead; and `next` (if set), `share` cache lines from
// there, `per_quad` lines per k-quad. With `raw` (one row) it writes the NB * 16 integer sums as
// they are (biased by 128 * the column's weight sum) instead.
template <int MR, int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void panel_rows(
    const uint8_t* xu, int64_t kp, const float* sx, const int8_t* panel, int64_t kq, const int32_t* w_sum,
    const float* ws, int64_t cols, float* y, int64_t ldy, bool ahead, const int8_t* next, int64_t share,
    int64_t per_quad, int32_t* raw) {
  __m512i acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_si512();
  for (int64_t g = 0; g < kq; ++g) {
    const int8_t* wp = panel + g * kQuadBytes;
    if (next != nullptr && g * per_quad < share) {
      for (int64_t l = 0; l < per_quad; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next + (g * per_quad + l) * 64), _MM_HINT_T0);
    }
    if (ahead) {
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchBytes + 64 * l), _MM_HINT_T0);
    }
    __m512i wv[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(wp + 64 * b);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t xv;
      std::memcpy(&xv, xu + m * kp + 4 * g, 4);
      const __m512i xb = _mm512_set1_epi32(xv);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbusd_epi32(acc[m][b], xb, wv[b]);
    }
  }
  if (raw != nullptr) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) _mm512_storeu_si512(raw + 16 * b, acc[0][b]);
    return;
  }
  // Fully unrolled with constant indices, so that the accumulators stay in registers.
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b) {
    const int64_t c0 = 16 * b;
    if (c0 >= cols) continue;
    const __mmask16 mk = cols - c0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - c0)) - 1);
    const __m512i corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mk, w_sum + c0), 7);
    const __m512 wsc = _mm512_maskz_loadu_ps(mk, ws + c0);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 r = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][b], corr));
      _mm512_mask_storeu_ps(y + m * ldy + c0, mk, _mm512_mul_ps(r, _mm512_mul_ps(_mm512_set1_ps(sx[m]), wsc)));
    }
  }
}

using PanelFn = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, const int32_t*,
                         const float*, int64_t, float*, int64_t, bool, const int8_t*, int64_t, int64_t, int32_t*);

// 1-6 rows use all 4 column vectors; 7 and 8 rows (not enough registers for 4 vectors) run the
// panel as two halves of 2 vectors, all rows at once, so the panel still streams once.
PanelFn panel_for(int64_t rows) {
  static const PanelFn table[8] = {panel_rows<1, 4>, panel_rows<2, 4>, panel_rows<3, 4>, panel_rows<4, 4>,
                                   panel_rows<5, 4>, panel_rows<6, 4>, panel_rows<7, 2>, panel_rows<8, 2>};
  return table[rows - 1];
}

// All m rows against panel p (output columns 64 p ..).
void run_panel(const uint8_t* xu, int64_t kp, const float* sx, int64_t m, const int8_t* w, int64_t kq,
               int64_t panels, int64_t p, const int32_t* w_sum, const float* ws, float* y, int64_t n) {
  const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, n - c0);
  const int8_t* panel = w + p * kq * kQuadBytes;
  if (m == 7 || m == 8) {
    for (int64_t half = 0; half < 2 && 32 * half < cols; ++half) {
      const int64_t h0 = 32 * half;
      panel_for(m)(xu, kp, sx, panel + 128 * half, kq, w_sum + c0 + h0, ws + c0 + h0, std::min<int64_t>(32, cols - h0),
                   y + c0 + h0, n, true, nullptr, 0, 0, nullptr);
    }
    return;
  }
  // Balanced blocks of at most kMaxBlockRows rows. With more than one block the panel stays in
  // cache after the first, and every block prefetches its share of the next panel.
  const int64_t blocks = (m + kMaxBlockRows - 1) / kMaxBlockRows;
  const int64_t share = (kq * 4 + blocks - 1) / blocks, per_quad = (share + kq - 1) / kq;
  const int8_t* next = blocks > 1 && p + 1 < panels ? panel + kq * kQuadBytes : nullptr;
  for (int64_t i = 0, b = 0; i < m; ++b) {
    const int64_t rows = (m - i + blocks - b - 1) / (blocks - b);
    panel_for(rows)(xu + i * kp, kp, sx + i, panel, kq, w_sum + c0, ws + c0, cols, y + i * n + c0, n, blocks == 1,
                    next != nullptr ? next + b * share * 64 : nullptr, share, per_quad, nullptr);
    i += rows;
  }
}

// One row's raw sums over quads [g0, g1) of a panel (see `row_split`).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void row_part(const uint8_t* xu, int64_t kp,
                                                                      const int8_t* panel, int64_t g0, int64_t g1,
                                                                      int32_t* raw) {
  panel_rows<1, 4>(xu + 4 * g0, kp, nullptr, panel + g0 * kQuadBytes, g1 - g0, nullptr, nullptr, 0, nullptr, 0, true,
                   nullptr, 0, 0, raw);
}

// Any MR of 1-6 rows and NB of 1-4 column vectors (`columns`).
PanelFn block_for(int64_t rows, int64_t vectors) {
#define WAFER_ROW(MR) {panel_rows<MR, 1>, panel_rows<MR, 2>, panel_rows<MR, 3>, panel_rows<MR, 4>}
  static const PanelFn table[kMaxBlockRows][4] = {WAFER_ROW(1), WAFER_ROW(2), WAFER_ROW(3),
                                                  WAFER_ROW(4), WAFER_ROW(5), WAFER_ROW(6)};
#undef WAFER_ROW
  return table[rows - 1][vectors - 1];
}

// Output columns [c0, c1) of m rows (`step::linear_columns`): each panel's part in that range,
// its rows in balanced blocks of at most kMaxBlockRows (the part held in cache after the first).
void columns(const uint8_t* xu, int64_t kp, const float* sx, int64_t m, const int8_t* w, int64_t kq,
             const int32_t* w_sum, const float* ws, int64_t n, int64_t c0, int64_t c1, float* y, int64_t ldy) {
  const int64_t blocks = (m + kMaxBlockRows - 1) / kMaxBlockRows;
  for (int64_t p = c0 / kPanelCols; p * kPanelCols < c1; ++p) {
    const int64_t base = p * kPanelCols, lo = std::max(c0, base), hi = std::min({c1, base + kPanelCols, n});
    const int64_t vectors = (hi - lo + 15) / 16;
    const int8_t* part = w + p * kq * kQuadBytes + 4 * (lo - base);
    for (int64_t i = 0, b = 0; i < m; ++b) {
      const int64_t rows = (m - i + blocks - b - 1) / (blocks - b);
      block_for(rows, vectors)(xu + i * kp, kp, sx + i, part, kq, w_sum + lo, ws + lo, hi - lo, y + i * ldy + lo, ldy,
                               i == 0 && vectors == 4, nullptr, 0, 0, nullptr);
      i += rows;
    }
  }
}

}  // namespace avx512

// quantize_row_portable with AVX2 (the AVX2 variants' activations).
__attribute__((target("avx2,fma"))) float quantize_row_avx2(const float* x, int64_t k, int8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float amax = _mm_cvtss_f32(m4);
  for (int64_t j = i; j < k; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float sx = std::max(amax / 127.0f, 1e-12f);
  const __m256 vs = _mm256_set1_ps(sx), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (i = 0; i + 8 <= k; i += 8) {
    __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i q32 = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, q)));
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(q16, q16));
  }
  for (; i < k; ++i) out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / sx))));
  return sx;
}

#define WAFER_AVX2_NS avx2
#define WAFER_AVX2_VNNI 0
#define WAFER_AVX2_TARGET __attribute__((target("avx2,fma")))
#include "w8a8_avx2.inc"
#undef WAFER_AVX2_NS
#undef WAFER_AVX2_VNNI
#undef WAFER_AVX2_TARGET

#define WAFER_AVX2_NS avx2_vnni
#define WAFER_AVX2_VNNI 1
#define WAFER_AVX2_TARGET __attribute__((target("avx2,fma,avxvnni")))
#include "w8a8_avx2.inc"
#undef WAFER_AVX2_NS
#undef WAFER_AVX2_VNNI
#undef WAFER_AVX2_TARGET

#endif  // WAFER_X86

// Whether `isa`'s kernels take the activations as q + 128: the VNNI instructions multiply unsigned
// by signed bytes (each output then subtracts 128 * its weight sum).
bool unsigned_codes(Isa isa) { return isa == wafer::kAvx512Vnni || isa == wafer::kAvx2Vnni; }

// Rows x[i * ldx ..][0, k) quantized (`quantize_row_portable`'s arithmetic, vectorized at `isa`'s
// level: the same codes at every level) into xq[i * kp ..], zero past k, scales into sx[i]; as
// q + 128 where `biased`.
void quantize_codes(Isa isa, const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* xq, int64_t kp, float* sx,
                    bool biased) {
  auto quantize = quantize_row_portable;
#if WAFER_X86
  if (isa == wafer::kAvx512Vnni) quantize = avx512::quantize_row;
  if (isa == wafer::kAvx2Vnni || isa == wafer::kAvx2) quantize = quantize_row_avx2;
#endif
  for (int64_t i = 0; i < m; ++i) {
    int8_t* row = xq + i * kp;
    std::fill(row + k, row + kp, static_cast<int8_t>(0));
    sx[i] = quantize(x + i * ldx, k, row);
    if (!biased) continue;
    for (int64_t j = 0; j < kp; ++j) row[j] = static_cast<int8_t>(static_cast<uint8_t>(row[j]) ^ 0x80);
  }
}

// The same product through torch's float32 matmul, for many rows where that is faster (the caller
// measures: `quantize.DynamicInt8Linear.sgemm_from_rows`): the panels widened to float32 [n, kp],
// the quantized rows as floats, and each block of at most 1024 inputs multiplied separately, so
// that every partial sum is an integer below 1024 * 127^2 < 2^24, exact in float32 in any order;
// the blocks add as int32. So the result is bit-identical to the integer kernels.
at::Tensor sgemm_path(const std::vector<int8_t>& xq, const std::vector<float>& sx, int64_t m, int64_t kp,
                      const int8_t* wp, int64_t panels, const float* ws, int64_t n) {
  const int64_t kq = kp / 4;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor wf = at::empty({panels * kPanelCols, kp}, options);
  float* fp = wf.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t c = 0; c < kPanelCols; ++c) {
        const int8_t* src = wp + p * kq * kQuadBytes + 4 * c;
        float* dst = fp + (p * kPanelCols + c) * kp;
        for (int64_t g = 0; g < kq; ++g) {
          for (int64_t t = 0; t < 4; ++t) dst[4 * g + t] = static_cast<float>(src[g * kQuadBytes + t]);
        }
      }
    }
  });
  at::Tensor xf = at::empty({m, kp}, options);
  float* xfp = xf.data_ptr<float>();
  for (int64_t i = 0; i < m * kp; ++i) xfp[i] = static_cast<float>(xq[i]);
  const at::Tensor wn = wf.narrow(0, 0, n);
  at::Tensor acc;
  for (int64_t k0 = 0; k0 < kp; k0 += 1024) {
    const int64_t len = std::min<int64_t>(1024, kp - k0);
    at::Tensor part = at::mm(xf.narrow(1, k0, len), wn.narrow(1, k0, len).t()).to(at::kInt);
    acc = acc.defined() ? acc.add_(part) : part;
  }
  const at::Tensor scales = at::from_blob(const_cast<float*>(sx.data()), {m, 1}, options) *
                            at::from_blob(const_cast<float*>(ws), {n}, options);
  return acc.to(at::kFloat).mul_(scales);
}

// All m rows against panel p, in the variant `isa`.
void run_panel_isa(Isa isa, const int8_t* xq, int64_t kp, const float* sx, int64_t m, const int8_t* w, int64_t kq,
                   int64_t panels, int64_t p, const int32_t* w_sum, const float* ws, float* y, int64_t n) {
#if WAFER_X86
  const auto* xu = reinterpret_cast<const uint8_t*>(xq);
  switch (isa) {
    case wafer::kAvx512Vnni:
      return avx512::run_panel(xu, kp, sx, m, w, kq, panels, p, w_sum, ws, y, n);
    case wafer::kAvx2Vnni:
      return avx2_vnni::run_panel(xu, kp, sx, m, w, kq, p, w_sum, ws, y, n);
    case wafer::kAvx2:
      return avx2::run_panel(xu, kp, sx, m, w, kq, p, w_sum, ws, y, n);
    default:
      break;
  }
#endif
  run_panel_portable(xq, kp, sx, m, w, kq, p, ws, y, n);
}

// One row's raw integer sums of panel `panel` over its quads [g0, g1), in the variant `isa`.
void row_part_isa(Isa isa, const int8_t* xq, int64_t kp, const int8_t* panel, int64_t g0, int64_t g1, int32_t* raw) {
#if WAFER_X86
  const auto* xu = reinterpret_cast<const uint8_t*>(xq);
  switch (isa) {
    case wafer::kAvx512Vnni:
      return avx512::row_part(xu, kp, panel, g0, g1, raw);
    case wafer::kAvx2Vnni:
      return avx2_vnni::row_part(xu, kp, panel, g0, g1, raw);
    case wafer::kAvx2:
      return avx2::row_part(xu, kp, panel, g0, g1, raw);
    default:
      break;
  }
#endif
  row_part_portable(xq, panel, g0, g1, raw);
}

// A thread streams at least this many k-quads of one row's weights (64 KiB at 256 bytes a quad).
constexpr int64_t kMinQuadsPerThread = 256;

// One row (decode at batch 1): the weights' quads, panel after panel as they lie in memory, cut
// into one even, contiguous range per thread. A split by whole panels leaves a thread idle for a
// panel's time whenever the panels do not divide evenly (SmolLM2's 576 outputs are 9 panels: 5
// and 4 on 2 threads), and uses at most one thread a panel. A panel cut between threads is
// summed in integers by each (`row_part`), and finished here from the exact sum, so the outputs
// are bit-identical to the panel split's. Returns false (nothing done) where one thread is enough.
bool row_split(Isa isa, const int8_t* xq, int64_t kp, float sx, const int8_t* w, int64_t kq, int64_t panels,
               const int32_t* w_sum, const float* ws, float* y, int64_t n) {
  const int64_t quads = panels * kq;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), quads / kMinQuadsPerThread);
  if (threads < 2) return false;
  // Each thread's range begins and ends in at most one cut panel: its integer sums go here.
  struct Part {
    int64_t panel = -1;
    int32_t sums[kPanelCols];
  };
  std::vector<Part> parts(static_cast<size_t>(2 * threads));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t q0 = quads * t / threads, q1 = quads * (t + 1) / threads;
      for (int64_t q = q0; q < q1;) {
        const int64_t p = q / kq, g0 = q % kq, g1 = std::min(kq, g0 + (q1 - q));
        if (g0 == 0 && g1 == kq) {
          run_panel_isa(isa, xq, kp, &sx, 1, w, kq, panels, p, w_sum, ws, y, n);
        } else {
          Part& part = parts[static_cast<size_t>(2 * t + (q == q0 ? 0 : 1))];
          part.panel = p;
          row_part_isa(isa, xq, kp, w + p * kq * kQuadBytes, g0, g1, part.sums);
        }
        q += g1 - g0;
      }
    }
  });
  // The cut panels, each finished from its parts' sum as the kernels finish a whole panel. A
  // panel's parts are consecutive: the ranges run in thread order.
  const bool biased = unsigned_codes(isa);  // q + 128 (see above)
  for (size_t i = 0; i < parts.size();) {
    const int64_t p = parts[i].panel;
    if (p < 0) {
      ++i;
      continue;
    }
    int32_t total[kPanelCols];
    std::copy(parts[i].sums, parts[i].sums + kPanelCols, total);
    for (++i; i < parts.size() && (parts[i].panel == p || parts[i].panel < 0); ++i) {
      if (parts[i].panel != p) continue;
      for (int64_t c = 0; c < kPanelCols; ++c) total[c] += parts[i].sums[c];
    }
    const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, n - c0);
    for (int64_t c = 0; c < cols; ++c) {
      const int32_t corr = biased ? w_sum[c0 + c] * 128 : 0;
      y[c0 + c] = static_cast<float>(total[c] - corr) * (sx * ws[c0 + c]);
    }
  }
  return true;
}

// One linear's int8 weights as the kernels read them: `panels` panels of 64 outputs (the layout
// above), then per output its float32 scale and its int32 weight sum.
struct Weights {
  const int8_t* panels_data;
  const float* scale;
  const int32_t* sum;
  int64_t panels;
  int64_t n;
};

// y = x's rows against `wt` (x checked by the caller: float32 [m, k] with k the panels' input
// size). `sgemm_from_rows`: with at least this many rows (0: never) the product runs `sgemm_path`.
at::Tensor run_linear(const at::Tensor& x, const Weights& wt, int64_t sgemm_from_rows) {
  const int64_t m = x.size(0), k = x.size(1), n = wt.n, panels = wt.panels;
  const int64_t kp = (k + 3) / 4 * 4, kq = kp / 4;
  if (m == 0 || n == 0) return at::empty({m, n}, x.options());
  const at::Tensor xc = x.contiguous();
  // The fastest variant quantizes the rows either way; the float32 path then multiplies them.
  const Isa fastest = wafer::pick(kLevels);
  const bool sgemm = sgemm_from_rows > 0 && m >= sgemm_from_rows;
  const Isa isa = sgemm ? wafer::kPortable : fastest;
  std::vector<int8_t> xq(static_cast<size_t>(m * kp));
  std::vector<float> sx(static_cast<size_t>(m));
  // The float32 path takes the signed codes (`isa` is then portable).
  quantize_codes(fastest, xc.data_ptr<float>(), k, m, k, xq.data(), kp, sx.data(), unsigned_codes(isa));
  if (sgemm) return sgemm_path(xq, sx, m, kp, wt.panels_data, panels, wt.scale, n);
  at::Tensor y = at::empty({m, n}, x.options());
  const int8_t* wp = wt.panels_data;
  const float* ws = wt.scale;
  const int32_t* sp = wt.sum;
  float* yp = y.data_ptr<float>();
  if (m == 1 && row_split(isa, xq.data(), kp, sx[0], wp, kq, panels, sp, ws, yp, n)) return y;
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) run_panel_isa(isa, xq.data(), kp, sx.data(), m, wp, kq, panels, p, sp, ws, yp, n);
  });
  return y;
}

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [rows, in]");
}

// The weights as three tensors: the panels, the scales and the weight sums.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_sum, int64_t sgemm_from_rows) {
  check_rows(x);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "w must be int8 panels [ceil(out / 64), ceil(in / 4) * 256]");
  const int64_t k = x.size(1), n = w_scale.numel();
  const int64_t kq = (k + 3) / 4, panels = w.size(0);
  TORCH_CHECK(w.size(1) == kq * kQuadBytes, "w's panels are not packed for x's input size ", k);
  TORCH_CHECK(panels == (n + kPanelCols - 1) / kPanelCols, "w's panels do not hold w_scale's ", n, " outputs");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(), "w_scale: one float32 per output");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == n,
              "w_sum: one int32 per output");
  return run_linear(x, {w.data_ptr<int8_t>(), w_scale.data_ptr<float>(), w_sum.data_ptr<int32_t>(), panels, n},
                    sgemm_from_rows);
}

// The weights as one int8 tensor (`DynamicInt8Linear.packed_bytes`): the panels, then the n float32 scales,
// then the n int32 weight sums. One tensor instead of three: the compiled graphs pass a third of
// the handles, and a call reads one tensor's metadata, which the streamed weights evict.
at::Tensor w8a8_linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t sgemm_from_rows) {
  check_rows(x);
  TORCH_CHECK(n >= 0, "n must be >= 0, got ", n);
  const int64_t k = x.size(1), kq = (k + 3) / 4, panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t weight_bytes = panels * kq * kQuadBytes;
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "packed must be a contiguous 1-D int8 tensor");
  TORCH_CHECK(packed.numel() == weight_bytes + 8 * n, "packed holds ", packed.numel(), " bytes; ", n,
              " outputs of ", k, " inputs need ", weight_bytes + 8 * n, " (panels, then scales and sums)");
  const int8_t* base = packed.data_ptr<int8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 4 == 0, "packed must start on a 4-byte boundary");
  const auto* scale = reinterpret_cast<const float*>(base + weight_bytes);
  const auto* sum = reinterpret_cast<const int32_t*>(base + weight_bytes + 4 * n);
  return run_linear(x, {base, scale, sum, panels, n}, sgemm_from_rows);
}

// The variant `w8a8_linear` runs now (kIsaNames).
std::string w8a8_variant() { return wafer::kIsaNames[wafer::pick(kLevels)]; }

}  // namespace

namespace wafer::step {

Linear packed_linear(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(n > 0 && k > 0, "a linear needs outputs and inputs, got ", n, " x ", k);
  const int64_t kq = (k + 3) / 4, panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t weight_bytes = panels * kq * kQuadBytes;
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.is_cpu(),
              "packed weights must be a contiguous 1-D int8 CPU tensor");
  TORCH_CHECK(packed.numel() == weight_bytes + 8 * n, "packed weights hold ", packed.numel(), " bytes; ", n,
              " outputs of ", k, " inputs need ", weight_bytes + 8 * n, " (panels, then scales and sums)");
  const int8_t* base = packed.data_ptr<int8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 4 == 0, "packed weights must start on a 4-byte boundary");
  return {base, reinterpret_cast<const float*>(base + weight_bytes),
          reinterpret_cast<const int32_t*>(base + weight_bytes + 4 * n), n, k};
}

Isa w8a8_isa() { return wafer::pick(kLevels); }

void quantize_rows(Isa isa, const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* xq, int64_t kp, float* sx) {
  quantize_codes(isa, x, ldx, m, k, xq, kp, sx, unsigned_codes(isa));
}

void linear_columns(Isa isa, const int8_t* xq, int64_t kp, const float* sx, int64_t m, const Linear& w, int64_t c0,
                    int64_t c1, float* y, int64_t ldy) {
  const int64_t kq = kp / 4;
#if WAFER_X86
  const auto* xu = reinterpret_cast<const uint8_t*>(xq);
  switch (isa) {
    case kAvx512Vnni:
      return avx512::columns(xu, kp, sx, m, w.panels, kq, w.sum, w.scale, w.n, c0, c1, y, ldy);
    case kAvx2Vnni:
      return avx2_vnni::columns(xu, kp, sx, m, w.panels, kq, w.sum, w.scale, w.n, c0, c1, y, ldy);
    case kAvx2:
      return avx2::columns(xu, kp, sx, m, w.panels, kq, w.sum, w.scale, w.n, c0, c1, y, ldy);
    default:
      break;
  }
#endif
  // Portable: each panel's 64 sums a row (`row_part_portable`), the range's columns kept.
  int32_t acc[kPanelCols];
  for (int64_t p = c0 / kPanelCols; p * kPanelCols < c1; ++p) {
    const int64_t base = p * kPanelCols, lo = std::max(c0, base), hi = std::min({c1, base + kPanelCols, w.n});
    for (int64_t i = 0; i < m; ++i) {
      row_part_portable(xq + i * kp, w.panels + p * kq * kQuadBytes, 0, kq, acc);
      for (int64_t c = lo; c < hi; ++c) y[i * ldy + c] = static_cast<float>(acc[c - base]) * (sx[i] * w.scale[c]);
    }
  }
}

}  // namespace wafer::step

TORCH_LIBRARY_FRAGMENT(wafer, lib) {
  lib.def("w8a8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor w_sum, int sgemm_from_rows=0) -> Tensor");
  lib.def("w8a8_linear_packed(Tensor x, Tensor packed, int n, int sgemm_from_rows=0) -> Tensor");
  lib.def("w8a8_variant() -> str", &w8a8_variant);
}

TORCH_LIBRARY_IMPL(wafer, CPU, lib) {
  lib.impl("w8a8_linear", &w8a8_linear);
  lib.impl("w8a8_linear_packed", &w8a8_linear_packed);
}
