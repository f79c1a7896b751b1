"""Opening a checkpoint: a Hugging Face folder (config.json + safetensors) or a GGUF file.

:func:`open_model` validates the input and returns a :class:`ModelSource`, which reads tensors lazily, one at a
time (``safetensors.safe_open``), so no code path needs the whole model in RAM. A GGUF file goes once through
transformers' de-quantization and is cached as a safetensors folder (float32, i.e. exactly the de-quantized
values) under the user cache; later starts open that folder directly.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import atomic_dir, cache_root, file_key
from .errors import SubspecError
from .families import CONTAINERS, Family, family_for, text_config

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_SHARD_BYTES = 2 << 30


def _check_safetensors(path: Path) -> list[str]:
    """Validate a safetensors file's header against its size; return its tensor names.

    Raises:
        SubspecError: the file is truncated or its header is not safetensors.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, struct.error, KeyError, TypeError, UnicodeDecodeError) as e:
        raise SubspecError(f"{path} is not a valid safetensors file ({e}): re-download or re-convert it") from None
    if 8 + n + end != size:
        raise SubspecError(
            f"{path} is truncated or corrupted ({size} bytes, header expects {8 + n + end}): re-download it"
        )
    return [k for k in header if k != "__metadata__"]


@dataclass
class ModelSource:
    """A checkpoint opened for lazy reading.

    Attributes:
        path: the Hugging Face folder holding config.json and the safetensors files (for a GGUF input, the
            converted folder in the cache).
        config: the transformers config (``PretrainedConfig``).
        family: the :class:`~subspec.families.Family` record of ``config.model_type``.
        key: a short hash identifying this checkpoint, used to key derived cache entries.
        eos_token_ids: token ids that end generation (from generation_config.json, else the config).
    """

    path: Path
    config: object
    family: Family
    key: str
    eos_token_ids: list[int]
    _where: dict[str, Path] = field(default_factory=dict, repr=False)
    _handles: dict[Path, object] = field(default_factory=dict, repr=False)
    _stored: dict[str, str] = field(default_factory=dict, repr=False)  # text-model name -> name in the file

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor called ``name``."""
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (CPU, checkpoint dtype) from its file without touching the others.

        Raises:
            KeyError: no tensor of that name.
        """
        return self._handle(name).get_tensor(self._stored.get(name, name))

    def _handle(self, name: str):
        """The open safetensors file holding ``name`` (opened on first use)."""
        from safetensors import safe_open

        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._handles[f]

    def nbytes(self, name: str) -> int:
        """Size in bytes of a tensor as stored in the checkpoint."""
        sl = self._handle(name).get_slice(self._stored.get(name, name))
        n = 1
        for d in sl.get_shape():
            n *= d
        return n * {"F32": 4, "F16": 2, "BF16": 2}.get(sl.get_dtype(), 4)

    def close(self) -> None:
        """Drop the open (memory-mapped) checkpoint files; a later :meth:`tensor` reopens them."""
        self._handles.clear()

    def tokenizer(self):
        """The transformers tokenizer (with its chat template) saved beside the config."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise SubspecError(f"no usable tokenizer in {self.path} ({type(e).__name__}): add the tokenizer files "
                               "to the model folder, or pass token ids") from None


def open_model(path: str | os.PathLike) -> ModelSource:
    """Open a Hugging Face model folder or a GGUF file.

    Args:
        path: a folder with ``config.json`` and ``*.safetensors`` (sharded with ``model.safetensors.index.json``
            or not), or a ``.gguf`` file.

    Raises:
        SubspecError: missing path, not a model, unsupported architecture, truncated or corrupted file.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise SubspecError(
            f"model path '{p}' does not exist: pass a Hugging Face model folder or a .gguf file"
        )
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise SubspecError(
                f"'{p}' is not a model: expected a .gguf file or a folder with config.json and *.safetensors"
            )
        return _open_hf_folder(_convert_gguf(p), key_from=p)
    return _open_hf_folder(p, key_from=p / "config.json")


def _open_hf_folder(folder: Path, key_from: Path) -> ModelSource:
    from transformers import AutoConfig, GenerationConfig

    cfg_file = folder / "config.json"
    files = sorted(folder.glob("*.safetensors"))
    if not cfg_file.is_file() or not files:
        raise SubspecError(
            f"'{folder}' is not a model folder: it needs config.json and *.safetensors weights"
        )
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type", "?")
    except (ValueError, UnicodeDecodeError) as e:
        raise SubspecError(f"{cfg_file} is not valid JSON ({e}): re-download the model") from None
    family_for(model_type)
    config = text_config(AutoConfig.from_pretrained(str(folder)))
    family = family_for(config.model_type)
    where: dict[str, Path] = {}
    stored: dict[str, str] = {}
    for f in files:
        for name in _check_safetensors(f):
            canonical = text_model_name(name) if model_type in CONTAINERS else name
            where[canonical] = f
            if canonical != name:
                stored[canonical] = name
    eos: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(str(folder))
        eos = gen.eos_token_id
    except OSError:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = []
    eos = [eos] if isinstance(eos, int) else list(eos)
    key = file_key(key_from, *(f.stat().st_size for f in files))
    return ModelSource(folder, config, family, key, eos, where, _stored=stored)


_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
"""Where a multimodal checkpoint keeps its text model: transformers 5 layout, then the original (Hub) layout."""


def text_model_name(name: str) -> str:
    """The text model's tensor name (``model.layers.0...``, ``lm_head.weight``) of a tensor stored in a multimodal
    checkpoint (``model.language_model.layers.0...`` or ``language_model.model.layers.0...``); others unchanged."""
    for prefix, repl in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


def _convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF file into a cached safetensors folder (float32) and return its path.

    Written atomically: an interrupted conversion leaves nothing behind.

    Raises:
        SubspecError: the GGUF is truncated/corrupted or of an unsupported architecture.
    """
    final = cache_root() / "models" / f"{gguf.stem}-{file_key(gguf)}"
    if (final / "config.json").is_file():
        return final
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.info("converting %s to safetensors (one time)", gguf)
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except SubspecError:
        raise
    except Exception as e:  # the gguf reader raises many types on bad input
        raise SubspecError(f"cannot read GGUF '{gguf}' ({type(e).__name__}: {e}): the file is corrupted or truncated, re-download it") from None
    family_for(config.model_type)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:
        raise SubspecError(f"cannot read GGUF '{gguf}' ({type(e).__name__}: {e}): the file is corrupted or truncated, re-download it") from None
    with atomic_dir(final) as tmp:
        shard: dict[str, torch.Tensor] = {}
        weight_map: dict[str, str] = {}
        size, total, n = 0, 0, 0

        def flush() -> None:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})

        for name in list(tensors):
            t = tensors.pop(name).to(torch.float32).contiguous()
            shard[name] = t
            size += t.numel() * 4
            total += t.numel() * 4
            if size >= _SHARD_BYTES:
                flush()
                shard, size, n = {}, 0, n + 1
        if shard:
            flush()
        if n == 0:  # one shard: the name transformers expects without an index
            os.replace(tmp / "model-00000.safetensors", tmp / "model.safetensors")
        else:  # several shards: transformers needs the index to load the folder
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    return final


class RandomSource(ModelSource):
    """A checkpoint of random weights generated on demand (no files): for shape-accurate benchmarks of large models.

    Each tensor is drawn from a generator seeded by its name, so repeated reads agree. Norm gains are ones.

    Args:
        config: a transformers config of a supported family. seed: base seed. std: weight standard deviation.
    """

    def __init__(self, config, seed: int = 0, std: float = 0.02):
        from .layout import biased_linears

        config = text_config(config)
        family = family_for(config.model_type)
        super().__init__(Path("<random>"), config, family, f"random-{config.model_type}-{seed}-{zlib.crc32(config.to_json_string().encode()):08x}",
                         [])
        self._seed, self._std = seed, std
        self._names: set[str] = {"model.embed_tokens.weight", "model.norm.weight"}
        if not getattr(config, "tie_word_embeddings", False):
            self._names.add("lm_head.weight")
        biased = biased_linears(config, family)
        from .families import LINEAR_NAMES, linear_prefix

        self._norm_shapes = {f"{name}.weight": shape for _, name, shape in family.layer_norm_shapes(config)}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self._names |= {p + name for name in self._norm_shapes}
            for n in LINEAR_NAMES:
                self._names.add(p + linear_prefix(n) + ".weight")
                if n in biased:
                    self._names.add(p + linear_prefix(n) + ".bias")

    def _shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        H, I, nh, kvh = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
        hd = getattr(c, "head_dim", None) or H // nh
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, H)
        if name == "model.norm.weight":
            return (H,)
        if name.endswith("norm.weight"):
            return self._norm_shapes[name.split(".", 3)[3]]
        out_in = {"q_proj": (nh * hd, H), "k_proj": (kvh * hd, H), "v_proj": (kvh * hd, H), "o_proj": (H, nh * hd),
                  "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}[name.split(".")[-2]]
        return out_in if name.endswith(".weight") else (out_in[0],)

    def has(self, name: str) -> bool:
        return name in self._names

    def nbytes(self, name: str) -> int:
        n = 4
        for d in self._shape(name):
            n *= d
        return n

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        shape = self._shape(name)
        if name.endswith("norm.weight"):  # a gain of one
            return torch.full(shape, 1.0 - self.family.norm.offset)
        g = torch.Generator().manual_seed(self._seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g) * self._std

    def tokenizer(self):
        raise SubspecError("a random-weight model has no tokenizer: pass token ids")
