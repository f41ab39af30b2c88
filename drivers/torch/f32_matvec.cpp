// wafer::f32_linear_t: y = x @ w_t for float32 weights kept [in, out] (`cpu_layout.py`) and a few
// rows of x (decode). torch's float32 path (MKL) reads the weights of a one-row product of
// SmolLM2's step at ~15 GB/s on a Zen 4 whose memory streams ~50 GB/s (two rows at ~10, four at
// ~6), so a float32 decode step spent ~34 of its ~40 ms in matmuls; this reads them at ~25 GB/s
// (two rows ~20, four ~15).
//
// The inputs are cut into parts (4, whatever the thread count) and the columns into tiles of 4,096;
// each part-and-tile item streams its weight rows in order, adding x[r][i] * w_t[i][tile] into its
// own partial sums (a tile of them in L1), and the parts' partial sums are added in part order.
// Every output sums its products in input order within a part with one fused multiply-add each
// (the AVX-512 and AVX2 variants give the same bits; the portable one rounds the products
// separately), so a row's result depends neither on the other rows nor on the thread count. More
// than kMaxRows rows go to torch's matmul (a GEMM is faster there).

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
constexpr int64_t kMaxRows = wafer::step::kF32MaxRows;
constexpr int64_t kTile = wafer::step::kF32Tile;    // output columns per tile: 16 KB a row of partial sums, in L1
constexpr int64_t kParts = wafer::step::kF32Parts;  // the inputs are cut into this many parts (not the thread count)

// y[r][c0:c1] = sum over i in [i0, i1) of x[r][i] * w[i][c0:c1] for the M rows, inputs in order;
// x rows are `in` long, w and y rows `ld`.
template <int M>
void part_portable(const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0, int64_t i1,
                   int64_t c0, int64_t c1) {
  for (int r = 0; r < M; ++r) std::fill(y + r * ld + c0, y + r * ld + c1, 0.0f);
  for (int64_t i = i0; i < i1; ++i) {
    const float* wi = w + i * ld;
    for (int r = 0; r < M; ++r) {
      const float xi = x[r * in + i];
      float* yr = y + r * ld;
      for (int64_t c = c0; c < c1; ++c) yr[c] += xi * wi[c];
    }
  }
}

#if WAFER_X86

template <int M>
__attribute__((target("avx512f"))) void part_avx512(const float* x, int64_t in, const float* w, int64_t ld, float* y,
                                                    int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
  for (int r = 0; r < M; ++r) std::fill(y + r * ld + c0, y + r * ld + c1, 0.0f);
  for (int64_t i = i0; i < i1; ++i) {  // one weight row at a time: the weights stream in order
    const float* wi = w + i * ld;
    __m512 xs[M];
    for (int r = 0; r < M; ++r) xs[r] = _mm512_set1_ps(x[r * in + i]);
    for (int64_t c = c0; c < c1; c += 16) {
      const __mmask16 m = c + 16 <= c1 ? 0xFFFF : static_cast<__mmask16>((1u << (c1 - c)) - 1);
      const __m512 wv = _mm512_maskz_loadu_ps(m, wi + c);
      for (int r = 0; r < M; ++r) {
        float* yr = y + r * ld + c;
        _mm512_mask_storeu_ps(yr, m, _mm512_fmadd_ps(xs[r], wv, _mm512_maskz_loadu_ps(m, yr)));
      }
    }
  }
}

// part_avx512 with 8 lanes; the last columns (fewer than 8) one at a time, fused the same way.
template <int M>
__attribute__((target("avx2,fma"))) void part_avx2(const float* x, int64_t in, const float* w, int64_t ld, float* y,
                                                   int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
  for (int r = 0; r < M; ++r) std::fill(y + r * ld + c0, y + r * ld + c1, 0.0f);
  const int64_t cv = c0 + (c1 - c0) / 8 * 8;  // the vector part ends here
  for (int64_t i = i0; i < i1; ++i) {
    const float* wi = w + i * ld;
    __m256 xs[M];
    for (int r = 0; r < M; ++r) xs[r] = _mm256_set1_ps(x[r * in + i]);
    for (int64_t c = c0; c < cv; c += 8) {
      const __m256 wv = _mm256_loadu_ps(wi + c);
      for (int r = 0; r < M; ++r) {
        float* yr = y + r * ld + c;
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(xs[r], wv, _mm256_loadu_ps(yr)));
      }
    }
    for (int64_t c = cv; c < c1; ++c) {
      for (int r = 0; r < M; ++r) y[r * ld + c] = __builtin_fmaf(x[r * in + i], wi[c], y[r * ld + c]);
    }
  }
}

#endif  // WAFER_X86

using Part = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t);

template <int M>
Part pick_part(wafer::Isa isa) {
#if WAFER_X86
  if (isa == wafer::kAvx512) return part_avx512<M>;
  if (isa == wafer::kAvx2) return part_avx2<M>;
#endif
  (void)isa;
  return part_portable<M>;
}

// The item function for m rows (1 <= m <= kMaxRows).
Part part_for(int64_t m, wafer::Isa isa) {
  return m == 1 ? pick_part<1>(isa) : m == 2 ? pick_part<2>(isa) : m == 3 ? pick_part<3>(isa) : pick_part<4>(isa);
}

at::Tensor f32_linear_t(const at::Tensor& x, const at::Tensor& w_t) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [rows, in]");
  TORCH_CHECK(w_t.dim() == 2 && w_t.scalar_type() == at::kFloat && w_t.is_contiguous(),
              "w_t: contiguous float32 [in, out]");
  TORCH_CHECK(x.size(1) == w_t.size(0), "x has ", x.size(1), " inputs, w_t ", w_t.size(0));
  const int64_t m = x.size(0), in = x.size(1), out = w_t.size(1);
  if (m > kMaxRows || m == 0 || in == 0) return at::matmul(x, w_t);
  const at::Tensor xc = x.contiguous();
  const wafer::Isa isa = wafer::pick(kLevels);
  const Part part = part_for(m, isa);
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
      part(xp, in, wp, out, pp + p * m * out, i0, i1, c0, std::min(out, c0 + kTile));
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

}  // namespace

namespace wafer::step {

Isa f32_isa() { return wafer::pick(kLevels); }

void f32_part(Isa isa, int64_t m, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0,
              int64_t i1, int64_t c0, int64_t c1) {
  part_for(m, isa)(x, in, w, ld, y, i0, i1, c0, c1);
}

}  // namespace wafer::step

TORCH_LIBRARY_FRAGMENT(wafer, lib) {
  lib.def("f32_linear_t(Tensor x, Tensor w_t) -> Tensor");
  lib.def("f32_linear_variant() -> str", &f32_linear_variant);
}

TORCH_LIBRARY_IMPL(wafer, CPU, lib) { lib.impl("f32_linear_t", &f32_linear_t); }
