// The 8-bit-moment update on AVX-512 over whole blocks of kQBlock elements (issue 33: the int8
// kernel must run at >= 0.9x the fp32 kernel's params/s). Included by cpu_adam_lowbit.h (x86
// only); the same arithmetic as low_block, bit for bit, in two passes per block:
//
// 1. per 16 lanes: load g and the master, decode both codes, Adam's update, store the master
//    (and the optional 16-bit copy); keep new exp_avg and sqrt(exp_avg_sq) in a 2 KiB stack
//    buffer (L1) and their running absmax (and absmin) in registers;
// 2. per 16 lanes: the moments' random bits (moment_bits), encode both codes against the block's
//    new absmax, store the bytes.
//
// Pass 1 of block n runs in the same loop as pass 2 of block n - 1 (q8_update_encode): pass 1 is
// bound by the divider (a square root and a division per 16 lanes), pass 2 by integer work, and
// interleaved they share the core instead of taking turns. A block whose every code is in the
// normal range (q8_fast_side, from the absmax and absmin) takes pass 2's short path. Pass 1
// prefetches its streams kQ8Prefetch elements ahead.
//
// Decoding is one vcvtph2ps: the codes are fp16's top bits. exp_avg's code (sign, 4 exponent,
// 3 mantissa bits) shifted left by 7 is the fp16 with that value (exponent bias 15, fp16's
// subnormals are the code's linear range c * 2^-17) once its sign moves from bit 14 to bit 15;
// sqrt(exp_avg_sq)'s (4 + 4 bits) shifted left by 6 likewise (c * 2^-18 below 2^-14). The
// conversion is exact and ignores MXCSR.DAZ, so it equals code_decode for every code.

// 16 gradients as fp32.
ELIXIR_AVX512 inline __m512 q8_grad16(int grad, const void* g, int64_t i) {
  if (grad == kF32) return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
  if (grad == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

ELIXIR_AVX512 inline __m512 q8_bf16x16(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp_avg codes (sign in bit 7) at src[0..16) as fp32 values on the code's grid (scale 1).
ELIXIR_AVX512 inline __m512 q8_decode_m16(const uint8_t* src) {
  const __m256i a = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 7);
  return _mm512_cvtph_ps(_mm256_add_epi16(a, _mm256_and_si256(a, _mm256_set1_epi16(0x4000))));  // bit 14 -> 15
}

// sqrt(exp_avg_sq) codes at src[0..16) as fp32 values on the code's grid (scale 1).
ELIXIR_AVX512 inline __m512 q8_decode_v16(const uint8_t* src) {
  return _mm512_cvtph_ps(
      _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 6));
}

// code_encode on 16 lanes plus 112 << M (its exponent bias, which the byte store drops: 1792 is
// 0 mod 256 and 896 is 128, so the code is the low byte for M = 4 and that byte ^ 0x80 for M = 3).
// noise = r16 << (7 - M): its random bits where they add to y's bits. y * 2^(14+M) is exact, so the
// fma rounds like code_encode's two steps; the linear range (y < 2^-14, NaN too) is computed only
// when a lane is in it, and only there can a code be 0: M = 4's rule (a nonzero sqrt(v) never
// rounds to 0) applies there alone.
template <int M>
ELIXIR_AVX512 inline __m512i q8_encode16(__m512 y, __m512i noise) {
  constexpr int kShift = 23 - M, kBias = 112 << M;
  __m512i q = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(y), noise), kShift);
  const __mmask16 linear = _mm512_cmp_ps_mask(y, _mm512_set1_ps(0x1p-14f), _CMP_NGE_UQ);
  if (__builtin_expect(linear != 0, 0)) {  // noise * 2^-kShift = r16 * 2^-16 exactly
    const __m512 lin = _mm512_fmadd_ps(y, _mm512_set1_ps(static_cast<float>(1 << (14 + M))),
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(noise), _mm512_set1_ps(1.0f / (1 << kShift))));
    __m512i ql = _mm512_cvttps_epi32(lin);
    if constexpr (M == 4)
      ql = _mm512_mask_max_epi32(ql, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ), ql, _mm512_set1_epi32(1));
    q = _mm512_mask_add_epi32(q, linear, ql, _mm512_set1_epi32(kBias));
  }
  return _mm512_min_epi32(q, _mm512_set1_epi32(kBias + (M == 3 ? 127 : 255)));
}

// The master's 16 lanes at i as fp32.
template <int MASTER>
ELIXIR_AVX512 inline __m512 q8_master16(const LowSpan& s, int64_t i) {
  if constexpr (MASTER == kMasterF32) return _mm512_loadu_ps(static_cast<const float*>(s.p) + i);
  const __m512 p = q8_bf16x16(static_cast<const uint16_t*>(s.p) + i);
  if constexpr (MASTER == kMasterBF16Kahan) return _mm512_add_ps(p, q8_bf16x16(s.comp + i));
  return p;
}

// Store the new master p in its format (h: the element hashes, bf16-sr); returns the value stored
// (bf16-kahan: the bf16 master plus its compensation).
template <int MASTER>
ELIXIR_AVX512 inline __m512 q8_store_master16(const LowSpan& s, int64_t i, __m512 p, __m512i h) {
  if constexpr (MASTER == kMasterF32) {
    _mm512_storeu_ps(static_cast<float*>(s.p) + i, p);
    return p;
  }
  __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(s.p) + i);
  if constexpr (MASTER == kMasterBF16SR) {
    const __m512i q = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_castps_si512(p), _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF))), 16);
    _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(q));
    return _mm512_castsi512_ps(_mm512_slli_epi32(q, 16));
  }
  const __m256i q = f32x16_to_bf16(p);
  const __m512 stored = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(q), 16));
  const __m256i r = f32x16_to_bf16(_mm512_sub_ps(p, stored));
  _mm256_storeu_si256(dst, q);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.comp + i), r);
  return _mm512_add_ps(stored, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));  // p + comp
}

ELIXIR_AVX512 inline void q8_out16(int out, void* dst, int64_t i, __m512 p) {
  if (out == kNone) return;
  if (out == kF32) {
    _mm512_storeu_ps(static_cast<float*>(dst) + i, p);
    return;
  }
  __m256i* d = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i);
  if (out == kBF16) _mm256_storeu_si256(d, f32x16_to_bf16(p));
  else _mm256_storeu_si256(d, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Software prefetch distance of pass 1's streams, in elements. The loop runs about four times
// as many instructions per element as the fp32 kernel's, so the out-of-order window reaches
// only ~100 elements ahead and the hardware prefetchers alone leave it waiting on DRAM.
// 20M params, A/B in one process (2026-11-28, docs/benchmarks.md): the fp32 kernel / this one,
// 2 threads, 1.01x without prefetch and 1.06x at 1024 ahead (quiet memory); loaded memory,
// 64 B-aligned buffers, 3 runs: 1.31-1.44x at 512, 1.35-1.48x at 768, 1.38-1.48x at 1024,
// 1.34-1.36x at 256, 1.31-1.37x adding 2048 ahead into L2; 1 thread 0.98x, 1.08x, 1.06x, 1.04x.
constexpr int64_t kQ8Prefetch = 768;

ELIXIR_AVX512 inline void q8_prefetch(const void* base, int64_t byte_offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(byte_offset)),
               _MM_HINT_T0);
}

// Per-block scratch: new exp_avg and sqrt(exp_avg_sq), written by pass 1 and read by pass 2.
struct Q8Scratch {
  alignas(64) float m[kQBlock];
  alignas(64) float r[kQBlock];
};

// Pass 1's state over one block: its scales and the running reductions of the new values' bits.
struct Q8Update {
  int64_t b;           // the block's first element
  __m512 ms, kv;       // exp_avg's scale; exp_avg_sq's factor (q8_v_factor)
  __m512i hidx;        // bf16-sr: the master's stream index * golden
  __m512i mmax, mmin;  // over |exp_avg|
  __m512i rmax, rmin;  // over sqrt(exp_avg_sq) as stored (its sign is set only on a NaN: q8_finish)
};

template <int MASTER>
ELIXIR_AVX512 inline Q8Update q8_start(const Consts& c, const LowSpan& s, int64_t b) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  Q8Update u;
  u.b = b;
  u.ms = _mm512_set1_ps(s.ms[b / kQBlock]);
  u.kv = _mm512_set1_ps(q8_v_factor(c, s.vs[b / kQBlock]));
  u.hidx = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(s.offset + b)), lane),
                              _mm512_set1_epi32(static_cast<int>(kGolden)));
  u.mmax = u.rmax = _mm512_setzero_si512();
  u.mmin = u.rmin = _mm512_set1_epi32(-1);
  return u;
}

// Pass 1 on the 16 lanes at u.b + j: the update, the master stored, new m and sqrt(v) kept.
template <int MASTER>
ELIXIR_AVX512 __attribute__((always_inline)) inline void q8_update16(const Consts& c, const Consts512& k, const LowOpts& o,
                                                                      const LowSpan& s, Q8Update& u, Q8Scratch& x,
                                                                      int64_t j) {
  const int64_t i = u.b + j;
  const int64_t ahead = i + kQ8Prefetch;  // prefetches never fault, past the end included
  q8_prefetch(s.g, ahead * (o.grad == kF32 ? 4 : 2));
  q8_prefetch(s.p, ahead * (MASTER == kMasterF32 ? 4 : 2));
  if ((j & 63) == 0) {  // a line of codes holds 64 elements
    q8_prefetch(s.m, ahead);
    q8_prefetch(s.v, ahead);
  }
  __m512 g = q8_grad16(o.grad, s.g, i);
  if (c.scale) g = _mm512_div_ps(g, k.div_scale);
  __m512 p = q8_master16<MASTER>(s, i);
  if (c.wd_mode == 1) g = _mm512_fmadd_ps(p, k.wd, g);
  if (c.wd_mode == 2) p = _mm512_mul_ps(p, k.decay);
  const __m512 m0 = _mm512_mul_ps(q8_decode_m16(static_cast<const uint8_t*>(s.m) + i), u.ms);
  const __m512 d = q8_decode_v16(static_cast<const uint8_t*>(s.v) + i);
  const __m512 mn = _mm512_fmadd_ps(k.lerp_w, _mm512_sub_ps(g, m0), c.lerp_from_m ? m0 : g);
  const __m512 vn = _mm512_fmadd_ps(_mm512_mul_ps(k.c2, g), g, _mm512_mul_ps(_mm512_mul_ps(d, d), u.kv));
  const __m512 sq = _mm512_sqrt_ps(vn);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(q8_step(c)), mn),
                                     _mm512_add_ps(sq, _mm512_set1_ps(q8_eps(c)))));
  __m512i h = _mm512_setzero_si512();
  if constexpr (MASTER == kMasterBF16SR) {
    h = mix32x16(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(s.key)), u.hidx));
    u.hidx = _mm512_add_epi32(u.hidx, _mm512_set1_epi32(static_cast<int>(16u * kGolden)));
  }
  q8_out16(o.out, s.out, i, q8_store_master16<MASTER>(s, i, p, h));
  _mm512_store_ps(x.m + j, mn);
  _mm512_store_ps(x.r + j, sq);
  const __m512i am = _mm512_and_si512(_mm512_castps_si512(mn), _mm512_set1_epi32(0x7FFFFFFF));
  u.mmax = _mm512_max_epu32(u.mmax, am);
  u.mmin = _mm512_min_epu32(u.mmin, am);
  u.rmax = _mm512_max_epu32(u.rmax, _mm512_castps_si512(sq));
  u.rmin = _mm512_min_epu32(u.rmin, _mm512_castps_si512(sq));
}

// Pass 2's view of one block: the reciprocal scales, the random stream, and whether every code
// is in the normal range (q8_fast_side).
struct Q8Encode {
  int64_t b;
  __m512 mi, vi;
  __m512i weyl;
  bool fast;
};

// Every y = RN(|x| * inv) of the block lies in [2^-14, 1 + 2^-23] when its largest |x| is a
// normal below 2^126 (so inv = RN(1/max) is normal and max * inv <= 1 + 2^-24) and its smallest
// |x| maps to y >= 2^-14 (RN is monotonic). code_encode then takes its normal branch for every
// element and never clamps: (bits(y) + noise) >> (23 - M) <= 0x3F8 (M = 3), 0x7F0 (M = 4).
inline bool q8_fast_side(uint32_t max_bits, uint32_t min_bits, float inv) {
  return max_bits >= 0x00800000u && max_bits < 0x7E800000u && bits_f32(min_bits) * inv >= 0x1p-14f;
}

// The end of pass 1: the block's new scales stored (block_absmax's order: NaN above inf).
ELIXIR_AVX512 inline Q8Encode q8_finish(const LowSpan& s, const Q8Update& u, const Q8Scratch& x) {
  const int64_t blk = u.b / kQBlock;
  uint32_t rbits = _mm512_reduce_max_epu32(u.rmax);
  const bool rsign = rbits >> 31;  // a NaN with its sign set: the absolute values' max instead
  if (rsign) rbits = f32_bits(block_absmax(x.r, kQBlock));
  const uint32_t mbits = _mm512_reduce_max_epu32(u.mmax);
  const float mmax = bits_f32(mbits), vmax = bits_f32(rbits);
  s.ms[blk] = mmax;
  s.vs[blk] = vmax;
  const float mi = mmax > 0.f ? 1.0f / mmax : 0.f, vi = vmax > 0.f ? 1.0f / vmax : 0.f;
  Q8Encode e;
  e.b = u.b;
  e.mi = _mm512_set1_ps(mi);
  e.vi = _mm512_set1_ps(vi);
  e.weyl = moment_weyl16(moment_key(s.key), s.offset + static_cast<uint32_t>(u.b));
  e.fast = !rsign && q8_fast_side(mbits, _mm512_reduce_min_epu32(u.mmin), mi) &&
           q8_fast_side(rbits, _mm512_reduce_min_epu32(u.rmin), vi);
  return e;
}

// Pass 2 on the 16 lanes at e.b + j, any values: code_encode's every branch.
ELIXIR_AVX512 __attribute__((always_inline)) inline void q8_encode16_any(const LowSpan& s, Q8Encode& e,
                                                                          const Q8Scratch& x, int64_t j) {
  // h2 = hx ^ (hx >> 16) (moment_bits): exp_avg's noise is h2's low half << 4, exp_avg_sq's its
  // high half (hx's) << 3
  const __m512i hx = moment_bits_x16(e.weyl);
  const __m512i nm = _mm512_ternarylogic_epi32(_mm512_slli_epi32(hx, 4), _mm512_srli_epi32(hx, 12),
                                               _mm512_set1_epi32(0xFFFF << 4), 0x28);
  const __m512i nv = _mm512_and_si512(_mm512_srli_epi32(hx, 13), _mm512_set1_epi32(0xFFFF << 3));
  const __m512i mb = _mm512_load_si512(x.m + j);
  const __m512 am = _mm512_castsi512_ps(_mm512_and_si512(mb, _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512i qm = q8_encode16<3>(_mm512_mul_ps(am, e.mi), nm);
  // (qm ^ 0x80) | sign in the low byte: the code with exp_avg's sign in bit 7
  const __m512i cm = _mm512_ternarylogic_epi32(qm, _mm512_srli_epi32(mb, 24), _mm512_set1_epi32(0x80), 0xDA);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(s.m) + e.b + j), _mm512_cvtepi32_epi8(cm));
  const __m512i qv = q8_encode16<4>(_mm512_mul_ps(_mm512_load_ps(x.r + j), e.vi), nv);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(s.v) + e.b + j), _mm512_cvtepi32_epi8(qv));
}

// bits(y) + noise of exp_avg (zm: y keeps its sign, which stays in bit 31) and of exp_avg_sq (zv:
// 2 bits(y) + 2 noise, whose >> 20 is (bits(y) + noise) >> 19: no overflow, bits(y) <= 0x3F800001)
// on the 16 lanes at j of a block whose codes are all normal; the code is bits 27..20 of each.
// exp_avg_sq's 2 noise is hx >> 12 masked, which exp_avg's noise shares.
ELIXIR_AVX512 __attribute__((always_inline)) inline void q8_sums16(Q8Encode& e, const Q8Scratch& x, int64_t j,
                                                                    __m512i& zm, __m512i& zv) {
  const __m512i hx = moment_bits_x16(e.weyl);
  const __m512i t = _mm512_srli_epi32(hx, 12), mask = _mm512_set1_epi32(0xFFFF << 4);
  const __m512i nm = _mm512_ternarylogic_epi32(_mm512_slli_epi32(hx, 4), t, mask, 0x28);
  zm = _mm512_add_epi32(_mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(x.m + j), e.mi)), nm);
  const __m512i yv = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(x.r + j), e.vi));
  zv = _mm512_add_epi32(_mm512_add_epi32(yv, yv), _mm512_and_si512(t, mask));
}

// Pass 2 on the 32 lanes at e.b + j of a block whose codes are all normal (Q8Encode::fast):
// code_encode's normal branch alone. The sums' high halves gathered into 32 words (bits 31..16),
// shifted right by 4: the low byte is the code (exp_avg's: 0x80, the exponent bias's, | code,
// bit 7 then taken from the sign in bit 15).
ELIXIR_AVX512 __attribute__((always_inline)) inline void q8_encode32_fast(const LowSpan& s, Q8Encode& e,
                                                                           const Q8Scratch& x, int64_t j) {
  __m512i zm0, zv0, zm1, zv1;
  q8_sums16(e, x, j, zm0, zv0);
  q8_sums16(e, x, j + 16, zm1, zv1);
  const __m512i hi = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                      23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i wm = _mm512_permutex2var_epi16(zm0, hi, zm1), wv = _mm512_permutex2var_epi16(zv0, hi, zv1);
  const __m512i cm = _mm512_ternarylogic_epi32(_mm512_srli_epi16(wm, 4), _mm512_srai_epi16(wm, 8),
                                               _mm512_set1_epi16(0x80), 0xD8);
  const int64_t i = e.b + j;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint8_t*>(s.m) + i), _mm512_cvtepi16_epi8(cm));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint8_t*>(s.v) + i),
                      _mm512_cvtepi16_epi8(_mm512_srli_epi16(wv, 4)));
}

// Pass 2 on the 32 lanes at e.b + j.
template <bool FAST>
ELIXIR_AVX512 __attribute__((always_inline)) inline void q8_encode32(const LowSpan& s, Q8Encode& e,
                                                                      const Q8Scratch& x, int64_t j) {
  if constexpr (FAST) {
    q8_encode32_fast(s, e, x, j);
  } else {
    q8_encode16_any(s, e, x, j);
    q8_encode16_any(s, e, x, j + 16);
  }
}

// Pass 1 of block u.b interleaved with pass 2 of the block before it (e, scratch y), so that
// the divider's work (pass 1's square root and division) runs beside pass 2's integer work.
template <int MASTER, bool FAST>
ELIXIR_AVX512 __attribute__((always_inline)) inline void q8_update_encode(const Consts& c, const Consts512& k, const LowOpts& o, const LowSpan& s,
                                    Q8Update& u, Q8Scratch& x, Q8Encode& e, const Q8Scratch& y) {
  for (int64_t j = 0; j < kQBlock; j += 32) {
    q8_update16<MASTER>(c, k, o, s, u, x, j);
    q8_update16<MASTER>(c, k, o, s, u, x, j + 16);
    q8_encode32<FAST>(s, e, y, j);
  }
}

template <bool FAST>
ELIXIR_AVX512 __attribute__((always_inline)) inline void q8_encode_block(const LowSpan& s, Q8Encode& e, const Q8Scratch& y) {
  for (int64_t j = 0; j < kQBlock; j += 32) q8_encode32<FAST>(s, e, y, j);
}

// The full blocks of [b, e): pass 1 of each block with pass 2 of the one before it.
template <int MASTER>
ELIXIR_AVX512 void q8_blocks_avx512(const Consts& c_in, const LowOpts& o_in, const LowSpan& s_in, int64_t b,
                                    int64_t e) {
  // local copies: no store in the loops can alias them, so they stay in registers
  const Consts c = c_in;
  const LowOpts o = o_in;
  const LowSpan s = s_in;
  const Consts512 k = broadcast512(c);
  Q8Scratch buf[2];
  Q8Encode prev{};
  for (int64_t x = b, n = 0; x + kQBlock <= e; x += kQBlock, ++n) {
    Q8Scratch& cur = buf[n & 1];
    Q8Update u = q8_start<MASTER>(c, s, x);
    if (n == 0) {
      for (int64_t j = 0; j < kQBlock; j += 16) q8_update16<MASTER>(c, k, o, s, u, cur, j);
    } else if (prev.fast) {
      q8_update_encode<MASTER, true>(c, k, o, s, u, cur, prev, buf[(n - 1) & 1]);
    } else {
      q8_update_encode<MASTER, false>(c, k, o, s, u, cur, prev, buf[(n - 1) & 1]);
    }
    prev = q8_finish(s, u, cur);
    if (x + 2 * kQBlock > e) {  // the last full block
      if (prev.fast) q8_encode_block<true>(s, prev, cur);
      else q8_encode_block<false>(s, prev, cur);
    }
  }
}
