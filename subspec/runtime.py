"""Building a ready-to-run model from user options: plan (:mod:`subspec.plan`) -> substitutes -> shared tensors and
resident layers -> offload tier -> draft -> engine -> calibration; and the :class:`Runtime` that holds them.

:func:`load` is the library entry point the CLI and the benchmark use::

    rt = subspec.runtime.load(Options(model="model.gguf", device_memory=parse_bytes("300MiB")))
    for text in rt.stream_text("Hello", SamplingParams(max_new_tokens=64)):
        print(text, end="")
    print(rt.engine.last_stats.tau)
"""
from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import Iterator, Optional

import torch

from .cache import cache_root, check_free_space
from .engine import Engine, NoDraft
from .errors import SubspecError
from .layout import layer_layout
from .loading import open_model
from .machine import check_device_memory
from .model import Decoder, ResidentLayers, load_linears
from .options import Options, model_context, resolve_device, resolve_dtype  # noqa: F401  (the library's names)
from .placement import Placement, SubstituteSpec
from .plan import Plan, first_start_cache_bytes, first_start_work, make_plan, plan_for  # noqa: F401  (library)
from .process import hold_gc_freeze, release_freed_heap, release_gc_freeze
from .progress import first_start, predict
from .sampling import SamplingParams
from .quant import load_substitutes
from .tiers import DiskTier, HostTier, packed_layers

log = logging.getLogger(__name__)

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

    def __del__(self, _finalizing=sys.is_finalizing):
        # a runtime dropped without close() gives its hold on the collector's freeze back (the tier closes itself);
        # not while the interpreter shuts down, when this module's globals may already be gone
        if getattr(self, "_gc_held", False) and not _finalizing():
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


def load(opts: Options, source=None, plan: Optional[Plan] = None) -> Runtime:
    """Open, plan and build everything for ``opts`` (``source``: an already opened checkpoint instead of opts.model;
    ``plan``: its :func:`~subspec.plan.make_plan`, if already made: a load plans once, or not at all).

    Order: open (a GGUF converted once) -> plan -> substitutes (quantized once, layer by layer, before the device
    holds anything else) -> shared tensors and resident layers -> offload tier (layers packed once) -> KV cache ->
    calibration (once per machine and placement). ``Runtime.opts`` are the plan's (context and budget resolved).

    Raises:
        SubspecError: any invalid option or input (see :mod:`subspec.errors`).
    """
    opts.validate()
    check_device_memory(opts.device_memory, resolve_device(opts.device))  # before a first start's conversion
    planned = source if source is not None else open_model(opts.model, resolve_dtype(opts.dtype), convert=False)
    if plan is None:
        plan = make_plan(opts, planned)
    work = first_start_work(plan, planned)
    with first_start(predict(plan.kernels, work)):  # one time left across the phases
        _check_first_start_space(plan, planned, work)
        return _build(plan, source if source is not None else open_model(opts.model, plan.dtype))


def _check_first_start_space(plan: Plan, planned, work: dict[str, float]) -> None:
    """Refuse a start whose cache files (:func:`~subspec.plan.first_start_cache_bytes`) do not fit the cache's free
    space, before the first of them is written (each phase checks its own again). While a file's digest is not
    remembered the cache's content cannot be looked up, so the digests are made first (the start makes them anyway)
    and what is already cached under them is not counted.

    Raises:
        SubspecError: one line naming the files, the bytes needed and free, and the fix.
    """
    from .cache import content_digest
    from .loading import cached_state

    if not sum(first_start_cache_bytes(plan, work).values()):
        return
    if not planned.key:  # (a checkpoint opened without its content key: look the cache up by its digests)
        for f in cached_state(planned.path, plan.dtype)[1]:
            content_digest(f)
        work = first_start_work(plan, planned)
    parts = first_start_cache_bytes(plan, work)
    if sum(parts.values()):
        check_free_space(cache_root(), sum(parts.values()), f"this model's first start ({', '.join(parts)})")


def _build(plan: Plan, source) -> Runtime:
    """The runtime of ``plan`` over ``source`` (opened, a GGUF converted): :func:`load`'s phases after opening."""
    opts, device, dtype, placement = plan.opts, plan.device, plan.dtype, plan.placement
    settings = plan.tree_settings()
    try:
        tokenizer = source.tokenizer()
    except SubspecError as e:  # a folder of weights only, or random weights: token ids in, token ids out
        log.info("%s", e)
        tokenizer = None
    substitutes = plan.substitutes
    if plan.advice:
        log.warning("%s", plan.advice)
    tier = None
    native = opts.native_kernels
    try:
        subs = {}
        if substitutes:  # quantized on an empty device (HQQ's temporaries do not compete with the KV cache)
            subs = load_substitutes(source, placement.substituted, SubstituteSpec(opts.bits, opts.group_size), dtype,
                                    device, dense=opts.dense_substitutes, native=native)
        coded = {}
        if placement.offloaded and placement.tier == "disk" and plan.coded:
            from .codec import coded_layers  # before the resident layers: the coding's buffers are transient

            coded = coded_layers(source, layer_layout(source.config, source.family, dtype), placement.offloaded, subs)
        decoder = Decoder.from_source(source, dtype, device, native=native,
                                      offload_embeddings=placement.embeddings_offloaded)
        resident = {i: load_linears(source, i, dtype, device, native) for i in placement.resident}
        if placement.offloaded:
            layout = layer_layout(source.config, source.family, dtype)
            if placement.tier == "disk":
                plain = [i for i in placement.offloaded if i not in coded]
                slots = _staging_slots(placement, coded, layout.extent)
                tier = DiskTier(packed_layers(source, layout, plain), layout, placement.offloaded, slots, device,
                                native=native, coded=coded, substitutes=subs, by_expert=opts.expert_streaming,
                                resident_attention=placement.resident_attention, expert_cache=placement.expert_cache)
                placement = replace(placement, stream_ratio=tier.stream_bytes / (len(placement.offloaded) * layout.extent),
                                    stream_ratio_estimated=False, staging_slots=slots, slot_bytes=tier.slot_bytes)
            else:
                tier = HostTier(source, layout, placement.offloaded, placement.staging_slots, device, native=native)
        layers = ResidentLayers(resident, tier)
        release_freed_heap()  # checkpoint reads and layer packing left freed heap behind: give it back before calibrating
        kv = decoder.new_kv_cache(opts.max_context + (settings.max_nodes if substitutes else 1))
        draft = None
        if substitutes:
            from .speculation import DraftHead, build_proposer, draft_vocab_size, head_rows

            special = list(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else []
            quantized = None
            if plan.head_bits == 4:
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


def _staging_slots(placement: Placement, coded: dict, extent: int) -> int:
    """Staging slots of the disk tier: the placement's, as many as its bytes for them hold of the real slots (slots of
    coded streams are as large as the largest stream; where a layer stayed plain, a stream that did not round-trip,
    every slot holds a whole layer), at least 2."""
    if placement.slot_bytes >= extent or not placement.offloaded:
        return placement.staging_slots
    if len(coded) < len(placement.offloaded):
        log.warning("%d of the %d offloaded layers are stored plain: staging slots of whole layers",
                    len(placement.offloaded) - len(coded), len(placement.offloaded))
        slot = extent
    else:
        slot = max(c.stream_bytes for c in coded.values())
    return max(2, min(placement.staging_slots, placement.staging_slots * placement.slot_bytes // slot))


def _calibrate(opts: Options, source, dtype, device, placement: Placement, engine: Engine, draft) -> None:
    """Choose the automatic tree settings from measured costs (cached per model, placement, kernels and machine;
    :mod:`subspec.policy`)."""
    from . import kernels
    from .policy import calibrate, candidate_budgets, forget_calibration

    budgets = candidate_budgets(draft.s, opts.verify_budget is not None)
    native = kernels.build_id() if opts.native_kernels else "torch"  # (a new kernel build is measured again)
    key = "|".join(str(x) for x in (source.key, dtype, device, placement.summary(), opts.bits, opts.group_size,
                                     placement.substitute_all,
                                     draft.s.topk, draft.head.size, native, torch.get_num_threads(), _cpu_name()))
    log.info("calibrating draft and verify costs (one time)")
    cal = calibrate(engine, draft, key, budgets)
    cal.choose(draft.s, budgets, opts.depth is not None, opts.verify_budget is not None, draft.depth_capacity,
               topk_given=opts.topk is not None)
    if opts.depth is None:
        def contradicted(t_step: float, t_verify: float) -> None:
            p = draft.policy  # (the step at the width drafted now, against the calibration's at that width)
            log.info("measured costs (draft step %.1f ms, verify %.0f ms) contradict the calibration (%.1f ms, "
                     "%.0f ms): following the measurements; the next start calibrates again", 1e3 * t_step,
                     1e3 * t_verify, 1e3 * p.prior_steps[p.topk], 1e3 * cal.t_verify[draft.s.verify_budget])
            forget_calibration(key)

        draft.policy = cal.policy(draft.s, draft.depth_capacity, on_contradicted=contradicted,
                                  adapt_width=opts.topk is None)
        if draft.s.depth == 0:
            p = draft.policy
            log.warning("drafting does not pay here (predicted %.2f tokens/s at the best depth %d, %.2f without "
                        "drafting): generating without a draft, re-measuring every %d rounds", p.rate(p.best_drafting()),
                        p.best_drafting(), p.rate(0), p.PROBE_EVERY)
    log.info("tree: depth %d, top-k %d, verify budget %d (draft step %s ms by width, verify %s s, its compute %s s)",
             draft.s.depth, draft.s.topk, draft.s.verify_budget,
             {w: round(1e3 * t, 1) for w, t in cal.t_draft_steps.items()},
             {n: round(t, 3) for n, t in cal.t_verify.items()}, {n: round(t, 3) for n, t in cal.t_verify_compute.items()})


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"
