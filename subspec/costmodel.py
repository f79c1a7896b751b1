"""The cost model: predicted tokens per second of plain offloaded decoding (ar) and of SubSpec for a placement.

Speculative decoding's speed is ``E(D) / (D * t_step + t_verify)`` tokens per second (design.md §3.2), with

- ``E(D) = 1 + a + ... + a^D`` the expected tokens a round of depth D emits when each drafted token is accepted
  with probability ``a`` given its parent was (the geometric model of :class:`~subspec.policy.AdaptiveDepth`;
  Leviathan et al. 2023, eq. 1, with a tree of width k making ``a`` the chance that one of k guesses is right);
- ``t_step`` one draft forward over the k frontier tokens. The draft's weights stay on the device, so a step costs
  what reading them costs (dense bytes / memory bandwidth; 4-bit substitute bytes / the 4-bit kernel's throughput,
  which on a CPU is bound by de-quantization rather than memory) plus a fixed dispatch cost per layer;
- ``t_verify`` one target forward over the tree: the resident layers (bytes / memory bandwidth, plus compute that
  grows with the tree's tokens), the same dispatch cost, and the offloaded layers, whose compute overlaps the reading
  of the next layer (the tier reads ahead): the larger of streamed bytes / offload bandwidth and their compute. A
  layer coded against its substitute (:mod:`subspec.codec`) is decoded by the compute threads as they multiply
  (``linear_coded``): its weights at the decode rate join its compute. What the tier read into its staging slots while
  the draft ran (at the offload rate for as long as the draft phase lasts) is not waited for.

ar is one target forward of one token per token. Both are predicted from the placement's bytes and the machine's
rates (:class:`Rates`, defaults per kernel tier: :meth:`Rates.for_tier`); :func:`forecast` picks the best depth. The same formulas drive the running generation's
depth choice (there with measured ``t_step``/``t_verify`` and the observed acceptance).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

PRIOR_ACCEPTANCE = 0.9
"""``a`` before any round was observed (the prior of :class:`~subspec.policy.AdaptiveDepth`: 9 hits, 1 miss).
Measured on this project's benchmarks: about 0.9 (SmolLM2-135M) to 0.95 (Qwen2.5-1.5B) with 4-bit substitutes."""


SKIP_ACCEPTANCE = ((0.0, 0.0), (0.25, 0.06), (0.5, 0.37), (0.75, 0.85), (1.0, 1.0))
"""(share of the layers the draft runs, factor on ``a``) for a draft that skips the offloaded layers the budget left
without a substitute (:attr:`~subspec.placement.Placement.draft_layers`), interpolated linearly. Measured on
Qwen2.5-Coder-1.5B (greedy, 6 Spec-Bench prompts, depth 10, top-k 4; substitutes kept by
:func:`~subspec.placement.spread_substitutes`): tau 6.25 / 3.78 / 1.49 / 1.06 / 1.02 with 28 / 21 / 14 / 7 / 0 of its 28
layers, i.e. ``a`` 0.88 / 0.75 / 0.33 / 0.05 / 0.02. Smaller models tolerate skipping worse (SmolLM2-135M: ``a`` 0.86
with all 30 layers, 0.23 with 22): the running policy measures the acceptance and stops drafting where it does not
pay."""


def skip_factor(share: float) -> float:
    """The factor :data:`SKIP_ACCEPTANCE` gives ``a`` when the draft runs ``share`` (0..1) of the layers."""
    pts = SKIP_ACCEPTANCE
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if share <= x1:
            return y0 + (y1 - y0) * (max(share, x0) - x0) / (x1 - x0)
    return 1.0


def expected_tokens(a: float, depth: int) -> float:
    """``E(D) = 1 + a + ... + a^D``: tokens a round of ``depth`` D emits on average (the bonus token included)."""
    if a >= 1.0:
        return depth + 1.0
    return (1.0 - a ** (depth + 1)) / (1.0 - a)


def round_rate(a: float, depth: int, t_step: float, t_verify: float) -> float:
    """Tokens per second of rounds of ``depth``: ``E(D) / (D * t_step + t_verify)`` (a tree of depth D takes D draft
    forwards: the root's, then one per depth but the last; seconds per draft step ``t_step``, per verify
    ``t_verify``)."""
    return expected_tokens(a, depth) / (depth * t_step + t_verify)


def best_depth(a: float, t_step: float, t_verify: Union[float, Callable[[int], float]],
               max_depth: int = 48) -> tuple[int, float]:
    """(depth in 1..max_depth, tokens per second) maximizing :func:`round_rate`; ``t_verify`` is the seconds of a
    verify forward, or a function of the depth giving them (a deeper tree holds more nodes)."""
    tv = t_verify if callable(t_verify) else (lambda _d: t_verify)
    rates = {d: round_rate(a, d, t_step, tv(d)) for d in range(1, max_depth + 1)}
    d = max(rates, key=rates.get)
    return d, rates[d]


@dataclass
class Rates:
    """Machine rates the predictions use.

    Attributes:
        memory: bytes per second a forward reads resident weights at (RAM on a CPU, HBM on a GPU).
        substitute: bytes per second of 4-bit substitute weights the draft's linears get through.
        offload: bytes per second the offload tier delivers (disk with O_DIRECT; host-to-device copies on CUDA).
        per_layer: seconds of fixed cost per layer per forward (operator dispatch, norms, RoPE, attention of a few
            tokens), independent of the weights' bytes.
        flops: multiply-adds per second x 2 of the dense linears over many tokens (the part of a verify forward
            that grows with the tree).
        decode: weights per second the compute threads decode a layer coded against its substitute at
            (``linear_coded``, before its multiply-adds).

    The defaults are an Intel AMX machine's; :meth:`for_tier` gives each kernel tier's.
    """

    memory: float = 25e9
    offload: float = 1.2e9
    per_layer: float = 0.45e-3
    flops: float = 1.2e12
    substitute: float = 19e9
    decode: float = 10e9

    @staticmethod
    def for_tier(tier: Optional[str]) -> "Rates":
        """The default rates where the kernel ``tier`` runs (None: torch's kernels): what verify and draft compute
        cost differs by an order of magnitude between AMX and AVX2, and with it the best placement. Measured on this
        project's 2-core machines, 2 threads (``scripts/bench_kernels.py``; flops: 17 rows of 8960 x 1536 and 1536 x
        8960, a verify's linears; decode: ``linear_coded`` at one row of the same shapes; substitute: the draft pass
        of Qwen2.5-1.5B's 4-bit linears at 3 rows). amx: an Intel AMX machine (decode: its AVX-512 decoder); avx512:
        a Xeon with AVX-512 BF16 (174 G flops/s, 10.7 G weights/s decoded, 21.9 GB/s of 4-bit weights); avx2: the
        same Xeon forced to avx2 (128 G, 6.7 G, 19.6 GB/s) and an AMD Zen 3 (80-90 G flops/s, 4-bit 12-15 GB/s),
        rounded down toward the slower; portable: the Xeon built for SSE2 (28 G, 0.47 G, 1.9 GB/s); torch's
        kernels: their BF16 linear where no tier runs is slow on AVX2 CPUs (18 G at 128 rows on a Zen 3)."""
        return _TIER_RATES.get(tier, _TIER_RATES[None])

    @staticmethod
    def measure(offload_file: Optional[Path] = None, device: torch.device = torch.device("cpu"),
                tier: Optional[str] = None) -> "Rates":
        """Measure the rates quickly (about a second): a 256 MiB copy for memory, 128 MiB read with O_DIRECT
        from ``offload_file`` for the offload tier (else the default), a [256, 2048] x [2048, 2048] linear (on the
        native kernel where it runs) for flops, and where the kernel ``tier`` runs, a [2048, 2048] weight coded
        against its 4-bit substitute multiplied by one row for decode. ``per_layer`` and ``substitute`` stay the
        tier's defaults (:meth:`for_tier`). The AMX defaults were
        measured on this project's 2-core machines: memory 25 GB/s (a copy), offload 1.2 GB/s (the disk tier's
        sustained reads vary 0.9-1.9 GB/s between machines and runs: 1.05-1.7 in one SmolLM2 bench on an Intel AMX
        machine, 1.05-1.3 on an AMD Zen 4, 1.8-1.9 during ar on Qwen2.5-1.5B on an earlier machine; at 1.8 the
        planner kept resident layers that a slower disk makes cost more than the read-ahead slots they replace:
        SmolLM2 at 300 MiB on avx2 ran 1.99x over ar with 6 resident layers and 2 slots, 2.56x with 12 slots),
        flops 1.2e12 (the verify forward's linears over 129 tokens), substitute 19 GB/s (the draft step of
        Qwen2.5-1.5B on substitutes of all 28 layers with the AMX-INT8 kernel of then, since replaced by the AVX-512
        one: 737 MB of 4-bit weights, 56 ms measured per step, 4 ms of head and 13 ms of per-layer cost beside; 11 GB/s
        with the BF16 de-quantizing kernel before it), per_layer 0.45 ms (SmolLM2-135M's draft step beyond its bytes:
        14 ms over 30 layers)."""
        n = 256 << 20
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t = best_time(lambda: dst.copy_(src), 3, device)
        memory = 2 * n / t  # a copy reads and writes every byte: the read bandwidth is at least this
        src = dst = None  # free the 512 MiB before the next measurement
        offload = _read_rate(offload_file) if offload_file is not None else Rates.offload
        from .weights import DenseLinear

        x = torch.randn(256, 2048, dtype=torch.bfloat16, device=device)
        lin = DenseLinear(torch.randn(2048, 2048, dtype=torch.bfloat16, device=device))
        lin(x)
        flops = 2 * 256 * 2048 * 2048 / best_time(lambda: lin(x), 3, device)
        base = Rates.for_tier(tier)
        decode = _decode_rate(tier) if tier is not None and device.type == "cpu" else base.decode
        return Rates(memory=memory, offload=offload, per_layer=base.per_layer, flops=flops,
                     substitute=base.substitute, decode=decode)


def _decode_rate(tier: str, n: int = 2048) -> float:
    """Weights per second the ``tier``'s ``linear_coded`` gets through at one row: an [n, n] Gaussian weight coded
    against its 4-bit group-64 substitute (the codec's typical 57 %), the fastest of 3 calls."""
    from .kernels import ops, using
    from .quant import Int4Linear, hqq_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, n, generator=g) * 0.02
    with using(tier):
        codes, scale, zero = hqq_quantize(w, 4, 64)
        sub = Int4Linear(codes, scale, zero, 64, None, torch.bfloat16, "cpu", native=True)
        op = ops(tier)
        stream = op.w4_delta_encode(w.bfloat16(), sub.packed, sub.scale, sub.shift, 64)
        index = op.w4_delta_index(stream, n, n)
        x = torch.randn(1, n, generator=g).bfloat16()
        call = lambda: op.linear_coded(x, stream, index, sub.packed, sub.scale, sub.shift, 64, None)  # noqa: E731
        call()
        return n * n / best_time(call, 3)


_TIER_RATES = {
    "amx": Rates(),
    "avx512": Rates(flops=1.6e11, substitute=20e9),
    "avx2": Rates(flops=1.0e11, substitute=14e9, decode=5e9),
    "portable": Rates(flops=3e10, substitute=2e9, decode=0.5e9),
    None: Rates(flops=5e10, substitute=5e9),  # torch's kernels (no coded layers without a native tier)
}


def best_time(fn, repeats: int, device: torch.device = torch.device("cpu"), enough: float = float("inf")) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` (interference from other processes only ever adds
    time), the device synchronized around each on CUDA; no more calls once one took ``enough`` seconds (a forward
    that streams gigabytes is not a few microseconds of noise, and a large model's calibration would take minutes)."""
    best = float("inf")
    for _ in range(repeats):
        if best < float("inf") and best >= enough:
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def _read_rate(path: Path, limit: int = 192 << 20, block: int = 48 << 20) -> float:
    """Bytes per second reading ``path`` with O_DIRECT in ``block``-byte requests (the page cache bypassed, as the
    disk tier reads, into the same kind of memory as its staging slots: :mod:`subspec.hostmem`): the fastest request
    (the first ones pay the device's warm-up; interference only adds time)."""
    from .hostmem import aligned_view, huge_page_map

    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    m = view = None
    try:
        m = huge_page_map(block)
        buf = aligned_view(m, block)
        buf.fill_(0)  # faulted in before timing, as a staging slot is after its first layer
        view = memoryview(buf.numpy())
        del buf
        size = min(os.fstat(fd).st_size // 4096 * 4096, limit)
        best, done = 0.0, 0
        while done + block <= size:
            t = time.perf_counter()
            got = os.preadv(fd, [view], done)
            dt = time.perf_counter() - t
            if got <= 0:
                break
            best = max(best, got / dt) if dt > 0 else best
            done += got
        return best or Rates.offload
    finally:
        os.close(fd)
        if view is not None:
            view.release()
        del view  # (with it the last reference to the tensor that exports the mapping)
        if m is not None:
            m.close()


@dataclass
class Forecast:
    """Predicted speed of one method at one placement.

    Attributes:
        method: 'ar' or 'subspec'. tokens_per_second: the prediction. t_single: seconds of a one-token target
        forward. t_step: seconds of a draft step (subspec). t_verify: seconds of a verify forward over the tree
        (subspec). depth: the best depth (subspec; 0 = drafting does not pay, plain decoding). acceptance: the ``a``
        assumed.
    """

    method: str
    tokens_per_second: float
    t_single: float
    t_step: float = 0.0
    t_verify: float = 0.0
    depth: int = 0
    acceptance: float = 0.0

    def line(self) -> str:
        if self.method == "ar":
            return f"ar: {self.tokens_per_second:.2f} tokens/s (one {1e3 * self.t_single:.0f} ms forward per token)"
        if self.depth == 0:
            return (f"subspec: {self.tokens_per_second:.2f} tokens/s without drafting (drafting does not pay here: "
                    f"draft step {1e3 * self.t_step:.1f} ms, verify {1e3 * self.t_verify:.0f} ms)")
        return (f"subspec: {self.tokens_per_second:.2f} tokens/s (depth {self.depth}, acceptance {self.acceptance:.2f} "
                f"assumed: {expected_tokens(self.acceptance, self.depth):.1f} tokens per round; draft step "
                f"{1e3 * self.t_step:.1f} ms, verify {1e3 * self.t_verify:.0f} ms)")


def forward_seconds(memory_bytes: float, streamed_bytes: float, layers: int, tokens: int, resident_params: float,
                    streamed_params: float, rates: Rates, decoded_params: float = 0.0) -> float:
    """Seconds of one forward over ``tokens`` tokens: resident bytes at memory speed plus their ``2 * params``
    flops per token beyond the first, the fixed cost per layer, and for the streamed layers the larger of their
    bytes at offload speed and their compute (read-ahead overlaps the two): their flops, and the decoding of the
    ``decoded_params`` weights of coded layers (at ``rates.decode``)."""
    extra = 2.0 * max(tokens - 1, 0) / rates.flops
    return (memory_bytes / rates.memory + resident_params * extra + layers * rates.per_layer
            + max(streamed_bytes / rates.offload, streamed_params * extra + decoded_params / rates.decode))


def read_ahead_bytes(placement) -> int:
    """Bytes of a verify's stream the disk tier can hold before the verify starts: its staging slots, each one
    offloaded layer (coded slots hold a coded stream), filled while the draft runs (the first offloaded layers of the
    next target forward do not change meanwhile); at most the whole stream. A mixture of experts streamed by expert
    reads its experts once routed: counted 0."""
    if not placement.offloaded or placement.experts is not None:
        return 0
    per_layer = placement.streamed_bytes(1) / len(placement.offloaded)
    return int(min(len(placement.offloaded), placement.staging_slots) * per_layer)


def forecast(placement, config, rates: Rates, *, method: str, draft_head_bytes: int = 0,
             verify_tokens: Optional[int] = None, acceptance: float = PRIOR_ACCEPTANCE, max_depth: int = 48,
             topk: int = 6, budgets: tuple[int, ...] = (16, 32, 64, 128)) -> Forecast:
    """Predict tokens per second for ``placement`` (:class:`~subspec.placement.Placement`).

    A round of depth D verifies a tree of ``min(budget, topk * D)`` nodes and the root (a verify's compute grows with
    its tree), as the running policy prices it (:class:`~subspec.policy.AdaptiveDepth`); with ``verify_tokens`` not
    given the verify budget is the best of ``budgets`` (the calibration's candidates), else ``verify_tokens - 1``.

    Args:
        config: the model's transformers config (layer count, hidden and intermediate sizes).
        rates: :class:`Rates`. method: 'ar' or 'subspec'.
        draft_head_bytes: bytes of the draft's output projection (its vocabulary subset in BF16; ignored when the
            placement holds a 4-bit "draft head", read at the substitutes' rate). verify_tokens: tokens of the
            largest verify forward (the verify budget + the root), None = automatic. acceptance: ``a``. max_depth:
            deepest tree considered. topk: nodes a depth adds. budgets: the automatic verify budgets.

    Returns:
        A :class:`Forecast` (its ``t_verify``: the verify at the chosen depth). For subspec, depth 0 (plain decoding
        through the same engine) when no depth beats it.
    """
    from .families import mlp_width

    L, H = config.num_hidden_layers, config.hidden_size
    # a token's weights in a layer (GQA's smaller k/v counted as full: an upper bound; a MoE: its top-k experts)
    per_layer = 4 * H * H + 3 * H * mlp_width(config, per_token=True)
    res_params = len(placement.resident) * per_layer
    off_params = len(placement.offloaded) * per_layer
    resident = sum(b for n, b, _ in placement.items if n in ("resident layers", "lm_head"))
    if method == "ar":
        t_single = forward_seconds(resident, placement.streamed_bytes(1), L, 1, res_params, off_params, rates)
        return Forecast("ar", 1.0 / t_single, t_single)
    # layers coded against their substitutes (the offloaded ones the draft has a substitute of) decode as they multiply
    coded = len(set(placement.offloaded) & set(placement.substituted)) if placement.stream_ratio < 1 else 0
    decoded = coded * per_layer
    t_single = forward_seconds(resident, placement.streamed_bytes(1), L, 1, res_params, off_params, rates, decoded)
    skipped = len(placement.draft_skipped)
    if skipped:  # a draft that skips layers guesses worse (measured: SKIP_ACCEPTANCE)
        acceptance *= skip_factor(1.0 - skipped / L)
    substitutes = sum(b for n, b, _ in placement.items if n == "substitutes")
    head4 = sum(b for n, b, _ in placement.items if n == "draft head")  # a 4-bit draft head runs on the 4-bit kernel
    substitutes += head4
    dense = 0 if head4 else draft_head_bytes
    if not placement.substitute_all:
        dense += sum(b for n, b, _ in placement.items if n == "resident layers")
    t_step = forward_seconds(dense, 0, L, 1, 0, 0, rates) + substitutes / rates.substitute

    ahead = read_ahead_bytes(placement)

    def t_verify(budget: int, depth: int) -> float:
        nodes = 1 + min(budget, topk * depth)  # a mixture of experts streams more experts for more nodes
        streamed = placement.streamed_bytes(nodes) - min(ahead, depth * t_step * rates.offload)
        return forward_seconds(resident, streamed, L, nodes, res_params, off_params, rates, decoded)

    best = None
    for budget in ([verify_tokens - 1] if verify_tokens is not None else budgets):
        depth, rate = best_depth(acceptance, t_step, lambda d, b=budget: t_verify(b, d), max_depth)
        if best is None or rate > best[2]:
            best = (budget, depth, rate)
    budget, depth, rate = best
    if rate < 1.0 / t_single:
        return Forecast("subspec", 1.0 / t_single, t_single, t_step, t_verify(budget, 1), 0, acceptance)
    return Forecast("subspec", rate, t_single, t_step, t_verify(budget, depth), depth, acceptance)
