"""``subspec plan``: the itemized device memory placement and the predicted speed, without loading any weights."""
from __future__ import annotations

import dataclasses

from .options import add_model_options, build_options, plan_run


def add_parser(sub, common) -> None:
    p = sub.add_parser("plan", parents=[common], help="show the device memory placement and predicted speed "
                                                      "(no weights loaded)",
                       description="Print the itemized device memory account for a model and budget: which layers "
                                   "stay resident, what is offloaded, the KV cache, substitutes, staging and "
                                   "workspace, and the minimum budget. Then the cost model's predicted tokens/s of "
                                   "plain offloaded decoding (ar) and of subspec (each draft-layers choice) at this "
                                   "budget, from the placement's bytes and this machine's memory and disk rates "
                                   "(measured in about a second).")
    add_model_options(p, tree=True)
    p.add_argument("--no-forecast", dest="forecast", action="store_false",
                   help="print the placement only (skip measuring the machine's rates)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..loading import open_model
    from ..runtime import resolve_dtype

    plan = plan_run(build_options(args))
    source = open_model(plan.opts.model, resolve_dtype(plan.opts.dtype), convert=False)
    print(plan.describe())
    if args.forecast:
        print()
        print(forecast_text(plan, source))
    return 0


TRY_OTHER = 1.03
"""The forecast suggests the other draft-layers choice when it predicts it this much faster (measured rates move
a few percent between runs)."""


def forecast_text(plan, source) -> str:
    """The predicted tokens/s of ar and subspec (both draft-layers choices) at ``plan``'s budget, as text lines."""
    from ..costmodel import Rates, forecast
    from ..errors import SubspecError
    from ..plan import plan_for
    from ..speculation import draft_head_bytes, tree_settings

    opts = plan.opts
    rates = Rates.measure(_offload_sample(source.path), plan.device, plan.kernels)
    tier = f"{plan.kernels} kernels" if plan.kernels else "torch's kernels"
    lines = [f"predicted speed (cost model; {tier}; memory {rates.memory / 1e9:.1f} GB/s, offload "
             f"{rates.offload / 1e9:.2f} GB/s, flops {rates.flops / 1e9:.0f} G/s, decode {rates.decode / 1e9:.1f} "
             f"G weights/s measured now, acceptance assumed; `subspec bench` measures):"]
    config = source.config
    head = draft_head_bytes(config, opts.draft_vocab, plan.dtype)
    verify = opts.verify_budget + 1 if opts.verify_budget is not None else None  # None: automatic
    topk = tree_settings(opts).topk
    results, rows = {}, []
    for method, layers in (("ar", None), ("subspec", "offloaded"), ("subspec", "all")):
        o = dataclasses.replace(opts, method=method, draft_layers=layers or opts.draft_layers)
        try:
            placement, _ = plan_for(o, source)
        except SubspecError as e:
            rows.append((f"{method} --draft-layers {layers}" if layers else method, f"does not fit ({e})", None))
            continue
        f = forecast(placement, config, rates, method=method, draft_head_bytes=head, verify_tokens=verify, topk=topk)
        results[(method, layers)] = f
        rows.append((f"{method} --draft-layers {layers}" if layers else method, f.line().split(": ", 1)[1],
                     placement.summary()))
    width = max((len(r[0]) for r in rows), default=0)
    lines += [f"  {label:{width}s}  {text}" + (f"  [{summary}]" if summary else "") for label, text, summary in rows]
    runs = opts.draft_layers  # the draft-layers choice a run at these settings takes
    if opts.method == "subspec" and opts.draft_layers == "auto":
        runs = plan.draft_choice
        line = (f"  --draft-layers auto (the default) takes {runs} (chosen at the {plan.kernels or 'torch'} tier's "
                "default rates")
        other = "offloaded" if runs == "all" else "all"
        mine, theirs = results.get(("subspec", runs)), results.get(("subspec", other))
        if mine and theirs and theirs.tokens_per_second > TRY_OTHER * mine.tokens_per_second:
            gain = theirs.tokens_per_second / mine.tokens_per_second - 1
            line += (f"; at the rates measured now {other} is predicted {100 * gain:.0f} % faster: "
                     f"try --draft-layers {other}")
        lines.append(line + ")")
    elif runs == "auto":  # a plan for ar: the faster of the two
        subs = {k[1]: f for k, f in results.items() if k[0] == "subspec"}
        runs = max(subs, key=lambda k: subs[k].tokens_per_second) if subs else runs
    ar, sub = results.get(("ar", None)), results.get(("subspec", runs))
    if ar and sub:
        ratio = sub.tokens_per_second / ar.tokens_per_second
        lines.append(f"  predicted speedup of subspec (--draft-layers {runs}) over ar: {ratio:.2f}x"
                     + ("  -> at this budget plain decoding is predicted faster: use --method ar" if ratio < 1 else ""))
    return "\n".join(lines)


def _offload_sample(path):
    """A file whose read rate stands for the offload tier's (the model file, or its largest shard)."""
    from pathlib import Path

    p = Path(path)
    if p.is_file():
        return p
    files = sorted(p.glob("*.safetensors"), key=lambda f: f.stat().st_size, reverse=True)
    return files[0] if files else None
