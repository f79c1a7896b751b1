"""Our decoder: explicit positions, explicit KV-cache slots, tree attention masks, sliding windows.

``Decoder.forward(tokens [T], positions [T], slots [T], n_slots, mask [T, n_slots] | None, layers, kv)`` runs
the target or the draft: the shared parts (embeddings, norms, lm_head, RoPE) live here, the seven linears of each
layer come from a :class:`LayerSource` (resident tensors, an offload tier's staging slot, or substitutes).
The math follows transformers' ``LlamaModel`` / ``MistralModel`` / ``Qwen2Model`` / ``Qwen3Model`` /
``Gemma3TextModel`` (RMSNorm in float32, rotate-half RoPE, gated MLP, sliding-window masks from positions) so logits
match it to float rounding; what differs between families comes from their :class:`~subspec.families.Family`.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from .errors import SubspecError
from .families import LINEAR_NAMES, Family, head_dim, linear_prefix
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


def window_mask(mask: Optional[torch.Tensor], causal: bool, window: int, q_pos: torch.Tensor,
                k_pos: torch.Tensor) -> torch.Tensor:
    """The attention mask [T, S] (True = attend) of a sliding-window layer (Beltagy et al. 2020, Mistral, Gemma).

    A query at position p sees the keys at positions ``> p - window`` (transformers' ``sliding_window_overlay``),
    intersected with ``mask`` (tree or causal mask), or with ``k_pos <= q_pos`` when ``causal`` (a prefill from slot
    0), or with nothing when both are absent (one token over all S slots). Positions, not slots, decide: a tree node
    sees the window of its own position ``L0 + depth``.

    Args:
        mask: [T, S] bool or None. causal: see above. window: tokens (>= 1). q_pos: [T] int64 query positions.
        k_pos: [S] int64 positions of the keys held in slots ``0..S-1``.
    """
    m = k_pos[None, :] > q_pos[:, None] - window
    if mask is not None:
        return m & mask
    if causal:
        return m & (k_pos[None, :] <= q_pos[:, None])
    return m


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_slots: int,
              mask: Optional[torch.Tensor], causal: bool, scale: float, window: Optional[int],
              q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention of T queries over the first ``n_slots`` cache slots (grouped-query).

    ``softmax(q k^T * scale + bias) v`` with ``bias = -inf`` where the query may not attend (Vaswani et al. 2017).

    Args:
        q: [T, heads, head_dim] queries (after RoPE). k_cache, v_cache: [kv_heads, max_slots, head_dim].
        n_slots: keys are the slots ``0..n_slots-1``. mask: [T, n_slots] bool, True = may attend (tree / causal
            mask); None with ``causal`` False = attend to every slot. causal: plain causal attention for a prefill
            from slot 0 (``n_slots == T``, mask None). scale: score scale (``head_dim ** -0.5`` for most families).
        window: sliding window in tokens (keys at positions ``> q_pos - window``), None = full attention.
        q_pos: [T] int64 query positions. k_pos: [n_slots] int64 positions of the keys (used with a window only).
            A token's position never exceeds its slot (linear runs: equal; tree nodes: ``L0 + depth <= L0 + node``),
            so with ``n_slots <= window`` every key is inside the window and no window mask is needed.

    Returns:
        [T, heads, head_dim] in q's dtype.
    """
    if window is not None and n_slots > window:
        mask, causal = window_mask(mask, causal, window, q_pos, k_pos), False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_cache[None, :, :n_slots], v_cache[None, :, :n_slots],
        attn_mask=None if mask is None else mask[None, None], is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


class Decoder:
    """Shared parts of a decoder-only model of any supported family, and the layer math.

    Attributes:
        config: transformers (text) config; family: structural switches; dtype/device: compute dtype and device.
        embed: [vocab, hidden]; lm_head: [vocab, hidden] (the same tensor as ``embed`` when tied);
        final_norm: [hidden] gain; norms: per-layer :class:`LayerNorms` (gains prepared by ``family.norm``).
        windows: per layer, its sliding window in tokens or None. attn_scale: attention score scale.
        ropes: distinct RoPE tables (inverse frequencies [head_dim/2] float32, attention scaling), ``rope_of[i]``
            indexes layer i's (Gemma 3: one for local, one for global layers).

    Raises:
        SubspecError: a config feature subspec does not implement (logit soft-capping, bidirectional attention,
            an unknown activation, dynamic or partial RoPE).
    """

    def __init__(self, config, family: Family, embed: torch.Tensor, lm_head: torch.Tensor,
                 final_norm: torch.Tensor, norms: list[LayerNorms], dtype: torch.dtype, device):
        from transformers.activations import ACT2FN

        self.config, self.family, self.dtype, self.device = config, family, dtype, torch.device(device)
        self.embed, self.lm_head, self.final_norm, self.norms = embed, lm_head, final_norm, norms
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.eps = config.rms_norm_eps
        for attr in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
            if getattr(config, attr, None):
                raise SubspecError(f"unsupported config: {attr}={getattr(config, attr)} ({config.model_type}); "
                                   "subspec runs causal models without logit soft-capping")
        act = getattr(config, family.activation_attr, None)
        if act not in ACT2FN:
            raise SubspecError(f"unsupported activation '{act}': subspec supports the activations of transformers' ACT2FN")
        self.act = ACT2FN[act]
        scalar = getattr(config, family.query_scale_attr) if family.query_scale_attr else self.head_dim
        self.attn_scale = float(scalar) ** -0.5
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=self.device)
                            if family.scaled_embeddings else None)
        self.windows = family.windows(config)
        self.ropes, self.rope_of = layer_ropes(config, self.device)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_source(cls, source, dtype: torch.dtype, device) -> "Decoder":
        """Load the shared tensors (embeddings, lm_head, norms) of ``source`` to ``device`` in ``dtype``."""
        cfg, fam = source.config, source.family
        to = dict(dtype=dtype, device=device)
        embed = source.tensor("model.embed_tokens.weight").to(**to)
        tied = getattr(cfg, "tie_word_embeddings", False) or not source.has("lm_head.weight")
        lm_head = embed if tied else source.tensor("lm_head.weight").to(**to)
        norms = []
        for i in range(cfg.num_hidden_layers):
            gains = {role: fam.norm.gain(source.tensor(f"model.layers.{i}.{name}.weight"), dtype, device)
                     for role, name, _ in fam.layer_norm_shapes(cfg)}
            norms.append(LayerNorms(**gains))
        final = fam.norm.gain(source.tensor("model.norm.weight"), dtype, device)
        return cls(cfg, fam, embed, lm_head, final, norms, dtype, device)

    def new_kv_cache(self, max_slots: int) -> KVCache:
        """A zeroed KV cache for this model with ``max_slots`` slots."""
        return KVCache(self.n_layers, self.kv_heads, self.head_dim, max_slots, self.dtype, self.device)

    # ---- math ---------------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, head_dim] in the compute dtype for positions [T] (computed in float32) from RoPE
        table ``table`` of :attr:`ropes`."""
        inv_freq, scale = self.ropes[table]
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scale).to(self.dtype)[:, None, :]
        sin = (emb.sin() * scale).to(self.dtype)[:, None, :]
        return cos, sin

    def layer_forward(self, i: int, h: torch.Tensor, lin: Linears, rope: tuple[torch.Tensor, torch.Tensor],
                      kv: KVCache, slots: torch.Tensor, n_slots: int, mask: Optional[torch.Tensor], causal: bool,
                      positions: torch.Tensor) -> torch.Tensor:
        """One decoder layer. h: [T, hidden] -> [T, hidden]; writes K/V of the T tokens at ``slots``.

        Pre-norm attention and gated MLP; the family's optional norms (q/k per head, Gemma's norms of the
        attention and MLP outputs) apply where its :class:`LayerNorms` has them.
        """
        g, norm, eps, T = self.norms[i], self.family.norm, self.eps, h.shape[0]
        x = norm(h, g.attn_in, eps)
        q = lin.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = lin.k_proj(x).view(T, self.kv_heads, self.head_dim)
        v = lin.v_proj(x).view(T, self.kv_heads, self.head_dim)
        if g.q is not None:
            q, k = norm(q, g.q, eps), norm(k, g.k, eps)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv.layer(i)
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))
        o = attention(q, k_cache, v_cache, n_slots, mask, causal, self.attn_scale, self.windows[i], positions,
                      kv.positions[:n_slots])
        a = lin.o_proj(o.reshape(T, self.n_heads * self.head_dim))
        h = h + (a if g.attn_out is None else norm(a, g.attn_out, eps))
        x = norm(h, g.mlp_in, eps)
        m = lin.down_proj(self.act(lin.gate_proj(x)) * lin.up_proj(x))
        return h + (m if g.mlp_out is None else norm(m, g.mlp_out, eps))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, n_slots: int,
                mask: Optional[torch.Tensor], layers: LayerSource, kv: KVCache,
                logits_rows: Optional[torch.Tensor | slice] = None, causal: bool = False) -> torch.Tensor:
        """Run the model over T tokens and return logits.

        Args:
            tokens: [T] int64 token ids. positions: [T] int64 RoPE positions. slots: [T] int64 cache slots the
                tokens' K/V are written to (with their positions, which sliding windows read).
            n_slots: the tokens attend over cache slots ``0..n_slots-1``.
            mask: [T, n_slots] bool, True = may attend (tree attention mask); None = attend to all n_slots
                (one token, or ``causal``). Sliding-window layers further restrict it by position.
            layers: source of each layer's linears. kv: the cache.
            logits_rows: rows of the T hidden states to project to logits (index tensor or slice); None = all.
            causal: plain causal attention for a prefill from slot 0 (``n_slots == T``, mask None).

        Returns:
            logits [R, vocab] in the compute dtype (R = selected rows).
        """
        h = self.embed[tokens]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        kv.positions.index_copy_(0, slots, positions)
        ropes = [self.rope(positions, t) for t in range(len(self.ropes))]
        for i in range(self.n_layers):
            lin = layers.acquire(i)
            h = self.layer_forward(i, h, lin, ropes[self.rope_of[i]], kv, slots, n_slots, mask, causal, positions)
            layers.release(i)
        if logits_rows is not None:
            h = h[logits_rows]
        return F.linear(self.family.norm(h, self.final_norm, self.eps), self.lm_head)


def layer_ropes(config, device) -> tuple[list[tuple[torch.Tensor, float]], list[int]]:
    """The distinct RoPE tables of a model and which one each layer uses.

    A config whose ``rope_parameters`` are nested by layer type (Gemma 3: 'full_attention' and 'sliding_attention'
    with their own bases and scaling) gets one table per type, indexed through ``config.layer_types``; any other
    config gets one table for all layers.

    Returns:
        (tables [(inv_freq [head_dim/2] float32, attention scaling)], table index of each layer).
    """
    params = getattr(config, "rope_parameters", None) or {}
    types = list(getattr(config, "layer_types", None) or [])
    nested = [t for t in dict.fromkeys(types) if isinstance(params.get(t), dict)]
    if not nested:
        return [rope_parameters(config, device)], [0] * config.num_hidden_layers
    return [rope_parameters(config, device, t) for t in nested], [nested.index(t) for t in types]


def rope_parameters(config, device, layer_type: Optional[str] = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [head_dim/2] (float32) and attention scaling, from transformers' rope init.

    Default RoPE is ``theta ** (-2j / head_dim)`` (Su et al. 2021); every ``rope_type`` of transformers'
    ``ROPE_INIT_FUNCTIONS`` (linear, llama3, yarn, longrope) comes from that function, for ``layer_type``'s entry
    when the parameters are nested by layer type. 'dynamic' is refused: its frequencies change with the sequence.

    Raises:
        SubspecError: dynamic NTK scaling; partial rotary embeddings.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:  # a transformers without rope_parameters: its Llama rotary embedding reads the config
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        if (getattr(config, "rope_scaling", None) or {}).get("rope_type") == "dynamic":
            raise SubspecError("rope scaling 'dynamic' is not supported: use a model with static RoPE scaling")
        rot = LlamaRotaryEmbedding(config)
        return rot.inv_freq.float().to(device), float(rot.attention_scaling)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    p = params[layer_type] if layer_type is not None else params
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "dynamic":
        raise SubspecError("rope scaling 'dynamic' is not supported: use a model with static RoPE scaling")
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise SubspecError("partial rotary embeddings are not supported: every head dimension must be rotated")
    if rope_type == "default":
        dim = head_dim(config)
        inv_freq = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq.to(device), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise SubspecError(f"unsupported rope type '{rope_type}': use a model with {', '.join(ROPE_INIT_FUNCTIONS)} RoPE")
    kw = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device, **kw)
    return inv_freq.float().to(device), float(scale)


def load_linears(source, i: int, dtype: torch.dtype, device) -> Linears:
    """Read layer ``i``'s seven linears (and biases) from the checkpoint as resident dense tensors."""
    fns = {}
    for name in LINEAR_NAMES:
        p = f"model.layers.{i}.{linear_prefix(name)}"
        w = source.tensor(p + ".weight").to(dtype=dtype, device=device)
        b = source.tensor(p + ".bias").to(dtype=dtype, device=device) if source.has(p + ".bias") else None
        fns[name] = DenseLinear(w, b)
    return Linears(**fns)
