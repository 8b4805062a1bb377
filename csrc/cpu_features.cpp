#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#include <pybind11/stl.h>

#include "registry.h"

namespace py = pybind11;

namespace elixir {

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512vl = __builtin_cpu_supports("avx512vl");
#if defined(__GNUC__) && (__GNUC__ >= 12 || defined(__clang__))
    f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
    // F16C has no __builtin_cpu_supports name on older compilers; every AVX2 CPU shipped has it.
    f.f16c = f.avx2;
#endif
    return f;
  }();
  return features;
}

static SimdLevel machine_level() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl && f.fma) return SimdLevel::kAVX512;
  if (f.avx2 && f.fma && f.f16c) return SimdLevel::kAVX2;
  return SimdLevel::kScalar;
}

SimdLevel simd_level() {
  static const SimdLevel level = [] {
    SimdLevel best = machine_level();
    const char* env = std::getenv("ELIXIR_SIMD");
    if (env == nullptr || env[0] == '\0') return best;
    SimdLevel wanted = best;
    if (std::strcmp(env, "scalar") == 0) wanted = SimdLevel::kScalar;
    else if (std::strcmp(env, "avx2") == 0) wanted = SimdLevel::kAVX2;
    else if (std::strcmp(env, "avx512") == 0) wanted = SimdLevel::kAVX512;
    // Never go above what the machine supports.
    return static_cast<int>(wanted) < static_cast<int>(best) ? wanted : best;
  }();
  return level;
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAVX512: return "avx512";
    case SimdLevel::kAVX2: return "avx2";
    default: return "scalar";
  }
}

void register_cpu_features(py::module_& m) {
  m.def(
      "cpu_features",
      [] {
        const CpuFeatures& f = cpu_features();
        py::dict d;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512bf16"] = f.avx512bf16;
        return d;
      },
      "CPU features detected at run time, as a dict of bools.");
  m.def(
      "simd_level", [] { return std::string(simd_level_name(simd_level())); },
      "The SIMD level kernels dispatch to: 'avx512', 'avx2' or 'scalar' (capped by ELIXIR_SIMD).");
  m.def(
      "build_info",
      [] {
        py::dict d;
#if defined(_OPENMP)
        d["openmp"] = true;
#else
        d["openmp"] = false;
#endif
#if defined(__x86_64__)
        d["arch"] = "x86_64";
#elif defined(__aarch64__)
        d["arch"] = "aarch64";
#else
        d["arch"] = "other";
#endif
        d["compiler"] = std::string(__VERSION__);
        return d;
      },
      "How the extension was built.");
}

}  // namespace elixir
