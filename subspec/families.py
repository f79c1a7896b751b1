"""Model families: the structural differences between decoder-only checkpoints, one record each.

The decoder (``subspec.model``) is written once; a :class:`Family` says which optional pieces a layer has and names
the small strategies that differ (how an RMSNorm weight scales, which layers attend through a sliding window).
Everything numeric (sizes, eps, RoPE, window lengths) comes from the Hugging Face config.

Supported: llama, mistral, qwen2, qwen3 and Gemma 3 (``gemma3_text``; a multimodal ``gemma3`` checkpoint runs its
text part, see :func:`text_config`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .errors import SubspecError


@dataclass(frozen=True)
class NormStyle:
    """How an RMSNorm (Zhang & Sennrich 2019, ``y = x / sqrt(mean(x^2) + eps) * g``) applies its gain ``g``.

    Attributes:
        offset: added to the stored weight to give the gain (Gemma stores ``w`` and scales by ``1 + w``).
        float32_gain: the gain multiplies the float32 normalized input before the cast back to the compute dtype
            (Gemma); otherwise the normalized input is cast first and multiplied by the weight in the compute dtype
            (Llama). The two orders round differently in BF16.
    """

    offset: float = 0.0
    float32_gain: bool = False

    def gain(self, weight: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
        """The gain tensor the forward multiplies by, from a checkpoint weight [n]: float32 when ``float32_gain``
        (``offset + w`` with ``w`` first rounded to ``dtype``, as transformers holds parameters), else ``dtype``."""
        w = weight.to(dtype=dtype, device=device)
        if self.float32_gain:
            w = w.float()
        return w + self.offset if self.offset else w

    def gain_bytes(self, elem_bytes: int) -> int:
        """Bytes per element of a prepared gain."""
        return 4 if self.float32_gain else elem_bytes

    def __call__(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of x [..., n] with a prepared ``gain`` [n]; computed in float32, returns x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if self.float32_gain:
            return (xf * gain).to(x.dtype)
        return gain * xf.to(x.dtype)


LLAMA_NORM = NormStyle()
GEMMA_NORM = NormStyle(offset=1.0, float32_gain=True)


@dataclass(frozen=True)
class NormNames:
    """Checkpoint names (after ``model.layers.{i}.``, without ``.weight``) of a layer's RMSNorms, by role.

    ``attn_in`` normalizes the attention input and ``mlp_in`` the MLP input (pre-norm, every family); ``attn_out`` and
    ``mlp_out`` normalize the attention / MLP output before its residual add (Gemma's "sandwich" norms); ``q`` / ``k``
    normalize each query / key head before RoPE (Qwen3, Gemma 3). None: the family has no such norm.
    """

    attn_in: str = "input_layernorm"
    attn_out: Optional[str] = None
    mlp_in: str = "post_attention_layernorm"
    mlp_out: Optional[str] = None
    q: Optional[str] = None
    k: Optional[str] = None

    HIDDEN_ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
    HEAD_ROLES = ("q", "k")


def no_windows(config) -> list[int]:
    """Every layer attends to the whole context (Llama): windows of 0."""
    return [0] * config.num_hidden_layers


def window_every_layer(config) -> list[int]:
    """``config.sliding_window`` (None = off) on every layer (Mistral v0.1)."""
    return [getattr(config, "sliding_window", None) or 0] * config.num_hidden_layers


def window_by_layer_type(config) -> list[int]:
    """``config.sliding_window`` on the layers that ``config.layer_types`` marks 'sliding_attention' (Qwen2/Qwen3
    with ``use_sliding_window``, Gemma 3's local layers); 0 (full attention) on 'full_attention' layers."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    w = getattr(config, "sliding_window", None) or 0
    return [w if t == "sliding_attention" else 0 for t in types]


@dataclass(frozen=True)
class Family:
    """Structural switches of one model family.

    Attributes:
        name: the Hugging Face ``model_type`` of the text model.
        qkv_bias: q/k/v projections always carry a bias (Qwen2). Otherwise ``config.attention_bias`` decides.
        norms: checkpoint names of each layer's RMSNorms by role (:class:`NormNames`).
        norm: how RMSNorm gains apply (:class:`NormStyle`), for every norm of the model.
        scaled_embeddings: token embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the compute dtype).
        activation_attr: the config attribute naming the gated MLP's activation (a transformers ``ACT2FN`` key).
        query_scale_attr: the config attribute ``s`` whose ``s ** -0.5`` scales attention scores; None: ``head_dim``.
        windows: ``config -> [window per layer]``: the sliding window of each layer in tokens, 0 = full attention
            (a query at position p sees the keys at positions > p - window).
    """

    name: str
    qkv_bias: bool = False
    norms: NormNames = field(default_factory=NormNames)
    norm: NormStyle = LLAMA_NORM
    scaled_embeddings: bool = False
    activation_attr: str = "hidden_act"
    query_scale_attr: Optional[str] = None
    windows: Callable[[object], list[int]] = no_windows

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalized per head before RoPE."""
        return self.norms.q is not None

    def layer_norm_shapes(self, config) -> list[tuple[str, str, tuple[int, ...]]]:
        """(role, checkpoint name without ``.weight``, shape) of each RMSNorm of one layer."""
        hd = head_dim(config)
        out = []
        for role in NormNames.HIDDEN_ROLES + NormNames.HEAD_ROLES:
            name = getattr(self.norms, role)
            if name is not None:
                out.append((role, name, (config.hidden_size,) if role in NormNames.HIDDEN_ROLES else (hd,)))
        return out


_QK = dict(q="self_attn.q_norm", k="self_attn.k_norm")

FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "mistral": Family("mistral", windows=window_every_layer),
    "qwen2": Family("qwen2", qkv_bias=True, windows=window_by_layer_type),
    "qwen3": Family("qwen3", norms=NormNames(**_QK), windows=window_by_layer_type),
    "gemma3_text": Family(
        "gemma3_text",
        norms=NormNames(attn_out="post_attention_layernorm", mlp_in="pre_feedforward_layernorm",
                        mlp_out="post_feedforward_layernorm", **_QK),
        norm=GEMMA_NORM, scaled_embeddings=True, activation_attr="hidden_activation",
        query_scale_attr="query_pre_attn_scalar", windows=window_by_layer_type),
}

CONTAINERS = {"gemma3": "gemma3_text"}
"""Multimodal checkpoint types whose text model subspec runs: ``model_type`` -> the text part's ``model_type``."""


def family_for(model_type: str) -> Family:
    """Return the family record for a config's ``model_type`` (a multimodal container maps to its text part).

    Raises:
        SubspecError: the architecture is not one of :data:`FAMILIES`.
    """
    try:
        return FAMILIES[CONTAINERS.get(model_type, model_type)]
    except KeyError:
        names = sorted(set(FAMILIES) | set(CONTAINERS))
        raise SubspecError(f"unsupported architecture '{model_type}': subspec runs {', '.join(names)} models") from None


def text_config(config):
    """The text model's config: ``config`` itself, or the text part of a multimodal container (``gemma3``)."""
    return config.get_text_config() if config.model_type in CONTAINERS else config


def head_dim(config) -> int:
    """Per-head size: ``config.head_dim`` when set, else ``hidden_size / num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven linear layers of a decoder layer, in the order they run."""


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each of a layer's seven linears (:data:`LINEAR_NAMES`): the one home of a
    decoder layer's geometry (grouped-query attention: k and v have ``num_key_value_heads`` heads)."""
    H, I = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
    return {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
            "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def linear_prefix(name: str) -> str:
    """The checkpoint module path of a linear inside a layer, e.g. ``self_attn.q_proj``."""
    return ("self_attn." if name in LINEAR_NAMES[:4] else "mlp.") + name
