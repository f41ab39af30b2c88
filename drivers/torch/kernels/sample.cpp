// wafer::sample_rows: random sampling of chosen logits rows, the same steps as `sampling.py`'s torch
// path (`_random_tokens`): divide by the temperature, keep the 256 most likely tokens, softmax,
// then top-k, top-p and min-p over them and an inverse-CDF pick at the row's uniform draw. The
// torch path costs ~0.35 ms a row warm and ~0.7 ms with the caches cold from the model's graph
// (topk over 49,152 logits, then ~20 small ops); this ~15 us warm and ~60 us cold (Zen 4).
//
// The top 256 come from two vector passes: each block's largest logit, which bounds the 256th
// largest from below, then the logits at or above that bound (usually a few hundred), ranked; the
// worst order (ascending logits) costs ~5x the usual. Ties go to the lower token id. Sums run in
// double; each probability, cumulative sum and the target are rounded to float32 where the torch
// path holds them in float32, so the picks agree with it except where a draw falls within float32
// rounding of a CDF step (torch's float32 softmax differs from this one in the last bits). A row
// with a NaN picks its first NaN, a row whose largest scaled logit is infinite its first maximum,
// a row with every logit -inf token 0 (greedy's answers; torch's softmax would give NaN).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_features.h"

#if WAFER_X86
#include <immintrin.h>
#endif

namespace {

// The variants, best first (cpu_features.h); portable: the *_scalar functions.
constexpr wafer::Isa kLevels[] = {wafer::kAvx512, wafer::kAvx2};
constexpr int64_t kPrefilter = 256;  // sampling.PREFILTER

// The first index j in [from, n) whose value is above `threshold` or NaN (not <= threshold); n if none.
int64_t next_above_scalar(const float* x, int64_t from, int64_t n, float threshold) {
  for (int64_t j = from; j < n; ++j) {
    if (!(x[j] <= threshold)) return j;
  }
  return n;
}

// The largest of each of the `blocks` blocks of `size` logits into `out`; false if a NaN is among them.
bool block_max_scalar(const float* x, int64_t blocks, int64_t size, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    float m = -INFINITY;
    for (int64_t j = b * size; j < (b + 1) * size; ++j) {
      if (std::isnan(x[j])) return false;
      m = x[j] > m ? x[j] : m;
    }
    out[b] = m;
  }
  return true;
}

#if WAFER_X86

__attribute__((target("avx512f"))) int64_t next_above_avx512(const float* x, int64_t from, int64_t n, float threshold) {
  const __m512 t = _mm512_set1_ps(threshold);
  int64_t j = from;
  for (; j + 32 <= n; j += 32) {
    const __mmask16 a = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), t, _CMP_NLE_UQ);  // above, or NaN
    const __mmask16 b = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 16), t, _CMP_NLE_UQ);
    if (a | b) return next_above_scalar(x, j, n, threshold);
  }
  return next_above_scalar(x, j, n, threshold);
}

__attribute__((target("avx512f"))) bool block_max_avx512(const float* x, int64_t blocks, int64_t size, float* out) {
  if (size % 16) return block_max_scalar(x, blocks, size, out);
  __mmask16 nan = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = b * size; j < (b + 1) * size; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, v);
    }
    out[b] = _mm512_reduce_max_ps(m);
  }
  return nan == 0;
}

__attribute__((target("avx2,fma"))) int64_t next_above_avx2(const float* x, int64_t from, int64_t n, float threshold) {
  const __m256 t = _mm256_set1_ps(threshold);
  int64_t j = from;
  for (; j + 16 <= n; j += 16) {
    const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(x + j), t, _CMP_NLE_UQ);  // above, or NaN
    const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(x + j + 8), t, _CMP_NLE_UQ);
    if (_mm256_movemask_ps(_mm256_or_ps(a, b))) return next_above_scalar(x, j, n, threshold);
  }
  return next_above_scalar(x, j, n, threshold);
}

__attribute__((target("avx2,fma"))) bool block_max_avx2(const float* x, int64_t blocks, int64_t size, float* out) {
  if (size % 8) return block_max_scalar(x, blocks, size, out);
  __m256 nan = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t j = b * size; j < (b + 1) * size; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, v);
    }
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    out[b] = _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
  return _mm256_movemask_ps(nan) == 0;
}

#endif  // WAFER_X86

struct Variant {
  int64_t (*next_above)(const float*, int64_t, int64_t, float);
  bool (*block_max)(const float*, int64_t, int64_t, float*);
};

struct Entry {
  float value;
  int64_t token;
};

// `a` ranks before `b`: a larger value, or the same value and a lower token id.
inline bool ranks_before(const Entry& a, const Entry& b) {
  return a.value > b.value || (a.value == b.value && a.token < b.token);
}

struct Params {
  float temperature;
  int64_t top_k;
  float top_p;
  float min_p;
  double u;
};

struct Scratch {
  std::vector<float> scaled, maxima;
  std::vector<Entry> kept;
};

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return j;
  }
  return 0;  // not reached: called where a NaN was seen
}

// The row's most likely tokens, best first, into `s.kept`: the 256 that torch's topk keeps, less
// any -inf ones (they get no probability, so they can never be picked). Returns -1, or the token
// of the row's first NaN. A threshold first: the 256th largest of the blocks' maxima, below which
// no top-256 logit can be (256 blocks each hold a logit at least that large); then only the
// logits at or above it are ranked, usually a few hundred.
int64_t most_likely(const float* x, int64_t n, const Variant& v, Scratch& s) {
  const int64_t k = std::min(kPrefilter, n);
  const int64_t size = n >= 64 * 2 * kPrefilter ? 64 : n >= 16 * 2 * kPrefilter ? 16 : 1;
  const int64_t blocks = n / size, tail = n - blocks * size;
  s.maxima.resize(static_cast<size_t>(blocks + (tail ? 1 : 0)));
  bool numbers = v.block_max(x, blocks, size, s.maxima.data());
  if (tail) numbers = block_max_scalar(x + blocks * size, 1, tail, s.maxima.data() + blocks) && numbers;
  if (!numbers) return first_nan(x, n);
  float* m = s.maxima.data();
  const int64_t at = std::min<int64_t>(k, s.maxima.size()) - 1;
  std::nth_element(m, m + at, m + s.maxima.size(), [](float a, float b) { return a > b; });
  const float bound = m[at];
  // Above the next float down: the logits >= bound (no NaN is left); -inf ones are never kept.
  const float threshold = bound == -INFINITY ? -INFINITY : std::nextafter(bound, -INFINITY);
  s.kept.clear();
  for (int64_t j = v.next_above(x, 0, n, threshold); j < n; j = v.next_above(x, j + 1, n, threshold)) {
    s.kept.push_back({x[j], j});
  }
  auto first = s.kept.begin(), last = s.kept.end();
  if (static_cast<int64_t>(s.kept.size()) > k) {
    std::nth_element(first, first + (k - 1), last, ranks_before);
    s.kept.resize(static_cast<size_t>(k));
  }
  std::sort(s.kept.begin(), s.kept.end(), ranks_before);
  return -1;
}

// One row's token.
int64_t sample_row(const float* x, int64_t n, const Params& p, const Variant& v, Scratch& s) {
  if (p.temperature != 1.0f) {
    s.scaled.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) s.scaled[j] = x[j] / p.temperature;  // as `logits / temp` rounds
    x = s.scaled.data();
  }
  const int64_t nan = most_likely(x, n, v, s);
  if (nan >= 0) return nan;
  const std::vector<Entry>& kept = s.kept;
  const int64_t k = static_cast<int64_t>(kept.size());
  if (k == 0) return 0;  // every logit -inf: the first maximum
  const double top = kept[0].value;
  if (std::isinf(top)) return kept[0].token;
  // Softmax over the kept values, each probability rounded to float32 as the torch path holds it.
  double exps[kPrefilter];
  float probs[kPrefilter];
  double total = 0.0;
  for (int64_t i = 0; i < k; ++i) total += exps[i] = std::exp(static_cast<double>(kept[i].value) - top);
  for (int64_t i = 0; i < k; ++i) probs[i] = static_cast<float>(exps[i] / total);
  // The filters, as `_random_tokens` applies them: top-k by rank, top-p on the mass of the strictly
  // more likely tokens (the first always kept), min-p against the most likely. Cumulative sums
  // accumulate in double and are rounded per entry, as torch's `cumsum` of float32 does.
  float cdf[kPrefilter];
  double before = 0.0, mass = 0.0;
  const float floor = p.min_p * probs[0];
  for (int64_t i = 0; i < k; ++i) {
    before += probs[i];
    const float mass_before = static_cast<float>(before) - probs[i];
    const bool keep = (p.top_k == 0 || i < p.top_k) && (mass_before < p.top_p || i == 0) && probs[i] >= floor;
    mass += keep ? probs[i] : 0.0f;
    cdf[i] = static_cast<float>(mass);
  }
  // searchsorted(cdf, target, right=True): the first entry whose cumulative mass exceeds the target.
  const float target = static_cast<float>(p.u) * cdf[k - 1];
  const int64_t pick = std::upper_bound(cdf, cdf + k, target) - cdf;
  return kept[std::min(pick, k - 1)].token;
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits: float32 [outputs, vocab], vocab > 0");
  const int64_t R = rows.numel(), n = logits.size(1);
  auto check = [R](const at::Tensor& t, at::ScalarType dtype, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.numel() == R && t.scalar_type() == dtype, what, ": one per row, ",
                c10::toString(dtype));
  };
  check(rows, at::kLong, "rows");
  check(temperature, at::kFloat, "temperature");
  check(top_k, at::kLong, "top_k");
  check(top_p, at::kFloat, "top_p");
  check(min_p, at::kFloat, "min_p");
  check(u, at::kDouble, "u");
  const at::Tensor xc = logits.contiguous(), rc = rows.contiguous(), tc = temperature.contiguous();
  const at::Tensor kc = top_k.contiguous(), pc = top_p.contiguous(), mc = min_p.contiguous(), uc = u.contiguous();
  const int64_t* rp = rc.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < logits.size(0), "rows: row ", rp[r], " is not a row of the logits");
  }
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  Variant variant{next_above_scalar, block_max_scalar};
#if WAFER_X86
  const wafer::Isa isa = wafer::pick(kLevels);
  if (isa == wafer::kAvx512) variant = {next_above_avx512, block_max_avx512};
  if (isa == wafer::kAvx2) variant = {next_above_avx2, block_max_avx2};
#endif
  const float* xp = xc.data_ptr<float>();
  const float *tp = tc.data_ptr<float>(), *pp = pc.data_ptr<float>(), *mp = mc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const Params params{tp[r], kp[r], pp[r], mp[r], up[r]};
      op[r] = sample_row(xp + rp[r] * n, n, params, variant, scratch);
    }
  });
  return out;
}

std::string sample_variant() { return wafer::kIsaNames[wafer::pick(kLevels)]; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(wafer, lib) {
  lib.def("sample_rows(Tensor logits, Tensor rows, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
          "Tensor u) -> Tensor");
  lib.def("sample_variant() -> str", &sample_variant);
}

TORCH_LIBRARY_IMPL(wafer, CPU, lib) { lib.impl("sample_rows", &sample_rows); }
