"""Block selection for block-sparse top-k attention (spec: shared/SPARSE_ATTENTION.md).

The four-stage rule twice over:
- `select_blocks` (with `probe_block_maxima` and `block_sums` for its inputs): plain Python
  over numpy arrays, one call per query head, for tests and tooling.
- `reserve_importance_nb` (stage 2) and `fill_probe_nb` (stages 3 and 4): the numba halves
  the attention kernels call, the reservation once per layer and decode step (importance is
  per layer), the fill once per query head.
Selections are block ids in ascending order with the stage that chose each block.
"""

import numpy as np
from numba import njit

STAGE_IMPORTANCE = 0
STAGE_PROBE = 1
STAGE_RECENCY = 2
STAGE_NAMES = ("importance", "probe", "recency")

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
    m = 0
    for b in range(n):
        if mark[b] >= 0:
            sel[m] = b
            stages[m] = mark[b]
            m += 1
    return m
