"""Mixture-of-experts families (qwen3_moe, mixtral) beyond the FP32 checks against transformers (test_families.py):
exact in BF16 on every kernel tier, the router, and the configs refused.

Batch invariance (design.md §3.5) is what makes a MoE verify exact: the tokens of a tree route to different experts,
so an expert's rows in a verify are a different set than in a one-token forward; with row-invariant linears (and a
row-invariant router) each node still gets the bits of its one-token forward.
"""
from __future__ import annotations

import pytest
import torch

from subspec import kernels
from subspec.errors import SubspecError
from subspec.model import Attention, Router
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams

from conftest import save_tiny, tiny_config

QWEN3_MOE = dict(head_dim=16, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
MIXTRAL = dict(intermediate_size=64, num_local_experts=6, num_experts_per_tok=2)
MOE = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}
PROMPTS = [[5, 17, 3, 99, 42, 8], [64, 120, 7], [11, 30, 13, 2 + 1, 77, 91, 4, 60], [100, 101, 102, 103]]


@pytest.fixture(scope="module", params=list(MOE))
def moe_model(request, tmp_path_factory):
    """A tiny random MoE checkpoint (4 layers, vocab 128) of each family."""
    cfg = tiny_config(request.param, False, layers=4, **MOE[request.param])
    return save_tiny(tmp_path_factory.mktemp(request.param) / "m", cfg, seed=1, scale=2.0)


def _ar(path, tier):
    with kernels.using(tier):
        return load(Options(model=str(path), method="ar", dtype="bfloat16", offload="none", max_context=128))


def test_tree_verify_equals_one_token_forwards_bit_for_bit_in_bf16(moe_model, kernel_tier):
    """A chain of 24 tokens verified in one forward (each token routed with the others sharing its experts) gives
    every position the logits of a one-token forward, bit for bit, on every kernel tier."""
    rt = _ar(moe_model, kernel_tier)
    try:
        dec, eng = rt.decoder, rt.engine
        assert dec.routers is not None and dec.native_attention and dec.k is kernels.ops(kernel_tier)
        prompt = PROMPTS[0]
        eng.eos = set()  # exactly 24 tokens
        eng.reset()
        out = eng.generate(prompt, SamplingParams(max_new_tokens=24))
        L = len(prompt)
        kv, layers = eng.kv, eng.layers
        one = []
        for j, t in enumerate(out[:23]):  # one-token forwards after the prefill (the engine's, slots L..)
            p = torch.tensor([L + j])
            one.append(dec.forward(torch.tensor([t]), p, p, Attention.tree(L + j, torch.ones(1, 1, dtype=torch.bool)),
                                   layers, kv)[0])
        n = 23
        pos = L + torch.arange(n)
        tree = dec.forward(torch.tensor(out[:n]), pos, pos, Attention.tree(L, torch.ones(n, n, dtype=torch.bool).tril()),
                           layers, kv)
        experts_used = {tuple(dec.routers[0](dec.embed[torch.tensor(out[:n])])[1].reshape(-1).tolist())}
        assert len(set(next(iter(experts_used)))) > dec.routers[0].top_k  # the chain's tokens use several experts
        bad = [j for j in range(n) if not torch.equal(tree[j], one[j])]
        assert not bad, f"{len(bad)} of {n} positions differ, first at {bad[0]}"
    finally:
        rt.close()


def test_greedy_subspec_with_offloaded_experts_equals_ar_in_bf16(moe_model, kernel_tier):
    """Every layer but one offloaded to disk (the verify reads each layer's attention and the experts its tree
    nodes route to); the draft routes with the full-precision router and runs the substitutes; BF16 greedy output equals plain decoding."""
    ar = _ar(moe_model, kernel_tier)
    try:
        refs = []
        ar.engine.eos = set()
        for p in PROMPTS:
            ar.engine.reset()
            refs.append(ar.engine.generate(p, SamplingParams(max_new_tokens=40)))
    finally:
        ar.close()
    with kernels.using(kernel_tier):
        spec = load(Options(model=str(moe_model), method="subspec", dtype="bfloat16", offload="disk", max_resident=1,
                            max_context=128, depth=4, topk=3, verify_budget=16))
    try:
        assert spec.placement.offloaded == [0, 1, 2] and not spec.tier.coded  # experts stream by expert, packed
        accepted = 0
        spec.engine.eos = set()
        for p, ref in zip(PROMPTS, refs):
            spec.engine.reset()
            assert spec.engine.generate(p, SamplingParams(max_new_tokens=40)) == ref
            accepted += spec.engine.last_stats.accepted_tokens
        assert accepted > 0  # trees were drafted and verified
    finally:
        spec.close()


def test_router_top_k_normalization_and_padding():
    """The router against its definition: softmax in float32, top-k, renormalized where the family does; a router of
    6 experts is padded to 16 rows whose scores are never chosen."""
    from subspec.families import FAMILIES

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 32, generator=g), torch.randn(5, 32, generator=g)
    cfg = tiny_config("mixtral", False, hidden_size=32, **MIXTRAL)
    r = Router(w, FAMILIES["mixtral"].moe, cfg, native=False)
    weights, experts = r(x)
    probs = torch.softmax(x @ w.t(), -1)
    top, idx = probs.topk(2, -1)
    assert torch.equal(experts, idx) and torch.allclose(weights, top / top.sum(-1, keepdim=True))
    assert r.linear.weight.shape == (16, 32) and int(experts.max()) < 6
    cfg = tiny_config("qwen3_moe", False, hidden_size=32, **dict(QWEN3_MOE, num_experts=6, norm_topk_prob=False))
    weights, _ = Router(w, FAMILIES["qwen3_moe"].moe, cfg, native=False)(x)
    assert torch.allclose(weights, probs.topk(3, -1).values)  # not renormalized


def test_moe_with_dense_layers_among_the_sparse_is_refused(tmp_path):
    cfg = tiny_config("qwen3_moe", False, layers=2, **dict(QWEN3_MOE, mlp_only_layers=[1]))
    path = save_tiny(tmp_path / "m", cfg)
    with pytest.raises(SubspecError, match="dense MLP layers among the experts"):
        load(Options(model=str(path), method="ar", dtype="float32", offload="none", max_context=64))


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def test_disk_reads_are_the_attention_and_the_routed_experts(moe_model):
    """Plain offloaded decoding of a MoE reads, per forward and offloaded layer, the attention unit and the units of
    the experts its tokens route to (adjacent ones in one read), counted by the kernel (/proc/self/io, O_DIRECT): far
    less than whole layers. The routing is recorded from the decoder's own routers during the same run."""
    rt = load(Options(model=str(moe_model), method="ar", dtype="bfloat16", offload="disk", max_resident=1,
                      max_context=128))
    try:
        dec, tier, units = rt.decoder, rt.tier, rt.tier.layout.units
        assert tier.direct and len(units) == 1 + dec.routers[0].experts and rt.placement.offloaded == [0, 1, 2]
        routed: list[set] = []
        moe = dec.moe

        def recording(i, x, lin):
            if i in rt.placement.offloaded:
                routed.append(set(dec.routers[i](x)[1].reshape(-1).tolist()))
            return moe(i, x, lin)

        dec.moe = recording
        rt.engine.eos = set()
        rt.engine.reset()
        before, counted = _read_bytes(), tier.bytes_read
        rt.engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=20))
        io, ours = _read_bytes() - before, tier.bytes_read - counted
        expected = sum(units[0][1] + sum(units[1 + e][1] for e in r) for r in routed)
        assert len(routed) == 3 * 20  # the prefill and 19 one-token forwards over three offloaded layers
        assert all(len(r) <= dec.routers[0].top_k for r in routed[3:])
        ahead = tier.n_slots * units[0][1]  # the attention units read ahead, before the run or after it
        assert expected - ahead <= ours <= expected + ahead and abs(io - ours) <= ahead, (io, ours, expected)
        assert io < 0.6 * 20 * 3 * tier.layout.extent  # whole-layer streaming would read every expert
    finally:
        rt.close()
