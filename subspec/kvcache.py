"""The static KV cache shared by the target and the draft.

One preallocated buffer for all layers, ``[n_layers, 2, kv_heads, max_slots, head_dim]`` (batch 1), written by
slot index. Slots ``0..L0-1`` hold the committed prefix; slots from ``L0`` on are scratch for the round in
flight (the root and the draft tree). :meth:`KVCache.commit` moves the K/V of the accepted tree nodes to
contiguous positions in place, for every layer at once, without touching the rest of the cache.
"""
from __future__ import annotations

import torch


class KVCache:
    """Static K/V storage addressed by cache slot.

    Args:
        n_layers: decoder layers.
        kv_heads: key/value heads (grouped-query attention).
        head_dim: per-head size.
        max_slots: max context + tree scratch, in tokens.
        dtype, device: storage dtype and device.
    """

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, max_slots: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.max_slots = max_slots
        self.buf = torch.zeros(n_layers, 2, kv_heads, max_slots, head_dim, dtype=dtype, device=device)

    @staticmethod
    def nbytes_for(n_layers: int, kv_heads: int, head_dim: int, max_slots: int, elem_bytes: int) -> int:
        """Bytes the cache occupies (for placement)."""
        return n_layers * 2 * kv_heads * max_slots * head_dim * elem_bytes

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of layer ``i``: views [kv_heads, max_slots, head_dim]."""
        return self.buf[i, 0], self.buf[i, 1]

    def commit(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Copy the K/V at ``src_slots`` ([n] int64, on the cache's device) to slots ``dst_start..dst_start+n-1``.

        All layers in one gather/scatter; the source is gathered first, so overlapping ranges are safe.
        """
        n = src_slots.numel()
        if n == 0:
            return
        self.buf[:, :, :, dst_start:dst_start + n] = self.buf.index_select(3, src_slots)
