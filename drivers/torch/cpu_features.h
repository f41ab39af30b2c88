// What the CPU running the C++ kernels supports, checked once per process. The vectorized paths
// are compiled for these features (`__attribute__((target(...)))`) and chosen at run time; other
// CPUs run the portable paths.

#pragma once

namespace wafer {

// AVX-512 with the byte/word, doubleword/quadword and 256-bit extensions (every AVX-512 server
// CPU since Skylake).
inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return yes;
}

// The int8 dot-product instruction `vpdpbusd` on 512-bit vectors.
inline bool has_vnni() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

}  // namespace wafer
