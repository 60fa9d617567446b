"""Attention kernels and KV cache against plain numpy (float64) references."""

import math

import numba
import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.kernels.attention import decode_attention, prefill_attention
from sparrow.kernels.sparse_select import block_sums, probe_block_maxima, select_blocks
from sparrow.kv_cache import KVCache
from sparrow.params import SparseParams

H, KVH, D, S = 4, 2, 32, 200  # S = 12 blocks of 16 plus a short block of 8
G = H // KVH
SCALE = 1 / math.sqrt(D)
# f16 / int8 storage against the f32 reference on unit-normal data (measured ~1e-3 / ~1e-2)
TOL = {"f32": 1e-5, "f16": 5e-3, "int8": 5e-2}


def make(dtype, seed=0, n=S, capacity=256):
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((n, KVH, D)).astype(np.float32)
    V = rng.standard_normal((n, KVH, D)).astype(np.float32)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    cache = KVCache(1, KVH, D, capacity, dtype)
    cache.layers[0].append(0, K, V)
    return cache.layers[0], q, K, V


def stored(layer, n):
    """What the cache holds, dequantised to float64 [n, KVH, D] (K, V)."""
    K = np.stack([layer.keys_f32(kh, n) for kh in range(KVH)], 1).astype(np.float64)
    V = np.stack([layer.values_f32(kh, n) for kh in range(KVH)], 1).astype(np.float64)
    return K, V


def raw_dots(qh, layer, kh, n):
    """Probe dots q . K[t] as the spec defines them for the cache's storage (float64)."""
    if layer.dtype == "int8":
        absmax = np.abs(qh).max()
        qs = np.float32(absmax / np.float32(127.0))
        qi = np.clip(np.rint(qh / qs), -127, 127).astype(np.int64)
        idot = layer.k[kh, :n].astype(np.int64) @ qi
        return idot * (float(qs) * layer.k_scale[kh, :n].astype(np.float64))
    return layer.keys_f32(kh, n).astype(np.float64) @ qh.astype(np.float64)


def attend(qh, layer, kh, positions):
    """Softmax attention of one head over the given positions -> (out [D], probs)."""
    n = positions.max() + 1
    _, V = stored(layer, n)
    s = raw_dots(qh, layer, kh, n)[positions] * SCALE
    p = np.exp(s - s.max())
    p /= p.sum()
    return p @ V[positions, kh], p


def ref_causal(q, K, V, start):
    """Exact causal attention with float64 math -> (out [T, H, D], importance [start+T])."""
    T = q.shape[0]
    out = np.zeros(q.shape)
    imp = np.zeros(start + T)
    for t in range(T):
        n = start + t + 1
        for h in range(H):
            s = K[:n, h // G] @ q[t, h].astype(np.float64) * SCALE
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ V[:n, h // G]
            imp[:n] += p
    return out, imp


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_exact_prefill_and_decode_match_reference(dtype):
    layer, q, K, V = make(dtype)
    out = prefill_attention(q, layer, 0, SCALE)
    Ks, Vs = stored(layer, S)
    ref, imp = ref_causal(q, Ks, Vs, 0)  # reference on exactly what is stored
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(layer.importance[:S], imp, rtol=1e-5, atol=1e-5)
    ref32, _ = ref_causal(q, K.astype(np.float64), V.astype(np.float64), 0)
    np.testing.assert_allclose(out, ref32, atol=TOL[dtype])

    dec = decode_attention(q[-1], layer, S, SCALE)
    want = np.stack([attend(q[-1, h], layer, h // G, np.arange(S))[0] for h in range(H)])
    np.testing.assert_allclose(dec, want, atol=1e-5)  # int8: quantised query, int dots
    np.testing.assert_allclose(dec, ref32[-1], atol=TOL[dtype])


def test_gqa_head_mapping():
    layer, q, K, V = make("f32")
    V[:, 0], V[:, 1] = 3.0, -7.0
    layer.append(0, K, V)
    out = decode_attention(q[-1], layer, S, SCALE)
    np.testing.assert_allclose(out[:G], 3.0, rtol=1e-6)  # heads 0, 1 -> KV head 0
    np.testing.assert_allclose(out[G:], -7.0, rtol=1e-6)  # heads 2, 3 -> KV head 1
    out = prefill_attention(q[:5], layer, 0, SCALE)
    np.testing.assert_allclose(out[:, G:], -7.0, rtol=1e-6)


def test_causal_mask_ignores_future_positions():
    layer, q, K, V = make("f32")
    a = prefill_attention(q[:50], layer, 0, SCALE, record_importance=False)
    K2, V2 = K.copy(), V.copy()
    K2[40:] *= 50.0
    V2[40:] = 1e6
    layer.append(0, K2, V2)
    b = prefill_attention(q[:50], layer, 0, SCALE, record_importance=False)
    np.testing.assert_allclose(a[:40], b[:40], atol=1e-6)
    assert np.abs(a[40:] - b[40:]).max() > 1.0


def test_chunked_prefill_equals_one_chunk():
    one, q, _, _ = make("f32")
    two, _, _, _ = make("f32")
    whole = prefill_attention(q, one, 0, SCALE)
    first = prefill_attention(q[:77], two, 0, SCALE)
    second = prefill_attention(q[77:], two, 77, SCALE)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, atol=1e-6)
    np.testing.assert_allclose(two.importance, one.importance, rtol=1e-6, atol=1e-6)
    _, imp = ref_causal(q, *stored(one, S), 0)
    np.testing.assert_allclose(two.importance[:S], imp, rtol=1e-5, atol=1e-5)
    assert not two.importance[S:].any()


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_sparse_with_all_blocks_is_bit_identical_to_exact(dtype):
    layer, q, _, _ = make(dtype)
    prefill_attention(q, layer, 0, SCALE)  # real importance
    for n in (S, 37, 16, 1):
        exact = decode_attention(q[n - 1], layer, n, SCALE)
        for block in (16, 32):
            nb = -(-n // block)
            sparse = decode_attention(q[n - 1], layer, n, SCALE, SparseParams(k=nb, block=block))
            assert np.array_equal(sparse, exact)
            trace = []
            sparse = decode_attention(q[n - 1], layer, n, SCALE, SparseParams(k=nb + 3, block=block),
                                      trace)
            assert np.array_equal(sparse, exact)
            # every block selected; stages as the rule gives them (probe values cannot matter)
            want = select_blocks(np.zeros(nb), block_sums(layer.importance, n, block), nb + 3)
            assert all((blocks, stages) == want for _, blocks, stages, _ in trace)
            assert all(abs(mass - 1.0) < 1e-6 for *_, mass in trace)  # everything selected


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_sparse_decode_matches_selected_token_reference(dtype):
    layer, q, _, _ = make(dtype, seed=3)
    prefill_attention(q[:150], layer, 0, SCALE)  # positions 150.. keep importance 0
    sp = SparseParams(k=4, block=16, probe=4)
    trace = []
    out = decode_attention(q[-1], layer, S, SCALE, sp, trace)
    assert [rec[0] for rec in trace] == list(range(H))
    for h, blocks, stages, mass in trace:
        probe = probe_block_maxima(raw_dots(q[-1, h], layer, h // G, S).astype(np.float32), S, 16, 4)
        imp = block_sums(layer.importance, S, 16)
        assert (blocks, stages) == select_blocks(probe, imp, 4)
        assert blocks[-1] == 12 and len(blocks) == 4 and stages.count("importance") == 2
        pos = np.concatenate([np.arange(b * 16, min(b * 16 + 16, S)) for b in blocks])
        np.testing.assert_allclose(out[h], attend(q[-1, h], layer, h // G, pos)[0], atol=1e-5)
        scores = layer.keys_f32(h // G, S).astype(np.float64) @ q[-1, h] * SCALE  # exact mass reference
        p = np.exp(scores - scores.max())
        assert abs(mass - p[pos].sum() / p.sum()) < 1e-5 and 0 < mass < 1


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_sparse_prefill_matches_per_query_reference(dtype):
    layer, q, _, _ = make(dtype, seed=5, n=100)
    sp = SparseParams(k=2, block=16, probe=4, prefill=True)
    out = prefill_attention(q[60:], layer, 60, SCALE, sp)  # second chunk only
    imp = np.zeros(100)
    for t in range(40):
        n = 61 + t
        for h in range(H):
            probe = probe_block_maxima(raw_dots(q[60 + t, h], layer, h // G, n).astype(np.float32), n, 16, 4)
            blocks, _ = select_blocks(probe, None, 2)
            pos = np.concatenate([np.arange(b * 16, min(b * 16 + 16, n)) for b in blocks])
            o, p = attend(q[60 + t, h], layer, h // G, pos)
            np.testing.assert_allclose(out[t, h], o, atol=1e-5)
            imp[pos] += p
    np.testing.assert_allclose(layer.importance[:100], imp, rtol=1e-5, atol=1e-5)
    # enough blocks for every prefix: same as exact up to rounding (exact prefill is BLAS on
    # dequantised f32, so for int8 it differs by the query quantisation)
    full = prefill_attention(q[60:], layer, 60, SCALE, SparseParams(k=7, block=16, prefill=True),
                             record_importance=False)
    exact = prefill_attention(q[60:], layer, 60, SCALE, record_importance=False)
    np.testing.assert_allclose(full, exact, atol=1e-5 if dtype == "f32" else TOL[dtype])


def test_thread_count_and_repeat_invariance():
    layer, q, _, _ = make("int8", seed=7)
    prefill_attention(q, layer, 0, SCALE)
    sp = SparseParams(k=3, block=16)
    spp = SparseParams(k=3, block=16, prefill=True)
    saved = numba.get_num_threads()

    def run():
        return (decode_attention(q[-1], layer, S, SCALE),
                decode_attention(q[-1], layer, S, SCALE, sp),
                prefill_attention(q[150:], layer, 150, SCALE, spp, record_importance=False))

    try:
        numba.set_num_threads(1)
        one = run()
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = run()
    finally:
        numba.set_num_threads(saved)
    for a, b in zip(one, two):
        assert np.array_equal(a, b)
    for a, b in zip(one, run()):
        assert np.array_equal(a, b)
    # a head's result does not depend on the other heads in the call
    alone = decode_attention(np.tile(q[-1, :1], (H, 1)), layer, S, SCALE, sp)
    assert np.array_equal(alone[0], one[1][0])


def test_trace_records():
    layer, q, _, _ = make("f32")
    trace = []
    decode_attention(q[-1], layer, S, SCALE, trace=trace)
    assert trace == []  # exact attention records nothing
    decode_attention(q[-1], layer, S, SCALE, SparseParams(k=5, block=16), trace)
    assert len(trace) == H
    for h, (head, blocks, stages, mass) in enumerate(trace):
        assert head == h and blocks == sorted(blocks) and len(blocks) == 5 == len(stages)
        assert 0.0 < mass <= 1.0
        assert set(stages) <= {"importance", "probe", "recency"}


def test_cache_bookkeeping():
    cache = KVCache(2, KVH, D, 64, "int8")
    assert cache.nbytes == 2 * (2 * KVH * 64 * D + 2 * KVH * 64 * 4 + 64 * 4)
    layer = cache.layers[0]
    x = np.random.default_rng(0).standard_normal((10, KVH, D)).astype(np.float32)
    layer.append(0, x, x)
    back = np.stack([layer.keys_f32(kh, 10) for kh in range(KVH)], 1)
    assert np.all(np.abs(back - x) <= layer.k_scale[:, :10].T[:, :, None] / 2 + 1e-7)
    layer.importance[:10] = 1.0
    cache.length = 10
    cache.truncate(6)
    assert cache.length == 6 and layer.importance[:6].all() and not layer.importance[6:].any()
    layer.importance[:6] = 1.0
    layer.append(4, x[:2], x[:2])  # rewritten positions lose stale prefill mass
    assert layer.importance[:4].all() and not layer.importance[4:].any()
    with pytest.raises(SparrowError):
        KVCache(1, 1, 4, 8, "bf16")
    with pytest.raises(SparrowError):
        layer.append(60, x, x)


def test_vectorised_exp_against_float64():
    from sparrow.kernels._attn_rows import exp_shifted

    x = np.concatenate([-np.linspace(0, 100, 20001), [-0.0, -1e-8, -87.5, -300.0]]).astype(np.float32)
    for m in (0.0, 3.5):
        s = x + np.float32(m)
        exp_shifted(s, np.float32(m), len(s), np.empty(len(s), np.int32))
        ref = np.exp(x.astype(np.float64))
        ok = x > -70
        assert np.all(np.abs(s[ok] - ref[ok]) <= 3e-7 * ref[ok])
        assert np.all(s[~ok] == 0)  # far tail dropped: < 4e-31 of the maximum's weight


def _fma_order_dot(q, k):
    """The documented order of a score: fma over 16-lane chunks into one vector, then the
    pairwise tree 16 -> 8 -> 4 -> 2 -> 1, then sequential fma over a head_dim tail. fma is
    emulated in float64 (the product of two float32 is exact there; the sum is then rounded
    once to float32, matching fma whenever the float64 sum is exact, as it is for these
    magnitudes)."""
    nch = len(q) // 16
    acc = np.zeros(16, np.float32)
    for c in range(nch):
        sl = slice(c * 16, c * 16 + 16)
        acc = (q[sl].astype(np.float64) * k[sl].astype(np.float64) + acc).astype(np.float32)
    while len(acc) > 1:
        h = len(acc) // 2
        acc = acc[:h] + acc[h:]
    tot = acc[0]
    for e in range(nch * 16, len(q)):
        tot = np.float32(np.float64(q[e]) * np.float64(k[e]) + np.float64(tot))
    return tot


@pytest.mark.parametrize("dim", [64, 128, 48, 40, 8])
def test_row_kernels_against_documented_order(dim):
    from numba import njit

    from sparrow.kernels._attn_rows import accum, dots

    @njit
    def run_dots(q, K2, t0, t1, step, s, off):
        return dots(q, K2, t0, t1, step, s, off)

    @njit
    def run_accum(w, off, V2, t0, t1, acc):
        accum(w, off, V2, t0, t1, acc)

    rng = np.random.default_rng(dim)
    q = rng.standard_normal(dim).astype(np.float32)
    base = rng.standard_normal((70, dim)).astype(np.float32)
    stores = {"f32": (base, base),
              "f16": (base.astype(np.float16).view(np.uint16), base.astype(np.float16).astype(np.float32)),
              "int8": (np.clip(np.rint(base * 30), -127, 127).astype(np.int8), None)}
    for name, (K2, Kf) in stores.items():
        Kf = K2.astype(np.float32) if Kf is None else Kf
        s = np.full(80, np.nan, np.float32)
        n = run_dots(q, K2, 3, 69, 2, s, 5)  # rows 3, 5, ..., 67: strided, 33 rows (odd)
        want = [_fma_order_dot(q, Kf[t]) for t in range(3, 69, 2)]
        assert n == 33 and np.array_equal(s[5:5 + n], np.array(want, np.float32)), name
        # weighted sum: row i of w to accumulator i % 4, any split into calls gives the same bits
        w = rng.standard_normal(100).astype(np.float32)
        one = np.zeros((4, dim), np.float32)
        run_accum(w, 7, K2, 0, 70, one)
        split = np.zeros((4, dim), np.float32)
        for a in range(0, 70, 9):
            run_accum(w, 7 + a, K2, a, min(70, a + 9), split)
        assert np.array_equal(one, split), name
        ref = np.zeros((4, dim))
        for j in range(70):
            ref[(7 + j) % 4] += np.float64(w[7 + j]) * Kf[j]
        np.testing.assert_allclose(one, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_probe_key_copy_follows_rewrites(dtype):
    # sparse decode reads the probe keys of full blocks from a copy (kv_cache.ProbeKeys); a
    # rewritten position (cache rewound and refilled) must be seen exactly as a fresh cache sees it
    layer, q, K, V = make(dtype, seed=11)
    sp = SparseParams(k=7, block=16)  # no prefill: importance reserves blocks 0-3, probes pick 3
    before = decode_attention(q[-1], layer, S, SCALE, sp)
    copy = layer.probe_keys(16, sp.probe, S)
    assert copy.blocks == S // 16 and copy.nbytes > 0
    K2, V2 = K.copy(), V.copy()
    K2[40:120] = 2 * q[-1, ::G]  # new keys in blocks 2..7, aligned with the query: selected now
    layer.append(40, K2[40:], V2[40:])
    after = decode_attention(q[-1], layer, S, SCALE, sp)
    fresh = KVCache(1, KVH, D, 256, dtype).layers[0]
    fresh.append(0, K2, V2)
    assert np.array_equal(after, decode_attention(q[-1], fresh, S, SCALE, sp))
    assert not np.array_equal(after, before)


def test_int8_quantisation_rule():
    from sparrow.kv_cache import quantize_int8

    rng = np.random.default_rng(21)
    x = rng.standard_normal((5, 3, 40)).astype(np.float32) * 3
    x[1, 2] = 0  # all-zero row: scale 0, codes 0
    x[2, 0] = np.arange(-20, 20, dtype=np.float32) * np.float32(127 / 40)  # exact halves after scaling
    codes, scale = quantize_int8(x)
    absmax = np.abs(x).max(-1)
    want_scale = (absmax / np.float32(127)).astype(np.float32)
    safe = np.where(want_scale > 0, want_scale, np.float32(1)).astype(np.float32)
    want = np.clip(np.rint(x / safe[..., None]), -127, 127).astype(np.int8)  # round half to even
    assert codes.dtype == np.int8 and scale.dtype == np.float32
    assert np.array_equal(scale, want_scale) and np.array_equal(codes, want)
    assert not codes[1, 2].any() and scale[1, 2] == 0
