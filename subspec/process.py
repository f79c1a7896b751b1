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
- **transformers without hqq at import** (:func:`skip_hqq_at_transformers_import`). ``transformers.cache_utils``
  imports ``hqq.core.quantize`` when hqq is installed (for its HQQ-quantized KV cache, which subspec never uses), and
  that module runs ``torch.compile`` as a decorator at class definition, which imports torch's compiler stack
  (``torch._dynamo``, ``torch._inductor``): 3 s of every process's start on a 2-core AMD EPYC (getting a llama config
  from transformers: 7.0 -> 3.9 s). The hook lets that one module see hqq as absent while it executes, then puts the
  real availability check back and binds ``HQQQuantizer`` to a stand-in that imports hqq's on first use, so
  transformers' HQQ cache still works. Installed by the command line's entry point and the bench workers (subspec's
  own processes), never by importing the library.
"""
from __future__ import annotations

import gc
import importlib.abc
import os
import sys
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


_CACHE_UTILS = "transformers.cache_utils"


class _LazyHqqQuantizer:
    """Stands for ``hqq.core.quantize.Quantizer`` in ``transformers.cache_utils``: imports it on first attribute use."""

    def __getattr__(self, name: str):
        from hqq.core.quantize import Quantizer

        return getattr(Quantizer, name)


class _WithoutHqq(importlib.abc.Loader):
    """Executes ``transformers.cache_utils`` (through its own loader) with transformers' ``is_hqq_available`` answering
    False, then restores the real check in both places and in the module, and binds the lazy quantizer."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import transformers.utils as tu
        import transformers.utils.import_utils as iu

        real = getattr(iu, "is_hqq_available", None)
        if real is None:  # a transformers without the check: nothing to hide
            self.loader.exec_module(module)
            return
        saved = tu.__dict__.get("is_hqq_available")
        tu.is_hqq_available = iu.is_hqq_available = _absent
        try:
            self.loader.exec_module(module)
        finally:
            iu.is_hqq_available = real
            if saved is not None:
                tu.is_hqq_available = saved
        if getattr(module, "is_hqq_available", None) is _absent:
            module.is_hqq_available = real
        if not hasattr(module, "HQQQuantizer") and real():
            module.HQQQuantizer = _LazyHqqQuantizer()


def _absent(*args, **kwargs) -> bool:
    return False


class _HqqDeferringFinder(importlib.abc.MetaPathFinder):
    """Finds ``transformers.cache_utils`` with the other finders and wraps its loader in :class:`_WithoutHqq`."""

    def find_spec(self, name, path=None, target=None):
        if name != _CACHE_UTILS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _WithoutHqq(spec.loader)
                return spec
        return None


def skip_hqq_at_transformers_import() -> None:
    """Keep ``transformers`` from importing hqq (and with it torch's compiler stack) when it is imported later in this
    process; see the module's notes. Does nothing when ``transformers.cache_utils`` is already imported or the hook is
    installed. Idempotent; safe with any transformers version (where the module or the check differ, nothing
    changes)."""
    if _CACHE_UTILS in sys.modules or any(isinstance(f, _HqqDeferringFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _HqqDeferringFinder())
