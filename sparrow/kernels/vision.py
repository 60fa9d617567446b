"""Kernels of the vision tower: LayerNorm, the two GELUs (tanh and exact erf) and full attention.

Prefill-sized work (hundreds to thousands of patch rows), so rows run in parallel; each row's
arithmetic is serial and fixed, so results do not depend on the thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from sparrow.kernels.attention.prefill import BK, key_blocks
from sparrow.kernels.attention.rows import softmax_step
from sparrow.kernels.attention.tile import mm_add
from sparrow.kernels.elementwise import over_one_plus_exp
from sparrow.kernels.ir import fma32
from sparrow.kernels.options import KW
from sparrow.kernels.parallel import run_parallel

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


_C = np.float32(2.0 * math.sqrt(2.0 / math.pi))


@njit(**_KW)
def _gelu_tanh(x, out):
    """0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), as x / (1 + exp(-2u)) (the
    same function: 0.5 (1 + tanh(u)) = sigmoid(2u)) by elementwise.over_one_plus_exp, whose
    loops vectorise."""
    n = x.shape[1]
    for t in prange(x.shape[0]):
        u2 = np.empty(n, np.float32)
        pbuf = np.empty(n, np.float32)
        ebits = np.empty(n, np.int32)
        for i in range(n):
            v = x[t, i]
            u2[i] = _C * fma32(np.float32(0.044715) * v * v, v, v)  # 2u
        over_one_plus_exp(x[t], u2, out[t], n, pbuf, ebits)


def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    """GELU of x [T, n]: approximate "tanh" (gelu_pytorch_tanh) or "none" (exact, erf)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.shape, np.float32)
    (_gelu_tanh if approximate == "tanh" else _gelu_erf)(x, out)
    return out


QT = 64  # query rows of a work item: its Q, score and output tiles stay in L1 with BK keys a step


@njit(cache=True, nogil=True)
def _attend_item(i, qt, q, KT, V, out):
    """Work item i: query rows t0..t0+qt-1 of head h, over every key of the image, in key
    blocks of BK with a running max and sum (as the text prefill's attention, without a mask):
      s = q' K_b^T (q' = q * scale);  mx = max(s); if mx > m: c = exp(m - mx), o *= c, l *= c, m = mx
      e = exp_shifted(s - m); l += sum(e); o += e V_b;  out = o * (1 / l)
    Each row's arithmetic depends only on its query and the keys, so any thread count or work
    split gives the same bits. q [N, H, D], KT [H, nblk, D, BK], V [H, N, D], out [N, H, D]."""
    N, _, D = q.shape
    nq = (N + qt - 1) // qt
    h, t0 = i // nq, (i % nq) * qt
    R = min(qt, N - t0)
    Q = np.empty((R, D), np.float32)
    S = np.empty((R, BK), np.float32)  # scores, then the block's weights in place
    O = np.zeros((R, D), np.float32)
    m = np.empty(R, np.float32)
    m[:] = -np.inf
    den = np.zeros(R, np.float32)
    for r in range(R):
        for d in range(D):
            Q[r, d] = q[t0 + r, h, d]
    for b in range(KT.shape[1]):
        k0 = b * BK
        kn = min(BK, N - k0)
        S[:] = 0
        mm_add(Q, KT[h, b], S, D)  # [R, BK]
        for r in range(R):
            softmax_step(S[r], kn, S[r], r, m, den, O)  # S[r, :kn] = exp(S[r] - m), S[r, kn:] = 0
        mm_add(S, V[h, k0 : k0 + kn], O, kn)  # [R, D]
    for r in range(R):
        inv = np.float32(1.0) / den[r]
        for d in range(D):
            out[t0 + r, h, d] = O[r, d] * inv


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Full (non-causal) attention of every head: softmax(q k^T * scale) v for q, k, v
    [N, H, D] f32 -> [N, H, D], one pass over the keys per query tile (scores never leave L1)."""
    N, H, _ = q.shape
    qs = np.ascontiguousarray(q * np.float32(scale), np.float32)  # [N, H, D]
    KT = key_blocks(np.ascontiguousarray(k.transpose(1, 0, 2), np.float32), N)  # [H, nblk, D, BK]
    V = np.ascontiguousarray(v.transpose(1, 0, 2), np.float32)  # [H, N, D]
    out = np.empty(q.shape, np.float32)
    run_parallel(H * ((N + QT - 1) // QT), _attend_item, (QT, qs, KT, V, out))
    return out
