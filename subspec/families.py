"""Model families: the structural differences between decoder-only checkpoints, one record each.

The decoder (``subspec.model``) is written once; a :class:`Family` says which optional pieces a layer has and names
the small strategies that differ (how an RMSNorm weight scales, which layers attend through a sliding window).
Everything numeric (sizes, eps, RoPE, window lengths) comes from the Hugging Face config.

Supported: llama, mistral, qwen2, qwen3 and Gemma 3 (``gemma3_text``; a multimodal ``gemma3`` checkpoint runs its
text part, see :func:`text_config`), and the sparse mixture-of-experts families qwen3_moe and mixtral (:class:`MoE`).
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
    """``config.sliding_window`` (None = off) on every layer (Mistral v0.1, Mixtral, Qwen3-MoE)."""
    return [getattr(config, "sliding_window", None) or 0] * config.num_hidden_layers


def window_by_layer_type(config) -> list[int]:
    """``config.sliding_window`` on the layers that ``config.layer_types`` marks 'sliding_attention' (Qwen2/Qwen3
    with ``use_sliding_window``, Gemma 3's local layers); 0 (full attention) on 'full_attention' layers."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    w = getattr(config, "sliding_window", None) or 0
    return [w if t == "sliding_attention" else 0 for t in types]


@dataclass(frozen=True)
class MoE:
    """A sparse mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen3-MoE) in place of the
    dense gated MLP of every layer.

    A router ``[experts, hidden]`` (no bias) scores each token; ``softmax`` in float32 over the experts, the top
    ``num_experts_per_tok`` kept (renormalized to sum 1 when :attr:`normalize_attr` says so, always when it is None),
    and the token's MLP output is the weighted sum of those experts' gated MLPs (each ``down(act(gate x) * up x)``,
    of width :attr:`size_attr`). Checkpoint names are canonical: ``mlp.gate`` (router) and
    ``mlp.experts.{e}.{gate,up,down}_proj`` (a family stored otherwise renames, :attr:`Family.renames`).

    Attributes:
        size_attr: config attribute holding one expert's intermediate size.
        normalize_attr: config attribute saying whether the top-k weights are renormalized; None: always (Mixtral).
        float32_weights: the routing weights multiply the expert output in float32 before the cast back (Mixtral);
            otherwise they are first cast to the compute dtype (Qwen3-MoE). The two round differently in BF16.
    """

    size_attr: str = "moe_intermediate_size"
    normalize_attr: Optional[str] = "norm_topk_prob"
    float32_weights: bool = False

    def experts(self, config) -> int:
        """Number of experts per layer."""
        return int(config.num_experts)

    def top_k(self, config) -> int:
        """Experts each token is routed to."""
        return int(config.num_experts_per_tok)

    def size(self, config) -> int:
        """Intermediate size of one expert."""
        return int(getattr(config, self.size_attr))

    def normalize(self, config) -> bool:
        """Whether the top-k routing weights are renormalized to sum 1."""
        return True if self.normalize_attr is None else bool(getattr(config, self.normalize_attr, False))


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
        moe: the sparse mixture-of-experts MLP of every layer (:class:`MoE`); None: a dense gated MLP.
        renames: ``(stored, canonical)`` substrings: how the family's checkpoint names map to the canonical ones
            the code reads (Mixtral's ``block_sparse_moe.experts.{e}.w1`` is ``mlp.experts.{e}.gate_proj``).
    """

    name: str
    qkv_bias: bool = False
    norms: NormNames = field(default_factory=NormNames)
    norm: NormStyle = LLAMA_NORM
    scaled_embeddings: bool = False
    activation_attr: str = "hidden_act"
    query_scale_attr: Optional[str] = None
    windows: Callable[[object], list[int]] = no_windows
    moe: Optional[MoE] = None
    renames: tuple[tuple[str, str], ...] = ()

    def canonical_name(self, name: str) -> str:
        """The canonical tensor name of a name stored in this family's checkpoints (:attr:`renames`)."""
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

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
    "qwen3_moe": Family("qwen3_moe", norms=NormNames(**_QK), windows=window_every_layer, moe=MoE()),
    "mixtral": Family("mixtral", windows=window_every_layer,
                      moe=MoE(size_attr="intermediate_size", normalize_attr=None, float32_weights=True),
                      renames=((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                               (".w2.", ".down_proj."))),
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


ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
LINEAR_NAMES = ATTENTION_NAMES + MLP_NAMES
"""The seven linear layers of a dense decoder layer, in the order they run."""


def expert_name(e: int, name: str) -> str:
    """The linear name of expert ``e``'s ``name`` (one of :data:`MLP_NAMES`): ``experts.{e}.{name}``."""
    return f"experts.{e}.{name}"


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear of one layer, in the order they run: the one home of a decoder
    layer's geometry. A dense layer has the seven :data:`LINEAR_NAMES`; a mixture-of-experts layer has the four
    attention linears, then ``experts.{e}.gate_proj / up_proj / down_proj`` of each expert e (:func:`expert_name`;
    the router is not among them: it stays resident with the norms). Grouped-query attention: k and v have
    ``num_key_value_heads`` heads.

    Raises:
        SubspecError: a mixture-of-experts config with dense layers among the sparse ones (``mlp_only_layers``,
            ``decoder_sparse_step`` > 1): every layer must have the same shape.
    """
    H = config.hidden_size
    q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
    shapes = {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q)}
    moe = family_for(config.model_type).moe
    if moe is None:
        I = config.intermediate_size
        return shapes | {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    if getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", 1) or 1) != 1:
        raise SubspecError(f"unsupported config: {config.model_type} with dense MLP layers among the experts "
                           "(mlp_only_layers / decoder_sparse_step): subspec runs models whose every layer is sparse")
    I = moe.size(config)
    for e in range(moe.experts(config)):
        shapes |= {expert_name(e, "gate_proj"): (I, H), expert_name(e, "up_proj"): (I, H),
                   expert_name(e, "down_proj"): (H, I)}
    return shapes


def linear_names(config) -> tuple[str, ...]:
    """The names of one layer's linears in the order they run (:func:`linear_shapes`)."""
    return tuple(linear_shapes(config))


def linear_prefix(name: str) -> str:
    """The checkpoint module path of a linear inside a layer, e.g. ``self_attn.q_proj``, ``mlp.experts.3.up_proj``."""
    return ("self_attn." if name in ATTENTION_NAMES else "mlp.") + name


def linear_of(tensor_name: str) -> Optional[str]:
    """The linear whose weight a layer tensor is (``self_attn.q_proj.weight`` -> ``q_proj``), None for a bias."""
    if not tensor_name.endswith(".weight"):
        return None
    stem = tensor_name[:-len(".weight")]
    for p in ("self_attn.", "mlp."):
        if stem.startswith(p):
            return stem[len(p):]
    return None


def distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected number of distinct experts ``tokens`` tokens route to, each to ``top_k`` of ``experts`` chosen
    uniformly and independently: ``E (1 - (1 - k/E)^T)`` (skewed or correlated routing touches fewer)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** max(tokens, 1.0))


def mlp_width(config, per_token: bool = False) -> int:
    """The intermediate width of one gated MLP: the dense MLP's, or one expert's; ``per_token``: the width a token
    runs through (a mixture of experts: its top-k experts side by side). A layer's MLP weights a token multiplies by
    are ``3 * hidden * mlp_width(config, per_token=True)``."""
    moe = family_for(config.model_type).moe
    if moe is None:
        return config.intermediate_size
    return moe.size(config) * (moe.top_k(config) if per_token else 1)


def router_rows(experts: int) -> int:
    """Rows of a router weight as the decoder holds it: the experts padded with zero rows to a multiple of 16, the
    row multiple of the native (batch-invariant) linear; the padded scores are dropped."""
    return (experts + 15) // 16 * 16


def router_name(i: int) -> str:
    """The checkpoint name of layer ``i``'s router weight [experts, hidden] (a mixture-of-experts family)."""
    return f"model.layers.{i}.mlp.gate.weight"
