// subspec CPU kernels: the torch operators of one tier, registered in the namespace subspec_<tier>.
//
// subspec/kernels/__init__.py builds this file once per machine for every tier the CPU can run, each with its own
// instruction-set flags and -DSUBSPEC_TIER_<NAME> -DSUBSPEC_NS=subspec_<name>; torch.ops.subspec_<name>.* are then
// that tier's operators (several tiers can be loaded in one process, e.g. to test each). Operators are registered for
// the CPU dispatch key: a tensor on another device gets torch's "could not run ... with arguments from the CUDA
// backend" error, and every operator checks its arguments' devices and dtypes again (common.h).
#include "common.h"

#if defined(SUBSPEC_TIER_AMX)
#include "tier_amx.h"
using Tier = subspec::AmxTier;
#elif defined(SUBSPEC_TIER_AVX512)
#include "tier_avx512.h"
using Tier = subspec::Avx512Tier;
#elif defined(SUBSPEC_TIER_AVX2)
#include "tier_avx2.h"
using Tier = subspec::Avx2Tier;
#elif defined(SUBSPEC_TIER_PORTABLE)
#include "tier_portable.h"
using Tier = subspec::PortableTier;
#else
#error "build with -DSUBSPEC_TIER_{AMX,AVX512,AVX2,PORTABLE}"
#endif

#ifndef SUBSPEC_NS
#error "build with -DSUBSPEC_NS=subspec_<tier>"
#endif

namespace {

std::string tier_name() { return Tier::kName; }

// Whether this process may run the tier (AMX: Linux grants tile data on request; the others: always).
bool tier_usable() {
#if defined(SUBSPEC_TIER_AMX)
  return Tier::usable();
#else
  return true;
#endif
}

}  // namespace

// TORCH_LIBRARY pastes its namespace argument: expand SUBSPEC_NS first.
#define SUBSPEC_DEFINE(ns, m) TORCH_LIBRARY(ns, m)
#define SUBSPEC_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

SUBSPEC_DEFINE(SUBSPEC_NS, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_w4(Tensor x, Tensor codes, Tensor scale, Tensor shift, int group, Tensor? bias) -> Tensor");
  m.def("pack_w4(Tensor codes, int group) -> Tensor");
  m.def("pack_w4_nibbles(Tensor codes, int group) -> Tensor");
  m.def("pack_w4_nibbles_(Tensor(a!) codes, int group) -> Tensor(a!)");
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, int prefix, Tensor ancestors, Tensor positions, "
        "int window, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor gain, float eps, bool float32_gain) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("expand_topk(Tensor logits, Tensor scores, int k, float inv_t) -> (Tensor, Tensor)");
  m.def("layers_w4(Tensor h, Tensor[] w, int group, Tensor[] attn_in, Tensor[] mlp_in, float eps, "
        "bool float32_gain, int n_heads, int kv_heads, Tensor cos, Tensor sin, Tensor(a!) kv, int[] layers, "
        "Tensor slots, int prefix, Tensor ancestors, Tensor positions, int[] windows, float attn_scale) -> Tensor");
  m.def("w4_delta_encode(Tensor w, Tensor codes, Tensor scale, Tensor shift, int group) -> Tensor");
  m.def("w4_delta_decode(Tensor src, Tensor codes, Tensor scale, Tensor shift, int group, Tensor(a!) out) -> int");
  m.def("w4_delta_index(Tensor stream, int N, int K) -> Tensor");
  m.def("linear_coded(Tensor x, Tensor stream, Tensor offsets, Tensor codes, Tensor scale, Tensor shift, int group, "
        "Tensor? bias) -> Tensor");
  m.def("hqq_quantize(Tensor w, int bits, int group, int iters, int chunk_rows, float lp_norm, float beta) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("tier() -> str", &tier_name);
  m.def("usable() -> bool", &tier_usable);
}

SUBSPEC_IMPL(SUBSPEC_NS, m) {
  m.impl("linear_bf16", &subspec::linear_bf16<Tier>);
  m.impl("linear_w4", &subspec::linear_w4<Tier>);
  m.impl("pack_w4", &subspec::pack_w4);
  m.impl("pack_w4_nibbles", &subspec::pack_w4_nibbles);
  m.impl("pack_w4_nibbles_", &subspec::pack_w4_nibbles_);
  m.impl("tree_attention", &subspec::tree_attention<Tier>);
  m.impl("rms_norm", &subspec::rms_norm<Tier>);
  m.impl("rope", &subspec::rope);
  m.impl("silu_mul", &subspec::silu_mul<Tier>);
  m.impl("expand_topk", &subspec::expand_topk<Tier>);
  m.impl("layers_w4", &subspec::layers_w4<Tier>);
  m.impl("w4_delta_encode", &subspec::w4_delta_encode);
  m.impl("w4_delta_decode", &subspec::w4_delta_decode<Tier>);
  m.impl("w4_delta_index", &subspec::w4_delta_index<Tier>);
  m.impl("linear_coded", &subspec::linear_coded<Tier>);
  m.impl("hqq_quantize", &subspec::hqq_quantize<Tier>);
}
