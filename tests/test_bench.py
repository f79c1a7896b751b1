"""subspec bench: prompt parsing, aggregation, and a small real run that writes every output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from subspec.bench.prompts import load_prompts, split_count
from subspec.bench.report import write_table
from subspec.bench.runner import BenchConfig, first_divergence, summarize
from subspec.bench.methods import Method
from subspec.errors import SubspecError
from subspec.runtime import Options

from conftest import SHARED


def test_prompt_sources_and_categories(tmp_path):
    f = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "second"]}
            for i, c in enumerate(["writing", "math_reasoning", "coding", "math_reasoning", "qa"])]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_prompts(str(f), ["mt_bench:1", "gsm8k:2"])
    assert [(p.id, p.category, p.text) for p in got] == [("0", "mt_bench", "q0"), ("1", "gsm8k", "q1"),
                                                         ("3", "gsm8k", "q3")]
    assert [p.id for p in load_prompts(f"{f}:2")] == ["0", "1"]
    assert split_count("a:b:12") == ("a:b", 12) and split_count("builtin") == ("builtin", None)
    assert len(load_prompts("builtin:3")) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(SubspecError, match="bad.jsonl:1"):
        load_prompts(str(bad))
    with pytest.raises(SubspecError, match="no prompts"):
        load_prompts(str(f), ["roleplay"])


def test_a_category_that_selects_nothing_is_an_error_naming_it(tmp_path):
    """A misspelt --categories entry would just shrink the benchmark: it is an error naming it (over every source:
    HumanEval and builtin prompts are kept whole beside a filtered file, as the README's benchmarks use them);
    --categories without a Spec-Bench file is an error too."""
    from subspec.bench.prompts import check_categories

    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]})
                           for i, c in enumerate(["writing", "math_reasoning"])) + "\n")
    got = load_prompts(str(f), ["gsm8k", "nosuch"])
    assert [p.category for p in got] == ["gsm8k"]
    with pytest.raises(SubspecError, match="categor.*nosuch.*check --categories"):
        check_categories(got, ["gsm8k", "nosuch:3"], [str(f)])
    both = got + load_prompts("builtin:2", ["gsm8k"])
    assert [p.category for p in both][:1] == ["gsm8k"] and len(both) == 3  # the builtin ones kept whole
    check_categories(both, ["gsm8k"], [str(f), "builtin:2"])
    with pytest.raises(SubspecError, match="Spec-Bench file"):
        check_categories(load_prompts("builtin"), ["gsm8k"], ["builtin"])


@pytest.mark.parametrize("args, fragment", [(["--methods", "ar,foo"], "unknown method(s) foo"),
                                            (["--methods", "draft-model"], "needs --draft-model"),
                                            (["--categories", "nosuch"], "Spec-Bench file"),
                                            (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1")])
def test_bad_bench_arguments_fail_before_any_work_or_output(tmp_path, args, fragment):
    """Checked before the demo budget's plan line and before the output folder is made."""
    from cli_process import run_cli

    out = tmp_path / "out"
    r = run_cli("bench", "--out", str(out), *args, env=dict(os.environ), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("subspec: note: ")]
    assert len(lines) == 1 and lines[0].startswith("subspec: error: ") and fragment in lines[0], r.stderr
    assert not out.exists()


@pytest.mark.skipif(not (SHARED / "data" / "spec_bench_questions.jsonl").exists(), reason="shared data missing")
def test_spec_bench_file_has_the_categories():
    ps = load_prompts(str(SHARED / "data" / "spec_bench_questions.jsonl"), ["mt_bench:20", "gsm8k:10"])
    assert len(ps) == 30 and {p.category for p in ps} == {"mt_bench", "gsm8k"}


def test_summary_medians_and_speedups():
    def row(prompt, cat, method, tps, tau, acc, eq=True):
        return dict(prompt=prompt, category=cat, method=method, tokens_per_second=tps, tau=tau, accept_lengths=acc,
                    bytes_streamed=100, target_forwards=10, peak_rss=5, equal_to_ar=eq, match_rate=1.0 if eq else 0.5,
                    first_divergence=8 if eq else 3)
    rows = [row("a", "x", "ar", 2.0, 1.0, []), row("a", "x", "subspec", 6.0, 5.0, [3, 5]),
            row("b", "y", "ar", 4.0, 1.0, []), row("b", "y", "subspec", 8.0, 7.0, [5, 5], eq=False),
            row("c", "y", "ar", 1.0, 1.0, []), row("c", "y", "subspec", 5.0, 9.0, [0])]
    ms = [Method("ar", None), Method("subspec", None)]
    s = summarize(rows, BenchConfig(methods=["ar", "subspec"]), Options(model="m"), ms)["methods"]
    assert s["subspec"]["speedup_vs_ar"] == 3.0            # median of 3, 2, 5
    assert s["subspec"]["speedup_by_category"] == {"x": 3.0, "y": 3.5}
    assert s["subspec"]["tau"] == 7.0 and s["ar"]["tau"] == 1.0
    assert s["subspec"]["accept_length_hist"] == [1, 0, 0, 1, 0, 3]
    assert s["subspec"]["equal_to_ar"] == 2
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2, 3]) == 2
    assert s["ar"]["timeline"] is None and s["subspec"]["timeline"] is None  # rows without rounds / disk counters


def test_the_timeline_is_the_mean_round_over_all_prompts():
    def row(prompt, rounds, draft, verify, wait, ddisk, vdisk, steps, widths):
        return dict(prompt=prompt, category="x", method="subspec", tokens_per_second=1.0, tau=2.0, accept_lengths=[],
                    bytes_streamed=1, target_forwards=1, peak_rss=1, rounds=rounds, draft_seconds=draft,
                    verify_seconds=verify, verify_wait_seconds=wait, draft_disk_seconds=ddisk,
                    verify_disk_seconds=vdisk, draft_steps=steps, draft_widths=widths)
    # the mean width: over the rounds that drafted (0: a round without a draft)
    rows = [row("a", 2, 0.2, 0.6, 0.1, 0.1, 0.4, 16, [4, 4]),
            row("b", 6, 0.6, 1.0, 0.3, 0.5, 0.4, 32, [4, 2, 2, 0, 2, 2])]
    t = summarize(rows, BenchConfig(methods=["subspec"]), Options(model="m"), [Method("subspec", None)])
    t = t["methods"]["subspec"]["timeline"]
    assert t["rounds"] == 8 and t["steps"] == 6.0  # totals over rounds, not a mean of the prompts' means
    assert t["width"] == pytest.approx(20 / 7)
    assert t["draft_seconds"] == pytest.approx(0.1) and t["verify_seconds"] == pytest.approx(0.2)
    assert t["verify_compute_seconds"] == pytest.approx(0.15) and t["draft_disk_seconds"] == pytest.approx(0.075)
    table = write_table(dict(model="m", dtype="bfloat16", device_memory=1, max_new_tokens=8,
                             tau_definition="tau", methods={"subspec": dict(
                                 tokens_per_second=1, speedup_vs_ar=2, tau=2, equal_to_ar=1, prompts=1, match_rate=1,
                                 bytes_per_forward=1, peak_rss=1, info="", timeline=t)}), Path(os.devnull))
    assert "| subspec | 8 | 100.0 | 6.0 | 2.9 | 75.0 | 200.0 | 150.0 | 50.0 | 100.0 | 300.0 |" in table


@pytest.mark.slow
def test_small_bench_run_writes_every_output(smollm2_gguf, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "subspec", "bench", "--model", str(smollm2_gguf), "--dtype", "float32",
           "--device-memory", "1200MiB", "--max-context", "512", "--prompts", "builtin:2",
           "--methods", "ar,subspec,ngram,draft-model,draft-only,hf", "--draft-model", str(smollm2_gguf),
           "--max-new-tokens", "8", "--flat-tokens", "4", "--depth", "3", "--topk", "2", "--verify-budget", "8",
           "--sweep-bits", "4", "--sweep-depth", "2", "--sweep-draft-vocab", "1024", "--sweep-prompts", "1", "--out", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(summary["methods"]) == {"ar", "subspec", "ngram", "draft-model", "draft-only", "hf"}
    for name in ("ar", "subspec", "ngram", "draft-model", "hf"):  # all lossless (hf: same target, fp32)
        assert summary["methods"][name]["equal_to_ar"] == 2, name
    assert summary["sweeps"]["bits"]["4"]["tau"] >= 1 and summary["sweeps"]["depth"]["2"]["tau"] >= 1
    assert summary["sweeps"]["draft_vocab"]["1024"]["tau"] >= 1
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["new_tokens"] >= 1 for r in rows)
    # each method runs in its own process: a real, per-method peak RSS (python + torch alone is > 100 MiB)
    assert all(100 * 2**20 < r["peak_rss"] < 8 * 2**30 for r in rows)
    peak = {n: m["peak_rss"] for n, m in summary["methods"].items()}
    assert peak["draft-model"] > peak["ar"], peak  # the draft model's weights live in that process only
    assert all(r["new_tokens"] <= 4 for r in rows if r["method"] in ("ar", "hf"))
    assert "| subspec |" in (out / "table.md").read_text()
    for png in ("tokens_per_second.png", "speedup_by_category.png", "acceptance.png", "tau_vs_bits.png", "depth_sweep.png"):
        assert (out / png).stat().st_size > 1000, png


@pytest.mark.slow
def test_a_method_that_cannot_load_is_skipped_with_its_reason(smollm2_gguf):
    from subspec.bench.runner import start_workers

    opts = Options(model=str(smollm2_gguf), dtype="float32", device="cpu", device_memory=300 * 2**20, max_context=256)
    cfg = BenchConfig(methods=["ar", "draft-model"], draft_model=str(smollm2_gguf))
    running, skipped = start_workers(cfg, opts, log=lambda s: None)
    try:
        assert [m.name for m in running] == ["ar"]
        assert "draft model" in skipped["draft-model"] and "budget" in skipped["draft-model"], skipped
        out, stats, meas = running[0].run([1, 2, 3], 2)
        assert len(out) == 2 and stats["tau"] == 1.0 and meas["peak_rss"] > 0
    finally:
        for m in running:
            m.close()


@pytest.mark.slow
def test_ctrl_c_stops_the_bench_and_its_workers(smollm2_gguf, tmp_path):
    import signal
    import time

    cmd = [sys.executable, "-m", "subspec", "bench", "--model", str(smollm2_gguf), "--device-memory", "300MiB",
           "--max-context", "512", "--prompts", "builtin:3", "--methods", "ar,subspec", "--depth", "4",
           "--verify-budget", "16", "--out", str(tmp_path / "o")]  # fixed tree: no calibration, workers up sooner
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen, deadline = "", time.time() + 600
    while time.time() < deadline and p.poll() is None:
        line = p.stderr.readline()
        seen += line
        if line.startswith("[1/3]"):  # both workers are up and generating
            break
    assert "[1/3]" in seen, seen[-2000:]
    workers = _worker_pids(p.pid)  # this bench's own workers (other benches may run on the machine)
    assert len(workers) == 2, workers
    os.kill(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in seen + err, (seen + err)[-2000:]
    left = [pid for pid in workers if b"subspec.bench.worker" in _cmdline(pid)]
    assert not left, f"workers still running: {left}"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # gone
        return b""


def _worker_pids(parent: int) -> list[int]:
    """Child processes of ``parent`` running the bench worker."""
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        kids = [int(x) for x in f.read().split()]
    return [k for k in kids if b"subspec.bench.worker" in _cmdline(k)]


def test_capped_workers_find_the_kernels_built_outside_their_cap(monkeypatch):
    """With --wrap (a memory cap), the kernel tier is built in bench's own process before the first worker starts:
    compiling it under `run-capped ... 1G` killed the compiler and every method ran without native kernels."""
    from subspec import kernels
    from subspec.bench import runner

    events = []
    monkeypatch.setattr(kernels, "active", lambda: events.append("kernels") or "avx2")

    class Started:
        def __init__(self, name, opts, draft_model, wrap):
            events.append(name)

    monkeypatch.setattr(runner, "WorkerMethod", Started)
    opts = Options(model="unused", device="cpu")
    runner.start_workers(BenchConfig(methods=["ar", "subspec"], wrap=["run-capped", "1G"]), opts, log=lambda s: None)
    assert events == ["kernels", "ar", "subspec"]
    events.clear()
    runner.start_workers(BenchConfig(methods=["ar"]), opts, log=lambda s: None)  # no cap: the worker builds them
    assert events == ["ar"]
