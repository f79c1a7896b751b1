"""subspec: lossless, fast inference of LLMs larger than device memory.

Offloaded layers stream from host RAM or disk; on the device each gets a 4-bit substitute, and the substitutes
together with the resident layers and the shared KV cache draft a deep token tree that the full model verifies
in one forward pass (SubSpec, NeurIPS 2025, arXiv 2509.18344). Same output as the full model.
"""
from .errors import SubspecError
from .sampling import SamplingParams

__all__ = ["SubspecError", "SamplingParams"]
__version__ = "0.1.0"
