// bench/decode_split.py: a decode step's int8 matmuls called one after another from C++, through
// torch's dispatcher as the compiled graphs call them, each call timed on its own. Called from
// Python one by one they cost ~2-3 us more each (the interpreter and pybind), ~0.3 ms a SmolLM2
// step, which the matmuls' GB/s would otherwise carry.

#include <torch/extension.h>

#include <chrono>
#include <vector>

// [reps, calls] seconds: call i of each repetition is w8a8_linear(xs[i], ws[i], scales[i], sums[i]).
at::Tensor time_sequence(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws,
                         const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& sums, int64_t reps) {
  TORCH_CHECK(xs.size() == ws.size() && ws.size() == scales.size() && scales.size() == sums.size(),
              "one x, weight, scale and sum per call");
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("wafer::w8a8_linear", "")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  const auto calls = static_cast<int64_t>(ws.size());
  at::Tensor out = at::empty({reps, calls}, at::kDouble);
  double* seconds = out.data_ptr<double>();
  for (int64_t r = 0; r < reps; ++r) {
    for (int64_t i = 0; i < calls; ++i) {
      const auto start = std::chrono::steady_clock::now();
      op.call(xs[i], ws[i], scales[i], sums[i], 0);
      seconds[r * calls + i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("time_sequence", &time_sequence); }
