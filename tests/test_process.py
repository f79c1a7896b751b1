"""The library leaves its host process as it found it (or scopes what it changes): the garbage collector's freeze is
held per runtime and released by the last one, importing subspec sets no environment variable (the command line
asks for huge pages for its own process), and gguf.GGUFReader stays a class that only the thread opening a file
shares a reader through."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import save_tiny, tiny_config

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, env_update: dict | None = None, drop: tuple[str, ...] = ()) -> str:
    """Run ``code`` in a fresh interpreter (one torch thread); return its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", **(env_update or {}))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


VM_FLAGS = """
def vm_flags(p):
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= p < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []
"""
"""The VmFlags of the mapping that holds address p (code for the child interpreter)."""


GC_SCRIPT = """
import gc, json, sys
from subspec.runtime import Options, load
opts = Options(model=sys.argv[1] if len(sys.argv) > 1 else {model!r}, method="ar", dtype="float32", max_context=64,
               offload="none")
out = {{"start": gc.get_freeze_count()}}
a = load(opts)
b = load(opts)
out["both"] = gc.get_freeze_count()
a.close(); a.close()
out["after_a"] = gc.get_freeze_count()
b.close()
out["after_b"] = gc.get_freeze_count()
gc.freeze()  # the host process freezes objects itself: a runtime loaded and closed leaves them frozen
out["host"] = gc.get_freeze_count()
c = load(opts)
out["host_loaded"] = gc.get_freeze_count()
c.close()
out["host_closed"] = gc.get_freeze_count()
print(json.dumps(out))
"""


def test_closing_one_of_two_runtimes_keeps_the_others_objects_frozen(tmp_path):
    model = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=64, layers=2))
    got = json.loads(_python(GC_SCRIPT.format(model=str(model))))
    assert got["start"] == 0 and got["both"] > 0
    assert got["after_a"] >= got["both"]  # b's objects (and a's, until the last runtime closes) stay frozen
    assert got["after_b"] == 0  # the last runtime gives everything back
    assert got["host"] > 0 and got["host_loaded"] == got["host"] and got["host_closed"] == got["host"]


def test_importing_subspec_sets_no_environment_variable_and_the_cli_asks_for_huge_pages():
    """``import subspec`` (and its command line module) leaves os.environ and torch unimported; the command line's
    entry point sets THP_MEM_ALLOC_ENABLE=1 before torch allocates, so its large tensors are advised to use huge pages
    (``hg`` among the flags of their mapping), unless the environment says 0."""
    code = ("import os, sys, subspec, subspec.cli; "
            "print(repr(os.environ.get('THP_MEM_ALLOC_ENABLE')), 'torch' in sys.modules)")
    assert _python(code, drop=("THP_MEM_ALLOC_ENABLE",)) == "None False"
    cli = VM_FLAGS + ("import os\nfrom subspec import cli\ntry:\n    cli.main(['--version'])\nexcept SystemExit:\n"
                      "    pass\nimport torch\nt = torch.empty(64 << 20, dtype=torch.uint8)\n"
                      "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), 'hg' in vm_flags(t.data_ptr()))")
    assert _python(cli, drop=("THP_MEM_ALLOC_ENABLE",)) == "1 True"
    assert _python(cli, env_update={"THP_MEM_ALLOC_ENABLE": "0"}) == "0 False"


def test_the_cli_keeps_transformers_from_importing_hqq_and_transformers_hqq_cache_still_works():
    """After the command line's entry point, importing transformers (a llama config) imports neither hqq nor torch's
    compiler stack (hqq's module runs torch.compile at import); transformers.cache_utils still reports hqq's real
    availability and its quantizer is hqq's own on first use. Importing the library alone changes nothing."""
    import importlib.util

    if importlib.util.find_spec("hqq") is None:
        pytest.skip("hqq is not installed")
    body = ("import sys\nfrom transformers import AutoConfig\nAutoConfig.for_model('llama')\n"
            "import transformers.cache_utils as cu\n"
            "seen = ('hqq.core.quantize' in sys.modules, 'torch._dynamo' in sys.modules)\n"
            "print(seen, cu.is_hqq_available(), getattr(cu, 'HQQQuantizer', None) is not None and "
            "cu.HQQQuantizer.quantize.__qualname__)")
    cli = "from subspec import cli\ntry:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n" + body
    assert _python(cli) == "(False, False) True Quantizer.quantize"
    lib = ("import sys, subspec, subspec.process, subspec.cli\n"
           "print(any(type(f).__module__.startswith('subspec') for f in sys.meta_path))")
    assert _python(lib) == "False"


def _tiny_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.value", 7)
    w.add_tensor("x", np.arange(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_one_reader_is_scoped_to_its_thread_and_gguf_reader_stays_a_class(tmp_path):
    """Inside ``one_reader(f)`` the opening thread shares one reader of ``f``; another thread opening ``f`` gets its own
    reader; ``gguf.GGUFReader`` stays a subclass of the original; blocks of two threads that end in crossed order
    leave the original class in place."""
    import gguf

    from subspec.convert import one_reader

    original = gguf.GGUFReader
    a, b = _tiny_gguf(tmp_path / "a.gguf"), _tiny_gguf(tmp_path / "b.gguf")
    seen: dict = {}
    with one_reader(a) as shared:
        assert gguf.GGUFReader(str(a)) is shared
        assert isinstance(gguf.GGUFReader, type) and issubclass(gguf.GGUFReader, original)
        t = threading.Thread(target=lambda: seen.update(other=gguf.GGUFReader(str(a))))
        t.start()
        t.join(60)
        assert seen["other"] is not shared and isinstance(seen["other"], original)
        assert gguf.GGUFReader(str(b)) is not shared  # another file: a reader of its own
    assert gguf.GGUFReader is original

    entered, leave_a, done = threading.Event(), threading.Event(), threading.Event()

    def hold_a():
        with one_reader(a):
            entered.set()
            assert leave_a.wait(60)
        done.set()

    t = threading.Thread(target=hold_a)
    t.start()
    assert entered.wait(60)
    with one_reader(b) as rb:  # entered after a's block, left before it ends
        assert gguf.GGUFReader(str(b)) is rb and gguf.GGUFReader(str(a)) is not rb
    leave_a.set()
    assert done.wait(60)
    t.join(60)
    assert gguf.GGUFReader is original
    with pytest.raises(Exception):
        with one_reader(tmp_path / "missing.gguf"):
            pass
    assert gguf.GGUFReader is original


def test_the_test_run_keeps_its_caches_and_models_out_of_home(tmp_path_factory):
    """The derived cache and downloaded models of a test run live in its temporary folder (removed by pytest after a
    few runs), not in HOME, unless the caller named their own folders (SUBSPEC_CACHE, SUBSPEC_MODELS)."""
    import conftest

    home, root = Path.home().resolve(), conftest.run_root(tmp_path_factory).resolve()
    for var, used in (("SUBSPEC_CACHE", "SUBSPEC_CACHE"), ("SUBSPEC_MODELS", "SUBSPEC_TEST_MODELS")):
        if var in conftest.CALLER_SET:
            continue
        where = Path(os.environ[used]).resolve()
        assert where.is_relative_to(root) and not where.is_relative_to(home), (var, where)


def test_the_cli_tests_forked_runner_gives_what_a_fresh_interpreter_gives(tmp_path):
    """tests/cli_process.py's ``run_cli`` (the CLI tests' runner: children forked from a server that imported torch
    and transformers once) gives exactly what ``python -m subspec`` gives: the same exit status, stdout and stderr for
    the help, for a user error that depends on an environment variable read when subspec is imported, and for a plan
    of a tiny model read through a relative path from the working folder given."""
    from cli_process import run_cli

    save_tiny(tmp_path / "tiny", tiny_config("llama", True, vocab=64))
    cases = [(("--help",), {}), (("plan", "--model", "tiny", "--no-forecast"), {"SUBSPEC_KERNELS": "sse9"}),
             (("plan", "--model", "tiny", "--device-memory", "1GiB", "--dtype", "float32", "--max-context", "256",
              "--no-forecast"), {})]
    for args, env_update in cases:
        env = dict(os.environ, **env_update)
        fresh = subprocess.run([sys.executable, "-m", "subspec", *args], capture_output=True, text=True, timeout=300,
                               env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
        forked = run_cli(*args, env=env, cwd=str(tmp_path))
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args
        assert fresh.stdout or fresh.stderr
    assert fresh.returncode == 0 and "resident" in fresh.stdout, fresh.stdout  # the tiny model's plan was made
