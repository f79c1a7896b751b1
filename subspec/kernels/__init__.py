"""Native CPU kernels in tiers, one per instruction set: batch-invariant BF16 linears, 4-bit substitute linears, tree
attention, the fused norm/RoPE/SwiGLU operators, a whole 4-bit substitute layer, and the codec of offloaded layers.

Tiers, best first (:data:`TIERS`): ``amx`` (Intel AMX + AVX-512 BF16), ``avx512`` (AVX-512 F/BW/VL/DQ, using BF16,
VNNI and VBMI2 where the CPU has them), ``avx2`` (x86-64-v3: AVX2 + FMA + F16C) and ``portable`` (plain C++ with
compiler vectorization; any target a C++ compiler builds for, ARM included, compiled for the CPU's own instruction set:
:func:`_native_isa`). The source (``csrc/``: one driver per operator in ``drivers.h`` over a tier's micro-kernels in
``tier_<name>.h``) is built once per machine and tier with torch's C++ extension builder (a C++ compiler and ninja are
needed) and cached in ``$SUBSPEC_KERNELS_CACHE`` or ``~/.cache/subspec-kernels``, keyed by the source, the flags,
torch and Python (the portable build also by the CPU's features). Each tier registers its operators as
``torch.ops.subspec_<tier>.*``, so several tiers can be loaded in one process (the tests run every tier the CPU can).

The active tier is the best one this CPU runs that builds; ``SUBSPEC_KERNELS=amx|avx512|avx2|portable`` forces one
(an error if this CPU cannot run it), ``SUBSPEC_NATIVE_KERNELS=0`` uses torch's kernels (BF16 verification is then
not batch-invariant: see design.md §3.5). Where no tier can be built, one line says why (:func:`status`) and subspec
runs on torch's kernels.

Operators (all tensors on the CPU; torch.ops.subspec_<tier>.<name>):

- ``linear_bf16(x [M, K] bf16, w [N, K] bf16, bias [N] | None) -> [M, N] bf16``: fp32 accumulation in an order fixed
  per output element, whatever M (batch-invariant). N % 16 == 0, K % 32 == 0.
- ``linear_w4(x [M, K] bf16, codes, scale [N/16, G, 16] bf16, shift, group, bias [N] | None) -> [M, N] bf16``:
  ``x @ (codes * scale + shift)^T`` with the 4-bit codes multiplying the activations as integers (quantized per row and
  group to 8 bits), exact in int32, each group's scale and shift applied in fp32 once
  per output element. Batch-invariant.
- ``pack_w4(codes [N, K] uint8, group) -> [N/16, K/kblock, kblock/8, 64] uint8``, kblock = 64 (32 for a group of 32):
  the codes of 16 output rows x 8 columns per 64 bytes, one dword per row (the layout every tier reads).
  ``pack_w4_nibbles(codes [N, K/2] uint8, group)``: the same from codes two a byte (:func:`subspec.quant.pack_codes`);
  ``pack_w4_nibbles_(codes, group)``: the same in place (codes contiguous; returns the layout as a view of them).
- ``tree_attention(q [T, H, D], k_cache [KVH, S, D], v_cache, prefix, ancestors [T, N] bool, positions [T], window,
  scale) -> [T, H, D]``: each query over the committed prefix then its ancestors, in position order.
- ``rms_norm``, ``rope``, ``silu_mul``, ``layers_w4`` (a run of 4-bit substitute layers in one call): see
  ``csrc/drivers.h``.
- ``expand_topk(logits [R, n] bf16 | fp32, scores [R] fp32, k, inv_t) -> (values [k] fp32, flat indices [k] int64)``:
  the draft tree's next frontier, the k best ``scores[r] + log_softmax(logits[r] * inv_t)[c]`` (descending, equal
  values in (row, column) order; :meth:`subspec.speculation.SubSpecDraft._expand`).
- ``w4_delta_encode(w [N, K] bf16, codes, scale, shift, group) -> stream uint8`` and ``w4_delta_decode(stream, codes,
  scale, shift, group, out [N, K] bf16) -> bytes consumed``: a weight coded losslessly against its 4-bit substitute
  (:mod:`subspec.codec`; the format, identical on every tier, in ``csrc/common.h``).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from ..errors import SubspecError

log = logging.getLogger(__name__)

TIERS = ("amx", "avx512", "avx2", "portable")
"""Kernel tiers, best first."""

_CSRC = Path(__file__).with_name("csrc")
_BASE_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off"]
_X86_V3 = ["-mavx2", "-mfma", "-mf16c", "-mpopcnt"]
_AVX512 = _X86_V3 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_REQUIRED = {  # /proc/cpuinfo flags a tier needs
    "amx": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
            "avx512_vbmi2", "amx_tile", "amx_bf16", "popcnt"),
    "avx512": ("avx2", "fma", "f16c", "popcnt", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma", "f16c", "popcnt"),
    "portable": (),
}
_OPTIONAL = {"avx512": (("avx512_bf16", "-mavx512bf16"), ("avx512_vnni", "-mavx512vnni"),
                        ("avx512_vbmi2", "-mavx512vbmi2"))}

_lock = threading.RLock()
_loaded: dict[str, str | None] = {}  # tier -> None (loaded) or why it is not available
_state: dict[str, object] = {}  # "active": the tier in use or None, "reason": why none


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (x86's ``flags``, ARM's ``Features``; empty where there is
    no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _x86_linux() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def missing_flags(tier: str) -> list[str]:
    """The CPU flags ``tier`` needs that this CPU lacks (all of an x86 tier's off Linux x86-64)."""
    need = _REQUIRED[tier]
    if need and not _x86_linux():
        return list(need)
    have = cpu_flags()
    return [f for f in need if f not in have]


def supported() -> list[str]:
    """The tiers this CPU can execute, best first (``portable`` always)."""
    return [t for t in TIERS if not missing_flags(t)]


def _native_isa() -> list[str]:
    """The compiler flag that targets this CPU's own instruction set (``-march=native`` on x86, ``-mcpu=native`` on
    ARM, where it adds e.g. the dot-product and SVE extensions to NEON), or none on other architectures."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64") or machine.startswith("armv"):
        return ["-mcpu=native"]
    return []


def _cpu_identity() -> str:
    """What a build for this CPU's own instruction set depends on: the architecture and the CPU's features
    (:func:`cpu_flags`; the CPU's name where there is no /proc/cpuinfo)."""
    features = cpu_flags()
    name = ""
    if not features and sys.platform == "darwin":
        import subprocess

        with contextlib.suppress(OSError, subprocess.SubprocessError):
            name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
    return f"{platform.machine()}|{name}|{' '.join(sorted(features))}"


def _flags(tier: str, native: bool = True) -> list[str]:
    """The compiler flags of ``tier``'s build. The ISA tiers name their instruction sets; the portable tier is built
    for this CPU's own (:func:`_native_isa`; ``native=False``: the architecture's baseline, its fallback where the
    compiler refuses the native flag), so the compiler vectorizes its plain C++ for what the CPU has."""
    have = cpu_flags()
    isa = {"amx": _AVX512 + ["-mavx512bf16", "-mavx512vnni", "-mavx512vbmi2", "-mamx-tile", "-mamx-bf16"],
           "avx512": _AVX512 + [flag for cpu, flag in _OPTIONAL["avx512"] if cpu in have],
           "avx2": _X86_V3, "portable": _native_isa() if native else []}[tier]
    return _BASE_FLAGS + isa + [f"-DSUBSPEC_TIER_{tier.upper()}", f"-DSUBSPEC_NS=subspec_{tier}"]


def _kernels_root() -> Path:
    """Where builds live: $SUBSPEC_KERNELS_CACHE, else ~/.cache/subspec-kernels, else (neither writable) the subspec
    cache folder's ``kernels/``, created here.

    Raises:
        SubspecError: none of them can be written.
    """
    from ..cache import cache_root

    env = os.environ.get("SUBSPEC_KERNELS_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "subspec-kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    fallback = cache_root() / "kernels"  # (a HOME that cannot be written: the writable cache folder)
    try:
        fallback.mkdir(exist_ok=True)
    except OSError as e:
        raise SubspecError(f"the kernel build folder {fallback} cannot be made ({e.strerror}): set "
                           "SUBSPEC_KERNELS_CACHE to a writable folder") from None
    return fallback


def _build_dir(tier: str, flags: list[str] | None = None) -> tuple[Path, str]:
    """The build folder and library name of ``tier`` built with ``flags`` (default :func:`_flags`), keyed by the
    source, the flags, torch and Python, and for a build with a ``native`` flag by the CPU (:func:`_cpu_identity`:
    a home folder shared by machines of different CPUs keeps one build per CPU)."""
    flags = _flags(tier) if flags is None else flags
    h = hashlib.sha256()
    for f in sorted(_CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}".encode())
    if any(f.endswith("=native") for f in flags):
        h.update(_cpu_identity().encode())
    digest = h.hexdigest()[:12]
    return _kernels_root() / f"{tier}-{digest}", f"subspec_kernels_{tier}_{digest}"


def _build(tier: str, folder: Path, name: str, flags: list[str], quiet: bool = False) -> None:
    """Compile one tier into a private folder, load it, then publish the folder as ``folder`` by one rename.

    An interrupted build (Ctrl-C, a killed process) leaves no half-built folder and no lock behind (torch's builder
    would make every later start wait forever on a stale lock file in a shared build folder); builds racing in two
    processes both succeed, the first rename wins.
    """
    import shutil
    import tempfile

    from torch.utils import cpp_extension

    if not quiet:
        print(f"subspec: building the native {tier} kernels (one time, about a minute)", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        cpp_extension.load(name=name, sources=[str(_CSRC / "ops.cpp")], extra_cflags=flags,
                           extra_include_paths=[str(_CSRC)], extra_ldflags=["-fopenmp"], build_directory=str(tmp),
                           is_python_module=False, verbose=False)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process published it first (or a stale folder without the library is there)
            if not (folder / f"{name}.so").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; the loaded library stays mapped


def _load_build(tier: str, quiet: bool) -> None:
    """Load ``tier``'s library, building it first where it is not cached; a portable build the compiler refuses for
    this CPU's own instruction set is made for the architecture's baseline instead (the same source).

    Raises:
        Exception: the build failed (no compiler, no ninja, a compile error): whatever torch's builder raised.
    """
    candidates = [_flags(tier)]
    if tier == "portable" and _native_isa():
        candidates.append(_flags(tier, native=False))
    for flags in candidates:  # a cached build first: a refused native flag is not tried again at every start
        folder, name = _build_dir(tier, flags)
        library = folder / f"{name}.so"
        if library.is_file():
            torch.ops.load_library(str(library))
            return
    for i, flags in enumerate(candidates):
        folder, name = _build_dir(tier, flags)
        try:
            _build(tier, folder, name, flags, quiet)
            return
        except Exception as e:
            if i + 1 == len(candidates):
                raise
            log.info("the %s kernels did not build with %s (%s): building for the baseline", tier, flags, e)


def compile_check(tier: str, timeout: float = 600.0) -> str | None:
    """Compile ``tier``'s source for its instruction set without building a library, whatever this CPU can run: the
    C++ compiler (``$CXX``, else ``c++``, as torch's builder) with the tier's flags and ``-fsyntax-only``, which
    still instantiates every template the tier's operators use. A change to the drivers that every tier shares is
    thus caught on a machine that cannot execute the tier it breaks (AMX or AVX-512 from an AVX2 machine) instead of
    on a user's, where the tier would silently not build. About 10 s a tier on 2 cores.

    Returns:
        None where it compiles, else the compiler's first error lines (or why the compiler did not run).

    Raises:
        ValueError: ``tier`` is not one of :data:`TIERS`.
    """
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    if tier not in TIERS:
        raise ValueError(f"unknown kernel tier '{tier}': one of {', '.join(TIERS)}")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(_CSRC)]
    cmd = [os.environ.get("CXX", "c++"), "-fsyntax-only", *_flags(tier), f"-DTORCH_EXTENSION_NAME=check_{tier}",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *[f"-I{p}" for p in includes], str(_CSRC / "ops.cpp")]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the compiler did not run: {e}"
    if out.returncode == 0:
        return None
    errors = [line for line in out.stderr.splitlines() if "error" in line] or out.stderr.splitlines()[-5:]
    return "\n".join(errors[:5])


def load(tier: str, quiet: bool = False) -> str | None:
    """Build (once per machine) and load ``tier``'s operators; return None on success, else why it is unavailable.

    Raises:
        ValueError: ``tier`` is not one of :data:`TIERS`.
    """
    if tier not in TIERS:
        raise ValueError(f"unknown kernel tier '{tier}': one of {', '.join(TIERS)}")
    with _lock:
        if tier in _loaded:
            return _loaded[tier]
        missing = missing_flags(tier)
        if missing:
            reason = f"this CPU lacks {', '.join(missing)}"
        else:
            try:
                _load_build(tier, quiet)
                usable = ops(tier, ensure=False).usable()
                reason = None if usable else "the operating system refused AMX to this process"
            except KeyboardInterrupt:
                raise
            except Exception as e:  # no compiler, no ninja, a failed build
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                reason = f"the native {tier} kernels could not be built ({type(e).__name__}: {first[:200]})"
        _loaded[tier] = reason
        return reason


def check_forced() -> str | None:
    """The tier ``SUBSPEC_KERNELS`` forces (None: none forced, or native kernels disabled), checked without building
    anything: the command line calls it first, so a wrong value fails in a second, before a model is opened.

    Raises:
        SubspecError: the value names no tier, or a tier this CPU lacks the instructions for (one line each).
    """
    if os.environ.get("SUBSPEC_NATIVE_KERNELS", "1") == "0":
        return None
    forced = os.environ.get("SUBSPEC_KERNELS", "").strip().lower()
    if not forced:
        return None
    if forced not in TIERS:
        raise SubspecError(f"SUBSPEC_KERNELS={forced} is not a kernel tier: use one of {', '.join(TIERS)}")
    missing = missing_flags(forced)
    if missing:
        raise SubspecError(f"SUBSPEC_KERNELS={forced}: this CPU lacks {', '.join(missing)}; "
                           f"this CPU runs {', '.join(supported())}")
    return forced


def _choose() -> tuple[str | None, str | None]:
    """(the active tier, None) or (None, why there is none)."""
    if os.environ.get("SUBSPEC_NATIVE_KERNELS", "1") == "0":
        return None, "disabled by SUBSPEC_NATIVE_KERNELS=0"
    forced = check_forced()
    if forced:
        reason = load(forced)
        if reason:
            raise SubspecError(f"SUBSPEC_KERNELS={forced}: {reason}; this CPU runs {', '.join(supported())}")
        return forced, None
    reasons = []
    for tier in supported():
        reason = load(tier)
        if reason is None:
            if reasons:
                print(f"subspec: note: {'; '.join(reasons)}; using the {tier} kernels", file=sys.stderr, flush=True)
            return tier, None
        reasons.append(reason)
    return None, "; ".join(reasons) or "no kernel tier for this CPU"


def active() -> str | None:
    """The tier in use (chosen on the first call: built if needed), or None (torch's kernels)."""
    if "active" not in _state:
        with _lock:
            if "active" not in _state:
                tier, reason = _choose()
                if reason:
                    print(f"subspec: note: {reason}; using torch's kernels (BF16 verification is then not "
                          "batch-invariant)", file=sys.stderr, flush=True)
                _state["reason"] = reason
                _state["active"] = tier
    return _state["active"]


def native() -> bool:
    """Whether a native tier is in use (chosen and built on the first call; later calls are free)."""
    return active() is not None


def status() -> str:
    """The tier in use (``amx``, ``avx512``, ``avx2``, ``portable``), else why none."""
    tier = active()
    return tier if tier is not None else str(_state["reason"])


def build_id() -> str:
    """The kernels in use as ``<tier>-<digest>`` (the digest of their sources, build flags, torch and Python: the
    build folder's name), else :func:`status`'s reason. A cache of what was measured with them (the calibration,
    :mod:`subspec.policy`) keys on this, so a new build of the kernels is measured again."""
    tier = active()
    return _build_dir(tier)[0].name if tier is not None else status()


def ops(tier: str | None = None, ensure: bool = True):
    """The operator namespace of ``tier`` (default: the active tier), ``torch.ops.subspec_<tier>``.

    Raises:
        RuntimeError: the tier is not available (no active tier, or ``tier`` could not be loaded).
    """
    tier = tier or active()
    if tier is None:
        raise RuntimeError(f"no native kernels: {status()}")
    if ensure:
        reason = load(tier)
        if reason:
            raise RuntimeError(f"the {tier} kernels are unavailable: {reason}")
    return getattr(torch.ops, f"subspec_{tier}")


@contextlib.contextmanager
def using(tier: str | None):
    """Make ``tier`` the active tier inside the block (None: torch's kernels), then restore the previous one: what is
    built inside keeps the tier it was built with (tests and benchmarks compare tiers in one process).

    Raises:
        RuntimeError: ``tier`` cannot run here.
    """
    if tier is not None:
        reason = load(tier)
        if reason:
            raise RuntimeError(f"the {tier} kernels are unavailable: {reason}")
    with _lock:
        active()
        saved = dict(_state)
        _state.update(active=tier, reason=None if tier else "disabled for this block")
    try:
        yield
    finally:
        with _lock:
            _state.clear()
            _state.update(saved)


def linear_fits(out_features: int, in_features: int) -> bool:
    """Whether a [out, in] weight has a shape the native linears take (out % 16 == 0 and in % 32 == 0)."""
    return out_features % 16 == 0 and in_features % 32 == 0


def attention_fits(head_dim: int) -> bool:
    """Whether the native tree attention takes this head size (a multiple of 16, at most 256)."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 256
