// wafer::w8a8_linear: y = (round(x / sx) @ Wq^T) * sx * sw with sx = max|x_row| / 127 per input
// row, float32 in and out, the same arithmetic as `DynamicInt8Linear`'s torch path, so both give
// bit-identical results (the integer sums are exact in any order).
//
// The int8 weights come packed for AVX512-VNNI (`quantize.pack_vnni`): panels of 64 output
// columns, each panel's bytes in k order, 4 input bytes of 16 columns per 64-byte vector:
// panel[p][k / 4][b][c][k % 4] = W[64 p + 16 b + c][k]. One `vpdpbusd` then adds 4 products into
// each of 16 column sums, so the sums come out as vectors of outputs (no horizontal reductions),
// and a panel streams from memory in one linear pass. Up to 6 activation rows run against a
// panel's 4 column vectors at once (24 accumulators); more rows run in balanced blocks of at most
// 6 over the panel, held in cache, while the next panel is prefetched. Columns past the weight's
// last row are zero weights, computed and never stored; input bytes past k are zero weights too.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr int64_t kPanelCols = 64;        // 4 vectors of 16 output columns
constexpr int64_t kQuadBytes = 256;       // one k-quad of a panel: 64 columns x 4 input bytes
constexpr int64_t kMaxBlockRows = 6;      // 6 rows x 4 vectors: 24 of the 32 vector registers
// Software prefetch this far ahead in the panel being streamed (one block of rows per panel).
constexpr int64_t kPrefetchBytes = 4096;

using wafer::has_vnni;

// Quantizes one row exactly as the torch path does: sx = max|x| / 127 (at least 1e-12), then
// round(x / sx) half to even, clamped to [-127, 127]. Returns sx.
__attribute__((target("avx512f,avx512bw"))) float quantize_row_avx512(const float* x, int64_t k, int8_t* out) {
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
// there, `per_quad` lines per k-quad.
template <int MR, int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void panel_rows(
    const uint8_t* xu, int64_t kp, const float* sx, const int8_t* panel, int64_t kq, const int32_t* w_sum,
    const float* ws, int64_t cols, float* y, int64_t ldy, bool ahead, const int8_t* next, int64_t share,
    int64_t per_quad) {
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
                         const float*, int64_t, float*, int64_t, bool, const int8_t*, int64_t, int64_t);

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
                   y + c0 + h0, n, true, nullptr, 0, 0);
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
                    next != nullptr ? next + b * share * 64 : nullptr, share, per_quad);
    i += rows;
  }
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_sum) {
  TORCH_CHECK(has_vnni(), "w8a8_linear needs AVX512-VNNI (check w8a8_has_vnni first)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [rows, in]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "w must be int8 VNNI panels [ceil(out / 64), ceil(in / 4) * 256]");
  const int64_t m = x.size(0), k = x.size(1), n = w_scale.numel();
  const int64_t kp = (k + 3) / 4 * 4, kq = kp / 4, panels = w.size(0);
  TORCH_CHECK(w.size(1) == kq * kQuadBytes, "w's panels are not packed for x's input size ", k);
  TORCH_CHECK(panels == (n + kPanelCols - 1) / kPanelCols, "w's panels do not hold w_scale's ", n, " outputs");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(), "w_scale: one float32 per output");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == n,
              "w_sum: one int32 per output");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  std::vector<int8_t> xq(static_cast<size_t>(m * kp), 0);
  std::vector<float> sx(static_cast<size_t>(m));
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) sx[i] = quantize_row_avx512(xp + i * k, k, xq.data() + i * kp);
  for (int8_t& v : xq) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80);  // q + 128 as uint8
  const auto* xu = reinterpret_cast<const uint8_t*>(xq.data());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* ws = w_scale.data_ptr<float>();
  const int32_t* sp = w_sum.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) run_panel(xu, kp, sx.data(), m, wp, kq, panels, p, sp, ws, yp, n);
  });
  return y;
}

}  // namespace

bool w8a8_has_vnni() { return has_vnni(); }

// How many threads one `at::parallel_for` over 64 items runs on: torch's thread count where the
// kernels were built with OpenMP, 1 where they were not (then ATen's `parallel_for` is serial).
int64_t parallel_threads() {
  std::vector<int> used(64, -1);
  at::parallel_for(0, 64, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) used[i] = at::get_thread_num();
  });
  std::sort(used.begin(), used.end());
  return std::unique(used.begin(), used.end()) - used.begin();
}

TORCH_LIBRARY(wafer, lib) {
  lib.def("w8a8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor w_sum) -> Tensor");
  lib.def("w8a8_has_vnni() -> bool", &w8a8_has_vnni);
  lib.def("parallel_threads() -> int", &parallel_threads);
}

TORCH_LIBRARY_IMPL(wafer, CPU, lib) { lib.impl("w8a8_linear", &w8a8_linear); }
