"""Weight matrices kept in their stored (possibly quantised) form.

A Weight is a 2-D matrix [out, in] used as y = x @ W.T. Quantised formats keep the raw
GGUF/ggml block bytes as a read-only uint8 array [out, nblocks * blockbytes], usually a view
of the model file's mmap, so resident memory stays close to the file size. Blocks of 32:
  q8_0: f16 d, 32 x int8 q                 (34 B)  value = q * d
  q4_0: f16 d, 16 B nibbles                (18 B)  value = (q - 8) * d
  q4_1: f16 d, f16 m, 16 B nibbles         (20 B)  value = q * d + m
  q5_0: f16 d, u32 qh, 16 B nibbles        (22 B)  value = (q - 16) * d
  q5_1: f16 d, f16 m, u32 qh, 16 B nibbles (24 B)  value = q * d + m
Nibble byte j holds element j (low 4 bits) and element 16 + j (high 4 bits); q5's fifth
bit of element i is bit i of qh (little-endian). Super-blocks of 256 (ggml's K-quants), each
eight sub-blocks of 32 (q6_k: sixteen of 16) with their own scales:
  q4_k: f16 d, f16 dmin, 12 B scales, 128 B nibbles         (144 B)
  q5_k: f16 d, f16 dmin, 12 B scales, 32 B qh, 128 B nibbles (176 B)
        value = (d * sc[s]) * q - dmin * m[s], sc / m 6-bit (ggml's get_scale_min_k4);
        nibble byte 32 c + l holds elements 64 c + l (low) and 64 c + 32 + l (high);
        q5_k's fifth bit of sub-block s, element l is bit s of qh[l]
  q6_k: 128 B ql, 64 B qh, 16 x int8 sc, f16 d               (210 B)
        value = (d * sc[e // 16]) * (q - 32), q = 4 bits of ql | 2 bits of qh << 4
f16 / bf16 are kept as uint16 [out, in], f32 as float32 [out, in]. Each format's block size and
bytes live in the format table (sparrow.kernels.formats), read from there.

The numpy dequantisation here is the reference (bit-identical to gguf.quants.dequantize);
the fast kernels live in sparrow.kernels.linear.
"""

import functools

import numpy as np

from sparrow.errors import SparrowError
from sparrow.kernels.formats import BLOCK_BYTES, BLOCK_VALUES, BY_NAME

QTYPES = tuple(BY_NAME)  # every format a Weight holds: those of the format table
QUANTIZE_TO = ("q8_0", "q4_0", "q4_1")  # what Weight.quantize writes (quantize_blocks)
BLOCK = BLOCK_VALUES["q8_0"]  # values a block of each of them
assert all(BLOCK_VALUES[q] == BLOCK for q in QUANTIZE_TO)
_NATIVE_GGUF = {q.upper(): q for q in QTYPES}  # GGUF tensor type name -> the format kept as stored
_ROW_CHUNK = 4096  # rows per numpy (de)quantisation step, bounds temporary memory


def _readonly(a):
    # One array type (read-only, C-contiguous, plain ndarray) for every Weight, so the
    # numba kernels compile once per format whether the bytes come from a file or not.
    a = np.ascontiguousarray(np.asarray(a))
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _f16_bits_to_f32(u16):
    return np.ascontiguousarray(u16).view(np.float16).astype(np.float32)


def _bf16_bits_to_f32(u16):
    return (np.asarray(u16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(a):
    # Round to nearest even, NaN kept quiet (as ggml_compute_fp32_to_bf16).
    n = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    r = ((n.astype(np.uint64) + (0x7FFF + ((n >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(nan, ((n >> 16) | 64).astype(np.uint16), r)


def _roundf(v):
    # C roundf (half away from zero), exactly as gguf.quants.np_roundf.
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(2 * (a - f)))


def _kq_scale_min(sc):
    """12 scale bytes [..., 12] of q4_k / q5_k -> (sc, m) uint8 [..., 8], 6 bits each."""
    a, b, c = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scl = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scl, mn


def _nibbles(qs, half):
    # [..., 2 * half * j ...]: byte half * j + l -> elements (2j) half + l (low), (2j + 1) half + l (high)
    q = qs.reshape(qs.shape[:-1] + (-1, 1, half)) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & np.uint8(15)).reshape(qs.shape[:-1] + (-1,))


def _q5_high(qh):
    # 4 qh bytes [..., 4] -> the fifth bit of each of the 32 values [..., 32]
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def dequantize_blocks(raw, qtype):
    """Raw block bytes [n, nb * blockbytes] -> f32 [n, nb * blocksize] (numpy reference,
    the same f32 operations in the same order as gguf.quants, hence the same bits)."""
    n = raw.shape[0]
    blk = np.asarray(raw).reshape(n, -1, BLOCK_BYTES[qtype])  # [n, nb, bb]
    f16 = lambda a, b: _f16_bits_to_f32(blk[:, :, a:b])  # noqa: E731  [n, nb, 1]
    if qtype == "q6_k":
        ql, qh, sc = blk[:, :, 0:128], blk[:, :, 128:192], blk[:, :, 192:208]
        d = f16(208, 210)  # [n, nb, 1]
        dl = (d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32))[..., None]  # [n, nb, 16, 1]
        lo = _nibbles(ql, 64)  # [n, nb, 256]: halves of 128, each two 64s of low / high nibbles
        hi = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & np.uint8(3)
        q = (lo | (hi.reshape(n, -1, 256) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return (dl * q.reshape(n, -1, 16, 16).astype(np.float32)).reshape(n, -1)
    if qtype in ("q4_k", "q5_k"):
        d, dmin = f16(0, 2), f16(2, 4)
        scl, mn = _kq_scale_min(blk[:, :, 4:16])
        dl = (d * scl.astype(np.float32))[..., None]  # [n, nb, 8, 1]
        ml = (dmin * mn.astype(np.float32))[..., None]
        if qtype == "q4_k":
            q = _nibbles(blk[:, :, 16:144], 32)
        else:
            qh = blk[:, :, 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = _nibbles(blk[:, :, 48:176], 32) | ((qh & np.uint8(1)) << np.uint8(4)).reshape(n, -1, 256)
        return (dl * q.reshape(n, -1, 8, 32).astype(np.float32) - ml).reshape(n, -1)
    d = f16(0, 2)
    if qtype == "q8_0":
        q = np.ascontiguousarray(blk[:, :, 2:]).view(np.int8).astype(np.float32)
        return (q * d).reshape(n, -1)
    if qtype in ("q5_0", "q5_1"):
        o = 2 if qtype == "q5_0" else 4
        q = _nibbles(blk[:, :, o + 4 : o + 20], 16) | (_q5_high(blk[:, :, o : o + 4]) << np.uint8(4))
        if qtype == "q5_0":
            return (d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)).reshape(n, -1)
        return (d * q.astype(np.float32) + f16(2, 4)).reshape(n, -1)
    q = _nibbles(blk[:, :, 2:18] if qtype == "q4_0" else blk[:, :, 4:20], 16)  # [n, nb, 32]
    if qtype == "q4_0":
        return (d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(n, -1)
    return (d * q.astype(np.float32) + f16(2, 4)).reshape(n, -1)


def quantize_blocks(a, qtype):
    """f32 [n, k] (k % 32 == 0) -> raw block bytes, rounding as ggml's reference quantizers."""
    a = np.asarray(a, dtype=np.float32)
    n = a.shape[0]
    x = a.reshape(n, -1, BLOCK)  # [n, nb, 32]
    with np.errstate(divide="ignore", invalid="ignore"):
        if qtype == "q8_0":
            d = np.abs(x).max(axis=2, keepdims=True) / np.float32(127)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
            q = _roundf(x * inv).astype(np.int8).view(np.uint8)
            parts = [d.astype(np.float16).view(np.uint8), q]
        elif qtype == "q4_0":
            imax = np.abs(x).argmax(axis=2)[..., None]
            d = np.take_along_axis(x, imax, axis=2) / np.float32(-8)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
            q = np.trunc(x * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
            parts = [d.astype(np.float16).view(np.uint8), q[..., :16] | (q[..., 16:] << 4)]
        elif qtype == "q4_1":
            lo = x.min(axis=2, keepdims=True)
            d = (x.max(axis=2, keepdims=True) - lo) / np.float32(15)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
            q = np.trunc((x - lo) * inv + np.float32(0.5)).astype(np.uint8).clip(0, 15)
            parts = [
                d.astype(np.float16).view(np.uint8),
                lo.astype(np.float16).view(np.uint8),
                q[..., :16] | (q[..., 16:] << 4),
            ]
        else:
            raise SparrowError(f"cannot quantise to {qtype!r}")
    return np.concatenate(parts, axis=2).reshape(n, -1)


@functools.cache
def gguf_support(ggml_type):
    """How sparrow runs a GGML tensor type (a gguf.GGMLQuantizationType or its number):
    "native" (kept as stored), "converted" (dequantised by gguf.quants at load, re-quantised
    to q8_0) or None (it cannot run it)."""
    import gguf

    try:
        gt = gguf.GGMLQuantizationType(ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[gt]
    except (ValueError, KeyError):
        return None
    if gt.name in _NATIVE_GGUF:
        return "native"
    try:  # one block of zeros: gguf.quants says whether it can dequantise the type
        gguf.quants.dequantize(np.zeros(size, np.uint8), gt)
    except Exception:
        return None
    return "converted"


class Weight:
    """A [out, in] weight matrix in stored form; see the module docstring for layouts."""

    __slots__ = ("qtype", "shape", "data")

    def __init__(self, qtype, data, shape):
        if qtype not in QTYPES:
            raise SparrowError(f"unknown weight type {qtype!r}")
        out, k = int(shape[0]), int(shape[1])
        if qtype in BLOCK_BYTES:
            bs = BLOCK_VALUES[qtype]
            if k % bs:
                raise SparrowError(f"{qtype} weight needs in % {bs} == 0, got shape {(out, k)}")
            want, dtype = (out, k // bs * BLOCK_BYTES[qtype]), np.uint8
        else:
            want, dtype = (out, k), {"f32": np.float32, "f16": np.uint16, "bf16": np.uint16}[qtype]
        data = np.asarray(data)
        if data.dtype != dtype or data.nbytes != want[0] * want[1] * data.itemsize:
            raise SparrowError(
                f"{qtype} weight of shape {(out, k)} needs {want} {np.dtype(dtype)}, got {data.shape} {data.dtype}"
            )
        self.qtype = qtype
        self.shape = (out, k)
        self.data = _readonly(data.reshape(want))  # [out, in] or [out, nb * blockbytes]

    @property
    def nbytes(self):
        return self.data.nbytes

    def __repr__(self):
        return f"Weight({self.qtype}, shape={self.shape})"

    # construction

    @classmethod
    def from_array(cls, a):
        """np.float32 -> f32 Weight, np.float16 -> f16 Weight (a is [out, in]).

        A C-contiguous array (e.g. a memory-mapped checkpoint) is kept as a read-only view,
        not copied: do not modify it afterwards."""
        a = np.asarray(a)
        if a.ndim != 2:
            raise SparrowError(f"weight must be 2-D, got shape {a.shape}")
        if a.dtype == np.float32:
            return cls("f32", a, a.shape)
        if a.dtype == np.float16:
            return cls("f16", np.ascontiguousarray(a).view(np.uint16), a.shape)
        raise SparrowError(f"from_array takes float32 or float16, got {a.dtype}")

    @classmethod
    def from_bf16(cls, u16):
        """bf16 bit patterns (uint16 [out, in]) -> bf16 Weight."""
        u16 = np.asarray(u16)
        if u16.ndim != 2 or u16.dtype != np.uint16:
            raise SparrowError(f"from_bf16 takes a 2-D uint16 array, got {u16.shape} {u16.dtype}")
        return cls("bf16", u16, u16.shape)

    @classmethod
    def from_gguf(cls, data, ggml_type, shape_out_in, name=None):
        """A GGUFReader tensor's .data with its ggml type, as a Weight of shape (out, in).

        F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K keep the file's bytes (no
        copy); other types that gguf.quants can dequantise (Q2_K, Q3_K, IQ4_NL, ...) are
        re-quantised to q8_0 at load. name (the tensor's) goes into error messages.
        """
        import gguf

        what = f"tensor {name!r}: " if name else ""
        try:
            gt = gguf.GGMLQuantizationType(ggml_type)
        except ValueError:
            raise SparrowError(f"{what}unknown GGML tensor type {ggml_type!r}") from None
        out, k = int(shape_out_in[0]), int(shape_out_in[1])
        data = np.asarray(data)
        qtype = _NATIVE_GGUF.get(gt.name)
        if qtype is not None:
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            if qtype == "f32":
                raw = raw.view(np.float32)
            elif qtype in ("f16", "bf16"):
                raw = raw.view(np.uint16)
            try:
                return cls(qtype, raw, (out, k))
            except SparrowError as e:
                raise SparrowError(f"{what}{e}") from None
        try:
            f = gguf.quants.dequantize(data, gt)
        except (NotImplementedError, gguf.quants.QuantError, KeyError, ValueError) as e:
            raise SparrowError(f"{what}unsupported GGML tensor type {gt.name} ({e})") from None
        if f.size != out * k:
            raise SparrowError(f"{what}{gt.name} tensor has {f.size} values, expected {out}x{k}")
        return cls.from_array(f.reshape(out, k).astype(np.float32)).quantize("q8_0")

    @classmethod
    def concat_rows(cls, weights):
        """One Weight stacking the rows of several of the same type and in (e.g. q, k, v):
        one kernel launch instead of several; copies the stored bytes."""
        weights = list(weights)
        if not weights or len({(w.qtype, w.shape[1]) for w in weights}) != 1:
            raise SparrowError("concat_rows needs weights of one type and one input size")
        data = np.concatenate([w.data for w in weights], axis=0)
        return cls(weights[0].qtype, data, (data.shape[0], weights[0].shape[1]))

    # conversion

    def quantize(self, qtype):
        """A new Weight in qtype ("q8_0", "q4_0", "q4_1"); a no-op if already that type."""
        if qtype == self.qtype:
            return self
        if qtype not in QUANTIZE_TO:
            raise SparrowError(f"cannot quantise weights to {qtype!r} (use q8_0, q4_0 or q4_1)")
        out, k = self.shape
        if k % BLOCK:
            raise SparrowError(f"cannot quantise to {qtype}: in={k} is not a multiple of 32")
        raw = np.empty((out, k // BLOCK * BLOCK_BYTES[qtype]), np.uint8)
        for a in range(0, out, _ROW_CHUNK):
            b = min(out, a + _ROW_CHUNK)
            raw[a:b] = quantize_blocks(self._dequant(self.data[a:b]), qtype)
        return Weight(qtype, raw, self.shape)

    def _dequant(self, stored):
        if self.qtype == "f32":
            return np.array(stored, dtype=np.float32)
        if self.qtype == "f16":
            return _f16_bits_to_f32(stored)
        if self.qtype == "bf16":
            return _bf16_bits_to_f32(stored)
        return dequantize_blocks(stored, self.qtype)

    def dequantize(self):
        """f32 [out, in] (numpy reference)."""
        return self._dequant(self.data)

    def rows(self, ids):
        """f32 [len(ids), in]: only the rows ids dequantised (embedding lookup)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise SparrowError(f"row id out of range [0, {self.shape[0]})")
        return self._dequant(self.data[ids])
