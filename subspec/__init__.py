"""subspec: lossless, fast inference of LLMs larger than device memory.

Offloaded layers stream from host RAM or disk; on the device each gets a 4-bit substitute, and the substitutes
together with the resident layers and the shared KV cache draft a deep token tree that the full model verifies
in one forward pass (SubSpec, NeurIPS 2025, arXiv 2509.18344). Same output as the full model.
"""
import os as _os

# Large CPU tensors in transparent huge pages (PyTorch's allocator, 2 MiB-aligned with madvise for big allocations):
# a draft step streams ~0.7 GB of 4-bit substitutes, and with 4 KiB pages the hardware prefetchers stop at every page
# boundary and the TLB misses; measured on the 1.5B's draft step: 72.9 -> 64.7 ms (mean of three alternated pairs).
# Read by PyTorch once, at its first allocation: it applies when subspec is imported before torch (the CLI, the bench
# workers, the server), and a process that imported torch first keeps its own setting.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .errors import SubspecError
from .sampling import SamplingParams

__all__ = ["SubspecError", "SamplingParams"]
__version__ = "0.1.0"
