"""Weights of one decoder layer, as the layer forward consumes them.

A layer's forward never knows where its weights live. It receives :class:`LayerNorms` (always resident: tiny)
and :class:`Linears` (seven callables ``y = f(x)``) that may be dense tensors of a resident layer, views into a
staging slot filled by an offload tier, or a low-bit substitute (``subspec.quant``).
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


@dataclass
class Linears:
    """The seven linears of a decoder layer (attention q/k/v/o, MLP gate/up/down), each ``[T, in] -> [T, out]``.

    ``fused``: the whole layer as one native operator where the linears allow it (4-bit substitutes on the native
    kernel: :class:`subspec.quant.FusedW4Layer`), else None; :meth:`subspec.model.Decoder.layer_forward` uses it
    where the layer's family and the forward allow it."""

    q_proj: LinearFn
    k_proj: LinearFn
    v_proj: LinearFn
    o_proj: LinearFn
    gate_proj: LinearFn
    up_proj: LinearFn
    down_proj: LinearFn
    fused: Optional[object] = None


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
