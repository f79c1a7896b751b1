"""Mixture-of-experts families (qwen3_moe, mixtral) beyond the FP32 checks against transformers (test_families.py):
exact in BF16 on every kernel tier, the router, and the configs refused.

Batch invariance (design.md §3.5) is what makes a MoE verify exact: the tokens of a tree route to different experts,
so an expert's rows in a verify are a different set than in a one-token forward; with row-invariant linears (and a
row-invariant router) each node still gets the bits of its one-token forward.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from subspec import kernels
from subspec.errors import SubspecError
from subspec.loading import open_model
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
        used = set(dec.routers[0](dec.embed[torch.tensor(out[:n])])[1].reshape(-1).tolist())
        assert len(used) > dec.routers[0].top_k  # the chain's tokens use several experts
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

        rt.engine.eos = set()
        rt.engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2))  # first-use work (imports) outside the count
        dec.moe = recording
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


def test_whole_layer_reading_gives_the_same_tokens_reading_every_expert(moe_model):
    """``expert_streaming=False`` (``--whole-layers``, the bench's ar-layers): every forward reads whole layers; the
    tokens are the same as with routed experts only."""
    outs, streamed = [], []
    for by_expert in (True, False):
        rt = load(Options(model=str(moe_model), method="ar", dtype="bfloat16", offload="disk", max_resident=1,
                          max_context=128, expert_streaming=by_expert))
        try:
            rt.engine.eos = set()
            rt.engine.reset()
            outs.append(rt.engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=12)))
            st = rt.engine.last_stats
            streamed.append(st.bytes_streamed / (st.target_forwards * 3 * rt.placement.layer_bytes))
        finally:
            rt.close()
    assert outs[0] == outs[1]
    assert streamed[1] == 1.0 and streamed[0] < 0.6, streamed


def test_distinct_experts_matches_simulated_uniform_routing():
    """E (1 - (1 - k/E)^T) against a simulation of T tokens each routed to k of E experts uniformly at random."""
    from subspec.families import distinct_experts

    g = torch.Generator().manual_seed(0)
    for E, k, T in ((8, 2, 1), (8, 2, 4), (8, 2, 16), (128, 8, 30)):
        picks = torch.rand(4000, T, E, generator=g).topk(k, dim=-1).indices  # k distinct experts per token
        seen = torch.zeros(4000, E).scatter_(1, picks.reshape(4000, -1), 1.0).sum(1).mean().item()
        assert abs(distinct_experts(E, k, T) - seen) <= 0.02 * seen, (E, k, T, seen)


def test_plan_prices_a_verify_by_the_experts_its_tree_touches(moe_model):
    """Streamed by expert, a one-token forward reads each offloaded layer's attention and top-k experts, a verify of
    many nodes nearly every expert; the forecast prices ar at the one-token bytes (faster than whole layers)."""
    from subspec.costmodel import Rates, forecast
    from subspec.runtime import plan_for

    opts = Options(model=str(moe_model), method="ar", dtype="bfloat16", offload="disk", max_resident=1,
                   max_context=128)
    src = open_model(moe_model)
    p, _ = plan_for(opts, src)
    w, _ = plan_for(dataclasses.replace(opts, expert_streaming=False), src)
    attention, expert, n, top_k = p.experts
    moe = src.family.moe
    assert w.experts is None and n == moe.experts(src.config) and top_k == moe.top_k(src.config)
    assert attention + n * expert == p.layer_bytes
    assert p.streamed_bytes(1) == 3 * (attention + top_k * expert) < w.streamed_bytes(1) == 3 * p.layer_bytes
    assert p.streamed_bytes(1) < p.streamed_bytes(4) < p.streamed_bytes(64) <= w.streamed_bytes(64)
    assert p.streamed_bytes(64) > 0.99 * w.streamed_bytes(64)
    rates = Rates(memory=20e9, substitute=20e9, offload=1e9, per_layer=0.0)
    cfg = src.config
    assert forecast(p, cfg, rates, method="ar").t_single < forecast(w, cfg, rates, method="ar").t_single
    assert f"attention + {top_k} of {n} experts a layer" in p.summary()


def test_a_moe_gguf_converts_to_the_same_model(moe_model, tmp_path):
    """The checkpoint written as llama.cpp lays out a MoE GGUF (experts stacked per layer; Mixtral as a llama file
    with experts, q/k permuted): the conversion splits the experts and gives logits within 1e-4 of transformers'
    model of the original checkpoint (FP32), the config naming the family, its experts and their width."""
    from transformers import AutoModelForCausalLM

    from subspec.model import Decoder, ResidentLayers, load_linears
    from tiny_gguf import write_gguf

    gguf = write_gguf(moe_model, tmp_path / "m.gguf")
    src = open_model(gguf, torch.float32)
    ref_cfg = open_model(moe_model).config
    assert src.config.model_type == ref_cfg.model_type and src.config.num_experts == ref_cfg.num_experts
    fam = src.family.moe
    assert fam.size(src.config) == fam.size(ref_cfg) and fam.normalize(src.config) == fam.normalize(ref_cfg)
    dec = Decoder.from_source(src, torch.float32, "cpu")
    layers = ResidentLayers({i: load_linears(src, i, torch.float32, "cpu") for i in range(dec.n_layers)})
    hf = AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32).eval()
    ids = PROMPTS[2] + PROMPTS[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    pos = torch.arange(len(ids))
    ours = dec.forward(torch.tensor(ids), pos, pos, Attention.run(0), layers, dec.new_kv_cache(32))
    assert (ours - ref).abs().max().item() <= 1e-4


def test_resident_attention_and_the_expert_cache_read_less_and_change_no_bit(moe_model):
    """A disk tier holding the offloaded layers' attention and caching 3 experts a layer (LFU) gives one-token
    forwards the same logits, bit for bit, as the resident model; after loading it reads only the experts it misses
    (each once, /proc/self/io agreeing), and hits some."""
    from subspec.layout import layer_layout
    from subspec.model import Decoder, ResidentLayers, load_linears
    from subspec.tiers import DiskTier, packed_layers

    src = open_model(moe_model)
    dec = Decoder.from_source(src, torch.float32, "cpu")
    layout = layer_layout(src.config, src.family, torch.float32)
    full = ResidentLayers({i: load_linears(src, i, torch.float32, "cpu") for i in range(4)})
    tier = DiskTier(packed_layers(src, layout, [0, 1, 2]), layout, [0, 1, 2], resident_attention=(0, 1, 2),
                    expert_cache=3)
    try:
        assert tier.direct
        streamed = ResidentLayers({3: full.resident[3]}, tier)
        kv_full, kv_tier = dec.new_kv_cache(64), dec.new_kv_cache(64)
        ids = PROMPTS[2] + PROMPTS[0] + PROMPTS[3] + PROMPTS[1] * 3
        before, read = _read_bytes(), tier.bytes_read
        one = torch.ones(1, 1, dtype=torch.bool)
        for j, t in enumerate(ids):
            p = torch.tensor([j])
            a = dec.forward(torch.tensor([t]), p, p, Attention.tree(j, one), full, kv_full)
            b = dec.forward(torch.tensor([t]), p, p, Attention.tree(j, one), streamed, kv_tier)
            assert torch.equal(a, b), j
        io, read = _read_bytes() - before, tier.bytes_read - read
        store, unit = tier._experts, layout.units[1][1]
        assert store.hits > 0 and store.hits + store.misses == 3 * len(ids) * dec.routers[0].top_k
        assert read == store.misses * unit and abs(io - read) <= 2 * unit, (io, read, store.misses)
        assert read < 3 * len(ids) * (layout.units[0][1] + dec.routers[0].top_k * unit)  # what no holding reads
    finally:
        tier.close()


def test_the_plan_holds_attention_then_caches_experts_within_the_budget():
    """A Qwen3-30B-A3B-shaped layer (128 experts, top-8) at 8 GiB: every offloaded layer's attention held, experts
    cached with the rest, the account within the budget, the bytes a token streams lower than without holding."""
    from transformers import AutoConfig

    from subspec.families import family_for
    from subspec.placement import plan_placement

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=151936, hidden_size=2048, moe_intermediate_size=768,
                               num_experts=128, num_experts_per_tok=8, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, tie_word_embeddings=False)
    kw = dict(max_context=1024, substitutes=False)
    p = plan_placement(cfg, family_for("qwen3_moe"), torch.bfloat16, 8 << 30, **kw)
    plain = plan_placement(cfg, family_for("qwen3_moe"), torch.bfloat16, 8 << 30, expert_streaming=False, **kw)
    assert p.total <= 8 << 30 and p.resident_attention == tuple(p.offloaded) and p.expert_cache > 0
    items = dict((n, b) for n, b, _ in p.items)
    assert items["resident attention"] == len(p.offloaded) * p.experts[0]
    assert items["expert cache"] == len(p.offloaded) * p.expert_cache * p.experts[1]
    assert p.streamed_bytes(1) < 0.1 * plain.streamed_bytes(1)
