"""Our Llama-family decoder: explicit positions, explicit KV-cache slots, tree attention.

``Decoder.forward(tokens [T], positions [T], slots [T], attn, layers, kv)`` runs the target or the draft: the shared
parts (embeddings, norms, lm_head, RoPE) live here, the seven linears of each layer come from a :class:`LayerSource`
(resident tensors, an offload tier's staging slot, or substitutes). :class:`Attention` says which cached keys each
token sees. The math follows transformers' ``LlamaModel`` / ``Qwen2Model`` / ``Qwen3Model`` (RMSNorm in float32,
rotate-half RoPE, SwiGLU MLP) so logits match it to float rounding.

Batch invariance (design.md §3.5): in BF16 on a CPU with AMX, the linears and the tree attention run on the native
kernels (:mod:`subspec.kernels`), whose every output row is bit-identical whatever the other rows of the forward.
A verify forward over a tree then gives each node exactly the logits, and writes exactly the K/V, of a one-token
forward at that node, so BF16 verification is exact. Prefill (a causal run) uses torch's SDPA: it is the same
computation for every method, so it needs no invariance.
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Attention:
    """Which cached keys the T tokens of a forward see: the tree attention mask in compact form.

    Every token sees the committed prefix, cache slots ``0..prefix-1`` (holding positions ``0..prefix-1``), then the
    tokens of the current run at slots ``prefix + j`` for which ``ancestors[t, j]`` is True (itself included). Run
    tokens are numbered in depth order, so ascending j is ascending position: a token's keys, in order, are exactly
    those a one-token forward at its position would see.

    Attributes:
        prefix: committed length L0 (tokens).
        ancestors: [T, N] bool over the N run slots ``prefix..prefix+N-1``; None for a causal run (below).
        causal: the T tokens are a linear run written at slots ``prefix..prefix+T-1`` (prefill): token t sees run
            tokens 0..t. Computed with torch's SDPA (fast for long runs, not batch-invariant).
    """

    prefix: int
    ancestors: Optional[torch.Tensor] = None
    causal: bool = False

    @staticmethod
    def tree(prefix: int, ancestors: torch.Tensor) -> "Attention":
        """Tree nodes (or a single token: ``ancestors = [[True]]``) after ``prefix`` committed tokens."""
        return Attention(prefix, ancestors, False)

    @staticmethod
    def run(prefix: int) -> "Attention":
        """A causal run (prefill chunk) after ``prefix`` committed tokens."""
        return Attention(prefix, None, True)

    def n_slots(self, n_tokens: int) -> int:
        """Cache slots ``0..n_slots-1`` the forward reads."""
        return self.prefix + (n_tokens if self.causal else self.ancestors.shape[1])

    def mask(self, n_tokens: int, device) -> Optional[torch.Tensor]:
        """Boolean mask [T, n_slots] (True = attend); None for a causal run from slot 0 (SDPA's is_causal)."""
        if self.causal:
            return None if self.prefix == 0 else causal_mask(self.prefix, n_tokens, device)
        m = torch.ones(n_tokens, self.n_slots(n_tokens), dtype=torch.bool, device=device)
        m[:, self.prefix:] = self.ancestors
        return m


class Decoder:
    """Shared parts of a Llama-family model and the layer math.

    Attributes:
        config: transformers config; family: structural switches; dtype/device: compute dtype and device.
        embed: [vocab, hidden]; lm_head: [vocab, hidden] (the same tensor as ``embed`` when tied);
        final_norm: [hidden]; norms: per-layer :class:`LayerNorms`.
    """

    def __init__(self, config, family: Family, embed: torch.Tensor, lm_head: torch.Tensor,
                 final_norm: torch.Tensor, norms: list[LayerNorms], dtype: torch.dtype, device, native: bool = True):
        self.config, self.family, self.dtype, self.device = config, family, dtype, torch.device(device)
        self.embed, self.lm_head, self.final_norm, self.norms = embed, lm_head, final_norm, norms
        self.lm_head_linear = DenseLinear(lm_head, None, native)
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        if getattr(config, "hidden_act", "silu") != "silu":
            raise SubspecError(f"unsupported activation '{config.hidden_act}': subspec supports SwiGLU (silu) models")
        self.inv_freq, self.rope_scale = rope_parameters(config, self.device)
        self.attn_scale = self.head_dim ** -0.5
        self.windows = [0] * self.n_layers  # sliding window of each layer in tokens (0 = full attention)
        from . import kernels

        # tree attention on the native kernel where it applies (BF16, CPU, AMX, a head_dim it takes)
        self.native_attention = (native and self.dtype == torch.bfloat16 and self.device.type == "cpu"
                                 and kernels.attention_fits(self.head_dim) and kernels.native())

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_source(cls, source, dtype: torch.dtype, device, native: bool = True) -> "Decoder":
        """Load the shared tensors (embeddings, lm_head, norms) of ``source`` to ``device`` in ``dtype``
        (``native``: use the native kernels where they apply)."""
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
        return cls(cfg, source.family, embed, lm_head, source.tensor("model.norm.weight").to(**to), norms, dtype, device,
                   native)

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

    def attend(self, i: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
               attn: Attention) -> torch.Tensor:
        """Attention of layer ``i``. q: [T, heads, head_dim]; k_cache, v_cache: [kv_heads, max_slots, head_dim] (the
        T tokens' own K/V already written); positions: [T]. Returns [T, heads, head_dim]."""
        if self.native_attention and not attn.causal:
            return torch.ops.subspec.tree_attention(q, k_cache, v_cache, attn.prefix, attn.ancestors, positions,
                                                    self.windows[i], self.attn_scale)
        T = q.shape[0]
        n_slots = attn.n_slots(T)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_cache[None, :, :n_slots], v_cache[None, :, :n_slots],
            attn_mask=None if attn.causal and attn.prefix == 0 else attn.mask(T, q.device)[None, None],
            is_causal=attn.causal and attn.prefix == 0, enable_gqa=True, scale=self.attn_scale)
        return o[0].transpose(0, 1)

    def layer_forward(self, i: int, h: torch.Tensor, lin: Linears, cos, sin, kv: KVCache, positions: torch.Tensor,
                      slots: torch.Tensor, attn: Attention) -> torch.Tensor:
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
        o = self.attend(i, q, k_cache, v_cache, positions, attn)
        h = h + lin.o_proj(o.reshape(T, self.n_heads * self.head_dim))
        x = rms_norm(h, norms.post_attention_layernorm, self.eps)
        return h + lin.down_proj(F.silu(lin.gate_proj(x)) * lin.up_proj(x))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attn: Attention,
                layers: LayerSource, kv: KVCache, logits_rows: Optional[torch.Tensor | slice] = None,
                head=None) -> torch.Tensor:
        """Run the model over T tokens and return logits.

        Args:
            tokens: [T] int64 token ids. positions: [T] int64 RoPE positions. slots: [T] int64 cache slots the
                tokens' K/V are written to (``attn.prefix + j`` for run token j).
            attn: which cached keys each token sees (:class:`Attention`).
            layers: source of each layer's linears. kv: the cache.
            logits_rows: rows of the T hidden states to project to logits (index tensor or slice); None = all.
            head: the output projection ``[R, hidden] -> [R, V']`` (default: the full lm_head; the draft passes its
                reduced-vocabulary head, :class:`~subspec.speculation.DraftHead`).

        Returns:
            logits [R, vocab] (or [R, V'] of ``head``) in the compute dtype (R = selected rows).
        """
        h = self.embed[tokens]
        cos, sin = self.rope(positions)
        for i in range(self.n_layers):
            lin = layers.acquire(i)
            try:
                h = self.layer_forward(i, h, lin, cos, sin, kv, positions, slots, attn)
            finally:  # an exception (or Ctrl-C) mid-forward must not leave a staging slot taken
                layers.release(i)
        if logits_rows is not None:
            h = h[logits_rows]
        return (head or self.lm_head_linear)(rms_norm(h, self.final_norm, self.eps))


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


def load_linears(source, i: int, dtype: torch.dtype, device, native: bool = True) -> Linears:
    """Read layer ``i``'s seven linears (and biases) from the checkpoint as resident dense tensors.

    ``native``: run them on the native kernels where they apply (see :class:`~subspec.weights.DenseLinear`)."""
    fns = {}
    for name in LINEAR_NAMES:
        p = f"model.layers.{i}.{linear_prefix(name)}"
        w = source.tensor(p + ".weight").to(dtype=dtype, device=device)
        b = source.tensor(p + ".bias").to(dtype=dtype, device=device) if source.has(p + ".bias") else None
        fns[name] = DenseLinear(w, b, native)
    return Linears(**fns)
