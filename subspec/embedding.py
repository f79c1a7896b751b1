"""Embedding tables kept off the device, rows read on demand (the embedding table goes with the offloaded weights).

A forward reads only the embedding rows of its own tokens (one to a few hundred), yet an untied table is as large as
the lm_head (Qwen2.5-1.5B: 445 MiB, 18 % of a 2.5 GiB budget). :class:`EmbeddingRows` leaves it where the offloaded
layers live and gives that memory to layers: on a CPU the rows are read from the checkpoint file with ``pread``
(through the page cache, which keeps the frequent tokens in RAM); with CUDA compute the table stays in host RAM and
only the gathered rows are copied to the device.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .tensorfile import TensorFile


class EmbeddingRows:
    """An embedding table [vocab, hidden] that is not on the device; ``rows[tokens]`` gathers rows on demand.

    Args:
        path: the safetensors file holding the table. name: the table's name in that file.
        dtype: compute dtype. device: compute device.

    Raises:
        OSError, TensorFileError: the file cannot be opened or parsed.
    """

    def __init__(self, path: Path, name: str, dtype: torch.dtype, device):
        self.file, self.name = TensorFile(Path(path)), name
        self.shape = tuple(self.file.shape(name))
        self.dtype, self.device = dtype, torch.device(device)
        self.host = None
        if self.device.type == "cuda":  # the table in host RAM; gathered rows are copied to the GPU
            self.host = self.file.read(name).to(dtype)
            self.close()

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [T] int64 -> rows [T, hidden] in the compute dtype on the compute device."""
        if self.host is not None:
            return self.host[tokens.cpu()].to(self.device, non_blocking=True)
        return self.file.read_rows(self.name, tokens.tolist()).to(self.dtype)

    def close(self) -> None:
        self.file.close()
