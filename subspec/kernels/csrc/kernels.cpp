// subspec CPU kernels: batch-invariant BF16 linears, 4-bit substitute linears and tree attention on Intel AMX.
//
// Registered as torch operators in the `subspec` namespace (see subspec/kernels/__init__.py, which builds this file
// once per machine and falls back to torch's own kernels where it cannot).
//
// Batch invariance (design.md §3.5): every value a row of the output gets is computed by the same sequence of
// instructions whatever the number of rows in the call and whatever the other rows hold. The linears compute
// Y^T = W X^T with W (the weight, [N, K] row-major as stored) as the AMX A operand and the activations X as the
// B operand; each output element accumulates its K dimension in the same fixed order (32-wide k-blocks, ascending)
// inside one tile register, and AMX computes every element of a tile independently of the others. Padding rows
// are zero columns of B and change nothing. The attention of a query runs over its keys in position order (the
// committed prefix, then its ancestors in the tree by depth), exactly the keys and the order of a one-token
// forward at that position, with fixed-lane reductions.
//
// Built with AMX/AVX-512 flags: subspec loads it only on CPUs that report amx_bf16, amx_tile and avx512_bf16.

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

// ---- the GEMM: Y [M, N] = X [M, K] W^T, W given as 16 x 32 tiles by a weight source -----------------------
// A weight source hands out the bf16 tile (rows nb*16.., columns kb*32..) of W as a pointer and row stride:
// DenseWeights points into a row-major [N, K] bf16 weight; W4Weights de-quantizes a 4-bit tile into a buffer.
struct DenseWeights {
  const uint16_t* w;
  int64_t K;
  int64_t stride() const { return K * 2; }
  const uint16_t* tile(int64_t nb, int64_t kb, int /*i*/, uint16_t* /*abuf*/, uint16_t* /*lut*/) const {
    return w + nb * kTileRows * K + kb * kTileK;
  }
};

// 4-bit weights in the tiled layout made by pack_w4: codes [Nb][Kb][8 row pairs][32 bytes], byte i of row pair p
// holding the codes of column k0+i for row 2p (low nibble) and row 2p+1 (high nibble); scale and shift
// [Nb][G][16] bf16 (G = K / group), so that w[n][k] = codes * scale + shift (HQQ: scale = s, shift = -zero * s),
// computed in fp32 and rounded to bf16 once.
//
// De-quantization by table look-up: at the start of each group, every row of an n-block gets the table of its 16
// possible weights, bf16(j * scale + shift) for j = 0..15 (one fp32 FMA over 16 lanes, rounded once), stored twice
// (32 entries); a tile row is then one vpermw of its codes into that table. vpermw reads the low 5 bits of each
// index, so the zero-extended byte of a row pair indexes the low nibble directly (the duplicated upper half absorbs
// bit 4) and the byte shifted right by 4 the high nibble. About 6 instructions per 64 weights instead of about 24
// for convert + FMA + round; the values are the same bits. Each tile is de-quantized once per call and multiplied
// with all rows of the activations.
inline __m512 bf16x16_to_ps(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The 16 tables of one n-block for one group: lut [16 rows][32] bf16.
inline void make_tables(const uint16_t* scale, const uint16_t* shift, uint16_t* lut) {
  alignas(64) float s[16], z[16];
  _mm512_store_ps(s, bf16x16_to_ps(scale));
  _mm512_store_ps(z, bf16x16_to_ps(shift));
  const __m512 j = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int r = 0; r < kTileRows; ++r) {
    const __m512 f = _mm512_fmadd_ps(j, _mm512_set1_ps(s[r]), _mm512_set1_ps(z[r]));
    _mm512_store_si512(lut + r * kTileK, (__m512i)_mm512_cvtne2ps_pbh(f, f));
  }
}

inline void dequant_tile(const uint8_t* codes, const uint16_t* lut, uint16_t* out) {
  for (int p = 0; p < kTileRows / 2; ++p) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32)));
    const __m512i t0 = _mm512_load_si512(lut + (2 * p) * kTileK), t1 = _mm512_load_si512(lut + (2 * p + 1) * kTileK);
    _mm512_store_si512(out + (2 * p) * kTileK, _mm512_permutexvar_epi16(v, t0));
    _mm512_store_si512(out + (2 * p + 1) * kTileK, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), t1));
  }
}

constexpr int64_t kPrefetchTiles = 16;  // measured: 0, 8, 16 and 24 tiles; 8-24 alike, about 10 % over none

struct W4Weights {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* shift;
  int64_t Kb, G, kb_per_group;
  int64_t stride() const { return 64; }
  // The tile (nb, kb) as block member i (0..3) of the caller, de-quantized into abuf (512 bf16): tables in
  // lut + i * 512, rebuilt at each group start (the caller walks kb in ascending order for each block).
  const uint16_t* tile(int64_t nb, int64_t kb, int i, uint16_t* abuf, uint16_t* lut) const {
    const int64_t g = kb / kb_per_group;
    uint16_t* t = lut + i * kTileElems;
    if (kb % kb_per_group == 0) make_tables(scale + (nb * G + g) * 16, shift + (nb * G + g) * 16, t);
    const uint8_t* c = codes + (nb * Kb + kb) * 256;
    // Software prefetch kPrefetchTiles tiles ahead in this n-block's stream (4 cache lines each): the blocks walk
    // several streams slowly, which the hardware prefetchers follow too late when the weights come from DRAM.
    // Past the end of the n-block it reaches the next one's first tiles (those the caller's next block starts with);
    // a prefetch never faults, so none is bounded.
    const char* f = reinterpret_cast<const char*>(c + kPrefetchTiles * 256);
    _mm_prefetch(f, _MM_HINT_T0);
    _mm_prefetch(f + 64, _MM_HINT_T0);
    _mm_prefetch(f + 128, _MM_HINT_T0);
    _mm_prefetch(f + 192, _MM_HINT_T0);
    dequant_tile(c, t, abuf);
    return abuf;
  }
};

// One block: NN consecutive n-blocks x NM consecutive m-blocks. Tiles 0..3 accumulate (n-block i, m-block j) in
// tile i * NM + j; tiles 4, 5 hold weight tiles (alternating), 6, 7 activation tiles.
template <int NN, int NM, class Src>
inline void gemm_block(const Src& src, int64_t nb0, const uint16_t* bp, int64_t mb0, int64_t Kb, float* cbuf,
                       uint16_t* abuf, uint16_t* lut) {
  static_assert(NN * NM <= 4 && NM <= 2 && NN <= 4, "at most 4 accumulator tiles");
  _tile_zero(0);
  if (NN * NM > 1) _tile_zero(1);
  if (NN * NM > 2) _tile_zero(2);
  if (NN * NM > 3) _tile_zero(3);
  const int64_t lda = src.stride();
  const uint16_t* b0 = bp + mb0 * Kb * kTileElems;
  const uint16_t* b1 = b0 + Kb * kTileElems;
  // Software pipeline: the weight tiles of k-block kb + 1 are prepared (de-quantized for 4-bit weights) while the
  // tile unit multiplies those of kb, so a tile load never waits for the stores that wrote its buffer.
  const uint16_t* a[2][NN];
  for (int i = 0; i < NN; ++i) a[0][i] = src.tile(nb0 + i, 0, i, abuf + i * kTileElems, lut);
  for (int64_t kb = 0; kb < Kb; ++kb) {
    TILE_LOAD(6, b0 + kb * kTileElems, 64);
    if (NM == 2) TILE_LOAD(7, b1 + kb * kTileElems, 64);
    const uint16_t* const* cur = a[kb & 1];
    for (int i = 0; i < NN; ++i) {
      if (i & 1)
        TILE_LOAD(5, cur[i], lda);
      else
        TILE_LOAD(4, cur[i], lda);
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
    if (kb + 1 < Kb) {
      const int next = (kb + 1) & 1;
      for (int i = 0; i < NN; ++i)
        a[next][i] = src.tile(nb0 + i, kb + 1, i, abuf + (next * 4 + i) * kTileElems, lut);
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
  alignas(64) uint16_t abuf[2 * 4 * kTileElems];  // two sets of a block's weight tiles (the pipeline's stages)
  alignas(64) uint16_t lut[4 * kTileElems];  // de-quantization tables of a block's n-blocks (4-bit weights)
  for (int64_t nb = nb_begin; nb < nb_end; nb += NN) {
    const int64_t nn = std::min<int64_t>(NN, nb_end - nb);
    for (int64_t mb = 0; mb < Mb; mb += NM) {
      const int64_t nm = std::min<int64_t>(NM, Mb - mb);
      if (nn == NN && nm == NM) {
        gemm_block<NN, NM>(src, nb, bp, mb, Kb, cbuf, abuf, lut);
        write_block<NN, NM>(cbuf, nb, mb, M, bias, y, N);
      } else {  // tails: the same per-element arithmetic with one accumulator tile
        for (int64_t i = 0; i < nn; ++i)
          for (int64_t j = 0; j < nm; ++j) {
            gemm_block<1, 1>(src, nb + i, bp, mb + j, Kb, cbuf, abuf, lut);
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

// y [M, N] = x [M, K] @ dequant(codes, scale, shift)^T (+ bias); N = codes.size(0) * 16.
at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& shift,
                     int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 8 &&
                  codes.size(3) == 32,
              "subspec: codes must be [N/16, K/32, 8, 32] uint8 (pack_w4)");
  const int64_t N = codes.size(0) * kTileRows, K = codes.size(1) * kTileK;
  TORCH_CHECK(group % kTileK == 0 && K % group == 0, "subspec: group size must be a multiple of 32 dividing K");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && shift.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  shift.is_contiguous() && scale.numel() == N * (K / group) && shift.numel() == scale.numel(),
              "subspec: scale/shift must be [N/16, K/group, 16] bf16");
  const W4Weights src{codes.data_ptr<uint8_t>(), bf16_ptr(scale), bf16_ptr(shift), K / kTileK, K / group,
                      group / kTileK};
  return run_gemm(src, x, N, K, bias);
}

// codes [N, K] uint8 (0..15) -> the tiled 4-bit layout [N/16, K/32, 8, 32] read by linear_w4 (row pairs).
at::Tensor pack_w4(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "subspec: codes must be [N, K] uint8");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(N % kTileRows == 0 && K % kTileK == 0, "subspec: N must be a multiple of 16 and K of 32");
  at::Tensor c = codes.contiguous();
  at::Tensor out = at::empty({N / kTileRows, K / kTileK, kTileRows / 2, 32}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t Kb = K / kTileK;
  at::parallel_for(0, N / 2, 32, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)  // rows 2p (low nibbles) and 2p + 1 (high nibbles)
      for (int64_t kb = 0; kb < Kb; ++kb) {
        const uint8_t* lo = src + (2 * p) * K + kb * kTileK;
        const uint8_t* hi = lo + K;
        uint8_t* d = dst + (((2 * p) / kTileRows) * Kb + kb) * 256 + (p % (kTileRows / 2)) * 32;
        for (int i = 0; i < 32; ++i) d[i] = uint8_t((lo[i] & 0x0F) | ((hi[i] & 0x0F) << 4));
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
// F.silu(g) * u); silu(v) = v / (1 + exp(-v)) in fp32.
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(g.scalar_type() == at::kBFloat16 && u.scalar_type() == at::kBFloat16 && g.is_contiguous() &&
                  u.is_contiguous() && g.sizes() == u.sizes() && g.numel() % 16 == 0,
              "subspec: silu_mul takes two contiguous bf16 tensors of one shape (numel % 16 == 0)");
  at::Tensor y = at::empty_like(g);
  const uint16_t* gp = bf16_ptr(g);
  const uint16_t* up = bf16_ptr(u);
  uint16_t* yp = bf16_ptr_mut(y);
  const int64_t n = g.numel();
  at::parallel_for(0, n / 16, 4096, [&](int64_t b0, int64_t b1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t b = b0; b < b1; ++b) {
      const __m512 v = bf16x16_to_ps(gp + b * 16);
      const __m512 e = exp_ps_any(_mm512_sub_ps(_mm512_setzero_ps(), v));
      __m512 sv = _mm512_div_ps(v, _mm512_add_ps(one, e));
      sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(sv)), 16));
      const __m512 p = _mm512_mul_ps(sv, bf16x16_to_ps(up + b * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + b * 16), (__m256i)_mm512_cvtneps_pbh(p));
    }
  });
  return y;
}

// ---- capability probe -------------------------------------------------------------------------------------------
bool amx_usable() { return request_amx_permission(); }

}  // namespace
}  // namespace subspec

TORCH_LIBRARY(subspec, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor", &subspec::linear_bf16);
  m.def("linear_w4(Tensor x, Tensor codes, Tensor scale, Tensor shift, int group, Tensor? bias) -> Tensor",
        &subspec::linear_w4);
  m.def("pack_w4(Tensor codes) -> Tensor", &subspec::pack_w4);
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, int prefix, Tensor ancestors, Tensor positions, "
        "int window, float scale) -> Tensor",
        &subspec::tree_attention);
  m.def("rms_norm(Tensor x, Tensor gain, float eps, bool float32_gain) -> Tensor", &subspec::rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &subspec::rope);
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor", &subspec::silu_mul);
  m.def("amx_usable() -> bool", &subspec::amx_usable);
}
