"""The options of a run: everything that decides how a model runs, validated before anything is loaded.

:class:`Options` is the one schema the CLI, the benchmark, the server and the library fill; :func:`model_context`,
:func:`resolve_device` and :func:`resolve_dtype` check it against a model and this machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import SubspecError

METHODS = ("subspec", "ar")
DRAFT_LAYERS = ("auto", "offloaded", "all")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class Options:
    """Everything that decides how a model runs (the CLI flags map onto these fields).

    Attributes:
        model: HF folder or GGUF file. method: 'subspec' or 'ar' (plain offloaded decoding).
        device: 'auto' | 'cpu' | 'cuda'. dtype: 'auto' (bfloat16) or a dtype name.
        device_memory: bytes the model may use on the device (None: CPU = everything resident; CUDA = free
            memory minus a margin). offload: 'auto' | 'none' | 'disk' | 'host'.
        max_context: context tokens the KV cache holds. staging_slots: ring size of the offload tier (None: 2, or
            where offloaded layers are coded the cost model's choice: resident layers given up for more slots, which
            the disk fills while the draft runs).
        bits, group_size: substitute settings. depth, topk, verify_budget: draft tree shape (None = automatic).
        threshold: early-stop probability of drafting. draft_temperature: draft softmax temperature.
        max_resident: keep at most this many layers resident (like-for-like sweeps).
        dense_substitutes: keep substitutes without a native kernel (bits other than 4) as their dequantized dense
            weights: the same draft values at dense speed and memory (tau studies such as the bits sweep).
        native_kernels: run linears, substitutes and tree attention on subspec's native CPU kernels (:mod:`subspec.kernels`:
            the best tier this CPU runs, amx, avx512, avx2 or portable; ``SUBSPEC_KERNELS`` forces one): faster, and
            BF16 verification batch-invariant, so greedy output equals plain decoding's token for token. False:
            torch's kernels everywhere.
        draft_vocab: tokens in the draft's vocabulary subset (frequency-ranked, FR-Spec; None = the default
            :data:`~subspec.speculation.DRAFT_VOCAB`, 0 = the full vocabulary). Verification always uses the full one.
        demo_budget: without ``device_memory``, the embedded demo model's budget: its minimum plus a few layers, so most
            layers are offloaded (:data:`subspec.plan.DEMO_RESIDENT_LAYERS`).
        draft_layers: 'offloaded' (the paper: substitutes replace the offloaded layers, the draft runs the resident
            layers themselves), 'all' (every layer has a substitute and the draft runs on substitutes only: a draft
            step reads about a quarter of the bytes, the resident layers serve verification; the substitutes of
            resident layers cost device memory) or 'auto' (the one :mod:`subspec.costmodel` predicts faster at this
            budget, with its default machine rates). Verification is the same either way.
    """

    model: str
    method: str = "subspec"
    device: str = "auto"
    dtype: str = "auto"
    device_memory: Optional[int] = None
    offload: str = "auto"
    max_context: int = 2048
    staging_slots: Optional[int] = None
    bits: int = 4
    group_size: int = 64
    depth: Optional[int] = None
    topk: Optional[int] = None
    verify_budget: Optional[int] = None
    threshold: Optional[float] = None
    draft_temperature: float = 0.2
    max_resident: Optional[int] = None
    dense_substitutes: bool = False
    native_kernels: bool = True
    draft_vocab: Optional[int] = None
    draft_layers: str = "auto"
    coded_offload: bool = True
    expert_streaming: bool = True
    draft_head_bits: int = 4
    demo_budget: bool = False

    def validate(self) -> "Options":
        """Check every value that does not need the model; return self.

        Raises:
            SubspecError: the first bad value, named with its allowed range (one line).
        """
        if self.method not in METHODS:
            raise SubspecError(f"unknown method '{self.method}': use one of {', '.join(METHODS)}")
        if self.offload not in ("auto", "none", "disk", "host"):
            raise SubspecError(f"unknown offload tier '{self.offload}': use auto, none, disk or host")
        resolve_dtype(self.dtype)
        if self.device_memory is not None and self.device_memory <= 0:
            raise SubspecError(f"--device-memory must be a positive size (got {self.device_memory} bytes)")
        if self.max_context < MIN_CONTEXT:
            raise SubspecError(f"--max-context must be at least {MIN_CONTEXT} tokens (got {self.max_context})")
        if self.draft_head_bits not in (4, 16):
            raise SubspecError(f"--draft-head-bits must be 4 or 16 (got {self.draft_head_bits})")
        if self.staging_slots is not None and self.staging_slots < 2:
            raise SubspecError(f"--staging-slots must be at least 2 (got {self.staging_slots}); leave it out for the "
                               "automatic choice")
        if self.bits not in (2, 3, 4, 8, 16):
            raise SubspecError(f"--bits must be 2, 3, 4, 8 or 16 (got {self.bits})")
        if self.group_size < 1:
            raise SubspecError(f"--group-size must be >= 1 (got {self.group_size})")
        for flag, value in (("depth", self.depth), ("topk", self.topk), ("verify-budget", self.verify_budget)):
            if value is not None and value < 1:
                raise SubspecError(f"--{flag} must be >= 1 (got {value}); leave it out for the automatic choice")
        if self.depth is not None and self.depth > MAX_DEPTH:
            raise SubspecError(f"--depth must be at most {MAX_DEPTH} (got {self.depth})")
        if self.threshold is not None and not 0 <= self.threshold < 1:
            raise SubspecError(f"the draft threshold must be in [0, 1) (got {self.threshold})")
        if not self.draft_temperature > 0:
            raise SubspecError(f"the draft temperature must be > 0 (got {self.draft_temperature})")
        if self.max_resident is not None and self.max_resident < 0:
            raise SubspecError(f"max-resident must be >= 0 (got {self.max_resident})")
        if self.draft_layers not in DRAFT_LAYERS:
            raise SubspecError(f"unknown draft layers '{self.draft_layers}': use {', '.join(DRAFT_LAYERS)}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise SubspecError(f"--draft-vocab must be >= 0 (got {self.draft_vocab}); 0 means the full vocabulary")
        return self


MIN_CONTEXT = 16
MAX_DEPTH = 256
"""The deepest draft tree accepted from the user (the KV scratch grows with depth x top-k)."""


def model_context(opts: Options, config) -> int:
    """The context (tokens) a run of ``opts`` on ``config`` uses, after the model's own limits.

    Raises:
        SubspecError: ``max_context`` beyond the model's ``max_position_embeddings``; ``topk`` beyond the vocabulary;
            a substitute group size that does not divide the layers' input features.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if limit and opts.max_context > limit:
        raise SubspecError(f"max-context {opts.max_context} is beyond the model's {limit} positions "
                           f"(max_position_embeddings): use --max-context {limit} or less")
    if opts.topk is not None and opts.topk > config.vocab_size:
        raise SubspecError(f"--topk {opts.topk} is larger than the vocabulary ({config.vocab_size} tokens)")
    if opts.method == "subspec" and opts.bits != 16:
        from .families import linear_shapes

        for n in {inp for _, inp in linear_shapes(config).values()}:
            if n % opts.group_size:
                raise SubspecError(f"group-size {opts.group_size} does not divide the layers' {n} input features: "
                                   "use 32, 64 or 128")
    return opts.max_context


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu. Raises SubspecError for cuda without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SubspecError("--device cuda was given but this torch build sees no CUDA device: use --device cpu")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise SubspecError(f"unknown device '{name}': use auto, cpu or cuda")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise SubspecError(f"unknown dtype '{name}': use bfloat16, float16 or float32") from None
