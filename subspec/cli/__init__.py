"""Command line: ``subspec generate``, ``chat``, ``plan``, ``bench`` and ``serve``, one module per command.

Each command module has ``add_parser(subparsers, common)``, which registers its options (the shared ones come from
:mod:`subspec.cli.options`, the one options builder) and sets ``run(args) -> exit status``.

Every user error (:class:`~subspec.errors.SubspecError`) is printed as one line ``subspec: error: <message>`` on
stderr with exit status 2 (the traceback only with ``--debug``); Ctrl-C during the one-time preparation prints
``subspec: interrupted`` and exits with 130 (cache entries are written atomically, so nothing half-written stays),
also where the interrupt surfaced as another error (:class:`InterruptWatch`).

Heavy imports (torch, transformers) happen inside the commands, so that ``--help`` is fast and Ctrl-C during
start-up is handled like any other interruption.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional

from . import bench, chat, generate, plan, serve
from .options import PROG, SigintScope, default_model, setup_logging

__all__ = ["main", "build_parser", "default_model"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
COMMANDS = (generate, chat, plan, bench, serve)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug log messages")
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run LLMs larger than device memory, losslessly: offloaded layers + SubSpec speculative "
                    "decoding (the output is exactly the full model's).",
        epilog="Run 'subspec COMMAND --help' for the options of a command.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub, common)
    return parser


class InterruptWatch(SigintScope):
    """Remembers a SIGINT while a command runs, then raises Python's KeyboardInterrupt as usual.

    A Ctrl-C that lands while the main thread waits on a worker (a thread pool's ``Future.result``: a
    ``threading.Condition`` wait) can surface as another exception (``RuntimeError: release unlocked lock``), which
    a loader then reports as a damaged input (e.g. "cannot read GGUF ... corrupted"); with the interrupt remembered,
    :func:`main` reports such an error as the interruption it is (exit 130). Installed only over Python's default
    handler, from the main thread (a SIGINT ignored by a background job stays ignored), and put back on exit. A
    command that catches a Ctrl-C and goes on installs its own handler meanwhile (``chat``'s answers), so an interrupt
    it consumed is not remembered here.
    """

    only_over_default = True

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def handler(self, signum, frame) -> None:
        self.seen = True
        signal.default_int_handler(signum, frame)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``subspec`` console script (and ``python -m subspec``); exits with the status."""
    from ..process import skip_hqq_at_transformers_import, use_huge_pages

    use_huge_pages()  # this process's setting (before torch allocates), see subspec.process
    skip_hqq_at_transformers_import()  # 3 s of start-up on a 2-core CPU, see subspec.process
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    setup_logging(debug)
    watch = InterruptWatch()
    try:
        from ..errors import SubspecError

        try:
            with watch:
                from ..kernels import check_forced

                check_forced()  # a wrong SUBSPEC_KERNELS fails now, not after the model's metadata is parsed
                code = args.run(args)
        except Exception as e:
            if watch.seen:  # the error is what a Ctrl-C left behind (InterruptWatch)
                raise KeyboardInterrupt from None
            if not isinstance(e, SubspecError):
                raise
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
