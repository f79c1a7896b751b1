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

from .cache import cache_root, read_json, write_json
from .costmodel import best_depth, best_time, round_rate
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


def candidate_budgets(settings: TreeSettings, budget_given: bool) -> list[int]:
    """Verify budgets calibration times: the one given, else those of :data:`AUTO_BUDGETS` the tree can fill."""
    if budget_given:
        return [settings.verify_budget]
    fit = [n for n in AUTO_BUDGETS if n <= settings.max_nodes - 1]
    return fit or [settings.max_nodes - 1]


class SubstituteLayers:
    """A :class:`~subspec.model.LayerSource` over the substitutes of the offloaded layers (always ready)."""

    def __init__(self, subs: dict[int, Linears]):
        self.subs = subs

    def acquire(self, i: int) -> Linears:
        return self.subs[i]

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
        if quantized is not None:  # (codes [size, hidden], scale, zero, group): a 4-bit copy on the native kernel
            from .quant import Int4Linear

            codes, scale, zero, group = quantized
            self.main = Int4Linear(codes, scale, zero, group, None, decoder.lm_head.dtype, decoder.device, native)
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
        self.policy: Optional[AdaptiveDepth] = None  # set by calibration when the depth is automatic
        self.depth_capacity = settings.depth  # the buffers hold trees up to this depth
        self._proposed = False  # a tree was handed over and its verdict (committed) is pending
        self.last_steps = 0  # draft forwards of the last proposal = its depth (the root's, then one per depth but the last)
        self._t_proposed = self._t_drafting = 0.0  # when the last tree was handed over; seconds spent drafting it

    def committed(self, tokens: list[int]) -> None:
        if self.policy is not None and self._proposed:
            # the verdict on our tree: the time since we handed it over is the verify forward (and its commit)
            t_verify = time.perf_counter() - self._t_proposed
            if self.last_steps:
                self.policy.observe(len(tokens) - 1, self.last_steps)
                self.policy.observe_costs(self._t_drafting / self.last_steps, t_verify)
            else:  # a round without drafting: a one-token forward
                self.policy.observe_single(t_verify)
            self.s.depth = self.policy.next_depth()
        self._proposed = False

    def reset(self) -> None:
        self._proposed = False

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
            logsumexp over a peaked [6, 32768] row block: 1.8 ms; this: 0.12 ms).
        """
        x = logits.to(torch.float32, copy=True)  # scratch: modified in place below
        top, col = torch.topk(x, k, dim=-1)  # [R, k]
        inv_t = 1.0 / self.s.draft_temperature
        m = top[:, :1]  # [R, 1] row maxima
        z = x.sub_(m).mul_(inv_t).clamp_min_(-87.0).exp_()
        lse = m * inv_t + z.sum(dim=-1, keepdim=True).log_()  # [R, 1]
        cand = top * inv_t - lse + scores[:, None]
        vals, best = torch.topk(cand.view(-1), k)
        row = best // k
        return vals, row * x.shape[1] + col.view(-1)[best]

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
        par = self.root_parents  # the first frontier hangs under the root
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
        self.last_steps = depth
        tree = self._prune(n)
        self._t_proposed = time.perf_counter()
        self._t_drafting = self._t_proposed - t0  # ``depth`` draft forwards
        return tree

    def _prune(self, n: int) -> DraftTree:
        """Keep the root and the ``verify_budget`` best nodes plus their ancestors, renumbered in depth order."""
        budget = self.s.verify_budget
        if n - 1 <= budget:
            return DraftTree(self.tokens[:n].clone(), self.parents[:n].clone(), self.depths[:n].clone(),
                             self.anc[:n, :n].clone())
        best = torch.topk(self.scores[1:n], budget).indices + 1
        keep = self.anc[best, :n].any(0)
        keep[0] = True
        sel = torch.nonzero(keep)[:, 0]
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


@dataclass
class Calibration:
    """Measured costs on this machine (seconds): one draft step over k tokens; ``t_verify[n]``: a target forward
    over a tree of the root and n nodes (n = 0: the root alone, i.e. one token)."""

    t_draft_step: float
    t_verify: dict[int, float]

    def choose(self, s: TreeSettings, budgets: list[int], depth_given: bool, budget_given: bool,
               depth_capacity: int) -> TreeSettings:
        """Pick the verify budget and depth from the measured costs.

        Verify budget: the largest of ``budgets`` whose forward costs at most 1.25x a one-token forward (tokens that
        ride along with the streamed weights almost for free), else the smallest. Depth: the best of
        :class:`AdaptiveDepth` for these costs, at most ``depth_capacity`` (what the draft's buffers hold).
        """
        if not budget_given:
            fits = [n for n in budgets if self.t_verify[n] <= 1.25 * self.t_verify[0]]
            s.verify_budget = max(fits) if fits else min(budgets)
        if not depth_given:
            s.depth = AdaptiveDepth(self.t_draft_step, self.t_verify[s.verify_budget], depth_capacity,
                                    t_single=self.t_verify[0]).best()
        return s


class AdaptiveDepth:
    """Chooses the draft depth each round from measured costs and the acceptance observed so far.

    Model (:mod:`subspec.costmodel`): each drafted token is accepted with probability ``a`` given its parent was
    (geometric run), so a round of depth D emits ``E(D) = 1 + a + ... + a^D`` tokens on average and costs
    ``D * t_step + t_verify`` (D draft forwards: the root's, then one per depth but the last; the verify forward);
    the depth maximizing ``E(D) / cost(D)`` tokens per second is used. ``a`` is the censored-geometric estimate
    ``accepted / (accepted + rounds that stopped before their depth)``, started from a prior of 9 accepted, 1 miss.

    Depth 0 is plain decoding (no draft forward, a one-token target forward costing ``t_single``): chosen when no
    depth beats ``1 / t_single`` tokens per second, e.g. a model fully resident on a fast device, or a draft the
    target keeps rejecting. While at depth 0, one round in :attr:`PROBE_EVERY` drafts anyway at the best depth, so
    the acceptance estimate (and the choice) follows the text being generated.

    The costs start from the calibration (the prior) and follow the running generation: each round's measured draft
    step and verify times move them by an exponential moving average (weight :attr:`RATE`). When, after
    :attr:`CONTRADICT_ROUNDS` rounds, either cost is off from the calibration by more than :attr:`CONTRADICT_RATIO`
    (the calibration ran on a busy machine, or the machine changed), ``on_contradicted`` is called once, so the cached
    calibration is dropped and the next start measures again.

    Args:
        t_step: seconds of one draft step (k rows). t_verify: seconds of one verify forward. max_depth: deepest tree.
        on_contradicted: called with (t_step, t_verify) as measured when the calibration is contradicted.
        t_single: seconds of a one-token target forward; None = never choose depth 0.
    """

    RATE = 0.25
    CONTRADICT_ROUNDS = 8
    CONTRADICT_RATIO = 2.0
    PROBE_EVERY = 16

    def __init__(self, t_step: float, t_verify: float, max_depth: int = AUTO_MAX_DEPTH, on_contradicted=None,
                 t_single: Optional[float] = None):
        self.t_step, self.t_verify, self.max_depth = t_step, t_verify, max_depth
        self.t_single = t_single
        self.prior = (t_step, t_verify)
        self.hits, self.misses = 9.0, 1.0
        self.rounds = 0
        self.plain_rounds = 0  # consecutive rounds at depth 0
        self.on_contradicted = on_contradicted

    @property
    def acceptance(self) -> float:
        """The estimated probability ``a`` that a drafted token is accepted given its parent was."""
        return self.hits / (self.hits + self.misses)

    def observe(self, accepted: int, depth: int) -> None:
        """Record a round: ``accepted`` draft tokens kept out of a tree drafted to ``depth``."""
        self.hits += accepted
        self.misses += accepted < depth

    def observe_costs(self, t_step: float, t_verify: float) -> None:
        """Record a round's measured seconds per draft step and of its verify forward (see the class docstring)."""
        r = self.RATE
        self.t_step += r * (t_step - self.t_step)
        self.t_verify += r * (t_verify - self.t_verify)
        self.rounds += 1
        self.plain_rounds = 0
        if self.on_contradicted is not None and self.rounds >= self.CONTRADICT_ROUNDS:
            off = max(_ratio(self.t_step, self.prior[0]), _ratio(self.t_verify, self.prior[1]))
            if off > self.CONTRADICT_RATIO:
                callback, self.on_contradicted = self.on_contradicted, None
                callback(self.t_step, self.t_verify)

    def observe_single(self, t: float) -> None:
        """Record the seconds of a round without drafting (a one-token target forward)."""
        if self.t_single is not None:
            self.t_single += self.RATE * (t - self.t_single)
        self.plain_rounds += 1

    def rate(self, depth: int) -> float:
        """Predicted tokens per second at ``depth`` (0: plain decoding)."""
        if depth == 0:
            return 1.0 / self.t_single if self.t_single else 0.0
        return round_rate(self.acceptance, depth, self.t_step, self.t_verify)

    def best_drafting(self) -> int:
        """The depth >= 1 with the highest predicted tokens per second."""
        return best_depth(self.acceptance, self.t_step, self.t_verify, self.max_depth)[0]

    def best(self) -> int:
        """The depth (>= 0) with the highest predicted tokens per second."""
        d = self.best_drafting()
        return 0 if self.t_single is not None and self.rate(0) > self.rate(d) else d

    def next_depth(self) -> int:
        """The depth of the next round: :meth:`best`, except that every :attr:`PROBE_EVERY`-th round at depth 0
        drafts at :meth:`best_drafting` to re-measure the acceptance."""
        d = self.best()
        if d == 0 and self.plain_rounds >= self.PROBE_EVERY:
            return self.best_drafting()
        return d


def _ratio(a: float, b: float) -> float:
    """How far apart two positive costs are, as a factor >= 1."""
    return max(a, b) / max(min(a, b), 1e-9)


CALIBRATION_VERSION = 2


def forget_calibration(key: str) -> None:
    """Drop the cached calibration of ``key`` (the running generation contradicted it): the next start measures
    again instead of sizing its trees from a stale or disturbed measurement."""
    path = cache_root() / "calibration.json"
    table = read_json(path) or {}
    if table.pop(f"v{CALIBRATION_VERSION}|{key}", None) is not None:
        write_json(path, table)


def calibrate(engine, draft: SubSpecDraft, key: str, budgets: list[int]) -> Calibration:
    """Measure one draft step and target forwards over root + n nodes for n in ``budgets`` and 0 (through the real
    offload tier); cached by ``key`` in ``calibration.json`` (missing budgets are measured and added).

    The measured forwards write only scratch slots the cache has (a short fake prefix, then the tree). Uses the
    scratch of an empty conversation: call before any request (the engine is reset afterwards).
    """
    path = cache_root() / "calibration.json"
    key = f"v{CALIBRATION_VERSION}|{key}"
    entry = (read_json(path) or {}).get(key) or {}
    try:
        t_step = float(entry["t_draft_step"]) if "t_draft_step" in entry else None
        t_verify = {int(n): float(t) for n, t in entry.get("t_verify", {}).items()}
    except (TypeError, ValueError, AttributeError):
        t_step, t_verify = None, {}
    need = [n for n in [0, *budgets] if n not in t_verify]
    if t_step is not None and not need:
        return Calibration(t_step, t_verify)
    dec, kv, k = engine.decoder, engine.kv, draft.s.topk
    longest = max([n + 1 for n in need] + [k])
    ctx = max(0, min(64, kv.max_slots - longest))  # a prefix that leaves room for the longest measured tree
    idx = torch.arange(kv.max_slots, device=dec.device)
    tokens = torch.zeros(longest, dtype=torch.long, device=dec.device)
    step_attn = Attention.tree(ctx, torch.ones(k, k, dtype=torch.bool, device=dec.device).tril())

    def draft_step():
        dec.forward(tokens[:k], idx[ctx:ctx + k], idx[ctx:ctx + k], step_attn, draft.layers, kv)

    def verify(n):
        a = Attention.tree(ctx, torch.ones(n, n, dtype=torch.bool, device=dec.device).tril())
        return lambda: dec.forward(tokens[:n], idx[ctx:ctx + n], idx[ctx:ctx + n], a, engine.layers, kv)

    try:
        if t_step is None:
            draft_step()  # warm-up
            t_step = best_time(draft_step, 5, dec.device)
        for n in need:
            t_verify[n] = best_time(verify(n + 1), 2, dec.device)
    finally:
        engine.reset()
    table = read_json(path) or {}  # re-read: another process may have added entries meanwhile
    table[key] = {"t_draft_step": t_step, "t_verify": t_verify}
    write_json(path, table)
    return Calibration(t_step, t_verify)
