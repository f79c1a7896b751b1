"""Offload tiers: where offloaded layers live and how they stream into staging slots.

Every tier is a :class:`~subspec.model.LayerSource` over the offloaded layers: ``acquire(i)`` returns layer i's
linears once its bytes are in a staging slot; ``release(i)`` hands the slot back. Offloaded layers are consumed in
the same cyclic order by every target forward, so each tier simply runs ahead around that cycle as far as its
ring of slots allows: while the draft works, the first offloaded layers of the next target forward are already
being fetched (prefetch during drafting, design.md §3.2) without anyone asking.

- :class:`DiskTier` — layers packed once into cache files (:func:`packed_layers`, :mod:`subspec.layerfile`: one file
  per layer, a header (4 KiB, more for a layer of many experts) saying what it was made from with a CRC-32 per section, then the layer's 4 KiB-aligned
  extent), read with O_DIRECT by a background thread into aligned host slots (then copied to the GPU when computing
  on CUDA). A second thread checks each layer's sections as it arrives. A layer coded against its substitutes
  (:mod:`subspec.codec`) stays coded in its slot (about 57 % of a layer: a slot of that size): the checker indexes its
  blocks and the forward's linears decode it as they multiply (:class:`~subspec.codec.CodedLinear`).
- :class:`HostTier` — CUDA only: layers in exactly-sized pinned host buffers, copied by a side stream into a
  ring of device slots, two events per slot, no device-wide synchronize.
"""
from __future__ import annotations

import functools
import logging
import mmap
import os
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm  # (the host tier's pinning; the first start's bars: subspec.progress)

from . import layerfile
from .codec import coded_linears, index_layer
from .layerfile import fill_layer
from .cache import cache_dir, cache_root, check_free_space
from .errors import SubspecError
from .experts import ExpertResidency, aligned_bytes
from .hostmem import aligned_view, huge_page_map
from .layout import LayerLayout
from .progress import bar as progress_bar
from .weights import Linears, dense_linears

log = logging.getLogger(__name__)


def linears_from_views(views: dict[str, torch.Tensor], native: bool = True) -> Linears:
    """Dense :class:`Linears` over the typed views of a packed layer (:func:`dense_linears`)."""
    return Linears(dense_linears(views, native))


PACKED_FORMAT = "subspec-packed-layer/2"


def _packed_expect(source, layout: LayerLayout, i: int) -> dict:
    """What the packed file of layer ``i`` must have been made from (its header's fields)."""
    return {"format": PACKED_FORMAT, "source": source.key, "layer": i, "dtype": str(layout.dtype),
            "extent": layout.extent, "tensors": [[t.name, list(t.shape), t.offset] for t in layout.tensors]}


def _packed_fits(layout: LayerLayout):
    def accept(i: int, path: Path, head: dict):
        return path if head["payload_bytes"] == layout.extent else f"holds {head['payload_bytes']} bytes, not one extent"
    return accept


def packed_folder(key: str, dtype: torch.dtype) -> Path:
    """Where the packed layer files of the model of content ``key`` in ``dtype`` live (:func:`layerfile.file_name`)."""
    return cache_root() / "packed" / f"{key}-{str(dtype).replace('torch.', '')}"


def packed_layers(source, layout: LayerLayout, layers: list[int]) -> dict[int, Path]:
    """The packed files of ``layers`` (one :mod:`~subspec.layerfile` per layer: the header, then the layer's extent;
    a CRC-32 per tensor), built where missing.

    Files live in ``packed/<source key>-<dtype>/layer-NNNNN.bin``; each is written layer by layer (one layer in
    memory) and atomically, so an interrupted packing keeps the layers already done. A file that is truncated or was
    made from something else is rebuilt with a one-line notice.

    Raises:
        SubspecError: the checkpoint cannot be read, or the cache cannot be written.
    """
    folder = cache_dir(packed_folder(source.key, layout.dtype))
    paths, todo = layerfile.scan(folder, layers, lambda i: _packed_expect(source, layout, i), _packed_fits(layout))
    if todo:
        check_free_space(folder, len(todo) * (layout.extent + layerfile.HEADER_BYTES),
                         f"{len(todo)} packed layers of the disk tier")
        buf = torch.zeros(layout.extent, dtype=torch.uint8)
        spans = [(t.name, t.offset, nbytes) for t, nbytes in zip(layout.tensors, layout.sizes())]
        for i in progress_bar("packing", todo, desc="packing layers for the disk tier", unit="layer"):
            buf.zero_()
            fill_layer(source, i, layout, buf)
            data = buf.numpy()
            paths[i] = folder / layerfile.file_name(i)
            layerfile.write(paths[i], _packed_expect(source, layout, i), data, layerfile.checksums(data, spans))
    return {i: paths[i] for i in layers}


class PinnedHost:
    """Host memory page-locked in place with ``cudaHostRegister`` (the exact size: no power-of-two rounding of the
    caching allocator), each range unlocked exactly once by :meth:`release` (idempotent).

    The owner keeps the tensors alive until :meth:`release` has run, and calls it once no copy out of them is in
    flight (in a ``finally``, and when its own construction fails half-way).
    """

    def __init__(self):
        self._ptrs: list[int] = []

    def pin(self, t: torch.Tensor) -> None:
        """Page-lock ``t`` (a contiguous CPU tensor).

        Raises:
            SubspecError: CUDA refused (names the size and the fix).
        """
        size = t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 0)
        if int(err) != 0:
            raise SubspecError(f"cannot pin {size} bytes of host memory (CUDA error {int(err)}): lower the offloaded "
                               "size or raise the locked-memory limit")
        self._ptrs.append(t.data_ptr())

    def release(self) -> None:
        """Unlock every range pinned so far (each once; a failure is logged and the others are still unlocked)."""
        ptrs, self._ptrs = self._ptrs, []
        for ptr in ptrs:
            err = torch.cuda.cudart().cudaHostUnregister(ptr)
            if int(err) != 0:
                log.warning("cudaHostUnregister failed (CUDA error %d): the range stays page-locked", int(err))


class _Ring:
    """One run of the tier's threads: semaphores of the slots, per-slot errors, the reader and the checker thread.
    Replaced on resync.

    Per slot: ``free`` (the reader may fill it), ``read`` (the layer's file bytes are in it: the checker's turn: it
    verifies the sections' checksums and indexes a coded layer's blocks), ``filled`` (the layer is ready for
    ``acquire``). Both threads walk the same cyclic layer order, so the checker works on one layer while the reader
    reads the next."""

    def __init__(self, tier: "DiskTier", start: int):
        n = tier.n_slots
        self.filled = [threading.Semaphore(0) for _ in range(n)]
        self.free = [threading.Semaphore(1) for _ in range(n)]
        self.read = [threading.Semaphore(0) for _ in range(n)]
        self.errors: list[BaseException | None] = [None] * n
        self.stopping = False
        self.thread = threading.Thread(target=self._produce, args=(tier, start), name="subspec-disk-tier", daemon=True)
        self.checker = threading.Thread(target=self._check, args=(tier, start), name="subspec-disk-checker",
                                        daemon=True)
        self.thread.start()
        self.checker.start()

    def _produce(self, tier: "DiskTier", j: int) -> None:
        n, L = tier.n_slots, len(tier.layers)
        while True:
            s = j % n
            self.free[s].acquire()
            if self.stopping:
                return
            layer = tier.layers[j % L]
            try:
                if tier._cuda:
                    tier._copied[s].synchronize()  # the previous device copy out of this host slot is done
                tier._touched[s].wait()  # its pages were faulted in (DiskTier._touch_slots)
                tier._read(layer, s)
            except BaseException as e:  # delivered by acquire() for the layer it concerns
                self.errors[s] = e
                self.filled[s].release()
                return
            self.read[s].release()
            j += 1

    def _check(self, tier: "DiskTier", j: int) -> None:
        n, L = tier.n_slots, len(tier.layers)
        while True:
            s = j % n
            self.read[s].acquire()
            if self.stopping:
                return
            try:
                tier._check(tier.layers[j % L], s)
            except BaseException as e:  # a damaged file (SubspecError) or anything else, for acquire() to raise
                self.errors[s] = e
                self.filled[s].release()
                return
            self.filled[s].release()
            j += 1

    def alive(self) -> bool:
        """Whether the thread that hands out the next layer (the checker) still runs."""
        return self.checker.is_alive()

    def stop(self) -> None:
        self.stopping = True
        for f in self.free + self.read:
            f.release()
        self.thread.join()
        self.checker.join()


class DiskTier:
    """Streams offloaded layers from their packed files with the page cache bypassed.

    Args:
        paths: layer index -> packed file (:func:`packed_layers`), for the layers not coded. layout: the layer layout.
            layers: offloaded layer indices in forward order. n_slots: staging slots (>= 2). device: compute device
            (cpu or cuda). coded: layer index -> :class:`~subspec.codec.CodedLayer` (its stream read into a slot and
            kept there, multiplied by :class:`~subspec.codec.CodedLinear` against ``substitutes[layer]``; CPU only).
            by_expert: stream a mixture-of-experts layer by expert (below); False: whole layers.

    Slots are as large as what they hold: a layer's extent, or where every offloaded layer is coded the largest
    coded stream (:attr:`slot_bytes`), so coding buys slots: the reader runs as far ahead as the slots reach, and
    while the draft runs (a verify's first offloaded layers do not change meanwhile) it fills them all.

    Mixture-of-experts layers (a layout with expert units, stored packed) stream by expert: the reader reads ahead
    only a layer's attention unit; the forward, once its router has chosen, asks for the routed experts
    (``Linears.fetch``), which are read then (adjacent experts in one read), checked and kept in the slot until it
    is refilled. A forward reads the attention and the union of its tokens' experts, not the whole layer. On the
    CPU, ``resident_attention`` layers keep their attention unit in memory (read once here) and ``expert_cache``
    experts of each layer are cached, the most used so far (:class:`~subspec.experts.ExpertResidency`).

    Counters: ``bytes_streamed`` (file bytes of the layers handed to forwards: coded layers count their stream,
    expert-streamed layers their attention and the experts fetched),
    ``bytes_read`` (bytes the reader read from disk, read-ahead included), ``wait_seconds`` (time ``acquire`` blocked
    on I/O, checking and decoding), :meth:`busy_seconds` (time the disk was reading for the tier: its reads' wall
    time, a read in flight included).

    Robustness: a read error, or a file found damaged as it is read (a section failing its CRC-32, a coded stream that
    does not decode: the file is removed so that the next start rebuilds it), is raised (as :class:`SubspecError`,
    naming the file) by the ``acquire`` of the layer it concerns; after any interruption (an exception inside a forward, a Ctrl-C anywhere, a read error) the next ``acquire`` restarts
    the reader at the layer asked for, so the tier never waits for a slot that will not be filled.

    O_DIRECT is used where the filesystem supports it; elsewhere each read is followed by
    ``posix_fadvise(DONTNEED)`` on its range (logged once), which also keeps the file out of the page cache.
    """

    def __init__(self, paths: dict[int, Path], layout: LayerLayout, layers: list[int], n_slots: int = 2,
                 device="cpu", native: bool = True, coded: dict | None = None, substitutes: dict | None = None,
                 by_expert: bool = True, resident_attention=(), expert_cache: int = 0):
        if n_slots < 2:
            raise ValueError("the disk tier needs at least 2 staging slots")
        self.layout, self.layers, self.n_slots = layout, list(layers), n_slots
        self.coded = {i: c for i, c in (coded or {}).items() if i in self.layers}
        if self.coded and torch.device(device).type != "cpu":
            raise ValueError("disk tier: coded layers are multiplied on the CPU only")
        self.substitutes = {i: substitutes[i] for i in self.coded} if self.coded else {}
        self.paths = {i: Path(self.coded[i].path if i in self.coded else paths[i]) for i in self.layers}
        self._bytes, self._sections, self._start = {}, {}, {}
        for i in self.layers:  # what a read moves (the payload), the checksums of its sections, where it starts
            self._bytes[i], self._sections[i], self._start[i] = layerfile.read_sections(self.paths[i])
            want = self.coded[i].stream_bytes if i in self.coded else layout.extent
            if self._bytes[i] != want:
                raise SubspecError(f"the layer file {self.paths[i]} holds {self._bytes[i]} bytes, not the {want} of "
                                   "its layer: delete it to rebuild it")
        # expert-streamed layers (packed, of a layout with expert units): the sections of each unit
        self._by_expert = {i: by_expert and layout.experts > 0 and i not in self.coded for i in self.layers}
        self._unit_sections = {i: [tuple(c for c in self._sections[i] if off <= c.offset < off + n)
                                   for off, n in layout.units] for i in self.layers if self._by_expert[i]}
        self._loaded: list[set[int]] = [set() for _ in range(n_slots)]  # experts present in each slot
        self.device = torch.device(device)
        self.direct = True
        self.fds: dict[int, int] = {}
        try:
            for i in self.layers:
                self.fds[i] = self._open(self.paths[i])
        except BaseException:
            self._close_files()
            raise
        self.bytes_read, self.bytes_streamed, self.wait_seconds = 0, 0, 0.0
        self._busy_done, self._busy_since = 0.0, {}  # seconds of finished reads; reads in flight: thread -> start
        self._busy_lock = threading.Lock()  # the reader and, for expert-streamed layers, the forward's thread read
        # a slot holds a whole layer, or where every layer is coded the largest stream (4 KiB multiples)
        self.slot_bytes = max(self._bytes.values()) if len(self.coded) == len(self.layers) else layout.extent
        self._maps = [huge_page_map(self.slot_bytes) for _ in range(n_slots)]
        self._host = [aligned_view(m, self.slot_bytes) for m in self._maps]
        self._views = [memoryview(h.numpy()) for h in self._host]  # what the reader's preadv fills
        self._index: dict[int, dict] = {}  # a coded layer's block offsets, by linear: made at its first read (_check)
        self._cuda = self.device.type == "cuda"
        self._pins = PinnedHost()
        if self._cuda:
            try:
                for h in self._host:
                    self._pins.pin(h)
            except BaseException:
                self._pins.release()
                self._close_files()
                raise
            self._dev = [torch.empty(layout.extent, dtype=torch.uint8, device=self.device) for _ in range(n_slots)]
            self._copied = [torch.cuda.Event() for _ in range(n_slots)]
            bufs = self._dev
        else:
            bufs = self._host
        whole = self.slot_bytes >= layout.extent  # slots of whole layers: typed views over them, made once
        self._linears = [linears_from_views(layout.views(b), native) if whole else None for b in bufs]
        self._experts = None
        if any(self._by_expert.values()):
            streamed = [i for i in self.layers if self._by_expert[i]]
            keep = not self._cuda  # the held units live in host memory: on the CPU only
            self._experts = ExpertResidency(layout, streamed, set(resident_attention) if keep else set(),
                                            expert_cache if keep else 0, native)
            self._slot_parts = [((lin.q_proj, lin.k_proj, lin.v_proj, lin.o_proj), lin.experts)
                                for lin in self._linears]
            for s, lin in enumerate(self._linears):
                lin.fetch = functools.partial(self._fetch, s)
            try:
                for i in sorted(self._experts.attention_layers):  # read once, checked, kept
                    buf = aligned_bytes(layout.units[0][1])
                    self._pread(i, memoryview(buf.numpy()), 0)
                    why = layerfile.verify(memoryview(buf.numpy()), self._unit_sections[i][0])
                    if why is not None:
                        raise layerfile.damaged(self.paths[i], "packed", why)
                    self._experts.hold_attention(i, buf)
            except BaseException:
                self._pins.release()
                self._close_files()
                raise
        self._consumed = 0
        self._dirty = False  # True while acquire/release is in progress or failed: the next acquire resyncs
        self._closed = False
        # the slots' first touch (page faults: on a VM's fresh memory slower than the disk) runs on the compute
        # threads ahead of the reader, which would otherwise fault each slot inside its first read (one thread)
        self._touched = [threading.Event() for _ in range(n_slots)]
        self._toucher = threading.Thread(target=self._touch_slots, name="subspec-disk-touch", daemon=True)
        self._toucher.start()
        self._ring = _Ring(self, 0)

    def _touch_slots(self) -> None:
        """Fault every staging slot's pages in, slot by slot (one write a page: torch's parallel fill, without the
        GIL), and set each slot's ``_touched`` event; the reader reads into a slot once it is set."""
        try:
            for s, h in enumerate(self._host):
                if not self._closed and not self._cuda:  # pinned CUDA slots were touched by the pinning
                    h[::mmap.PAGESIZE].fill_(0)
                self._touched[s].set()
        finally:
            for e in self._touched:
                e.set()  # never leave the reader waiting

    @property
    def stream_bytes(self) -> int:
        """File bytes one pass over the offloaded layers reads (coded layers: their streams)."""
        return sum(self._bytes.values())

    def _open(self, path: Path) -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise SubspecError(f"cannot open the packed layer file {path} ({e.strerror}): delete it to rebuild it") from None
        if self.direct:
            log.warning("O_DIRECT is not supported for %s: bypassing the page cache with posix_fadvise", path)
        self.direct = False
        return fd

    def _read(self, layer: int, s: int) -> None:
        """On the reader thread: layer ``layer``'s bytes into slot ``s`` (an expert-streamed layer: its attention)."""
        if self._by_expert[layer]:
            self._loaded[s] = set()  # the slot is free: nobody reads this while the reader refills it
            if layer in self._experts.attention_layers:
                return  # held in memory: nothing to read ahead
            off, n = self.layout.units[0]
            self._pread(layer, self._views[s][off:off + n], off)
            return
        self._pread(layer, self._views[s][:self._bytes[layer]], 0)

    def _pread(self, layer: int, view: memoryview, offset: int) -> None:
        """Read ``len(view)`` bytes of ``layer``'s payload from ``offset`` (4 KiB-aligned) into ``view``."""
        fd, n, done, start = self.fds[layer], len(view), 0, self._start[layer] + offset
        me = threading.get_ident()
        with self._busy_lock:
            self._busy_since[me] = time.perf_counter()
        try:
            while done < n:
                got = os.preadv(fd, [view[done:]], start + done)
                if got <= 0:
                    raise SubspecError(f"the packed layer file {self.paths[layer]} ended early at byte "
                                       f"{start + done}: restart to rebuild it")
                done += got
        except OSError as e:
            raise SubspecError(f"cannot read the packed layer file {self.paths[layer]} ({e.strerror}): "
                               "restart to rebuild it") from None
        finally:
            with self._busy_lock:
                self._busy_done += time.perf_counter() - self._busy_since.pop(me)
        if not self.direct:
            os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
        self.bytes_read += n

    def busy_seconds(self) -> float:
        """Seconds the disk has spent reading for this tier since it opened: the wall time of its reads summed (the
        reader's read-ahead and a forward's expert reads; two reads at once count twice), reads in flight counted up
        to now. Sampled at a round's phase boundaries it says how busy the disk was while the draft ran and while the
        verify ran."""
        with self._busy_lock:
            now = time.perf_counter()
            return self._busy_done + sum(now - t for t in self._busy_since.values())

    def _fetch(self, s: int, experts: list[int]) -> None:
        """The forward's routed ``experts`` of the layer in slot ``s`` (the one acquired), read where not yet in the
        slot: runs of adjacent experts in one read each, every section checked (on the calling thread).

        Raises:
            SubspecError: a read fails, or a section fails its checksum (the file is removed to be rebuilt).
        """
        layer = self.layers[self._consumed % len(self.layers)]
        store = self._experts
        to_slot, to_cache = store.route(layer, sorted(set(experts)))
        need = sorted(e for e in to_slot if e not in self._loaded[s])
        t = time.perf_counter()
        units, runs = self.layout.units, []
        for e in need:
            if runs and e == runs[-1][-1] + 1:
                runs[-1].append(e)
            else:
                runs.append([e])
        for e, c in to_cache.items():  # into the cache: kept for the next forwards
            off, n = units[1 + e]
            entry = memoryview(store.entry(layer, c).numpy())
            try:
                self._pread(layer, entry, off)
                why = layerfile.verify(entry, self._unit_sections[layer][1 + e], base=off)
                if why is not None:
                    raise layerfile.damaged(self.paths[layer], "packed", why)
            except BaseException:
                store.forget(layer, c)
                raise
            store.admit(layer, e, c)
            self.bytes_streamed += n
        for run in runs:
            off = units[1 + run[0]][0]
            end = units[1 + run[-1]][0] + units[1 + run[-1]][1]
            self._pread(layer, self._views[s][off:end], off)
            for e in run:
                why = layerfile.verify(self._views[s], self._unit_sections[layer][1 + e])
                if why is not None:
                    raise layerfile.damaged(self.paths[layer], "packed", why)
            if self._cuda:
                self._dev[s][off:end].copy_(self._host[s][off:end], non_blocking=True)
            self._loaded[s].update(run)
            self.bytes_streamed += end - off
        if self._cuda and runs:
            self._copied[s].record()
        lin = self._linears[s]
        if store.capacity:  # cached experts from the cache, the others from the slot
            lin.experts = tuple(store.cached(layer, e) or own for e, own in enumerate(self._slot_parts[s][1]))
        self.wait_seconds += time.perf_counter() - t

    def _check(self, layer: int, s: int) -> None:
        """On the checker thread: verify the sections of the layer just read into slot ``s`` and index a coded
        layer's blocks (:func:`~subspec.codec.index_layer`, once per layer: a full pass over the stream, about 0.2 ms a
        SmolLM2 layer, 6 ms a round, on one of two cores the forward also uses; a later read that passes the same
        CRC-32s holds the same bytes).

        Raises:
            SubspecError: a section fails its checksum or a coded stream's blocks do not fit it: the file is damaged
                (it is removed, so that the next start rebuilds it).
        """
        if self._by_expert[layer]:  # the attention unit (the experts are checked as they are fetched)
            if layer in self._experts.attention_layers:
                return
            why = layerfile.verify(self._views[s], self._unit_sections[layer][0])
            if why is not None:
                raise layerfile.damaged(self.paths[layer], "packed", why)
            return
        coded = self.coded.get(layer)
        n = self._bytes[layer]
        why = layerfile.verify(self._views[s][:n], self._sections[layer])
        if why is None and coded is not None:
            if layer not in self._index:  # the first read; later ones pass the same CRC-32s: the same bytes
                try:
                    self._index[layer] = index_layer(self._host[s][:n], coded, self.substitutes[layer])
                except RuntimeError as e:  # the operator's error: a damaged stream
                    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if why is not None:
            raise layerfile.damaged(self.paths[layer], "coded" if coded is not None else "packed", why)

    def _resync(self, i: int) -> None:
        """Restart the reader so that layer ``i`` is the next one streamed (after an interruption)."""
        if i not in self.layers:
            raise RuntimeError(f"disk tier: layer {i} is not offloaded")
        self._ring.stop()
        self._consumed = self.layers.index(i)
        self._ring = _Ring(self, self._consumed)

    def acquire(self, i: int) -> Linears:
        """Layer ``i``'s linears once its bytes are in a staging slot (blocks on I/O).

        Raises:
            SubspecError: the layer could not be read (named, with the fix).
        """
        if self._closed:
            raise RuntimeError("disk tier: acquire after close")
        if self._dirty or i != self.layers[self._consumed % len(self.layers)]:
            self._dirty = True
            self._resync(i)
        self._dirty = True
        ring, s = self._ring, self._consumed % self.n_slots
        t = time.perf_counter()
        while not ring.filled[s].acquire(timeout=1.0):
            if not ring.alive() and ring.errors[s] is None:
                raise RuntimeError("disk tier: the reader thread stopped")  # defensive: never wait forever
        self.wait_seconds += time.perf_counter() - t
        if ring.errors[s] is not None:
            raise ring.errors[s]
        if self._cuda:
            self._dev[s].copy_(self._host[s], non_blocking=True)
            self._copied[s].record()
        if i in self.coded:  # multiplied from the stream in the slot
            self.bytes_streamed += self._bytes[i]
            self._dirty = False
            return coded_linears(self._host[s], self.coded[i], self.substitutes[i], self._index[i], self.layout.dtype)
        lin = self._linears[s]
        if self._by_expert[i]:
            held = self._experts.attention(i)
            lin.q_proj, lin.k_proj, lin.v_proj, lin.o_proj = held or self._slot_parts[s][0]
            lin.experts = self._slot_parts[s][1]
            self.bytes_streamed += 0 if held else self.layout.units[0][1]
        else:
            self.bytes_streamed += self._bytes[i]
        self._dirty = False
        return lin

    def release(self, i: int) -> None:
        """Hand layer ``i``'s slot back to the reader."""
        self._dirty = True
        self._ring.free[self._consumed % self.n_slots].release()
        self._consumed += 1
        self._dirty = False

    def close(self) -> None:
        """Stop the reader thread, close the files and (CUDA) unpin the host slots once their last copy is done."""
        if self._closed:
            return
        self._closed = True
        try:
            self._toucher.join()
            self._ring.stop()
            if self._cuda:
                for e in self._copied:
                    e.synchronize()
        finally:
            try:
                self._close_files()
            finally:
                self._pins.release()

    def _close_files(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

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

    Counters: ``bytes_streamed`` (bytes of layers handed to forwards), ``bytes_read`` (bytes copied host -> device,
    prefetch included); ``wait_seconds`` stays 0 (waits happen on the GPU).

    The host buffers are page-locked in place (:class:`PinnedHost`) and unlocked by :meth:`close` (or when building
    fails half-way).
    """

    def __init__(self, source, layout: LayerLayout, layers: list[int], n_slots: int = 2, device="cuda",
                 native: bool = True):
        if not torch.cuda.is_available():
            raise SubspecError("the host offload tier needs CUDA: use --offload disk on a CPU")
        self.layout, self.layers, self.n_slots = layout, list(layers), n_slots
        self.device = torch.device(device)
        self.bytes_read, self.bytes_streamed, self.wait_seconds = 0, 0, 0.0
        self._host = {}
        self._pins = PinnedHost()
        self._stream = None
        self._closed = False
        try:  # whatever fails below (a read, pinning, device memory), the buffers pinned so far are unpinned
            for i in tqdm(self.layers, desc="loading offloaded layers into pinned RAM", unit="layer"):
                buf = torch.zeros(layout.extent, dtype=torch.uint8)
                fill_layer(source, i, layout, buf)
                self._host[i] = buf  # alive until unpinned
                self._pins.pin(buf)
            self._dev = [torch.empty(layout.extent, dtype=torch.uint8, device=self.device) for _ in range(n_slots)]
            self._linears = [linears_from_views(layout.views(b), native) for b in self._dev]
            self._copied = [torch.cuda.Event() for _ in range(n_slots)]
            self._used = [torch.cuda.Event() for _ in range(n_slots)]
            self._stream = torch.cuda.Stream(device=self.device)
            self._consumed = 0
            for j in range(min(n_slots, len(self.layers))):
                self._issue(j)
        except BaseException:
            self.close()
            raise

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
        if self._closed:
            raise RuntimeError("host tier: acquire after close")
        c = self._consumed
        s = c % self.n_slots
        while i != self.layers[c % len(self.layers)]:  # resynchronize after an interrupted forward
            if i not in self.layers:
                raise RuntimeError(f"host tier: layer {i} is not offloaded")
            self.release(-1)
            c = self._consumed
            s = c % self.n_slots
        torch.cuda.current_stream(self.device).wait_event(self._copied[s])
        self.bytes_streamed += self.layout.extent
        return self._linears[s]

    def release(self, i: int) -> None:
        c = self._consumed
        self._used[c % self.n_slots].record(torch.cuda.current_stream(self.device))
        self._consumed += 1
        self._issue(c + self.n_slots)

    def close(self) -> None:
        """Wait for the copy stream to be idle, then unpin and drop the host buffers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stream is not None:
                self._stream.synchronize()  # no copy out of a pinned buffer is in flight
        finally:
            self._pins.release()
            self._host = {}
