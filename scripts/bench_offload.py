"""Benchmark (not a test): plain offloaded decoding ("ar") on the disk tier against the link bound.

    python scripts/bench_offload.py --model M.gguf --device-memory 140MiB [--tokens 32] [--dtype bfloat16]

Prints tokens/s, seconds per target forward, the disk bandwidth measured here with O_DIRECT on the packed file,
the bound (offloaded bytes / bandwidth) and the ratio t_forward / bound (1.0 = streaming at the link speed with
all compute hidden behind I/O), and the peak RSS against the budget (fixed overhead = interpreter, torch,
tokenizer, measured after opening the checkpoint and loading its tokenizer, before any weights).
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from subspec.bench.worker import peak_rss, reset_peak_rss
from subspec.hostmem import huge_page_map
from subspec.layout import layer_layout
from subspec.placement import fmt_bytes, parse_bytes
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams
from subspec.layerfile import read_sections


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def direct_read_bandwidth(paths, extent: int, seconds: float = 3.0) -> float:
    """Bytes/s of O_DIRECT reads of the packed layer files ``paths``, one ``extent`` each, round robin."""
    starts = [read_sections(p)[2] for p in paths]  # where each file's payload begins (after its header)
    fds, m = [], None
    try:
        fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
        m = huge_page_map(extent)  # the kind of memory the tier's slots are
        with memoryview(m) as whole, whole[:extent] as buf:
            j, n, t0 = 0, 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                n += os.preadv(fds[j % len(fds)], [buf], starts[j % len(fds)])
                j += 1
            dt = time.perf_counter() - t0
        return n / dt
    finally:
        if m is not None:
            m.close()
        for fd in fds:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device-memory", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-context", type=int, default=1024)
    a = ap.parse_args()
    from subspec.loading import open_model
    from subspec.runtime import resolve_dtype

    open_model(a.model, resolve_dtype(a.dtype)).tokenizer()  # fixed overhead: python, torch, transformers' config registry, tokenizer
    overhead = rss_now()
    budget = parse_bytes(a.device_memory)
    rt = load(Options(model=a.model, method="ar", dtype=a.dtype, device_memory=budget, max_context=a.max_context))
    layout = layer_layout(rt.source.config, rt.source.family, rt.decoder.dtype)
    bw = direct_read_bandwidth(list(rt.tier.paths.values()), layout.extent)
    ids = rt.encode("Write a short story about a lighthouse keeper.")
    rt.engine.generate(ids, SamplingParams(max_new_tokens=4))  # warm-up
    rt.engine.reset()
    import gc

    gc.collect()
    reset_peak_rss()  # measure generation, not loading
    t = time.perf_counter()
    out = rt.engine.generate(ids, SamplingParams(max_new_tokens=a.tokens))
    dt = time.perf_counter() - t
    st = rt.engine.last_stats
    t_fwd = (dt - st.prefill_seconds) / max(st.target_forwards - 1, 1)
    bound = rt.placement.offloaded_bytes / bw
    peak = peak_rss()
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"model {a.model} dtype {a.dtype} budget {fmt_bytes(budget)}: {rt.placement.summary()}")
    print(f"decode: {len(out)} tokens in {dt:.2f}s = {len(out) / dt:.2f} tokens/s; {t_fwd:.3f} s per target forward "
          f"(waiting for weights {st.wait_seconds:.2f}s of {dt:.2f}s)")
    print(f"disk: measured O_DIRECT bandwidth {bw / 1e9:.2f} GB/s; streamed {fmt_bytes(st.bytes_streamed / st.target_forwards)}"
          f" per forward; bound {bound:.3f} s; t_forward / bound = {t_fwd / bound:.2f}")
    print(f"memory: peak RSS while generating {fmt_bytes(peak)} = fixed overhead {fmt_bytes(overhead)} (python, torch, "
          f"transformers, tokenizer) + {fmt_bytes(peak - overhead)} (budget {fmt_bytes(budget)}, planned {fmt_bytes(rt.placement.total)}); "
          f"peak while loading {fmt_bytes(load_peak)} (one-time GGUF conversion / packing / reading the checkpoint)")
    rt.close()


if __name__ == "__main__":
    main()
