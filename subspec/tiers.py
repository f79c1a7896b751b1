"""Offload tiers: where offloaded layers live and how they stream into staging slots.

Every tier is a :class:`~subspec.model.LayerSource` over the offloaded layers: ``acquire(i)`` returns layer i's
linears once its bytes are in a staging slot; ``release(i)`` hands the slot back. Offloaded layers are consumed in
the same cyclic order by every target forward, so each tier simply runs ahead around that cycle as far as its
ring of slots allows: while the draft works, the first offloaded layers of the next target forward are already
being fetched (prefetch during drafting, design.md §3.2) without anyone asking.

- :class:`DiskTier` — layers packed once into a cache file (each a 4 KiB-aligned extent), read with O_DIRECT by a
  background thread into aligned host slots (then copied to the GPU when computing on CUDA).
- :class:`HostTier` — CUDA only: layers in exactly-sized pinned host buffers, copied by a side stream into a
  ring of device slots, two events per slot, no device-wide synchronize.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .cache import atomic_file, cache_root
from .errors import SubspecError
from .families import LINEAR_NAMES, linear_prefix
from .layout import LayerLayout
from .weights import DenseLinear, Linears

log = logging.getLogger(__name__)


def linears_from_views(views: dict[str, torch.Tensor], native: bool = True) -> Linears:
    """Dense :class:`Linears` over the typed views of a packed layer (``native``: see DenseLinear)."""
    fns = {}
    for name in LINEAR_NAMES:
        p = linear_prefix(name)
        fns[name] = DenseLinear(views[p + ".weight"], views.get(p + ".bias"), native)
    return Linears(**fns)


def fill_layer(source, i: int, layout: LayerLayout, buf: torch.Tensor) -> None:
    """Write layer ``i``'s tensors from the checkpoint into ``buf`` (uint8, >= extent bytes) in the layout's dtype."""
    for name, view in layout.views(buf).items():
        view.copy_(source.tensor(f"model.layers.{i}.{name}"))


def packed_file(source, layout: LayerLayout) -> Path:
    """The cache file holding every layer of ``source`` packed in ``layout`` (layer j at ``j * extent``).

    Built once with a progress bar and written atomically; reused afterwards.
    """
    dt = str(layout.dtype).replace("torch.", "")
    path = cache_root() / "packed" / f"{source.key}-{dt}.layers"
    L = source.config.num_hidden_layers
    if path.is_file() and path.stat().st_size == L * layout.extent:
        return path
    buf = torch.zeros(layout.extent, dtype=torch.uint8)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        for i in tqdm(range(L), desc="packing layers for the disk tier", unit="layer"):
            buf.zero_()
            fill_layer(source, i, layout, buf)
            f.write(memoryview(buf.numpy()))
        f.flush()
        os.fsync(f.fileno())
    return path


def _register_pinned(t: torch.Tensor) -> None:
    """Page-lock an existing CPU tensor in place (exact size: no power-of-two rounding of the caching allocator)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise SubspecError(f"cannot pin {t.numel() * t.element_size()} bytes of host memory (CUDA error {int(err)}): "
                           "lower the offloaded size or raise the locked-memory limit")


class DiskTier:
    """Streams offloaded layers from the packed cache file with the page cache bypassed.

    Args:
        path: the packed file (:func:`packed_file`). layout: the layer layout. layers: offloaded layer indices in
            forward order. n_slots: staging slots (>= 2). device: compute device (cpu or cuda).

    Counters: ``bytes_read`` (bytes read from the file), ``wait_seconds`` (time ``acquire`` blocked on I/O).

    O_DIRECT is used where the filesystem supports it; elsewhere each read is followed by
    ``posix_fadvise(DONTNEED)`` on its range (logged once), which also keeps the file out of the page cache.
    """

    def __init__(self, path: Path, layout: LayerLayout, layers: list[int], n_slots: int = 2, device="cpu",
                 native: bool = True):
        if n_slots < 2:
            raise ValueError("the disk tier needs at least 2 staging slots")
        self.layout, self.layers, self.n_slots = layout, list(layers), n_slots
        self.device = torch.device(device)
        self.direct = True
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            self.direct = False
            self.fd = os.open(path, os.O_RDONLY)
            log.warning("O_DIRECT is not supported for %s: bypassing the page cache with posix_fadvise", path)
        self.bytes_read, self.wait_seconds = 0, 0.0
        self._maps = [mmap.mmap(-1, layout.extent) for _ in range(n_slots)]  # page-aligned
        self._host = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            for h in self._host:
                _register_pinned(h)
            self._dev = [torch.empty(layout.extent, dtype=torch.uint8, device=self.device) for _ in range(n_slots)]
            self._copied = [torch.cuda.Event() for _ in range(n_slots)]
            bufs = self._dev
        else:
            bufs = self._host
        self._linears = [linears_from_views(layout.views(b), native) for b in bufs]
        self._filled = [threading.Semaphore(0) for _ in range(n_slots)]
        self._free = [threading.Semaphore(1) for _ in range(n_slots)]
        self._consumed = 0
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, name="subspec-disk-tier", daemon=True)
        self._thread.start()

    def _read(self, layer: int, s: int) -> None:
        off, n, view, done = layer * self.layout.extent, self.layout.extent, memoryview(self._maps[s]), 0
        while done < n:
            got = os.preadv(self.fd, [view[done:]], off + done)
            if got <= 0:
                raise SubspecError(f"the packed layer file ended early at byte {off + done}: delete it to rebuild")
            done += got
        if not self.direct:
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)
        self.bytes_read += n

    def _produce(self) -> None:
        j = 0
        try:
            while True:
                s = j % self.n_slots
                self._free[s].acquire()
                if self._stop:
                    return
                if self._cuda:
                    self._copied[s].synchronize()  # the previous device copy out of this host slot is done
                self._read(self.layers[j % len(self.layers)], s)
                self._filled[s].release()
                j += 1
        except BaseException as e:  # surfaced to the consumer by acquire()
            self._error = e
            for f in self._filled:
                f.release()

    def acquire(self, i: int) -> Linears:
        c = self._consumed
        s = c % self.n_slots
        if i != self.layers[c % len(self.layers)]:
            self._skip_to(i)
            c = self._consumed
            s = c % self.n_slots
        t = time.perf_counter()
        self._filled[s].acquire()
        self.wait_seconds += time.perf_counter() - t
        if self._error is not None:
            raise self._error
        if self._cuda:
            self._dev[s].copy_(self._host[s], non_blocking=True)
            self._copied[s].record()
        return self._linears[s]

    def release(self, i: int) -> None:
        self._free[self._consumed % self.n_slots].release()
        self._consumed += 1

    def _skip_to(self, i: int) -> None:
        """Resynchronize after an interrupted forward (e.g. Ctrl-C): drop streamed layers until ``i`` is next."""
        if i not in self.layers:
            raise RuntimeError(f"disk tier: layer {i} is not offloaded")
        while self.layers[self._consumed % len(self.layers)] != i:
            self._filled[self._consumed % self.n_slots].acquire()
            self.release(-1)

    def close(self) -> None:
        """Stop the reader thread and close the file."""
        if self._stop:
            return
        self._stop = True
        for f in self._free:
            f.release()
        self._thread.join(timeout=10)
        os.close(self.fd)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class HostTier:
    """CUDA: offloaded layers in pinned host RAM, streamed by a copy stream into a ring of device slots.

    Two events per slot: the compute stream waits for ``copied[s]`` before using slot s; the copy stream waits for
    ``used[s]`` (recorded by the compute stream at release) before overwriting it. No host synchronization.

    Args:
        source: the checkpoint. layout: layer layout. layers: offloaded layers in forward order.
        n_slots: device slots (>= 2). device: a CUDA device.

    Counters: ``bytes_read`` (bytes copied host -> device); ``wait_seconds`` stays 0 (waits happen on the GPU).
    """

    def __init__(self, source, layout: LayerLayout, layers: list[int], n_slots: int = 2, device="cuda",
                 native: bool = True):
        if not torch.cuda.is_available():
            raise SubspecError("the host offload tier needs CUDA: use --offload disk on a CPU")
        self.layout, self.layers, self.n_slots = layout, list(layers), n_slots
        self.device = torch.device(device)
        self.bytes_read, self.wait_seconds = 0, 0.0
        self._host = {}
        for i in tqdm(self.layers, desc="loading offloaded layers into pinned RAM", unit="layer"):
            buf = torch.zeros(layout.extent, dtype=torch.uint8)
            fill_layer(source, i, layout, buf)
            _register_pinned(buf)
            self._host[i] = buf
        self._dev = [torch.empty(layout.extent, dtype=torch.uint8, device=self.device) for _ in range(n_slots)]
        self._linears = [linears_from_views(layout.views(b), native) for b in self._dev]
        self._copied = [torch.cuda.Event() for _ in range(n_slots)]
        self._used = [torch.cuda.Event() for _ in range(n_slots)]
        self._stream = torch.cuda.Stream(device=self.device)
        self._consumed = 0
        for j in range(min(n_slots, len(self.layers))):
            self._issue(j)

    def _issue(self, j: int) -> None:
        """Enqueue the copy of stream position j into slot j % n_slots, after that slot's last use."""
        s = j % self.n_slots
        with torch.cuda.stream(self._stream):
            if j >= self.n_slots:
                self._stream.wait_event(self._used[s])
            self._dev[s].copy_(self._host[self.layers[j % len(self.layers)]], non_blocking=True)
            self._copied[s].record(self._stream)
        self.bytes_read += self.layout.extent

    def acquire(self, i: int) -> Linears:
        c = self._consumed
        s = c % self.n_slots
        while i != self.layers[c % len(self.layers)]:  # resynchronize after an interrupted forward
            if i not in self.layers:
                raise RuntimeError(f"host tier: layer {i} is not offloaded")
            self.release(-1)
            c = self._consumed
            s = c % self.n_slots
        torch.cuda.current_stream(self.device).wait_event(self._copied[s])
        return self._linears[s]

    def release(self, i: int) -> None:
        c = self._consumed
        self._used[c % self.n_slots].record(torch.cuda.current_stream(self.device))
        self._consumed += 1
        self._issue(c + self.n_slots)

    def close(self) -> None:
        pass
