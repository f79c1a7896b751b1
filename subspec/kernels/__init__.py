"""Native CPU kernels on Intel AMX: batch-invariant BF16 linears, 4-bit substitute linears, tree attention.

The operators (``torch.ops.subspec.*``, source in ``csrc/kernels.cpp``) are built once per machine with torch's C++
extension builder (a C++ compiler and ninja are needed) and cached under the subspec cache folder, keyed by the
source, torch and Python versions, in ``$SUBSPEC_KERNELS_CACHE`` or ``~/.cache/subspec-kernels`` (shared by every
subspec cache folder, so a fresh ``$SUBSPEC_CACHE`` does not rebuild them). Where the CPU lacks AMX / AVX-512 BF16, the platform is not Linux x86-64, or the
build fails (the CPU needs AMX-BF16, AMX-INT8, AVX-512 BF16 and VBMI2), :func:`native` returns False, one line says why (:func:`status`), and subspec runs on torch's own
kernels: the same math, but a BF16 forward over many tokens is then not bit-identical row by row to a one-token
forward (design.md §3.5), and 4-bit substitutes cost more per row.

Operators (all tensors on the CPU):

- ``linear_bf16(x [M, K] bf16, w [N, K] bf16, bias [N] | None) -> [M, N] bf16``: fp32 accumulation in a fixed
  order per output element, whatever M (batch-invariant). N % 16 == 0, K % 32 == 0.
- ``linear_w4(x [M, K] bf16, codes, scale [N/16, G, 16] bf16, shift, group, bias [N] | None) -> [M, N] bf16``:
  ``x @ (codes * scale + shift)^T`` on AMX-INT8: the 4-bit codes multiply the activations (quantized per row and
  group to 15 bits, split into two signed bytes) as integers, exact in int32; each group's scale and shift are
  applied in fp32 once per output element (see the kernel's comment for the formula). Batch-invariant.
- ``pack_w4(codes [N, K] uint8, group) -> [N/16, K/kblock, kblock/8, 64] uint8``, kblock = 64 (32 for a group of 32):
  the codes as AMX-INT8 B tiles, two tile rows per 64 bytes (low and high nibbles).
- ``tree_attention(q [T, H, D], k_cache [KVH, S, D], v_cache, prefix, ancestors [T, N] bool, positions [T], window,
  scale) -> [T, H, D]``: each query over the committed prefix then its ancestors, in position order.
- ``w4_delta_encode(w [N, K] bf16, codes, scale, shift, group) -> stream uint8`` and ``w4_delta_decode(stream, codes,
  scale, shift, group, out [N, K] bf16) -> bytes consumed``: a weight coded losslessly against its 4-bit substitute
  (one byte of difference to the substitute's BF16 prediction in BF16's ordered-integer view, or an escape and the
  raw bits; :mod:`subspec.codec`); the decoder may run in place over a stream at the end of its output buffer.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc") / "kernels.cpp"
_CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
           "-mavx512vbmi2", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mfma", "-mf16c"]
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vbmi2", "amx_tile", "amx_bf16", "amx_int8")

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _unsupported_reason() -> str | None:
    if os.environ.get("SUBSPEC_NATIVE_KERNELS", "1") == "0":
        return "disabled by SUBSPEC_NATIVE_KERNELS=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"no native kernels for {sys.platform}/{platform.machine()} (they need Linux x86-64 with AMX)"
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def _kernels_root() -> Path:
    """Where builds live: $SUBSPEC_KERNELS_CACHE, else ~/.cache/subspec-kernels, else the subspec cache folder."""
    from ..cache import cache_root

    env = os.environ.get("SUBSPEC_KERNELS_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "subspec-kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return cache_root() / "kernels"


def _build_dir() -> tuple[Path, str]:
    h = hashlib.sha256(_CSRC.read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}".encode())
    digest = h.hexdigest()[:12]
    return _kernels_root() / digest, f"subspec_kernels_{digest}"


def _load() -> str | None:
    """Build (once) and load the operators; return None on success, else the reason they are unavailable."""
    reason = _unsupported_reason()
    if reason:
        return reason
    try:
        folder, name = _build_dir()
        library = folder / f"{name}.so"
        if library.is_file():
            torch.ops.load_library(str(library))
        else:
            _build(folder, name)
    except Exception as e:  # no compiler, no ninja, a failed build: torch's kernels take over
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"the native kernels could not be built ({type(e).__name__}: {first[:200]})"
    if not torch.ops.subspec.amx_usable():
        return "the operating system refused AMX to this process"
    return None


def _build(folder: Path, name: str) -> None:
    """Compile the operators into a private folder, load them, then publish the folder as ``folder`` by one rename.

    An interrupted build (Ctrl-C, a killed process) leaves no half-built folder and no lock behind (torch's builder
    would make every later start wait forever on a stale lock file in a shared build folder); builds racing in two
    processes both succeed, the first rename wins.
    """
    import shutil
    import tempfile

    from torch.utils import cpp_extension

    print("subspec: building the native AMX kernels (one time, about a minute)", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        cpp_extension.load(name=name, sources=[str(_CSRC)], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(tmp), is_python_module=False, verbose=False)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process published it first (or a stale folder without the library is there)
            if not (folder / f"{name}.so").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; the loaded library stays mapped


def native() -> bool:
    """Whether the native operators are loaded (built on the first call; later calls are free)."""
    if "reason" not in _state:
        with _lock:
            if "reason" not in _state:
                reason = _load()
                _state["reason"] = reason
                if reason:
                    print(f"subspec: note: {reason}; using torch's kernels (BF16 verification is then not "
                          "batch-invariant)", file=sys.stderr, flush=True)
    return _state["reason"] is None


def status() -> str:
    """'amx' when the native operators are in use, else why not."""
    native()
    return "amx" if _state["reason"] is None else str(_state["reason"])


def linear_fits(out_features: int, in_features: int) -> bool:
    """Whether a [out, in] weight has a shape the native linears take (out % 16 == 0 and in % 32 == 0)."""
    return out_features % 16 == 0 and in_features % 32 == 0


def attention_fits(head_dim: int) -> bool:
    """Whether the native tree attention takes this head size (a multiple of 16, at most 256)."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 256
