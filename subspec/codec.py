"""Offloaded layers coded losslessly against their 4-bit substitutes: the disk tier reads about 40 % fewer bytes.

A target forward reads every offloaded layer's BF16 weights from disk, and the draft already holds each of those
weights as a 4-bit substitute in memory. The substitute predicts most of a weight's bits, so the file stores only
what it does not: per weight, the difference of the weight's BF16 bits and the prediction's in the order-preserving
integer view of BF16, in one byte when it is small, else an escape and the weight's 16 bits
(the kernel tiers' ``w4_delta_encode`` / ``w4_delta_decode``, format in ``kernels/csrc/common.h``). Decoding
gives back the same bits, always: the verification, and so the output, do not change. On qwen2.5-coder-1.5b's
layers (4-bit, group 64) a weight takes 9.2 bits instead of 16 (92.7 % of them in one byte).

A coded layer file (:mod:`subspec.layerfile`): a JSON header, 4 KiB or a multiple (what it was made from, the CRC-32 of the
substitute it was coded against, its sections and a CRC-32 of each), then the stream padded to 4 KiB. The disk tier
reads the stream into a staging slot of the stream's size (about 60 % of a layer, so coding buys more slots: more
read-ahead while the draft runs) and keeps it coded there: each linear of the forward is a :class:`CodedLinear`, whose
native ``linear_coded`` decodes the weight's 16-row blocks into a buffer in L2 as it multiplies (the bits of
``linear_bf16`` over the decoded weight), so the decoding runs on the compute threads, never written out whole.
Before a file is written its stream is decoded once in place in a slot-shaped buffer (:func:`decode_layer`: the stream
at the buffer's end, the output growing behind the input not yet read) and compared bit for bit. A layer whose stream
would not round-trip is not stored coded (it stays in the plain packed format; it is tried again at the next start).
The disk tier checks each section's CRC-32 before the layer is used: a flipped byte on disk is an error of that
layer naming the file (which is removed and rebuilt at the next start), never different weights.

Applies to offloaded layers whose substitutes (every linear of the layer) run on the native 4-bit kernel
(:class:`~subspec.quant.Int4Linear` with ``native``); other layers (and plain offloading, which has no substitutes) keep :func:`~subspec.tiers.packed_layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import layerfile
from .cache import cache_dir, cache_root, check_free_space
from .families import linear_of
from .layout import ALIGN, LayerLayout, _round_up
from .progress import bar as progress_bar
from .weights import Linears

CODED_FORMAT = "subspec-coded-layer/2"
CODED_RATIO = 0.58
"""Coded bytes per raw byte that planning assumes before the files exist (measured, 4-bit group-64 substitutes:
qwen2.5-coder-1.5b 0.573, SmolLM2-135M 0.564)."""


SLOT_RATIO = 0.60
"""Bytes of a staging slot that holds coded streams, per raw byte of a layer, that planning assumes before the files
exist: a little above the largest stream of a model's layers (qwen2.5-coder-1.5b: 0.564-0.580 of a layer). The disk
tier sizes its slots by the real streams."""


def slot_bytes(extent: int) -> int:
    """Planned bytes of a staging slot for coded streams of layers of ``extent`` bytes (4 KiB-aligned)."""
    return _round_up(int(SLOT_RATIO * extent), ALIGN)


@dataclass(frozen=True)
class Section:
    """One tensor of a coded layer: ``name`` (layout tensor), ``linear`` (the substitute it is coded against, or None:
    stored raw), its place in the slot (``out_offset``, ``out_bytes``) and in the stream (``in_offset``, ``in_bytes``)."""

    name: str
    linear: str | None
    out_offset: int
    out_bytes: int
    in_offset: int
    in_bytes: int


@dataclass(frozen=True)
class CodedLayer:
    """A coded layer file: ``path``, ``stream_bytes`` (the stream padded to 4 KiB: what a read moves) and its sections.
    The disk tier reads the stream into a staging slot and multiplies it there (:func:`coded_linears`)."""

    path: Path
    stream_bytes: int
    sections: tuple[Section, ...]


def codable(lins: Linears | None) -> bool:
    """Whether a layer's substitutes can code it: every linear a native 4-bit :class:`~subspec.quant.Int4Linear`."""
    from .quant import Int4Linear

    return lins is not None and all(isinstance(f, Int4Linear) and f.native for _, f in lins.items())


def substitute_crc(lins: Linears) -> str:
    """CRC-32 (hex) of the layer's substitutes' codes, scales and shifts: a coded file decodes right only against the
    exact substitute it was coded with."""
    crc = 0
    for _, f in lins.items():
        for t in (f.packed, f.scale, f.shift):  # ISA-L's CRC-32 where installed (layerfile): zlib's values, faster
            crc = layerfile.crc32(t.contiguous().view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"


def encode_layer(buf: torch.Tensor, layout: LayerLayout, lins: Linears) -> tuple[torch.Tensor, tuple[Section, ...]]:
    """Code one layer. ``buf``: the layer's raw extent (uint8, :func:`~subspec.layerfile.fill_layer`); ``lins``: its
    substitutes (:func:`codable`). Returns (the stream, uint8, unpadded; its sections in slot order)."""
    views = layout.views(buf)
    parts, sections, at = [], [], 0
    for t in sorted(layout.tensors, key=lambda t: t.offset):
        v = views[t.name]
        out_bytes = v.numel() * v.element_size()
        name = linear_of(t.name)
        if name is not None and v.dtype == torch.bfloat16:
            f = lins[name]
            part = f.ops.w4_delta_encode(v.contiguous(), f.packed, f.scale, f.shift, f.group_size)
        else:
            name, part = None, v.contiguous().view(torch.uint8).reshape(-1).clone()
        sections.append(Section(t.name, name, t.offset, out_bytes, at, part.numel()))
        parts.append(part)
        at += part.numel()
    return torch.cat(parts), tuple(sections)


def decode_layer(slot: torch.Tensor, extent: int, coded: CodedLayer, lins: Linears) -> None:
    """Decode a coded layer in place: ``slot`` (uint8, >= ``extent`` bytes) holds the stream at ``extent -
    coded.stream_bytes``; afterwards its first ``extent`` bytes are the layer in the packed layout.

    Runs on one thread (the disk tier's decoder thread) and releases the GIL inside each operator.

    Raises:
        RuntimeError: the stream is damaged (the operator names what it found).
    """
    base = extent - coded.stream_bytes
    for s in coded.sections:
        src = slot[base + s.in_offset:base + s.in_offset + s.in_bytes]
        out = slot[s.out_offset:s.out_offset + s.out_bytes]
        if s.linear is None:
            out.copy_(src.clone())  # small (biases); the two ranges may overlap
            continue
        f = lins[s.linear]
        n, k = f.packed.shape[0] * 16, f.packed.shape[1] * f.packed.shape[2] * 8
        used = f.ops.w4_delta_decode(src, f.packed, f.scale, f.shift, f.group_size, out.view(torch.bfloat16).view(n, k))
        if used != s.in_bytes:
            raise RuntimeError(f"coded section {s.name}: {used} bytes decoded, {s.in_bytes} stored")


class CodedLinear:
    """``y = x @ W.T + b`` for a weight held as its coded stream (in a staging slot) against its 4-bit substitute: the
    native ``linear_coded`` decodes the weight's rows block by block as it multiplies (never written out whole), with
    exactly the bits ``linear_bf16`` gives over the decoded weight (batch-invariant).

    Args:
        stream: [bytes] uint8, the weight's section of the stream. offsets: [N/16 + 1] int64, its block offsets
            (``w4_delta_index``). sub: the substitute (:class:`~subspec.quant.Int4Linear`, native) it was coded
            against. bias: [N] or None (a raw section of the same stream).
    """

    __slots__ = ("stream", "offsets", "sub", "bias", "op")

    def __init__(self, stream: torch.Tensor, offsets: torch.Tensor, sub, bias: torch.Tensor | None):
        self.stream, self.offsets, self.sub, self.bias = stream, offsets, sub, bias
        self.op = sub.ops.linear_coded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] bf16 -> [T, out_features] bf16."""
        f = self.sub
        return self.op(x, self.stream, self.offsets, f.packed, f.scale, f.shift, f.group_size, self.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in] decoded (a new tensor: for checks; a forward never makes it)."""
        f = self.sub
        n, k = f.packed.shape[0] * 16, f.packed.shape[1] * f.packed.shape[2] * 8
        out = torch.empty(n, k, dtype=torch.bfloat16)
        f.ops.w4_delta_decode(self.stream, f.packed, f.scale, f.shift, f.group_size, out)
        return out


def index_layer(stream: torch.Tensor, coded: CodedLayer, lins: Linears) -> dict[str, torch.Tensor]:
    """The block offsets (``w4_delta_index``) of every coded section of a layer's ``stream`` (uint8, from its first
    byte), by linear name. Runs on the disk tier's checker thread (the GIL released inside each operator).

    Raises:
        RuntimeError: a section's stream is shorter than its blocks (damaged; the operator says so).
    """
    index = {}
    for s in coded.sections:
        if s.linear is not None:
            f = lins[s.linear]
            n, k = f.packed.shape[0] * 16, f.packed.shape[1] * f.packed.shape[2] * 8
            index[s.linear] = f.ops.w4_delta_index(stream[s.in_offset:s.in_offset + s.in_bytes], n, k)
            if int(index[s.linear][-1]) != s.in_bytes:
                raise RuntimeError(f"coded section {s.name}: {int(index[s.linear][-1])} bytes of blocks, "
                                   f"{s.in_bytes} stored")
    return index


def coded_linears(stream: torch.Tensor, coded: CodedLayer, lins: Linears, index: dict[str, torch.Tensor],
                  dtype: torch.dtype) -> Linears:
    """The :class:`~subspec.weights.Linears` of a coded layer held as its ``stream`` (uint8, in a staging slot):
    :class:`CodedLinear` over each coded section with its ``index`` (:func:`index_layer`), biases as ``dtype`` views
    of their raw sections."""
    raw = {s.name: stream[s.in_offset:s.in_offset + s.in_bytes].view(dtype) for s in coded.sections if s.linear is None}
    fns = {}
    for s in coded.sections:
        if s.linear is not None:
            sec = stream[s.in_offset:s.in_offset + s.in_bytes]
            fns[s.linear] = CodedLinear(sec, index[s.linear], lins[s.linear], raw.get(s.name[:-len("weight")] + "bias"))
    return Linears(fns)


def _expect(source, layout: LayerLayout, i: int, crc: str) -> dict:
    """What the coded file of layer ``i`` must have been made from (its header's fields)."""
    return {"format": CODED_FORMAT, "source": source.key, "layer": i, "dtype": str(layout.dtype),
            "extent": layout.extent, "tensors": [[t.name, list(t.shape), t.offset] for t in layout.tensors],
            "substitute_crc": crc}


def _sections_fit(layout: LayerLayout, stream: int, sections: tuple[Section, ...]) -> bool:
    """Whether stored sections describe this layout: every tensor once, at its offset and size, coded only against the
    linear of its own weight, the stream contiguous and shorter than the slot, 4 KiB-aligned for O_DIRECT."""
    want = {t.name: (t.offset, n) for t, n in zip(layout.tensors, layout.sizes())}
    at = 0
    for s in sections:
        if want.pop(s.name, None) != (s.out_offset, s.out_bytes) or s.in_offset != at or s.in_bytes <= 0:
            return False
        if s.linear is not None and linear_of(s.name) != s.linear:
            return False
        at += s.in_bytes
    return not want and 0 < stream < layout.extent and stream % ALIGN == 0 and at <= stream


def _accept(layout: LayerLayout):
    """The check of a coded file's own fields (after :func:`subspec.layerfile.check`): its sections describe this
    layout; returns the :class:`CodedLayer`, or what is wrong."""
    def accept(i: int, path: Path, head: dict):
        try:
            stream = int(head["stream_bytes"])
            sections = tuple(Section(str(a), b, int(c), int(d), int(e), int(g)) for a, b, c, d, e, g in head["coded"])
        except (KeyError, TypeError, ValueError):
            return "is not a coded layer"
        if stream != head["payload_bytes"] or not _sections_fit(layout, stream, sections):
            return "does not describe this layer's layout"
        return CodedLayer(path, stream, sections)
    return accept


def coded_folder(key: str, dtype: torch.dtype) -> Path:
    """Where the coded layer files of the model of content ``key`` in ``dtype`` live (:func:`layerfile.file_name`)."""
    return cache_root() / "coded" / f"{key}-{str(dtype).replace('torch.', '')}"


def coded_layers(source, layout: LayerLayout, layers: list[int], subs: dict[int, Linears]) -> dict[int, CodedLayer]:
    """Coded files of the ``layers`` whose substitutes can code them (:func:`codable`), built where missing.

    Files live in ``coded/<source key>-<dtype>/layer-NNNNN.bin``, each written atomically after a check that it
    decodes in place to the layer's exact bits; a layer whose check fails (or whose stream would not be smaller) is
    left out (the caller packs it plainly). A file made against another substitute is rebuilt with a notice.

    Returns:
        layer index -> :class:`CodedLayer`, for the layers coded.

    Raises:
        SubspecError: the checkpoint cannot be read, or the cache cannot be written.
    """
    if layout.dtype != torch.bfloat16 or layout.experts:  # the coding is of BF16 bits; experts stream packed, by
        return {}                                              # expert (subspec.tiers.DiskTier)
    todo = [i for i in layers if codable(subs.get(i))]
    if not todo:
        return {}
    folder = cache_dir(coded_folder(source.key, layout.dtype))
    crcs = {i: substitute_crc(subs[i]) for i in todo}
    out, build = layerfile.scan(folder, todo, lambda i: _expect(source, layout, i, crcs[i]), _accept(layout))
    if build:
        check_free_space(folder, int(len(build) * (CODED_RATIO * layout.extent + layerfile.HEADER_BYTES)),
                         f"{len(build)} coded layers of the disk tier")
        buf = torch.zeros(layout.extent, dtype=torch.uint8)
        slot = torch.zeros(layout.extent, dtype=torch.uint8)
        for i in progress_bar("coding", build, desc="coding offloaded layers against their substitutes", unit="layer"):
            path = folder / layerfile.file_name(i)
            buf.zero_()
            layerfile.fill_layer(source, i, layout, buf)
            stream, sections = encode_layer(buf, layout, subs[i])
            padded = _round_up(stream.numel(), ALIGN)
            if padded >= layout.extent:
                continue
            coded = CodedLayer(path, padded, sections)
            slot.zero_()
            slot[layout.extent - padded:layout.extent - padded + stream.numel()] = stream
            try:
                decode_layer(slot, layout.extent, coded, subs[i])
                exact = all(torch.equal(slot[s.out_offset:s.out_offset + s.out_bytes],
                                        buf[s.out_offset:s.out_offset + s.out_bytes]) for s in sections)
            except RuntimeError:
                exact = False
            if not exact:
                continue
            head = dict(_expect(source, layout, i, crcs[i]), stream_bytes=padded,
                        coded=[[s.name, s.linear, s.out_offset, s.out_bytes, s.in_offset, s.in_bytes] for s in sections])
            data = stream.numpy()
            sums = layerfile.checksums(data, [(s.name, s.in_offset, s.in_bytes) for s in sections])
            layerfile.write(path, head, data, sums)
            out[i] = coded
    return {i: out[i] for i in layers if i in out}
