"""The fused decode step's MoE phase: the sparse MLP block (Qwen3-MoE) of a step's rows on every thread.

Called by decode_step.fused_decode_step in place of the dense gate/up/down phases for a layer whose MLP is
a MoE block, with h the worker's normed copy of x [R, E] (R rows: a decode step's one, a
batch's, or verification's); x (the residual stream) gets the block's output added. Three
barriers:

    router logits (each worker its share of the experts, for every row) | -> top-k of each row
    (each worker, redundantly, the same _route), the rows' (row, expert) pairs grouped by expert
    -> gate/up rows of the routed experts, silu * up (each worker its share of the groups' rows,
    an expert's rows read once for all the rows it serves) | -> down rows of those experts and
    each row's weighted sum (each worker its share of the E output rows) |

Bit-identical to the staged path (models/qwen3_moe.MoEBlock with kernels/moe.expert_pairs) and
to a row's own step: the router rows are dotted by widen.dot as linear()'s f32 matvec dots them,
routing is the same _route, and the experts' rows, silu and weighted sum are kernels/moe.py's own
helpers (gate_up_rows, down_rows, combine_rows), whose row dots give each row the same bits
whatever other rows share the call; the sum in ascending expert order as MoEBlock adds.
Experts are read where the file mapping holds them (ExpertTable's addresses), in both
activations modes: their rows take the exact row dots, whose address the record carries.
"""

from typing import NamedTuple

import numpy as np
from numba import njit

from sparrow.kernels.fused.sync import barrier
from sparrow.kernels.matmul.widen import dot, exact_sums
from sparrow.kernels.moe import _route, combine_rows, down_rows, gate_up_rows
from sparrow.kernels.native_call import view
from sparrow.kernels.options import KW

_F32_LIKE = np.zeros((0, 0), np.float32)  # the routers' type (read-only f32 rows), for view()
_F32_LIKE.flags.writeable = False


class StepMoE(NamedTuple):
    """The MoE layers of a fused step (built once per model by models/qwen3_moe.step_moe)."""

    sparse: np.ndarray  # [L] int64: 1 where the layer's MLP is a MoE block
    router: np.ndarray  # [L, 3] (address, experts, E) of each MoE layer's f32 router rows
    etab: np.ndarray  # [L, 3, NE] each expert's gate / up / down rows (kernels.moe.ExpertTable)
    dims: np.ndarray  # [L, 3, 2] their (rows, bytes a row)
    kinds: np.ndarray  # [L, 3] their formats.KIND
    addrs: tuple  # (widen.rows_exact's address, its K-quant row loop's or 0)
    top_k: int
    norm: bool  # renormalise the top-k weights
    # shared by the workers, for up to SMALL_T rows (P = rows x top_k (row, expert) pairs)
    logits: np.ndarray  # [SMALL_T, NE] router logits
    g: np.ndarray  # [SMALL_T * k, F] gate rows of the routed experts, a row a pair
    u: np.ndarray  # [SMALL_T * k, F]
    act: np.ndarray  # [SMALL_T * k, F] silu(g) * u
    ys: np.ndarray  # [SMALL_T * k, E] each pair's expert's down output


@njit(**KW)
def _share(n, tid, nt):
    return n * tid // nt, n * (tid + 1) // nt


@njit(**KW)
def moe_phase(tid, nt, sync, layer, h, x, moe):
    """Layer `layer`'s MoE block for worker tid of nt over the rows of h and x [R, E] (see the
    module doc); False, doing nothing, where the layer is dense."""
    if not moe.sparse[layer]:
        return False
    R, k = x.shape[0], moe.top_k
    ne, e_n = moe.router[layer, 1], moe.router[layer, 2]
    router = view(moe.router[layer, 0], (ne, e_n), _F32_LIKE)
    logits = moe.logits[:R]
    a, b = _share(ne, tid, nt)
    for r in range(R):
        for o in range(a, b):
            logits[r, o] = dot(router[o], h[r])
    barrier(sync, nt)
    idx = np.empty((R, k), np.int64)
    w = np.empty((R, k), np.float32)
    _route(logits, k, moe.norm, idx, w)
    # the (row, expert) pairs by expert (a stable sort of row-major order: rows ascending
    # within an expert), so each routed expert's rows are read once for all its rows
    P = R * k
    pe, pr, pw = idx.ravel().copy(), np.empty(P, np.int64), w.ravel().copy()  # [P] expert, row, weight
    for p in range(P):
        pr[p] = p // k
    for j in range(1, P):  # insertion sort: P <= SMALL_T * k is small
        i = j
        while i > 0 and pe[i - 1] > pe[i]:
            pe[i - 1], pe[i] = pe[i], pe[i - 1]
            pr[i - 1], pr[i] = pr[i], pr[i - 1]
            pw[i - 1], pw[i] = pw[i], pw[i - 1]
            i -= 1
    rp = np.empty((R, k), np.int64)  # each row's pairs, in ascending expert order
    n_r = np.zeros(R, np.int64)
    gs = np.empty(P + 1, np.int64)  # group gi (one expert) holds pairs gs[gi]..gs[gi + 1]-1
    ng = 0
    for p in range(P):
        rp[pr[p], n_r[pr[p]]] = p
        n_r[pr[p]] += 1
        if p == 0 or pe[p] != pe[p - 1]:
            gs[ng] = p
            ng += 1
    gs[ng] = P
    experts = (moe.etab[layer], moe.dims[layer], moe.kinds[layer], moe.addrs)  # moe.ExpertTable.kernel_form
    dims, kinds = experts[1], experts[2]
    g, u, act, ys = moe.g, moe.u, moe.act, moe.ys
    f_n = dims[0, 0]
    a, b = _share(ng * f_n, tid, nt)
    for gi in range(ng):
        f0, f1 = max(a, gi * f_n) - gi * f_n, min(b, (gi + 1) * f_n) - gi * f_n
        if f1 > f0:
            p0, p1 = gs[gi], gs[gi + 1]
            xg = np.empty((p1 - p0, e_n), np.float32)  # the group's rows of h
            for p in range(p0, p1):
                xg[p - p0] = h[pr[p]]
            sums = (exact_sums(xg, kinds[0], True), exact_sums(xg, kinds[1], True))
            gate_up_rows(experts, pe[p0], xg, sums, (g[p0:p1], u[p0:p1], act[p0:p1]), f0, f1)
    barrier(sync, nt)
    a, b = _share(x.shape[1], tid, nt)
    if b > a:
        for gi in range(ng):
            p0, p1 = gs[gi], gs[gi + 1]
            ag = np.ascontiguousarray(act[p0:p1])
            down_rows(experts, pe[p0], ag, exact_sums(ag, kinds[2], True), ys[p0:p1], a, b)
        for r in range(R):
            combine_rows(ys, pw, rp[r], x, r, a, b)
    barrier(sync, nt)
    return True
