"""ggml's 5-bit and K-quant formats (q5_0, q5_1, q4_k, q5_k, q6_k): storage and numpy
dequantisation bit for bit against gguf.quants, and every kernel path (widen_row, the decode
row dots, the prefill GEMM) against that reference."""

import gguf
import numba
import numpy as np
import pytest
from test_gemm import bits, fma32, fma_order_reference

from sparrow.errors import SparrowError
from sparrow.kernels import linear as L
from sparrow.kernels.formats import BLOCK_BYTES, BLOCK_VALUES, KIND
from sparrow.kernels.matmul import widen as _widen
from sparrow.kernels.matmul.widen import F16_LUT, call_slp, widen_row
from sparrow.quant import Weight
from weights import acts

GT = gguf.GGMLQuantizationType
KQ_TYPES = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
PREFILL_T = L.SMALL_T + 13


def _f16_bytes(a):
    a = np.asarray(a, np.float32)
    return a.reshape(-1).astype(np.float16).view(np.uint8).reshape(a.shape + (2,))


def make_kq(qtype, shape, seed=0):
    """A Weight of random blocks: uniform codes, sane f16 scales (values ~0.01..0.5)."""
    out, k = shape
    bb, nb = BLOCK_BYTES[qtype], k // BLOCK_VALUES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (out, nb, bb), dtype=np.uint8)
    u = lambda lo, hi: rng.uniform(lo, hi, (out, nb)) * rng.choice([-1, 1], (out, nb))  # noqa: E731
    if qtype == "q6_k":
        raw[:, :, 208:210] = _f16_bytes(u(2e-4, 1e-3))
    elif qtype in ("q4_k", "q5_k"):
        raw[:, :, 0:2] = _f16_bytes(np.abs(u(1e-3, 1e-2)))
        raw[:, :, 2:4] = _f16_bytes(np.abs(u(1e-3, 1e-2)))
    else:
        raw[:, :, 0:2] = _f16_bytes(u(5e-3, 2e-2))
        if qtype == "q5_1":
            raw[:, :, 2:4] = _f16_bytes(u(0, 0.2))
    return Weight(qtype, raw.reshape(out, -1), shape)


# ---------------------------------------------------------------- storage and dequantisation


@pytest.mark.parametrize("qtype", KQ_TYPES)
@pytest.mark.parametrize("rows,nb", [(1, 1), (7, 3), (37, 2)])
def test_dequantize_matches_gguf(qtype, rows, nb):
    # Fully random bytes: every f16 scale pattern (subnormal, 65504, -0, inf, NaN) and every
    # 6-bit scale / min and code; bit patterns compared, NaNs included.
    bb, bs = BLOCK_BYTES[qtype], BLOCK_VALUES[qtype]
    raw = np.random.default_rng(rows * 10 + nb).integers(0, 256, (rows, nb * bb), dtype=np.uint8)
    # and the extreme scales on purpose, in the first block of the first rows
    at = 208 if qtype == "q6_k" else 0
    for r, v in zip(range(rows), (65504.0, -65504.0, 6e-8, 0.0, -0.0, 1e-4, np.inf)):
        raw[r, at : at + 2] = _f16_bytes(np.float32(v))
        if qtype in ("q5_1", "q4_k", "q5_k"):
            raw[r, 2:4] = _f16_bytes(np.float32(-v))
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(raw, GT[qtype.upper()]).reshape(rows, nb * bs)
        w = Weight.from_gguf(raw, GT[qtype.upper()], (rows, nb * bs))
        got = w.dequantize()
        assert w.qtype == qtype and w.shape == (rows, nb * bs) and w.nbytes == raw.nbytes
        assert np.shares_memory(w.data, raw)  # the stored bytes, not a copy
        assert np.array_equal(bits(got), bits(ref))
        ids = np.array([rows - 1, 0, rows // 2])
        assert np.array_equal(bits(w.rows(ids)), bits(ref[ids]))


def test_from_gguf_errors_name_the_tensor():
    with pytest.raises(SparrowError, match=r"tensor 'blk.0.ffn_down.weight'.*q4_k.*256"):
        Weight.from_gguf(np.zeros((2, 144), np.uint8), GT.Q4_K, (2, 288), name="blk.0.ffn_down.weight")
    with pytest.raises(SparrowError, match=r"tensor 'x'.*I32"):
        Weight.from_gguf(np.zeros((2, 32), np.int32), GT.I32, (2, 32), name="x")
    with pytest.raises(SparrowError):
        Weight("q6_k", np.zeros((2, 210), np.uint8), (2, 512))  # bytes for one block, not two
    with pytest.raises(SparrowError):
        make_kq("q4_k", (2, 256)).quantize("q4_k" + "x")
    assert make_kq("q6_k", (2, 256)).quantize("q6_k").qtype == "q6_k"


def test_iq4_nl_falls_back_to_q8_0():
    # A type without a native kernel: dequantised by gguf.quants and requantised (README table)
    raw = np.random.default_rng(3).integers(0, 256, (3, 2 * 18), dtype=np.uint8)
    raw.reshape(3, 2, 18)[:, :, 0:2] = _f16_bytes(np.full((3, 2), 0.01, np.float32))
    w = Weight.from_gguf(raw, GT.IQ4_NL, (3, 64))
    ref = gguf.quants.dequantize(raw, GT.IQ4_NL).reshape(3, 64)
    assert w.qtype == "q8_0"
    step = np.abs(ref).reshape(3, -1, 32).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(w.dequantize() - ref).reshape(3, -1, 32) <= 0.57 * step)


# ---------------------------------------------------------------- kernels

SHAPES = {"q5_0": ((37, 96), (5, 608), (3, 32)), "q5_1": ((37, 96), (5, 608), (3, 32))}
SHAPES.update({q: ((37, 256), (21, 768), (5, 1536)) for q in ("q4_k", "q5_k", "q6_k")})


@pytest.mark.parametrize("qtype", KQ_TYPES)
def test_widen_row_bit_exact(qtype):
    # widen_row packs the prefill GEMM's panels and feeds the MoE experts
    for shape in SHAPES[qtype]:
        w = make_kq(qtype, shape, seed=shape[1])
        full = w.dequantize()
        out = np.full_like(full, np.nan)
        for o in range(len(out)):
            call_slp(widen_row, w.data[o], KIND[qtype], F16_LUT, out[o], out[o].view(np.uint32), True)
        assert np.array_equal(bits(out), bits(full))
    # every byte random: extreme f16 scales (subnormal, 65504, inf, NaN), all 6-bit scales
    bb, bs = BLOCK_BYTES[qtype], BLOCK_VALUES[qtype]
    raw = np.random.default_rng(15).integers(0, 256, (64, 2 * bb), dtype=np.uint8)
    w = Weight(qtype, raw, (64, 2 * bs))
    with np.errstate(all="ignore"):
        full = w.dequantize()
    out = np.full_like(full, np.nan)
    for o in range(len(out)):
        call_slp(widen_row, w.data[o], KIND[qtype], F16_LUT, out[o], out[o].view(np.uint32), True)
    nan = np.isnan(full)
    assert np.array_equal(np.isnan(out), nan) and np.array_equal(bits(out)[~nan], bits(full)[~nan])


@pytest.mark.parametrize("qtype", KQ_TYPES)
def test_linear_against_reference(qtype):
    for shape in SHAPES[qtype]:
        w = make_kq(qtype, shape, seed=1)
        wf = w.dequantize().astype(np.float64)
        for t in (1, 3, PREFILL_T):
            x = acts(t, shape[1])
            y = L.linear(x, w)
            exact = x.astype(np.float64) @ wf.T
            scale = np.abs(x).astype(np.float64) @ np.abs(wf).T
            assert np.all(np.abs(y - exact) <= 2e-6 * scale + 1e-30)


@pytest.mark.parametrize("qtype", KQ_TYPES)
def test_identity_rows_give_the_weights(qtype):
    # x = identity rows: y[t, o] is w[o, t] exactly on both paths (value equality: a -0
    # weight comes out +0). The decode path adds the offset term after the scaled codes,
    # which is the reference's own order: (d sc) q - dmin m.
    shape = SHAPES[qtype][1]
    w = make_kq(qtype, shape, seed=2)
    full = w.dequantize()
    eye = np.eye(shape[1], dtype=np.float32)
    for r0 in range(0, shape[1], L.SMALL_T):
        assert np.array_equal(L.linear(eye[r0 : r0 + L.SMALL_T], w).T, full[:, r0 : r0 + L.SMALL_T])
    assert np.array_equal(L.linear(eye, w).T, full)


def k_scales_mins(blk):
    """q4_k / q5_k super-blocks [O, nb, bb] uint8 -> the 6-bit (scales, mins) [O, nb, 8] int64."""
    sb = blk[:, :, 4:16].astype(np.int64)
    sc = np.empty(sb.shape[:2] + (8,), np.int64)
    mn = np.empty_like(sc)
    for s in range(8):
        if s < 4:
            sc[..., s], mn[..., s] = sb[..., s] & 63, sb[..., s + 4] & 63
        else:
            sc[..., s] = (sb[..., s + 4] & 15) | ((sb[..., s - 4] >> 6) << 4)
            mn[..., s] = (sb[..., s + 4] >> 4) | ((sb[..., s] >> 6) << 4)
    return sc, mn


def _unpack(qtype, raw, k):
    """(codes [O, K] f32 as the row dots multiply them, scale per unit [O, K / n] f32, unit
    size n, offset coefficient per 32 values [O, K / 32] f32 or None): an independent decode
    of the layouts in sparrow.quant's docstring."""
    o = raw.shape[0]
    blk = raw.reshape(o, -1, BLOCK_BYTES[qtype])
    f16 = lambda a: np.ascontiguousarray(blk[:, :, a : a + 2]).view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if qtype in ("q5_0", "q5_1"):
        at = 2 if qtype == "q5_0" else 4
        qh = np.ascontiguousarray(blk[:, :, at : at + 4]).view(np.uint32)  # [O, nb, 1]
        qs = blk[:, :, at + 4 : at + 20].astype(np.uint32)
        nib = np.concatenate([qs & 15, qs >> 4], axis=2)  # [O, nb, 32]
        q = nib | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4)
        d = f16(0)
        c = d * np.float32(-16) if qtype == "q5_0" else f16(2)
        return q.reshape(o, k).astype(np.float32), d, 32, c
    if qtype in ("q4_k", "q5_k"):
        sc, mn = k_scales_mins(blk)
        qo = 16 if qtype == "q4_k" else 48
        q = np.empty(blk.shape[:2] + (256,), np.int64)
        for s in range(8):
            nib = blk[:, :, qo + 32 * (s // 2) : qo + 32 * (s // 2) + 32].astype(np.int64)
            q[..., 32 * s : 32 * s + 32] = (nib >> (4 * (s % 2))) & 15
            if qtype == "q5_k":
                q[..., 32 * s : 32 * s + 32] |= ((blk[:, :, 16:48].astype(np.int64) >> s) & 1) << 4
        dl = f16(0)[..., None] * sc.astype(np.float32)
        ml = f16(2)[..., None] * mn.astype(np.float32)
        return q.reshape(o, k).astype(np.float32), dl.reshape(o, -1), 32, -ml.reshape(o, -1)
    q = np.empty(blk.shape[:2] + (256,), np.int64)
    for h in range(2):
        for s in range(4):
            ql = blk[:, :, 64 * h + 32 * (s & 1) : 64 * h + 32 * (s & 1) + 32].astype(np.int64)
            qh = blk[:, :, 128 + 32 * h : 160 + 32 * h].astype(np.int64)
            q[..., 128 * h + 32 * s : 128 * h + 32 * s + 32] = (
                ((ql >> (4 * (s >> 1))) & 15) | (((qh >> (2 * s)) & 3) << 4)
            ) - 32
    sc = np.ascontiguousarray(blk[:, :, 192:208]).view(np.int8).astype(np.float32)
    return q.reshape(o, k).astype(np.float32), (f16(208)[..., None] * sc).reshape(o, -1), 16, None


def rowdot_order_reference(qtype, w, x):
    """y [O] for one x row [K], emulating the row dots' f32 operations in order (module doc
    of sparrow.kernels.matmul.kquants): per unit of n values, t = q . x in 16 lanes, acc[u % 2] =
    fma(t, scale, acc[u % 2]); offsets fma'd into a scalar in order; then the pairwise sum."""
    q, scale, n, c = _unpack(qtype, w.data, w.shape[1])
    f64 = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731
    acc = [np.zeros((w.shape[0], 16), np.float32) for _ in range(2)]
    for u in range(w.shape[1] // n):
        a, xs = q[:, u * n : u * n + n], x[u * n : u * n + n]
        t = (a[:, :16] * xs[:16]).astype(np.float32)  # one f32 product: exact in f32 rounding
        if n == 32:
            t = fma32(f64(a[:, 16:]) * f64(xs[16:]), t)
        acc[u % 2] = fma32(f64(t) * f64(scale[:, u])[:, None], acc[u % 2])
    v = (acc[0] + acc[1]).astype(np.float32)
    while v.shape[1] > 1:
        v = (v[:, : v.shape[1] // 2] + v[:, v.shape[1] // 2 :]).astype(np.float32)
    accm = np.zeros(w.shape[0], np.float32)
    if c is not None:
        sx = np.zeros(w.shape[1] // 32, np.float32)
        for j in range(32):
            sx = (sx + x[j::32]).astype(np.float32)
        for b in range(len(sx)):
            accm = fma32(f64(c[:, b]) * np.float64(sx[b]), accm)
    return (v[:, 0] + accm).astype(np.float32)


@pytest.mark.parametrize("qtype", KQ_TYPES)
def test_decode_exact_operation_order(qtype):
    # the decode kernels, bit for bit, against a numpy emulation of their documented order
    for shape in SHAPES[qtype]:
        w = make_kq(qtype, shape, seed=4)
        x = acts(3, shape[1], seed=5)
        y = L.linear(x, w)
        for t in range(3):
            assert np.array_equal(bits(y[t]), bits(rowdot_order_reference(qtype, w, x[t])))


@pytest.mark.parametrize("qtype", KQ_TYPES)
def test_prefill_exact_summation_order(qtype):
    # a sequential fma over k on the dequantised weights, as for every other format
    w = make_kq(qtype, SHAPES[qtype][0], seed=6)
    x = acts(11, w.shape[1], seed=7)
    assert np.array_equal(bits(L.linear(x, w)), bits(fma_order_reference(x, w.dequantize())))


@pytest.mark.parametrize("qtype", KQ_TYPES)
def test_batch_and_thread_invariance(qtype):
    shape = SHAPES[qtype][1]
    w = make_kq(qtype, shape, seed=8)
    x = acts(L.SMALL_T, shape[1], seed=9)
    xp = acts(PREFILL_T, shape[1], seed=10)
    y, yp = L.linear(x, w), L.linear(xp, w)
    for i in range(x.shape[0]):
        assert np.array_equal(bits(L.linear(x[i : i + 1].copy(), w)[0]), bits(y[i]))
        assert np.array_equal(bits(L.linear(x[i : i + 3].copy(), w)[0]), bits(y[i]))
    # the parallel and serial decode kernels (matvec_widened picks by size) give the same bits
    yk = np.empty_like(y)
    addrs = (_widen.exact_rows_address(w.data), _widen.kq_rows_address(w.data))
    _widen._matvec_rows(addrs, w.data, KIND[qtype], x, yk, True)
    assert np.array_equal(bits(yk), bits(y))
    threads = numba.get_num_threads()
    try:
        for n in (1, 2):
            if n <= numba.config.NUMBA_NUM_THREADS:
                numba.set_num_threads(n)
                _widen._matvec_rows(addrs, w.data, KIND[qtype], x, yk, True)
                assert np.array_equal(bits(yk), bits(y))
                assert np.array_equal(bits(L.linear(xp, w)), bits(yp))
    finally:
        numba.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k", "q5_0", "q5_1"])
def test_rows_taken_together_keep_each_rows_bits(qtype):
    """The row loop takes q4_k / q5_k rows two at a time (ir.make_rows' together), a unit of
    each in turn: over even and odd row ranges each row's value is the one a range of that row
    alone gives (its own path), for every K-quant-module format."""
    size = 32 if qtype in ("q5_0", "q5_1") else 256
    for n in (1, 3):
        w = make_kq(qtype, (23, size * n), seed=n + 20)
        x = acts(1, size * n, seed=n + 21)
        sx = _widen.exact_sums(x, KIND[qtype], True)
        kq = _widen.kq_rows_address(w.data)
        alone = np.full((1, 23), np.nan, np.float32)
        for o in range(23):
            _widen.rows_exact(w.data, KIND[qtype], x, sx, alone, o, o + 1, kq)
        for o0, o1 in ((0, 23), (1, 23), (3, 19), (4, 6), (7, 8)):
            y = np.full((1, 23), np.nan, np.float32)
            _widen.rows_exact(w.data, KIND[qtype], x, sx, y, o0, o1, kq)
            assert np.array_equal(bits(y[:, o0:o1]), bits(alone[:, o0:o1])), (n, o0, o1)
            assert np.isnan(y[:, :o0]).all() and np.isnan(y[:, o1:]).all()


def test_concat_rows_keeps_the_format():
    a, b = make_kq("q4_k", (37, 512), seed=12), make_kq("q4_k", (5, 512), seed=13)
    c = Weight.concat_rows([a, b])
    assert c.qtype == "q4_k" and c.shape == (42, 512)
    x = acts(2, 512)
    assert np.array_equal(bits(L.linear(x, c)[:, 37:]), bits(L.linear(x, b)))


# ---------------------------------------------------------------- loading


def test_gguf_loader_refuses_types_it_cannot_run():
    from types import SimpleNamespace

    from sparrow.loaders.gguf import gguf_tensors
    from sparrow.loaders.gguf_file import GGUFTensor

    cfg = SimpleNamespace(architecture="qwen3", num_hidden_layers=1, mtp_layers=0)  # the ModelConfig fields read
    bad = GGUFTensor("blk.0.ffn_down.weight", (256, 2), GT.Q8_K, np.zeros((2, 292), np.uint8))
    with pytest.raises(SparrowError, match=r"^m.gguf: tensor 'blk.0.ffn_down.weight' has GGML type Q8_K, which"):
        gguf_tensors(SimpleNamespace(path="/x/m.gguf", tensors=[bad]), cfg)
    raw = make_kq("q4_k", (2, 256)).data
    ok = GGUFTensor("blk.0.ffn_down.weight", (256, 2), GT.Q4_K, raw)
    w = gguf_tensors(SimpleNamespace(path="m.gguf", tensors=[ok]), cfg)["model.layers.0.mlp.down_proj.weight"]
    w = w.to_weight()
    assert w.qtype == "q4_k" and np.shares_memory(w.data, raw)


def test_k_quant_gguf_matches_transformers(tmp_path):
    """A Q4_K_M-style file (q4_k, q6_k; sparrow_lab.bench.shapes' writer, random weights) against
    transformers loading the same GGUF (it dequantises with gguf.quants): prefill and decode
    max |diff| <= 1e-4 [measured 1.2e-6], top-1 identical."""
    import torch
    from transformers import AutoModelForCausalLM

    import sparrow
    from conftest import decode_logits
    from sparrow_lab.bench import shapes

    tiny_k = dict(
        hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512, tied=True,
        rope_theta=1e6, rms_eps=1e-6, context=256,
    )  # fmt: skip
    path = shapes.write_gguf(str(tmp_path / "tiny-k.gguf"), tiny_k, "q4_k_m", name="tiny")
    llm = sparrow.load(path, threads=1)
    kinds = {w.qtype for lay in llm.model.layers for w in (lay.attn.o, lay.mlp.down)} | {llm.model.embed.qtype}
    assert kinds == {"q4_k", "q6_k"}
    # transformers' GGUF config mapping leaves qwen3's head_dim at its default; give it
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-k.gguf", dtype=torch.float32, head_dim=64)
    ids = np.random.default_rng(14).integers(0, 486, 40)
    with torch.no_grad():
        ref = hf.eval()(torch.tensor(ids)[None]).logits[0].numpy()
    for got in (llm.logits(ids), decode_logits(llm, ids)):
        assert np.abs(got - ref).max() <= 1e-4
        assert np.array_equal(got.argmax(-1), ref.argmax(-1))
