"""Weights of one decoder layer, as the layer forward consumes them.

A layer's forward never knows where its weights live. It receives :class:`LayerNorms` (always resident: tiny)
and :class:`Linears` (callables ``y = f(x)`` by name: seven, or attention and experts) that may be dense tensors of a
resident layer, views into a staging slot filled by an offload tier, or a low-bit substitute (``subspec.quant``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor], torch.Tensor]


def use_native(weight: torch.Tensor, native: bool) -> bool:
    """Whether a linear over ``weight`` [out, in] runs on the native kernels (:mod:`subspec.kernels`): asked for, a
    BF16 CPU weight of a shape they take, and a kernel tier active on this machine."""
    from . import kernels

    return (native and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and kernels.linear_fits(*weight.shape) and kernels.native())


class DenseLinear:
    """``y = x @ W.T + b`` with a full-precision weight.

    In BF16 on the CPU it runs on the active kernel tier's ``linear_bf16`` (:mod:`subspec.kernels`, the tier captured
    at construction): batch-invariant (each row's bits do not depend on the other rows, design.md §3.5) and faster
    than torch's beyond one row; else on ``F.linear``.

    Args:
        weight: [out_features, in_features].
        bias: [out_features] or None.
        native: use the native kernels where they apply (False: always torch's).
    """

    __slots__ = ("weight", "bias", "native", "op")

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, native: bool = True):
        from . import kernels

        self.weight = weight
        self.bias = bias
        self.native = use_native(weight, native)
        self.op = kernels.ops().linear_bf16 if self.native else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features]."""
        if self.native:
            return self.op(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def dense_linears(views: dict[str, torch.Tensor], native: bool = True) -> dict[str, "DenseLinear"]:
    """Linear name -> :class:`DenseLinear` over typed views of layer tensors (tensor name -> view, in layout order:
    a whole layer or one of its units, :meth:`subspec.layout.LayerLayout.views`; biases where the views hold them;
    ``native``: see DenseLinear)."""
    from .families import linear_of

    fns = {}
    for tname, w in views.items():
        name = linear_of(tname)
        if name is not None:
            fns[name] = DenseLinear(w, views.get(tname[:-len("weight")] + "bias"), native)
    return fns


class Linears:
    """The linears of one decoder layer by name (:func:`subspec.families.linear_shapes`), each ``[T, in] -> [T, out]``.

    A dense layer has seven: attention ``q_proj k_proj v_proj o_proj`` and MLP ``gate_proj up_proj down_proj``
    (attributes of those names). A mixture-of-experts layer has the four attention linears and, for each expert e,
    ``experts.{e}.gate_proj / up_proj / down_proj``: :attr:`experts` holds them as (gate, up, down) per expert, and
    the dense MLP attributes are None.

    Args:
        fns: linear name -> callable. fused: the whole layer as one native operator where the linears allow it (4-bit
            substitutes on the native kernel: :class:`subspec.quant.FusedW4Layer`), else None;
            :meth:`subspec.model.Decoder.layer_forward` uses it where the layer's family and the forward allow it.
        fetch: for a mixture-of-experts layer whose experts are read on demand (the disk tier), ``fetch(experts)``
            makes those experts' weights present (blocks on I/O) before the forward runs them; None: all present.

    Raises:
        KeyError: an attention linear is missing, or an expert lacks one of its three.
    """

    __slots__ = ("named", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts",
                 "fused", "fetch")

    def __init__(self, fns: dict[str, LinearFn], fused: Optional[object] = None,
                 fetch: Optional[Callable[[list[int]], None]] = None):
        self.named = fns
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (fns[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.gate_proj, self.up_proj, self.down_proj = (fns.get(n) for n in ("gate_proj", "up_proj", "down_proj"))
        n_experts = sum(1 for n in fns if n.startswith("experts.") and n.endswith(".gate_proj"))
        self.experts = tuple((fns[f"experts.{e}.gate_proj"], fns[f"experts.{e}.up_proj"], fns[f"experts.{e}.down_proj"])
                             for e in range(n_experts)) or None
        self.fused = fused
        self.fetch = fetch

    def __getitem__(self, name: str) -> LinearFn:
        """The linear called ``name``."""
        return self.named[name]

    def items(self):
        """(name, linear) pairs in the order they run."""
        return self.named.items()


@dataclass
class LayerNorms:
    """RMSNorm gains of one layer by role (see :class:`subspec.families.NormNames`), prepared by the family's
    :class:`~subspec.families.NormStyle`: ``attn_in``, ``mlp_in`` (always) and ``attn_out``, ``mlp_out`` (Gemma)
    [hidden] each; ``q``, ``k`` [head_dim] (Qwen3, Gemma 3). None: the family has no such norm."""

    attn_in: torch.Tensor
    mlp_in: torch.Tensor
    attn_out: Optional[torch.Tensor] = None
    mlp_out: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
