"""Byte layout of one decoder layer's linears packed into a single contiguous extent.

An offloaded layer moves as one block: the linears' weights (and biases) in the compute dtype, each tensor at a
64-byte-aligned offset, the block padded to 4 KiB so it can be read with O_DIRECT and copied to the device in
one transfer. The same layout sizes the staging slots, so placement and the tiers agree to the byte.

A mixture-of-experts layer is laid out in **units**: the attention linears first, then each expert's three linears,
every unit starting at a 4 KiB boundary, so that the disk tier can read the attention part and then only the experts
the forward's tokens route to (:attr:`LayerLayout.units`), each with one aligned read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import Family, linear_prefix, linear_shapes

ALIGN = 4096
_TENSOR_ALIGN = 64


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorSlot:
    """One tensor inside a layer extent: checkpoint suffix (e.g. ``self_attn.q_proj.weight``), shape, byte offset."""

    name: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class LayerLayout:
    """The packed layout of a decoder layer.

    Attributes:
        tensors: the tensors in order. dtype: their dtype. nbytes: payload bytes (weights + biases).
        extent: the padded size of one layer block (multiple of 4 KiB).
        units: (offset, bytes) of the parts a tier may read separately, 4 KiB-aligned, covering the extent: one unit
            (the whole layer) for a dense layer; for a mixture-of-experts layer the attention part, then expert e's
            three linears as unit ``1 + e``.
    """

    tensors: tuple[TensorSlot, ...]
    dtype: torch.dtype
    nbytes: int
    extent: int
    units: tuple[tuple[int, int], ...] = ()

    @property
    def experts(self) -> int:
        """Experts laid out as units of their own (0 for a dense layer)."""
        return max(len(self.units) - 1, 0)

    def sizes(self) -> tuple[int, ...]:
        """Bytes of each tensor of :attr:`tensors`, in order."""
        es = torch.empty((), dtype=self.dtype).element_size()
        out = []
        for t in self.tensors:
            n = es
            for d in t.shape:
                n *= d
            out.append(n)
        return tuple(out)

    def views(self, buf: torch.Tensor, unit: int | None = None) -> dict[str, torch.Tensor]:
        """Typed views of each tensor into ``buf`` (a uint8 tensor of >= ``extent`` bytes); with ``unit``, of that
        unit's tensors into ``buf`` holding only the unit (its bytes from the unit's start, :attr:`units`)."""
        start, n_unit = (0, self.extent) if unit is None else self.units[unit]
        return {t.name: buf[t.offset - start:t.offset - start + n].view(self.dtype).view(t.shape)
                for t, n in zip(self.tensors, self.sizes()) if start <= t.offset < start + n_unit}


def biased_linears(config, family: Family) -> set[str]:
    """Names of the linears that carry a bias: q/k/v for Qwen2; q/k/v/o with ``attention_bias``; MLP with ``mlp_bias``."""
    out = set()
    if family.qkv_bias:
        out |= {"q_proj", "k_proj", "v_proj"}
    if getattr(config, "attention_bias", False):
        out |= {"q_proj", "k_proj", "v_proj", "o_proj"}
    if getattr(config, "mlp_bias", False):
        out |= {"gate_proj", "up_proj", "down_proj"}
    return out


def layer_layout(config, family: Family, dtype: torch.dtype) -> LayerLayout:
    """The packed layout of one decoder layer of ``config`` in ``dtype`` (pure: no weights needed)."""
    shapes = linear_shapes(config)
    biased = biased_linears(config, family)
    es = torch.empty((), dtype=dtype).element_size()
    tensors, off, payload, starts = [], 0, 0, [0]
    for name in shapes:
        if name.startswith("experts.") and name.endswith(".gate_proj"):  # an expert's unit starts at 4 KiB
            off = _round_up(off, ALIGN)
            starts.append(off)
        prefix = linear_prefix(name)
        entries = [(prefix + ".weight", shapes[name])]
        if name in biased:
            entries.append((prefix + ".bias", (shapes[name][0],)))
        for tname, shape in entries:
            n = es
            for d in shape:
                n *= d
            tensors.append(TensorSlot(tname, shape, off))
            off = _round_up(off + n, _TENSOR_ALIGN)
            payload += n
    extent = _round_up(off, ALIGN)
    ends = starts[1:] + [extent]
    return LayerLayout(tuple(tensors), dtype, payload, extent, tuple((a, b - a) for a, b in zip(starts, ends)))
