// The 8-bit-moment update on AVX-512, one whole block of kQBlock elements per call (issue 33: the
// int8 kernel must run at >= 0.9x the fp32 kernel's params/s). Included by cpu_adam_lowbit.h
// (x86 only); the same arithmetic as low_block, bit for bit, in two passes over the block:
//
// 1. per 16 lanes: load g and the master, decode both codes, Adam's update, store the master
//    (and the optional 16-bit copy); keep new exp_avg and sqrt(exp_avg_sq) in a 2 KiB stack
//    buffer (L1) and their running absmax in registers;
// 2. per 16 lanes: the moments' random bits (moment_bits), encode both codes against the block's
//    new absmax, store the bytes.
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

// Per-block scratch: new exp_avg, sqrt(exp_avg_sq) and their absmaxes.
struct Q8Scratch {
  alignas(64) float m[kQBlock];
  alignas(64) float r[kQBlock];
  __m512i mmax, rmax;  // running max of |bits| (block_absmax's order: NaN above inf)
};

// Pass 1 over the full block at b: the update, the master stored, new m and sqrt(v) kept.
template <int MASTER>
ELIXIR_AVX512 inline void q8_update_block(const Consts& c, const Consts512& k, const LowOpts& o, const LowSpan& s,
                                          int64_t b, Q8Scratch& x) {
  const float vscale = s.vs[b / kQBlock];
  const __m512 ms = _mm512_set1_ps(s.ms[b / kQBlock]), kv = _mm512_set1_ps(q8_v_factor(c, vscale));
  const __m512 step = _mm512_set1_ps(q8_step(c)), eps = _mm512_set1_ps(q8_eps(c));
  const uint8_t* cm = static_cast<const uint8_t*>(s.m) + b;
  const uint8_t* cv = static_cast<const uint8_t*>(s.v) + b;
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), key = _mm512_set1_epi32(static_cast<int>(s.key));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i golden = _mm512_set1_epi32(static_cast<int>(0x9E3779B9u));
  __m512i hidx = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(s.offset + b)), lane), golden);
  __m512i mmax = _mm512_setzero_si512(), rmax = _mm512_setzero_si512();
  for (int64_t j = 0; j < kQBlock; j += 16) {
    const int64_t i = b + j;
    __m512 g = q8_grad16(o.grad, s.g, i);
    if (c.scale) g = _mm512_div_ps(g, k.div_scale);
    __m512 p = q8_master16<MASTER>(s, i);
    if (c.wd_mode == 1) g = _mm512_fmadd_ps(p, k.wd, g);
    if (c.wd_mode == 2) p = _mm512_mul_ps(p, k.decay);
    const __m512 m0 = _mm512_mul_ps(q8_decode_m16(cm + j), ms);
    const __m512 d = q8_decode_v16(cv + j);
    const __m512 mn = _mm512_fmadd_ps(k.lerp_w, _mm512_sub_ps(g, m0), c.lerp_from_m ? m0 : g);
    const __m512 vn = _mm512_fmadd_ps(_mm512_mul_ps(k.c2, g), g, _mm512_mul_ps(_mm512_mul_ps(d, d), kv));
    const __m512 sq = _mm512_sqrt_ps(vn);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(step, mn), _mm512_add_ps(sq, eps)));
    __m512i h = _mm512_setzero_si512();
    if constexpr (MASTER == kMasterBF16SR) {
      h = mix32x16(_mm512_xor_si512(key, hidx));
      hidx = _mm512_add_epi32(hidx, _mm512_slli_epi32(golden, 4));
    }
    q8_out16(o.out, s.out, i, q8_store_master16<MASTER>(s, i, p, h));
    _mm512_store_ps(x.m + j, mn);
    _mm512_store_ps(x.r + j, sq);
    mmax = _mm512_max_epu32(mmax, _mm512_and_si512(_mm512_castps_si512(mn), abs_mask));
    rmax = _mm512_max_epu32(rmax, _mm512_and_si512(_mm512_castps_si512(sq), abs_mask));
  }
  x.mmax = mmax;
  x.rmax = rmax;
}

// Pass 2: the block's scales, then both codes of every element.
ELIXIR_AVX512 inline void q8_encode_block(const LowSpan& s, int64_t b, const Q8Scratch& x) {
  const int64_t blk = b / kQBlock;
  const float mmax = bits_f32(_mm512_reduce_max_epu32(x.mmax)), vmax = bits_f32(_mm512_reduce_max_epu32(x.rmax));
  s.ms[blk] = mmax;
  s.vs[blk] = vmax;
  const __m512 mi = _mm512_set1_ps(mmax > 0.f ? 1.0f / mmax : 0.f), vi = _mm512_set1_ps(vmax > 0.f ? 1.0f / vmax : 0.f);
  uint8_t* dm = static_cast<uint8_t*>(s.m) + b;
  uint8_t* dv = static_cast<uint8_t*>(s.v) + b;
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i nm_mask = _mm512_set1_epi32(0xFFFF << 4), nv_mask = _mm512_set1_epi32(0xFFFF << 3);
  __m512i weyl = moment_weyl16(moment_key(s.key), s.offset + static_cast<uint32_t>(b));
  for (int64_t j = 0; j < kQBlock; j += 16) {
    // h2 = hx ^ (hx >> 16) (moment_bits): exp_avg's noise is h2's low half << 4, exp_avg_sq's its
    // high half (hx's) << 3
    const __m512i hx = moment_bits_x16(weyl);
    const __m512i nm = _mm512_ternarylogic_epi32(_mm512_slli_epi32(hx, 4), _mm512_srli_epi32(hx, 12), nm_mask, 0x28);
    const __m512i nv = _mm512_and_si512(_mm512_srli_epi32(hx, 13), nv_mask);
    const __m512i mb = _mm512_load_si512(x.m + j);
    const __m512 am = _mm512_castsi512_ps(_mm512_and_si512(mb, abs_mask));
    const __m512i qm = q8_encode16<3>(_mm512_mul_ps(am, mi), nm);
    // (qm ^ 0x80) | sign in the low byte: the code with exp_avg's sign in bit 7
    const __m512i cm = _mm512_ternarylogic_epi32(qm, _mm512_srli_epi32(mb, 24), _mm512_set1_epi32(0x80), 0xDA);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dm + j), _mm512_cvtepi32_epi8(cm));
    const __m512i qv = q8_encode16<4>(_mm512_mul_ps(_mm512_load_ps(x.r + j), vi), nv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dv + j), _mm512_cvtepi32_epi8(qv));
  }
}

// One full block of 8-bit moments.
template <int MASTER>
ELIXIR_AVX512 inline void q8_block_avx512(const Consts& c, const Consts512& k, const LowOpts& o, const LowSpan& s,
                                          int64_t b) {
  Q8Scratch x;
  q8_update_block<MASTER>(c, k, o, s, b, x);
  q8_encode_block(s, b, x);
}
