"""Time the linears on this machine, on every kernel tier it runs: subspec's 4-bit and BF16 kernels against torch's.

Usage: python scripts/bench_kernels.py [--threads 2] [--tiers avx512,avx2] [--shapes 1536x1536,8960x1536,1536x8960]

Prints, per tier (default: every tier this CPU runs, :func:`subspec.kernels.supported`), one line per shape and row
count: milliseconds per call (median of ``--repeats``) for the tier's 4-bit linear (``linear_w4``), torch's int4 CPU
kernel (``_weight_int4pack_mm_for_cpu``), the tier's BF16 linear (``linear_bf16``) and torch's BF16 ``F.linear``, and
the memory floor of the 4-bit weights (their bytes / the measured copy bandwidth), then the codec's: the BF16 weight
coded against the 4-bit substitute multiplied as it is decoded (``linear_coded``, a coded layer's linear in a verify)
and the whole weight decoded into a buffer (``w4_delta_decode``, no multiply).

``--draft-pass LAYERS`` (default 28) then times what a draft step's 4-bit work is on Qwen2.5-1.5B: its seven
linears x LAYERS layers, each with distinct random codes (737 MB at 28 layers, more than the last-level cache, so the
codes come from DRAM as in a real step), at each row count; ms per pass against the floor (the codes' and scales'
bytes / the measured read bandwidth). 0 skips it.
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
    ap.add_argument("--draft-pass", type=int, default=28, metavar="LAYERS")
    ap.add_argument("--tiers", help="comma-separated kernel tiers (default: every tier this CPU runs)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from subspec import kernels

    big = torch.empty(512 << 20, dtype=torch.uint8)
    dst = torch.empty_like(big)
    bw = big.numel() * 2 / (timed(lambda: dst.copy_(big), 5) / 1e3)  # read + write bytes per second
    big = dst = None
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}; copy bandwidth {bw / 1e9:.1f} GB/s; {a.threads} threads")
    rows = [int(r) for r in a.rows.split(",")]
    for tier in (a.tiers.split(",") if a.tiers else kernels.supported()):
        with kernels.using(tier):
            print(f"\ntier {tier}")
            linears(a.shapes.split(","), rows, a.repeats, bw)
            if a.draft_pass:
                draft_pass(a.draft_pass, rows)


def linears(shapes: list[str], rows: list[int], repeats: int, bw: float) -> None:
    """One line per shape and row count: the active tier's 4-bit and BF16 linears against torch's."""
    from subspec.quant import Int4Linear, hqq_quantize
    from subspec.weights import DenseLinear

    print(f"{'shape':>13} {'rows':>4} {'w4 ours':>8} {'w4 torch':>8} {'bf16 ours':>9} {'bf16 torch':>10} {'w4 floor':>8}"
          f" {'coded':>8} {'decode':>8}")
    for shape in shapes:
        out_f, in_f = (int(x) for x in shape.split("x"))
        w = torch.randn(out_f, in_f) * 0.02
        codes, scale, zero = hqq_quantize(w, 4, 64)
        ours = Int4Linear(codes, scale, zero, 64, None, torch.bfloat16, "cpu", native=True)
        theirs = Int4Linear(codes, scale, zero, 64, None, torch.bfloat16, "cpu", native=False)
        wb = w.to(torch.bfloat16)
        dense = DenseLinear(wb, None, native=True)
        floor = 1e3 * (out_f * in_f / 2 + 2 * 2 * out_f * in_f / 64) / bw
        coded = coded_linear(wb, ours)
        decoded = torch.empty_like(wb)
        decode = timed(lambda: ours.ops.w4_delta_decode(coded.stream, ours.packed, ours.scale, ours.shift, 64, decoded),
                       repeats)
        for m in rows:
            x = torch.randn(m, in_f, dtype=torch.bfloat16)
            row = [timed(lambda: ours(x), repeats), timed(lambda: theirs(x), repeats),
                   timed(lambda: dense(x), repeats), timed(lambda: F.linear(x, wb), repeats)]
            print(f"{shape:>13} {m:>4} " + " ".join(f"{t:>8.3f}" for t in row[:2]) + f" {row[2]:>9.3f} {row[3]:>10.3f}"
                  f" {floor:>8.3f} {timed(lambda: coded(x), repeats):>8.3f} {decode:>8.3f}")


def coded_linear(wb: torch.Tensor, sub):
    """``wb`` [out, in] bf16 coded against its native 4-bit substitute ``sub``: the codec's CodedLinear (the
    README's "coded" column: the weight decoded block by block as it multiplies; "decode": the whole weight decoded
    into a buffer, no multiply)."""
    from subspec.codec import CodedLinear

    stream = sub.ops.w4_delta_encode(wb, sub.packed, sub.scale, sub.shift, sub.group_size)
    offsets = sub.ops.w4_delta_index(stream, wb.shape[0], wb.shape[1])
    return CodedLinear(stream, offsets, sub, None)


QWEN15B_LINEARS = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960)]
"""(out, in) of Qwen2.5-1.5B's q, k, v, o, gate, up and down projections."""


def draft_pass(layers: int, rows: list[int]) -> None:
    """Time the 4-bit linears of ``layers`` Qwen2.5-1.5B layers (distinct random codes, group 64) per row count."""
    from subspec.quant import Int4Linear

    g = torch.Generator().manual_seed(0)
    lins, nbytes = [], 0
    for _ in range(layers):
        for out_f, in_f in QWEN15B_LINEARS:
            codes = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
            scale = torch.rand(out_f, in_f // 64, generator=g) * 0.01 + 1e-3
            zero = torch.rand(out_f, in_f // 64, generator=g) * 15
            lins.append((Int4Linear(codes, scale, zero, 64, None, torch.bfloat16, "cpu"), in_f))
            nbytes += out_f * in_f // 2 + 2 * 2 * out_f * in_f // 64
    from subspec.machine import ram_read_rate

    read = ram_read_rate(nbytes)  # bytes per second, the process's threads reading
    print(f"draft pass: {layers} layers x 7 linears of Qwen2.5-1.5B, {nbytes / 1e6:.0f} MB of 4-bit weights; "
          f"read bandwidth {read / 1e9:.1f} GB/s, floor {1e3 * nbytes / read:.1f} ms")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (1536, 8960)}
        t = timed(lambda: [lin(xs[k]) for lin, k in lins], 10)
        print(f"  {m:>3} rows: {t:7.2f} ms per pass")


if __name__ == "__main__":
    main()
