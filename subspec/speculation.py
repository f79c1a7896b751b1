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

import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from .cache import atomic_file, cache_root
from .kvcache import KVCache
from .model import Decoder, ResidentLayers
from .placement import Placement, SubstituteSpec
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

    With ``depth`` not given, KV scratch is reserved for :data:`AUTO_MAX_DEPTH`; with ``verify_budget`` not given,
    the workspace is sized for the largest of :data:`AUTO_BUDGETS`.
    """
    s = TreeSettings(depth=AUTO_MAX_DEPTH, verify_budget=AUTO_BUDGETS[-1], draft_temperature=opts.draft_temperature)
    if opts.topk:
        s.topk = opts.topk
    if opts.depth:
        s.depth = opts.depth
    elif opts.verify_budget:
        s.depth = max(1, min(64, opts.verify_budget // s.topk))
    if opts.verify_budget:
        s.verify_budget = opts.verify_budget
    if opts.threshold is not None:
        s.threshold = opts.threshold
    return s


class SubstituteLayers:
    """A :class:`~subspec.model.LayerSource` over the substitutes of the offloaded layers (always ready)."""

    def __init__(self, subs: dict[int, Linears]):
        self.subs = subs

    def acquire(self, i: int) -> Linears:
        return self.subs[i]

    def release(self, i: int) -> None:
        pass


class SubSpecDraft:
    """The SubSpec proposer (see module docstring). Tree state lives in preallocated device tensors.

    Args:
        decoder: the target's decoder (shared parts). layers: resident layers + substitutes. kv: the target's cache.
        settings: tree shape.
    """

    def __init__(self, decoder: Decoder, layers: ResidentLayers, kv: KVCache, settings: TreeSettings):
        self.decoder, self.layers, self.kv, self.s = decoder, layers, kv, settings
        self.max_nodes = settings.max_nodes
        N, dev = self.max_nodes, decoder.device
        self.tokens = torch.zeros(N, dtype=torch.long, device=dev)
        self.parents = torch.zeros(N, dtype=torch.long, device=dev)
        self.depths = torch.zeros(N, dtype=torch.long, device=dev)
        self.scores = torch.zeros(N, dtype=torch.float32, device=dev)
        self.anc = torch.zeros(N, N, dtype=torch.bool, device=dev)
        self.eye = torch.eye(N, dtype=torch.bool, device=dev)
        self.mask = torch.ones(settings.topk, kv.max_slots, dtype=torch.bool, device=dev)
        self.slot_idx = torch.arange(kv.max_slots, device=dev)
        self.root_parents = torch.zeros(settings.topk, dtype=torch.long, device=dev)
        self.log_threshold = math.log(settings.threshold) if settings.threshold > 0 else -math.inf
        self.sync_every = 1 if dev.type == "cpu" else 4
        self.depth_reached: list[int] = []
        self.policy: Optional[AdaptiveDepth] = None  # set by calibration when the depth is automatic
        self._drafted_depth = 0

    def committed(self, tokens: list[int]) -> None:
        if self.policy is not None and self._drafted_depth:
            self.policy.observe(len(tokens) - 1, self._drafted_depth)
            self.s.depth = self.policy.best()
        self._drafted_depth = 0

    def reset(self) -> None:
        self._drafted_depth = 0

    def _logp(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float() / self.s.draft_temperature, dim=-1)

    def propose(self, root: torch.Tensor, L0: int) -> DraftTree:
        """Draft a tree under ``root`` [1] at position/slot ``L0``; returns the pruned tree to verify."""
        k, dec = self.s.topk, self.decoder
        pos = self.slot_idx[L0:L0 + 1]
        logits = dec.forward(root, pos, pos, L0 + 1, None, self.layers, self.kv)
        self.tokens[0] = root[0]
        self.depths[0] = 0
        self.scores[0] = 0.0
        self.anc[0] = self.eye[0]
        vals, toks = torch.topk(self._logp(logits)[0], k)
        par = self.root_parents  # the first frontier hangs under the root
        n = 1
        depth = 0
        self.mask[:, :L0] = True  # every tree node sees the whole committed prefix
        for d in range(1, self.s.depth + 1):
            idx = self.slot_idx[n:n + k]
            self.tokens[n:n + k] = toks
            self.parents[n:n + k] = par
            self.depths[n:n + k] = d
            self.scores[n:n + k] = vals
            self.anc[n:n + k] = self.anc[par] | self.eye[n:n + k]
            n += k
            depth = d
            if d == self.s.depth:
                break
            if d % self.sync_every == 0 and vals.max().item() < self.log_threshold:
                break
            mask = self.mask[:, :L0 + n]
            mask[:, L0:] = self.anc[n - k:n, :n]
            logits = dec.forward(self.tokens[n - k:n], self.slot_idx[L0 + d].expand(k), L0 + idx, L0 + n, mask,
                                 self.layers, self.kv)
            cand = self._logp(logits) + vals[:, None]  # [k, V] cumulative log-probabilities
            vals, flat = torch.topk(cand.view(-1), k)
            V = cand.shape[1]
            par = idx[flat // V]
            toks = flat % V
        self.depth_reached.append(depth)
        self._drafted_depth = depth
        return self._prune(n)

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


def build_proposer(opts, settings: TreeSettings, source, decoder: Decoder, resident: dict[int, Linears],
                   placement: Placement, kv: KVCache):
    """The SubSpec draft for a loaded model: substitutes of the offloaded layers + the shared resident layers."""
    from .quant import load_substitutes

    subs = load_substitutes(source, placement.offloaded, SubstituteSpec(opts.bits, opts.group_size),
                            decoder.dtype, decoder.device, dense=opts.dense_substitutes)
    draft = SubSpecDraft(decoder, ResidentLayers(resident, SubstituteLayers(subs)), kv, settings)
    return draft, draft


@dataclass
class Calibration:
    """Measured costs on this machine (seconds): one draft step over k tokens, target forwards over n tokens."""

    t_draft_step: float
    t_verify: dict[int, float]

    def choose(self, s: TreeSettings, depth_given: bool, budget_given: bool) -> TreeSettings:
        """Pick the verify budget and depth from the measured costs.

        Verify budget: the largest n in :data:`AUTO_BUDGETS` whose forward costs at most 1.25x a one-token forward
        (tokens that ride along with the streamed weights almost for free). Depth: drafting may take about half of
        a verify forward, ``D = t_verify(n) / (2 t_draft_step)``, clamped to [4, 48]; early stopping at
        ``threshold`` makes the used depth adaptive below that.
        """
        if not budget_given:
            t1 = self.t_verify[1]
            fits = [n for n in AUTO_BUDGETS if self.t_verify[n] <= 1.25 * t1]
            s.verify_budget = max(fits) if fits else AUTO_BUDGETS[0]
        if not depth_given:
            s.depth = AdaptiveDepth(self.t_draft_step, self.t_verify[s.verify_budget]).best()
        return s


class AdaptiveDepth:
    """Chooses the draft depth each round from measured costs and the acceptance observed so far.

    Model: each drafted token is accepted with probability ``a`` given its parent was (geometric run), so a round
    of depth D emits ``E(D) = 1 + a + ... + a^D`` tokens on average and costs ``D * t_step + t_verify``; the depth
    maximizing ``E(D) / cost(D)`` is used. ``a`` is the censored-geometric estimate
    ``accepted / (accepted + rounds that stopped before their depth)``, started from a prior of 9 accepted, 1 miss.
    """

    def __init__(self, t_step: float, t_verify: float, max_depth: int = AUTO_MAX_DEPTH):
        self.t_step, self.t_verify, self.max_depth = t_step, t_verify, max_depth
        self.hits, self.misses = 9.0, 1.0

    def observe(self, accepted: int, depth: int) -> None:
        """Record a round: ``accepted`` draft tokens kept out of a tree drafted to ``depth``."""
        self.hits += accepted
        self.misses += accepted < depth

    def best(self) -> int:
        a = self.hits / (self.hits + self.misses)
        best_d, best_rate, expected = 1, 0.0, 1.0
        for d in range(1, self.max_depth + 1):
            expected += a ** d
            rate = expected / (d * self.t_step + self.t_verify)
            if rate > best_rate:
                best_d, best_rate = d, rate
        return best_d


def _best_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs (interference from other processes only ever adds time)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def calibrate(engine, draft: SubSpecDraft, key: str) -> Calibration:
    """Measure one draft step and target forwards of 1..128 tokens (through the real offload tier); cached by ``key``.

    Uses the scratch of an empty conversation: call before any request (the engine is reset afterwards).
    """
    path = cache_root() / "calibration.json"
    try:
        table = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        table = {}
    if key in table:
        c = table[key]
        return Calibration(c["t_draft_step"], {int(n): t for n, t in c["t_verify"].items()})
    dec, kv, k = engine.decoder, engine.kv, draft.s.topk
    idx = torch.arange(kv.max_slots, device=dec.device)
    tokens = torch.zeros(kv.max_slots, dtype=torch.long, device=dec.device)
    ctx = 64
    mask = torch.ones(k, ctx + k, dtype=torch.bool, device=dec.device)

    def draft_step():
        dec.forward(tokens[:k], idx[ctx:ctx + k], idx[ctx:ctx + k], ctx + k, mask, draft.layers, kv)

    def verify(n):
        m = torch.ones(n, ctx + n, dtype=torch.bool, device=dec.device)
        return lambda: dec.forward(tokens[:n], idx[ctx:ctx + n], idx[ctx:ctx + n], ctx + n, m, engine.layers, kv)

    draft_step()  # warm-up
    t_step = _best_time(draft_step, 5)
    t_verify = {n: _best_time(verify(n), 2) for n in (1,) + AUTO_BUDGETS}
    engine.reset()
    table[key] = {"t_draft_step": t_step, "t_verify": t_verify}
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1))
    return Calibration(t_step, t_verify)
