"""Measure one start of subspec against its plan (run by test_memory.py in a fresh process).

    python peak_memory_worker.py MODEL METHOD DTYPE BUDGET_BYTES MAX_CONTEXT

Prints one JSON line: the fixed overhead (RSS after imports and the tokenizer, before any weights), the plan's total
and budget, and the peak RSS above the overhead while loading, while generating greedily and while sampling.
"""
from __future__ import annotations

import gc
import json
import os
import sys


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    model, method, dtype, budget, ctx = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    from subspec.process import skip_hqq_at_transformers_import

    skip_hqq_at_transformers_import()  # as the command line's process does
    import torch

    from subspec.bench.worker import peak_rss, reset_peak_rss
    from subspec.loading import open_model
    from subspec.runtime import Options, load, resolve_dtype
    from subspec.sampling import SamplingParams

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    src = open_model(model, resolve_dtype(dtype))
    tok = src.tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    torch.ones(64, 64) @ torch.ones(64, 64)  # thread pools and kernels initialized: part of the fixed overhead
    src.close()
    del src
    gc.collect()
    overhead = rss()
    out = {"overhead": overhead}
    assert reset_peak_rss(), "this kernel refuses to reset the peak RSS"
    rt = load(Options(model=model, method=method, dtype=dtype, device_memory=budget, max_context=ctx))
    out["load"] = peak_rss() - overhead
    out["plan"], out["budget"] = rt.placement.total, rt.placement.budget
    out["placement"] = rt.placement.summary()
    n = 24 if method == "subspec" else 8  # ar streams every layer for each token: its steady state is one token
    for name, params in (("greedy", SamplingParams(max_new_tokens=n)),
                         ("sampling", SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.9, seed=0))):
        rt.engine.reset()
        gc.collect()
        reset_peak_rss()
        rt.engine.generate(ids, params)
        out[name] = peak_rss() - overhead
    rt.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
