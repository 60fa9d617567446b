"""Row-wise kernels of the vision tower: LayerNorm and the two GELUs (tanh and exact erf).

Prefill-sized work (hundreds to thousands of patch rows), so rows run in parallel; each row's
arithmetic is serial and fixed, so results do not depend on the thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from sparrow.kernels.options import KW

_KW = dict(KW, parallel=True)


@njit(**_KW)
def _layer_norm(x, w, b, eps, out):
    n = x.shape[1]
    for t in prange(x.shape[0]):
        mean = 0.0
        for i in range(n):
            mean += x[t, i]
        mean /= n
        var = 0.0
        for i in range(n):
            d = x[t, i] - mean
            var += d * d
        inv = 1.0 / math.sqrt(var / n + eps)
        for i in range(n):
            out[t, i] = np.float32((x[t, i] - mean) * inv) * w[i] + b[i]


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis of x [T, n] (statistics in f64) -> f32 [T, n]."""
    out = np.empty(x.shape, np.float32)
    _layer_norm(np.ascontiguousarray(x, np.float32), w, b, float(eps), out)
    return out


@njit(**_KW)
def _gelu_erf(x, out):
    r = 1.0 / math.sqrt(2.0)
    for t in prange(x.shape[0]):
        for i in range(x.shape[1]):
            v = np.float64(x[t, i])
            out[t, i] = 0.5 * v * (1.0 + math.erf(v * r))


def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    """GELU of x [T, n]: approximate "tanh" (gelu_pytorch_tanh) or "none" (exact, erf)."""
    x = np.ascontiguousarray(x, np.float32)
    if approximate == "tanh":  # numpy's SIMD f32 tanh: 2x a scalar f64 loop, within 5e-7 of torch's
        c = np.float32(math.sqrt(2.0 / math.pi))
        return np.float32(0.5) * x * (np.float32(1) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))
    out = np.empty(x.shape, np.float32)
    _gelu_erf(x, out)
    return out
