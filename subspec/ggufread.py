"""A :class:`gguf.GGUFReader` that parses a GGUF's metadata arrays in bulk: the same fields, parts and types.

``gguf.GGUFReader`` parses an array field element by element, recursively, each element a view of the file's
``numpy.memmap`` (several microseconds each, in Python): a tokenizer of 262,144 tokens (Gemma 3: its tokens, scores
and token types, 786k elements) took 57 s to open on a 2-core AMD EPYC (Zen 1), Qwen2.5's 151,936 tokens and
151,387 merges 5-15 s. Every array of scalars here is one view of the file, sliced per element, and an array of
strings is scanned once for its lengths; each element's parts are views of a plain ``numpy.ndarray`` over the
mapping (cheap to slice, and to read for transformers' ``_gguf_parse_value``, which runs on every field at every
``load_gguf_checkpoint``). Fields of any other shape (nested arrays, a file of the other byte order) are parsed by the
original code. ``tests/test_convert.py`` checks every field of real GGUFs equal to the original reader's.
"""
from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFValueType
from gguf.gguf_reader import GGUFReader  # the module's name: one_reader may have replaced the package's


class FastGGUFReader(GGUFReader):
    """``gguf.GGUFReader`` (same constructor, fields, tensors and errors) with array fields parsed in bulk."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        flat = np.asarray(self.data)  # the uint8 mapping as a plain ndarray (no copy): slices skip memmap's hooks
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
        if n == 0 or (itype not in self.gguf_scalar_to_np and itype != GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list = [raw_itype, alen]
        if itype == GGUFValueType.STRING:
            if offs + 8 * n > len(flat):
                raise ValueError("GGUF string array runs past the end of the file")
            u64, view, unpack = np.dtype(np.uint64), memoryview(flat), struct.Struct("=Q").unpack_from  # host order
            for _ in range(n):
                length = unpack(view, offs)[0] if offs + 8 <= len(flat) else len(flat)
                if offs + 8 + length > len(flat):
                    raise ValueError("GGUF string runs past the end of the file")
                parts.append(flat[offs:offs + 8].view(u64))
                parts.append(flat[offs + 8:offs + 8 + length])
                offs += 8 + length
            data = list(range(3, 2 + 2 * n, 2))
        else:
            dtype = np.dtype(self.gguf_scalar_to_np[GGUFValueType(itype)])
            end = offs + dtype.itemsize * n
            if end > len(flat):
                raise ValueError("GGUF array runs past the end of the file")
            values = flat[offs:end].view(dtype)
            parts += [values[i:i + 1] for i in range(n)]
            data = list(range(2, 2 + n))
            offs = end
        return offs - orig_offs, parts, data, [GGUFValueType.ARRAY, GGUFValueType(itype)]
