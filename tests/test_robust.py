"""No crash, no hang, no stale cache: interrupted forwards, damaged cache files, every flag combination.

Each request that follows a failure runs under a deadline (a worker thread joined with a timeout), so a hang fails
the test instead of stalling the suite.
"""
from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from subspec.errors import SubspecError
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams

from conftest import save_tiny, tiny_config

PROMPT = [3, 5, 7, 11]
DEADLINE = 120


def within_deadline(fn, seconds: float = DEADLINE):
    """Run ``fn()`` in a thread; return its result or raise its exception; fail if it takes longer than ``seconds``."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for more than {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("robust") / "m", tiny_config("qwen2", False, vocab=96, layers=6))


@pytest.fixture(scope="module")
def reference(tiny):
    """Plain decoding with every layer resident: the output every configuration must reproduce."""
    rt = load(Options(model=str(tiny), method="ar", dtype="float32", max_context=256, offload="none"))
    return rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))


def offloaded(tiny, method: str, **kw):
    """A runtime of ``tiny`` with 2 of 6 layers resident and 4 on the disk tier."""
    rt = load(Options(model=str(tiny), method=method, dtype="float32", max_context=256, device_memory=1 << 30,
                      max_resident=2, **kw))
    assert rt.placement.offloaded == [0, 1, 3, 4]  # resident 2 and 5, spread
    return rt


@pytest.mark.parametrize("method", ["ar", "subspec"])
def test_exception_mid_forward_then_next_request_works(tiny, reference, monkeypatch, method):
    """An exception inside a layer forward (and a Ctrl-C there) leaves the disk tier usable: no hang, same output."""
    from subspec.model import Decoder

    rt = offloaded(tiny, method, depth=3, topk=2, verify_budget=6)
    real = Decoder.layer_forward
    for exc in (RuntimeError("injected"), KeyboardInterrupt()):
        calls = {"n": 0}

        def failing(self, i, *a, _exc=exc, **kw):
            calls["n"] += 1
            if i == 3 and calls["n"] > 8:  # a streamed layer, in the middle of a later forward
                raise _exc
            return real(self, i, *a, **kw)

        monkeypatch.setattr(Decoder, "layer_forward", failing)
        with pytest.raises(type(exc)):
            within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24)))
        monkeypatch.setattr(Decoder, "layer_forward", real)
        rt.engine.reset()
        assert within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))) == reference
    rt.close()


def test_a_verify_interrupted_with_coded_slots_read_ahead_leaves_the_next_request_equal_to_ar(tiny, monkeypatch):
    """BF16 on the native kernels: the offloaded layers stay coded in staging slots that the reader fills ahead while
    the draft runs. An exception inside a verify's layer, a Ctrl-C there and a request cancelled between rounds leave
    the tier and the KV cache consistent: the next request equals plain decoding token for token."""
    from subspec import kernels
    from subspec.model import Decoder

    if kernels.active() is None:
        pytest.skip(f"no native kernel tier here: {kernels.status()}")
    ref = load(Options(model=str(tiny), method="ar", dtype="bfloat16", max_context=256, offload="none"))
    want = ref.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))
    ref.close()
    rt = load(Options(model=str(tiny), method="subspec", dtype="bfloat16", max_context=256, device_memory=1 << 30,
                      max_resident=2, depth=3, topk=2, verify_budget=6, staging_slots=3))
    try:
        tier = rt.tier
        assert tier.coded and tier.slot_bytes < tier.layout.extent and tier.n_slots == 3  # slots of coded streams
        real = Decoder.layer_forward
        for exc in (RuntimeError("injected"), KeyboardInterrupt()):
            calls = {"n": 0}

            def failing(self, i, x, *a, _exc=exc, **kw):
                calls["n"] += 1
                if i == 3 and x.shape[0] > 1 and calls["n"] > 20:  # a streamed layer of a later verify (a tree)
                    raise _exc
                return real(self, i, x, *a, **kw)

            monkeypatch.setattr(Decoder, "layer_forward", failing)
            with pytest.raises(type(exc)):
                within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24)))
            monkeypatch.setattr(Decoder, "layer_forward", real)
            rt.engine.reset()
            assert within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))) == want
        stream = rt.engine.stream(PROMPT, SamplingParams(max_new_tokens=24))  # cancelled after two rounds
        next(stream), next(stream)
        stream.close()
        rt.engine.reset()
        assert within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))) == want
        assert rt.engine.last_stats.tau > 1  # the draft ran
    finally:
        rt.close()


def test_reader_error_is_raised_for_its_layer_and_the_tier_recovers(tiny, reference, monkeypatch):
    rt = offloaded(tiny, "ar")
    tier = rt.tier
    real = type(tier)._read
    broken = {"on": True}

    def read(self, layer, s):
        if broken["on"] and layer == 4:
            raise SubspecError(f"simulated read error in layer {layer}")
        return real(self, layer, s)

    monkeypatch.setattr(type(tier), "_read", read)
    for _ in range(3):  # raised every time the layer is needed, never a hang
        with pytest.raises(SubspecError, match="layer 4"):
            within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=4)))
        rt.engine.reset()
    broken["on"] = False
    assert within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))) == reference
    rt.close()


def test_truncated_packed_file_fails_in_one_line_then_is_rebuilt(tiny, reference, caplog):
    rt = offloaded(tiny, "ar")
    path = rt.tier.paths[3]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    for _ in range(2):
        with pytest.raises(SubspecError) as e:
            within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24)))
        assert str(path) in one_line(e.value)
        rt.engine.reset()
    rt.close()
    with caplog.at_level(logging.WARNING, logger="subspec"):
        again = offloaded(tiny, "ar")
    assert any(str(path) in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    assert within_deadline(lambda: again.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))) == reference
    again.close()


def test_a_flipped_byte_in_a_packed_file_fails_in_one_line_then_is_rebuilt(tiny, reference):
    """One bit flipped on disk inside a packed layer is an error of that layer naming the file (never other weights);
    the file is removed and the next start packs the layer again, with the reference output."""
    rt = offloaded(tiny, "ar")
    path = rt.tier.paths[3]
    q = next(t for t in rt.tier.layout.tensors if t.name == "self_attn.q_proj.weight")
    with open(path, "r+b") as f:
        f.seek(4096 + q.offset + 5)
        b = f.read(1)[0]
        f.seek(4096 + q.offset + 5)
        f.write(bytes([b ^ 0x10]))
    with pytest.raises(SubspecError) as e:
        within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24)))
    msg = one_line(e.value)
    assert str(path) in msg and "damaged" in msg and "self_attn.q_proj.weight" in msg
    assert not path.exists()
    rt.engine.reset()
    with pytest.raises(SubspecError, match=str(path)):  # asked again: the same error, never a hang
        within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24)))
    rt.close()
    again = offloaded(tiny, "ar")
    assert path.exists()
    assert within_deadline(lambda: again.engine.generate(PROMPT, SamplingParams(max_new_tokens=24))) == reference
    again.close()


GRID = [  # (max_context, depth, topk, verify_budget)
    (256, None, None, 8),      # a budget calibration never timed
    (100, 4, None, None),      # a short context with a fixed depth
    (16, None, None, None),    # the shortest context, automatic tree
    (40, 1, 1, 1),
    (256, 3, 2, None),
    (256, None, 2, 5),
    (256, 2, 5, 300),          # a budget larger than the tree
    (256, None, 1, None),      # a narrow tree: only small budgets fit
    (256, 0, None, None),
    (256, -1, None, None),
    (256, None, 0, None),
    (256, None, -3, None),
    (256, None, None, 0),
    (256, None, 97, None),     # wider than the vocabulary
    (600, None, None, None),   # beyond max_position_embeddings (512)
    (8, None, None, None),
]


@pytest.mark.parametrize("ctx,depth,topk,budget", GRID)
def test_tree_and_context_flags_run_and_equal_ar_or_fail_in_one_line(tiny, reference, ctx, depth, topk, budget):
    n = min(24, ctx - len(PROMPT))
    opts = Options(model=str(tiny), method="subspec", dtype="float32", max_context=ctx, device_memory=1 << 30,
                   max_resident=2, depth=depth, topk=topk, verify_budget=budget)
    try:
        rt = within_deadline(lambda: load(opts))
    except SubspecError as e:
        one_line(e)
        bad = [v for v in (depth, topk, budget) if v is not None and v < 1]
        assert bad or ctx > 512 or ctx < 16 or (topk or 0) > 96, f"refused a valid combination: {e}"
        return
    assert rt.placement.offloaded
    out = within_deadline(lambda: rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=n)))
    assert out == reference[:n]
    rt.close()


def test_sliding_window_model_runs_past_its_window_as_transformers_does(tmp_path):
    """A sliding-window model keeps the context asked for (no cap) and decodes past its window as transformers does."""
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path / "m", tiny_config("mistral", False, vocab=64, layers=2, sliding_window=8))
    rt = load(Options(model=str(path), method="ar", dtype="float32", max_context=200, offload="none"))
    assert rt.opts.max_context == 200 and rt.engine.max_context == 200
    out = rt.engine.generate([3, 4, 5], SamplingParams(max_new_tokens=30))
    rt.close()
    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    ref = hf.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=30, do_sample=False)[0, 3:].tolist()
    assert out == ref[:len(out)] and len(out) >= 12  # well past the 8-token window


def test_replaced_weights_of_the_same_shapes_give_the_new_models_output(tmp_path):
    """Packed layers and substitutes are keyed by content: new weights in the same file are never served stale."""
    cfg = tiny_config("llama", False, vocab=64, layers=4)
    path = save_tiny(tmp_path / "m", cfg, seed=0)

    def run():
        rt = load(Options(model=str(path), method="subspec", dtype="float32", max_context=128, device_memory=1 << 30,
                          max_resident=1, depth=3, topk=2, verify_budget=6))
        assert rt.placement.offloaded == [0, 1, 2]
        out = rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=16))
        rt.close()
        plain = load(Options(model=str(path), method="ar", dtype="float32", max_context=128, offload="none"))
        return out, plain.engine.generate(PROMPT, SamplingParams(max_new_tokens=16))

    first, first_plain = run()
    assert first == first_plain
    save_tiny(tmp_path / "m", cfg, seed=1)  # same names, shapes and file size; other values
    second, second_plain = run()
    assert second == second_plain and second_plain != first_plain


def test_damaged_cache_entries_are_rebuilt_with_a_notice(tiny, reference, caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache"
    opts = dict(depth=3, topk=2, verify_budget=6)
    rt = within_deadline(lambda: offloaded(tiny, "subspec", **opts))  # every entry exists
    key = rt.source.key
    rt.close()
    layer_file = next((root / "substitutes").glob(f"{key}-*/layer-00003.safetensors"))
    with open(layer_file, "r+b") as f:  # one byte short
        f.truncate(layer_file.stat().st_size - 1)
    with caplog.at_level(logging.WARNING, logger="subspec"):
        rt = offloaded(tiny, "subspec", **opts)
        assert rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24)) == reference
        rt.close()
    assert any(str(layer_file) in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    # plain files where folders belong, a folder where a file belongs, a digest memo that is not JSON
    for name in ("packed", "substitutes"):
        os.rename(root / name, root / f"{name}.away")
        (root / name).write_text("not a folder")
    (root / "calibration.json").unlink(missing_ok=True)
    (root / "calibration.json").mkdir()
    (root / "digests.json").write_text("{ truncated")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="subspec"):
        rt = within_deadline(lambda: offloaded(tiny, "subspec"))
        assert rt.engine.generate(PROMPT, SamplingParams(max_new_tokens=24)) == reference
        rt.close()
    notices = [r.getMessage() for r in caplog.records]
    for what in ("packed", "substitutes", "calibration.json", "digests.json"):
        assert any(str(root / what) in m and "rebuilding" in m for m in notices), (what, notices)
