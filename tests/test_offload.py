"""Placement and offload tiers: exact output, bytes really read from disk, the budget's minimum."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from subspec.engine import Engine, NoDraft
from subspec.errors import SubspecError
from subspec.layout import layer_layout
from subspec.loading import open_model
from subspec.model import Decoder, ResidentLayers, load_linears
from subspec.placement import plan_placement
from subspec.runtime import Options, load, plan_for
from subspec.sampling import SamplingParams
from subspec.tiers import DiskTier, packed_layers

from conftest import save_tiny, tiny_config


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


@pytest.fixture()
def tiny(tmp_path):
    return save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=96, layers=6))


def test_resident_layers_are_spread_among_the_offloaded():
    """Each resident layer follows a run of offloaded ones (the disk reads the next offloaded layer while a resident one
    computes); r evenly spaced layers, the last one resident."""
    from subspec.placement import spread_resident

    assert spread_resident(8, 28) == [3, 6, 10, 13, 17, 20, 24, 27]
    assert spread_resident(2, 30) == [14, 29]
    assert spread_resident(0, 5) == [] and spread_resident(5, 5) == [0, 1, 2, 3, 4]
    for L in range(1, 40):
        for r in range(L + 1):
            res = spread_resident(r, L)
            assert len(set(res)) == r and all(0 <= i < L for i in res) and res == sorted(res)
            gaps = [b - a for a, b in zip([-1] + res, res)]
            assert max(gaps, default=1) - min(gaps, default=1) <= 1  # as even as the counts allow


def test_placement_accounts_and_minimum(tiny):
    src = open_model(tiny)
    cfg, fam = src.config, src.family
    full = plan_placement(cfg, fam, torch.float32, None, max_context=256)
    assert full.offloaded == [] and full.tier == "none"
    layout = layer_layout(cfg, fam, torch.float32)
    assert layout.nbytes == sum(src.nbytes(f"model.layers.0.{t.name}") for t in layout.tensors)
    budget = full.full_draft_minimum + 2 * full.layer_bytes + full.staging_slots * 0
    p = plan_placement(cfg, fam, torch.float32, budget, max_context=256)
    assert p.total <= budget and len(p.resident) >= 1
    assert sorted(p.resident + p.offloaded) == list(range(6)) and p.resident[-1] == 5  # spread, the last resident
    assert plan_placement(cfg, fam, torch.float32, budget + 3 * p.layer_bytes, max_context=256).resident != p.resident
    with pytest.raises(SubspecError, match="minimum"):
        plan_placement(cfg, fam, torch.float32, p.minimum - 1, max_context=256)
    assert "kv cache" in p.table() and "resident layers" in p.table()


def test_disk_offload_ar_token_identical_and_reads_offloaded_bytes(tiny):
    src = open_model(tiny)
    dec = Decoder.from_source(src, torch.float32, "cpu")
    all_layers = ResidentLayers({i: load_linears(src, i, torch.float32, "cpu") for i in range(6)})
    ref = Engine(dec, all_layers, NoDraft(), [], 200).generate([3, 5, 7, 11], SamplingParams(max_new_tokens=40))

    layout = layer_layout(src.config, src.family, torch.float32)
    offloaded = [1, 2, 3, 4, 5]
    paths = packed_layers(src, layout, offloaded)
    io0 = _read_bytes()
    tier = DiskTier(paths, layout, offloaded, n_slots=2)
    assert tier.direct, "O_DIRECT should work on this filesystem"
    layers = ResidentLayers({0: all_layers.resident[0]}, tier)
    eng = Engine(dec, layers, NoDraft(), [], 200, tier=tier)
    out = eng.generate([3, 5, 7, 11], SamplingParams(max_new_tokens=40))
    tier.close()  # the reader thread has stopped: its byte count and the kernel's are final
    io1 = _read_bytes()
    assert out == ref
    forwards = eng.last_stats.target_forwards
    expected = forwards * len(offloaded) * layout.extent
    assert eng.last_stats.bytes_streamed == tier.bytes_streamed == expected  # every forward got every layer once
    # from disk: each layer once per forward, plus at most the ring's read-ahead after the last forward
    assert expected <= tier.bytes_read <= expected + tier.n_slots * layout.extent
    assert expected <= io1 - io0 <= expected + tier.n_slots * layout.extent + (1 << 20), (io1 - io0, expected)


def test_the_rounds_timeline_counts_the_disks_busy_time_while_drafting_and_verifying(tiny, monkeypatch):
    """A disk of 10 ms a read (preadv slowed): the tier's busy seconds are at least its reads' 10 ms each, and a
    round's timeline splits them between the draft (here a 30 ms proposer, while the reader reads ahead into the
    slots the last verify freed) and the verify; the verify's blocked time is part of the verify's."""
    import os
    import time

    import subspec.tiers as tiers

    real = os.preadv

    def slow(fd, bufs, offset):
        time.sleep(0.01)
        return real(fd, bufs, offset)

    monkeypatch.setattr(tiers.os, "preadv", slow)

    class SlowDraft(NoDraft):
        def propose(self, root, cache_len):
            time.sleep(0.03)
            return super().propose(root, cache_len)

    src = open_model(tiny)
    dec = Decoder.from_source(src, torch.float32, "cpu")
    layout = layer_layout(src.config, src.family, torch.float32)
    offloaded = [1, 2, 3, 4, 5]
    tier = DiskTier(packed_layers(src, layout, offloaded), layout, offloaded, n_slots=2)
    try:
        eng = Engine(dec, ResidentLayers({0: load_linears(src, 0, torch.float32, "cpu")}, tier), SlowDraft(), [],
                     200, tier=tier)
        eng.generate([3, 5, 7, 11], SamplingParams(max_new_tokens=6))
        st = eng.last_stats
        busy, reads = tier.busy_seconds(), tier.bytes_read // layout.extent
    finally:
        tier.close()
    assert st.rounds == 5 and reads >= 6 * len(offloaded)
    assert busy >= 0.01 * reads
    assert 0 < st.verify_wait_seconds <= st.verify_seconds
    # the reader refills the two freed slots during each 30 ms draft: 2 reads of >= 10 ms a round, overlapped
    assert st.draft_disk_seconds >= 0.01 * st.rounds, st
    assert st.verify_disk_seconds >= 0.01 * (len(offloaded) - 2) * st.rounds, st
    assert st.draft_disk_seconds + st.verify_disk_seconds <= busy + 1e-6


@pytest.mark.slow
def test_smollm2_disk_offload_matches_resident(smollm2_gguf):
    params = SamplingParams(max_new_tokens=32)
    base = load(Options(model=str(smollm2_gguf), method="ar", dtype="float32", max_context=256))
    ids = base.encode("Name three colors of the rainbow.")
    ref = base.engine.generate(ids, params)
    minimum = base.placement.minimum
    off = load(Options(model=str(smollm2_gguf), method="ar", dtype="float32", max_context=256,
                       device_memory=minimum + 4 * base.placement.layer_bytes))
    assert len(off.placement.offloaded) >= 0.75 * 30
    assert off.engine.generate(ids, params) == ref
    st = off.engine.last_stats
    assert st.bytes_streamed >= st.target_forwards * off.placement.offloaded_bytes * 0.95
    off.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_tier_token_identical(tiny):
    params = SamplingParams(max_new_tokens=32)
    ref = load(Options(model=str(tiny), method="ar", dtype="float32", device="cuda", offload="none",
                       max_context=128)).engine.generate([3, 5, 7], params)
    full = load(Options(model=str(tiny), method="ar", dtype="float32", device="cuda", max_context=128,
                        device_memory=1 << 30))
    budget = full.placement.minimum + full.placement.layer_bytes
    for tier in ("host", "disk"):
        rt = load(Options(model=str(tiny), method="ar", dtype="float32", device="cuda", offload=tier,
                          device_memory=budget, max_context=128))
        assert rt.placement.offloaded
        assert rt.engine.generate([3, 5, 7], params) == ref
        rt.close()


def test_disk_tier_resynchronizes_after_an_interrupted_forward(tiny):
    """A forward cut off mid-way (Ctrl-C) must not leave the stream expecting the wrong layer."""
    src = open_model(tiny)
    layout = layer_layout(src.config, src.family, torch.float32)
    tier = DiskTier(packed_layers(src, layout, [2, 3, 4, 5]), layout, [2, 3, 4, 5], n_slots=2)
    w3 = src.tensor("model.layers.3.self_attn.q_proj.weight")
    w2 = src.tensor("model.layers.2.self_attn.q_proj.weight")
    tier.acquire(2)
    tier.release(2)
    # interrupted here: layers 3..5 never consumed; the next forward starts again at layer 2
    assert torch.equal(tier.acquire(2).q_proj.weight, w2)
    tier.release(2)
    assert torch.equal(tier.acquire(3).q_proj.weight, w3)
    tier.release(3)
    tier.close()


def test_untied_embeddings_go_with_the_offloaded_weights_when_the_budget_binds(tiny):
    """Under a binding budget the untied embedding table leaves the device (its bytes buy layers), its rows are read
    from the checkpoint file on demand, and the output is unchanged."""
    from subspec.embedding import EmbeddingRows

    src = open_model(tiny)
    cfg, fam = src.config, src.family
    full = plan_placement(cfg, fam, torch.float32, None, max_context=256)
    assert not full.embeddings_offloaded  # no budget: everything on the device
    budget = full.minimum + 2 * full.layer_bytes
    kept = plan_placement(cfg, fam, torch.float32, budget, max_context=256, offload_embeddings=False)
    moved = plan_placement(cfg, fam, torch.float32, budget, max_context=256)
    emb = cfg.vocab_size * cfg.hidden_size * 4
    assert moved.embeddings_offloaded and dict((n, b) for n, b, _ in moved.items)["embeddings"] == 0
    assert moved.minimum < kept.minimum and len(moved.resident) >= len(kept.resident)
    assert moved.total <= budget

    dec = Decoder.from_source(src, torch.float32, "cpu", offload_embeddings=True)
    assert isinstance(dec.embed, EmbeddingRows) and dec.embed.shape == (cfg.vocab_size, cfg.hidden_size)
    table = src.tensor("model.embed_tokens.weight")
    ids = torch.tensor([0, 5, 95, 5, 17])
    assert torch.equal(dec.embed[ids], table[ids])
    assert emb == table.numel() * 4

    ref = load(Options(model=str(tiny), method="ar", dtype="float32", max_context=256, offload="none"))
    want = ref.engine.generate([3, 5, 7, 11], SamplingParams(max_new_tokens=24))
    ref.close()
    for method in ("ar", "subspec"):
        opts = Options(model=str(tiny), method=method, dtype="float32", max_context=256, device_memory=1 << 30)
        roomy, _ = plan_for(opts, src)
        opts = replace(opts, device_memory=roomy.full_draft_minimum + 2 * roomy.layer_bytes)
        rt = load(opts)
        assert rt.placement.offloaded and rt.placement.embeddings_offloaded and isinstance(rt.engine.decoder.embed, EmbeddingRows)
        assert rt.engine.generate([3, 5, 7, 11], SamplingParams(max_new_tokens=24)) == want, method
        rt.close()


class _FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister (pointer, size); registering fails from call ``fail_at`` on."""

    def __init__(self, fail_at: int | None = None):
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def cudaHostRegister(self, ptr, size, flags):
        if self.fail_at is not None and len(self.registered) >= self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


class _FakeStream:
    def __init__(self, device=None):
        self.synchronized = 0

    def wait_event(self, event):
        pass

    def synchronize(self):
        self.synchronized += 1


class _FakeEvent:
    def record(self, stream=None):
        pass


def _fake_cuda(monkeypatch, cudart: _FakeCudart) -> None:
    """Enough of torch.cuda for HostTier to run its real code on CPU tensors (the copies are plain CPU copies)."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())


def test_host_tier_unpins_every_buffer_once_on_close_and_when_building_fails(tiny, monkeypatch):
    """HostTier page-locks each offloaded layer's buffer (exact size) and unlocks each exactly once: at close (after its
    copy stream is idle; closing twice does nothing) and when building fails half-way (the buffers pinned so far)."""
    from subspec.tiers import HostTier

    src = open_model(tiny)
    layout = layer_layout(src.config, src.family, torch.float32)
    cudart = _FakeCudart()
    _fake_cuda(monkeypatch, cudart)
    tier = HostTier(src, layout, [1, 2, 3], n_slots=2, device="cpu")
    assert [size for _, size in cudart.registered] == [layout.extent] * 3
    assert torch.equal(tier.acquire(1).q_proj.weight, src.tensor("model.layers.1.self_attn.q_proj.weight"))
    tier.release(1)
    tier.close()
    assert sorted(cudart.unregistered) == sorted(p for p, _ in cudart.registered)
    assert tier._stream.synchronized == 1
    tier.close()
    assert len(cudart.unregistered) == 3
    with pytest.raises(RuntimeError, match="after close"):
        tier.acquire(1)

    failing = _FakeCudart(fail_at=2)
    _fake_cuda(monkeypatch, failing)
    with pytest.raises(SubspecError, match="cannot pin"):
        HostTier(src, layout, [1, 2, 3], n_slots=2, device="cpu")
    assert sorted(failing.unregistered) == sorted(p for p, _ in failing.registered) and len(failing.registered) == 2


def test_layer_file_checksum_is_zlibs_crc32():
    """The layer files' checksum (ISA-L where installed) has zlib's CRC-32 values, so files stay valid either way."""
    import zlib

    from subspec import layerfile

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g).numpy()
    spans = [("a", 0, 4096), ("b", 4096 + 64, (1 << 20) + 5), ("c", 2 << 20, 1 << 20)]
    got = layerfile.checksums(data, spans)
    assert [c.crc for c in got] == [zlib.crc32(memoryview(data)[o:o + n]) for _, o, n in spans]
    assert layerfile.verify(memoryview(data), tuple(got)) is None
    data[(2 << 20) + 17] ^= 1
    assert "section c fails its CRC-32" in layerfile.verify(memoryview(data), tuple(got))


def test_a_layer_file_header_grows_past_4_kib_for_many_sections(tmp_path, caplog):
    """A layer of many experts lists hundreds of sections: the header takes as many 4 KiB blocks as it needs, the
    payload starts after it (read_sections says where), and a file of the older fixed 4 KiB header is rebuilt."""
    import json

    from subspec import layerfile

    data = torch.arange(3 * 4096, dtype=torch.int64).to(torch.uint8).numpy()
    spans = [(f"mlp.experts.{e}.gate_proj.weight", 32 * e, 32) for e in range(384)]
    path = tmp_path / layerfile.file_name(0)
    layerfile.write(path, {"format": "f", "layer": 0}, data, layerfile.checksums(data, spans))
    payload, sections, start = layerfile.read_sections(path)
    assert start > 4096 and start % 4096 == 0 and payload == data.size and len(sections) == 384
    raw = path.read_bytes()
    assert raw.startswith(b"subspec-layer-file %d\n" % start) and raw[start:] == data.tobytes()
    assert layerfile.verify(memoryview(raw[start:]), sections) is None
    found, todo = layerfile.scan(tmp_path, [0], lambda i: {"format": "f", "layer": i})
    assert found == {0: path} and todo == []
    head = json.dumps({"format": "f", "layer": 0, "payload_bytes": 4096, "checksum": "crc32", "sections": []}).encode()
    path.write_bytes(head + b" " * (4096 - len(head)) + bytes(4096))  # the header format of earlier versions
    found, todo = layerfile.scan(tmp_path, [0], lambda i: {"format": "f", "layer": i})
    assert found == {} and todo == [0] and not path.exists() and "older subspec" in caplog.text


def test_a_full_disk_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    """Packing offloaded layers into a cache whose disk has less free space than the files need: one error naming the
    bytes needed and free, raised before any layer file is written (nothing half-written left behind)."""
    import shutil
    from collections import namedtuple

    from subspec import cache

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    src = open_model(tiny)
    layout = layer_layout(src.config, src.family, torch.float32)
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda p: usage(real(p).total, real(p).used, 1 << 20))
    with pytest.raises(SubspecError, match=r"not enough disk space for 3 packed layers .* needs .* GiB \(.* GiB and "
                                           r"a 64 MiB margin\), 0\.00 GiB free: free some space or set "
                                           r"SUBSPEC_CACHE") as e:
        packed_layers(src, layout, [1, 2, 3])
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "cache").rglob("layer-*"))
    monkeypatch.setattr(cache.shutil, "disk_usage", real)
    assert sorted(packed_layers(src, layout, [1, 2, 3])) == [1, 2, 3]


def test_substitutes_kept_when_the_budget_is_short_are_spread_with_the_first_and_last():
    from subspec.placement import spread_substitutes

    assert spread_substitutes(0, 28) == [] and spread_substitutes(1, 28) == [0]
    assert spread_substitutes(2, 28) == [0, 27] and spread_substitutes(28, 28) == list(range(28))
    assert spread_substitutes(4, 10) == [0, 3, 6, 9]
    for L in range(1, 40):
        for n in range(L + 1):
            kept = spread_substitutes(n, L)
            assert len(set(kept)) == n and kept == sorted(kept) and all(0 <= i < L for i in kept)
            if n >= 2:
                assert kept[0] == 0 and kept[-1] == L - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_budget_short_of_every_substitute_drafts_without_the_rest_and_equals_ar(tiny, dtype):
    """Below the budget that holds a substitute for every offloaded layer, the plan keeps every layer offloaded and as
    many substitutes as fit; the draft skips the other layers and the output is still plain decoding's."""
    params = SamplingParams(max_new_tokens=40)
    prompt = [3, 5, 7, 11, 13]
    ar = load(Options(model=str(tiny), method="ar", dtype=dtype, offload="none", max_context=128))
    ref = ar.engine.generate(prompt, params)
    ar.close()
    kw = dict(model=str(tiny), method="subspec", dtype=dtype, max_context=128, depth=4, topk=2, verify_budget=8)
    src = open_model(tiny)
    full, _ = plan_for(Options(**kw, device_memory=1 << 30, max_resident=0), src)
    budget = full.minimum + int(2.5 * full.substitute_layer_bytes * 1.1) + (1 << 10)
    rt = load(Options(**kw, device_memory=budget))
    try:
        p = rt.placement
        assert p.resident == [] and 1 <= len(p.substituted) < 6 and p.draft_skipped
        assert sorted(p.substituted + p.draft_skipped) == list(range(6))
        assert sorted(rt.draft.layers.rest.subs) == p.substituted  # the draft holds only those that fit
        assert "the draft skips" in p.summary()
        assert p.total <= budget
        assert rt.engine.generate(prompt, params) == ref
        assert rt.engine.last_stats.rounds > 0
    finally:
        rt.close()
