"""Prompt-lookup drafting ("ngram"): a training-free peer proposer for the same tree verifier.

The draft is a chain copied from the conversation itself: find the most recent earlier occurrence of the last
``n`` tokens (n from ``max_ngram`` down to 1) and propose the tokens that followed it (Saxena 2023, "prompt
lookup decoding"). No model runs; the target verifies the chain like any tree.
"""
from __future__ import annotations

import torch

from .tree import DraftTree


class NgramLookup:
    """Proposes up to ``length`` tokens by n-gram lookup in the history (prompt + emitted tokens).

    Args:
        length: longest chain proposed (tokens after the root). max_ngram: longest suffix matched. device.
    """

    def __init__(self, length: int = 16, max_ngram: int = 3, device="cpu"):
        self.length, self.max_ngram, self.device = length, max_ngram, torch.device(device)
        self.max_nodes = length + 1
        self.history: list[int] = []

    def committed(self, tokens: list[int], cut: bool = False) -> None:
        self.history.extend(tokens)

    def reset(self) -> None:
        self.history = []

    def lookup(self) -> list[int]:
        """The continuation after the latest earlier match of the history's suffix (empty if none)."""
        h = self.history
        for n in range(min(self.max_ngram, len(h) - 1), 0, -1):
            suffix = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):
                if h[start:start + n] == suffix:
                    return h[start + n:start + n + self.length]
        return []

    def propose(self, root: torch.Tensor, cache_len: int) -> DraftTree:
        """The chain ``root`` [1] (the last emitted token, the end of the history) + :meth:`lookup`'s continuation."""
        cont = torch.tensor(self.lookup(), dtype=torch.long, device=self.device)
        return DraftTree.chain(torch.cat((root.to(self.device, torch.long), cont)))
