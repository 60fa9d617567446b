"""Small building blocks shared by the decoders: RMSNorm, RoPE, SwiGLU MLP.

RMSNorm, RoPE and silu(gate) * up are small numba kernels: at decode each is a few hundred
floats, so one compiled call replaces several numpy calls (Python overhead dominated them).
They are serial and work row by row, so a row's result never depends on the batch.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..kernels.linear import linear
from ..quant import Weight

_KW = dict(cache=True, nogil=True)


@njit(fastmath={"reassoc", "contract"}, **_KW)
def _ssq(r):
    s = np.float32(0)
    for i in range(r.shape[0]):
        s += r[i] * r[i]
    return s


@njit(**_KW)
def _rms_rows(x, w, eps, out):
    n = np.float32(x.shape[1])
    for t in range(x.shape[0]):
        inv = np.float32(1) / np.float32(math.sqrt(_ssq(x[t]) / n + eps))
        for i in range(x.shape[1]):
            out[t, i] = (x[t, i] * inv) * w[i]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis in f32, weight applied as is (Llama/Qwen, not 1 + w)."""
    x2 = x.reshape(-1, x.shape[-1])  # [R, D] (a view when x allows it)
    out = np.empty(x2.shape, np.float32)
    _rms_rows(x2, w, np.float32(eps), out)
    return out.reshape(x.shape)


@njit(**_KW)
def _rope(x, cos, sin, positions, out):
    # rotate-half: out = [x1 c - x2 s, x2 c + x1 s] per head
    half = cos.shape[1]
    for t in range(x.shape[0]):
        c = cos[positions[t]]
        s = sin[positions[t]]
        for h in range(x.shape[1]):
            for i in range(half):
                a = x[t, h, i]
                b = x[t, h, half + i]
                out[t, h, i] = a * c[i] - b * s[i]
                out[t, h, half + i] = b * c[i] + a * s[i]


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # k * _LN2_HI is exact for |k| < 2**9
_LN2_LO = np.float32(-2.12194440e-4)


@njit(fastmath={"reassoc", "contract"}, **_KW)
def _silu_mul(gu, f, out):
    """out = silu(g) * u with g = gu[:, :f], u = gu[:, f:].

    exp(-g) is computed so that LLVM vectorises it (libm expf is a scalar call): 2**k * e**r,
    k = round(x / ln 2), e**r by its degree-6 Taylor polynomial (relative error < 3e-7),
    2**k built in the exponent bits; the argument is clamped to [-87, 88] (finite f32).
    """
    ebits = np.empty(f, np.int32)
    fb = ebits.view(np.float32)
    for t in range(gu.shape[0]):
        o = out[t]
        for i in range(f):
            x = min(max(-gu[t, i], np.float32(-87.0)), np.float32(88.0))
            k = np.floor(x * _LOG2E + np.float32(0.5))
            r = (x - k * _LN2_HI) - k * _LN2_LO
            p = np.float32(1.0 / 720)
            p = p * r + np.float32(1.0 / 120)
            p = p * r + np.float32(1.0 / 24)
            p = p * r + np.float32(1.0 / 6)
            p = p * r + np.float32(0.5)
            p = p * r + np.float32(1.0)
            p = p * r + np.float32(1.0)
            o[i] = p
            ebits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
        for i in range(f):
            o[i] = gu[t, i] / (np.float32(1) + o[i] * fb[i]) * gu[t, f + i]


class Rope:
    """Rotate-half rotary embedding, cos/sin cached per position in f32 like transformers."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        # transformers: inv_freq = 1 / theta ** (arange(0, d, 2) / d) computed in f32
        exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv = (1.0 / (np.float32(theta) ** exps)).astype(np.float32)  # [D/2]
        self.inv_freq = _scale_inv_freq(inv, scaling)
        self.attention_factor = 1.0
        self.cos = np.zeros((0, head_dim // 2), np.float32)
        self.sin = np.zeros((0, head_dim // 2), np.float32)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * len(self.cos), 256)
        pos = np.arange(n, dtype=np.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [n, D/2] f32 product, as torch does
        self.cos = np.cos(freqs).astype(np.float32)
        self.sin = np.sin(freqs).astype(np.float32)

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: [T, H, D] at the given absolute positions [T]; returns a new array."""
        if positions.max() >= len(self.cos):
            self._grow(int(positions.max()) + 1)
        out = np.empty(x.shape, np.float32)
        _rope(x, self.cos, self.sin, positions.astype(np.int64, copy=False), out)
        return out


def _scale_inv_freq(inv: np.ndarray, scaling: dict | None) -> np.ndarray:
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    # llama3: long wavelengths slowed by `factor`, short kept, smooth blend in between.
    factor = float(scaling["factor"])
    lo = float(scaling.get("low_freq_factor", 1.0))
    hi = float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * np.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(is_mid, mid, scaled).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives silu = -0, as wanted
        return x / (1.0 + np.exp(-x))


class FusedLinear:
    """Several projections of the same input as one kernel launch when their formats agree
    (q/k/v, gate/up): per-token decode is dominated by launch overhead, not arithmetic."""

    def __init__(self, weights: list[Weight]):
        self.sizes = [w.shape[0] for w in weights]
        same = len({(w.qtype, w.shape[1]) for w in weights}) == 1
        self.fused = Weight.concat_rows(weights) if same and len(weights) > 1 else None
        self.parts = None if self.fused is not None else weights

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        if self.fused is None:
            return [linear(x, w) for w in self.parts]
        y = linear(x, self.fused)  # [T, sum(sizes)]
        return np.split(y, np.cumsum(self.sizes)[:-1], axis=1)


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: Weight, up: Weight, down: Weight):
        self.gate_up = FusedLinear([gate, up])
        self.down = down

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.gate_up.fused is None:
            g, u = self.gate_up(x)  # [T, F] [T, F]
            return linear(silu(g) * u, self.down)  # [T, E]
        gu = linear(x, self.gate_up.fused)  # [T, 2F]
        f = self.gate_up.sizes[0]
        h = np.empty((gu.shape[0], f), np.float32)  # [T, F]
        _silu_mul(gu, f, h)
        return linear(h, self.down)  # [T, E]
