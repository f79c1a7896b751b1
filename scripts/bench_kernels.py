"""Time the draft's linears on this machine: subspec's native 4-bit and BF16 kernels against torch's, by rows.

Usage: python scripts/bench_kernels.py [--threads 2] [--shapes 1536x1536,8960x1536,1536x8960,151936x1536]

Prints one line per shape and row count: milliseconds per call (median of ``--repeats``) for the native 4-bit
linear (``linear_w4``), torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``), the native BF16 linear
(``linear_bf16``) and torch's BF16 ``F.linear``, and the memory floor of the 4-bit weights (their bytes / the
measured copy bandwidth).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="1536x1536,8960x1536,1536x8960")
    ap.add_argument("--rows", default="1,6,12,32")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from subspec import kernels
    from subspec.quant import Int4Linear, hqq_quantize
    from subspec.weights import DenseLinear

    big = torch.empty(512 << 20, dtype=torch.uint8)
    dst = torch.empty_like(big)
    bw = big.numel() * 2 / (timed(lambda: dst.copy_(big), 5) / 1e3)  # read + write bytes per second
    del big, dst
    print(f"native kernels: {kernels.status()}; copy bandwidth {bw / 1e9:.1f} GB/s; {a.threads} threads")
    print(f"{'shape':>13} {'rows':>4} {'w4 ours':>8} {'w4 torch':>8} {'bf16 ours':>9} {'bf16 torch':>10} {'w4 floor':>8}")
    for shape in a.shapes.split(","):
        out_f, in_f = (int(x) for x in shape.split("x"))
        w = torch.randn(out_f, in_f) * 0.02
        codes, scale, zero = hqq_quantize(w, 4, 64)
        ours = Int4Linear(codes, scale, zero, 64, None, torch.bfloat16, "cpu", native=True)
        theirs = Int4Linear(codes, scale, zero, 64, None, torch.bfloat16, "cpu", native=False)
        wb = w.to(torch.bfloat16)
        dense = DenseLinear(wb, None, native=True)
        floor = 1e3 * (out_f * in_f / 2 + 2 * 2 * out_f * in_f / 64) / bw
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, in_f, dtype=torch.bfloat16)
            row = [timed(lambda: ours(x), a.repeats), timed(lambda: theirs(x), a.repeats),
                   timed(lambda: dense(x), a.repeats), timed(lambda: F.linear(x, wb), a.repeats)]
            print(f"{shape:>13} {m:>4} " + " ".join(f"{t:>8.3f}" for t in row[:2]) + f" {row[2]:>9.3f} {row[3]:>10.3f}"
                  f" {floor:>8.3f}")


if __name__ == "__main__":
    main()
