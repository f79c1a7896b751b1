"""Model families: the few structural differences between Llama-family checkpoints, one record each.

The decoder (``subspec.model``) is written once; a :class:`Family` says which optional pieces a layer has.
Everything numeric (sizes, eps, RoPE) comes from the Hugging Face config.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import SubspecError


@dataclass(frozen=True)
class Family:
    """Structural switches of one model family.

    Attributes:
        name: the Hugging Face ``model_type``.
        qkv_bias: q/k/v projections always carry a bias (Qwen2). Otherwise ``config.attention_bias`` decides.
        qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    """

    name: str
    qkv_bias: bool = False
    qk_norm: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2", qkv_bias=True),
    "qwen3": Family("qwen3", qk_norm=True),
}


def family_for(model_type: str) -> Family:
    """Return the family record for a config's ``model_type``.

    Raises:
        SubspecError: the architecture is not one of :data:`FAMILIES`.
    """
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise SubspecError(
            f"unsupported architecture '{model_type}': subspec runs {', '.join(sorted(FAMILIES))} models"
        ) from None


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven linear layers of a decoder layer, in the order they run."""


def linear_prefix(name: str) -> str:
    """The checkpoint module path of a linear inside a layer, e.g. ``self_attn.q_proj``."""
    return ("self_attn." if name in LINEAR_NAMES[:4] else "mlp.") + name
