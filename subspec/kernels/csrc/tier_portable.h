// The portable tier: plain C++ with GCC/Clang vector extensions and no intrinsics, so it compiles for any target; it
// is built for the CPU's own instruction set (-march=native, -mcpu=native: ARM64's NEON and its dot-product or SVE
// extensions, AVX2 on x86; the target's baseline where the compiler refuses that) and the compiler vectorizes it for
// what the CPU has. Built with
// -ffp-contract=off: a * b + c is a multiply and an add wherever it appears, so every element's sequence is the one
// written here (batch invariance, drivers.h), whatever the compiler chooses to vectorize.
#pragma once

#include "drivers.h"

namespace subspec {

struct PortableTier {
  static constexpr const char* kName = "portable";

  struct V {
    static constexpr int W = 8;
    typedef float F __attribute__((vector_size(32)));
    typedef int32_t I __attribute__((vector_size(32)));
    typedef uint32_t U __attribute__((vector_size(32)));

    static F zero() { return F{}; }
    static F set1(float v) { return F{} + v; }
    static F load(const float* p) {
      F v;
      std::memcpy(&v, p, sizeof v);
      return v;
    }
    static void store(float* p, F v) { std::memcpy(p, &v, sizeof v); }
    static F load_bf16(const uint16_t* p) {
      typedef uint16_t H __attribute__((vector_size(16)));
      H h;
      std::memcpy(&h, p, sizeof h);
      const U u = __builtin_convertvector(h, U) << 16;
      F f;
      std::memcpy(&f, &u, sizeof f);
      return f;
    }
    static U rne_bits(F v) {  // to_bf16 of each lane (round to nearest even, NaN -> 0x7FC0) in its low 16 bits
      U u;
      std::memcpy(&u, &v, sizeof u);
      const U r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
      return v != v ? U{} + 0x7FC0u : r;
    }
    static void store_bf16(uint16_t* p, F v) {
      typedef uint16_t H __attribute__((vector_size(16)));
      const H h = __builtin_convertvector(rne_bits(v), H);
      std::memcpy(p, &h, sizeof h);
    }
    static F round_bf16(F v) {
      const U b = rne_bits(v) << 16;
      F f;
      std::memcpy(&f, &b, sizeof f);
      return f;
    }
    static F from_i32(const int32_t* p) {
      I v;
      std::memcpy(&v, p, sizeof v);
      return __builtin_convertvector(v, F);
    }
    static F add(F a, F b) { return a + b; }
    static F sub(F a, F b) { return a - b; }
    static F mul(F a, F b) { return a * b; }
    static F div(F a, F b) { return a / b; }
    static F fma(F a, F b, F c) { return a * b + c; }  // two roundings (no contraction in this build)
    static F max(F a, F b) { return a > b ? a : b; }
    static F min(F a, F b) { return a < b ? a : b; }
    static F abs(F a) {
      U u;
      std::memcpy(&u, &a, sizeof u);
      u &= 0x7FFFFFFFu;
      std::memcpy(&a, &u, sizeof a);
      return a;
    }
    static float hsum(F v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
    static float hmax(F v) {
      float m = v[0];
      for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
      return m;
    }
    static F first(F v, int n) {  // lanes n.. set to 0
      const I idx = {0, 1, 2, 3, 4, 5, 6, 7};
      return idx < n ? v : F{};
    }
    static F round_int(F x) {  // to the nearest integer, ties to even (|x| < 2^22)
      const F big = set1(12582912.0f);
      return (x + big) - big;
    }
    static F pow2(F n) {  // 2^n for integral n in [-126, 127]
      const I e = (__builtin_convertvector(n, I) + 127) << 23;
      F r;
      std::memcpy(&r, &e, sizeof r);
      return r;
    }
    // Cephes expf (about 1 ulp) on [-87.3, 88.3]; clamped at -87.3, where it reaches the smallest normal float
    static F exp_neg(F x) {
      x = max(x, set1(-87.3f));
      const F n = round_int(x * 1.44269504088896341f);
      F r = x - n * 0.693359375f;
      r = r + n * 2.12194440e-4f;
      F p = set1(1.9875691500E-4f);
      p = p * r + 1.3981999507E-3f;
      p = p * r + 8.3334519073E-3f;
      p = p * r + 4.1665795894E-2f;
      p = p * r + 1.6666665459E-1f;
      p = p * r + 5.0000001201E-1f;
      p = p * (r * r) + (r + 1.0f);
      return p * pow2(n);
    }
    static F round(F x) { return round_int(x); }
    static F copysign(F a, F b) {  // |a| with b's sign
      U ua, ub;
      std::memcpy(&ua, &a, sizeof ua);
      std::memcpy(&ub, &b, sizeof ub);
      ua = (ua & 0x7FFFFFFFu) | (ub & 0x80000000u);
      std::memcpy(&a, &ua, sizeof a);
      return a;
    }
    static float hmin(F v) {
      float m = v[0];
      for (int i = 1; i < W; ++i) m = v[i] < m ? v[i] : m;
      return m;
    }
    // Cephes logf (about 1 ulp) for x >= 0: log(0) = -inf (denormals are not exact: log of their normalized bits)
    static F log(F x) {
      U bits;
      std::memcpy(&bits, &x, sizeof bits);
      const I ei = __builtin_convertvector(bits >> 23, I) - 126;
      F e = __builtin_convertvector(ei, F);
      const U mb = (bits & 0x007FFFFFu) | 0x3F000000u;
      F m;
      std::memcpy(&m, &mb, sizeof m);
      const auto small = m < 0.707106781186547524f;
      e = small ? e - 1.0f : e;
      m = (small ? m + m : m) - 1.0f;
      const F r = cephes_log<V>(m, e);
      return x == 0.0f ? set1(-INFINITY) : r;
    }
    static F exp_any(F x) {  // all of fp32: +inf where it overflows (as expf)
      const F inf = set1(INFINITY);
      const F y = exp_neg(min(x, set1(88.3f)));
      return x > 88.3f ? inf : y;
    }
  };

  // BF16 linear: fp32 products and sums, 8 lanes over k; 3 rows x 3 weights per block (9 accumulators, 3 rows of x,
  // a weight and the product in flight: 14 vectors, within AVX2's 16 and NEON's 32 registers of 4 lanes x 2). On a
  // Zen 3 (-march=native), 8960 x 1536 at 3 and 17 rows, 2 threads, best of the runs: 3.16 -> 2.13 ms and
  // 9.37 -> 5.67 ms against 2 x 4 (3 x 4 spills: 2.15 / 8.50 ms; 4 x 2: 1.89 / 7.70 ms)
  using X = float;
  using WX = float;
#ifndef SUBSPEC_PORTABLE_MR  // (tuning builds override these)
#define SUBSPEC_PORTABLE_MR 3
#define SUBSPEC_PORTABLE_NR 3
#define SUBSPEC_PORTABLE_NR1 4
#endif
  static constexpr int kMR = SUBSPEC_PORTABLE_MR, kNR = SUBSPEC_PORTABLE_NR, kNR1 = SUBSPEC_PORTABLE_NR1, kDotK = V::W;
  using WReg = V::F;
  using XReg = V::F;
  static WReg wload(const uint16_t* p) { return V::load_bf16(p); }
  static WReg wload(const float* p) { return V::load(p); }
  static XReg xload(const float* p) { return V::load(p); }
  static V::F dot(V::F acc, WReg w, XReg x) { return V::fma(w, x, acc); }
  static void convert_w(const uint16_t* src, float* dst, int64_t K) {
    for (int64_t k = 0; k < K; k += V::W) V::store(dst + k, V::load_bf16(src + k));
  }
  using Bf16Gemm = DotBf16Gemm<PortableTier>;

  // 4-bit linear: 8-bit activations, integer dot products per chunk
  static int32_t quantize_q8(const uint16_t* x, int64_t n, float inv, int8_t* q) {
    int32_t sum = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int32_t v = int32_t(std::nearbyint(bf16_to_float(x[k]) * inv));  // ties to even
      q[k] = int8_t(v);
      sum += v;
    }
    return sum;
  }
  // P[r][n] = sum over the group's chunks of codes x q (drivers.h). A chunk is 16 words, one per output row n, whose
  // byte j holds the codes of k = j (low nibble) and k = 4 + j (high nibble). Taken a quarter of a chunk at a time
  // (4 words: 16 bytes widened to 16 uint16 lanes in the chunk's own order), the low and high nibbles are a mask and a
  // shift, and lane 4t + j multiplies by q[j] (low) and q[4 + j] (high): the same four int16 values in every group of
  // four lanes, one 8-byte broadcast each, made once per group (pattern). Each lane sums its products in int16 over
  // up to 8 chunks (|sum| <= 8 x 2 x 15 x 127 = 30480), then a row's four lanes are added in int32. Only
  // element-wise operators, a widening conversion and broadcasts: any target's vectorizer maps them onto its 16-bit
  // multiplies (AVX2's vpmullw, NEON's mla). Integer sums: exact in any order. On a Zen 3 (-march=native, AVX2),
  // bench_kernels' draft pass (30 Qwen2.5-1.5B layers, floor 29.5 ms) at 1, 3 and 17 rows: 135 / 290 / 1690 ms with
  // a chunk's eight nibble planes widened from 32-bit words and eight broadcast multiplies a row -> 65 / 100 / 461 ms
  // (a build without -march=native, SSE2 only, 3 rows: 350-410 -> 550-610 ms; the patterns made with shuffles
  // instead of broadcasts: 480 ms there, 10-25 % slower with AVX2).
  template <int MR>
  static void w4_group(const uint8_t* c, int nchunks, const int8_t* q, int64_t ldq, int32_t (*P)[16]) {
    typedef uint8_t U8x16 __attribute__((vector_size(16)));
    typedef uint16_t U16x16 __attribute__((vector_size(32)));
    typedef int16_t I16x16 __attribute__((vector_size(32)));
    typedef uint64_t U64x4 __attribute__((vector_size(32)));
    typedef int32_t I32x8 __attribute__((vector_size(32)));
    typedef uint32_t U32x8 __attribute__((vector_size(32)));
    constexpr int kSpan = 8;  // chunks summed in int16 before widening
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < 16; ++n) P[r][n] = 0;
    for (int i0 = 0; i0 < nchunks; i0 += kSpan) {
      const int span = nchunks - i0 < kSpan ? nchunks - i0 : kSpan;
      int16_t pattern[MR][kSpan][8];  // row r, chunk i: q[8i .. 8i + 7] as int16 (low nibbles' 4, high nibbles' 4)
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < span; ++i)
          for (int j = 0; j < 8; ++j) pattern[r][i][j] = q[r * ldq + 8 * (i0 + i) + j];
      I32x8 pairs[MR][4];
      for (int v = 0; v < 4; ++v) {  // words 4v .. 4v + 3: output rows 4v .. 4v + 3
        I16x16 acc[MR];
        for (int r = 0; r < MR; ++r) acc[r] = I16x16{};
        for (int i = 0; i < span; ++i) {
          U8x16 b;
          std::memcpy(&b, c + 64 * (i0 + i) + 16 * v, sizeof b);
          const U16x16 w = __builtin_convertvector(b, U16x16);
          const I16x16 lo = I16x16(w & 15), hi = I16x16(w >> 4);
          for (int r = 0; r < MR; ++r) {
            uint64_t a, h;
            std::memcpy(&a, pattern[r][i], 8);
            std::memcpy(&h, pattern[r][i] + 4, 8);
            const U64x4 av = U64x4{} + a, hv = U64x4{} + h;
            I16x16 qa, qh;
            std::memcpy(&qa, &av, sizeof qa);
            std::memcpy(&qh, &hv, sizeof qh);
            acc[r] += lo * qa + hi * qh;
          }
        }
        for (int r = 0; r < MR; ++r) {  // lanes 4t + j: pairs added in int32 lanes (2t, 2t + 1)
          I32x8 x;
          std::memcpy(&x, &acc[r], sizeof x);
          pairs[r][v] = (I32x8(U32x8(x) << 16) >> 16) + (x >> 16);  // (the left shift unsigned: defined)
        }
      }
      for (int r = 0; r < MR; ++r)  // the two pairs of each row: even + odd lanes of quarters (0, 1) and (2, 3)
        for (int h = 0; h < 2; ++h) {
          const I32x8 a = pairs[r][2 * h], b = pairs[r][2 * h + 1];
#if defined(__clang__) || __GNUC__ >= 12
          const I32x8 sum = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
                            __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#else
          const I32x8 sum = {a[0] + a[1], a[2] + a[3], a[4] + a[5], a[6] + a[7],
                             b[0] + b[1], b[2] + b[3], b[4] + b[5], b[6] + b[7]};
#endif
          I32x8 p;
          std::memcpy(&p, P[r] + 8 * h, sizeof p);
          p += sum;
          std::memcpy(P[r] + 8 * h, &p, sizeof p);
        }
    }
  }
  static constexpr int kW4Rows = 8;  // rows of x per pass over the codes
  using W4Gemm = DotW4Gemm<PortableTier>;

  // codec
  static int64_t count_escapes(const uint8_t* d, int64_t n) { return count_escapes_scalar(d, n); }
  // A block decoded a chunk row at a time on 8-lane vectors (common.h's format): the
  // row's eight codes (nibble e of its dword: byte e % 4, the high nibble for e >= 4), the prediction
  // bf16_rne(code * scale + shift) in fp32 lanes rounded by predict_bf16's integer arithmetic, then ord() + d and back
  // on int32 lanes; a row with escapes (d = -128, a few percent of weights) has them patched in after, in stream order.
  static void decode_block(const W4Shape& s, const uint8_t* cp, const uint16_t* sp, const uint16_t* hp,
                           const int8_t* d, const uint16_t* esc, uint16_t* out) {
    typedef uint32_t U8 __attribute__((vector_size(32)));
    typedef int32_t I8 __attribute__((vector_size(32)));
    typedef float F8 __attribute__((vector_size(32)));
    typedef uint16_t H8 __attribute__((vector_size(16)));
    const U8 shifts = {0, 8, 16, 24, 4, 12, 20, 28}, byte_up = {24, 16, 8, 0, 24, 16, 8, 0};
    float s16[16], z16[16];  // the group's 16 scales and shifts, widened once per group
    int64_t made = -1;
    for (int64_t kb = 0; kb < s.Kb; ++kb) {
      const int64_t g = kb * s.kblock / s.group;
      if (g != made) {
        for (int t = 0; t < 16; ++t) {
          s16[t] = bf16_to_float(sp[g * kNBlock + t]);
          z16[t] = bf16_to_float(hp[g * kNBlock + t]);
        }
        made = g;
      }
      prefetch_l2(d + kDecodeAhead, 16 * s.kblock);  // the stream (and on into the next block) and codes ahead
      prefetch_l2(cp + kb * s.chunks * 64 + kDecodeAhead / 2, s.chunks * 64);
      for (int64_t i = 0; i < s.chunks; ++i) {
        const uint8_t* chunk = cp + (kb * s.chunks + i) * 64;
        for (int nt = 0; nt < 16; ++nt, d += 8) {  // row nt: stream order (quarter nt / 4)
          uint32_t word;
          std::memcpy(&word, chunk + 4 * nt, 4);
          const U8 code = ((U8{} + word) >> shifts) & 15u;
          const F8 v = __builtin_convertvector(code, F8) * s16[nt] + z16[nt];
          U8 u;
          std::memcpy(&u, &v, sizeof u);
          const I8 p = I8(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16) >> 16;  // the prediction, as int16
          uint32_t dw[2];
          std::memcpy(dw, d, sizeof dw);  // d's 8 bytes sign-extended in place (a conversion of int8 lanes is scalar)
          const I8 dv = I8(U8{dw[0], dw[0], dw[0], dw[0], dw[1], dw[1], dw[1], dw[1]} << byte_up) >> 24;
          const I8 o = (p < 0 ? p ^ 0x7FFF : p) + dv;  // ord(prediction) + d
          const I8 x = (o << 16) >> 16;
          const H8 w = __builtin_convertvector(x < 0 ? x ^ 0x7FFF : x, H8);
          uint16_t* row = out + nt * s.K + kb * s.kblock + 8 * i;
          std::memcpy(row, &w, sizeof w);
          uint64_t t;  // the escaped lanes (d = -128): the zero bytes of d ^ 0x80.., their top bits, then one bit each
          std::memcpy(&t, d, sizeof t);
          t ^= 0x8080808080808080ull;
          const uint64_t zero = ~(((t & 0x7F7F7F7F7F7F7F7Full) + 0x7F7F7F7F7F7F7F7Full) | t) & 0x8080808080808080ull;
          for (uint32_t m = uint32_t((zero * 0x0002040810204081ull) >> 56); m; m &= m - 1)  // lowest lane first
            row[__builtin_ctz(m)] = *esc++;
        }
      }
    }
  }
};

}  // namespace subspec
