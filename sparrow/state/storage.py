"""K/V storage of one layer of one sequence: one class per kind behind one interface.

Layout per layer: k, v are [KVH, capacity, D] so one KV head's keys are contiguous rows (the
decode kernel streams them; prefill slices [:S] and hands them to BLAS).

Storage kinds (LayerCache subclasses):
- F32Layer: float32.
- F16Layer: IEEE half stored as uint16 bit patterns (numba has no float16 type on the CPU; the
  kernels widen the bits with an LLVM fpext). `layer.k.view(np.float16)` gives the values.
- Int8Layer: symmetric per (head, position) quantisation: scale = absmax/127 over D,
  q = rint(x / scale) in [-127, 127]; an all-zero row gets scale 0 and codes 0.

Every kind hands the attention kernels the same things: k, v, k_scale, v_scale, `scaled`
(whether dots and values take the per-row scales) and `query()`, the query in the form its
dots need. Float kinds have no scales; their k_scale / v_scale are one [KVH, 1] placeholder,
made once, that the kernels never read.
"""

import numpy as np

from sparrow.errors import SparrowError
from sparrow.kernels.elementwise import quantize_int8_rows, store_f16_rows
from sparrow.params import KV_DTYPES


def quantize_int8(x):
    """x float32 [..., D] -> (codes int8 [..., D], scale float32 [...]) with scale = absmax/127."""
    return quantize_int8_rows(x)


class LayerCache:
    """K/V rows of one layer of one sequence; subclasses fix the storage kind."""

    kind = ""  # "f32" | "f16" | "int8"
    storage = np.float32  # element type of k, v
    scaled = False  # rows carry per-(head, position) scales

    def __init__(self, n_kv_heads, head_dim, capacity):
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        shape = (n_kv_heads, capacity, head_dim)
        self.k = np.zeros(shape, dtype=self.storage)  # [KVH, C, D]
        self.v = np.zeros(shape, dtype=self.storage)  # [KVH, C, D]
        # placeholder for the kernels' scale arguments (Int8Layer replaces it)
        self.k_scale = self.v_scale = np.zeros((n_kv_heads, 1), dtype=np.float32)  # [KVH, 1]

    def append(self, start, k, v):
        """Write float32 k, v [T, KVH, D] at positions start..start+T-1 (storage only:
        KVCache.append also clears the sparse state of the rewritten positions)."""
        k = np.asarray(k, dtype=np.float32)
        v = np.asarray(v, dtype=np.float32)
        T = k.shape[0]
        if k.shape != (T, self.n_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"append expects [T, {self.n_kv_heads}, {self.head_dim}], got {k.shape} / {v.shape}")
        if start < 0 or start + T > self.capacity:
            raise SparrowError(f"KV cache overflow: positions {start}..{start + T - 1} exceed capacity {self.capacity}")
        self._store(self.k, self.k_scale, start, k.transpose(1, 0, 2))  # [KVH, T, D]
        self._store(self.v, self.v_scale, start, v.transpose(1, 0, 2))  # [KVH, T, D]

    def _store(self, dst, scale, start, x):
        """Encode x float32 [KVH, T, D] into dst[:, start:start+T] (and its scales)."""
        raise NotImplementedError

    def _rows_f32(self, x, scale, kh, n):
        """Rows 0..n-1 of KV head kh of x (k or v) as float32 [n, D]."""
        raise NotImplementedError

    def keys_f32(self, kh, n):
        """Dequantised keys of KV head kh for positions 0..n-1 as float32 [n, D]."""
        return self._rows_f32(self.k, self.k_scale, kh, n)

    def values_f32(self, kh, n):
        """Dequantised values of KV head kh for positions 0..n-1 as float32 [n, D]."""
        return self._rows_f32(self.v, self.v_scale, kh, n)

    def query(self, q, scale):
        """q float32 [..., H, D] -> (probe queries, attention queries, per-head scales [..., H])
        as the attention kernels take them. Float kinds: q for the probes (the spec's raw
        q . K) and q * scale for the scores, which saves a multiply per key; no scales."""
        return q, q * np.float32(scale), np.zeros(q.shape[:-1], np.float32)

    @property
    def nbytes(self):
        n = self.k.nbytes + self.v.nbytes
        if self.scaled:
            n += self.k_scale.nbytes + self.v_scale.nbytes
        return n

    def resized(self, capacity, n):
        """A layer of the same kind with `capacity` positions holding this one's rows 0..n-1."""
        out = type(self)(self.n_kv_heads, self.head_dim, capacity)
        out.k[:, :n], out.v[:, :n] = self.k[:, :n], self.v[:, :n]
        if self.scaled:
            out.k_scale[:, :n], out.v_scale[:, :n] = self.k_scale[:, :n], self.v_scale[:, :n]
        return out

    @classmethod
    def bytes_at(cls, n_kv_heads, head_dim, capacity):
        """nbytes of a layer of this kind with `capacity` positions."""
        per_row = 2 * head_dim * np.dtype(cls.storage).itemsize + (8 if cls.scaled else 0)
        return n_kv_heads * capacity * per_row


class F32Layer(LayerCache):
    kind, storage = "f32", np.float32

    def _store(self, dst, scale, start, x):
        dst[:, start : start + x.shape[1]] = x

    def _rows_f32(self, x, scale, kh, n):
        return x[kh, :n]  # a view, no copy


class F16Layer(LayerCache):
    kind, storage = "f16", np.uint16

    def _store(self, dst, scale, start, x):
        store_f16_rows(x, dst, start)

    def _rows_f32(self, x, scale, kh, n):
        return x[kh, :n].view(np.float16).astype(np.float32)


class Int8Layer(LayerCache):
    kind, storage, scaled = "int8", np.int8, True

    def __init__(self, n_kv_heads, head_dim, capacity):
        super().__init__(n_kv_heads, head_dim, capacity)
        self.k_scale = np.zeros((n_kv_heads, capacity), dtype=np.float32)  # [KVH, C]
        self.v_scale = np.zeros((n_kv_heads, capacity), dtype=np.float32)  # [KVH, C]

    def _store(self, dst, scale, start, x):
        end = start + x.shape[1]
        dst[:, start:end], scale[:, start:end] = quantize_int8(x)

    def _rows_f32(self, x, scale, kh, n):
        return x[kh, :n].astype(np.float32) * scale[kh, :n, None]

    def query(self, q, scale):
        """The int8 codes of q (same absmax/127 rule as the cache) as float32, exact small
        integers, so every dot is the exact int8 x int8 dot, for both uses; the kernels apply
        the query, key and softmax scales."""
        codes, qscale = quantize_int8(q)  # [..., H, D], [..., H]
        codes = codes.astype(np.float32)
        return codes, codes, qscale


LAYER_KINDS = {cls.kind: cls for cls in (F32Layer, F16Layer, Int8Layer)}


def layer_cache(kind, n_kv_heads, head_dim, capacity):
    """A LayerCache of the named storage kind ("f32", "f16", "int8")."""
    if kind not in LAYER_KINDS:
        raise SparrowError(f"unknown KV cache dtype {kind!r} (choose from {', '.join(KV_DTYPES)})")
    return LAYER_KINDS[kind](n_kv_heads, head_dim, capacity)
