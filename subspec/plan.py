"""Planning: one pure step from the options, the checkpoint's config and this machine to a frozen :class:`Plan`.

Everything :func:`~subspec.runtime.load` assembles is decided here, once, before any weight is read: the budget
(the demo model's default included), the memory placement and its tier (:mod:`subspec.placement`), whether the draft
runs on substitutes of every layer (``--draft-layers auto``: the cost model's choice), the draft tree's shape before
calibration, whether offloaded layers are coded against their substitutes, the draft head's bits, the native kernel
tier, and the one-line advice when plain decoding is predicted faster. ``subspec plan`` prints the plan
(:meth:`Plan.describe`), ``subspec generate --show-plan`` prints the same text, and ``load`` builds exactly it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Optional

from pathlib import Path

import torch

from .errors import SubspecError
from .machine import check_device_memory
from .options import Options, model_context, resolve_device, resolve_dtype
from .layerfile import HEADER_BYTES
from .layout import layer_layout
from .model import attention_materializes_scores
from .placement import Placement, SubstituteSpec, fmt_bytes, plan_placement
from .speculation import TreeSettings, draft_head_bytes, draft_vocab_size, head_rows, tree_settings

DEMO_RESIDENT_LAYERS = 6
"""Full-precision layers the embedded demo model keeps resident without ``--device-memory`` (the rest offloaded)."""


@dataclass(frozen=True)
class Plan:
    """What a run of a model will be, decided before any weight is read (:func:`make_plan`).

    Attributes:
        opts: the options, validated, the context resolved against the model, the demo budget applied (as bytes).
        device, dtype: where and in which dtype the model computes.
        placement: the itemized memory account: resident and offloaded layers, substitutes, KV cache, tier
            (:class:`~subspec.placement.Placement`; its stream ratio is the coding's estimate, the loaded runtime
            reports the measured one).
        settings: the draft tree's shape (top-k; depth and verify budget as given, else their largest automatic
            values, narrowed by calibration at load). A copy is handed to the draft: the plan does not change.
        coded: offloaded layers are stored coded against their 4-bit substitutes (:mod:`subspec.codec`).
        head_bits: the draft's output head: 4 (a 4-bit copy of its vocabulary subset on the native kernel) or 16
            (the lm_head's own rows).
        head_rows: tokens of the draft head's vocabulary subset (the whole vocabulary: the lm_head's row count).
        kernels: the native kernel tier the run uses (:mod:`subspec.kernels`: amx, avx512, avx2, portable), or None
            (torch's kernels).
        advice: one line when the cost model predicts plain decoding faster at this budget, else None.
        cache_bytes: what the first start writes to the cache folder, by item (bytes; each is written once and read
            from the cache at later starts; an item already cached costs nothing again).
        first_start: a first start's predicted seconds by phase on this machine's kernel tier
            (:func:`first_start_work`, :func:`subspec.progress.predict`), everything to do.
        moe_experts: experts per layer of a mixture-of-experts model (0: dense).
        draft_choice: the draft-layers choice the placement made ('all' or 'offloaded'; auto's pick), None for ar.
    """

    opts: Options
    device: torch.device
    dtype: torch.dtype
    placement: Placement
    settings: TreeSettings
    coded: bool
    head_bits: int
    head_rows: int
    kernels: Optional[str]
    advice: Optional[str] = None
    cache_bytes: tuple[tuple[str, int], ...] = ()
    moe_experts: int = 0
    draft_choice: Optional[str] = None
    first_start: tuple[tuple[str, float], ...] = ()

    @property
    def substitutes(self) -> bool:
        """Whether the run drafts with substitutes (SubSpec) or decodes plainly (ar)."""
        return self.opts.method == "subspec"

    def tree_settings(self) -> TreeSettings:
        """A fresh copy of :attr:`settings` (calibration narrows the copy a draft holds)."""
        return dataclasses.replace(self.settings)

    def describe(self) -> str:
        """The plan as text: the placement table, then one line each for the kernels, the draft and the coding."""
        o, p, s = self.opts, self.placement, self.settings
        lines = [p.table()]
        if self.kernels and self.dtype == torch.bfloat16:
            lines.append(f"kernels: {self.kernels} (BF16 verification batch-invariant: equals plain decoding)")
        elif self.kernels:
            lines.append(f"kernels: {self.kernels} for the 4-bit substitutes, torch's for the {str(self.dtype).removeprefix('torch.')} layers")
        else:
            lines.append("kernels: torch's")
        if self.substitutes and not p.substituted and not p.offloaded:
            lines.append("draft: none needed, every layer resident (rounds run without a draft where it does not pay)")
        elif self.substitutes and not p.substituted:
            lines.append("draft: no room for any substitute at this budget: the draft is the embeddings and the head "
                         "alone (rarely right; rounds run without a draft where it does not pay): raise --device-memory")
        elif self.substitutes:
            layers = "every layer" if p.substitute_all else f"the {len(p.substituted)} offloaded layers"
            if p.draft_skipped:
                layers = (f"{len(p.substituted)} of the {len(p.offloaded)} offloaded layers (the draft skips the other "
                          f"{len(p.draft_skipped)}: no room for their substitutes)")
            head = "4-bit copy of" if self.head_bits == 4 else "lm_head rows of"
            depth = f"depth {s.depth}" if o.depth is not None else f"depth automatic (up to {s.depth})"
            budget = (f"verify budget {s.verify_budget}" if o.verify_budget is not None
                      else f"verify budget automatic (up to {s.verify_budget})")
            lines.append(f"draft: {o.bits}-bit group-{o.group_size} substitutes of {layers}; head: {head} "
                         f"{self.head_rows} tokens; tree: top-k {s.topk}, {depth}, {budget}")
        else:
            lines.append("draft: none (plain offloaded decoding)")
        if p.offloaded:
            moe = self.moe_experts
            how = (f"coded against their substitutes (about {p.stream_ratio:.0%} of the bytes)" if self.coded else
                   f"plain; attention read ahead, then only the routed of the {moe} experts of each layer"
                   if moe and p.tier == "disk" else "plain")
            lines.append(f"offloaded layers: {p.tier}, {how}")
        if self.cache_bytes:
            parts = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in self.cache_bytes)
            lines.append(f"disk: the first start writes about {fmt_bytes(sum(n for _, n in self.cache_bytes))} to the "
                         f"cache ({parts}), once")
        if self.first_start:
            from .progress import fmt_seconds

            parts = ", ".join(f"{name} {fmt_seconds(s)}" for name, s in self.first_start if s >= 0.5)
            lines.append(f"first start: about {fmt_seconds(sum(s for _, s in self.first_start))} of preparation "
                         f"({parts}; {self.kernels or 'torch'} tier's rates), once; later starts read the cache")
        if self.advice:
            lines.append(f"advice: {self.advice}")
        return "\n".join(lines)


def default_budget(device: torch.device) -> Optional[int]:
    """CUDA: free device memory minus 10 % (at least 512 MiB); CPU: None (everything resident)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free - max(0.1 * free, 512 << 20))


def make_plan(opts: Options, source, device: Optional[torch.device] = None) -> Plan:
    """Plan a run of ``opts`` on ``source`` (an opened checkpoint: only its config and family are read).

    Raises:
        SubspecError: an invalid option, a budget beyond the machine's memory or below the minimum (the message
            names the minimum), a tier that does not fit the device, a model too large for ``--offload none``, a
            kernel tier forced with ``SUBSPEC_KERNELS`` that this CPU cannot run.
    """
    opts.validate()
    device = device or resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype)
    check_device_memory(opts.device_memory, device)
    opts = replace(opts, max_context=model_context(opts, source.config))
    kernels = _kernel_tier(opts, device)
    if opts.demo_budget and opts.device_memory is None and opts.offload != "none":
        full = _placement(replace(opts, demo_budget=False), source, device, dtype, kernels, None)[0]
        opts = replace(opts, device_memory=full.full_draft_minimum + DEMO_RESIDENT_LAYERS * full.layer_bytes)
    budget = opts.device_memory if opts.device_memory is not None else default_budget(device)
    placement, settings, coded, head_bits, choice = _placement(opts, source, device, dtype, kernels, budget)
    advice = _advice(opts, source, device, dtype, kernels, placement, settings) if placement.offloaded else None
    rows = head_rows(source.config.vocab_size, draft_vocab_size(opts.draft_vocab))
    moe = source.family.moe
    plan = Plan(opts, device, dtype, placement, settings, coded, head_bits, rows, kernels, advice,
                _cache_bytes(opts, source, dtype, placement, coded), moe.experts(source.config) if moe else 0,
                draft_choice=choice)
    from .progress import predict

    whole = predict(kernels, first_start_work(plan, source, pending=False))
    return replace(plan, first_start=tuple(whole.items()))


def _cache_bytes(opts: Options, source, dtype: torch.dtype, placement, coded: bool) -> tuple[tuple[str, int], ...]:
    """Bytes the first start writes to the cache, by item: a GGUF's conversion to ``dtype`` (every weight), the
    offloaded layers' files (coded: about :data:`~subspec.codec.CODED_RATIO` of a layer) and the substitutes."""
    c = source.config
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    if str(opts.model).endswith(".gguf"):
        n_layers = len(placement.resident) + len(placement.offloaded)
        tables = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
        out.append(("GGUF conversion", tables * es + n_layers * placement.layer_bytes))
    if placement.tier == "disk" and placement.offloaded:
        ratio = placement.stream_ratio if coded else 1.0
        out.append(("offloaded layers", int(len(placement.offloaded) * (placement.layer_bytes * ratio + HEADER_BYTES))))
    if placement.substituted:
        out.append(("substitutes", len(placement.substituted) * placement.substitute_layer_bytes))
    return tuple(out)


def first_start_work(plan: Plan, source, pending: bool = True) -> dict[str, float]:
    """The work of a start of ``plan`` on ``source`` (an opened checkpoint; its path is read for the cache's state), by
    phase (:data:`subspec.progress.PHASES`): 'conversion' parameters (a GGUF not converted yet), 'content digest'
    bytes (files whose digest is not remembered), 'substitutes' and 'coding' parameters and 'packing' bytes (layers
    without a file in the cache), 'calibration' seconds of a one-token target forward (the cost model's, for a model,
    dtype and device not calibrated yet). With ``pending`` False: a first start's, everything to do. Only the
    cache's file names and memos are read; while the model's content key is unknown, everything is pending.
    """
    from . import layerfile
    from .codec import coded_folder
    from .costmodel import Rates, forecast
    from .loading import cached_state
    from .policy import calibrated
    from .quant import substitutes_folder
    from .tiers import packed_folder

    c, p = source.config, plan.placement
    es = torch.empty((), dtype=plan.dtype).element_size()
    layer_params = p.layer_bytes / es
    tables = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    path = Path(source.path)
    gguf = path.is_file()
    if pending and source.key:  # opened for loading: converted and hashed
        key, unhashed, convert = source.key, [], False
    elif pending:
        key, unhashed, convert = cached_state(path, plan.dtype)
    else:
        key, unhashed, convert = None, [path] if gguf else sorted(path.glob("*.safetensors")), gguf
    exists = (lambda folder, i, name: key is not None and (folder / name(i)).is_file())  # noqa: E731
    subs = SubstituteSpec(plan.opts.bits, plan.opts.group_size)
    coded = set(p.offloaded) & set(p.substituted) if plan.coded else set()
    todo_subs = [i for i in p.substituted
                 if not exists(substitutes_folder(key, subs) if key else None, i, lambda i: f"layer-{i:05d}.safetensors")]
    todo_coded = [i for i in coded if not exists(coded_folder(key, plan.dtype) if key else None, i, layerfile.file_name)]
    plain = [i for i in p.offloaded if i not in coded] if p.tier == "disk" else []
    todo_packed = [i for i in plain if not exists(packed_folder(key, plan.dtype) if key else None, i, layerfile.file_name)]
    work = {"conversion": (tables + len(p.resident + p.offloaded) * layer_params) if convert else 0.0,
            "content digest": float(sum(f.stat().st_size for f in unhashed)),
            "substitutes": len(todo_subs) * layer_params, "coding": len(todo_coded) * layer_params,
            "packing": float(len(todo_packed) * p.layer_bytes)}
    o = plan.opts
    if plan.substitutes and p.offloaded and (o.depth is None or o.verify_budget is None):
        if key is None or not calibrated(f"{key}|{plan.dtype}|{plan.device}|"):
            work["calibration"] = forecast(p, c, Rates.for_tier(plan.kernels), method="ar").t_single
    return {k: v for k, v in work.items() if v > 0}


def first_start_cache_bytes(plan: Plan, work: dict[str, float]) -> dict[str, int]:
    """Bytes the pending part of a start writes to the cache (``work``: :func:`first_start_work`'s), by item (those
    above zero): the conversion (parameters x element size), the substitutes, the coded layers (about
    :data:`~subspec.codec.CODED_RATIO` of a layer) and the packed ones, each file with its header. Checked against the
    free space before the first of them is written (:func:`subspec.runtime.load`), so a full disk is named at the
    start, not after minutes of writing."""
    from .codec import CODED_RATIO

    p = plan.placement
    es = torch.empty((), dtype=plan.dtype).element_size()
    layers = lambda phase: work.get(phase, 0.0) * es / p.layer_bytes if p.layer_bytes else 0.0  # noqa: E731
    packed = work.get("packing", 0.0)
    parts = {"conversion": work.get("conversion", 0.0) * es,
             "substitutes": layers("substitutes") * p.substitute_layer_bytes,
             "coded layers": layers("coding") * (CODED_RATIO * p.layer_bytes + HEADER_BYTES),
             "packed layers": packed + (packed / p.layer_bytes * HEADER_BYTES if p.layer_bytes else 0.0)}
    return {name: int(n) for name, n in parts.items() if n > 0}


def plan_for(opts: Options, source, device: Optional[torch.device] = None) -> tuple[Placement, TreeSettings]:
    """The placement and draft tree settings of :func:`make_plan` (a shorthand)."""
    plan = make_plan(opts, source, device)
    return plan.placement, plan.tree_settings()


def _kernel_tier(opts: Options, device: torch.device) -> Optional[str]:
    """The native kernel tier a run uses: asked for, on the CPU, and one available (built on first use)."""
    from . import kernels

    return kernels.active() if opts.native_kernels and device.type == "cpu" else None


def _placement(opts: Options, source, device, dtype, kernels: Optional[str],
               budget: Optional[int]) -> tuple[Placement, TreeSettings, bool, int, Optional[str]]:
    """(placement, tree settings, coded, draft head bits, draft-layers choice: 'all', 'offloaded' or None for ar) at
    ``budget``."""
    tier_kind = opts.offload if opts.offload != "auto" else ("host" if device.type == "cuda" else "disk")
    if tier_kind == "host" and device.type != "cuda":
        raise SubspecError("the host offload tier streams to a GPU: on a CPU use --offload disk")
    settings = tree_settings(opts)
    substitutes = opts.method == "subspec"
    # experts stream packed, each read as routed (subspec.tiers.DiskTier): a mixture-of-experts model is not coded
    coded = (substitutes and tier_kind == "disk" and _codes_offload(opts, device, dtype, kernels)
             and source.family.moe is None)
    head_bits = _draft_head_bits(opts, source.config, device, kernels) if substitutes else 16
    head_memory = draft_head_bytes(source.config, opts.draft_vocab, dtype, 4) if head_bits == 4 else 0
    coded_slot = 0  # coded layers stay coded in their slots (subspec.tiers.DiskTier): slots of a stream's size
    if coded:
        from .codec import slot_bytes

        coded_slot = slot_bytes(layer_layout(source.config, source.family, dtype).extent)
    head = draft_head_bytes(source.config, opts.draft_vocab, dtype, head_bits)
    verify = settings.verify_budget + 1 if opts.verify_budget is not None else None  # None: automatic
    scores = attention_materializes_scores(source.config, device, dtype)  # else the workspace holds masks only

    def rate(p: Placement) -> float:  # the cost model's tokens/s at the kernel tier's default machine rates
        from .costmodel import Rates, forecast

        return forecast(p, source.config, Rates.for_tier(kernels), method="subspec", draft_head_bytes=head, verify_tokens=verify,
                        topk=settings.topk).tokens_per_second

    def place(substitute_all: bool, trade: int = 0) -> Placement:
        p = plan_placement(source.config, source.family, dtype, budget if tier_kind != "none" else None,
                           max_context=opts.max_context, tree_nodes=settings.max_nodes if substitutes else 1,
                           spec=SubstituteSpec(opts.bits, opts.group_size), substitutes=substitutes,
                           tier=tier_kind, staging_slots=opts.staging_slots or 2,
                           verify_nodes=settings.verify_budget + 1 if substitutes else 1,
                           draft_width=settings.topk if substitutes else 0, max_resident=opts.max_resident,
                           substitute_all=substitute_all, draft_head=head_memory,
                           expert_streaming=opts.expert_streaming,
                           coded_slot=coded_slot, slot_trade=trade if opts.staging_slots is None else None,
                           attention_scores=scores)
        if coded and p.offloaded:  # an estimate until the coded files exist (the runtime reports the measured ratio)
            from .codec import CODED_RATIO

            coded_share = len(p.substituted) / len(p.offloaded) if p.draft_skipped else 1.0  # the rest: plain
            p = replace(p, stream_ratio=coded_share * CODED_RATIO + (1.0 - coded_share), stream_ratio_estimated=True)
        return p

    def place_slots(substitute_all: bool) -> Placement:
        """Coded slots: as many resident layers given up for more slots as pay (the cost model: a slot of a coded
        stream is 60 % of a layer and is read while the draft runs, a resident layer saves its stream every verify)."""
        first = place(substitute_all)
        if not coded_slot or opts.staging_slots is not None or not first.resident:
            return first
        return max([first] + [place(substitute_all, t) for t in range(1, len(first.resident) + 1)], key=rate)

    if not substitutes or opts.draft_layers != "auto":
        placement = place_slots(substitutes and opts.draft_layers == "all")
        choice = opts.draft_layers if substitutes else None
    else:  # the cost model's choice: a draft on substitutes only reads fewer bytes but leaves fewer layers resident
        offloaded, every = place_slots(False), place_slots(True)
        placement, choice = (every, "all") if rate(every) > rate(offloaded) else (offloaded, "offloaded")
    coded = coded and bool(placement.substituted)  # a layer without a substitute is stored plainly
    if tier_kind == "none" and budget is not None and placement.total > budget:
        raise SubspecError(f"the model needs {fmt_bytes(placement.total)} fully resident, over the budget of "
                           f"{fmt_bytes(budget)}: use --offload disk (CPU) or host (CUDA)")
    return placement, settings, coded, head_bits, choice


def _codes_offload(opts: Options, device: torch.device, dtype: torch.dtype, kernels: Optional[str]) -> bool:
    """Whether a disk tier's offloaded layers are coded against their substitutes (:mod:`subspec.codec`): asked for,
    BF16 on a CPU with a native kernel tier, 4-bit substitutes of a group the native kernel takes."""
    return (opts.coded_offload and opts.method == "subspec" and device.type == "cpu" and dtype == torch.bfloat16
            and opts.bits == 4 and (opts.group_size == 32 or opts.group_size % 64 == 0) and kernels is not None)


def _draft_head_bits(opts: Options, config, device: torch.device, kernels: Optional[str]) -> int:
    """4 where the draft head can be a 4-bit copy on the native kernel (asked for, CPU, a 64-multiple hidden size),
    else 16 (the lm_head's own rows)."""
    from .kernels import linear_fits

    rows = head_rows(config.vocab_size, draft_vocab_size(opts.draft_vocab))
    ok = (opts.draft_head_bits == 4 and device.type == "cpu" and kernels is not None and config.hidden_size % 64 == 0
          and rows % 16 == 0 and linear_fits(rows, config.hidden_size))
    return 4 if ok else 16


def _advice(opts: Options, source, device, dtype, kernels, placement: Placement, settings: TreeSettings) -> Optional[str]:
    """One line when the cost model (the kernel tier's default rates, so a plan does not move with a noisy
    measurement) predicts plain decoding faster than subspec at this budget: where ar keeps every layer resident
    (e.g. a small model on a CPU: a verify forward over a tree costs several one-token forwards there), or where a
    budget near subspec's minimum leaves it few staging slots. The run goes on as asked; its depth policy drafts
    only where drafting pays."""
    if opts.method != "subspec":
        return None
    from .costmodel import Rates, forecast

    budget = opts.device_memory if opts.device_memory is not None else default_budget(device)
    ar_placement = _placement(replace(opts, method="ar"), source, device, dtype, kernels, budget)[0]
    rates = Rates.for_tier(kernels)
    ar = forecast(ar_placement, source.config, rates, method="ar")
    verify = settings.verify_budget + 1 if opts.verify_budget is not None else None  # None: automatic
    sub = forecast(placement, source.config, rates, method="subspec", verify_tokens=verify, topk=settings.topk,
                   draft_head_bytes=draft_head_bytes(source.config, opts.draft_vocab, dtype))
    if sub.tokens_per_second >= ar.tokens_per_second:
        return None
    why = "the whole model fits without offloading: " if not ar_placement.offloaded else ""
    return (f"at this budget {why}plain decoding (--method ar) is predicted faster ({ar.tokens_per_second:.1f} "
            f"against {sub.tokens_per_second:.1f} tokens/s at the {kernels or 'torch'} tier's default rates); "
            f"`subspec plan` shows the forecast at this machine's")
