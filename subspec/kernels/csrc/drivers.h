// subspec CPU kernels: one driver per operator, written once over a tier's micro-kernels.
//
// A tier (tier_portable.h, tier_avx2.h, tier_avx512.h, tier_amx.h) is a struct providing
//   V          fp32 vectors of V::W lanes (load/store of bf16 and fp32, add/mul/fma/max, a fixed horizontal sum, exp),
//   Bf16Gemm   the BF16 linear's engine: Bf16Gemm(x, w, bias, y) prepares, tasks() units of work, run(t0, t1);
//   W4Gemm     the 4-bit substitute linear's engine, the same interface;
//   decode_block(...)  one 16-row block of the codec's stream (the format is in common.h); its escapes come with at
//              least kEscapeSlack readable bytes after the last one (readable_escapes), so a tier may place them with
//              16-byte loads without counting them first.
// The drivers below do everything else: argument checks, allocation, threading, the attention's key order, the
// norms' reductions, the layer composition.
//
// Batch invariance (design.md §3.5), the contract every tier keeps: every value a row of an output gets is computed
// by the same sequence of instructions whatever the number of rows in the call and whatever the other rows hold.
//   - Linears: an output element (m, n) is reduced over K in an order fixed by the tier alone (its lane count and
//     step), never by M, the block it falls in or the thread that computes it; row tails run the same per-element
//     sequence with fewer rows interleaved. The 4-bit linears quantize each row of x on its own, and their integer
//     products are exact (any order gives the same integer); the group scales are applied per element in group order.
//   - Attention: a query reads exactly the keys of a one-token forward at its position (the committed prefix, then
//     its ancestors in the tree by depth) in position order, and reduces with lane = key index mod V::W.
//   - Element-wise operators and norms: per row, lanes over the row's own elements.
// So within one tier the tree-verify forward gives each node the bits of a one-token forward at its position, and
// BF16 greedy output equals plain decoding. Bits need not agree across tiers.
#pragma once

#include "common.h"
#include <functional>
#include <type_traits>

namespace subspec {

// ---- linears ----------------------------------------------------------------------------------------------------
// y [M, N] = x [M, K] @ w[N, K]^T (+ bias), bf16 in and out, fp32 accumulation; batch-invariant.
template <class T>
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_bf16(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "subspec: w must be [N, K] bf16, contiguous");
  const int64_t N = w.size(0), K = w.size(1);
  check_linear_args(x, N, K, bias);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  typename T::Bf16Gemm gemm(x, w, b, y);
  gemm.parallel([&](int64_t t0, int64_t t1) { gemm.run(t0, t1); });
  return y;
}

// y [M, N] = x [M, K] @ (codes * scale + shift)^T (+ bias), bf16 out; N = codes.size(0) * 16 (HQQ: scale, and
// shift = -zero * scale, per output row and group of K). Batch-invariant.
template <class T>
at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& shift,
                     int64_t group, const c10::optional<at::Tensor>& bias) {
  const W4Shape s = w4_shape(codes, scale, shift, group);
  check_linear_args(x, s.N, s.K, bias);
  at::Tensor y = at::empty({x.size(0), s.N}, x.options());
  if (x.size(0) == 0) return y;
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  typename T::W4Gemm gemm(x, codes, scale, shift, s, b, y);
  gemm.parallel([&](int64_t t0, int64_t t1) { gemm.run(t0, t1); });
  return y;
}

// ---- attention ----------------------------------------------------------------------------------------------------
// Whether attend_group accumulates a head's output in passes over the values where a row and the head's accumulators
// do not fit the registers together (V::kValuePasses, measured per tier; default: no).
template <class V, class = void>
struct ValuePasses : std::false_type {};
template <class V>
struct ValuePasses<V, std::void_t<decltype(V::kValuePasses)>> : std::bool_constant<V::kValuePasses> {};

// Whether V has hsum8 (eight horizontal sums at once, each in V::hsum's order): attend_group's scores use it.
template <class V, class = void>
struct Hsum8 : std::false_type {};
template <class V>
struct Hsum8<V, std::void_t<decltype(V::hsum8(static_cast<const typename V::F*>(nullptr)))>> : std::true_type {};

// The most of a head's NV output vectors whose accumulators fit in kRegs registers beside a value vector and the
// broadcast weight (a divisor of NV: every pass the same width).
constexpr int attend_dims_a_pass(int nv, int regs) {
  int best = 1;
  for (int d = 1; d <= nv; ++d)
    if (nv % d == 0 && d + 3 <= regs) best = d;
  return best;
}

// The G query heads of one KV head (grouped-query attention) over their key sequence (cache slots in position order).
// Each key and value row is loaded and widened once for the G heads; every head's arithmetic is its own and fixed:
// its score with key j is the hsum of its lane-wise products (q times k, V::W lanes, the same FMA chain for every j);
// the softmax runs with lane = index in the sequence modulo V::W; the output accumulates p_j v_j in key order. The
// output's loop runs over the keys outside and a block of heads inside (HB heads' accumulators in registers): each
// element's chain is the same, but the heads' chains run side by side instead of one head's waiting on the FMA's
// latency at every key. Where V has hsum8 (avx2), the scores are made 8 keys at a time, each head's 8 chains side by
// side and their hsums in one reduction, each score's arithmetic unchanged. Where one head's accumulators and a row
// do not fit the registers together (HB = 1) and the tier asks for it (ValuePasses), the value rows are read once a
// head, a block of DV vectors at a time.
//   q: head h's [D] bf16 at q + h * qs; out: head h's at out + h * os; D = DB * 16; s: G rows of n + W floats.
template <class V, int DB>
void attend_group(const uint16_t* q, int64_t qs, int G, const uint16_t* kc, const uint16_t* vc, int64_t ld,
                  const int64_t* keys, int64_t n, float scale, float* s, uint16_t* out, int64_t os) {
  using F = typename V::F;
  constexpr int NV = DB * 16 / V::W, D = DB * 16;
  constexpr int kRegs = sizeof(F) >= 64 ? 32 : 16;  // vector registers (AVX-512: 32)
  constexpr int HB = std::max(1, std::min(16, (kRegs - NV - 1) / NV));  // heads whose accumulators fit beside a row
  alignas(64) float qf[16][D];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < NV; ++v) V::store(qf[h] + V::W * v, V::load_bf16(q + h * qs + V::W * v));
  const int64_t ls = n + V::W;  // a head's row of scores
  float mx[16], inv[16];
  for (int h = 0; h < G; ++h) mx[h] = -INFINITY;
  int64_t j_scalar = 0;  // the keys from which the scores are made one at a time (below)
  if constexpr (Hsum8<V>::value) {  // V::W == 8: 8 keys a head, their chains side by side, their hsums in one reduction
    // (the same additions in the same order as V::hsum: the same bits as below); their rows widened once into kf
    constexpr int KB = 8;
    static_assert(V::W == KB, "V::hsum8 sums 8 accumulators of 8 lanes: a block is V::W keys");
    alignas(64) float kf[KB][D];
    F mv[16];
    for (int h = 0; h < G; ++h) mv[h] = V::set1(-INFINITY);
    const F scv = V::set1(scale);
    for (; j_scalar + KB <= n; j_scalar += KB) {
      for (int b = 0; b < KB; ++b) {
        const uint16_t* k = kc + keys[j_scalar + b] * ld;
        for (int v = 0; v < NV; ++v) V::store(kf[b] + V::W * v, V::load_bf16(k + V::W * v));
      }
      for (int h = 0; h < G; ++h) {
        F acc[KB];
        const F q0 = V::load(qf[h]);
        for (int b = 0; b < KB; ++b) acc[b] = V::mul(q0, V::load(kf[b]));
        for (int v = 1; v < NV; ++v) {
          const F qv = V::load(qf[h] + V::W * v);
          for (int b = 0; b < KB; ++b) acc[b] = V::fma(qv, V::load(kf[b] + V::W * v), acc[b]);
        }
        const F sc = V::mul(V::hsum8(acc), scv);
        V::store(s + h * ls + j_scalar, sc);
        mv[h] = V::max(sc, mv[h]);  // (a NaN score is passed over, as below)
      }
    }
    for (int h = 0; h < G; ++h) mx[h] = V::hmax(mv[h]);
  }
  for (int64_t j = j_scalar; j < n; ++j) {
    const uint16_t* k = kc + keys[j] * ld;
    F kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = V::load_bf16(k + V::W * v);
    for (int h = 0; h < G; ++h) {
      F acc = V::mul(V::load(qf[h]), kv[0]);
      for (int v = 1; v < NV; ++v) acc = V::fma(V::load(qf[h] + V::W * v), kv[v], acc);
      const float sj = V::hsum(acc) * scale;
      s[h * ls + j] = sj;
      mx[h] = sj > mx[h] ? sj : mx[h];
    }
  }
  for (int h = 0; h < G; ++h) {
    float* sh = s + h * ls;
    const F m = V::set1(mx[h]);
    F lsum = V::zero();
    for (int64_t j = 0; j < n; j += V::W) {
      const int valid = int(std::min<int64_t>(V::W, n - j));
      const F p = V::first(V::exp_neg(V::sub(V::load(sh + j), m)), valid);
      V::store(sh + j, p);
      lsum = V::add(lsum, p);
    }
    inv[h] = 1.0f / V::hsum(lsum);
  }
  if constexpr (HB == 1 && ValuePasses<V>::value) {  // a row does not fit beside one head's accumulators (NV + NV +
    // 1 > kRegs): one head and DV of its NV vectors a pass, each value vector widened where it is used. (Holding the
    // row as below spilled accumulators there, a store and a reload in every key's chain.) Every element's chain is
    // the one below, so the same bits.
    constexpr int DV = attend_dims_a_pass(NV, kRegs);
    for (int h = 0; h < G; ++h) {
      const float* pr = s + h * ls;
      const F iv = V::set1(inv[h]);
      for (int v0 = 0; v0 < NV; v0 += DV) {
        F o[DV];
        for (int v = 0; v < DV; ++v) o[v] = V::zero();
        for (int64_t j = 0; j < n; ++j) {
          const uint16_t* vv = vc + keys[j] * ld + V::W * v0;
          const F p = V::set1(pr[j]);
          for (int v = 0; v < DV; ++v) o[v] = V::fma(p, V::load_bf16(vv + V::W * v), o[v]);
        }
        for (int v = 0; v < DV; ++v) V::store_bf16(out + h * os + V::W * (v0 + v), V::mul(o[v], iv));
      }
    }
    return;
  }
  for (int h0 = 0; h0 < G; h0 += HB) {
    const int hb = std::min(HB, G - h0);
    const float* prow[HB];
    for (int i = 0; i < HB; ++i) prow[i] = s + (h0 + std::min(i, hb - 1)) * ls;  // (a short block repeats its last)
    F o[HB][NV];
    for (int i = 0; i < HB; ++i)
      for (int v = 0; v < NV; ++v) o[i][v] = V::zero();
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vv = vc + keys[j] * ld;
      F vr[NV];
      for (int v = 0; v < NV; ++v) vr[v] = V::load_bf16(vv + V::W * v);
      for (int i = 0; i < HB; ++i) {
        const F p = V::set1(prow[i][j]);
        for (int v = 0; v < NV; ++v) o[i][v] = V::fma(p, vr[v], o[i][v]);
      }
    }
    for (int i = 0; i < hb; ++i) {
      const F iv = V::set1(inv[h0 + i]);
      for (int v = 0; v < NV; ++v) V::store_bf16(out + (h0 + i) * os + V::W * v, V::mul(o[i][v], iv));
    }
  }
}

template <class V>
using AttendFn = void (*)(const uint16_t*, int64_t, int, const uint16_t*, const uint16_t*, int64_t, const int64_t*,
                          int64_t, float, float*, uint16_t*, int64_t);

template <class V>
AttendFn<V> attend_for(int64_t head_dim) {
  switch (head_dim / 16) {
    case 1: return attend_group<V, 1>;
    case 2: return attend_group<V, 2>;
    case 3: return attend_group<V, 3>;
    case 4: return attend_group<V, 4>;
    case 5: return attend_group<V, 5>;
    case 6: return attend_group<V, 6>;
    case 7: return attend_group<V, 7>;
    case 8: return attend_group<V, 8>;
    case 9: return attend_group<V, 9>;
    case 10: return attend_group<V, 10>;
    case 11: return attend_group<V, 11>;
    case 12: return attend_group<V, 12>;
    case 13: return attend_group<V, 13>;
    case 14: return attend_group<V, 14>;
    case 15: return attend_group<V, 15>;
    case 16: return attend_group<V, 16>;
    default: return nullptr;
  }
}

// Tree attention, batch-invariant.
//   q [T, H, D] bf16; k_cache, v_cache [KVH, S, D] bf16 (slot-major rows, contiguous D);
//   prefix: committed length L0 (keys at slots 0..L0-1 hold positions 0..L0-1);
//   ancestors [T, N] bool: node t attends to tree node j (at slot L0 + j, position L0 + depth of j) when
//     ancestors[t][j]; nodes are in depth order, so ascending j is ascending position;
//   positions [T] int64 (L0 + depth); window: keys at positions <= position - window are not seen (0 = none).
// The constructor checks the arguments (throws c10::Error); unit(u) computes query token u / KVH's heads of KV head
// u % KVH into out [T, H, D] bf16 and throws nothing, so units can run inside an OpenMP region.
template <class T>
struct TreeAttention {
  using V = typename T::V;
  at::Tensor pos_c;
  AttendFn<V> fn;
  const uint16_t *qp, *kp, *vp;
  const bool* ap;
  const int64_t* pp;
  uint16_t* op;
  int64_t Tq, H, D, KVH, Nt, prefix, window, group, ld, lh, qs0, qs1, as0;
  float sc;

  TreeAttention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t prefix_,
                const at::Tensor& ancestors, const at::Tensor& positions, int64_t window_, double scale,
                at::Tensor& out) {
    check_bf16(q, "q");
    check_bf16(k_cache, "k_cache");
    check_bf16(v_cache, "v_cache");
    check_cpu(ancestors, "ancestors");
    check_cpu(positions, "positions");
    TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "subspec: q must be [T, H, D] bf16");
    TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.stride(2) == 1 &&
                    v_cache.stride(2) == 1 && k_cache.stride(1) == v_cache.stride(1) &&
                    k_cache.stride(0) == v_cache.stride(0),
                "subspec: k/v cache must be [KVH, S, D] bf16 with equal strides");
    Tq = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0);
    const int64_t S = k_cache.size(1);
    TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0, "subspec: head dims do not match");
    TORCH_CHECK(ancestors.dim() == 2 && ancestors.size(0) == Tq && ancestors.scalar_type() == at::kBool &&
                    ancestors.stride(1) == 1,
                "subspec: ancestors must be [T, N] bool");
    TORCH_CHECK(positions.numel() == Tq && positions.scalar_type() == at::kLong,
                "subspec: positions must be [T] int64");
    TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == at::kBFloat16,
                "subspec: the attention output must be a contiguous [T, H, D] bf16 tensor");
    pos_c = positions.contiguous();
    Nt = ancestors.size(1), prefix = prefix_, window = window_;
    TORCH_CHECK(prefix >= 0 && prefix + Nt <= S, "subspec: the tree does not fit the cache");
    fn = attend_for<V>(D);
    TORCH_CHECK(fn != nullptr && D % 16 == 0, "subspec: head_dim ", D, " is not supported");
    qp = bf16_ptr(q), kp = bf16_ptr(k_cache), vp = bf16_ptr(v_cache);
    ap = ancestors.data_ptr<bool>();
    pp = pos_c.data_ptr<int64_t>();
    op = bf16_ptr_mut(out);
    group = H / KVH, ld = k_cache.stride(1), lh = k_cache.stride(0);
    qs0 = q.stride(0), qs1 = q.stride(1), as0 = ancestors.stride(0);
    sc = static_cast<float>(scale);
    TORCH_CHECK(group <= 16, "subspec: at most 16 query heads per KV head (got ", group, ")");
  }

  int64_t units() const { return Tq * KVH; }

  void unit(int64_t u) const noexcept {
    thread_local std::vector<int64_t> keys;  // scratch of this thread, grown as needed, never cleared
    thread_local std::vector<float> s;
    if (keys.size() < size_t(prefix + Nt)) keys.resize(size_t(prefix + Nt));
    if (s.size() < size_t(group * (prefix + Nt + V::W))) s.resize(size_t(group * (prefix + Nt + V::W)));
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
    fn(qp + t * qs0 + kvh * group * qs1, qs1, int(group), kp + kvh * lh, vp + kvh * lh, ld, keys.data(), n, sc,
       s.data(), op + (t * H + kvh * group) * D, D);
  }
};

// Returns o [T, H, D] bf16 (see TreeAttention).
template <class T>
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t prefix,
                          const at::Tensor& ancestors, const at::Tensor& positions, int64_t window, double scale) {
  at::Tensor out = at::empty(q.sizes(), q.options());  // (q is checked by TreeAttention)
  const TreeAttention<T> att(q, k_cache, v_cache, prefix, ancestors, positions, window, scale, out);
  parallel_tasks(att.units(), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) att.unit(u);
  });
  return out;
}

// ---- fused element-wise operators of a decoder layer (BF16) -----------------------------------------------------
// Each replaces several torch operators (and their dispatch, which dominates small models' draft steps) with one
// pass, rounding to bf16 where the torch composition it replaces rounds.

// RMSNorm (Zhang & Sennrich 2019) over the last dim n of x [..., n] bf16: r = 1 / sqrt(mean(x^2) + eps) in fp32;
// float32_gain: y = bf16(x * r * gain) with gain fp32 [n] (Gemma), else y = bf16(gain * bf16(x * r)) with gain bf16
// [n] (Llama's order).
// One row: y [n] from x [n] (gf: the fp32 gain, or gb: the bf16 gain).
template <class V>
inline void rms_norm_row(const uint16_t* xr, uint16_t* yr, int64_t n, const float* gf, const uint16_t* gb, float e) {
  using F = typename V::F;
  F acc = V::zero();
  for (int64_t j = 0; j < n; j += V::W) {
    const F v = V::load_bf16(xr + j);
    acc = V::fma(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(V::hsum(acc) / static_cast<float>(n) + e);
  const F iv = V::set1(inv);
  for (int64_t j = 0; j < n; j += V::W) {
    F v = V::mul(V::load_bf16(xr + j), iv);
    if (gf != nullptr)
      v = V::mul(v, V::load(gf + j));
    else  // round the normalized input to bf16 first, then multiply by the bf16 gain
      v = V::mul(V::round_bf16(v), V::load_bf16(gb + j));
    V::store_bf16(yr + j, v);
  }
}

inline void check_rms_gain(const at::Tensor& gain, int64_t n, bool float32_gain) {
  check_cpu(gain, "gain");
  TORCH_CHECK(n % 16 == 0 && gain.numel() == n && gain.is_contiguous(),
              "subspec: rms_norm needs n % 16 == 0, gain [n]");
  TORCH_CHECK(gain.scalar_type() == (float32_gain ? at::kFloat : at::kBFloat16), "subspec: rms_norm gain dtype");
}

template <class T>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& gain, double eps, bool float32_gain) {
  using V = typename T::V;
  check_bf16(x, "x");
  TORCH_CHECK(x.is_contiguous(), "subspec: rms_norm takes contiguous bf16 x");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  check_rms_gain(gain, n, float32_gain);
  at::Tensor y = at::empty_like(x);
  const uint16_t* xp = bf16_ptr(x);
  uint16_t* yp = bf16_ptr_mut(y);
  const float* gf = float32_gain ? gain.data_ptr<float>() : nullptr;
  const uint16_t* gb = float32_gain ? nullptr : bf16_ptr(gain);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row<V>(xp + r * n, yp + r * n, n, gf, gb, e);
  });
  return y;
}

// Rotate-half RoPE (Su et al. 2021) of x [T, heads, D] bf16 with cos, sin [T, 1, D] bf16:
// y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = [-x[D/2:], x[:D/2]] (torch's rounding).
// One head's row: xr, c, s, yr [D].
inline void rope_row(const uint16_t* xr, const uint16_t* c, const uint16_t* s, uint16_t* yr, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < D; ++j) {
    const float xv = bf16_to_float(xr[j]);
    const float rv = j < half ? -bf16_to_float(xr[j + half]) : bf16_to_float(xr[j - half]);
    const float a = bf16_round(xv * bf16_to_float(c[j]));
    const float b = bf16_round(rv * bf16_to_float(s[j]));
    yr[j] = to_bf16(a + b);
  }
}

inline at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "subspec: rope takes x [T, H, D] bf16");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D && cos.is_contiguous() && sin.is_contiguous(),
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
      rope_row(xp + t * s0 + h * s1, cp + t * D, sp + t * D, yp + u * D, D);
    }
  });
  return y;
}

// SwiGLU's gate (Shazeer 2020): y = bf16(bf16(silu(g)) * u) for g, u [T, I] bf16 (torch's rounding of
// F.silu(g) * u); silu(v) = v / (1 + exp(-v)) in fp32. Rows of g and u are ld_in apart, rows of y ld_out apart.
template <class V>
inline void silu_mul_blocks(const uint16_t* gp, const uint16_t* up, int64_t ld_in, int64_t I, uint16_t* yp,
                            int64_t ld_out, int64_t b0, int64_t b1) {  // blocks b0..b1 of V::W elements
  using F = typename V::F;
  const int64_t per_row = I / V::W;
  const F one = V::set1(1.0f);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t t = b / per_row, j = (b % per_row) * V::W;
    const F v = V::load_bf16(gp + t * ld_in + j);
    const F e = V::exp_any(V::sub(V::zero(), v));
    const F sv = V::round_bf16(V::div(v, V::add(one, e)));
    V::store_bf16(yp + t * ld_out + j, V::mul(sv, V::load_bf16(up + t * ld_in + j)));
  }
}

template <class V>
void silu_mul_rows(const uint16_t* gp, const uint16_t* up, int64_t ld_in, int64_t T, int64_t I, uint16_t* yp,
                   int64_t ld_out) {
  at::parallel_for(0, T * (I / V::W), 4096, [&](int64_t b0, int64_t b1) {
    silu_mul_blocks<V>(gp, up, ld_in, I, yp, ld_out, b0, b1);
  });
}

template <class T>
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  check_bf16(g, "g");
  check_bf16(u, "u");
  TORCH_CHECK(g.is_contiguous() && u.is_contiguous() && g.sizes() == u.sizes() && g.numel() % 16 == 0,
              "subspec: silu_mul takes two contiguous bf16 tensors of one shape (numel % 16 == 0)");
  at::Tensor y = at::empty_like(g);
  silu_mul_rows<typename T::V>(bf16_ptr(g), bf16_ptr(u), 0, 1, g.numel(), bf16_ptr_mut(y), 0);
  return y;
}

// ---- the draft tree's expansion: each row's k largest logits and its log-sum-exp, in two passes ------------------
// Offer (v, i) to the k best so far (top[0..have) descending, their ids in index): offered in id order, an equal
// value stays behind the earlier ones (and out when the list is full).
inline void keep_top_k(float* top, int64_t* index, int64_t& have, int64_t k, float v, int64_t i) {
  if (have == k && !(v > top[k - 1])) return;
  int64_t p = have < k ? have++ : k - 1;
  for (; p > 0 && v > top[p - 1]; --p) {
    top[p] = top[p - 1];
    index[p] = index[p - 1];
  }
  top[p] = v;
  index[p] = i;
}

// For logits [R, n] (bf16 or fp32) and t = inv_temperature: top [R, k] fp32 (the k largest logits, descending; equal
// values in column order), index [R, k] int64 (their columns), lse [R] fp32 = m t + log(sum_j exp(max((x_j - m) t,
// -87.3))) with m the row's maximum (the clamp: terms below e^-87 change no fp32 sum that holds the term 1, and
// would be denormals, ~100x slower). Pass 1 takes the maximum of each 64-column block; the k largest columns lie in
// the blocks whose maxima are among the k largest (a block holding one of them has a maximum at least that large,
// and fewer than k other blocks can have a larger one), which are then scanned. Pass 2 sums the exponentials.
template <class V, class E>
inline void top_k_lse_row(const E* x, int64_t n, int64_t k, float t, float* top, int64_t* index, float* lse,
                          std::vector<float>& bmax) {
  using F = typename V::F;
  constexpr int64_t B = 64;
  static_assert(B % V::W == 0, "a block is whole vectors");
  auto load = [](const E* p) {
    if constexpr (std::is_same<E, float>::value) return V::load(p); else return V::load_bf16(p);
  };
  auto at = [x](int64_t j) -> float {
    if constexpr (std::is_same<E, float>::value) return x[j]; else return bf16_to_float(x[j]);
  };
  const int64_t nb = (n + B - 1) / B, full = n / B;
  bmax.resize(size_t(nb));
  for (int64_t b = 0; b < full; ++b) {
    F mv = load(x + b * B);
    for (int64_t j = V::W; j < B; j += V::W) mv = V::max(mv, load(x + b * B + j));
    bmax[size_t(b)] = V::hmax(mv);
  }
  if (full < nb) {
    float mv = -INFINITY;
    for (int64_t j = full * B; j < n; ++j) mv = std::max(mv, at(j));
    bmax[size_t(full)] = mv;
  }
  float m = -INFINITY;
  for (float v : bmax) m = std::max(m, v);
  std::vector<float> order(bmax);  // the k-th largest block maximum: the blocks to scan have one at least as large
  const int64_t kk = std::min(k, nb);
  std::nth_element(order.begin(), order.begin() + (kk - 1), order.end(), std::greater<float>());
  const float least = order[size_t(kk - 1)];
  int64_t have = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (!(bmax[size_t(b)] >= least)) continue;
    for (int64_t j = b * B; j < std::min(n, (b + 1) * B); ++j) {
      keep_top_k(top, index, have, k, at(j), j);
    }
  }
  const F mv = V::set1(m), tv = V::set1(t);
  F acc = V::zero();
  for (int64_t j = 0; j < full * B; j += V::W) acc = V::add(acc, V::exp_neg(V::mul(V::sub(load(x + j), mv), tv)));
  float sum = V::hsum(acc);
  for (int64_t j = full * B; j < n; ++j) sum += std::exp(std::max((at(j) - m) * t, -87.3f));
  *lse = m * t + std::log(sum);
}

// The draft tree's next frontier: the k best (row, column) pairs of logits [R, n] (bf16 or fp32) by cumulative
// log-probability scores[r] + x[r][c] t - lse[r] (scores [R] fp32), among each row's k largest (top_k_lse_row).
// Returns (values [k] fp32, descending, equal values in (row, column) order; flat indices [k] int64: r n + c).
template <class T>
std::tuple<at::Tensor, at::Tensor> expand_topk(const at::Tensor& logits, const at::Tensor& scores, int64_t k,
                                               double inv_t) {
  check_cpu(logits, "logits");
  check_cpu(scores, "scores");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat),
              "subspec: expand_topk takes contiguous [R, n] bf16 or fp32 logits");
  const int64_t R = logits.size(0), n = logits.size(1);
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == R && scores.scalar_type() == at::kFloat,
              "subspec: expand_topk takes [R] fp32 scores");
  TORCH_CHECK(k >= 1 && k <= n, "subspec: expand_topk needs 1 <= k <= the logits' columns");
  std::vector<float> top(static_cast<size_t>(R * k)), lse(static_cast<size_t>(R));
  std::vector<int64_t> col(static_cast<size_t>(R * k));
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const float t = float(inv_t);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> bmax;
    for (int64_t r = r0; r < r1; ++r) {
      float* tp = top.data() + r * k;
      int64_t* cp = col.data() + r * k;
      if (bf16)
        top_k_lse_row<typename T::V>(bf16_ptr(logits) + r * n, n, k, t, tp, cp, &lse[size_t(r)], bmax);
      else
        top_k_lse_row<typename T::V>(logits.data_ptr<float>() + r * n, n, k, t, tp, cp, &lse[size_t(r)], bmax);
    }
  });
  const at::Tensor sc = scores.contiguous();
  const float* sp = sc.data_ptr<float>();
  at::Tensor vals = at::empty({k}, scores.options()), flat = at::empty({k}, scores.options().dtype(at::kLong));
  float* vp = vals.data_ptr<float>();
  int64_t* fp = flat.data_ptr<int64_t>();
  int64_t have = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < k; ++j)  // in (row, column) order
      keep_top_k(vp, fp, have, k, top[size_t(r * k + j)] * t - lse[size_t(r)] + sp[r], r * n + col[size_t(r * k + j)]);
  return {vals, flat};
}

// ---- decoder layers of the draft on 4-bit substitutes, fused ----------------------------------------------------
// The same operators, in the same order and with the same rounding, as Decoder.layer_forward with the fused
// element-wise operators (so the same bits): RMSNorm, q/k/v as one linear_w4 over their concatenated codes (each
// output element's arithmetic is its own: concatenating changes no bit), RoPE of q and k, K/V written at ``slots``,
// tree attention, o_proj, residual add, RMSNorm, gate/up as one linear_w4, SwiGLU, down_proj, residual add.
// One call for a run of layers (a whole draft step's, where every layer has its substitute in memory) instead of
// about twenty operators and their Python per layer, and one OpenMP region for all of it: the phases are separated by
// barriers instead of a fork and join per operator, and no Python runs between layers (a small model's draft step
// was dispatch and thread wake-ups: on SmolLM2-135M 0.36 ms a layer for 0.11 ms of code bytes).
//   h [T, hidden] bf16; per layer l of ``layers`` (cache layers, ascending; a layer the draft skips is left out):
//   w[16 l .. 16 l + 15]: for qkv, o, gate_up, down: codes, scale, shift (pack_w4 layout) and an fp32 bias (numel 0:
//   none), every layer of the same shapes; attn_in[l], mlp_in[l]: gains [hidden] (bf16; fp32 with float32_gain);
//   windows[l]: its sliding window (0: none). cos, sin [T, 1, D] bf16 (one RoPE table for the run); kv: the cache
//   [n_layers, 2, KVH, S, D] bf16 (KVCache.buf), written at ``slots`` [T] int64 of each layer run; prefix, ancestors,
//   positions, attn_scale: tree_attention's. Returns the last layer's output [T, hidden].
// Every argument is checked before the region (c10::Error, one line); an error raised inside it (an engine's
// allocation) is carried out of it and rethrown.
#ifdef SUBSPEC_PHASES  // (a tuning build: thread 0's seconds per phase of layers_w4, printed at exit)
struct PhaseClock {
  double t[9] = {0};
  long n = 0;
  ~PhaseClock() {
    const char* names[] = {"norm", "qkv", "rope+attn", "o", "add+norm", "gate_up", "silu", "down", "add"};
    std::fprintf(stderr, "layers_w4 phases (us a layer, %ld layers):", n);
    for (int i = 0; i < 9; ++i) std::fprintf(stderr, " %s %.1f", names[i], 1e6 * t[i] / std::max(1L, n));
    std::fprintf(stderr, "\n");
  }
};
inline PhaseClock g_phases;
#define PHASE_START() \
  double phase_t0 = omp_get_wtime(); \
  if (omp_get_thread_num() == 0) ++g_phases.n
#define PHASE(i) \
  if (omp_get_thread_num() == 0) { \
    const double now = omp_get_wtime(); \
    g_phases.t[i] += now - phase_t0; \
    phase_t0 = now; \
  }
#else
#define PHASE_START()
#define PHASE(i)
#endif

template <class T>
at::Tensor layers_w4(const at::Tensor& h, at::TensorList w, int64_t group, at::TensorList attn_in,
                     at::TensorList mlp_in, double eps, bool float32_gain, int64_t n_heads, int64_t kv_heads,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv, at::IntArrayRef layers,
                     const at::Tensor& slots, int64_t prefix, const at::Tensor& ancestors, const at::Tensor& positions,
                     at::IntArrayRef windows, double attn_scale) {
  using V = typename T::V;
  using Gemm = typename T::W4Gemm;
  const int64_t L = int64_t(layers.size());
  TORCH_CHECK(L >= 1 && int64_t(w.size()) == 16 * L && int64_t(attn_in.size()) == L &&
                  int64_t(mlp_in.size()) == L && int64_t(windows.size()) == L,
              "subspec: layers_w4 takes, for each of its layers, 16 weight tensors (codes, scale, shift, bias x 4), "
              "two gains and a window");
  check_bf16(h, "h");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "subspec: h must be [T, hidden] bf16");
  check_bf16(kv, "kv");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(2) == kv_heads && kv.stride(4) == 1,
              "subspec: layers_w4: kv must be the cache [n_layers, 2, kv_heads, S, head_dim]");
  const int64_t Tn = h.size(0), Hd = h.size(1), D = kv.size(4), S = kv.size(3), qn = n_heads * D, kn = kv_heads * D;
  W4Shape sh[4];
  std::vector<at::Tensor> bias(4 * L);
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(layers[l] >= 0 && layers[l] < kv.size(0) && (l == 0 || layers[l] > layers[l - 1]),
                "subspec: layers_w4: layers must be ascending cache layers");
    for (int i = 0; i < 4; ++i) {
      const at::Tensor* p = &w[16 * l + 4 * i];
      const W4Shape s = w4_shape(p[0], p[1], p[2], group);
      if (l == 0) sh[i] = s;
      TORCH_CHECK(s.N == sh[i].N && s.K == sh[i].K, "subspec: layers_w4: every layer must have the same shapes");
      if (p[3].numel()) {
        check_cpu(p[3], "bias");
        TORCH_CHECK(p[3].numel() == s.N && p[3].is_contiguous(), "subspec: layers_w4: bias [N]");
        bias[4 * l + i] = p[3];
      }
    }
    check_rms_gain(attn_in[l], Hd, float32_gain);
    check_rms_gain(mlp_in[l], Hd, float32_gain);
  }
  const int64_t I = sh[2].N / 2;
  TORCH_CHECK(sh[0].N == qn + 2 * kn && sh[0].K == Hd, "subspec: layers_w4: q/k/v widths do not match the heads");
  TORCH_CHECK(sh[1].N == Hd && sh[1].K == qn, "subspec: layers_w4: o_proj must be [hidden, heads x head_dim]");
  TORCH_CHECK(I % 16 == 0, "subspec: layers_w4: the intermediate size must be a multiple of 16");
  TORCH_CHECK(sh[2].K == Hd && sh[3].N == Hd && sh[3].K == I, "subspec: layers_w4: the MLP shapes do not match");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(D % 2 == 0 && cos.numel() == Tn * D && sin.numel() == Tn * D && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "subspec: rope takes cos, sin [T, 1, D] bf16");
  check_cpu(slots, "slots");
  TORCH_CHECK(slots.numel() == Tn && slots.scalar_type() == at::kLong, "subspec: slots must be [T] int64");
  const at::Tensor slots_c = slots.contiguous();
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < Tn; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "subspec: layers_w4: slot ", sp[t], " is outside the cache");

  const auto opt = h.options();
  at::Tensor xn = at::empty({Tn, Hd}, opt), qkv = at::empty({Tn, sh[0].N}, opt), q = at::empty({Tn, n_heads, D}, opt);
  at::Tensor o = at::empty({Tn, n_heads, D}, opt), a = at::empty({Tn, Hd}, opt), h2 = at::empty({Tn, Hd}, opt);
  at::Tensor gu = at::empty({Tn, 2 * I}, opt), m = at::empty({Tn, I}, opt);
  at::Tensor outs[2] = {at::empty({Tn, Hd}, opt), at::empty({Tn, Hd}, opt)};
  const TreeAttention<T> att(q, kv[layers[0]][0], kv[layers[0]][1], prefix, ancestors, positions, windows[0],
                            attn_scale, o);
  std::vector<TreeAttention<T>> atts(size_t(L), att);  // each layer's: the same but for its cache and window
  for (int64_t l = 0; l < L; ++l) {
    atts[l].kp = bf16_ptr(kv) + layers[l] * kv.stride(0);
    atts[l].vp = atts[l].kp + kv.stride(1);
    atts[l].window = windows[l];
  }
  int64_t maxK = 0, maxG = 0;
  for (const W4Shape& x : sh) maxK = std::max(maxK, x.K), maxG = std::max(maxG, x.G);
  W4Scratch scratch(Tn * maxK, 2 * Tn * maxG, opt);
  const at::Tensor o2 = o.view({Tn, qn});
  const float e = static_cast<float>(eps);
  auto gains = [&](const at::Tensor& g) {
    return std::make_pair(float32_gain ? g.data_ptr<float>() : nullptr, float32_gain ? nullptr : bf16_ptr(g));
  };
  const uint16_t *cp = bf16_ptr(cos), *snp = bf16_ptr(sin);
  uint16_t *xp = bf16_ptr_mut(xn), *qkvp = bf16_ptr_mut(qkv), *qp = bf16_ptr_mut(q), *ap = bf16_ptr_mut(a);
  uint16_t *h2p = bf16_ptr_mut(h2), *gup = bf16_ptr_mut(gu), *mp = bf16_ptr_mut(m), *kvp = bf16_ptr_mut(kv);
  const int64_t ld = kv.stride(3), lh = kv.stride(2), lkv = kv.stride(1), ll = kv.stride(0), Nq = sh[0].N;
  const int64_t heads = n_heads + kv_heads, blocks = Tn * (I / V::W);

  auto add_row = [Hd](const uint16_t* x, const uint16_t* y, uint16_t* out) {  // torch's bf16 add: fp32, then RNE
    for (int64_t j = 0; j < Hd; j += V::W) V::store_bf16(out + j, V::add(V::load_bf16(x + j), V::load_bf16(y + j)));
  };
  c10::optional<Gemm> gemm[4];
  std::exception_ptr error;
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();  // (asked here: see parallel_range)
  RangeTasks tasks(threads);
  // a linear: its engine made (x quantized) by one thread, then its tasks shared out (RangeTasks: each thread streams
  // its own part of the weights, in 8 chunks, and helps with the others' once done)
  auto linear = [&](int64_t l, int i, const at::Tensor& x, at::Tensor& y) {
#pragma omp single
    {
      try {
        if (!error) {
          gemm[i].emplace(x, w[16 * l + 4 * i], w[16 * l + 4 * i + 1], w[16 * l + 4 * i + 2], sh[i], bias[4 * l + i],
                          y, &scratch);  // (the one before it is done: a barrier)
          tasks.reset(gemm[i]->tasks(), dynamic_grain(gemm[i]->tasks(), threads));
        }
      } catch (...) {
        error = std::current_exception();
      }
    }  // (barrier)
    if (error) return;
    const Gemm& g = *gemm[i];
    tasks.run(omp_get_thread_num(), omp_get_num_threads(), [&g](int64_t t0, int64_t t1) { g.run(t0, t1); });
#pragma omp barrier
  };
  auto layer = [&](int64_t l) {  // every thread of the region runs this; the loops share the work out
    const uint16_t* hp = l == 0 ? bf16_ptr(h) : bf16_ptr(outs[(l - 1) & 1]);
    uint16_t* outp = bf16_ptr_mut(outs[l & 1]);
    const auto g_attn = gains(attn_in[l]), g_mlp = gains(mlp_in[l]);
    uint16_t* kc = kvp + layers[l] * ll;
    uint16_t* vc = kc + lkv;
    PHASE_START();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < Tn; ++r) rms_norm_row<V>(hp + r * Hd, xp + r * Hd, Hd, g_attn.first, g_attn.second, e);
    PHASE(0);
    linear(l, 0, xn, qkv);
    PHASE(1);
    if (error) return;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < Tn * heads; ++u) {  // RoPE of q; RoPE of k and v, written into the cache at their slots
      const int64_t t = u / heads, j = u % heads;
      const uint16_t* row = qkvp + t * Nq;
      if (j < n_heads) {
        rope_row(row + j * D, cp + t * D, snp + t * D, qp + (t * n_heads + j) * D, D);
      } else {
        const int64_t kvh = j - n_heads, at_slot = kvh * lh + sp[t] * ld;
        rope_row(row + qn + kvh * D, cp + t * D, snp + t * D, kc + at_slot, D);
        std::memcpy(vc + at_slot, row + qn + kn + kvh * D, size_t(D) * 2);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < atts[l].units(); ++u) atts[l].unit(u);
    PHASE(2);
    linear(l, 1, o2, a);
    PHASE(3);
    if (error) return;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < Tn; ++r) {  // h2 = h + attention, then the MLP's norm
      add_row(hp + r * Hd, ap + r * Hd, h2p + r * Hd);
      rms_norm_row<V>(h2p + r * Hd, xp + r * Hd, Hd, g_mlp.first, g_mlp.second, e);
    }
    PHASE(4);
    linear(l, 2, xn, gu);
    PHASE(5);
    if (error) return;
    const int64_t grain = std::max<int64_t>(1, blocks / (4 * omp_get_num_threads()));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b += grain)
      silu_mul_blocks<V>(gup, gup + I, 2 * I, I, mp, I, b, std::min(blocks, b + grain));
    PHASE(6);
    linear(l, 3, m, a);
    PHASE(7);
    if (error) return;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < Tn; ++r) add_row(h2p + r * Hd, ap + r * Hd, outp + r * Hd);
    PHASE(8);
  };
#pragma omp parallel num_threads(threads)
  for (int64_t l = 0; l < L && !error; ++l) layer(l);  // (error is read after a barrier: every thread stops alike)
  if (error) std::rethrow_exception(error);
  return outs[(L - 1) & 1];
}

// ---- the codec's decoder (format: common.h) ----------------------------------------------------------------------
// A block's escapes (n of them, at esc) where its decoder may read kEscapeSlack bytes past the last one: in place when
// the stream goes on that far (every block but a stream's last: the next block's 16 K bytes follow), else copied to
// ``pad`` with the slack after them. The count comes from the block offsets, so nothing is scanned twice.
inline const uint16_t* readable_escapes(const uint8_t* esc, int64_t n, const uint8_t* stream_end,
                                        std::vector<uint16_t>& pad) {
  if (esc + 2 * n + kEscapeSlack <= stream_end) return reinterpret_cast<const uint16_t*>(esc);
  pad.resize(size_t(n + kEscapeSlack / 2));
  std::memcpy(pad.data(), esc, size_t(2 * n));
  return pad.data();
}

// The stream (src, as written by w4_delta_encode) -> out [N, K] bf16. src and out may share a buffer (a staging slot
// read with the stream at its end and decoded in place): a block whose input the output would overwrite is copied
// aside first; the output of a block must not reach a later block's input. Returns the bytes of src consumed.
template <class T>
int64_t w4_delta_decode(const at::Tensor& src, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& shift, int64_t group, at::Tensor out) {
  const W4Shape s = w4_shape(codes, scale, shift, group);
  check_cpu(src, "src");
  check_bf16(out, "out");
  TORCH_CHECK(src.dim() == 1 && src.scalar_type() == at::kByte && src.is_contiguous(),
              "subspec: the delta stream must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == s.N && out.size(1) == s.K,
              "subspec: out must be a contiguous [N, K] bf16 tensor matching the codes");
  const uint8_t* in = src.data_ptr<uint8_t>();
  const uint8_t* in_end = in + src.numel();
  uint8_t* ob = reinterpret_cast<uint8_t*>(out.data_ptr());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = bf16_ptr(scale);
  const uint16_t* hp = bf16_ptr(shift);
  const int64_t block_d = kNBlock * s.K, block_out = 2 * kNBlock * s.K;
  std::vector<uint8_t> aside;
  std::vector<uint16_t> pad;
  for (int64_t nb = 0; nb < s.N / kNBlock; ++nb) {
    TORCH_CHECK(in + block_d <= in_end, "subspec: the delta stream ended early (damaged layer file?)");
    const uint8_t* d = in;
    const int64_t n_esc = T::count_escapes(d, block_d);
    const int64_t block_in = block_d + 2 * n_esc;
    TORCH_CHECK(in + block_in <= in_end, "subspec: the delta stream ended early (damaged layer file?)");
    uint8_t* o0 = ob + nb * block_out;
    TORCH_CHECK(!(in + block_in < in_end && o0 + block_out > in + block_in && o0 < in_end),
                "subspec: decoding in place would overwrite input not yet read");
    const uint16_t* esc;
    if (o0 < in + block_in && in < o0 + block_out) {  // in place, over its own input: decode from a padded copy
      aside.assign(in, in + block_in);
      aside.resize(size_t(block_in + kEscapeSlack));
      d = aside.data();
      esc = reinterpret_cast<const uint16_t*>(d + block_d);
    } else {
      esc = readable_escapes(d + block_d, n_esc, in_end, pad);
    }
    T::decode_block(s, cp + nb * s.Kb * s.chunks * 64, sp + nb * s.G * kNBlock, hp + nb * s.G * kNBlock,
                    reinterpret_cast<const int8_t*>(d), esc, reinterpret_cast<uint16_t*>(o0));
    in += block_in;
  }
  return int64_t(in - src.data_ptr<uint8_t>());
}

// ---- a coded layer's linear, decoded block by block as it multiplies -------------------------------------------
// The index of a weight's stream (format: common.h): the byte offset of each 16-row block, [N/16 + 1] int64, the last
// one the stream's length. A block is its 16 K bytes of differences then 2 bytes per escape among them, so the
// offsets are a running count of escapes. Raises when the stream is shorter than its blocks (a damaged file).
template <class T>
at::Tensor w4_delta_index(const at::Tensor& stream, int64_t N, int64_t K) {
  check_cpu(stream, "stream");
  TORCH_CHECK(stream.dim() == 1 && stream.scalar_type() == at::kByte && stream.is_contiguous(),
              "subspec: the delta stream must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(N > 0 && N % kNBlock == 0 && K > 0, "subspec: w4_delta_index needs N a multiple of 16 and K > 0");
  const int64_t Nb = N / kNBlock, block_d = kNBlock * K, n = stream.numel();
  at::Tensor offsets = at::empty({Nb + 1}, stream.options().dtype(at::kLong));
  int64_t* off = offsets.data_ptr<int64_t>();
  const uint8_t* d = stream.data_ptr<uint8_t>();
  int64_t at = 0;
  for (int64_t nb = 0; nb < Nb; ++nb) {
    off[nb] = at;
    TORCH_CHECK(at + block_d <= n, "subspec: the delta stream ended early (damaged layer file?)");
    at += block_d + 2 * T::count_escapes(d + at, block_d);
    TORCH_CHECK(at <= n, "subspec: the delta stream ended early (damaged layer file?)");
  }
  off[Nb] = at;
  return offsets;
}

// y [M, N] = x [M, K] @ w^T (+ bias) where w is given as its stream coded against the 4-bit substitute (codes, scale,
// shift, group) with the stream's block offsets (w4_delta_index). Each task decodes its n-blocks into a buffer of
// its own (16 rows x K each: in L2) and runs the tier's BF16 linear over them (Bf16Gemm::run_cols), so every output
// element gets exactly the bits linear_bf16 gives it over the decoded weight, whatever M (batch-invariant), and the
// layer is never written out whole: per weight about 1.7 bytes are read (the stream and the codes) instead of a
// decoded copy's 2 written then 2 read.
template <class T>
at::Tensor linear_coded(const at::Tensor& x, const at::Tensor& stream, const at::Tensor& offsets,
                        const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& shift, int64_t group,
                        const c10::optional<at::Tensor>& bias) {
  const W4Shape s = w4_shape(codes, scale, shift, group);
  check_linear_args(x, s.N, s.K, bias);
  check_cpu(stream, "stream");
  check_cpu(offsets, "offsets");
  const int64_t Nb = s.N / kNBlock, block_d = kNBlock * s.K;
  TORCH_CHECK(stream.dim() == 1 && stream.scalar_type() == at::kByte && stream.is_contiguous(),
              "subspec: the delta stream must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.numel() == Nb + 1,
              "subspec: offsets must be the stream's [N/16 + 1] int64 block offsets (w4_delta_index)");
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t nb = 0; nb < Nb; ++nb)
    TORCH_CHECK(off[nb] >= 0 && off[nb] % 2 == 0 && off[nb + 1] >= off[nb] + block_d,
                "subspec: the block offsets do not describe a delta stream (w4_delta_index)");
  TORCH_CHECK(off[Nb] <= stream.numel(), "subspec: the delta stream ended early (damaged layer file?)");
  at::Tensor y = at::empty({x.size(0), s.N}, x.options());
  if (x.size(0) == 0) return y;
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  typename T::Bf16Gemm gemm(x, s.N, s.K, b, y);
  const int64_t per = gemm.blocks_per_task();
  const uint8_t* sp = stream.data_ptr<uint8_t>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* scp = bf16_ptr(scale);
  const uint16_t* hp = bf16_ptr(shift);
  const uint8_t* stream_end = sp + stream.numel();
  gemm.parallel([&](int64_t t0, int64_t t1) {
    thread_local std::vector<uint16_t> buf, pad;
    if (buf.size() < size_t(per * block_d)) buf.resize(size_t(per * block_d));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb0 = t * per, nb1 = std::min(Nb, nb0 + per);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const uint8_t* d = sp + off[nb];
        const uint16_t* esc = readable_escapes(d + block_d, (off[nb + 1] - off[nb] - block_d) / 2, stream_end, pad);
        T::decode_block(s, cp + nb * s.Kb * s.chunks * 64, scp + nb * s.G * kNBlock, hp + nb * s.G * kNBlock,
                        reinterpret_cast<const int8_t*>(d), esc, buf.data() + (nb - nb0) * block_d);
      }
      gemm.run_cols(buf.data(), nb0, nb1);
    }
  });
  return y;
}

inline int64_t count_escapes_scalar(const uint8_t* d, int64_t n) {
  int64_t c = 0;
  for (int64_t j = 0; j < n; ++j) c += d[j] == 0x80;
  return c;
}

// ---- HQQ quantization (data-free; Badri & Shaji 2023), one fused pass per optimizer iteration ----------------------
// The arithmetic of the hqq package's CPU path (``Quantizer.quantize``'s min-max start, then
// ``optimize_weights_proximal_legacy``, axis 1) for groups of `group` consecutive weights, with s the inverse scale:
//   start: s = top / (max - min) (1 where max - min <= 1e-4), at most 2e4; z = -min * s
//   each iteration: q = clamp(round(w s + z), 0, top); r = (q - z) / s; e = w - r;
//     err = mean |e| (over the chunk); e' = sign(e) max(|e| - |e|^(p-1) / beta, 0);
//     z = mean over the group of (q - (w - e') s); stop after an iteration whose err is not below the best so far
//   codes = clamp(round(w s + z), 0, top), scale = 1 / s, zero = z.
// Rows are taken in chunks of `chunk_rows` (the early stop is decided per chunk, as the Python path's row chunks do),
// chunks in parallel. One pass over a chunk per iteration instead of the package's ten tensor operators; the sums run
// in another order, so a code at an exact rounding tie may differ (the error is the same to well under 0.5 %).
// Returns (codes [N, K] uint8, scale [N, K/group] fp32, zero [N, K/group] fp32).
template <class T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> hqq_quantize(const at::Tensor& w, int64_t bits, int64_t group,
                                                            int64_t iters, int64_t chunk_rows, double lp_norm,
                                                            double beta) {
  using V = typename T::V;
  using F = typename V::F;
  check_cpu(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "subspec: hqq_quantize takes w [N, K] fp32");
  TORCH_CHECK(bits >= 1 && bits <= 8 && group > 0 && group % V::W == 0 && w.size(1) % group == 0 && chunk_rows > 0,
              "subspec: hqq_quantize needs 1..8 bits and a group (a multiple of ", V::W, ") dividing K");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), G = K / group;
  at::Tensor codes = at::empty({N, K}, wc.options().dtype(at::kByte));
  at::Tensor scale = at::empty({N, G}, wc.options());
  at::Tensor zero = at::empty({N, G}, wc.options());
  const float* wp = wc.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  float* zp = zero.data_ptr<float>();
  const float top = float((1 << bits) - 1), ib = float(1.0 / beta), pm1 = float(lp_norm - 1.0);
  const float inv_group = 1.0f / float(group);
  const int64_t chunks = (N + chunk_rows - 1) / chunk_rows;
  parallel_tasks(chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> z_new;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r0 = c * chunk_rows, r1 = std::min(N, r0 + chunk_rows), ng = (r1 - r0) * G;
      const float* wg0 = wp + r0 * K;
      float* s = sp + r0 * G;  // the inverse scale while optimizing
      float* z = zp + r0 * G;
      for (int64_t g = 0; g < ng; ++g) {  // min-max start
        const float* wg = wg0 + g * group;
        F lo = V::load(wg), hi = lo;
        for (int64_t k = V::W; k < group; k += V::W) {
          lo = V::min(lo, V::load(wg + k));
          hi = V::max(hi, V::load(wg + k));
        }
        const float mn = V::hmin(lo), denom = V::hmax(hi) - mn;
        const float inv = std::min(std::fabs(denom) <= 1e-4f ? 1.0f : top / denom, 2e4f);
        s[g] = inv;
        z[g] = -mn * inv;
      }
      z_new.resize(size_t(ng));
      double best = INFINITY;
      for (int64_t it = 0; it < iters; ++it) {
        double err = 0.0;
        for (int64_t g = 0; g < ng; ++g) {
          const float* wg = wg0 + g * group;
          const F sv = V::set1(s[g]), zv = V::set1(z[g]);
          F esum = V::zero(), zsum = V::zero();
          for (int64_t k = 0; k < group; k += V::W) {
            const F wv = V::load(wg + k);
            const F q = V::min(V::max(V::round(V::add(V::mul(wv, sv), zv)), V::zero()), V::set1(top));
            const F e = V::sub(wv, V::div(V::sub(q, zv), sv));
            const F a = V::abs(e);
            esum = V::add(esum, a);
            const F shrunk = V::max(V::sub(a, V::mul(V::set1(ib), V::exp_any(V::mul(V::set1(pm1), V::log(a))))),
                                    V::zero());
            const F signed_shrunk = V::copysign(shrunk, e);
            zsum = V::add(zsum, V::sub(q, V::mul(V::sub(wv, signed_shrunk), sv)));
          }
          err += double(V::hsum(esum));
          z_new[size_t(g)] = V::hsum(zsum) * inv_group;
        }
        std::memcpy(z, z_new.data(), sizeof(float) * size_t(ng));
        const double current = err / double(ng * group);
        if (current < best)
          best = current;
        else
          break;
      }
      for (int64_t g = 0; g < ng; ++g) {  // the codes at the final zero; the scale as stored
        const float* wg = wg0 + g * group;
        uint8_t* cg = cp + r0 * K + g * group;
        for (int64_t k = 0; k < group; ++k) {
          const float q = std::nearbyint(wg[k] * s[g] + z[g]);
          cg[k] = uint8_t(std::min(std::max(q, 0.0f), top));
        }
        s[g] = 1.0f / s[g];
      }
    }
  });
  return std::make_tuple(codes, scale, zero);
}

// ---- the 4-bit linear on integer dot products (every tier's) -------------------------------------------------------
// y[m][n] = sum_g ( s[n][g] * xs[m][g] * P[m][n][g] + z[n][g] * xs[m][g] * Q[m][g] ),
//   P[m][n][g] = sum_{k in g} c[n][k] q[m][k],  Q[m][g] = sum_{k in g} q[m][k],
// with the activations quantized per row and group to 8 bits, q = round(x / xs), xs = max|x| / 127 (symmetric, so
// q in [-127, 127]); P and Q are exact integers (the tier's micro-kernel T::w4_group computes P for up to 8 rows and
// one n-block, reading the codes once), the scales are applied per element in fp32 in group order. The 8-bit
// activations cost at most 1/254 of a group's largest value per element, far below the 4-bit weights' own error
// (a draft's guesses need accuracy, not exactness: the target decides every token). Every tier runs this engine.
template <class T>
struct DotW4Gemm {
  using V = typename T::V;
  using F = typename V::F;
  static constexpr int kMaxRows = T::kW4Rows;  // rows of x per pass over the codes (at most 8)
  static constexpr int64_t kPrefetchBytes = 4096;  // software prefetch distance in the code stream
  at::Tensor q8_, st_;
  const int8_t* q;
  const float *xs, *xq;
  const uint8_t* codes;
  const uint16_t *scale, *shift;
  W4Shape s;
  at::Tensor bias_;
  const float* bias;  // fp32 [N] or null
  uint16_t* y;
  int64_t M;

  DotW4Gemm(const at::Tensor& x, const at::Tensor& c, const at::Tensor& sc, const at::Tensor& sh, const W4Shape& shape,
            const at::Tensor& b, at::Tensor& out, W4Scratch* scratch = nullptr)
      : s(shape), bias_(bias_f32(b)), bias(bias_.defined() ? bias_.data_ptr<float>() : nullptr),
        y(bf16_ptr_mut(out)), M(x.size(0)) {
    if (!scratch || scratch->q8.numel() < M * s.K || scratch->st.numel() < 2 * M * s.G) {
      q8_ = at::empty({M, s.K}, x.options().dtype(at::kChar));
      st_ = at::empty({2 * M * s.G}, x.options().dtype(at::kFloat));
    }
    int8_t* qm = q8_.defined() ? q8_.data_ptr<int8_t>() : scratch->q8.data_ptr<int8_t>();
    float* xsm = st_.defined() ? st_.data_ptr<float>() : scratch->st.data_ptr<float>();
    const uint16_t* xp = bf16_ptr(x);
    const int64_t ldx = x.stride(0), G = s.G, group = s.group, K = s.K;
    parallel_range(M * G, 64, [&](int64_t u0, int64_t u1) {  // (inside layers_w4's region: by one thread)
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t m = u / G, g = u % G;
        const uint16_t* row = xp + m * ldx + g * group;
        F amax = V::zero();
        for (int64_t k = 0; k < group; k += V::W) amax = V::max(amax, V::abs(V::load_bf16(row + k)));
        const float top = V::hmax(amax);
        const float inv = top > 0 ? 127.0f / top : 0.0f;
        const int32_t sum = T::quantize_q8(row, group, inv, qm + m * K + g * group);
        const float step = top / 127.0f;
        xsm[m * G + g] = step;
        xsm[M * G + m * G + g] = step * float(sum);
      }
    });
    q = qm;
    xs = xsm;
    xq = xsm + M * G;
    codes = c.data_ptr<uint8_t>();
    scale = bf16_ptr(sc);
    shift = bf16_ptr(sh);
  }

  int64_t tasks() const { return s.N / kNBlock; }
  template <class Fn>
  void parallel(const Fn& fn) const { parallel_tasks(tasks(), dynamic_grain(tasks()), fn); }

  template <int MR>
  void block(int64_t nb, int64_t m0) const {
    constexpr int NV = 16 / V::W;
    F acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = V::zero();
    alignas(64) int32_t P[MR][16];
    const int64_t per_group = s.group / 8;  // chunks of a group
    const uint8_t* cn = codes + nb * s.Kb * s.chunks * 64;
    for (int64_t g = 0; g < s.G; ++g) {
      // software prefetch a few KB ahead in the code stream (it runs on into the next n-block) and the scales
      const char* ahead = reinterpret_cast<const char*>(cn + (g * per_group) * 64) + kPrefetchBytes;
      for (int64_t o = 0; o < per_group * 64; o += 64) __builtin_prefetch(ahead + o, 0, 3);
      __builtin_prefetch(scale + (nb * s.G + g) * kNBlock + kPrefetchBytes / 16, 0, 3);
      __builtin_prefetch(shift + (nb * s.G + g) * kNBlock + kPrefetchBytes / 16, 0, 3);
      T::template w4_group<MR>(cn + g * per_group * 64, int(per_group), q + m0 * s.K + g * s.group, s.K, P);
      const uint16_t* sg = scale + (nb * s.G + g) * kNBlock;
      const uint16_t* zg = shift + (nb * s.G + g) * kNBlock;
      for (int v = 0; v < NV; ++v) {
        const F sv = V::load_bf16(sg + v * V::W), zv = V::load_bf16(zg + v * V::W);
        for (int r = 0; r < MR; ++r) {
          const int64_t m = m0 + r;
          const F pv = V::mul(V::from_i32(P[r] + v * V::W), sv);
          acc[r][v] = V::fma(zv, V::set1(xq[m * s.G + g]), V::fma(pv, V::set1(xs[m * s.G + g]), acc[r][v]));
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        const F b = bias ? V::load(bias + nb * kNBlock + v * V::W) : V::zero();
        V::store_bf16(y + (m0 + r) * s.N + nb * kNBlock + v * V::W, V::add(acc[r][v], b));
      }
  }

  template <int r>
  void rows_block(int64_t nb, int64_t m0, int64_t rows) const {  // block<rows> for rows <= r
    if constexpr (r > 0) {
      if (rows == r)
        block<r>(nb, m0);
      else
        rows_block<r - 1>(nb, m0, rows);
    }
  }

  void run(int64_t t0, int64_t t1) const {
    for (int64_t nb = t0; nb < t1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) rows_block<kMaxRows>(nb, m0, std::min<int64_t>(kMaxRows, M - m0));
  }
};

// ---- the BF16 linear as dot products, for the tiers without AMX ----------------------------------------------------
// Whether tier T's BF16 linear spreads the prefetch of the next group of weight rows over the current group's
// blocks (T::kSpreadPrefetch, measured per tier) instead of issuing it all at the group's start.
template <class T, class = void>
struct SpreadPrefetch : std::false_type {};
template <class T>
struct SpreadPrefetch<T, std::void_t<decltype(T::kSpreadPrefetch)>> : std::bool_constant<T::kSpreadPrefetch> {};

// Each output element is V::hsum of V::W lanes, lane l accumulating x[k] * w[k] over k = l, l + W, ... (T::dot, an
// FMA or a BF16 pair dot product, in ascending k), whatever block of rows it falls in: blocks of up to MR rows of x
// times NR rows of w share the loads, each of their MR x NR chains is its own. Rows of x are converted once per call
// (T::X: fp32 where the weights are multiplied in fp32, bf16 where the tier multiplies bf16 pairs), and with more
// than MR rows a block of weights is converted once for all of them (T::WX): the same values, so the same bits.
template <class T>
struct DotBf16Gemm {
  using V = typename T::V;
  using F = typename V::F;
  using X = typename T::X;
  using WX = typename T::WX;
  static constexpr int MR = T::kMR, NR = T::kNR;
  static constexpr int64_t kPanelBytes = 384 * 1024;  // rows of x re-read for each group of weights stay in L2
  at::Tensor xc_;
  const X* xp;
  int64_t ldx;
  const uint16_t* w;
  at::Tensor bias_;
  const float* bias;  // fp32 [N] or null
  uint16_t* y;
  int64_t M, N, K;

  DotBf16Gemm(const at::Tensor& x, const at::Tensor& wt, const at::Tensor& b, at::Tensor& out)
      : DotBf16Gemm(x, wt.size(0), wt.size(1), b, out) {
    w = bf16_ptr(wt);
  }

  // Without a weight tensor: run_cols is handed the weights of each group of n-blocks (a coded layer's, decoded).
  DotBf16Gemm(const at::Tensor& x, int64_t n, int64_t k, const at::Tensor& b, at::Tensor& out)
      : w(nullptr), bias_(bias_f32(b)), bias(bias_.defined() ? bias_.data_ptr<float>() : nullptr),
        y(bf16_ptr_mut(out)), M(x.size(0)), N(n), K(k) {
    if constexpr (std::is_same<X, uint16_t>::value) {
      xp = bf16_ptr(x);
      ldx = x.stride(0);
    } else {
      xc_ = at::empty({M, K}, x.options().dtype(at::kFloat));
      float* xf = xc_.data_ptr<float>();
      const uint16_t* xb = bf16_ptr(x);
      const int64_t ld = x.stride(0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += V::W) V::store(xf + m * K + k, V::load_bf16(xb + m * ld + k));
      xp = xf;
      ldx = K;
    }
  }

  int64_t tasks() const { return N / kNBlock; }
  int64_t blocks_per_task() const { return 1; }  // a task is one n-block (16 output columns)
  template <class Fn>
  void parallel(const Fn& fn) const { parallel_tasks(tasks(), dynamic_grain(tasks()), fn); }

  // pf (or null; SpreadPrefetch): the bf16 rows of the next group of columns (K apart), prefetched a cache line of
  // each per 32 k as this block streams its own, not in a burst at its start. On a Zen 1 (avx2), one row of 49152 x
  // 576 on one thread: 14.3-19.7 -> 7.7-10.2 ms; 8960 x 1536 on two threads: 2.6-3.5 -> 1.9-2.9 ms. Where the weights
  // are converted for more rows (columns), the panel's first block prefetches as it multiplies from the converted copy
  // (a burst of a group's lines stalled the conversion: on a Zen 3, one thread, 8960 x 1536 at 16-17 rows 8.0-8.7 ->
  // 7.6-7.9 ms, at 6 rows 4.1-4.3 -> 3.8-4.0 ms, three alternated runs)
  template <int mr, int nr, class WT>
  void block(const X* x, const WT* wb, int64_t ldw, int64_t n0, int64_t m0, const uint16_t* pf = nullptr) const {
    F acc[mr][nr];
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) acc[i][j] = V::zero();
    for (int64_t k = 0; k < K; k += T::kDotK) {
      if (pf != nullptr && k % 32 == 0)
        for (int j = 0; j < nr; ++j) __builtin_prefetch(pf + j * K + k, 0, 3);
      typename T::XReg xr[mr];
      for (int i = 0; i < mr; ++i) xr[i] = T::xload(x + i * ldx + k);
      for (int j = 0; j < nr; ++j) {
        const typename T::WReg wr = T::wload(wb + j * ldw + k);
        for (int i = 0; i < mr; ++i) acc[i][j] = T::dot(acc[i][j], wr, xr[i]);
      }
    }
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) {
        const float v = V::hsum(acc[i][j]);
        y[(m0 + i) * N + n0 + j] = to_bf16(bias ? v + bias[n0 + j] : v);
      }
  }

  // rows m_begin..m_end of output columns n0..n0+nr: blocks of MR rows, then the row tail with fewer rows interleaved
  // (pf: see block; handed to the first block only, the later ones read the same weights again)
  template <int nr, class WT>
  void rows(const WT* wb, int64_t ldw, int64_t n0, int64_t m_begin, int64_t m_end, const uint16_t* pf = nullptr) const {
    int64_t m = m_begin;
    for (; m + MR <= m_end; m += MR, pf = nullptr) block<MR, nr>(xp + m * ldx, wb, ldw, n0, m, pf);
    tail<MR - 1, nr>(m_end - m, wb, ldw, n0, m, pf);
  }

  template <int r, int nr, class WT>
  void tail(int64_t left, const WT* wb, int64_t ldw, int64_t n0, int64_t m, const uint16_t* pf) const {
    if constexpr (r > 0) {
      if (left == r)
        block<r, nr>(xp + m * ldx, wb, ldw, n0, m, pf);
      else
        tail<r - 1, nr>(left, wb, ldw, n0, m, pf);
    }
  }

  // columns n0..n0+nr (nr <= NR) for rows m_begin..m_end, from the bf16 weights (wn: column n0's row) or a converted
  // copy of them
  template <int nr>
  void columns(const uint16_t* wn, int64_t n0, int64_t m_begin, int64_t m_end, WX* wbuf,
               const uint16_t* pf = nullptr) const {
    constexpr bool can_convert = !std::is_same<WX, uint16_t>::value;
    if constexpr (can_convert) {
      if (wbuf != nullptr) {
        for (int j = 0; j < nr; ++j) T::convert_w(wn + j * K, wbuf + j * K, K);
        rows<nr>(static_cast<const WX*>(wbuf), K, n0, m_begin, m_end, pf);  // the first block prefetches the next
        return;
      }
    }
    rows<nr>(wn, K, n0, m_begin, m_end, pf);
  }

  template <int nr>
  void column_tail(int64_t left, const uint16_t* wn, int64_t n0, int64_t m_begin, int64_t m_end, WX* wbuf) const {
    if constexpr (nr > 0) {
      if (left == nr)
        columns<nr>(wn, n0, m_begin, m_end, wbuf);
      else
        column_tail<nr - 1>(left, wn, n0, m_begin, m_end, wbuf);
    }
  }

  // Output columns of tasks t0..t1 (16 each), in groups of NR (NR1 with one or two rows: more weight rows streamed
  // at once); with more than MR rows, the weights of a group are converted once (T::WX) and used for a panel of rows
  // that stays in L2. The grouping changes which chains run interleaved, never an element's own sequence.
  void run(int64_t t0, int64_t t1) const { run_cols(w + t0 * kNBlock * K, t0, t1); }

  // n-blocks nb0..nb1 from the weights wc (row nb0 * 16 first, [(nb1 - nb0) * 16, K] row-major): the same
  // per-element arithmetic wherever the weights come from.
  void run_cols(const uint16_t* wc, int64_t nb0, int64_t nb1) const {
    if (M <= 2)
      run_groups<T::kNR1>(wc, nb0, nb1);
    else
      run_groups<NR>(wc, nb0, nb1);
  }

  template <int G>
  void run_groups(const uint16_t* wc, int64_t t0, int64_t t1) const {
    const int64_t n_begin = t0 * kNBlock, n_end = t1 * kNBlock;
    const bool convert = !std::is_same<WX, uint16_t>::value && M > MR;
    thread_local std::vector<WX> buf;
    if (convert && buf.size() < size_t(G * K)) buf.resize(size_t(G * K));
    WX* wbuf = convert ? buf.data() : nullptr;
    // a panel's rows are sized as if K were at most 2048: with a long K (the down projection's 8960) fewer rows per
    // panel would convert every weight again for each few rows (on a Zen 3, 1536 x 8960 at 32 rows: 22 -> 11 ms)
    const int64_t kp = std::min<int64_t>(K, 2048) * int64_t(sizeof(X));
    const int64_t panel = convert ? std::max<int64_t>(MR, (kPanelBytes / kp) / MR * MR) : M;
    constexpr bool spread = SpreadPrefetch<T>::value;  // the next group's rows a line at a time, else all of them now
    for (int64_t p = 0; p < M; p += panel) {
      const int64_t pe = std::min(M, p + panel);
      int64_t n0 = n_begin;
      for (; n0 + G <= n_end; n0 += G) {
        const uint16_t* next = p == 0 && n0 + 2 * G <= n_end ? wc + (n0 + G - n_begin) * K : nullptr;
        if (next != nullptr && !spread) prefetch_l2(next, G * K * 2);
        columns<G>(wc + (n0 - n_begin) * K, n0, p, pe, wbuf, spread ? next : nullptr);
      }
      column_tail<G - 1>(n_end - n0, wc + (n0 - n_begin) * K, n0, p, pe, wbuf);
    }
  }
};

}  // namespace subspec
