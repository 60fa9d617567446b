"""Attention kernels and KV cache against plain numpy (float64) references."""

import math

import numba
import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.kernels.attention.select import block_sums, probe_block_maxima, select_blocks
from sparrow.models.attention import decode_attention, prefill_attention
from sparrow.params import SparseParams
from sparrow.state.cache import KVCache

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
    cache.append(0, 0, K, V)
    return cache, q, K, V


def dec(cache, q, n, sparse=None, trace=None):
    """Decode attention of q [H, D] over positions 0..n-1 of the cache's one layer."""
    return decode_attention(q, cache.layers[0], cache.sparse[0], n, SCALE, sparse, trace)


def pre(cache, q, start, sparse=None, record_importance=True):
    """Prefill attention of q [T, H, D] at positions start.. of the cache's one layer."""
    return prefill_attention(q, cache.layers[0], cache.sparse[0], start, SCALE, sparse, record_importance)


def stored(layer, n):
    """What the cache holds, dequantised to float64 [n, KVH, D] (K, V)."""
    K = np.stack([layer.keys_f32(kh, n) for kh in range(KVH)], 1).astype(np.float64)
    V = np.stack([layer.values_f32(kh, n) for kh in range(KVH)], 1).astype(np.float64)
    return K, V


def raw_dots(qh, layer, kh, n):
    """Probe dots q . K[t] as the spec defines them for the cache's storage (float64)."""
    if layer.scaled:
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
    cache, q, K, V = make(dtype)
    layer = cache.layers[0]
    out = pre(cache, q, 0)
    Ks, Vs = stored(layer, S)
    ref, imp = ref_causal(q, Ks, Vs, 0)  # reference on exactly what is stored
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(cache.sparse[0].importance[:S], imp, rtol=1e-5, atol=1e-5)
    ref32, _ = ref_causal(q, K.astype(np.float64), V.astype(np.float64), 0)
    np.testing.assert_allclose(out, ref32, atol=TOL[dtype])

    got = dec(cache, q[-1], S)
    want = np.stack([attend(q[-1, h], layer, h // G, np.arange(S))[0] for h in range(H)])
    np.testing.assert_allclose(got, want, atol=1e-5)  # int8: quantised query, int dots
    np.testing.assert_allclose(got, ref32[-1], atol=TOL[dtype])


def test_gqa_head_mapping():
    cache, q, K, V = make("f32")
    V[:, 0], V[:, 1] = 3.0, -7.0
    cache.append(0, 0, K, V)
    out = dec(cache, q[-1], S)
    np.testing.assert_allclose(out[:G], 3.0, rtol=1e-6)  # heads 0, 1 -> KV head 0
    np.testing.assert_allclose(out[G:], -7.0, rtol=1e-6)  # heads 2, 3 -> KV head 1
    out = pre(cache, q[:5], 0)
    np.testing.assert_allclose(out[:, G:], -7.0, rtol=1e-6)


def test_causal_mask_ignores_future_positions():
    cache, q, K, V = make("f32")
    a = pre(cache, q[:50], 0, record_importance=False)
    K2, V2 = K.copy(), V.copy()
    K2[40:] *= 50.0
    V2[40:] = 1e6
    cache.append(0, 0, K2, V2)
    b = pre(cache, q[:50], 0, record_importance=False)
    np.testing.assert_allclose(a[:40], b[:40], atol=1e-6)
    assert np.abs(a[40:] - b[40:]).max() > 1.0


def test_chunked_prefill_equals_one_chunk():
    one, q, _, _ = make("f32")
    two, _, _, _ = make("f32")
    whole = pre(one, q, 0)
    first = pre(two, q[:77], 0)
    second = pre(two, q[77:], 77)
    # a query's row depends only on its query and the keys it sees, not on the chunking
    assert np.array_equal(np.concatenate([first, second]), whole)
    imp1, imp2 = one.sparse[0].importance, two.sparse[0].importance
    np.testing.assert_allclose(imp2, imp1, rtol=1e-6, atol=1e-6)
    _, imp = ref_causal(q, *stored(one.layers[0], S), 0)
    np.testing.assert_allclose(imp2[:S], imp, rtol=1e-5, atol=1e-5)
    assert not imp2[S:].any()


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_sparse_with_all_blocks_is_bit_identical_to_exact(dtype):
    cache, q, _, _ = make(dtype)
    pre(cache, q, 0)  # real importance
    for n in (S, 37, 16, 1):
        exact = dec(cache, q[n - 1], n)
        for block in (16, 32):
            nb = -(-n // block)
            sparse = dec(cache, q[n - 1], n, SparseParams(k=nb, block=block))
            assert np.array_equal(sparse, exact)
            trace = []
            sparse = dec(cache, q[n - 1], n, SparseParams(k=nb + 3, block=block), trace)
            assert np.array_equal(sparse, exact)
            # every block selected; stages as the rule gives them (probe values cannot matter)
            want = select_blocks(np.zeros(nb), block_sums(cache.sparse[0].importance, n, block), nb + 3)
            assert all((blocks, stages) == want for _, blocks, stages, _ in trace)
            assert all(abs(mass - 1.0) < 1e-6 for *_, mass in trace)  # everything selected


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_sparse_decode_matches_selected_token_reference(dtype):
    # selection against sparrow's own Python rule; test_sparse_reference.py checks the same
    # paths against a reference written from the spec alone
    cache, q, _, _ = make(dtype, seed=3)
    layer = cache.layers[0]
    pre(cache, q[:150], 0)  # positions 150.. keep importance 0
    sp = SparseParams(k=4, block=16, probe=4)
    trace = []
    out = dec(cache, q[-1], S, sp, trace)
    assert [rec[0] for rec in trace] == list(range(H))
    for h, blocks, stages, mass in trace:
        probe = probe_block_maxima(raw_dots(q[-1, h], layer, h // G, S).astype(np.float32), S, 16, 4)
        imp = block_sums(cache.sparse[0].importance, S, 16)
        assert (blocks, stages) == select_blocks(probe, imp, 4)
        assert blocks[-1] == 12 and len(blocks) == 4 and stages.count("importance") == 2
        pos = np.concatenate([np.arange(b * 16, min(b * 16 + 16, S)) for b in blocks])
        np.testing.assert_allclose(out[h], attend(q[-1, h], layer, h // G, pos)[0], atol=1e-5)
        scores = layer.keys_f32(h // G, S).astype(np.float64) @ q[-1, h] * SCALE  # exact mass reference
        p = np.exp(scores - scores.max())
        assert abs(mass - p[pos].sum() / p.sum()) < 1e-5 and 0 < mass < 1


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_sparse_prefill_matches_per_query_reference(dtype):
    cache, q, _, _ = make(dtype, seed=5, n=100)
    layer = cache.layers[0]
    sp = SparseParams(k=2, block=16, probe=4, prefill=True)
    out = pre(cache, q[60:], 60, sp)  # second chunk only
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
    np.testing.assert_allclose(cache.sparse[0].importance[:100], imp, rtol=1e-5, atol=1e-5)
    # enough blocks for every prefix: same as exact up to rounding (exact prefill is BLAS on
    # dequantised f32, so for int8 it differs by the query quantisation)
    full = pre(cache, q[60:], 60, SparseParams(k=7, block=16, prefill=True), record_importance=False)
    exact = pre(cache, q[60:], 60, record_importance=False)
    np.testing.assert_allclose(full, exact, atol=1e-5 if dtype == "f32" else TOL[dtype])


def test_thread_count_and_repeat_invariance():
    cache, q, _, _ = make("int8", seed=7)
    pre(cache, q, 0)
    sp = SparseParams(k=3, block=16)
    spp = SparseParams(k=3, block=16, prefill=True)
    saved = numba.get_num_threads()

    def run():
        return (
            dec(cache, q[-1], S),
            dec(cache, q[-1], S, sp),
            pre(cache, q[150:], 150, spp, record_importance=False),
            pre(cache, q[150:], 150, record_importance=False),
        )

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
    alone = dec(cache, np.tile(q[-1, :1], (H, 1)), S, sp)
    assert np.array_equal(alone[0], one[1][0])


def test_trace_records():
    cache, q, _, _ = make("f32")
    trace = []
    dec(cache, q[-1], S, trace=trace)
    assert trace == []  # exact attention records nothing
    dec(cache, q[-1], S, SparseParams(k=5, block=16), trace)
    assert len(trace) == H
    for h, (head, blocks, stages, mass) in enumerate(trace):
        assert head == h and blocks == sorted(blocks) and len(blocks) == 5 == len(stages)
        assert 0.0 < mass <= 1.0
        assert set(stages) <= {"importance", "probe", "recency"}


def test_cache_bookkeeping():
    cache = KVCache(2, KVH, D, 64, "int8")
    assert cache.nbytes == 2 * (2 * KVH * 64 * D + 2 * KVH * 64 * 4 + 64 * 4)
    layer, imp = cache.layers[0], cache.sparse[0].importance
    x = np.random.default_rng(0).standard_normal((10, KVH, D)).astype(np.float32)
    cache.append(0, 0, x, x)
    back = np.stack([layer.keys_f32(kh, 10) for kh in range(KVH)], 1)
    assert np.all(np.abs(back - x) <= layer.k_scale[:, :10].T[:, :, None] / 2 + 1e-7)
    imp[:10] = 1.0
    cache.length = 10
    cache.truncate(6)
    assert cache.length == 6 and imp[:6].all() and not imp[6:].any()
    imp[:6] = 1.0
    cache.append(0, 4, x[:2], x[:2])  # rewritten positions lose stale prefill mass
    assert imp[:4].all() and not imp[4:].any()
    with pytest.raises(SparrowError):
        KVCache(1, 1, 4, 8, "bf16")
    with pytest.raises(SparrowError):
        cache.append(0, 60, x, x)


def test_vectorised_exp_against_float64():
    from sparrow.kernels.attention.rows import exp_shifted

    x = np.concatenate([-np.linspace(0, 100, 20001), [-0.0, -1e-8, -87.5, -300.0]]).astype(np.float32)
    for m in (0.0, 3.5):
        s = x + np.float32(m)
        exp_shifted(s, np.float32(m), len(s), np.empty(len(s), np.int32))
        ref = np.exp(x.astype(np.float64))
        ok = x > -70
        assert np.all(np.abs(s[ok] - ref[ok]) <= 3e-7 * ref[ok])
        assert np.all(s[~ok] == 0)  # far tail dropped: < 4e-31 of the maximum's weight


@pytest.mark.parametrize("width", [64, 40, 16, 7])
def test_row_softmax_step_equals_the_row_kernels(width):
    """exp_sum and row_max (the prefill's softmax step, in vector IR) give exp_shifted's,
    sum_f32's and max_at's bits for every count n <= width, in place and into another row,
    with arguments near the -70 and -87 cut-offs and zero tails past n."""
    from numba import njit

    from sparrow.kernels.attention.rows import exp_shifted, exp_sum, max_at, row_max, sum_f32

    @njit
    def fused(s, m, n, out):
        return row_max(s, 0, n), exp_sum(s, m, n, out)

    @njit
    def maxima(s, i, n):
        return row_max(s, i, n), max_at(s, i, n)

    @njit
    def plain(s, m, n):
        mx = max_at(s, 0, n)
        exp_shifted(s, m, n, np.empty(len(s), np.int32))
        s[n:] = 0
        return mx, sum_f32(s, n)

    def bits(x):
        return np.atleast_1d(np.asarray(x, np.float32)).view(np.uint32)

    rng = np.random.default_rng(7)
    edges = np.array([-69.99, -70.0, -70.01, -86.99, -87.0, -87.01, -120.0, -0.0, 0.0], np.float32)
    for trial in range(40):
        m = np.float32((0.0, 3.5, -2.25)[trial % 3])  # m + edge and (m + edge) - m are exact
        s = (m - np.abs(rng.standard_normal(width)) * (1 + 30 * (trial % 4))).astype(np.float32)
        k = rng.integers(0, width, size=min(width, 5))
        s[k] = m + rng.choice(edges, size=len(k))
        for i in (0, 1, 5, 16, 17):
            for n in range(max(0, width - i) + 1):
                got_max, want_max = maxima(s, i, n)
                assert got_max == want_max or (n == 0 and got_max == -np.inf), (trial, i, n)
        for n in range(width + 1):
            want_s = s.copy()
            want = plain(want_s, m, n)
            got_s, got_o = s.copy(), np.full(width, np.nan, np.float32)
            got = fused(s.copy(), m, n, got_o)
            assert got[0] == want[0] or (n == 0 and got[0] == -np.inf)
            assert np.array_equal(bits(got[1]), bits(want[1])), (trial, n)
            assert np.array_equal(bits(got_o), bits(want_s)), (trial, n)
            in_place = fused(got_s, m, n, got_s)
            assert np.array_equal(bits(in_place[1]), bits(want[1]))
            assert np.array_equal(bits(got_s), bits(want_s))


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


@pytest.mark.parametrize("dim", [64, 128, 256, 48, 40, 8])
def test_row_kernels_against_documented_order(dim):
    from numba import njit

    from sparrow.kernels.attention.rows import accum, dots

    @njit
    def run_dots(q, K2, t0, t1, step, s, off, ahead=0):
        return dots(q, K2, t0, t1, step, s, off, ahead)

    @njit
    def run_accum(w, off, V2, t0, t1, acc, ahead=0):
        accum(w, off, V2, t0, t1, acc, ahead)

    rng = np.random.default_rng(dim)
    q = rng.standard_normal(dim).astype(np.float32)
    base = rng.standard_normal((70, dim)).astype(np.float32)
    stores = {
        "f32": (base, base),
        "f16": (base.astype(np.float16).view(np.uint16), base.astype(np.float16).astype(np.float32)),
        "int8": (np.clip(np.rint(base * 30), -127, 127).astype(np.int8), None),
    }
    for name, (K2, Kf) in stores.items():
        Kf = K2.astype(np.float32) if Kf is None else Kf
        s = np.full(80, np.nan, np.float32)
        n = run_dots(q, K2, 3, 69, 2, s, 5)  # rows 3, 5, ..., 67: strided, 33 rows (odd)
        want = [_fma_order_dot(q, Kf[t]) for t in range(3, 69, 2)]
        assert n == 33 and np.array_equal(s[5 : 5 + n], np.array(want, np.float32)), name
        # contiguous rows, prefetching ahead up to the last row or not at all: the same bits
        for ahead in (0, 70, 40):
            s = np.full(80, np.nan, np.float32)
            n = run_dots(q, K2, 1, 67, 1, s, 2, ahead)
            want = [_fma_order_dot(q, Kf[t]) for t in range(1, 67)]
            assert n == 66 and np.array_equal(s[2 : 2 + n], np.array(want, np.float32)), (name, ahead)
        # weighted sum: row i of w to accumulator i % 4, any split into calls gives the same bits
        w = rng.standard_normal(100).astype(np.float32)
        one = np.zeros((4, dim), np.float32)
        run_accum(w, 7, K2, 0, 70, one)
        split = np.zeros((4, dim), np.float32)
        for a in range(0, 70, 9):
            run_accum(w, 7 + a, K2, a, min(70, a + 9), split, 70 if a % 2 else a + 30)
        assert np.array_equal(one, split), name
        ref = np.zeros((4, dim))
        for j in range(70):
            ref[(7 + j) % 4] += np.float64(w[7 + j]) * Kf[j]
        np.testing.assert_allclose(one, ref, rtol=1e-5, atol=1e-5)


def _stores(base):
    """The three KV storages of base [n, D]: (name, stored rows, their float32 values)."""
    f16 = base.astype(np.float16)
    codes = np.clip(np.rint(base * 30), -127, 127).astype(np.int8)
    return [("f32", base, base), ("f16", f16.view(np.uint16), f16.astype(np.float32)),
            ("int8", codes, codes.astype(np.float32))]  # fmt: skip


@pytest.mark.parametrize("dim", [64, 128, 80, 40])
def test_widened_rows_give_the_stored_rows_bits(dim):
    """dots / accum over widen's float32 copy of rows t0..t1-1 give the bits they give over the
    stored rows (what lets the rows of a KV group share one widening), for every cut of a block."""
    from numba import njit

    from sparrow.kernels.attention.rows import accum, dots, widen

    @njit
    def run(q, w, K2, t0, t1, off, s, acc, buf, s2, acc2):
        n = dots(q, K2, t0, t1, 1, s, off, K2.shape[0])
        accum(w, off, K2, t0, t1, acc, K2.shape[0])
        widen(K2, t0, t1, buf)
        n2 = dots(q, buf, 0, t1 - t0, 1, s2, off, 0)
        accum(w, off, buf, 0, t1 - t0, acc2, 0)
        return n, n2

    rng = np.random.default_rng(dim)
    q = rng.standard_normal(dim).astype(np.float32)
    w = rng.standard_normal(80).astype(np.float32)
    for name, K2, Kf in _stores(rng.standard_normal((70, dim)).astype(np.float32)):
        for t0, t1, off in [(0, 32, 0), (32, 64, 5), (3, 10, 7), (64, 70, 2), (5, 6, 3), (38, 70, 1)]:
            s, s2 = np.full(80, np.nan, np.float32), np.full(80, np.nan, np.float32)
            acc = rng.standard_normal((4, dim)).astype(np.float32)
            acc2 = acc.copy()
            buf = np.full((32, dim), np.nan, np.float32)
            assert run(q, w, K2, t0, t1, off, s, acc, buf, s2, acc2) == (t1 - t0, t1 - t0)
            assert np.array_equal(buf[: t1 - t0], Kf[t0:t1]), name  # widening is exact
            assert s[off : off + t1 - t0].tobytes() == s2[off : off + t1 - t0].tobytes(), (name, t0, t1)
            assert acc.tobytes() == acc2.tobytes(), (name, t0, t1)


@pytest.mark.parametrize("dim", [64, 128, 80, 40])
def test_rows_sharing_blocks_equal_rows_alone(dim):
    """attend_rows over G rows that share blocks (widened once for all of them) gives every
    row the bits of that row attended alone (the stored rows read directly), for random marks
    and lengths that cut blocks, every KV storage, with and without int8 scales."""
    from sparrow.kernels.attention.decode import attend_rows

    rng = np.random.default_rng(dim + 1)
    n, bs, G = 150, 32, 10
    nb = -(-n // bs)
    qa = rng.standard_normal((G, dim)).astype(np.float32)
    qs, ks, vs = (rng.random(k, dtype=np.float32) + np.float32(0.5) for k in (G, n, n))
    lens = rng.integers(1, n + 1, G).astype(np.int64)
    lens[:3] = n  # full rows, sharing every block
    mark = np.zeros((G, nb), np.bool_)
    ntok = np.zeros(G, np.int64)
    for g in range(G):
        live = -(-lens[g] // bs)
        mark[g, :live] = rng.random(live) < 0.7 if g % 2 else True
        mark[g, live - 1] = True
        ntok[g] = sum(min(b * bs + bs, lens[g]) - b * bs for b in range(live) if mark[g, b])
    keys = _stores(rng.standard_normal((n, dim)).astype(np.float32))
    values = _stores(rng.standard_normal((n, dim)).astype(np.float32))
    scale = np.float32(0.125)
    for (name, K2, _), (_, V2, _) in zip(keys, values):
        int8 = name == "int8"
        out, pacc = np.zeros((G, dim), np.float32), np.zeros((G, n), np.float32)
        kv = (K2, V2, ks, vs, int8)
        attend_rows((qa, qs), kv, 0, lens, scale, bs, (mark, ntok), out, (True, pacc))
        for g in range(G):
            one, pone = np.zeros((G, dim), np.float32), np.zeros((G, n), np.float32)
            sl = slice(g, g + 1)
            attend_rows((qa, qs), kv, g, lens[sl], scale, bs, (mark[sl], ntok[sl]), one, (True, pone))
            assert one[g].tobytes() == out[g].tobytes(), (name, g)
            assert pone[g].tobytes() == pacc[g].tobytes(), (name, g)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_probe_key_copy_follows_rewrites(dtype):
    # sparse decode reads the probe keys of full blocks from a copy (state.sparse.ProbeKeys); a
    # rewritten position (cache rewound and refilled) must be seen exactly as a fresh cache sees it
    cache, q, K, V = make(dtype, seed=11)
    sp = SparseParams(k=7, block=16)  # no prefill: importance reserves blocks 0-3, probes pick 3
    before = dec(cache, q[-1], S, sp)
    copy, n = cache.sparse[0].probe_keys(cache.layers[0], 16, sp.probe, S)
    assert copy.blocks == n == S // 16 and copy.nbytes > 0
    K2, V2 = K.copy(), V.copy()
    K2[40:120] = 2 * q[-1, ::G]  # new keys in blocks 2..7, aligned with the query: selected now
    cache.append(0, 40, K2[40:], V2[40:])
    after = dec(cache, q[-1], S, sp)
    fresh = KVCache(1, KVH, D, 256, dtype)
    fresh.append(0, 0, K2, V2)
    assert np.array_equal(after, dec(fresh, q[-1], S, sp))
    assert not np.array_equal(after, before)


def test_int8_quantisation_rule():
    from sparrow.state.storage import quantize_int8

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


@pytest.mark.parametrize("rows, inner, cols, n", [(24, 64, 64, 64), (7, 33, 29, 20), (5, 128, 8, 128), (3, 8, 17, 5)])
def test_tile_product_matches_float64(rows, inner, cols, n):
    """mm_add (the prefill attention's tile product) on every row/column tail path, and on a
    column slice (the rows of B need not be contiguous with each other)."""
    from numba import njit

    from sparrow.kernels.attention.tile import mm_add

    @njit
    def run(A, B, C, n):
        mm_add(A, B, C, n)

    rng = np.random.default_rng(rows * cols)
    A = rng.standard_normal((rows, inner)).astype(np.float32)
    wide = rng.standard_normal((inner, cols + 3)).astype(np.float32)
    B = wide[:, 1 : cols + 1]
    C = rng.standard_normal((rows, cols)).astype(np.float32)
    want = C.astype(np.float64) + A[:, :n].astype(np.float64) @ B[:n].astype(np.float64)
    run(A, B, C, n)
    np.testing.assert_allclose(C, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["f16", "int8"])
def test_exact_prefill_widens_stored_kv_to_the_layer_float32_values(dtype):
    """The exact prefill kernel reads f16 bits and int8 codes itself: its output and importance
    equal, bit for bit, the float32 kernel's over the values keys_f32 / values_f32 give (what
    it was handed before it widened them), here over a partial last key block."""
    from sparrow.kernels.attention.prefill import BK
    from sparrow.kernels.attention.prefill import prefill_attention as kernel
    from sparrow.kernels.matmul.widen import F16_LUT

    cache, q, _, _ = make(dtype, seed=5)
    layer, start, n = cache.layers[0], 70, S
    assert n % BK
    qa = q[start:n] * np.float32(SCALE)  # [T, H, D]
    out, imp = kernel(qa, layer.k, layer.v, start, G, True, layer.k_scale, layer.v_scale, layer.scaled, F16_LUT)
    K = np.stack([layer.keys_f32(kh, n) for kh in range(KVH)])  # [KVH, n, D]
    V = np.stack([layer.values_f32(kh, n) for kh in range(KVH)])  # [KVH, n, D]
    ref, ref_imp = kernel(qa, K, V, start, G, True)
    assert out.tobytes() == ref.tobytes() and imp.tobytes() == ref_imp.tobytes()


def test_prefill_tile_is_one_fma_chain_per_element():
    """mm_add (prefill attention's register tile, kernels.cpu.ATTENTION_TILE wide) gives every
    element of C += A @ B as one fma chain from C's value, k ascending: checked against a scalar
    loop of the same fmas for row counts across the tile's row tails (8, 4, 1), column counts
    across its column tails (32 / 16 / 8 lanes, single columns) and strided column slices."""
    from numba import njit

    from sparrow.kernels.attention.tile import mm_add
    from sparrow.kernels.ir import fma32

    @njit(cache=False)
    def chain(A, B, C, n):
        for r in range(C.shape[0]):
            for c in range(C.shape[1]):
                acc = C[r, c]
                for k in range(n):
                    acc = fma32(A[r, k], B[k, c], acc)
                C[r, c] = acc

    @njit(cache=False)
    def tile(A, B, C, n):
        mm_add(A, B, C, n)

    rng = np.random.default_rng(5)
    for rows, cols, n in ((1, 1, 1), (3, 7, 5), (8, 32, 128), (13, 64, 64), (16, 128, 64), (19, 70, 33), (12, 41, 9)):
        A = rng.standard_normal((rows, n + 3)).astype(np.float32)
        Bw = rng.standard_normal((n, cols + 11)).astype(np.float32)
        B = Bw[:, 4 : 4 + cols]  # a column slice: rows contiguous, strided
        C0 = rng.standard_normal((rows, cols)).astype(np.float32)
        want, got = C0.copy(), C0.copy()
        chain(A, B, want, n)
        tile(A, B, got, n)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (rows, cols, n)


@pytest.mark.parametrize("T", [5, 8, 37, 130])
def test_exact_prefill_bits_do_not_depend_on_the_item_size(monkeypatch, T):
    """Work items of 8, 16, 32 or 64 queries (prefill.items_of picks by chunk length) give the
    same output and importance bits: importance is summed per 8-query group in one order."""
    import sparrow.kernels.attention.prefill as pf

    rng = np.random.default_rng(T)
    n = 300
    K = rng.standard_normal((KVH, n, D)).astype(np.float32)
    V = rng.standard_normal((KVH, n, D)).astype(np.float32)
    start = n - T
    qa = rng.standard_normal((T, H, D)).astype(np.float32)
    assert [pf.items_of(t) for t in (1, 64, 120, 128, 200, 256, 448, 512, 4096)] == [8, 8, 16, 16, 16, 32, 32, 64, 64]
    runs = []
    for qt in (8, 16, 32, 64):
        monkeypatch.setattr(pf, "items_of", lambda t, qt=qt: qt)
        runs.append(pf.prefill_attention(qa, K, V, start, G, True))
    for out, imp in runs[1:]:
        assert out.tobytes() == runs[0][0].tobytes() and imp.tobytes() == runs[0][1].tobytes()
