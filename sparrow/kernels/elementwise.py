"""Row-wise element kernels of the decoder: RMSNorm, rotate-half RoPE (and its frequency
table), silu(gate) * up, and the int8 and f16 KV row encodings. Their sums and multiply-adds have one
order on every CPU (RMSNorm's sum of squares in ir.lane_fold's lanes, exp's fmas explicit).

At decode each is a few hundred floats, so one compiled call replaces several numpy calls
(Python overhead dominated them). They work row by row, so a row's result never depends on
the batch it came in; a prefill's RMSNorm and silu(gate) * up run the same serial kernels on
chunks of PAR_ROWS rows across the threads (silu serial was 0.26 of a 5.5 s 512-token prefill of
the Qwen3-1.7B shape).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from sparrow.kernels.ir import f16_bits, fma32, lane_dot
from sparrow.kernels.options import KW as _KW
from sparrow.kernels.parallel import run_parallel

PAR_ROWS = 16  # rows a parallel item of a prefill's element kernels covers


@njit(**_KW)
def _rms_rows(x, w, eps, out):
    # sum of squares in ir.lane_fold's order (lane_dot of the row with itself), so a norm has
    # the same bits on every CPU; then one f32 rounding a step
    n = np.float32(x.shape[1])
    for t in range(x.shape[0]):
        inv = np.float32(1) / np.float32(math.sqrt(lane_dot(x[t], x[t]) / n + eps))
        for i in range(x.shape[1]):
            out[t, i] = (x[t, i] * inv) * w[i]


@njit(**_KW)
def _rms_chunk(c, x, w, eps, out):
    # rows [c PAR_ROWS, (c + 1) PAR_ROWS) of rms_norm, one launch each (kernels/parallel.py)
    _rms_rows(x[c * PAR_ROWS : (c + 1) * PAR_ROWS], w, eps, out[c * PAR_ROWS : (c + 1) * PAR_ROWS])


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis in f32, weight applied as is (Llama/Qwen, not 1 + w). A
    prefill's rows go in chunks on every thread (the same bits a row)."""
    x2 = x.reshape(-1, x.shape[-1])  # [R, D] (a view when x allows it)
    out = np.empty(x2.shape, np.float32)
    if x2.shape[0] > 2 * PAR_ROWS:
        run_parallel((x2.shape[0] + PAR_ROWS - 1) // PAR_ROWS, _rms_chunk, (x2, w, np.float32(eps), out))
    else:
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


@njit(**_KW)
def exp_parts(x):
    """(p, k) with exp(x) = p * 2**k for finite f32 x in [-87, 88], written so that LLVM
    vectorises loops calling it (libm expf is a scalar call): k = round(x / ln 2), p = e**r for
    |r| <= ln 2 / 2 by its degree-6 Taylor polynomial (relative error < 3e-7). The caller
    builds 2**k in exponent bits: (int32(k) + 127) << 23. Every multiply-add is an explicit
    fma (ir.fma32), so the bits are the same with and without the CPU's FMA (no fastmath: a
    contraction left to LLVM happens only where the target has FMA)."""
    k = np.floor(fma32(x, _LOG2E, np.float32(0.5)))
    r = fma32(-k, _LN2_LO, fma32(-k, _LN2_HI, x))  # k * _LN2_HI is exact: x - k ln 2 in two steps
    p = np.float32(1.0 / 720)
    p = fma32(p, r, np.float32(1.0 / 120))
    p = fma32(p, r, np.float32(1.0 / 24))
    p = fma32(p, r, np.float32(1.0 / 6))
    p = fma32(p, r, np.float32(0.5))
    p = fma32(p, r, np.float32(1.0))
    p = fma32(p, r, np.float32(1.0))
    return p, k


@njit(**_KW)
def _silu_mul(gu, f, out):
    """out = silu(g) * u with g = gu[:, :f], u = gu[:, f:]: g / fma(p, 2**k, 1) * u.

    exp(-g) = p 2**k by exp_parts (vectorised), the argument clamped to [-87, 88] (finite f32).
    """
    ebits = np.empty(f, np.int32)
    fb = ebits.view(np.float32)
    for t in range(gu.shape[0]):
        o = out[t]
        for i in range(f):
            p, k = exp_parts(min(max(-gu[t, i], np.float32(-87.0)), np.float32(88.0)))
            o[i] = p
            ebits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
        for i in range(f):
            o[i] = gu[t, i] / fma32(o[i], fb[i], np.float32(1)) * gu[t, f + i]


@njit(**_KW)
def over_one_plus_exp(x, y, out, n, pbuf, ebits):
    """out[i] = x[i] / (1 + exp(-y[i])) for i < n (x may be y; out must be neither): silu(x)
    with y = x, a sigmoid gate, gelu-tanh's x sigmoid(2u). exp(-y) = p 2**k by exp_parts, the
    argument clamped to [-87, 88] (finite f32), 2**k built in the exponent bits of ebits (k in
    [-125, 127]: the value ldexp gives), p kept in pbuf; _silu_mul's arithmetic, in loops that
    vectorise (no loop writes an array it reads at another index, which would fail LLVM's
    overlap check and run the scalar loop)."""
    fb = ebits.view(np.float32)
    for i in range(n):
        p, k = exp_parts(min(max(-y[i], np.float32(-87.0)), np.float32(88.0)))
        pbuf[i] = p
        ebits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    for i in range(n):
        out[i] = x[i] / fma32(pbuf[i], fb[i], np.float32(1))


def rope_powers(theta: float, dim: int) -> np.ndarray:
    """theta ** e [dim / 2] in f32 for RoPE's exponents e = f32(2 i) / f32(dim), as transformers
    computes them: the power in float64 by the C library's pow (correctly rounded or within an
    ulp of it, on x86 and aarch64 alike), rounded to f32 once. The callers take 1 / power in f32,
    as transformers does (torch's f32 power agrees with this one for 99.6% of frequencies, 1640
    measured). numpy's f32 power, used before, dispatches to SVML on AVX-512 (1 ulp off for 5 of
    SmolLM2's 32 frequencies; its f64 power for ~7% of exponents), so the tables followed the
    CPU; every power of the models tested lies far enough from f32's rounding points that this
    table is the same on every CPU (tests/test_cpu_paths.py)."""
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)  # [dim / 2]
    return np.array([math.pow(float(theta), float(e)) for e in exps], np.float64).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [T, H, D] rotated by the cos/sin rows [*, D/2] of positions [T]; a new array."""
    out = np.empty(x.shape, np.float32)
    _rope(x, cos, sin, positions.astype(np.int64, copy=False), out)
    return out


@njit(**_KW)
def _silu_chunk(c, gu, f, out):
    # rows [c PAR_ROWS, (c + 1) PAR_ROWS) of silu_mul, one launch each (kernels/parallel.py)
    _silu_mul(gu[c * PAR_ROWS : (c + 1) * PAR_ROWS], f, out[c * PAR_ROWS : (c + 1) * PAR_ROWS])


def silu_mul(gu: np.ndarray, f: int) -> np.ndarray:
    """gu [T, 2F] = [gate | up] -> silu(gate) * up [T, F]."""
    h = np.empty((gu.shape[0], f), np.float32)
    if gu.shape[0] > PAR_ROWS:
        run_parallel((gu.shape[0] + PAR_ROWS - 1) // PAR_ROWS, _silu_chunk, (gu, f, h))
    else:
        _silu_mul(gu, f, h)
    return h


@njit(**_KW, inline="always")
def quantize_row(x, codes, top):
    """codes[i] = rint(x[i] / scale) clipped to [-top, top], scale = max |x| / top (float32
    divisions; a zero row: scale 0, codes 0); returns scale. The int8 KV cache's rule with top
    127, v3's 4-bit key codes' with 7 (attention.codes4)."""
    a = np.float32(0)
    for i in range(x.shape[0]):
        a = max(a, abs(x[i]))
    sc = a / np.float32(top)
    safe = sc if sc > np.float32(0) else np.float32(1)
    for i in range(x.shape[0]):
        q = np.float32(np.rint(x[i] / safe))
        codes[i] = np.int8(min(max(q, np.float32(-top)), np.float32(top)))
    return sc


@njit(**_KW)
def _quant_rows(x, codes, scale):
    for r in range(x.shape[0]):
        scale[r] = quantize_row(x[r], codes[r], 127)


def quantize_int8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [..., D] -> (codes int8 [..., D], scale f32 [...]): scale = absmax / 127 per row,
    codes = rint(x / scale) clipped to +-127 (all-zero rows: scale 0, codes 0). One compiled
    pass instead of ~8 numpy calls: the int8 cache quantises every appended K/V row and every
    decode query, ~1 ms per token of numpy overhead on the default model."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # [R, D]
    codes = np.empty(x2.shape, np.int8)
    scale = np.empty(x2.shape[0], np.float32)
    _quant_rows(x2, codes, scale)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


@njit(**_KW)
def _f16_rows(x, dst, start):
    for kh in range(x.shape[0]):
        for t in range(x.shape[1]):
            for d in range(x.shape[2]):
                dst[kh, start + t, d] = f16_bits(x[kh, t, d])


def store_f16_rows(x: np.ndarray, dst: np.ndarray, start: int) -> None:
    """dst[:, start : start + T] = x (f32 [KVH, T, D], any strides) as IEEE half bits (uint16),
    rounded to nearest even as numpy's astype(float16) and the fused decode step's store round.
    One compiled pass: numpy's conversion of a strided [KVH, T, D] view took ~1.4 ms for each of
    a 512-token prefill chunk's K and V on a Qwen3-1.7B shape."""
    _f16_rows(x, dst, np.int64(start))
