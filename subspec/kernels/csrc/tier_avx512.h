// The AVX-512 tier (F, BW, VL, DQ): Intel Xeon since Skylake-SP, Ice/Tiger/Rocket Lake, AMD since Zen 4. Where the CPU
// has them (the build adds the flags), AVX512-BF16 multiplies the BF16 linear's pairs (vdpbf16ps, no widening),
// AVX512-VNNI the 4-bit linear's bytes (vpdpbusd), AVX512-VBMI2 expands the codec's escapes.
// BF16 linear: 16 lanes over k (32 with BF16 pairs). 4-bit linear: 8-bit activations, output rows in lanes.
#pragma once

#include <immintrin.h>

#include "drivers.h"

namespace subspec {

struct Avx512Tier {
  static constexpr const char* kName = "avx512";

  struct V {
    static constexpr int W = 16;
    using F = __m512;

    static F zero() { return _mm512_setzero_ps(); }
    static F set1(float v) { return _mm512_set1_ps(v); }
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static F load_bf16(const uint16_t* p) {
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    }
    static __m256i to_bf16_bits(F v) {
#ifdef __AVX512BF16__
      return (__m256i)_mm512_cvtneps_pbh(v);
#else  // round to nearest even by integer arithmetic (NaN -> 0x7FC0, as torch)
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
      return _mm512_cvtepi32_epi16(r);
#endif
    }
    static void store_bf16(uint16_t* p, F v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
    }
    static F round_bf16(F v) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
    }
    static F from_i32(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F div(F a, F b) { return _mm512_div_ps(a, b); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F max(F a, F b) { return _mm512_max_ps(a, b); }
    static F min(F a, F b) { return _mm512_min_ps(a, b); }
    static F abs(F a) { return _mm512_abs_ps(a); }
    static float hsum(F v) { return _mm512_reduce_add_ps(v); }
    static float hmax(F v) { return _mm512_reduce_max_ps(v); }
    static F first(F v, int n) { return _mm512_maskz_mov_ps(__mmask16((1u << n) - 1), v); }  // n <= 16
    // Cephes expf (about 1 ulp) on [-87.3, 88.3]; clamped at -87.3
    static F exp_neg(F x) {
      x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
      const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
      r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
      __m512 p = _mm512_set1_ps(1.9875691500E-4f);
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
      p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
      return _mm512_scalef_ps(p, n);
    }
    static F exp_any(F x) {  // all of fp32: +inf where it overflows (as expf)
      const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.3f), _CMP_GT_OQ);
      return _mm512_mask_blend_ps(over, exp_neg(_mm512_min_ps(x, _mm512_set1_ps(88.3f))), _mm512_set1_ps(INFINITY));
    }
    static F copysign(F a, F b) {  // |a| with b's sign
      const F sign = _mm512_castsi512_ps(_mm512_set1_epi32(int(0x80000000u)));
      return _mm512_or_ps(_mm512_andnot_ps(sign, a), _mm512_and_ps(sign, b));
    }
    static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static float hmin(F v) { return _mm512_reduce_min_ps(v); }
    // Cephes logf (about 1 ulp) for x >= 0: log(0) = -inf (denormals are not exact: log of their normalized bits)
    static F log(F x) {
      const __m512i bits = _mm512_castps_si512(x);
      F e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(126)));
      F m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x007FFFFF)),
                                                _mm512_set1_epi32(0x3F000000)));  // [0.5, 1)
      const __mmask16 small = _mm512_cmp_ps_mask(m, set1(0.707106781186547524f), _CMP_LT_OQ);
      e = _mm512_mask_sub_ps(e, small, e, set1(1.0f));
      m = _mm512_sub_ps(_mm512_mask_add_ps(m, small, m, m), set1(1.0f));
      const F r = cephes_log<V>(m, e);
      return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ), r, set1(-INFINITY));
    }
  };

  // BF16 linear: 4 rows x 4 weights per block (16 accumulators)
#ifndef SUBSPEC_AVX512_MR  // (tuning builds override these)
#define SUBSPEC_AVX512_MR 4
#define SUBSPEC_AVX512_NR 4
#define SUBSPEC_AVX512_NR1 8
#endif
  static constexpr int kMR = SUBSPEC_AVX512_MR, kNR = SUBSPEC_AVX512_NR, kNR1 = SUBSPEC_AVX512_NR1;
#ifdef __AVX512BF16__  // pairs of bf16 multiplied and summed into fp32 by vdpbf16ps: 32 k per step, no widening
  using X = uint16_t;
  using WX = uint16_t;
  static constexpr int kDotK = 32;
  using WReg = __m512bh;
  using XReg = __m512bh;
  static WReg wload(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static XReg xload(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 dot(__m512 acc, WReg w, XReg x) { return _mm512_dpbf16_ps(acc, w, x); }
#else  // weights widened to fp32, FMA over 16 lanes of k
  using X = float;
  using WX = float;
  static constexpr int kDotK = 16;
  using WReg = __m512;
  using XReg = __m512;
  static WReg wload(const uint16_t* p) { return V::load_bf16(p); }
  static WReg wload(const float* p) { return _mm512_loadu_ps(p); }
  static XReg xload(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 dot(__m512 acc, WReg w, XReg x) { return _mm512_fmadd_ps(w, x, acc); }
  static void convert_w(const uint16_t* src, float* dst, int64_t K) {
    for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(dst + k, V::load_bf16(src + k));
  }
#endif
  // drivers.h: DotBf16Gemm::block. On a Zen 4, Qwen2.5-1.5B MLP weights from DRAM, 2 threads, ns a weight at 1 / 6 / 16
  // / 32 rows: 0.063 / 0.093 / 0.143 / 0.220 with the burst, 0.058 / 0.083 / 0.130 / 0.206 spread
  static constexpr bool kSpreadPrefetch = true;
  using Bf16Gemm = DotBf16Gemm<Avx512Tier>;

  // 4-bit linear
  static int32_t quantize_q8(const uint16_t* x, int64_t n, float inv, int8_t* q) {
    const __m512 iv = _mm512_set1_ps(inv);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < n; k += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(V::load_bf16(x + k), iv));  // nearest, ties to even
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
    }
    return _mm512_reduce_add_epi32(sum);
  }

  static __m512i bcast32(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }

  // P[r][n] for MR rows of q and the 16 rows of one n-block (a chunk is one register: 16 rows x 4 bytes).
  template <int MR>
  static void w4_group(const uint8_t* c, int nchunks, const int8_t* q, int64_t ldq, int32_t (*P)[16]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
#ifdef __AVX512VNNI__
    for (int i = 0; i < nchunks; ++i) {
      const __m512i v = _mm512_loadu_si512(c + i * 64);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      for (int r = 0; r < MR; ++r) {
        const int8_t* qr = q + r * ldq + 8 * i;
        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, bcast32(qr));
        acc[r] = _mm512_dpbusd_epi32(acc[r], hi, bcast32(qr + 4));
      }
    }
#else  // vpmaddubsw pairs into int16 (4 products of at most 15 x 127 per lane), vpmaddwd widens
    const __m512i ones = _mm512_set1_epi16(1);
    for (int i = 0; i < nchunks; ++i) {
      const __m512i v = _mm512_loadu_si512(c + i * 64);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      for (int r = 0; r < MR; ++r) {
        const int8_t* qr = q + r * ldq + 8 * i;
        const __m512i t =
            _mm512_add_epi16(_mm512_maddubs_epi16(lo, bcast32(qr)), _mm512_maddubs_epi16(hi, bcast32(qr + 4)));
        acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(t, ones));
      }
    }
#endif
    for (int r = 0; r < MR; ++r) _mm512_storeu_si512(P[r], acc[r]);
  }
  static constexpr int kW4Rows = 8;  // rows of x per pass over the codes
  using W4Gemm = DotW4Gemm<Avx512Tier>;

  // codec
  static int64_t count_escapes(const uint8_t* d, int64_t n) {
    int64_t c = 0;
    for (int64_t j = 0; j < n; j += 64)
      c += __builtin_popcountll(_mm512_cmpeq_epi8_mask(_mm512_loadu_si512(d + j), _mm512_set1_epi8(-128)));
    return c;
  }

  // ord() on 32 int16 lanes (an involution: also its own inverse).
  static __m512i ord_epi16(__m512i b) { return _mm512_xor_si512(b, _mm512_srli_epi16(_mm512_srai_epi16(b, 15), 1)); }

  // bf16_rne bits of 16 fp32 lanes, in the low half of each 32-bit lane.
  static __m512i rne_bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  }

  // The prediction of each code 0..15 for the 16 rows of one group as ord() int16: tab[t][c] for row t, code c.
  static void prediction_words(const uint16_t* sp, const uint16_t* hp, int16_t (*tab)[16]) {
    const __m512 c = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int t = 0; t < 16; ++t) {
      const __m512 sc = _mm512_set1_ps(bf16_to_float(sp[t])), sh = _mm512_set1_ps(bf16_to_float(hp[t]));
      __m256i p = _mm512_cvtepi32_epi16(rne_bf16_bits(_mm512_add_ps(_mm512_mul_ps(c, sc), sh)));
      p = _mm256_xor_si256(p, _mm256_srli_epi16(_mm256_srai_epi16(p, 15), 1));  // ord()
      _mm256_store_si256(reinterpret_cast<__m256i*>(tab[t]), p);
    }
  }

  // One block: per quarter, 32 weights (4 rows x 8 columns) in one register, a row per 128-bit lane; each weight's
  // prediction looked up by one vpermt2w over the quarter's 4 rows x 16 codes of the group's table (prediction_words,
  // made once per group; two pshufb on split byte tables and an unpack before: 5 % slower on a Zen 4).
  static void decode_block(const W4Shape& s, const uint8_t* cp, const uint16_t* sp, const uint16_t* hp,
                           const int8_t* d, const uint16_t* esc, uint16_t* out) {
#ifndef __AVX512VBMI2__  // escapes placed from 16-byte loads (the drivers leave kEscapeSlack bytes after the last)
    static const ExpandTable table;
#endif
    // a quarter's four dwords (broadcast) -> lane r: row 4q + r's 4 bytes, each a word, twice (low, high nibbles)
    alignas(64) int8_t dup_idx[64];
    for (int r = 0; r < 4; ++r)
      for (int j = 0; j < 16; ++j) dup_idx[16 * r + j] = int8_t(j % 2 == 0 ? 4 * r + (j / 2) % 4 : -1);
    const __m512i dup = _mm512_load_si512(dup_idx);
    const __m512i nib = _mm512_set1_epi16(0x0F);
    const __m512i rowoff = _mm512_setr_epi64(0, 0, 0x0010001000100010LL, 0x0010001000100010LL,
                                             0x0020002000200020LL, 0x0020002000200020LL,
                                             0x0030003000300030LL, 0x0030003000300030LL);
    const __m512i escape = _mm512_set1_epi16(-128);
    alignas(64) int16_t tab[16][16];
    uint8_t* o0 = reinterpret_cast<uint8_t*>(out);
    int64_t made = -1;
    __m512i ta[4], tb[4];
    for (int64_t kb = 0; kb < s.Kb; ++kb) {
      const int64_t g = kb * s.kblock / s.group;
      if (g != made) {
        prediction_words(sp + g * kNBlock, hp + g * kNBlock, tab);
        for (int q = 0; q < 4; ++q) {
          ta[q] = _mm512_load_si512(tab[4 * q]);
          tb[q] = _mm512_load_si512(tab[4 * q + 2]);
        }
        made = g;
      }
      prefetch_l2(d + kDecodeAhead, 16 * s.kblock);  // the stream (and on into the next block) and codes ahead
      prefetch_l2(cp + kb * s.chunks * 64 + kDecodeAhead / 2, s.chunks * 64);
      for (int64_t i = 0; i < s.chunks; ++i) {
        const uint8_t* chunk = cp + (kb * s.chunks + i) * 64;
        for (int q = 0; q < 4; ++q) {
          const __m512i c = _mm512_shuffle_epi8(
              _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16 * q))), dup);
          const __m512i codes = _mm512_mask_blend_epi64(0xAA, _mm512_and_si512(c, nib),
                                                        _mm512_and_si512(_mm512_srli_epi16(c, 4), nib));
          const __m512i pred = _mm512_permutex2var_epi16(ta[q], _mm512_add_epi16(codes, rowoff), tb[q]);
          const __m512i dv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
          __m512i wv = ord_epi16(_mm512_add_epi16(pred, dv));
          const __mmask32 em = _mm512_cmpeq_epi16_mask(dv, escape);
#ifdef __AVX512VBMI2__
          // without a branch: about 9 in 10 quarters hold an escape (7 % of weights on Qwen2.5 and SmolLM2), so an
          // `if (em)` mispredicted often; branchless, a 1.5B linear_coded on a Zen 4 ran 25 % faster at one row
          wv = _mm512_mask_expandloadu_epi16(wv, em, esc);
          esc += __builtin_popcount(em);
#else  // per row (8 lanes), its escapes placed by a pshufb from the padded copy (as the avx2 tier; a branch and a
       // scalar loop before: 5x slower)
          __m512i ev = _mm512_undefined_epi32();
          for (int r = 0; r < 4; ++r) {
            const uint32_t m = (em >> (8 * r)) & 0xFF;
            const __m128i e = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(esc)),
                                               _mm_load_si128(reinterpret_cast<const __m128i*>(table.ctrl[m])));
            ev = _mm512_inserti32x4(ev, e, r);
            esc += __builtin_popcount(m);
          }
          wv = _mm512_mask_mov_epi16(wv, em, ev);
#endif
          d += 32;
          uint8_t* o = o0 + (4 * q * s.K + kb * s.kblock + 8 * i) * 2;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_extracti32x4_epi32(wv, 0));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * s.K), _mm512_extracti32x4_epi32(wv, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 4 * s.K), _mm512_extracti32x4_epi32(wv, 2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 6 * s.K), _mm512_extracti32x4_epi32(wv, 3));
        }
      }
    }
  }
};

}  // namespace subspec
