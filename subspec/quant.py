"""Substitutes: low-bit copies of an offloaded layer's linears, made data-free with HQQ (design.md §3.3).

Quantization follows the ``hqq`` package (its own code, or the same arithmetic fused natively on the CPU): HQQ's min-max start (as ``Quantizer.quantize``, axis 1: groups of
``group_size`` consecutive input features, dequantized as ``W = (W_q - zero) * scale``) refined by HQQ's proximal
optimizer (``optimize_weights_proximal_legacy``) for at most :data:`HQQ_ITERS` iterations. HQQ's optimizer treats
every group independently, so a weight is quantized in row chunks that fit the CPU cache (:data:`CHUNK_BYTES`), much
faster than whole matrices.
4-bit substitutes run on torch's native packed-int4 kernels (CPU ``_weight_int4pack_mm_for_cpu``, CUDA
``_weight_int4pack_mm``), whose dequantization is ``W = (q - 8) * s + z``; HQQ's triple converts exactly with
``s = scale``, ``z = (8 - zero) * scale``. Other bit widths run through HQQ's own ``Quantizer.dequantize``.

Substitutes are cached per layer (:func:`load_substitutes`): one safetensors file per layer holding each linear's
codes packed (:func:`pack_codes`: two 4-bit codes per byte), scale and zero, with a header (``__metadata__``) naming
the model, bits, group size and layer they were made from. Each file is written atomically as soon as its layer
is quantized, so a second start (or a start after an interruption) only reads what it needs, layer by layer.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .cache import cache_root
from .families import linear_names, linear_prefix
from .placement import SubstituteSpec
from .progress import bar as progress_bar
from .weights import DenseLinear, Linears


INT4_KERNEL_GROUPS = (32, 64, 128, 256)
"""Group sizes torch's packed-int4 kernels accept; other 4-bit groups run through HQQ's dequantizing path."""


CHUNK_BYTES = 256 << 10
"""float32 bytes of weight quantized at once (row chunks). Measured on a 1536 x 2048 weight (1 thread, a busy 2-core
machine): whole matrix 53 s, 1 MiB chunks 7.2 s, 256 KiB 4.1-4.6 s, 64 KiB 47 s (per-call overhead)."""


HQQ_ITERS = 8
"""Iterations of HQQ's proximal optimizer (HQQ's own default: 20, with an early stop that ends at about 13 on the
1.5B's weights). Measured on qwen2.5-coder-1.5b's layer 13 (4-bit, group 64; relative Frobenius error of the
de-quantized weight): down_proj 0.08934 after 1 iteration, 0.08762 after 4, 0.08716 after 8, 0.08711 after 20, in
0.45 s instead of 0.86 s; q_proj 0.07930 after 8 and after 20. Eight iterations keep the error within 0.1 % of HQQ's
default and halve the time of a first start's substitutes."""


def hqq_quantize(w: torch.Tensor, bits: int, group_size: int, device="cpu",
                 chunk_bytes: int = CHUNK_BYTES, iters: int = HQQ_ITERS,
                 native: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HQQ-quantize a weight (data-free, axis 1), in row chunks of about ``chunk_bytes`` (float32).

    Each chunk is quantized on its own: HQQ's min-max start (the same arithmetic as ``Quantizer.quantize``), then
    HQQ's proximal optimizer (``hqq.core.optimize.optimize_weights_proximal_legacy``) for at most ``iters``
    iterations (HQQ's early stop included). HQQ's groups are independent, so the only difference from one call on the
    whole matrix is that the early stop is decided per chunk. On the CPU with a native kernel tier the optimizer runs
    as one fused native pass per iteration over both cores (``hqq_quantize`` of :mod:`subspec.kernels`: the same
    arithmetic, sums in another order, 40-200x faster; the same error to within 0.01 % on SmolLM2's weights); with
    ``native=False`` (or no tier) the ``hqq`` package runs it, and with ``iters=20`` the result is bit-identical to
    ``Quantizer.quantize``'s.

    Args:
        w: [out, in] float weight. bits: 2, 3, 4 or 8. group_size: must divide ``in``. device: where HQQ's
            optimization runs (a GPU makes it much faster); results come back on the CPU. iters: optimizer
            iterations (:data:`HQQ_ITERS`; 0 = HQQ's min-max start, not optimized). native: use the native
            optimizer (None: where a kernel tier runs and ``device`` is the CPU).

    Returns:
        (codes [out, in] uint8 in 0..2^bits-1, scale [out, in/group] float32, zero [out, in/group] float32), with
        ``w ≈ (codes - zero) * scale`` per group.

    Raises:
        ValueError: ``group_size`` does not divide ``in``.
    """
    from . import kernels

    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"group size {group_size} does not divide {in_f} input features")
    rows = max(1, chunk_bytes // (4 * in_f))
    if native is None:
        native = torch.device(device).type == "cpu" and group_size % 16 == 0 and kernels.native()
    if native:
        return kernels.ops().hqq_quantize(w.to(torch.float32), bits, group_size, iters, rows, 0.7, 1e1)
    from hqq.core.optimize import optimize_weights_proximal_legacy

    g = in_f // group_size
    codes = torch.empty(out_f, in_f, dtype=torch.uint8)
    scale = torch.empty(out_f, g, dtype=torch.float32)
    zero = torch.empty(out_f, g, dtype=torch.float32)
    top = float(2 ** bits - 1)
    params = {"lp_norm": 0.7, "beta": 1e1, "kappa": 1.01, "iters": iters}  # HQQ's defaults but the iterations
    for r in range(0, out_f, rows):
        chunk = w[r:r + rows].to(device=device, dtype=torch.float32).reshape(-1, group_size)
        lo, hi = chunk.min(dim=1, keepdim=True)[0], chunk.max(dim=1, keepdim=True)[0]
        denom = hi - lo  # HQQ's start: the inverse scale maps [min, max] onto [0, 2^bits - 1]
        inv = torch.where(denom.abs() <= 1e-4, torch.ones_like(denom), top / denom).clamp(max=2e4)
        z = -lo * inv
        if iters > 0:
            q, inv, z = optimize_weights_proximal_legacy(chunk, inv, z, [0, top], axis=1, device=str(chunk.device),
                                                         opt_params=params)
        else:
            q = (chunk * inv + z).round_().clamp_(0, top)
        n = chunk.shape[0] * group_size // in_f
        codes[r:r + n] = q.reshape(n, in_f).to(torch.uint8).cpu()
        scale[r:r + n] = (1.0 / inv).float().reshape(n, g).cpu()
        zero[r:r + n] = z.float().reshape(n, g).cpu()
    return codes, scale, zero


def _per_byte(bits: int) -> int:
    """Codes stored per byte: 4 of 2 bits, 2 of 3 or 4 bits (a 3-bit code takes a nibble), 1 of 8 bits."""
    return {2: 4, 3: 2, 4: 2, 8: 1}[bits]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes [out, in] uint8 (< 2^bits) along ``in``: code ``j*p + t`` of a row in bits ``t*w..`` of byte j, with
    p codes of width w = 8/p per byte (:func:`_per_byte`). Returns [out, in/p] uint8."""
    p = _per_byte(bits)
    if p == 1:
        return codes.contiguous()
    out_f, in_f = codes.shape
    c = codes.view(out_f, in_f // p, p)
    w = 8 // p
    packed = c[..., 0].clone()
    for t in range(1, p):
        packed |= c[..., t] << (t * w)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: [out, in/p] uint8 -> codes [out, in] uint8."""
    p = _per_byte(bits)
    if p == 1:
        return packed
    w = 8 // p
    mask = (1 << w) - 1
    return torch.stack([(packed >> (t * w)) & mask for t in range(p)], dim=-1).reshape(packed.shape[0], -1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """HQQ's dequantization ``(codes - zero) * scale`` per group; returns [out, in] float32 (the reference)."""
    out_f, in_f = codes.shape
    g = in_f // scale.shape[1]
    return ((codes.float().view(out_f, -1, g) - zero[..., None]) * scale[..., None]).view(out_f, in_f)


class Int4Linear:
    """A 4-bit substitute linear.

    On the CPU it runs on the active kernel tier's ``linear_w4`` (:mod:`subspec.kernels`; group 32 or a multiple of
    64): the codes multiply the activations as integers (exact in int32; the activations quantized per row and group,
    to 8 bits) and each group's scale and shift (``w = codes * scale + shift`` with
    ``shift = -zero * scale``, HQQ's ``(codes - zero) * scale``, both in BF16) are applied in fp32 once per output
    element; the codes are read once for up to 8 rows, so a k-row draft step costs little more than one row.
    Elsewhere it runs on torch's packed-int4 kernels
    (CPU ``_weight_int4pack_mm_for_cpu``, CUDA ``_weight_int4pack_mm``, tinygemm layout), whose de-quantization is
    ``(q - 8) * s + z``, exactly HQQ's with ``s = scale``, ``z = (8 - zero) * scale``.

    Args:
        codes: [out, in] uint8 in 0..15, or two a byte [out, in/2] (``nibbles``: :func:`pack_codes`, the cached form);
            scale, zero: [out, in/group] (HQQ convention); group_size; bias: [out] or None; dtype: activation dtype;
            device; native: use the native kernel where it applies. consume: the caller gives up ``codes`` (a
            contiguous uint8 tensor two a byte): the native kernel's layout is made in their memory (they change).
    """

    __slots__ = ("packed", "scales_zeros", "group_size", "bias", "kernel_dtype", "cuda", "native", "scale", "shift",
                 "ops")

    def __init__(self, codes, scale, zero, group_size: int, bias, dtype: torch.dtype, device, native: bool = True,
                 nibbles: bool = False, consume: bool = False):
        from . import kernels

        device = torch.device(device)
        out_f, in_f = codes.shape[0], codes.shape[1] * (2 if nibbles else 1)
        self.cuda = device.type == "cuda"
        # BF16 activations always: the torch kernels' float32 path is a slow reference (7-60x slower on CPU); the
        # draft only needs to be accurate, the target decides every emitted token.
        self.kernel_dtype = torch.bfloat16
        self.group_size = group_size
        self.native = (native and device.type == "cpu" and (group_size == 32 or group_size % 64 == 0)
                       and kernels.linear_fits(out_f, in_f) and kernels.native())
        # the native kernel adds the bias in fp32 (a draft-only linear: no rounding to match); torch's in ``dtype``
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32 if self.native else dtype).contiguous()
        self.scales_zeros = self.scale = self.shift = None
        self.ops = kernels.ops() if self.native else None  # the tier's operators (codec.py decodes with them too)
        if self.native:
            g = in_f // group_size

            def tiled(t: torch.Tensor) -> torch.Tensor:  # [out, g] -> [out/16, g, 16] bf16
                return t.float().view(out_f // 16, 16, g).transpose(1, 2).contiguous().to(torch.bfloat16)

            if nibbles and consume and codes.dtype == torch.uint8 and codes.is_contiguous():
                self.packed = self.ops.pack_w4_nibbles_(codes, group_size)  # in place: no second buffer
            else:
                pack = self.ops.pack_w4_nibbles if nibbles else self.ops.pack_w4
                self.packed = pack(codes.to(torch.uint8), group_size)
            self.scale, self.shift = tiled(scale), tiled(-zero.float() * scale.float())
            return
        if nibbles:
            codes = unpack_codes(codes, 4)
        z = (8.0 - zero) * scale  # HQQ (codes - zero) * scale == (codes - 8) * scale + z
        self.scales_zeros = torch.stack([scale.t(), z.t()], dim=-1).to(self.kernel_dtype).contiguous().to(device)
        if self.cuda:
            c = codes.to(device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack((c[:, ::2] << 4 | c[:, 1::2]).contiguous(), 8)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x's dtype."""
        xk = x.to(self.kernel_dtype)
        if self.native:
            return self.ops.linear_w4(xk, self.packed, self.scale, self.shift, self.group_size,
                                      self.bias).to(x.dtype)
        elif self.cuda:
            y = torch.ops.aten._weight_int4pack_mm(xk, self.packed, self.group_size, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.packed, self.group_size, self.scales_zeros)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class FusedW4Layer:
    """A layer's seven native 4-bit substitutes as the operands of the kernel tier's ``layers_w4`` (the whole layer in
    one call: a small model's draft step is otherwise mostly operator dispatch).

    The q/k/v and the gate/up codes, scales and shifts are concatenated along the output dimension (whole 16-row
    blocks of :func:`pack_w4`'s layout, so each output element's arithmetic is unchanged), and the seven
    :class:`Int4Linear` are re-pointed at views of the concatenated tensors: the layer's memory does not change and the
    per-linear path computes the same bits.

    Args:
        lins: linear name -> native :class:`Int4Linear`, all seven, one group size (see :meth:`applies`).

    Attributes:
        weights: 16 tensors, (codes, scale, shift, fp32 bias or an empty tensor) for qkv, o, gate_up and down.
        group: the group size.
    """

    __slots__ = ("weights", "group")

    def __init__(self, lins: dict[str, "Int4Linear"]):
        self.group = lins["q_proj"].group_size
        self.weights = (self._join([lins[n] for n in ("q_proj", "k_proj", "v_proj")]) + self._join([lins["o_proj"]])
                        + self._join([lins["gate_proj"], lins["up_proj"]]) + self._join([lins["down_proj"]]))

    @staticmethod
    def applies(lins: dict[str, object]) -> bool:
        """Whether these linears can run fused: all seven native :class:`Int4Linear` of one group size."""
        return (all(isinstance(f, Int4Linear) and f.native for f in lins.values()) and len(lins) == 7
                and "gate_proj" in lins
                and len({f.group_size for f in lins.values()}) == 1)

    @staticmethod
    def _join(parts: list["Int4Linear"]) -> list[torch.Tensor]:
        if len(parts) == 1:
            p = parts[0]
            return [p.packed, p.scale, p.shift, p.bias if p.bias is not None else torch.empty(0)]
        packed = _adjacent(p.packed for p in parts)
        if packed is None:  # not already back to back in one buffer (substitutes converted in place are)
            packed = torch.cat([p.packed for p in parts])
        scale = torch.cat([p.scale for p in parts])
        shift = torch.cat([p.shift for p in parts])
        if any(p.bias is not None for p in parts):  # an fp32 zero bias adds nothing to the fp32 accumulator
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.packed.shape[0] * 16) for p in parts])
        else:
            bias = torch.empty(0)
        off = 0
        for p in parts:
            nb = p.packed.shape[0]
            p.packed, p.scale, p.shift = packed[off:off + nb], scale[off:off + nb], shift[off:off + nb]
            if p.bias is not None:
                p.bias = bias[off * 16:(off + nb) * 16]
            off += nb
        return [packed, scale, shift, bias]


class DequantLinear:
    """A 2/3/8-bit substitute: dequantized through HQQ on every call, then a dense matmul.

    Args: codes, scale, zero (HQQ convention, see :func:`hqq_quantize`), bits, bias [out] | None, dtype, device.
    """

    def __init__(self, codes, scale, zero, bits: int, bias, dtype: torch.dtype, device):
        from hqq.core.quantize import Quantizer

        out_f, in_f = codes.shape
        g = in_f // scale.shape[1]
        self.W_q = Quantizer.pack[Quantizer.bit_to_packing[bits]](codes.reshape(-1, g).to(device))
        self.meta = {"nbits": bits, "group_size": g, "shape": (out_f, in_f), "axis": 1, "view_as_float": False,
                     "packing": Quantizer.bit_to_packing[bits], "compute_dtype": dtype,
                     "scale": scale.reshape(-1, 1).to(device=device, dtype=dtype),
                     "zero": zero.reshape(-1, 1).to(device=device, dtype=dtype)}
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from hqq.core.quantize import Quantizer

        return F.linear(x, Quantizer.dequantize(self.W_q, self.meta).to(x.dtype), self.bias)

    def densify(self, native: bool = True) -> "DenseLinear":
        """The same substitute as a dense linear over its dequantized weight [out, in] (no per-call dequantize)."""
        from hqq.core.quantize import Quantizer

        from .weights import DenseLinear

        return DenseLinear(Quantizer.dequantize(self.W_q, self.meta).contiguous(), self.bias, native)


def _adjacent(parts) -> torch.Tensor | None:
    """The concatenation along dim 0 of contiguous tensors that already lie back to back in one storage, as a view
    spanning them (no copy); None when they do not."""
    parts = list(parts)
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
               and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts):
        return None
    if any(b.data_ptr() != a.data_ptr() + a.numel() * a.element_size() for a, b in zip(parts, parts[1:])):
        return None
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())


def native_kernel(bits: int, group_size: int) -> bool:
    """True when substitutes of ``bits``/``group_size`` run on a native kernel (packed int4) or are dense (16)."""
    return bits == 16 or (bits == 4 and group_size in INT4_KERNEL_GROUPS)


SUBSTITUTE_FORMAT = "subspec-substitute/1"


def _layer_shapes(source) -> dict[str, tuple[int, int]]:
    from .layout import layer_layout

    layout = layer_layout(source.config, source.family, torch.float32)
    return {name: next(t.shape for t in layout.tensors if t.name == linear_prefix(name) + ".weight")
            for name in linear_names(source.config)}


def _metadata(source, spec: SubstituteSpec, i: int) -> dict[str, str]:
    return {"format": SUBSTITUTE_FORMAT, "source": source.key, "bits": str(spec.bits),
            "group_size": str(spec.group_size), "layer": str(i)}


def _entries(shapes: dict[str, tuple[int, int]], spec: SubstituteSpec) -> list[tuple[str, torch.dtype, tuple]]:
    """A layer's cached tensors in file order: every linear's codes first, back to back in the order the linears run
    (one read; q/k/v and gate/up end up adjacent, as :class:`FusedW4Layer` joins them), then scales and zeros.
    Files written in the earlier order (codes, scale, zero per linear) hold the same entries and read the same."""
    out = [(f"{name}.codes", torch.uint8, (o, n // _per_byte(spec.bits))) for name, (o, n) in shapes.items()]
    for name, (o, n) in shapes.items():
        out += [(f"{name}.scale", torch.float32, (o, n // spec.group_size)),
                (f"{name}.zero", torch.float32, (o, n // spec.group_size))]
    return out


def _read_layer(path: Path, meta: dict[str, str], entries) -> dict[str, torch.Tensor] | None:
    """The stored substitute of one layer, or None when missing; a damaged or foreign file is removed (notice)."""
    from .cache import remove_entry
    from .tensorfile import TensorFile, TensorFileError

    if not path.exists() and not path.is_symlink():
        return None
    try:
        f = TensorFile(path, direct=True)  # read once per start: past the page cache
    except TensorFileError as e:
        remove_entry(path, f"is damaged ({e})")
        return None
    except OSError as e:
        remove_entry(path, f"cannot be read ({e.strerror or e})")
        return None
    try:
        if f.metadata != meta:
            remove_entry(path, "was made from another model or with other settings")
            return None
        if {n: (f.dtype(n), f.shape(n)) for n in f.names} != {n: (d, tuple(s)) for n, d, s in entries}:
            remove_entry(path, "holds other tensors than this layer needs")
            return None
        codes = [n for n, _, _ in entries if n.endswith(".codes")]
        out = f.read_run(codes)  # one buffer where they are back to back (this version's order)
        out.update((n, f.read(n)) for n in f.names if n not in out)
        return out
    finally:
        f.close()


def _store(path: Path, entries, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    """Write one cached substitute entry (a safetensors file of ``entries`` with ``meta``) atomically."""
    from .cache import atomic_file
    from .tensorfile import TensorFileWriter

    with atomic_file(path) as tmp:
        with TensorFileWriter(tmp, entries, meta) as w:
            for name, t in tensors.items():
                w.write(name, t)


def quantize_layer(source, i: int, spec: SubstituteSpec, device) -> dict[str, torch.Tensor]:
    """HQQ-quantize layer ``i``'s linears: {name.codes (packed, :func:`pack_codes`), name.scale, name.zero}."""
    out = {}
    for name in linear_names(source.config):
        w = source.tensor(f"model.layers.{i}.{linear_prefix(name)}.weight")
        codes, scale, zero = hqq_quantize(w, spec.bits, spec.group_size, device)
        out[f"{name}.codes"], out[f"{name}.scale"], out[f"{name}.zero"] = pack_codes(codes, spec.bits), scale, zero
    return out


def substitutes_folder(key: str, spec: SubstituteSpec) -> Path:
    """Where the substitutes of the model of content ``key`` at ``spec`` live: ``layer-NNNNN.safetensors`` each."""
    return cache_root() / "substitutes" / f"{key}-b{spec.bits}-g{spec.group_size}"


def load_substitutes(source, layers: list[int], spec: SubstituteSpec, dtype: torch.dtype, device,
                     dense: bool = False, native: bool = True) -> dict[int, Linears]:
    """Substitutes for ``layers``, one layer at a time: read from the per-layer cache, or HQQ-quantized (then stored)
    where missing; 16 bits = the dense weights themselves ("self").

    ``native``: run 4-bit substitutes (and dense ones) on the native kernels where they apply.
    ``dense=True`` keeps substitutes that have no native kernel (:class:`DequantLinear`) as their dequantized
    weights in ``dtype`` (same values, dense speed and memory: for tau studies).

    Returns:
        layer index -> :class:`Linears` of :class:`Int4Linear` (4-bit with a group in :data:`INT4_KERNEL_GROUPS`)
        or :class:`DequantLinear` (other bits and groups).

    Raises:
        SubspecError: the checkpoint cannot be read, or the cache cannot be written.
    """
    from .cache import cache_dir
    from .process import release_freed_heap

    if spec.bits == 16:  # the "self" upper bound: the draft is the full-precision target
        from .model import load_linears

        return {i: load_linears(source, i, dtype, device, native) for i in layers}
    if not layers:
        return {}
    folder = cache_dir(substitutes_folder(source.key, spec))
    entries = _entries(_layer_shapes(source), spec)
    out: dict[int, Linears] = {}
    paths = {i: folder / f"layer-{i:05d}.safetensors" for i in layers}
    # what the cache holds (validated headers) is read first, so the bar below shows real work; the next layer's
    # file is read (preadv, without the GIL) while this one is converted to the kernel's layout
    from concurrent.futures import ThreadPoolExecutor

    def read(i: int):
        return _read_layer(paths[i], _metadata(source, spec, i), entries)

    with ThreadPoolExecutor(1, thread_name_prefix="subspec-read") as pool:
        pending = pool.submit(read, layers[0])
        for k, i in enumerate(layers):
            stored = pending.result()
            if k + 1 < len(layers):
                pending = pool.submit(read, layers[k + 1])
            if stored is not None:
                out[i] = _linears(source, i, stored, spec, dtype, device, dense, native)
            del stored
    todo = [i for i in layers if i not in out]
    for i in progress_bar("substitutes", todo, desc=f"quantizing substitutes ({spec.bits}-bit, group {spec.group_size})",
                          unit="layer", disable=not todo):
        q = quantize_layer(source, i, spec, device)
        _store(paths[i], entries, _metadata(source, spec, i), q)
        out[i] = _linears(source, i, q, spec, dtype, device, dense, native)
        del q
        release_freed_heap()  # HQQ's float32 temporaries: freed memory kept by the allocator counts against the budget
    return {i: out[i] for i in layers}


def _linears(source, i: int, stored: dict[str, torch.Tensor], spec: SubstituteSpec, dtype, device,
             dense: bool, native: bool) -> Linears:
    """Executable substitutes of layer ``i`` from its stored (packed) codes, scales and zeros."""
    fns = {}
    for name in linear_names(source.config):
        codes = stored[f"{name}.codes"]  # packed two a byte for 4 bits (:func:`pack_codes`)
        scale, zero = stored[f"{name}.scale"], stored[f"{name}.zero"]
        bname = f"model.layers.{i}.{linear_prefix(name)}.bias"
        bias = source.tensor(bname) if source.has(bname) else None
        if native_kernel(spec.bits, spec.group_size):
            fns[name] = Int4Linear(codes, scale, zero, spec.group_size, bias, dtype, device, native, nibbles=True,
                                   consume=True)  # read for this: converted in place
        else:
            fns[name] = DequantLinear(unpack_codes(codes, spec.bits), scale, zero, spec.bits, bias, dtype, device)
            if dense:
                fns[name] = fns[name].densify(native)
    return Linears(fns, fused=FusedW4Layer(fns) if FusedW4Layer.applies(fns) else None)


def load_draft_head(source, lm_head: torch.Tensor, rows: int, spec: SubstituteSpec) -> tuple:
    """A 4-bit copy of the lm_head's first ``rows`` rows (the draft's vocabulary subset), HQQ-quantized like the
    substitutes and cached next to them (``draft-head-<rows>.safetensors``), for :class:`~subspec.speculation.DraftHead`.

    Args:
        source: the checkpoint (its key names the cache entry). lm_head: [V, hidden] (the model's, any float dtype).
        rows: rows kept (a multiple of 16). spec: bits (4) and group size.

    Returns:
        (codes [rows, hidden / 2] uint8, two a byte as :func:`pack_codes` stores them (as read: the kernel packs
        them without an unpacked copy), scale, zero [rows, hidden / group] float32, group size).

    Raises:
        SubspecError: the cache cannot be written.
    """
    from .cache import cache_dir

    hidden = lm_head.shape[1]
    folder = cache_dir(substitutes_folder(source.key, spec))
    path = folder / f"draft-head-{rows}.safetensors"
    meta = {"format": SUBSTITUTE_FORMAT, "source": source.key, "bits": str(spec.bits),
            "group_size": str(spec.group_size), "draft_head_rows": str(rows)}
    entries = [("codes", torch.uint8, (rows, hidden // _per_byte(spec.bits))),
               ("scale", torch.float32, (rows, hidden // spec.group_size)),
               ("zero", torch.float32, (rows, hidden // spec.group_size))]
    stored = _read_layer(path, meta, entries)
    if stored is None:
        codes, scale, zero = hqq_quantize(lm_head[:rows], spec.bits, spec.group_size)
        stored = {"codes": pack_codes(codes, spec.bits), "scale": scale, "zero": zero}
        _store(path, entries, meta, stored)
    return stored["codes"], stored["scale"], stored["zero"], spec.group_size
