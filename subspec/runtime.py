"""Building a ready-to-run model from user options: load -> plan placement -> build tier and draft -> engine.

:func:`load` is the library entry point the CLI and the benchmark use::

    rt = subspec.runtime.load(Options(model="model.gguf", device_memory=parse_bytes("300MiB")))
    for text in rt.stream_text("Hello", SamplingParams(max_new_tokens=64)):
        print(text, end="")
    print(rt.engine.last_stats.tau)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch

from .engine import Engine, NoDraft
from .errors import SubspecError
from .layout import layer_layout
from .loading import open_model
from .machine import check_device_memory
from .model import Decoder, ResidentLayers, load_linears
from .placement import Placement, SubstituteSpec, fmt_bytes, plan_placement
from .process import hold_gc_freeze, release_gc_freeze
from .sampling import SamplingParams
from .quant import load_substitutes
from .tiers import DiskTier, HostTier, packed_layers

log = logging.getLogger(__name__)

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
        max_context: context tokens the KV cache holds. staging_slots: ring size of the offload tier.
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
    staging_slots: int = 2
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
    draft_head_bits: int = 4

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
            raise SubspecError(f"device-memory must be a positive size (got {self.device_memory} bytes)")
        if self.max_context < MIN_CONTEXT:
            raise SubspecError(f"max-context must be at least {MIN_CONTEXT} tokens (got {self.max_context})")
        if self.draft_head_bits not in (4, 16):
            raise SubspecError(f"draft-head-bits must be 4 or 16 (got {self.draft_head_bits})")
        if self.staging_slots < 2:
            raise SubspecError(f"staging slots must be at least 2 (got {self.staging_slots})")
        if self.bits not in (2, 3, 4, 8, 16):
            raise SubspecError(f"bits must be 2, 3, 4, 8 or 16 (got {self.bits})")
        if self.group_size < 1:
            raise SubspecError(f"group-size must be >= 1 (got {self.group_size})")
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
        heads = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        for n in {config.hidden_size, config.intermediate_size, heads}:
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


class Runtime:
    """A loaded model ready to generate: checkpoint, tokenizer, decoder, placement, tier and engine."""

    def __init__(self, opts: Options, source, tokenizer, decoder: Decoder, placement: Placement, tier, engine: Engine,
                 draft=None):
        self.opts, self.source, self.tokenizer, self.decoder = opts, source, tokenizer, decoder
        self.placement, self.tier, self.engine, self.draft = placement, tier, engine, draft
        self._gc_held = False  # set by load() once it holds the collector's freeze for this runtime

    def encode(self, text: str, chat: bool = True, history: Optional[list[dict]] = None) -> list[int]:
        """Token ids for ``text``: through the chat template (after the ``history`` messages) when the model has one
        and ``chat``, else raw. Raises SubspecError for a model without a tokenizer."""
        if chat and self._tok().chat_template:
            return encode_messages(self.tokenizer, (history or []) + [{"role": "user", "content": text}])
        return list(self.tokenizer(text)["input_ids"])

    @property
    def exactness(self) -> str:
        """The kernels in use and what verification guarantees on this run (README "What is guaranteed"), in a few
        words.

        FP32: exact up to FP32 rounding (tested token for token against transformers). BF16 on a native kernel tier
        (:mod:`subspec.kernels`: amx, avx512, avx2 or portable): batch-invariant, every verified token gets the bits of a
        one-token forward, so greedy equals plain decoding token for token. Otherwise (CUDA, FP16,
        ``--no-native-kernels``, no tier buildable): exact verification of the tree forward's logits, whose last bits
        can differ from a one-token forward's, so near-ties may flip. Plain decoding (ar) is the reference itself.
        """
        tier = self.decoder.kernel_tier
        kernels = f"{tier} kernels" if tier else "torch's kernels"
        if self.decoder.dtype == torch.float32:
            return f"fp32, {kernels}"
        if self.opts.method == "ar":
            return kernels
        if self.decoder.native_attention:
            return f"bf16 batch-invariant ({kernels}): equals ar token for token"
        return f"{kernels}, not batch-invariant: near-ties may differ from ar"

    def _tok(self):
        if self.tokenizer is None:
            raise SubspecError(f"the model at {self.source.path} has no tokenizer: add its tokenizer files")
        return self.tokenizer

    def stream_text(self, context_ids: list[int], params: SamplingParams) -> Iterator[tuple[list[int], str]]:
        """Generate after ``context_ids`` (the whole context: the engine reuses the prefix it already holds, see
        :meth:`Engine.stream_context`) and yield (new token ids, new text) once per round; text is decoded
        incrementally, special tokens skipped, an incomplete UTF-8 character held back until it completes.

        Raises:
            SubspecError: as :meth:`Engine.stream_context`, at the call (before anything is generated).
        """
        self._tok()
        gen = self.engine.stream_context(context_ids, params)
        return self._detokenize(gen)

    def _detokenize(self, gen: Iterator[list[int]]) -> Iterator[tuple[list[int], str]]:
        ids: list[int] = []
        shown = ""
        try:
            for chunk in gen:
                ids.extend(chunk)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                    yield chunk, ""
                    continue
                yield chunk, text[len(shown):]
                shown = text
        finally:
            gen.close()  # closing this iterator stops the engine at once (between rounds)

    def __del__(self):
        # a runtime dropped without close() gives its hold on the collector's freeze back (the tier closes itself)
        if getattr(self, "_gc_held", False):
            self._gc_held = False
            release_gc_freeze()

    def close(self) -> None:
        """Stop the offload tier's reader and close the files a run holds open (idempotent). The runtime's hold on the
        garbage collector's freeze is released (:mod:`subspec.process`: the last runtime to close unfreezes)."""
        try:
            if self.tier is not None:
                self.tier.close()
        finally:
            try:
                close = getattr(self.decoder.embed, "close", None)  # rows read on demand: an open file
                if close is not None:
                    close()
            finally:
                if self._gc_held:
                    self._gc_held = False
                    release_gc_freeze()


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat ``messages`` ([{"role", "content"}, ...]) through the tokenizer's chat template, with the
    prompt for the assistant's answer appended.

    Raises:
        SubspecError: the tokenizer has no chat template, or the template rejects the messages (e.g. roles out of
            the order it requires).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise SubspecError("this model's tokenizer has no chat template: use plain completions")
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError, TypeError, KeyError) as e:  # e.g. roles out of the order it requires
        raise SubspecError(f"the chat template rejected the messages: {e}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def default_budget(device: torch.device) -> Optional[int]:
    """CUDA: free device memory minus 10 % (at least 512 MiB); CPU: None (everything resident)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free - max(0.1 * free, 512 << 20))


def plan_for(opts: Options, source, device: Optional[torch.device] = None) -> tuple[Placement, "TreeSettings"]:
    """The placement (and draft tree settings) that :func:`load` would use, without loading any weights.

    Raises:
        SubspecError: an invalid option, budget below the minimum, a tier that does not fit the device, a model too
            large for ``--offload none``.
    """
    opts.validate()
    return _plan(replace(opts, max_context=model_context(opts, source.config)), source,
                 device or resolve_device(opts.device))


def _plan(opts: Options, source, device: torch.device) -> tuple[Placement, "TreeSettings"]:
    from .speculation import draft_head_bytes, tree_settings  # the draft's shape decides KV scratch and workspace

    dtype = resolve_dtype(opts.dtype)
    budget = opts.device_memory if opts.device_memory is not None else default_budget(device)
    tier_kind = opts.offload if opts.offload != "auto" else ("host" if device.type == "cuda" else "disk")
    if tier_kind == "host" and device.type != "cuda":
        raise SubspecError("the host offload tier streams to a GPU: on a CPU use --offload disk")
    settings = tree_settings(opts)
    substitutes = opts.method == "subspec"

    coded = substitutes and tier_kind == "disk" and _codes_offload(opts, device, dtype)

    head_bits = _draft_head_bits(opts, source.config, device) if substitutes else 16
    head_memory = draft_head_bytes(source.config, opts.draft_vocab, dtype, 4) if head_bits == 4 else 0

    def place(substitute_all: bool) -> Placement:
        p = plan_placement(source.config, source.family, dtype, budget if tier_kind != "none" else None,
                              max_context=opts.max_context, tree_nodes=settings.max_nodes if substitutes else 1,
                              spec=SubstituteSpec(opts.bits, opts.group_size), substitutes=substitutes,
                              tier=tier_kind, staging_slots=opts.staging_slots,
                              verify_nodes=settings.verify_budget + 1 if substitutes else 1,
                              draft_width=settings.topk if substitutes else 0, max_resident=opts.max_resident,
                              substitute_all=substitute_all, draft_head=head_memory)
        if coded and p.offloaded:  # an estimate until the coded files exist (load() sets the measured ratio)
            from .codec import CODED_RATIO

            p.stream_ratio = CODED_RATIO
        return p

    if not substitutes or opts.draft_layers != "auto":
        placement = place(substitutes and opts.draft_layers == "all")
    else:  # the cost model's choice: a draft on substitutes only reads fewer bytes but leaves fewer layers resident
        from .costmodel import Rates, forecast

        head = draft_head_bytes(source.config, opts.draft_vocab, dtype, head_bits)
        options = [place(False), place(True)]
        placement = max(options, key=lambda p: forecast(p, source.config, Rates(), method="subspec",
                                                        draft_head_bytes=head,
                                                        verify_tokens=settings.verify_budget + 1).tokens_per_second)
    if tier_kind == "none" and budget is not None and placement.total > budget:
        raise SubspecError(f"the model needs {fmt_bytes(placement.total)} fully resident, over the budget of "
                           f"{fmt_bytes(budget)}: use --offload disk (CPU) or host (CUDA)")
    return placement, settings


def _native() -> bool:
    from . import kernels

    return kernels.native()


def _codes_offload(opts: Options, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a disk tier's offloaded layers are coded against their substitutes (:mod:`subspec.codec`): asked for,
    BF16 on a CPU with the native kernels, 4-bit substitutes of a group the native kernel takes."""
    return (opts.coded_offload and opts.method == "subspec" and device.type == "cpu" and dtype == torch.bfloat16
            and opts.bits == 4 and (opts.group_size == 32 or opts.group_size % 64 == 0) and opts.native_kernels
            and _native())


def _draft_head_bits(opts: Options, config, device: torch.device) -> int:
    """4 where the draft head can be a 4-bit copy on the native kernel (asked for, CPU, a 64-multiple hidden size),
    else 16 (the lm_head's own rows)."""
    from . import kernels
    from .speculation import draft_vocab_size, head_rows

    rows = head_rows(config.vocab_size, draft_vocab_size(opts.draft_vocab))
    ok = (opts.draft_head_bits == 4 and device.type == "cpu" and opts.native_kernels and config.hidden_size % 64 == 0
          and rows % 16 == 0 and _native() and kernels.linear_fits(rows, config.hidden_size))
    return 4 if ok else 16


def load(opts: Options, source=None) -> Runtime:
    """Open, plan and build everything for ``opts`` (``source``: an already opened checkpoint instead of opts.model).

    Order: open (a GGUF converted once) -> plan -> substitutes (quantized once, layer by layer, before the device
    holds anything else) -> shared tensors and resident layers -> offload tier (layers packed once) -> KV cache ->
    calibration (once per machine and placement). ``Runtime.opts.max_context`` is the context actually used.

    Raises:
        SubspecError: any invalid option or input (see :mod:`subspec.errors`).
    """
    opts.validate()
    device, dtype = resolve_device(opts.device), resolve_dtype(opts.dtype)
    check_device_memory(opts.device_memory, device)
    source = source if source is not None else open_model(opts.model, dtype)
    opts = replace(opts, max_context=model_context(opts, source.config))
    try:
        tokenizer = source.tokenizer()
    except SubspecError as e:  # a folder of weights only, or random weights: token ids in, token ids out
        log.info("%s", e)
        tokenizer = None
    placement, settings = _plan(opts, source, device)
    substitutes = opts.method == "subspec"
    if substitutes and placement.offloaded:
        _advise_method(opts, source, device, placement, settings)
    tier = None
    native = opts.native_kernels
    try:
        subs = {}
        if substitutes:  # quantized on an empty device (HQQ's temporaries do not compete with the KV cache)
            subs = load_substitutes(source, placement.substituted, SubstituteSpec(opts.bits, opts.group_size), dtype,
                                    device, dense=opts.dense_substitutes, native=native)
        coded = {}
        if placement.offloaded and placement.tier == "disk" and _codes_offload(opts, device, dtype):
            from .codec import coded_layers  # before the resident layers: the coding's buffers are transient

            coded = coded_layers(source, layer_layout(source.config, source.family, dtype), placement.offloaded, subs)
        decoder = Decoder.from_source(source, dtype, device, native=native,
                                      offload_embeddings=placement.embeddings_offloaded)
        resident = {i: load_linears(source, i, dtype, device, native) for i in placement.resident}
        if placement.offloaded:
            layout = layer_layout(source.config, source.family, dtype)
            if placement.tier == "disk":
                plain = [i for i in placement.offloaded if i not in coded]
                tier = DiskTier(packed_layers(source, layout, plain), layout, placement.offloaded,
                                opts.staging_slots, device, native=native, coded=coded, substitutes=subs)
                placement.stream_ratio = tier.stream_bytes / (len(placement.offloaded) * layout.extent)
            else:
                tier = HostTier(source, layout, placement.offloaded, opts.staging_slots, device, native=native)
        layers = ResidentLayers(resident, tier)
        release_freed_heap()  # checkpoint reads and layer packing left freed heap behind: give it back before calibrating
        kv = decoder.new_kv_cache(opts.max_context + (settings.max_nodes if substitutes else 1))
        draft = None
        if substitutes:
            from .speculation import DraftHead, build_proposer, draft_vocab_size, head_rows

            special = list(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else []
            quantized = None
            if _draft_head_bits(opts, source.config, device) == 4:
                from .quant import load_draft_head

                rows = head_rows(decoder.lm_head.shape[0], draft_vocab_size(opts.draft_vocab))
                if rows % 16 == 0:  # the native kernel's row blocks (the vocabulary as the config states it was)
                    quantized = load_draft_head(source, decoder.lm_head, rows, SubstituteSpec(4, 64))
            head = DraftHead(decoder, draft_vocab_size(opts.draft_vocab), list(source.eos_token_ids) + special,
                             native=native, quantized=quantized)
            proposer = draft = build_proposer(settings, decoder, {} if placement.substitute_all else resident, subs,
                                              kv, head)
        else:
            proposer = NoDraft()
        engine = Engine(decoder, layers, proposer, source.eos_token_ids, opts.max_context, tier=tier, kv=kv)
        if substitutes and (opts.depth is None or opts.verify_budget is None):
            _calibrate(opts, source, dtype, device, placement, engine, draft)
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    finally:
        source.close()  # weights now live in their placement (RAM stays near the budget)
        release_freed_heap()
    rt = Runtime(opts, source, tokenizer, decoder, placement, tier, engine, draft)
    hold_gc_freeze()  # the objects of loading, out of the cyclic collector's sight while the runtime lives
    rt._gc_held = True
    return rt


def _advise_method(opts: Options, source, device, placement: Placement, settings) -> None:
    """Say so (one line) when plain decoding would keep every layer resident at this budget and the cost model
    predicts it faster than subspec (e.g. a small model on a CPU: a verify forward over a tree costs several
    one-token forwards there). The run goes on as asked; its depth policy drafts only where drafting pays."""
    from .costmodel import Rates, forecast
    from .speculation import draft_head_bytes

    ar_placement, _ = _plan(replace(opts, method="ar"), source, device)
    if ar_placement.offloaded:
        return
    rates = Rates()
    ar = forecast(ar_placement, source.config, rates, method="ar")
    sub = forecast(placement, source.config, rates, method="subspec", verify_tokens=settings.verify_budget + 1,
                   draft_head_bytes=draft_head_bytes(source.config, opts.draft_vocab, resolve_dtype(opts.dtype)))
    if sub.tokens_per_second < ar.tokens_per_second:
        log.warning("at this budget the whole model fits without offloading: plain decoding (--method ar) is "
                    "predicted faster (%.1f against %.1f tokens/s); `subspec plan` shows the forecast",
                    ar.tokens_per_second, sub.tokens_per_second)


def _calibrate(opts: Options, source, dtype, device, placement: Placement, engine: Engine, draft) -> None:
    """Choose the automatic tree settings from measured costs (cached per model, placement, kernels and machine;
    :mod:`subspec.policy`)."""
    from . import kernels
    from .policy import calibrate, candidate_budgets, forget_calibration

    budgets = candidate_budgets(draft.s, opts.verify_budget is not None)
    native = kernels.status() if opts.native_kernels else "torch"
    key = "|".join(str(x) for x in (source.key, dtype, device, placement.summary(), opts.bits, opts.group_size,
                                     placement.substitute_all,
                                     draft.s.topk, draft.head.size, native, torch.get_num_threads(), _cpu_name()))
    log.info("calibrating draft and verify costs (one time)")
    cal = calibrate(engine, draft, key, budgets)
    cal.choose(draft.s, budgets, opts.depth is not None, opts.verify_budget is not None, draft.depth_capacity)
    if opts.depth is None:
        def contradicted(t_step: float, t_verify: float) -> None:
            log.info("measured costs (draft step %.1f ms, verify %.0f ms) contradict the calibration (%.1f ms, "
                     "%.0f ms): following the measurements; the next start calibrates again", 1e3 * t_step,
                     1e3 * t_verify, 1e3 * cal.t_draft_step, 1e3 * cal.t_verify[draft.s.verify_budget])
            forget_calibration(key)

        draft.policy = cal.policy(draft.s, draft.depth_capacity, on_contradicted=contradicted)
        if draft.s.depth == 0:
            p = draft.policy
            log.warning("drafting does not pay here (predicted %.2f tokens/s at the best depth %d, %.2f without "
                        "drafting): generating without a draft, re-measuring every %d rounds", p.rate(p.best_drafting()),
                        p.best_drafting(), p.rate(0), p.PROBE_EVERY)
    log.info("tree: depth %d, top-k %d, verify budget %d (draft step %.1f ms, verify %s)", draft.s.depth,
             draft.s.topk, draft.s.verify_budget, 1e3 * cal.t_draft_step,
             {n: round(t, 3) for n, t in cal.t_verify.items()})


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def release_freed_heap() -> None:
    """Return heap memory freed during loading (float32 checkpoint tensors) to the OS (glibc ``malloc_trim``)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim
            pass
