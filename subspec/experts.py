"""What the disk tier keeps in memory of the layers it streams by expert (a mixture of experts).

A forward of an expert-streamed layer needs its attention unit (every forward) and the units of the experts its
tokens route to (:class:`~subspec.tiers.DiskTier`). Two kinds of memory save those reads, both sized by the placement
(:attr:`~subspec.placement.Placement.resident_attention`, :attr:`~subspec.placement.Placement.expert_cache`):

- resident attention: a layer's attention unit read once at load and kept;
- an expert cache: ``capacity`` experts of each layer kept in memory, chosen least-frequently-used (LFU): every
  routed expert counts one use; a missed expert is read into a free cache entry, or in place of the cached expert
  used least so far when it has been used more (the experts the forward needs are never evicted), else into the
  staging slot as before. Frequencies follow the generation, so the cache holds the hot experts of what is being
  generated (routing is far from uniform in real mixtures of experts).
"""
from __future__ import annotations

from typing import Optional

import torch

from .layout import ALIGN, LayerLayout
from .weights import dense_linears


def aligned_bytes(n: int) -> torch.Tensor:
    """A zeroed uint8 tensor of ``n`` bytes starting at a 4 KiB boundary (a destination for O_DIRECT reads)."""
    raw = torch.zeros(n + ALIGN, dtype=torch.uint8)
    off = -raw.data_ptr() % ALIGN
    return raw[off:off + n]


class ExpertResidency:
    """Resident attention units and an LFU expert cache for the expert-streamed layers of one disk tier.

    Args:
        layout: the layer layout (with expert units). layers: the expert-streamed layers. attention: those of them
            whose attention unit stays in memory (filled by :meth:`hold_attention`). capacity: cached experts per
            layer (0: none). native: run the held linears on the native kernels where they apply.

    Counters: ``hits`` / ``misses`` (routed experts found in the cache or read).
    """

    def __init__(self, layout: LayerLayout, layers: list[int], attention: set[int], capacity: int, native: bool):
        self.layout, self.native = layout, native
        self.attention_layers = set(attention) & set(layers)
        self.capacity = min(capacity, layout.experts)
        self.hits = self.misses = 0
        self._attention: dict[int, tuple] = {}
        n_exp, unit = layout.experts, layout.units[1][1] if layout.experts else 0
        self._uses = {i: [0] * n_exp for i in layers}
        self._where: dict[int, dict[int, int]] = {i: {} for i in layers}  # layer -> expert -> cache entry
        self._free = {i: list(range(self.capacity)) for i in layers}  # entries holding nothing
        self._buf = {i: aligned_bytes(self.capacity * unit) for i in layers} if self.capacity else {}
        self._lins: dict[int, list[Optional[tuple]]] = {i: [None] * self.capacity for i in layers}

    def hold_attention(self, layer: int, buf: torch.Tensor) -> None:
        """Keep ``buf`` (the layer's attention unit, read and checked) as its resident attention."""
        lin = dense_linears(self.layout.views(buf, 0), self.native)
        self._attention[layer] = (buf, tuple(lin[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")))

    def attention(self, layer: int) -> Optional[tuple]:
        """(q, k, v, o) linears of a layer whose attention is resident, else None."""
        held = self._attention.get(layer)
        return held[1] if held else None

    def cached(self, layer: int, expert: int) -> Optional[tuple]:
        """(gate, up, down) of a cached expert, else None."""
        c = self._where[layer].get(expert)
        return None if c is None else self._lins[layer][c]

    def route(self, layer: int, experts: list[int]) -> tuple[list[int], dict[int, int]]:
        """Count one use of each routed expert and decide where the missing ones go.

        Returns:
            (experts to read into the staging slot, {expert: cache entry to read it into}).
        """
        uses, where = self._uses[layer], self._where[layer]
        for e in experts:
            uses[e] += 1
        missing = [e for e in experts if e not in where]
        self.hits += len(experts) - len(missing)
        self.misses += len(missing)
        if not self.capacity:
            return missing, {}
        to_slot, to_cache = [], {}
        free = self._free[layer]
        needed = set(experts)
        for e in sorted(missing, key=lambda e: -uses[e]):  # the most used first
            if free:
                to_cache[e] = free.pop()
                continue
            victims = [v for v in where if v not in needed and v not in to_cache]
            victim = min(victims, key=lambda v: uses[v], default=None)
            if victim is not None and uses[victim] < uses[e]:
                to_cache[e] = where.pop(victim)
            else:
                to_slot.append(e)
        return to_slot, to_cache

    def entry(self, layer: int, c: int) -> torch.Tensor:
        """Cache entry ``c`` of ``layer`` (uint8, one expert unit): where :meth:`admit` expects the expert's bytes."""
        unit = self.layout.units[1][1]
        return self._buf[layer][c * unit:(c + 1) * unit]

    def admit(self, layer: int, expert: int, c: int) -> None:
        """Record that cache entry ``c`` of ``layer`` now holds ``expert`` (read and checked)."""
        self._where[layer][expert] = c
        lin = dense_linears(self.layout.views(self.entry(layer, c), 1 + expert), self.native)
        self._lins[layer][c] = tuple(lin[f"experts.{expert}.{n}"] for n in ("gate_proj", "up_proj", "down_proj"))

    def forget(self, layer: int, c: int) -> None:
        """Cache entry ``c`` of ``layer`` (given out by :meth:`route`, not yet admitted) holds nothing usable: a read
        into it failed. It is free again."""
        self._free[layer].append(c)
