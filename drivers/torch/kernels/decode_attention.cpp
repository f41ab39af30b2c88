// wafer::decode_attention: attention of one query per request over keys read in place from the
// paged cache, float32, for decode passes on the CPU. For request b and KV head g it reads the
// keys' rows k_cache[key_index[b, j], g] where mask[b, j] (never the padding), so nothing is
// gathered into a padded copy first; a request whose row is `empty` attends to nothing and gets
// zeros. The G = H / Hkv query heads of a KV head share each key and value row as it is read.
// Longer key lists run as pieces over the threads, merged in order (`run_tasks`).
//
// The cache may hold float32, float16 or bfloat16 (`--kv-dtype`); rows are widened to float32 as
// they are read, and all arithmetic is float32.
//
// Softmax as the reference computes it: scores times scale, minus their maximum, exp, divided by
// the sum. exp is a degree-7 polynomial after range reduction (relative error ~1e-7); results
// match `masked_attention` to float32 rounding, not bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "step_parts.h"
#include "vec_math.h"

#if WAFER_X86
#include <immintrin.h>
#endif

namespace {

// The variants, best first (cpu_features.h); portable: attend_scalar.
constexpr wafer::Isa kLevels[] = {wafer::kAvx512, wafer::kAvx2};

// One (request, KV head) of work: its query rows q[G][D] (contiguous heads), its valid keys' cache
// rows (of element type T) at `k + rows[j]` and `v + rows[j]`, and where its G output rows go.
template <typename T>
struct Task {
  const float* q;
  const int64_t* rows;
  int64_t n;
  const T* k;
  const T* v;
  int64_t heads;  // G
  int64_t dim;    // D
  float scale;
  float* scores;  // [G][n] scratch
  float* out;     // [G][D]
  // Null: `out` is the attention output. Else the task is one piece of a longer key list
  // (`run_tasks`): `out` is left unnormalized (sum_j e_j v_j) and each head's score maximum and
  // sum of e_j = exp(score_j - maximum) go to stats[2 i] and stats[2 i + 1].
  float* stats;
};

// Asks for the `bytes` at base + rows[j] for each of the n keys (every cache line of each row),
// without waiting for them; a prefetch never faults.
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* rows, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* p = reinterpret_cast<const char*>(base + rows[j]);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
  }
}

template <typename T>
void attend_scalar(const Task<T>& t) {
  for (int64_t i = 0; i < t.heads; ++i) {
    const float* q = t.q + i * t.dim;
    float* s = t.scores + i * t.n;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < t.n; ++j) {
      const T* k = t.k + t.rows[j];
      float dot = 0.0f;
      for (int64_t d = 0; d < t.dim; ++d) dot += q[d] * static_cast<float>(k[d]);
      s[j] = dot * t.scale;
      top = std::max(top, s[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < t.n; ++j) sum += (s[j] = std::exp(s[j] - top));
    float* o = t.out + i * t.dim;
    std::fill(o, o + t.dim, 0.0f);
    for (int64_t j = 0; j < t.n; ++j) {
      const T* v = t.v + t.rows[j];
      for (int64_t d = 0; d < t.dim; ++d) o[d] += s[j] * static_cast<float>(v[d]);
    }
    if (t.stats != nullptr) {
      t.stats[2 * i] = top;
      t.stats[2 * i + 1] = sum;
      continue;
    }
    for (int64_t d = 0; d < t.dim; ++d) o[d] /= sum;
  }
}

#if WAFER_X86

// Sixteen vectors -> one whose lane j is the sum of the lanes of v[j]: a tree of in-lane and
// cross-lane shuffles, 15 adds for 16 dot products instead of a full reduction each.
__attribute__((target("avx512f,avx512dq"))) inline __m512 reduce16(__m512* v) {
  // Round 1: pairs (j, j + 8) -> 8 vectors whose 256-bit halves belong to j and j + 8.
  for (int j = 0; j < 8; ++j) {
    const __m512 lo = _mm512_shuffle_f32x4(v[j], v[j + 8], 0x44);  // v[j].lo256, v[j+8].lo256
    const __m512 hi = _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE);  // v[j].hi256, v[j+8].hi256
    v[j] = _mm512_add_ps(lo, hi);
  }
  // Round 2: (j, j + 4) over 128-bit quarters: [j.q0 j+4.q0 j.q1 j+4.q1]-style.
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(v[j], v[j + 4], 0x88);  // quarters 0, 2 of each
    const __m512 b = _mm512_shuffle_f32x4(v[j], v[j + 4], 0xDD);  // quarters 1, 3 of each
    v[j] = _mm512_add_ps(a, b);
  }
  // Round 3: (j, j + 2) within 128-bit lanes, interleaved single floats.
  for (int j = 0; j < 2; ++j) v[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[j], v[j + 2]), _mm512_unpackhi_ps(v[j], v[j + 2]));
  // Round 4: (0, 1), pairs of floats.
  const __m512d a = _mm512_castps_pd(v[0]), b = _mm512_castps_pd(v[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

// The lane order reduce16 leaves: lane L holds the sum of vector kReduceOrder[L]. Callers put the
// vector meant for lane L at kReduceOrder[L], so the lanes come out in order.
constexpr int kReduceOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// 16 elements of a cache row from `p`, as float32 (`mask`: which are read; the rest are 0).
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) inline __m512 load16(const float* p, __mmask16 mask) {
  return mask == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask, p);
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) inline __m512 load16(const at::Half* p, __mmask16 mask) {
  const __m256i h = mask == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                   : _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_cvtph_ps(h);
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) inline __m512 load16(const at::BFloat16* p,
                                                                                   __mmask16 mask) {
  // bfloat16 is the high half of a float32.
  const __m256i h = mask == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                   : _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// NC vectors of 16 per head row; `Tail`: the last is partial (D not a multiple of 16).
template <int NC, bool Tail, typename T>
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void attend_avx512(const Task<T>& t) {
  // Locals, so that the compiler keeps them in registers (stores through `t.scores` and `t.out`
  // could alias the task's fields otherwise).
  const int64_t n = t.n, dim = t.dim;
  const int64_t* rows = t.rows;
  const T* kc = t.k;
  const T* vc = t.v;
  const __mmask16 tail = (dim % 16) ? static_cast<__mmask16>((1u << (dim % 16)) - 1) : 0xFFFF;
#define load(p, c) load16((p) + 16 * (c), Tail && (c) == NC - 1 ? tail : static_cast<__mmask16>(0xFFFF))
  for (int64_t i = 0; i < t.heads; ++i) {
    __m512 q[NC];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) q[c] = _mm512_mul_ps(load(t.q + i * dim, c), _mm512_set1_ps(t.scale));
    float* s = t.scores + i * n;
    // Scores: 16 keys at a time, their dot products reduced together.
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) {
        const T* k = kc + rows[j + u];
        __m512 a = _mm512_mul_ps(q[0], load(k, 0));
#pragma GCC unroll 16
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(q[c], load(k, c), a);
        acc[kReduceOrder[u]] = a;
      }
      _mm512_storeu_ps(s + j, reduce16(acc));
    }
    for (; j < n; ++j) {
      const T* k = kc + rows[j];
      __m512 a = _mm512_mul_ps(q[0], load(k, 0));
#pragma GCC unroll 16
      for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(q[c], load(k, c), a);
      s[j] = _mm512_reduce_add_ps(a);
    }
    // Softmax over the n scores.
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (j = 0; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    float top = _mm512_reduce_max_ps(vmax);
    for (int64_t r = j; r < n; ++r) top = std::max(top, s[r]);
    const __m512 vtop = _mm512_set1_ps(top);
    __m512 vsum = _mm512_setzero_ps();
    for (j = 0; j < n; j += 16) {
      const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = wafer::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vtop));
      _mm512_mask_storeu_ps(s + j, m, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
    }
    const float total = _mm512_reduce_add_ps(vsum);
    if (t.stats != nullptr) {
      t.stats[2 * i] = top;
      t.stats[2 * i + 1] = total;
    }
    const __m512 inv = _mm512_set1_ps(t.stats != nullptr ? 1.0f : 1.0f / total);
    // Output: the weighted sum of the value rows, even and odd keys in two sets of sums, so that
    // consecutive keys do not wait on each other's additions.
    __m512 o[2][NC];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) o[0][c] = o[1][c] = _mm512_setzero_ps();
    for (j = 0; j + 2 <= n; j += 2) {
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
        const T* v = vc + rows[j + e];
        const __m512 w = _mm512_set1_ps(s[j + e]);
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) o[e][c] = _mm512_fmadd_ps(w, load(v, c), o[e][c]);
      }
    }
    if (j < n) {
      const T* v = vc + rows[j];
      const __m512 w = _mm512_set1_ps(s[j]);
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) o[0][c] = _mm512_fmadd_ps(w, load(v, c), o[0][c]);
    }
    float* out = t.out + i * dim;
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m512 r = _mm512_mul_ps(_mm512_add_ps(o[0][c], o[1][c]), inv);
      if (c == NC - 1) {
        _mm512_mask_storeu_ps(out + 16 * c, tail, r);
      } else {
        _mm512_storeu_ps(out + 16 * c, r);
      }
    }
  }
#undef load
}


// ------------------------------------------------------------------------------------ AVX2

// Eight vectors -> one whose lane j is the sum of the lanes of v[j] (in order).
__attribute__((target("avx2,fma"))) inline __m256 reduce8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// 8 elements of a cache row from `p` as float32; `count` < 8: only the first `count` are read
// (the rest are 0), count <= 0: none.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)), lane));
}

__attribute__((target("avx2,fma,f16c"))) inline __m128i load8_bits(const void* p, int64_t count) {
  if (count >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  uint16_t part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (count > 0) std::memcpy(part, p, static_cast<size_t>(count) * 2);
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(part));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::Half* p, int64_t count) {
  return _mm256_cvtph_ps(load8_bits(p, count));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::BFloat16* p, int64_t count) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load8_bits(p, count)), 16));
}

// NC vectors of 8 per head row; `Tail`: D < 8 NC, and each vector reads only what is in the row.
// The query is scaled into a padded local copy; the output is summed in chunks of 8 vectors, so
// that the sums stay within the 16 registers (D = 128: two passes over the value rows).
template <int NC, bool Tail, typename T>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const Task<T>& t) {
  const int64_t n = t.n, dim = t.dim;
  const int64_t* rows = t.rows;
  const T* kc = t.k;
  const T* vc = t.v;
#define count(c) (Tail ? dim - 8 * (c) : 8)
  alignas(32) float qs[8 * NC];
  for (int64_t i = 0; i < t.heads; ++i) {
    const float* qi = t.q + i * dim;
    for (int64_t d = 0; d < 8 * NC; ++d) qs[d] = d < dim ? qi[d] * t.scale : 0.0f;
    float* s = t.scores + i * n;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 acc[8];
      const __m256 q0 = _mm256_load_ps(qs);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_mul_ps(q0, load8(kc + rows[j + u], count(0)));
#pragma GCC unroll 32
      for (int c = 1; c < NC; ++c) {
        const __m256 qc = _mm256_load_ps(qs + 8 * c);
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qc, load8(kc + rows[j + u] + 8 * c, count(c)), acc[u]);
      }
      _mm256_storeu_ps(s + j, reduce8(acc));
    }
    for (; j < n; ++j) {
      const T* k = kc + rows[j];
      __m256 a = _mm256_mul_ps(_mm256_load_ps(qs), load8(k, count(0)));
#pragma GCC unroll 32
      for (int c = 1; c < NC; ++c) a = _mm256_fmadd_ps(_mm256_load_ps(qs + 8 * c), load8(k + 8 * c, count(c)), a);
      s[j] = hsum8(a);
    }
    // Softmax over the n scores.
    float top = -std::numeric_limits<float>::infinity();
    for (j = 0; j < n; ++j) top = std::max(top, s[j]);
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
      const __m256 e = wafer::exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), vtop));
      _mm256_storeu_ps(s + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    if (j < n) {
      const __m256 e = wafer::exp_nonpositive_avx2(_mm256_sub_ps(load8(s + j, n - j), vtop));
      alignas(32) float tail[8];
      _mm256_store_ps(tail, e);
      for (int64_t r = j; r < n; ++r) sum += (s[r] = tail[r - j]);
    }
    if (t.stats != nullptr) {
      t.stats[2 * i] = top;
      t.stats[2 * i + 1] = sum;
    }
    const __m256 inv = _mm256_set1_ps(t.stats != nullptr ? 1.0f : 1.0f / sum);
    // Output: the weighted sum of the value rows, 8 vectors at a time.
    float* out = t.out + i * dim;
    for (int c0 = 0; c0 < NC; c0 += 8) {
      __m256 o[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) o[c] = _mm256_setzero_ps();
      for (j = 0; j < n; ++j) {
        const T* v = vc + rows[j];
        const __m256 w = _mm256_set1_ps(s[j]);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          if (c0 + c < NC) o[c] = _mm256_fmadd_ps(w, load8(v + 8 * (c0 + c), count(c0 + c)), o[c]);
        }
      }
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        if (c0 + c >= NC) break;
        const __m256 r = _mm256_mul_ps(o[c], inv);
        const int64_t live = count(c0 + c);
        if (live <= 0) break;
        if (live >= 8) {
          _mm256_storeu_ps(out + 8 * (c0 + c), r);
        } else {
          alignas(32) float part[8];
          _mm256_store_ps(part, r);
          std::memcpy(out + 8 * (c0 + c), part, static_cast<size_t>(live) * sizeof(float));
        }
      }
    }
  }
#undef count
}

#endif  // WAFER_X86

template <typename T>
using Kernel = void (*)(const Task<T>&);

#if WAFER_X86
template <int NC, typename T>
Kernel<T> pick_avx512(int64_t dim) {
  if constexpr (NC > 16) {
    return attend_scalar<T>;
  } else if (dim == 16 * NC) {
    return attend_avx512<NC, false, T>;
  } else {
    return dim > 16 * (NC - 1) && dim < 16 * NC ? attend_avx512<NC, true, T> : pick_avx512<NC + 1, T>(dim);
  }
}

// The AVX2 kernel for head size `dim`: instantiated for 1-8 vectors exactly and for 12, 16, 24
// and 32 (D = 96, 128, 192, 256); other sizes run the next larger one with its tail masked.
template <typename T>
Kernel<T> pick_avx2(int64_t dim) {
  constexpr int kSizes[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32};
  constexpr Kernel<T> kExact[] = {attend_avx2<1, false, T>,  attend_avx2<2, false, T>,  attend_avx2<3, false, T>,
                                  attend_avx2<4, false, T>,  attend_avx2<5, false, T>,  attend_avx2<6, false, T>,
                                  attend_avx2<7, false, T>,  attend_avx2<8, false, T>,  attend_avx2<12, false, T>,
                                  attend_avx2<16, false, T>, attend_avx2<24, false, T>, attend_avx2<32, false, T>};
  constexpr Kernel<T> kTail[] = {attend_avx2<1, true, T>,  attend_avx2<2, true, T>,  attend_avx2<3, true, T>,
                                 attend_avx2<4, true, T>,  attend_avx2<5, true, T>,  attend_avx2<6, true, T>,
                                 attend_avx2<7, true, T>,  attend_avx2<8, true, T>,  attend_avx2<12, true, T>,
                                 attend_avx2<16, true, T>, attend_avx2<24, true, T>, attend_avx2<32, true, T>};
  for (int i = 0; i < 12; ++i) {
    if (dim <= 8 * kSizes[i]) return dim == 8 * kSizes[i] ? kExact[i] : kTail[i];
  }
  return attend_scalar<T>;
}

#endif  // WAFER_X86

// The kernel of the variant `isa` for head size `dim`.
template <typename T>
Kernel<T> kernel_for(wafer::Isa isa, int64_t dim) {
#if WAFER_X86
  if (isa == wafer::kAvx512) return pick_avx512<1, T>(dim);
  if (isa == wafer::kAvx2) return pick_avx2<T>(dim);
#endif
  return attend_scalar<T>;
}

// A (request, KV head) over more keys than `piece_keys(count)` runs as pieces of at most that
// many keys, each a task of its own, merged in order (`merge_pieces`). So one request's attention
// spreads over every thread: SmolLM2 has 3 KV heads, one task each would run 2 and 1 on two
// threads. Up to kShortKeys keys the pieces are short (kShortPiece: a piece's keys then also stay
// in L1 while its G heads read them); past it they are long (kLongPiece), since the merge and each
// piece's softmax cost more than the balance buys there (measured at 1,024 and 2,000 keys). The
// cut depends only on the request's own key count: its result is the same alone or in any batch,
// on any number of threads.
constexpr int64_t kShortPiece = 64, kShortKeys = 512, kLongPiece = 256;
constexpr int64_t piece_keys(int64_t count) { return count <= kShortKeys ? kShortPiece : kLongPiece; }
// The threads share the tasks by weight, not by count (a request's last piece is short, and the
// requests of a batch hold different numbers of keys): a task weighs its keys plus a fixed cost
// (its softmax's setup, a merge) of kTaskCost keys. Which thread runs a task does not change its bits.
constexpr int64_t kTaskCost = 16;

// The output of one (request, KV head) from its pieces' unnormalized outputs `part` [P][G][D]
// and stats [P][G][2]: each piece's sums rescaled to the largest maximum, in piece order.
void merge_pieces(const float* part, const float* stats, int64_t pieces, int64_t heads, int64_t dim, float* out) {
  for (int64_t i = 0; i < heads; ++i) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < pieces; ++p) top = std::max(top, stats[(p * heads + i) * 2]);
    float sum = 0.0f;
    float* o = out + i * dim;
    std::fill(o, o + dim, 0.0f);
    for (int64_t p = 0; p < pieces; ++p) {
      const float w = std::exp(stats[(p * heads + i) * 2] - top);
      sum += w * stats[(p * heads + i) * 2 + 1];
      const float* src = part + (p * heads + i) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += w * src[d];
    }
    for (int64_t d = 0; d < dim; ++d) o[d] /= sum;
  }
}

// All (request, KV head) tasks over a cache of element type T (see `step::schedule_attention`),
// the workers' shares run over the threads.
template <typename T>
void run_tasks(const float* qp, const T* kp, const T* vp, float* op, const int64_t* idx, const bool* mk,
               const bool* em, int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t n, int64_t slots, float scale,
               bool portable) {
  wafer::step::AttentionSchedule s;
  wafer::step::schedule_attention(s, idx, mk, em, b, h, hkv, d, n, slots, at::get_num_threads());
  if (s.tasks == 0) return;
  s.arm();
  const wafer::Isa isa = portable ? wafer::kPortable : wafer::pick(kLevels);
  at::parallel_for(0, s.workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) wafer::step::attend_share(s, w, qp, kp, vp, op, scale, isa);
  });
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& key_index, const at::Tensor& mask, const at::Tensor& empty, double scale,
                  bool portable) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: [B, H, D] float32");
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && (kv == at::kFloat || kv == at::kHalf || kv == at::kBFloat16) &&
                  k_cache.is_contiguous(),
              "k_cache: contiguous [S, Hkv, D] float32, float16 or bfloat16");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kv && v_cache.is_contiguous(),
              "v_cache: like k_cache");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), slots = k_cache.size(0), hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && hkv > 0 && h % hkv == 0, "q heads must be a multiple of the cache's KV heads");
  TORCH_CHECK(key_index.dim() == 2 && key_index.size(0) == b && key_index.scalar_type() == at::kLong,
              "key_index: [B, K] int64");
  TORCH_CHECK(mask.sizes() == key_index.sizes() && mask.scalar_type() == at::kBool, "mask: [B, K] bool");
  TORCH_CHECK(empty.dim() == 1 && empty.size(0) == b && empty.scalar_type() == at::kBool, "empty: [B] bool");
  const at::Tensor qc = q.contiguous(), ic = key_index.contiguous(), mc = mask.contiguous(), ec = empty.contiguous();
  at::Tensor out = at::zeros({b, h, d}, q.options());
  const int64_t n = key_index.size(1);
  const int64_t* idx = ic.data_ptr<int64_t>();
  const bool* mk = mc.data_ptr<bool>();
  const bool* em = ec.data_ptr<bool>();
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  if (kv == at::kFloat) {
    run_tasks(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), op, idx, mk, em, b, h, hkv, d, n, slots, sc,
              portable);
  } else if (kv == at::kHalf) {
    run_tasks(qp, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), op, idx, mk, em, b, h, hkv, d, n, slots,
              sc, portable);
  } else {
    run_tasks(qp, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), op, idx, mk, em, b, h, hkv, d, n,
              slots, sc, portable);
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& key_index, const at::Tensor& mask, const at::Tensor& empty,
                            double scale) {
  return attend(q, k_cache, v_cache, key_index, mask, empty, scale, false);
}

// The same with the portable variant whatever the CPU and the cap (for side-by-side tests).
at::Tensor decode_attention_portable(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& key_index, const at::Tensor& mask, const at::Tensor& empty,
                                     double scale) {
  return attend(q, k_cache, v_cache, key_index, mask, empty, scale, true);
}

std::string decode_attention_variant() { return wafer::kIsaNames[wafer::pick(kLevels)]; }

}  // namespace

namespace wafer::step {

void AttentionSchedule::arm() {
  for (int64_t rg = 0; split && rg < b * hkv; ++rg) left[rg].store(first[rg + 1] - first[rg], std::memory_order_relaxed);
}

// Each request's valid keys (each checked to lie in the cache's `slots`), then its (request, KV
// head, piece) tasks, and the workers' shares of them by weight (kTaskCost).
void schedule_attention(AttentionSchedule& s, const int64_t* idx, const bool* mk, const bool* em, int64_t b,
                        int64_t h, int64_t hkv, int64_t d, int64_t n, int64_t slots, int64_t max_workers) {
  s.b = b, s.h = h, s.hkv = hkv, s.d = d, s.n = n, s.groups = h / hkv;
  s.rows.assign(static_cast<size_t>(b * n), 0);
  s.count.assign(static_cast<size_t>(b), 0);
  for (int64_t r = 0; r < b; ++r) {
    if (em[r]) continue;
    for (int64_t j = 0; j < n; ++j) {
      if (!mk[r * n + j]) continue;
      // Every key a request reads is checked before any is read: a bad slot is an error, not a fault.
      TORCH_CHECK(idx[r * n + j] >= 0 && idx[r * n + j] < slots, "key_index: slot ", idx[r * n + j], " of request ",
                  r, " outside the cache's ", slots, " slots");
      s.rows[r * n + s.count[r]++] = idx[r * n + j] * hkv * d;
    }
  }
  // The tasks in (request, KV head, piece) order; `first[r * hkv + g]`: the first of a (r, g);
  // `ends[t]`: the running weight at task t's end (the workers share the tasks by it, below).
  s.first.assign(static_cast<size_t>(b * hkv + 1), 0);
  s.ends.clear();
  int64_t total = 0;
  for (int64_t rg = 0; rg < b * hkv; ++rg) {
    const int64_t c = s.count[rg / hkv], pk = piece_keys(c);
    for (int64_t j0 = 0; j0 < c; j0 += pk) s.ends.push_back(total += std::min(pk, c - j0) + kTaskCost);
    s.first[rg + 1] = static_cast<int64_t>(s.ends.size());
  }
  const int64_t tasks = s.tasks = s.first[b * hkv];
  // Each worker runs consecutive tasks: task t goes to the worker whose share of the total weight
  // holds the middle of t's weight (`bounds[w]`: worker w's first task).
  const int64_t workers = s.workers = std::min<int64_t>(std::max<int64_t>(max_workers, 1), tasks);
  s.bounds.assign(static_cast<size_t>(workers + 1), tasks);
  for (int64_t w = 0, t = 0; w < workers; ++w) {
    while (t < tasks && ((t ? s.ends[t - 1] : 0) + s.ends[t]) * workers < 2 * w * total) ++t;
    s.bounds[w] = t;
  }
  // The pieces of split (r, g)s leave their outputs and stats here, at their task's place.
  s.split = std::any_of(s.count.begin(), s.count.end(), [](int64_t c) { return c > piece_keys(c); });
  s.part.assign(s.split ? static_cast<size_t>(tasks * s.groups * d) : 0, 0.0f);
  s.stats.assign(s.split ? static_cast<size_t>(tasks * s.groups * 2) : 0, 0.0f);
  s.left.reset(s.split ? new std::atomic<int64_t>[b * hkv] : nullptr);
}

template <typename T>
void attend_share(AttentionSchedule& s, int64_t w, const float* qp, const T* kp, const T* vp, float* op, float scale,
                  Isa isa) {
  const int64_t t0 = s.bounds[w], t1 = s.bounds[w + 1];
  if (t0 == t1) return;
  const int64_t hkv = s.hkv, d = s.d, n = s.n, h = s.h, groups = s.groups;
  const Kernel<T> kernel = kernel_for<T>(isa, d);
  const std::vector<int64_t>& first = s.first;
  // Task `task` of (r, g) = rg: its first key (of the request's valid keys) and how many it reads.
  auto piece = [&](int64_t rg, int64_t task) {
    const int64_t c = s.count[rg / hkv], pk = piece_keys(c), j0 = (task - first[rg]) * pk;
    return std::pair<int64_t, int64_t>(j0, std::min(pk, c - j0));
  };
  std::vector<float> scores(static_cast<size_t>(groups * std::min(n, kLongPiece)));
  int64_t rg = std::upper_bound(first.begin(), first.end(), t0) - first.begin() - 1;
  // The worker asks for all its tasks' key rows, then all their value rows, before it runs any.
  // In a decode step the weights streamed since this layer's last step have evicted them, and
  // the kernels read one block of keys at a time: without this each block waited on memory.
  // (Keys first, then values: asked for task by task, keys and values in turn, it gained nothing.)
  for (int64_t kv = 0; kv < 2; ++kv) {
    for (int64_t task = t0, pg = rg; task < t1; ++task) {
      while (first[pg + 1] <= task) ++pg;
      const auto [j0, len] = piece(pg, task);
      prefetch_rows((kv ? vp : kp) + (pg % hkv) * d, s.rows.data() + (pg / hkv) * n + j0, len,
                    d * static_cast<int64_t>(sizeof(T)));
    }
  }
  for (int64_t task = t0; task < t1; ++task) {
    while (first[rg + 1] <= task) ++rg;
    const int64_t r = rg / hkv, g = rg % hkv, pieces = first[rg + 1] - first[rg];
    const auto [j0, len] = piece(rg, task);
    const float* q = qp + (r * h + g * groups) * d;
    float* out = pieces == 1 ? op + (r * h + g * groups) * d : s.part.data() + task * groups * d;
    float* st = pieces == 1 ? nullptr : s.stats.data() + task * groups * 2;
    kernel(Task<T>{q, s.rows.data() + r * n + j0, len, kp + g * d, vp + g * d, groups, d, scale, scores.data(), out,
                   st});
    // acq_rel: the merging worker sees every piece's writes, whichever thread made them.
    if (pieces > 1 && s.left[rg].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      merge_pieces(s.part.data() + first[rg] * groups * d, s.stats.data() + first[rg] * groups * 2, pieces, groups, d,
                   op + (r * h + g * groups) * d);
    }
  }
}

template void attend_share<float>(AttentionSchedule&, int64_t, const float*, const float*, const float*, float*,
                                  float, Isa);
template void attend_share<at::Half>(AttentionSchedule&, int64_t, const float*, const at::Half*, const at::Half*,
                                     float*, float, Isa);
template void attend_share<at::BFloat16>(AttentionSchedule&, int64_t, const float*, const at::BFloat16*,
                                         const at::BFloat16*, float*, float, Isa);

Isa attention_isa() { return wafer::pick(kLevels); }

}  // namespace wafer::step

TORCH_LIBRARY_FRAGMENT(wafer, lib) {
  lib.def("decode_attention_variant() -> str", &decode_attention_variant);
#define WAFER_ATTENTION_ARGS \
  "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_index, Tensor mask, Tensor empty, float scale) -> Tensor"
  lib.def("decode_attention" WAFER_ATTENTION_ARGS);
  lib.def("decode_attention_portable" WAFER_ATTENTION_ARGS);
#undef WAFER_ATTENTION_ARGS
}

TORCH_LIBRARY_IMPL(wafer, CPU, lib) {
  lib.impl("decode_attention", &decode_attention);
  lib.impl("decode_attention_portable", &decode_attention_portable);
}
