"""Time a start of subspec by phase: conversion, opening, packing, substitutes, calibration, first token.

Usage (a first start: an empty cache folder; run it again with the same folder for the second start):

    ../shared/scripts/run-capped --evict MODEL --evict CACHE 4G \\
        python scripts/first_start.py --model MODEL --cache CACHE --device-memory 2.5GiB [--method ar] [--dtype ...]

Each phase is a library function wrapped with a timer (those that exist in this version of the code); the
remaining load time is reported as "other". Prints one table and a JSON line (seconds, peak RSS in bytes).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time

PHASES = [  # (module, function name, phase label): wrapped wherever the same function object is referenced
    ("subspec.loading", "_convert_gguf", "gguf conversion"),
    ("subspec.convert", "convert_gguf", "gguf conversion"),
    ("subspec.cache", "content_digest", "content digest"),
    ("subspec.tiers", "packed_file", "packing layers"),
    ("subspec.tiers", "packed_layers", "packing layers"),
    ("subspec.quant", "load_substitutes", "substitutes"),
    ("subspec.policy", "calibrate", "calibration"),
    ("subspec.codec", "coded_layers", "coding layers"),
    ("subspec.model", "Decoder.from_source", "shared tensors"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", required=True, help="SUBSPEC_CACHE for this run")
    ap.add_argument("--device-memory", default=None)
    ap.add_argument("--method", default="subspec")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=4, help="substitute bits (subspec)")
    ap.add_argument("--draft-layers", default="auto", choices=("auto", "offloaded", "all"))
    ap.add_argument("--tokens", type=int, default=8, help="new tokens generated after loading")
    ap.add_argument("--prompt-ids", default="", help="comma-separated token ids (for models without a tokenizer)")
    ap.add_argument("--whole-layers", action="store_true", help="a mixture of experts: read every expert (baseline)")
    a = ap.parse_args()
    os.environ["SUBSPEC_CACHE"] = a.cache
    t_start = time.perf_counter()
    import importlib

    import subspec.runtime as runtime
    from subspec.placement import parse_bytes
    from subspec.sampling import SamplingParams

    t_import = time.perf_counter() - t_start
    spent: dict[str, float] = {}
    depth = [0]

    def timed(fn, label):
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # nested phases count once, in the outermost
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        return wrapper

    mods = [m for name, m in list(sys.modules.items()) if name.startswith("subspec")]
    for modname, attr, label in PHASES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        owner, _, fname = attr.rpartition(".")
        holder = getattr(mod, owner) if owner else mod
        fn = getattr(holder, fname, None)
        if fn is None:
            continue
        if owner:  # a classmethod: rebind on the class
            setattr(holder, fname, classmethod(timed(fn.__func__, label)))
            continue
        w = timed(fn, label)
        for m in mods + [mod]:
            if getattr(m, fname, None) is fn:
                setattr(m, fname, w)
    opts = runtime.Options(model=a.model, method=a.method, dtype=a.dtype, max_context=a.max_context,
                           device_memory=parse_bytes(a.device_memory) if a.device_memory else None, bits=a.bits,
                           draft_layers=a.draft_layers, expert_streaming=not a.whole_layers)
    t0 = time.perf_counter()
    rt = runtime.load(opts)
    t_load = time.perf_counter() - t0
    ids = [int(x) for x in a.prompt_ids.split(",") if x] or rt.encode("Write a short story about a lighthouse.")
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in rt.engine.stream(ids, SamplingParams(max_new_tokens=a.tokens)):
        n += len(chunk)
        if first is None:
            first = time.perf_counter() - t0
    t_gen = time.perf_counter() - t0
    rt.close()
    total = time.perf_counter() - t_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    other = t_load - sum(spent.values())
    rows = [("imports", t_import)] + list(spent.items()) + [("other loading", other), ("first token (prefill)", first or 0.0),
                                                            (f"generate {n} tokens", t_gen), ("total", total)]
    print(f"first_start: {a.model} method {a.method} dtype {a.dtype} budget {a.device_memory}: {rt.placement.summary()}")
    for label, s in rows:
        print(f"  {label:24s} {s:8.1f} s")
    print(f"  peak RSS {peak / 2**30:.2f} GiB")
    st = rt.engine.last_stats
    print(json.dumps({"phases": dict(rows), "peak_rss": peak, "placement": rt.placement.summary(),
                      "tau": st.tau, "tokens_per_second": st.tokens_per_second,
                      "bytes_streamed_per_forward": st.bytes_streamed / max(st.target_forwards, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
