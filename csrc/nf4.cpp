// NF4 dequantisation (and quantisation: nf4_encode, below) of a frozen shard
// (elixir/chunk/quant.py) over raw buffers.
//
// Input: packed codes (two 4-bit codes per byte, the first element in the high nibble), one scale
// per block of 64 elements (fp32 or bf16: the block's absmax, already dequantised), the 16 levels
// as floats. Output: out[i] = level[code[i]] * scale[i / 64], in fp32, or rounded to bf16 (nearest
// even). A bf16 level times a bf16 scale is exact in fp32, so rounding the fp32 product once is
// exactly torch's bf16 multiply: every variant gives torch's bits (tests/test_frozen_quant.py).
//
// Variants (AVX-512: a 16-lane permute of the levels; AVX2: two 8-lane permutes and a blend;
// scalar) are compiled here with target attributes and chosen at run time; OpenMP splits blocks.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define ELIXIR_NF4_X86 1
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_features.h"
#include "registry.h"

namespace py = pybind11;

namespace elixir {
namespace {

constexpr int64_t kBlock = 64;

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (no NaN reaches here)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct Args {
  const uint8_t* codes;
  const void* scales;
  void* out;
  const float* levels;
  bool bf16;  // scales and out are bf16 (else fp32)
};

inline float scale_of(const Args& a, int64_t b) {
  return a.bf16 ? bf16_to_f32(static_cast<const uint16_t*>(a.scales)[b]) : static_cast<const float*>(a.scales)[b];
}

void blocks_scalar(const Args& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float s = scale_of(a, b);
    const uint8_t* c = a.codes + b * (kBlock / 2);
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      const float x0 = a.levels[c[i] >> 4] * s, x1 = a.levels[c[i] & 15] * s;
      const int64_t o = b * kBlock + 2 * i;
      if (a.bf16) {
        static_cast<uint16_t*>(a.out)[o] = f32_to_bf16(x0);
        static_cast<uint16_t*>(a.out)[o + 1] = f32_to_bf16(x1);
      } else {
        static_cast<float*>(a.out)[o] = x0;
        static_cast<float*>(a.out)[o + 1] = x1;
      }
    }
  }
}

#ifdef ELIXIR_NF4_X86
#define ELIXIR_NF4_AVX2 __attribute__((target("avx2,fma")))
#define ELIXIR_NF4_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

// bf16 rounding of 8 / 16 floats (nearest even), as f32_to_bf16
ELIXIR_NF4_AVX2 inline __m128i round_bf16_8(__m256 x) {
  __m256i bits = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m256i packed = _mm256_packus_epi32(bits, bits);  // lanes 0-3 and 4-7 of each 128-bit half
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

ELIXIR_NF4_AVX512 inline __m256i round_bf16_16(__m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_cvtepi32_epi16(bits);
}

ELIXIR_NF4_AVX2 void blocks_avx2(const Args& a, int64_t b0, int64_t b1) {
  const __m256 lo_lv = _mm256_loadu_ps(a.levels), hi_lv = _mm256_loadu_ps(a.levels + 8);
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m256i shifts = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0);
  const __m256i fifteen = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  for (int64_t b = b0; b < b1; ++b) {
    const __m256 s = _mm256_set1_ps(scale_of(a, b));
    const uint8_t* c = a.codes + b * (kBlock / 2);
    for (int64_t i = 0; i < kBlock / 2; i += 4) {  // 4 bytes: 8 elements
      int32_t four;
      std::memcpy(&four, c + i, 4);
      __m128i bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(four), dup);
      __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(bytes), shifts), fifteen);
      __m256 lo = _mm256_permutevar8x32_ps(lo_lv, idx), hi = _mm256_permutevar8x32_ps(hi_lv, idx);
      __m256 lv = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(idx, eight), eight)));
      __m256 x = _mm256_mul_ps(lv, s);
      const int64_t o = b * kBlock + 2 * i;
      if (a.bf16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.out) + o), round_bf16_8(x));
      } else {
        _mm256_storeu_ps(static_cast<float*>(a.out) + o, x);
      }
    }
  }
}

ELIXIR_NF4_AVX512 void blocks_avx512(const Args& a, int64_t b0, int64_t b1) {
  const __m512 lv = _mm512_loadu_ps(a.levels);
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i shifts = _mm512_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512i fifteen = _mm512_set1_epi32(15);
  for (int64_t b = b0; b < b1; ++b) {
    const __m512 s = _mm512_set1_ps(scale_of(a, b));
    const uint8_t* c = a.codes + b * (kBlock / 2);
    for (int64_t i = 0; i < kBlock / 2; i += 8) {  // 8 bytes: 16 elements
      __m128i bytes = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)), dup);
      __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(bytes), shifts), fifteen);
      __m512 x = _mm512_mul_ps(_mm512_permutexvar_ps(idx, lv), s);
      const int64_t o = b * kBlock + 2 * i;
      if (a.bf16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.out) + o), round_bf16_16(x));
      } else {
        _mm512_storeu_ps(static_cast<float*>(a.out) + o, x);
      }
    }
  }
}
#endif

// ---- encode ------------------------------------------------------------------------------------
//
// The torch path (FrozenCodec.encode) step by step, each operation rounded as torch rounds it in
// the compute dtype (bf16: the float result rounded to nearest even; fp32: as computed):
// scaled = x / absmax; k = (the levels <= scaled) - 1, clamped to [0, 14]; the code is k + 1 when
// |scaled - level[k+1]| < |scaled - level[k]|, else k. Two codes per byte, the first element high.

struct EncodeArgs {
  const void* values;  // padded to whole blocks
  const void* absmax;  // one per block, zero replaced by one
  uint8_t* codes;
  const float* levels;  // the 16 levels in the compute dtype, as floats
  bool bf16;
};

inline float value_of(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline float rounded(float x, bool bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

// One block at a time in fixed-length loops the compiler vectorises (the clones: AVX2 where the CPU
// has it); the level search counts the levels at or below each value instead of branching.
#if defined(ELIXIR_NF4_X86) && defined(__GNUC__) && !defined(__clang__)
#define ELIXIR_NF4_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ELIXIR_NF4_CLONES
#endif

ELIXIR_NF4_CLONES void encode_blocks(const EncodeArgs& a, int64_t b0, int64_t b1) {
  float lv[16];
  for (int j = 0; j < 16; ++j) lv[j] = a.levels[j];
  for (int64_t b = b0; b < b1; ++b) {
    const float s = value_of(a.absmax, b, a.bf16);
    float x[kBlock];
    int32_t k[kBlock];
    uint8_t code[kBlock];
    if (a.bf16) {
      const uint16_t* v = static_cast<const uint16_t*>(a.values) + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) x[i] = rounded(bf16_to_f32(v[i]) / s, true);
    } else {
      const float* v = static_cast<const float*>(a.values) + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) x[i] = v[i] / s;
    }
    for (int64_t i = 0; i < kBlock; ++i) {  // searchsorted(right=True) - 1, clamped to [0, 14]
      int32_t c = 0;
      for (int j = 1; j < 15; ++j) c += lv[j] <= x[i] ? 1 : 0;
      k[i] = c;
    }
    for (int64_t i = 0; i < kBlock; ++i) {
      const float below = std::fabs(rounded(x[i] - lv[k[i]], a.bf16));
      const float above = std::fabs(rounded(x[i] - lv[k[i] + 1], a.bf16));
      code[i] = static_cast<uint8_t>(k[i] + (above < below ? 1 : 0));
    }
    uint8_t* out = a.codes + b * (kBlock / 2);
    for (int64_t i = 0; i < kBlock / 2; ++i) out[i] = static_cast<uint8_t>(code[2 * i] << 4 | code[2 * i + 1]);
  }
}

using BlocksFn = void (*)(const Args&, int64_t, int64_t);

BlocksFn pick(const std::string& requested) {
  const CpuFeatures& f = cpu_features();
  int best = 0;  // 0 scalar, 1 avx2, 2 avx512
#ifdef ELIXIR_NF4_X86
  if (f.avx512f && f.avx512bw && f.avx512vl) best = 2;
  else if (f.avx2 && f.fma) best = 1;
#endif
  int level = best;
  if (requested.empty()) {
    const SimdLevel s = simd_level();
    level = s == SimdLevel::kAVX512 ? best : (s == SimdLevel::kAVX2 ? (best < 1 ? best : 1) : 0);
  } else if (requested == "scalar") {
    level = 0;
  } else if (requested == "avx2") {
    level = best < 1 ? best : 1;
  } else if (requested != "avx512") {
    throw std::invalid_argument("unknown SIMD level '" + requested + "' (expected scalar, avx2 or avx512)");
  }
#ifdef ELIXIR_NF4_X86
  if (level == 2) return blocks_avx512;
  if (level == 1) return blocks_avx2;
#endif
  return blocks_scalar;
}

const char* level_name(BlocksFn fn) {
#ifdef ELIXIR_NF4_X86
  if (fn == blocks_avx512) return "avx512";
  if (fn == blocks_avx2) return "avx2";
#endif
  return "scalar";
}

// Runs work(b0, b1) over [0, n_blocks) in tasks of 1024 blocks (64K elements), split by OpenMP.
template <typename Work>
void over_blocks(int64_t n_blocks, int num_threads, const Work& work) {
  const int64_t per = 1024;
  const int64_t tasks = (n_blocks + per - 1) / per;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (tasks > 1)
#endif
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t b0 = t * per, b1 = b0 + per < n_blocks ? b0 + per : n_blocks;
    work(b0, b1);
  }
}

}  // namespace

void register_nf4(py::module_& m) {
  m.def(
      "nf4_decode",
      [](uintptr_t codes, uintptr_t scales, uintptr_t out, uintptr_t levels, int64_t n_blocks, bool bf16,
         int num_threads, const std::string& simd) {
        if (n_blocks < 0) throw std::invalid_argument("negative block count");
        if (n_blocks > 0 && (!codes || !scales || !out || !levels)) throw std::invalid_argument("null pointer");
        const Args a{reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const void*>(scales),
                     reinterpret_cast<void*>(out), reinterpret_cast<const float*>(levels), bf16};
        const BlocksFn fn = pick(simd);
        py::gil_scoped_release release;
        over_blocks(n_blocks, num_threads, [&](int64_t b0, int64_t b1) { fn(a, b0, b1); });
      },
      py::arg("codes"), py::arg("scales"), py::arg("out"), py::arg("levels"), py::arg("n_blocks"), py::arg("bf16"),
      py::arg("num_threads"), py::arg("simd") = "",
      "NF4 dequantisation over raw addresses: n_blocks blocks of 64 elements, 32 code bytes each (high "
      "nibble first), one scale per block (bf16 or fp32), 16 fp32 levels; out (bf16 or fp32) = level x "
      "scale, rounded once. Releases the GIL. `simd` forces a variant (tests), capped at the CPU's.");
  m.def(
      "nf4_encode",
      [](uintptr_t values, uintptr_t absmax, uintptr_t codes, uintptr_t levels, int64_t n_blocks, bool bf16,
         int num_threads) {
        if (n_blocks < 0) throw std::invalid_argument("negative block count");
        if (n_blocks > 0 && (!values || !absmax || !codes || !levels)) throw std::invalid_argument("null pointer");
        const EncodeArgs a{reinterpret_cast<const void*>(values), reinterpret_cast<const void*>(absmax),
                           reinterpret_cast<uint8_t*>(codes), reinterpret_cast<const float*>(levels), bf16};
        py::gil_scoped_release release;
        over_blocks(n_blocks, num_threads, [&](int64_t b0, int64_t b1) { encode_blocks(a, b0, b1); });
      },
      py::arg("values"), py::arg("absmax"), py::arg("codes"), py::arg("levels"), py::arg("n_blocks"), py::arg("bf16"),
      py::arg("num_threads"),
      "NF4 codes over raw addresses: n_blocks blocks of 64 values (bf16 or fp32) and their absmaxes (zero "
      "replaced by one); each value scaled and matched to the nearest of the 16 levels as torch does it in "
      "that dtype (FrozenCodec.encode); 32 code bytes per block, high nibble first. Releases the GIL.");
  m.def(
      "nf4_kernel_level", [](const std::string& simd) { return std::string(level_name(pick(simd))); },
      py::arg("simd") = "", "The variant nf4_decode runs for this `simd` request.");
}

}  // namespace elixir
