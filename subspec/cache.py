"""The user cache folder and atomic writes.

Everything subspec derives from a model (a GGUF converted to safetensors, the packed layer file of the disk
tier, quantized substitutes, calibration) lives under ``$SUBSPEC_CACHE`` or ``~/.cache/subspec``. Every entry is
written into a temporary name beside its final path and renamed into place, so an interrupted run (Ctrl-C,
crash, full disk) never leaves a half-written entry that a later run would trust.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import SubspecError


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


def file_key(path: Path, *parts: object) -> str:
    """A short hash naming a cache entry derived from ``path`` (its absolute path, size and mtime) and ``parts``."""
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    for p in parts:
        h.update(f"|{p}".encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a temporary folder beside ``final``; on success rename it to ``final``, on any error remove it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
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
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
