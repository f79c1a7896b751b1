"""The command line run in a process of its own, as a user runs it, without paying for torch's and transformers'
imports in every one.

:func:`run_cli` is ``subprocess.run([sys.executable, "-m", "subspec", *args], capture_output=True, text=True, ...)``
with the interpreter's start and the third-party imports done once: each call is a new process forked from a
multiprocessing fork server that imported torch, transformers (with the CLI's hook installed first, as
``python -m subspec`` has it), tokenizers, gguf and safetensors, and nothing else. subspec itself is imported anew in
each child, so what it reads at import (``SUBSPEC_KERNELS``, ``SUBSPEC_CACHE``, ...) comes from the run's environment.
A child gets the run's argument vector, environment, working folder, ``sys.path`` as ``python -m`` builds it (the
working folder, ``PYTHONPATH``'s entries, the interpreter's own), standard input, file-level standard output and error, and exits with ``python -m subspec``'s status (a traceback and 1 for an
uncaught exception, as the interpreter does). On this project's 2-core machines that is 4-10 s less for each CLI run
of the test suite.

What a child does not repeat is the interpreter's own start and the entry point's import hook: tests/test_process.py
checks those in fresh interpreters, and the tests that drive a CLI with signals or a server start real processes.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_BASE_PATH: list[str] = []  # the fork server's sys.path (site-packages and the standard library), set by _preload
_lock = threading.Lock()
_context = None


def _preload() -> None:
    """In the fork server only: the third-party imports of a CLI run (transformers after the CLI's hook)."""
    from subspec.process import skip_hqq_at_transformers_import

    skip_hqq_at_transformers_import()
    import gguf  # noqa: F401
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers
    from transformers import PreTrainedTokenizerFast  # noqa: F401
    from transformers.integrations import ggml  # noqa: F401

    for model_type in ("llama", "qwen2", "gemma3_text"):
        transformers.AutoConfig.for_model(model_type)
    # the interpreter's own path, without the entries of the server's start (its '' and this folder)
    _BASE_PATH[:] = [p for p in sys.path if p not in ("", _HERE)]
    # subspec was imported for its hook only: the children import it afresh, under their own environment
    for name in [m for m in sys.modules if m == "subspec" or m.startswith("subspec.")]:
        del sys.modules[name]


if os.environ.get("_SUBSPEC_CLI_FORKSERVER"):  # imported by the fork server (its preload list names this module)
    _preload()


def _ctx():
    global _context
    with _lock:
        if _context is None:
            from multiprocessing import forkserver

            ctx = multiprocessing.get_context("forkserver")
            saved = {k: os.environ.get(k) for k in ("_SUBSPEC_CLI_FORKSERVER", "PYTHONPATH")}
            # seen by the server only, which starts now with this environment: it preloads, and finds this module
            os.environ["_SUBSPEC_CLI_FORKSERVER"] = "1"
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, saved["PYTHONPATH"]]))
            try:
                ctx.set_forkserver_preload([__name__])
                forkserver.ensure_running()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            _context = ctx
        return _context


def _child(args: list[str], env: dict, stdin_path: str, out_path: str, err_path: str, cwd: str | None) -> None:
    """In the forked child: become ``python -m subspec *args`` and exit with its status (raises SystemExit)."""
    import runpy
    import traceback

    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    for fd, path, flags in ((0, stdin_path, os.O_RDONLY), (1, out_path, os.O_WRONLY), (2, err_path, os.O_WRONLY)):
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.argv = ["-m", *args]
    code = 0
    try:
        if not _BASE_PATH:
            raise RuntimeError("tests/cli_process.py: the fork server did not preload this module")
        # python -m's path: the working folder, PYTHONPATH's entries, then the interpreter's own (multiprocessing gave
        # the child its parent's, the test worker's)
        sys.path[:] = [os.getcwd(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *_BASE_PATH]
        runpy.run_module("subspec", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    raise SystemExit(code & 0xFF)  # multiprocessing's exit: finalizers run, non-daemon threads joined, then _exit


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, input: str | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m subspec *args`` in a new process with environment ``env`` (the whole environment), standard input
    ``input`` (empty when None), in ``cwd``; output captured as text.

    Raises subprocess.TimeoutExpired (the child killed) when it runs past ``timeout`` seconds."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="subspec-cli-") as d:
        paths = [os.path.join(d, n) for n in ("stdin", "stdout", "stderr")]
        for p, text in zip(paths, (input or "", "", "")):
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
        proc = _ctx().Process(target=_child, args=(list(args), env, *paths, cwd))
        proc.start()
        try:
            proc.join(timeout)
            if proc.exitcode is None:
                raise subprocess.TimeoutExpired([sys.executable, "-m", "subspec", *args], timeout)
        finally:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
            code = proc.exitcode
            proc.close()
        with open(paths[1], encoding="utf-8") as o, open(paths[2], encoding="utf-8", errors="replace") as e:
            out, err = o.read(), e.read()
    return subprocess.CompletedProcess([sys.executable, "-m", "subspec", *args], code, out, err)
