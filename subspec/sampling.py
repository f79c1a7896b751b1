"""Turning target logits into token choices: greedy, or sampling with temperature / top-k / top-p.

Only the **target's** logits go through here (design.md §3.5): the verifier draws the target's own token at every
tree node, so the output distribution is the target's whatever the draft proposed.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import SubspecError


@dataclass
class SamplingParams:
    """How tokens are chosen and when generation stops.

    Attributes:
        temperature: 0 = greedy (argmax); > 0 = sample from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = all).
        seed: seed of the random draws (None = nondeterministic). The same seed gives the same tokens whatever the
            method and tree shape (the draws are indexed by output position, see :class:`TokenChooser`).
        max_new_tokens: the most tokens to generate (>= 1).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    max_new_tokens: int = 128

    def validate(self) -> "SamplingParams":
        """Raise :class:`SubspecError` naming the bad value; return self."""
        if not self.temperature >= 0:
            raise SubspecError(f"--temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise SubspecError(f"--top-p (top_p) must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise SubspecError(f"--top-k (top_k) must be >= 0 (got {self.top_k}); 0 disables it")
        if self.max_new_tokens < 1:
            raise SubspecError(f"--max-new-tokens (max_tokens) must be >= 1 (got {self.max_new_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The processed target distribution: softmax(logits / T) restricted to top-k then top-p, renormalized.

    Args:
        logits: [N, V] (any float dtype). Returns: [N, V] float32 probabilities.
    """
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= p.top_p                      # the top token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


SAMPLING_ROWS = 2
"""Rows of logits processed at once when sampling (bounds the top-k / top-p workspace, which the placement reserves:
every row fewer leaves ``V * SAMPLING_BYTES_PER_LOGIT`` bytes to staging slots or resident layers, 1.9 MiB at SmolLM2's
vocabulary and 5.8 MiB at Qwen2.5's). Two rows cost no more than eight: 33 sampled rows with top-p 0.9 took 68 / 64
ms at 49,152 entries and 213 / 289 ms at 151,936 (2 / 8 rows at a time, 2 threads, AMD EPYC Zen 4); each row's
result is its own, so the rows at a time change no token."""
SAMPLING_BYTES_PER_LOGIT = 40
"""Workspace of :func:`target_probs` per row and vocabulary entry: float32 logits, probabilities, sorted values, int64
sort indices, cumulative sums and masks (measured: 31 bytes at 64 x 152064 with top-k and top-p)."""


UNIFORM_BLOCK = 1024
"""Output positions whose uniforms one seeded generator makes at once (:meth:`TokenChooser._cover`)."""


def _block_seed(seed: int, block: int) -> int:
    """The seed of block ``block`` of a request seeded with ``seed`` (any int): 64 bits of a hash of both."""
    digest = hashlib.blake2b(f"subspec-sampling|{seed}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class TokenChooser:
    """The verifier's choice rule: the target's token at each of N positions.

    Greedy = argmax. Sampling = inverse-CDF sampling of :func:`target_probs` with one uniform per **output
    position**: the token that will sit at absolute position p of the conversation is drawn with the uniform u[p], a
    function of the seed and p alone (blocks of :data:`UNIFORM_BLOCK` positions, each from a generator seeded with a
    hash of (seed, block)). Every tree node of depth d in a round at committed length L0 chooses the token of
    position L0 + 1 + d, so sibling nodes share u[L0 + 1 + d]; sample-and-match then emits at each position exactly
    the sample plain decoding draws there (the same seed gives the same text whatever the tree shape), and the
    output distribution stays the target's: the path accepted up to position p depends only on u[< p], so u[p] is a
    fresh uniform for the token emitted at p.
    """

    def __init__(self, params: SamplingParams, device):
        self.params = params
        self.device = torch.device(device)
        self.seed: Optional[int] = None
        if not params.greedy:
            self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._u = torch.empty(0, dtype=torch.float64, device=self.device)  # u[p] for p in [_base, _base + len)
        self._base = 0

    def _cover(self, start: int, end: int) -> None:
        """Make u[p] available for every position ``start <= p < end`` (host work once per :data:`UNIFORM_BLOCK`
        positions: a CPU generator per block, one copy to the device)."""
        have_from, have_to = self._base, self._base + self._u.numel()
        if have_from <= start and end <= have_to:
            return
        lo = (min(start, have_from) if self._u.numel() else start) // UNIFORM_BLOCK
        hi = (max(end, have_to) + UNIFORM_BLOCK - 1) // UNIFORM_BLOCK
        blocks = []
        for b in range(lo, hi):
            g = torch.Generator().manual_seed(_block_seed(self.seed, b))
            blocks.append(torch.rand(UNIFORM_BLOCK, generator=g, dtype=torch.float64))
        self._base, self._u = lo * UNIFORM_BLOCK, torch.cat(blocks).to(self.device)

    def __call__(self, logits: torch.Tensor, first: int, depths: Optional[torch.Tensor] = None,
                 span: Optional[int] = None) -> torch.Tensor:
        """logits [N, V] -> tokens [N] int64 (on the logits' device; no host sync).

        Args:
            logits: [N, V] the target's logits at N nodes.
            first: the absolute output position (host int) of the token the shallowest node chooses.
            depths: [N] int64 on the logits' device, each node's depth below that node (a node of depth d chooses
                the token of position ``first + d``; each d < ``span``); None: ``0 .. N-1``.
            span: positions the depths may reach (default N; a chunk of a larger tree's nodes passes the tree's size).

        Sampling works on :data:`SAMPLING_ROWS` rows at a time, so its workspace (about :data:`SAMPLING_BYTES_PER_LOGIT`
        bytes per row and vocabulary entry) stays within what the placement reserves whatever the tree size.
        """
        if self.seed is None:
            return logits.argmax(-1)
        n = logits.shape[0]
        span = n if span is None else span
        self._cover(first, first + span)
        lo = first - self._base
        u = self._u[lo:lo + n] if depths is None else self._u[lo:lo + span][depths]
        return torch.cat([_inverse_cdf(target_probs(logits[r:r + SAMPLING_ROWS], self.params), u[r:r + SAMPLING_ROWS])
                          for r in range(0, n, SAMPLING_ROWS)])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (rows summing to about 1), u [R] uniforms in [0, 1) -> tokens [R] int64: the first token whose
    cumulative probability exceeds ``u`` x the row's total (a token of probability 0 is never chosen)."""
    cdf = probs.to(torch.float64).cumsum_(-1)
    x = (u[:, None] * cdf[:, -1:]).contiguous()
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
