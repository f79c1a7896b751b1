"""Every native kernel tier this CPU runs (amx, avx512, avx2, portable), against reference math, and its batch
invariance. A tier the CPU supports that does not build fails these tests (it does not skip them)."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from subspec import kernels
from subspec.quant import dequantize, hqq_quantize



@pytest.fixture
def k(kernel_tier):
    """The operators of the tier under test (torch.ops.subspec_<tier>)."""
    return kernels.ops(kernel_tier)

# every linear shape of SmolLM2-135M and Qwen2.5-1.5B (out, in), and their lm_heads (vocab x hidden)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)]


def _bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("out_f,in_f", SHAPES + [(49152, 576)])
def test_linear_bf16_equals_float_reference_and_is_batch_invariant(k, out_f, in_f):
    w, b, x = _bf16(out_f, in_f, scale=0.05), _bf16(out_f, seed=1), _bf16(80, in_f, seed=2)
    y = k.linear_bf16(x, w, b)
    ref = x.double() @ w.double().t() + b.double()
    # fp32 accumulation, one bf16 rounding of the result: within 2^-8 relative (plus fp32 accumulation slack)
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3 * ref.abs().max()).all()
    singles = torch.cat([k.linear_bf16(x[i:i + 1], w, b) for i in range(80)])
    for m in (1, 2, 3, 5, 16, 17, 31, 32, 33, 48, 64, 80):
        assert torch.equal(k.linear_bf16(x[:m], w, b), singles[:m]), m
    other = x.clone()
    other[1:] = _bf16(79, in_f, seed=3)  # the other rows' content does not matter either
    assert torch.equal(k.linear_bf16(other, w, b)[0], singles[0])
    assert torch.equal(k.linear_bf16(x[7:40], w, b.float()), singles[7:40])  # an fp32 bias adds the same values


def test_linear_bf16_differs_from_torch_batched_where_torch_is_not_invariant(k):
    """The reason the kernel exists: torch's BF16 linear changes row 0's bits with the number of rows here."""
    w, x = _bf16(1536, 8960, scale=0.05), _bf16(64, 8960, seed=2)
    one = F.linear(x[:1], w)
    torch_varies = any(not torch.equal(F.linear(x[:m], w)[:1], one) for m in (3, 17, 33, 64))
    ours = k.linear_bf16
    assert all(torch.equal(ours(x[:m], w, None)[:1], ours(x[:1], w, None)) for m in (3, 17, 33, 64))
    if not torch_varies:
        pytest.skip("torch's BF16 linear happens to be row-invariant for this shape on this machine")


def _kernel_weight(codes, scale, zero) -> torch.Tensor:
    """HQQ's weight as the kernel uses it: ``codes * scale + shift`` with scale and shift (= -zero * scale) in BF16,
    computed exactly (float64)."""
    out_f, in_f = codes.shape
    g = scale.shape[1]
    s, z = scale.bfloat16().double(), (-zero * scale).bfloat16().double()
    w = codes.double().view(out_f, g, in_f // g) * s[..., None] + z[..., None]
    return w.view(out_f, in_f)


def _w4_bound(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """The error the activations' quantization may add to ``x @ w.T`` [M, N]: per row and group, half a step
    (max|x| / 127: 8 bits on every tier) times sum |w| over the group."""
    levels = 127
    M, K = x.shape
    step = x.double().abs().view(M, K // group, group).amax(-1) / levels  # [M, G]
    wsum = w.double().abs().view(w.shape[0], K // group, group).sum(-1)  # [N, G]
    return 0.5 * step @ wsum.t()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_pack_w4_from_codes_two_a_byte_equals_pack_w4_of_the_unpacked_codes(kernel_tier, group):
    """The substitutes' cached form (two codes a byte) goes to the kernel layout without an unpacked copy: the same
    bytes as packing the unpacked codes, and the same linear."""
    from subspec.quant import Int4Linear, pack_codes, unpack_codes

    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (48, 256), generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert torch.equal(unpack_codes(packed, 4), codes)
    ops = kernels.ops(kernel_tier)
    assert torch.equal(ops.pack_w4_nibbles(packed, group), ops.pack_w4(codes, group))
    scale = torch.rand(48, 256 // group, generator=gen) * 0.01 + 1e-3
    zero = torch.rand(48, 256 // group, generator=gen) * 15
    with kernels.using(kernel_tier):
        a = Int4Linear(codes, scale, zero, group, None, torch.bfloat16, "cpu")
        b = Int4Linear(packed, scale, zero, group, None, torch.bfloat16, "cpu", nibbles=True)
        c = Int4Linear(packed, scale, zero, group, None, torch.bfloat16, "cpu", native=False, nibbles=True)
    assert a.native and b.native and not c.native
    assert torch.equal(a.packed, b.packed)
    x = _bf16(3, 256, seed=8)
    assert torch.equal(a(x), b(x))
    torch.testing.assert_close(c(x), a(x), rtol=0.05, atol=0.05)  # torch's int4 kernel, from the unpacked codes
    # in place (a loaded substitute's codes consumed): the same bytes, in the codes' own memory, on a thread each
    mine = packed.clone()
    with kernels.using(kernel_tier):
        d = Int4Linear(mine, scale, zero, group, None, torch.bfloat16, "cpu", nibbles=True, consume=True)
    assert d.packed.data_ptr() == mine.data_ptr() and torch.equal(d.packed, a.packed)
    assert torch.equal(d(x), a(x))
    wide = torch.randint(0, 256, (16 * 37, 1536 // 2), generator=gen, dtype=torch.uint8)  # 37 n-blocks over 2 threads
    assert torch.equal(ops.pack_w4_nibbles_(wide.clone(), group), ops.pack_w4_nibbles(wide, group))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.pack_w4_nibbles_(wide.t(), group)


@pytest.mark.parametrize("out_f,in_f,group", [s + (64,) for s in SHAPES] + [(1536, 1536, 32), (256, 1536, 128)])
def test_linear_w4_equals_hqq_dequantized_matmul(kernel_tier, out_f, in_f, group):
    """The 4-bit kernel against HQQ's own de-quantization in float64 (round-to-nearest HQQ codes: fast for big
    shapes): within one bf16 rounding of the result plus the activations' quantization error, bounded exactly."""
    from hqq.core.quantize import Quantizer

    from subspec.quant import Int4Linear

    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(4)) * 0.05
    w_q, meta = Quantizer.quantize(w, nbits=4, group_size=group, axis=1, optimize=False, bitpack=False,
                                   compute_dtype=torch.float32, device="cpu")
    g = in_f // group
    codes = w_q.reshape(out_f, in_f).to(torch.uint8)
    scale, zero = meta["scale"].float().reshape(out_f, g), meta["zero"].float().reshape(out_f, g)
    hqq = Quantizer.dequantize(w_q, meta).reshape(out_f, in_f).double()
    assert torch.allclose(hqq, dequantize(codes, scale, zero).double(), atol=1e-6)
    with kernels.using(kernel_tier):
        lin = Int4Linear(codes, scale, zero, group, None, torch.bfloat16, "cpu")
    assert lin.native and lin.ops is kernels.ops(kernel_tier)
    w_kernel = _kernel_weight(codes, scale, zero)
    assert (w_kernel - hqq).abs().max() <= 2 ** -6 * hqq.abs().max()  # BF16 scale and shift
    x = _bf16(64, in_f, seed=5)
    singles = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    bound = _w4_bound(x, w_kernel, group)
    for m in (1, 2, 6, 8, 9, 16, 17, 33, 64):
        y = lin(x[:m])
        ref = x[:m].double() @ w_kernel.t()
        # one bf16 rounding of the result (2^-9 relative) and fp32 accumulation, plus the activations' quantization
        assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + bound[:m] + 1e-5 * ref.abs().max()).all(), m
        assert torch.equal(y, singles[:m]), m  # batch-invariant: a row's values do not depend on the others'


def test_hqq_optimized_codes_run_on_the_kernel(kernel_tier):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(6)) * 0.05
    codes, scale, zero = hqq_quantize(w, 4, 64)
    from subspec.quant import Int4Linear

    with kernels.using(kernel_tier):
        lin = Int4Linear(codes, scale, zero, 64, torch.randn(256) * 0.1, torch.bfloat16, "cpu")
    x = _bf16(6, 512, seed=7)
    wk = _kernel_weight(codes, scale, zero)
    ref = x.double() @ wk.t() + lin.bias.double()
    bound = _w4_bound(x, wk, 64)
    assert ((lin(x).double() - ref).abs() <= ref.abs() * 2 ** -8 + bound + 1e-5 * ref.abs().max()).all()


def _tree_case(prefix: int, seed: int = 0, D: int = 64):
    """A random cache [KVH, S, D] and a tree of 12 nodes (a chain of 6 with branches) after ``prefix`` tokens."""
    g = torch.Generator().manual_seed(seed)
    H, KVH, S = 6, 2, prefix + 16
    kc = (torch.randn(KVH, S, D, generator=g)).bfloat16()
    vc = (torch.randn(KVH, S, D, generator=g)).bfloat16()
    parents = [0, 0, 1, 2, 3, 4, 5, 0, 1, 7, 2, 9]
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for j in range(n):
        anc[j, j] = True
        if j:
            anc[j] |= anc[parents[j]]
            depth[j] = depth[parents[j]] + 1
    q = torch.randn(n, H, D, generator=g).bfloat16()
    return q, kc, vc, anc, torch.tensor(depth) + prefix


def _reference_attention(q, kc, vc, keys_of, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    G = q.shape[1] // kc.shape[0]
    for t in range(q.shape[0]):
        keys = keys_of(t)
        for h in range(q.shape[1]):
            k, v = kc[h // G, keys].double(), vc[h // G, keys].double()
            p = torch.softmax(k @ q[t, h].double() * scale, 0)
            out[t, h] = p @ v
    return out


@pytest.mark.parametrize("window,D", [(0, 64), (5, 64), (0, 128), (5, 256)])
def test_tree_attention_equals_reference_and_single_token(k, window, D):
    """Head dims 64, 128 and 256: on AVX2 (16 registers, value passes) a head's output is accumulated 8 vectors a pass
    over the values, one pass at 64, two at 128, four at 256; the other tiers hold a value row for a block of heads."""
    P = 40
    q, kc, vc, anc, pos = _tree_case(P, D=D)
    scale = D ** -0.5
    o = k.tree_attention(q, kc, vc, P, anc, pos, window, scale)

    def keys_of(t):
        keys = list(range(P)) + [P + j for j in range(anc.shape[1]) if anc[t, j]]
        first = max(0, int(pos[t]) - window + 1) if window else 0
        return [k for i, k in enumerate(keys) if i >= first]  # key i of the sequence sits at position i

    ref = _reference_attention(q, kc, vc, keys_of, scale)
    assert (o.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    # each node equals a one-token forward at its position over a cache holding its own path contiguously
    for t in range(anc.shape[0]):
        path = [P + j for j in range(anc.shape[1]) if anc[t, j]]
        kc1, vc1 = kc.clone(), vc.clone()
        kc1[:, P:P + len(path)] = kc[:, path]
        vc1[:, P:P + len(path)] = vc[:, path]
        L = P + len(path) - 1
        one = k.tree_attention(q[t:t + 1], kc1, vc1, L, torch.ones(1, 1, dtype=torch.bool), pos[t:t + 1], window,
                               scale)
        assert torch.equal(one[0], o[t]), t


def test_interrupted_kernel_build_leaves_nothing_behind(tmp_path):
    """Ctrl-C during the one-time build: no half-built folder, no stale lock (which would make every later start
    wait forever), the process exits on the interrupt."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = tmp_path / "kernels"
    env = dict(os.environ, SUBSPEC_KERNELS_CACHE=str(root))
    p = subprocess.Popen([sys.executable, "-c", "from subspec import kernels; kernels.native()"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored as in CI
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120 and p.poll() is None and not any(root.glob(".tmp-*/build.ninja")):
            time.sleep(0.05)
        assert p.poll() is None, "the build ended before it could be interrupted"
        time.sleep(0.5)  # the compiler is running
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and "KeyboardInterrupt" in err
    assert list(root.iterdir()) == [], list(root.iterdir())  # neither the private build folder nor a published one


def test_kernel_builds_go_to_the_cache_folder_where_home_cannot_be_written(tmp_path, monkeypatch):
    """HOME not writable (a file here), SUBSPEC_CACHE writable: builds go to the cache's kernels/ folder, made if
    missing (a build into a missing folder failed on every start and left torch's slower kernels in use)."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SUBSPEC_KERNELS_CACHE", raising=False)
    monkeypatch.setenv("SUBSPEC_CACHE", str(tmp_path / "cache"))
    root = kernels._kernels_root()
    assert root == tmp_path / "cache" / "kernels" and root.is_dir()
    assert kernels._build_dir("portable")[0].parent == root


def test_portable_build_targets_this_cpu_and_is_kept_per_cpu(monkeypatch):
    """The portable tier is compiled for this CPU's own instruction set (so the compiler vectorizes it for AVX2 or
    ARM's dot products, not for the architecture's baseline), and its build is keyed by the CPU: a home folder
    shared by two machines must not hand one CPU's build to another that lacks its instructions."""
    import platform

    flags = kernels._flags("portable")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "-march=native" in flags
    assert "native" not in " ".join(kernels._flags("portable", native=False))
    assert "native" not in " ".join(kernels._flags("avx2"))
    here = kernels._build_dir("portable")[0]
    monkeypatch.setattr(kernels, "_cpu_identity", lambda: "x86_64||avx2 sse2 another-cpu")
    assert kernels._build_dir("portable")[0] != here
    assert kernels._build_dir("avx2")[0] == kernels._build_dir("avx2")[0]  # explicit ISA flags: not keyed by the CPU
    avx2 = kernels._build_dir("avx2")[0]
    monkeypatch.undo()
    assert kernels._build_dir("avx2")[0] == avx2


def test_portable_build_falls_back_to_the_baseline_where_the_native_flag_fails(tmp_path, monkeypatch):
    """A compiler that refuses the native flag (an old or foreign one) still gets a portable tier: the same source
    built without it, in its own folder."""
    monkeypatch.setenv("SUBSPEC_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_native_isa", lambda: ["-mcpu=no-such-cpu"])
    built = []

    def fake_build(tier, folder, name, flags, quiet=False):
        built.append(flags)
        if "-mcpu=no-such-cpu" in flags:
            raise RuntimeError("error: unknown target CPU 'no-such-cpu'")

    monkeypatch.setattr(kernels, "_build", fake_build)
    kernels._load_build("portable", quiet=True)
    assert built == [kernels._flags("portable"), kernels._flags("portable", native=False)]
    assert "-mcpu=no-such-cpu" not in built[1]
    folder, name = kernels._build_dir("portable", built[1])  # the baseline build is there: the next start loads it
    folder.mkdir()
    (folder / f"{name}.so").write_bytes(b"")
    loaded = []
    monkeypatch.setattr(kernels.torch.ops, "load_library", loaded.append)
    built.clear()
    kernels._load_build("portable", quiet=True)
    assert built == [] and loaded == [str(folder / f"{name}.so")]  # no failing native build at every start
    built.clear()  # an ISA tier has no fallback: its one failed build is its error
    monkeypatch.setattr(kernels, "_flags", lambda tier, native=True: ["-mcpu=no-such-cpu"])
    with pytest.raises(RuntimeError, match="unknown target CPU"):
        kernels._load_build("avx2", quiet=True)
    assert built == [["-mcpu=no-such-cpu"]]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place between two bf16 tensors of one sign pattern."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("float32_gain", [False, True])
def test_fused_rms_norm_matches_the_torch_composition_and_is_batch_invariant(k, float32_gain):
    """The native RMSNorm rounds where the torch composition (subspec.families.NormStyle) rounds: at most one bf16
    ulp apart (the sum of squares is reduced in another order), most elements equal; each row's bits do not depend
    on the other rows."""
    from subspec.families import GEMMA_NORM, LLAMA_NORM

    style = GEMMA_NORM if float32_gain else LLAMA_NORM
    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).bfloat16()
    gain = style.gain(torch.randn(576) * 0.1 + 1.0, torch.bfloat16, "cpu")
    want = style(x, gain, 1e-6)
    got = k.rms_norm(x, gain, 1e-6, float32_gain)
    assert _ulps(got, want).max() <= 1 and (got == want).float().mean() > 0.95
    assert torch.equal(k.rms_norm(x[5:6].clone(), gain, 1e-6, float32_gain), got[5:6])
    heads = x.view(37, 9, 64)  # per-head norms (q/k norms) over the last dim of a 3-d tensor
    g64 = style.gain(torch.randn(64) * 0.1 + 1.0, torch.bfloat16, "cpu")
    assert _ulps(k.rms_norm(heads, g64, 1e-6, float32_gain), style(heads, g64, 1e-6)).max() <= 1


def test_fused_rope_equals_the_torch_composition(k):
    from subspec.model import apply_rope

    torch.manual_seed(1)
    T, H, D = 7, 9, 64
    x = torch.randn(T, H * D).bfloat16().view(T, H, D)
    ang = torch.arange(T)[:, None].float() * torch.rand(D // 2)[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().bfloat16()[:, None, :], emb.sin().bfloat16()[:, None, :]
    assert torch.equal(k.rope(x, cos, sin), apply_rope(x, cos, sin))


def test_fused_silu_mul_matches_the_torch_composition(k):
    torch.manual_seed(2)
    g = (torch.randn(6, 1536) * 4).bfloat16()
    u = torch.randn(6, 1536).bfloat16()
    want = F.silu(g) * u
    got = k.silu_mul(g, u)
    assert _ulps(got, want).max() <= 1 and (got == want).float().mean() > 0.99
    big = torch.tensor([[-100.0, 100.0, 0.0, -20.0] * 4]).bfloat16()
    assert torch.equal(k.silu_mul(big, torch.ones_like(big)), F.silu(big) * torch.ones_like(big))
    # the tier's bf16 stores at the edges: +inf stays inf and a NaN (here a negative one, bits 0xFFC0) a NaN, whatever
    # its bits (AVX512-BF16's vcvtneps2bf16 keeps the sign; the integer rounding writes 0x7FC0)
    edge = torch.tensor([[float("inf"), float("nan"), 3.0e38, 1.0] * 4]).bfloat16()
    edge.view(torch.int16)[0, 1::4] = -64  # 0xFFC0
    got, want = k.silu_mul(edge, torch.ones_like(edge)), F.silu(edge) * torch.ones_like(edge)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan]), got


@pytest.mark.parametrize("rows,n,topk,inv_t", [(3, 32768, 3, 1.0), (6, 32770, 6, 1.0), (1, 100, 1, 0.5),
                                              (4, 50, 8, 1.25)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_draft_expansion_equals_the_float64_log_softmax_top_k(k, rows, n, topk, inv_t, dtype):
    """expand_topk: the k best (row, column) pairs by score + log_softmax(logits * inv_t), against float64; equal
    values (BF16 has many) in (row, column) order; each row's maximum anywhere, the last partial block included."""
    g = torch.Generator().manual_seed(rows * n + topk)
    logits = (torch.randn(rows, n, generator=g) * 4).to(dtype)
    logits[0, n - 1] = 30.0  # the largest logit in the last (partial) block
    if rows > 1:
        logits[1, :] = logits[1, 0]  # a row of equal values: its first columns win
    scores = (-torch.rand(rows, generator=g) * 3).float()
    vals, flat = k.expand_topk(logits, scores, topk, inv_t)
    x = logits.double() * inv_t
    lp = (x - torch.logsumexp(x, -1, keepdim=True) + scores.double()[:, None]).view(-1)
    ranked = sorted(range(lp.numel()), key=lambda i: (-lp[i].item(), i))  # value descending, then (row, column)
    assert flat.tolist() == ranked[:topk]
    assert torch.allclose(vals.double(), lp[ranked[:topk]], rtol=0, atol=2e-5)
    assert vals.dtype == torch.float32 and flat.dtype == torch.int64


class _OneByOne:
    """A layer source that does not say it holds its layers in memory: the forward runs each fused layer alone."""

    def __init__(self, subs):
        self.subs = subs

    def acquire(self, i):
        return self.subs.get(i)

    def release(self, i):
        pass


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_fused_substitute_layers_equal_their_operators_bit_for_bit(tmp_path, kernel_tier, model_type):
    """``layers_w4`` (4-bit substitute layers in one call, q/k/v and gate/up on concatenated codes) gives the bits of
    the per-operator path: the logits and every K/V it writes, over a tree after a prefix, 1-9 rows; a whole draft's
    run of layers in one call, one layer a call, and a run with a layer the draft skips (no substitute for it); the
    per-linear path still works on the views it leaves (qwen2: q/k/v biases)."""
    from subspec.weights import Linears

    from conftest import save_tiny, tiny_config
    from subspec.loading import open_model
    from subspec.model import Attention, Decoder, ResidentLayers
    from subspec.placement import SubstituteSpec
    from subspec.quant import load_substitutes
    from subspec.speculation import SubstituteLayers

    src = open_model(save_tiny(tmp_path / "m", tiny_config(model_type, tied=False, layers=3)))
    with kernels.using(kernel_tier):
        dec = Decoder.from_source(src, torch.bfloat16, "cpu")
        subs = load_substitutes(src, [0, 1, 2], SubstituteSpec(4, 64), torch.bfloat16, "cpu")
    assert dec.k is kernels.ops(kernel_tier)
    assert dec.fused_layer and all(s.fused is not None for s in subs.values())
    unfused = {i: Linears(s.named) for i, s in subs.items()}  # the same linears, not fused
    calls, ops = [], dec.k

    class Counting:  # how many layers each native call ran
        def __getattr__(self, name):
            if name == "layers_w4":
                return lambda *a: calls.append(len(a[12])) or ops.layers_w4(*a)
            return getattr(ops, name)

    dec.k = Counting()
    torch.manual_seed(3)
    prefix_tokens = torch.randint(0, 128, (11,))
    for rows in (1, 6, 9):
        anc = (torch.rand(rows, rows) < 0.5).tril() | torch.eye(rows, dtype=torch.bool)
        pos, tokens, idx = 11 + anc.long().sum(1) - 1, torch.randint(0, 128, (rows,)), torch.arange(64)
        for keep in ([0, 1, 2], [0, 2]):
            out = []
            for source in (SubstituteLayers, _OneByOne, lambda s: SubstituteLayers({i: unfused[i] for i in s})):
                calls.clear()
                layers = source({i: subs[i] for i in keep})
                kv = dec.new_kv_cache(64)
                dec.forward(prefix_tokens, idx[:11], idx[:11], Attention.run(0), ResidentLayers(unfused), kv)
                logits = dec.forward(tokens, pos, idx[11:11 + rows], Attention.tree(11, anc), layers, kv)
                out.append((logits, *(kv.layer(i)[j].clone() for i in range(3) for j in range(2))))
                if source is SubstituteLayers:
                    assert calls == [len(keep)]  # the draft's whole run in one call
                elif source is _OneByOne:
                    assert calls == [1] * len(keep)
                else:
                    assert calls == []
            for a, b, c in zip(*out):
                assert torch.equal(a, b) and torch.equal(a, c)


_FIRST_CALL = """
import sys, torch
from subspec import kernels
k = kernels.ops(sys.argv[1])
g = torch.Generator().manual_seed(0)
H, I, NH, KVH, D, G, T, L0 = 576, 1536, 9, 3, 64, 64, 6, 40  # SmolLM2-135M's layer: 60 n-blocks of q/k/v
w = []
for n, kk in (((NH + 2 * KVH) * D, H), (H, NH * D), (2 * I, H), (H, I)):
    s = torch.rand(n // 16, kk // G, 16, generator=g) * 0.004 + 0.001
    w += [k.pack_w4(torch.randint(0, 16, (n, kk), generator=g, dtype=torch.uint8), G), s.bfloat16(),
          (-8 * s).bfloat16(), torch.empty(0)]
h, one = torch.randn(T, H, generator=g).bfloat16(), torch.ones(H, dtype=torch.bfloat16)
angle = torch.rand(T, 1, D, generator=g)
cache = torch.randn(1, 2, KVH, 64, D, generator=g).bfloat16()
pos, anc = torch.arange(L0, L0 + T), torch.ones(T, T, dtype=torch.bool).tril()
outs = []
for _ in range(3):  # the process's first call, then two more
    kv = cache.clone()
    y = k.layers_w4(h, w, G, [one], [one], 1e-5, False, NH, KVH, angle.cos().bfloat16(), angle.sin().bfloat16(), kv,
                    [0], pos, L0, anc, pos, [0], 0.125)
    outs.append((y, kv))
same = [all(torch.equal(a, b) for a, b in zip(outs[i], outs[2])) for i in (0, 1)]
print(*same)
"""


def test_fused_substitute_layer_first_call_of_a_process_equals_later_calls(kernel_tier):
    """A process's first ``layers_w4`` call gives the bits of later ones (SmolLM2-sized linears, the CPU's threads).

    Regression: the linears' grain was asked of torch (``at::get_num_threads``) inside the layer's OpenMP region, by
    each thread; a worker thread's first such call (torch's per-thread lazy set-up) answered differently, so the two
    threads split a worksharing loop with different bounds: on the first call some of q/k/v's output rows were never
    computed (uninitialized memory, NaN in the draft's logits and in the K/V written to the cache)."""
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPU threads to race")
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL, kernel_tier], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], out.stdout


@pytest.mark.parametrize("out_f,in_f,group", [(576, 576, 64), (1536, 576, 64), (576, 1536, 128), (256, 1536, 32),
                                              (8960, 1536, 64), (1536, 8960, 64)])
def test_coded_linear_equals_the_bf16_linear_over_the_decoded_weight_bit_for_bit(k, out_f, in_f, group):
    """``linear_coded`` multiplies a weight held as its stream coded against the 4-bit substitute (each task decodes its
    rows as it goes): every row gets exactly linear_bf16's bits over the weight itself (batch-invariant: any row
    count, bias or none), and the block index is the stream's own (a truncated stream is refused, not read past)."""
    from subspec.quant import Int4Linear

    w = _bf16(out_f, in_f, scale=0.03, seed=4)
    codes, scale, zero = hqq_quantize(w.float(), 4, group)
    lin = Int4Linear(codes, scale, zero, group, None, torch.bfloat16, "cpu")
    w[0, :4] = torch.tensor([3e38, 0.0, -0.0, 1e-40]).bfloat16()  # far from the prediction: escapes
    packed, s, z = lin.packed, lin.scale, lin.shift
    stream = k.w4_delta_encode(w, packed, s, z, group)
    offsets = k.w4_delta_index(stream, out_f, in_f)
    assert offsets.shape == (out_f // 16 + 1,) and int(offsets[-1]) == stream.numel()
    blocks = offsets[1:] - offsets[:-1]  # 16 K bytes of differences, 2 more per escape
    assert (blocks >= 16 * in_f).all() and ((blocks - 16 * in_f) % 2 == 0).all() and blocks[0] > 16 * in_f
    b = _bf16(out_f, seed=5)
    x = _bf16(40, in_f, seed=6)
    for m in (1, 2, 3, 6, 16, 17, 33, 40):
        for bias in (None, b):
            got = k.linear_coded(x[:m], stream, offsets, packed, s, z, group, bias)
            assert torch.equal(got.view(torch.int16), k.linear_bf16(x[:m], w, bias).view(torch.int16)), m
    with pytest.raises(RuntimeError, match="ended early"):
        k.w4_delta_index(stream[:-2].clone(), out_f, in_f)
    with pytest.raises(RuntimeError, match="ended early"):
        k.linear_coded(x[:1], stream[:-2].clone(), offsets, packed, s, z, group, None)


@pytest.mark.parametrize("tier", [t for t in kernels.TIERS if kernels.missing_flags(t)])
def test_a_tier_this_cpu_cannot_run_still_compiles(tier):
    """The kernel_tier tests build and run every tier this CPU runs; each other tier is compiled here (syntax only,
    every template its operators use instantiated), so a change to the drivers all tiers share cannot break the AMX
    or AVX-512 build from an AVX2 machine unnoticed (on the machines that have them, subspec would fall back to a
    slower tier)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the amx, avx512 and avx2 tiers compile for x86 only")
    error = kernels.compile_check(tier)
    assert error is None, f"the {tier} tier does not compile:\n{error}"


def test_the_compile_check_catches_an_error_only_a_template_instantiation_shows(tmp_path, monkeypatch):
    """The check above cannot pass vacuously: an error inside a template, seen only where a tier instantiates it
    (the 4-bit linear's block), fails it with the compiler's message."""
    import shutil

    src = tmp_path / "csrc"
    shutil.copytree(kernels._CSRC, src)
    drivers = src / "drivers.h"
    text = drivers.read_text()
    anchor = "  void block(int64_t nb, int64_t m0) const {\n"
    assert anchor in text
    drivers.write_text(text.replace(anchor, anchor + '    static_assert(sizeof(T) == 0, "injected error");\n', 1))
    monkeypatch.setattr(kernels, "_CSRC", src)
    error = kernels.compile_check("portable")
    assert error is not None and "injected error" in error, error


def test_the_avx512_tier_built_without_bf16_vnni_and_vbmi2_is_exact():
    """Skylake-SP and Cascade Lake run the avx512 tier without its optional extensions: that build's fallback paths
    (fp32 FMA BF16 linear, vpmaddubsw 4-bit linear, pshufb escapes in the codec), built here with those extensions
    left out, against float64 and the codec's other tiers (tests/baseline_avx512_worker.py, a process of its own)."""
    import subprocess
    import sys
    from pathlib import Path

    if "avx512" not in kernels.supported():
        pytest.skip("this CPU cannot execute the avx512 tier")
    worker = Path(__file__).with_name("baseline_avx512_worker.py")
    out = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", "linear_bf16", "ok", "linear_w4", "ok", "codec"], out.stdout
