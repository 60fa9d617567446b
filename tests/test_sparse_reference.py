"""Block-sparse attention against a reference written from shared/SPARSE_ATTENTION.md alone.

Nothing here comes from sparrow's own selector (`select_blocks`, `probe_block_maxima`, the
numba kernels): the reference below restates the spec's four stages and its attention rule
in plain Python over float64, so a misreading of the spec shared by sparrow's two
implementations would show up here. From sparrow it takes only what is stored: the cache's
raw K/V rows (and int8 scales) and the importance prefill recorded.
"""

import math

import numpy as np
import pytest

from sparrow.models.attention import decode_attention, prefill_attention
from sparrow.params import SparseParams
from sparrow.state.cache import KVCache

H, KVH, D = 4, 2, 32
G = H // KVH
SCALE = 1 / math.sqrt(D)


# ---------------------------------------------------------------- the reference, from the spec
def stored_rows(layer, x, scale, kh, n):
    """Rows 0..n-1 of KV head kh as stored, float64 [n, D], and, for int8, the codes and the
    per-position scales separately (int8 dots are int8 x int8 with the scales applied)."""
    if x.dtype == np.int8:
        return x[kh, :n].astype(np.float64) * scale[kh, :n, None], x[kh, :n].astype(np.int64), scale[kh, :n]
    if x.dtype == np.uint16:  # f16 stored as its bit patterns
        return x[kh, :n].view(np.float16).astype(np.float64), None, None
    return x[kh, :n].astype(np.float64), None, None


def spec_dots(qh, layer, kh, n):
    """q . K[t] for t < n. int8 cache: the query quantised to int8 per head (absmax / 127,
    round to nearest), the int8 x int8 dot, times both scales."""
    K, codes, ks = stored_rows(layer, layer.k, layer.k_scale, kh, n)
    if codes is None:
        return K @ qh.astype(np.float64)
    qs = np.float32(np.abs(qh).max() / np.float32(127))
    qi = np.clip(np.rint(qh / qs), -127, 127).astype(np.int64) if qs > 0 else np.zeros(len(qh), np.int64)
    return (codes @ qi) * (float(qs) * ks.astype(np.float64))


def spec_select(dots, importance, seq_len, k_blocks, block_size, n_probe):
    """The spec's four stages for one query head -> (blocks ascending, stage names).
    dots[t] = q . K[t]; importance: one value per position, or None when absent."""
    n_blocks = -(-seq_len // block_size)  # ceil
    span = [(b * block_size, min((b + 1) * block_size, seq_len)) for b in range(n_blocks)]
    # 1. probe: the max of q . K[ps] over ps = p0, p0 + step, ... < p_end (start -1e30)
    probe = []
    for p0, p_end in span:
        step = max(1, (p_end - p0) // n_probe)
        best = -1e30
        for ps in range(p0, p_end, step):
            best = max(best, dots[ps])
        probe.append(best)
    chosen = {}  # block -> stage name
    # 2. importance reservation: (k + 1) // 2 blocks by largest imp_sum, ties to the smaller index
    if importance is not None:
        imp_sum = [float(np.sum(importance[p0:p_end], dtype=np.float64)) for p0, p_end in span]
        budget = (k_blocks + 1) // 2
        while len(chosen) < budget and len(chosen) < n_blocks:
            unused = [b for b in range(n_blocks) if b not in chosen]
            chosen[max(unused, key=lambda b: (imp_sum[b], -b))] = "importance"
    # 3. top-k fill by largest probe, ties to the smaller index, never padding
    while len(chosen) < min(k_blocks, n_blocks):
        unused = [b for b in range(n_blocks) if b not in chosen]
        chosen[max(unused, key=lambda b: (probe[b], -b))] = "probe"
    # 4. recency: the last block replaces the probe-chosen block of lowest probe (ties: the
    # larger index); importance blocks are never replaced, and without a probe block it is not added
    last = n_blocks - 1
    if last not in chosen:
        by_probe = [b for b, stage in chosen.items() if stage == "probe"]
        if by_probe:
            del chosen[min(by_probe, key=lambda b: (probe[b], -b))]
            chosen[last] = "recency"
    blocks = sorted(chosen)
    return blocks, [chosen[b] for b in blocks]


def spec_attend(qh, layer, kh, seq_len, blocks, block_size, scale):
    """Softmax of q . K[t] * scale over the tokens of the selected blocks only (max
    subtracted), out = sum w_t V[t] -> (out [D], positions, weights)."""
    pos = np.concatenate([np.arange(b * block_size, min((b + 1) * block_size, seq_len)) for b in blocks])
    s = spec_dots(qh, layer, kh, seq_len)[pos] * scale
    w = np.exp(s - s.max())
    w /= w.sum()
    V, _, _ = stored_rows(layer, layer.v, layer.v_scale, kh, seq_len)
    return w @ V[pos], pos, w


def spec_mass(qh, layer, kh, seq_len, blocks, block_size, scale):
    """The trace's mass: share of the exact softmax (dequantised keys, q as given) inside the blocks."""
    K, _, _ = stored_rows(layer, layer.k, layer.k_scale, kh, seq_len)
    s = K @ qh.astype(np.float64) * scale
    p = np.exp(s - s.max())
    inside = np.concatenate([np.arange(b * block_size, min((b + 1) * block_size, seq_len)) for b in blocks])
    return p[inside].sum() / p.sum()


# ---------------------------------------------------------------- helpers
def filled(dtype, n, seed, capacity=256, integer=False):
    """A one-layer cache holding n random positions, its queries [n, H, D] and K, V."""
    rng = np.random.default_rng(seed)
    if integer:  # small integers: every dot is exact in float32, so ties are real ties
        K = rng.integers(-2, 3, (n, KVH, D)).astype(np.float32)
        V = rng.integers(-3, 4, (n, KVH, D)).astype(np.float32)
        q = rng.integers(-1, 2, (n, H, D)).astype(np.float32)
    else:
        K = rng.standard_normal((n, KVH, D)).astype(np.float32)
        V = rng.standard_normal((n, KVH, D)).astype(np.float32)
        q = rng.standard_normal((n, H, D)).astype(np.float32)
    cache = KVCache(1, KVH, D, capacity, dtype)
    cache.append(0, 0, K, V)
    return cache, q, K, V


def check_decode(cache, qv, seq_len, sp, scale=SCALE):
    """One sparse decode step against the reference: same blocks and stages per head, output
    and mass to float tolerance. Returns the output."""
    layer, st = cache.layers[0], cache.sparse[0]
    trace = []
    out = decode_attention(qv, layer, st, seq_len, scale, sp, trace)
    assert [rec[0] for rec in trace] == list(range(H))
    for h, blocks, stages, mass in trace:
        dots = spec_dots(qv[h], layer, h // G, seq_len)
        want = spec_select(dots, st.importance[:seq_len], seq_len, sp.k, sp.block, sp.probe)
        assert (blocks, stages) == want, (seq_len, h)
        ref, _, _ = spec_attend(qv[h], layer, h // G, seq_len, blocks, sp.block, scale)
        np.testing.assert_allclose(out[h], ref, rtol=1e-5, atol=1e-6)
        assert mass == pytest.approx(
            spec_mass(qv[h], layer, h // G, seq_len, blocks, sp.block, scale), rel=1e-5, abs=1e-7
        )
    return out


# ---------------------------------------------------------------- tests
def test_reference_reads_the_spec_examples():
    # the spec's own statements, on hand-made probe dots (block 4, probe 2 -> step 2)
    dots = np.zeros(16)
    dots[5] = 9.0  # block 1, offset 1: not a probe position (offsets 0 and 2)
    dots[10] = 3.0  # block 2, offset 2: probed
    imp = np.zeros(16)
    imp[0:4] = 1.0
    # k=1 with importance: the one slot goes to importance, the last block is not added
    assert spec_select(dots, imp, 16, 1, 4, 2) == ([0], ["importance"])
    # k=3: importance 0 (budget 2: then block 1, ties at 0 to the smaller index); probe 2;
    # recency: block 3 replaces the only probe-chosen block
    assert spec_select(dots, imp, 16, 3, 4, 2) == ([0, 1, 3], ["importance", "importance", "recency"])
    # no importance, k=2: probe 2 (3.0), then 0 (tie at 0 with 1 and 3 -> smallest index);
    # recency replaces block 0 (the lowest probe; tie-free here)
    assert spec_select(dots, None, 16, 2, 4, 2) == ([2, 3], ["probe", "recency"])
    # k >= n_blocks: everything, and the short last block [16, 18) is its own block
    assert spec_select(np.zeros(18), None, 18, 9, 4, 2) == ([0, 1, 2, 3, 4], ["probe"] * 5)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("block,probe", [(16, 4), (16, 16), (32, 8), (26, 3), (16, 40)])
def test_decode_matches_spec(dtype, k, block, probe):
    S = 200  # block 16: 12 full blocks and a short one; 26: 7 full and one of 18
    cache, q, _, _ = filled(dtype, S, seed=31 + k)
    cache.sparse[0].importance[:150] = np.random.default_rng(k).random(150, dtype=np.float32)
    check_decode(cache, q[-1], S, SparseParams(k=k, block=block, probe=probe))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_decode_tie_rules_match_spec(dtype, k):
    # integer keys and queries: many exactly equal probe maxima and importance sums
    S = 150
    cache, q, _, _ = filled(dtype, S, seed=k, integer=True)
    cache.sparse[0].importance[:S] = np.random.default_rng(k).integers(0, 2, S).astype(np.float32)
    for seq_len in (150, 97, 64, 33):
        check_decode(cache, q[seq_len - 1], seq_len, SparseParams(k=k, block=16, probe=4))


@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("k", [1, 2])
def test_growing_cache_decoded_step_by_step(dtype, k):
    # an exact prefill of 40 positions records importance; then one position is appended and
    # decoded at a time, as generation does (the probe copy grows block by block)
    n = 130
    rng = np.random.default_rng(7)
    K = rng.standard_normal((n, KVH, D)).astype(np.float32)
    V = rng.standard_normal((n, KVH, D)).astype(np.float32)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    cache = KVCache(1, KVH, D, n, dtype)
    cache.append(0, 0, K[:40], V[:40])
    prefill_attention(q[:40], cache.layers[0], cache.sparse[0], 0, SCALE)
    sp = SparseParams(k=k, block=16, probe=4)
    for t in range(40, n):
        cache.append(0, t, K[t : t + 1], V[t : t + 1])
        check_decode(cache, q[t], t + 1, sp)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_shrinking_seq_len_matches_spec_and_a_fresh_cache(dtype):
    # a decode at 200 copies the probe keys of 12 blocks; later decodes over fewer positions
    # (bench attention --contexts 4096 2048) must read only full blocks below their seq_len
    cache, q, K, V = filled(dtype, 200, seed=13)
    sp = SparseParams(k=2, block=16, probe=4)
    check_decode(cache, q[-1], 200, sp)
    for seq_len in (150, 100, 37, 16, 5):
        got = check_decode(cache, q[seq_len - 1], seq_len, sp)
        fresh = KVCache(1, KVH, D, 256, dtype)
        fresh.append(0, 0, K[:seq_len], V[:seq_len])
        want = decode_attention(q[seq_len - 1], fresh.layers[0], fresh.sparse[0], seq_len, SCALE, sp)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_prefill_matches_spec(dtype, k):
    # each prefill query selects over its own causal prefix, without importance; the mass
    # each position receives is recorded as its importance
    cache, q, _, _ = filled(dtype, 100, seed=17 + k)
    layer = cache.layers[0]
    sp = SparseParams(k=k, block=16, probe=4, prefill=True)
    out = prefill_attention(q[60:], layer, cache.sparse[0], 60, SCALE, sp)  # [40, H, D]
    imp = np.zeros(100)
    for t in range(40):
        n = 61 + t
        for h in range(H):
            blocks, _ = spec_select(spec_dots(q[60 + t, h], layer, h // G, n), None, n, k, 16, 4)
            ref, pos, w = spec_attend(q[60 + t, h], layer, h // G, n, blocks, 16, SCALE)
            np.testing.assert_allclose(out[t, h], ref, rtol=1e-5, atol=1e-6)
            imp[pos] += w
    np.testing.assert_allclose(cache.sparse[0].importance[:100], imp, rtol=1e-5, atol=1e-6)
