"""The plan is what happens: peak memory while loading and generating stays within the placement's total.

Each start runs in a fresh process (tests/peak_memory_worker.py): its fixed overhead (interpreter, torch,
transformers, the tokenizer) is measured before any weight is read; every peak above it must fit the plan. The
default model in FP32 at ar's minimum budget and, for subspec, with room for half the substitutes (every layer
offloaded): a first start (packing, quantizing, calibrating in an empty cache; the GGUF conversion is shared) and a
later start, greedy and sampling. The model's files (the FP32 conversion) are larger than the budget: a model that
does not fit in its memory loads and generates within it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("peak_memory_worker.py")


def _start(model: Path, method: str, budget: int, cache: Path) -> dict:
    env = dict(os.environ, SUBSPEC_CACHE=str(cache))
    r = subprocess.run([sys.executable, str(WORKER), str(model), method, "float32", str(budget), "512"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["subspec", "ar"])
def test_peak_memory_stays_within_the_plan(smollm2_gguf, tmp_path, method):
    from subspec.loading import open_model
    from subspec.runtime import Options, plan_for

    src = open_model(smollm2_gguf, torch.float32)  # the conversion, shared with the private cache below
    opts = Options(model=str(smollm2_gguf), method=method, dtype="float32", max_context=512)
    full = plan_for(opts, src)[0]
    # subspec: a budget with room for half the substitutes (the draft skips the other layers); ar: its minimum
    budget = full.minimum + (int(15 * full.substitute_layer_bytes * 1.1) if method == "subspec" else 0)
    session, cache = Path(os.environ["SUBSPEC_CACHE"]), tmp_path / "cache"
    shutil.copytree(session / "models", cache / "models", copy_function=os.link)
    shutil.copy(session / "digests.json", cache / "digests.json")
    weights = sum(f.stat().st_size for f in (cache / "models").rglob("*.safetensors"))  # what the run reads
    for start in ("first", "later"):
        m = _start(smollm2_gguf, method, budget, cache)
        assert m["plan"] <= m["budget"] == budget < weights  # a model whose files do not fit in the memory it gets
        for phase in ("load", "greedy", "sampling"):
            assert m[phase] <= m["plan"], (start, phase, m[phase] / 2**20, m["plan"] / 2**20, m)
        if method == "subspec":
            assert "the draft skips" in m["placement"], m["placement"]


RECLAIM = """
import gc, sys, weakref
from subspec.runtime import Options, load
rt = load(Options(model=sys.argv[1], method="subspec", dtype="float32", max_context=64, device_memory=1 << 30,
                  max_resident=1, depth=2, topk=2, verify_budget=4))
assert gc.get_freeze_count() > 0
head = weakref.ref(rt.decoder.lm_head)
rt.decoder.cycle = rt.decoder  # a cycle among the frozen objects: only the cyclic collector can free it
rt.close()
del rt
gc.collect()
print(head() is None)
"""


def test_a_closed_runtime_in_a_reference_cycle_is_reclaimed(tmp_path):
    """``load`` freezes the loaded objects out of the cyclic garbage collector's sight (a draft step's speed);
    ``close`` of the last runtime hands them back, so a closed runtime caught in a reference cycle is still freed (in
    a process of its own: a runtime another test left open would hold the freeze, see tests/test_process.py)."""
    from conftest import save_tiny, tiny_config

    path = save_tiny(tmp_path / "m", tiny_config("llama", tied=False))
    r = subprocess.run([sys.executable, "-c", RECLAIM, str(path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "True"


def _sdpa_allocated(dtype, math: bool) -> tuple[int, int]:
    """Bytes torch allocates inside one prefill-sized SDPA call as Decoder.attend makes it (SmolLM2's heads: 9 query,
    3 KV heads of 64; a 256-token chunk over 1024 keys, boolean mask), and the size of its float32 score matrix."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    T, keys, nh, kvh, hd = 256, 1024, 9, 3, 64
    q = torch.randn(1, nh, T, hd, dtype=dtype)
    k, v = torch.randn(1, kvh, keys, hd, dtype=dtype), torch.randn(1, kvh, keys, hd, dtype=dtype)
    mask = (torch.arange(keys)[None, :] <= torch.arange(T)[:, None] + keys - T)[None, None]
    backends = [SDPBackend.MATH] if math else list(SDPBackend.__members__.values())
    with sdpa_kernel(backends), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=hd ** -0.5)
    return sum(max(e.self_cpu_memory_usage, 0) for e in p.events()), nh * T * keys * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_workspace_holds_attention_scores_only_where_torch_materializes_them(dtype):
    """The placement reserves the [heads, T, keys] scores only where SDPA's math kernel would run (the dispatcher's
    answer, attention_materializes_scores): then a call allocates them; otherwise a fused kernel allocates well under
    a quarter of them. The measuring itself is checked on the math kernel, forced."""
    from transformers import LlamaConfig

    from subspec.model import attention_materializes_scores

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    forced, scores = _sdpa_allocated(dtype, math=True)
    assert forced >= scores  # the profiler sees a materialized score matrix
    allocated, _ = _sdpa_allocated(dtype, math=False)
    if attention_materializes_scores(cfg, "cpu", dtype):
        assert allocated >= scores
    else:
        assert allocated < scores / 4, (allocated, scores)


def test_a_torch_that_cannot_say_gets_the_scores_reserved(monkeypatch):
    from transformers import LlamaConfig

    from subspec.model import attention_materializes_scores
    from subspec.placement import plan_placement
    from subspec.families import family_for

    def refuse(*a, **k):
        raise RuntimeError("no such query")

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                      num_hidden_layers=4, vocab_size=1024)
    monkeypatch.setattr(torch, "_fused_sdp_choice", refuse)
    assert attention_materializes_scores(cfg, "cpu", torch.bfloat16)
    fam = family_for("llama")
    work = {s: dict((n, b) for n, b, _ in plan_placement(cfg, fam, torch.bfloat16, None, max_context=1024,
                                                         attention_scores=s).items)["workspace"] for s in (True, False)}
    # the float32 scores of a 256-token prefill chunk over 1025 slots, less the masks a fused kernel takes instead
    assert work[True] - work[False] >= 9 * 256 * 1025 * 4 - 5 * 256 * 1025
