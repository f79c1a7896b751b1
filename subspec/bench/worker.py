"""One benchmark method in its own process, so that its memory is its own.

``subspec bench`` starts one worker per method (optionally under a wrapper command such as a memory cap) and
talks to it over stdin/stdout, one JSON object per line:

1. parent -> worker: ``{"method", "opts", "draft_model"}``; worker -> parent: ``{"ready": true, "info", "lossless"}``
   or ``{"error": "one-line reason"}`` (the method is then skipped with that reason).
2. parent -> worker: ``{"ids": [prompt token ids], "max_new": N}``; worker -> parent: ``{"out": [new token ids],
   "stats": {...}, "wall_seconds", "peak_rss", "peak_device_memory"}``. ``peak_rss`` is the process's peak
   resident set size (bytes) during this request alone (Linux ``VmHWM`` after resetting it through
   ``/proc/self/clear_refs``; where that is refused, the peak since the start); ``peak_device_memory`` is
   ``torch.cuda.max_memory_allocated`` for the request on CUDA, else None.
3. parent -> worker: ``{"close": true}`` or end of input: the worker releases its method and exits.

Everything the method prints goes to stderr; stdout carries only the protocol.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak resident set size of this process in bytes (since the last :func:`reset_peak_rss`)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills its workers
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library output goes to stderr
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    from ..process import skip_hqq_at_transformers_import

    skip_hqq_at_transformers_import()  # as the command line does (subspec.process)
    from ..errors import SubspecError
    from ..runtime import Options
    from .methods import build_methods

    first = sys.stdin.readline()
    if not first:
        return 1
    req = json.loads(first)
    try:
        opts = Options(**req["opts"])
        (method,), shared = build_methods([req["method"]], opts, req.get("draft_model"),
                                     log=lambda s: print(s, file=sys.stderr, flush=True))
    except Exception as e:  # noqa: BLE001 - any failure to load is reported as the reason the method is skipped
        send({"error": f"{type(e).__name__ + ': ' if not isinstance(e, SubspecError) else ''}{e}".splitlines()[0]})
        return 0
    send({"ready": True, "info": method.info, "lossless": method.lossless})
    import torch

    cuda = torch.cuda.is_available() and opts.device != "cpu"
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("close"):
            break
        reset_peak_rss()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        out, stats = method.run(req["ids"], req["max_new"])
        wall = time.perf_counter() - t
        send({"out": out, "stats": stats, "wall_seconds": wall, "peak_rss": peak_rss(),
              "peak_device_memory": torch.cuda.max_memory_allocated() if cuda else None})
    method.close()
    for rt in ("ar", "subspec"):
        if rt in shared:
            shared[rt].close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
