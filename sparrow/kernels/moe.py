"""Mixture-of-experts kernels (Qwen3-MoE).

route: softmax over all experts, top-k, optional renormalisation; one token row at a time by
one fixed loop, so a token's experts and weights do not depend on the other rows or the
thread count. Ties go to the lower expert index (as a stable argsort on -probs): the scan
only replaces its best on a strictly larger value. Serial: it is tiny, and on a shared
machine every parallel launch can wait a scheduler slice for its threads.

expert_pairs: the SwiGLU experts for a list of (token, expert) pairs in two parallel launches
(gate+up, then down) instead of three linear calls per expert; parallel over (expert, chunk
of weight rows), so each output has one writer. Each stored row is widened to f32 once per
expert and dotted with each of its pairs' f32 activation rows in one fixed order
(ir.lane_dot), so a pair's output depends only on that pair (batch and thread invariant). The widening and dot helpers
are kernels/matmul/widen.py's (the numba cache directory is keyed on every kernel source, so an
edit there recompiles these too).
"""

import math

import numba
import numpy as np
from numba import njit, prange

from sparrow.kernels.formats import KIND
from sparrow.kernels.matmul.widen import F16_LUT, call_slp
from sparrow.kernels.matmul.widen import dot as _dot
from sparrow.kernels.matmul.widen import widen_row as _widen_row
from sparrow.kernels.options import KW
from sparrow.kernels.options import ROWS as _ROWS


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
def _gate_up(x, tok, gstart, gexp, gates, ups, kg, ku, lut, h):
    # h[p, f] = silu(gate_e[f] . x[tok[p]]) * (up_e[f] . x[tok[p]]) for the pairs p of group
    # g (expert e = gexp[g]); each weight row is widened once per group.
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
def _down(h, gstart, gexp, downs, kd, lut, y):
    # y[p, o] = down_e[o] . h[p] for the pairs p of group g (expert e = gexp[g])
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


class StackedExperts:
    """The experts' stored rows as numba typed lists (views, no copies), one per projection.
    Projections may differ in type (GGUF "Q4_K_M" files keep ffn_down in another format)."""

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


def expert_pairs(x, tok, exp, stacked):
    """x f32 [T, hidden]; pairs (tok[p], exp[p]) sorted by expert -> each pair's expert output
    f32 [P, hidden]. Every output depends only on its own pair (row-wise kernels)."""
    tok = np.ascontiguousarray(tok, np.int64)
    exp = np.ascontiguousarray(exp, np.int64)
    h = np.empty((len(tok), stacked.ffn), np.float32)  # [P, F]
    y = np.empty((len(tok), stacked.hidden), np.float32)  # [P, hidden]
    if len(tok):
        if np.any(exp[1:] < exp[:-1]):
            raise ValueError("expert_pairs: pairs must be sorted by expert")
        gstart = np.concatenate([[0], np.flatnonzero(np.diff(exp)) + 1, [len(exp)]])  # [G + 1]
        gexp = np.ascontiguousarray(exp[gstart[:-1]])  # [G]
        (gates, ups, downs), (kg, ku, kd) = stacked.lists, stacked.kinds
        call_slp(_gate_up, x, tok, gstart, gexp, gates, ups, kg, ku, F16_LUT, h)
        call_slp(_down, h, gstart, gexp, downs, kd, F16_LUT, y)
    return y
