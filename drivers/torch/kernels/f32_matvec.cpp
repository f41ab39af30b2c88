// wafer::f32_linear_t: y = x @ w_t for float32 weights kept [in, out] (`cpu_layout.py`) and a few
// rows of x (decode). torch's float32 path (MKL) reads the weights of SmolLM2's step at ~15 GB/s at
// one row, ~10 at two and ~5-7 at 4-24 on a Zen 4 whose memory streams ~50 GB/s, so float32 decode
// spent most of its step in matmuls; this reads them 1.2-2x faster at one row and 1.2-3.6x at 2-24
// (bench/f32_matmul.py).
//
// The inputs are cut into parts (4, whatever the thread count) and the columns into tiles of 4,096;
// each part-and-tile item streams its weight rows in order, adding x[r][i] * w_t[i][tile] into its
// own partial sums, and the parts' partial sums are added in part order. Every output sums its
// products in input order within a part with one fused multiply-add each (the AVX-512 and AVX2
// variants give the same bits; the portable one rounds the products separately), so a row's
// result depends neither on the other rows nor on the thread count. More than `f32_max_rows` rows
// (24; 4 for the portable variant) go to torch's matmul (a GEMM is as fast there).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu_features.h"
#include "step_parts.h"

#if WAFER_X86
#include <immintrin.h>
#endif

namespace {

// The variants, best first (cpu_features.h); portable: part_portable.
constexpr wafer::Isa kLevels[] = {wafer::kAvx512, wafer::kAvx2};
constexpr int64_t kTile = wafer::step::kF32Tile;    // output columns per tile
constexpr int64_t kParts = wafer::step::kF32Parts;  // the inputs are cut into this many parts (not the thread count)
constexpr int64_t kBlock = 8;  // weight rows an item's sums stay in registers over
constexpr int64_t kChunkFloats = 8192;  // 32 KB: an item's partial sums are cut to fit L1

// part_<variant>: y[r][c0:c1] = sum over i in [i0, i1) of x[r][i] * w[i][c0:c1] for rows r < m,
// inputs in order; x rows are `in` long, w and y rows `ld`. Every variant takes kBlock weight rows
// at a time and, for each run of columns, keeps the sums of those columns for a group of rows (8;
// AVX-512 4 up to 4 rows, AVX2 4 past 2) in registers over the block: they are loaded from y and
// stored back once a block, not once a weight row (the one-weight-row loop this replaces was bound
// by those loads and stores at 4-8 rows: 11 and 5 GB/s against ~20 now), and the block's weights,
// in L1 after the first group, serve every group. A row's sums run in input order whatever the
// groups.

// W columns (W a constant where it can be, for the compiler's vectors) for M rows over weight
// rows [i, i + kk).
template <int M, int64_t W>
inline void block_portable(const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i, int64_t kk,
                           bool first, int64_t c, int64_t n) {
  float acc[M][W];
  for (int r = 0; r < M; ++r)
    for (int64_t j = 0; j < n; ++j) acc[r][j] = first ? 0.0f : y[r * ld + c + j];
  for (int64_t k = 0; k < kk; ++k) {
    const float* wk = w + (i + k) * ld + c;
    for (int r = 0; r < M; ++r) {
      const float xv = x[r * in + i + k];
      for (int64_t j = 0; j < n; ++j) acc[r][j] += xv * wk[j];
    }
  }
  for (int r = 0; r < M; ++r) std::copy(acc[r], acc[r] + n, y + r * ld + c);
}

// block_portable for R = rows (1 <= rows <= 8) rows.
template <int64_t W, int R = 1>
void group_portable(int64_t rows, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i,
                    int64_t kk, bool first, int64_t c, int64_t n) {
  if constexpr (R < 8) {
    if (rows != R) return group_portable<W, R + 1>(rows, x, in, w, ld, y, i, kk, first, c, n);
  }
  block_portable<R, W>(x, in, w, ld, y, i, kk, first, c, n);
}

void part_portable(int64_t m, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0,
                   int64_t i1, int64_t c0, int64_t c1) {
  constexpr int64_t W = 16;
  for (int64_t i = i0; i < i1; i += kBlock) {
    const int64_t kk = std::min(kBlock, i1 - i);
    for (int64_t c = c0; c < c1; c += W) {
      for (int64_t r = 0; r < m; r += 8) {
        group_portable<W>(std::min<int64_t>(8, m - r), x + r * in, in, w, ld, y + r * ld, i, kk, i == i0, c,
                          std::min(W, c1 - c));
      }
    }
  }
}

#if WAFER_X86

// NC vectors of 16 columns (fewer at the end: `mask`) for M rows over weight rows [i, i + kk).
template <int M, int NC>
__attribute__((target("avx512f"), always_inline)) inline void block_avx512(const float* x, int64_t in, const float* w,
                                                                          int64_t ld, float* y, int64_t i, int64_t kk,
                                                                          bool first, int64_t c, __mmask16 mask) {
  __m512 acc[M][NC];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NC; ++j) {
      const __mmask16 m = j == NC - 1 ? mask : 0xFFFF;
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, y + r * ld + c + 16 * j);
    }
  for (int64_t k = 0; k < kk; ++k) {
    const float* wk = w + (i + k) * ld + c;
    for (int j = 0; j < NC; ++j) {
      const __m512 wv = _mm512_maskz_loadu_ps(j == NC - 1 ? mask : 0xFFFF, wk + 16 * j);
      for (int r = 0; r < M; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * in + i + k]), wv, acc[r][j]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NC; ++j) _mm512_mask_storeu_ps(y + r * ld + c + 16 * j, j == NC - 1 ? mask : 0xFFFF, acc[r][j]);
}

// For R = rows (1 <= rows <= G) rows: NC vectors of columns (`run`) or one masked vector.
template <int NC, int G, int R = 1>
__attribute__((target("avx512f"))) void group_avx512(int64_t rows, bool run, const float* x, int64_t in,
                                                     const float* w, int64_t ld, float* y, int64_t i, int64_t kk,
                                                     bool first, int64_t c, __mmask16 mask) {
  if constexpr (R < G) {
    if (rows != R) return group_avx512<NC, G, R + 1>(rows, run, x, in, w, ld, y, i, kk, first, c, mask);
  }
  if (run) return block_avx512<R, NC>(x, in, w, ld, y, i, kk, first, c, 0xFFFF);
  block_avx512<R, 1>(x, in, w, ld, y, i, kk, first, c, mask);
}

// Columns [c0, c1) in runs of NC vectors, then single (masked) vectors, for the m rows in groups
// of G.
template <int NC, int G>
__attribute__((target("avx512f"))) void runs_avx512(int64_t m, const float* x, int64_t in, const float* w, int64_t ld,
                                                    float* y, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
  for (int64_t i = i0; i < i1; i += kBlock) {
    const int64_t kk = std::min(kBlock, i1 - i);
    for (int64_t c = c0; c < c1;) {
      const bool run = c + 16 * NC <= c1;
      const __mmask16 mask = c + 16 <= c1 ? 0xFFFF : static_cast<__mmask16>((1u << (c1 - c)) - 1);
      for (int64_t r = 0; r < m; r += G) {
        group_avx512<NC, G>(std::min<int64_t>(G, m - r), run, x + r * in, in, w, ld, y + r * ld, i, kk, i == i0, c, mask);
      }
      c += run ? 16 * NC : 16;
    }
  }
}

void part_avx512(int64_t m, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0, int64_t i1,
                 int64_t c0, int64_t c1) {
  // At most 16 sums in registers (of 32).
  if (m <= 4) return runs_avx512<4, 4>(m, x, in, w, ld, y, i0, i1, c0, c1);
  runs_avx512<2, 8>(m, x, in, w, ld, y, i0, i1, c0, c1);
}

// NC vectors of 8 columns for M rows over weight rows [i, i + kk).
template <int M, int NC>
__attribute__((target("avx2,fma"), always_inline)) inline void block_avx2(const float* x, int64_t in, const float* w,
                                                                         int64_t ld, float* y, int64_t i, int64_t kk,
                                                                         bool first, int64_t c) {
  __m256 acc[M][NC];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NC; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ld + c + 8 * j);
  for (int64_t k = 0; k < kk; ++k) {
    const float* wk = w + (i + k) * ld + c;
    for (int j = 0; j < NC; ++j) {
      const __m256 wv = _mm256_loadu_ps(wk + 8 * j);
      for (int r = 0; r < M; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * in + i + k]), wv, acc[r][j]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NC; ++j) _mm256_storeu_ps(y + r * ld + c + 8 * j, acc[r][j]);
}

// group_avx512 with 8 lanes, for R = rows (1 <= rows <= G) rows.
template <int NC, int G, int R = 1>
__attribute__((target("avx2,fma"))) void group_avx2(int64_t rows, bool run, const float* x, int64_t in, const float* w,
                                                    int64_t ld, float* y, int64_t i, int64_t kk, bool first,
                                                    int64_t c) {
  if constexpr (R < G) {
    if (rows != R) return group_avx2<NC, G, R + 1>(rows, run, x, in, w, ld, y, i, kk, first, c);
  }
  if (run) return block_avx2<R, NC>(x, in, w, ld, y, i, kk, first, c);
  block_avx2<R, 1>(x, in, w, ld, y, i, kk, first, c);
}

// runs_avx512 with 8 lanes and groups of G rows; the last columns (fewer than 8) one at a time,
// fused the same way.
template <int NC, int G>
__attribute__((target("avx2,fma"))) void runs_avx2(int64_t m, const float* x, int64_t in, const float* w, int64_t ld,
                                                   float* y, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
  for (int64_t i = i0; i < i1; i += kBlock) {
    const int64_t kk = std::min(kBlock, i1 - i);
    const bool first = i == i0;
    int64_t c = c0;
    while (c + 8 <= c1) {
      const bool run = c + 8 * NC <= c1;
      for (int64_t r = 0; r < m; r += G) {
        group_avx2<NC, G>(std::min<int64_t>(G, m - r), run, x + r * in, in, w, ld, y + r * ld, i, kk, first, c);
      }
      c += run ? 8 * NC : 8;
    }
    for (; c < c1; ++c) {
      for (int64_t r = 0; r < m; ++r) {
        float acc = first ? 0.0f : y[r * ld + c];
        for (int64_t k = 0; k < kk; ++k) acc = __builtin_fmaf(x[r * in + i + k], w[(i + k) * ld + c], acc);
        y[r * ld + c] = acc;
      }
    }
  }
}

void part_avx2(int64_t m, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0, int64_t i1,
               int64_t c0, int64_t c1) {
  // At most 8 sums in registers (of 16). One row: 64 columns a run, as AVX-512 reads them (32 were
  // 6-20% slower on the step's products, alternated in one process).
  if (m == 1) return runs_avx2<8, 1>(m, x, in, w, ld, y, i0, i1, c0, c1);
  if (m <= 2) return runs_avx2<4, 2>(m, x, in, w, ld, y, i0, i1, c0, c1);
  runs_avx2<2, 4>(m, x, in, w, ld, y, i0, i1, c0, c1);
}

#endif  // WAFER_X86

using Part = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t,
                      int64_t);

// The item function of the variant `isa`.
Part part_for(wafer::Isa isa) {
#if WAFER_X86
  if (isa == wafer::kAvx512) return part_avx512;
  if (isa == wafer::kAvx2) return part_avx2;
#endif
  (void)isa;
  return part_portable;
}

// One item: columns [c0, c1) in chunks whose m rows of partial sums fit L1 (kChunkFloats): at 16-24
// rows a 4,096-column tile's sums (256-384 KB), loaded and stored once per kBlock weight rows, came
// from L2 and bound the AVX2 variant (bench/f32_matmul.py, AVX2 at 24 rows: 128 -> 97 ms).
void run_item(Part part, int64_t m, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0,
              int64_t i1, int64_t c0, int64_t c1) {
  const int64_t chunk = std::max<int64_t>(64, kChunkFloats / m / 64 * 64);
  for (int64_t c = c0; c < c1; c += chunk) part(m, x, in, w, ld, y, i0, i1, c, std::min(c1, c + chunk));
}

at::Tensor f32_linear_t(const at::Tensor& x, const at::Tensor& w_t) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [rows, in]");
  TORCH_CHECK(w_t.dim() == 2 && w_t.scalar_type() == at::kFloat && w_t.is_contiguous(),
              "w_t: contiguous float32 [in, out]");
  TORCH_CHECK(x.size(1) == w_t.size(0), "x has ", x.size(1), " inputs, w_t ", w_t.size(0));
  const int64_t m = x.size(0), in = x.size(1), out = w_t.size(1);
  const wafer::Isa isa = wafer::pick(kLevels);
  if (m > wafer::step::f32_max_rows(isa) || m == 0 || in == 0) return at::matmul(x, w_t);
  const at::Tensor xc = x.contiguous();
  const Part part = part_for(isa);
  const float* xp = xc.data_ptr<float>();
  const float* wp = w_t.data_ptr<float>();
  // Work items: a part of the inputs times a tile of the columns, each writing its own partial
  // sums; the parts' sums are then added in part order. The cut depends on the shape alone, so a
  // result never depends on the thread count.
  const int64_t parts = std::min(kParts, in), tiles = (out + kTile - 1) / kTile;
  at::Tensor partial = at::empty({parts, m, out}, x.options());
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, parts * tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t p = item / tiles, t = item % tiles;
      const int64_t i0 = in * p / parts, i1 = in * (p + 1) / parts, c0 = t * kTile;
      run_item(part, m, xp, in, wp, out, pp + p * m * out, i0, i1, c0, std::min(out, c0 + kTile));
    }
  });
  at::Tensor y = at::empty({m, out}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t n = m * out;
  at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      float acc = pp[j];
      for (int64_t p = 1; p < parts; ++p) acc += pp[p * n + j];
      yp[j] = acc;
    }
  });
  return y;
}

std::string f32_linear_variant() { return wafer::kIsaNames[wafer::pick(kLevels)]; }

int64_t f32_linear_max_rows() { return wafer::step::f32_max_rows(wafer::pick(kLevels)); }

}  // namespace

namespace wafer::step {

Isa f32_isa() { return wafer::pick(kLevels); }

int64_t f32_max_rows(Isa isa) { return isa == kPortable ? 4 : kF32MaxRows; }

void f32_part(Isa isa, int64_t m, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0,
              int64_t i1, int64_t c0, int64_t c1) {
  run_item(part_for(isa), m, x, in, w, ld, y, i0, i1, c0, c1);
}

}  // namespace wafer::step

TORCH_LIBRARY_FRAGMENT(wafer, lib) {
  lib.def("f32_linear_t(Tensor x, Tensor w_t) -> Tensor");
  lib.def("f32_linear_variant() -> str", &f32_linear_variant);
  lib.def("f32_linear_max_rows() -> int", &f32_linear_max_rows);
}

TORCH_LIBRARY_IMPL(wafer, CPU, lib) { lib.impl("f32_linear_t", &f32_linear_t); }
