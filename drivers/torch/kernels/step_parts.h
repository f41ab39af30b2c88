// The pieces of the kernels that `decode_step.cpp` runs inside its own parallel region: the w8a8
// matmul's activation quantization and a range of its output columns (w8a8_kernel.cpp), the
// float32 product's items (f32_matvec.cpp), and one worker's share of decode attention
// (decode_attention.cpp). Each runs on the calling thread
// only; the ops of those files call them from their own `at::parallel_for`.

#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_features.h"

namespace wafer::step {

// ------------------------------------------------------------------ w8a8 (w8a8_kernel.cpp)

// One linear's int8 weights as the kernels read them (`quantize.pack_vnni`'s panels of 64
// outputs, then per output its float32 scale and its int32 weight sum).
struct Linear {
  const int8_t* panels;
  const float* scale;
  const int32_t* sum;
  int64_t n;  // outputs
  int64_t k;  // inputs
};

// The weights in `packed` (`DynamicInt8Linear.packed_bytes`' layout) of a linear with n outputs
// and k inputs; TORCH_CHECKs the size and alignment.
Linear packed_linear(const at::Tensor& packed, int64_t n, int64_t k);

// The variant the w8a8 kernels run now (kAvx512Vnni, kAvx2Vnni, kAvx2 or kPortable).
Isa w8a8_isa();

// The input bytes a row of quantized activations takes: k rounded up to a multiple of 4.
inline int64_t quantized_width(int64_t k) { return (k + 3) / 4 * 4; }

// Rows x[i * ldx ..][0, k) quantized as `DynamicInt8Linear` does into xq[i * kp ..] (zero past k)
// with their scales in sx[i]; as q + 128 where `isa` multiplies unsigned bytes (the VNNI levels).
void quantize_rows(Isa isa, const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* xq, int64_t kp, float* sx);

// Output columns [c0, c1) of the m rows' product with `w` into y[i * ldy + c] (c0 a multiple of
// 16; c1 a multiple of 16 or w.n), from `quantize_rows`' output for the same `isa`. Bit-identical
// to the w8a8_linear op's columns.
void linear_columns(Isa isa, const int8_t* xq, int64_t kp, const float* sx, int64_t m, const Linear& w, int64_t c0,
                    int64_t c1, float* y, int64_t ldy);

// ---------------------------------------------------------- float32 (f32_matvec.cpp)

// The float32 decode product y = x @ w_t (weights [in, out]) of at most `f32_max_rows` rows: the
// inputs cut into kF32Parts parts (at most; never more than the inputs), the columns into tiles of
// kF32Tile, each (part, tile) item writing its own partial sums, the parts then added in part order.
constexpr int64_t kF32MaxRows = 24, kF32Parts = 4, kF32Tile = 4096;

// The variant the float32 product runs now (kAvx512, kAvx2 or kPortable).
Isa f32_isa();

// The most rows the product takes in variant `isa` (more are torch's matmul, faster there;
// bench/f32_matmul.py): kF32MaxRows for the vector variants, 4 for the portable one.
int64_t f32_max_rows(Isa isa);

// One item: y[r * ld + c] for c in [c0, c1) = the sum over inputs i in [i0, i1) of x[r * in + i] *
// w[i * ld + c], in input order, for rows r < m (m >= 1; any count, fastest up to `f32_max_rows`).
void f32_part(Isa isa, int64_t m, const float* x, int64_t in, const float* w, int64_t ld, float* y, int64_t i0,
              int64_t i1, int64_t c0, int64_t c1);

// ------------------------------------------------- decode attention (decode_attention.cpp)

// Which keys each (request, KV head) reads and how the work is cut into tasks and shared among
// `workers` workers: built once for a pass, it serves every layer (they share the key lists).
struct AttentionSchedule {
  int64_t b = 0, h = 0, hkv = 0, d = 0, n = 0, groups = 0, tasks = 0, workers = 0;
  bool split = false;                  // some (request, KV head) runs as several pieces
  std::vector<int64_t> rows;           // [b][n]: each valid key's element offset in a layer's cache
  std::vector<int64_t> count;          // [b]: valid keys of each request
  std::vector<int64_t> first;          // [b * hkv + 1]: each (request, KV head)'s first task
  std::vector<int64_t> ends;           // [tasks]: the running weight at each task's end
  std::vector<int64_t> bounds;         // [workers + 1]: each worker's first task
  std::vector<float> part, stats;      // the pieces' unnormalized outputs and softmax stats
  std::unique_ptr<std::atomic<int64_t>[]> left;  // [b * hkv]: pieces still running (`arm`)

  // Sets the pieces-left counters; before each run over the schedule (a layer).
  void arm();
};

// The schedule of queries q [b][h][d] over keys key_index [b][n] where mask [b][n], requests
// `empty` [b] attending to nothing, in a cache of `slots` rows of hkv heads; every key's slot is
// TORCH_CHECKed against `slots` here, before any is read. At most `max_workers` workers.
void schedule_attention(AttentionSchedule& s, const int64_t* key_index, const bool* mask, const bool* empty,
                        int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t n, int64_t slots, int64_t max_workers);

// Worker w's tasks (of s.workers) over one layer's cache k, v (element type T: float, at::Half or
// at::BFloat16, [slots][hkv][d]) into out [b][h][d]; rows of `empty` requests are not written. A
// split (request, KV head) is merged by whichever worker finishes its last piece.
template <typename T>
void attend_share(AttentionSchedule& s, int64_t w, const float* q, const T* k, const T* v, float* out, float scale,
                  Isa isa);

// The variant decode attention runs now (kAvx512, kAvx2 or kPortable).
Isa attention_isa();

}  // namespace wafer::step
