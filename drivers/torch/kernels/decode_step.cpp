// wafer's fused decode step (`DecodeStep`, a Python class of the build; `fused_decode.py`): a
// whole decode pass of a Llama-style model with w8a8 or float32 weights (one query per request,
// float32 activations) in one call and one parallel region, from the embeddings to the chosen
// rows' logits. The layers run the same kernels as the ops (w8a8_kernel.cpp's panels,
// f32_matvec.cpp's items, decode attention's tasks) through `step_parts.h`, on the threads of one
// OpenMP region, with a barrier between the phases of a layer, instead of ~150 op calls a step,
// each a fork and a join of the threads, with the small work between them (norms, RoPE, SiLU,
// residuals) on one thread while the other waits.
//
// A layer, per thread t of T:
//   norm + quantize (the rows' own work, see below)                  | barrier when shared out
//   q/k/v columns (the thread's share, in 16-column units; float32: | barrier
//     its share of the op's items, a barrier, its share of the sums)
//   RoPE of q and k, K/V into the cache (KV heads t, t + T, ...)     | barrier
//   attention (worker t's tasks of the pass's schedule)              | barrier
//   quantize the attention rows                                      | barrier when shared out
//   o columns                                                        | barrier
//   residual, norm, quantize                                         | barrier when shared out
//   gate/up columns                                                  | barrier
//   SiLU(gate) * up, quantize                                        | barrier when shared out
//   down columns                                                     | barrier
//   residual
// then the final norm and the output head's columns for the chosen rows.
// The rows' own work (the residual stream, norms, SiLU, int8 codes): with fewer than kSplitRows
// rows every thread does all of it into its own copy (computed by the same code from the same
// inputs, so the copies are equal and no thread waits for another to make them); from kSplitRows
// rows on there is one copy and each thread does its share of the rows, a barrier before a
// product reads them (the work grows with the rows, the weights read do not).
//
// Every output of a matmul is summed as its op sums it (w8a8: exact integers, by one thread;
// float32: the op's parts, added in part order), and everything else is computed the same way for
// a row whatever the batch or the thread count: a row's logits are the same alone or in any
// batch, on any number of threads. They agree with the
// torch path of the same model (eager or compiled) to float32 rounding in the norms, SiLU and
// softmax, which w8a8's activation rounding can amplify to a rounding step of an int8 code.

#include <omp.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "step_parts.h"
#include "vec_math.h"

#if WAFER_X86
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace {

using wafer::Isa;
namespace step = wafer::step;

// 1 / sqrt(mean(x^2) + eps) of one row, the square sums in double.
float inverse_rms(const float* x, int64_t n, float eps) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) s[j] += static_cast<double>(x[i + j]) * x[i + j];
  }
  for (; i < n; ++i) s[0] += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>((s[0] + s[1] + s[2] + s[3]) / static_cast<double>(n));
  return 1.0f / std::sqrt(mean + eps);
}

// out = x * inverse_rms(x) * w, row by row (Llama's RMSNorm in float32: x normed, then times w).
void rms_norm_rows(const float* x, int64_t m, int64_t n, const float* w, float eps, float* out) {
  for (int64_t i = 0; i < m; ++i) {
    const float* xi = x + i * n;
    float* oi = out + i * n;
    const float r = inverse_rms(xi, n, eps);
    for (int64_t j = 0; j < n; ++j) oi[j] = (xi[j] * r) * w[j];
  }
}

// SiLU(g) * u over n elements: g * s * u with s = 1 / (1 + e) for g >= 0 and e / (1 + e) below,
// e = exp(-|g|) (so exp's argument is never positive).
void silu_mul_portable(const float* g, const float* u, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp(-std::fabs(g[j]));
    const float s = g[j] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    out[j] = g[j] * s * u[j];
  }
}

#if WAFER_X86
__attribute__((target("avx512f,avx512dq"))) void silu_mul_avx512(const float* g, const float* u, int64_t n,
                                                                    float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(mk, g + j);
    const __m512 e = wafer::exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + j, mk, _mm512_mul_ps(_mm512_mul_ps(x, s), _mm512_maskz_loadu_ps(mk, u + j)));
  }
}

__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* g, const float* u, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(g + j);
    const __m256 e = wafer::exp_nonpositive_avx2(_mm256_or_ps(x, sign));  // -|x|
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 s = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(u + j)));
  }
  silu_mul_portable(g + j, u + j, n - j, out + j);
}
#endif

void silu_mul(Isa isa, const float* g, const float* u, int64_t n, float* out) {
#if WAFER_X86
  if (isa == wafer::kAvx512) return silu_mul_avx512(g, u, n, out);
  if (isa == wafer::kAvx2) return silu_mul_avx2(g, u, n, out);
#endif
  silu_mul_portable(g, u, n, out);
}

// x [d] rotated (rotate-half RoPE): x * cos + rotate_half(x) * sin, as `model.apply_rope`.
void rope(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float rotated = j < half ? -x[j + half] : x[j - half];
    const float a = x[j] * cos[j], b = rotated * sin[j];
    out[j] = a + b;
  }
}

// A barrier of the enclosing parallel region where `on` (the same on every thread).
void barrier_if(bool on) {
  if (on) {
#pragma omp barrier
  }
}

// From this many rows on a step shares the rows' own work (norms, quantization, SiLU, residuals)
// out between its threads instead of every thread doing all of it.
constexpr int64_t kSplitRows = 4;

// Columns [c0, c1) of an n-output matmul that thread t of T computes: an even share of n's
// 16-column units (the kernels' vectors).
std::pair<int64_t, int64_t> share(int64_t n, int t, int threads) {
  const int64_t units = (n + 15) / 16;
  const int64_t u0 = units * t / threads, u1 = units * (t + 1) / threads;
  return {std::min(16 * u0, n), std::min(16 * u1, n)};
}

// One projection as the step reads it: packed w8a8 weights (`q8`), or float32 weights [in, out]
// (`f32`, `cpu_layout.TransposedLinear.weight_t`).
struct Projection {
  step::Linear q8{};
  const float* f32 = nullptr;
  int64_t n = 0, k = 0;
};

class DecodeStep {
 public:
  // `embed`: the float32 token embeddings [vocab, hidden]; `inv_freq`: RoPE's inverse
  // frequencies [head_dim / 2]. `weights`: per layer the q/k/v, o, gate/up and down linears, then
  // the output head, all packed w8a8 (int8, `DynamicInt8Linear.packed`) or all float32 [in, out]
  // (`TransposedLinear.weight_t`); `outs`: each one's output count. `norms`: per layer the input
  // and post-attention norms' weights, then the final norm's. The caches: [layers, slots,
  // kv_heads, head_dim].
  DecodeStep(at::Tensor embed, at::Tensor inv_freq, std::vector<at::Tensor> weights, std::vector<int64_t> outs,
             std::vector<at::Tensor> norms, at::Tensor k_cache, at::Tensor v_cache, int64_t heads, int64_t kv_heads,
             int64_t head_dim, double eps, double scale)
      : embed_(std::move(embed)), inv_freq_(std::move(inv_freq)), weights_(std::move(weights)),
        norms_(std::move(norms)), k_cache_(std::move(k_cache)), v_cache_(std::move(v_cache)), heads_(heads),
        kv_heads_(kv_heads), dim_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "heads must be a positive multiple of kv_heads, head_dim positive and even");
    TORCH_CHECK(weights_.size() % 4 == 1 && weights_.size() >= 5, "weights: 4 per layer, then the head; got ",
                weights_.size());
    TORCH_CHECK(outs.size() == weights_.size(), "outs: one per weight");
    layers_ = static_cast<int64_t>(weights_.size() / 4);
    TORCH_CHECK(static_cast<int64_t>(norms_.size()) == 2 * layers_ + 1, "norms: 2 per layer, then the final one");
    hidden_ = norms_.back().numel();
    for (const at::Tensor& w : norms_) {
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.is_cpu() && w.numel() == hidden_,
                  "norm weights: contiguous float32 [hidden]");
    }
    const int64_t qkv = (heads + 2 * kv_heads) * head_dim;
    for (int64_t l = 0; l < layers_; ++l) {
      TORCH_CHECK(outs[4 * l] == qkv, "layer ", l, ": q/k/v has ", outs[4 * l], " outputs, heads need ", qkv);
      TORCH_CHECK(outs[4 * l + 1] == hidden_ && outs[4 * l + 3] == hidden_, "layer ", l,
                  ": o and down must output hidden_size");
      TORCH_CHECK(outs[4 * l + 2] % 2 == 0 && outs[4 * l + 2] == outs[2], "layer ", l,
                  ": gate/up must output twice the intermediate size");
    }
    inter_ = outs[2] / 2;
    f32_ = weights_.back().scalar_type() == at::kFloat;
    auto projection = [&](const at::Tensor& w, int64_t n, int64_t k) {
      Projection p;
      p.n = n, p.k = k;
      if (!f32_) {
        p.q8 = step::packed_linear(w, n, k);
        return p;
      }
      TORCH_CHECK(w.dim() == 2 && w.size(0) == k && w.size(1) == n && w.scalar_type() == at::kFloat &&
                      w.is_contiguous() && w.is_cpu(),
                  "float32 weights: contiguous [in, out] = [", k, ", ", n, "], like the others");
      p.f32 = w.data_ptr<float>();
      return p;
    };
    for (int64_t l = 0; l < layers_; ++l) {
      const int64_t ins[4] = {hidden_, heads * head_dim, hidden_, inter_};
      for (int64_t j = 0; j < 4; ++j) linears_.push_back(projection(weights_[4 * l + j], outs[4 * l + j], ins[j]));
    }
    linears_.push_back(projection(weights_.back(), outs.back(), hidden_));
    vocab_ = outs.back();
    TORCH_CHECK(embed_.dim() == 2 && embed_.size(1) == hidden_ && embed_.scalar_type() == at::kFloat &&
                    embed_.is_contiguous() && embed_.is_cpu(),
                "embed: contiguous float32 [vocab, hidden]");
    TORCH_CHECK(inv_freq_.dim() == 1 && inv_freq_.size(0) == head_dim / 2 && inv_freq_.scalar_type() == at::kFloat &&
                    inv_freq_.is_contiguous(),
                "inv_freq: contiguous float32 [head_dim / 2]");
    const auto kv = k_cache_.scalar_type();
    TORCH_CHECK(k_cache_.dim() == 4 && k_cache_.size(0) == layers_ && k_cache_.size(2) == kv_heads &&
                    k_cache_.size(3) == head_dim && k_cache_.is_contiguous() && k_cache_.is_cpu() &&
                    (kv == at::kFloat || kv == at::kHalf || kv == at::kBFloat16),
                "k_cache: contiguous [layers, slots, kv_heads, head_dim] float32, float16 or bfloat16");
    TORCH_CHECK(v_cache_.sizes() == k_cache_.sizes() && v_cache_.scalar_type() == kv && v_cache_.is_contiguous(),
                "v_cache: like k_cache");
  }

  // The logits [rows, vocab] of a decode pass: `tokens` [M] at `positions` [M], slots [M] where
  // each token's K/V goes, request r's keys key_index[r] where mask[r] (its own token's slot among
  // them), `empty` requests attending to nothing, `rows` the rows whose logits are wanted.
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots,
                  const at::Tensor& key_index, const at::Tensor& mask, const at::Tensor& empty,
                  const at::Tensor& rows) {
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.size(0) > 0,
                "tokens: int64 [tokens], at least one");
    const int64_t m = tokens.size(0);
    TORCH_CHECK(m <= max_rows(), "a float32 step takes at most ", max_rows(), " tokens, got ", m);
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == m && positions.scalar_type() == at::kLong,
                "positions: int64 [tokens]");
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == m && slots.scalar_type() == at::kLong, "slots: int64 [tokens]");
    TORCH_CHECK(key_index.dim() == 2 && key_index.size(0) == m && key_index.scalar_type() == at::kLong,
                "key_index: int64 [tokens, keys] (one query per request)");
    TORCH_CHECK(mask.sizes() == key_index.sizes() && mask.scalar_type() == at::kBool, "mask: bool like key_index");
    TORCH_CHECK(empty.dim() == 1 && empty.size(0) == m && empty.scalar_type() == at::kBool, "empty: bool [tokens]");
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows: int64 [outputs]");
    const at::Tensor tc = tokens.contiguous(), pc = positions.contiguous(), slc = slots.contiguous();
    const at::Tensor ic = key_index.contiguous(), mc = mask.contiguous(), ec = empty.contiguous();
    const at::Tensor rc = rows.contiguous();
    const int64_t num_slots = k_cache_.size(1);
    const int64_t* sp = slc.data_ptr<int64_t>();
    const int64_t* tp = tc.data_ptr<int64_t>();
    const int64_t vocab = embed_.size(0);
    for (int64_t i = 0; i < m; ++i) {
      TORCH_CHECK(tp[i] >= 0 && tp[i] < vocab, "tokens: ", tp[i], " outside the vocabulary of ", vocab);
      TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slots: ", sp[i], " outside the cache's ", num_slots, " slots");
    }
    const int64_t* rp = rc.data_ptr<int64_t>();
    for (int64_t i = 0; i < rc.numel(); ++i) {
      TORCH_CHECK(rp[i] >= 0 && rp[i] < m, "rows: ", rp[i], " is not a row of the pass's ", m);
    }
    const int threads = std::max(1, at::get_num_threads());
    step::schedule_attention(schedule_, ic.data_ptr<int64_t>(), mc.data_ptr<bool>(), ec.data_ptr<bool>(), m, heads_,
                             kv_heads_, dim_, key_index.size(1), num_slots, threads);
    at::Tensor logits = at::empty({rc.numel(), vocab_}, embed_.options());
    // The embeddings and each token's RoPE cos/sin [D] (rotate-half: the D / 2 angles twice), the
    // angles in float32 as `model.rope_cos_sin` computes them.
    std::vector<float> x(m * hidden_), cosines(m * dim_), sines(m * dim_);
    const float* ep = embed_.data_ptr<float>();
    const float* fp = inv_freq_.data_ptr<float>();
    const int64_t* pp = pc.data_ptr<int64_t>();
    const int64_t half = dim_ / 2;
    for (int64_t i = 0; i < m; ++i) {
      std::copy(ep + tp[i] * hidden_, ep + (tp[i] + 1) * hidden_, x.begin() + i * hidden_);
      for (int64_t j = 0; j < half; ++j) {
        const float angle = static_cast<float>(pp[i]) * fp[j];
        cosines[i * dim_ + j] = cosines[i * dim_ + half + j] = std::cos(angle);
        sines[i * dim_ + j] = sines[i * dim_ + half + j] = std::sin(angle);
      }
    }
    const Inputs in{x.data(), cosines.data(), sines.data(), sp, rp, rc.numel(), logits.data_ptr<float>()};
    switch (k_cache_.scalar_type()) {
      case at::kFloat:
        run(in, m, threads, k_cache_.data_ptr<float>(), v_cache_.data_ptr<float>());
        break;
      case at::kHalf:
        run(in, m, threads, k_cache_.data_ptr<at::Half>(), v_cache_.data_ptr<at::Half>());
        break;
      default:
        run(in, m, threads, k_cache_.data_ptr<at::BFloat16>(), v_cache_.data_ptr<at::BFloat16>());
        break;
    }
    return logits;
  }

  // Which variants a step runs now: "w8a8 <level>, attention <level>" (or "float32 <level>, ...").
  std::string variant() const {
    const char* matmul = f32_ ? "float32 " : "w8a8 ";
    return matmul + std::string(wafer::kIsaNames[f32_ ? step::f32_isa() : step::w8a8_isa()]) + ", attention " +
           wafer::kIsaNames[step::attention_isa()];
  }

  // From how many rows on the threads share out the rows' own work (`run`); for the tests.
  void set_split_rows(int64_t rows) {
    TORCH_CHECK(rows >= 1, "split_rows: at least 1, got ", rows);
    split_rows_ = rows;
  }

  // The most tokens a pass may have: the float32 product's rows (any for w8a8).
  int64_t max_rows() const {
    return f32_ ? step::f32_max_rows(step::f32_isa()) : std::numeric_limits<int64_t>::max();
  }

 private:
  struct Inputs {
    const float* x;
    const float* cos;
    const float* sin;
    const int64_t* slots;
    const int64_t* rows;
    int64_t num_rows;
    float* logits;
  };

  template <typename T>
  void run(const Inputs& in, int64_t m, int threads, T* kc, T* vc) {
    const int64_t hidden = hidden_, inter = inter_, d = dim_, h = heads_, hkv = kv_heads_, groups = h / hkv;
    const int64_t qn = h * d, qkv_n = (h + 2 * hkv) * d, layer_elems = k_cache_.size(1) * hkv * d;
    const int64_t widest = std::max({hidden, qn, inter});
    const int64_t kp = step::quantized_width(widest);
    const Isa mm = f32_ ? step::f32_isa() : step::w8a8_isa(), vec = step::attention_isa();
    // Shared between the threads: the matmuls' outputs, the rotated queries, attention's output;
    // with float32 weights, the parts' partial sums of a product.
    std::vector<float> qkv(m * qkv_n), q_rot(m * qn), attn(m * qn, 0.0f), o(m * hidden), gu(m * 2 * inter),
        down(m * hidden);
    const int64_t mo = std::max(m, in.num_rows);
    std::vector<float> partial(f32_ ? step::kF32Parts * mo * std::max({qkv_n, hidden, 2 * inter, vocab_}) : 0);
    // The rows' own work: the residual stream, normed rows (or SiLU's), their int8 codes and
    // scales. Few rows: each thread does all of it into its own copy (equal copies: the same code
    // on the same inputs), no thread waiting for another. From `split_rows_` rows on: one shared
    // copy, each thread its share of the rows, a barrier before a product reads them.
    const bool split = threads > 1 && m >= split_rows_;
    std::vector<Rows> own(split ? 1 : threads);
    if (split) own[0].size(m, mo, hidden, inter, kp);
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      Rows& my = own[split ? 0 : t];
      if (!split) my.size(m, mo, hidden, inter, kp);
      // The rows of `count` this thread works on: all of them, or its share.
      auto mine = [&](int64_t count) -> std::pair<int64_t, int64_t> {
        if (!split) return {0, count};
        return {count * t / nt, count * (t + 1) / nt};
      };
      const auto [r0, r1] = mine(m);
      std::copy(in.x + r0 * hidden, in.x + r1 * hidden, my.x.begin() + r0 * hidden);
      std::vector<float> rot(d);  // a rotated key
      // Rows [a, b) of `src` (k inputs each) made ready for a product: w8a8 quantizes them into
      // the int8 codes and scales (float32 reads `src` itself); then, when the rows are shared
      // out, a barrier.
      auto ready = [&](const float* src, int64_t k, int64_t a, int64_t b) {
        if (!f32_) {
          const int64_t wk = step::quantized_width(k);
          step::quantize_rows(mm, src + a * k, k, b - a, k, my.xq.data() + a * wk, wk, my.sx.data() + a);
        }
        barrier_if(split);
      };
      // y = the rows of `src` (k inputs each, `ready`) times `w`, the thread's share of it. w8a8:
      // its columns from the rows' int8 codes. float32: the op's items (a part of the inputs
      // times a tile of the columns) shared out, a barrier, then the parts' partial sums added in
      // part order, each thread its share of the outputs (f32_matvec.cpp's bits).
      auto product = [&](const Projection& w, int64_t rows, const float* src, int64_t k, float* y) {
        if (!f32_) {
          const auto [c0, c1] = share(w.n, t, nt);
          const int64_t wk = step::quantized_width(k);
          if (c0 < c1) step::linear_columns(mm, my.xq.data(), wk, my.sx.data(), rows, w.q8, c0, c1, y, w.n);
          return;
        }
        const int64_t parts = std::min(step::kF32Parts, k), tiles = (w.n + step::kF32Tile - 1) / step::kF32Tile;
        const int64_t items = parts * tiles, size = rows * w.n;
        for (int64_t item = items * t / nt; item < items * (t + 1) / nt; ++item) {
          const int64_t p = item / tiles, c0 = item % tiles * step::kF32Tile;
          step::f32_part(mm, rows, src, k, w.f32, w.n, partial.data() + p * size, k * p / parts, k * (p + 1) / parts,
                         c0, std::min(w.n, c0 + step::kF32Tile));
        }
#pragma omp barrier
        for (int64_t j = size * t / nt; j < size * (t + 1) / nt; ++j) {
          float acc = partial[j];
          for (int64_t p = 1; p < parts; ++p) acc += partial[p * size + j];
          y[j] = acc;
        }
      };
      const int64_t own_rows = r1 - r0;
      float* const x = my.x.data();
      float* const hr = my.h.data();
      for (int64_t l = 0; l < layers_; ++l) {
        const Projection* lin = &linears_[4 * l];
        rms_norm_rows(x + r0 * hidden, own_rows, hidden, norms_[2 * l].data_ptr<float>(), eps_, hr + r0 * hidden);
        ready(hr, hidden, r0, r1);
        product(lin[0], m, hr, hidden, qkv.data());
#pragma omp barrier
        T* kl = kc + l * layer_elems;
        T* vl = vc + l * layer_elems;
        for (int64_t g = t; g < hkv; g += nt) {
          for (int64_t r = 0; r < m; ++r) {
            const float* row = qkv.data() + r * qkv_n;
            const float *cs = in.cos + r * d, *sn = in.sin + r * d;
            for (int64_t i = g * groups; i < (g + 1) * groups; ++i) rope(row + i * d, cs, sn, d, q_rot.data() + r * qn + i * d);
            rope(row + qn + g * d, cs, sn, d, rot.data());
            const float* vr = row + qn + hkv * d + g * d;
            T* kdst = kl + (in.slots[r] * hkv + g) * d;
            T* vdst = vl + (in.slots[r] * hkv + g) * d;
            for (int64_t j = 0; j < d; ++j) {
              kdst[j] = static_cast<T>(rot[j]);
              vdst[j] = static_cast<T>(vr[j]);
            }
          }
        }
        if (t == 0) schedule_.arm();
#pragma omp barrier
        for (int64_t w = t; w < schedule_.workers; w += nt) step::attend_share(schedule_, w, q_rot.data(), kl, vl, attn.data(), scale_, vec);
#pragma omp barrier
        if (!f32_) ready(attn.data(), qn, r0, r1);  // (float32 reads the rows as they are)
        product(lin[1], m, attn.data(), qn, o.data());
#pragma omp barrier
        for (int64_t j = r0 * hidden; j < r1 * hidden; ++j) x[j] += o[j];
        rms_norm_rows(x + r0 * hidden, own_rows, hidden, norms_[2 * l + 1].data_ptr<float>(), eps_, hr + r0 * hidden);
        ready(hr, hidden, r0, r1);
        product(lin[2], m, hr, hidden, gu.data());
#pragma omp barrier
        for (int64_t r = r0; r < r1; ++r) {
          const float* row = gu.data() + r * 2 * inter;
          silu_mul(vec, row, row + inter, inter, hr + r * inter);
        }
        ready(hr, inter, r0, r1);
        product(lin[3], m, hr, inter, down.data());
#pragma omp barrier
        for (int64_t j = r0 * hidden; j < r1 * hidden; ++j) x[j] += down[j];
      }
      barrier_if(split);  // the chosen rows' residuals, from whichever thread made them
      const auto [o0, o1] = mine(in.num_rows);
      for (int64_t i = o0; i < o1; ++i) {
        const float* xi = x + in.rows[i] * hidden;
        std::copy(xi, xi + hidden, hr + i * hidden);
      }
      rms_norm_rows(hr + o0 * hidden, o1 - o0, hidden, norms_.back().data_ptr<float>(), eps_, hr + o0 * hidden);
      ready(hr, hidden, o0, o1);
      if (in.num_rows > 0) product(linears_.back(), in.num_rows, hr, hidden, in.logits);
    }
  }

  // The rows' own work's buffers (`run`).
  struct Rows {
    std::vector<float> x, h, sx;
    std::vector<int8_t> xq;

    void size(int64_t m, int64_t mo, int64_t hidden, int64_t inter, int64_t kp) {
      x.resize(m * hidden);
      h.resize(mo * std::max(hidden, inter));
      xq.resize(mo * kp);
      sx.resize(mo);
    }
  };

  at::Tensor embed_, inv_freq_;
  std::vector<at::Tensor> weights_, norms_;
  at::Tensor k_cache_, v_cache_;
  int64_t heads_, kv_heads_, dim_;
  float eps_, scale_;
  int64_t layers_ = 0, hidden_ = 0, inter_ = 0, vocab_ = 0;
  std::vector<Projection> linears_;
  bool f32_ = false;  // float32 weights (else w8a8)
  int64_t split_rows_ = kSplitRows;
  step::AttentionSchedule schedule_;
};

// Columns [c0, c1) of x's rows times a packed linear's weights, the rest zeros: the step's matmul
// code alone, for the tests (against the w8a8_linear_packed op, every variant).
at::Tensor w8a8_columns(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t c0, int64_t c1) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [rows, in]");
  TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= n && c0 % 16 == 0 && (c1 % 16 == 0 || c1 == n),
              "columns [c0, c1): c0 a multiple of 16, c1 one or n");
  const at::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), kp = step::quantized_width(k);
  const step::Linear w = step::packed_linear(packed, n, k);
  const Isa isa = step::w8a8_isa();
  std::vector<int8_t> xq(m * kp);
  std::vector<float> sx(m);
  step::quantize_rows(isa, xc.data_ptr<float>(), k, m, k, xq.data(), kp, sx.data());
  at::Tensor y = at::zeros({m, n}, x.options());
  if (c0 < c1) step::linear_columns(isa, xq.data(), kp, sx.data(), m, w, c0, c1, y.data_ptr<float>(), n);
  return y;
}

}  // namespace

namespace wafer {

void register_decode_step(py::module_& m) {
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                    at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("step", &DecodeStep::step, py::call_guard<py::gil_scoped_release>())
      .def("variant", &DecodeStep::variant)
      .def("max_rows", &DecodeStep::max_rows)
      .def("set_split_rows", &DecodeStep::set_split_rows);
  m.def("w8a8_columns", &w8a8_columns);
}

}  // namespace wafer
