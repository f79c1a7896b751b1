"""The tree policy (subspec.policy): verify cost by tree size, depth priced by the nodes a tree holds, and a
calibration that times the draft step the draft really runs."""
from __future__ import annotations

import pytest
import torch

from subspec.costmodel import best_depth, expected_tokens
from subspec.policy import AdaptiveDepth, Calibration, VerifyCurve, calibrate
from subspec.runtime import Options, load
from subspec.speculation import DraftHead, TreeSettings

from conftest import save_tiny, tiny_config


def test_verify_curve_interpolates_measured_points_and_extends_the_last_segment():
    c = VerifyCurve({0: 1.0, 16: 1.2, 32: 1.6, 128: 4.0})
    assert c(0) == 1.0 and c(16) == 1.2 and c(128) == 4.0
    assert c(8) == pytest.approx(1.1) and c(24) == pytest.approx(1.4) and c(80) == pytest.approx(2.8)
    assert c(160) == pytest.approx(4.8)  # beyond the last point: the last segment's slope (0.025 s a node)
    assert c(-3) == 1.0
    assert VerifyCurve(0.5)(100) == 0.5 and VerifyCurve({7: 2.0})(1) == 2.0


def test_a_tree_is_priced_at_the_verify_cost_of_the_nodes_it_holds():
    """A compute-bound verify (its cost grows with the tree, as on a 2-core CPU without AMX) makes shallow trees
    cheaper than full-budget ones: the policy prices a depth-D tree at min(budget, topk * D) nodes and goes
    shallower than one that prices every tree at the full budget would, and exactly the depth the formula gives."""
    steep = {0: 0.10, 16: 0.20, 32: 0.30, 64: 0.50, 128: 0.90}
    p = AdaptiveDepth(t_step=0.01, t_verify=steep, budget=128, topk=6)
    assert p.t_verify(2) == pytest.approx(0.10 + 12 / 16 * 0.10)  # 12 nodes
    assert p.t_verify(40) == pytest.approx(0.90)  # capped at the budget
    want = max(range(1, 49), key=lambda d: expected_tokens(p.acceptance, d) / (d * 0.01 + VerifyCurve(steep)(
        min(128, 6 * d))))
    assert p.best_drafting() == want
    flat = AdaptiveDepth(t_step=0.01, t_verify=0.90)  # every tree priced as a full one
    assert p.best_drafting() < flat.best_drafting()
    assert p.rate(p.best_drafting()) > flat.rate(flat.best_drafting())
    assert best_depth(p.acceptance, 0.01, p.t_verify)[0] == want  # the cost model takes the function of depth


def test_measured_verify_times_scale_the_curve_at_the_size_they_were_measured():
    p = AdaptiveDepth(t_step=0.01, t_verify={0: 0.1, 64: 0.5}, budget=64, topk=4)
    for _ in range(40):
        p.observe_costs(0.01, 2 * VerifyCurve({0: 0.1, 64: 0.5})(8), nodes=8)  # twice the curve at 8 nodes
    assert p.scale == pytest.approx(2.0, rel=1e-3)
    assert p.t_verify() == pytest.approx(1.0, rel=1e-3)  # the whole curve followed: 2 x 0.5 at the budget


def test_calibration_chooses_the_budget_by_the_measured_curve():
    cal = Calibration(0.01, {0: 0.1, 16: 0.11, 32: 0.124, 64: 0.2, 128: 0.4})
    s = cal.choose(TreeSettings(depth=48, topk=6, verify_budget=128), [16, 32, 64, 128], False, False, 48)
    assert s.verify_budget == 32  # the largest within 1.25x of a one-token forward
    slow = Calibration(0.01, {0: 0.1, 16: 0.3, 32: 0.5})
    assert slow.choose(TreeSettings(), [16, 32], False, False, 48).verify_budget == 16


def test_the_budget_is_chosen_by_the_verify_compute_not_its_wait_for_the_disk():
    """Forwards waiting for the disk cost about the same whatever their size; in generation the draft's time hides
    that wait, so the budget follows what the nodes add to the compute (this session's SmolLM2 calibration on an AMX
    machine: wall 99 / 108 / 111 / 112 / 190 ms, which chose 64)."""
    wall = {0: 0.099, 16: 0.108, 32: 0.111, 64: 0.112, 128: 0.190}
    assert Calibration(0.007, wall).choose(TreeSettings(), [16, 32, 64, 128], False, False, 48).verify_budget == 64
    compute = {0: 0.069, 16: 0.090, 32: 0.098, 64: 0.125, 128: 0.164}
    cal = Calibration(0.007, wall, t_verify_compute=compute)
    assert cal.choose(TreeSettings(), [16, 32, 64, 128], False, False, 48).verify_budget == 16
    riding = Calibration(0.007, wall, t_verify_compute={0: 0.069, 16: 0.080, 32: 0.085, 64: 0.125, 128: 0.164})
    assert riding.choose(TreeSettings(), [16, 32, 64, 128], False, False, 48).verify_budget == 32  # the largest fit
    partial = Calibration(0.007, wall, t_verify_compute={0: 0.069, 16: 0.090})  # (not every budget: the wall times)
    assert partial.choose(TreeSettings(), [16, 32, 64, 128], False, False, 48).verify_budget == 64


def test_calibration_times_the_draft_step_the_draft_runs(tmp_path, monkeypatch):
    """The calibrated draft step goes through the draft's own output head (a vocabulary subset, not the lm_head)
    and its top-k expansion, as every step of ``propose`` does."""
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    path = save_tiny(tmp_path / "m", tiny_config("llama", tied=False, vocab=96, layers=4))
    rt = load(Options(model=str(path), method="subspec", dtype="float32", max_context=128, device_memory=10 << 30,
                      max_resident=2, depth=4, topk=2, verify_budget=8, draft_vocab=32))
    try:
        draft = rt.draft
        assert draft.head.size < rt.decoder.lm_head.shape[0]
        heads, expands = [], []
        real_forward, real_expand = rt.decoder.forward, draft._expand
        monkeypatch.setattr(rt.decoder, "forward", lambda *a, **k: (heads.append(k.get("head")), real_forward(*a, **k))[1])
        monkeypatch.setattr(draft, "_expand", lambda *a: (expands.append(a[0].shape), real_expand(*a))[1])
        cal = calibrate(rt.engine, draft, "test-key", [8])
        assert cal.t_draft_step > 0 and set(cal.t_verify) == {0, 8} and set(cal.t_verify_compute) == {0, 8}
        assert all(0 <= cal.t_verify_compute[n] <= cal.t_verify[n] + 1e-3 for n in (0, 8))
        drafted = [h for h in heads if isinstance(h, DraftHead)]
        assert len(drafted) >= 2 and all(h is draft.head for h in drafted)  # every draft step through the draft's head
        assert expands and all(shape == (2, draft.head.size) for shape in expands)  # k rows of the subset's logits
        verified = [h for h in heads if not isinstance(h, DraftHead)]  # the verify forwards: the full lm_head, chosen
        assert len(verified) >= 2 and all(h is not None for h in verified)  # from as the engine's verify does
        hidden = torch.randn(9, rt.decoder.config.hidden_size)
        assert torch.equal(verified[-1](hidden), rt.decoder.lm_head_linear(hidden).argmax(-1))  # 9 nodes: greedy
    finally:
        rt.close()


def test_the_width_fits_what_pruning_keeps_per_depth():
    """A frontier about twice as wide as the nodes a depth keeps after pruning: narrow for a small budget over a deep
    tree (the draft step costs more with each row on CPUs without AMX), the widest for a large budget."""
    from subspec.policy import choose_width

    assert choose_width(16, 15, [2, 3, 4, 6]) == 3  # ceil(32 / 15) = 3
    assert choose_width(16, 40, [2, 3, 4, 6]) == 2
    assert choose_width(128, 13, [2, 3, 4, 6]) == 6  # 20 wanted: the widest there is
    assert choose_width(64, 16, [2, 4, 6]) == 6 and choose_width(64, 32, [2, 4, 6]) == 4
    steps = {2: 0.010, 3: 0.011, 4: 0.012, 6: 0.014}
    cal = Calibration(steps[6], {0: 0.1, 16: 0.11, 32: 0.3}, steps)
    s = cal.choose(TreeSettings(depth=48, topk=6, verify_budget=128), [16, 32], False, False, 48, topk_given=False)
    assert s.verify_budget == 16 and s.topk < 6 and cal.t_draft_step == steps[s.topk]
    fixed = Calibration(steps[6], {0: 0.1, 16: 0.11, 32: 0.3}, steps)
    assert fixed.choose(TreeSettings(depth=48, topk=6, verify_budget=128), [16, 32], False, False, 48).topk == 6


def test_the_width_is_judged_at_its_own_draft_step():
    """Each width is priced at its own draft step: a wide frontier's dearer step makes shallow trees look best, and
    shallow trees ask for a wide frontier. Costs measured on a Zen 3 (avx2, qwen2.5-coder-1.5b at 2.5 GiB, seconds):
    at the 6-wide step the best depth is 12, for which choose_width asks 3; at the 2-wide step it is 17, for which 2
    is enough, and 2 it is."""
    from subspec.policy import AdaptiveDepth, choose_width

    steps = {2: 0.0266, 3: 0.0337, 4: 0.0412, 6: 0.0617}
    t_verify = {0: 0.861, 16: 0.990, 32: 1.209, 64: 1.816, 128: 3.478}
    compute = {0: 0.142, 16: 0.629, 32: 1.067, 64: 1.816, 128: 3.478}
    depth = {w: AdaptiveDepth(steps[w], t_verify, 48, t_single=t_verify[0], budget=16, topk=w).best_drafting()
             for w in steps}
    assert (depth[6], depth[2]) == (12, 17) and choose_width(16, depth[6], list(steps)) == 3
    cal = Calibration(steps[6], t_verify, steps, compute)
    s = cal.choose(TreeSettings(depth=48, topk=6, verify_budget=128), [16, 32, 64, 128], False, False, 48,
                   topk_given=False)
    assert (s.verify_budget, s.topk, cal.t_draft_step) == (16, 2, steps[2])
    assert s.depth == depth[2]


def test_a_new_kernel_build_is_calibrated_again(tmp_path, monkeypatch):
    """The calibration is cached per kernel build, not per tier name: a start with other kernels (a new version's,
    rebuilt from changed sources) measures again instead of choosing trees from the old build's costs."""
    from subspec import kernels, policy

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    path = save_tiny(tmp_path / "m", tiny_config("llama", tied=False, vocab=96, layers=4))
    measured = []
    real_measure = policy.calibrate

    def spy(engine, draft, key, budgets):
        measured.append((key, policy.calibrated(key)))  # (cached already: read, not measured)
        return real_measure(engine, draft, key, budgets)

    monkeypatch.setattr(policy, "calibrate", spy)
    for build in ("amx-000000000001", "amx-000000000001", "amx-000000000002"):
        monkeypatch.setattr(kernels, "build_id", lambda b=build: b)
        rt = load(Options(model=str(path), method="subspec", dtype="float32", max_context=128, device_memory=10 << 30,
                          max_resident=2, topk=2, verify_budget=8))
        rt.close()
    keys, cached = [k for k, _ in measured], [c for _, c in measured]
    assert len(keys) == 3 and "amx-000000000001" in keys[0] and "amx-000000000002" in keys[2]
    assert keys[0] == keys[1] and keys[2] != keys[0]
    assert cached == [False, True, False]  # measured, read back for the same build, measured for the new one


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_verify_compute_leaves_out_the_tiers_wait_except_a_mixture_of_experts_reads(tmp_path, monkeypatch, family):
    """A dense model's calibrated verify compute is its time less its time blocked on the tier; a mixture of experts
    keeps the blocked time (its routed experts are read during the forward, more for bigger trees, and no draft hides
    that). Each forward here is made to have waited a second on the tier."""
    extra = dict(head_dim=16, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=3) if family != "llama" else {}
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    path = save_tiny(tmp_path / "m", tiny_config(family, tied=False, vocab=96, layers=4, **extra))
    rt = load(Options(model=str(path), method="subspec", dtype="float32", max_context=128, device_memory=10 << 30,
                      max_resident=2, depth=4, topk=2, verify_budget=8))
    try:
        assert rt.engine.tier is not None  # (offloaded layers: the tier's counters are real)
        waited = iter(range(1000))
        monkeypatch.setattr(rt.engine, "tier_counters", lambda: (0, float(next(waited))))
        cal = calibrate(rt.engine, rt.draft, f"test-{family}", [8])
        for n in (0, 8):
            if family == "llama":
                assert cal.t_verify_compute[n] == 0.0  # a second subtracted from a forward of milliseconds
            else:
                assert 0 < cal.t_verify_compute[n] <= cal.t_verify[n] + 1e-3
                assert cal.t_verify_compute[n] >= 0.5 * cal.t_verify[n]
    finally:
        rt.close()


# the 1.5B's costs on a Zen 3 (avx2, qwen2.5-coder-1.5b at 2.5 GiB): draft step by width, verify by tree size (s)
ZEN3_STEPS = {2: 0.033, 3: 0.041, 4: 0.052, 6: 0.064}
ZEN3_VERIFY = {0: 0.861, 16: 0.990, 32: 1.209, 64: 1.816, 128: 3.478}


def _zen3_policy(width: int = 4) -> AdaptiveDepth:
    return AdaptiveDepth(ZEN3_STEPS[width], ZEN3_VERIFY, 48, t_single=ZEN3_VERIFY[0], budget=16, topk=width,
                         steps=ZEN3_STEPS)


def test_the_width_narrows_where_the_accepted_nodes_were_the_drafts_first_choices():
    """The ranks of the accepted nodes say what a narrower frontier would have accepted: where they are all 0 or 1,
    2 wide accepts as much as 4 wide for a cheaper step, and the policy narrows to it once it has seen
    WIDTH_ROUNDS rounds (as on the 1.5B: the same tau at 2, 4 and 6 wide); where a rank-3 node sits inside most
    accepted runs, 2 wide would lose them and the width stays."""
    p = _zen3_policy()
    for i in range(AdaptiveDepth.WIDTH_ROUNDS):
        assert p.next_width() == 4  # too few rounds to judge
        p.observe(8, 12, [i % 2, 0, 1, 0, 0, 1, 0, 0])
    assert p.acceptance_at(2) == p.acceptance_at(4) and p.acceptance_at(6) == 0.9  # 6: never observed, the prior
    assert p.next_width() == 2 and p.t_step == ZEN3_STEPS[2]
    assert p.best_at(2)[1] > AdaptiveDepth.WIDTH_MARGIN * p.best_at(4)[1]

    q = _zen3_policy()
    for i in range(AdaptiveDepth.WIDTH_ROUNDS):
        q.next_width()
        q.observe(8, 12, [0, 0, 3, 0, 0, 0, 0, 0])  # the third accepted node was the draft's fourth choice
    # 2 and 3 wide: 2 accepted and a miss a round; 4 wide: 8 and a miss
    assert q.counts[2] == q.counts[3] == [9.0 + 2 * 8, 1.0 + 8] and q.counts[4] == [9.0 + 8 * 8, 1.0 + 8]
    assert q.next_width() == 4


def test_a_narrowed_width_probes_the_next_wider_one_round_in_probe_every():
    """A frontier wider than the one drafted is never observed: one round in PROBE_EVERY drafts at the next wider
    width (its step costs least more), and where that width then predicts more, the policy widens to it, and probes
    the next one."""
    p = _zen3_policy()
    widths = []
    for _ in range(2 * AdaptiveDepth.PROBE_EVERY):
        widths.append(p.next_width())
        p.observe(8, 12, [0] * 8)
    n, every = AdaptiveDepth.WIDTH_ROUNDS, AdaptiveDepth.PROBE_EVERY
    assert widths == [4] * n + [2] * (every - 1 - n) + [3] + [2] * (every - 1) + [3]  # rounds 16 and 32: probes
    widened = None
    for probe in range(1, 11):  # probes at 3 whose runs go through rank 2, while 2-wide rounds accept little
        while p.next_width() != 3:
            p.observe(1, 12, [0])
        p.observe(10, 12, [0, 2] * 5)
        if p.next_width() == 3:
            widened = probe
            break
        p.observe(1, 12, [0])
    assert widened is not None and p.probing is None and p.t_step == ZEN3_STEPS[3]
    seen = []
    for _ in range(AdaptiveDepth.PROBE_EVERY):
        p.observe(10, 12, [0, 2] * 5)
        seen.append(p.next_width())
    assert set(seen) == {3, 4} and seen.count(4) == 1  # the next probe: at 4


def test_a_policy_of_one_width_keeps_it():
    """Without other widths' steps (the width was given, or one was calibrated), the width never changes and ranks
    change nothing."""
    p = AdaptiveDepth(0.05, ZEN3_VERIFY, 48, budget=16, topk=4)
    for _ in range(3 * AdaptiveDepth.WIDTH_ROUNDS):
        p.observe(8, 12, [0] * 8)
        assert p.next_width() == 4
    assert AdaptiveDepth(0.05, 1.0).next_width() is None


def test_a_slower_machine_is_slower_at_every_width_and_a_probe_always_drafts():
    """The drafted width's measured step scales every width's (a width not drafted does not stay at a cheap
    calibration); rounds without drafting do not count toward a probe, and a probe round drafts even where plain
    decoding is predicted faster."""
    p = _zen3_policy()
    for _ in range(40):
        p.observe_costs(2 * ZEN3_STEPS[4], ZEN3_VERIFY[16], 16)  # the step at 4 wide measures twice the calibration's
    assert p.steps[2] == pytest.approx(2 * ZEN3_STEPS[2], rel=1e-3)
    assert p.t_step == pytest.approx(2 * ZEN3_STEPS[4], rel=1e-3)

    q = AdaptiveDepth(ZEN3_STEPS[2], ZEN3_VERIFY, 48, t_single=0.01, budget=16, topk=2, steps=ZEN3_STEPS)
    assert q.best() == 0  # a one-token forward of 10 ms: plain decoding is predicted faster
    for _ in range(3 * AdaptiveDepth.PROBE_EVERY):
        q.observe_single(0.01)
        assert q.next_width() == 2  # plain rounds: no width rounds, no probes
    assert q.width_rounds == 0
    q.plain_rounds = 0  # a drafting round (the depth policy's own probe)
    q.width_rounds = AdaptiveDepth.PROBE_EVERY - 1
    assert q.next_width() == 3 and q.next_depth() >= 1  # the width's probe drafts


def test_a_round_cut_short_is_censored_not_a_miss():
    """A round whose tokens an EOS or the token limit cut inside its accepted run: its accepted tokens count, its
    end is no miss (the run went on); a narrower width whose run ended inside the kept tokens (a rank it cannot
    hold) still misses there."""
    p = _zen3_policy()
    p.observe(3, 12, [0, 2, 0], complete=False)
    assert p.counts[4] == [9.0 + 3, 1.0] and p.counts[3] == [9.0 + 3, 1.0]  # censored at 3: no miss
    assert p.counts[2] == [9.0 + 1, 1.0 + 1]  # 2 wide: the rank-2 node ends its run
    p.observe(3, 12, [0, 2, 0])  # the same run, complete: it stopped at 3 of 12
    assert p.counts[4] == [9.0 + 6, 1.0 + 1] and p.counts[3] == [9.0 + 6, 1.0 + 1]
    p.observe(12, 12, [0] * 12, complete=False)  # cut at the full depth: no miss either way
    assert p.counts[4] == [9.0 + 18, 1.0 + 1]
