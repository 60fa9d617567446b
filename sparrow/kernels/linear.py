"""y = x @ W.T for a sparrow.quant.Weight, working on the stored form.

Small T (decode, a few batched sequences): numba kernels over the stored rows, parallel over
output rows only. Every y[t, o] is computed by one fixed instruction sequence that depends on
neither T nor the thread count, so a row alone is bit-identical to that row in a batch and
any number of threads gives the same bits:
  - f32 / f16 / bf16: the weight row is widened to f32 once, then dotted with each x row
    by one compiled f32 loop (vector lanes, then a fixed tree; see _widen.dot).
  - q8_0 / q4_0 / q4_1: each x row is quantised per 32-block to int8 with an f32 scale
    (and, for q4_1's min term, the block sum) as llama.cpp's q8_0/q8_1; each block is an
    exact int32 dot product, blocks are summed in order in f32.
Large T (prefill): chunks of W rows are widened to f32 (bit-identical to
Weight.dequantize) and dotted with every x row in f32 (sparrow.kernels._widen). No BLAS:
OpenBLAS's own threads spin after each call and starve numba's threads on a shared machine.
"""

import numpy as np
from numba import njit, prange

from sparrow.kernels._widen import (F16_LUT, KW, call_slp, dequantize_rows, matmul_widened,
                                    matvec_widened)
from sparrow.quant import BLOCK

__all__ = ["linear", "dequantize_rows", "SMALL_T"]

SMALL_T = 8  # T above this takes the widen-to-f32 (prefill) path

# The block kernels index with uint64 so numba emits no negative-index wraparound (which
# hides the consecutive loads from LLVM); call_slp compiles them with LLVM's SLP
# vectoriser, which turns each 32-element block dot product into a few vector instructions.
_U = np.uint64


@njit(**KW)
def _quant_act(x, xq, xd, xs):
    # x f32 [T, K] -> xq int8 [T, K], xd f32 [T, nb] scales, xs f32 [T, nb] = xd * sum(q).
    # Rounding is C roundf of x * (127 / amax), as ggml's quantize_row_q8_1.
    t_n, k = x.shape
    for t in range(t_n):
        for b in range(k // 32):
            p = b * 32
            amax = np.float32(0)
            for j in range(32):
                amax = max(amax, abs(x[t, p + j]))
            d = amax / np.float32(127)
            inv = np.float32(1) / d if d != 0 else np.float32(0)
            s = 0
            for j in range(32):
                v = x[t, p + j] * inv
                a = abs(v)
                f = np.floor(a)
                r = np.int32(f + np.floor(np.float32(2) * (a - f)))
                q = -r if v < 0 else r
                xq[t, p + j] = q
                s += q
            xd[t, b] = d
            xs[t, b] = d * np.float32(s)


# ---------------------------------------------------------------- small T, block formats


@njit(parallel=True, **KW)
def _mv_q8_0(raw, xq, xd, lut, y):
    o_n = raw.shape[0]
    t_n, nb = xd.shape
    for o in prange(o_n):
        row = raw[o]
        for t in range(t_n):
            xr = xq[t]
            acc = np.float32(0)
            for b in range(nb):
                p = _U(b) * _U(34)
                px = _U(b) * _U(32)
                d = lut[np.int32(row[p]) | (np.int32(row[p + _U(1)]) << 8)]
                isum = np.int32(0)
                for j in range(32):
                    u = _U(j)
                    isum = np.int32(isum + np.int32(np.int8(row[p + _U(2) + u]))
                                    * np.int32(xr[px + u]))
                acc += d * xd[t, b] * np.float32(isum)
            y[t, o] = acc


@njit(parallel=True, **KW)
def _mv_q4_0(raw, xq, xd, lut, y):
    o_n = raw.shape[0]
    t_n, nb = xd.shape
    for o in prange(o_n):
        row = raw[o]
        for t in range(t_n):
            xr = xq[t]
            acc = np.float32(0)
            for b in range(nb):
                p = _U(b) * _U(18)
                px = _U(b) * _U(32)
                d = lut[np.int32(row[p]) | (np.int32(row[p + _U(1)]) << 8)]
                isum = np.int32(0)
                for j in range(16):
                    u = _U(j)
                    q = np.int32(row[p + _U(2) + u])
                    isum = np.int32(isum + ((q & 15) - 8) * np.int32(xr[px + u])
                                    + ((q >> 4) - 8) * np.int32(xr[px + _U(16) + u]))
                acc += d * xd[t, b] * np.float32(isum)
            y[t, o] = acc


@njit(parallel=True, **KW)
def _mv_q4_1(raw, xq, xd, xs, lut, y):
    o_n = raw.shape[0]
    t_n, nb = xd.shape
    for o in prange(o_n):
        row = raw[o]
        for t in range(t_n):
            xr = xq[t]
            acc = np.float32(0)
            for b in range(nb):
                p = _U(b) * _U(20)
                px = _U(b) * _U(32)
                d = lut[np.int32(row[p]) | (np.int32(row[p + _U(1)]) << 8)]
                m = lut[np.int32(row[p + _U(2)]) | (np.int32(row[p + _U(3)]) << 8)]
                isum = np.int32(0)
                for j in range(16):
                    u = _U(j)
                    q = np.int32(row[p + _U(4) + u])
                    isum = np.int32(isum + (q & 15) * np.int32(xr[px + u])
                                    + (q >> 4) * np.int32(xr[px + _U(16) + u]))
                acc += d * xd[t, b] * np.float32(isum) + m * xs[t, b]
            y[t, o] = acc


# ---------------------------------------------------------------- entry point


def linear(x, w, out=None):
    """y = x @ W.T; x f32 [T, in] C-contiguous, returns (or fills out) f32 [T, out]."""
    t_n, k = x.shape
    o_n = w.shape[0]
    if x.dtype != np.float32 or not x.flags.c_contiguous or k != w.shape[1]:
        raise ValueError(f"linear: x must be C-contiguous float32 [T, {w.shape[1]}], "
                         f"got {x.dtype} {x.shape}")
    if out is None:
        out = np.empty((t_n, o_n), np.float32)
    elif out.dtype != np.float32 or out.shape != (t_n, o_n) or not out.flags.c_contiguous:
        raise ValueError(f"linear: out must be C-contiguous float32 [{t_n}, {o_n}]")
    if t_n == 0:
        return out
    if t_n > SMALL_T:
        return matmul_widened(x, w, out)
    q = w.qtype
    if q in ("f32", "f16", "bf16"):
        matvec_widened(x, w, out)
    else:
        xq = np.empty((t_n, k), np.int8)  # [T, in]
        xd = np.empty((t_n, k // BLOCK), np.float32)  # [T, nb]
        xs = np.empty((t_n, k // BLOCK), np.float32)  # [T, nb]
        _quant_act(x, xq, xd, xs)
        if q == "q8_0":
            call_slp(_mv_q8_0, w.data, xq, xd, F16_LUT, out)
        elif q == "q4_0":
            call_slp(_mv_q4_0, w.data, xq, xd, F16_LUT, out)
        else:
            call_slp(_mv_q4_1, w.data, xq, xd, xs, F16_LUT, out)
    return out
