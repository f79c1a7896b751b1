// The AMX tier (Intel Xeon since Sapphire Rapids: AMX-BF16, AMX-INT8, AVX-512 BF16 and VBMI2): the AVX-512 tier's
// operators, with both linears on the tile unit.
//
// BF16 linear: Y^T = W X^T with W (the weight, [N, K] row-major as stored) as the AMX A operand and the activations X
// as the B operand; each output element accumulates its K dimension in the same fixed order (32-wide k-blocks,
// ascending) inside one tile register, and AMX computes every element of a tile independently of the others. Padding
// rows are zero columns of B and change nothing. 4-bit linear: see its section (15-bit activations, exact int32
// products on AMX-INT8).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tier_avx512.h"

namespace subspec {
namespace amx {

constexpr int64_t kTileRows = 16;  // rows of an AMX tile (and output columns per tile)
constexpr int64_t kTileK = 32;     // bf16 values per tile row: 64 bytes
constexpr int64_t kTileElems = kTileRows * kTileK;  // 512 bf16 = 1 KiB

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile: 16 rows x 64 bytes. Loaded once per parallel task (tile configuration is per thread).
inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = kTileRows;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// GCC's _tile_loadd is an asm statement without a memory clobber: without this barrier the compiler may move our
// plain stores into a buffer (a de-quantized tile, packed activations) after the tile load that reads it.
#define TILE_LOAD(tile, base, stride)          \
  do {                                        \
    __asm__ volatile("" ::: "memory");        \
    _tile_loadd(tile, base, stride);          \
  } while (0)

// Linux only lets a process use AMX tile data after asking (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
bool request_amx_permission() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}


// ---- activations as the AMX B operand -------------------------------------------------------------------------
// X [M, K] bf16 (row stride ldx) -> tiles [Mb][Kb][16 k-pairs][16 m][2] bf16 (VNNI), rows beyond M zero.
void pack_activations(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, uint16_t* out) {
  const int64_t Mb = (M + kTileRows - 1) / kTileRows, Kb = K / kTileK;
  parallel_range(Mb * Kb, 16, [&](int64_t begin, int64_t end) {
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(kTileRows));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mb = t / Kb, kb = t % Kb;
      uint32_t* tile = reinterpret_cast<uint32_t*>(out + t * kTileElems);
      for (int64_t m = 0; m < kTileRows; ++m) {
        const int64_t row = mb * kTileRows + m;
        __m512i pairs = _mm512_setzero_si512();
        if (row < M) pairs = _mm512_loadu_si512(x + row * ldx + kb * kTileK);
        // element r of `pairs` (k = 2r, 2r+1) goes to tile[r][m]
        _mm512_i32scatter_epi32(tile + m, col, pairs, 4);
      }
    }
  });
}

// C tile [16 n][16 m] fp32 (+ bias[n]) -> Y[m][n] bf16 for the valid m.
inline void store_transposed(const float* c, int64_t m0, int64_t M, int64_t n0, const float* bias16, uint16_t* y,
                             int64_t ldy) {
  const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kTileRows));
  const __m512 b = bias16 ? _mm512_loadu_ps(bias16) : _mm512_setzero_ps();
  for (int64_t m = 0; m < kTileRows && m0 + m < M; ++m) {
    __m512 v = _mm512_add_ps(_mm512_i32gather_ps(stride, c + m, 4), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * ldy + n0), (__m256i)_mm512_cvtneps_pbh(v));
  }
}


// ---- the BF16 GEMM: Y [M, N] = X [M, K] W^T, W given as 16 x 32 tiles by a weight source ------------------
// A weight source hands out the bf16 tile (rows nb*16.., columns kb*32..) of W as a pointer and row stride
// (DenseWeights: into a row-major [N, K] bf16 weight).
struct DenseWeights {
  const uint16_t* w;  // row nb0 * 16 of the weight
  int64_t K;
  int64_t nb0;
  int64_t stride() const { return K * 2; }
  const uint16_t* tile(int64_t nb, int64_t kb) const {
    return w + (nb - nb0) * kTileRows * K + kb * kTileK;
  }
};

inline __m512 bf16x16_to_ps(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One block: NN consecutive n-blocks x NM consecutive m-blocks. Tiles 0..3 accumulate (n-block i, m-block j) in
// tile i * NM + j; tiles 4, 5 hold weight tiles (alternating), 6, 7 activation tiles.
template <int NN, int NM, class Src>
inline void gemm_block(const Src& src, int64_t nb0, const uint16_t* bp, int64_t mb0, int64_t Kb, float* cbuf) {
  static_assert(NN * NM <= 4 && NM <= 2 && NN <= 4, "at most 4 accumulator tiles");
  _tile_zero(0);
  if (NN * NM > 1) _tile_zero(1);
  if (NN * NM > 2) _tile_zero(2);
  if (NN * NM > 3) _tile_zero(3);
  const int64_t lda = src.stride();
  const uint16_t* b0 = bp + mb0 * Kb * kTileElems;
  const uint16_t* b1 = b0 + Kb * kTileElems;
  for (int64_t kb = 0; kb < Kb; ++kb) {
    TILE_LOAD(6, b0 + kb * kTileElems, 64);
    if (NM == 2) TILE_LOAD(7, b1 + kb * kTileElems, 64);
    for (int i = 0; i < NN; ++i) {
      if (i & 1)
        TILE_LOAD(5, src.tile(nb0 + i, kb), lda);
      else
        TILE_LOAD(4, src.tile(nb0 + i, kb), lda);
      if (NM == 2) {
        if (i == 0) {
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        } else {
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      } else if (i == 0) {
        _tile_dpbf16ps(0, 4, 6);
      } else if (i == 1) {
        _tile_dpbf16ps(1, 5, 6);
      } else if (i == 2) {
        _tile_dpbf16ps(2, 4, 6);
      } else {
        _tile_dpbf16ps(3, 5, 6);
      }
    }
  }
  _tile_stored(0, cbuf, 64);
  if (NN * NM > 1) _tile_stored(1, cbuf + 256, 64);
  if (NN * NM > 2) _tile_stored(2, cbuf + 512, 64);
  if (NN * NM > 3) _tile_stored(3, cbuf + 768, 64);
}

// Accumulator (n-block i, m-block j) of a block -> Y (+ bias), bf16.
template <int NN, int NM>
inline void write_block(const float* cbuf, int64_t nb0, int64_t mb0, int64_t M, const at::Tensor& bias, uint16_t* y,
                        int64_t N) {
  alignas(64) float b16[16];
  for (int i = 0; i < NN; ++i) {
    const int64_t n0 = (nb0 + i) * kTileRows;
    const float* bb = nullptr;
    if (bias.defined()) {
      bias_block(bias, n0, b16);
      bb = b16;
    }
    for (int j = 0; j < NM; ++j)
      store_transposed(cbuf + (i * NM + j) * 256, (mb0 + j) * kTileRows, M, n0, bb, y, N);
  }
}

template <int NN, int NM, class Src>
void gemm_range(const Src& src, int64_t nb_begin, int64_t nb_end, const uint16_t* bp, int64_t Mb, int64_t Kb,
                int64_t M, const at::Tensor& bias, uint16_t* y, int64_t N) {
  alignas(64) float cbuf[4 * 256];
  for (int64_t nb = nb_begin; nb < nb_end; nb += NN) {
    const int64_t nn = std::min<int64_t>(NN, nb_end - nb);
    for (int64_t mb = 0; mb < Mb; mb += NM) {
      const int64_t nm = std::min<int64_t>(NM, Mb - mb);
      if (nn == NN && nm == NM) {
        gemm_block<NN, NM>(src, nb, bp, mb, Kb, cbuf);
        write_block<NN, NM>(cbuf, nb, mb, M, bias, y, N);
      } else {  // tails: the same per-element arithmetic with one accumulator tile
        for (int64_t i = 0; i < nn; ++i)
          for (int64_t j = 0; j < nm; ++j) {
            gemm_block<1, 1>(src, nb + i, bp, mb + j, Kb, cbuf);
            write_block<1, 1>(cbuf, nb + i, mb + j, M, bias, y, N);
          }
      }
    }
  }
}

// ---- 4-bit linears on AMX-INT8 -----------------------------------------------------------------------------------
// y [M, N] = x [M, K] w^T with w[n][k] = c[n][k] * s[n][g] + z[n][g] (HQQ: s = scale, z = -zero * scale, c the 4-bit
// code, g = k / group). The codes multiply the activations as integers; each group's scale and shift are applied once
// per output element and group:
//   y[m][n] = sum_g ( s[n][g] * xs[m][g] * P[m][n][g] + z[n][g] * xs[m][g] * Q[m][g] ),
//   P[m][n][g] = sum_{k in g} c[n][k] q[m][k],  Q[m][g] = sum_{k in g} q[m][k],
// with the activations quantized per row and group to 15-bit integers q = round(x / xs), xs = max|x| / 16192 (within
// 2^-15 of the group's largest value, 128 times finer than a bf16 ulp of it), split as q = 128 hi + lo, hi in
// [-127, 127] and lo in [-64, 63], so that both halves are signed bytes. P is exact in int32: the high and the low
// halves of a block's rows are stacked in one A tile (rows 0..mrows-1 and mrows..2 mrows-1), one TDPBSUD (signed
// activations x unsigned codes) per n-block and k-block computes both, and P = (P_hi << 7) + P_lo. The codes become
// the B operand straight from their nibbles (an AND and a shift per 128 weights): no de-quantization to bf16 and no
// per-group tables (the BF16 path spent 40 % of its time building them).
//
// Layout (pack_w4): codes [N/16][K/kblock][kblock/8][64] bytes, kblock = 64 (32 for a group of 32). Chunk i of an
// (n-block, k-block) holds B-tile rows 2i (low nibbles) and 2i+1 (high nibbles); byte 4n + j of B row r is the code
// of row n0 + n, column k0 + 4r + j (VNNI: four consecutive k of one output column per dword).
//
// Each output element's arithmetic depends only on its own row of x (rows are quantized independently, the m-block
// only decides where in a tile a row sits, and the tile unit computes every element independently): batch-invariant.

constexpr int64_t kMBlock = 8;           // rows of x per m-block (their two halves fill a 16-row tile)
constexpr int64_t kPrefetchBytes = 4096;  // software prefetch distance in each n-block's code stream

// Tiles 0-3: int32 accumulators, tile 2 * stage + slot (two slots x two pipeline stages), 2 mrows(slot) x 16;
// tile 4: activations of slot 0; tile 5: activations of slot 1 (two m-blocks) or the codes of slot 1 (two n-blocks);
// tile 6: the codes of slot 0. Activation tiles are 2 mrows x kblock bytes, code tiles kblock/4 rows x 64 bytes.
inline void configure_int8_tiles(int mrows0, int mrows1, bool two_m, int kblock) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int i = 0; i < 4; ++i) {
    cfg.rows[i] = uint8_t(2 * ((i & 1) ? mrows1 : mrows0));
    cfg.colsb[i] = 64;
  }
  cfg.rows[4] = uint8_t(2 * mrows0);
  cfg.colsb[4] = uint16_t(kblock);
  cfg.rows[5] = uint8_t(two_m ? 2 * mrows1 : kblock / 4);
  cfg.colsb[5] = uint16_t(two_m ? kblock : 64);
  cfg.rows[6] = uint8_t(kblock / 4);
  cfg.colsb[6] = 64;
  _tile_loadconfig(&cfg);
}

// x [M, K] bf16 -> a8 [Mb][Kb][16][kblock] signed bytes (per m-block and k-block: the rows' high halves, then their
// low halves), xs [M][G] (the step) and xq [M][G] (xs * Q).
void quantize_activations(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, int64_t group, int64_t kblock,
                          int8_t* a8, float* xs, float* xq) {
  const int64_t G = K / group, Kb = K / kblock;
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = x + m * ldx;
    const int64_t mb = m / kMBlock, r = m % kMBlock, mrows = std::min<int64_t>(kMBlock, M - mb * kMBlock);
    for (int64_t g = 0; g < G; ++g) {
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16x16_to_ps(row + k)));
      const float top = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(top > 0 ? 16192.0f / top : 0.0f);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_ps(row + k), inv));  // nearest, ties to even
        const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(64)), 7);
        const __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 7));
        sum = _mm512_add_epi32(sum, q);
        int8_t* tile = a8 + (mb * Kb + k / kblock) * kTileRows * kblock + (k % kblock);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(tile + r * kblock), _mm512_cvtepi32_epi8(h));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(tile + (mrows + r) * kblock), _mm512_cvtepi32_epi8(l));
      }
      const float step = top / 16192.0f;
      xs[m * G + g] = step;
      xq[m * G + g] = step * float(_mm512_reduce_add_epi32(sum));
    }
  }
}

// The B tile of codes of one (n-block, k-block): nibbles to bytes, kblock/4 rows x 64 bytes.
inline void unpack_codes_tile(const uint8_t* c, int kblock, uint8_t* out) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < kblock / 8; ++i) {
    const __m512i v = _mm512_loadu_si512(c + i * 64);
    _mm512_store_si512(out + i * 128, _mm512_and_si512(v, mask));
    _mm512_store_si512(out + i * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

struct W4Args {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* shift;
  const int8_t* a8;
  const float* xs;
  const float* xq;
  int64_t M, N, K, group, kblock, Kb, G;
};

#define TDP_INT8(c, a, b)                   \
  do {                                      \
    __asm__ volatile("" ::: "memory");      \
    _tile_dpbsud(c, a, b);                  \
  } while (0)

// More than 8 rows: one n-block for two consecutive m-blocks per pass (rows 9-16 read the codes once), the two
// accumulated side by side; every m-block of x is covered by the passes; y (+ bias) written as bf16. (Up to 8 rows:
// w4_block_rows.)
// Software pipeline: group g's products run on the tile unit in one pair of accumulator tiles while the vector units
// apply group g - 1's scales from the other pair; the next k-block's codes are unpacked while the current multiplies.
void w4_block(const W4Args& a, int64_t nb0, int nn, const float* bias32, uint16_t* y) {
  (void)nn;  // one n-block per task
  alignas(64) uint8_t bbuf[2][16 * 64];      // [stage] unpacked code tiles
  alignas(64) int32_t cbuf[2][16 * 16];      // [slot] accumulators of the group being rescaled
  alignas(64) float acc[2][kMBlock][16];
  const int64_t chunk = a.kblock / 8 * 64;  // packed bytes per (n-block, k-block)
  const int64_t kb_per_group = a.group / a.kblock;
  const int64_t Mb = (a.M + kMBlock - 1) / kMBlock;
  const uint8_t* cp = a.codes + nb0 * a.Kb * chunk;
  for (int64_t mb0 = 0; mb0 < Mb; mb0 += 2) {
    int mrows[2];
    for (int j = 0; j < 2; ++j) {
      const int64_t mb = std::min(mb0 + j, Mb - 1);  // a lone last m-block: slot 1 repeats it
      mrows[j] = int(std::min<int64_t>(kMBlock, a.M - mb * kMBlock));
    }
    const int slots = int(std::min<int64_t>(2, Mb - mb0));
    configure_int8_tiles(mrows[0], mrows[1], true, int(a.kblock));
    std::memset(acc, 0, sizeof acc);
    const int8_t* at0 = a.a8 + mb0 * a.Kb * kTileRows * a.kblock;
    const int8_t* at1 = a.a8 + std::min(mb0 + 1, Mb - 1) * a.Kb * kTileRows * a.kblock;
    auto rescale = [&](int64_t g) {
      for (int j = 0; j < slots; ++j) {
        const int64_t nb = nb0, mb = mb0 + j;
        const __m512 s = bf16x16_to_ps(a.scale + (nb * a.G + g) * 16);
        const __m512 z = bf16x16_to_ps(a.shift + (nb * a.G + g) * 16);
        for (int r = 0; r < mrows[j]; ++r) {
          const int64_t m = mb * kMBlock + r;
          const __m512i p = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cbuf[j] + r * 16), 7),
                                             _mm512_load_si512(cbuf[j] + (mrows[j] + r) * 16));
          __m512 v = _mm512_load_ps(acc[j][r]);
          v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), s), _mm512_set1_ps(a.xs[m * a.G + g]), v);
          v = _mm512_fmadd_ps(z, _mm512_set1_ps(a.xq[m * a.G + g]), v);
          _mm512_store_ps(acc[j][r], v);
        }
      }
    };
    auto store_pair = [&](bool odd) {
      if (odd) {
        _tile_stored(2, cbuf[0], 64);
        _tile_stored(3, cbuf[1], 64);
      } else {
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
      }
      __asm__ volatile("" ::: "memory");
    };
    unpack_codes_tile(cp, int(a.kblock), bbuf[0]);
    for (int64_t g = 0; g < a.G; ++g) {
      const bool odd = g & 1;
      if (odd) {
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_zero(0);
        _tile_zero(1);
      }
      for (int64_t j = 0; j < kb_per_group; ++j) {
        const int64_t kb = g * kb_per_group + j;
        TILE_LOAD(4, at0 + kb * kTileRows * a.kblock, a.kblock);
        TILE_LOAD(5, at1 + kb * kTileRows * a.kblock, a.kblock);
        TILE_LOAD(6, bbuf[kb & 1], 64);
        if (odd) {
          TDP_INT8(2, 4, 6);
          TDP_INT8(3, 5, 6);
        } else {
          TDP_INT8(0, 4, 6);
          TDP_INT8(1, 5, 6);
        }
        if (kb + 1 < a.Kb) {
          const uint8_t* c = cp + (kb + 1) * chunk;
          const char* f = reinterpret_cast<const char*>(c) + kPrefetchBytes;
          for (int64_t o = 0; o < chunk; o += 64) _mm_prefetch(f + o, _MM_HINT_T0);
          unpack_codes_tile(c, int(a.kblock), bbuf[(kb + 1) & 1]);
        }
      }
      if (g > 0) {  // group g - 1's accumulators (the other pair) out and scaled while group g multiplies
        store_pair(!odd);
        rescale(g - 1);
      }
    }
    store_pair((a.G - 1) & 1);
    rescale(a.G - 1);
    for (int j = 0; j < slots; ++j) {
      const int64_t nb = nb0, mb = mb0 + j;
      const __m512 b = bias32 ? _mm512_loadu_ps(bias32) : _mm512_setzero_ps();
      for (int r = 0; r < mrows[j]; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (mb * kMBlock + r) * a.N + nb * kTileRows),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc[j][r]), b)));
    }
  }
}

// w4_block for up to 8 rows (one m-block of MR rows, a compile-time count): the same arithmetic in the same order as
// the two-n-block pass of the general kernel, with the fp32 accumulators of both n-blocks in registers instead of a stack buffer.
template <int MR>
void w4_block_rows(const W4Args& a, int64_t nb0, int nn, const float* bias32, uint16_t* y) {
  alignas(64) uint8_t bbuf[2][2][16 * 64];   // [stage][slot] unpacked code tiles
  alignas(64) int32_t cbuf[2][16 * 16];      // [slot] accumulators of the group being rescaled
  __m512 acc[2][MR];
  const int64_t chunk = a.kblock / 8 * 64;
  const int64_t kb_per_group = a.group / a.kblock;
  const uint8_t* cp[2] = {a.codes + nb0 * a.Kb * chunk, a.codes + (nb0 + nn - 1) * a.Kb * chunk};
  configure_int8_tiles(MR, MR, false, int(a.kblock));
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  const int8_t* at0 = a.a8;
  auto rescale = [&](int64_t g) {
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      const int64_t nb = nb0 + (j < nn ? j : 0);
      const __m512 s = bf16x16_to_ps(a.scale + (nb * a.G + g) * 16);
      const __m512 z = bf16x16_to_ps(a.shift + (nb * a.G + g) * 16);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i p = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cbuf[j] + r * 16), 7),
                                           _mm512_load_si512(cbuf[j] + (MR + r) * 16));
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), s), _mm512_set1_ps(a.xs[r * a.G + g]), acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(z, _mm512_set1_ps(a.xq[r * a.G + g]), v);
      }
    }
  };
  auto store_pair = [&](bool odd) {
    if (odd) {
      _tile_stored(2, cbuf[0], 64);
      _tile_stored(3, cbuf[1], 64);
    } else {
      _tile_stored(0, cbuf[0], 64);
      _tile_stored(1, cbuf[1], 64);
    }
    __asm__ volatile("" ::: "memory");
  };
  for (int i = 0; i < 2; ++i) unpack_codes_tile(cp[i], int(a.kblock), bbuf[0][i]);
  for (int64_t g = 0; g < a.G; ++g) {
    const bool odd = g & 1;
    if (odd) {
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_zero(0);
      _tile_zero(1);
    }
    for (int64_t j = 0; j < kb_per_group; ++j) {
      const int64_t kb = g * kb_per_group + j;
      TILE_LOAD(4, at0 + kb * kTileRows * a.kblock, a.kblock);
      TILE_LOAD(5, bbuf[kb & 1][1], 64);
      TILE_LOAD(6, bbuf[kb & 1][0], 64);
      if (odd) {
        TDP_INT8(2, 4, 6);
        TDP_INT8(3, 4, 5);
      } else {
        TDP_INT8(0, 4, 6);
        TDP_INT8(1, 4, 5);
      }
      if (kb + 1 < a.Kb)
        for (int i = 0; i < 2; ++i) {
          const uint8_t* c = cp[i] + (kb + 1) * chunk;
          const char* f = reinterpret_cast<const char*>(c) + kPrefetchBytes;
          for (int64_t o = 0; o < chunk; o += 64) _mm_prefetch(f + o, _MM_HINT_T0);
          unpack_codes_tile(c, int(a.kblock), bbuf[(kb + 1) & 1][i]);
        }
    }
    if (g > 0) {
      store_pair(!odd);
      rescale(g - 1);
    }
  }
  store_pair((a.G - 1) & 1);
  rescale(a.G - 1);
  for (int j = 0; j < nn; ++j) {
    const __m512 b = bias32 ? _mm512_loadu_ps(bias32 + j * 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * a.N + (nb0 + j) * kTileRows),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j][r], b)));
  }
}

using W4BlockFn = void (*)(const W4Args&, int64_t, int, const float*, uint16_t*);
inline W4BlockFn w4_block_for(int64_t M) {
  switch (M) {
    case 1: return w4_block_rows<1>;
    case 2: return w4_block_rows<2>;
    case 3: return w4_block_rows<3>;
    case 4: return w4_block_rows<4>;
    case 5: return w4_block_rows<5>;
    case 6: return w4_block_rows<6>;
    case 7: return w4_block_rows<7>;
    case 8: return w4_block_rows<8>;
    default: return w4_block;
  }
}


// ---- the engines (drivers.h's interface) ---------------------------------------------------------------------------
// Y [M, N] = X [M, K] W^T (+ bias); parallel over n-blocks (tasks of 4 n-blocks for one m-block, else 2 n-blocks x
// 2 m-blocks).
struct Bf16Gemm {
  at::Tensor bp_, bias;
  const uint16_t* w;
  uint16_t* y;
  int64_t M, N, K, Mb, Kb, Nb, step;

  Bf16Gemm(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& b, at::Tensor& out)
      : Bf16Gemm(x, wt.size(0), wt.size(1), b, out) {
    w = bf16_ptr(wt);
  }

  // Without a weight tensor: run_cols is handed the weights of each task's n-blocks (a coded layer's, decoded).
  Bf16Gemm(const at::Tensor& x, int64_t n, int64_t k, const at::Tensor& b, at::Tensor& out)
      : bias(b), w(nullptr), y(bf16_ptr_mut(out)), M(x.size(0)), N(n), K(k) {
    TORCH_CHECK(request_amx_permission(), "subspec: the kernel refused AMX (arch_prctl)");
    Mb = (M + kTileRows - 1) / kTileRows;
    Kb = K / kTileK;
    Nb = N / kTileRows;
    step = Mb == 1 ? 4 : 2;
    bp_ = at::empty({Mb * Kb * kTileElems}, x.options());
    pack_activations(bf16_ptr(x), M, K, x.stride(0), bf16_ptr_mut(bp_));
  }

  int64_t tasks() const { return (Nb + step - 1) / step; }
  int64_t blocks_per_task() const { return step; }
  template <class Fn>
  void parallel(const Fn& fn) const { at::parallel_for(0, tasks(), 1, fn); }  // (tiles configured per call)

  void run(int64_t t0, int64_t t1) const {
    const int64_t nb0 = t0 * step, nb1 = std::min(Nb, t1 * step);
    run_cols(w + nb0 * kTileRows * K, nb0, nb1);
  }

  // n-blocks nb0..nb1 from the weights wc (row nb0 * 16 first, row-major with K columns): the same per-element
  // arithmetic wherever the weights come from.
  void run_cols(const uint16_t* wc, int64_t nb0, int64_t nb1) const {
    configure_tiles();
    const DenseWeights src{wc, K, nb0};
    if (Mb == 1)
      gemm_range<4, 1>(src, nb0, nb1, bf16_ptr(bp_), Mb, Kb, M, bias, y, N);
    else
      gemm_range<2, 2>(src, nb0, nb1, bf16_ptr(bp_), Mb, Kb, M, bias, y, N);
    _tile_release();
  }
};

// y [M, N] = x [M, K] @ (codes * scale + shift)^T (+ bias). Up to 8 rows: tasks of two n-blocks (one m-block); more
// rows: tasks of one n-block, two m-blocks per pass.
struct W4Gemm {
  at::Tensor a8_, st_, bias;
  W4Args args;
  W4BlockFn block;
  uint16_t* y;
  int64_t Nb, per_task;

  W4Gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& shift,
         const W4Shape& s, const at::Tensor& b, at::Tensor& out, W4Scratch* = nullptr)  // (allocates its own)
      : bias(b), y(bf16_ptr_mut(out)) {
    TORCH_CHECK(request_amx_permission(), "subspec: the kernel refused AMX (arch_prctl)");
    const int64_t M = x.size(0);
    const int64_t Mb = (M + kMBlock - 1) / kMBlock, Kb = s.Kb, G = s.G;
    Nb = s.N / kTileRows;
    a8_ = at::empty({Mb * Kb * kTileRows * s.kblock}, x.options().dtype(at::kChar));
    st_ = at::empty({2 * M * G}, x.options().dtype(at::kFloat));
    float* xs = st_.data_ptr<float>();
    quantize_activations(bf16_ptr(x), M, s.K, x.stride(0), s.group, s.kblock, a8_.data_ptr<int8_t>(), xs, xs + M * G);
    args = W4Args{codes.data_ptr<uint8_t>(), bf16_ptr(scale), bf16_ptr(shift), a8_.data_ptr<int8_t>(), xs,
                  xs + M * G, M, s.N, s.K, s.group, s.kblock, Kb, G};
    per_task = Mb > 1 ? 1 : 2;
    block = w4_block_for(M);
  }

  int64_t tasks() const { return (Nb + per_task - 1) / per_task; }
  template <class Fn>
  void parallel(const Fn& fn) const { at::parallel_for(0, tasks(), 1, fn); }  // (tiles configured per call)

  void run(int64_t t0, int64_t t1) const {
    alignas(64) float b32[32];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = per_task * t;
      const int nn = int(std::min<int64_t>(per_task, Nb - nb));
      const float* bp = nullptr;
      if (bias.defined()) {
        for (int i = 0; i < nn; ++i) bias_block(bias, (nb + i) * kTileRows, b32 + i * 16);
        bp = b32;
      }
      block(args, nb, nn, bp, y);
    }
    _tile_release();
  }
};

}  // namespace amx

struct AmxTier : Avx512Tier {
  static constexpr const char* kName = "amx";
  using Bf16Gemm = amx::Bf16Gemm;
  using W4Gemm = amx::W4Gemm;
  static bool usable() { return amx::request_amx_permission(); }
};

}  // namespace subspec
