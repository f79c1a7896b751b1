"""The methods a benchmark compares, all at one memory budget and dtype.

Each method is a :class:`Method` whose ``run(prompt_ids, max_new_tokens)`` returns the new tokens and a stats dict.
Methods over our engine share loaded runtimes where their placement is the same:

- ``ar``: plain offloaded decoding (the baseline; a mixture of experts reads only the routed experts).
  ``ar-layers``: the same reading whole layers (every expert), as layer-wise offloaders do (for a MoE model). ``ngram``: prompt lookup through the same verifier, on ar's
  placement. ``subspec``: substitutes + tree drafting. ``draft-only``: the substitute model alone, decoding
  autoregressively (direct low-bit deployment: fast, lossy). ``draft-model``: a separate small model (resident,
  counted in the budget) drafting for the target. ``hf``: transformers ``generate`` with accelerate offloading
  (a disk offload folder on CPU) — what a user gets without this project.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..engine import Engine, NoDraft
from ..errors import SubspecError
from ..sampling import SamplingParams

ALL_METHODS = ("ar", "subspec", "ngram", "draft-model", "draft-only", "hf", "ar-layers")
FLAT_COST = ("ar", "hf", "ar-layers")
"""Methods whose cost per token is flat (one full streamed forward each): they may be timed on fewer tokens."""


@dataclass
class Method:
    """A named decoding method: ``run(prompt_ids, max_new_tokens) -> (tokens, stats)``; ``lossless`` is False for
    methods whose output may differ from the target's (draft-only); ``info`` describes its configuration."""

    name: str
    run: Callable[[list[int], int], tuple[list[int], dict]]
    lossless: bool = True
    info: str = ""
    close: Callable[[], None] = lambda: None


def engine_runner(engine: Engine) -> Callable[[list[int], int], tuple[list[int], dict]]:
    def run(ids: list[int], max_new: int):
        engine.reset()
        out = engine.generate(ids, SamplingParams(max_new_tokens=max_new))
        st = engine.last_stats.as_dict()
        return out, st
    return run


def check_methods(names: list[str], draft_model: Optional[str]) -> None:
    """Raises SubspecError for an unknown method name, or draft-model without a draft model."""
    bad = [n for n in names if n not in ALL_METHODS]
    if bad:
        raise SubspecError(f"unknown method(s) {', '.join(bad)}: choose from {', '.join(ALL_METHODS)}")
    if "draft-model" in names and not draft_model:
        raise SubspecError("method draft-model needs --draft-model (a smaller model with the same tokenizer)")


def build_methods(names: list[str], opts, draft_model: Optional[str] = None,
                  log: Callable[[str], None] = print) -> tuple[list[Method], dict]:
    """Load the runtimes the requested methods need and wrap them as :class:`Method`s.

    Args:
        names: methods from :data:`ALL_METHODS`. opts: :class:`~subspec.runtime.Options` (budget, dtype, ...).
        draft_model: checkpoint of the small model for ``draft-model``.

    Returns:
        (methods in the order given, shared objects: the 'subspec' runtime and the tokenizer).

    Raises:
        SubspecError: an unknown method, draft-model without --draft-model.
    """
    from ..loading import open_model
    from ..runtime import load

    check_methods(names, draft_model)
    methods: dict[str, Method] = {}
    shared: dict = {}
    if {"ar", "ngram"} & set(names):
        ar = load(dataclasses.replace(opts, method="ar"))
        shared.setdefault("tokenizer", ar.tokenizer)
        shared["ar"] = ar
        if "ar" in names:
            methods["ar"] = Method("ar", engine_runner(ar.engine), info=ar.placement.summary(), close=ar.close)
        if "ngram" in names:
            from ..lookup import NgramLookup

            eng = Engine(ar.decoder, ar.engine.layers, NgramLookup(16, 3, ar.decoder.device), ar.source.eos_token_ids,
                         opts.max_context, tier=ar.tier)
            methods["ngram"] = Method("ngram", engine_runner(eng), info="prompt lookup (3-gram, 16 tokens) on ar's placement")
    if "ar-layers" in names:
        whole = load(dataclasses.replace(opts, method="ar", expert_streaming=False))
        shared.setdefault("tokenizer", whole.tokenizer)
        methods["ar-layers"] = Method("ar-layers", engine_runner(whole.engine), close=whole.close,
                                      info=whole.placement.summary() + "; whole layers read (every expert)")
    if {"subspec", "draft-only"} & set(names):
        rt = load(dataclasses.replace(opts, method="subspec"))
        shared["subspec"] = rt
        shared.setdefault("tokenizer", rt.tokenizer)
        s = rt.draft.s
        depth = f"depth {s.depth}" if opts.depth else f"depth adaptive per round (from {s.depth})"
        info = (f"{rt.placement.summary()}; {opts.bits}-bit g{opts.group_size} substitutes; {depth} "
                f"top-k {s.topk} verify budget {s.verify_budget} threshold {s.threshold}")
        if "subspec" in names:
            methods["subspec"] = Method("subspec", engine_runner(rt.engine), info=info, close=rt.close)
        if "draft-only" in names:
            eng = Engine(rt.decoder, rt.draft.layers, NoDraft(), rt.source.eos_token_ids, opts.max_context)
            methods["draft-only"] = Method("draft-only", engine_runner(eng), lossless=False,
                                           info=f"the substitute model alone ({opts.bits}-bit), no verification")
    if "draft-model" in names:
        from ..draft_model import DraftModel
        from ..layout import layer_layout
        from ..speculation import tree_settings

        dsrc = open_model(draft_model, _dtype(opts))
        dl = layer_layout(dsrc.config, dsrc.family, _dtype(opts))
        es = torch.empty((), dtype=_dtype(opts)).element_size()
        embed = dsrc.config.vocab_size * dsrc.config.hidden_size * es
        draft_bytes = dsrc.config.num_hidden_layers * dl.extent + embed * (1 if dsrc.config.tie_word_embeddings else 2)
        budget = (opts.device_memory or 0) - draft_bytes
        if opts.device_memory is not None and budget <= 0:
            raise SubspecError(f"the draft model ({draft_bytes >> 20} MiB) does not fit in the budget")
        settings = tree_settings(opts)
        settings.depth, settings.verify_budget = opts.depth or 8, opts.verify_budget or 32
        target = load(dataclasses.replace(opts, method="ar", device_memory=budget if opts.device_memory else None))
        prop = DraftModel(dsrc, settings, opts.max_context + settings.max_nodes, target.decoder.dtype, target.decoder.device)
        eng = Engine(target.decoder, target.engine.layers, prop, target.source.eos_token_ids, opts.max_context,
                     tier=target.tier)
        methods["draft-model"] = Method(
            "draft-model", engine_runner(eng), close=target.close,
            info=f"{draft_model} resident ({draft_bytes >> 20} MiB of the budget); target {target.placement.summary()}; "
                 f"tree depth {settings.depth} top-k {settings.topk} verify budget {settings.verify_budget}")
    if "hf" in names:
        methods["hf"] = hf_method(opts)
    return [methods[n] for n in names], shared


def _dtype(opts):
    from ..runtime import resolve_dtype

    return resolve_dtype(opts.dtype)


def hf_method(opts) -> Method:
    """transformers ``generate`` with accelerate offloading at the same budget (disk offload folder on CPU).

    accelerate's ``max_memory`` counts weights only, so it gets the weight bytes (embeddings, lm_head, norms,
    resident layers) that ``ar``'s placement keeps at this budget; the rest goes to the offload folder.

    On a CPU, accelerate's disk offload reads through the page cache; measure under ``run-capped`` for a real disk.
    """
    from transformers import AutoModelForCausalLM

    from ..loading import open_model
    from ..runtime import plan_for

    src = open_model(opts.model, _dtype(opts))
    folder = tempfile.mkdtemp(prefix="subspec-hf-offload-")
    kw = dict(dtype=_dtype(opts), low_cpu_mem_usage=True)
    weights = None
    if opts.device_memory:
        # accelerate's max_memory counts weights only; give it the weight bytes ar keeps in memory at this budget
        # (embeddings, lm_head, norms, resident layers), so its KV cache and activations are not extra memory
        ar_plan, _ = plan_for(dataclasses.replace(opts, method="ar"), src)
        weights = ar_plan.weight_bytes
        kw.update(device_map="auto", max_memory={"cpu": weights}, offload_folder=folder)
    model = AutoModelForCausalLM.from_pretrained(str(src.path), **kw).eval()
    eos = src.eos_token_ids

    def run(ids: list[int], max_new: int):
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new,
                                 eos_token_id=eos or None, pad_token_id=(eos or [0])[0])[0, len(ids):].tolist()
        dt = time.perf_counter() - t
        return out, {"new_tokens": len(out), "target_forwards": len(out), "tau": 1.0, "wall_seconds": dt,
                     "bytes_streamed": None}

    return Method("hf", run, info=(f"transformers generate + accelerate disk offload, max_memory {weights / 2**20:.0f} MiB "
                                   f"= the weight bytes ar keeps resident at this budget" if weights else
                                   "transformers generate, all in RAM"),
                  close=lambda: shutil.rmtree(folder, ignore_errors=True))
