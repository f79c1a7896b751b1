"""Placement: which decoder layers stay resident on the device and which are offloaded, under a byte budget.

A pure function of the config, dtype and settings (no weights are loaded): it accounts for everything that must
live on the device — embeddings, lm_head, norms, the static KV cache (max context + tree scratch), the
substitutes of offloaded layers, the staging slots of the offload tier, and a workspace for activations — and
then keeps as many full-precision layers resident as fit (design.md §3.1). On a CPU the "device" is RAM.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import SubspecError
from .families import Family, distinct_experts, head_dim, linear_shapes, mlp_width, router_rows
from .kvcache import KVCache
from .layout import layer_layout
from .sampling import SAMPLING_BYTES_PER_LOGIT, SAMPLING_ROWS

SLACK_FIXED, SLACK = 64 << 20, 0.10
"""Reserve for what the itemized bytes do not cover: a fixed part (libraries loaded while preparing, e.g. HQQ's
modules on a first start, thread pools, allocator arenas) plus a share of the itemized bytes (fragmentation,
temporaries of a forward). Measured peak RSS above the process's fixed overhead, first start (quantizing,
calibrating) and later starts (tests/test_memory.py; tests/peak_memory_worker.py on the 1.5B): SmolLM2-135M FP32 at
its minimum budget needed about 60 MiB over 292 MiB itemized; Qwen2.5-1.5B in BF16 at 2.5 GiB (13 resident layers)
240 MiB over 2.44 GB itemized while sampling (10 %), less when greedy or loading."""


def slack(nbytes: int) -> int:
    """The allocator reserve for ``nbytes`` of itemized device memory: :data:`SLACK_FIXED` + :data:`SLACK` x bytes."""
    return SLACK_FIXED + int(SLACK * nbytes)


PREFILL_CHUNK = 256
"""Prompts are prefilled in chunks of this many tokens, which bounds the prefill workspace."""

VERIFY_LOGIT_ROWS = 33
"""A verify forward makes the target's logits this many tree nodes at a time (each chunk chosen from, then dropped),
which bounds the verify's logits workspace: a 129-node tree's whole [129, vocab] logits would be 12 MiB of
SmolLM2's 300 MiB budget (three staging slots), the 1.5B's 37 MiB. 33 rows (a verify budget of 32 and the root)
keep the lm_head's weights read once for the trees the calibration chooses on CPUs (budgets 16 and 32)."""


@dataclass(frozen=True)
class SubstituteSpec:
    """Low-bit substitute settings (HQQ): ``bits`` in {2, 3, 4, 8}, ``group_size`` weights per scale/zero.

    ``bits = 16`` means the dense weights themselves ("self" draft, for measuring the upper bound of tau).
    """

    bits: int = 4
    group_size: int = 64

    def linear_bytes(self, out_f: int, in_f: int, elem_bytes: int) -> int:
        """Bytes of one substituted [out_f, in_f] weight: packed codes + a scale and a zero per group."""
        n = out_f * in_f
        if self.bits == 16:  # "self": the full-precision weight as its own substitute (an upper bound)
            return n * elem_bytes
        codes = {2: n // 4, 3: (n + 9) // 10 * 4, 4: n // 2, 8: n}[self.bits]
        return codes + 2 * (n // self.group_size) * elem_bytes


def parse_bytes(text: str) -> int:
    """Parse a size such as ``1.5GiB``, ``800MiB``, ``2G``, ``512M`` or a plain (whole) byte count. Units are binary
    whether or not written with an ``i``: ``1GB`` = ``1GiB`` = 2^30 bytes.

    Raises:
        SubspecError: unreadable size, or a fraction without a unit (``1.5``: bytes cannot be fractional; a unit
        was probably left out).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise SubspecError(f"cannot read the size '{text}': write it like 1.5GiB, 800MiB or 2G")
    if not m.group(2) and "." in m.group(1):
        raise SubspecError(f"the size '{text}' has no unit (a byte count is a whole number): write it like "
                           f"{m.group(1)}GiB or {m.group(1)}MiB")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def fmt_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass(frozen=True)
class Placement:
    """The result of :func:`plan_placement`.

    Attributes:
        resident: indices of full-precision layers kept on the device. offloaded: the others, in forward order.
        items: itemized device bytes (name, bytes, detail), summed in ``total``.
        budget: the budget in bytes (None = unlimited). layer_bytes: one layer's packed extent.
        substitute_layer_bytes: one layer's substitute. staging_slots: slots of the offload tier.
        tier: 'none', 'disk' or 'host'. minimum: the smallest budget that works with these settings.
        full_draft_minimum: the smallest budget at which every offloaded layer has its substitute (= ``minimum``
            without substitutes).
        embeddings_offloaded: the (untied) embedding table stays with the offloaded weights, rows read on demand.
        substitute_all: every layer has a substitute (the draft runs on substitutes only), not just the offloaded.
        stream_ratio: file bytes a target forward reads per byte of offloaded layer: below 1 when the offloaded
            layers are coded against their substitutes (:mod:`subspec.codec`; an estimate until the files exist,
            then the measured ratio: ``stream_ratio_estimated`` says which, and :meth:`summary` marks an estimate
            with "~"). It changes what a forward reads, not what memory holds.
        draft_layers: when the budget cannot hold a substitute for every offloaded layer (no layer resident), the
            offloaded layers that get one (:func:`spread_substitutes`); the draft skips the others (their residual
            stream passes through, as in self-speculative layer skipping: Zhang et al. 2024, "Draft & Verify"; Xia et
            al. 2025, "SWIFT"). None: every offloaded layer has a substitute.
        experts: a mixture-of-experts model streamed by expert (the disk tier): (attention unit bytes, expert unit
            bytes, experts per layer, top-k): a forward reads the attention and the experts its tokens route to
            (:meth:`streamed_bytes`). None: whole layers.
        resident_attention: offloaded layers of a model streamed by expert whose attention unit stays in memory
            (read once at load: every forward needs it).
        expert_cache: experts of each offloaded layer kept in memory, the most used so far (an LFU cache the disk
            tier fills as it streams: a routed expert found there is not read).
        slot_bytes: bytes of one staging slot: a layer's extent, or where the offloaded layers are coded against
            their substitutes, their coded stream (:func:`subspec.codec.slot_bytes`, about 60 % of a layer).
    """

    resident: list[int]
    offloaded: list[int]
    items: list[tuple[str, int, str]]
    budget: int | None
    layer_bytes: int
    substitute_layer_bytes: int
    staging_slots: int
    tier: str
    minimum: int
    spec: SubstituteSpec = field(default_factory=SubstituteSpec)
    embeddings_offloaded: bool = False
    substitute_all: bool = False
    stream_ratio: float = 1.0
    stream_ratio_estimated: bool = False
    draft_layers: tuple[int, ...] | None = None
    full_draft_minimum: int = 0
    experts: tuple[int, int, int, int] | None = None
    resident_attention: tuple[int, ...] = ()
    expert_cache: int = 0
    slot_bytes: int = 0

    @property
    def substituted(self) -> list[int]:
        """Layers that get a substitute: the offloaded ones (those of :attr:`draft_layers` when the budget is short),
        or all with :attr:`substitute_all`."""
        if not self.substitute_layer_bytes:
            return []
        if self.draft_layers is not None:
            return list(self.draft_layers)
        return sorted(self.resident + self.offloaded) if self.substitute_all else list(self.offloaded)

    @property
    def draft_skipped(self) -> list[int]:
        """Offloaded layers without a substitute, which the draft skips (empty unless the budget is short)."""
        if not self.substitute_layer_bytes or self.draft_layers is None:
            return []
        return [i for i in self.offloaded if i not in self.draft_layers]

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.items)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights kept on the device in full precision: embeddings, lm_head, norms, resident layers."""
        return sum(b for name, b, _ in self.items if name in ("embeddings", "lm_head", "norms", "resident layers"))

    @property
    def offloaded_bytes(self) -> int:
        """Bytes streamed by one target forward of one token (whole layers; of a mixture of experts streamed by
        expert, the attention and the top-k experts of each offloaded layer)."""
        return self.streamed_bytes(1)

    def streamed_bytes(self, tokens: float) -> int:
        """Bytes one target forward over ``tokens`` tokens streams: whole layers (times the coding's ratio), or for
        experts streamed by expert, each offloaded layer's attention and the distinct experts its tokens route to
        (expected under uniform routing: :func:`~subspec.families.distinct_experts`; a verify's bytes grow with the
        experts its tree touches)."""
        if self.experts is None:
            return int(len(self.offloaded) * self.layer_bytes * self.stream_ratio)
        attention, expert, n, top_k = self.experts
        miss = 1.0 - self.expert_cache / n  # the cache's hit rate under uniform routing (skewed routing: higher)
        return round((len(self.offloaded) - len(self.resident_attention)) * attention
                     + len(self.offloaded) * expert * distinct_experts(n, top_k, tokens) * miss)

    def summary(self) -> str:
        """One line: resident/offloaded counts, tier and streamed bytes per forward."""
        n = len(self.resident) + len(self.offloaded)
        about = "~" if self.stream_ratio_estimated and self.stream_ratio < 1 else ""  # (before the coded files exist)
        tier = self.tier + (f", coded to {about}{self.stream_ratio:.0%}" if self.stream_ratio < 1 else "")
        if self.experts is None:
            per = "per target forward"
        else:
            attention = "attention resident" if self.resident_attention else "attention"
            cache = f", {self.expert_cache} cached" if self.expert_cache else ""
            per = (f"per one-token forward ({attention} + {self.experts[3]} of {self.experts[2]} experts a layer"
                   f"{cache})")
        ahead = f", {self.staging_slots} staging slots" if self.staging_slots > 2 else ""
        return (f"{len(self.resident)}/{n} layers resident, {len(self.offloaded)} offloaded ({tier}{ahead}), "
                f"{about}{fmt_bytes(self.offloaded_bytes)} streamed {per}"
                + ("; draft on substitutes of every layer" if self.substitute_all and not self.draft_skipped else "")
                + (f"; the draft skips {len(self.draft_skipped)} layers (no room for their substitutes)"
                   if self.draft_skipped else ""))

    def table(self) -> str:
        """The itemized byte account as a text table."""
        rows = [("item", "bytes", "detail")] + [(n, fmt_bytes(b), d) for n, b, d in self.items]
        rows.append(("total", fmt_bytes(self.total), "budget " + (fmt_bytes(self.budget) if self.budget else "unlimited")))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines = [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        lines.append(self.summary())
        lines.append(f"minimum budget for these settings: {fmt_bytes(self.minimum)}"
                     + (f" ({fmt_bytes(self.full_draft_minimum)} for a substitute of every layer)"
                        if self.full_draft_minimum > self.minimum else ""))
        return "\n".join(lines)


def spread_resident(r: int, n_layers: int) -> list[int]:
    """Which ``r`` of ``n_layers`` layers stay resident: evenly spaced, each after a run of offloaded layers
    (layer ``ceil((j + 1) * n_layers / r) - 1`` for j < r; all of them when r = n_layers).

    Why not the first r: a forward computes its layers in order while the offload tier reads ahead into its staging
    slots. With the resident layers first, a forward begins with r layers of compute while the slots, filled during
    the previous round, are full and the disk idles: on the 1.5B, 8 resident layers of a 100-node verify are ~0.1 s of
    disk time lost per round. Spread out, each resident layer computes while the disk reads the next offloaded one.
    """
    return [-(-(j + 1) * n_layers // r) - 1 for j in range(r)] if r else []


def spread_substitutes(n: int, n_layers: int) -> list[int]:
    """Which ``n`` of ``n_layers`` offloaded layers get a substitute when the budget holds only ``n``: the first and
    the last always (the layers whose skipping hurts a draft most: Elhoushi et al. 2024, "LayerSkip", fig. 2; Xia et
    al. 2025, "SWIFT"), the rest evenly spaced between them."""
    if n >= n_layers:
        return list(range(n_layers))
    if n <= 1:
        return [0][:n]
    return sorted({round(j * (n_layers - 1) / (n - 1)) for j in range(n)})


def plan_placement(config, family: Family, dtype: torch.dtype, budget: int | None, *, max_context: int = 2048,
                   tree_nodes: int = 1, spec: SubstituteSpec = SubstituteSpec(), substitutes: bool = True,
                   tier: str = "disk", staging_slots: int = 2, verify_nodes: int = 0,
                   draft_width: int = 0, max_resident: int | None = None,
                   offload_embeddings: bool = True, substitute_all: bool = False, draft_head: int = 0,
                   expert_streaming: bool = True, coded_slot: int = 0, slot_trade: int | None = 0,
                   attention_scores: bool = True) -> Placement:
    """Decide resident and offloaded layers under ``budget`` bytes of device memory.

    Args:
        config: transformers config. family: the family record. dtype: compute dtype.
        budget: device bytes available to the model (None = everything resident).
        max_context: tokens of context the KV cache must hold. tree_nodes: the largest draft tree (KV scratch).
            spec: substitute settings. substitutes: whether offloaded layers get substitutes (SubSpec) or not
            (plain offloading). tier: 'disk' or 'host' for offloaded layers. staging_slots: ring size.
            verify_nodes: the largest verified tree (workspace; default tree_nodes). draft_width: tokens per draft
            step (their logits). max_resident: keep at most this many layers resident (like-for-like sweeps).
        offload_embeddings: when the budget cannot hold every layer and the embedding table is not tied to the
            lm_head, keep the table with the offloaded weights (a forward reads only its tokens' rows) and give its
            bytes to layers (:class:`~subspec.embedding.EmbeddingRows`).
        substitute_all: every layer gets a substitute, resident ones too (the draft runs on substitutes only).
        draft_head: bytes of the draft's own output head (a 4-bit copy of its vocabulary subset; 0: a view of the
            lm_head). expert_streaming: a mixture-of-experts model on the disk tier reads only routed experts.
        coded_slot: bytes of a staging slot holding a coded layer's stream (the offloaded layers are coded against
            their substitutes; 0: slots of whole layers). Then ``slot_trade`` resident layers are given up (at most
            those kept) and the budget's rest holds more slots, at most one per offloaded layer: slots are the
            tier's read-ahead (``slot_trade`` None: ``staging_slots`` slots, no more). A draft that skips layers
            (plain files beside coded ones) keeps slots of whole layers.
        attention_scores: the torch attention materializes its ``[heads, T, keys]`` float32 scores (SDPA's math
            kernel; :func:`~subspec.model.attention_materializes_scores`): the workspace holds them. False: a fused
            kernel works in blocks, and the workspace holds its masks instead (boolean and additive, 5 bytes a score).

    Returns:
        A :class:`Placement` keeping as many layers resident as fit, spread evenly among the offloaded ones
        (:func:`spread_resident`). Substitutes come first: a layer stays resident only when every offloaded layer
        has its substitute; below that (every layer offloaded) as many offloaded layers as fit get one
        (:func:`spread_substitutes`) and the draft skips the rest, so SubSpec runs at any budget plain offloading
        runs at, with the draft's head and tree workspace on top.

    Raises:
        SubspecError: ``budget`` is below the minimum (every layer offloaded, no substitute); the message names the
            minimum.
    """
    es = torch.empty((), dtype=dtype).element_size()
    L, H, V = config.num_hidden_layers, config.hidden_size, config.vocab_size
    moe = family.moe
    I = mlp_width(config, per_token=True)  # a mixture of experts: its top-k experts' rows, side by side
    nh, kvh = config.num_attention_heads, config.num_key_value_heads
    hd = head_dim(config)
    layout = layer_layout(config, family, dtype)
    norm_shapes = family.layer_norm_shapes(config)
    norm_elems = sum(shape[0] for _, _, shape in norm_shapes)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shapes = list(linear_shapes(config).values())
    bias_bytes = layout.nbytes - sum(o * i for o, i in shapes) * es
    sub = sum(spec.linear_bytes(o, i, es) for o, i in shapes) + bias_bytes if substitutes else 0
    max_slots = max_context + tree_nodes
    verify_nodes = min(verify_nodes or tree_nodes, tree_nodes)
    T = max(verify_nodes, PREFILL_CHUNK)
    work = (T * (4 * H + 2 * (nh + 2 * kvh) * hd + 3 * I) * es  # hidden states, q/k/v/o, MLP
            + (nh * T * max_slots * 4 + tree_nodes * max_slots      # attention scores (float32), tree masks
               if attention_scores else 5 * T * max_slots)          # or a fused kernel's masks (bool, additive)
            + min(verify_nodes, VERIFY_LOGIT_ROWS) * V * es         # verify logits, made a chunk of rows at a time
            + draft_width * V * (es + 8)                            # draft logits, their float32 copy and scaling
            + SAMPLING_ROWS * V * SAMPLING_BYTES_PER_LOGIT          # top-k / top-p sampling, a few rows at a time
            + (5 * T * max_slots if any(family.windows(config)) else 0))  # window mask (bool and additive)
    emb = [("embeddings", V * H * es, f"{V} x {H}")]
    fixed = [
        ("lm_head", 0 if tied else V * H * es, "tied to embeddings" if tied else f"{V} x {H}"),
        ("norms", (L * norm_elems + H) * family.norm.gain_bytes(es), f"{L * len(norm_shapes) + 1} RMSNorms"),
    ] + ([("routers", L * router_rows(moe.experts(config)) * H * es, f"{L} x {moe.experts(config)} x {H}")]
         if moe is not None else []) + [
        ("kv cache", KVCache.nbytes_for(L, kvh, hd, max_slots, es), f"{max_context} context + {tree_nodes} tree slots"),
        ("workspace", work, f"activations for {T} tokens"),
    ] + ([("draft head", draft_head, "4-bit copy of the draft's vocabulary subset of the lm_head")] if draft_head else [])
    base = sum(b for _, b, _ in fixed)

    def full_draft(r: int) -> int:  # substitutes when every one fits: the offloaded layers' (all with substitute_all)
        return (L if substitute_all else L - r) if substitutes else 0

    def planned(r: int, nsub: int | None = None, extra: int = 0) -> int:
        return base + emb[0][1] + layers(r, full_draft(r) if nsub is None else nsub) + extra

    def layers(r: int, nsub: int) -> int:  # every substitute held and coded slots: slots of streams
        slot = coded_slot if coded_slot and nsub >= full_draft(r) else layout.extent
        return r * layout.extent + nsub * sub + (staging_slots * slot if r < L else 0)

    def account(r: int, nsub: int | None = None, extra: int = 0) -> int:  # + the allocator's slack: 5-17 % on CPU
        return planned(r, nsub, extra) + slack(planned(r, nsub, extra))

    offload_emb = offload_embeddings and not tied and budget is not None and account(L) > budget
    if offload_emb:  # the budget binds: the table's bytes buy layers; a forward reads only its own tokens' rows
        emb = [("embeddings", 0, f"{V} x {H}, with the offloaded weights (rows read on demand)")]
    minimum = account(0, 0)
    nsub = None  # a substitute for every offloaded layer (every layer with substitute_all)
    if budget is None:
        r = L
    else:
        if budget < minimum:
            raise SubspecError(
                f"device memory budget {fmt_bytes(budget)} is below the minimum of {fmt_bytes(minimum)} for this model "
                f"(every layer offloaded, {max_context}-token context): raise --device-memory or lower --max-context"
            )
        fits = [k for k in range(L + 1) if account(k) <= budget]
        if fits:
            r = max(fits)
        else:  # not even every substitute fits: all layers offloaded, as many substitutes as fit
            r, nsub = 0, max(n for n in range(L + 1) if account(0, n) <= budget)
    if max_resident is not None:
        r = min(r, max_resident)
    units = None  # a mixture of experts streamed by expert: (attention units resident, cached experts a layer)
    if layout.experts and expert_streaming and tier == "disk" and budget is not None and r < L:
        by_unit = _unit_residency(layout, moe.top_k(config), L, budget, lambda k: planned(k, nsub))
        if max_resident is None:  # whole layers or units: the fewest bytes a token streams
            r = min(range(r + 1), key=lambda k: (by_unit(k)[2], -k))
        units = by_unit(r)[:2]
    slots = staging_slots
    if coded_slot and slot_trade is not None and budget is not None and r < L and nsub is None and not layout.experts:
        r = max(0, r - slot_trade)  # a layer given up frees more than the substitute it then needs
        while slots < L - r and account(r, None, (slots + 1 - staging_slots) * coded_slot) <= budget:
            slots += 1
    off = L - r
    nsub = full_draft(r) if nsub is None else nsub
    partial = substitutes and sub > 0 and nsub < off
    slot = coded_slot if coded_slot and not partial and not layout.experts else layout.extent
    unit_extra = (slots - staging_slots) * slot
    n_att, n_cache = units or (0, 0)
    unit_bytes = n_att * layout.units[0][1] + off * n_cache * (layout.units[1][1] if layout.experts else 0)
    unit_bytes += unit_extra
    items = emb + fixed + [("allocator slack", slack(planned(r, nsub, unit_bytes)),
                            f"{fmt_bytes(SLACK_FIXED)} + {SLACK:.0%} of the rest")] + [
        ("resident layers", r * layout.extent, f"{r} x {fmt_bytes(layout.extent)}"),
        ("substitutes", nsub * sub, f"{nsub} x {fmt_bytes(sub)} ({spec.bits}-bit, group {spec.group_size})"
         + (", every layer" if substitute_all and not partial else "")
         + (f"; the draft skips the other {off - nsub} layers" if partial else "") if substitutes else "none (plain offloading)"),
        ("staging slots", slots * slot if off else 0,
         (f"{slots} x {fmt_bytes(slot)}" + (" (coded streams; the disk reads ahead into them while the draft runs)"
                                            if slot < layout.extent else "")) if off else "none"),
    ] + ([("resident attention", n_att * layout.units[0][1], f"{n_att} x {fmt_bytes(layout.units[0][1])} (of the "
           "offloaded layers: every forward reads it)"),
          ("expert cache", off * n_cache * layout.units[1][1], f"{n_cache} of {layout.experts} experts x {off} "
           f"layers x {fmt_bytes(layout.units[1][1])} (the most used so far)")] if units else [])
    resident = spread_resident(r, L)
    return Placement(resident, [i for i in range(L) if i not in resident], items, budget, layout.extent, sub,
                     slots if off else 0, tier if off else "none", minimum, spec, offload_emb,
                     substitute_all and substitutes and not partial,
                     draft_layers=tuple(spread_substitutes(nsub, L)) if partial else None,
                     full_draft_minimum=account(0),
                     experts=((layout.units[0][1], layout.units[1][1], layout.experts, moe.top_k(config))
                              if layout.experts and expert_streaming and tier == "disk" and off else None),
                     resident_attention=tuple(i for i in range(L) if i not in resident)[:n_att],
                     expert_cache=n_cache, slot_bytes=slot if off else 0)


def _unit_residency(layout, top_k: int, L: int, budget: int, planned) -> Callable[[int], tuple[int, int, float]]:
    """For a mixture of experts streamed by expert with ``k`` whole layers resident: the budget's rest buys the
    attention units of the offloaded layers first (every forward reads them), then the same number of cached experts
    for each offloaded layer. ``planned(k)``: the itemized bytes without them (the allocator slack comes on top).

    Returns:
        ``k -> (attention units resident, cached experts a layer, bytes a one-token forward streams)``.
    """
    attention, expert, n = layout.units[0][1], layout.units[1][1], layout.experts

    def of(k: int) -> tuple[int, int, float]:
        off = L - k
        spare = max(0, int((budget - SLACK_FIXED) / (1 + SLACK)) - planned(k))
        n_att = min(off, spare // attention)
        cache = min(n, (spare - n_att * attention) // (off * expert)) if n_att == off and off else 0
        return n_att, cache, (off - n_att) * attention + off * top_k * expert * (1 - cache / n)
    return of
