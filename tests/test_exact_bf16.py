"""Exact in BF16 (design.md §3.5): with the batch-invariant native kernels, a verify forward over a tree gives every
node the very bits of a one-token forward at its position, so every method's greedy output equals plain decoding's.

Real SmolLM2-135M in BF16, on every kernel tier this CPU runs (the conftest fixture ``kernel_tier``: a supported tier
that does not build fails, it does not skip).
"""
from __future__ import annotations

import pytest
import torch

from subspec import kernels
from subspec.engine import Engine
from subspec.lookup import NgramLookup
from subspec.model import Attention
from subspec.runtime import Options, load, plan_for
from subspec.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a haiku about the sea.", "def fibonacci(n):\n    # complete this function", "What is 17 * 23?",
    "Translate to German: The train leaves at noon.", "List the planets of the solar system.",
    "Explain what a hash table is in two sentences.", "Count from 1 to 25, separated by commas.",
    "Write a limerick about a cat who learned to code.", "Summarize the plot of Romeo and Juliet.",
    "Give three tips for a job interview.", "What is the capital of Australia? Answer briefly.",
    "Write a SQL query selecting all users older than 30.", "Describe the water cycle for a child.",
    "Continue the pattern: A1 B2 C3 D4", "Write a short email declining a meeting politely.",
    "What are the primary colors?", "Name five fruits that are red.", "How do I reverse a list in Python?",
    "Write two sentences about the history of Rome.", "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def resident(smollm2_gguf, kernel_tier):
    with kernels.using(kernel_tier):
        rt = load(Options(model=str(smollm2_gguf), method="ar", dtype="bfloat16", offload="none", max_context=1024))
    assert rt.decoder.native_attention and rt.decoder.k is kernels.ops(kernel_tier)
    yield rt
    rt.close()


def _default_tier(tier: str) -> bool:
    """Whether ``tier`` is the one this CPU uses by default: full CI sizes there, shorter runs on the slower tiers."""
    return tier == kernels.supported()[0]


def _one_token_logits(rt, prompt_ids, n):
    """Greedy plain decoding, one token per forward: (tokens [n + 1], logits [n, V] of the one-token forwards)."""
    eng = rt.engine
    eng.reset()
    out, logits = [], []
    params = SamplingParams(max_new_tokens=1)
    out += eng.generate(prompt_ids, params)
    dec, L = rt.decoder, eng.cache_len
    for j in range(n):
        tok = torch.tensor(out[-1:])
        p = torch.tensor([L + j])
        lg = dec.forward(tok, p, p, Attention.tree(L + j, torch.ones(1, 1, dtype=torch.bool)), eng.layers, eng.kv)
        logits.append(lg[0])
        out.append(int(lg[0].argmax()))
    return out, torch.stack(logits)


def _tree(path: list[int], extra: int, seed: int, vocab: int):
    """A tree holding ``path`` (root first) as one branch, plus ``extra`` distractor nodes hung on random nodes, in
    depth order (ties shuffled, so path nodes sit among distractors). Returns tokens, depths, ancestors, path index."""
    g = torch.Generator().manual_seed(seed)
    nodes = [(0, -1, path[0], True)]  # (depth, parent, token, on path)
    for d, t in enumerate(path[1:], 1):
        nodes.append((d, d - 1, t, True))
    for _ in range(extra):
        parent = int(torch.randint(len(nodes), (1,), generator=g))
        tok = int(torch.randint(vocab, (1,), generator=g))
        nodes.append((nodes[parent][0] + 1, parent, tok, False))
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i][0], float(torch.rand(1, generator=g))))
    new = {old: i for i, old in enumerate(order)}
    n = len(nodes)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, old in enumerate(order):
        anc[i, i] = True
        p = nodes[old][1]
        while p >= 0:
            anc[i, new[p]] = True
            p = nodes[p][1]
    tokens = torch.tensor([nodes[o][2] for o in order])
    depths = torch.tensor([nodes[o][0] for o in order])
    path_idx = [new[d] for d in range(len(path))]  # path node of depth d (old index d)
    return tokens, depths, anc, path_idx


@pytest.mark.parametrize("extra", [0, 40, 150])
def test_tree_verify_logits_equal_one_token_logits_bit_for_bit(resident, extra):
    rt = resident
    ids = rt.encode(PROMPTS[extra % len(PROMPTS)])
    out, ref = _one_token_logits(rt, ids, 64)
    eng, dec = rt.engine, rt.decoder
    eng.reset()
    eng.generate(ids, SamplingParams(max_new_tokens=1))  # the same prefill; cache_len = prompt length
    L = eng.cache_len
    tokens, depths, anc, path_idx = _tree(out[:64], extra, seed=extra, vocab=dec.lm_head.shape[0])
    n = tokens.shape[0]
    slots = L + torch.arange(n)
    logits = dec.forward(tokens, L + depths, slots, Attention.tree(L, anc), eng.layers, eng.kv)
    got = logits[path_idx]
    mismatched = [d for d in range(64) if not torch.equal(got[d], ref[d])]
    assert not mismatched, f"{len(mismatched)} of 64 positions differ, first at depth {mismatched[0]}"


@pytest.fixture(scope="module")
def offloaded_runs(smollm2_gguf, resident, kernel_tier):
    """ar (the reference, all resident) and each verifying method with most layers offloaded to disk."""
    spec_opts = Options(model=str(smollm2_gguf), method="subspec", dtype="bfloat16", max_context=1024)
    with kernels.using(kernel_tier):
        full, _ = plan_for(spec_opts, resident.source)
        spec_opts.device_memory = full.full_draft_minimum + 6 * full.layer_bytes
        spec = load(spec_opts)
    assert spec.decoder.k is kernels.ops(kernel_tier)
    assert len(spec.placement.offloaded) >= 0.75 * spec.decoder.n_layers
    assert spec.placement.stream_ratio < 0.7 and spec.tier.coded  # the offloaded layers stream coded (subspec.codec)
    assert not spec.placement.stream_ratio_estimated  # the files' measured ratio
    yield spec
    spec.close()


def _greedy(engine, ids, n=128):
    engine.reset()
    return engine.generate(ids, SamplingParams(max_new_tokens=n))


def test_greedy_subspec_ngram_draft_model_equal_ar_in_bf16(resident, offloaded_runs, smollm2_gguf, kernel_tier):
    """CI: on the tier this machine uses by default, 5 of the prompts x 96 tokens, ngram and draft-model on 2 of them;
    on the other tiers it runs (slower ones, which the tree test above also covers bit for bit), one prompt x 32
    tokens with all three (the full check below is opt-in: ``-m heavy``)."""
    with kernels.using(kernel_tier):
        if _default_tier(kernel_tier):
            _check_greedy(resident, offloaded_runs, smollm2_gguf, PROMPTS[::4], every=3, n=96)
        else:
            _check_greedy(resident, offloaded_runs, smollm2_gguf, PROMPTS[1:2], every=1, n=32)


@pytest.mark.heavy
def test_greedy_equal_ar_in_bf16_20_prompts(resident, offloaded_runs, smollm2_gguf, kernel_tier):
    """The issue's check: 20 prompts x 128 tokens, ngram and draft-model on every 4th (about 5 minutes a tier)."""
    with kernels.using(kernel_tier):
        _check_greedy(resident, offloaded_runs, smollm2_gguf, PROMPTS, every=4)


def _check_greedy(resident, offloaded_runs, smollm2_gguf, prompts: list[str], every: int, n: int = 128) -> None:
    from subspec.draft_model import DraftModel
    from subspec.loading import open_model
    from subspec.speculation import TreeSettings

    spec = offloaded_runs
    dec, layers = spec.decoder, spec.engine.layers
    eos = spec.source.eos_token_ids
    ngram = Engine(dec, layers, NgramLookup(16, 3), eos, 1024, tier=spec.tier)
    dm = DraftModel(open_model(str(smollm2_gguf), torch.bfloat16), TreeSettings(depth=6, topk=2, verify_budget=16),
                    1024 + 13, torch.bfloat16, "cpu")
    draft_model = Engine(dec, layers, dm, eos, 1024, tier=spec.tier)
    diverged = []
    for i, prompt in enumerate(prompts):
        ids = resident.encode(prompt)
        ref = _greedy(resident.engine, ids, n)
        runs = {"subspec": spec.engine}
        if i % every == 0:  # the n-gram and draft-model proposers go through the same verifier: a subset keeps CI short
            runs.update(ngram=ngram, draft_model=draft_model)
        for name, eng in runs.items():
            got = _greedy(eng, ids, n)
            if got != ref:
                first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                diverged.append(f"{name} on prompt {i} at token {first}")
        assert spec.engine.last_stats.tau > 1.5
    assert not diverged, diverged


def test_bf16_chat_turns_equal_ar(resident, offloaded_runs, kernel_tier):
    """A three-turn chat (prefix reuse, pending tokens) gives subspec exactly ar's answers (32 tokens a turn on the
    tier this machine uses by default, 24 on the slower tiers it also runs)."""
    n = 32 if _default_tier(kernel_tier) else 24
    answers = {}
    for name, rt in (("ar", resident), ("subspec", offloaded_runs)):
        rt.engine.reset()
        history, outs = [], []
        for msg in ("Name a famous painter.", "Which country was he from?", "Name one of his paintings."):
            history.append({"role": "user", "content": msg})
            ids = rt.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            out = []
            for chunk in rt.engine.stream_context(ids, SamplingParams(max_new_tokens=n)):
                out += chunk
            outs.append(out)
            history.append({"role": "assistant", "content": rt.tokenizer.decode(out, skip_special_tokens=True)})
        answers[name] = outs
    assert answers["subspec"] == answers["ar"]


def test_seeded_sampling_equals_ar_in_bf16(resident, offloaded_runs, kernel_tier):
    """A seeded sampled request gives subspec (its depth chosen per round from measured costs) exactly ar's tokens in
    BF16: the draws are indexed by output position and the tree forward is batch-invariant. CI: one prompt x 64
    tokens on the tier this machine uses by default, x 32 tokens on the slower tiers it also runs."""
    default = _default_tier(kernel_tier)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_new_tokens=64 if default else 32)
    with kernels.using(kernel_tier):
        for prompt in PROMPTS[1:2]:
            ids = resident.encode(prompt)
            got = {}
            for name, rt in (("ar", resident), ("subspec", offloaded_runs)):
                rt.engine.reset()
                got[name] = rt.engine.generate(ids, SamplingParams(**vars(params)))
            assert got["subspec"] == got["ar"], prompt
            assert offloaded_runs.engine.last_stats.tau > 1.2
        # and at fixed tree shapes: depth 2 and depth 12, the same tokens as ar
        draft = offloaded_runs.draft
        policy, depth = draft.policy, draft.s.depth
        try:
            draft.policy = None
            for d in (2, 12):
                draft.s.depth = d
                offloaded_runs.engine.reset()
                assert offloaded_runs.engine.generate(ids, SamplingParams(**vars(params))) == got["ar"], d
                assert 2 <= max(offloaded_runs.engine.last_stats.draft_depths) <= d
        finally:
            draft.policy, draft.s.depth = policy, depth
