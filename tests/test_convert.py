"""GGUF conversion: tensor by tensor, equal to transformers' own GGUF loader; files that carry what they hold."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import shared_model


def _transformers_tensors(gguf) -> dict[str, torch.Tensor]:
    """What ``from_pretrained(gguf_file=...)`` loads: transformers' load_gguf_checkpoint (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]


def _ours(folder) -> dict[str, torch.Tensor]:
    from subspec.tensorfile import TensorFile

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        tf = TensorFile(f)
        out.update({n: tf.read(n) for n in tf.names})
        tf.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name, dtypes", [("smollm2-135m", (torch.bfloat16,)),  # float32: gemma below
                                          pytest.param("gemma3-270m", (torch.float32,), marks=pytest.mark.heavy)])
def test_converted_tensors_equal_transformers_gguf_loader(name, dtypes, tmp_path, monkeypatch):
    """Every tensor, name and shape equals transformers' loader (llama q/k un-permute, gemma norm offsets included);
    small row chunks exercise the chunked path; bfloat16 is the float32 values rounded once."""
    from subspec.cache import content_digest
    from subspec.convert import convert_gguf

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    gguf = shared_model(name)
    ref = _transformers_tensors(gguf)
    for dtype in dtypes:
        folder = convert_gguf(gguf, content_digest(gguf), dtype, chunk_bytes=4 << 20)
        ours = _ours(folder)
        assert set(ours) == set(ref)
        for n, t in ref.items():
            assert ours[n].dtype == dtype and ours[n].shape == t.shape, n
            assert torch.equal(ours[n], t.to(dtype)), n
        assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()


def test_tensorfile_direct_reads_give_the_same_tensors_from_the_disk(tmp_path):
    """``TensorFile(direct=True)`` reads large tensors with O_DIRECT: straight into the tensor's memory (placed to agree
    with the file offset modulo a page) where its elements are aligned, through an aligned buffer where they are not;
    the same bytes as a buffered read at unaligned offsets and across the buffer's chunks, and every byte comes from
    the disk (counted in /proc/self/io), not from the page cache that the write just filled."""
    from subspec.tensorfile import DIRECT_CHUNK, TensorFile, TensorFileWriter

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randint(0, 255, (101,), generator=g, dtype=torch.uint8),
               "c": torch.randint(0, 255, (3 << 20,), generator=g, dtype=torch.uint8),  # starts and ends mid-page
               "pad": torch.zeros(3, dtype=torch.uint8),
               "b": torch.randn(DIRECT_CHUNK // 4 + 3087, generator=g),  # aligned floats, > one chunk, ends mid-page
               "e": torch.zeros(1, dtype=torch.uint8),
               "d": torch.randn((1 << 20) // 4 + 5, generator=g)}  # misaligned floats: through the buffer
    path = tmp_path / "t.safetensors"
    with TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]) as w:
        for n, t in tensors.items():
            w.write(n, t)
    direct = TensorFile(path, direct=True)
    try:
        if direct._direct_fd < 0:
            pytest.skip("this filesystem has no O_DIRECT")
        offsets = {n: direct.entries[n][2] for n in tensors}
        assert offsets["b"] % 4 == 0 and offsets["b"] % 4096 and offsets["d"] % 4
        io0 = _disk_read_bytes()
        got = {n: direct.read(n) for n in ("b", "c", "d")}
        assert _disk_read_bytes() - io0 >= sum(tensors[n].numel() * tensors[n].element_size() for n in got)
        for n in ("b", "c"):  # read in place
            assert (got[n].data_ptr() - offsets[n]) % 4096 == 0, n
        got.update({n: direct.read(n) for n in ("a", "pad", "e")})
    finally:
        direct.close()
    buffered = TensorFile(path)
    for n, t in tensors.items():
        assert torch.equal(got[n], t) and torch.equal(buffered.read(n), t), n
    for f in (buffered, TensorFile(path, direct=True)):  # a run back to back: views of one buffer, same values
        try:
            run = f.read_run(["b", "e"])
            assert run["e"].data_ptr() == run["b"].data_ptr() + tensors["b"].numel() * 4
            apart = f.read_run(["a", "b"])  # not adjacent: each read on its own
            misaligned = f.read_run(["c", "pad", "b"])  # b 3 bytes off c's alignment: each read on its own
            assert misaligned["b"].data_ptr() % 4 == 0
            for r in (run, apart, misaligned):
                for n, t in r.items():
                    assert torch.equal(t, tensors[n]), n
        finally:
            f.close()


def _disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def test_tensorfile_roundtrip_and_damage(tmp_path):
    from safetensors.torch import load_file

    from subspec.tensorfile import TensorFile, TensorFileError, TensorFileWriter

    a, b = torch.randn(5, 3).bfloat16(), torch.arange(7, dtype=torch.int64)
    path = tmp_path / "x.safetensors"
    w = TensorFileWriter(path, [("a", torch.bfloat16, (5, 3)), ("b", torch.int64, (7,))], {"made_from": "test"})
    w.write("b", b)
    w.write("a", a[:2])
    w.write("a", a[2:], row=2)
    w.close()
    ref = load_file(str(path))  # the official reader agrees
    assert torch.equal(ref["a"], a) and torch.equal(ref["b"], b)
    f = TensorFile(path)
    assert torch.equal(f.read("a"), a) and f.metadata == {"made_from": "test"}
    f.close()
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1)
    with pytest.raises(TensorFileError, match="truncated"):
        TensorFile(path)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(TensorFileError):
        TensorFile(path)
    w = TensorFileWriter(tmp_path / "y.safetensors", [("a", torch.float32, (2,))])
    with pytest.raises(ValueError, match="never written"):
        w.close()
    # an interruption inside the write (Ctrl-C, an error) is what the caller sees, not "never written"
    with pytest.raises(KeyboardInterrupt):
        with TensorFileWriter(tmp_path / "z.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]) as w:
            w.write("a", torch.ones(2))
            raise KeyboardInterrupt
    assert w.fd == -1


def _count_readers(monkeypatch) -> list[str]:
    """Make every ``gguf.GGUFReader`` built from now on append its path to the returned list."""
    import gguf

    built = []

    from subspec.ggufread import FastGGUFReader

    class Counting(FastGGUFReader):  # gguf's reader, metadata parsed in bulk (as one_reader builds it)
        def __init__(self, path, *a, **k):
            built.append(str(path))
            super().__init__(path, *a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return built


def test_a_gguf_config_is_parsed_once_per_file_version_across_processes(smollm2_gguf, tmp_path, monkeypatch):
    """Every command plans from the config, and parsing a GGUF's metadata takes seconds: a later process (the memo of
    this one cleared) gets the same config from the cache without building a reader; a damaged memo is rebuilt with a
    notice; another version of the file (a new mtime) is parsed again and replaces the old entry."""
    import os
    import shutil

    from subspec import convert

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(convert, "_CONFIGS", {})
    built = _count_readers(monkeypatch)
    copy = tmp_path / smollm2_gguf.name
    shutil.copyfile(smollm2_gguf, copy)
    first = convert.gguf_config(copy)
    assert len(built) == 1
    convert._CONFIGS.clear()  # a new process
    again = convert.gguf_config(copy)
    assert len(built) == 1 and type(again) is type(first) and again.to_dict() == first.to_dict()
    memo = tmp_path / "cache" / "gguf-configs.json"
    memo.write_text("{not json")
    convert._CONFIGS.clear()
    assert convert.gguf_config(copy).to_dict() == first.to_dict() and len(built) == 2
    os.utime(copy, ns=(1, 1))  # another version of the file
    convert._CONFIGS.clear()
    assert convert.gguf_config(copy).to_dict() == first.to_dict() and len(built) == 3
    assert len(json.loads(memo.read_text())) == 1


def test_first_open_parses_the_gguf_metadata_once(smollm2_gguf, tmp_path, monkeypatch):
    """A first open (config, conversion, tokenizer) builds one ``gguf.GGUFReader`` of the file, not one per use, and
    one tensor name map (transformers' name mapping asks for one at each of the model's 397 modules), and parses the
    metadata into Python values once (transformers does it for the config, the tensor plan and the tokenizer), and
    leaves ``gguf.GGUFReader``, ``gguf.get_tensor_name_map`` and transformers' ``load_gguf_checkpoint`` as they were;
    the tokenizer saved with the conversion encodes like the GGUF's own."""
    import gguf

    from subspec import convert
    from subspec.loading import open_model

    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(convert, "_CONFIGS", {})
    built = _count_readers(monkeypatch)
    counting = gguf.GGUFReader
    maps, build_map = [], gguf.get_tensor_name_map

    def counting_maps(arch, n_blocks):
        maps.append((arch, n_blocks))
        return build_map(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_maps)
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    parses, parse = [], hf_gguf.load_gguf_checkpoint

    def counting_parse(path, return_tensors=False, *args, **kwargs):
        parses.append(return_tensors)
        return parse(path, return_tensors, *args, **kwargs)

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counting_parse)
    src = open_model(smollm2_gguf)
    assert gguf.GGUFReader is counting and gguf.get_tensor_name_map is counting_maps
    assert hf_gguf.load_gguf_checkpoint is counting_parse
    assert len(built) == 1, built
    assert maps == [(gguf.MODEL_ARCH.LLAMA, 30)], maps
    assert parses == [False], parses  # transformers' metadata parse: once for the config, tensor plan and tokenizer
    from transformers import AutoTokenizer

    text = "Hello, lighthouse keeper! 123"
    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    assert src.tokenizer().encode(text) == ref.encode(text)


def _same_fields(fast, ref) -> int:
    """Assert two readers' fields and tensor tables equal (names, offsets, data indices, types, every part's dtype,
    shape and values); returns the number of parts compared."""
    import numpy as np

    assert list(fast.fields) == list(ref.fields)
    n = 0
    for name, a in fast.fields.items():
        b = ref.fields[name]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), name
        assert len(a.parts) == len(b.parts), name
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
            n += 1
        assert a.contents() == b.contents(), name
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.shape.tolist()) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.shape.tolist()) for t in ref.tensors]
    return n


def test_bulk_gguf_reader_gives_gguf_readers_fields(smollm2_gguf, tmp_path):
    """FastGGUFReader (metadata arrays parsed in bulk) gives every field of gguf's own reader, part for part: on the
    real SmolLM2 GGUF (49,152 tokens and 48,900 merges) and on a file with empty strings, empty arrays, non-ASCII,
    every scalar array type and a nested array (parsed by the original code); a truncated file raises."""
    import gguf
    import numpy as np

    from subspec.ggufread import FastGGUFReader

    assert _same_fields(FastGGUFReader(str(smollm2_gguf)), gguf.GGUFReader(str(smollm2_gguf))) > 2 * 49152
    path = tmp_path / "edge.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["", "a", "héllo ▁wörld", "", "x" * 300])
    w.add_array("t.empty", [])
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_key_value("t.i8", [-3, 4], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT8)
    w.add_key_value("t.u64", [2**40, 5], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    w.add_key_value("t.bools", [True, False], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.s", "plain")
    w.add_tensor("x", np.arange(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fast = FastGGUFReader(str(path))
    _same_fields(fast, gguf.GGUFReader(str(path)))
    assert fast.fields["t.strings"].contents() == ["", "a", "héllo ▁wörld", "", "x" * 300]
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    at = data.index(b"x" * 300)
    cut.write_bytes(data[:at + 100])  # inside the long string
    with pytest.raises(ValueError):
        FastGGUFReader(str(cut))
