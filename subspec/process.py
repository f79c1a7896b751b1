"""What subspec changes in its host process, each change scoped so that the process is left as it was found.

- **Garbage collector freeze.** The objects of a loaded model (tokenizer, configs, modules: hundreds of thousands)
  live as long as its runtime; the cyclic collector's full passes over them cost about 6 % of a small model's draft
  step. :func:`hold_gc_freeze` (called by :func:`subspec.runtime.load`) moves the objects alive now out of the
  collector's sight (``gc.freeze``); :func:`release_gc_freeze` (called once by ``Runtime.close``) gives them back
  (``gc.unfreeze``) when the **last** runtime holding the freeze closes, so closing one of two runtimes does not
  unfreeze the other's objects. When the host process had frozen objects itself before the first runtime loaded, the
  collector is its business: the runtimes neither freeze nor unfreeze.
- **Freed heap returned to the OS** (:func:`release_freed_heap`, glibc's ``malloc_trim``) after loading, so the
  process's memory stays near its plan.
- **Transparent huge pages for PyTorch's CPU allocator** (``THP_MEM_ALLOC_ENABLE``; a draft step of the 1.5B: 72.9 ->
  64.7 ms). PyTorch reads the variable once, at its first allocation, so it can only be set before torch allocates:
  :func:`use_huge_pages` is called by the command line's entry point (before it imports torch; the bench workers and
  the server it starts inherit it), never by importing the library. ``THP_MEM_ALLOC_ENABLE=0`` in the environment
  opts out; a program using the library sets ``THP_MEM_ALLOC_ENABLE=1`` itself, before importing torch, to get it.
"""
from __future__ import annotations

import gc
import os
import threading

THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"

_lock = threading.Lock()
_holders = 0  # runtimes holding the freeze
_owned = False  # whether the freeze is ours (nobody had frozen objects when the first runtime took it)


def use_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for transparent huge pages in this process and its children, unless the environment
    already sets :data:`THP_VARIABLE` (``0`` opts out). Effective only before torch's first allocation."""
    os.environ.setdefault(THP_VARIABLE, "1")


def hold_gc_freeze() -> None:
    """Freeze the objects alive now out of the cyclic collector's sight, for one runtime (pair with one
    :func:`release_gc_freeze`). Does nothing when the host process had frozen objects before the first holder."""
    global _holders, _owned
    with _lock:
        if _holders == 0:
            _owned = gc.get_freeze_count() == 0
        _holders += 1
        if _owned:
            gc.collect()
            gc.freeze()


def release_gc_freeze() -> None:
    """One holder is done; the last one unfreezes what the holders froze (when the freeze was ours)."""
    global _holders, _owned
    with _lock:
        if _holders == 0:
            raise RuntimeError("release_gc_freeze without a hold")
        _holders -= 1
        if _holders == 0 and _owned:
            gc.unfreeze()
            _owned = False


def release_freed_heap() -> None:
    """Return heap memory freed during loading (float32 checkpoint tensors) to the OS (glibc ``malloc_trim``)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim
            pass
