// Fused Adam / AdamW update on the CPU over contiguous ranges of raw buffers.
//
// One pass per element: read the fp32 master param p, moments m and v, and the gradient g (fp32,
// fp16 or bf16); divide g by div_scale (loss-scale unscale and clip in one factor); apply L2 or
// decoupled weight decay; update m, v and p; optionally write p cast to fp16 or bf16 (round to
// nearest even, like torch's `.to()`).
//
// The arithmetic is that of torch's fused CPU Adam kernel as shipped (torch 2.x, vector path),
// operation by operation, with constants rounded to float the same way. Its source writes
// v * beta2 + (1 - beta2) * g * g and g + p * wd; its build contracts both into the fmas below,
// which the tests confirm bit for bit:
//   g  = g / div_scale                          (only when div_scale != 1)
//   g  = fma(p, wd, g)                          (Adam, L2 decay)   | p = p * (1 - lr*wd) (AdamW)
//   m  = fma(w, g - m, m)  if |w| < 0.5 else fma(w - 1, g - m, g),  w = 1 - beta1 (torch's lerp)
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   p  = p + (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
// Every element, vector or tail, uses exactly these operations, so results do not depend on the
// SIMD level, the thread count or how a range is split. Compiler contraction of a*b+c into fma is
// switched off below so that only the fmas written here exist.
//
// SIMD variants (AVX-512 with or without native bf16 conversion, AVX2+F16C, scalar) are compiled
// into this one object with target attributes and chosen at run time; OpenMP splits the work.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 false positive on the intrinsics' `__Y = __Y` placeholders (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define ELIXIR_ADAM_X86 1
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <pybind11/stl.h>

#include "cpu_features.h"
#include "registry.h"

// No a*b+c contraction: the only fmas are the ones written below (see the header comment).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace py = pybind11;

namespace elixir {
namespace {

// Element types of the gradient and of the optional low-precision output.
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 3 };

// The kernel variants; kAVX512BF16 is AVX-512 plus the native fp32->bf16 conversion instruction.
enum Level : int { kLScalar = 0, kLAVX2 = 1, kLAVX512 = 2, kLAVX512BF16 = 3 };
constexpr int kNumLevels = 4;
const char* const kLevelNames[kNumLevels] = {"scalar", "avx2", "avx512", "avx512bf16"};

// Per-call constants, already rounded to float exactly where torch rounds them.
struct Consts {
  float div_scale;   // gradient divisor (unscale and clip); used only when `scale`
  bool scale;
  int wd_mode;       // 0: no decay, 1: L2 (Adam), 2: decoupled (AdamW)
  float wd;          // L2 coefficient
  float decay;       // 1 - lr * wd, decoupled
  float lerp_w;      // coefficient of (g - m)
  bool lerp_from_m;  // base of the lerp: m when |1 - beta1| < 0.5, else g
  float beta2;
  float c2;          // 1 - beta2
  float bc2_sqrt;    // sqrt(bias_correction2)
  float eps;
  float neg_step;    // -lr / bias_correction1
};

// One contiguous range: every pointer addresses n elements.
struct Span {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* out;
  int64_t n;
};

// ---------------------------------------------------------------------------------------------
// Scalar conversions (exact, bit-for-bit what the hardware instructions produce for non-NaN).

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);
  // Subnormal half: normalise.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return bits_f32(sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3FFu) << 13));
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x1FFu);  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                       // normal half (>= 2^-14)
    return sign | static_cast<uint16_t>((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13);
  }
  if (a <= 0x33000000u) return sign;  // <= 2^-25 rounds to zero (the tie goes to even)
  // Subnormal half: value = mant * 2^(e - 150), in units of 2^-24 it is mant >> (126 - e).
  const uint32_t e = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;
  uint32_t r = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

template <int G>
inline float load_grad1(const void* g, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(g)[i];
  if constexpr (G == kF16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  if constexpr (G == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return 0.f;
}

template <int O>
inline void store_out1(void* out, int64_t i, float x) {
  if constexpr (O == kF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
  if constexpr (O == kBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
}

// The update of one element: the reference formula. Inlined into every SIMD variant for tails,
// where __builtin_fmaf becomes the fma instruction.
template <int G, int O>
__attribute__((always_inline)) inline void adam_one(const Consts& c, const Span& s, int64_t i) {
  float g = load_grad1<G>(s.g, i);
  float p = s.p[i];
  if (c.scale) g = g / c.div_scale;
  if (c.wd_mode == 1) g = __builtin_fmaf(p, c.wd, g);
  if (c.wd_mode == 2) p = p * c.decay;
  const float m0 = s.m[i];
  const float m = __builtin_fmaf(c.lerp_w, g - m0, c.lerp_from_m ? m0 : g);
  const float v = __builtin_fmaf(c.c2 * g, g, s.v[i] * c.beta2);
  s.m[i] = m;
  s.v[i] = v;
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step * m) / denom;
  s.p[i] = p;
  store_out1<O>(s.out, i, p);
}

template <int G, int O>
void range_scalar(const Consts& c, const Span& s, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) adam_one<G, O>(c, s, i);
}

#ifdef ELIXIR_ADAM_X86
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: 8 lanes.
#define ELIXIR_AVX2 __attribute__((target("avx2,fma,f16c")))

ELIXIR_AVX2 inline __m256 bf16x8_to_f32(const void* ptr) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(ptr));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ELIXIR_AVX2 inline __m128i f32x8_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(nan));
  // Pack 8 x u32 (each <= 0xFFFF) into 8 x u16.
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <int G, int O>
ELIXIR_AVX2 void range_avx2(const Consts& c, const Span& s, int64_t b, int64_t e) {
  const __m256 div_scale = _mm256_set1_ps(c.div_scale), wd = _mm256_set1_ps(c.wd);
  const __m256 decay = _mm256_set1_ps(c.decay), lerp_w = _mm256_set1_ps(c.lerp_w);
  const __m256 beta2 = _mm256_set1_ps(c.beta2), c2 = _mm256_set1_ps(c.c2);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 neg_step = _mm256_set1_ps(c.neg_step);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 g;
    if constexpr (G == kF32) g = _mm256_loadu_ps(static_cast<const float*>(s.g) + i);
    if constexpr (G == kF16)
      g = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s.g) + i)));
    if constexpr (G == kBF16) g = bf16x8_to_f32(static_cast<const uint16_t*>(s.g) + i);
    __m256 p = _mm256_loadu_ps(s.p + i);
    if (c.scale) g = _mm256_div_ps(g, div_scale);
    if (c.wd_mode == 1) g = _mm256_fmadd_ps(p, wd, g);
    if (c.wd_mode == 2) p = _mm256_mul_ps(p, decay);
    const __m256 m0 = _mm256_loadu_ps(s.m + i);
    const __m256 m = _mm256_fmadd_ps(lerp_w, _mm256_sub_ps(g, m0), c.lerp_from_m ? m0 : g);
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(_mm256_loadu_ps(s.v + i), beta2));
    _mm256_storeu_ps(s.m + i, m);
    _mm256_storeu_ps(s.v + i, v);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
    _mm256_storeu_ps(s.p + i, p);
    if constexpr (O == kF16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(s.out) + i),
                       _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if constexpr (O == kBF16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(s.out) + i), f32x8_to_bf16(p));
  }
  for (; i < e; ++i) adam_one<G, O>(c, s, i);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL) + FMA + F16C: 16 lanes. NATIVE_BF16 uses vcvtneps2bf16 for the bf16 output.
#define ELIXIR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ELIXIR_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

ELIXIR_AVX512 inline __m256i f32x16_to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// vcvtneps2bf16 rounds to nearest even but treats fp32 subnormal inputs as zero, where torch keeps
// them (bf16 has fp32's exponent range). Vectors holding a subnormal take the integer path.
ELIXIR_AVX512BF16 inline __m256i f32x16_to_bf16_native(__m512 x) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 subnormal = _mm512_cmp_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)),
                                                    _mm512_set1_epi32(0x007FFFFF), _MM_CMPINT_LT);
  if (__builtin_expect(subnormal != 0, 0)) return f32x16_to_bf16(x);
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}

// Broadcast constants, built once per range.
struct Consts512 {
  __m512 div_scale, wd, decay, lerp_w, beta2, c2, bc2_sqrt, eps, neg_step;
};

ELIXIR_AVX512 inline Consts512 broadcast512(const Consts& c) {
  return {_mm512_set1_ps(c.div_scale), _mm512_set1_ps(c.wd),       _mm512_set1_ps(c.decay),
          _mm512_set1_ps(c.lerp_w),    _mm512_set1_ps(c.beta2),    _mm512_set1_ps(c.c2),
          _mm512_set1_ps(c.bc2_sqrt),  _mm512_set1_ps(c.eps),      _mm512_set1_ps(c.neg_step)};
}

// Updates p, m, v at [i, i + 16) and returns the new p (for the low-precision copy).
template <int G>
ELIXIR_AVX512 __attribute__((always_inline)) inline __m512 step16(const Consts& c, const Consts512& k,
                                                                   const Span& s, int64_t i) {
  __m512 g;
  if constexpr (G == kF32) g = _mm512_loadu_ps(static_cast<const float*>(s.g) + i);
  if constexpr (G == kF16)
    g = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(s.g) + i)));
  if constexpr (G == kBF16)
    g = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(s.g) + i))),
        16));
  __m512 p = _mm512_loadu_ps(s.p + i);
  if (c.scale) g = _mm512_div_ps(g, k.div_scale);
  if (c.wd_mode == 1) g = _mm512_fmadd_ps(p, k.wd, g);
  if (c.wd_mode == 2) p = _mm512_mul_ps(p, k.decay);
  const __m512 m0 = _mm512_loadu_ps(s.m + i);
  const __m512 m = _mm512_fmadd_ps(k.lerp_w, _mm512_sub_ps(g, m0), c.lerp_from_m ? m0 : g);
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(k.c2, g), g, _mm512_mul_ps(_mm512_loadu_ps(s.v + i), k.beta2));
  _mm512_storeu_ps(s.m + i, m);
  _mm512_storeu_ps(s.v + i, v);
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), k.bc2_sqrt), k.eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(k.neg_step, m), denom));
  _mm512_storeu_ps(s.p + i, p);
  return p;
}

// Ranges at least this long write the low-precision copy with non-temporal stores: the copy is
// write-only, so streaming it skips reading its lines first (2 of 30 bytes per element) and
// keeps it from evicting p, m and v.
constexpr int64_t kStreamMin = int64_t(1) << 18;

// Elements to process one by one from `i` until the 16-bit copy at `i` is 32-byte aligned, or -1
// when streaming does not apply to [i, e).
inline int64_t stream_peel(const void* out, int64_t i, int64_t e) {
  if (e - i < kStreamMin) return -1;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(out) + i);
  if (addr & 1u) return -1;
  return static_cast<int64_t>(((32u - (addr & 31u)) & 31u) / 2u);
}

template <int G, int O, bool STREAM>
ELIXIR_AVX512 __attribute__((always_inline)) inline void loop_avx512(const Consts& c, const Consts512& k,
                                                                      const Span& s, int64_t& i, int64_t e) {
  for (; i + 16 <= e; i += 16) {
    const __m512 p = step16<G>(c, k, s, i);
    if constexpr (O != kNone) {
      __m256i h;
      if constexpr (O == kF16) h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      else h = f32x16_to_bf16(p);
      __m256i* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(s.out) + i);
      if constexpr (STREAM) _mm256_stream_si256(out, h);
      else _mm256_storeu_si256(out, h);
    }
  }
}

template <int G, int O>
ELIXIR_AVX512 void range_avx512(const Consts& c, const Span& s, int64_t b, int64_t e) {
  const Consts512 k = broadcast512(c);
  int64_t i = b;
  const int64_t peel = O == kNone ? -1 : stream_peel(s.out, b, e);
  if (peel >= 0) {
    for (const int64_t stop = b + peel; i < stop; ++i) adam_one<G, O>(c, s, i);
    loop_avx512<G, O, true>(c, k, s, i, e);
    _mm_sfence();
  } else {
    loop_avx512<G, O, false>(c, k, s, i, e);
  }
  for (; i < e; ++i) adam_one<G, O>(c, s, i);
}

// Only the bf16 output differs from range_avx512.
template <bool STREAM, int G>
ELIXIR_AVX512BF16 __attribute__((always_inline)) inline void loop_avx512bf16(const Consts& c, const Consts512& k,
                                                                              const Span& s, int64_t& i, int64_t e) {
  for (; i + 16 <= e; i += 16) {
    const __m512 p = step16<G>(c, k, s, i);
    __m256i* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(s.out) + i);
    if constexpr (STREAM) _mm256_stream_si256(out, f32x16_to_bf16_native(p));
    else _mm256_storeu_si256(out, f32x16_to_bf16_native(p));
  }
}

template <int G, int O>
ELIXIR_AVX512BF16 void range_avx512bf16(const Consts& c, const Span& s, int64_t b, int64_t e) {
  static_assert(O == kBF16, "the native-bf16 variant only exists for bf16 output");
  const Consts512 k = broadcast512(c);
  int64_t i = b;
  const int64_t peel = stream_peel(s.out, b, e);
  if (peel >= 0) {
    for (const int64_t stop = b + peel; i < stop; ++i) adam_one<G, O>(c, s, i);
    loop_avx512bf16<true, G>(c, k, s, i, e);
    _mm_sfence();
  } else {
    loop_avx512bf16<false, G>(c, k, s, i, e);
  }
  for (; i < e; ++i) adam_one<G, O>(c, s, i);
}
#endif  // ELIXIR_ADAM_X86

// ---------------------------------------------------------------------------------------------
// Bandwidth probe (benchmarks): the update's memory traffic, read p g m v and write p m v (fp32),
// with one add per stream instead of Adam's arithmetic. Its GB/s is the roofline of the update.

void probe_scalar(const Consts&, const Span& s, int64_t b, int64_t e) {
  float* __restrict p = s.p;
  float* __restrict m = s.m;
  float* __restrict v = s.v;
  const float* __restrict g = static_cast<const float*>(s.g);
  for (int64_t i = b; i < e; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

#ifdef ELIXIR_ADAM_X86
ELIXIR_AVX512 void probe_avx512(const Consts& c, const Span& s, int64_t b, int64_t e) {
  const float* g = static_cast<const float*>(s.g);
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(s.p + i, _mm512_add_ps(_mm512_loadu_ps(s.p + i), x));
    _mm512_storeu_ps(s.m + i, _mm512_add_ps(_mm512_loadu_ps(s.m + i), x));
    _mm512_storeu_ps(s.v + i, _mm512_add_ps(_mm512_loadu_ps(s.v + i), x));
  }
  probe_scalar(c, s, i, e);
}

ELIXIR_AVX2 void probe_avx2(const Consts& c, const Span& s, int64_t b, int64_t e) {
  const float* g = static_cast<const float*>(s.g);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(s.p + i, _mm256_add_ps(_mm256_loadu_ps(s.p + i), x));
    _mm256_storeu_ps(s.m + i, _mm256_add_ps(_mm256_loadu_ps(s.m + i), x));
    _mm256_storeu_ps(s.v + i, _mm256_add_ps(_mm256_loadu_ps(s.v + i), x));
  }
  probe_scalar(c, s, i, e);
}
#endif  // ELIXIR_ADAM_X86

// ---------------------------------------------------------------------------------------------
// Dispatch.

using RangeFn = void (*)(const Consts&, const Span&, int64_t, int64_t);

template <int G, int O>
RangeFn pick(int level) {
#ifdef ELIXIR_ADAM_X86
  if (level == kLAVX512BF16) {
    if constexpr (O == kBF16) return &range_avx512bf16<G, O>;
    return &range_avx512<G, O>;
  }
  if (level == kLAVX512) return &range_avx512<G, O>;
  if (level == kLAVX2) return &range_avx2<G, O>;
#endif
  (void)level;
  return &range_scalar<G, O>;
}

template <int G>
RangeFn pick_out(int level, int out) {
  switch (out) {
    case kF16: return pick<G, kF16>(level);
    case kBF16: return pick<G, kBF16>(level);
    default: return pick<G, kNone>(level);
  }
}

RangeFn pick_fn(int level, int grad, int out) {
  switch (grad) {
    case kF16: return pick_out<kF16>(level, out);
    case kBF16: return pick_out<kBF16>(level, out);
    default: return pick_out<kF32>(level, out);
  }
}

RangeFn pick_probe(int level) {
#ifdef ELIXIR_ADAM_X86
  if (level >= kLAVX512) return &probe_avx512;
  if (level == kLAVX2) return &probe_avx2;
#endif
  (void)level;
  return &probe_scalar;
}

// The best variant this CPU can run, ignoring ELIXIR_SIMD.
int machine_level() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl && f.fma && f.f16c) return f.avx512bf16 ? kLAVX512BF16 : kLAVX512;
  if (f.avx2 && f.fma && f.f16c) return kLAVX2;
  return kLScalar;
}

// `requested` empty: the process-wide level (ELIXIR_SIMD honoured). Otherwise a level name, capped
// at what the machine supports (used by tests to cover every path in one process).
int resolve_level(const std::string& requested) {
  const int best = machine_level();
  if (requested.empty()) {
    switch (simd_level()) {
      case SimdLevel::kAVX512: return best >= kLAVX512 ? best : kLAVX2;
      case SimdLevel::kAVX2: return best >= kLAVX2 ? kLAVX2 : kLScalar;
      default: return kLScalar;
    }
  }
  for (int l = 0; l < kNumLevels; ++l) {
    if (requested == kLevelNames[l]) return l < best ? l : best;
  }
  throw std::invalid_argument("unknown SIMD level '" + requested +
                              "' (expected scalar, avx2, avx512 or avx512bf16)");
}

Consts make_consts(double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool adamw_mode, bool bias_correction, double div_scale) {
  // Bias corrections and step size in double, then rounded to float, as torch does.
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
  const double step_size = lr / bc1;
  Consts c{};
  c.scale = div_scale != 1.0;
  c.div_scale = static_cast<float>(div_scale);
  c.wd_mode = weight_decay != 0.0 ? (adamw_mode ? 2 : 1) : 0;
  c.wd = static_cast<float>(weight_decay);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  const float w = static_cast<float>(1.0 - beta1);
  c.lerp_from_m = std::fabs(w) < 0.5f;
  c.lerp_w = c.lerp_from_m ? w : w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.c2 = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.neg_step = static_cast<float>(-step_size);
  return c;
}

// Below this many elements per thread, extra threads cost more than they bring.
constexpr int64_t kMinPerThread = int64_t(1) << 15;
// Thread boundaries fall on multiples of this many elements (one 64-byte line of fp32).
constexpr int64_t kAlign = 16;

// Thread `t` of `nt` processes the elements [lo, hi) of the concatenation of all spans.
void run_share(RangeFn fn, const Consts& c, const std::vector<Span>& spans, int64_t total, int t, int nt) {
  const int64_t lo = t == 0 ? 0 : (total * t / nt) / kAlign * kAlign;
  const int64_t hi = t == nt - 1 ? total : (total * (t + 1) / nt) / kAlign * kAlign;
  int64_t base = 0;
  for (const Span& s : spans) {
    const int64_t b = lo > base ? lo - base : 0;
    const int64_t e = hi - base < s.n ? hi - base : s.n;
    if (b < e) fn(c, s, b, e);
    base += s.n;
    if (base >= hi) break;
  }
}

void run_all(RangeFn fn, const Consts& c, const std::vector<Span>& spans, int num_threads) {
  int64_t total = 0;
  for (const Span& s : spans) total += s.n;
  if (total == 0) return;
  int64_t nt = num_threads > 0 ? num_threads : 1;
  const int64_t useful = (total + kMinPerThread - 1) / kMinPerThread;
  if (nt > useful) nt = useful;
#if defined(_OPENMP)
  if (nt > 1) {
#pragma omp parallel num_threads(static_cast<int>(nt))
    run_share(fn, c, spans, total, omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  run_share(fn, c, spans, total, 0, 1);
}

using SpanTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t>;

std::vector<Span> to_spans(const std::vector<SpanTuple>& spans, bool need_out) {
  std::vector<Span> list;
  list.reserve(spans.size());
  for (const SpanTuple& t : spans) {
    Span s{reinterpret_cast<float*>(std::get<0>(t)), reinterpret_cast<const void*>(std::get<1>(t)),
           reinterpret_cast<float*>(std::get<2>(t)), reinterpret_cast<float*>(std::get<3>(t)),
           reinterpret_cast<void*>(std::get<4>(t)), std::get<5>(t)};
    if (s.n < 0) throw std::invalid_argument("negative span length");
    if (s.n > 0 && (!s.p || !s.g || !s.m || !s.v || (need_out && !s.out)))
      throw std::invalid_argument("null pointer in a non-empty span");
    list.push_back(s);
  }
  return list;
}

#include "cpu_adam_lowbit.h"  // low-precision state: shares this namespace's helpers

}  // namespace

void register_cpu_adam(py::module_& m) {
  register_lowbit(m);
  m.def(
      "adam_update",
      [](const std::vector<SpanTuple>& spans, int grad_dtype, int out_dtype, double step, double lr,
         double beta1, double beta2, double eps, double weight_decay, bool adamw_mode, bool bias_correction,
         double div_scale, int num_threads, const std::string& simd) {
        if (grad_dtype < kF32 || grad_dtype > kBF16) throw std::invalid_argument("grad_dtype must be 0, 1 or 2");
        if (out_dtype < kF32 + 1 || out_dtype > kNone) throw std::invalid_argument("out_dtype must be 1, 2 or 3");
        const std::vector<Span> list = to_spans(spans, out_dtype != kNone);
        const RangeFn fn = pick_fn(resolve_level(simd), grad_dtype, out_dtype);
        const Consts c = make_consts(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, div_scale);
        py::gil_scoped_release release;
        run_all(fn, c, list, num_threads);
      },
      py::arg("spans"), py::arg("grad_dtype"), py::arg("out_dtype"), py::arg("step"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
      py::arg("bias_correction"), py::arg("div_scale"), py::arg("num_threads"), py::arg("simd") = "",
      "Adam/AdamW step over spans (p, g, m, v, out, n) of raw addresses: p, m, v fp32; g of grad_dtype "
      "(0 fp32, 1 fp16, 2 bf16); out of out_dtype (1 fp16, 2 bf16, 3 none). Releases the GIL. `simd` "
      "forces a kernel variant (tests), capped at what the CPU supports.");
  m.def(
      "adam_bandwidth_probe",
      [](const std::vector<SpanTuple>& spans, int num_threads) {
        const std::vector<Span> list = to_spans(spans, false);
        const RangeFn fn = pick_probe(resolve_level(""));
        py::gil_scoped_release release;
        run_all(fn, Consts{}, list, num_threads);
      },
      py::arg("spans"), py::arg("num_threads"),
      "Benchmarks: p += g; m += g; v += g over fp32 spans, split as adam_update splits them: the "
      "update's memory traffic without its arithmetic (its roofline).");
  m.def(
      "adam_kernel_level", [](const std::string& simd) { return std::string(kLevelNames[resolve_level(simd)]); },
      py::arg("simd") = "", "The kernel variant adam_update runs for this `simd` request.");
  m.def(
      "adam_kernel_levels",
      [] {
        std::vector<std::string> out;
        for (int l = 0; l <= machine_level(); ++l) out.emplace_back(kLevelNames[l]);
        return out;
      },
      "Every kernel variant this CPU can run, slowest first.");
}

}  // namespace elixir
