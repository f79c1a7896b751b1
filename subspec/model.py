"""Our decoder: explicit positions, explicit KV-cache slots, tree attention, sliding windows.

``Decoder.forward(tokens [T], positions [T], slots [T], attn, layers, kv)`` runs the target or the draft: the shared
parts (embeddings, norms, lm_head, RoPE, the routers of a mixture of experts) live here, the linears of each layer
come from a :class:`LayerSource` (resident tensors, an offload tier's staging slot, or substitutes). :class:`Attention`
says which cached keys each token sees. The math follows transformers' ``LlamaModel`` / ``MistralModel`` /
``Qwen2Model`` / ``Qwen3Model`` / ``Gemma3TextModel`` / ``Qwen3MoeModel`` / ``MixtralModel`` (RMSNorm in float32,
rotate-half RoPE, gated MLP or top-k experts, sliding windows by position) so logits match it to float rounding;
what differs between families comes from their :class:`~subspec.families.Family`.

Batch invariance (design.md §3.5): in BF16 on the CPU, the linears and the tree attention run on the native kernels
(:mod:`subspec.kernels`, any tier), whose every output row is bit-identical whatever the other rows of the forward.
A verify forward over a tree then gives each node exactly the logits, and writes exactly the K/V, of a one-token
forward at that node, so BF16 verification is exact. Prefill (a causal run) uses torch's SDPA: it is the same
computation for every method, so it needs no invariance.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from .errors import SubspecError
from .families import MoE, Family, head_dim, linear_names, linear_prefix, mlp_width, router_name, router_rows
from .kvcache import KVCache
from .weights import DenseLinear, LayerNorms, Linears


class LayerSource(Protocol):
    """Where a forward gets each layer's linears: ``acquire(i)`` blocks until ready, ``release(i)`` frees it.
    ``acquire`` returns None for a layer the forward skips (a draft without that layer's substitute).

    A source whose every layer is held in memory (``acquire`` neither blocks nor reads, ``release`` frees nothing) says
    so with a true ``in_memory`` attribute: a forward may then acquire several layers ahead and run a run of fused
    4-bit layers in one native call (:meth:`Decoder.forward`)."""

    def acquire(self, i: int) -> Optional[Linears]: ...

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

    @property
    def in_memory(self) -> bool:
        """Whether every layer is in memory (the resident ones are; the rest's source, if any, says)."""
        return self.rest is None or bool(getattr(self.rest, "in_memory", False))


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

    def mask(self, n_tokens: int, device, positions: Optional[torch.Tensor] = None,
             window: int = 0) -> Optional[torch.Tensor]:
        """Boolean mask [T, n_slots] (True = attend); None for a causal run from slot 0 without a window (SDPA's
        is_causal).

        ``window > 0`` (a sliding-window layer; Beltagy et al. 2020, Mistral, Gemma) further hides the keys at
        positions ``<= positions[t] - window`` (transformers' ``sliding_window_overlay``), by the positions this
        description implies: prefix slot j holds position j; run token j of a causal run, position ``prefix + j``;
        the ancestors of a tree node, in depth order, positions ``prefix, prefix + 1, ...`` (one per depth). So a tree
        node sees the window of its own position, as the native kernel does.

        Args:
            n_tokens: T. positions: [T] int64 query positions (needed with a window). window: tokens, 0 = none.
        """
        if self.causal and not window:
            return None if self.prefix == 0 else causal_mask(self.prefix, n_tokens, device)
        if self.causal:
            m = causal_mask(self.prefix, n_tokens, device)
            run_pos = torch.arange(self.prefix, self.prefix + n_tokens, device=device).expand(n_tokens, n_tokens)
        else:
            m = torch.ones(n_tokens, self.n_slots(n_tokens), dtype=torch.bool, device=device)
            m[:, self.prefix:] = self.ancestors
            if not window:
                return m
            run_pos = self.prefix - 1 + self.ancestors.long().cumsum(1)  # position of each ancestor (where True)
        key_pos = torch.cat((torch.arange(self.prefix, device=device).expand(n_tokens, self.prefix), run_pos), 1)
        return m & (key_pos > positions[:, None] - window)


class Router:
    """The router of a mixture-of-experts layer (:class:`~subspec.families.MoE`): which experts each token runs, and
    with what weights.

    ``softmax(x W^T)`` in float32 over the experts, the top-k kept (ties to the lower index, as ``torch.topk``),
    renormalized to sum 1 where the family does; then cast to the compute dtype unless the family multiplies in
    float32 (:attr:`~subspec.families.MoE.float32_weights`). The scores run on a :class:`DenseLinear` over the weight
    padded to :func:`~subspec.families.router_rows` rows, so in BF16 on the native kernels a token's routing does not
    depend on the other tokens of the forward (batch invariance, design.md §3.5): the target and the draft, a verify
    and a one-token forward route each token the same. It is small and full-precision, shared by target and draft.

    Args:
        weight: [experts, hidden] in the compute dtype. moe: the family's switches. config: the text config.
        native: run the scores on the native kernels where they apply.
    """

    __slots__ = ("linear", "experts", "top_k", "normalize", "float32_weights")

    def __init__(self, weight: torch.Tensor, moe: MoE, config, native: bool = True):
        self.experts, hidden = weight.shape
        rows = router_rows(self.experts)
        if rows != self.experts:
            weight = torch.cat((weight, weight.new_zeros(rows - self.experts, hidden)))
        self.linear = DenseLinear(weight.contiguous(), None, native)
        self.top_k, self.normalize = moe.top_k(config), moe.normalize(config)
        self.float32_weights = moe.float32_weights

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, top_k] (float32 or x's dtype), experts [T, top_k] int64)."""
        probs = torch.softmax(self.linear(x)[:, :self.experts].float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), experts


class Decoder:
    """Shared parts of a decoder-only model of any supported family, and the layer math.

    Attributes:
        config: transformers (text) config; family: structural switches; dtype/device: compute dtype and device.
        embed: [vocab, hidden]; lm_head: [vocab, hidden] (the same tensor as ``embed`` when tied);
        final_norm: [hidden] gain; norms: per-layer :class:`LayerNorms` (gains prepared by ``family.norm``).
        windows: per layer, its sliding window in tokens (0 = full attention). attn_scale: attention score scale.
        routers: per layer, its :class:`Router` (a mixture-of-experts family), else None.
        ropes: distinct RoPE tables (inverse frequencies [head_dim/2] float32, attention scaling); ``rope_of[i]``
            indexes layer i's (Gemma 3: one for local, one for global layers).

    Raises:
        SubspecError: a config feature subspec does not implement (logit soft-capping, bidirectional attention,
            an unknown activation, dynamic or partial RoPE).
    """

    def __init__(self, config, family: Family, embed: torch.Tensor, lm_head: torch.Tensor,
                 final_norm: torch.Tensor, norms: list[LayerNorms], dtype: torch.dtype, device, native: bool = True,
                 routers: Optional[list[torch.Tensor]] = None):
        self.config, self.family, self.dtype, self.device = config, family, dtype, torch.device(device)
        # routers [experts, hidden] per layer (a mixture-of-experts family)
        self.routers = [Router(w, family.moe, config, native) for w in routers] if routers else None
        self.embed, self.lm_head, self.final_norm, self.norms = embed, lm_head, final_norm, norms
        self.lm_head_linear = DenseLinear(lm_head, None, native)
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
        self.act = activation(act)
        self.ropes, self.rope_of = layer_ropes(config, self.device)
        scalar = getattr(config, family.query_scale_attr) if family.query_scale_attr else self.head_dim
        self.attn_scale = float(scalar) ** -0.5
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=self.device)
                            if family.scaled_embeddings else None)
        self.windows = family.windows(config)  # sliding window of each layer in tokens (0 = full attention)
        from . import kernels

        # the active kernel tier's operators (captured: a runtime keeps the tier it was built with), or None
        native = native and self.dtype == torch.bfloat16 and self.device.type == "cpu" and kernels.native()
        self.k = kernels.ops() if native else None
        self.kernel_tier = kernels.active() if native else None  # its name (amx, avx512, avx2, portable)
        # tree attention on the native kernel where it applies (BF16, CPU, a kernel tier, a head_dim it takes)
        self.native_attention = self.k is not None and kernels.attention_fits(self.head_dim)
        # RMSNorm, RoPE and SwiGLU's gate as one native operator each (BF16 on the CPU; the same rounding as the
        # torch composition they replace, a fraction of the dispatch cost that dominates small models' draft steps)
        self.fused = self.k is not None and config.hidden_size % 16 == 0 and self.head_dim % 16 == 0
        self.fused_silu = self.fused and act == "silu" and mlp_width(config) % 16 == 0
        # whole substitute layers as one native operator (``Linears.fused``; tree attention, no extra norms)
        self.fused_layer = self.fused_silu and self.native_attention
        self._plain_norms = [g.q is None and g.attn_out is None and g.mlp_out is None for g in norms]
        self._stacks: dict[tuple[int, ...], tuple] = {}  # layers_w4's argument lists by run of layers (see _layers_w4)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_source(cls, source, dtype: torch.dtype, device, native: bool = True,
                    offload_embeddings: bool = False) -> "Decoder":
        """Load the shared tensors (embeddings, lm_head, norms, routers) of ``source`` to ``device`` in ``dtype``
        (``native``: use the native kernels where they apply; ``offload_embeddings``: an untied embedding table stays
        with the offloaded weights, rows read on demand, :class:`~subspec.embedding.EmbeddingRows`)."""
        cfg, fam = source.config, source.family
        to = dict(dtype=dtype, device=device)
        tied = getattr(cfg, "tie_word_embeddings", False) or not source.has("lm_head.weight")
        where = source.locate("model.embed_tokens.weight") if offload_embeddings and not tied else None
        if where is not None:
            from .embedding import EmbeddingRows

            embed = EmbeddingRows(*where, dtype, device)
        else:
            embed = source.tensor("model.embed_tokens.weight", direct=True).to(**to)  # read once: past the page cache
        lm_head = embed if tied else source.tensor("lm_head.weight", direct=True).to(**to)
        norms = []
        for i in range(cfg.num_hidden_layers):
            gains = {role: fam.norm.gain(source.tensor(f"model.layers.{i}.{name}.weight"), dtype, device)
                     for role, name, _ in fam.layer_norm_shapes(cfg)}
            norms.append(LayerNorms(**gains))
        final = fam.norm.gain(source.tensor("model.norm.weight"), dtype, device)
        routers = ([source.tensor(router_name(i)).to(**to) for i in range(cfg.num_hidden_layers)]
                   if fam.moe is not None else None)
        return cls(cfg, fam, embed, lm_head, final, norms, dtype, device, native, routers)

    def new_kv_cache(self, max_slots: int) -> KVCache:
        """A zeroed KV cache for this model with ``max_slots`` slots."""
        return KVCache(self.n_layers, self.kv_heads, self.head_dim, max_slots, self.dtype, self.device)

    # ---- math ---------------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, head_dim] in the compute dtype for positions [T] (computed in float32) from RoPE table
        ``table`` of :attr:`ropes`."""
        inv_freq, scale = self.ropes[table]
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scale).to(self.dtype)[:, None, :]
        sin = (emb.sin() * scale).to(self.dtype)[:, None, :]
        return cos, sin

    def norm(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """The family's RMSNorm of x [..., n] with a prepared gain (:class:`~subspec.families.NormStyle`), on the
        fused native operator where it applies."""
        if self.fused and x.is_contiguous():
            return self.k.rms_norm(x, gain, eps, self.family.norm.float32_gain)
        return self.family.norm(x, gain, eps)

    def attend(self, i: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
               attn: Attention) -> torch.Tensor:
        """Attention of layer ``i``: ``softmax(q k^T * attn_scale, masked) v`` over the keys ``attn`` describes,
        restricted to the layer's sliding window (keys at positions ``> position - window``) when it has one.

        q: [T, heads, head_dim]; k_cache, v_cache: [kv_heads, max_slots, head_dim] (the T tokens' own K/V already
        written); positions: [T] int64. Returns [T, heads, head_dim]. A token's position never exceeds its slot, so
        while the forward reads at most ``window`` slots every key is inside the window and no window mask is built.
        """
        window = self.windows[i]
        if self.native_attention and not attn.causal:
            return self.k.tree_attention(q, k_cache, v_cache, attn.prefix, attn.ancestors, positions, window,
                                         self.attn_scale)
        T = q.shape[0]
        n_slots = attn.n_slots(T)
        mask = attn.mask(T, q.device, positions, window if n_slots > window else 0)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_cache[None, :, :n_slots], v_cache[None, :, :n_slots],
            attn_mask=None if mask is None else mask[None, None], is_causal=mask is None, enable_gqa=True,
            scale=self.attn_scale)
        return o[0].transpose(0, 1)

    def layer_forward(self, i: int, h: torch.Tensor, lin: Linears, rope: tuple[torch.Tensor, torch.Tensor],
                      kv: KVCache, positions: torch.Tensor, slots: torch.Tensor, attn: Attention) -> torch.Tensor:
        """One decoder layer. h: [T, hidden] -> [T, hidden]; writes K/V of the T tokens at ``slots``.

        Pre-norm attention and gated MLP; the family's optional norms (q/k per head, Gemma's norms of the attention
        and MLP outputs before their residual adds) apply where its :class:`LayerNorms` has them.
        """
        g, eps, T = self.norms[i], self.eps, h.shape[0]
        if self._fusable(i, lin, attn):  # the same operators in one native call (the same bits)
            return self._layers_w4(h, [(i, lin)], rope, kv, positions, slots, attn)
        norm = self.norm
        x = norm(h, g.attn_in, eps)
        q = lin.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = lin.k_proj(x).view(T, self.kv_heads, self.head_dim)
        v = lin.v_proj(x).view(T, self.kv_heads, self.head_dim)
        if g.q is not None:
            q, k = norm(q, g.q, eps), norm(k, g.k, eps)
        cos, sin = rope
        if self.fused:
            q, k = self.k.rope(q, cos, sin), self.k.rope(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv.layer(i)
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))
        o = self.attend(i, q, k_cache, v_cache, positions, attn)
        a = lin.o_proj(o.reshape(T, self.n_heads * self.head_dim))
        h = h + (a if g.attn_out is None else norm(a, g.attn_out, eps))
        x = norm(h, g.mlp_in, eps)
        m = self.gated_mlp(x, lin.gate_proj, lin.up_proj, lin.down_proj) if lin.experts is None else self.moe(i, x, lin)
        return h + (m if g.mlp_out is None else norm(m, g.mlp_out, eps))

    def _fusable(self, i: int, lin: Optional[Linears], attn: Attention) -> bool:
        """Whether layer ``i`` with these linears runs as a fused 4-bit layer (``layers_w4``)."""
        return (lin is not None and lin.fused is not None and self.fused_layer and not attn.causal
                and self._plain_norms[i])

    def _fused_run(self, i0: int, layers: LayerSource, attn: Attention) -> list[tuple[int, Optional[Linears]]]:
        """Layers ``i0, i0 + 1, ...`` acquired from an in-memory source while one ``layers_w4`` call can run them:
        fused 4-bit layers of one group size and RoPE table, and layers the draft skips (None). Empty where layer
        ``i0`` is not such a layer; the first layer that ends the run is released again (acquired later as usual)."""
        run: list[tuple[int, Optional[Linears]]] = []
        group = None
        for i in range(i0, self.n_layers):
            lin = layers.acquire(i)
            if lin is not None:
                if (not self._fusable(i, lin, attn) or self.rope_of[i] != self.rope_of[i0]
                        or group not in (None, lin.fused.group)):
                    layers.release(i)
                    break
                group = lin.fused.group
            run.append((i, lin))
        while run and run[-1][1] is None:  # skipped layers at the end: left to the loop (nothing to run)
            layers.release(run.pop()[0])
        return run

    def _layers_w4(self, h: torch.Tensor, run: list[tuple[int, Optional[Linears]]], rope, kv: KVCache,
                   positions: torch.Tensor, slots: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Run the fused 4-bit layers of ``run`` (layer index, linears or None: skipped) in one native ``layers_w4``
        call. h: [T, hidden] -> [T, hidden]; writes each layer's K/V of the T tokens at ``slots``.

        The call's lists (16 weight tensors and two gains per layer, the layers, their windows) are built once per run
        and kept while its substitutes are the same objects (no per-step Python over 30 layers)."""
        live = tuple((i, lin.fused) for i, lin in run if lin is not None)
        key = tuple(i for i, _ in live)
        entry = self._stacks.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], (f for _, f in live))):
            if len(self._stacks) >= 16:
                self._stacks.clear()
            w = [t for _, f in live for t in f.weights]
            entry = (tuple(f for _, f in live), w, [self.norms[i].attn_in for i in key],
                     [self.norms[i].mlp_in for i in key], list(key), [self.windows[i] for i in key], live[0][1].group)
            self._stacks[key] = entry
        _, w, attn_in, mlp_in, ids, windows, group = entry
        cos, sin = rope
        return self.k.layers_w4(h.contiguous(), w, group, attn_in, mlp_in, self.eps, self.family.norm.float32_gain,
                                self.n_heads, self.kv_heads, cos, sin, kv.buf, ids, slots, attn.prefix,
                                attn.ancestors, positions, windows, self.attn_scale)

    def gated_mlp(self, x: torch.Tensor, gate, up, down) -> torch.Tensor:
        """``down(act(gate x) * up x)``: x [T, hidden] -> [T, hidden] (the fused native gate where it applies)."""
        if self.fused_silu:
            return down(self.k.silu_mul(gate(x), up(x)))
        return down(self.act(gate(x)) * up(x))

    def moe(self, i: int, x: torch.Tensor, lin: Linears) -> torch.Tensor:
        """Layer ``i``'s mixture-of-experts MLP: x [T, hidden] (normalized) -> [T, hidden].

        The routed experts are fetched first where the layer's experts are read on demand (``Linears.fetch``: the
        union over the forward's tokens, e.g. a verify's tree nodes). Each token's output is the sum over its routed
        experts (:class:`Router`), in ascending expert order, of
        ``weight * gated_mlp(x)`` (transformers' order: a zero tensor, then one ``index_add_`` per expert). Each expert
        runs on the rows routed to it; with batch-invariant linears a row's bits do not depend on which other rows
        share its expert, so a verify forward gives each tree node the bits of a one-token forward (BF16 exact).
        """
        weights, experts = self.routers[i](x)
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, rank) pairs grouped by expert, tokens ascending
        ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
        ids, counts = ids.tolist(), counts.tolist()  # one host sync per layer: which experts run
        if lin.fetch is not None:  # experts read on demand (the disk tier): only the routed ones
            lin.fetch(ids)
        out = torch.zeros_like(x)
        start = 0
        for e, n in zip(ids, counts):
            pick = order[start:start + n]
            start += n
            rows = pick // top_k
            gate, up, down = lin.experts[e]
            y = self.gated_mlp(x[rows], gate, up, down)
            w = weights.reshape(-1)[pick, None]
            y = (y.float() * w).to(x.dtype) if w.dtype != y.dtype else y * w
            out.index_add_(0, rows, y)
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attn: Attention,
                layers: LayerSource, kv: KVCache, logits_rows: Optional[torch.Tensor | slice] = None,
                head=None) -> torch.Tensor:
        """Run the model over T tokens and return logits.

        Args:
            tokens: [T] int64 token ids. positions: [T] int64 RoPE positions. slots: [T] int64 cache slots the
                tokens' K/V are written to (``attn.prefix + j`` for run token j).
            attn: which cached keys each token sees (:class:`Attention`); sliding-window layers see the part of it
                inside their window.
            layers: source of each layer's linears. kv: the cache.
            logits_rows: rows of the T hidden states to project to logits (index tensor or slice); None = all.
            head: the output projection ``[R, hidden] -> [R, V']`` (default: the full lm_head; the draft passes its
                reduced-vocabulary head, :class:`~subspec.speculation.DraftHead`).

        Returns:
            logits [R, vocab] (or [R, V'] of ``head``) in the compute dtype (R = selected rows).
        """
        h = self.embed[tokens]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        ropes = [self.rope(positions, t) for t in range(len(self.ropes))]
        stack = self.fused_layer and not attn.causal and getattr(layers, "in_memory", False)
        i = 0
        while i < self.n_layers:
            run = self._fused_run(i, layers, attn) if stack else []
            if run:  # fused 4-bit layers held in memory (a draft's): one native call for all of them
                try:
                    h = self._layers_w4(h, run, ropes[self.rope_of[i]], kv, positions, slots, attn)
                finally:
                    for j, _ in run:
                        layers.release(j)
                i += len(run)
                continue
            lin = layers.acquire(i)
            try:  # None: a draft without this layer's substitute skips it (the residual stream passes through)
                if lin is not None:
                    h = self.layer_forward(i, h, lin, ropes[self.rope_of[i]], kv, positions, slots, attn)
            finally:  # an exception (or Ctrl-C) mid-forward must not leave a staging slot taken
                layers.release(i)
            i += 1
        if logits_rows is not None:
            h = h[logits_rows]
        return (head or self.lm_head_linear)(self.norm(h, self.final_norm, self.eps))


def attention_materializes_scores(config, device, dtype: torch.dtype) -> bool:
    """Whether :meth:`Decoder.attend`'s torch path (prefill; every attention off the native kernels) materializes the
    score matrix: torch's ``scaled_dot_product_attention`` picks its math kernel for this model's heads, ``dtype`` and
    ``device`` with a boolean mask and grouped-query heads (the math kernel forms ``[heads, T, keys]`` scores; the
    fused ones, CPU flash attention included, work in blocks). Asked of torch's own dispatcher on tiny tensors; when
    torch cannot say, the answer is yes (the placement then reserves the scores: the safe side)."""
    try:
        from torch.nn.attention import SDPBackend

        hd, nh, kvh = head_dim(config), config.num_attention_heads, config.num_key_value_heads
        q = torch.zeros(1, nh, 2, hd, dtype=dtype, device=device)
        k = torch.zeros(1, kvh, 4, hd, dtype=dtype, device=device)
        mask = torch.ones(1, 1, 2, 4, dtype=torch.bool, device=device)
        choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False, scale=hd ** -0.5, enable_gqa=True)
        return int(choice) == SDPBackend.MATH.value
    except Exception:  # a torch without this dispatcher query (or its enum): count the scores
        return True


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}
"""The gated MLPs' activations of the families we run, as transformers' ``ACT2FN`` computes them (``nn.SiLU``,
``GELUActivation``, ``PytorchGELUTanh``): importing ``transformers.activations`` costs 3 s of a start."""


def activation(name: str):
    """The activation function transformers' ``ACT2FN[name]`` is (ours where we have it, else transformers').

    Raises:
        SubspecError: transformers has no activation of that name.
    """
    fn = _ACTIVATIONS.get(name)
    if fn is not None:
        return fn
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise SubspecError(f"unsupported activation '{name}': subspec supports the activations of transformers' ACT2FN")
    return ACT2FN[name]


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


def load_linears(source, i: int, dtype: torch.dtype, device, native: bool = True) -> Linears:
    """Read layer ``i``'s linears (and biases) from the checkpoint as resident dense tensors.

    ``native``: run them on the native kernels where they apply (see :class:`~subspec.weights.DenseLinear`)."""
    fns = {}
    for name in linear_names(source.config):
        p = f"model.layers.{i}.{linear_prefix(name)}"
        w = source.tensor(p + ".weight").to(dtype=dtype, device=device)
        b = source.tensor(p + ".bias").to(dtype=dtype, device=device) if source.has(p + ".bias") else None
        fns[name] = DenseLinear(w, b, native)
    return Linears(fns)
