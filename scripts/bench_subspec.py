"""Benchmark (not a test): SubSpec vs plain offloaded decoding ("ar") at the same memory budget, same run.

    python scripts/bench_subspec.py --model M.gguf --device-memory 700MiB [--prompts N] [--tokens 128]
        [--ar-tokens 32] [--bits 4 [--sweep-bits 2,3,4,8,16]] [--dtype bfloat16]

Prompts: MT-Bench first turns from ../shared/data/spec_bench_questions.jsonl. Methods run interleaved prompt by
prompt. tau = new tokens / target forwards (prefill counted as the forward that emits the first token; ar has
tau = 1). With --ar-tokens N < --tokens, ar's tokens/s is measured on its first N tokens (its cost per token is
flat: one streamed forward each); the script says so. --sweep-bits also loads drafts of other bit widths
(16 = "self": the full-precision target as its own draft, the upper bound) and reports their tau.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from subspec.placement import fmt_bytes, parse_bytes
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_questions.jsonl"


def mt_bench(n: int) -> list[str]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    mt = [r for r in rows if r.get("category") in ("writing", "roleplay", "reasoning", "math", "coding",
                                                   "extraction", "stem", "humanities")]
    step = max(1, len(mt) // n)
    return [r["turns"][0] for r in mt[::step][:n]]


def run(rt, ids, tokens):
    rt.engine.reset()
    t = time.perf_counter()
    out = rt.engine.generate(ids, SamplingParams(max_new_tokens=tokens))
    return out, rt.engine.last_stats, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device-memory", required=True)
    ap.add_argument("--ar-device-memory", help="ar's budget (default: the same as subspec's)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ar-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--sweep-bits", default="")
    ap.add_argument("--sweep-prompts", type=int, default=4)
    ap.add_argument("--sweep-only", action="store_true", help="skip the ar/subspec comparison")
    ap.add_argument("--depth", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--verify-budget", type=int)
    ap.add_argument("--threshold", type=float)
    a = ap.parse_args()
    budget = parse_bytes(a.device_memory)
    common = dict(model=a.model, dtype=a.dtype, device_memory=budget, max_context=a.max_context)
    spec_kw = dict(depth=a.depth, topk=a.topk, verify_budget=a.verify_budget, threshold=a.threshold)
    ar_common = dict(common, device_memory=parse_bytes(a.ar_device_memory) if a.ar_device_memory else budget)
    ar = load(Options(method="ar", **ar_common))
    spec = load(Options(method="subspec", bits=a.bits, **spec_kw, **common))
    ar_tokens = a.ar_tokens or a.tokens
    print(f"model {a.model}  dtype {a.dtype}  budget {fmt_bytes(budget)} (ar {fmt_bytes(ar_common['device_memory'])})"
          f"  greedy, {a.tokens} new tokens")
    print(f"ar      placement: {ar.placement.summary()}")
    print(f"subspec placement: {spec.placement.summary()}; substitutes {a.bits}-bit g{spec.opts.group_size}; "
          f"tree depth {spec.draft.s.depth} k {spec.draft.s.topk} verify budget {spec.draft.s.verify_budget} "
          f"threshold {spec.draft.s.threshold}")
    if ar_tokens < a.tokens:
        print(f"note: ar is timed on its first {ar_tokens} tokens per prompt (its cost per token is flat)")
    print("tau = new tokens / target forwards (prefill counted); ar has tau = 1")
    prompts = mt_bench(max(a.prompts, a.sweep_prompts))
    rows = []
    for i, p in enumerate(prompts[:0 if a.sweep_only else a.prompts]):
        ids = spec.encode(p)
        a_out, a_st, a_t = run(ar, ids, ar_tokens)
        s_out, s_st, s_t = run(spec, ids, a.tokens)
        same = s_out[:len(a_out)] == a_out
        agree = next((j for j, (x, y) in enumerate(zip(s_out, a_out)) if x != y), min(len(s_out), len(a_out)))
        rows.append(dict(ar_tps=len(a_out) / a_t, spec_tps=len(s_out) / s_t, tau=s_st.tau, same=same,
                         ar_fwd_s=a_t / a_st.target_forwards, mean_acc=s_st.mean_accepted,
                         draft_s=s_st.draft_seconds, verify_s=s_st.verify_seconds, wait_s=s_st.wait_seconds,
                         bytes_fwd=s_st.bytes_streamed / s_st.target_forwards, tokens=len(s_out)))
        r = rows[-1]
        print(f"[{i + 1:2d}/{len(prompts)}] ar {r['ar_tps']:6.2f} tok/s | subspec {r['spec_tps']:6.2f} tok/s "
              f"tau {r['tau']:5.2f} ({r['tokens']} tok, draft {r['draft_s']:.1f}s verify {r['verify_s']:.1f}s "
              f"wait {r['wait_s']:.1f}s) speedup {r['spec_tps'] / r['ar_tps']:5.2f}x same={same} (first {agree} tokens agree)", flush=True)
    med = lambda k: statistics.median(r[k] for r in rows) if rows else float("nan")  # noqa: E731
    speedups = [r["spec_tps"] / r["ar_tps"] for r in rows] or [float("nan")]
    print(f"\nmedian: ar {med('ar_tps'):.2f} tok/s ({med('ar_fwd_s'):.3f} s/forward), subspec {med('spec_tps'):.2f} tok/s, "
          f"tau {med('tau'):.2f}, "
          f"speedup median {statistics.median(speedups):.2f}x, "
          f"bytes/forward {fmt_bytes(med('bytes_fwd'))}, outputs equal to ar: {sum(r['same'] for r in rows)}/{len(rows)}")
    spec.close()
    for bits in [int(b) for b in a.sweep_bits.split(",") if b]:
        # same resident layers as the main run and a fixed deep tree (depth 32, no early stop): tau measures the draft
        kw = dict(spec_kw, depth=a.depth or 32, threshold=0.0 if a.threshold is None else a.threshold)
        rt = load(Options(method="subspec", bits=bits, **kw, **dict(common, device_memory=None),
                          max_resident=len(spec.placement.resident)))
        taus = []
        for p in prompts[:a.sweep_prompts]:
            _, st, _ = run(rt, rt.encode(p), a.tokens)
            taus.append(st.tau)
        name = "self (bf16 target as draft)" if bits == 16 else f"{bits}-bit"
        print(f"bits sweep ({len(rt.placement.resident)} resident): {name:28s} tau mean {statistics.mean(taus):.2f} over {len(taus)} prompts {['%.1f' % t for t in taus]}")
        rt.close()
    ar.close()


if __name__ == "__main__":
    main()
