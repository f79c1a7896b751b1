"""The user cache folder: content keys, atomic writes, and entries that repair themselves.

Everything subspec derives from a model (a GGUF converted to safetensors, the packed layer files of the disk tier,
quantized substitutes, calibration) lives under ``$SUBSPEC_CACHE`` or ``~/.cache/subspec``.

- Entries are named by **content**: :func:`content_digest` is the sha256 of a file's bytes, computed once per file
  version (its device, inode, size, mtime and ctime, remembered in ``digests.json``), so replacing a model's weights
  by other ones of the same shapes gives new cache entries, and a second start costs no hashing.
- Every entry is written into a temporary name beside its final path and renamed into place, so an interrupted run
  (Ctrl-C, crash, full disk) never leaves a half-written entry that a later run would trust.
- A damaged entry (truncated, foreign, of the wrong type, unreadable JSON) is rebuilt with a one-line notice
  (:func:`notice`); an entry that cannot be replaced is a one-line :class:`~subspec.errors.SubspecError`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .errors import SubspecError

log = logging.getLogger(__name__)

_HASH_CHUNK = 16 << 20


def cache_root() -> Path:
    """The cache folder, created if missing.

    Raises:
        SubspecError: the folder cannot be created or written.
    """
    root = Path(os.environ.get("SUBSPEC_CACHE") or Path.home() / ".cache" / "subspec")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".probe-", delete=True)
        probe.close()
    except OSError as e:
        raise SubspecError(
            f"cache folder {root} is not writable ({e.strerror}): set SUBSPEC_CACHE to a writable folder"
        ) from None
    return root


def notice(message: str) -> None:
    """A one-line notice to the user about the cache (shown by the CLI as ``subspec: warning: ...``)."""
    log.warning("%s", message)


def remove_entry(path: Path, why: str) -> None:
    """Delete a damaged cache entry (file or folder) with a one-line notice saying ``why`` and that it is rebuilt.

    Raises:
        SubspecError: the entry cannot be removed (names it and the fix).
    """
    notice(f"cache entry {path} {why}: rebuilding it")
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as e:
        raise SubspecError(f"cannot remove the damaged cache entry {path} ({e.strerror}): delete it by hand") from None


def cache_dir(path: Path) -> Path:
    """The cache folder ``path``, created if missing; anything else of that name is removed first (with a notice).

    Raises:
        SubspecError: it cannot be created.
    """
    root = cache_root()
    inside = path.resolve().is_relative_to(root.resolve())
    for p in [*reversed(path.parents), path]:  # the folder and its parents inside the cache
        if inside and p.resolve().is_relative_to(root.resolve()) and (p.exists() or p.is_symlink()) and not p.is_dir():
            remove_entry(p, "is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SubspecError(f"cannot create the cache folder {path} ({e.strerror}): check SUBSPEC_CACHE") from None
    return path


DISK_MARGIN = 64 << 20
"""Bytes left free beyond what a cache write needs (the filesystem's own metadata, other writers)."""


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Refuse to start writing ``needed`` bytes of ``what`` into ``folder`` when its filesystem has less free space
    (plus :data:`DISK_MARGIN`), before the first byte: a cache write that runs out of space half-way costs minutes and
    leaves the user guessing.

    Raises:
        SubspecError: one line naming the folder, the bytes needed and the bytes free, and the fix.
    """
    free = shutil.disk_usage(folder).free
    if needed + DISK_MARGIN > free:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        raise SubspecError(f"not enough disk space for {what} in {folder}: needs {gib(needed + DISK_MARGIN)} "
                           f"({gib(needed)} and a {DISK_MARGIN >> 20} MiB margin), {gib(free)} free: free some space "
                           "or set SUBSPEC_CACHE to a folder on a larger disk")


def read_json(path: Path) -> dict | None:
    """A JSON object the cache wrote earlier, or None when missing; a damaged one is removed with a notice."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        value = json.loads(path.read_text())
        if isinstance(value, dict):
            return value
        why = "does not hold a JSON object"
    except IsADirectoryError:
        why = "is a folder, not a file"
    except (ValueError, UnicodeDecodeError):
        why = "is not valid JSON (truncated?)"
    except OSError as e:
        why = f"cannot be read ({e.strerror})"
    remove_entry(path, why)
    return None


def write_json(path: Path, value: dict) -> None:
    """Write a JSON object atomically (replacing a damaged entry of that name)."""
    if path.is_dir() and not path.is_symlink():
        remove_entry(path, "is a folder, not a file")
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(value, indent=1))


def _file_version(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def content_digest(path: Path) -> str:
    """sha256 (hex) of the bytes of ``path``, computed once per file version and remembered in the cache.

    A file version is its resolved path, device, inode, size, mtime and ctime: a file replaced in any way (copied
    over, re-downloaded, edited) is hashed again. Reading bypasses nothing but drops the pages it read from the page
    cache (``posix_fadvise``), so hashing a large model does not evict everything else.

    Raises:
        SubspecError: the file cannot be read.
    """
    path = Path(path)
    memo_path = cache_root() / "digests.json"
    version = _file_version(path)
    memo = read_json(memo_path) or {}
    if version in memo:
        return memo[version]
    h = hashlib.sha256()
    size = path.stat().st_size
    try:
        with open(path, "rb", buffering=0) as f:
            bar = _progress(size, f"hashing {path.name}") if size >= 1 << 30 else None
            off = 0
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
                os.posix_fadvise(f.fileno(), off, len(chunk), os.POSIX_FADV_DONTNEED)
                off += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
            if bar is not None:
                bar.close()
    except OSError as e:
        raise SubspecError(f"cannot read {path} ({e.strerror}): check that the file exists and is readable") from None
    digest = h.hexdigest()
    memo = {k: v for k, v in (read_json(memo_path) or {}).items() if not k.startswith(str(path.resolve()) + "|")}
    memo[version] = digest
    write_json(memo_path, memo)
    return digest


def known_digest(path: Path) -> str | None:
    """The remembered :func:`content_digest` of this version of ``path`` (None: it would be computed)."""
    try:
        version = _file_version(Path(path))
    except OSError:
        return None
    return (read_json(cache_root() / "digests.json") or {}).get(version)


def _progress(total: int, desc: str):
    from .progress import bar

    return bar("content digest", total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


def short_key(*parts: object) -> str:
    """A 16-hex-digit name for a cache entry derived from ``parts`` (digests, settings)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(f"{p}|".encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a temporary folder beside ``final``; on success rename it to ``final``, on any error remove it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        elif final.exists() or final.is_symlink():
            final.unlink()
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(final: Path):
    """Yield a temporary file path beside ``final``; on success rename it to ``final``, else delete it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.tmp-")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
