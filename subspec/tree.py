"""The draft tree of one round and the acceptance walk over it.

Vocabulary (used throughout): node 0 is the **root** — the last emitted token, whose K/V is not in the cache yet,
at position ``L0`` (the committed length). Nodes are numbered in depth order; node n sits at cache slot
``L0 + n`` and position ``L0 + depth[n]``. After the target's **verify** forward over all nodes, the target's own
choice at each node is known; walking from the root, a child whose token equals the target's choice at its
parent is an **accepted token**; the target's choice at the deepest accepted node is the **bonus token**, which
becomes the next root. Every emitted token is thus the target's choice given its accepted prefix (lossless).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A token tree in depth order.

    Attributes:
        tokens: [N] int64; tokens[0] is the root.
        parents: [N] int64 parent node of each node (root: 0, ignored).
        depths: [N] int64 (root: 0).
        ancestors: [N, N] bool; ancestors[i, j] is True when j is i or an ancestor of i (the tree attention
            mask among the nodes).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def chain(tokens: torch.Tensor) -> "DraftTree":
        """A linear tree: root followed by a chain. tokens: [N] (tokens[0] = root)."""
        n, dev = tokens.shape[0], tokens.device
        idx = torch.arange(n, device=dev)
        return DraftTree(tokens, (idx - 1).clamp(min=0), idx, idx[None, :] <= idx[:, None])


def accept(tree: DraftTree, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the tree with the target's choices, on the device, without a host sync.

    Args:
        tree: the verified tree (N nodes).
        choice: [N] int64, the target's token at each node (argmax or a sample of its processed distribution).

    Returns:
        (path, bonus): ``path`` [N] bool marking the accepted path (root included; siblings carry distinct tokens,
        so at most one path matches); ``bonus`` [1] int64, the target's choice at the deepest accepted node.
    """
    match = tree.tokens == choice[tree.parents]
    match[0] = True
    ok = ~(tree.ancestors & ~match[None, :]).any(1)
    deepest = torch.argmax(torch.where(ok, tree.depths, -1))
    return tree.ancestors[deepest], choice[deepest].view(1)
