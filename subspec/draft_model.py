"""Classic speculative decoding with a separate small draft model ("draft-model"), through the same verifier.

The draft model (same tokenizer, e.g. Qwen2.5-Coder-0.5B for 1.5B) is fully resident with its own KV cache. Before
each round it catches up on the tokens committed since its last round, then drafts a top-k tree exactly as SubSpec
does (same :class:`~subspec.speculation.SubSpecDraft` search, on its own model and cache).
"""
from __future__ import annotations

import torch

from .model import Attention, Decoder, ResidentLayers, load_linears
from .speculation import SubSpecDraft, TreeSettings
from .tree import DraftTree


class DraftModel:
    """A resident small model as the proposer.

    Args:
        source: the draft checkpoint (:class:`~subspec.loading.ModelSource`). settings: tree shape.
        max_slots: context + tree scratch (as the target's cache). dtype, device.

    Raises:
        SubspecError: (from loading) a bad draft path.
    """

    def __init__(self, source, settings: TreeSettings, max_slots: int, dtype, device):
        dec = Decoder.from_source(source, dtype, device)
        layers = ResidentLayers({i: load_linears(source, i, dtype, device) for i in range(dec.n_layers)})
        self.kv = dec.new_kv_cache(max_slots)
        self.search = SubSpecDraft(dec, layers, self.kv, settings)
        self.max_nodes = self.search.max_nodes
        self.history: list[int] = []
        self.cached = 0  # tokens of history whose K/V the draft cache holds

    def committed(self, tokens: list[int], cut: bool = False) -> None:
        self.history.extend(tokens)

    def reset(self) -> None:
        self.history, self.cached = [], 0

    def propose(self, root: torch.Tensor, cache_len: int) -> DraftTree:
        """Catch up on history[cached:cache_len], then draft under ``root`` at ``cache_len``."""
        dec = self.search.decoder
        if cache_len < self.cached:  # the conversation was cut back (EOS / limit): recompute from there
            self.cached = cache_len
        if cache_len > self.cached:
            n, start = cache_len - self.cached, self.cached
            ids = torch.tensor(self.history[start:cache_len], dtype=torch.long, device=dec.device)
            pos = torch.arange(start, cache_len, device=dec.device)
            dec.forward(ids, pos, pos, Attention.run(start), self.search.layers, self.kv, logits_rows=slice(n - 1, n))
            self.cached = cache_len
        return self.search.propose(root, cache_len)
