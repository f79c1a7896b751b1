"""HQQ substitutes: our chunked call of HQQ's optimizer against HQQ's own ``Quantizer.quantize``, and the error of
the iteration cap we use (:data:`subspec.quant.HQQ_ITERS`) on a real model's weights."""
import pytest
import torch

from subspec.quant import HQQ_ITERS, hqq_quantize


def _error(w, codes, scale, zero, group):
    """Relative Frobenius error of HQQ's de-quantization ``(codes - zero) * scale`` against ``w``."""
    out_f, in_f = w.shape
    r = ((codes.float().view(out_f, -1, group) - zero[..., None]) * scale[..., None]).view(out_f, in_f)
    return ((r - w.float()).norm() / w.float().norm()).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_twenty_iterations_equal_hqq_quantizer(bits):
    from hqq.core.quantize import Quantizer

    g = torch.Generator().manual_seed(bits)
    w = (torch.randn(300, 512, generator=g) * 0.02).to(torch.bfloat16)
    w[3, :64] = 1e-3  # a constant group: HQQ's small-denominator branch
    codes, scale, zero = hqq_quantize(w, bits, 64, iters=20, chunk_bytes=1 << 30, native=False)
    q, meta = Quantizer.quantize(w, nbits=bits, group_size=64, axis=1, optimize=True, bitpack=False,
                                 compute_dtype=torch.float32, device="cpu")
    assert torch.equal(codes, q.reshape(300, 512).to(torch.uint8))
    assert torch.equal(scale, meta["scale"].float().reshape(300, -1))
    assert torch.equal(zero, meta["zero"].float().reshape(300, -1))


def test_iteration_cap_keeps_hqq_error_on_real_weights(smollm2_gguf):
    """On SmolLM2's MLP weights the capped optimizer is within 0.5 % of HQQ's 20 iterations and clearly better than
    HQQ's un-optimized min-max start."""
    from subspec.loading import open_model

    src = open_model(smollm2_gguf)
    for name in ("model.layers.5.mlp.down_proj.weight", "model.layers.20.self_attn.q_proj.weight"):
        w = src.tensor(name)
        e0 = _error(w, *hqq_quantize(w, 4, 64, iters=0, native=False), 64)
        e_cap = _error(w, *hqq_quantize(w, 4, 64, iters=HQQ_ITERS, native=False), 64)
        e20 = _error(w, *hqq_quantize(w, 4, 64, iters=20, native=False), 64)
        assert e_cap <= e20 * 1.005, (name, e_cap, e20)
        assert e_cap < e0 * 0.99, (name, e_cap, e0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_native_optimizer_matches_the_hqq_package_on_real_weights(smollm2_gguf, kernel_tier, bits):
    """The fused native HQQ (every kernel tier) against the hqq package's optimizer on SmolLM2's weights: the same
    relative error to 0.5 % (in fact to 0.01 %), the same codes almost everywhere (sums in another order can move a
    code at an exact rounding tie), HQQ's start and early stop included; a constant group is handled."""
    from subspec import kernels
    from subspec.loading import open_model

    src = open_model(smollm2_gguf)
    with kernels.using(kernel_tier):
        for name in ("model.layers.5.mlp.down_proj.weight", "model.layers.20.self_attn.q_proj.weight"):
            w = src.tensor(name).float()
            w[3, :64] = 1e-3  # a constant group: HQQ's small-denominator branch
            for iters in (0, HQQ_ITERS):
                ref = hqq_quantize(w, bits, 64, iters=iters, native=False)
                got = hqq_quantize(w, bits, 64, iters=iters, native=True)
                e_ref, e_got = _error(w, *ref, 64), _error(w, *got, 64)
                assert abs(e_got - e_ref) <= 0.005 * e_ref, (name, iters, e_got, e_ref)
                assert (got[0] == ref[0]).float().mean() > 0.999, (name, iters)
                assert torch.allclose(got[1], ref[1], rtol=1e-6) and torch.equal(got[1][3, 0], ref[1][3, 0])


def test_cached_substitutes_load_in_place_into_one_buffer_and_equal_the_quantized_ones(tmp_path, monkeypatch):
    """A layer's cached codes lie back to back (every linear's codes first), are read in one request and made the
    kernel's layout in place: q/k/v and gate/up are then joined without a copy, and every tensor the kernels read
    equals the one made from the freshly quantized codes. A file of the earlier order (codes, scale, zero per linear)
    reads the same."""
    from conftest import save_tiny, tiny_config
    from subspec import kernels, quant
    from subspec.cache import cache_dir
    from subspec.loading import open_model
    from subspec.placement import SubstituteSpec
    from subspec.tensorfile import TensorFile, TensorFileWriter

    if not kernels.native():
        pytest.fail("no native kernel tier built on this CPU")  # CI builds them before the tests
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    src = open_model(save_tiny(tmp_path / "m", tiny_config("qwen2", tied=False, layers=2)))
    spec = SubstituteSpec(4, 64)
    made = quant.load_substitutes(src, [0, 1], spec, torch.bfloat16, "cpu")  # quantized, stored
    path = cache_dir(quant.substitutes_folder(src.key, spec)) / "layer-00001.safetensors"
    names = TensorFile(path).names
    assert names[:7] == [f"{n}.codes" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj")]

    def check(loaded):
        for i in (0, 1):
            fused, lins = loaded[i].fused, loaded[i].named
            assert fused is not None
            assert fused.weights[0].data_ptr() == lins["q_proj"].packed.data_ptr()  # q/k/v: one buffer, not a copy
            assert fused.weights[8].data_ptr() == lins["gate_proj"].packed.data_ptr()
            assert lins["k_proj"].packed.data_ptr() == lins["q_proj"].packed.data_ptr() + lins["q_proj"].packed.numel()
            for a, b in zip(fused.weights, made[i].fused.weights):
                assert torch.equal(a, b)
            for n, f in lins.items():
                assert torch.equal(f.packed, made[i].named[n].packed) and torch.equal(f.scale, made[i].named[n].scale)

    monkeypatch.setattr(quant, "hqq_quantize", lambda *a, **k: pytest.fail("quantized again instead of reading"))
    check(quant.load_substitutes(src, [0, 1], spec, torch.bfloat16, "cpu"))
    f = TensorFile(path)  # rewrite layer 1 in the earlier order: the same entries, read one by one
    old = {n: f.read(n) for n in f.names}
    meta = f.metadata
    f.close()
    order = [f"{n}.{part}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
             for part in ("codes", "scale", "zero")]
    with TensorFileWriter(path, [(n, old[n].dtype, tuple(old[n].shape)) for n in order], meta) as w:
        for n in order:
            w.write(n, old[n])
    again = quant.load_substitutes(src, [1], spec, torch.bfloat16, "cpu")[1]
    for a, b in zip(again.fused.weights, made[1].fused.weights):
        assert torch.equal(a, b)
