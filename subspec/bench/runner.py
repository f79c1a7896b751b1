"""Running a benchmark: methods interleaved prompt by prompt, warm-up excluded, results and summary written.

tau = new tokens / target forwards (the prefill counted as the forward that emits the first token); plain
decoding has tau = 1. Speedups are per-prompt ratios of tokens/s against ``ar`` measured in the same run.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..engine import TIMELINE
from ..errors import SubspecError
from .methods import FLAT_COST, check_methods
from .prompts import Prompt

TAU_DEFINITION = "tau = new tokens / target forwards (prefill counted as the forward that emits the first token; ar has tau = 1)"


@dataclass
class BenchConfig:
    """What to run: ``methods`` over ``prompts`` with ``max_new_tokens``; flat-cost methods (ar, hf) are timed on
    their first ``flat_tokens`` tokens when set; sweeps over substitute bits, draft depth and draft vocabulary size on ``sweep_prompts``
    prompts with ``sweep_tokens`` new tokens (default ``max_new_tokens``); ``wrap`` is a command prefix every
    method's worker process runs under (e.g. ``run-capped --evict DIR SIZE``)."""

    methods: list[str]
    max_new_tokens: int = 128
    flat_tokens: Optional[int] = None
    draft_model: Optional[str] = None
    sweep_bits: list[int] = field(default_factory=list)
    sweep_depth: list[int] = field(default_factory=list)
    sweep_draft_vocab: list[int] = field(default_factory=list)
    sweep_prompts: int = 2
    sweep_tokens: Optional[int] = None
    wrap: list[str] = field(default_factory=list)


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token of ``a`` and ``b`` over their common length (that length if none)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class WorkerMethod:
    """A method running in its own worker process (:mod:`subspec.bench.worker`), so that its peak memory is its
    own and a memory cap (``wrap``, e.g. ``run-capped ... SIZE``) applies to it alone.

    ``run(ids, max_new)`` returns (new tokens, stats, measurements: wall_seconds, peak_rss, peak_device_memory).

    Raises:
        SubspecError: from the constructor when the worker cannot load the method (the message says why), and
            from ``run`` when the worker has died.
    """

    def __init__(self, name: str, opts, draft_model: Optional[str], wrap: list[str]):
        self.name = name
        cmd = [*wrap, sys.executable, "-m", "subspec.bench.worker"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        reply = self._ask({"method": name, "opts": dataclasses.asdict(opts), "draft_model": draft_model})
        if "error" in reply:
            self.close()
            raise SubspecError(reply["error"])
        self.info, self.lossless = reply["info"], reply["lossless"]

    def _ask(self, obj: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise SubspecError(f"the {self.name} worker exited with code {rc} (its stderr is above; "
                               f"a memory cap that is too small shows as code 137)")
        return json.loads(line)

    def run(self, ids: list[int], max_new: int) -> tuple[list[int], dict, dict]:
        r = self._ask({"ids": ids, "max_new": max_new})
        return r["out"], r["stats"], {k: r[k] for k in ("wall_seconds", "peak_rss", "peak_device_memory")}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"close": True}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_workers(cfg: BenchConfig, opts, log) -> tuple[list[WorkerMethod], dict[str, str]]:
    """One worker per method, started one after the other; returns (running methods, skipped: name -> reason)."""
    check_methods(cfg.methods, cfg.draft_model)
    from ..options import resolve_device

    if cfg.wrap and opts.native_kernels and resolve_device(opts.device).type == "cpu":
        # build this CPU's kernel tier here, outside the workers' memory cap (compiling it takes more than a small
        # cap allows: under `run-capped ... 1G` the compiler was killed); the workers load the cached build
        from .. import kernels

        try:
            kernels.active()
        except SubspecError:
            pass  # a forced tier this CPU cannot run: each worker says so
    running, skipped = [], {}
    for name in cfg.methods:
        log(f"starting {name} ...")
        try:
            running.append(WorkerMethod(name, opts, cfg.draft_model, cfg.wrap))
        except SubspecError as e:
            if name == "ar":
                for w in running:
                    w.close()
                raise SubspecError(f"the baseline ar cannot run: {e}") from None
            skipped[name] = str(e)
            log(f"skipped {name}: {e}")
    return running, skipped


def run_bench(opts, prompts: list[Prompt], cfg: BenchConfig, out_dir: Path, log=print) -> dict:
    """Run the benchmark and write ``results.jsonl``, ``summary.json``, ``table.md`` and plots into ``out_dir``.

    Every method runs in its own worker process (:class:`WorkerMethod`); prompts are interleaved: each prompt
    goes to every method in turn, so machine drift cancels in the per-prompt ratios. One short warm-up
    generation per method is excluded.

    Returns:
        the summary dict (also written as summary.json).

    Raises:
        SubspecError: unknown methods, draft-model without a draft model, ar unable to run, a worker that dies.
    """
    from ..loading import open_model
    from ..runtime import resolve_dtype

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = open_model(opts.model, resolve_dtype(opts.dtype)).tokenizer()
    encoded = [(p, _encode(tok, p.text)) for p in prompts]
    t_start = time.perf_counter()
    methods, skipped = start_workers(cfg, opts, log)
    rows = []
    try:
        log(TAU_DEFINITION)
        for m in methods:
            log(f"  {m.name:11s} {m.info}")
        for name, why in skipped.items():
            log(f"  {name:11s} skipped: {why}")
        if cfg.flat_tokens and cfg.flat_tokens < cfg.max_new_tokens:
            log(f"note: {', '.join(n for n in FLAT_COST if n in cfg.methods)} timed on their first {cfg.flat_tokens} "
                f"tokens per prompt: their cost per token is flat (one full streamed forward each)")
        for m in methods:  # warm-up, excluded
            m.run(encoded[0][1], 4)
        with open(out_dir / "results.jsonl", "w") as f:
            for i, (p, ids) in enumerate(encoded):
                ref: Optional[list[int]] = None
                for m in sorted(methods, key=lambda m: m.name != "ar"):  # ar first: the others compare to it
                    n = cfg.flat_tokens if (cfg.flat_tokens and m.name in FLAT_COST) else cfg.max_new_tokens
                    out, st, meas = m.run(ids, n)
                    wall = meas["wall_seconds"]
                    row = dict(prompt=p.id, category=p.category, method=m.name, new_tokens=len(out), wall_seconds=wall,
                               tokens_per_second=len(out) / wall, tau=st.get("tau"),
                               target_forwards=st.get("target_forwards"), bytes_streamed=st.get("bytes_streamed"),
                               accept_lengths=st.get("accept_lengths", []),
                               draft_steps=st.get("draft_steps"), draft_misses=st.get("draft_misses"),
                               draft_widths=st.get("draft_widths", []),
                               rounds=st.get("rounds"), **{k: st.get(k) for k in TIMELINE},
                               wait_seconds=st.get("wait_seconds"), peak_rss=meas["peak_rss"],
                               peak_device_memory=meas["peak_device_memory"], token_ids=out)
                    if m.name == "ar":
                        ref = out
                    if ref is not None:
                        k = min(len(out), len(ref))
                        row["first_divergence"] = first_divergence(out, ref)
                        row["equal_to_ar"] = out[:k] == ref[:k]
                        row["match_rate"] = sum(x == y for x, y in zip(out, ref)) / max(k, 1)
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    log(f"[{i + 1}/{len(encoded)}] {p.category:12s} {m.name:11s} {row['tokens_per_second']:7.2f} tok/s "
                        f"tau {row['tau'] or 0:5.2f}  {len(out):4d} tok  peak RSS {meas['peak_rss'] / 2**20:6.0f} MiB"
                        + (f"  equal to ar: {row['equal_to_ar']}" if "equal_to_ar" in row and m.name != "ar" else ""))
    except BaseException:  # Ctrl-C or a dead worker: stop the others now rather than let them finish a prompt
        for m in methods:
            m.proc.kill()
        raise
    finally:
        for m in methods:
            m.close()
    summary = summarize(rows, cfg, opts, methods)
    summary["skipped"] = skipped
    summary["wrap"] = cfg.wrap
    summary["sweeps"] = run_sweeps(opts, encoded[:cfg.sweep_prompts], cfg, log)
    summary["elapsed_seconds"] = time.perf_counter() - t_start
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    from .report import write_plots, write_table

    write_table(summary, out_dir / "table.md")
    write_plots(rows, summary, out_dir)
    return summary


def _encode(tok, text: str) -> list[int]:
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tok(text)["input_ids"])


def summarize(rows: list[dict], cfg: BenchConfig, opts, methods) -> dict:
    """Medians per method, per-prompt speedups vs ar (overall and per category), acceptance histograms."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    by = {m.name: [r for r in rows if r["method"] == m.name] for m in methods}
    ar_tps = {r["prompt"]: r["tokens_per_second"] for r in by.get("ar", [])}
    out = {"tau_definition": TAU_DEFINITION, "model": opts.model, "dtype": opts.dtype,
           "device_memory": opts.device_memory, "max_new_tokens": cfg.max_new_tokens, "flat_tokens": cfg.flat_tokens,
           "methods": {}}
    for m in methods:
        rs = by[m.name]
        speedups = [r["tokens_per_second"] / ar_tps[r["prompt"]] for r in rs if r["prompt"] in ar_tps]
        cats = sorted({r["category"] for r in rs})
        acc = [a for r in rs for a in r["accept_lengths"]]
        out["methods"][m.name] = {
            "info": m.info, "lossless": m.lossless, "prompts": len(rs),
            "tokens_per_second": med([r["tokens_per_second"] for r in rs]),
            "tau": med([r["tau"] for r in rs if r["tau"] is not None]),
            "speedup_vs_ar": med(speedups),
            "speedup_by_category": {c: med([r["tokens_per_second"] / ar_tps[r["prompt"]] for r in rs
                                            if r["category"] == c and r["prompt"] in ar_tps]) for c in cats},
            "equal_to_ar": sum(bool(r.get("equal_to_ar")) for r in rs),
            "match_rate": med([r["match_rate"] for r in rs if "match_rate" in r]),
            "first_divergence": med([r["first_divergence"] for r in rs if "first_divergence" in r]),
            "bytes_per_forward": med([r["bytes_streamed"] / r["target_forwards"] for r in rs
                                      if r["bytes_streamed"] and r["target_forwards"]]),
            "peak_rss": max((r["peak_rss"] for r in rs), default=None),
            "accept_length_hist": _hist(acc),
            "timeline": timeline(rs),
        }
    return out


def timeline(rows: list[dict]) -> Optional[dict]:
    """A method's mean round over its prompts (seconds per round, totals over rounds): the draft, the disk busy
    while it ran (read-ahead), the verify, its time blocked on the offload tier, the disk busy while it ran, and the
    verify's compute (verify - blocked); ``steps``: draft steps per round; ``width``: the mean frontier width of the
    rounds that drafted (None: not recorded). None for a method without rounds (ar) or
    rows of an older version (without the disk counters)."""
    rs = [r for r in rows if r.get("rounds") and all(r.get(k) is not None for k in TIMELINE)]
    rounds = sum(r["rounds"] for r in rs)
    if not rounds:
        return None
    t = {k: sum(r[k] for r in rs) / rounds for k in TIMELINE}
    t["verify_compute_seconds"] = t["verify_seconds"] - t["verify_wait_seconds"]
    t["steps"] = sum(r.get("draft_steps") or 0 for r in rs) / rounds
    widths = [w for r in rs for w in r.get("draft_widths") or [] if w]
    t["width"] = sum(widths) / len(widths) if widths else None
    t["rounds"] = rounds
    return t


def _hist(xs: list[int]) -> list[int]:
    h = [0] * (max(xs) + 1 if xs else 0)
    for x in xs:
        h[x] += 1
    return h


def run_sweeps(opts, encoded, cfg: BenchConfig, log) -> dict:
    """tau (and tokens/s) of subspec for each substitute bit width, each fixed draft depth and each draft vocabulary
    size (0 = the full vocabulary; the other settings as in the main run).

    The bits sweep keeps the main run's resident layers and a fixed deep tree (depth 32 unless given, with the
    run's early-stop threshold, so a poor draft stops early instead of drafting 32 doomed steps) so that tau
    measures the draft alone. Bit widths without a native kernel (all but 4) run with their
    substitutes dequantized once to dense weights: the same draft values, so the same tau, at dense speed; their
    tokens/s is reported as None.
    """
    from ..loading import open_model
    from ..quant import native_kernel
    from ..runtime import load, plan_for
    from ..sampling import SamplingParams

    res: dict = {"bits": {}, "depth": {}, "draft_vocab": {}}
    n_resident = None
    if cfg.sweep_bits and opts.device_memory is not None:
        main, _ = plan_for(dataclasses.replace(opts, method="subspec"), open_model(opts.model, convert=False))
        n_resident = len(main.resident)
    for kind, values in (("bits", cfg.sweep_bits), ("depth", cfg.sweep_depth), ("draft_vocab", cfg.sweep_draft_vocab)):
        for v in values:
            o = dataclasses.replace(opts, method="subspec", **{kind: v})
            if kind == "bits":  # same resident layers as the main run, a fixed deep tree: tau measures the draft
                if n_resident is not None:
                    o.max_resident, o.device_memory = n_resident, None
                o.depth = opts.depth or 32
                o.dense_substitutes = True
            rt = load(o)
            taus, tps = [], []
            for _, ids in encoded:
                rt.engine.reset()
                t = time.perf_counter()
                out = rt.engine.generate(ids, SamplingParams(max_new_tokens=cfg.sweep_tokens or cfg.max_new_tokens))
                tps.append(len(out) / (time.perf_counter() - t))
                taus.append(rt.engine.last_stats.tau)
            rt.close()
            native = native_kernel(o.bits, o.group_size)
            res[kind][str(v)] = {"tau": statistics.mean(taus), "tokens_per_second": statistics.mean(tps) if native else None}
            log(f"sweep {kind}={v}: tau {statistics.mean(taus):.2f}, {statistics.mean(tps):.2f} tok/s"
                + ("" if native else " (dequantized substitutes: speed not representative)"))
    return res
