"""``subspec plan``: the itemized device memory placement, without loading any weights."""
from __future__ import annotations

from .options import add_model_options, build_options


def add_parser(sub, common) -> None:
    p = sub.add_parser("plan", parents=[common], help="show the device memory placement (no weights loaded)",
                       description="Print the itemized device memory account for a model and budget: which layers "
                                   "stay resident, what is offloaded, the KV cache, substitutes, staging and "
                                   "workspace, and the minimum budget.")
    add_model_options(p, tree=False)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..loading import open_model
    from ..runtime import plan_for, resolve_dtype

    opts = build_options(args)
    placement, _ = plan_for(opts, open_model(opts.model, resolve_dtype(opts.dtype), convert=False))
    print(placement.table())
    return 0
