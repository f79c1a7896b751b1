"""subspec: lossless, fast inference of LLMs larger than device memory.

Offloaded layers stream from host RAM or disk; on the device each gets a 4-bit substitute, and the substitutes
together with the resident layers and the shared KV cache draft a deep token tree that the full model verifies
in one forward pass (SubSpec, NeurIPS 2025, arXiv 2509.18344). Same output as the full model.

Importing the package changes nothing in the host process (no environment variable, no global patch, no garbage
collector setting): what a loaded runtime changes is scoped to it (see :mod:`subspec.process`). Torch is imported on
first use of :class:`SamplingParams` or any module that needs it, so the command line can set its process settings
first.
"""
from .errors import SubspecError

__all__ = ["SubspecError", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "SamplingParams":  # imports torch
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'subspec' has no attribute {name!r}")
