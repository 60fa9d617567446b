"""A lean GGUF reader: metadata as plain Python values, tensors as memory-mapped numpy views.

gguf.GGUFReader makes one numpy view per array element; for a 49K-token vocabulary that is
~100K small arrays (2.8 s and +160 MiB resident while loading). Here string arrays become one
Python list and numeric arrays one numpy view, so opening the default model takes ~0.1 s.
Tensor views have the shapes GGUFReader gives (Weight.from_gguf relies on them).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import SparrowError

# GGUF value types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 4  # arrays of arrays: llama.cpp writes none; a corrupt file could nest them without end
_MAX_ALIGN = 1 << 16
# ggml tensor types stored as plain numbers (others are blocks of bytes)
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped view, rows first


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            size = len(self.buf)
            raise SparrowError(f"GGUF file is truncated: {n} bytes needed at offset {self.pos}, file has {size}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def count(self, n: int, least: int, what: str) -> int:
        """A count read from the file, checked against the bytes left (each item takes `least` or
        more) before anything is allocated or looped over for it."""
        left = len(self.buf) - self.pos
        if n * least > left:
            raise SparrowError(f"GGUF file is truncated or corrupt: {what} claims {n} items, {left} bytes are left")
        return n

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(self.count(n, 8, "a string array"))]
            if etype in _NP:
                size = np.dtype(_NP[etype]).itemsize * n
                return np.frombuffer(self.take(size), dtype=_NP[etype])
            if etype != _ARRAY:
                raise SparrowError(f"GGUF metadata has an array of unknown value type {etype}")
            if depth >= _MAX_NESTING:
                raise SparrowError(f"GGUF metadata nests arrays more than {_MAX_NESTING} deep")
            return [self.value(etype, depth + 1) for _ in range(self.count(n, 12, "an array of arrays"))]
        raise SparrowError(f"GGUF metadata has unknown value type {vtype}")


class GGUFFile:
    def __init__(self, path: str):
        import gguf

        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        # the header through a memoryview: slicing the memmap itself makes a numpy object per
        # slice, ~20 us each, 9 s for a Qwen3 vocabulary's 300K strings and merges
        cur = _Cursor(memoryview(self._mm))
        if bytes(cur.take(4)) != b"GGUF":
            raise SparrowError("not a GGUF file")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise SparrowError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise SparrowError(f"corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
        cur.count(n_kv, 12, "the header's key count")  # key length + value type, at least
        self.meta: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            self.meta[key] = cur.value(cur.scalar("<I"))
        cur.count(n_tensors, 24, "the header's tensor count")  # name length, n_dims, type, offset
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise SparrowError(f"corrupt GGUF tensor info for {name!r:.60}: {n_dims} dimensions")
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = self.meta.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= _MAX_ALIGN or align & (align - 1):
            raise SparrowError(f"corrupt GGUF header: general.alignment is {align!r}, not a power of two"[:200])
        start = -(-cur.pos // align) * align
        self.tensors = []
        for name, dims, ttype, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(ttype)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise SparrowError(f"tensor {name!r:.60} has unknown ggml type {ttype}") from None
            n = math.prod(dims)  # Python ints: np.prod would wrap around on corrupt sizes
            if dims and dims[0] % block:
                raise SparrowError(f"corrupt GGUF tensor info for {name!r:.60}: rows of {dims[0]} are not whole blocks")
            nbytes = n // block * type_size
            a = start + offset
            if a + nbytes > len(self._mm):
                raise SparrowError(f"GGUF file is truncated: tensor {name!r:.60} ends past the end of the file")
            raw = self._mm[a : a + nbytes]
            rows = tuple(reversed(dims[1:]))
            if ttype in _PLAIN:
                data = raw.view(_PLAIN[ttype]).reshape(rows + (dims[0],))
            else:
                data = raw.reshape(rows + (dims[0] // block * type_size,))
            self.tensors.append(GGUFTensor(name, dims, qtype, data))
