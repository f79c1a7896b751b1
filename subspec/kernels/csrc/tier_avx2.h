// The AVX2 tier (x86-64-v3: AVX2, FMA, F16C): Intel Core since Haswell, AMD since Zen 1.
// BF16 linear: weights widened to fp32 (a shift), FMA over 8 lanes of k. 4-bit linear: 8-bit activations times the
// codes with vpmaddubsw (unsigned codes x signed activations, pairs summed in int16; 4 products of at most 15 x 127 per
// int16 lane before widening with vpmaddwd, so nothing saturates), output rows in lanes.
#pragma once

#include <immintrin.h>

#include "drivers.h"

namespace subspec {

struct Avx2Tier {
  static constexpr const char* kName = "avx2";

  struct V {
    static constexpr int W = 8;
    using F = __m256;
    // drivers.h: attend_group's value passes (one thread, 3 rows, tree_attention's min of 1000 calls: 9 heads of 64
    // over 800 keys 196 -> 166 us, 12 heads of 128 over 800 462 -> 400 us; measured on a Zen 3. The portable tier's
    // compiled form got slower at 64: 321 -> 380 us)
    static constexpr bool kValuePasses = true;

    static F zero() { return _mm256_setzero_ps(); }
    static F set1(float v) { return _mm256_set1_ps(v); }
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static F load_bf16(const uint16_t* p) {
      return _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    }
    // round to nearest even, in the low 16 bits of each 32-bit lane (NaN -> 0x7FC0, as torch)
    static __m256i rne_bits(F v) {
      const __m256i u = _mm256_castps_si256(v);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    }
    static void store_bf16(uint16_t* p, F v) {
      const __m256i r = rne_bits(v);
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
    }
    static F round_bf16(F v) { return _mm256_castsi256_ps(_mm256_slli_epi32(rne_bits(v), 16)); }
    static F from_i32(const int32_t* p) {
      return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F div(F a, F b) { return _mm256_div_ps(a, b); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F max(F a, F b) { return _mm256_max_ps(a, b); }
    static F min(F a, F b) { return _mm256_min_ps(a, b); }
    static F abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
    static float hsum(F v) {  // ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      return _mm_cvtss_f32(s);
    }
    // hsum of eight vectors at once: lane i = hsum(a[i]) bit for bit (the same additions in the same order), by
    // transposing as it adds (drivers.h: attend_group's scores, 8 keys a head, when V has it)
    static F hsum8(const F* a) {
      auto halves = [](F x, F y) {  // [x0+x4 .. x3+x7 | y0+y4 .. y3+y7]
        return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
      };
      const F c01 = halves(a[0], a[1]), c23 = halves(a[2], a[3]), c45 = halves(a[4], a[5]), c67 = halves(a[6], a[7]);
      // hsum's second step, (s0 + s2, s1 + s3) of each vector: [a[0]'s, a[2]'s | a[1]'s, a[3]'s] in e0
      const F e0 = _mm256_add_ps(_mm256_shuffle_ps(c01, c23, 0x44), _mm256_shuffle_ps(c01, c23, 0xEE));
      const F e1 = _mm256_add_ps(_mm256_shuffle_ps(c45, c67, 0x44), _mm256_shuffle_ps(c45, c67, 0xEE));
      // their two halves added: vectors 0, 2, 4, 6 in the low 128 bits, 1, 3, 5, 7 in the high
      const F r = _mm256_add_ps(_mm256_shuffle_ps(e0, e1, 0x88), _mm256_shuffle_ps(e0, e1, 0xDD));
      return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    }
    static float hmax(F v) {
      __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_max_ps(s, _mm_movehl_ps(s, s));
      s = _mm_max_ss(s, _mm_movehdup_ps(s));
      return _mm_cvtss_f32(s);
    }
    static F first(F v, int n) {  // lanes n.. set to 0
      const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx)));
    }
    // Cephes expf (about 1 ulp) on [-87.3, 88.3]; clamped at -87.3, where it reaches the smallest normal float
    static F exp_neg(F x) {
      x = _mm256_max_ps(x, set1(-87.3f));
      const F n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      F r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
      r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
      F p = set1(1.9875691500E-4f);
      p = _mm256_fmadd_ps(p, r, set1(1.3981999507E-3f));
      p = _mm256_fmadd_ps(p, r, set1(8.3334519073E-3f));
      p = _mm256_fmadd_ps(p, r, set1(4.1665795894E-2f));
      p = _mm256_fmadd_ps(p, r, set1(1.6666665459E-1f));
      p = _mm256_fmadd_ps(p, r, set1(5.0000001201E-1f));
      p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, set1(1.0f)));
      const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
      return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    }
    static F exp_any(F x) {  // all of fp32: +inf where it overflows (as expf)
      const F over = _mm256_cmp_ps(x, set1(88.3f), _CMP_GT_OQ);
      return _mm256_blendv_ps(exp_neg(_mm256_min_ps(x, set1(88.3f))), set1(INFINITY), over);
    }
    static F copysign(F a, F b) {  // |a| with b's sign
      const F sign = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
      return _mm256_or_ps(_mm256_andnot_ps(sign, a), _mm256_and_ps(sign, b));
    }
    static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static float hmin(F v) {
      __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_min_ps(s, _mm_movehl_ps(s, s));
      s = _mm_min_ss(s, _mm_movehdup_ps(s));
      return _mm_cvtss_f32(s);
    }
    // Cephes logf (about 1 ulp) for x >= 0: log(0) = -inf (denormals are not exact: log of their normalized bits)
    static F log(F x) {
      const __m256i bits = _mm256_castps_si256(x);
      F e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
      F m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                                _mm256_set1_epi32(0x3F000000)));  // [0.5, 1)
      const F small = _mm256_cmp_ps(m, set1(0.707106781186547524f), _CMP_LT_OQ);
      e = _mm256_sub_ps(e, _mm256_and_ps(small, set1(1.0f)));
      m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(small, m)), set1(1.0f));
      const F r = cephes_log<V>(m, e);
      return _mm256_blendv_ps(r, set1(-INFINITY), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ));
    }
  };

  // BF16 linear: weights widened to fp32, FMA over 8 lanes of k; 3 rows x 4 weights per block (12 accumulators, the
  // 3 rows of x held in registers and each weight vector loaded once for them: on a Zen 3, 8960 x 1536 at 32 rows
  // 19 -> 11 ms against 4 x 2)
  using X = float;
  using WX = float;
#ifndef SUBSPEC_AVX2_MR  // (tuning builds override these)
#define SUBSPEC_AVX2_MR 3
#define SUBSPEC_AVX2_NR 4
#define SUBSPEC_AVX2_NR1 8
#endif
  static constexpr int kMR = SUBSPEC_AVX2_MR, kNR = SUBSPEC_AVX2_NR, kNR1 = SUBSPEC_AVX2_NR1, kDotK = V::W;
  static constexpr bool kSpreadPrefetch = true;  // drivers.h: DotBf16Gemm::block (measured on a Zen 1)
  using WReg = __m256;
  using XReg = __m256;
  static WReg wload(const uint16_t* p) { return V::load_bf16(p); }
  static WReg wload(const float* p) { return _mm256_loadu_ps(p); }
  static XReg xload(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 dot(__m256 acc, WReg w, XReg x) { return _mm256_fmadd_ps(w, x, acc); }
  static void convert_w(const uint16_t* src, float* dst, int64_t K) {
    for (int64_t k = 0; k < K; k += V::W) _mm256_storeu_ps(dst + k, V::load_bf16(src + k));
  }
  using Bf16Gemm = DotBf16Gemm<Avx2Tier>;

  // 4-bit linear
  static int32_t quantize_q8(const uint16_t* x, int64_t n, float inv, int8_t* q) {
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = 0; k < n; k += 8) {
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(V::load_bf16(x + k), iv));  // nearest, ties to even
      sum = _mm256_add_epi32(sum, v);
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w16, w16));
    }
    alignas(32) int32_t s[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s), sum);
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
  }

  static __m256i bcast32(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }

  // P[r][n] = sum over the group's chunks of codes x q, for MR rows of q (ldq apart) and the 16 rows of one n-block;
  // each half (8 output rows, 32 bytes of a chunk) in turn, two chunks per widening.
  template <int MR>
  static void w4_group(const uint8_t* c, int nchunks, const int8_t* q, int64_t ldq, int32_t (*P)[16]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
      __m256i acc[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_si256();
      for (int i = 0; i < nchunks; i += 2) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * 64 + 32 * h));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (i + 1) * 64 + 32 * h));
        const __m256i lo0 = _mm256_and_si256(v0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
        const __m256i lo1 = _mm256_and_si256(v1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
        for (int r = 0; r < MR; ++r) {
          const int8_t* qr = q + r * ldq + 8 * i;
          const __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bcast32(qr)),
                                              _mm256_maddubs_epi16(hi0, bcast32(qr + 4)));
          const __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, bcast32(qr + 8)),
                                              _mm256_maddubs_epi16(hi1, bcast32(qr + 12)));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_add_epi16(t0, t1), ones));
        }
      }
      for (int r = 0; r < MR; ++r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(P[r] + 8 * h), acc[r]);
    }
  }
  static constexpr int kW4Rows = 8;  // rows of x per pass over the codes
  using W4Gemm = DotW4Gemm<Avx2Tier>;

  // codec
  static int64_t count_escapes(const uint8_t* d, int64_t n) {
    int64_t c = 0;
    const __m256i esc = _mm256_set1_epi8(char(0x80));
    for (int64_t j = 0; j < n; j += 32)
      c += __builtin_popcount(uint32_t(_mm256_movemask_epi8(
          _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + j)), esc))));
    return c;
  }

  static __m256i ord16(__m256i b) { return _mm256_xor_si256(b, _mm256_srli_epi16(_mm256_srai_epi16(b, 15), 1)); }

  // The prediction of each code 0..15 for the 16 rows of one group (common.h: bf16_rne(code * scale + shift)), as
  // ord() int16 split into byte tables: lo[t][c] and hi[t][c] are the low and high bytes of row t's for code c.
  // A block's codes then become predictions by two pshufb (one table row per 128-bit lane).
  static void prediction_tables(const uint16_t* sp, const uint16_t* hp, uint8_t (*lo)[16], uint8_t (*hi)[16]) {
    const __m256 c0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), c1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int t = 0; t < 16; ++t) {
      const __m256 sc = _mm256_set1_ps(bf16_to_float(sp[t])), sh = _mm256_set1_ps(bf16_to_float(hp[t]));
      const __m256i p0 = rne_hi(_mm256_add_ps(_mm256_mul_ps(c0, sc), sh));
      const __m256i p1 = rne_hi(_mm256_add_ps(_mm256_mul_ps(c1, sc), sh));
      // codes 0..15 as uint16 in order, then ord(), then per 128-bit lane its 8 low bytes and 8 high bytes
      __m256i p = ord16(_mm256_permute4x64_epi64(_mm256_packus_epi32(p0, p1), 0xD8));
      p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p, split), 0xD8);  // [low bytes 0..15 | high bytes 0..15]
      _mm_store_si128(reinterpret_cast<__m128i*>(lo[t]), _mm256_castsi256_si128(p));
      _mm_store_si128(reinterpret_cast<__m128i*>(hi[t]), _mm256_extracti128_si256(p, 1));
    }
  }

  // bf16_rne bits of 8 fp32 lanes (no NaN case: the codec's prediction is defined by this integer rounding alone),
  // in the low half of each 32-bit lane.
  static __m256i rne_hi(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  }

  // One block, branch-free: two rows of a quarter (16 weights) per vector of 16-bit lanes, a row per 128-bit lane.
  // Predictions from the group's tables (prediction_tables, made once per group); escapes expanded into their lanes
  // with pshufb from 16-byte loads (the drivers leave kEscapeSlack readable bytes after the block's escapes).
  static void decode_block(const W4Shape& s, const uint8_t* cp, const uint16_t* sp, const uint16_t* hp,
                           const int8_t* d, const uint16_t* esc, uint16_t* out) {
    static const ExpandTable table;
    const __m256i escape = _mm256_set1_epi16(-128), m4 = _mm256_set1_epi8(0x0F);
    // a row pair's two dwords (8 bytes, broadcast) -> lane 0: row nt's 4 bytes twice, lane 1: row nt + 1's
    const __m256i dup = _mm256_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1, -1,
                                         4, 5, 6, 7, 4, 5, 6, 7, -1, -1, -1, -1, -1, -1, -1, -1);
    alignas(32) uint8_t lo[16][16], hi[16][16];
    int64_t made = -1;
    for (int64_t kb = 0; kb < s.Kb; ++kb) {
      const int64_t g = kb * s.kblock / s.group;
      if (g != made) {
        prediction_tables(sp + g * kNBlock, hp + g * kNBlock, lo, hi);
        made = g;
      }
      prefetch_l2(d + kDecodeAhead, 16 * s.kblock);  // the stream (and on into the next block) and codes ahead
      prefetch_l2(cp + kb * s.chunks * 64 + kDecodeAhead / 2, s.chunks * 64);
      for (int64_t i = 0; i < s.chunks; ++i) {
        const uint8_t* chunk = cp + (kb * s.chunks + i) * 64;
        for (int nt = 0; nt < 16; nt += 2, d += 16) {  // rows nt, nt + 1: stream order (quarter nt / 4)
          const __m256i c = _mm256_shuffle_epi8(
              _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + 4 * nt))), dup);
          // per lane: bytes 0..3 the low nibbles (columns 0..3), bytes 4..7 the high ones (columns 4..7)
          const __m256i codes =
              _mm256_blend_epi32(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_srli_epi16(c, 4), m4), 0x22);
          const __m256i pred = _mm256_unpacklo_epi8(
              _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(lo[nt])), codes),
              _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(hi[nt])), codes));
          const __m256i dv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
          __m256i w = ord16(_mm256_add_epi16(pred, dv));
          const __m256i em = _mm256_cmpeq_epi16(dv, escape);
          const uint32_t bits = uint32_t(_mm256_movemask_epi8(_mm256_packs_epi16(em, _mm256_setzero_si256())));
          const uint32_t ma = bits & 0xFF, mb = (bits >> 16) & 0xFF;
          const __m128i ea = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(esc)),
                                              _mm_load_si128(reinterpret_cast<const __m128i*>(table.ctrl[ma])));
          esc += _mm_popcnt_u32(ma);
          const __m128i eb = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(esc)),
                                              _mm_load_si128(reinterpret_cast<const __m128i*>(table.ctrl[mb])));
          esc += _mm_popcnt_u32(mb);
          w = _mm256_blendv_epi8(w, _mm256_set_m128i(eb, ea), em);
          uint16_t* o = out + nt * s.K + kb * s.kblock + 8 * i;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(w));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + s.K), _mm256_extracti128_si256(w, 1));
        }
      }
    }
  }
};

}  // namespace subspec
