// The `wafer` op library's own ops: what the CPU supports, the cap on the kernels' variants
// (cpu_features.h), and how many threads a kernel's `parallel_for` runs on.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_features.h"

namespace {

// The levels this CPU supports, lowest first (the cap does not change them).
std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  for (int i = 0; i < wafer::kNumIsas; ++i) {
    if (wafer::cpu_has(static_cast<wafer::Isa>(i))) out.emplace_back(wafer::kIsaNames[i]);
  }
  return out;
}

// Caps every kernel at the level `name` (one of kIsaNames); returns the previous cap's name.
std::string set_isa_cap(const std::string& name) {
  const auto* end = wafer::kIsaNames + wafer::kNumIsas;
  const auto* it = std::find(wafer::kIsaNames, end, name);
  TORCH_CHECK(it != end, "unknown instruction-set level '", name, "': one of portable, avx2, avx2_vnni, avx512, ",
              "avx512_vnni");
  const int before = wafer::isa_cap.exchange(static_cast<int>(it - wafer::kIsaNames));
  return wafer::kIsaNames[before];
}

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

}  // namespace

TORCH_LIBRARY(wafer, lib) {
  lib.def("cpu_isas() -> str[]", &cpu_isas);
  lib.def("set_isa_cap(str name) -> str", &set_isa_cap);
  lib.def("parallel_threads() -> int", &parallel_threads);
}
