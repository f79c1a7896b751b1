// subspec CPU kernels: batch-invariant BF16 linears (AMX-BF16), 4-bit substitute linears (AMX-INT8) and tree
// attention on Intel AMX.
//
// Registered as torch operators in the `subspec` namespace (see subspec/kernels/__init__.py, which builds this file
// once per machine and falls back to torch's own kernels where it cannot).
//
// Batch invariance (design.md §3.5): every value a row of the output gets is computed by the same sequence of
// instructions whatever the number of rows in the call and whatever the other rows hold. The BF16 linears compute
// Y^T = W X^T with W (the weight, [N, K] row-major as stored) as the AMX A operand and the activations X as the
// B operand; each output element accumulates its K dimension in the same fixed order (32-wide k-blocks, ascending)
// inside one tile register, and AMX computes every element of a tile independently of the others. Padding rows
// are zero columns of B and change nothing (the 4-bit linears: see their section). The attention of a query runs over its keys in position order (the
// committed prefix, then its ancestors in the tree by depth), exactly the keys and the order of a one-token
// forward at that position, with fixed-lane reductions.
//
// Built with AMX/AVX-512 flags: subspec loads it only on CPUs that report amx_bf16, amx_int8, amx_tile and
// avx512_bf16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace subspec {
namespace {

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

inline const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* bf16_ptr_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// ---- activations as the AMX B operand -------------------------------------------------------------------------
// X [M, K] bf16 (row stride ldx) -> tiles [Mb][Kb][16 k-pairs][16 m][2] bf16 (VNNI), rows beyond M zero.
void pack_activations(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, uint16_t* out) {
  const int64_t Mb = (M + kTileRows - 1) / kTileRows, Kb = K / kTileK;
  at::parallel_for(0, Mb * Kb, 16, [&](int64_t begin, int64_t end) {
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

inline void bias_block(const at::Tensor& bias, int64_t n0, float* out16) {
  if (bias.scalar_type() == at::kBFloat16) {
    const uint16_t* b = bf16_ptr(bias) + n0;
    for (int i = 0; i < 16; ++i) {
      uint32_t bits = uint32_t(b[i]) << 16;
      std::memcpy(out16 + i, &bits, 4);
    }
  } else {
    const float* b = bias.data_ptr<float>() + n0;
    for (int i = 0; i < 16; ++i) out16[i] = b[i];
  }
}

// ---- the BF16 GEMM: Y [M, N] = X [M, K] W^T, W given as 16 x 32 tiles by a weight source ------------------
// A weight source hands out the bf16 tile (rows nb*16.., columns kb*32..) of W as a pointer and row stride
// (DenseWeights: into a row-major [N, K] bf16 weight).
struct DenseWeights {
  const uint16_t* w;
  int64_t K;
  int64_t stride() const { return K * 2; }
  const uint16_t* tile(int64_t nb, int64_t kb) const {
    return w + nb * kTileRows * K + kb * kTileK;
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

void check_linear_args(const at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_cpu(), "subspec: x must be [M, K] bf16 on CPU");
  TORCH_CHECK(x.size(1) == K && x.stride(1) == 1, "subspec: x must have K = ", K, " contiguous columns");
  TORCH_CHECK(N % kTileRows == 0 && K % kTileK == 0, "subspec: N must be a multiple of 16 and K of 32");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() &&
                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                "subspec: bias must be [N] bf16 or fp32");
  TORCH_CHECK(request_amx_permission(), "subspec: the kernel refused AMX (arch_prctl)");
}

// Y [M, N] = X [M, K] W^T (+ bias) over a weight source; parallel over n-blocks (tasks of 4 n-blocks for one
// m-block, else 2 n-blocks x 2 m-blocks).
template <class Src>
at::Tensor run_gemm(const Src& src, const at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias) {
  check_linear_args(x, N, K, bias);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t Mb = (M + kTileRows - 1) / kTileRows, Kb = K / kTileK, Nb = N / kTileRows;
  at::Tensor bp = at::empty({Mb * Kb * kTileElems}, x.options());
  pack_activations(bf16_ptr(x), M, K, x.stride(0), bf16_ptr_mut(bp));
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  const uint16_t* bpp = bf16_ptr(bp);
  uint16_t* yp = bf16_ptr_mut(y);
  const int64_t step = Mb == 1 ? 4 : 2;
  at::parallel_for(0, (Nb + step - 1) / step, 1, [&](int64_t t0, int64_t t1) {
    configure_tiles();
    const int64_t nb0 = t0 * step, nb1 = std::min(Nb, t1 * step);
    if (Mb == 1)
      gemm_range<4, 1>(src, nb0, nb1, bpp, Mb, Kb, M, b, yp, N);
    else
      gemm_range<2, 2>(src, nb0, nb1, bpp, Mb, Kb, M, b, yp, N);
    _tile_release();
  });
  return y;
}

// y [M, N] = x [M, K] @ w[N, K]^T (+ bias), bf16 in and out, fp32 accumulation; batch-invariant.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "subspec: w must be [N, K] bf16, contiguous");
  return run_gemm(DenseWeights{bf16_ptr(w), w.size(1)}, x, w.size(0), w.size(1), bias);
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

// y [M, N] = x [M, K] @ (codes * scale + shift)^T (+ bias), bf16 out; N = codes.size(0) * 16.
at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& shift,
                     int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(3) == 64 &&
                  (codes.size(2) == 8 || codes.size(2) == 4),
              "subspec: codes must be [N/16, K/kblock, kblock/8, 64] uint8 (pack_w4)");
  const int64_t kblock = codes.size(2) * 8;
  const int64_t N = codes.size(0) * kTileRows, K = codes.size(1) * kblock;
  TORCH_CHECK(group > 0 && group % kblock == 0 && K % group == 0 && (kblock == 64 || group == 32),
              "subspec: the group size must be 32 or a multiple of 64 dividing K, as given to pack_w4");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && shift.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  shift.is_contiguous() && scale.numel() == N * (K / group) && shift.numel() == scale.numel(),
              "subspec: scale/shift must be [N/16, K/group, 16] bf16");
  check_linear_args(x, N, K, bias);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t Mb = (M + kMBlock - 1) / kMBlock, Kb = K / kblock, G = K / group, Nb = N / kTileRows;
  at::Tensor a8 = at::empty({Mb * Kb * kTileRows * kblock}, x.options().dtype(at::kChar));
  at::Tensor st = at::empty({2 * M * G}, x.options().dtype(at::kFloat));
  float* xs = st.data_ptr<float>();
  quantize_activations(bf16_ptr(x), M, K, x.stride(0), group, kblock, a8.data_ptr<int8_t>(), xs, xs + M * G);
  const W4Args args{codes.data_ptr<uint8_t>(), bf16_ptr(scale), bf16_ptr(shift), a8.data_ptr<int8_t>(), xs,
                    xs + M * G, M, N, K, group, kblock, Kb, G};
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  uint16_t* yp = bf16_ptr_mut(y);
  // Up to 8 rows: tasks of two n-blocks (one m-block); more rows: tasks of one n-block, two m-blocks per pass.
  const bool two_m = Mb > 1;
  const int64_t per_task = two_m ? 1 : 2;
  const W4BlockFn block = w4_block_for(M);
  at::parallel_for(0, (Nb + per_task - 1) / per_task, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float b32[32];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = per_task * t;
      const int nn = int(std::min<int64_t>(per_task, Nb - nb));
      const float* bp = nullptr;
      if (b.defined()) {
        for (int i = 0; i < nn; ++i) bias_block(b, (nb + i) * kTileRows, b32 + i * 16);
        bp = b32;
      }
      block(args, nb, nn, bp, yp);
    }
    _tile_release();
  });
  return y;
}

// codes [N, K] uint8 (0..15) -> the layout linear_w4 reads: [N/16, K/kblock, kblock/8, 64], kblock = 64 (32 for a
// group of 32).
at::Tensor pack_w4(const at::Tensor& codes, int64_t group) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "subspec: codes must be [N, K] uint8");
  const int64_t N = codes.size(0), K = codes.size(1);
  const int64_t kblock = group % 64 == 0 ? 64 : 32;
  TORCH_CHECK(group > 0 && N % kTileRows == 0 && K % kblock == 0 && (kblock == 64 || group == 32),
              "subspec: N must be a multiple of 16, K of 64 (32 for a group of 32), the group 32 or a multiple of 64");
  at::Tensor c = codes.contiguous();
  const int64_t Kb = K / kblock, chunks = kblock / 8;
  at::Tensor out = at::empty({N / kTileRows, Kb, chunks, 64}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, (N / kTileRows) * Kb, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = t / Kb, kb = t % Kb;
      uint8_t* d = dst + t * chunks * 64;
      for (int64_t i = 0; i < chunks; ++i)
        for (int64_t byte = 0; byte < 64; ++byte) {  // B rows 2i and 2i + 1, column n = byte / 4, k offset byte % 4
          const uint8_t* col = src + (nb * kTileRows + byte / 4) * K + kb * kblock + byte % 4;
          d[i * 64 + byte] = uint8_t((col[8 * i] & 0x0F) | ((col[8 * i + 4] & 0x0F) << 4));
        }
    }
  });
  return out;
}

// ---- attention ------------------------------------------------------------------------------------------------
inline __m512 exp_ps(__m512 x) {  // Cephes expf on 16 lanes (x <= 0 here), ~1 ulp
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

inline __m512 exp_ps_any(__m512 x) {  // exp on all of fp32: +inf where it overflows (as expf)
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.3f), _CMP_GT_OQ);
  return _mm512_mask_blend_ps(over, exp_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f))), _mm512_set1_ps(INFINITY));
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One query head over its key sequence. keys: cache slots in position order; q: [NV*16] bf16.
template <int NV>
void attend_one(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, int64_t ld, const int64_t* keys, int64_t n,
                float scale, float* s, uint16_t* out) {
  __m512 qv[NV];
  for (int v = 0; v < NV; ++v) qv[v] = load_bf16x16(q + 16 * v);
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* k = kc + keys[j] * ld;
    __m512 acc = _mm512_mul_ps(qv[0], load_bf16x16(k));
    for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(qv[v], load_bf16x16(k + 16 * v), acc);
    const float sj = _mm512_reduce_add_ps(acc) * scale;
    s[j] = sj;
    mx = sj > mx ? sj : mx;
  }
  // probabilities and their sum: lane = index in the sequence modulo 16 (fixed for a given sequence)
  const __m512 m = _mm512_set1_ps(mx);
  __m512 lsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    __m512 p = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + j), m));
    p = _mm512_maskz_mov_ps(valid, p);
    _mm512_mask_storeu_ps(s + j, valid, p);
    lsum = _mm512_add_ps(lsum, p);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(lsum);
  __m512 o[NV];
  for (int v = 0; v < NV; ++v) o[v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* vv = vc + keys[j] * ld;
    const __m512 p = _mm512_set1_ps(s[j]);
    for (int v = 0; v < NV; ++v) o[v] = _mm512_fmadd_ps(p, load_bf16x16(vv + 16 * v), o[v]);
  }
  const __m512 iv = _mm512_set1_ps(inv);
  for (int v = 0; v < NV; ++v)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * v), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[v], iv)));
}

using AttendFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, const int64_t*, int64_t, float,
                          float*, uint16_t*);

AttendFn attend_for(int64_t head_dim) {
  switch (head_dim / 16) {
    case 1: return attend_one<1>;
    case 2: return attend_one<2>;
    case 3: return attend_one<3>;
    case 4: return attend_one<4>;
    case 5: return attend_one<5>;
    case 6: return attend_one<6>;
    case 7: return attend_one<7>;
    case 8: return attend_one<8>;
    case 9: return attend_one<9>;
    case 10: return attend_one<10>;
    case 11: return attend_one<11>;
    case 12: return attend_one<12>;
    case 13: return attend_one<13>;
    case 14: return attend_one<14>;
    case 15: return attend_one<15>;
    case 16: return attend_one<16>;
    default: return nullptr;
  }
}

// Tree attention, batch-invariant.
//   q [T, H, D] bf16; k_cache, v_cache [KVH, S, D] bf16 (slot-major rows, contiguous D);
//   prefix: committed length L0 (keys at slots 0..L0-1 hold positions 0..L0-1);
//   ancestors [T, N] bool: node t attends to tree node j (at slot L0 + j, position L0 + depth of j) when
//     ancestors[t][j]; nodes are in depth order, so ascending j is ascending position;
//   positions [T] int64 (L0 + depth); window: keys at positions <= position - window are not seen (0 = none).
// Returns o [T, H, D] bf16.
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t prefix,
                          const at::Tensor& ancestors, const at::Tensor& positions, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "subspec: q must be [T, H, D] bf16");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 &&
                  k_cache.stride(1) == v_cache.stride(1) && k_cache.stride(0) == v_cache.stride(0),
              "subspec: k/v cache must be [KVH, S, D] bf16 with equal strides");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0, "subspec: head dims do not match");
  TORCH_CHECK(ancestors.dim() == 2 && ancestors.size(0) == T && ancestors.scalar_type() == at::kBool &&
                  ancestors.stride(1) == 1,
              "subspec: ancestors must be [T, N] bool");
  TORCH_CHECK(positions.numel() == T && positions.scalar_type() == at::kLong, "subspec: positions must be [T] int64");
  const at::Tensor pos_c = positions.contiguous();
  const int64_t Nt = ancestors.size(1);
  TORCH_CHECK(prefix >= 0 && prefix + Nt <= S, "subspec: the tree does not fit the cache");
  AttendFn fn = attend_for(D);
  TORCH_CHECK(fn != nullptr && D % 16 == 0, "subspec: head_dim ", D, " is not supported");
  at::Tensor out = at::empty({T, H, D}, q.options());
  const uint16_t* qp = bf16_ptr(q);
  const uint16_t* kp = bf16_ptr(k_cache);
  const uint16_t* vp = bf16_ptr(v_cache);
  const bool* ap = ancestors.data_ptr<bool>();
  const int64_t* pp = pos_c.data_ptr<int64_t>();
  uint16_t* op = bf16_ptr_mut(out);
  const int64_t group = H / KVH, ld = k_cache.stride(1), lh = k_cache.stride(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), as0 = ancestors.stride(0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T * KVH, 1, [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> keys(prefix + Nt);
    std::vector<float> s(prefix + Nt + 16);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t = u / KVH, kvh = u % KVH;
      const int64_t pos = pp[t];
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      int64_t n = 0;
      for (int64_t j = first; j < prefix; ++j) keys[n++] = j;
      int64_t depth_pos = prefix;  // position of the next ancestor (depths 0, 1, ... in order)
      const bool* arow = ap + t * as0;
      for (int64_t j = 0; j < Nt; ++j)
        if (arow[j]) {
          if (depth_pos >= first) keys[n++] = prefix + j;
          ++depth_pos;
        }
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
        fn(qp + t * qs0 + h * qs1, kp + kvh * lh, vp + kvh * lh, ld, keys.data(), n, sc, s.data(),
           op + (t * H + h) * D);
    }
  });
  return out;
}

// ---- fused element-wise operators of a decoder layer (BF16) -----------------------------------------------------
// Each replaces several torch operators (and their dispatch, which dominates small models' draft steps) with one
// pass, rounding to bf16 where the torch composition it replaces rounds. Every row is computed by the same
// instructions whatever the number of rows (batch-invariant, like the linears).

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_round(float f) {  // round-to-nearest-even to bf16, returned as float
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// RMSNorm (Zhang & Sennrich 2019) over the last dim n of x [..., n] bf16: r = 1 / sqrt(mean(x^2) + eps) in fp32;
// float32_gain: y = bf16(x * r * gain) with gain fp32 [n] (Gemma), else y = bf16(gain * bf16(x * r)) with gain bf16
// [n] (Llama's order).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& gain, double eps, bool float32_gain) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "subspec: rms_norm takes contiguous bf16 x");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(n % 16 == 0 && gain.numel() == n && gain.is_contiguous(), "subspec: rms_norm needs n % 16 == 0, gain [n]");
  TORCH_CHECK(gain.scalar_type() == (float32_gain ? at::kFloat : at::kBFloat16), "subspec: rms_norm gain dtype");
  at::Tensor y = at::empty_like(x);
  const uint16_t* xp = bf16_ptr(x);
  uint16_t* yp = bf16_ptr_mut(y);
  const float* gf = float32_gain ? gain.data_ptr<float>() : nullptr;
  const uint16_t* gb = float32_gain ? nullptr : bf16_ptr(gain);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xp + r * n;
      uint16_t* yr = yp + r * n;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = bf16x16_to_ps(xr + j);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + e);
      const __m512 iv = _mm512_set1_ps(inv);
      for (int64_t j = 0; j < n; j += 16) {
        __m512 v = _mm512_mul_ps(bf16x16_to_ps(xr + j), iv);
        if (float32_gain) {
          v = _mm512_mul_ps(v, _mm512_loadu_ps(gf + j));
        } else {  // round the normalized input to bf16 first, then multiply by the bf16 gain
          v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
          v = _mm512_mul_ps(v, bf16x16_to_ps(gb + j));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + j), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  });
  return y;
}

// Rotate-half RoPE (Su et al. 2021) of x [T, heads, D] bf16 with cos, sin [T, 1, D] bf16:
// y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = [-x[D/2:], x[:D/2]] (torch's rounding).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1, "subspec: rope takes x [T, H, D] bf16");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  cos.numel() == T * D && sin.numel() == T * D && cos.is_contiguous() && sin.is_contiguous(),
              "subspec: rope takes cos, sin [T, 1, D] bf16");
  at::Tensor y = at::empty({T, H, D}, x.options());
  const uint16_t* xp = bf16_ptr(x);
  const uint16_t* cp = bf16_ptr(cos);
  const uint16_t* sp = bf16_ptr(sin);
  uint16_t* yp = bf16_ptr_mut(y);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T * H, std::max<int64_t>(1, 65536 / D), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t = u / H, h = u % H;
      const uint16_t* xr = xp + t * s0 + h * s1;
      const uint16_t* c = cp + t * D;
      const uint16_t* s = sp + t * D;
      uint16_t* yr = yp + u * D;
      for (int64_t j = 0; j < D; ++j) {
        const float xv = bf16_to_float(xr[j]);
        const float rv = j < half ? -bf16_to_float(xr[j + half]) : bf16_to_float(xr[j - half]);
        const float a = bf16_round(xv * bf16_to_float(c[j]));
        const float b = bf16_round(rv * bf16_to_float(s[j]));
        yr[j] = to_bf16(a + b);
      }
    }
  });
  return y;
}

// SwiGLU's gate (Shazeer 2020): y = bf16(bf16(silu(g)) * u) for g, u [T, I] bf16 (torch's rounding of
// F.silu(g) * u); silu(v) = v / (1 + exp(-v)) in fp32. Rows of g and u are ld_in apart, rows of y ld_out apart.
void silu_mul_rows(const uint16_t* gp, const uint16_t* up, int64_t ld_in, int64_t T, int64_t I, uint16_t* yp,
                   int64_t ld_out) {
  const int64_t per_row = I / 16;
  at::parallel_for(0, T * per_row, 4096, [&](int64_t b0, int64_t b1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = b / per_row, j = (b % per_row) * 16;
      const __m512 v = bf16x16_to_ps(gp + t * ld_in + j);
      const __m512 e = exp_ps_any(_mm512_sub_ps(_mm512_setzero_ps(), v));
      __m512 sv = _mm512_div_ps(v, _mm512_add_ps(one, e));
      sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(sv)), 16));
      const __m512 p = _mm512_mul_ps(sv, bf16x16_to_ps(up + t * ld_in + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + t * ld_out + j), (__m256i)_mm512_cvtneps_pbh(p));
    }
  });
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(g.scalar_type() == at::kBFloat16 && u.scalar_type() == at::kBFloat16 && g.is_contiguous() &&
                  u.is_contiguous() && g.sizes() == u.sizes() && g.numel() % 16 == 0,
              "subspec: silu_mul takes two contiguous bf16 tensors of one shape (numel % 16 == 0)");
  at::Tensor y = at::empty_like(g);
  silu_mul_rows(bf16_ptr(g), bf16_ptr(u), 0, 1, g.numel(), bf16_ptr_mut(y), 0);
  return y;
}

// ---- one decoder layer of the draft on 4-bit substitutes, fused --------------------------------------------------
// The same operators, in the same order and with the same rounding, as Decoder.layer_forward with the fused
// element-wise operators (so the same bits): RMSNorm, q/k/v as one linear_w4 over their concatenated codes (each
// output element's arithmetic is its own: concatenating changes no bit), RoPE of q and k, K/V written at ``slots``,
// tree attention, o_proj, residual add, RMSNorm, gate/up as one linear_w4, SwiGLU, down_proj, residual add.
// One call per layer instead of about twenty operators and their Python: a small model's draft step is dispatch.
//   h [T, hidden] bf16; w: 16 tensors, for qkv, o, gate_up, down: codes, scale, shift (pack_w4 layout) and an fp32
//   bias (numel 0: none); gains attn_in, mlp_in [hidden] (bf16; fp32 with float32_gain); cos, sin [T, 1, D] bf16;
//   k_cache, v_cache [KVH, S, D]; slots [T] int64; prefix, ancestors, positions, window, attn_scale: tree_attention's.
at::Tensor layer_w4(const at::Tensor& h, at::TensorList w, int64_t group, const at::Tensor& attn_in,
                    const at::Tensor& mlp_in, double eps, bool float32_gain, int64_t n_heads, int64_t kv_heads,
                    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slots, int64_t prefix, const at::Tensor& ancestors, const at::Tensor& positions,
                    int64_t window, double attn_scale) {
  TORCH_CHECK(w.size() == 16, "subspec: layer_w4 takes 16 weight tensors (codes, scale, shift, bias) x 4");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kBFloat16 && h.is_contiguous(), "subspec: h must be [T, hidden] bf16");
  auto lin = [&](const at::Tensor& x, int i) {
    const at::Tensor& b = w[4 * i + 3];
    return linear_w4(x, w[4 * i], w[4 * i + 1], w[4 * i + 2], group,
                     b.numel() ? c10::optional<at::Tensor>(b) : c10::optional<at::Tensor>());
  };
  const int64_t T = h.size(0), D = k_cache.size(2), qn = n_heads * D, kn = kv_heads * D;
  const at::Tensor qkv = lin(rms_norm(h, attn_in, eps, float32_gain), 0);  // [T, qn + 2 kn]
  TORCH_CHECK(qkv.size(1) == qn + 2 * kn, "subspec: layer_w4: q/k/v widths do not match the heads");
  const at::Tensor q = rope(qkv.narrow(1, 0, qn).view({T, n_heads, D}), cos, sin);
  const at::Tensor k = rope(qkv.narrow(1, qn, kn).view({T, kv_heads, D}), cos, sin);
  const at::Tensor v = qkv.narrow(1, qn + kn, kn).view({T, kv_heads, D});
  k_cache.index_copy_(1, slots, k.transpose(0, 1));
  v_cache.index_copy_(1, slots, v.transpose(0, 1));
  const at::Tensor o = tree_attention(q, k_cache, v_cache, prefix, ancestors, positions, window, attn_scale);
  const at::Tensor h2 = at::add(h, lin(o.view({T, qn}), 1));
  const at::Tensor gu = lin(rms_norm(h2, mlp_in, eps, float32_gain), 2);  // [T, 2 I]
  const int64_t I = gu.size(1) / 2;
  TORCH_CHECK(I % 16 == 0, "subspec: layer_w4: the intermediate size must be a multiple of 16");
  at::Tensor m = at::empty({T, I}, h.options());
  silu_mul_rows(bf16_ptr(gu), bf16_ptr(gu) + I, 2 * I, T, I, bf16_ptr_mut(m), I);
  return at::add(h2, lin(m, 3));
}

// ---- lossless delta coding of an offloaded weight against its 4-bit substitute ------------------------------------
// A target forward streams every offloaded layer's BF16 weights; the draft already holds each of them as a 4-bit
// substitute (codes, scale, shift in pack_w4's layout), which predicts most of a weight's sign, exponent and leading
// mantissa bits. The stream stores, per weight, the difference d = ord(w) - ord(p) of the weight's BF16 bits w and
// the prediction's p in the order-preserving integer view of BF16 (ord(b) = b for b >= 0, b ^ 0x7fff for b < 0, as
// int16: adjacent floats are adjacent integers), in one signed byte when |d| <= 127, else the byte -128 and the
// weight's 16 bits in the escape list. Decoding adds d back: the same bits, always (any bit pattern round-trips).
//   prediction p = bf16_rne(fma(code, scale, shift)) in fp32, rounded to nearest even by integer arithmetic (the same
//   bits in the vector decoder, the scalar encoder and any machine).
// Order (the decoder's): for each 16-row block nb: for each k-block kb, chunk i (kblock/8 of them), quarter q (4):
// 32 weights, rows nb*16 + 4q + p/8 and columns kb*kblock + 8i + p%8 for p = 0..31. Each block's 16 K bytes of d are
// followed by its escapes (2 bytes each, in the same order), so a block decodes from its own bytes.
inline uint16_t predict_bf16(uint8_t code, float scale, float shift) {
  const float v = std::fma(float(code), scale, shift);
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline int32_t ord_bf16(uint16_t b) { return int16_t(b) < 0 ? int32_t(int16_t(b ^ 0x7FFF)) : int32_t(int16_t(b)); }

struct DeltaShape {
  int64_t N, K, kblock, chunks, Kb, G, group;
};

DeltaShape delta_shape(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& shift, int64_t group) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(3) == 64 &&
                  (codes.size(2) == 8 || codes.size(2) == 4),
              "subspec: codes must be [N/16, K/kblock, kblock/8, 64] uint8 (pack_w4)");
  DeltaShape d;
  d.chunks = codes.size(2);
  d.kblock = d.chunks * 8;
  d.N = codes.size(0) * kTileRows;
  d.Kb = codes.size(1);
  d.K = d.Kb * d.kblock;
  d.group = group;
  TORCH_CHECK(group > 0 && group % d.kblock == 0 && d.K % group == 0, "subspec: the group does not match the codes");
  d.G = d.K / group;
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && shift.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  shift.is_contiguous() && scale.numel() == d.N * d.G && shift.numel() == scale.numel(),
              "subspec: scale/shift must be [N/16, K/group, 16] bf16");
  return d;
}

// w [N, K] bf16 (row-major) -> the stream (uint8): the reference of the format, scalar.
at::Tensor w4_delta_encode(const at::Tensor& w, const at::Tensor& codes, const at::Tensor& scale,
                           const at::Tensor& shift, int64_t group) {
  const DeltaShape s = delta_shape(codes, scale, shift, group);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(0) == s.N &&
                  w.size(1) == s.K,
              "subspec: w must be a contiguous [N, K] bf16 tensor matching the codes");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  const uint16_t* hp = reinterpret_cast<const uint16_t*>(shift.data_ptr());
  std::vector<uint8_t> out;
  out.reserve(size_t(s.N * s.K + s.N * s.K / 4));
  std::vector<uint16_t> esc;
  for (int64_t nb = 0; nb < s.N / kTileRows; ++nb) {
    esc.clear();
    for (int64_t kb = 0; kb < s.Kb; ++kb) {
      const int64_t g = kb * s.kblock / s.group;
      for (int64_t i = 0; i < s.chunks; ++i) {
        const uint8_t* chunk = cp + ((nb * s.Kb + kb) * s.chunks + i) * 64;
        for (int q = 0; q < 4; ++q)
          for (int p = 0; p < 32; ++p) {
            const int64_t nt = 4 * q + p / 8, e = p % 8;
            const uint8_t byte = chunk[4 * nt + e % 4];
            const uint8_t code = e < 4 ? (byte & 0x0F) : (byte >> 4);
            const int64_t at = (nb * s.G + g) * kTileRows + nt;
            const uint16_t pred = predict_bf16(code, bf16_to_float(sp[at]), bf16_to_float(hp[at]));
            const uint16_t wb = wp[(nb * kTileRows + nt) * s.K + kb * s.kblock + 8 * i + e];
            const int32_t d = ord_bf16(wb) - ord_bf16(pred);
            if (d >= -127 && d <= 127) {
              out.push_back(uint8_t(int8_t(d)));
            } else {
              out.push_back(uint8_t(0x80));
              esc.push_back(wb);
            }
          }
      }
    }
    const size_t at = out.size();
    out.resize(at + 2 * esc.size());
    std::memcpy(out.data() + at, esc.data(), 2 * esc.size());
  }
  at::Tensor t = at::empty({int64_t(out.size())}, codes.options());
  std::memcpy(t.data_ptr<uint8_t>(), out.data(), out.size());
  return t;
}

// ord() on 32 int16 lanes (an involution: also its own inverse).
inline __m512i ord_epi16(__m512i b) {
  return _mm512_xor_si512(b, _mm512_srli_epi16(_mm512_srai_epi16(b, 15), 1));
}

// bf16_rne bits of 16 fp32 lanes, in the low half of each 32-bit lane.
inline __m512i rne_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
}

// The stream (src, as written by w4_delta_encode) -> out [N, K] bf16. src and out may share a buffer (a staging slot
// read with the stream at its end and decoded in place): a block whose input the output would overwrite is copied
// aside first; the output of a block must not reach a later block's input. Returns the bytes of src consumed.
int64_t w4_delta_decode(const at::Tensor& src, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& shift, int64_t group, at::Tensor out) {
  const DeltaShape s = delta_shape(codes, scale, shift, group);
  TORCH_CHECK(src.dim() == 1 && src.scalar_type() == at::kByte && src.is_contiguous(),
              "subspec: the delta stream must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(0) == s.N &&
                  out.size(1) == s.K,
              "subspec: out must be a contiguous [N, K] bf16 tensor matching the codes");
  const uint8_t* in = src.data_ptr<uint8_t>();
  const uint8_t* in_end = in + src.numel();
  uint8_t* ob = reinterpret_cast<uint8_t*>(out.data_ptr());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  const uint16_t* hp = reinterpret_cast<const uint16_t*>(shift.data_ptr());
  const int64_t block_d = kTileRows * s.K, block_out = 2 * kTileRows * s.K;
  // lanes of a quarter: row 4q + t/4 of the block's 16 scales; the lo/hi halves -> (row, column) order
  __m512i rows_of[4];
  for (int q = 0; q < 4; ++q) {
    alignas(64) int32_t idx[16];
    for (int t = 0; t < 16; ++t) idx[t] = 4 * q + t / 4;
    rows_of[q] = _mm512_load_si512(idx);
  }
  alignas(64) int16_t join[32];
  for (int p = 0; p < 32; ++p) {
    const int nl = p / 8, e = p % 8;
    join[p] = int16_t(e < 4 ? 2 * (4 * nl + e) : 32 + 2 * (4 * nl + e - 4));
  }
  const __m512i join_idx = _mm512_load_si512(join);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i escape = _mm512_set1_epi16(-128);
  std::vector<uint8_t> aside;
  for (int64_t nb = 0; nb < s.N / kTileRows; ++nb) {
    TORCH_CHECK(in + block_d <= in_end, "subspec: the delta stream ended early (damaged layer file?)");
    const uint8_t* d = in;
    const int64_t n_esc = [&] {
      int64_t c = 0;
      for (int64_t j = 0; j < block_d; j += 64)
        c += __builtin_popcountll(_mm512_cmpeq_epi8_mask(_mm512_loadu_si512(d + j), _mm512_set1_epi8(-128)));
      return c;
    }();
    const int64_t block_in = block_d + 2 * n_esc;
    TORCH_CHECK(in + block_in <= in_end, "subspec: the delta stream ended early (damaged layer file?)");
    uint8_t* o0 = ob + nb * block_out;
    TORCH_CHECK(!(in + block_in < in_end && o0 + block_out > in + block_in && o0 < in_end),
                "subspec: decoding in place would overwrite input not yet read");
    if (o0 < in + block_in && in < o0 + block_out) {  // in place, over its own input: decode from a copy
      aside.assign(in, in + block_in);
      d = aside.data();
    }
    const uint16_t* esc = reinterpret_cast<const uint16_t*>(d + block_d);
    for (int64_t kb = 0; kb < s.Kb; ++kb) {
      const int64_t g = kb * s.kblock / s.group;
      const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + (nb * s.G + g) * 16))), 16));
      const __m512 sh = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp + (nb * s.G + g) * 16))), 16));
      __m512 sq[4], hq[4];
      for (int q = 0; q < 4; ++q) {
        sq[q] = _mm512_permutexvar_ps(rows_of[q], sc);
        hq[q] = _mm512_permutexvar_ps(rows_of[q], sh);
      }
      for (int64_t i = 0; i < s.chunks; ++i) {
        const __m512i c = _mm512_loadu_si512(cp + ((nb * s.Kb + kb) * s.chunks + i) * 64);
        const __m512i lo = _mm512_and_si512(c, nib), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
        for (int q = 0; q < 4; ++q) {
          __m128i l4, h4;
          switch (q) {
            case 0: l4 = _mm512_extracti32x4_epi32(lo, 0); h4 = _mm512_extracti32x4_epi32(hi, 0); break;
            case 1: l4 = _mm512_extracti32x4_epi32(lo, 1); h4 = _mm512_extracti32x4_epi32(hi, 1); break;
            case 2: l4 = _mm512_extracti32x4_epi32(lo, 2); h4 = _mm512_extracti32x4_epi32(hi, 2); break;
            default: l4 = _mm512_extracti32x4_epi32(lo, 3); h4 = _mm512_extracti32x4_epi32(hi, 3); break;
          }
          const __m512i pl = rne_bf16_bits(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(l4)), sq[q], hq[q]));
          const __m512i ph = rne_bf16_bits(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h4)), sq[q], hq[q]));
          const __m512i pred = _mm512_permutex2var_epi16(pl, join_idx, ph);  // 4 rows x 8 columns
          const __m512i dv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
          d += 32;
          __m512i wv = ord_epi16(_mm512_add_epi16(ord_epi16(pred), dv));
          const __mmask32 em = _mm512_cmpeq_epi16_mask(dv, escape);
          wv = _mm512_mask_expandloadu_epi16(wv, em, esc);
          esc += __builtin_popcount(em);
          uint8_t* o = o0 + (4 * q * s.K + kb * s.kblock + 8 * i) * 2;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_extracti32x4_epi32(wv, 0));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * s.K), _mm512_extracti32x4_epi32(wv, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 4 * s.K), _mm512_extracti32x4_epi32(wv, 2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 6 * s.K), _mm512_extracti32x4_epi32(wv, 3));
        }
      }
    }
    in += block_in;
  }
  return int64_t(in - src.data_ptr<uint8_t>());
}

// ---- capability probe -------------------------------------------------------------------------------------------
bool amx_usable() { return request_amx_permission(); }

}  // namespace
}  // namespace subspec

TORCH_LIBRARY(subspec, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor", &subspec::linear_bf16);
  m.def("linear_w4(Tensor x, Tensor codes, Tensor scale, Tensor shift, int group, Tensor? bias) -> Tensor",
        &subspec::linear_w4);
  m.def("pack_w4(Tensor codes, int group) -> Tensor", &subspec::pack_w4);
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, int prefix, Tensor ancestors, Tensor positions, "
        "int window, float scale) -> Tensor",
        &subspec::tree_attention);
  m.def("rms_norm(Tensor x, Tensor gain, float eps, bool float32_gain) -> Tensor", &subspec::rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &subspec::rope);
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor", &subspec::silu_mul);
  m.def("layer_w4(Tensor h, Tensor[] w, int group, Tensor attn_in, Tensor mlp_in, float eps, bool float32_gain, "
        "int n_heads, int kv_heads, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int prefix, Tensor ancestors, Tensor positions, int window, float attn_scale) -> Tensor",
        &subspec::layer_w4);
  m.def("w4_delta_encode(Tensor w, Tensor codes, Tensor scale, Tensor shift, int group) -> Tensor",
        &subspec::w4_delta_encode);
  m.def("w4_delta_decode(Tensor src, Tensor codes, Tensor scale, Tensor shift, int group, Tensor(a!) out) -> int",
        &subspec::w4_delta_decode);
  m.def("amx_usable() -> bool", &subspec::amx_usable);
}
