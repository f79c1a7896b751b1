"""Substitutes: low-bit copies of an offloaded layer's linears, made data-free with HQQ (design.md §3.3).

Quantization uses the ``hqq`` package (``Quantizer.quantize``, axis 1: groups of ``group_size`` consecutive input
features, dequantized as ``W = (W_q - zero) * scale``). 4-bit substitutes run on torch's native packed-int4 kernels
(CPU ``_weight_int4pack_mm_for_cpu``, CUDA ``_weight_int4pack_mm``), whose dequantization is
``W = (q - 8) * s + z``; HQQ's triple converts exactly with ``s = scale``, ``z = (8 - zero) * scale``.
Other bit widths run through HQQ's own ``Quantizer.dequantize``. Results are cached per model, bits, group size
and dtype (:func:`load_substitutes`), written atomically, so a second start skips quantization.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .cache import atomic_file, cache_root
from .families import LINEAR_NAMES, linear_prefix
from .placement import SubstituteSpec
from .weights import DenseLinear, Linears


INT4_KERNEL_GROUPS = (32, 64, 128, 256)
"""Group sizes torch's packed-int4 kernels accept; other 4-bit groups run through HQQ's dequantizing path."""


def hqq_quantize(w: torch.Tensor, bits: int, group_size: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HQQ-quantize a weight (data-free, axis 1).

    Args:
        w: [out, in] float weight. bits: 2, 3, 4 or 8. group_size: must divide ``in``. device: where HQQ's
            optimization runs (a GPU makes it much faster); results come back on the CPU.

    Returns:
        (codes [out, in] uint8 in 0..2^bits-1, scale [out, in/group] float32, zero [out, in/group] float32), with
        ``w ≈ (codes - zero) * scale`` per group.
    """
    from hqq.core.quantize import Quantizer

    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"group size {group_size} does not divide {in_f} input features")
    w = w.to(device)
    codes, meta = Quantizer.quantize(w.float(), nbits=bits, group_size=group_size, axis=1, optimize=True,
                                     bitpack=False, compute_dtype=torch.float32, device=str(w.device))
    g = in_f // group_size
    return (codes.reshape(out_f, in_f).to(torch.uint8).cpu(), meta["scale"].float().reshape(out_f, g).cpu(),
            meta["zero"].float().reshape(out_f, g).cpu())


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """HQQ's dequantization ``(codes - zero) * scale`` per group; returns [out, in] float32 (the reference)."""
    out_f, in_f = codes.shape
    g = in_f // scale.shape[1]
    return ((codes.float().view(out_f, -1, g) - zero[..., None]) * scale[..., None]).view(out_f, in_f)


class Int4Linear:
    """A 4-bit substitute linear.

    On a CPU with AMX it runs on ``torch.ops.subspec.linear_w4``: each 16 x 32 weight tile is de-quantized to BF16
    once (``w = codes * scale + shift`` with ``shift = -zero * scale``, HQQ's ``(codes - zero) * scale``) and used for
    every row, so a k-row draft step costs about what one row costs. Elsewhere it runs on torch's packed-int4 kernels
    (CPU ``_weight_int4pack_mm_for_cpu``, CUDA ``_weight_int4pack_mm``, tinygemm layout), whose de-quantization is
    ``(q - 8) * s + z``, exactly HQQ's with ``s = scale``, ``z = (8 - zero) * scale``.

    Args:
        codes: [out, in] uint8 in 0..15; scale, zero: [out, in/group] (HQQ convention); group_size; bias: [out] or
            None; dtype: activation dtype; device; native: use the native kernel where it applies.
    """

    __slots__ = ("packed", "scales_zeros", "group_size", "bias", "kernel_dtype", "cuda", "native", "scale", "shift")

    def __init__(self, codes, scale, zero, group_size: int, bias, dtype: torch.dtype, device, native: bool = True):
        from . import kernels

        device = torch.device(device)
        out_f, in_f = codes.shape
        self.cuda = device.type == "cuda"
        # BF16 activations always: the torch kernels' float32 path is a slow reference (7-60x slower on CPU); the
        # draft only needs to be accurate, the target decides every emitted token.
        self.kernel_dtype = torch.bfloat16
        self.group_size = group_size
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.native = (native and device.type == "cpu" and group_size % 32 == 0 and kernels.linear_fits(out_f, in_f)
                       and kernels.native())
        self.scales_zeros = self.scale = self.shift = None
        if self.native:
            g = in_f // group_size

            def tiled(t: torch.Tensor) -> torch.Tensor:  # [out, g] -> [out/16, g, 16] bf16
                return t.float().view(out_f // 16, 16, g).transpose(1, 2).contiguous().to(torch.bfloat16)

            self.packed = torch.ops.subspec.pack_w4(codes.to(torch.uint8))
            self.scale, self.shift = tiled(scale), tiled(-zero.float() * scale.float())
            return
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
            y = torch.ops.subspec.linear_w4(xk, self.packed, self.scale, self.shift, self.group_size, None)
        elif self.cuda:
            y = torch.ops.aten._weight_int4pack_mm(xk, self.packed, self.group_size, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.packed, self.group_size, self.scales_zeros)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


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


def native_kernel(bits: int, group_size: int) -> bool:
    """True when substitutes of ``bits``/``group_size`` run on a native kernel (packed int4) or are dense (16)."""
    return bits == 16 or (bits == 4 and group_size in INT4_KERNEL_GROUPS)


def _cache_path(source, spec: SubstituteSpec) -> Path:
    return cache_root() / "substitutes" / f"{source.key}-b{spec.bits}-g{spec.group_size}.safetensors"


def load_substitutes(source, layers: list[int], spec: SubstituteSpec, dtype: torch.dtype, device,
                     dense: bool = False, native: bool = True) -> dict[int, Linears]:
    """Substitutes for ``layers``: HQQ-quantized once (progress bar) and cached; 16 bits = the dense weights ("self").

    ``native``: run 4-bit substitutes (and dense ones) on the native kernels where they apply.
    ``dense=True`` keeps substitutes that have no native kernel (:class:`DequantLinear`) as their dequantized
    weights in ``dtype`` (same values, dense speed and memory: for tau studies).

    Returns:
        layer index -> :class:`Linears` of :class:`Int4Linear` (4-bit with a group in :data:`INT4_KERNEL_GROUPS`)
        or :class:`DequantLinear` (other bits and groups).
    """
    from safetensors.torch import load_file, save_file

    if spec.bits == 16:  # the "self" upper bound: the draft is the full-precision target
        from .model import load_linears

        return {i: load_linears(source, i, dtype, device, native) for i in layers}
    path = _cache_path(source, spec)
    stored: dict[str, torch.Tensor] = load_file(str(path)) if path.is_file() else {}
    missing = [i for i in layers if f"{i}.q_proj.codes" not in stored]
    if missing:
        for i in tqdm(missing, desc=f"quantizing substitutes ({spec.bits}-bit, group {spec.group_size})", unit="layer"):
            for name in LINEAR_NAMES:
                w = source.tensor(f"model.layers.{i}.{linear_prefix(name)}.weight")
                codes, scale, zero = hqq_quantize(w, spec.bits, spec.group_size, device)
                stored[f"{i}.{name}.codes"] = codes
                stored[f"{i}.{name}.scale"] = scale
                stored[f"{i}.{name}.zero"] = zero
        with atomic_file(path) as tmp:
            save_file(stored, str(tmp))
    out = {}
    for i in layers:
        fns = {}
        for name in LINEAR_NAMES:
            codes, scale, zero = (stored[f"{i}.{name}.{k}"] for k in ("codes", "scale", "zero"))
            bname = f"model.layers.{i}.{linear_prefix(name)}.bias"
            bias = source.tensor(bname) if source.has(bname) else None
            if native_kernel(spec.bits, spec.group_size):
                fns[name] = Int4Linear(codes, scale, zero, spec.group_size, bias, dtype, device, native)
            else:
                fns[name] = DequantLinear(codes, scale, zero, spec.bits, bias, dtype, device)
                if dense:
                    fns[name] = fns[name].densify(native)
        out[i] = Linears(**fns)
    return out
