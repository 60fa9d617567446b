"""Block selection for block-sparse top-k attention: `seed` (spec: shared/SPARSE_ATTENTION.md)
and `v2` (spec: docs/SPARSE_SELECT_V2.md).

seed, the four-stage rule twice over:
- `select_blocks` (with `probe_block_maxima` and `block_sums` for its inputs): plain Python
  over numpy arrays, one call per query head, for tests and tooling.
- `reserve_importance_nb` (stage 2) and `fill_probe_nb` (stages 3 and 4): the numba halves
  the attention kernels call, the reservation once per layer and decode step (importance is
  per layer), the fill once per query head.
v2: `summarise_block` (a block's key mean and variance, the row its score is a dot with),
`v2_query` (the query side of that dot) and `select_v2_nb` (recency, sink, then top scores).
v3 (spec: docs/SPARSE_SELECT_V3.md): `quantize_keys` (the int8 key codes every block's mass
is estimated from), `v3_query` (the query's codes) and `select_v3_nb` (top k, or top p of the
estimated mass); the scores themselves are attention.decode's `_v3_scores`.
Selections are block ids in ascending order with the stage that chose each block.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from sparrow.kernels.elementwise import _quant_rows
from sparrow.kernels.ir import f16_bits
from sparrow.params import (
    V2_ON,
    V2_RECENT,
    V2_SINK,
    V3_MIN_SHIFT,
    V3_P_ONE,
    V3_P_SHIFT,
)

STAGE_IMPORTANCE = 0
STAGE_PROBE = 1
STAGE_RECENCY = 2
STAGE_SINK = 3
STAGE_SCORE = 4
STAGE_NAMES = ("importance", "probe", "recency", "sink", "score")

PROBE_START = -1e30


def probe_block_maxima(dots, seq_len, block, n_probe):
    """Spec stage 1 from precomputed per-position dots [seq_len]: max over the probed keys."""
    n_blocks = (seq_len + block - 1) // block
    out = np.empty(n_blocks, dtype=np.float32)
    for b in range(n_blocks):
        p0, p1 = b * block, min((b + 1) * block, seq_len)
        step = max(1, (p1 - p0) // n_probe)
        best = np.float32(PROBE_START)
        for ps in range(p0, p1, step):
            if dots[ps] > best:
                best = dots[ps]
        out[b] = best
    return out


def block_sums(importance, seq_len, block):
    """Per-block float32 sums of importance[:seq_len], summed in position order."""
    n_blocks = (seq_len + block - 1) // block
    out = np.zeros(n_blocks, dtype=np.float32)
    for b in range(n_blocks):
        acc = np.float32(0.0)
        for p in range(b * block, min((b + 1) * block, seq_len)):
            acc = np.float32(acc + importance[p])
        out[b] = acc
    return out


def select_blocks(probe_scores, imp_sums, k):
    """Select up to k blocks; returns (blocks: list[int] ascending, stages: list[str]).

    probe_scores: per-block probe maxima; imp_sums: per-block importance sums or None.
    """
    probe = [float(x) for x in probe_scores]
    n = len(probe)
    stage = {}  # block -> stage name
    if imp_sums is not None:
        imp = [float(x) for x in imp_sums]
        for _ in range(min((k + 1) // 2, n)):
            best = None
            for b in range(n):  # strict > keeps the lower index on ties
                if b not in stage and (best is None or imp[b] > imp[best]):
                    best = b
            stage[best] = "importance"
    while len(stage) < min(k, n):
        best = None
        for b in range(n):
            if b not in stage and (best is None or probe[b] > probe[best]):
                best = b
        stage[best] = "probe"
    last = n - 1
    if n > 0 and last not in stage:
        victim = None
        for b in sorted(stage):  # <= moves a tie onto the larger index
            if stage[b] == "probe" and (victim is None or probe[b] <= probe[victim]):
                victim = b
        if victim is not None:
            del stage[victim]
            stage[last] = "recency"
    blocks = sorted(stage)
    return blocks, [stage[b] for b in blocks]


@njit(cache=True, nogil=True)
def _emit(mark, sel, stages):
    """Marked blocks (stage code >= 0) -> ascending ids in sel[:m], their stages; returns m."""
    m = 0
    for b in range(mark.shape[0]):
        if mark[b] >= 0:
            sel[m] = b
            stages[m] = mark[b]
            m += 1
    return m


@njit(cache=True, nogil=True)
def reserve_importance_nb(imp, k, n):
    """Stage 2 alone: stage codes per block (-1 unused, STAGE_IMPORTANCE reserved).

    Importance is per layer, so one reservation serves every query head of a decode step."""
    mark = np.full(n, -1, dtype=np.int8)
    for _ in range(min((k + 1) // 2, n)):
        best = -1
        for b in range(n):  # strict > keeps the lower index on ties
            if mark[b] < 0 and (best < 0 or imp[b] > imp[best]):
                best = b
        mark[best] = STAGE_IMPORTANCE
    return mark


@njit(cache=True, nogil=True)
def fill_probe_nb(probe, reserved, k, sel, stages):
    """Stages 3 and 4 after a reservation (`reserve_importance_nb`, or all -1 without
    importance): writes ascending ids to sel[:m], stage codes to stages[:m], returns m."""
    n = probe.shape[0]
    mark = reserved.copy()
    taken = 0
    for b in range(n):
        taken += mark[b] >= 0
    limit = min(k, n)
    if taken < limit:
        # a stable sort of -probe lists blocks by falling probe, ties by index: the greedy
        # "largest probe, lowest index first" of the spec in O(n log n) instead of O(k n)
        order = np.argsort(-probe, kind="mergesort")
        for b in order:
            if taken >= limit:
                break
            if mark[b] < 0:
                mark[b] = STAGE_PROBE
                taken += 1
    last = n - 1
    if n > 0 and mark[last] < 0:
        victim = -1
        for b in range(n):  # <= moves a tie onto the larger index
            if mark[b] == STAGE_PROBE and (victim < 0 or probe[b] <= probe[victim]):
                victim = b
        if victim >= 0:
            mark[victim] = -1
            mark[last] = STAGE_RECENCY
    return _emit(mark, sel, stages)


# ---------------------------------------------------------------- v2 (docs/SPARSE_SELECT_V2.md)
def key_f32(K2, ks, lut, t, d):
    """Stored key K2[t, d] as float32: f32 as is, f16 bits via lut, int8 code * its scale ks[t]."""


@overload(key_f32, inline="always")
def _key_f32(K2, ks, lut, t, d):
    if K2.dtype == types.float32:
        return lambda K2, ks, lut, t, d: K2[t, d]
    if K2.dtype == types.uint16:
        return lambda K2, ks, lut, t, d: lut[K2[t, d]]
    if K2.dtype == types.int8:
        return lambda K2, ks, lut, t, d: np.float32(K2[t, d]) * ks[t]
    return None


F16_MAX = np.float32(65504.0)  # the largest finite float16


@njit(cache=True, nogil=True, inline="always")
def _f16_clamped(x):
    """x rounded to float16 bits (to nearest, ties to even), magnitudes past F16_MAX held at it."""
    return f16_bits(min(max(x, -F16_MAX), F16_MAX))


@njit(cache=True, nogil=True)
def summarise_block(K2, ks, lut, p0, p1, out):
    """out[:D] = mean, out[D:] = variance of keys p0..p1-1 per channel as float16 bits (uint16),
    computed in float32 (sums in position order, then / n; the variance is the mean of
    (k - mean)**2, two passes, no cancellation) and rounded once: the scores read half the bytes
    an f32 summary takes, which at 128K is most of what v2's selection reads."""
    D = K2.shape[1]
    n = np.float32(p1 - p0)
    for d in range(D):
        a = np.float32(0.0)
        for t in range(p0, p1):
            a += key_f32(K2, ks, lut, t, d)
        mu = a / n
        v = np.float32(0.0)
        for t in range(p0, p1):
            x = key_f32(K2, ks, lut, t, d) - mu
            v += x * x
        out[d] = _f16_clamped(mu)
        out[D + d] = _f16_clamped(v / n)


@njit(cache=True, nogil=True)
def summarise_blocks(K, ks, lut, block, b0, b1, rows):
    """rows[kh, b] = summarise_block of full block b of every KV head, for b0 <= b < b1."""
    for kh in range(K.shape[0]):
        for b in range(b0, b1):
            summarise_block(K[kh], ks[kh], lut, b * block, b * block + block, rows[kh, b])


@njit(cache=True, nogil=True)
def v2_query(q, qs, int8, scale, u):
    """u = [scale * q, (scale * scale * 0.5) * q * q], one head (int8: q = codes * qs), so that
    u . [mean, var] = scale * q.mean + scale**2 / 2 * sum(q**2 var): the log of a block's
    softmax mass if its scores were Gaussian, less log(n)."""
    D = q.shape[0]
    half = np.float32(scale * scale) * np.float32(0.5)
    for d in range(D):
        x = q[d] * qs if int8 else q[d]
        u[d] = x * scale
        u[D + d] = half * (x * x)


@njit(cache=True, nogil=True, inline="always")
def _above(x, y):
    """x ranks above y: the larger value, NaN above every number (np.partition's order)."""
    return x > y or (x != x and y == y)


@njit(cache=True, nogil=True)
def _kth_largest_free(score, mark, want):
    """The want-th largest score[b] over the free blocks (mark[b] < 0), repeats counted, as
    np.partition finds it, from one pass with a min-heap of the want largest so far: the pass
    reads each score once and k is small (4,096 blocks a head at 128K, k = 32), where a
    partition copies the scores twice and walks them several times."""
    heap = np.empty(want, dtype=np.float32)  # heap[0]: the lowest-ranked of those kept
    m = 0
    for b in range(score.shape[0]):
        if mark[b] >= 0:
            continue
        x = score[b]
        if m < want:
            i = m
            m += 1
            while i > 0:
                p = (i - 1) >> 1
                if not _above(heap[p], x):
                    break
                heap[i] = heap[p]
                i = p
            heap[i] = x
        elif _above(x, heap[0]):
            i = 0
            while True:
                c = 2 * i + 1
                if c >= want:
                    break
                if c + 1 < want and _above(heap[c], heap[c + 1]):
                    c += 1
                if not _above(x, heap[c]):
                    break
                heap[i] = heap[c]
                i = c
            heap[i] = x
    return heap[0]


@njit(cache=True, nogil=True)
def select_v2_nb(score, flags, k, sel, stages):
    """v2 selection over n = len(score) blocks: the last block (with V2_RECENT), block 0 (with
    V2_SINK), then the largest scores, ties to the lower index, until k are taken; writes
    ascending ids to sel[:m], stage codes to stages[:m], returns m."""
    n = score.shape[0]
    mark = np.full(n, -1, dtype=np.int8)
    taken = 0
    limit = min(k, n)
    if flags & V2_RECENT and taken < limit:
        mark[n - 1] = STAGE_RECENCY
        taken += 1
    if flags & V2_SINK and taken < limit and mark[0] < 0:
        mark[0] = STAGE_SINK
        taken += 1
    want = limit - taken
    if want > 0:
        # the want-th largest free score, then every free block above it and, in index
        # order, as many at it as fit: "largest first, ties to the lower index"
        thr = _kth_largest_free(score, mark, want)
        for b in range(n):
            if mark[b] < 0 and score[b] > thr:
                mark[b] = STAGE_SCORE
                want -= 1
        for b in range(n):
            if want == 0:
                break
            if mark[b] < 0 and score[b] == thr:
                mark[b] = STAGE_SCORE
                want -= 1
    return _emit(mark, sel, stages)


# ---------------------------------------------------------------- v3 (docs/SPARSE_SELECT_V3.md)
def quantize_key_rows(K2, ks, lut, t0, t1, codes, scale):
    """codes[j], scale[j] = K2[t0 + j] as the int8 cache stores a row (codes and absmax / 127),
    for t0 <= t0 + j < t1: an int8 cache's rows as stored, float rows widened and quantised."""


@overload(quantize_key_rows, inline="always")
def _quantize_key_rows(K2, ks, lut, t0, t1, codes, scale):
    if K2.dtype == types.int8:

        def stored(K2, ks, lut, t0, t1, codes, scale):
            for t in range(t0, t1):
                codes[t - t0] = K2[t]
                scale[t - t0] = ks[t]

        return stored

    def quantised(K2, ks, lut, t0, t1, codes, scale):
        wide = np.empty((1, K2.shape[1]), dtype=np.float32)
        for t in range(t0, t1):
            for d in range(K2.shape[1]):
                wide[0, d] = key_f32(K2, ks, lut, t, d)
            _quant_rows(wide, codes[t - t0 : t - t0 + 1], scale[t - t0 : t - t0 + 1])

    return quantised


@njit(cache=True, nogil=True)
def quantize_keys(K, ks, lut, block, b0, b1, codes, scale):
    """codes[kh, t], scale[kh, t] for the rows t of full blocks b0 <= b < b1 of every KV head
    (state.sparse.KeyCodes of a float cache): the rows quantize_key_rows gives."""
    for kh in range(K.shape[0]):
        t0, t1 = b0 * block, b1 * block
        quantize_key_rows(K[kh], ks[kh], lut, t0, t1, codes[kh, t0:t1], scale[kh, t0:t1])


@njit(cache=True, nogil=True)
def v3_query(qh, qsh, int8, codes):
    """codes = the int8 codes of one head's query as float32 (exact small integers); returns
    their scale. With an int8 cache qh already holds them (the attention's query, scale qsh)."""
    if int8:
        codes[:] = qh
        return qsh
    c = np.empty((1, qh.shape[0]), dtype=np.int8)
    sc = np.empty(1, dtype=np.float32)
    _quant_rows(qh.reshape((1, qh.shape[0])), c, sc)
    for d in range(qh.shape[0]):
        codes[d] = np.float32(c[0, d])
    return sc[0]


@njit(cache=True, nogil=True)
def v3_budget(flags):
    """(min_blocks, p in units of 2**-16, 0 for a fixed k) from SparseParams.flags."""
    return (flags >> V3_MIN_SHIFT) & 0xFFFF, (flags >> V3_P_SHIFT) & 0x1FFFF


@njit(cache=True, nogil=True)
def _top_in_order(mass, want):
    """The want blocks of largest mass, by falling mass, ties by index: the first want entries of
    a stable argsort of -mass, from one pass for the want-th largest and a sort of want blocks
    (k = 32 of 1,024 blocks at 32K: the full sort was most of top-p's cost)."""
    thr = _kth_largest_free(mass, np.full(mass.shape[0], -1, dtype=np.int8), want)
    top = np.empty(want, dtype=np.int64)  # those above thr, then as many at it, each in index order
    m = 0
    for b in range(mass.shape[0]):
        if mass[b] > thr:
            top[m] = b
            m += 1
    for b in range(mass.shape[0]):
        if m == want:
            break
        if mass[b] == thr:
            top[m] = b
            m += 1
    return top[np.argsort(-mass[top], kind="mergesort")]


@njit(cache=True, nogil=True)
def select_v3_nb(mass, flags, k, sel, stages):
    """v3 selection over n = len(mass) blocks by estimated log mass: the k largest, ties to the
    lower index, or (a p in flags) blocks in that order until their estimated share of the
    mass reaches p, at least min_blocks and at most k; writes ascending ids to sel[:m], stage
    codes to stages[:m], returns m."""
    min_blocks, p_units = v3_budget(flags)
    if p_units == 0:
        return select_v2_nb(mass, V2_ON, k, sel, stages)  # no sink or recency: the top k alone
    n = mass.shape[0]
    order = _top_in_order(mass, min(k, n))
    top = np.float64(mass[order[0]])
    share = np.empty(n, dtype=np.float64)  # each block's mass relative to the heaviest's
    total = 0.0
    for b in range(n):
        share[b] = math.exp(np.float64(mass[b]) - top)
        total += share[b]
    target = (p_units / V3_P_ONE) * total
    mark = np.full(n, -1, dtype=np.int8)
    taken, covered = 0, 0.0
    for r in range(order.shape[0]):
        if taken >= min_blocks and covered >= target:
            break
        mark[order[r]] = STAGE_SCORE
        covered += share[order[r]]
        taken += 1
    return _emit(mark, sel, stages)
