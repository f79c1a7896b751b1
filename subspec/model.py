"""Our Llama-family decoder: explicit positions, explicit KV-cache slots, tree attention masks.

``Decoder.forward(tokens [T], positions [T], slots [T], n_slots, mask [T, n_slots] | None, layers, kv)`` runs
the target or the draft: the shared parts (embeddings, norms, lm_head, RoPE) live here, the seven linears of each
layer come from a :class:`LayerSource` (resident tensors, an offload tier's staging slot, or substitutes).
The math follows transformers' ``LlamaModel`` / ``Qwen2Model`` / ``Qwen3Model`` (RMSNorm in float32, rotate-half
RoPE, SwiGLU MLP) so logits match it to float rounding.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from .errors import SubspecError
from .families import LINEAR_NAMES, Family, linear_prefix
from .kvcache import KVCache
from .weights import DenseLinear, LayerNorms, Linears


class LayerSource(Protocol):
    """Where a forward gets each layer's linears: ``acquire(i)`` blocks until ready, ``release(i)`` frees it."""

    def acquire(self, i: int) -> Linears: ...

    def release(self, i: int) -> None: ...


class ResidentLayers:
    """A :class:`LayerSource` over layers held in memory, with another source for the rest.

    Args:
        resident: layer index -> its linears, kept on the device.
        rest: source for every other layer (an offload tier for the target, substitutes for the draft).
    """

    def __init__(self, resident: dict[int, Linears], rest: Optional[LayerSource] = None):
        self.resident = resident
        self.rest = rest

    def acquire(self, i: int) -> Linears:
        lin = self.resident.get(i)
        return lin if lin is not None else self.rest.acquire(i)

    def release(self, i: int) -> None:
        if i not in self.resident:
            self.rest.release(i)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as transformers does; returns x's dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_mask(start: int, n_tokens: int, device) -> torch.Tensor:
    """Mask [n_tokens, start + n_tokens] (True = attend) for a linear run placed at slots start.. after a prefix."""
    cols = torch.arange(start + n_tokens, device=device)
    rows = torch.arange(n_tokens, device=device) + start
    return cols[None, :] <= rows[:, None]


class Decoder:
    """Shared parts of a Llama-family model and the layer math.

    Attributes:
        config: transformers config; family: structural switches; dtype/device: compute dtype and device.
        embed: [vocab, hidden]; lm_head: [vocab, hidden] (the same tensor as ``embed`` when tied);
        final_norm: [hidden]; norms: per-layer :class:`LayerNorms`.
    """

    def __init__(self, config, family: Family, embed: torch.Tensor, lm_head: torch.Tensor,
                 final_norm: torch.Tensor, norms: list[LayerNorms], dtype: torch.dtype, device):
        self.config, self.family, self.dtype, self.device = config, family, dtype, torch.device(device)
        self.embed, self.lm_head, self.final_norm, self.norms = embed, lm_head, final_norm, norms
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        if getattr(config, "hidden_act", "silu") != "silu":
            raise SubspecError(f"unsupported activation '{config.hidden_act}': subspec supports SwiGLU (silu) models")
        self.inv_freq, self.rope_scale = rope_parameters(config, self.device)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_source(cls, source, dtype: torch.dtype, device) -> "Decoder":
        """Load the shared tensors (embeddings, lm_head, norms) of ``source`` to ``device`` in ``dtype``."""
        cfg = source.config
        to = dict(dtype=dtype, device=device)
        embed = source.tensor("model.embed_tokens.weight").to(**to)
        tied = getattr(cfg, "tie_word_embeddings", False) or not source.has("lm_head.weight")
        lm_head = embed if tied else source.tensor("lm_head.weight").to(**to)
        norms = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            qn = source.tensor(p + "self_attn.q_norm.weight").to(**to) if source.family.qk_norm else None
            kn = source.tensor(p + "self_attn.k_norm.weight").to(**to) if source.family.qk_norm else None
            norms.append(LayerNorms(source.tensor(p + "input_layernorm.weight").to(**to),
                                    source.tensor(p + "post_attention_layernorm.weight").to(**to), qn, kn))
        return cls(cfg, source.family, embed, lm_head, source.tensor("model.norm.weight").to(**to), norms, dtype, device)

    def new_kv_cache(self, max_slots: int) -> KVCache:
        """A zeroed KV cache for this model with ``max_slots`` slots."""
        return KVCache(self.n_layers, self.kv_heads, self.head_dim, max_slots, self.dtype, self.device)

    # ---- math ---------------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, head_dim] in the compute dtype for positions [T] (computed in float32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(self.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scale).to(self.dtype)[:, None, :]
        return cos, sin

    def layer_forward(self, i: int, h: torch.Tensor, lin: Linears, cos, sin, kv: KVCache,
                      slots: torch.Tensor, n_slots: int, mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """One decoder layer. h: [T, hidden] -> [T, hidden]; writes K/V of the T tokens at ``slots``."""
        norms, T = self.norms[i], h.shape[0]
        x = rms_norm(h, norms.input_layernorm, self.eps)
        q = lin.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = lin.k_proj(x).view(T, self.kv_heads, self.head_dim)
        v = lin.v_proj(x).view(T, self.kv_heads, self.head_dim)
        if norms.q_norm is not None:
            q = rms_norm(q, norms.q_norm, self.eps)
            k = rms_norm(k, norms.k_norm, self.eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache, v_cache = kv.layer(i)
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_cache[None, :, :n_slots], v_cache[None, :, :n_slots],
            attn_mask=None if mask is None else mask[None, None], is_causal=causal, enable_gqa=True)
        h = h + lin.o_proj(o[0].transpose(0, 1).reshape(T, self.n_heads * self.head_dim))
        x = rms_norm(h, norms.post_attention_layernorm, self.eps)
        return h + lin.down_proj(F.silu(lin.gate_proj(x)) * lin.up_proj(x))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, n_slots: int,
                mask: Optional[torch.Tensor], layers: LayerSource, kv: KVCache,
                logits_rows: Optional[torch.Tensor | slice] = None, causal: bool = False) -> torch.Tensor:
        """Run the model over T tokens and return logits.

        Args:
            tokens: [T] int64 token ids. positions: [T] int64 RoPE positions. slots: [T] int64 cache slots the
                tokens' K/V are written to.
            n_slots: the tokens attend over cache slots ``0..n_slots-1``.
            mask: [T, n_slots] bool, True = may attend (tree attention mask); None = attend to all n_slots
                (one token, or ``causal``).
            layers: source of each layer's linears. kv: the cache.
            logits_rows: rows of the T hidden states to project to logits (index tensor or slice); None = all.
            causal: plain causal attention for a prefill from slot 0 (``n_slots == T``, mask None).

        Returns:
            logits [R, vocab] in the compute dtype (R = selected rows).
        """
        h = self.embed[tokens]
        cos, sin = self.rope(positions)
        for i in range(self.n_layers):
            lin = layers.acquire(i)
            try:
                h = self.layer_forward(i, h, lin, cos, sin, kv, slots, n_slots, mask, causal)
            finally:  # an exception (or Ctrl-C) mid-forward must not leave a staging slot taken
                layers.release(i)
        if logits_rows is not None:
            h = h[logits_rows]
        return F.linear(rms_norm(h, self.final_norm, self.eps), self.lm_head)


def rope_parameters(config, device) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [head_dim/2] (float32) and attention scaling, from transformers' rope init.

    Every ``rope_scaling`` type transformers supports (default, linear, llama3, yarn, longrope) works, except
    'dynamic', whose frequencies change with the sequence length.

    Raises:
        SubspecError: dynamic NTK scaling.
    """
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) == "dynamic":
        raise SubspecError("rope scaling 'dynamic' is not supported: use a model with static RoPE scaling")
    rot = LlamaRotaryEmbedding(config)
    return rot.inv_freq.float().to(device), float(rot.attention_scaling)


def load_linears(source, i: int, dtype: torch.dtype, device) -> Linears:
    """Read layer ``i``'s seven linears (and biases) from the checkpoint as resident dense tensors."""
    fns = {}
    for name in LINEAR_NAMES:
        p = f"model.layers.{i}.{linear_prefix(name)}"
        w = source.tensor(p + ".weight").to(dtype=dtype, device=device)
        b = source.tensor(p + ".bias").to(dtype=dtype, device=device) if source.has(p + ".bias") else None
        fns[name] = DenseLinear(w, b)
    return Linears(**fns)
