// Which instruction-set variant each C++ kernel runs. One build holds every variant (each compiled
// for its features with `__attribute__((target(...)))`); at each call a kernel takes the best
// variant that the CPU supports and that the process's cap allows. The cap (`set_isa_cap`) lets
// tests and benches run a lower variant on a CPU that has a higher one; it never raises a level.
// On a CPU that is not x86-64 only the portable variants are compiled.

#pragma once

#include <atomic>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#define WAFER_X86 1
#else
#define WAFER_X86 0
#endif

namespace wafer {

// The levels in the order a cap lowers through them. A CPU may have a level without one below it
// (AVX-512 VNNI without AVX-VNNI: Ice Lake, Zen 4); each kernel checks the exact level it runs.
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx2Vnni = 2, kAvx512 = 3, kAvx512Vnni = 4 };
constexpr int kNumIsas = 5;
constexpr const char* kIsaNames[kNumIsas] = {"portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni"};

// Whether the CPU supports a level: avx2 means AVX2 with FMA and F16C (every AVX2 CPU since
// Haswell and Zen 1); avx2_vnni adds AVX-VNNI (the 256-bit `vpdpbusd`, Alder Lake, Zen 5);
// avx512 is F, DQ, BW and VL (Skylake-X and later); avx512_vnni adds AVX512-VNNI.
inline bool cpu_has(Isa isa) {
#if WAFER_X86
  static const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  switch (isa) {
    case kPortable:
      return true;
    case kAvx2:
      return avx2;
    case kAvx2Vnni:
      return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512:
      return avx512;
    case kAvx512Vnni:
      return avx512 && __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return isa == kPortable;
#endif
}

// The highest level any kernel may use in this process (every level by default).
inline std::atomic<int> isa_cap{kNumIsas - 1};

// Whether a kernel may run its variant for `isa` now.
inline bool use(Isa isa) { return isa <= isa_cap.load(std::memory_order_relaxed) && cpu_has(isa); }

// The first of `levels` (best first) that `use` allows; kPortable if none.
template <int N>
inline Isa pick(const Isa (&levels)[N]) {
  for (Isa isa : levels) {
    if (use(isa)) return isa;
  }
  return kPortable;
}

}  // namespace wafer
