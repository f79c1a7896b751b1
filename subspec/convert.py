"""GGUF to a safetensors folder in the compute dtype, tensor by tensor, in bounded memory.

The GGUF is read with the ``gguf`` package (:class:`gguf.GGUFReader` for the tensor table, ``gguf.dequantize`` for
the values); each tensor's bytes are read with ``pread`` (a row chunk at a time for large tensors, so a 7B
embedding never needs gigabytes of float32), de-quantized, passed through transformers' own per-architecture GGUF
processing (its ``TENSOR_PROCESSORS``: llama q/k un-permute, gemma norm offsets, ...) and name map
(``get_gguf_hf_weights_map``), exactly as ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` does,
then cast to the compute dtype and written into its place in a shard (:class:`~subspec.tensorfile.TensorFileWriter`).
The config, generation config and tokenizer come from transformers' GGUF support.

Mixture-of-experts GGUFs store each layer's experts stacked (``blk.N.ffn_{gate,up,down}_exps``, [experts, out, in])
and the router as ``blk.N.ffn_gate_inp``: they are split into one tensor per expert under the canonical names
(``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, ``model.layers.N.mlp.gate.weight``), one expert in
memory at a time. A ``qwen3moe`` file's expert width comes from its ``expert_feed_forward_length``; a ``llama`` file
with experts (how llama.cpp stores Mixtral) becomes a ``mixtral`` config (:func:`moe_config`).

The folder is cached by the GGUF's content digest and the dtype (bfloat16 by default; float32 only when the run
computes in float32: GGUF blocks do not de-quantize exactly into bfloat16, so FP32 runs need FP32 weights) and
written atomically.
"""
from __future__ import annotations

import contextlib
import json
import re
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .cache import atomic_dir, cache_dir, cache_root, check_free_space, remove_entry
from .errors import SubspecError
from .tensorfile import TensorFile, TensorFileError, TensorFileWriter

log = logging.getLogger(__name__)

FORMAT = "subspec-gguf-conversion/1"
SHARD_BYTES = 2 << 30
CHUNK_BYTES = 64 << 20
"""Large tensors are de-quantized in row chunks of about this many float32 bytes (bounded memory, cache-friendly)."""
MARKER = "subspec-source.json"

_ROW_MIXING = (".attn_q.", ".attn_k.")
"""GGUF tensors whose transformers processing mixes rows (llama's q/k un-permute): always processed whole."""
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _bad_gguf(gguf: Path, e: BaseException) -> SubspecError:
    return SubspecError(f"cannot read GGUF '{gguf}' ({type(e).__name__}: {' '.join(str(e).split())[:200]}): the file "
                        "is corrupted or truncated, re-download it")


_CONFIGS: dict[str, object] = {}  # file version -> config (gguf_config)


_SHARING = threading.local()  # this thread's shared readers: real path -> reader
_INSTALL_LOCK = threading.Lock()
# one_reader blocks open in the process, and what they patched: (module, attribute, original, shim) each
_INSTALL: dict = {"blocks": 0, "patched": []}


def _fast_reader(original: type) -> type:
    """:class:`~subspec.ggufread.FastGGUFReader` (metadata arrays parsed in bulk) where it derives from ``original``
    (gguf's own reader), else ``original`` (someone else's replacement: theirs is used as it is)."""
    from .ggufread import FastGGUFReader

    return FastGGUFReader if issubclass(FastGGUFReader, original) else original


def _shared_reader_class(original: type) -> type:
    """A subclass of ``original`` whose construction returns the calling thread's shared reader of a file that thread
    opened with :func:`one_reader` (read mode), and builds an ordinary reader (an instance of ``original``) otherwise."""

    base = _fast_reader(original)

    class SharedGGUFReader(base):
        def __new__(cls, path, mode="r", *args, **kwargs):
            readers = getattr(_SHARING, "readers", None)
            if readers and mode == "r":
                shared = readers.get(os.path.realpath(path))
                if shared is not None:
                    return shared  # not an instance of cls: __init__ does not run again
            return super().__new__(cls)

    SharedGGUFReader.__name__ = SharedGGUFReader.__qualname__ = original.__name__
    SharedGGUFReader.__module__ = original.__module__
    return SharedGGUFReader


def _shared_parse(original):
    """``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` that, for a metadata-only parse
    (``return_tensors=False``) of a file the calling thread opened with :func:`one_reader`, parses it once per block
    and hands each caller a copy of its own (:func:`_copy_parsed`); any other call goes to ``original``."""
    import functools

    @functools.wraps(original)
    def load_gguf_checkpoint(path, return_tensors=False, *args, **kwargs):
        parsed = getattr(_SHARING, "parsed", None)
        if return_tensors or args or kwargs or parsed is None:
            return original(path, return_tensors, *args, **kwargs)
        target = os.path.realpath(path)
        if target not in getattr(_SHARING, "readers", {}):
            return original(path, return_tensors)
        if target not in parsed:
            parsed[target] = original(path, return_tensors)
        return _copy_parsed(parsed[target])

    return load_gguf_checkpoint


def _copy_parsed(x):
    """A copy of a parsed GGUF metadata tree that shares nothing mutable with ``x``: dicts and lists copied at every
    level, a list of scalars (a GGUF array: one element type) copied in one step (``copy.deepcopy`` of Gemma 3's
    262,144-token vocabulary took as long as parsing it)."""
    if isinstance(x, dict):
        return {k: _copy_parsed(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy_parsed(v) for v in x] if x and isinstance(x[0], (list, dict, np.ndarray)) else list(x)
    if isinstance(x, np.ndarray):
        return x.copy()
    return x  # str, bytes, numbers, None: immutable


@contextlib.contextmanager
def one_reader(gguf: Path):
    """Within the block every ``gguf.GGUFReader`` of this file **built on this thread** is one reader, ours and those
    transformers' GGUF support opens (for the config, the tensor map and the tokenizer); yields that reader.

    Building a reader parses all the metadata (with gguf's own reader 5.5-15 s for Qwen2.5's 151,936-token vocabulary
    and 151,387 merges on these CPUs, 57 s for Gemma 3's 262,144 tokens on a Zen 1; 1-2.5 s with
    :class:`~subspec.ggufread.FastGGUFReader`, which the block builds); a first conversion built four. transformers
    imports ``gguf.GGUFReader`` when it needs one, so while any block is open in the process that name is a subclass of
    the original class whose construction returns the calling thread's shared reader for a file that thread opened, and
    an ordinary reader for anything else (other threads, other files, write mode): nobody else sees a difference. The
    original class is put back when the last block in the process ends (blocks of several threads may end in any order).
    Re-entrant on one thread.

    transformers also parses every metadata field into Python values at each of those uses
    (``load_gguf_checkpoint(..., return_tensors=False)``: 1.2 s each for SmolLM2's 49,152-token vocabulary, about 7 s
    for Gemma 3's on a Zen 1); within the block that parse is made once per file on the thread and each caller gets a
    copy of its own (:func:`_shared_parse`, :func:`_copy_parsed`; installed and removed the same way). And its GGUF
    name mapping (``get_gguf_hf_weights_map``) calls ``gguf.get_tensor_name_map(arch, n_blocks)`` at each of the
    model's modules (397 for SmolLM2, 30-45 ms each here: 12.75 s); while a block is open that function builds each map
    once (memoized; the maps are only read), 0.04 s.

    Raises:
        SubspecError: not a readable GGUF.
    """
    import functools

    import gguf as gguf_pkg
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    target = os.path.realpath(gguf)
    readers = getattr(_SHARING, "readers", None)
    if readers is None:
        readers = _SHARING.readers = {}
    if getattr(_SHARING, "parsed", None) is None:
        _SHARING.parsed = {}
    if target in readers:  # an outer block of this thread opened it
        yield readers[target]
        return
    with _INSTALL_LOCK:
        if _INSTALL["blocks"] == 0:
            for module, attr, make_shim in ((gguf_pkg, "GGUFReader", _shared_reader_class),
                                            (hf_gguf, "load_gguf_checkpoint", _shared_parse),
                                            (gguf_pkg, "get_tensor_name_map", functools.lru_cache(maxsize=None))):
                original = getattr(module, attr)
                shim = make_shim(original)
                setattr(module, attr, shim)
                _INSTALL["patched"].append((module, attr, original, shim))
        _INSTALL["blocks"] += 1
        original = _INSTALL["patched"][0][2]  # gguf.GGUFReader's own class
    try:
        try:
            reader = _fast_reader(original)(str(gguf))
        except Exception as e:  # the gguf reader raises many types on bad input
            raise _bad_gguf(Path(gguf), e) from None
        readers[target] = reader
        try:
            yield reader
        finally:
            del readers[target]
            _SHARING.parsed.pop(target, None)
    finally:
        with _INSTALL_LOCK:
            _INSTALL["blocks"] -= 1
            if _INSTALL["blocks"] == 0:
                for module, attr, original, shim in _INSTALL["patched"]:
                    if getattr(module, attr) is shim:
                        setattr(module, attr, original)
                    else:  # someone replaced it meanwhile: theirs stays (ours only ever defers to the original)
                        log.debug("%s.%s was replaced while a one_reader block was open; leaving it",
                                  module.__name__, attr)
                _INSTALL["patched"].clear()


def gguf_config(gguf: Path):
    """The transformers config of a GGUF file (metadata only, no tensor is read).

    Parsing a GGUF's metadata takes seconds (10 s for SmolLM2-135M's, 7-15 s for Qwen2.5's 151,936-token vocabulary
    on 2 cores), so the result is remembered per file version (path, device, inode, size, mtime, ctime): for the
    process, and in the cache (``gguf-configs.json``, written atomically), so that later starts (every command of the
    CLI plans from the config) skip the parse. A copy is returned.

    Raises:
        SubspecError: not a readable GGUF, or an architecture transformers cannot read.
    """
    import copy

    from transformers import AutoConfig

    from .cache import _file_version, cache_root, read_json, write_json

    version = _file_version(Path(gguf))
    if version not in _CONFIGS:
        memo_path = cache_root() / "gguf-configs.json"
        known = (read_json(memo_path) or {}).get(version)
        config = _config_from_dict(known) if isinstance(known, dict) else None
        if config is None:
            with one_reader(gguf) as reader:
                try:
                    config = moe_config(reader, AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
                except Exception as e:  # the gguf reader raises many types on bad input
                    raise _bad_gguf(gguf, e) from None
            path = str(Path(gguf).resolve()) + "|"
            memo = {k: v for k, v in (read_json(memo_path) or {}).items() if not k.startswith(path)}  # older versions
            memo[version] = config.to_dict()
            write_json(memo_path, memo)
        _CONFIGS[version] = config
    return copy.deepcopy(_CONFIGS[version])


def _config_from_dict(d: dict):
    """A transformers config from its remembered ``to_dict()`` (None when transformers no longer takes it)."""
    from transformers import AutoConfig

    d = dict(d)
    try:
        return AutoConfig.for_model(d.pop("model_type"), **d)
    except (KeyError, ValueError, TypeError):
        return None


def moe_config(reader, config):
    """``config`` (transformers' reading of a GGUF) with what it misses of a mixture of experts: a ``qwen3moe``
    file's expert width (``expert_feed_forward_length``; transformers keeps its default), and for a ``llama`` file
    with experts (llama.cpp's Mixtral) a ``mixtral`` config with the experts (``feed_forward_length`` is then one
    expert's width). Any other config is returned as it is."""
    from transformers import MixtralConfig
    from transformers.modeling_gguf_pytorch_utils import read_field

    arch = read_field(reader, "general.architecture")[0]
    experts = (read_field(reader, f"{arch}.expert_count") or [0])[0]
    if arch == "qwen3moe":
        width = read_field(reader, f"{arch}.expert_feed_forward_length")
        if width:
            config.moe_intermediate_size = int(width[0])
        return config
    if arch == "llama" and experts:
        keep = {k: v for k, v in config.to_dict().items()
                if k not in ("model_type", "architectures", "transformers_version", "mlp_bias", "pretraining_tp")}
        return MixtralConfig(**dict(keep, num_local_experts=int(experts),
                                    num_experts_per_tok=int(read_field(reader, f"{arch}.expert_used_count")[0]),
                                    sliding_window=None, architectures=["MixtralForCausalLM"]))
    return config


def converted_folder(gguf: Path, digest: str, dtype: torch.dtype) -> Path:
    """Where the conversion of ``gguf`` (content ``digest``) to ``dtype`` lives in the cache."""
    return cache_root() / "models" / f"{gguf.stem}-{dtype_name(dtype)}-{digest[:16]}"


def check_converted(folder: Path, digest: str, dtype: torch.dtype) -> str | None:
    """None when ``folder`` is a complete conversion of the GGUF ``digest`` to ``dtype``, else what is wrong."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as e:
        return f"has no readable {MARKER} ({type(e).__name__})"
    if marker.get("format") != FORMAT or marker.get("gguf_sha256") != digest or marker.get("dtype") != dtype_name(dtype):
        return "was made from another file or by another version"
    for name in marker.get("shards", []):
        try:
            TensorFile(folder / name).close()
        except (OSError, TensorFileError) as e:
            return f"has a damaged shard {name} ({e})"
    if not (folder / "config.json").is_file():
        return "has no config.json"
    return None


def convert_gguf(gguf: Path, digest: str, dtype: torch.dtype = torch.bfloat16, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """The cached safetensors folder of ``gguf`` in ``dtype``, converting it first if needed (progress bar).

    Args:
        gguf: the GGUF file. digest: its content digest (:func:`subspec.cache.content_digest`).
        dtype: dtype of the stored weights. chunk_bytes: float32 bytes per row chunk of large tensors.

    Returns:
        a folder with config.json, generation_config.json, the tokenizer and the weights as safetensors shards.

    Raises:
        SubspecError: the GGUF is truncated, corrupted or of an architecture transformers' GGUF support lacks.
    """
    final = converted_folder(gguf, digest, dtype)
    cache_dir(final.parent)
    if final.exists():
        why = check_converted(final, digest, dtype) if final.is_dir() else "is not a folder"
        if why is None:
            return final
        remove_entry(final, why)
    log.info("converting %s to %s safetensors (one time)", gguf, dtype_name(dtype))
    with atomic_dir(final) as tmp, one_reader(gguf):
        try:
            _convert(gguf, tmp, dtype, chunk_bytes)
        except (SubspecError, KeyboardInterrupt):
            raise
        except Exception as e:  # a damaged file shows as many exception types inside gguf / transformers
            raise _bad_gguf(gguf, e) from None
        shards = sorted(p.name for p in tmp.glob("*.safetensors"))
        marker = {"format": FORMAT, "gguf": str(gguf), "gguf_sha256": digest, "dtype": dtype_name(dtype), "shards": shards}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    return final


def _tensor_plan(gguf: Path, config):
    """(processor, its keyword arguments, [(gguf tensor, hf name, hf shape, expert)]) for every tensor transformers
    loads, and each expert of a mixture of experts' stacked tensors (``expert``: its index, else None)."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                          load_gguf_checkpoint, read_field)

    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    reader = GGUFReader(str(gguf))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    if config.model_type == "mixtral":  # llama.cpp's Mixtral is a llama file: transformers names it as one
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, processor)  # (its name maps built once: one_reader)
    plan = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        experts, router = _EXPERTS.match(t.name), _ROUTER.match(t.name)
        if experts:  # [experts, out, in]: one tensor per expert
            i, which = experts.groups()
            plan += [(t, f"model.layers.{i}.mlp.experts.{e}.{which}_proj.weight", shape[1:], e) for e in range(shape[0])]
        elif router:
            plan.append((t, f"model.layers.{router.group(1)}.mlp.gate.weight", shape, None))
        elif t.name in names:
            plan.append((t, names[t.name], shape, None))
    return processor, dict(tensor_key_mapping=names, parsed_parameters=parsed), plan


def _rows(t, chunk_bytes: int) -> int:
    """Rows per chunk of a GGUF tensor: all of them for small or row-mixing tensors."""
    shape = tuple(reversed(t.shape.tolist()))
    if len(shape) != 2 or any(s in t.name for s in _ROW_MIXING):
        return max(shape[0], 1) if shape else 1
    return max(1, min(shape[0], chunk_bytes // (4 * shape[1])))


def _read_rows(fd: int, t, r0: int, r1: int) -> np.ndarray:
    """Rows r0..r1 of tensor ``t``'s stored data (the layout ``t.data`` has), read with pread."""
    shape, dt = t.data.shape, t.data.dtype
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize if len(shape) > 1 else dt.itemsize
    if len(shape) == 1:
        r0, r1 = 0, 1
        row_bytes = t.n_bytes
    n = (r1 - r0) * row_bytes
    buf = bytearray(n)
    view, done = memoryview(buf), 0
    while done < n:
        got = os.preadv(fd, [view[done:]], t.data_offset + r0 * row_bytes + done)
        if got <= 0:
            raise SubspecError(f"the GGUF ended early inside tensor {t.name}: the file is truncated, re-download it")
        done += got
    arr = np.frombuffer(buf, dtype=dt)
    return arr.reshape(((r1 - r0),) + tuple(shape[1:])) if len(shape) > 1 else arr.reshape(shape)


def _ordered(pool: ThreadPoolExecutor, fn, items: list, ahead: int = 2):
    """``fn`` over ``items`` on ``pool``, results in order, at most ``ahead`` computed but not yet consumed."""
    pending = []
    for x in items:
        pending.append(pool.submit(fn, x))
        if len(pending) > ahead:
            yield pending.pop(0).result()
    for f in pending:
        yield f.result()


def _convert(gguf: Path, out: Path, dtype: torch.dtype, chunk_bytes: int) -> None:
    from gguf import dequantize
    from transformers import AutoTokenizer, GenerationConfig

    from .progress import bar as progress_bar

    config = gguf_config(gguf)
    processor, kwargs, plan = _tensor_plan(gguf, config)
    es = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple]] = [[]]
    size = 0
    for t, name, shape, expert in plan:
        n = int(np.prod(shape, dtype=np.int64)) * es
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((t, name, shape, expert))
        size += n
    files = ["model.safetensors"] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                             for i in range(len(shards))]
    total = sum(int(np.prod(s, dtype=np.int64)) for _, _, s, _ in plan)
    check_free_space(out, total * es, f"the {dtype_name(dtype)} conversion of {gguf.name}")
    fd = os.open(gguf, os.O_RDONLY)
    pool = ThreadPoolExecutor(max_workers=2)  # numpy releases the GIL: two de-quantizing chunks at once
    try:
        with progress_bar("conversion", total=total, desc=f"converting {gguf.name} to {dtype_name(dtype)}", unit="param",
                          unit_scale=True) as bar:
            for fname, entries in zip(files, shards):
                with TensorFileWriter(out / fname, [(name, dtype, shape) for _, name, shape, _ in entries],
                                      {"format": "pt"}) as w:  # interrupted: the half-written file goes with the folder
                    for t, name, shape, expert in entries:
                        if expert is not None:  # one expert of a stacked tensor: its row of the first dimension
                            x = dequantize(_read_rows(fd, t, expert, expert + 1), t.tensor_type)
                            w.write(name, torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype)
                                    .reshape(shape))
                            bar.update(int(np.prod(shape, dtype=np.int64)))
                            if expert == int(t.shape.tolist()[-1]) - 1:  # the tensor's last expert
                                os.posix_fadvise(fd, t.data_offset, t.n_bytes, os.POSIX_FADV_DONTNEED)
                            continue
                        step = _rows(t, chunk_bytes)
                        starts = list(range(0, max(shape[0], 1) if len(shape) > 1 else 1, step))

                        def job(r0, t=t, shape=shape, step=step):
                            r1 = min(r0 + step, shape[0]) if len(shape) > 1 else 1
                            x = dequantize(_read_rows(fd, t, r0, r1), t.tensor_type)
                            res = processor.process(weights=x, name=t.name, **kwargs)
                            if res.name != t.name:
                                raise SubspecError(f"GGUF tensor {t.name}: transformers renames it while processing, "
                                                   "which subspec's converter does not support")
                            return r0, torch.from_numpy(np.ascontiguousarray(res.weights, dtype=np.float32)).to(dtype)

                        for r0, chunk in _ordered(pool, job, starts):
                            w.write(name, chunk.reshape((-1,) + shape[1:]) if len(shape) > 1 else chunk.reshape(shape), row=r0)
                            bar.update(chunk.numel())
                        os.posix_fadvise(fd, t.data_offset, t.n_bytes, os.POSIX_FADV_DONTNEED)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        os.close(fd)
    if len(files) > 1:
        weight_map = {name: f for f, entries in zip(files, shards) for _, name, _, _ in entries}
        index = {"metadata": {"total_size": total * es}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (KeyError, ValueError, OSError, TypeError) as e:  # a GGUF of weights only: token ids in, token ids out
        log.info("%s holds no usable tokenizer (%s: %s)", gguf, type(e).__name__, e)
        return
    tokenizer.save_pretrained(str(out))
