"""The tree policy: how deep and how wide to draft and how many nodes to verify, from this machine's measured costs.

:func:`calibrate` measures, once per model, placement, kernel tier and machine (cached in ``calibration.json``), a
draft step exactly as drafting runs it (the draft's own output head and its top-k expansion, k rows) and verify
forwards over trees of n nodes for the candidate verify budgets: a verify's cost grows with its tree where the
linears' compute is not hidden behind the offloaded layers' reading (a 2-core CPU without AMX: a 128-node verify of a
1.5B model is compute-bound). :class:`Calibration` picks the verify budget; :class:`AdaptiveDepth` picks each
round's depth with the cost model of :mod:`subspec.costmodel`, pricing a tree of depth D at the verify cost of the
nodes it can hold (``min(budget, top-k * D)``, the measured curve :class:`VerifyCurve`), follows the running
generation's measured costs and acceptance, and re-chooses the width (top-k) from the ranks of the accepted nodes.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import torch

from .cache import cache_root, read_json, write_json
from .costmodel import best_depth, best_time, round_rate
from .model import Attention
from .progress import bar as progress_bar, weigh
from .sampling import SamplingParams, TokenChooser
from .speculation import AUTO_BUDGETS, AUTO_MAX_DEPTH, TreeSettings


def candidate_budgets(settings: TreeSettings, budget_given: bool) -> list[int]:
    """Verify budgets calibration times: the one given, else those of :data:`AUTO_BUDGETS` the tree can fill."""
    if budget_given:
        return [settings.verify_budget]
    fit = [n for n in AUTO_BUDGETS if n <= settings.max_nodes - 1]
    return fit or [settings.max_nodes - 1]


class VerifyCurve:
    """Seconds of a verify forward by tree size: ``curve(n)`` for a tree of the root and n nodes, piecewise linear
    through measured points (``{n: seconds}``), extended beyond the last point along the last segment (flat below the
    first and for a single point; a plain number is a constant curve)."""

    def __init__(self, points: Union[Mapping[int, float], float]):
        items = sorted(points.items()) if isinstance(points, Mapping) else [(0, float(points))]
        self.n = [float(n) for n, _ in items]
        self.t = [float(t) for _, t in items]

    def __call__(self, nodes: float) -> float:
        n, t = self.n, self.t
        if len(n) == 1 or nodes <= n[0]:
            return t[0]
        i = min(max(bisect_left(n, nodes), 1), len(n) - 1)
        return t[i - 1] + (t[i] - t[i - 1]) * (nodes - n[i - 1]) / (n[i] - n[i - 1])


WIDTHS = (2, 3, 4, 6)
"""Frontier widths (top-k) calibration times a draft step at (those up to the tree's top-k)."""


def choose_width(budget: int, depth: int, widths: list[int]) -> int:
    """The frontier width for trees of ``depth`` pruned to ``budget`` nodes: the smallest of ``widths`` at least
    twice the nodes a depth keeps after pruning (``2 * budget / depth``, at least 2), else the largest. A draft step
    costs more with each row it drafts on CPUs without AMX, and a frontier much wider than what pruning keeps per
    depth drafts nodes that are thrown away (measured on qwen2.5-coder-1.5b, budget 16, depth ~15: tau the same at
    top-k 2, 4 and 6, the draft step 25 / 30 / 40 ms on the AVX2 tier)."""
    need = max(2, -(-2 * budget // max(depth, 1)))
    fit = [w for w in sorted(widths) if w >= need]
    return fit[0] if fit else max(widths)


@dataclass
class Calibration:
    """Measured costs on this machine (seconds): ``t_draft_steps[k]``: one draft step over k frontier tokens (the
    draft's head and expansion included; ``t_draft_step``: at the tree's top-k); ``t_verify[n]``: a target forward
    over a tree of the root and n nodes (n = 0: the root alone, i.e. one token); ``t_verify_compute[n]``: its compute,
    the forward's time less its time blocked on the offload tier (empty: not measured; equal to ``t_verify`` where
    nothing is offloaded, on CUDA's host tier, whose waits happen on the GPU, and for a mixture of experts, whose
    routed experts are read during the forward, more for a bigger tree, which no draft hides)."""

    t_draft_step: float
    t_verify: dict[int, float]
    t_draft_steps: dict[int, float] = field(default_factory=dict)
    t_verify_compute: dict[int, float] = field(default_factory=dict)

    def choose(self, s: TreeSettings, budgets: list[int], depth_given: bool, budget_given: bool,
               depth_capacity: int, topk_given: bool = True) -> TreeSettings:
        """Pick the verify budget, the width and the depth from the measured costs.

        Verify budget: the largest of ``budgets`` whose forward's compute costs at most 1.25x a one-token forward's
        (tokens that ride along with the weights almost for free), else the smallest. Compute, not wall time: the
        calibration's forwards run back to back and wait for the disk, which in generation reads the next verify's
        layers while the draft runs; their wall times flatten the curve (SmolLM2 at 300 MiB on an AMX machine: 99 ms
        for one token, 112 ms for 64 nodes, which in generation cost 125-147 ms against 77-84 ms for 16).
        Width (top-k, when not given): :meth:`width`, the narrowest frontier :func:`choose_width` asks for at the best
        depth of that width's own draft step.
        Depth: the best of :class:`AdaptiveDepth` for these costs, at most ``depth_capacity`` (what the draft's
        buffers hold).
        """
        if not budget_given:
            c = self.t_verify_compute if all(n in self.t_verify_compute for n in [0, *budgets]) else self.t_verify
            fits = [n for n in budgets if c[n] <= 1.25 * c[0]]
            s.verify_budget = max(fits) if fits else min(budgets)
        widths = [w for w in self.t_draft_steps if w <= s.topk]
        if not topk_given and widths:
            s.topk = self.width(s.verify_budget, depth_capacity, widths)
            self.t_draft_step = self.t_draft_steps[s.topk]
        if not depth_given:
            s.depth = self.policy(s, depth_capacity).best()
        return s

    def width(self, budget: int, depth_capacity: int, widths: list[int]) -> int:
        """The narrowest of ``widths`` that :func:`choose_width` asks for at the best depth of its own draft step
        (``t_draft_steps[w]``), else the widest. Judged at the widest frontier's step instead, the dearer step makes
        shallow trees look best and shallow trees ask for a wide frontier: on a Zen 3 (avx2) qwen2.5-coder-1.5b at
        2.5 GiB drafted 6 wide (64 ms a step) at a depth of 12, where the same tau came from narrower, cheaper steps."""
        for w in sorted(widths):
            deep = self._depth(self.t_draft_steps[w], budget, w, depth_capacity).best_drafting()
            if choose_width(budget, deep, widths) <= w:
                return w
        return max(widths)

    def policy(self, s: TreeSettings, depth_capacity: int, on_contradicted=None,
               adapt_width: bool = False) -> "AdaptiveDepth":
        """The :class:`AdaptiveDepth` for these costs and ``s``'s top-k and verify budget; with ``adapt_width``, it
        also chooses the width among the calibrated ones by the acceptance it observes."""
        steps = self.t_draft_steps if adapt_width else None
        return self._depth(self.t_draft_step, s.verify_budget, s.topk, depth_capacity, on_contradicted, steps)

    def _depth(self, t_step: float, budget: int, topk: int, depth_capacity: int,
               on_contradicted=None, steps: Optional[Mapping[int, float]] = None) -> "AdaptiveDepth":
        return AdaptiveDepth(t_step, self.t_verify, depth_capacity, on_contradicted=on_contradicted,
                             t_single=self.t_verify.get(0), budget=budget, topk=topk, steps=steps)


class AdaptiveDepth:
    """Chooses the draft depth (and, given several widths' draft steps, the frontier width) each round from measured
    costs and the acceptance observed so far.

    Model (:mod:`subspec.costmodel`): each drafted token is accepted with probability ``a`` given its parent was
    (geometric run), so a round of depth D emits ``E(D) = 1 + a + ... + a^D`` tokens on average and costs
    ``D * t_step + t_verify(D)`` (D draft forwards: the root's, then one per depth but the last; the verify forward
    over the tree's nodes, ``min(budget, topk * D)``, priced by the measured :class:`VerifyCurve`); the depth
    maximizing ``E(D) / cost(D)`` tokens per second is used. ``a`` is the censored-geometric estimate
    ``accepted / (accepted + rounds that stopped before their depth)``, started from a prior of 9 accepted, 1 miss.

    Depth 0 is plain decoding (no draft forward, a one-token target forward costing ``t_single``): chosen when no
    depth beats ``1 / t_single`` tokens per second, e.g. a model fully resident on a fast device, or a draft the
    target keeps rejecting. While at depth 0, one round in :attr:`PROBE_EVERY` drafts anyway at the best depth, so
    the acceptance estimate (and the choice) follows the text being generated.

    Width (``steps``: seconds of a draft step by frontier width): each depth of the tree keeps the k most probable
    nodes under the draft, in order, so the **rank** of each accepted node within its depth (0: the draft's first
    choice) says what a narrower frontier would have accepted: a run of ranks below w. Each round's ranks give every
    width w up to the round's its own acceptance estimate (the width's run, censored as above; an estimate: a w-wide
    draft keeps the same nodes wherever their parents were among its own); after :attr:`WIDTH_ROUNDS` rounds the
    width with the best predicted rate (its own step, its own tree size) is drafted, if it beats the current one by
    :attr:`WIDTH_MARGIN`. A width wider than the current one is only observed by a probe: one round in
    :attr:`PROBE_EVERY` at the next wider width (the next one's step costs least more, so the probes cost little:
    about 0.3 % of the time at 2 wide on the Zen 3 below, against 1.8 % for probes at 6; widening goes one width
    at a time). On a Zen 3 (avx2), qwen2.5-coder-1.5b at 2.5 GiB: the same tau at 2, 4 and 6 wide, the 2-wide step
    33 ms against 52 and 64: 3.70x over ar against 3.18x and 2.78x.

    The costs start from the calibration (the prior) and follow the running generation: each round's measured draft
    step, against the calibration's at the drafted width, moves a scale on every width's step (a machine slower than
    its calibration is slower at every width, so an undrafted width does not look cheap by comparison), and its
    verify time, against the curve's value at that tree's size, moves a scale on the whole curve, both by an
    exponential moving average (weight :attr:`RATE`). When, after
    :attr:`CONTRADICT_ROUNDS` rounds, either is off from the calibration by more than :attr:`CONTRADICT_RATIO` (the
    calibration ran on a busy machine, or the machine changed), ``on_contradicted`` is called once, so the cached
    calibration is dropped and the next start measures again.

    Args:
        t_step: seconds of one draft step (k rows). t_verify: seconds of a verify forward, by tree size (``{nodes:
            seconds}``, see :class:`VerifyCurve`) or one number for every tree. max_depth: deepest tree.
        on_contradicted: called with (t_step, t_verify at the budget) as measured when the calibration is
            contradicted.
        t_single: seconds of a one-token target forward; None = never choose depth 0.
        budget: verified nodes at most (None: a tree is always priced at ``t_verify``'s largest point). topk: nodes a
            depth adds (with ``budget``: a depth-D tree holds ``min(budget, topk * D)`` nodes).
        steps: ``{width: seconds of a draft step}`` the width may be chosen among (with ``topk``; None: ``topk``
            only). Widths must fit the draft's buffers.
    """

    RATE = 0.25
    CONTRADICT_ROUNDS = 8
    CONTRADICT_RATIO = 2.0
    PROBE_EVERY = 16
    WIDTH_ROUNDS = 8
    WIDTH_MARGIN = 1.03

    def __init__(self, t_step: float, t_verify: Union[Mapping[int, float], float], max_depth: int = AUTO_MAX_DEPTH,
                 on_contradicted=None, t_single: Optional[float] = None, budget: Optional[int] = None,
                 topk: Optional[int] = None, steps: Optional[Mapping[int, float]] = None):
        self.curve = VerifyCurve(t_verify)
        self.max_depth = max_depth
        self.budget = int(budget) if budget is not None else int(self.curve.n[-1])
        self.topk = topk
        self.prior_steps = {int(w): float(t) for w, t in (steps or {}).items()} if topk else {}
        self.prior_steps[topk] = float(t_step)  # (key None: one width, not named)
        self.step_scale = 1.0  # measured draft step / the calibration's (at the drafted width), followed by EMA
        self.counts = {w: [9.0, 1.0] for w in self.prior_steps}  # accepted, misses: the prior, then the observed
        self.observed = dict.fromkeys(self.prior_steps, 0)  # rounds that informed each width
        self.width_rounds = 0  # rounds whose width was chosen (every PROBE_EVERY-th drafts the next wider width)
        self.probing = self.probing_from = None  # the width of a probe round and the width it left
        self.scale = 1.0  # measured verify seconds / the curve's, followed by EMA
        self.t_single = t_single
        self.rounds = 0
        self.plain_rounds = 0  # consecutive rounds at depth 0
        self.on_contradicted = on_contradicted

    @property
    def steps(self) -> dict:
        """Seconds of a draft step by width: the calibration's, times the scale the drafted widths measured."""
        return {w: t * self.step_scale for w, t in self.prior_steps.items()}

    @property
    def t_step(self) -> float:
        """Seconds of a draft step at the current width."""
        return self.prior_steps[self.topk] * self.step_scale

    @property
    def acceptance(self) -> float:
        """The estimated probability ``a`` that a drafted token is accepted given its parent was (current width)."""
        return self.acceptance_at(self.topk)

    def acceptance_at(self, width: Optional[int]) -> float:
        """The estimated acceptance ``a`` of a ``width``-wide frontier (one of ``steps``)."""
        hits, misses = self.counts[width]
        return hits / (hits + misses)

    def nodes(self, depth: int, width: Optional[int] = None) -> int:
        """Nodes (beyond the root) a tree of ``depth`` holds at most (at ``width``; None: the current one)."""
        k = self.topk if width is None else width
        return min(self.budget, k * depth) if k else self.budget

    def t_verify(self, depth: Optional[int] = None, width: Optional[int] = None) -> float:
        """Predicted seconds of the verify forward of a tree of ``depth`` (None: a full budget) and ``width``."""
        return self.scale * self.curve(self.budget if depth is None else self.nodes(depth, width))

    def observe(self, accepted: int, depth: int, ranks: Optional[list[int]] = None, complete: bool = True) -> None:
        """Record a round: ``accepted`` draft tokens kept out of a tree drafted to ``depth``; ``ranks``: the rank
        of each accepted node within its depth (see the class docstring; None: the current width only).
        ``complete`` False: the round's tokens were cut (an EOS, the token limit) before its run ended, so the run is
        censored there: ``accepted`` counts, no miss (a narrower width still misses at a rank it cannot hold)."""
        k = self.topk
        for w in self.prior_steps:
            if ranks is None or w is None or w == k:
                run = accepted if w == k else None
            elif w < k:
                run = next((i for i, r in enumerate(ranks) if r >= w), len(ranks))
            else:
                run = None  # a wider frontier than drafted: not observed
            if run is not None:
                self.counts[w][0] += run
                self.counts[w][1] += run < depth and (complete or run < accepted)
                self.observed[w] += 1

    def observe_costs(self, t_step: float, t_verify: float, nodes: Optional[int] = None) -> None:
        """Record a round's measured seconds per draft step and of its verify forward over ``nodes`` tree nodes
        (None: a full budget) (see the class docstring)."""
        r = self.RATE
        self.step_scale += r * (t_step / self.prior_steps[self.topk] - self.step_scale)
        expected = self.curve(self.budget if nodes is None else nodes)
        self.scale += r * (t_verify / max(expected, 1e-9) - self.scale)
        self.rounds += 1
        self.plain_rounds = 0
        if self.on_contradicted is not None and self.rounds >= self.CONTRADICT_ROUNDS:
            off = max(_ratio(self.step_scale, 1.0), _ratio(self.scale, 1.0))
            if off > self.CONTRADICT_RATIO:
                callback, self.on_contradicted = self.on_contradicted, None
                callback(self.t_step, self.t_verify())

    def observe_single(self, t: float) -> None:
        """Record the seconds of a round without drafting (a one-token target forward)."""
        if self.t_single is not None:
            self.t_single += self.RATE * (t - self.t_single)
        self.plain_rounds += 1

    def rate(self, depth: int) -> float:
        """Predicted tokens per second at ``depth`` (0: plain decoding)."""
        if depth == 0:
            return 1.0 / self.t_single if self.t_single else 0.0
        return round_rate(self.acceptance, depth, self.t_step, self.t_verify(depth))

    def best_at(self, width: Optional[int]) -> tuple[int, float]:
        """(depth >= 1, predicted tokens per second) of the best tree ``width`` wide."""
        return best_depth(self.acceptance_at(width), self.prior_steps[width] * self.step_scale,
                          lambda d: self.t_verify(d, width),
                          self.max_depth)

    def best_drafting(self) -> int:
        """The depth >= 1 with the highest predicted tokens per second."""
        return self.best_at(self.topk)[0]

    def best(self) -> int:
        """The depth (>= 0) with the highest predicted tokens per second."""
        d = self.best_drafting()
        return 0 if self.t_single is not None and self.rate(0) > self.rate(d) else d

    def next_width(self) -> Optional[int]:
        """The width of the next round (see the class docstring); sets :attr:`topk`."""
        if len(self.prior_steps) < 2:
            return self.topk
        if self.plain_rounds:  # a round without drafting (depth 0) says nothing of widths, and is no probe's turn
            return self.topk
        self.width_rounds += 1
        if self.topk == self.probing:  # back from a probe: to the width it left
            self.topk, self.probing = self.probing_from, None
        rates = {w: self.best_at(w)[1] for w in self.prior_steps if self.observed[w] >= self.WIDTH_ROUNDS}
        if rates:
            w = max(rates, key=rates.get)
            if self.topk not in rates or rates[w] > self.WIDTH_MARGIN * rates[self.topk]:
                self.topk = w
        wider = [w for w in self.prior_steps if w > self.topk]
        if wider and self.width_rounds % self.PROBE_EVERY == 0:
            self.probing, self.probing_from, self.topk = min(wider), self.topk, min(wider)
        return self.topk

    def next_depth(self) -> int:
        """The depth of the next round: :meth:`best`, except that every :attr:`PROBE_EVERY`-th round at depth 0, and
        a width's probe round, drafts at :meth:`best_drafting` (to re-measure the acceptance)."""
        d = self.best()
        if d == 0 and (self.plain_rounds >= self.PROBE_EVERY or self.probing is not None):
            return self.best_drafting()
        return d


def _settle(engine, quiet: float = 0.2, limit: float = 10.0) -> None:
    """Wait (at most ``limit`` seconds) until the offload tier's disk has read nothing for ``quiet`` seconds: its
    first read-ahead fills every staging slot at the start, and the checking of each layer it reads runs on the same
    cores as a draft step timed meanwhile."""
    busy = getattr(getattr(engine, "tier", None), "busy_seconds", None)
    if busy is None:
        return
    end = time.perf_counter() + limit
    last, since = busy(), time.perf_counter()
    while time.perf_counter() < end:
        time.sleep(quiet / 4)
        now = busy()
        if now != last:
            last, since = now, time.perf_counter()
        elif time.perf_counter() - since >= quiet:
            return


def _ratio(a: float, b: float) -> float:
    """How far apart two positive costs are, as a factor >= 1."""
    return max(a, b) / max(min(a, b), 1e-9)


CALIBRATION_VERSION = 7  # 3: the draft step with the draft's own head and expansion; 4: by width; 5: verify compute;
# 6: the disk tier's staging slots in huge pages (its reads faster: verifies wait less; subspec/hostmem.py);
# 7: the widths timed in turn once the first read-ahead is done (timed one after the other, the first were slow)


def calibrated(prefix: str) -> bool:
    """Whether ``calibration.json`` holds a calibration whose key (after its version) starts with ``prefix``."""
    head = f"v{CALIBRATION_VERSION}|{prefix}"
    return any(k.startswith(head) for k in read_json(cache_root() / "calibration.json") or {})


def forget_calibration(key: str) -> None:
    """Drop the cached calibration of ``key`` (the running generation contradicted it): the next start measures
    again instead of sizing its trees from a stale or disturbed measurement."""
    path = cache_root() / "calibration.json"
    table = read_json(path) or {}
    if table.pop(f"v{CALIBRATION_VERSION}|{key}", None) is not None:
        write_json(path, table)


def calibrate(engine, draft, key: str, budgets: list[int]) -> Calibration:
    """Measure one draft step and target forwards over root + n nodes for n in ``budgets`` and 0 (through the real
    offload tier); cached by ``key`` in ``calibration.json`` (missing budgets are measured and added).

    The draft step is the one :meth:`~subspec.speculation.SubSpecDraft.propose` runs at each depth: a forward of k
    frontier tokens through the draft's layers and its own output head (:class:`~subspec.speculation.DraftHead`: a
    vocabulary subset, often a 4-bit copy, far fewer bytes than the lm_head), then the top-k expansion. The measured
    forwards write only scratch slots the cache has (a short fake prefix, then the tree). Uses the scratch of an empty
    conversation: call before any request (the engine is reset afterwards).

    Args:
        engine: the :class:`~subspec.engine.Engine` (target decoder, layers with the offload tier, KV cache).
        draft: the :class:`~subspec.speculation.SubSpecDraft`. key: the cache key (model, placement, kernels,
            machine). budgets: verify budgets (nodes) to time.
    """
    path = cache_root() / "calibration.json"
    key = f"v{CALIBRATION_VERSION}|{key}"
    entry = (read_json(path) or {}).get(key) or {}
    kmax = draft.s.topk
    widths = sorted({w for w in WIDTHS if w < kmax} | {kmax})
    try:
        steps = {int(w): float(t) for w, t in entry.get("t_draft_steps", {}).items()}
        t_verify = {int(n): float(t) for n, t in entry.get("t_verify", {}).items()}
        t_compute = {int(n): float(t) for n, t in entry.get("t_verify_compute", {}).items()}
    except (TypeError, ValueError, AttributeError):
        steps, t_verify, t_compute = {}, {}, {}
    need = [n for n in [0, *budgets] if n not in t_verify or n not in t_compute]
    need_widths = [w for w in widths if w not in steps]
    if not need and not need_widths:
        return Calibration(steps[kmax], t_verify, {w: steps[w] for w in widths}, t_compute)
    dec, kv = engine.decoder, engine.kv
    longest = max([n + 1 for n in need] + [kmax])
    ctx = max(0, min(64, kv.max_slots - longest))  # a prefix that leaves room for the longest measured tree
    idx = torch.arange(kv.max_slots, device=dec.device)
    # a mixture of experts: distinct tokens (a fixed scatter over the vocabulary), routed as a real tree's, so the
    # measured verify reads the experts a tree of that size touches; a dense model keeps token 0, as it always had
    tokens = torch.arange(longest, device=dec.device) * (7919 if dec.routers is not None else 0) % dec.lm_head.shape[0]
    scores = torch.zeros(kmax, dtype=torch.float32, device=dec.device)

    def draft_step(k):
        step_attn = Attention.tree(ctx, torch.ones(k, k, dtype=torch.bool, device=dec.device).tril())

        def step():
            logits = dec.forward(tokens[:k], idx[ctx:ctx + k], idx[ctx:ctx + k], step_attn, draft.layers, kv,
                                 head=draft.head)
            draft._expand(logits, scores[:k], k)
        return step

    blocked = (lambda: 0.0) if dec.routers is not None else (lambda: engine.tier_counters()[1])

    def verify(n):
        a = Attention.tree(ctx, torch.ones(n, n, dtype=torch.bool, device=dec.device).tril())
        head = engine.choosing_head(TokenChooser(SamplingParams(), dec.device), ctx + 1, idx[:n])  # a greedy verify's
        computed = []  # each call's seconds less its seconds blocked on the offload tier (all of them for an MoE)

        def forward():
            w0, t0 = blocked(), time.perf_counter()
            dec.forward(tokens[:n], idx[ctx:ctx + n], idx[ctx:ctx + n], a, engine.layers, kv, head=head)
            if dec.device.type == "cuda":
                torch.cuda.synchronize(dec.device)
            computed.append(time.perf_counter() - t0 - (blocked() - w0))
        return forward, computed

    bar = progress_bar("calibration", total=len(need_widths) + len(need), unit="cost",
                       desc="calibrating draft and verify costs (one time)")
    spent: list[float] = []  # seconds each measurement took

    def measured(t0: float) -> None:
        spent.append(time.perf_counter() - t0)
        if len(spent) > len(need_widths):  # a verify is measured: the ones to come are priced at the last one
            weigh(bar, spent + [spent[-1]] * (len(need_widths) + len(need) - len(spent)))
        bar.update(1)

    try:
        _settle(engine)
        # the widths in turn, 5 rounds after a warm-up one, each the fastest of its 5: a width timed while something
        # else ran (the disk tier's first read-ahead, checked and indexed on these cores) is timed again later; one
        # width after the other, the first ones were (qwen2.5-coder-1.5b on a Zen 3: 114 and 117 ms for a 2- and a
        # 3-wide step, 52 ms for a 4-wide one)
        calls = {w: draft_step(w) for w in need_widths}
        for w in need_widths:
            calls[w]()  # warm-up
        times: dict[int, list[float]] = {w: [] for w in need_widths}
        for _ in range(5):
            for w in need_widths:
                times[w].append(best_time(calls[w], 1, dec.device))
        for w in need_widths:
            steps[w] = min(times[w])
            measured(time.perf_counter() - sum(times[w]))  # (the bar: each width's seconds, its warm-up aside)
        for n in need:
            t0 = time.perf_counter()
            forward, computed = verify(n + 1)
            t_verify[n] = best_time(forward, 2, dec.device, enough=1.0)
            t_compute[n] = max(0.0, min(computed))
            measured(t0)
    finally:
        bar.close()
        engine.reset()
    table = read_json(path) or {}  # re-read: another process may have added entries meanwhile
    table[key] = {"t_draft_steps": steps, "t_verify": t_verify, "t_verify_compute": t_compute}
    write_json(path, table)
    return Calibration(steps[kmax], t_verify, {w: steps[w] for w in widths}, t_compute)
