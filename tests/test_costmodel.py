"""The cost model (subspec/costmodel.py): its arithmetic, and its predictions against measured runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from subspec.costmodel import Rates, best_depth, expected_tokens, forecast, round_rate
from subspec.families import family_for
from subspec.placement import plan_placement

from conftest import tiny_config


def test_expected_tokens_is_the_geometric_sum_and_the_best_depth_maximizes_the_rate():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 7) == 8.0
    d, rate = best_depth(0.9, 0.05, 1.0, max_depth=48)
    assert rate == pytest.approx(expected_tokens(0.9, d) / (d * 0.05 + 1.0))
    assert all(round_rate(0.9, x, 0.05, 1.0) <= rate for x in range(1, 49))
    # a cheaper draft step or a better acceptance never gives a shallower best tree
    assert best_depth(0.9, 0.01, 1.0)[0] >= d and best_depth(0.95, 0.05, 1.0)[0] >= d


def _placements(budget_layers: float):
    config = tiny_config("qwen2", False, vocab=4096, layers=8, hidden_size=256, intermediate_size=768)
    fam = family_for(config.model_type)
    full = plan_placement(config, fam, torch.bfloat16, None, max_context=256, substitutes=False)
    budget = int(full.minimum + budget_layers * full.layer_bytes) if budget_layers >= 0 else None
    kw = dict(max_context=256, tree_nodes=1 + 16 * 6, verify_nodes=65, draft_width=6)
    return config, {
        "ar": plan_placement(config, fam, torch.bfloat16, budget, max_context=256, substitutes=False),
        "offloaded": plan_placement(config, fam, torch.bfloat16, budget, **kw),
        "all": plan_placement(config, fam, torch.bfloat16, budget, substitute_all=True, **kw),
    }


def test_forecast_reads_the_placements_bytes():
    """t_single = resident bytes / memory + streamed bytes / offload + layers x per-layer cost; a draft step on
    substitutes of every layer reads fewer bytes than one that runs the resident layers themselves."""
    config, p = _placements(3)
    rates = Rates(memory=20e9, offload=1.5e9, per_layer=1e-3, flops=1e12)
    ar = forecast(p["ar"], config, rates, method="ar")
    resident = sum(b for n, b, _ in p["ar"].items if n in ("resident layers", "lm_head"))
    want = resident / 20e9 + p["ar"].offloaded_bytes / 1.5e9 + 8 * 1e-3
    assert ar.t_single == pytest.approx(want) and ar.tokens_per_second == pytest.approx(1 / want)
    off = forecast(p["offloaded"], config, rates, method="subspec", draft_head_bytes=0)
    every = forecast(p["all"], config, rates, method="subspec", draft_head_bytes=0)
    assert p["offloaded"].resident and every.t_step < off.t_step
    assert off.depth >= 1 and off.tokens_per_second > ar.tokens_per_second  # offloading: drafting pays


def test_forecast_falls_back_to_plain_decoding_when_drafting_cannot_pay():
    """Everything resident, a verify over 65 tokens costing several one-token forwards and a poor acceptance:
    no depth beats plain decoding, so the forecast is depth 0 at the one-token rate (what AdaptiveDepth does)."""
    config, p = _placements(-1)
    rates = Rates(memory=20e9, offload=1.5e9, per_layer=1e-3, flops=2e9)
    f = forecast(p["offloaded"], config, rates, method="subspec", acceptance=0.3)
    assert f.depth == 0 and f.tokens_per_second == pytest.approx(1 / f.t_single)
    assert round_rate(0.3, 1, f.t_step, f.t_verify) < 1 / f.t_single


# The README's benchmark runs, as `subspec bench` wrote them (docs/bench-*/results.jsonl: BF16, disk tier, run-capped
# with the model files evicted, 2 cores): per run, the measured seconds per draft step and per verify forward (totals /
# draft_steps and / rounds), the accepted draft tokens and the draft misses (rounds that stopped before their depth),
# and the measured end-to-end tokens per second (all new tokens over all wall time, prefill included).
DOCS = Path(__file__).resolve().parent.parent / "docs"
RECORDED = sorted(p.parent.name for p in DOCS.glob("bench-*/results.jsonl")
                  if any(json.loads(line).get("draft_steps") for line in p.open()))


def _recorded(name: str) -> dict:
    runs = [r for r in map(json.loads, (DOCS / name / "results.jsonl").open()) if r["method"] == "subspec"]
    total = lambda key: sum(r[key] for r in runs)  # noqa: E731
    return dict(t_step=total("draft_seconds") / total("draft_steps"), t_verify=total("verify_seconds") / total("rounds"),
                accepted=sum(sum(r["accept_lengths"]) for r in runs), misses=total("draft_misses"),
                measured=total("new_tokens") / total("wall_seconds"))


def test_the_recorded_runs_are_there():
    assert {"bench-smollm2", "bench-qwen2.5-coder-1.5b"} <= set(RECORDED), RECORDED


@pytest.mark.parametrize("name", RECORDED)
def test_predicted_tokens_per_second_within_15_percent_of_measured(name):
    """The rate the depth policy maximizes, E(D*) / (D* t_step + t_verify) at its best depth D*, with the acceptance
    estimated as the policy does (accepted / (accepted + misses)), against the measured tokens/s of the same run."""
    r = _recorded(name)
    a = r["accepted"] / (r["accepted"] + r["misses"])
    depth, predicted = best_depth(a, r["t_step"], r["t_verify"])
    assert 4 <= depth <= 48  # drafting deep pays on every recorded run
    assert abs(predicted - r["measured"]) <= 0.15 * r["measured"], (name, predicted, r["measured"])
