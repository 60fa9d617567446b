"""The activations="q8" mode on ggml's 5-bit and K-quant formats (q5_0 / q5_1 in
kernels/matmul/q8/groups.py, q4_k / q5_k / q6_k in kernels/matmul/q8/kquant_groups.py): the documented order bit for bit
against numpy, on this CPU's path and on the generic one, on 1 and 2 threads, a row alone
equal to that row in a batch, and fused decode equal to staged."""

import numba
import numpy as np
import pytest
from test_cpu_paths import Q8_PATHS, q8_path_matches_here
from test_gemm import bits, fma32
from test_kquants import _unpack, k_scales_mins, make_kq
from test_q8act import q8_outputs, quantize_reference, rowdot_reference

import sparrow
from sparrow.kernels.formats import BLOCK_BYTES, PREFILL_FORMATS
from sparrow.kernels.linear import SMALL_T, linear, prepare
from sparrow.kernels.matmul.q8.quantized import quantize, rows_q8
from sparrow.kernels.runtime import set_threads
from sparrow.quant import Weight
from weights import acts, make

# (format, [out, in], T): one and several super-blocks (or odd block counts for q5_*), T up
# to SMALL_T, and matvecs past the serial threshold (the parallel path)
CASES = [
    ("q5_0", (37, 96), 1),
    ("q5_1", (21, 608), 3),
    ("q4_k", (37, 256), 1),
    ("q5_k", (21, 768), 5),
    ("q6_k", (5, 1536), 8),
    ("q4_k", (2048, 2048), 1),
    ("q6_k", (1024, 4096), 2),
    ("q5_k", (24, 512), 2),
    ("q5_0", (2048, 2048), 1),
    ("q4_k", (40, 512), 37),  # prefills: AMX or zmm tiles where this host has them
    ("q6_k", (40, 512), 37),
    ("q5_0", (45, 96), 13),
    ("q5_1", (21, 608), 11),
]


def _f32(v):
    return np.asarray(v, np.float64).astype(np.float32)


def kq8_reference(x, w):
    """_kq8's module docstring in float64-emulated f32: per row, x block after x block b
    (sub-block j = b % 8 of super-block n = b // 8), an exact integer sum I (sc[j] times the
    codes' dot with x's codes; q6_k: two scaled halves of 16), acc = fma(I, d * dx[b], acc),
    q4_k / q5_k also accm = fma(-(dmin m[j]), sx[b], accm); then acc + accm."""
    t_n, k = x.shape
    o_n, ns = w.shape[0], k // 256
    xq, dx, sx = quantize_reference(x)  # [T, K] int8, [T, K / 32] f32 x2
    blk = w.data.reshape(o_n, ns, BLOCK_BYTES[w.qtype])  # [O, ns, bb]

    def half(at):
        return blk[:, :, at : at + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [O, ns]

    q = _unpack(w.qtype, w.data, k)[0].astype(np.int64)  # [O, K]: q6_k's already minus 32
    prod = q[None] * xq[:, None].astype(np.int64)  # [T, O, K]
    if w.qtype == "q6_k":
        sc = blk[:, :, 192:208].view(np.int8).astype(np.int64).reshape(o_n, k // 16)  # [O, K / 16]
        isum = (prod.reshape(t_n, o_n, k // 16, 16).sum(axis=3) * sc).reshape(t_n, o_n, k // 32, 2).sum(axis=3)
        d, neg_ml = half(208), None
    else:
        sc, mn = k_scales_mins(blk)  # [O, ns, 8]
        isum = prod.reshape(t_n, o_n, k // 32, 32).sum(axis=3) * sc.reshape(o_n, -1)  # [T, O, K / 32]
        d = half(0)
        neg_ml = -_f32(half(2)[..., None].astype(np.float64) * mn).reshape(o_n, -1)  # [O, K / 32]
    acc = np.zeros((t_n, o_n), np.float32)
    accm = np.zeros((t_n, o_n), np.float32)
    for b in range(k // 32):
        coef = _f32(d[None, :, b // 8].astype(np.float64) * dx[:, None, b])  # [T, O]
        acc = fma32(isum[:, :, b].astype(np.float64) * coef, acc)
        if neg_ml is not None:
            accm = fma32(neg_ml[None, :, b].astype(np.float64) * sx[:, None, b], accm)
    return acc if neg_ml is None else _f32(acc.astype(np.float64) + accm)


def reference(x, w):
    """The documented q8 order for any q8-mode format: _kq8's for K-quants, else _x8's."""
    return kq8_reference(x, w) if w.qtype.endswith("_k") else rowdot_reference(x, w)


def compute():
    return q8_outputs(CASES, make_kq)


def test_documented_order_bit_for_bit_any_threads_and_batch():
    assert all(t <= SMALL_T or q in PREFILL_FORMATS for q, _, t in CASES)  # q8 prefills keep the order
    out = compute()
    for i, (q, shape, t) in enumerate(CASES):
        x, w = acts(t, shape[1], seed=7), make_kq(q, shape, seed=8)
        ref = reference(x, w)
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            assert np.array_equal(bits(out[f"c{i}_{n}"]), bits(ref)), (q, shape, t, n)
        # a row alone equals that row in the batch
        assert np.array_equal(bits(linear(np.ascontiguousarray(x[-1:]), prepare(w, "q8"))), bits(ref[-1:]))


def extreme_weight(qtype, o_n=8):
    """[o_n, 512] weights of qtype at the integer sums' largest magnitudes: half the rows at
    one end of the code range, half at the other, scales (and mins) at their maximum."""
    raw = make_kq(qtype, (o_n, 512), seed=3).data.copy().reshape(o_n, -1, BLOCK_BYTES[qtype])
    h = o_n // 2
    if qtype == "q6_k":
        raw[:h, :, :192] = 0  # codes -32 (the largest |code|)
        raw[:h, :, 192:208] = 0x80  # scales -128
        raw[h:, :, :192] = 0xFF  # codes 31
        raw[h:, :, 192:208] = 0x7F
    elif qtype in ("q4_k", "q5_k"):
        raw[:, :, 4:] = 0xFF  # scales and mins 63, codes 15 (q5_k: 31)
    else:
        at = 2 if qtype == "q5_0" else 4
        raw[:h, :, at:] = 0xFF  # codes 31 (q5_0: 15)
        raw[h:, :, at:] = 0  # codes 0 (q5_0: -16)
    return Weight(qtype, raw.reshape(o_n, -1), (o_n, 512))


def extreme_x(t_n):
    """x rows at +-127 codes (all +, then alternating signs), then all zero."""
    x = np.full((t_n, 512), 7.5, np.float32)
    x[1::2, ::2] = -7.5
    x[-1] = 0
    return x


@pytest.mark.parametrize("qtype", ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_extreme_codes_and_scales(qtype):
    """All-max codes and scales against all-max x (the integer sums' largest magnitudes:
    no int16 saturation in pmaddubsw, no int32 overflow), and an all-zero x row."""
    w, x = extreme_weight(qtype), extreme_x(3)
    y = linear(x, prepare(w, "q8"))
    assert np.array_equal(bits(y), bits(reference(x, w)))
    assert np.all(y[2] == 0)


def test_prefill_in_q8_mode_on_all_but_q5_k():
    """Prefill (T > SMALL_T) in the q8 mode: q5_0, q5_1, q4_k and q6_k run the interleaved
    groups (AMX or zmm tiles where the host has them; the reference's bits either way), q5_k
    the f32 GEMM (its bits, as outside the mode)."""
    x = acts(SMALL_T + 12, 512, seed=13)
    for q in ("q4_k", "q5_0", "q5_1", "q5_k", "q6_k"):
        w = make_kq(q, (27, 512), seed=14)
        exact = linear(x, w)
        got = linear(x, prepare(w, "q8"))
        if q != "q5_k":
            assert np.array_equal(bits(got), bits(reference(x, w))), q
            assert not np.array_equal(got, exact)
        else:
            assert np.array_equal(bits(got), bits(exact)), q


def test_q8_is_not_f32_and_is_close():
    for q in ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k"):
        x, w = acts(2, 1024, seed=1), make_kq(q, (64, 1024), seed=2)
        exact = linear(x, w)
        q8 = linear(x, prepare(w, "q8"))
        assert not np.array_equal(q8, exact), q  # the mode really changes the arithmetic
        np.testing.assert_allclose(q8, exact, rtol=0, atol=0.03 * np.abs(exact).max())


def test_fused_k_quant_file_q8_equals_staged_and_differs_from_f32(tmp_path):
    """A Q4_K_M-style file in the q8 mode: the fused step (every projection through the q8
    row dots) gives the staged path's bits on 1 and 2 threads, and not the f32 mode's."""
    from sparrow.models.decoder import Segment
    from sparrow_lab.bench import shapes

    tiny_k = dict(
        hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512, tied=True,
        rope_theta=1e6, rms_eps=1e-6, context=128,
    )  # fmt: skip
    llm = sparrow.load(shapes.write_gguf(str(tmp_path / "tiny-k.gguf"), tiny_k, "q4_k_m", name="tiny"))
    model = llm.model
    assert {w.qtype for lay in model.layers for w in (lay.mlp.down, lay.attn.o)} >= {"q4_k", "q6_k"}
    models = {m: llm.with_activations(m).model for m in ("f32", "q8")}
    ids = np.random.default_rng(3).integers(0, 486, 20)

    def decode(fused, mode):
        model_ = models[mode]
        model_.use_fused = fused
        plan = model_.fused_step()
        plan.backoff, before = 0, plan.steps
        try:
            cache = model_.new_cache(len(ids), "f32")
            model_.forward([Segment(ids[:12], cache, 0)])
            rows = [model_.forward([Segment(ids[i : i + 1], cache, i, decode=True)])[0] for i in range(12, len(ids))]
            assert (plan.steps - before > 0) == fused
            return np.stack(rows)
        finally:
            model_.use_fused = True

    try:
        for threads in (1, 2):
            set_threads(threads)
            assert numba.get_num_threads() == threads
            q8 = decode(True, "q8")
            assert q8.tobytes() == decode(False, "q8").tobytes(), threads
        assert not np.array_equal(q8, decode(True, "f32"))
    finally:
        set_threads(2)


@pytest.mark.skipif(not Q8_PATHS, reason="CPU names of x86 and aarch64 only")
@pytest.mark.parametrize("path", sorted(Q8_PATHS))
def test_other_code_paths_give_the_same_bits(tmp_path, path):
    """Compiled for another CPU, the same bits: on x86 "generic" (no AVX2: plain vector IR
    instead of pmaddubsw) and "avx2" (pmaddubsw + pmaddwd where a VNNI host takes vpdpbusd);
    on aarch64 "generic", "cortex-a76" (sdot) and "neoverse-n2" (sdot, i8mm, SVE2)."""
    q8_path_matches_here(tmp_path, path, compute)


def test_row_range_into_a_strided_output():
    """The compiled row loops (_ir.make_rows; _x8's groups of 8 rows in the q8 mode) write
    exactly their rows, into a column slice of a wider output (the fused step writes q/k/v
    pieces so), with the reference's bits; the exact path's row loops (_widen, _kquants)
    likewise. Row ranges of the q8 mode's q4_0 / q8_0 count groups: rows 8 g0 .. 8 g1."""
    from sparrow.kernels.formats import KIND, KQ_KIND
    from sparrow.kernels.matmul.widen import exact_sums, kq_rows_address, rows_exact

    for q, t in (("q4_0", 1), ("q5_0", 3), ("q8_0", 2), ("q4_k", 1), ("q4_0", 6)):
        k = 256
        x = acts(t, k, seed=4)
        w = make(q, (37, k), seed=5) if q in ("q4_0", "q8_0") else make_kq(q, (37, k), seed=5)
        xq, dx, sx = quantize(x)
        want_q8 = linear(x, prepare(w, "q8"))
        want = linear(x, w)
        w8 = prepare(w, "q8")
        data8, kind8 = w8.rows, w8.kind
        grouped = data8.shape[0] != 37
        for o0, o1 in ((0, 37), (3, 22), (21, 22), (5, 5), (1, 5)):
            for exact in (False, True):
                if grouped and not exact and o1 > 5:
                    continue  # 5 groups
                big = np.full((t, 50), np.float32(-7))
                y = big[:, 9 : 9 + 37]  # [T, 37] with row stride 50
                if not exact:
                    rows_q8(data8, kind8, xq, dx, sx, y, o0, o1)
                    if grouped:
                        o0, o1 = min(8 * o0, 37), min(8 * o1, 37)
                else:
                    kq = kq_rows_address(w.data) if q in KQ_KIND else 0
                    rows_exact(w.data, KIND[q], x, exact_sums(x, KIND[q], True), y, o0, o1, kq)
                ref = want if exact else want_q8
                assert np.array_equal(bits(y[:, o0:o1]), bits(ref[:, o0:o1])), (q, t, o0, o1, exact)
                untouched = np.ones(50, bool)
                untouched[9 + o0 : 9 + o1] = False
                assert (big[:, untouched] == -7).all(), (q, t, o0, o1, exact)
