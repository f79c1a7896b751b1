"""Embedding tables kept off the device, rows read on demand (the embedding table goes with the offloaded weights).

A forward reads only the embedding rows of its own tokens (one to a few hundred), yet an untied table is as large as
the lm_head (Qwen2.5-1.5B: 445 MiB, 18 % of a 2.5 GiB budget). :class:`EmbeddingRows` leaves it where the offloaded
layers live and gives that memory to layers: on a CPU the rows are read from the checkpoint file with ``pread``
(through the page cache, which keeps the frequent tokens in RAM); with CUDA compute the table stays in host RAM and
only the gathered rows are copied to the device.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch


class EmbeddingRows:
    """An embedding table [vocab, hidden] that is not on the device; ``rows[tokens]`` gathers rows on demand.

    Args:
        path: the safetensors file holding the table. offset: byte offset of its data in the file.
        stored: its dtype in the file. shape: (vocab, hidden). dtype: compute dtype. device: compute device.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: Path, offset: int, stored: torch.dtype, shape: tuple[int, int], dtype: torch.dtype,
                 device):
        self.path, self.offset, self.stored, self.shape = Path(path), offset, stored, tuple(shape)
        self.dtype, self.device = dtype, torch.device(device)
        self.row_bytes = shape[1] * torch.empty((), dtype=stored).element_size()
        self.fd = os.open(self.path, os.O_RDONLY)
        self.host = None
        if self.device.type == "cuda":  # the table in host RAM; gathered rows are copied to the GPU
            buf = torch.empty(shape[0] * self.row_bytes, dtype=torch.uint8)
            self._pread_into(memoryview(buf.numpy()), 0)
            self.host = buf.view(stored).view(shape).to(dtype)
            self.close()

    def _pread_into(self, view: memoryview, first_row: int) -> None:
        done, n = 0, len(view)
        while done < n:
            got = os.preadv(self.fd, [view[done:]], self.offset + first_row * self.row_bytes + done)
            if got <= 0:
                raise OSError(f"{self.path} ended early while reading embedding rows")
            done += got

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [T] int64 -> rows [T, hidden] in the compute dtype on the compute device."""
        ids = tokens.tolist()
        if self.host is not None:
            return self.host[torch.tensor(ids)].to(self.device, non_blocking=True)
        out = torch.empty(len(ids) * self.row_bytes, dtype=torch.uint8)  # flat: the view slices bytes
        view = memoryview(out.numpy())
        for j, t in enumerate(ids):
            self._pread_into(view[j * self.row_bytes:(j + 1) * self.row_bytes], t)
        return out.view(self.stored).view(len(ids), self.shape[1]).to(self.dtype)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except OSError:
            pass
