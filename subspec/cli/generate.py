"""``subspec generate``: one prompt, the answer streamed to stdout, statistics on stderr."""
from __future__ import annotations

import json
import sys

from .options import (add_model_options, add_sampling_options, load_runtime, low_acceptance_note, sampling_params,
                      stats_line)


def add_parser(sub, common) -> None:
    p = sub.add_parser("generate", parents=[common], help="generate text for one prompt (streamed to stdout)",
                       description="Generate text for one prompt, streamed to stdout as tokens are accepted. "
                                   "Statistics go to stderr.")
    p.add_argument("prompt", nargs="?", metavar="PROMPT",
                   help="the prompt (or --prompt-file, or standard input when it is not a terminal)")
    p.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    p.add_argument("--raw", action="store_true",
                   help="plain completion of the prompt text (default: apply the model's chat template)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object {text, token_ids, stats} as the last line instead of streaming")
    p.add_argument("--show-plan", action="store_true",
                   help="print the run's plan on stderr before loading (what `subspec plan` prints, without the "
                        "forecast)")
    add_model_options(p)
    add_sampling_options(p, "the most tokens to generate")
    p.set_defaults(run=run)


def read_prompt(args) -> str:
    """The prompt from the argument, --prompt-file or standard input. Raises SubspecError when there is none."""
    from ..errors import SubspecError

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


def run(args) -> int:
    prompt = read_prompt(args)
    sampling_params(args)  # invalid sampling values are reported before anything is loaded
    rt, params = load_runtime(args)
    try:
        ids: list[int] = []
        text = ""
        stream = rt.stream_text(rt.encode(prompt, chat=not args.raw), params)
        try:
            for chunk, new in stream:
                ids += chunk
                text += new
                if not args.json and new:
                    sys.stdout.write(new)
                    sys.stdout.flush()
        except BaseException:  # (a Ctrl-C) the answer so far ends its line: "interrupted" is not glued to it
            if not args.json and text and not text.endswith("\n"):
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
        finally:
            stream.close()
        stats = rt.engine.last_stats
        if args.json:
            d = stats.as_dict()
            d["placement"] = rt.placement.summary()
            print(json.dumps({"text": text, "token_ids": ids, "stats": d}), flush=True)
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(stats_line(stats, rt.placement, rt.exactness), file=sys.stderr, flush=True)
        note = low_acceptance_note(stats, args.method)
        if note:
            print(note, file=sys.stderr, flush=True)
    finally:
        rt.close()
    return 0
