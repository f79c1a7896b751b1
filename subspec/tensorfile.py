"""Reading and writing safetensors files one tensor at a time, in bounded memory.

The format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data section) plus an optional
``"__metadata__"`` of strings, then the data section at ``8 + N``.

:class:`TensorFile` validates the header against the file size once and reads each tensor with ``pread`` into memory
it owns (no memory map stays behind, so reading a whole model never grows the resident set beyond the tensors
kept). :class:`TensorFileWriter` lays out the header first from the names, dtypes and shapes, then takes the tensors in
any order (``pwrite``): a converter never holds more than one tensor.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


class TensorFileError(ValueError):
    """A file that is not a complete safetensors file (the message says what is wrong)."""


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= int(d)
    return n


DIRECT_CHUNK = 16 << 20
"""Bytes of the aligned buffer through which a direct read takes what does not start and end on a 4 KiB page of both
the file and the memory (:class:`TensorFile` with ``direct``)."""
DIRECT_ALIGN = 4096
"""O_DIRECT's alignment of file offsets, memory addresses and lengths (the page: any block size up to it divides it)."""
DIRECT_MIN = 1 << 20
"""Tensors of fewer bytes are read through the page cache even with ``direct`` (a few pages either way)."""


class TensorFile:
    """An open safetensors file: header validated against the file size, tensors read on demand.

    Args:
        path: the file. direct: read tensors of :data:`DIRECT_MIN` bytes or more with O_DIRECT where the
            filesystem takes it, straight into the tensor's memory (allocated 4 KiB longer, and placed so that its
            address agrees with the file offset modulo 4 KiB: the tensor's pages are read in one request, which
            the kernel splits across the device's queue: 1.37 GB/s against 0.8-1.0 GB/s in 16 MiB reads on this
            project's disks); its unaligned first and last bytes go through a small aligned buffer. A file read
            once per start (the substitutes, the embedding and lm_head) does not go through the page cache, whose
            reclaim under a memory cap read them at a third of the disk's rate; a file read again soon (a
            checkpoint both quantized and coded) should not.

    Raises:
        TensorFileError: truncated, longer than its header says, or not safetensors.
        OSError: the file cannot be opened.
    """

    def __init__(self, path: Path, direct: bool = False):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self._direct_fd, self._buf = -1, None
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self._direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                except OSError:  # a filesystem without O_DIRECT: buffered reads
                    self._direct_fd = -1
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise TensorFileError(f"only {size} bytes, not even a header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise TensorFileError(f"header of {n} bytes does not fit the file of {size} bytes")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            end = 0
            for name, e in header.items():
                dtype, shape, (b, f) = DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), e["data_offsets"]
                if f - b != _nbytes(dtype, shape) or b < 0:
                    raise TensorFileError(f"tensor {name} has {f - b} bytes for shape {list(shape)}")
                self.entries[name] = (dtype, shape, 8 + n + b, f - b)
                end = max(end, f)
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            if isinstance(e, TensorFileError):
                raise
            raise TensorFileError(f"unreadable header ({type(e).__name__}: {e})") from None
        if 8 + n + end != size:
            raise TensorFileError(f"{size} bytes where the header expects {8 + n + end} (truncated?)")

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def nbytes(self, name: str) -> int:
        return self.entries[name][3]

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (CPU, stored dtype) in freshly allocated memory.

        Raises:
            KeyError: no such tensor. OSError: the read failed or ended early.
        """
        dtype, shape, off, n = self.entries[name]
        return self._read_bytes(off, n, name, dtype.itemsize).view(dtype).reshape(shape)

    def read_run(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (CPU, stored dtypes) as views of one fresh buffer, read in one go, where they lie back
        to back in the file in this order, each at an offset of whole elements; otherwise each read on its own
        (:meth:`read`). One buffer keeps all of them alive (for tensors used together, e.g. a layer's codes).

        Raises:
            KeyError: no such tensor. OSError: the read failed or ended early.
        """
        ents = [self.entries[n] for n in names]
        off0 = ents[0][2] if ents else 0
        if (len(ents) < 2 or any(a[2] + a[3] != b[2] for a, b in zip(ents, ents[1:]))
                or any(off % dtype.itemsize or (off - off0) % dtype.itemsize for dtype, _, off, _ in ents)):
            return {n: self.read(n) for n in names}
        # placed at off0 modulo a page (direct) or at an aligned base (buffered): every element aligned either way
        raw = self._read_bytes(off0, ents[-1][2] + ents[-1][3] - off0, names[0], 1)
        return {n: raw[off - off0:off - off0 + nb].view(dtype).reshape(shape)
                for n, (dtype, shape, off, nb) in zip(names, ents)}

    def _read_bytes(self, off: int, n: int, name: str, itemsize: int) -> torch.Tensor:
        """``n`` bytes from ``off`` in fresh memory (uint8 [n]). Direct reads of ``DIRECT_MIN`` bytes or more place
        them at an address that agrees with ``off`` modulo :data:`DIRECT_ALIGN` (the page-aligned body in one request),
        unless ``off`` is not a multiple of ``itemsize`` (then elements would be misaligned: fresh memory, chunked)."""
        if self._direct_fd >= 0 and n >= DIRECT_MIN and off % itemsize == 0:
            raw = torch.empty(n + DIRECT_ALIGN, dtype=torch.uint8)
            at = (off - raw.data_ptr()) % DIRECT_ALIGN  # the bytes' address agrees with their offset modulo a page
            buf = raw[at:at + n]
            self._pread_direct(memoryview(buf.numpy()), off, name, buf.data_ptr())
        elif self._direct_fd >= 0 and n >= DIRECT_MIN:  # a misaligned element: the tensor in fresh memory
            buf = torch.empty(n, dtype=torch.uint8)
            self._pread_direct(memoryview(buf.numpy()), off, name)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
            self._pread(memoryview(buf.numpy()), off, name)
        return buf

    def read_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """Rows ``rows`` of the tensor ``name`` ([len(rows), *shape[1:]], stored dtype), read one by one without
        touching the others (e.g. the embedding rows of a forward's tokens).

        Raises:
            KeyError: no such tensor. OSError: the read failed or ended early.
        """
        dtype, shape, off, n = self.entries[name]
        row = n // shape[0]
        buf = torch.empty(len(rows) * row, dtype=torch.uint8)  # flat: the view below slices bytes
        view = memoryview(buf.numpy())
        for j, r in enumerate(rows):
            self._pread(view[j * row:(j + 1) * row], off + r * row, name)
        return buf.view(dtype).view(len(rows), *shape[1:])

    def _pread(self, view: memoryview, offset: int, name: str) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path} ended early while reading {name}")
            done += got

    def _pread_direct(self, view: memoryview, offset: int, name: str, addr: int = 0) -> None:
        """``len(view)`` bytes from ``offset`` with O_DIRECT. Where the view's address ``addr`` agrees with
        ``offset`` modulo :data:`DIRECT_ALIGN` (:meth:`read` places it so), the whole pages between its first and
        last page boundary are read into it in one request; the rest (or all of it, where ``addr`` is 0 or does
        not agree) goes through an aligned buffer of :data:`DIRECT_CHUNK` bytes."""
        n = len(view)
        head = -offset % DIRECT_ALIGN
        if addr and (addr - offset) % DIRECT_ALIGN == 0 and n - head >= DIRECT_ALIGN:
            body = (n - head) // DIRECT_ALIGN * DIRECT_ALIGN
            done = 0
            while done < body:  # one request (the kernel caps one at 2 GiB - 4 KiB): any rest is read the same way
                got = os.preadv(self._direct_fd, [view[head + done:head + body]], offset + head + done)
                if got <= 0:
                    raise OSError(f"{self.path} ended early while reading {name}")
                done += got
            if head:
                self._pread_buffered_direct(view[:head], offset, name)
            if head + body < n:
                self._pread_buffered_direct(view[head + body:], offset + head + body, name)
            return
        self._pread_buffered_direct(view, offset, name)

    def _pread_buffered_direct(self, view: memoryview, offset: int, name: str) -> None:
        """``len(view)`` bytes from ``offset`` with O_DIRECT: 4 KiB-aligned spans through an aligned buffer."""
        from .hostmem import huge_page_map

        if self._buf is None:
            self._buf = huge_page_map(DIRECT_CHUNK)  # page-aligned, private (as the disk tier's slots)
        done = 0
        with memoryview(self._buf) as scratch:  # released before the buffer can be closed
            while done < len(view):
                pos = offset + done
                start = pos - pos % DIRECT_ALIGN
                want = min(DIRECT_CHUNK, -(-(pos + len(view) - done - start) // DIRECT_ALIGN) * DIRECT_ALIGN)
                got = os.preadv(self._direct_fd, [scratch[:want]], start)
                take = min(got - (pos - start), len(view) - done)
                if take <= 0:
                    raise OSError(f"{self.path} ended early while reading {name}")
                view[done:done + take] = scratch[pos - start:pos - start + take]
                done += take

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    def __del__(self):
        try:
            self.close()
        except OSError:
            pass


class TensorFileWriter:
    """Write a safetensors file whose tensors arrive one at a time, in any order.

    Args:
        path: the file to create. entries: (name, dtype, shape) of every tensor, in storage order.
        metadata: string key/values stored as ``__metadata__``.

    :meth:`write` each tensor once, then :meth:`close` (checks that every tensor was written, then fsyncs); as a
    context manager it closes on success and aborts on an exception.
    """

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata or {})}
        off = 0
        self._where: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        for name, dtype, shape in entries:
            n = _nbytes(dtype, shape)
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            self._where[name] = (off, n, dtype, tuple(shape))
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 64)  # data section 64-byte aligned
        self._data_start = 8 + len(raw)
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self._data_start + off)
        self._pending = set(self._where)

    def write(self, name: str, tensor: torch.Tensor, row: int = 0) -> None:
        """Store ``tensor`` as ``name`` (converted to its declared dtype); ``row`` > 0 writes rows from that row on,
        so a large tensor can arrive in row chunks."""
        off, n, dtype, shape = self._where[name]
        t = tensor.to(dtype).contiguous()
        if row == 0 and tuple(t.shape) == shape:
            self._pending.discard(name)
        elif t.shape[1:] != shape[1:] or row + t.shape[0] > shape[0]:
            raise ValueError(f"{name}: rows {row}..{row + t.shape[0]} of shape {list(t.shape)} do not fit {list(shape)}")
        elif row + t.shape[0] == shape[0]:
            self._pending.discard(name)
        row_bytes = n // shape[0] if shape and shape[0] else 0
        data = memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else b""
        pos, start = 0, self._data_start + off + row * row_bytes
        while pos < len(data):
            pos += os.pwrite(self.fd, data[pos:], start + pos)

    def close(self) -> None:
        """Finish the file (fsync) and close it.

        Raises:
            ValueError: a declared tensor was never written.
        """
        if self.fd < 0:
            return
        try:
            if self._pending:
                raise ValueError(f"{self.path}: tensors never written: {sorted(self._pending)[:5]}")
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        """Close without finishing (the write was interrupted): the caller discards the file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "TensorFileWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        """:meth:`close` after a complete write; :meth:`abort` when an exception (Ctrl-C included) ends it early, so
        that the exception, not a "never written" error, is what the caller sees."""
        if kind is None:
            self.close()
        else:
            self.abort()
