// subspec CPU kernels: what every tier shares (scalar BF16 helpers, argument checks, the 4-bit code layout).
//
// A tier is one build of ops.cpp for one instruction set (tier_*.h); see drivers.h for the operators and the
// batch-invariance contract every tier keeps.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <vector>
#include <exception>
#include <omp.h>

namespace subspec {

constexpr int64_t kNBlock = 16;  // output rows per block of the 4-bit layout (pack_w4) and of its scale/shift tiles

inline const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* bf16_ptr_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even to bf16 (torch's c10::BFloat16 rounding: NaN -> the quiet NaN 0x7FC0).
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline float bf16_round(float f) { return bf16_to_float(to_bf16(f)); }

// ---- threads ------------------------------------------------------------------------------------------------------
// Tasks [0, n) shared out by the threads of an OpenMP region as contiguous ranges that are balanced at their ends: range
// r = [n r / R, n (r + 1) / R) (R ranges, one a thread), claimed front to back in chunks of `grain` tasks through its
// own counter, first by its owner, then by every thread that has finished its own. Each thread thus streams through
// consecutive weights (its software and hardware prefetch run ahead in one stream: a draft step of SmolLM2-135M's
// fused 4-bit layers was 25 % faster than with the chunks dealt out in turn, which sends each thread jumping across
// the weights), while a thread the OS takes away (another process on the cores) still delays only the chunk it holds:
// the others take the rest of its range. Which thread runs a task changes no arithmetic.
class RangeTasks {
 public:
  static constexpr int kMaxRanges = 64;  // more threads than this share the ranges (each range's counter is atomic)
  // ranges: the threads that will call run (their counters live in this object: nothing is allocated per loop)
  explicit RangeTasks(int ranges) : ranges_(std::min(kMaxRanges, std::max(1, ranges))) { reset(0, 1); }
  // Before a loop, by one thread, with a barrier between it and run (an OpenMP single's).
  void reset(int64_t n, int64_t grain) {
    n_ = n;
    grain_ = std::max<int64_t>(1, grain);
    for (int r = 0; r < ranges_; ++r) next_[r].store(0, std::memory_order_relaxed);
  }
  // By each thread `me` of `threads`: fn(t0, t1) over the chunks it claims, its own range's first. No barrier after.
  template <class Fn>
  void run(int me, int threads, const Fn& fn) {
    const int R = std::min(threads, ranges_);
    for (int k = 0; k < R; ++k) {
      const int r = (me + k) % R;
      const int64_t r0 = n_ * r / R, r1 = n_ * (r + 1) / R;
      for (;;) {
        const int64_t t0 = r0 + next_[r].fetch_add(1, std::memory_order_relaxed) * grain_;
        if (t0 >= r1) break;
        fn(t0, std::min(r1, t0 + grain_));
      }
    }
  }

 private:
  int64_t n_ = 0, grain_ = 1;
  int ranges_;
  std::atomic<int64_t> next_[kMaxRanges];
};

// Tasks [0, n) by torch's OpenMP threads (RangeTasks, in chunks of `grain`), or on this thread alone where there is one
// thread or the call is inside a parallel region.
template <class Fn>
inline void parallel_tasks(int64_t n, int64_t grain, const Fn& fn) {
  const int threads = at::get_num_threads();
  if (n <= grain || threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(int64_t(0), n);
    return;
  }
#ifdef SUBSPEC_STATIC_TASKS  // (a tuning build: torch's static split, for comparison)
  at::parallel_for(0, n, 1, fn);
#else
  RangeTasks tasks(threads);
  tasks.reset(n, grain);
#pragma omp parallel num_threads(threads)
  tasks.run(omp_get_thread_num(), omp_get_num_threads(), fn);
#endif
}

// fn over [0, n) by torch's parallel_for, or on this thread alone inside an OpenMP region of ours (layers_w4's): torch
// does not see our regions, and would open a nested one and ask for its thread count from a worker thread.
template <class Fn>
inline void parallel_range(int64_t n, int64_t grain, const Fn& fn) {
  if (omp_in_parallel()) {
    if (n > 0) fn(int64_t(0), n);
  } else {
    at::parallel_for(0, n, grain, fn);
  }
}

// Buffers a 4-bit linear's engine borrows for its quantized activations instead of allocating them: layers_w4 sizes
// one before its OpenMP region, so nothing is allocated inside it (an allocation is a microsecond the other thread
// waits out at the next barrier, eight a layer).
struct W4Scratch {
  at::Tensor q8, st;  // int8 activations, fp32 per-group steps and sums
  W4Scratch(int64_t q8_bytes, int64_t st_floats, const at::TensorOptions& o)
      : q8(at::empty({q8_bytes}, o.dtype(at::kChar))), st(at::empty({st_floats}, o.dtype(at::kFloat))) {}
};

// A grain that gives each of torch's threads about 8 chunks of n tasks (asked outside any OpenMP region: see layers_w4).
// Ask for ``bytes`` from ``p`` on into L2 (a group of weight rows the next step reads from DRAM: the hardware's
// stream prefetchers restart at every 4 KiB page and every new row, so a cold row's first lines would stall).
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

constexpr int64_t kDecodeAhead = 4096;  // a coded stream's decoder prefetches this far ahead (its codes half as far)
constexpr int64_t kEscapeSlack = 16;  // readable bytes after a block's last escape (drivers.h: readable_escapes)

// pshufb controls that expand the first popcount(m) 16-bit values of a vector into the 8 lanes set in m (the codec's
// escapes, where the tier has no expand instruction: avx2, AVX-512 without VBMI2)
struct ExpandTable {
  alignas(16) uint8_t ctrl[256][16];
  ExpandTable() {
    for (int m = 0; m < 256; ++m)
      for (int l = 0, k = 0; l < 8; ++l) {
        const bool set = m >> l & 1;
        ctrl[m][2 * l] = set ? uint8_t(2 * k) : 0x80;
        ctrl[m][2 * l + 1] = set ? uint8_t(2 * k + 1) : 0x80;
        k += set;
      }
  }
};

inline int64_t dynamic_grain(int64_t n, int threads) { return std::max<int64_t>(1, n / (8 * threads)); }
inline int64_t dynamic_grain(int64_t n) { return dynamic_grain(n, at::get_num_threads()); }

// Cephes logf's polynomial (about 1 ulp), written once for every tier's V::log: log(x) = e ln 2 + log(1 + m), with
// x's mantissa folded to 1 + m in [sqrt(1/2), sqrt(2)) and its exponent e (each tier extracts them with its own bit
// operations and maps x == 0 to -inf). V::fma is fused where the tier has FMA, two roundings on the portable tier.
template <class V>
inline typename V::F cephes_log(typename V::F m, typename V::F e) {
  using F = typename V::F;
  static constexpr float kPoly[] = {-1.1514610310E-1f, 1.1676998740E-1f, -1.2420140846E-1f, 1.4249322787E-1f,
                                    -1.6668057665E-1f, 2.0000714765E-1f, -2.4999993993E-1f, 3.3333331174E-1f};
  const F z = V::mul(m, m);
  F y = V::set1(7.0376836292E-2f);
  for (float c : kPoly) y = V::fma(y, m, V::set1(c));
  y = V::mul(V::mul(y, m), z);
  y = V::fma(e, V::set1(-2.12194440e-4f), y);
  y = V::fma(z, V::set1(-0.5f), y);
  return V::fma(e, V::set1(0.693359375f), V::add(m, y));
}

// ---- argument checks (one line each, naming the operator's contract) ------------------------------------------
inline void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "subspec: ", what, " must be a CPU tensor (the native kernels run on the CPU), got ",
              t.device());
}

inline void check_bf16(const at::Tensor& t, const char* what) {
  check_cpu(t, what);
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "subspec: ", what, " must be bf16, got ", t.scalar_type());
}

inline void check_linear_args(const at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias) {
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2, "subspec: x must be [M, K]");
  TORCH_CHECK(x.size(1) == K && x.stride(1) == 1, "subspec: x must have K = ", K, " contiguous columns");
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "subspec: N must be a multiple of 16 and K of 32");
  if (bias.has_value() && bias->defined()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() &&
                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                "subspec: bias must be [N] bf16 or fp32");
  }
}

// The bias as an fp32 tensor [N] (undefined: none), read by pointer in the kernels' inner code: no calls there, so the
// compiler keeps the accumulators in registers (a call clobbers every vector register).
inline at::Tensor bias_f32(const at::Tensor& bias) {
  return bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
}

// bias[n0 .. n0 + 16) as fp32.
inline void bias_block(const at::Tensor& bias, int64_t n0, float* out16) {
  if (bias.scalar_type() == at::kBFloat16) {
    const uint16_t* b = bf16_ptr(bias) + n0;
    for (int i = 0; i < 16; ++i) out16[i] = bf16_to_float(b[i]);
  } else {
    const float* b = bias.data_ptr<float>() + n0;
    for (int i = 0; i < 16; ++i) out16[i] = b[i];
  }
}

// ---- the 4-bit code layout (every tier reads the same bytes; the codec's stream order follows it) ------------------
// codes [N/16][K/kblock][kblock/8][64] bytes, kblock = 64 (32 for a group of 32). Chunk i of an (n-block, k-block)
// covers columns k0 + 8i .. k0 + 8i + 7 of the block's 16 rows: byte 4n + j holds row n0 + n's code of column
// k0 + 8i + j in its low nibble and of column k0 + 8i + 4 + j in its high nibble (j = 0..3). So a chunk is 16 dwords,
// one per output row, each the codes of 4 consecutive columns: the operand layout of integer dot-product
// instructions (VNNI, maddubs), with output rows in lanes.
struct W4Shape {
  int64_t N, K, kblock, chunks, Kb, G, group;
};

inline W4Shape w4_shape(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& shift, int64_t group) {
  check_cpu(codes, "codes");
  check_cpu(scale, "scale");
  check_cpu(shift, "shift");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(3) == 64 &&
                  (codes.size(2) == 8 || codes.size(2) == 4),
              "subspec: codes must be [N/16, K/kblock, kblock/8, 64] uint8 (pack_w4)");
  W4Shape s;
  s.chunks = codes.size(2);
  s.kblock = s.chunks * 8;
  s.N = codes.size(0) * kNBlock;
  s.Kb = codes.size(1);
  s.K = s.Kb * s.kblock;
  s.group = group;
  TORCH_CHECK(group > 0 && group % s.kblock == 0 && s.K % group == 0 && (s.kblock == 64 || group == 32),
              "subspec: the group size must be 32 or a multiple of 64 dividing K, as given to pack_w4");
  s.G = s.K / group;
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && shift.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  shift.is_contiguous() && scale.numel() == s.N * s.G && shift.numel() == scale.numel(),
              "subspec: scale/shift must be [N/16, K/group, 16] bf16");
  return s;
}

// One n-block x k-block of the layout above (16 rows x kblock columns, chunks x 64 bytes at ``d``) from the 16 rows
// starting at ``rows`` (``row_bytes`` apart), whose k-block kb is taken: codes one a byte (0..15) or two a byte
// (``Nibbles``: column 2c in the low nibble, 2c + 1 in the high: subspec.quant.pack_codes, the substitutes' cached form).
template <bool Nibbles>
inline void pack_w4_block(const uint8_t* rows, int64_t row_bytes, int64_t kb, int64_t kblock, int64_t chunks,
                          uint8_t* d) {
  for (int64_t n = 0; n < kNBlock; ++n) {  // byte 4n + j of chunk i: row n, columns 8i + j (low), 8i + 4 + j (high)
    const uint8_t* row = rows + n * row_bytes + kb * kblock / (Nibbles ? 2 : 1);
    for (int64_t i = 0; i < chunks; ++i) {
      uint8_t* o = d + i * 64 + 4 * n;
      if constexpr (Nibbles) {  // columns 8i..8i+7 are bytes b0..b3, column 2m in b_m's low nibble, 2m + 1 high
        const uint8_t* b = row + 4 * i;
        o[0] = uint8_t((b[0] & 0x0F) | ((b[2] & 0x0F) << 4));
        o[1] = uint8_t((b[0] >> 4) | (b[2] & 0xF0));
        o[2] = uint8_t((b[1] & 0x0F) | ((b[3] & 0x0F) << 4));
        o[3] = uint8_t((b[1] >> 4) | (b[3] & 0xF0));
      } else {
        const uint8_t* b = row + 8 * i;
        for (int j = 0; j < 4; ++j) o[j] = uint8_t((b[j] & 0x0F) | ((b[j + 4] & 0x0F) << 4));
      }
    }
  }
}

// The layout above from codes given one a byte (codes [N, K] uint8, 0..15) or two a byte (``nibbles``: [N, K/2]).
template <bool Nibbles>
inline at::Tensor pack_w4_from(const at::Tensor& codes, int64_t group) {
  check_cpu(codes, "codes");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte,
              Nibbles ? "subspec: codes must be [N, K/2] uint8 (two 4-bit codes a byte)" : "subspec: codes must be [N, K] uint8");
  const int64_t N = codes.size(0), K = codes.size(1) * (Nibbles ? 2 : 1);
  const int64_t kblock = group % 64 == 0 ? 64 : 32;
  TORCH_CHECK(group > 0 && N % kNBlock == 0 && K % kblock == 0 && (kblock == 64 || group == 32),
              "subspec: N must be a multiple of 16, K of 64 (32 for a group of 32), the group 32 or a multiple of 64");
  at::Tensor c = codes.contiguous();
  const int64_t Kb = K / kblock, chunks = kblock / 8, row_bytes = Nibbles ? K / 2 : K;
  at::Tensor out = at::empty({N / kNBlock, Kb, chunks, 64}, codes.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, (N / kNBlock) * Kb, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = t / Kb, kb = t % Kb;
      pack_w4_block<Nibbles>(src + nb * kNBlock * row_bytes, row_bytes, kb, kblock, chunks, dst + t * chunks * 64);
    }
  });
  return out;
}

// codes [N, K] uint8 (0..15) -> the layout above.
inline at::Tensor pack_w4(const at::Tensor& codes, int64_t group) { return pack_w4_from<false>(codes, group); }

// codes two a byte [N, K/2] uint8 (contiguous) -> the layout above in the same memory, returned as a view of it. The
// 16 rows of an n-block hold 8K bytes in both forms, at the same offset, so each n-block is copied to a scratch of its
// own and rewritten from there: no second buffer (a loaded substitute's codes become the kernel's without new memory).
inline at::Tensor pack_w4_nibbles_(at::Tensor& codes, int64_t group) {
  check_cpu(codes, "codes");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "subspec: codes must be contiguous [N, K/2] uint8 (two 4-bit codes a byte)");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  const int64_t kblock = group % 64 == 0 ? 64 : 32;
  TORCH_CHECK(group > 0 && N % kNBlock == 0 && K % kblock == 0 && (kblock == 64 || group == 32),
              "subspec: N must be a multiple of 16, K of 64 (32 for a group of 32), the group 32 or a multiple of 64");
  const int64_t Kb = K / kblock, chunks = kblock / 8, row_bytes = K / 2, block_bytes = kNBlock * row_bytes;
  uint8_t* base = codes.data_ptr<uint8_t>();
  at::parallel_for(0, N / kNBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> scratch(block_bytes);
    for (int64_t nb = b0; nb < b1; ++nb) {
      uint8_t* blk = base + nb * block_bytes;
      std::memcpy(scratch.data(), blk, block_bytes);  // the block's rows, read from here while rewritten in place
      for (int64_t kb = 0; kb < Kb; ++kb)
        pack_w4_block<true>(scratch.data(), row_bytes, kb, kblock, chunks, blk + kb * chunks * 64);
    }
  });
  return codes.view({N / kNBlock, Kb, chunks, 64});
}

// codes two a byte [N, K/2] uint8 -> the layout above (no unpacked copy).
inline at::Tensor pack_w4_nibbles(const at::Tensor& codes, int64_t group) { return pack_w4_from<true>(codes, group); }

// ---- lossless delta coding of an offloaded weight against its 4-bit substitute: the format ----------------------
// A target forward streams every offloaded layer's BF16 weights; the draft already holds each of them as a 4-bit
// substitute (codes, scale, shift in pack_w4's layout), which predicts most of a weight's sign, exponent and leading
// mantissa bits. The stream stores, per weight, the difference d = ord(w) - ord(p) of the weight's BF16 bits w and
// the prediction's p in the order-preserving integer view of BF16 (ord(b) = b for b >= 0, b ^ 0x7fff for b < 0, as
// int16: adjacent floats are adjacent integers), in one signed byte when |d| <= 127, else the byte -128 and the
// weight's 16 bits in the escape list. Decoding adds d back: the same bits, always (any bit pattern round-trips).
//   prediction p = bf16_rne(code * scale + shift) in fp32: code * scale is exact in fp32 (a 4-bit integer times a
//   bf16), so there is one rounding (the add's; an FMA gives the same), then round to nearest even by integer
//   arithmetic: the same bits on every tier and machine.
// Order (the decoder's): for each 16-row block nb: for each k-block kb, chunk i (kblock/8 of them), quarter q (4):
// 32 weights, rows nb*16 + 4q + p/8 and columns kb*kblock + 8i + p%8 for p = 0..31. Each block's 16 K bytes of d are
// followed by its escapes (2 bytes each, in the same order), so a block decodes from its own bytes.
inline uint16_t predict_bf16(uint8_t code, float scale, float shift) {
  const float v = float(code) * scale + shift;  // exact product, one rounding (ops.cpp is built without contraction)
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline int32_t ord_bf16(uint16_t b) { return int16_t(b) < 0 ? int32_t(int16_t(b ^ 0x7FFF)) : int32_t(int16_t(b)); }

// w [N, K] bf16 (row-major) -> the stream (uint8): the reference of the format, scalar, the same on every tier. The
// 16-row blocks are coded in parallel (each block's bytes depend on its own weights alone), then joined in order.
inline at::Tensor w4_delta_encode(const at::Tensor& w, const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& shift, int64_t group) {
  const W4Shape s = w4_shape(codes, scale, shift, group);
  check_bf16(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) == s.N && w.size(1) == s.K,
              "subspec: w must be a contiguous [N, K] bf16 tensor matching the codes");
  const uint16_t* wp = bf16_ptr(w);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = bf16_ptr(scale);
  const uint16_t* hp = bf16_ptr(shift);
  const int64_t Nb = s.N / kNBlock;
  std::vector<std::vector<uint8_t>> blocks(static_cast<size_t>(Nb));
  at::parallel_for(0, Nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> esc;
    int32_t tab[kNBlock][16];  // ord() of each row's prediction for each code, per group
    for (int64_t nb = b0; nb < b1; ++nb) {
      std::vector<uint8_t>& out = blocks[size_t(nb)];
      out.resize(size_t(kNBlock * s.K));  // the differences, then the escapes appended
      uint8_t* o = out.data();
      esc.clear();
      int64_t made = -1;
      for (int64_t kb = 0; kb < s.Kb; ++kb) {
        const int64_t g = kb * s.kblock / s.group;
        if (g != made) {
          for (int64_t nt = 0; nt < kNBlock; ++nt) {
            const int64_t at = (nb * s.G + g) * kNBlock + nt;
            for (int c = 0; c < 16; ++c)
              tab[nt][c] = ord_bf16(predict_bf16(uint8_t(c), bf16_to_float(sp[at]), bf16_to_float(hp[at])));
          }
          made = g;
        }
        for (int64_t i = 0; i < s.chunks; ++i) {
          const uint8_t* chunk = cp + ((nb * s.Kb + kb) * s.chunks + i) * 64;
          for (int q = 0; q < 4; ++q)
            for (int p = 0; p < 32; ++p) {
              const int64_t nt = 4 * q + p / 8, e = p % 8;
              const uint8_t byte = chunk[4 * nt + e % 4];
              const uint8_t code = e < 4 ? (byte & 0x0F) : (byte >> 4);
              const uint16_t wb = wp[(nb * kNBlock + nt) * s.K + kb * s.kblock + 8 * i + e];
              const int32_t d = ord_bf16(wb) - tab[nt][code];
              if (d >= -127 && d <= 127) {
                *o++ = uint8_t(int8_t(d));
              } else {
                *o++ = uint8_t(0x80);
                esc.push_back(wb);
              }
            }
        }
      }
      const size_t at = out.size();
      out.resize(at + 2 * esc.size());
      std::memcpy(out.data() + at, esc.data(), 2 * esc.size());
    }
  });
  int64_t total = 0;
  for (const auto& b : blocks) total += int64_t(b.size());
  at::Tensor t = at::empty({total}, codes.options());
  uint8_t* dst = t.data_ptr<uint8_t>();
  for (const auto& b : blocks) {
    std::memcpy(dst, b.data(), b.size());
    dst += b.size();
  }
  return t;
}

}  // namespace subspec
