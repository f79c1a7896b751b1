"""SubSpec drafting: the substitute draft proposes a deep, narrow token tree (design.md §3.4).

The draft is the target's own shadow: the same :class:`~subspec.model.Decoder` (embeddings, norms, lm_head, RoPE),
the same resident layers (the very tensors), substitutes in place of offloaded layers, and the target's KV cache.
It never prefills: for the prefix it reads the target's K/V, and it writes only scratch slots ``L0 + node``.

One round of drafting: the root forward, then one batched forward per depth over the k frontier nodes. Each
depth keeps the global top-k (parent, token) pairs by cumulative log-probability under the draft sharpened at
``T_draft`` (paper: T = 0.2, k = 6). Drafting stops early when the best frontier path's probability falls below
``threshold``; the tree is then pruned to the ``verify_budget`` best-scoring nodes (kept connected).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .kvcache import KVCache
from .model import Attention, Decoder, ResidentLayers
from .tree import DraftTree
from .weights import Linears


@dataclass
class TreeSettings:
    """Shape of the draft tree.

    Attributes:
        depth: draft forwards after the root (D). topk: frontier width (k). verify_budget: most non-root nodes the
        target verifies. threshold: stop drafting when the best frontier path's draft probability falls below it.
        draft_temperature: softmax temperature sharpening the draft's distribution.
    """

    depth: int = 32
    topk: int = 6
    verify_budget: int = 128
    threshold: float = 0.05
    draft_temperature: float = 0.2

    @property
    def max_nodes(self) -> int:
        """Largest tree the draft can write (root + depth * topk): the KV scratch to reserve."""
        return 1 + self.depth * self.topk


AUTO_MAX_DEPTH = 48
AUTO_BUDGETS = (16, 32, 64, 128)


def tree_settings(opts) -> TreeSettings:
    """Settings from options: the given flags, else the largest automatic choice (narrowed by :func:`calibrate`).

    With ``depth`` not given, KV scratch is reserved for :data:`AUTO_MAX_DEPTH` (or the verify budget when that is
    smaller: a path deeper than the budget could not be verified); with ``verify_budget`` not given, the workspace is
    sized for the largest of :data:`AUTO_BUDGETS`. Flags are validated by ``Options.validate`` (>= 1).
    """
    s = TreeSettings(depth=AUTO_MAX_DEPTH, verify_budget=AUTO_BUDGETS[-1], draft_temperature=opts.draft_temperature)
    if opts.topk is not None:
        s.topk = opts.topk
    if opts.verify_budget is not None:
        s.verify_budget = opts.verify_budget
        s.depth = min(AUTO_MAX_DEPTH, opts.verify_budget)
    if opts.depth is not None:
        s.depth = opts.depth
    if opts.threshold is not None:
        s.threshold = opts.threshold
    return s


class SubstituteLayers:
    """A :class:`~subspec.model.LayerSource` over the substitutes of the offloaded layers (always ready); None for an
    offloaded layer without one (the budget held too few: the draft skips it)."""

    in_memory = True  # (every substitute is held in memory: see LayerSource)

    def __init__(self, subs: dict[int, Linears]):
        self.subs = subs

    def acquire(self, i: int) -> Optional[Linears]:
        return self.subs.get(i)

    def release(self, i: int) -> None:
        pass


class DraftHead:
    """The draft's output projection over a frequency-ranked vocabulary subset (FR-Spec, arXiv 2502.14856).

    Byte-level BPE and SentencePiece vocabularies number their tokens by merge order or score, which follows token
    frequency in the tokenizer's training corpus, so ids ``0..size-1`` are the frequent tokens; ``extra`` ids (end of
    sequence, chat-template tokens) are always added. The draft ranks its candidates among these only, reading
    ``size / vocab`` of the lm_head per step; the target verifies with its full lm_head, so the output does not
    change, only how often the draft's guesses are right.

    Args:
        decoder: the model (its ``lm_head`` [V, hidden]). size: tokens in the subset (None or >= V: the full head).
        extra: token ids added to the subset. native: use the native kernels where they apply.
        quantized: a 4-bit copy of the subset's rows (:func:`~subspec.quant.load_draft_head`: codes [size, hidden / 2]
        two a byte, scale, zero [size, hidden / group], group), run as an :class:`~subspec.quant.Int4Linear`.

    Attributes:
        token_ids: [V'] int64, the token id of each column of the head's logits.
    """

    def __init__(self, decoder: Decoder, size: Optional[int], extra: list[int] = (), native: bool = True,
                 quantized: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = None):
        from .weights import DenseLinear

        V = decoder.lm_head.shape[0]
        size = head_rows(V, size)
        tail = sorted({t for t in extra if size <= t < V})
        self.size = size + len(tail)
        if quantized is not None:  # (codes [size, hidden / 2] two a byte, scale, zero, group): a 4-bit copy
            from .quant import Int4Linear

            codes, scale, zero, group = quantized
            self.main = Int4Linear(codes, scale, zero, group, None, decoder.lm_head.dtype, decoder.device, native,
                                   nibbles=True)
        else:
            self.main = decoder.lm_head_linear if size == V else DenseLinear(decoder.lm_head[:size], None, native)
        self.tail = decoder.lm_head[tail].clone() if tail else None
        self.token_ids = torch.cat([torch.arange(size), torch.tensor(tail, dtype=torch.long)]).to(decoder.device)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [R, hidden] (after the final norm) -> logits [R, V'] over the subset."""
        logits = self.main(h)
        if self.tail is not None:
            logits = torch.cat([logits, F.linear(h, self.tail)], dim=-1)
        return logits


class SubSpecDraft:
    """The SubSpec proposer (see module docstring). Tree state lives in preallocated device tensors.

    Args:
        decoder: the target's decoder (shared parts). layers: resident layers + substitutes. kv: the target's cache.
        settings: tree shape. head: the draft's output projection (default: the full-vocabulary lm_head).
    """

    def __init__(self, decoder: Decoder, layers: ResidentLayers, kv: KVCache, settings: TreeSettings,
                 head: Optional[DraftHead] = None):
        self.decoder, self.layers, self.kv, self.s = decoder, layers, kv, settings
        self.head = head or DraftHead(decoder, None)
        self.max_nodes = settings.max_nodes
        N, dev = self.max_nodes, decoder.device
        self.tokens = torch.zeros(N, dtype=torch.long, device=dev)
        self.parents = torch.zeros(N, dtype=torch.long, device=dev)
        self.depths = torch.zeros(N, dtype=torch.long, device=dev)
        self.scores = torch.zeros(N, dtype=torch.float32, device=dev)
        self.anc = torch.zeros(N, N, dtype=torch.bool, device=dev)
        self.eye = torch.eye(N, dtype=torch.bool, device=dev)
        self.slot_idx = torch.arange(kv.max_slots, device=dev)
        self.root_parents = torch.zeros(settings.topk, dtype=torch.long, device=dev)
        self.log_threshold = math.log(settings.threshold) if settings.threshold > 0 else -math.inf
        self.sync_every = 1 if dev.type == "cpu" else 4
        self._native_expand = (decoder.k is not None and decoder.kernel_tier != "portable"  # (_expand)
                               and decoder.dtype in (torch.bfloat16, torch.float32))
        self.policy = None  # an AdaptiveDepth (subspec.policy), set by calibration when the depth is automatic
        self.depth_capacity = settings.depth  # the buffers hold trees up to this depth
        self._proposed = False  # a tree was handed over and its verdict (committed) is pending
        self.last_width = 0  # the last proposal's frontier width (top-k)
        self.last_steps = 0  # draft forwards of the last proposal = its depth (the root's, then one per depth but the last)
        self.last_nodes = 0  # nodes of the last proposed tree beyond the root (what its verify forward ran over)
        self._t_proposed = self._t_drafting = 0.0  # when the last tree was handed over; seconds spent drafting it
        self._tree: Optional[DraftTree] = None  # the last drafted tree (its accepted nodes' ranks: _ranks)
        self._drafted: Optional[torch.Tensor] = None  # the drafted index of each node of a pruned last tree

    def committed(self, tokens: list[int], cut: bool = False) -> None:
        if self.policy is not None and self._proposed:
            # the verdict on our tree: the time since we handed it over is the verify forward (and its commit)
            t_verify = time.perf_counter() - self._t_proposed
            if self.last_steps:
                # the accepted draft tokens, then the bonus token; a cut round (EOS, the limit) kept no bonus
                drafted = tokens if cut else tokens[:-1]
                narrower = any(w < self.last_width for w in self.policy.prior_steps if w)
                ranks = self._ranks(drafted) if narrower else None  # (ranks inform narrower widths only)
                self.policy.observe(len(drafted), self.last_steps, ranks, complete=not cut)
                self.policy.observe_costs(self._t_drafting / self.last_steps, t_verify, self.last_nodes)
            else:  # a round without drafting: a one-token forward
                self.policy.observe_single(t_verify)
            self.s.topk = self.policy.next_width() or self.s.topk  # (None: a policy of one unnamed width)
            self.s.depth = self.policy.next_depth()
        self._proposed = False

    def reset(self) -> None:
        self._proposed = False

    def _ranks(self, accepted: list[int]) -> list[int]:
        """The rank of each of the last tree's accepted nodes among the k frontier nodes of its depth (0: the draft's
        most probable of that depth), along the accepted path; ``accepted``: the accepted tokens, in order. Drafting
        writes each depth's k nodes at ``1 + (depth - 1) k ...`` in descending cumulative probability (``_expand``);
        a pruned tree's node keeps its drafted index (``_prune``), so the rank is exact, ties included. One host
        copy of the tree's [3 or 4, N] indices."""
        tree = self._tree
        rows = (tree.tokens, tree.parents, tree.depths) + ((self._drafted,) if self._drafted is not None else ())
        tokens, parents, depths, *pruned = torch.stack(rows).tolist()
        drafted = pruned[0] if pruned else range(len(tokens))  # (an unpruned tree: its nodes' drafted indices)
        ranks, node, k = [], 0, self.last_width
        for token in accepted:
            d = depths[node] + 1
            node = next((i for i in range(node + 1, len(depths))
                         if depths[i] == d and parents[i] == node and tokens[i] == token), None)
            if node is None:  # (cannot happen for a path the verify accepted)
                break
            ranks.append((drafted[node] - 1) % k)
        return ranks

    def _expand(self, logits: torch.Tensor, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best (row, column) pairs by cumulative draft log-probability, top-k before normalization.

        Args:
            logits: [R, V'] draft logits of the R frontier nodes. scores: [R] their cumulative log-probabilities.

        Returns:
            (values [k] float32, flat indices [k] into R x V'). With ``T = draft_temperature``, the log-probability of
            column c of row r is ``logits[r, c] / T - logsumexp(logits[r] / T)``: the k best pairs are among each
            row's k largest logits, so the full [R, V'] log-softmax is never formed. The log-sum-exp is taken from
            the row maximum (the top-1 logit) with exponents clamped at -87: terms below e^-87 change no float32 sum
            of a term >= 1, and without the clamp they are denormals, which cost the CPU ~100x a normal exp (torch's
            logsumexp over a peaked [6, 32768] row block: 1.8 ms; this: 0.12 ms). On a native kernel tier one
            operator does it all (``expand_topk``, two passes over the logits; [3, 32768] BF16 on 2 Zen 4 cores:
            avx512 27 us, avx2 35 us, against 230 us for this composition, 420 us inside a generation); the portable
            tier's (360 us: the baseline target's narrow vectors) is not used.
        """
        inv_t = 1.0 / self.s.draft_temperature
        if self._native_expand:  # all of it in one operator, two passes over the logits (drivers.h: expand_topk)
            return self.decoder.k.expand_topk(logits, scores, k, inv_t)
        x = logits.to(torch.float32, copy=True)  # scratch: modified in place below
        top, col = torch.topk(x, k, dim=-1)  # [R, k]
        m = top[:, :1]  # [R, 1] row maxima
        z = x.sub_(m).mul_(inv_t).clamp_min_(-87.0).exp_()
        lse = m * inv_t + z.sum(dim=-1, keepdim=True).log_()  # [R, 1]
        cand = top * inv_t - lse + scores[:, None]
        vals, best = torch.topk(cand.view(-1), k)
        row = best // k
        return vals, row * logits.shape[1] + col.view(-1)[best]

    def propose(self, root: torch.Tensor, L0: int) -> DraftTree:
        """Draft a tree under ``root`` [1] at position/slot ``L0``; returns the pruned tree to verify."""
        t0 = time.perf_counter()
        k, dec = self.s.topk, self.decoder
        self._proposed = True
        if min(self.s.depth, self.depth_capacity) < 1:  # the policy found that drafting does not pay: the root alone
            self.last_steps = 0
            self._t_proposed = time.perf_counter()
            return DraftTree.chain(root.clone())
        pos = self.slot_idx[L0:L0 + 1]
        self.anc[0] = self.eye[0]
        logits = dec.forward(root, pos, pos, Attention.tree(L0, self.anc[:1, :1]), self.layers, self.kv,
                             head=self.head)
        self.tokens[0] = root[0]
        self.depths[0] = 0
        self.scores[0] = 0.0
        vals, flat = self._expand(logits, self.scores[:1], k)
        toks = self.head.token_ids[flat]
        par = self.root_parents[:k]  # the first frontier hangs under the root (k: this round's width, <= the buffers')
        n = 1
        depth = 0
        depth_limit = min(self.s.depth, self.depth_capacity)
        for d in range(1, depth_limit + 1):
            idx = self.slot_idx[n:n + k]
            self.tokens[n:n + k] = toks
            self.parents[n:n + k] = par
            self.depths[n:n + k] = d
            self.scores[n:n + k] = vals
            self.anc[n:n + k] = self.anc[par] | self.eye[n:n + k]
            n += k
            depth = d
            if d == depth_limit:
                break
            if d % self.sync_every == 0 and vals.max().item() < self.log_threshold:
                break
            logits = dec.forward(self.tokens[n - k:n], self.slot_idx[L0 + d].expand(k), L0 + idx,
                                 Attention.tree(L0, self.anc[n - k:n, :n]), self.layers, self.kv, head=self.head)
            vals, flat = self._expand(logits, vals, k)
            V = logits.shape[1]
            par = idx[flat // V]
            toks = self.head.token_ids[flat % V]
        self.last_steps, self.last_width = depth, k
        tree = self._tree = self._prune(n)
        self.last_nodes = tree.tokens.shape[0] - 1
        self._t_proposed = time.perf_counter()
        self._t_drafting = self._t_proposed - t0  # ``depth`` draft forwards
        return tree

    def _prune(self, n: int) -> DraftTree:
        """Keep the root and the ``verify_budget`` best nodes plus their ancestors, renumbered in depth order."""
        budget = self.s.verify_budget
        self._drafted = None
        if n - 1 <= budget:
            return DraftTree(self.tokens[:n].clone(), self.parents[:n].clone(), self.depths[:n].clone(),
                             self.anc[:n, :n].clone())
        best = torch.topk(self.scores[1:n], budget).indices + 1
        keep = self.anc[best, :n].any(0)
        keep[0] = True
        sel = self._drafted = torch.nonzero(keep)[:, 0]
        new_index = torch.cumsum(keep.long(), 0) - 1
        return DraftTree(self.tokens[sel], new_index[self.parents[sel]], self.depths[sel], self.anc[sel][:, sel])


DRAFT_VOCAB = 32768
"""Default size of the draft's vocabulary subset (:class:`DraftHead`), chosen by measurement (see README)."""


def draft_vocab_size(option: Optional[int]) -> Optional[int]:
    """The draft head's subset size for the ``draft_vocab`` option (None: :data:`DRAFT_VOCAB`; 0: the full one)."""
    return DRAFT_VOCAB if option is None else (option or None)


def head_rows(vocab: int, size: Optional[int]) -> int:
    """Rows of the lm_head the draft head keeps: ``size`` rounded down to 16 (the native kernels' row blocks), at
    least 16; the whole vocabulary for None or ``size >= vocab``."""
    return vocab if size is None or size >= vocab else max(16, size // 16 * 16)


def draft_head_bytes(config, option: Optional[int], dtype: torch.dtype, bits: int = 16, group: int = 64) -> int:
    """Bytes of the draft head a draft step reads: its vocabulary subset x hidden, in ``dtype`` (``bits`` 16: a view
    of the lm_head, no memory of its own) or as a 4-bit copy (codes + a bf16 scale and shift per ``group``)."""
    from .placement import SubstituteSpec

    rows = head_rows(config.vocab_size, draft_vocab_size(option))
    if bits == 4:  # the native kernel keeps the scale and shift in bf16
        return SubstituteSpec(4, group).linear_bytes(rows, config.hidden_size, 2)
    return rows * config.hidden_size * torch.empty((), dtype=dtype).element_size()


def build_proposer(settings: TreeSettings, decoder: Decoder, resident: dict[int, Linears], subs: dict[int, Linears],
                   kv: KVCache, head: Optional["DraftHead"] = None) -> SubSpecDraft:
    """The SubSpec draft for a loaded model (the engine's proposer): ``subs`` (substitutes of the offloaded layers, see
    :func:`subspec.quant.load_substitutes`) + the shared resident layers, decoder and KV cache, and the draft's
    output ``head`` (:class:`DraftHead`; default the full lm_head)."""
    return SubSpecDraft(decoder, ResidentLayers(resident, SubstituteLayers(subs)), kv, settings, head)
