// Runtime CPU feature detection and the SIMD level the kernels dispatch to.
#pragma once
#include <string>

namespace elixir {

enum class SimdLevel : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
};

// What the machine supports (cached after the first call).
const CpuFeatures& cpu_features();

// The best level the machine supports, capped by the ELIXIR_SIMD environment variable
// ("scalar", "avx2" or "avx512"), read once. Kernels must dispatch on this.
SimdLevel simd_level();

const char* simd_level_name(SimdLevel level);

}  // namespace elixir
