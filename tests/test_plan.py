"""Planning (subspec.plan): one pure step, one frozen plan, printed the same by `plan` and `generate`, assembled by
`load` without planning again."""
from __future__ import annotations

import dataclasses

import pytest

from subspec import plan as plan_module
from subspec.errors import SubspecError
from subspec.loading import open_model
from subspec.plan import DEMO_RESIDENT_LAYERS, make_plan
from subspec.runtime import Options, load

from conftest import save_tiny, tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("plan") / "m", tiny_config("qwen2", False, vocab=96, layers=4))


def _count_placements(monkeypatch) -> list[int]:
    calls = []
    real = plan_module.plan_placement
    monkeypatch.setattr(plan_module, "plan_placement", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("method", ["subspec", "ar"])
def test_a_load_plans_once_and_builds_exactly_the_plan(tiny, monkeypatch, method):
    """``load`` makes one plan (the placements a single :func:`make_plan` makes, --draft-layers auto's two and the
    method advice's included), never patches it, and its runtime holds that plan's placement."""
    opts = Options(model=str(tiny), method=method, dtype="float32", max_context=128, device_memory=1 << 30,
                   max_resident=2, depth=4, topk=2, verify_budget=8)
    calls = _count_placements(monkeypatch)
    plan = make_plan(opts, open_model(tiny))
    per_plan = len(calls)
    assert per_plan >= 1
    calls.clear()
    rt = load(opts)
    try:
        assert len(calls) == per_plan  # one planning, nothing else
        assert rt.placement.resident == plan.placement.resident and rt.placement.items == plan.placement.items
    finally:
        rt.close()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.placement.stream_ratio = 0.5  # a plan does not change after planning


def test_the_demo_budget_is_planned_in_the_one_plan(tmp_path):
    """Without --device-memory the demo budget (the minimum + a few layers) is part of the plan, not a second one."""
    path = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=96, layers=12))
    src = open_model(path)
    full = make_plan(Options(model=str(path), dtype="float32", max_context=128), src)
    demo = make_plan(Options(model=str(path), dtype="float32", max_context=128, demo_budget=True), src)
    assert demo.opts.device_memory == full.placement.full_draft_minimum + DEMO_RESIDENT_LAYERS * demo.placement.layer_bytes
    assert demo.placement.budget == demo.opts.device_memory and 0 < len(demo.placement.offloaded) < 12


def test_plan_and_generate_print_the_same_plan(smollm2_gguf, tmp_path):
    """`subspec plan --no-forecast` prints the plan that `subspec generate --show-plan` prints and then runs; the
    generate path plans once (the demo budget included)."""
    from cli_process import run_cli

    args = ["--model", str(smollm2_gguf), "--device-memory", "300MiB", "--max-context", "512"]
    plan = run_cli("plan", "--no-forecast", *args)
    assert plan.returncode == 0, plan.stderr
    gen = run_cli("generate", "Hi", "--show-plan", "--max-new-tokens", "2", *args)
    assert gen.returncode == 0, gen.stderr
    text = plan.stdout.strip()
    assert text in gen.stderr and "kernels:" in text and "draft:" in text and "offloaded layers:" in text


@pytest.mark.parametrize("budget", ["225MiB", "400MiB"])
def test_the_plan_advises_ar_wherever_its_forecast_says_ar_is_faster(smollm2_gguf, budget, monkeypatch):
    """Not only where ar fits whole: near subspec's minimum (a few staging slots) the same one line, from the same
    forecast (the tier's default rates) as the plan's own rows; none where subspec is predicted faster. (At 225 MiB
    a fresh user measured ar 6.80 against subspec 6.44 tokens/s and saw no advice.)"""
    from subspec.costmodel import Rates, forecast
    from subspec.placement import parse_bytes
    from subspec.speculation import draft_head_bytes

    monkeypatch.setattr(plan_module, "_kernel_tier", lambda opts, device: "avx512")  # one tier's rates on any CPU
    source = open_model(smollm2_gguf, convert=False)
    opts = Options(model=str(smollm2_gguf), device_memory=parse_bytes(budget))
    plan = make_plan(opts, source)
    ar = make_plan(dataclasses.replace(opts, method="ar"), source)
    assert ar.placement.offloaded  # ar offloads too at both budgets
    rates = Rates.for_tier(plan.kernels)
    t_ar = forecast(ar.placement, source.config, rates, method="ar").tokens_per_second
    t_sub = forecast(plan.placement, source.config, rates, method="subspec", topk=plan.tree_settings().topk,
                     draft_head_bytes=draft_head_bytes(source.config, None, plan.dtype)).tokens_per_second
    if t_sub < t_ar:
        assert plan.advice and "plain decoding (--method ar) is predicted faster" in plan.advice
        assert f"({t_ar:.1f} against {t_sub:.1f} tokens/s at the avx512 tier" in plan.advice
        assert "advice:" in plan.describe()
    else:
        assert plan.advice is None
    assert (t_sub < t_ar) == (budget == "225MiB")  # the two sides are both reached


@pytest.mark.parametrize("budget", ["225MiB", "250MiB", "300MiB", "380MiB"])
def test_auto_draft_layers_names_the_choice_it_placed(smollm2_gguf, budget, monkeypatch):
    """The plan records auto's pick ('all' or 'offloaded'): the explicit choice of that name places the same, also
    below the budget where every substitute fits (there the placement's substitute_all flag is False whatever was
    chosen, so it cannot tell)."""
    from subspec.placement import parse_bytes

    monkeypatch.setattr(plan_module, "_kernel_tier", lambda opts, device: "avx512")
    source = open_model(smollm2_gguf, convert=False)
    opts = Options(model=str(smollm2_gguf), device_memory=parse_bytes(budget))
    plan = make_plan(opts, source)
    assert plan.draft_choice in ("all", "offloaded")
    assert make_plan(dataclasses.replace(opts, draft_layers=plan.draft_choice), source).placement == plan.placement
    assert make_plan(dataclasses.replace(opts, method="ar"), source).draft_choice is None


def test_one_planning_per_cli_generate(smollm2_gguf, monkeypatch, capsys):
    """The CLI's generate (the demo model's budget computed in the plan) calls make_plan once."""
    from subspec.cli import main

    calls = []
    real = plan_module.make_plan
    monkeypatch.setattr(plan_module, "make_plan", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with pytest.raises(SystemExit) as done:
        main(["generate", "Hi", "--max-new-tokens", "2", "--method", "ar", "--max-context", "256"])
    assert done.value.code == 0
    assert len(calls) == 1
    assert "demo: --device-memory" in capsys.readouterr().err


def test_a_fully_resident_plan_predicts_no_drafting_and_a_small_verify(tiny):
    """Everything resident: the forecast picks the smallest useful verify (a verify's compute grows with its tree) and
    says drafting does not pay, rather than pricing a 129-token verify."""
    from subspec.costmodel import Rates, forecast, forward_seconds

    src = open_model(tiny)
    p = make_plan(Options(model=str(tiny), dtype="float32", max_context=128), src)
    assert not p.placement.offloaded
    rates = Rates(memory=20e9, offload=1.5e9, per_layer=1e-4, flops=1e9)
    f = forecast(p.placement, src.config, rates, method="subspec", topk=6)
    c = src.config
    params = 4 * (4 * c.hidden_size ** 2 + 3 * c.hidden_size * c.intermediate_size)
    resident = sum(b for n, b, _ in p.placement.items if n in ("resident layers", "lm_head"))
    full_tree = forward_seconds(resident, 0, 4, 129, params, 0, rates)
    assert f.depth == 0 and f.t_verify == pytest.approx(forward_seconds(resident, 0, 4, 7, params, 0, rates))
    assert f.t_verify < full_tree / 5  # a depth-1 tree (top-k 6), not a 129-token verify
    assert "draft: none needed, every layer resident" in p.describe()


def test_the_plan_predicts_the_bytes_the_first_start_writes(tiny, tmp_path, monkeypatch):
    """`plan`'s disk line: the offloaded layers' files and the substitutes it predicts are what a first start writes
    into an empty cache (within 5 %, beside the files' headers)."""
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    opts = Options(model=str(tiny), dtype="float32", max_context=128, device_memory=1 << 30, max_resident=1, depth=4,
                   topk=2, verify_budget=8)
    plan = make_plan(opts, open_model(tiny))
    want = dict(plan.cache_bytes)
    assert set(want) == {"offloaded layers", "substitutes"} and "disk: the first start writes about" in plan.describe()
    rt = load(opts)
    rt.close()
    size = lambda folder: sum(p.stat().st_size for p in (tmp_path / "cache" / folder).rglob("*") if p.is_file())  # noqa: E731
    assert size("packed") == pytest.approx(want["offloaded layers"], rel=0.05)
    n = len(plan.placement.substituted)  # + one safetensors header (~3 KiB) per substitute file
    assert size("substitutes") == pytest.approx(want["substitutes"] + 3 * 1024 * n, rel=0.05)


def test_a_first_start_that_cannot_fit_its_files_is_refused_before_writing_any(tiny, tmp_path, monkeypatch):
    """The whole first start's files (what the plan predicts) are checked against the free space before the first
    is written: with room for the substitutes but not also the offloaded layers, one error and an empty cache (each
    phase checked only its own files: a start wrote the substitutes, then failed)."""
    import shutil
    from collections import namedtuple

    from subspec import cache
    from subspec.plan import first_start_cache_bytes, first_start_work

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    opts = Options(model=str(tiny), dtype="float32", max_context=128, device_memory=1 << 30, max_resident=1, depth=4,
                   topk=2, verify_budget=8)
    source = open_model(tiny)
    plan = make_plan(opts, source)
    want = dict(plan.cache_bytes)
    total = sum(first_start_cache_bytes(plan, first_start_work(plan, source)).values())
    assert total == pytest.approx(sum(want.values()), rel=0.02)  # the plan's disk line, from the work still to do
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    free = cache.DISK_MARGIN + want["substitutes"] + want["offloaded layers"] // 2
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda p: usage(real(p).total, real(p).used, free))
    with pytest.raises(SubspecError, match=r"not enough disk space for this model's first start .* needs") as e:
        load(opts)
    assert "\n" not in str(e.value)
    assert not [f for f in (tmp_path / "cache").rglob("*") if f.is_file() and f.suffix in (".bin", ".safetensors")]
    monkeypatch.setattr(cache.shutil, "disk_usage", real)
    load(opts).close()
    assert first_start_cache_bytes(plan, first_start_work(plan, open_model(tiny))) == {}  # a later start writes none
    # the weights' file touched (its digest no longer remembered): the cache still holds everything under the same
    # content, so a start on a full disk is not refused for files it would not write
    import os

    for f in tiny.glob("*.safetensors"):
        os.utime(f, (f.stat().st_atime, f.stat().st_mtime + 60))
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda p: usage(real(p).total, real(p).used, cache.DISK_MARGIN))
    load(opts).close()


def test_a_library_load_of_a_gguf_checks_the_space_before_converting(smollm2_gguf, tmp_path, monkeypatch):
    """`load(opts)` without a plan (the bench's workers, the library) plans from the GGUF's metadata first: on a full
    disk the conversion is refused before it writes (it was converted first, then the rest refused)."""
    import shutil
    from collections import namedtuple

    from subspec import cache

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache.shutil, "disk_usage",
                        lambda p: usage(real(p).total, real(p).used, cache.DISK_MARGIN + (1 << 20)))
    with pytest.raises(SubspecError, match=r"first start \(conversion, substitutes, coded layers\)"):
        load(Options(model=str(smollm2_gguf), device_memory=300 << 20, max_context=256))
    assert not [f for f in (tmp_path / "cache").rglob("*") if f.is_file() and f.suffix in (".bin", ".safetensors")]


REAL_SHAPES = {  # the configs of real models (sizes only; the weights are generated, never read)
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "Qwen2.5-14B": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
}
SUBSPEC_MARGIN = 256 << 20
"""What subspec may need beyond plain offloading's minimum: its draft head, the tree's KV slots and workspace."""


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_subspec_runs_at_every_budget_plain_offloading_runs_at(name):
    """subspec's minimum budget is ar's plus a small fixed margin on real model shapes (the plan is arithmetic, no
    weights are read): below the budget for every substitute the draft keeps those that fit and skips the rest."""
    from transformers import AutoConfig

    from subspec.loading import RandomSource

    kw = dict(REAL_SHAPES[name])
    src = RandomSource(AutoConfig.for_model(kw.pop("model_type"), max_position_embeddings=32768, **kw))
    budget = 6 << 30  # any budget both methods run at: the minimum does not depend on it

    def plan(method: str, device_memory: int = budget):
        return make_plan(Options(model="<random>", method=method, max_context=2048, device_memory=device_memory), src)

    ar_min, sub_min = plan("ar").placement.minimum, plan("subspec").placement.minimum
    assert ar_min <= sub_min <= ar_min + SUBSPEC_MARGIN, (name, ar_min / 2**20, sub_min / 2**20)
    at_min = plan("subspec", sub_min).placement  # plans (raised before: substitutes of every layer needed room)
    assert at_min.resident == [] and at_min.total <= sub_min
    short = plan("subspec", sub_min + int(2.5 * at_min.substitute_layer_bytes * 1.1))
    p = short.placement
    assert p.resident == [] and len(p.substituted) == 2 and len(p.draft_skipped) == len(p.offloaded) - 2
    assert "the draft skips" in short.describe()
    with pytest.raises(SubspecError, match="minimum"):
        plan("subspec", sub_min - 1)


@pytest.mark.parametrize("budget_gib", [2.5, 2.8])
def test_coded_slots_read_ahead_within_the_budget(kernel_tier, budget_gib):
    """Where the offloaded layers are coded (BF16 on a native tier), the staging slots hold coded streams (about 60 % of
    a layer) and the plan may give up resident layers for more of them (the disk fills them while the draft runs):
    on Qwen2.5-1.5B's shape every plan's items add up within the budget, the slots row is slots x slot bytes, there
    are at least 2 and at most one per offloaded layer, and the runtime's real slots (sized by the real streams, here
    74 % of a layer: fewer of them) never take more than the plan's bytes."""
    from transformers import AutoConfig

    from subspec import kernels
    from subspec.codec import CodedLayer, slot_bytes
    from subspec.loading import RandomSource
    from subspec.runtime import _staging_slots

    kw = dict(REAL_SHAPES["Qwen2.5-1.5B"])
    src = RandomSource(AutoConfig.for_model(kw.pop("model_type"), max_position_embeddings=32768, **kw))
    budget = int(budget_gib * 2**30)
    with kernels.using(kernel_tier):
        plan = make_plan(Options(model="<random>", max_context=1024, device_memory=budget), src)
    p = plan.placement
    assert plan.coded and plan.kernels == kernel_tier
    assert p.total <= budget and p.offloaded
    assert p.slot_bytes == slot_bytes(p.layer_bytes) < p.layer_bytes
    assert 2 <= p.staging_slots <= len(p.offloaded)
    assert dict((n, b) for n, b, _ in p.items)["staging slots"] == p.staging_slots * p.slot_bytes
    big = {i: CodedLayer(None, int(0.74 * p.layer_bytes) // 4096 * 4096, ()) for i in p.offloaded}
    n = _staging_slots(p, big, p.layer_bytes)
    assert 2 <= n <= p.staging_slots and (n == 2 or n * max(c.stream_bytes for c in big.values())
                                           <= p.staging_slots * p.slot_bytes)
    n = _staging_slots(p, {i: big[i] for i in p.offloaded[1:]}, p.layer_bytes)  # one stayed plain: whole layers
    assert 2 <= n <= p.staging_slots and (n == 2 or n * p.layer_bytes <= p.staging_slots * p.slot_bytes)
    fixed = make_plan(Options(model="<random>", max_context=1024, device_memory=budget, staging_slots=2), src)
    assert fixed.placement.staging_slots == 2  # --staging-slots: as given, no resident layer traded


def test_coded_layers_decode_on_the_compute_threads_in_the_forecast(tiny):
    """A verify of coded layers costs, beside their bytes at the disk's rate, their weights at the decode rate added to
    their compute (the larger of the two): with a fast disk, the decode's seconds exactly."""
    from subspec.costmodel import Rates, forecast

    src = open_model(tiny)
    p = make_plan(Options(model=str(tiny), dtype="float32", max_context=128, device_memory=1 << 30, max_resident=1,
                          depth=4, topk=2, verify_budget=8), src).placement
    assert p.offloaded and p.stream_ratio == 1.0
    coded = dataclasses.replace(p, stream_ratio=0.57)
    c = src.config
    per_layer = 4 * c.hidden_size ** 2 + 3 * c.hidden_size * c.intermediate_size
    fast = Rates(memory=20e9, offload=1e15, per_layer=1e-4, flops=1e9, decode=1e15)
    slow = dataclasses.replace(fast, decode=1e6)
    kw = dict(method="subspec", verify_tokens=9, topk=2)
    t_fast, t_slow = (forecast(coded, c, r, **kw) for r in (fast, slow))
    assert t_slow.t_single - t_fast.t_single == pytest.approx(len(p.offloaded) * per_layer / 1e6, rel=1e-6)
    assert forecast(p, c, slow, **kw).t_single == pytest.approx(t_fast.t_single, rel=1e-3)  # plain layers: no decode


def test_a_planned_coded_ratio_is_marked_as_an_estimate(tiny):
    """Before the coded files exist the plan's ratio is CODED_RATIO, an estimate: the summary marks it and the bytes
    it gives with "~" (the quick start's first line said 58 % and its last 57 %, both unmarked); the runtime's
    measured ratio is unmarked (test_exact_bf16 checks a real run's)."""
    from subspec.placement import fmt_bytes

    p = make_plan(Options(model=str(tiny), dtype="float32", max_context=128, device_memory=1 << 30, max_resident=1,
                          depth=4, topk=2, verify_budget=8), open_model(tiny)).placement
    assert p.offloaded and not p.stream_ratio_estimated and "~" not in p.summary()
    est = dataclasses.replace(p, stream_ratio=0.58, stream_ratio_estimated=True)
    assert "coded to ~58%" in est.summary() and f"~{fmt_bytes(est.offloaded_bytes)} streamed" in est.summary()
    measured = dataclasses.replace(est, stream_ratio=0.57, stream_ratio_estimated=False)
    assert "coded to 57%" in measured.summary() and "~" not in measured.summary()


def test_sizes_are_binary_and_a_fraction_needs_a_unit():
    """1GB = 1GiB (binary, as the --help says); a bare fraction is a size whose unit was left out: an error naming
    the fix, never 1 byte."""
    from subspec.errors import SubspecError
    from subspec.placement import parse_bytes

    assert parse_bytes("1.5GiB") == parse_bytes("1.5GB") == parse_bytes("1.5g") == 3 << 29
    assert parse_bytes("800MiB") == 800 << 20 and parse_bytes("4096") == 4096
    with pytest.raises(SubspecError, match=r"'1\.5' has no unit.*1\.5GiB"):
        parse_bytes("1.5")
    with pytest.raises(SubspecError, match="cannot read the size"):
        parse_bytes("abc")
