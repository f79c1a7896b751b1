"""Layer files: the disk tier's offloaded layers, one file per layer, two formats, one home.

A layer file is a header (a first line ``subspec-layer-file <header bytes>``, then JSON, space-padded to a multiple
of 4 KiB: :data:`HEADER_BYTES` for a dense layer, more for a layer of many experts) followed by its payload, padded
to 4 KiB so that it can be read with O_DIRECT at the header's end. The header says what the file was made from (its ``format``, the model's key, the layer, the
dtype and layout, and what else its format needs) and carries a CRC-32 of each section of the payload. The formats:

- packed (:func:`subspec.tiers.packed_layers`): the payload is the layer's extent as the layout lays it out; a
  section per tensor.
- coded (:func:`subspec.codec.coded_layers`): the payload is the layer coded against its 4-bit substitute; a section
  per coded tensor.

What both use from here: :func:`write` (atomic, fsynced), :func:`scan` (the check of every file against what it must
have been made from, removing the damaged ones with a notice so they are rebuilt), :func:`read_sections` and
:func:`verify` (the disk tier checks each section as it reads the layer: one flipped bit on disk is an error, never
different weights) and :func:`damaged` (that error, naming the file, which is removed so that the next start rebuilds
it).

The checksum is the CRC-32 of zlib, computed with ISA-L (the ``isal`` package: about 28 GB/s on these CPUs, the same
values) where it is installed, else with zlib (about 4-5 GB/s). The disk tier computes it on its second thread while
the reader reads the next layer (``scripts/disk_tier_pass.py`` measures the read path).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from .cache import atomic_file, remove_entry
from .errors import SubspecError

try:  # ISA-L's CRC-32: the values of zlib.crc32, about 6x faster (both release the GIL)
    from isal.isal_zlib import crc32
except ImportError:  # a platform without its wheel
    from zlib import crc32

HEADER_BYTES = 4096
"""The unit (and the usual size) of a layer file's header; the payload starts after it, aligned for O_DIRECT."""
MAGIC = b"subspec-layer-file "
"""How a layer file starts: then the header's size in bytes, a newline, and the JSON."""
ALIGN = 4096
CHECKSUM = "crc32"


@dataclass(frozen=True)
class Checked:
    """One section of a payload and its checksum: ``name`` (for messages), ``offset`` and ``nbytes`` in the payload,
    ``crc`` (CRC-32 of those bytes)."""

    name: str
    offset: int
    nbytes: int
    crc: int


def fill_layer(source, i: int, layout, buf) -> None:
    """Write layer ``i``'s tensors from the checkpoint into ``buf`` (uint8 tensor, >= ``layout.extent`` bytes) in the
    :class:`~subspec.layout.LayerLayout`'s dtype: the payload of a packed file, what a coded one codes."""
    for name, view in layout.views(buf).items():
        view.copy_(source.tensor(f"model.layers.{i}.{name}"))


def file_name(layer: int) -> str:
    """The file name of layer ``layer`` inside its format's folder."""
    return f"layer-{layer:05d}.bin"


def checksums(payload, spans: Iterable[tuple[str, int, int]]) -> list[Checked]:
    """The CRC-32 of each section ``(name, offset, nbytes)`` of ``payload`` (anything exposing a byte buffer)."""
    view = memoryview(payload).cast("B")
    return [Checked(name, off, n, crc32(view[off:off + n])) for name, off, n in spans]


def write(path: Path, head: dict, payload, sections: list[Checked]) -> None:
    """Write a layer file atomically: ``head`` (plus ``payload_bytes`` and the section checksums) as the header (a
    multiple of 4 KiB), then ``payload`` (bytes-like) zero-padded to 4 KiB, fsynced before the rename.

    Raises:
        OSError: the file cannot be written.
    """
    view = memoryview(payload).cast("B")
    padded = -(-view.nbytes // ALIGN) * ALIGN
    full = dict(head, payload_bytes=padded, checksum=CHECKSUM,
                sections=[[s.name, s.offset, s.nbytes, s.crc] for s in sections])
    raw = json.dumps(full, separators=(",", ":")).encode()
    size = -(-(len(MAGIC) + 21 + len(raw)) // HEADER_BYTES) * HEADER_BYTES  # room for the size's digits and newline
    first = MAGIC + b"%d\n" % size
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(first + raw + b" " * (size - len(first) - len(raw)))
        f.write(view)
        f.write(bytes(padded - view.nbytes))
        f.flush()
        os.fsync(f.fileno())


def _sections(head: dict, payload: int) -> Optional[tuple[Checked, ...]]:
    """The checked sections a header lists, or None when they are malformed or outside the payload."""
    try:
        out = tuple(Checked(str(a), int(b), int(c), int(d)) for a, b, c, d in head["sections"])
    except (KeyError, TypeError, ValueError):
        return None
    if head.get("checksum") != CHECKSUM or any(s.offset < 0 or s.nbytes <= 0 or s.offset + s.nbytes > payload
                                               for s in out):
        return None
    return out


def check(path: Path, expect: dict) -> Union[dict, str, None]:
    """The header of the layer file at ``path`` when it is complete and was made from ``expect`` (every key of
    ``expect`` equal in the header); None when there is no file; else a few words saying what is wrong with it."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
            if raw.startswith(b"{"):
                return "was written by an older subspec (another header format)"
            first, _, rest = raw.partition(b"\n")
            if not first.startswith(MAGIC):
                return "is not a layer file"
            header = int(first[len(MAGIC):])
            if header < HEADER_BYTES or header % HEADER_BYTES or header > size:
                return "has a damaged header"
            rest += f.read(header - len(raw))
        head = json.loads(rest.decode().rstrip())
    except IsADirectoryError:
        return "is a folder, not a file"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError):
        return "is not a layer file"
    if not isinstance(head, dict) or "format" not in head:
        return "is not a layer file"
    if any(head.get(k) != v for k, v in expect.items()):
        return "was made from another model, dtype, layout, substitute or format version"
    try:
        payload = int(head["payload_bytes"])
    except (KeyError, TypeError, ValueError):
        return "is not a layer file"
    if payload <= 0 or payload % ALIGN or _sections(head, payload) is None:
        return "has a damaged header"
    if size != header + payload:
        return f"has {size} bytes instead of {header + payload} (truncated?)"
    return dict(head, header_bytes=header)


def scan(folder: Path, layers: Iterable[int], expect: Callable[[int], dict],
         accept: Callable[[int, Path, dict], object] = lambda i, path, head: path) -> tuple[dict, list[int]]:
    """The check-or-rebuild loop of a format: each layer's file in ``folder`` is checked (:func:`check`) against
    ``expect(layer)`` and handed to ``accept(layer, path, header)``, which returns what the caller keeps of it, or a
    string saying why the file does not fit (then it is rebuilt). A damaged file is removed with a one-line notice.

    Returns:
        (layer -> what ``accept`` returned, for the good files; the layers to build, in order).

    Raises:
        SubspecError: a damaged file cannot be removed.
    """
    found, todo = {}, []
    for i in layers:
        path = folder / file_name(i)
        got = check(path, expect(i))
        if isinstance(got, dict):
            got = accept(i, path, got)
            if not isinstance(got, str):
                found[i] = got
                continue
        if isinstance(got, str):
            remove_entry(path, got)
        todo.append(i)
    return found, todo


def read_sections(path: Path) -> tuple[int, tuple[Checked, ...], int]:
    """(payload bytes, checked sections, header bytes: where the payload starts) of a layer file that :func:`scan`
    accepted.

    Raises:
        SubspecError: the header can no longer be read (names the file and the fix).
    """
    head = check(path, {})
    if not isinstance(head, dict):
        raise SubspecError(f"the layer file {path} {head or 'is missing'}: restart to rebuild it")
    payload = int(head["payload_bytes"])
    return payload, _sections(head, payload), int(head["header_bytes"])


def verify(payload: memoryview, sections: tuple[Checked, ...], base: int = 0) -> Optional[str]:
    """None when every section of ``payload`` (the file's payload as read, from payload offset ``base``: a part of it
    read alone) has its checksum, else which one does not."""
    for s in sections:
        got = crc32(payload[s.offset - base:s.offset - base + s.nbytes])
        if got != s.crc:
            return f"section {s.name} fails its CRC-32 ({got:08x} instead of {s.crc:08x})"
    return None


def damaged(path: Path, kind: str, what: str) -> SubspecError:
    """The error of a layer whose ``kind`` ('packed', 'coded') file at ``path`` turned out damaged (``what``) while it
    was read; the file is removed so that the next start rebuilds it."""
    try:
        path.unlink(missing_ok=True)
        fix = "it was removed: restart to rebuild it"
    except OSError:
        fix = "delete it to rebuild it"
    return SubspecError(f"the {kind} layer file {path} is damaged ({what}): {fix}")
