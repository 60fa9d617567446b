"""Mixture-of-experts kernels (Qwen3-MoE).

route: softmax over all experts, top-k, optional renormalisation; one token row at a time by
one fixed loop, so a token's experts and weights do not depend on the other rows or the
thread count. Ties go to the lower expert index (as a stable argsort on -probs): the scan
only replaces its best on a strictly larger value. Serial: it is tiny, and on a shared
machine every parallel launch can wait a scheduler slice for its threads.

expert_pairs: the SwiGLU experts for a list of (token, expert) pairs in two parallel launches
(gate+up, then down) instead of three linear calls per expert; parallel over (expert, chunk
of weight rows), so each output has one writer, and each output depends only on its own pair
(batch and thread invariant). A work item dots its chunk of rows with all of its expert's
pairs at once, so each row is read once for all of them (a 96-token prompt's few-row experts:
1.7x faster than a pair at a time). Experts in a block format (q8_0, q4_0, q4_1, q5_0, q5_1 and the
K-quants, as GGUF files store them) are dotted with the pairs' f32 activation rows by the exact
decode's row dots (widen.rows_exact, called through its address): a row's order is the one a
dense matvec over the same format takes, and the rows are read straight from their blocks.
They are reached through a table of addresses (ExpertTable: each expert's rows, a view of the
file mapping), and the helpers gate_up_rows / down_rows / combine_rows are shared with the
fused decode step's MoE phase (kernels/fused/moe_phase.py), which therefore gives the same
bits. f16 / bf16 / f32 experts (HF folders) are widened to f32 once per expert and dotted by
one fixed order (widen_row, then widen.dot's ir.lane_dot), the order of linear()'s matvec over those formats.
The widening and dot helpers are kernels/matmul/widen.py's (the numba cache directory is keyed
on every kernel source, so an edit there recompiles these too).
"""

import math

import numba
import numpy as np
from numba import njit, prange

from sparrow.kernels.formats import BY_NAME, KIND, KQ_FIRST
from sparrow.kernels.matmul.widen import F16_LUT, call_slp, exact_rows_address, exact_sums, kq_rows_address
from sparrow.kernels.matmul.widen import dot as _dot
from sparrow.kernels.matmul.widen import widen_row as _widen_row
from sparrow.kernels.native_call import call_native, view
from sparrow.kernels.options import KW
from sparrow.kernels.options import ROWS as _ROWS
from sparrow.kernels.parallel import run_parallel

ROWS_LIKE = np.zeros((0, 0), np.uint8)  # an expert's rows as the row dots read them (read-only bytes), for view()
ROWS_LIKE.flags.writeable = False


@njit(**KW)
def _route(logits, k, norm, idx, w):
    t_n, n = logits.shape
    for t in range(t_n):
        row = logits[t]
        m = row[0]
        for e in range(1, n):
            m = max(m, row[e])
        p = np.empty(n, np.float32)
        s = np.float32(0)
        for e in range(n):
            p[e] = np.float32(math.exp(row[e] - m))
            s += p[e]
        for e in range(n):
            p[e] = p[e] / s
        taken = np.zeros(n, np.bool_)
        for j in range(k):
            best = -1
            for e in range(n):
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            idx[t, j] = best
            w[t, j] = p[best]
        if norm:
            tot = np.float32(0)
            for j in range(k):
                tot += w[t, j]
            for j in range(k):
                w[t, j] = w[t, j] / tot


def route(logits, k, norm):
    """logits f32 [T, n] -> (experts int64 [T, k] by descending weight, weights f32 [T, k])."""
    t_n, n = logits.shape
    if not 0 < k <= n:
        raise ValueError(f"route: top-{k} of {n} experts")
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    idx = np.empty((t_n, k), np.int64)  # [T, k]
    w = np.empty((t_n, k), np.float32)  # [T, k]
    if t_n:
        _route(logits, k, bool(norm), idx, w)
    return idx, w


@njit(parallel=True, **KW)
def _gate_up(x, tok, groups, gates, ups, kg, ku, lut, h):
    # h[p, f] = silu(gate_e[f] . x[tok[p]]) * (up_e[f] . x[tok[p]]) for the pairs p of group
    # g (groups (gstart, gexp): expert e = gexp[g]); each weight row is widened once per group.
    gstart, gexp = groups
    f_n = h.shape[1]
    k = x.shape[1]
    nc = (f_n + _ROWS - 1) // _ROWS
    for c in prange(len(gexp) * nc):
        g = c // nc
        f0 = (c % nc) * _ROWS
        gw = gates[gexp[g]]
        uw = ups[gexp[g]]
        bg = np.empty(k, np.float32)
        bu = np.empty(k, np.float32)
        bg_bits = bg.view(np.uint32)
        bu_bits = bu.view(np.uint32)
        for f in range(f0, min(f_n, f0 + _ROWS)):
            _widen_row(gw[f], kg, lut, bg, bg_bits, True)
            _widen_row(uw[f], ku, lut, bu, bu_bits, True)
            for p in range(gstart[g], gstart[g + 1]):
                xr = x[tok[p]]
                gv = _dot(bg, xr)
                uv = _dot(bu, xr)
                h[p, f] = gv / (np.float32(1) + np.float32(math.exp(-gv))) * uv


@njit(parallel=True, **KW)
def _down(h, groups, downs, kd, lut, y):
    # y[p, o] = down_e[o] . h[p] for the pairs p of group g (expert e = gexp[g])
    gstart, gexp = groups
    o_n = y.shape[1]
    k = h.shape[1]
    nc = (o_n + _ROWS - 1) // _ROWS
    for c in prange(len(gexp) * nc):
        g = c // nc
        o0 = (c % nc) * _ROWS
        dw = downs[gexp[g]]
        buf = np.empty(k, np.float32)
        bits = buf.view(np.uint32)
        for o in range(o0, min(o_n, o0 + _ROWS)):
            _widen_row(dw[o], kd, lut, buf, bits, True)
            for p in range(gstart[g], gstart[g + 1]):
                y[p, o] = _dot(buf, h[p])


class ExpertTable:
    """Experts in a block format as tables the kernels read (no copies): etab [3, NE] the
    address of each expert's gate, up and down rows, dims [3, 2] their (rows, bytes a row),
    kinds [3] their formats.KIND, addrs (rows_exact's address, its K-quant row loop's or 0).
    The experts' Weights (views of the file mapping) must outlive the table: MoEBlock holds both."""

    def __init__(self, experts):
        self.ffn, self.hidden = experts[0].gate.shape
        etab, dims, kinds = [], [], []
        for proj in ("gate", "up", "down"):
            ws = [getattr(ex, proj) for ex in experts]
            if len({w.qtype for w in ws}) != 1 or len({w.shape for w in ws}) != 1:
                raise ValueError(f"experts' {proj} weights differ in type or shape")
            if BY_NAME[ws[0].qtype].row_dot == "widened" or any(
                w.data.dtype != np.uint8 or not w.data.flags.c_contiguous or w.data.ndim != 2 for w in ws
            ):
                raise ValueError(f"experts' {proj} weights are not rows of a block format")
            etab.append([w.data.ctypes.data for w in ws])
            dims.append(ws[0].data.shape)
            kinds.append(KIND[ws[0].qtype])
        self.etab = np.array(etab, np.int64)  # [3, NE]
        self.dims = np.array(dims, np.int64)  # [3, 2]
        self.kinds = np.array(kinds, np.int64)  # [3]
        kq = bool((self.kinds >= KQ_FIRST).any())
        self.addrs = (exact_rows_address(ROWS_LIKE), kq_rows_address(ROWS_LIKE) if kq else 0)

    def kernel_form(self):
        """(etab, dims, kinds, addrs): the experts as the row kernels take them (experts)."""
        return self.etab, self.dims, self.kinds, self.addrs


@njit(**KW)
def _rows(experts, j, e, x, sx, y, o0, o1):
    # y[t, o] = row o of projection j (0 gate, 1 up, 2 down) of expert e . x[t], o0 <= o < o1:
    # the exact row dots (widen.rows_exact) through their address; x, sx C [T, K], [T, K / 32]
    etab, dims, kinds, addrs = experts
    w = view(etab[j, e], (dims[j, 0], dims[j, 1]), ROWS_LIKE)
    call_native(addrs[0], (w, kinds[j], x, sx, y[:, 0 : y.shape[1]], np.int64(o0), np.int64(o1), addrs[1]))


@njit(**KW)
def silu_up(g, u):
    """silu(g) * u of one expert activation, in f32."""
    return g / (np.float32(1) + np.float32(math.exp(-g))) * u


@njit(**KW)
def gate_up_rows(experts, e, x, sums, outs, f0, f1):
    """Rows f0..f1-1 of expert e's gate and up (experts: (etab, dims, kinds, addrs), an
    ExpertTable's kernel_form) dotted with each row of x [T, hidden] (C; sums (sxg, sxu): its
    sums for gate's and up's formats, exact_sums) into outs (g, u, act) [T, F], then act[t, f]
    = silu(g) * u. A row's bits do not depend on T (the row dots are row-wise)."""
    sxg, sxu = sums
    g, u, act = outs
    _rows(experts, 0, e, x, sxg, g, f0, f1)
    _rows(experts, 1, e, x, sxu, u, f0, f1)
    for t in range(x.shape[0]):
        for f in range(f0, f1):
            act[t, f] = silu_up(g[t, f], u[t, f])


@njit(**KW)
def down_rows(experts, e, act, sxa, y, o0, o1):
    """Rows o0..o1-1 of expert e's down dotted with each row of act [T, F] (C; sxa: its sums) into y [T, hidden]."""
    _rows(experts, 2, e, act, sxa, y, o0, o1)


@njit(**KW)
def combine_rows(ys, ws, ps, x, r, o0, o1):
    """x[r, o] += (((0 + ys[p0, o] ws[p0]) + ys[p1, o] ws[p1]) + ...) over the pairs ps of one
    token (its experts' outputs and weights, in ascending expert order), o0 <= o < o1:
    MoEBlock's sum (numpy's f32 products and sums, no fma)."""
    for o in range(o0, o1):
        a = np.float32(0)
        for p in ps:
            a = a + ys[p, o] * ws[p]
        x[r, o] = x[r, o] + a


@njit(**KW)
def _gate_up_chunk(c, nc, xs, sums, groups, experts, outs):
    # work item c: rows [f0, f0 + ROWS) of group c // nc's expert, for all of its pairs at once
    # (xs: the pairs' activation rows, grouped by expert; groups (gstart, gexp))
    sxg, sxu = sums
    gstart, gexp = groups
    g, u, act = outs
    gi = c // nc
    f0 = (c % nc) * _ROWS
    f1 = min(g.shape[1], f0 + _ROWS)
    p0, p1 = gstart[gi], gstart[gi + 1]
    gate_up_rows(experts, gexp[gi], np.ascontiguousarray(xs[p0:p1]),
                 (np.ascontiguousarray(sxg[p0:p1]), np.ascontiguousarray(sxu[p0:p1])),
                 (g[p0:p1], u[p0:p1], act[p0:p1]), f0, f1)  # fmt: skip


@njit(**KW)
def _down_chunk(c, nc, act, sxa, groups, experts, y):
    gstart, gexp = groups
    gi = c // nc
    o0 = (c % nc) * _ROWS
    o1 = min(y.shape[1], o0 + _ROWS)
    p0, p1 = gstart[gi], gstart[gi + 1]
    down_rows(experts, gexp[gi], np.ascontiguousarray(act[p0:p1]), np.ascontiguousarray(sxa[p0:p1]), y[p0:p1], o0, o1)


class StackedExperts:
    """The experts' stored rows as numba typed lists (views, no copies), one per projection,
    for f16 / bf16 / f32 experts. Projections may differ in type."""

    def __init__(self, experts):
        self.ffn, self.hidden = experts[0].gate.shape
        self.lists, self.kinds = [], []
        for proj in ("gate", "up", "down"):
            ws = [getattr(ex, proj) for ex in experts]
            qtypes = {w.qtype for w in ws}
            if len(qtypes) != 1 or len({w.shape for w in ws}) != 1:
                raise ValueError(f"experts' {proj} weights differ in type or shape")
            # f32 rows travel as their bit patterns so that every list holds unsigned ints.
            self.lists.append(numba.typed.List([w.data.view(np.uint32) if w.qtype == "f32" else w.data for w in ws]))
            self.kinds.append(KIND[ws[0].qtype])


def stack_experts(experts):
    """The kernels' form of a layer's experts: an ExpertTable for block formats, else
    StackedExperts; ValueError where the experts differ in type or shape."""
    try:
        return ExpertTable(experts)
    except ValueError:
        return StackedExperts(experts)


def expert_pairs(x, tok, exp, stacked):
    """x f32 [T, hidden]; pairs (tok[p], exp[p]) sorted by expert -> each pair's expert output
    f32 [P, hidden]. Every output depends only on its own pair (row-wise kernels)."""
    tok = np.ascontiguousarray(tok, np.int64)
    exp = np.ascontiguousarray(exp, np.int64)
    y = np.empty((len(tok), stacked.hidden), np.float32)  # [P, hidden]
    if len(tok):
        if np.any(exp[1:] < exp[:-1]):
            raise ValueError("expert_pairs: pairs must be sorted by expert")
        gstart = np.concatenate([[0], np.flatnonzero(np.diff(exp)) + 1, [len(exp)]])  # [G + 1]
        gexp = np.ascontiguousarray(exp[gstart[:-1]])  # [G]
        if isinstance(stacked, ExpertTable):
            _table_pairs(x, tok, gstart, gexp, stacked, y)
        else:
            h = np.empty((len(tok), stacked.ffn), np.float32)  # [P, F]
            (gates, ups, downs), (kg, ku, kd) = stacked.lists, stacked.kinds
            call_slp(_gate_up, x, tok, (gstart, gexp), gates, ups, kg, ku, F16_LUT, h)
            call_slp(_down, h, (gstart, gexp), downs, kd, F16_LUT, y)
    return y


def _table_pairs(x, tok, gstart, gexp, t, y):
    experts, kinds, groups = t.kernel_form(), t.kinds, (gstart, gexp)
    P, F = len(tok), t.ffn
    g = np.empty((P, F), np.float32)  # [P, F]
    u = np.empty((P, F), np.float32)
    act = np.empty((P, F), np.float32)
    xs = x[tok]  # [P, hidden]: each pair's token row, grouped by expert
    sxg = exact_sums(xs, kinds[0], True)  # [P, hidden / 32]
    sxu = sxg if kinds[1] == kinds[0] else exact_sums(xs, kinds[1], True)
    nc = (F + _ROWS - 1) // _ROWS
    run_parallel(len(gexp) * nc, _gate_up_chunk, (nc, xs, (sxg, sxu), groups, experts, (g, u, act)))
    sxa = exact_sums(act, kinds[2], True)  # [P, F / 32]
    nc = (t.hidden + _ROWS - 1) // _ROWS
    run_parallel(len(gexp) * nc, _down_chunk, (nc, act, sxa, groups, experts, y))
