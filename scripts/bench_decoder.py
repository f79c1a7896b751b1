"""Benchmark (not a test): BF16 decode tokens/s of our decoder vs transformers on SmolLM2-135M, same run.

    python scripts/bench_decoder.py [--model PATH] [--tokens 128] [--repeats 3]

Both decode greedily from the same prompt, everything resident on the CPU; runs alternate so machine drift
cancels; prints medians and the ratio ours / transformers.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF or HF folder (default: get-model smollm2-135m)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from subspec.runtime import Options, load
    from subspec.sampling import SamplingParams

    model = a.model or subprocess.run([str(Path(__file__).resolve().parents[2] / "shared/scripts/get-model"),
                                       "smollm2-135m"], capture_output=True, text=True, check=True).stdout.strip()
    rt = load(Options(model=model, method="ar", dtype="bfloat16", max_context=1024))
    hf = AutoModelForCausalLM.from_pretrained(str(rt.source.path), dtype=torch.bfloat16).eval()
    ids = rt.encode("Write a story about a robot who learns to paint.")
    p = SamplingParams(max_new_tokens=a.tokens)
    ours, theirs = [], []
    for r in range(a.repeats + 1):  # the first round is warm-up
        rt.engine.reset()
        t = time.perf_counter()
        out = rt.engine.generate(ids, p)
        t_ours = time.perf_counter() - t
        with torch.no_grad():
            t = time.perf_counter()
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=a.tokens, min_new_tokens=a.tokens)
            t_hf = time.perf_counter() - t
        if r:
            ours.append(len(out) / t_ours)
            theirs.append((ref.shape[1] - len(ids)) / t_hf)
    same = out == ref[0, len(ids):len(ids) + len(out)].tolist()
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(f"threads={torch.get_num_threads()} bf16, {a.tokens} new tokens, {a.repeats} repeats (prefill included)")
    print(f"ours         {mo:7.1f} tokens/s  {['%.1f' % x for x in ours]}")
    print(f"transformers {mt:7.1f} tokens/s  {['%.1f' % x for x in theirs]}")
    print(f"ratio ours / transformers = {mo / mt:.2f}x; same tokens (bf16): {same}")


if __name__ == "__main__":
    sys.exit(main())
