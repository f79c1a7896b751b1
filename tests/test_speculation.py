"""SubSpec: exact int4 substitutes, lossless greedy and sampled output, EOS inside a run, real sharing."""
from __future__ import annotations

import gc

import pytest
import torch

from subspec import kernels
from subspec.engine import Engine, NoDraft
from subspec.kvcache import KVCache
from subspec.loading import open_model
from subspec.model import Decoder, ResidentLayers, load_linears
from subspec.placement import SubstituteSpec
from subspec.quant import Int4Linear, dequantize, hqq_quantize, load_substitutes
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams, target_probs
from subspec.speculation import SubSpecDraft, SubstituteLayers, TreeSettings
from subspec.tree import accept

from conftest import save_tiny, tiny_config


def test_int4_kernel_equals_hqq_dequantized_matmul():
    torch.manual_seed(0)
    w = torch.randn(256, 512) * 0.05
    codes, scale, zero = hqq_quantize(w, 4, 64)
    assert codes.max() <= 15 and (dequantize(codes, scale, zero) - w).abs().mean() < 0.1 * w.abs().mean()
    from hqq.core.quantize import Quantizer

    _, meta = Quantizer.quantize(w, nbits=4, group_size=64, axis=1, bitpack=False, device="cpu")
    assert torch.allclose(meta["scale"].reshape(256, 8).float(), scale)
    lin = Int4Linear(codes, scale, zero, 64, None, torch.bfloat16, "cpu")
    x = torch.randn(5, 512)
    ref = x.bfloat16().float() @ dequantize(codes, scale.bfloat16().float(), zero).t()
    got = lin(x.bfloat16()).float()
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()  # bf16 rounding of outputs and zeros only
    # a wrong zero conversion would be far off
    bad = Int4Linear(codes, scale, zero + 1, 64, None, torch.bfloat16, "cpu")
    assert (bad(x.bfloat16()).float() - ref).abs().max() > 0.1 * ref.abs().max()


def _tiny_subspec(path, bits=4, settings=None, offloaded=(1, 2), eos=()):
    src = open_model(path)
    dec = Decoder.from_source(src, torch.float32, "cpu")
    L = dec.n_layers
    resident = {i: load_linears(src, i, torch.float32, "cpu") for i in range(L) if i not in offloaded}
    full = ResidentLayers({**resident, **{i: load_linears(src, i, torch.float32, "cpu") for i in offloaded}})
    settings = settings or TreeSettings(depth=2, topk=3, verify_budget=12, threshold=0.0)
    kv = dec.new_kv_cache(64 + settings.max_nodes)
    subs = load_substitutes(src, list(offloaded), SubstituteSpec(bits, 32), torch.float32, "cpu")
    draft = SubSpecDraft(dec, ResidentLayers(resident, SubstituteLayers(subs)), kv, settings)
    return src, dec, full, draft, Engine(dec, full, draft, list(eos), 64, kv=kv), resident


def _ar_then_subspec(tmp_path, max_context: int, max_new: int, **tree):
    """A tiny qwen2 model: ar's greedy answer to [3, 5, 7] (``max_new`` tokens), and a subspec runtime of the tree
    settings ``tree`` with 2 layers resident (the caller closes it)."""
    path = save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=96, layers=4))
    ref = load(Options(model=str(path), method="ar", dtype="float32", max_context=max_context, offload="none"))
    want = ref.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=max_new))
    ref.close()
    return want, load(Options(model=str(path), method="subspec", dtype="float32", max_context=max_context,
                              device_memory=1 << 30, max_resident=2, **tree))


def _sample_counts(engine, prompt, params, runs):
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        engine.reset()
        params.seed = seed
        out = tuple(engine.generate(prompt, params))
        counts[out] = counts.get(out, 0) + 1
    return counts


def _exact_distribution(path, prompt, params):
    """P(t1, t2, t3 | prompt) under the target's processed distribution, by enumeration with transformers."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    V = m.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(m(torch.tensor([prompt])).logits[0, -1:], params)[0]
        seq2 = torch.tensor([prompt + [a] for a in range(V)])
        p2 = target_probs(m(seq2).logits[:, -1], params)  # [V, V]
        seq3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = target_probs(m(seq3).logits[:, -1], params).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi2_pvalue(counts, exact, runs):
    from scipy.stats import chisquare

    V = exact.shape[0]
    flat = exact.flatten().double()
    obs = torch.zeros_like(flat)
    for (a, b, c), n in counts.items():
        obs[(a * V + b) * V + c] += n
    exp = flat * runs
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = e > 0
    return chisquare(o[keep].numpy(), e[keep].numpy() * o.sum().item() / e[keep].sum().item()).pvalue


class _DraftTrustingEngine(Engine):
    """A deliberately wrong verifier: at every node with children it accepts the draft's best child."""

    def verify(self, tree, chooser):
        path, bonus = super().verify(tree, chooser)  # run the target forward as usual
        choice = chooser(torch.zeros(tree.size, 16), self.cache_len + 1, tree.depths)  # placeholder sample, replaced below where a child exists
        for n in range(tree.size - 1, 0, -1):  # the best-scored child is the first one listed under a parent
            choice[tree.parents[n]] = tree.tokens[n]
        choice[0] = tree.tokens[1] if tree.size > 1 else bonus[0]
        return accept(tree, choice)


TINY_MOE = dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


@pytest.mark.parametrize("model_type,temperature,top_p", [("llama", 1.0, 1.0), ("llama", 0.7, 0.9),
                                                          ("qwen3_moe", 1.0, 1.0)])
def test_sampling_is_lossless_chi_square(tmp_path, model_type, temperature, top_p):
    """Sequences of 3 sampled tokens against their exact law (enumerated with transformers): SubSpec passes; at
    temperature 1 (llama) plain sampling passes and a verifier that trusts the draft fails (the test's power). The
    MoE case drafts with 4-bit substitutes of every expert, routed by the full-precision router."""
    extra = TINY_MOE if model_type == "qwen3_moe" else {}
    path = save_tiny(tmp_path / "m", tiny_config(model_type, True, vocab=16, layers=3, **extra), seed=3, scale=4.0)
    prompt = [3, 9, 1]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=3)
    exact = _exact_distribution(path, prompt, params)
    power_case = temperature == 1.0 and model_type == "llama"
    # SubSpec: 4000 draws where the test's power is shown too, else 2500 and 2000 (the MoE case's forwards are slower;
    # a lossless sampler fails p > 0.01 one time in a hundred at any count). The power check needs far fewer: plain
    # sampling (the chi-square accepting a correct sampler) 1500 draws, the draft-trusting verifier 500 (its p-value
    # was 1e-270 at 500 draws on a Zen 1: far off the exact law)
    runs = 4000 if power_case else 2500 if model_type == "llama" else 2000
    _, dec, full, draft, spec_engine, _ = _tiny_subspec(path)
    p_spec = _chi2_pvalue(_sample_counts(spec_engine, prompt, params, runs), exact, runs)
    assert p_spec > 0.01, p_spec
    if power_case:  # the test's power (shown once): plain sampling passes, a
        # verifier that trusts the draft fails
        ar = Engine(dec, full, NoDraft(), [], 64)
        p_ar = _chi2_pvalue(_sample_counts(ar, prompt, params, 1500), exact, 1500)
        assert p_ar > 0.01, p_ar
        wrong = _DraftTrustingEngine(dec, full, draft, [], 64, kv=draft.kv)
        p_wrong = _chi2_pvalue(_sample_counts(wrong, prompt, params, 500), exact, 500)
        assert p_wrong < 0.01, p_wrong


def test_a_seeded_sampled_answer_is_the_same_at_any_tree_shape_and_equals_ar(tmp_path):
    """The random draws are indexed by output position, not by tree node: a seeded sampled request emits the same
    tokens with a depth-2 tree, a depth-12 tree and plain decoding (FP32; another seed gives another answer)."""
    from dataclasses import replace

    path = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=48, layers=3), seed=3, scale=4.0)
    prompt = [3, 9, 1, 7]
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=32, seed=11, max_new_tokens=48)
    answers = {}
    for depth in (2, 12):
        settings = TreeSettings(depth=depth, topk=3, verify_budget=64, threshold=0.0)
        _, dec, full, draft, eng, _ = _tiny_subspec(path, settings=settings)
        answers[depth] = eng.generate(prompt, replace(params))
        assert eng.last_stats.accepted_tokens >= 8 and eng.last_stats.rounds < 40  # the trees were used
    ar = Engine(dec, full, NoDraft(), [], 64)
    answers["ar"] = ar.generate(prompt, replace(params))
    assert len(answers["ar"]) == params.max_new_tokens
    assert answers[2] == answers["ar"] and answers[12] == answers["ar"], answers
    ar.reset()
    assert ar.generate(prompt, replace(params, seed=12)) != answers["ar"]


def test_a_verify_choosing_from_chunks_of_logits_equals_choosing_from_all(tmp_path):
    """The verify makes the target's logits VERIFY_LOGIT_ROWS nodes at a time (its workspace): on a tree of several
    chunks, greedy and seeded sampling choose what a choice over the whole [N, vocab] logits chooses."""
    from subspec.model import Attention
    from subspec.placement import VERIFY_LOGIT_ROWS
    from subspec.sampling import TokenChooser

    path = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=48, layers=3), seed=3, scale=4.0)
    settings = TreeSettings(depth=40, topk=2, verify_budget=128, threshold=0.0)  # depths beyond a chunk's rows
    _, dec, full, draft, eng, _ = _tiny_subspec(path, settings=settings)
    eng.tokens = [3, 9, 1, 7]
    root = eng.prefill(eng.tokens, TokenChooser(SamplingParams(), "cpu"))
    tree = draft.propose(root, eng.cache_len)
    assert tree.size > 2 * VERIFY_LOGIT_ROWS  # three chunks at least
    L0 = eng.cache_len
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=5)):
        chooser = TokenChooser(params, "cpu")
        logits = dec.forward(tree.tokens, L0 + tree.depths, eng._node_idx[L0:L0 + tree.size],
                             Attention.tree(L0, tree.ancestors), full, eng.kv)
        want = accept(tree, chooser(logits, L0 + 1, tree.depths))
        got = eng.verify(tree, TokenChooser(params, "cpu"))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_per_round_records_are_per_request_and_the_draft_keeps_no_growing_history(tmp_path):
    """Every per-round list of :class:`GenerationStats` has one entry per round of its request (nothing declared and
    left empty), and a long-running engine (a server) keeps no per-round history in the draft: its state after six
    requests is the size it was after one. ``build_proposer`` returns the draft itself."""
    from dataclasses import fields

    from subspec.engine import GenerationStats
    from subspec.speculation import build_proposer

    path = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=48, layers=3), seed=3, scale=4.0)
    src, dec, full, draft, eng, resident = _tiny_subspec(path)
    params = SamplingParams(max_new_tokens=12)

    def sizes():
        return {k: len(v) for k, v in vars(draft).items() if isinstance(v, (list, dict, set))}

    eng.generate([3, 9, 1], params)
    first = sizes()
    st = eng.last_stats
    lists = [f.name for f in fields(GenerationStats) if isinstance(getattr(st, f.name), list)]
    assert lists and st.rounds > 1
    for name in lists:
        assert len(getattr(st, name)) == st.rounds, name
    assert sum(st.draft_depths) == st.draft_steps and max(st.draft_depths) == draft.s.depth
    for i in range(5):
        eng.reset()  # a new conversation, as the server's next client
        eng.generate([4 + i, 9], params)
    assert sizes() == first
    assert len(eng.last_stats.draft_depths) == eng.last_stats.rounds
    proposer = build_proposer(draft.s, dec, resident, draft.layers.rest.subs, draft.kv)
    assert isinstance(proposer, SubSpecDraft)


def test_eos_inside_accepted_run_cuts_exactly(tmp_path):
    path = save_tiny(tmp_path / "m", tiny_config("qwen3", False, vocab=64, layers=3))
    # draft = the target itself (16 bits): every round accepts the whole chain of best guesses
    settings = TreeSettings(depth=6, topk=2, verify_budget=12, threshold=0.0)
    _, dec, full, draft, eng, _ = _tiny_subspec(path, bits=16, settings=settings)
    free = eng.generate([5, 6, 7], SamplingParams(max_new_tokens=30))
    st = eng.last_stats
    assert st.tau > 2.5, "the self-draft should accept several tokens per round"
    # pick a token emitted in the middle of a multi-token round
    pos, start = None, 1
    for n in st.accept_lengths:
        if n >= 3:
            pos = start + 1
            break
        start += n + 1
    assert pos is not None
    stop = free[pos]
    first = free.index(stop)
    _, _, _, _, eng2, _ = _tiny_subspec(path, bits=16, settings=settings, eos=[stop])
    cut = eng2.generate([5, 6, 7], SamplingParams(max_new_tokens=30))
    assert cut == free[:first + 1]
    assert eng2.last_stats.new_tokens == first + 1 == len(cut)
    for st in (eng.last_stats, eng2.last_stats):
        _assert_stats_count_emitted_tokens_only(st)
    # a limit inside a multi-token round: the statistics stop where the tokens stop
    _, _, _, _, eng3, _ = _tiny_subspec(path, bits=16, settings=settings)
    limited = eng3.generate([5, 6, 7], SamplingParams(max_new_tokens=pos + 1))
    assert limited == free[:pos + 1]
    _assert_stats_count_emitted_tokens_only(eng3.last_stats)


class _HeardPolicy:
    """A depth policy that drafts ``depth`` deep every round and records what the draft tells it."""

    def __init__(self, depth: int):
        self.depth, self.prior_steps, self.heard = depth, {}, []

    def observe(self, accepted, depth, ranks=None, complete=True):
        self.heard.append((accepted, depth, complete))

    def observe_costs(self, *a):
        pass

    def observe_single(self, *a):
        pass

    def next_width(self):
        return None

    def next_depth(self):
        return self.depth


def test_a_round_cut_by_the_limit_is_no_miss_of_the_draft(tmp_path):
    """The last round, cut by the token limit inside its accepted run, went on past the tokens kept: neither the
    statistics nor the depth policy count it as a run that stopped (a miss); the policy hears its kept tokens as
    accepted draft tokens (no bonus among them), every complete round as it ran."""
    path = save_tiny(tmp_path / "m", tiny_config("qwen3", False, vocab=64, layers=3))
    settings = TreeSettings(depth=6, topk=2, verify_budget=12, threshold=0.0)
    _, _, _, draft, eng, _ = _tiny_subspec(path, bits=16, settings=settings)  # the self-draft: long runs
    draft.policy = _HeardPolicy(6)
    free = eng.generate([5, 6, 7], SamplingParams(max_new_tokens=30))
    st, heard = eng.last_stats, draft.policy.heard
    assert heard[:-1] == [(a, d, True) for a, d in zip(st.accept_lengths, st.draft_depths)][:len(heard) - 1]
    r = next(i for i, n in enumerate(st.accept_lengths[:-1]) if n >= 3)  # cut this round after its second token
    start = 1 + sum(n + 1 for n in st.accept_lengths[:r])  # the round's first token
    eng.reset()
    draft.policy = _HeardPolicy(6)
    limited = eng.generate([5, 6, 7], SamplingParams(max_new_tokens=start + 2))
    cut = eng.last_stats
    assert limited == free[:start + 2] and cut.rounds == r + 1
    assert draft.policy.heard == heard[:r] + [(2, 6, False)]
    assert cut.accept_lengths[-1] == 2 < cut.draft_depths[-1] == 6  # counted a miss before this change
    assert cut.draft_misses == sum(a < d for a, d in zip(st.accept_lengths[:r], st.draft_depths[:r]))


def _assert_stats_count_emitted_tokens_only(st):
    """new tokens = the prefill's token + per round its emitted draft tokens + its bonus (the last round may have
    lost its bonus, and some draft tokens, to an EOS or the limit)."""
    assert sum(st.accept_lengths) == st.accepted_tokens and len(st.accept_lengths) == st.rounds
    bonuses = st.new_tokens - 1 - st.accepted_tokens
    assert st.rounds - 1 <= bonuses <= st.rounds, (st.new_tokens, st.accepted_tokens, st.rounds)


def test_draft_shares_resident_tensors_and_kv(tmp_path):
    path = save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=64, layers=4))
    gc.collect()
    before = sum(isinstance(o, KVCache) for o in gc.get_objects())
    _, dec, full, draft, eng, resident = _tiny_subspec(path, offloaded=(2, 3))
    assert sum(isinstance(o, KVCache) for o in gc.get_objects()) - before == 1
    assert draft.kv is eng.kv and draft.decoder is eng.decoder
    for i in (0, 1):
        t, d = full.acquire(i), draft.layers.acquire(i)
        for name in ("q_proj", "down_proj"):
            assert getattr(t, name).weight.data_ptr() == getattr(d, name).weight.data_ptr()
    assert isinstance(draft.layers.acquire(2).q_proj, Int4Linear)


PROMPTS = [
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "def quicksort(arr):\n    # complete this Python function"}],
    [{"role": "user", "content": "List five European capitals, one per line."}],
    [{"role": "user", "content": "What is 12 times 7? Answer with the number only."}],
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Explain photosynthesis to a ten-year-old."}],
    [{"role": "user", "content": "Translate to French: The weather is nice today."}],
    [{"role": "user", "content": "Summarize: " + "The city council met on Tuesday to discuss the new park. " * 12}],
    [{"role": "user", "content": "Write a JSON object with keys name and age."}],
    [{"role": "user", "content": "Say only the word yes."}],
]


@pytest.mark.slow
def test_greedy_subspec_lossless_on_smollm2(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    from subspec.runtime import plan_for

    base = load(Options(model=str(smollm2_gguf), method="ar", dtype="float32", max_context=512))
    spec_opts = Options(model=str(smollm2_gguf), method="subspec", dtype="float32", max_context=512)
    full, _ = plan_for(spec_opts, base.source)
    spec_opts.device_memory = full.full_draft_minimum + 6 * full.layer_bytes  # about 5 of 30 layers resident
    spec = load(spec_opts)
    assert len(spec.placement.offloaded) >= 0.75 * 30
    hf = AutoModelForCausalLM.from_pretrained(str(base.source.path), dtype=torch.float32).eval()
    eos = base.source.eos_token_ids
    stopped_early = 0
    for msgs in PROMPTS[0:5:2] + PROMPTS[9:]:  # four of them, two that end on EOS early (more: test_exact_bf16.py)
        ids = base.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        params = SamplingParams(max_new_tokens=64)  # 128-token answers in BF16: test_exact_bf16.py
        base.engine.reset()
        spec.engine.reset()
        ar_out = base.engine.generate(ids, params)
        spec_out = spec.engine.generate(ids, params)
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, eos_token_id=eos,
                                 pad_token_id=eos[0])[0, len(ids):].tolist()
        assert spec_out == ar_out == hf_out, msgs
        stopped_early += len(spec_out) < 64
        assert spec.engine.last_stats.bytes_streamed > 0
    assert stopped_early >= 1, "at least one prompt should end on EOS before the limit"
    spec.close()


def test_adaptive_depth_follows_acceptance_and_costs():
    from subspec.policy import AdaptiveDepth

    p = AdaptiveDepth(t_step=0.02, t_verify=0.2)
    start = p.best()
    for _ in range(20):
        p.observe(accepted=p.best(), depth=p.best())  # every round accepts its whole depth
    assert p.best() > start
    q = AdaptiveDepth(t_step=0.02, t_verify=0.2)
    for _ in range(20):
        q.observe(accepted=0, depth=q.best())  # nothing accepted: drafting is wasted
    assert q.best() < start
    # a cheaper draft step (relative to the verify forward) affords a deeper tree at equal acceptance
    assert AdaptiveDepth(t_step=0.005, t_verify=0.2).best() > AdaptiveDepth(t_step=0.05, t_verify=0.2).best()


def test_adaptive_depth_costs_follow_the_running_generation_and_a_contradicted_calibration_is_dropped(
        tmp_path, monkeypatch):
    """A calibration measured on a busy machine (draft step 6x too slow) is the prior only: the measured rounds pull
    the costs to the quiet figures (the depth grows back), and the cached entry is dropped once, never re-cached."""
    from subspec.cache import read_json, write_json
    from subspec.policy import CALIBRATION_VERSION, AdaptiveDepth, forget_calibration

    calls = []
    busy = AdaptiveDepth(t_step=0.6, t_verify=2.0, on_contradicted=lambda s, v: calls.append((s, v)))
    quiet = AdaptiveDepth(t_step=0.1, t_verify=2.0)
    assert busy.best() < quiet.best()
    for i in range(AdaptiveDepth.CONTRADICT_ROUNDS - 1):
        busy.observe_costs(0.1, 2.0)
    assert not calls  # too few rounds to overrule the calibration
    for _ in range(20):
        busy.observe_costs(0.1, 2.0)
    assert len(calls) == 1 and abs(calls[0][0] - 0.1) < 0.1 * 0.6  # called once, with the measured cost
    assert abs(busy.t_step - 0.1) < 1e-3 and busy.best() == quiet.best()
    agreeing = AdaptiveDepth(t_step=0.1, t_verify=2.0, on_contradicted=lambda s, v: calls.append((s, v)))
    for _ in range(30):
        agreeing.observe_costs(0.12, 1.8)  # within the ratio: the calibration stands
    assert len(calls) == 1

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path))
    path = tmp_path / "calibration.json"
    write_json(path, {f"v{CALIBRATION_VERSION}|a": {"t_draft_step": 0.6}, f"v{CALIBRATION_VERSION}|b": {}})
    forget_calibration("a")
    assert set(read_json(path)) == {f"v{CALIBRATION_VERSION}|b"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_subspec_lossless_tiny(tmp_path):
    path = save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=96, layers=4))
    common = dict(model=str(path), dtype="float32", device="cuda", max_context=128)
    ref = load(Options(method="ar", offload="none", **common)).engine.generate([3, 5, 7], SamplingParams(max_new_tokens=40))
    full = load(Options(method="subspec", device_memory=1 << 30, **common))
    budget = full.placement.full_draft_minimum + full.placement.layer_bytes
    spec = load(Options(method="subspec", offload="host", device_memory=budget, depth=4, topk=3, verify_budget=12, **common))
    assert spec.placement.offloaded
    assert spec.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=40)) == ref


def test_draft_head_is_a_vocabulary_subset_and_verification_uses_the_full_head(tmp_path):
    """The draft ranks among ids 0..N-1 plus the special ids only; the target verifies with its full lm_head, so
    the output (token-identical to ar) contains tokens the draft could never have proposed."""
    from subspec.speculation import DraftHead

    path = save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=96, layers=4))
    ref = load(Options(model=str(path), method="ar", dtype="float32", max_context=128, offload="none"))
    want = ref.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=40))
    dec = ref.decoder
    head = DraftHead(dec, 16, extra=[90], native=False)
    assert head.token_ids.tolist() == list(range(16)) + [90] and head.size == 17
    h = torch.randn(3, dec.lm_head.shape[1])
    assert torch.allclose(head(h), h @ dec.lm_head[head.token_ids].T, atol=1e-5)
    ref.close()
    for bits in (16, 4):  # 4: a 4-bit copy of the subset on the native kernel (where it runs)
        rt = load(Options(model=str(path), method="subspec", dtype="float32", max_context=128, device_memory=1 << 30,
                          max_resident=1, draft_vocab=16, depth=4, topk=2, verify_budget=8, draft_head_bits=bits))
        assert rt.draft.head.size < 96
        four = isinstance(rt.draft.head.main, Int4Linear)
        assert four == (bits == 4 and kernels.native())
        assert any(n == "draft head" for n, _, _ in rt.placement.items) == four  # its memory is accounted
        got = rt.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=40))
        rt.close()
        assert got == want
        assert any(t >= 16 and t not in rt.draft.head.token_ids.tolist() for t in got), got  # only the full head


def test_four_bit_draft_head_is_hqq_of_the_subset_and_cached(tmp_path, monkeypatch, kernel_tier):
    """On every kernel tier: the 4-bit draft head computes the subset's logits with HQQ's de-quantized rows (to bf16
    rounding), and a second start reads it from the cache instead of quantizing again."""
    with kernels.using(kernel_tier):
        _check_four_bit_draft_head(tmp_path, monkeypatch)


def _check_four_bit_draft_head(tmp_path, monkeypatch):
    from subspec import quant
    from subspec.speculation import DraftHead

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))  # the tier's own cache entry, not another tier's
    path = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=96, layers=2))
    src = open_model(path, torch.bfloat16)
    dec = Decoder.from_source(src, torch.bfloat16, "cpu")
    q = quant.load_draft_head(src, dec.lm_head, 48, SubstituteSpec(4, 64))
    head = DraftHead(dec, 48, extra=[90], quantized=q)
    h = torch.randn(6, 64, dtype=torch.bfloat16)
    assert q[0].shape == (48, 32)  # two codes a byte, as stored
    w = quant.dequantize(quant.unpack_codes(q[0], 4), *q[1:3])  # [48, 64] float32, HQQ's reference de-quantization
    want = torch.cat([h.float() @ w.T, h.float() @ dec.lm_head[[90]].float().T], dim=1)
    got = head(h).float()
    assert got.shape == (6, 49) and torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(quant, "hqq_quantize", lambda *a, **k: pytest.fail("quantized again instead of reading"))
    again = quant.load_draft_head(src, dec.lm_head, 48, SubstituteSpec(4, 64))
    assert all(torch.equal(a, b) for a, b in zip(again[:3], q[:3]))


def test_adaptive_depth_chooses_plain_decoding_when_drafting_cannot_pay_and_probes():
    """Depth 0 (no draft forward) wins exactly when no depth beats 1 / t_single tokens/s; while there, every
    PROBE_EVERY-th round drafts at the best depth so a change in acceptance is seen."""
    from subspec.policy import AdaptiveDepth

    # resident model: a verify over the tree costs 3x a one-token forward, draft steps are 60 % of one
    p = AdaptiveDepth(t_step=0.006, t_verify=0.03, t_single=0.01)
    for _ in range(40):
        p.observe(0, 4)  # the target rejects everything: a -> 9 / 50
    a = p.acceptance
    d = p.best_drafting()
    expected = sum(a ** j for j in range(d + 1))
    assert p.rate(d) == pytest.approx(expected / (d * 0.006 + 0.03))
    assert p.rate(0) == pytest.approx(100.0) and p.rate(0) > p.rate(d)
    assert p.best() == 0
    depths = []
    for _ in range(3 * AdaptiveDepth.PROBE_EVERY):
        depth = p.next_depth()
        depths.append(depth)
        if depth == 0:
            p.observe_single(0.01)
        else:
            p.observe(0, depth)
            p.observe_costs(0.006, 0.03)
    probes = [i for i, x in enumerate(depths) if x > 0]
    assert len(probes) == 2 and probes[0] == AdaptiveDepth.PROBE_EVERY, depths
    # the same costs with a draft the target accepts: drafting pays, depth > 0
    q = AdaptiveDepth(t_step=0.006, t_verify=0.03, t_single=0.01)
    for _ in range(40):
        q.observe(8, 8)
    assert q.best() > 0 and q.rate(q.best()) > q.rate(0)
    # without t_single (the user fixed the method), depth 0 is never chosen
    assert AdaptiveDepth(t_step=0.006, t_verify=0.03).best() >= 1


def test_a_round_without_drafting_verifies_the_root_alone_and_output_equals_ar(tmp_path):
    """When the policy picks depth 0 the draft runs no forward and the round is a one-token target forward; the
    output stays ar's."""
    from subspec.policy import AdaptiveDepth

    want, rt = _ar_then_subspec(tmp_path, 128, 40, depth=4, topk=2, verify_budget=8)
    draft = rt.draft
    draft.policy = AdaptiveDepth(t_step=1.0, t_verify=1.0, max_depth=4, t_single=1e-3)  # drafting never pays
    draft.s.depth = 0
    calls = []
    real = draft.decoder.forward
    draft.decoder.forward = lambda *a, **k: (calls.append(k.get("head")), real(*a, **k))[1]
    try:
        got = rt.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=40))
    finally:
        draft.decoder.forward = real
        rt.close()
    assert got == want
    assert not any(h is draft.head for h in calls[:AdaptiveDepth.PROBE_EVERY])  # no draft forward before a probe
    assert rt.engine.last_stats.draft_depths[:AdaptiveDepth.PROBE_EVERY] == [0] * AdaptiveDepth.PROBE_EVERY


def test_draft_on_substitutes_of_every_layer_equals_ar(tmp_path):
    """--draft-layers all: every layer has a 4-bit substitute, the draft never touches a full-precision layer, the
    placement counts the substitutes of the resident layers, and the output equals ar's."""
    from subspec.quant import Int4Linear

    path = save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=96, layers=4))
    ref = load(Options(model=str(path), method="ar", dtype="float32", max_context=128, offload="none"))
    want = ref.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=40))
    ref.close()
    common = dict(model=str(path), method="subspec", dtype="float32", max_context=128, device_memory=1 << 30,
                  max_resident=2, depth=4, topk=2, verify_budget=8)
    part = load(Options(draft_layers="offloaded", **common))
    every = load(Options(draft_layers="all", **common))
    try:
        assert every.placement.resident == [1, 3] and every.placement.substituted == [0, 1, 2, 3]
        assert part.placement.substituted == [0, 2]
        sub = {n: b for n, b, _ in part.placement.items}["substitutes"]
        assert {n: b for n, b, _ in every.placement.items}["substitutes"] == 2 * sub > 0
        for i in range(4):
            lin = every.draft.layers.acquire(i)
            assert all(isinstance(getattr(lin, n), Int4Linear) for n in ("q_proj", "o_proj", "down_proj"))
        assert every.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=40)) == want
    finally:
        part.close()
        every.close()


def test_expand_gives_the_k_best_cumulative_draft_log_probabilities(tmp_path, monkeypatch, kernel_tier):
    """``_expand`` (top-k before normalization, log-sum-exp from the row maximum with clamped exponents) picks the
    pairs and values of the full float64 log-softmax at the draft temperature, on peaked rows whose small terms are
    float32 denormals unclamped: torch's composition and each kernel tier's operator (expand_topk)."""
    src, dec, full, draft, engine, resident = _tiny_subspec(save_tiny(tmp_path / "m", tiny_config("llama", tied=True)))
    torch.manual_seed(5)
    k, T = 4, draft.s.draft_temperature
    logits = torch.randn(3, 4096) * 2
    logits[0, 17] = 30.0  # one dominant token: (x - max) / T reaches -180
    logits[2] = 0.0  # a flat row
    scores = torch.tensor([-0.5, -1.0, -7.0])
    ref = (torch.log_softmax(logits.double() / T, dim=-1) + scores.double()[:, None]).view(-1)
    want_vals, want_flat = torch.topk(ref, k)
    assert draft._native_expand == (dec.k is not None and dec.kernel_tier != "portable")
    monkeypatch.setattr(dec, "k", kernels.ops(kernel_tier))
    for draft._native_expand in (False, True):
        vals, flat = draft._expand(logits.clone(), scores, k)
        assert torch.equal(flat, want_flat), draft._native_expand
        assert torch.allclose(vals.double(), want_vals, rtol=0, atol=1e-4)


def test_accepted_ranks_are_the_frontiers_ranks_and_pruning_keeps_them(tmp_path, monkeypatch, kernel_tier):
    """The rank ``_ranks`` gives an accepted node is its place among the k best of its depth (descending
    cumulative draft probability), the same in the full tree and in the tree pruned to a small verify budget: with
    torch's expansion and with each kernel tier's (expand_topk)."""
    from subspec.sampling import TokenChooser

    path = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=48, layers=3), seed=3, scale=4.0)
    for native in (False, True):
        settings = TreeSettings(depth=5, topk=4, verify_budget=20, threshold=0.0)
        _, dec, _, draft, eng, _ = _tiny_subspec(path, settings=settings)
        monkeypatch.setattr(dec, "k", kernels.ops(kernel_tier))
        draft._native_expand = native
        _check_ranks(draft, eng, TokenChooser(SamplingParams(), "cpu"))


def _check_ranks(draft, eng, chooser) -> None:
    eng.tokens = [3, 9, 1, 7]
    root = eng.prefill(eng.tokens, chooser)
    full = draft.propose(root, eng.cache_len)
    full_drafted = draft._drafted
    n = full.size
    scores = draft.scores[:n].clone()
    draft.s.verify_budget = 6
    pruned = draft.propose(root, eng.cache_len)
    pruned_drafted = draft._drafted
    assert full_drafted is None and pruned_drafted is not None and n == 21 and 1 + 6 <= pruned.size < n
    for d in range(1, 6):  # each depth's nodes: in descending score, 4 of them
        at = (full.depths == d).nonzero()[:, 0]
        assert at.numel() == 4 and torch.all(scores[at][:-1] >= scores[at][1:])
    seen = set()
    for leaf in range(1, pruned.size):  # every path of the pruned tree, ranked in both trees
        chain = [leaf]
        while int(pruned.parents[chain[-1]]) != 0:
            chain.append(int(pruned.parents[chain[-1]]))
        nodes = list(reversed(chain))
        tokens = [int(pruned.tokens[i]) for i in nodes]
        draft._tree, draft._drafted = pruned, pruned_drafted
        ranks = draft._ranks(tokens)
        draft._tree, draft._drafted = full, full_drafted
        assert draft._ranks(tokens) == ranks and len(ranks) == len(tokens)
        seen.update(ranks)
        for i, r in zip(nodes, ranks):  # the pruned tree's rank: the full frontier's
            at = (full.depths == int(pruned.depths[i])).nonzero()[:, 0]
            assert int(full.tokens[at[r]]) == int(pruned.tokens[i])
    assert len(seen) > 1  # (not only first choices)


def test_a_width_chosen_by_the_observed_ranks_changes_no_token(tmp_path, monkeypatch):
    """With the width adapted per round (narrowed by the accepted ranks, a probe at the widest), the greedy output
    stays ar's, and the rounds ran at more than one width."""
    from subspec.policy import AdaptiveDepth

    monkeypatch.setattr(AdaptiveDepth, "WIDTH_ROUNDS", 2)
    monkeypatch.setattr(AdaptiveDepth, "PROBE_EVERY", 5)
    want, rt = _ar_then_subspec(tmp_path, 160, 60, depth=4, topk=4, verify_budget=12)
    try:
        rt.draft.policy = AdaptiveDepth(0.05, {0: 0.1, 12: 0.1}, 4, budget=12, topk=4,
                                        steps={2: 0.001, 3: 0.03, 4: 0.05})  # 2 wide: far cheaper
        got = rt.engine.generate([3, 5, 7], SamplingParams(max_new_tokens=60))
        widths = rt.engine.last_stats.draft_widths
    finally:
        rt.close()
    assert got == want
    assert widths[:2] == [4, 4] and {2, 4} <= set(widths), widths
