"""Per-sequence KV cache: f32, f16 or int8 storage, plus per-position prefill importance.

Layout per layer: k, v are [KVH, capacity, D] so one KV head's keys are contiguous rows (the
decode kernel streams them; prefill slices [:S] and hands them to BLAS).

Storage:
- "f32": float32.
- "f16": IEEE half stored as uint16 bit patterns (numba has no float16 type on the CPU; the
  kernels widen the bits with an LLVM fpext). `LayerCache.k.view(np.float16)` gives the values.
- "int8": symmetric per (head, position) quantisation: scale = absmax/127 over D,
  q = rint(x / scale) in [-127, 127]; an all-zero row gets scale 0 and codes 0.
"""

import numpy as np

from sparrow.errors import SparrowError
from sparrow.params import KV_DTYPES
from sparrow.kernels.elementwise import quantize_int8_rows

_STORAGE = {"f32": np.float32, "f16": np.uint16, "int8": np.int8}


def quantize_int8(x):
    """x float32 [..., D] -> (codes int8 [..., D], scale float32 [...]) with scale = absmax/127."""
    return quantize_int8_rows(x)


class LayerCache:
    """One layer of one sequence."""

    def __init__(self, n_kv_heads, head_dim, capacity, dtype="f32"):
        if dtype not in _STORAGE:
            raise SparrowError(f"unknown KV cache dtype {dtype!r} (choose from {', '.join(KV_DTYPES)})")
        self.dtype = dtype
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        shape = (n_kv_heads, capacity, head_dim)
        self.k = np.zeros(shape, dtype=_STORAGE[dtype])  # [KVH, C, D]
        self.v = np.zeros(shape, dtype=_STORAGE[dtype])  # [KVH, C, D]
        if dtype == "int8":
            self.k_scale = np.zeros((n_kv_heads, capacity), dtype=np.float32)  # [KVH, C]
            self.v_scale = np.zeros((n_kv_heads, capacity), dtype=np.float32)  # [KVH, C]
        else:
            self.k_scale = None
            self.v_scale = None
        self.importance = np.zeros(capacity, dtype=np.float32)  # [C]
        self._probes = {}  # (block, n_probe) -> ProbeKeys

    def append(self, start, k, v):
        """Write float32 k, v [T, KVH, D] at positions start..start+T-1."""
        k = np.asarray(k, dtype=np.float32)
        v = np.asarray(v, dtype=np.float32)
        T = k.shape[0]
        if k.shape != (T, self.n_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"append expects [T, {self.n_kv_heads}, {self.head_dim}], got {k.shape} / {v.shape}")
        if start < 0 or start + T > self.capacity:
            raise SparrowError(f"KV cache overflow: positions {start}..{start + T - 1} exceed capacity {self.capacity}")
        kt = k.transpose(1, 0, 2)  # [KVH, T, D]
        vt = v.transpose(1, 0, 2)  # [KVH, T, D]
        end = start + T
        if self.dtype == "f32":
            self.k[:, start:end] = kt
            self.v[:, start:end] = vt
        elif self.dtype == "f16":
            self.k[:, start:end] = kt.astype(np.float16).view(np.uint16)
            self.v[:, start:end] = vt.astype(np.float16).view(np.uint16)
        else:
            self.k[:, start:end], self.k_scale[:, start:end] = quantize_int8(kt)
            self.v[:, start:end], self.v_scale[:, start:end] = quantize_int8(vt)
        # a rewritten position (prompt-cache reuse) must not keep stale prefill mass
        self.importance[start:end] = 0.0
        for p in self._probes.values():  # nor stale probe copies
            p.blocks = min(p.blocks, start // p.block)

    def probe_keys(self, block, n_probe, seq_len):
        """The probe keys of every full block below seq_len, copied contiguously (ProbeKeys).

        Sparse decode reads n_probe of every block's keys each step; straight from K that is a
        strided walk (one row in four by default) that ran ~5x slower per byte than a
        contiguous read here. The copy costs n_probe / block of K's bytes and is filled once
        per block, on first use."""
        p = self._probes.get((block, n_probe))
        if p is None:
            p = self._probes[(block, n_probe)] = ProbeKeys(self, block, n_probe)
        p.update(self, seq_len // block)
        return p

    def keys_f32(self, kh, n):
        """Dequantised keys of KV head kh for positions 0..n-1 as float32 [n, D]."""
        return self._f32(self.k, self.k_scale, kh, n)

    def values_f32(self, kh, n):
        """Dequantised values of KV head kh for positions 0..n-1 as float32 [n, D]."""
        return self._f32(self.v, self.v_scale, kh, n)

    def _f32(self, x, scale, kh, n):
        if self.dtype == "f32":
            return x[kh, :n]
        if self.dtype == "f16":
            return x[kh, :n].view(np.float16).astype(np.float32)
        return x[kh, :n].astype(np.float32) * scale[kh, :n, None]

    @property
    def nbytes(self):
        n = self.k.nbytes + self.v.nbytes + self.importance.nbytes
        if self.k_scale is not None:
            n += self.k_scale.nbytes + self.v_scale.nbytes
        return n

    @property
    def probe_nbytes(self):
        """Bytes of the probe-key copies sparse decode made (not in nbytes)."""
        return sum(p.nbytes for p in self._probes.values())


class ProbeKeys:
    """Probe rows of full blocks: rows[kh, b * per_block + j] = K[kh, b * block + j * step]
    (step = max(1, block // n_probe), the spec's probe positions of a full block), with their
    int8 scales; `blocks` full blocks are valid."""

    def __init__(self, layer, block, n_probe):
        self.block, self.step = block, max(1, block // n_probe)
        self.per_block = len(range(0, block, self.step))
        n = (layer.capacity // block) * self.per_block
        self.rows = np.zeros((layer.n_kv_heads, n, layer.head_dim), layer.k.dtype)  # [KVH, n, D]
        self.scale = np.zeros((layer.n_kv_heads, n if layer.k_scale is not None else 1), np.float32)
        self.blocks = 0

    def update(self, layer, full_blocks):
        if full_blocks <= self.blocks:
            return
        b0, b1 = self.blocks, full_blocks
        pos = (np.arange(b0, b1)[:, None] * self.block + np.arange(0, self.block, self.step)).ravel()
        r0, r1 = b0 * self.per_block, b1 * self.per_block
        self.rows[:, r0:r1] = layer.k[:, pos]
        if layer.k_scale is not None:
            self.scale[:, r0:r1] = layer.k_scale[:, pos]
        self.blocks = full_blocks

    @property
    def nbytes(self):
        return self.rows.nbytes + self.scale.nbytes


class KVCache:
    """All layers of one sequence; `length` is advanced by the model after each forward."""

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity, dtype="f32"):
        if capacity < 1:
            raise SparrowError(f"KV cache capacity must be >= 1 (got {capacity})")
        self.dtype = dtype
        self.capacity = capacity
        self.layers = [LayerCache(n_kv_heads, head_dim, capacity, dtype) for _ in range(n_layers)]
        self.length = 0

    @property
    def nbytes(self):
        return sum(layer.nbytes for layer in self.layers)

    @property
    def probe_nbytes(self):
        return sum(layer.probe_nbytes for layer in self.layers)

    def truncate(self, n):
        """Drop positions >= n (their K/V are simply overwritten later)."""
        n = max(0, min(int(n), self.length))
        self.length = n
        for layer in self.layers:
            layer.importance[n:] = 0.0
