"""Opening a checkpoint: a Hugging Face folder (config.json + safetensors) or a GGUF file.

:func:`open_model` validates the input and returns a :class:`ModelSource`, which reads tensors lazily, one at a
time, with plain reads into memory it owns (:class:`~subspec.tensorfile.TensorFile`), so no code path needs the
whole model in RAM and nothing stays memory-mapped. A GGUF file is converted once, tensor by tensor, into a
safetensors folder in the compute dtype (:mod:`subspec.convert`); later starts open that folder directly.

Every derived cache entry (packed layers, substitutes, calibration) is keyed by :attr:`ModelSource.key`, which is
computed from the checkpoint's **content** (the sha256 of each weight file, computed once per file version, and the
config), so replacing the weights by other ones of the same shapes never reuses the old entries.
"""
from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import content_digest, short_key
from .errors import SubspecError
from .families import CONTAINERS, Family, family_for, linear_shapes, text_config
from .tensorfile import TensorFile, TensorFileError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


@dataclass
class ModelSource:
    """A checkpoint opened for lazy reading.

    Attributes:
        path: the Hugging Face folder holding config.json and the safetensors files (for a GGUF input, the
            converted folder in the cache).
        config: the transformers config (``PretrainedConfig``).
        family: the :class:`~subspec.families.Family` record of ``config.model_type``.
        key: a short hash of the checkpoint's content (weights and config), keying derived cache entries.
        eos_token_ids: token ids that end generation (from generation_config.json, else the config).
        fix: what the user should do when a weight file turns out unreadable (re-download, or delete a cache entry).
    """

    path: Path
    config: object
    family: Family
    key: str
    eos_token_ids: list[int]
    _where: dict[str, Path] = field(default_factory=dict, repr=False)
    _files: dict[tuple[Path, bool], TensorFile] = field(default_factory=dict, repr=False)
    fix: str = "re-download the model"
    _stored: dict[str, str] = field(default_factory=dict, repr=False)  # text-model name -> name in the file

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor called ``name``."""
        return name in self._where

    def tensor(self, name: str, direct: bool = False) -> torch.Tensor:
        """Read one tensor (CPU, checkpoint dtype, memory of its own) without touching the others; ``direct``: past
        the page cache (a large tensor read once per start, e.g. the embedding table: :class:`TensorFile`).

        Raises:
            KeyError: no tensor of that name. SubspecError: the file cannot be read (names it and the fix).
        """
        f = self._file(name, direct)
        try:
            return f.read(self._stored.get(name, name))
        except OSError as e:
            raise SubspecError(f"cannot read {name} from {f.path} ({e}): {self.fix}") from None

    def _file(self, name: str, direct: bool = False) -> TensorFile:
        """The open file holding ``name`` (opened on first use; ``direct``: a second handle reading past the page
        cache)."""
        p = self._where[name]
        key = (p, direct)
        if key not in self._files:
            try:
                self._files[key] = TensorFile(p, direct=direct)
            except (OSError, TensorFileError) as e:
                raise SubspecError(f"{p} cannot be read ({e}): {self.fix}") from None
        return self._files[key]

    def nbytes(self, name: str) -> int:
        """Size in bytes of a tensor as stored in the checkpoint."""
        return self._file(name).nbytes(self._stored.get(name, name))

    def locate(self, name: str) -> tuple[Path, str] | None:
        """Where ``name`` is stored: (its safetensors file, its name in that file), for reading parts of it (rows of
        an embedding table) without loading the rest; None when it is not in a file.

        Raises:
            KeyError: no tensor of that name.
        """
        return self._where[name], self._stored.get(name, name)

    def close(self) -> None:
        """Close the open checkpoint files; a later :meth:`tensor` reopens them."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def tokenizer(self):
        """The transformers tokenizer (with its chat template) saved beside the config."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise SubspecError(f"no usable tokenizer in {self.path} ({type(e).__name__}): add the tokenizer files "
                               "to the model folder, or pass token ids") from None


def open_model(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, convert: bool = True) -> ModelSource:
    """Open a Hugging Face model folder or a GGUF file.

    Args:
        path: a folder with ``config.json`` and ``*.safetensors`` (sharded with ``model.safetensors.index.json``
            or not), or a ``.gguf`` file.
        dtype: the compute dtype: a GGUF is converted (once, cached) into this dtype. A folder is read as stored.
        convert: False opens for planning only: a GGUF's config and family from its metadata (no conversion, no
            tensor: ``has`` is False for every name); a folder without computing its content key.

    Raises:
        SubspecError: missing path, not a model, unsupported architecture, truncated or corrupted file.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise SubspecError(
            f"model path '{p}' does not exist: pass a Hugging Face model folder or a .gguf file"
        )
    if p.is_file():
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise SubspecError(f"cannot read the model file {p} ({e.strerror}): check its permissions") from None
        if magic != GGUF_MAGIC and p.suffix.lower() == ".gguf":
            raise SubspecError(f"'{p}' is not a valid GGUF file (it does not start with 'GGUF'): download it again")
        if magic != GGUF_MAGIC:
            raise SubspecError(
                f"'{p}' is not a model: expected a .gguf file or a folder with config.json and *.safetensors"
            )
        if not convert:
            from .convert import gguf_config

            config = gguf_config(p)
            return ModelSource(p, config, family_for(config.model_type), "", [], fix="re-download it")
        return open_gguf(p, dtype)
    return _open_hf_folder(p, key=None if convert else "")


def open_gguf(gguf: Path, dtype: torch.dtype) -> ModelSource:
    """A GGUF file as a :class:`ModelSource` over its conversion to ``dtype`` (converted on first use).

    Raises:
        SubspecError: unreadable GGUF, unsupported architecture.
    """
    from .convert import check_converted, convert_gguf, converted_folder, dtype_name, gguf_config, one_reader

    digest = content_digest(gguf)
    folder = converted_folder(gguf, digest, dtype)
    if not folder.is_dir() or check_converted(folder, digest, dtype) is not None:
        with one_reader(gguf):  # the metadata parsed once for the config, the conversion and the tokenizer
            family_for(gguf_config(gguf).model_type)  # an unsupported architecture fails before any conversion
            folder = convert_gguf(gguf, digest, dtype)
    return _open_hf_folder(folder, key=short_key("gguf", digest, dtype_name(dtype)),
                           fix=f"delete {folder} to convert {gguf.name} again")


def cached_state(path: str | os.PathLike, dtype: torch.dtype) -> tuple[str | None, list[Path], bool]:
    """What the cache already holds of the model at ``path``, without reading its weights: (its content key, or None
    while a file's digest is not remembered; the files whose digest is not; whether a GGUF still has to be converted
    to ``dtype``). A folder is never converted."""
    from .cache import known_digest

    p = Path(path).expanduser()
    if p.is_file():
        from .convert import MARKER, converted_folder, dtype_name

        digest = known_digest(p)
        if digest is None:
            return None, [p], True
        done = (converted_folder(p, digest, dtype) / MARKER).is_file()
        return short_key("gguf", digest, dtype_name(dtype)), [], not done
    files = sorted(p.glob("*.safetensors"))
    digests = {f: known_digest(f) for f in files}
    unknown = [f for f, d in digests.items() if d is None]
    if unknown or not (p / "config.json").is_file():
        return None, unknown, False
    return short_key("hf", (p / "config.json").read_bytes(), *(f"{f.name}={d}" for f, d in digests.items())), [], False


def _read_config(folder: Path, fix: str):
    from transformers import AutoConfig

    cfg_file = folder / "config.json"
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type", "?")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError) as e:
        raise SubspecError(f"{cfg_file} is not a readable JSON config ({type(e).__name__}): {fix}") from None
    family_for(model_type)
    try:
        config = text_config(AutoConfig.from_pretrained(str(folder)))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SubspecError(f"{cfg_file} is not a usable {model_type} config ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:160]}): {fix}") from None
    return config, family_for(config.model_type), model_type


def _eos_ids(folder: Path, config, fix: str) -> list[int]:
    from transformers import GenerationConfig

    eos = None
    if (folder / "generation_config.json").exists():
        try:
            eos = GenerationConfig.from_pretrained(str(folder)).eos_token_id
        except (OSError, ValueError, TypeError) as e:
            raise SubspecError(f"{folder / 'generation_config.json'} is not readable ({type(e).__name__}): {fix}") from None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _open_hf_folder(folder: Path, key: str | None = None, fix: str = "re-download the model") -> ModelSource:
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        raise SubspecError(
            f"'{folder}' is not a model folder: it needs config.json and *.safetensors weights"
        )
    config, family, model_type = _read_config(folder, fix)
    where: dict[str, Path] = {}
    stored: dict[str, str] = {}
    opened: dict[Path, TensorFile] = {}
    for f in files:
        try:
            tf = TensorFile(f)
        except TensorFileError as e:
            raise SubspecError(f"{f} is truncated or corrupted ({e}): {fix}") from None
        except OSError as e:
            raise SubspecError(f"cannot read {f} ({e.strerror}): check its permissions, or {fix}") from None
        for name in tf.names:
            canonical = family.canonical_name(text_model_name(name) if model_type in CONTAINERS else name)
            where[canonical] = f
            if canonical != name:
                stored[canonical] = name
        opened[f] = tf
    eos = _eos_ids(folder, config, fix)
    if key is None:
        key = short_key("hf", (folder / "config.json").read_bytes(), *(f"{f.name}={content_digest(f)}" for f in files))
    return ModelSource(folder, config, family, key, eos, where, opened, fix, stored)


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
        from .families import linear_prefix, router_name

        self._norm_shapes = {f"{name}.weight": shape for _, name, shape in family.layer_norm_shapes(config)}
        self._linear_shapes = {linear_prefix(n): shape for n, shape in linear_shapes(config).items()}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self._names |= {p + name for name in self._norm_shapes}
            if family.moe is not None:
                self._names.add(router_name(i))
            for n in linear_shapes(config):
                self._names.add(p + linear_prefix(n) + ".weight")
                if n in biased:
                    self._names.add(p + linear_prefix(n) + ".bias")

    def _shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        H = c.hidden_size
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, H)
        if name == "model.norm.weight":
            return (H,)
        if name.endswith("norm.weight"):
            return self._norm_shapes[name.split(".", 3)[3]]
        stem, kind = name.split(".", 3)[3].rsplit(".", 1)
        if stem == "mlp.gate":  # a router
            return (self.family.moe.experts(c), H)
        out_in = self._linear_shapes[stem]
        return out_in if kind == "weight" else (out_in[0],)

    def has(self, name: str) -> bool:
        return name in self._names

    def nbytes(self, name: str) -> int:
        n = 4
        for d in self._shape(name):
            n *= d
        return n

    def tensor(self, name: str, direct: bool = False) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        shape = self._shape(name)
        if name.endswith("norm.weight"):  # a gain of one
            return torch.full(shape, 1.0 - self.family.norm.offset)
        g = torch.Generator().manual_seed(self._seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g) * self._std

    def locate(self, name: str) -> None:
        return None  # generated, not stored: read whole

    def tokenizer(self):
        raise SubspecError("a random-weight model has no tokenizer: pass token ids")
