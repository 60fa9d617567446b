"""Block selector (shared/SPARSE_ATTENTION.md): hand-built cases with exact expected results."""

import math

import numpy as np
import pytest

from sparrow.kernels.attention.select import (
    STAGE_NAMES,
    block_sums,
    fill_probe_nb,
    probe_block_maxima,
    reserve_importance_nb,
    select_blocks,
)
from sparrow.models.attention import decode_attention
from sparrow.params import SparseParams
from sparrow.state.cache import KVCache


def nb_select(probe, imp, k):
    """The numba selection as the attention kernels run it: the importance reservation
    (none without importance), then the probe fill and recency."""
    probe = np.asarray(probe, np.float32)
    n = probe.shape[0]
    if imp is None:
        reserved = np.full(n, -1, np.int8)
    else:
        reserved = reserve_importance_nb(np.asarray(imp, np.float32), k, n)
    sel = np.empty(max(n, 1), np.int64)
    stages = np.empty(max(n, 1), np.int8)
    m = fill_probe_nb(probe, reserved, k, sel, stages)
    return sel[:m].tolist(), [STAGE_NAMES[c] for c in stages[:m]]


def both(probe, imp, k):
    """Run both implementations, require agreement, return the result."""
    a = select_blocks(probe, imp, k)
    assert nb_select(probe, imp, k) == a
    return a


def test_probe_ties_go_to_lower_index():
    assert both([1, 5, 5, 9], None, 2) == ([1, 3], ["probe", "probe"])


def test_importance_ties_go_to_lower_index():
    # budget (2+1)//2 = 1 -> block 0 (tie with 1); probe fills block 1 (all-equal probes);
    # the last block 3 then replaces it.
    assert both([0, 0, 0, 0], [3, 3, 1, 0], 2) == ([0, 3], ["importance", "recency"])


def test_k1_with_importance_is_just_the_importance_block():
    assert both([9, 9, 9, 9], [0, 0, 5, 0], 1) == ([2], ["importance"])


def test_recency_replaces_lowest_probe_chosen_never_importance():
    probe = [5, -100, 7, 6, 8, 1]
    imp = [0, 10, 0, 0, 0, 0]
    # importance: 1 (10), 0 (tie at 0 -> lowest index); probe: 4 (8), 2 (7);
    # recency: last block 5 replaces probe block 2 (lowest probe among probe-chosen), not
    # block 1 which has the lowest probe of all but is importance-reserved.
    assert both(probe, imp, 4) == ([0, 1, 4, 5], ["importance", "importance", "probe", "recency"])


def test_recency_replacement_tie_replaces_larger_index():
    assert both([4, 4, 9, 0], None, 3) == ([0, 2, 3], ["probe", "probe", "recency"])


def test_last_block_chosen_by_probe_needs_no_recency():
    assert both([0, 1, 2, 3], None, 2) == ([2, 3], ["probe", "probe"])


def test_k_above_block_count_selects_everything():
    assert both([1, 2, 3], None, 5) == ([0, 1, 2], ["probe"] * 3)
    # budget min((5+1)//2, 3) = 3: every block goes to importance
    assert both([1, 2, 3], [0.5, 0.1, 0.2], 5) == ([0, 1, 2], ["importance"] * 3)
    assert both([1, 2, 3, 4], [0.5, 0.1, 0.2, 0.0], 4) == ([0, 1, 2, 3], ["importance", "probe", "importance", "probe"])


def test_single_block():
    assert both([-3], None, 32) == ([0], ["probe"])
    assert both([-3], [0.0], 1) == ([0], ["importance"])


def test_numba_and_python_agree_on_random_cases():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        probe = rng.integers(-3, 4, n).astype(np.float32)  # many ties on purpose
        imp = rng.integers(0, 3, n).astype(np.float32) if rng.random() < 0.6 else None
        both(probe, imp, int(rng.integers(1, 45)))


def test_probe_maxima_uses_uniform_steps_and_short_last_block():
    dots = np.zeros(70, np.float32)
    dots[13] = 5.0  # not on a probe (step 32//8 = 4): invisible
    dots[12] = 2.0  # on a probe
    dots[67] = 3.0  # short last block [64, 70): probe 8 -> step 1, probe 2 -> step 3 (64, 67)
    dots[68] = 9.0
    got = probe_block_maxima(dots, 70, 32, 8)
    np.testing.assert_array_equal(got, np.float32([2.0, 0.0, 9.0]))
    got = probe_block_maxima(dots, 70, 32, 2)  # step 16: probes 0, 16 / 32, 48 / 64, 67
    np.testing.assert_array_equal(got, np.float32([0.0, 0.0, 3.0]))
    np.testing.assert_array_equal(
        block_sums(np.arange(70, dtype=np.float32), 70, 32),
        np.float32([sum(range(32)), sum(range(32, 64)), sum(range(64, 70))]),
    )


def _needle_cache(dtype, n, needle_pos, D=8):
    """Keys orthogonal to the query (dot exactly 0) except one aligned key at needle_pos."""
    rng = np.random.default_rng(0)
    K = np.zeros((n, 1, D), np.float32)
    K[:, 0, 1] = 0.5
    K[needle_pos, 0, 0] = 4.0
    V = rng.standard_normal((n, 1, D)).astype(np.float32)
    q = np.zeros((1, D), np.float32)
    q[0, 0] = 1.0
    cache = KVCache(1, 1, D, n, dtype)
    cache.append(0, 0, K, V)
    return cache, q


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_needle_mid_block_found_by_probe_max(dtype):
    # 6 blocks of 26; probe 2 -> step 13: probes at offsets 0 (dull) and 13 (the needle)
    n, needle = 26 * 6, 26 * 2 + 13
    cache, q = _needle_cache(dtype, n, needle)
    cache.sparse[0].importance[3 * 26 : 4 * 26] = 1.0
    cache.sparse[0].importance[4 * 26 : 5 * 26] = 0.5

    def run(k, probe):
        trace = []
        decode_attention(
            q, cache.layers[0], cache.sparse[0], n, 1 / math.sqrt(8), SparseParams(k=k, block=26, probe=probe), trace
        )
        return [rec[:3] for rec in trace]  # (head, blocks, stages); mass is tested elsewhere

    # k=4: importance 3, 4; probe: 2 (the needle), then 0 (ties at 0 -> lowest);
    # recency: last block 5 replaces block 0 (lowest probe among probe-chosen)
    assert run(4, 2) == [(0, [2, 3, 4, 5], ["probe", "importance", "importance", "recency"])]
    # k=2: importance 3; probe 2; recency replaces it (the only probe-chosen block)
    assert run(2, 2) == [(0, [3, 5], ["importance", "recency"])]
    # probe 6 -> step 4: offset 13 is never probed, all probes tie at 0 -> blocks 0, 1 and
    # recency replaces block 1 (tie: larger index); the needle block is missed
    assert run(4, 6) == [(0, [0, 3, 4, 5], ["probe", "importance", "importance", "recency"])]


def test_sequence_shorter_than_one_block():
    cache, q = _needle_cache("f32", 5, 3)
    layer, st = cache.layers[0], cache.sparse[0]
    trace = []
    exact = decode_attention(q, layer, st, 5, 0.5)
    sparse = decode_attention(q, layer, st, 5, 0.5, SparseParams(k=1, block=32), trace)
    assert [rec[:3] for rec in trace] == [(0, [0], ["importance"])]
    assert np.array_equal(exact, sparse)
