"""The disk tier's read path alone: passes over a set of offloaded layers (plain packed and coded), no compute.

Usage: python scripts/disk_tier_pass.py [--model M.gguf] [--layers 24] [--passes 6]

Builds (or reuses) the packed and coded files of the first ``--layers`` layers of the model in BF16, then times
``--passes`` passes of acquire/release over them through :class:`~subspec.tiers.DiskTier` (O_DIRECT, its reader and
decoder threads), with the page cache bypassed. Prints per tier kind: seconds per pass (median), GB/s of file bytes,
and the process CPU seconds per pass (the reader's and decoder's work, checksums included).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def passes(tier, layers: list[int], n: int) -> tuple[float, float]:
    """(median wall seconds, mean CPU seconds) of one pass over ``layers`` (one warm-up pass first)."""
    walls, cpus = [], []
    for k in range(n + 1):
        t, c = time.perf_counter(), cpu_seconds()
        for i in layers:
            tier.acquire(i)
            tier.release(i)
        if k:
            walls.append(time.perf_counter() - t)
            cpus.append(cpu_seconds() - c)
    return statistics.median(walls), statistics.mean(cpus)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--passes", type=int, default=6)
    a = ap.parse_args()
    from subspec.cli import default_model
    from subspec.codec import coded_layers
    from subspec.layout import layer_layout
    from subspec.loading import open_model
    from subspec.placement import SubstituteSpec
    from subspec.quant import load_substitutes
    from subspec.tiers import DiskTier, packed_layers

    src = open_model(a.model or default_model(), torch.bfloat16)
    layout = layer_layout(src.config, src.family, torch.bfloat16)
    layers = list(range(min(a.layers, src.config.num_hidden_layers)))
    subs = load_substitutes(src, layers, SubstituteSpec(4, 64), torch.bfloat16, "cpu")
    coded = coded_layers(src, layout, layers, subs)
    plain = packed_layers(src, layout, layers)
    for name, kw in (("plain", {}), ("coded", {"coded": coded, "substitutes": subs})):
        tier = DiskTier(plain, layout, layers, 2, "cpu", **kw)
        try:
            wall, cpu = passes(tier, layers, a.passes)
            size = tier.stream_bytes
        finally:
            tier.close()
        print(f"{name}: {len(layers)} layers, {size / 2**20:.1f} MiB per pass: {wall * 1e3:.1f} ms per pass "
              f"(median of {a.passes}), {size / wall / 1e9:.2f} GB/s, CPU {cpu * 1e3:.1f} ms per pass")


if __name__ == "__main__":
    main()
