"""The AVX-512 tier as built for a CPU without its optional extensions (AVX512-BF16, VNNI, VBMI2: Skylake-SP, Cascade
Lake), checked on this CPU (run by test_kernels.py in a fresh process: a process loads one build of a tier).

    python baseline_avx512_worker.py

The build then takes its fallback paths: the BF16 linear widens weights to fp32 (FMA), the 4-bit linear multiplies
bytes with vpmaddubsw, the codec places escapes by pshufb. Checks each against an independent reference and prints
one line per check ("ok NAME"); raises (exit 1) on a mismatch.
"""
from __future__ import annotations

import torch

from subspec import kernels

OPTIONAL = {"avx512_bf16", "avx512_vnni", "avx512_vbmi2"}


def main() -> None:
    have = kernels.cpu_flags()
    kernels.cpu_flags = lambda: have - OPTIONAL  # the build's flags follow the CPU's (kernels._flags)
    assert not any(f in " ".join(kernels._flags("avx512")) for f in ("bf16", "vnni", "vbmi2")), kernels._flags("avx512")
    why = kernels.load("avx512")
    assert why is None, why
    k = kernels.ops("avx512")
    g = torch.Generator().manual_seed(0)

    # the BF16 linear: within an fp32-accumulation bound of float64, and batch-invariant
    w = (torch.randn(1536, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(40, 576, generator=g).bfloat16()
    y = k.linear_bf16(x, w, None)
    ref = x.double() @ w.double().t()
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3 * ref.abs().max()).all()
    singles = torch.cat([k.linear_bf16(x[i:i + 1], w, None) for i in range(40)])
    for m in (1, 2, 3, 5, 16, 17, 33, 40):
        assert torch.equal(k.linear_bf16(x[:m], w, None), singles[:m]), m
    print("ok linear_bf16")

    # the 4-bit linear: HQQ's de-quantized weight in float64, within the activations' 8-bit quantization bound
    from subspec.quant import Int4Linear, hqq_quantize

    group = 64
    codes, scale, zero = hqq_quantize(w.float(), 4, group)
    with kernels.using("avx512"):
        lin = Int4Linear(codes, scale, zero, group, None, torch.bfloat16, "cpu")
    s, z = scale.bfloat16().double(), (-zero * scale).bfloat16().double()
    wq = (codes.double().view(1536, -1, group) * s[..., None] + z[..., None]).view(1536, 576)
    ref4 = x.double() @ wq.t()
    step = x.double().abs().view(40, -1, group).amax(-1) / 127
    bound = 0.5 * step @ wq.abs().view(1536, -1, group).sum(-1).t()
    y4 = k.linear_w4(x, lin.packed, lin.scale, lin.shift, group, None).double()
    assert ((y4 - ref4).abs() <= bound + ref4.abs() * 2 ** -8 + 1e-6).all()
    print("ok linear_w4")

    # the codec: every bit pattern round-trips, a coded linear gives linear_bf16's bits over the weight
    wc = w.clone()
    wc[0, :9] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, float("inf"), float("-inf"),
                              float("nan")]).bfloat16()
    wc[1] = torch.randint(-32768, 32767, (576,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    stream = k.w4_delta_encode(wc, lin.packed, lin.scale, lin.shift, group)
    portable = kernels.ops("portable")
    assert torch.equal(stream, portable.w4_delta_encode(wc, lin.packed, lin.scale, lin.shift, group))
    out = torch.empty_like(wc)
    assert k.w4_delta_decode(stream, lin.packed, lin.scale, lin.shift, group, out) == stream.numel()
    assert torch.equal(out.view(torch.int16), wc.view(torch.int16))
    offsets = k.w4_delta_index(stream, 1536, 576)
    for m in (1, 3, 16, 17):
        got = k.linear_coded(x[:m], stream, offsets, lin.packed, lin.scale, lin.shift, group, None)
        assert torch.equal(got.view(torch.int16), k.linear_bf16(x[:m], wc, None).view(torch.int16)), m
    print("ok codec")


if __name__ == "__main__":
    main()
