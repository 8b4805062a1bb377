// Adam/AdamW with low-precision optimizer state (issue 33), included by cpu_adam.cpp inside its
// anonymous namespace: it shares that file's Consts, conversions, levels and make_consts.
//
// One fused pass per block of kQBlock elements (the block stays in L1): read the gradient, the
// master (fp32, or bf16 plus a bf16 Kahan compensation) and the moments (fp32, bf16, or 8-bit
// codes with one fp32 absmax scale per block), update them with cpu_adam.cpp's arithmetic, and
// write them back in their formats. Every element goes through the same scalar-semantics loops,
// compiled once per SIMD level (the compiler vectorises them), so results do not depend on the
// level, the thread count or the split. elixir/optim/lowbit.py is the same math in torch.
//
// Rounding:
// - bf16-sr master and bf16 moments: stochastic rounding, adding 16 random bits below bf16's
//   mantissa and truncating. bf16-kahan: round to nearest even, the residual kept in the
//   compensation buffer (master = p + comp); the optional copy `out` (fp32, fp16 or bf16) gets
//   the compensated value p + comp, so a compute copy finer than bf16 sees every update at once
//   (given p alone, the forward lags the master by up to half a bf16 ulp: issue 33's +3% at 124M).
// - int8 moments: exp_avg as sign + a 7-bit float code (4 exponent, 3 mantissa bits),
//   sqrt(exp_avg_sq) as an unsigned 8-bit float code (4 exponent, 4 mantissa bits), each relative
//   to its block's absmax (a dynamic code: 15 binades below the block's largest value, then a
//   linear subnormal range), rounded stochastically. A nonzero sqrt(v) never rounds to 0 (that
//   would turn a small update into m / eps).
// - Random bits: h = mix32(key ^ index * 0x9E3779B9), `key` per (seed, chunk, step) from Python
//   and `index` the element's position in its chunk, so a run is reproducible and ranks draw
//   independent streams. The master's rounding takes h's low 16 bits; the moments take
//   h2 = moment_bits(moment_key(key), index), a second, cheaper stream (one hash per element
//   where only the moments round), exp_avg its low and exp_avg_sq its high 16 bits.

enum MasterFmt : int { kMasterF32 = 0, kMasterBF16SR = 1, kMasterBF16Kahan = 2 };
enum MomentFmt : int { kMomF32 = 0, kMomBF16 = 1, kMomQ8 = 2 };
constexpr int64_t kQBlock = 256;  // keep equal to elixir.plan.state_format.QUANT_BLOCK

struct LowSpan {
  void* p;           // fp32 or bf16 master
  const void* g;     // gradient, of LowOpts::grad
  void* m;           // exp_avg: fp32, bf16 or uint8 codes
  void* v;           // exp_avg_sq (fp32, bf16) or sqrt(exp_avg_sq) codes (uint8)
  float* ms;         // int8 only: per-block absmax of exp_avg
  float* vs;         // int8 only: per-block absmax of sqrt(exp_avg_sq)
  uint16_t* comp;    // bf16-kahan only: the compensation buffer
  void* out;         // optional fp32/fp16/bf16 copy of the new master (bf16-kahan: p + comp)
  int64_t n;
  uint32_t key;      // random stream of this span's chunk and step
  uint32_t offset;   // index of the span's first element in its stream
};

struct LowOpts {
  int grad;
  int master;
  int moments;
  int out;
};

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of the moments' random stream, from the master's (lowbit._moment_key).
inline uint32_t moment_key(uint32_t key) { return mix32(key ^ 0x68E31DA4u); }

// The moments' random bits of element idx (lowbit.moment_bits): a Weyl sequence (one add per
// element in the SIMD loop: (key + idx * golden) * 0x7feb352d steps by a constant), then half of
// mix32: xorshift, multiply, xorshift. Six vector ops per 16 elements against mix32's ten; its
// 16-bit halves pass the same uniformity and neighbour-correlation checks as mix32's (and each
// element's bits are uniform over steps for any bijection of the key, which this is).
constexpr uint32_t kGolden = 0x9E3779B9u, kWeylMul = 0x7feb352du, kMomMul = 0x846ca68bu;
inline uint32_t moment_bits(uint32_t key, uint32_t idx) {
  uint32_t x = (key + idx * kGolden) * kWeylMul;
  x ^= x >> 16;
  x *= kMomMul;
  return x ^ (x >> 16);
}

// fp16 -> fp32 without branches (vectorisable): subnormals by an exact power-of-two product.
inline float f16_to_f32_flat(uint16_t h) {
  const uint32_t em = h & 0x7FFFu;
  float f = bits_f32(em << 13) * 0x1p112f;
  if (em >= 0x7C00u) f = bits_f32(0x7F800000u | (em << 13));
  return bits_f32(f32_bits(f) | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

// 8-bit float code with M mantissa bits of y in [0, ~1], rounded stochastically with the 16
// random bits `r16` (placed at the top of the bits the code drops).
// Branch-free (the compiler vectorises the loops calling these only without control flow).
template <int M>
inline int32_t code_encode(float y, uint32_t r16) {
  constexpr int kShift = 23 - M;
  const int32_t normal = static_cast<int32_t>((f32_bits(y) + (r16 << (kShift - 16))) >> kShift) - (112 << M);
  // the linear range below 2^-14, in steps of 2^-(14+M)
  const int32_t linear =
      static_cast<int32_t>(y * static_cast<float>(1 << (14 + M)) + static_cast<float>(static_cast<int32_t>(r16)) * 0x1p-16f);
  const int32_t is_normal = -static_cast<int32_t>(y >= 0x1p-14f);
  const int32_t q = (normal & is_normal) | (linear & ~is_normal);
  return std::min(q, M == 3 ? 127 : 255);
}

template <int M>
inline float code_decode(uint32_t c) {
  const uint32_t sub = f32_bits(static_cast<float>(static_cast<int32_t>(c)) * (1.0f / static_cast<float>(1 << (14 + M))));
  const uint32_t nrm = (c + (112u << M)) << (23 - M);
  const uint32_t is_sub = -static_cast<uint32_t>(c < (1u << M));
  return bits_f32((sub & is_sub) | (nrm & ~is_sub));
}

// The 8-bit-moment update's constants (lowbit.kernel_consts, q8_step and q8_eps). It divides once:
// p + (neg_step * bc2_sqrt * m) / (sqrt(v) + eps * bc2_sqrt), the fp32 update's
// p + (neg_step * m) / (sqrt(v) / bc2_sqrt + eps) with the bias correction moved out of the
// denominator (the divider is the pass's bottleneck). And exp_avg_sq is d * d * (scale^2 * beta2)
// with d the decoded code (d * d is exact: d has at most 5 significant bits): one rounding, one
// multiply fewer than (d * scale)^2 * beta2.
inline float q8_step(const Consts& c) { return c.neg_step * c.bc2_sqrt; }
inline float q8_eps(const Consts& c) { return c.eps * c.bc2_sqrt; }
inline float q8_v_factor(const Consts& c, float vscale) { return vscale * vscale * c.beta2; }

inline uint16_t sr_bf16(float x, uint32_t rb) { return static_cast<uint16_t>((f32_bits(x) + (rb & 0xFFFFu)) >> 16); }

inline float block_absmax(const float* x, int64_t len) {
  uint32_t mx = 0;
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t a = f32_bits(x[j]) & 0x7FFFFFFFu;
    mx = a > mx ? a : mx;
  }
  return bits_f32(mx);
}


#ifdef ELIXIR_ADAM_X86
ELIXIR_AVX512 inline __m512i mix32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// moment_bits before its last xorshift for 16 elements; the Weyl term y advances by 16 elements.
ELIXIR_AVX512 inline __m512i moment_bits_x16(__m512i& y) {
  const __m512i x = _mm512_mullo_epi32(_mm512_xor_si512(y, _mm512_srli_epi32(y, 16)), _mm512_set1_epi32(static_cast<int>(kMomMul)));
  y = _mm512_add_epi32(y, _mm512_set1_epi32(static_cast<int>(16u * kGolden * kWeylMul)));
  return x;
}

// The Weyl term of moment_bits for elements idx0 .. idx0 + 15.
ELIXIR_AVX512 inline __m512i moment_weyl16(uint32_t key, uint32_t idx0) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(idx0)), lane);
  const __m512i kg = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(key)),
                                      _mm512_mullo_epi32(idx, _mm512_set1_epi32(static_cast<int>(kGolden))));
  return _mm512_mullo_epi32(kg, _mm512_set1_epi32(static_cast<int>(kWeylMul)));
}

ELIXIR_AVX512 int64_t moment_bits_avx512(uint32_t key, uint32_t idx0, uint32_t* h, int64_t len) {
  __m512i y = moment_weyl16(key, idx0);
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    const __m512i x = moment_bits_x16(y);
    _mm512_store_si512(h + j, _mm512_xor_si512(x, _mm512_srli_epi32(x, 16)));
  }
  return j;
}

ELIXIR_AVX512 int64_t hash_avx512(uint32_t key, uint32_t idx0, uint32_t* h, int64_t len) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i k = _mm512_set1_epi32(static_cast<int>(key));
  const __m512i golden = _mm512_set1_epi32(static_cast<int>(0x9E3779B9u));
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(idx0 + static_cast<uint32_t>(j))), lane);
    _mm512_store_si512(h + j, mix32x16(_mm512_xor_si512(k, _mm512_mullo_epi32(idx, golden))));
  }
  return j;
}

#include "cpu_adam_lowbit_q8.h"  // the fused 8-bit-moment block
#endif

// h[j] for j < len: the master's stream mix32(key ^ (idx0 + j) * 0x9E3779B9), or with MOMENTS the
// moments' cheaper moment_bits(key, idx0 + j).
template <bool AVX512, bool MOMENTS>
__attribute__((always_inline)) inline void fill_bits(uint32_t key, uint32_t idx0, uint32_t* h, int64_t len) {
  int64_t j0 = 0;
#ifdef ELIXIR_ADAM_X86
  if constexpr (AVX512) j0 = MOMENTS ? moment_bits_avx512(key, idx0, h, len) : hash_avx512(key, idx0, h, len);
#endif
  for (int64_t j = j0; j < len; ++j) {
    const uint32_t idx = idx0 + static_cast<uint32_t>(j);
    h[j] = MOMENTS ? moment_bits(key, idx) : mix32(key ^ (idx * 0x9E3779B9u));
  }
}

// The update on len elements: cpu_adam.cpp's adam_one, operation by operation, or with the 8-bit
// moments (Q8) q8_step's one division; v[j] * vmul is exp_avg_sq * beta2 (q8_v_factor for Q8).
template <bool Q8>
__attribute__((always_inline)) inline void low_update(const Consts& c, float vmul, const float* __restrict__ g,
                                                      float* __restrict__ p, float* __restrict__ m,
                                                      float* __restrict__ v, float* __restrict__ r, int64_t len) {
  const float step = Q8 ? q8_step(c) : c.neg_step, eps = Q8 ? q8_eps(c) : c.eps;
  const int wd_mode = c.wd_mode;  // locals: the loop vectorises only when no store can alias c
  const bool from_m = c.lerp_from_m;
  const float wd = c.wd, decay = c.decay, lerp_w = c.lerp_w, c2 = c.c2, bc2_sqrt = c.bc2_sqrt;
  for (int64_t j = 0; j < len; ++j) {
    float gg = g[j];
    float pp = p[j];
    if (wd_mode == 1) gg = __builtin_fmaf(pp, wd, gg);
    if (wd_mode == 2) pp = pp * decay;
    const float m0 = m[j];
    const float mn = __builtin_fmaf(lerp_w, gg - m0, from_m ? m0 : gg);
    const float vn = __builtin_fmaf(c2 * gg, gg, v[j] * vmul);
    const float sq = std::sqrt(vn);
    const float denom = Q8 ? sq + eps : sq / bc2_sqrt + eps;
    p[j] = pp + (step * mn) / denom;
    m[j] = mn;
    v[j] = vn;
    r[j] = sq;
  }
}

// One block [b, b + len) of span s: the whole update, state read and written in its formats.
template <int LEN, bool AVX512>
__attribute__((always_inline)) inline void low_block(const Consts& c, const LowOpts& o, const LowSpan& s, int64_t b,
                                                     int64_t dyn_len) {
  const int64_t len = LEN > 0 ? LEN : dyn_len;
  const int64_t blk = b / kQBlock;
  alignas(64) float g[kQBlock], p[kQBlock], m[kQBlock], v[kQBlock], r[kQBlock];
  alignas(64) uint32_t h[kQBlock], h2[kQBlock];  // the master's and the moments' random bits
  const uint32_t idx0 = s.offset + static_cast<uint32_t>(b);
  if (o.master == kMasterBF16SR) fill_bits<AVX512, false>(s.key, idx0, h, len);
  if (o.moments != kMomF32) fill_bits<AVX512, true>(moment_key(s.key), idx0, h2, len);
  // gradient
  if (o.grad == kF32) {
    const float* src = static_cast<const float*>(s.g) + b;
    for (int64_t j = 0; j < len; ++j) g[j] = src[j];
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(s.g) + b;
    if (o.grad == kBF16) {
      for (int64_t j = 0; j < len; ++j) g[j] = bf16_to_f32(src[j]);
    } else {
      for (int64_t j = 0; j < len; ++j) g[j] = f16_to_f32_flat(src[j]);
    }
  }
  if (c.scale) {
    for (int64_t j = 0; j < len; ++j) g[j] = g[j] / c.div_scale;
  }
  // master
  if (o.master == kMasterF32) {
    const float* src = static_cast<const float*>(s.p) + b;
    for (int64_t j = 0; j < len; ++j) p[j] = src[j];
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(s.p) + b;
    if (o.master == kMasterBF16Kahan) {
      const uint16_t* cmp = s.comp + b;
      for (int64_t j = 0; j < len; ++j) p[j] = bf16_to_f32(src[j]) + bf16_to_f32(cmp[j]);
    } else {
      for (int64_t j = 0; j < len; ++j) p[j] = bf16_to_f32(src[j]);
    }
  }
  // moments
  if (o.moments == kMomF32) {
    const float* sm = static_cast<const float*>(s.m) + b;
    const float* sv = static_cast<const float*>(s.v) + b;
    for (int64_t j = 0; j < len; ++j) m[j] = sm[j];
    for (int64_t j = 0; j < len; ++j) v[j] = sv[j];
  } else if (o.moments == kMomBF16) {
    const uint16_t* sm = static_cast<const uint16_t*>(s.m) + b;
    const uint16_t* sv = static_cast<const uint16_t*>(s.v) + b;
    for (int64_t j = 0; j < len; ++j) m[j] = bf16_to_f32(sm[j]);
    for (int64_t j = 0; j < len; ++j) v[j] = bf16_to_f32(sv[j]);
  } else {
    const uint8_t* sm = static_cast<const uint8_t*>(s.m) + b;
    const uint8_t* sv = static_cast<const uint8_t*>(s.v) + b;
    const float mscale = s.ms[blk];
    for (int64_t j = 0; j < len; ++j) {
      const float a = code_decode<3>(sm[j] & 0x7Fu) * mscale;
      m[j] = bits_f32(f32_bits(a) | (static_cast<uint32_t>(sm[j] & 0x80u) << 24));
    }
    for (int64_t j = 0; j < len; ++j) {
      const float d = code_decode<4>(sv[j]);
      v[j] = d * d;  // exact; the scale is in q8_v_factor
    }
  }
  if (o.moments == kMomQ8) low_update<true>(c, q8_v_factor(c, s.vs[blk]), g, p, m, v, r, len);
  else low_update<false>(c, c.beta2, g, p, m, v, r, len);
  // master back, p[] becoming the value stored
  if (o.master == kMasterF32) {
    float* dst = static_cast<float*>(s.p) + b;
    for (int64_t j = 0; j < len; ++j) dst[j] = p[j];
  } else if (o.master == kMasterBF16SR) {
    uint16_t* dst = static_cast<uint16_t*>(s.p) + b;
    for (int64_t j = 0; j < len; ++j) {
      const uint16_t q = sr_bf16(p[j], h[j]);
      dst[j] = q;
      p[j] = bf16_to_f32(q);
    }
  } else {
    uint16_t* dst = static_cast<uint16_t*>(s.p) + b;
    uint16_t* cmp = s.comp + b;
    for (int64_t j = 0; j < len; ++j) {
      const uint16_t q = f32_to_bf16(p[j]);
      const float stored = bf16_to_f32(q);
      const uint16_t r = f32_to_bf16(p[j] - stored);
      cmp[j] = r;
      dst[j] = q;
      p[j] = stored + bf16_to_f32(r);  // the compensated master: what the compute copy holds
    }
  }
  // moments back
  if (o.moments == kMomF32) {
    float* dm = static_cast<float*>(s.m) + b;
    float* dv = static_cast<float*>(s.v) + b;
    for (int64_t j = 0; j < len; ++j) dm[j] = m[j];
    for (int64_t j = 0; j < len; ++j) dv[j] = v[j];
  } else if (o.moments == kMomBF16) {
    uint16_t* dm = static_cast<uint16_t*>(s.m) + b;
    uint16_t* dv = static_cast<uint16_t*>(s.v) + b;
    for (int64_t j = 0; j < len; ++j) dm[j] = sr_bf16(m[j], h2[j]);  // m: the low, v: the high half
    for (int64_t j = 0; j < len; ++j) dv[j] = sr_bf16(v[j], h2[j] >> 16);
  } else {
    uint8_t* dm = static_cast<uint8_t*>(s.m) + b;
    uint8_t* dv = static_cast<uint8_t*>(s.v) + b;
    const float mmax = block_absmax(m, len), vmax = block_absmax(r, len);
    const float minv = mmax > 0.f ? 1.0f / mmax : 0.f, vinv = vmax > 0.f ? 1.0f / vmax : 0.f;
    s.ms[blk] = mmax;
    s.vs[blk] = vmax;
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t sign = (f32_bits(m[j]) >> 24) & 0x80u;
      const int32_t q = code_encode<3>(std::fabs(m[j]) * minv, h2[j] & 0xFFFFu);
      dm[j] = static_cast<uint8_t>(static_cast<uint32_t>(q) | sign);
    }
    for (int64_t j = 0; j < len; ++j) {
      const float y = r[j] * vinv;
      const int32_t q = code_encode<4>(y, h2[j] >> 16);
      dv[j] = static_cast<uint8_t>(q + static_cast<int32_t>((q == 0) & (y > 0.f)));
    }
  }
  if (o.out == kF32) {
    float* dst = static_cast<float*>(s.out) + b;
    for (int64_t j = 0; j < len; ++j) dst[j] = p[j];
  } else if (o.out == kBF16) {
    uint16_t* dst = static_cast<uint16_t*>(s.out) + b;
    for (int64_t j = 0; j < len; ++j) dst[j] = f32_to_bf16(p[j]);
  } else if (o.out == kF16) {
    uint16_t* dst = static_cast<uint16_t*>(s.out) + b;
    for (int64_t j = 0; j < len; ++j) dst[j] = f32_to_f16(p[j]);
  }
}

template <bool AVX512>
__attribute__((always_inline)) inline void low_range_impl(const Consts& c, const LowOpts& o, const LowSpan& s,
                                                          int64_t b, int64_t e) {
  for (int64_t x = b; x < e; x += kQBlock) {
    if (e - x >= kQBlock) low_block<kQBlock, AVX512>(c, o, s, x, kQBlock);
    else low_block<0, AVX512>(c, o, s, x, e - x);
  }
}

using LowRangeFn = void (*)(const Consts&, const LowOpts&, const LowSpan&, int64_t, int64_t);

void low_range_scalar(const Consts& c, const LowOpts& o, const LowSpan& s, int64_t b, int64_t e) {
  low_range_impl<false>(c, o, s, b, e);
}
#ifdef ELIXIR_ADAM_X86
ELIXIR_AVX2 void low_range_avx2(const Consts& c, const LowOpts& o, const LowSpan& s, int64_t b, int64_t e) {
  low_range_impl<false>(c, o, s, b, e);
}
// 8-bit moments: full blocks take the fused q8_blocks_avx512 (same results, a fraction of the time).
template <int MASTER>
ELIXIR_AVX512 void q8_range_avx512(const Consts& c, const LowOpts& o, const LowSpan& s, int64_t b, int64_t e) {
  const int64_t full = b + (e - b) / kQBlock * kQBlock;
  if (full > b) q8_blocks_avx512<MASTER>(c, o, s, b, full);
  if (full < e) low_block<0, true>(c, o, s, full, e - full);
}

ELIXIR_AVX512 void low_range_avx512(const Consts& c, const LowOpts& o, const LowSpan& s, int64_t b, int64_t e) {
  if (o.moments != kMomQ8) return low_range_impl<true>(c, o, s, b, e);
  if (o.master == kMasterF32) return q8_range_avx512<kMasterF32>(c, o, s, b, e);
  if (o.master == kMasterBF16SR) return q8_range_avx512<kMasterBF16SR>(c, o, s, b, e);
  q8_range_avx512<kMasterBF16Kahan>(c, o, s, b, e);
}
#endif

LowRangeFn pick_low(int level) {
#ifdef ELIXIR_ADAM_X86
  if (level >= kLAVX512) return &low_range_avx512;
  if (level == kLAVX2) return &low_range_avx2;
#endif
  (void)level;
  return &low_range_scalar;
}

// Blocks per unit of work handed to a thread (whole blocks, so the split changes no result).
constexpr int64_t kLowTaskBlocks = 64;

void run_low(LowRangeFn fn, const Consts& c, const LowOpts& o, const std::vector<LowSpan>& spans, int num_threads) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> tasks;  // (span, begin, end)
  int64_t total = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(spans.size()); ++i) {
    const int64_t n = spans[i].n;
    total += n;
    for (int64_t b = 0; b < n; b += kQBlock * kLowTaskBlocks)
      tasks.emplace_back(i, b, std::min(n, b + kQBlock * kLowTaskBlocks));
  }
  int64_t nt = num_threads > 0 ? num_threads : 1;
  const int64_t useful = (total + kMinPerThread - 1) / kMinPerThread;
  if (nt > useful) nt = useful;
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
#if defined(_OPENMP)
  if (nt > 1) {
#pragma omp parallel for num_threads(static_cast<int>(nt)) schedule(static)
    for (int64_t t = 0; t < ntasks; ++t) fn(c, o, spans[std::get<0>(tasks[t])], std::get<1>(tasks[t]), std::get<2>(tasks[t]));
    return;
  }
#endif
  for (int64_t t = 0; t < ntasks; ++t) fn(c, o, spans[std::get<0>(tasks[t])], std::get<1>(tasks[t]), std::get<2>(tasks[t]));
}

// (p, g, m, v, m_scale, v_scale, comp, out, n, key, offset): raw addresses, 0 for unused ones.
using LowSpanTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                uintptr_t, int64_t, uint32_t, uint32_t>;

std::vector<LowSpan> to_low_spans(const std::vector<LowSpanTuple>& spans, const LowOpts& o) {
  std::vector<LowSpan> list;
  list.reserve(spans.size());
  for (const LowSpanTuple& t : spans) {
    LowSpan s{reinterpret_cast<void*>(std::get<0>(t)),  reinterpret_cast<const void*>(std::get<1>(t)),
              reinterpret_cast<void*>(std::get<2>(t)),  reinterpret_cast<void*>(std::get<3>(t)),
              reinterpret_cast<float*>(std::get<4>(t)), reinterpret_cast<float*>(std::get<5>(t)),
              reinterpret_cast<uint16_t*>(std::get<6>(t)), reinterpret_cast<void*>(std::get<7>(t)),
              std::get<8>(t), std::get<9>(t), std::get<10>(t)};
    if (s.n < 0) throw std::invalid_argument("negative span length");
    const bool bad = !s.p || !s.g || !s.m || !s.v || (o.moments == kMomQ8 && (!s.ms || !s.vs)) ||
                     (o.master == kMasterBF16Kahan && !s.comp) || (o.out != kNone && !s.out);
    if (s.n > 0 && bad) throw std::invalid_argument("null pointer in a non-empty span");
    list.push_back(s);
  }
  return list;
}

void register_lowbit(py::module_& m) {
  m.def(
      "adam_update_lowbit",
      [](const std::vector<LowSpanTuple>& spans, int grad_dtype, int master, int moments, int out_dtype,
         double step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, double div_scale, int num_threads, const std::string& simd) {
        if (grad_dtype < kF32 || grad_dtype > kBF16) throw std::invalid_argument("grad_dtype must be 0, 1 or 2");
        if (master < kMasterF32 || master > kMasterBF16Kahan) throw std::invalid_argument("master must be 0, 1 or 2");
        if (moments < kMomF32 || moments > kMomQ8) throw std::invalid_argument("moments must be 0, 1 or 2");
        if (out_dtype < kF32 || out_dtype > kNone) throw std::invalid_argument("out_dtype must be 0, 1, 2 or 3");
        const LowOpts o{grad_dtype, master, moments, out_dtype};
        const std::vector<LowSpan> list = to_low_spans(spans, o);
        const LowRangeFn fn = pick_low(resolve_level(simd));
        const Consts c = make_consts(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, div_scale);
        py::gil_scoped_release release;
        run_low(fn, c, o, list, num_threads);
      },
      py::arg("spans"), py::arg("grad_dtype"), py::arg("master"), py::arg("moments"), py::arg("out_dtype"),
      py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("div_scale"), py::arg("num_threads"),
      py::arg("simd") = "",
      "Adam/AdamW step with low-precision state over spans (p, g, m, v, m_scale, v_scale, comp, out, n, key, "
      "offset): master 0 fp32, 1 bf16 stochastic rounding, 2 bf16 + Kahan comp (out: p + comp); moments 0 fp32, 1 bf16, 2 "
      "8-bit codes with per-256-block fp32 absmax scales (m_scale, v_scale). Releases the GIL.");
}
