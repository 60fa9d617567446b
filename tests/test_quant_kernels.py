"""Weight storage formats (sparrow.quant) and the linear kernels (sparrow.kernels.linear)."""

import gguf
import numba
import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.kernels import linear as L
from sparrow.kernels.formats import KIND
from sparrow.kernels.matmul.widen import F16_LUT, call_slp, widen_row
from sparrow.quant import Weight, f32_to_bf16_bits, quantize_blocks
from weights import acts, make

GT = gguf.GGMLQuantizationType
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
SHAPES = ((37, 64), (37, 96), (21, 576), (5, 32), (19, 608))  # 1 to 19 blocks, odd and even
PREFILL_T = L.SMALL_T + 13


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_against_reference(qtype, shape):
    w = make(qtype, shape)
    wf = w.dequantize().astype(np.float64)
    for t in (1, 3, PREFILL_T):
        x = acts(t, shape[1])
        y = L.linear(x, w)
        assert y.dtype == np.float32 and y.shape == (t, shape[0])
        exact = x.astype(np.float64) @ wf.T
        scale = np.abs(x).astype(np.float64) @ np.abs(wf).T  # sum |x w|
        # Activations stay f32 on every path: only f32 summation rounding separates y from
        # the float64 product of the dequantised weights.
        assert np.all(np.abs(y - exact) <= 2e-6 * scale + 1e-30)


def test_float_tail_and_out_buffer():
    for qtype in ("f32", "f16", "bf16"):
        w = make(qtype, (37, 50))  # in not a multiple of 32
        wf = w.dequantize().astype(np.float64)
        for t in (3, PREFILL_T):
            x = acts(t, 50)
            out = np.full((t, 37), np.nan, np.float32)
            y = L.linear(x, w, out=out)
            assert y is out
            scale = np.abs(x).astype(np.float64) @ np.abs(wf).T
            assert np.all(np.abs(y - x.astype(np.float64) @ wf.T) <= 2e-6 * scale)
    assert L.linear(np.zeros((0, 50), np.float32), w).shape == (0, 37)
    with pytest.raises(ValueError):
        L.linear(np.zeros((2, 50), np.float64), w)


@pytest.mark.parametrize("qtype", FORMATS)
def test_batch_and_thread_invariance(qtype):
    w = make(qtype, (37, 96), seed=3)
    x = acts(L.SMALL_T, 96, seed=4)
    y = L.linear(x, w)
    for i in range(x.shape[0]):
        assert np.array_equal(L.linear(x[i : i + 1].copy(), w)[0], y[i])
        assert np.array_equal(L.linear(x[i : i + 3].copy(), w)[0], y[i])
    threads = numba.get_num_threads()
    try:
        for n in (1, 2):
            if n <= numba.config.NUMBA_NUM_THREADS:
                numba.set_num_threads(n)
                assert np.array_equal(L.linear(x, w), y)
                assert np.array_equal(L.linear(x[:1].copy(), w), y[:1])
    finally:
        numba.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_several_x_rows_share_each_block_with_one_rows_bits(qtype):
    """T = 2..SMALL_T x rows take the multi-row dots (each block decoded once for every x row):
    every x row gets the bits it gets alone, with blocks in groups of 16 and odd or even tails
    (17, 18, 33 and 37 blocks), on a row slice of the output and on 1 and 2 threads."""
    from sparrow.kernels.matmul import widen

    assert widen.MULTI_T == L.SMALL_T
    for nb in (17, 18, 33, 37):
        w = make(qtype, (29, 32 * nb), seed=nb)
        x = acts(L.SMALL_T, 32 * nb, seed=nb + 1)
        x[1, 7] = 1e30  # one huge value: any mixing of x rows would show in the others
        alone = np.stack([L.linear(x[i : i + 1].copy(), w)[0] for i in range(L.SMALL_T)])
        for t in range(2, L.SMALL_T + 1):
            got = L.linear(x[:t].copy(), w)
            assert np.array_equal(got.view(np.uint32), alone[:t].view(np.uint32)), (nb, t)
        sx = widen.exact_sums(x, KIND[qtype], None)
        y = np.full((L.SMALL_T, 40), np.nan, np.float32)
        widen.rows_exact(w.data, KIND[qtype], x, sx, y[:, 3:32], 5, 21, 0)  # rows 5..20 only
        assert np.array_equal(y[:, 8:24].view(np.uint32), alone[:, 5:21].view(np.uint32))
        assert np.isnan(y[:, :8]).all() and np.isnan(y[:, 24:]).all()
    threads = numba.get_num_threads()
    try:
        for n in (1, 2):
            if n <= numba.config.NUMBA_NUM_THREADS:
                numba.set_num_threads(n)
                got = L.linear(x[:5].copy(), w)
                assert np.array_equal(got.view(np.uint32), alone[:5].view(np.uint32))
    finally:
        numba.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_rows_taken_together_keep_each_rows_bits(qtype):
    """The row loop takes q4_0 / q4_1 rows two at a time (ir.make_rows' together), their blocks
    interleaved: over even and odd row ranges, each row's value is the one a range of that
    row alone gives (its own path, one row at a time), for blocks in groups of 16 and tails."""
    from sparrow.kernels.matmul import widen

    for nb in (17, 18, 33, 37):
        w = make(qtype, (23, 32 * nb), seed=nb)
        x = acts(1, 32 * nb, seed=nb + 2)
        sx = widen.exact_sums(x, KIND[qtype], None)
        alone = np.full((1, 23), np.nan, np.float32)
        for o in range(23):
            widen.rows_exact(w.data, KIND[qtype], x, sx, alone, o, o + 1, 0)
        for o0, o1 in ((0, 23), (1, 23), (3, 19), (4, 6), (7, 8)):
            y = np.full((1, 23), np.nan, np.float32)
            widen.rows_exact(w.data, KIND[qtype], x, sx, y, o0, o1, 0)
            assert np.array_equal(y[:, o0:o1].view(np.uint32), alone[:, o0:o1].view(np.uint32)), (nb, o0, o1)
            assert np.isnan(y[:, :o0]).all() and np.isnan(y[:, o1:]).all()


@pytest.mark.parametrize("qtype", ["f32", "q4_1"])
def test_prefill_thread_invariance(qtype):
    w = make(qtype, (37, 96), seed=10)
    x = acts(PREFILL_T, 96, seed=11)
    y = L.linear(x, w)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert np.array_equal(L.linear(x, w), y)
    finally:
        numba.set_num_threads(threads)


def test_concat_rows():
    a, b = make("q4_1", (37, 96), seed=12), make("q4_1", (5, 96), seed=13)
    c = Weight.concat_rows([a, b])
    assert c.shape == (42, 96) and np.array_equal(c.dequantize()[37:], b.dequantize())
    x = acts(2, 96)
    assert np.array_equal(L.linear(x, c)[:, :37], L.linear(x, a))
    with pytest.raises(SparrowError):
        Weight.concat_rows([a, make("q8_0", (5, 96))])


@pytest.mark.parametrize("qtype", FORMATS)
def test_widened_rows_and_embedding_rows(qtype):
    # The kernels widen stored rows to exactly Weight.dequantize()'s values. x = identity rows:
    # y[t, o] = 0 + ... + 1 * w[o, t] + ... is w[o, t] exactly (a -0 weight comes out +0, hence
    # value equality), on the decode path (T <= SMALL_T) and on the prefill path.
    w = make(qtype, (37, 96), seed=5)
    full = w.dequantize()
    eye = np.eye(96, dtype=np.float32)
    for r0 in range(0, 96, L.SMALL_T):
        assert np.array_equal(L.linear(eye[r0 : r0 + L.SMALL_T], w).T, full[:, r0 : r0 + L.SMALL_T])
    assert np.array_equal(L.linear(eye, w).T, full)
    # widen_row itself (the MoE expert kernels and the f16 / bf16 / f32 panels use it), bit for bit
    out = np.empty_like(full)
    data = w.data.view(np.uint32) if qtype == "f32" else w.data  # f32 rows as their bits
    for o in range(len(out)):
        call_slp(widen_row, data[o], KIND[qtype], F16_LUT, out[o], out[o].view(np.uint32), True)
    assert np.array_equal(out.view(np.uint32), full.view(np.uint32))
    ids = np.array([36, 0, 5, 5])
    assert np.array_equal(w.rows(ids), full[ids])
    with pytest.raises(SparrowError):
        w.rows([37])


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_block_formats_match_gguf(name):
    a = np.random.default_rng(6).standard_normal((37, 96)).astype(np.float32)
    a[3, :32] = 0  # an all-zero block
    raw = gguf.quants.quantize(a, GT[name])
    w = Weight.from_gguf(raw, GT[name], (37, 96))
    assert w.qtype == name.lower() and w.shape == (37, 96) and w.nbytes == raw.nbytes
    assert np.array_equal(w.dequantize(), gguf.quants.dequantize(raw, GT[name]))
    # our quantiser writes the same bytes as gguf's (ggml reference rounding)
    assert np.array_equal(Weight.from_array(a).quantize(name.lower()).data, raw)
    assert np.array_equal(quantize_blocks(a, name.lower()), raw)


def test_gguf_float_formats():
    a = np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32)
    assert np.array_equal(Weight.from_gguf(a, GT.F32, (5, 64)).dequantize(), a)
    h = a.astype(np.float16)
    assert np.array_equal(Weight.from_gguf(h, GT.F16, (5, 64)).dequantize(), h.astype(np.float32))
    bits = f32_to_bf16_bits(a)
    raw = bits.view(np.uint8)  # GGUFReader hands BF16 over as bytes [out, 2 * in]
    assert np.array_equal(raw, gguf.quants.quantize(a, GT.BF16))
    bf = Weight.from_gguf(raw, GT.BF16, (5, 64)).dequantize()
    assert np.array_equal(bf, gguf.quants.dequantize(raw, GT.BF16).reshape(5, 64))
    assert np.all(np.abs(bf - a) <= np.abs(a) * 2.0**-8)


def _q3_k_blocks(n_blocks, seed):
    # Random Q3_K super-blocks (110 B per 256 values, f16 d last) with a sane d.
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, 110), dtype=np.uint8)
    raw[:, 108:110] = rng.uniform(1e-3, 1e-2, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def test_gguf_q3_k_requantised_to_q8_0():
    # Q3_K has no kernel (Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 do: tests/test_kquants.py)
    raw = _q3_k_blocks(6, seed=8).reshape(3, 2 * 110)  # [3, 512] weight
    ref = gguf.quants.dequantize(raw, GT.Q3_K).reshape(3, 512)
    w = Weight.from_gguf(raw, GT.Q3_K, (3, 512))
    assert w.qtype == "q8_0" and w.shape == (3, 512)
    assert np.array_equal(w.data, quantize_blocks(ref, "q8_0"))
    step = np.abs(ref).reshape(3, -1, 32).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(w.dequantize() - ref).reshape(3, -1, 32) <= 0.57 * step)


def test_quantize_q8_0_error_bound():
    a = np.random.default_rng(9).standard_normal((37, 576)).astype(np.float32)
    for w in (Weight.from_array(a), Weight.from_bf16(f32_to_bf16_bits(a)), Weight.from_array(a.astype(np.float16))):
        src = w.dequantize()
        q = w.quantize("q8_0")
        assert q.qtype == "q8_0" and q.nbytes == 37 * 18 * 34
        # half a step from rounding plus the step's own f16 rounding (127 * 2^-11 steps)
        step = np.abs(src).reshape(37, -1, 32).max(axis=2, keepdims=True) / 127
        assert np.all(np.abs(q.dequantize() - src).reshape(37, -1, 32) <= 0.57 * step)
    assert w.quantize("f16") is w


def test_errors():
    with pytest.raises(SparrowError, match="I32"):
        Weight.from_gguf(np.zeros((2, 32), np.int32), GT.I32, (2, 32))
    with pytest.raises(SparrowError):
        Weight.from_gguf(np.zeros(8, np.uint8), 12345, (2, 4))
    with pytest.raises(SparrowError):
        Weight.from_array(np.zeros((4, 40), np.float32)).quantize("q8_0")
    with pytest.raises(SparrowError):
        Weight.from_array(np.zeros((4, 64), np.float32)).quantize("q5_0")
    with pytest.raises(SparrowError):
        Weight.from_gguf(np.zeros((4, 33), np.uint8), GT.Q8_0, (4, 64))
    with pytest.raises(SparrowError):
        Weight.from_array(np.zeros((4, 64), np.int32))


# ---------------------------------------------------------------- fused small ops (kernels.elementwise)


def test_fused_small_ops_against_numpy():
    from sparrow.kernels import elementwise as El
    from sparrow.models import layers as Ly
    from sparrow.models.rope import Rope

    rng = np.random.default_rng(20)
    x = rng.standard_normal((5, 7, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * w
    assert np.abs(Ly.rms_norm(x, w, 1e-5) - ref).max() <= 2e-6 * np.abs(ref).max()
    view = rng.standard_normal((3, 50)).astype(np.float32)[:, 5:38]  # non-contiguous rows, odd width
    v64 = view.astype(np.float64)
    ref = v64 / np.sqrt((v64**2).mean(-1, keepdims=True) + 1e-6) * w[:33]
    assert np.abs(Ly.rms_norm(view, w[:33], 1e-6) - ref).max() <= 2e-6 * np.abs(ref).max()
    # a prefill's rows (more than 2 PAR_ROWS: chunks on every thread) keep each row's bits
    many = rng.standard_normal((3 * El.PAR_ROWS + 5, 64)).astype(np.float32)
    rows = np.concatenate([Ly.rms_norm(many[i : i + 1], w, 1e-5) for i in range(len(many))])
    assert np.array_equal(Ly.rms_norm(many, w, 1e-5).view(np.uint32), rows.view(np.uint32))
    rope = Rope(64, 10000.0, None)
    pos = np.array([0, 3, 100, 7, 2000])
    got = rope.apply(x, pos)  # grows the cos / sin tables to position 2000
    c, s = rope.cos[pos][:, None, :], rope.sin[pos][:, None, :]  # [T, 1, 32]
    want = np.concatenate([x[..., :32] * c - x[..., 32:] * s, x[..., 32:] * c + x[..., :32] * s], -1)
    assert np.array_equal(got, want)  # same f32 operations, same order
    g = np.concatenate(
        [rng.standard_normal((3, 61)).astype(np.float32) * 30, np.float32([[100, -100, 0, 88.5, -88.5]] * 3)], 1
    )  # [3, 66]
    gu = np.concatenate([g, rng.standard_normal(g.shape).astype(np.float32)], 1)  # [3, 132]
    h = El.silu_mul(gu, g.shape[1])
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * gu[:, g.shape[1] :]
    assert np.all(np.abs(h - ref) <= 1e-6 * np.abs(ref) + 1e-30)
    one = El.silu_mul(gu[1:2].copy(), g.shape[1])
    assert np.array_equal(one[0], h[1])  # a row alone == that row in a batch
    big = np.concatenate([gu] * 15)  # [45, 132]: a prefill's rows, in parallel chunks of 16
    assert big.shape[0] > El.PAR_ROWS
    assert np.array_equal(El.silu_mul(big, g.shape[1]).view(np.uint32), np.concatenate([h] * 15).view(np.uint32))
