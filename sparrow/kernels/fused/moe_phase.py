"""The fused decode step's MoE phase: one token's sparse MLP block (Qwen3-MoE) on every thread.

Called by decode_step.worker in place of the dense gate/up/down phases for a layer whose MLP is
a MoE block, with h the worker's normed copy of x [1, E]; x (the residual stream) gets the
block's output added. Three barriers:

    router logits (each worker its share of the experts) | -> top-k (each worker, redundantly,
    the same _route) -> gate/up rows of the k experts, silu * up (each worker its share of the
    k * F rows) | -> down rows of the k experts and their weighted sum (each worker its share of
    the E output rows) |

Bit-identical to the staged path (models/qwen3_moe.MoEBlock with kernels/moe.expert_pairs):
the router rows are dotted by widen.dot as linear()'s f32 matvec dots them, routing is the
same _route, and the experts' rows, silu and weighted sum are kernels/moe.py's own helpers
(gate_up_rows, down_rows, combine_rows), the sum in ascending expert order as MoEBlock adds.
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
    logits: np.ndarray  # [1, NE] router logits, shared by the workers
    g: np.ndarray  # [k, F] gate rows of the routed experts, shared
    u: np.ndarray  # [k, F]
    act: np.ndarray  # [k, F] silu(g) * u
    ys: np.ndarray  # [k, E] each routed expert's down output


@njit(**KW)
def _share(n, tid, nt):
    return n * tid // nt, n * (tid + 1) // nt


@njit(**KW)
def moe_phase(tid, nt, sync, layer, h, x, moe):
    """Layer `layer`'s MoE block for worker tid of nt (see the module doc); False, doing
    nothing, where the layer is dense."""
    if not moe.sparse[layer]:
        return False
    k = moe.top_k
    ne, e_n = moe.router[layer, 1], moe.router[layer, 2]
    router = view(moe.router[layer, 0], (ne, e_n), _F32_LIKE)
    logits = moe.logits
    a, b = _share(ne, tid, nt)
    for o in range(a, b):
        logits[0, o] = dot(router[o], h[0])
    barrier(sync, nt)
    idx = np.empty((1, k), np.int64)
    w = np.empty((1, k), np.float32)
    _route(logits, k, moe.norm, idx, w)
    es = np.empty(k, np.int64)  # the routed experts in ascending order, with their weights
    ws = np.empty(k, np.float32)
    for j in range(k):
        es[j], ws[j] = idx[0, j], w[0, j]
    for j in range(1, k):  # insertion sort: k is small, experts distinct
        i = j
        while i > 0 and es[i - 1] > es[i]:
            es[i - 1], es[i] = es[i], es[i - 1]
            ws[i - 1], ws[i] = ws[i], ws[i - 1]
            i -= 1
    etab, dims, kinds, addrs = moe.etab[layer], moe.dims[layer], moe.kinds[layer], moe.addrs
    g, u, act, ys = moe.g, moe.u, moe.act, moe.ys
    f_n = dims[0, 0]
    sxg = exact_sums(h, kinds[0], True)
    sxu = exact_sums(h, kinds[1], True)
    a, b = _share(k * f_n, tid, nt)
    for j in range(k):
        f0, f1 = max(a, j * f_n) - j * f_n, min(b, (j + 1) * f_n) - j * f_n
        if f1 > f0:
            gate_up_rows(etab, dims, kinds, es[j], h, sxg, sxu, g[j : j + 1], u[j : j + 1], act[j : j + 1], f0, f1,
                         addrs)  # fmt: skip
    barrier(sync, nt)
    a, b = _share(x.shape[1], tid, nt)
    if b > a:
        for j in range(k):
            aj = np.ascontiguousarray(act[j : j + 1])
            down_rows(etab, dims, kinds, es[j], aj, exact_sums(aj, kinds[2], True), ys[j : j + 1], a, b, addrs)
        combine_rows(ys, ws, k, x, a, b)
    barrier(sync, nt)
    return True
