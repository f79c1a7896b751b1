"""Offloaded layers coded against their substitutes (subspec.codec): the stream's format against an independent
reference, bit-exact round trips (any bit pattern, in place in a slot), the cache files, and the disk tier reading
the coded bytes from disk and handing forwards the same weights."""
from __future__ import annotations

import json

import pytest
import torch

from subspec import kernels
from subspec.codec import CodedLayer, coded_layers, decode_layer, encode_layer, index_layer, substitute_crc
from subspec.families import LINEAR_NAMES, linear_prefix
from subspec.layout import layer_layout
from subspec.loading import open_model
from subspec.placement import SubstituteSpec
from subspec.quant import Int4Linear, hqq_quantize, load_substitutes
from subspec.layerfile import fill_layer
from subspec.tiers import DiskTier

from conftest import save_tiny, tiny_config

# every test runs on every kernel tier this CPU runs (the conftest fixture ``kernel_tier``): the stream's format is one,
# each tier's decoder must give back the same bits


@pytest.fixture(autouse=True)
def _tier(kernel_tier):
    """Substitutes built in these tests run on (and decode with) the tier under test."""
    with kernels.using(kernel_tier):
        yield kernel_tier


def _ord(b: torch.Tensor) -> torch.Tensor:
    """The order-preserving integer of BF16 bits (int16 view) as int32."""
    b = b.view(torch.int16).to(torch.int32)
    return torch.where(b < 0, b ^ 0x7FFF, b)


def _reference_stream(w: torch.Tensor, lin: Int4Linear, codes: torch.Tensor) -> bytes:
    """The documented format, built with torch alone: prediction = bf16(fp32(code * scale + shift)) (one rounding to
    fp32 of the exact value = an FMA), d = ord(w) - ord(prediction), in the decoder's order, escapes after each block."""
    N, K = w.shape
    g = lin.group_size
    scale = lin.scale.float().transpose(1, 2).reshape(N, K // g)  # [N/16, G, 16] -> [N, G]
    shift = lin.shift.float().transpose(1, 2).reshape(N, K // g)
    exact = codes.double().view(N, -1, g) * scale.double()[..., None] + shift.double()[..., None]
    pred = exact.view(N, K).float().to(torch.bfloat16)
    d = _ord(w) - _ord(pred)
    kblock = 64 if g % 64 == 0 else 32
    # (nb, 4 quarters, 4 rows, kb, chunks, 8 columns) -> (nb, kb, chunk, quarter, row, column)
    order = lambda t: t.reshape(N // 16, 4, 4, K // kblock, kblock // 8, 8).permute(0, 3, 4, 1, 2, 5).reshape(N // 16, -1)
    d, wb = order(d), order(w.view(torch.int16))
    out = bytearray()
    for nb in range(N // 16):
        esc = (d[nb] < -127) | (d[nb] > 127)
        out += torch.where(esc, torch.full_like(d[nb], -128), d[nb]).to(torch.int8).numpy().tobytes()
        out += wb[nb][esc].numpy().tobytes()
    return bytes(out)


@pytest.mark.parametrize("shape,group", [((64, 256), 64), ((32, 128), 32), ((48, 512), 128)])
def test_stream_matches_the_reference_and_round_trips_every_bit_pattern(shape, group):
    torch.manual_seed(0)
    w = (torch.randn(*shape) * 0.02).to(torch.bfloat16)
    codes, scale, zero = hqq_quantize(w.float(), 4, group)
    lin = Int4Linear(codes, scale, zero, group, None, torch.bfloat16, "cpu")
    # far from any prediction: zeros of both signs, denormals, huge values, infinities, NaN, random bit patterns
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, float("inf"), float("-inf"), float("nan")])
    w[0, :9] = specials.to(torch.bfloat16)
    w[1] = torch.randint(-32768, 32767, (shape[1],), dtype=torch.int16).view(torch.bfloat16)
    stream = lin.ops.w4_delta_encode(w, lin.packed, lin.scale, lin.shift, group)
    assert bytes(stream.numpy()) == _reference_stream(w, lin, codes)
    out = torch.empty_like(w)
    assert lin.ops.w4_delta_decode(stream, lin.packed, lin.scale, lin.shift, group, out) == stream.numel()
    assert torch.equal(out.view(torch.int16), w.view(torch.int16))
    assert stream.numel() < 0.75 * 2 * w.numel()  # Gaussian weights: about 9.4 bits of 16


def test_a_damaged_stream_is_refused_not_read_past_its_end():
    torch.manual_seed(1)
    w = (torch.randn(32, 128) * 0.02).to(torch.bfloat16)
    lin = Int4Linear(*hqq_quantize(w.float(), 4, 64), 64, None, torch.bfloat16, "cpu")
    stream = lin.ops.w4_delta_encode(w, lin.packed, lin.scale, lin.shift, 64)
    with pytest.raises(RuntimeError, match="ended early"):
        lin.ops.w4_delta_decode(stream[:-3].clone(), lin.packed, lin.scale, lin.shift, 64, torch.empty_like(w))


@pytest.fixture()
def tiny_bf16(tmp_path, monkeypatch):
    """A qwen2 model (q/k/v biases: raw sections between coded ones) with 64-multiple widths, and its substitutes;
    a cache folder of its own (these tests damage cache files)."""
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config("qwen2", False, vocab=96, layers=4, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2)
    src = open_model(save_tiny(tmp_path / "m", cfg), torch.bfloat16)
    subs = load_substitutes(src, [1, 2, 3], SubstituteSpec(4, 64), torch.bfloat16, "cpu")
    return src, layer_layout(src.config, src.family, torch.bfloat16), subs


def test_a_layer_decodes_in_place_at_the_end_of_its_slot(tiny_bf16):
    src, layout, subs = tiny_bf16
    raw = torch.zeros(layout.extent, dtype=torch.uint8)
    fill_layer(src, 2, layout, raw)
    stream, sections = encode_layer(raw, layout, subs[2])
    assert [s.linear for s in sections if s.linear] == list(LINEAR_NAMES) and any(s.linear is None for s in sections)
    padded = -(-stream.numel() // 4096) * 4096
    slot = torch.full((layout.extent,), 0xAB, dtype=torch.uint8)
    slot[layout.extent - padded:layout.extent - padded + stream.numel()] = stream
    decode_layer(slot, layout.extent, CodedLayer(None, padded, sections), subs[2])
    for s in sections:
        assert torch.equal(slot[s.out_offset:s.out_offset + s.out_bytes], raw[s.out_offset:s.out_offset + s.out_bytes])


def _bf16(src, name: str) -> torch.Tensor:
    return src.tensor(name).to(torch.bfloat16)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def test_disk_tier_reads_the_coded_bytes_and_hands_out_the_exact_weights(tiny_bf16):
    src, layout, subs = tiny_bf16
    offloaded = [1, 2, 3]
    coded = coded_layers(src, layout, offloaded, subs)
    assert sorted(coded) == offloaded
    again = coded_layers(src, layout, offloaded, subs)  # a second start reads the files, builds nothing
    assert {i: c.path.stat().st_mtime_ns for i, c in again.items()} == {i: c.path.stat().st_mtime_ns for i, c in coded.items()}
    stream = sum(c.stream_bytes for c in coded.values())
    assert stream < 0.8 * len(offloaded) * layout.extent
    io0 = _read_bytes()
    tier = DiskTier({}, layout, offloaded, n_slots=2, coded=coded, substitutes=subs)
    try:
        assert tier.direct
        for _ in range(2):  # two passes: the ring wraps around, slots are reused
            for i in offloaded:
                lins = tier.acquire(i)
                for name in LINEAR_NAMES:
                    p = linear_prefix(name)
                    assert torch.equal(getattr(lins, name).weight, _bf16(src, f"model.layers.{i}.{p}.weight")), (i, name)
                    if src.has(f"model.layers.{i}.{p}.bias"):
                        assert torch.equal(getattr(lins, name).bias, _bf16(src, f"model.layers.{i}.{p}.bias"))
                tier.release(i)
    finally:
        tier.close()
    io = _read_bytes() - io0
    assert tier.bytes_streamed == 2 * stream
    assert 2 * stream <= tier.bytes_read <= 2 * stream + 2 * max(c.stream_bytes for c in coded.values())
    assert 2 * stream <= io <= tier.bytes_read + (1 << 20), (io, stream)


def test_a_coded_file_made_against_another_substitute_or_truncated_is_rebuilt(tiny_bf16, caplog):
    src, layout, subs = tiny_bf16
    coded = coded_layers(src, layout, [1, 2], subs)
    with open(coded[2].path, "r+b") as f:  # truncated
        f.truncate(coded[2].path.stat().st_size - 4096)
    other = load_substitutes(src, [1], SubstituteSpec(4, 64), torch.bfloat16, "cpu")
    q = other[1].q_proj
    q.scale.view(torch.int16)[0, 0, 0] += 1  # a substitute that differs in one scale
    assert substitute_crc(other[1]) != substitute_crc(subs[1])
    rebuilt = coded_layers(src, layout, [1, 2], {1: other[1], 2: subs[2]})
    assert "truncated" in caplog.text and "another model, dtype, layout, substitute" in caplog.text
    raw = rebuilt[2].path.read_bytes()  # a header whose sections do not describe the layout (a moved tensor)
    first, _, rest = raw[:4096].partition(b"\n")  # "subspec-layer-file 4096", then the JSON
    assert first == b"subspec-layer-file 4096"
    head = json.loads(rest.decode())
    head["coded"][1][2] += 64
    text = first + b"\n" + json.dumps(head, separators=(",", ":")).encode()
    rebuilt[2].path.write_bytes(text + b" " * (4096 - len(text)) + raw[4096:])
    rebuilt = coded_layers(src, layout, [1, 2], {1: other[1], 2: subs[2]})
    assert "does not describe this layer's layout" in caplog.text
    for i, lins in ((1, other[1]), (2, subs[2])):
        slot = torch.zeros(layout.extent, dtype=torch.uint8)
        with open(rebuilt[i].path, "rb") as f:
            f.seek(4096)
            data = f.read()
        slot[layout.extent - len(data):] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        decode_layer(slot, layout.extent, rebuilt[i], lins)
        w = layout.views(slot)["self_attn.q_proj.weight"]
        assert torch.equal(w, _bf16(src, f"model.layers.{i}.self_attn.q_proj.weight"))


def test_coded_tier_resynchronizes_after_an_interrupted_forward_and_reports_a_damaged_file(tiny_bf16):
    """A forward cut off mid-way restarts the reader and the decoder at the layer asked for; a stream damaged on disk
    after the start is an error of that layer's acquire (naming the file), never a hang."""
    from subspec.errors import SubspecError

    src, layout, subs = tiny_bf16
    coded = coded_layers(src, layout, [1, 2, 3], subs)
    tier = DiskTier({}, layout, [1, 2, 3], n_slots=2, coded=coded, substitutes=subs)
    try:
        tier.acquire(1)
        tier.release(1)
        # interrupted: layers 2 and 3 never consumed; the next forward starts again at layer 1
        assert torch.equal(tier.acquire(1).q_proj.weight, _bf16(src, "model.layers.1.self_attn.q_proj.weight"))
        tier.release(1)
        assert torch.equal(tier.acquire(2).up_proj.weight, _bf16(src, "model.layers.2.mlp.up_proj.weight"))
        with open(coded[1].path, "r+b") as f:  # before the reader reaches layer 1 again: every delta an escape
            f.seek(4096)
            f.write(b"\x80" * coded[1].stream_bytes)
        tier.release(2)
        tier.acquire(3)
        tier.release(3)
        with pytest.raises(SubspecError, match="coded layer file .*layer-00001.* is damaged .*removed"):
            tier.acquire(1)
    finally:
        tier.close()
    assert not coded[1].path.exists()  # removed: the next start codes the layer again
    assert sorted(coded_layers(src, layout, [1, 2, 3], subs)) == [1, 2, 3]


def test_a_coded_layer_is_indexed_at_its_first_read_and_still_checked_at_every_later_one(tiny_bf16, monkeypatch):
    """The checker indexes a coded layer's blocks once (the first read), reuses the index at later reads (their bytes
    pass the same CRC-32s) and hands out the exact weights; a byte flipped on disk after the first pass is still an
    error of that layer's next acquire."""
    import subspec.tiers as tiers
    from subspec.errors import SubspecError

    src, layout, subs = tiny_bf16
    offloaded = [1, 2, 3]
    coded = coded_layers(src, layout, offloaded, subs)
    made = []
    monkeypatch.setattr(tiers, "index_layer", lambda stream, c, lins: made.append(c.path) or index_layer(stream, c, lins))
    tier = DiskTier({}, layout, offloaded, n_slots=2, coded=coded, substitutes=subs)
    try:
        for _ in range(3):
            for i in offloaded:
                lins = tier.acquire(i)
                for name in LINEAR_NAMES:
                    want = _bf16(src, f"model.layers.{i}.{linear_prefix(name)}.weight")
                    assert torch.equal(getattr(lins, name).weight, want), (i, name)
                tier.release(i)
        assert sorted(made) == sorted(c.path for c in coded.values())  # once per layer, not once per read
        down = next(s for s in coded[2].sections if s.linear == "down_proj")
        with open(coded[2].path, "r+b") as f:
            f.seek(4096 + down.in_offset + 5)
            byte = f.read(1)[0]
            f.seek(4096 + down.in_offset + 5)
            f.write(bytes([byte ^ 0x40]))
        with pytest.raises(SubspecError, match="CRC-32") as e:
            for _ in range(2):  # the slots may hold a copy read before the flip: at the latest in the second pass
                for i in offloaded:
                    tier.acquire(i)
                    tier.release(i)
    finally:
        tier.close()
    assert str(coded[2].path) in str(e.value)


def test_a_flipped_byte_in_a_coded_file_is_an_error_naming_it_then_the_file_is_rebuilt(tiny_bf16):
    """One bit flipped on disk inside a coded section (one that still decodes, to other weights) is an error of that
    layer's acquire: one line naming the file and the section; the file is removed and the next start codes it again,
    after which the tier hands out the exact weights."""
    from subspec.errors import SubspecError

    src, layout, subs = tiny_bf16
    coded = coded_layers(src, layout, [1, 2, 3], subs)
    q = next(s for s in coded[2].sections if s.linear == "q_proj")
    with open(coded[2].path, "r+b") as f:
        f.seek(4096 + q.in_offset)
        data = f.read(q.in_bytes)
        at = next(k for k, b in enumerate(data) if b not in (0x80, 0x82))  # not an escape before or after the flip
        f.seek(4096 + q.in_offset + at)
        f.write(bytes([data[at] ^ 0x02]))
    tier = DiskTier({}, layout, [1, 2, 3], n_slots=2, coded=coded, substitutes=subs)
    try:
        tier.acquire(1)
        tier.release(1)
        with pytest.raises(SubspecError) as e:
            tier.acquire(2)
    finally:
        tier.close()
    msg = str(e.value)
    assert "\n" not in msg and str(coded[2].path) in msg and "self_attn.q_proj.weight" in msg and "CRC-32" in msg
    assert not coded[2].path.exists()
    again = coded_layers(src, layout, [1, 2, 3], subs)
    assert again[2].path.exists()
    tier = DiskTier({}, layout, [1, 2, 3], n_slots=2, coded=again, substitutes=subs)
    try:
        tier.acquire(1)
        tier.release(1)
        assert torch.equal(tier.acquire(2).q_proj.weight, _bf16(src, "model.layers.2.self_attn.q_proj.weight"))
        tier.release(2)
    finally:
        tier.close()
