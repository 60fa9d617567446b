"""Prefill GEMM (sparrow.kernels.matmul.gemm via linear for T > SMALL_T): accuracy on every
format and odd size, the exact summation order (sequential fma over k), and bit-identical
results whatever the thread count or the batch a row is computed in."""

import numba
import numpy as np
import pytest

from sparrow.kernels.linear import SMALL_T, linear
from sparrow.kernels.matmul import gemm as gemm
from sparrow.quant import Weight
from weights import acts, make

FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
# O: below one panel, one panel and a tail, several panels; K: 1 to 19 blocks
SHAPES = ((37, 32), (21, 96), (5, 576), (gemm.NR * 2 + 7, 608))
TS = (9, 13, 37, 515)  # T: one x block and tails, several blocks, 515 = 64 blocks + 3


def fma32(p, c):
    """f32 fma(a, b, c) = fl32(a b + c) from p = a b in float64 (exact for f32 a, b) and f32 c.

    s = p + c in f64 and its TwoSum error e give the exact p + c = s + e. Rounding s to f32
    is the correct rounding of s + e except when s is exactly halfway between two f32 (|e| is
    below half an f64 ulp of s, and every f32 midpoint is an f64), where the sign of e decides.
    """
    a = np.asarray(c, np.float32).astype(np.float64)
    s = p + a
    bb = s - p
    e = (p - (s - bb)) + (a - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
    tie = (r64 != s) & ((r64 + other.astype(np.float64)) * 0.5 == s) & (e != 0)
    up = np.where(e > 0, np.maximum(r, other), np.minimum(r, other))
    return np.where(tie, up, r)


def fma_order_reference(x, wf):
    """y[t, o] = fl(...fl(fl(x[t,0] w[o,0]) + x[t,1] w[o,1]) ...): one f32 fma per k, in order."""
    acc = np.zeros((x.shape[0], wf.shape[0]), np.float32)  # [T, O]
    for k in range(x.shape[1]):
        acc = fma32(x[:, k, None].astype(np.float64) * wf[None, :, k].astype(np.float64), acc)
    return acc


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_against_reference(qtype, shape):
    w = make(qtype, shape)
    wf = w.dequantize().astype(np.float64)
    for t in TS:
        x = acts(t, shape[1])
        out = np.full((t, shape[0]), np.nan, np.float32)
        y = linear(x, w, out=out)
        assert y is out
        exact = x.astype(np.float64) @ wf.T
        scale = np.abs(x).astype(np.float64) @ np.abs(wf).T  # sum |x w|
        assert np.all(np.abs(y - exact) <= 2e-6 * scale + 1e-30)


@pytest.mark.parametrize("qtype", ("f32", "f16", "bf16"))
def test_float_k_not_multiple_of_32(qtype):
    w = make(qtype, (gemm.NR + 5, 50))
    wf = w.dequantize()
    for t in (9, 37):
        x = acts(t, 50)
        y = linear(x, w)
        scale = np.abs(x).astype(np.float64) @ np.abs(wf.astype(np.float64)).T
        assert np.all(np.abs(y - x.astype(np.float64) @ wf.astype(np.float64).T) <= 2e-6 * scale)
        assert np.array_equal(bits(y), bits(fma_order_reference(x, wf)))


@pytest.mark.parametrize("qtype", FORMATS)
def test_packed_panels_equal_dequantize(qtype):
    # x = identity: y[t, o] = 0 + ... + 1 * w[o, t] + 0 * ... is w[o, t] exactly (a -0 weight
    # comes out +0, hence value rather than bit equality)
    for shape in ((gemm.NR * 2 + 7, 96), (5, 608)) + (((37, 50),) if qtype in ("f32", "f16", "bf16") else ()):
        w = make(qtype, shape, seed=7)
        y = linear(np.eye(shape[1], dtype=np.float32), w)
        assert np.array_equal(y.T, w.dequantize())


@pytest.mark.parametrize("qtype", FORMATS)
def test_exact_summation_order(qtype):
    # Bit for bit a sequential fma over k on the dequantised weights: packing is exact and
    # neither tiles nor tails change the order.
    shape = (gemm.NR + 7, 96)
    w = make(qtype, shape, seed=3)
    x = acts(gemm.MR * 2 + 5, shape[1], seed=4)
    assert np.array_equal(bits(linear(x, w)), bits(fma_order_reference(x, w.dequantize())))


def test_reference_rounds_ties_by_the_error():
    # acc = 1 + 2^-23, then + 2^-24 (1 + 2^-18)(1 - 2^-18) = 2^-24 - 2^-60: f64 rounds the sum
    # to the f32 midpoint 1 + 2^-23 + 2^-24; the exact value lies below it, so one fma gives
    # 1 + 2^-23 where rounding the f64 sum again (ties to even) would give 1 + 2^-22.
    x = np.tile(np.array([[1 + 2.0**-23, 2.0**-24 * (1 + 2.0**-18)]], np.float32), (SMALL_T + 1, 1))
    w = np.array([[1.0, 1 - 2.0**-18]], np.float32)
    want = np.float32(1 + 2.0**-23)
    assert np.all(fma_order_reference(x, w) == want)
    assert np.all(linear(x, Weight.from_array(w)) == want)
    x = np.tile(np.array([[1.0, 2.0**-24]], np.float32), (SMALL_T + 1, 1))  # exact tie: to even
    assert np.all(fma_order_reference(x, np.ones((1, 2), np.float32)) == 1)
    assert np.all(linear(x, Weight.from_array(np.ones((1, 2), np.float32))) == 1)


@pytest.mark.parametrize("qtype", FORMATS)
def test_thread_and_batch_invariance(qtype):
    shape = (gemm.NR * 3 + 5, 576)
    w = make(qtype, shape, seed=5)
    x = acts(515, shape[1], seed=6)
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        y1 = linear(x, w)
        if numba.config.NUMBA_NUM_THREADS >= 2:
            numba.set_num_threads(2)
            assert np.array_equal(bits(linear(x, w)), bits(y1))
    finally:
        numba.set_num_threads(old)
    assert np.array_equal(bits(linear(x, w)), bits(y1))
    # rows at the start, straddling x blocks and in the tail, computed in a T = 9 batch
    for r0 in (0, 3, 506):
        xs = np.ascontiguousarray(x[r0 : r0 + SMALL_T + 1])
        assert np.array_equal(bits(linear(xs, w)), bits(y1[r0 : r0 + SMALL_T + 1]))
    xr = x.copy()
    xr.flags.writeable = False  # read-only activations compile to another type, same bits
    assert np.array_equal(bits(linear(xr, w)), bits(y1))


def test_reused_scratch_and_other_threads():
    # The packing buffers are kept per calling thread and reused: results must not depend on
    # what an earlier call (a larger T or K, another format) left in them, nor on the thread.
    import threading

    cases = [("q4_1", (gemm.NR * 2 + 7, 608), 515), ("f16", (37, 50), 9), ("q8_0", (gemm.NR + 7, 96), 13)]
    first = [linear(acts(t, s[1], seed=8), make(q, s, seed=9)) for q, s, t in cases]
    for (q, s, t), y in zip(reversed(cases), reversed(first)):
        assert np.array_equal(bits(linear(acts(t, s[1], seed=8), make(q, s, seed=9))), bits(y))
    got = []

    def run():
        got.extend(linear(acts(t, s[1], seed=8), make(q, s, seed=9)) for q, s, t in cases)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(got, first)) and len(got) == len(cases)
