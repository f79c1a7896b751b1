"""Facts about this machine that user options are checked against (before any work starts)."""
from __future__ import annotations

import os
from typing import Optional

from .errors import SubspecError


def physical_memory() -> Optional[int]:
    """Bytes of RAM of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def ram_read_rate(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s that this process's torch threads read from RAM: the best of ``repeats`` sums over ``nbytes`` of fp32.

    A draft step reads its weights and writes little, so its memory floor is a read rate, not a copy's (a copy counted
    as twice its size reads 23-27 GB/s where a sum reads 28-39 GB/s on a 2-core Zen 3: a copy's floor flatters the
    step). Used by ``scripts/profile_round.py`` and ``scripts/bench_kernels.py``; allocates ``nbytes`` while it runs.
    """
    import time

    import torch

    a = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best


def check_device_memory(budget: Optional[int], device) -> None:
    """Refuse a ``--device-memory`` budget (bytes) beyond what the device has: RAM for a CPU, the GPU's total memory
    for CUDA (a plan for memory that is not there would swap or fail at run time).

    Raises:
        SubspecError: the budget exceeds the device's memory (one line naming both and the fix).
    """
    if budget is None:
        return
    from .placement import fmt_bytes

    if device.type == "cuda":
        import torch

        have, what = torch.cuda.get_device_properties(device).total_memory, f"memory of {torch.cuda.get_device_name(device)}"
    else:
        have, what = physical_memory(), "RAM"
    if have is not None and budget > have:
        raise SubspecError(f"--device-memory {fmt_bytes(budget)} is more than this machine's {fmt_bytes(have)} of {what}: "
                           f"give at most {fmt_bytes(have)} (less what else runs), or leave it out")
