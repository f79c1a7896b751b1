// The AMX tier (Intel Xeon since Sapphire Rapids: AMX-BF16, AVX-512 BF16, VNNI and VBMI2): the AVX-512 tier's
// operators, with the BF16 linear on the tile unit.
//
// BF16 linear: Y^T = W X^T with W (the weight, [N, K] row-major as stored) as the AMX A operand and the activations X
// as the B operand; each output element accumulates its K dimension in the same fixed order (32-wide k-blocks,
// ascending) inside one tile register, and AMX computes every element of a tile independently of the others. Padding
// rows are zero columns of B and change nothing.
// 4-bit linear: the AVX-512 tier's (8-bit activations, VPDPBUSD). An AMX-INT8 one (15-bit activations as two signed
// bytes, the codes as the B tile straight from their nibbles) was 1.3-2.3x slower at the 1-32 rows a draft runs
// (a 2-vCPU Sapphire Rapids: 8960 x 1536 at 1 / 6 / 12 / 32 rows 0.39 / 0.44 / 0.83 / 1.82 ms against 0.17 / 0.29 /
// 0.56 / 1.24; SmolLM2's draft step 10.4 against 5.6 ms): with so few rows the tile unit idles while the codes are
// unpacked and each group's scales applied, work the vector units do with the products in registers.
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

}  // namespace amx

struct AmxTier : Avx512Tier {
  static constexpr const char* kName = "amx";
  using Bf16Gemm = amx::Bf16Gemm;  // (W4Gemm: the AVX-512 tier's, inherited)
  static bool usable() { return amx::request_amx_permission(); }
};

}  // namespace subspec
