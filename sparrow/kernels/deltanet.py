"""The Gated DeltaNet's recurrence (Qwen3.5's linear-attention layers): the gated delta rule over
a run of tokens, one value head per parallel item, and its depthwise causal convolution.

The rule, per value head with state S [Dk, Dv] (f32, updated in place), for each token t (one
pass over S per token: _rule_run interleaves token t's update with token t+1's decay, each
element and sum keeping this order):

    S      = S * exp(g_t)                      # decay
    kv_mem = k_t @ S                           # [Dv], sum over Dk in ascending order
    delta  = (v_t - kv_mem) * beta_t
    S      = S + outer(k_t, delta)
    o_t    = q_t @ S                           # [Dv], sum over Dk in ascending order

Order of the math (documented, as every numerical order in sparrow): tokens one at a time in
this recurrent form, for prefill as for decode. transformers' prefill reorders the same math
into 64-token chunks (torch_chunk_gated_delta_rule) to feed GPU matmuls. The recurrent order
buys one property: a token's output and the state after it have the same bits whether the
token came in a prefill chunk of any length, a decode step or a speculative verification, so
prefix-cache checkpoints and speculative rollbacks are exact. It costs prefill little: the
rule is ~7 flops a state element and token, and with each group of columns of S held in L1
and its two sums in registers (_rule_pass) it runs at ~130 GFLOP/s a Zen 5 core, 0.44 ms
for a head's 512 tokens at Dk = Dv = 128, ~4% of a 512-token prefill at the 0.8B shapes.
transformers' 64-token chunks do ~1.4x those flops (docs/qwen3_5.md).

Heads are independent, so a run's bits do not depend on the thread count. Every multiply-add of
the rule is an explicit fma (ir.fma32) and its sums run in the order written, so the bits do not
depend on whether the CPU has FMA either; exp and log1p of the per-head gates are libm's.

`gated_deltanet` is a whole layer's mixing for a run of one sequence's tokens in two launches:
the convolution with SiLU over every channel, then per value head the L2 norms of its key
head's q and k, the gates, the rule and the output's RMSNorm gated by silu(z). Prefill chunks
and the staged path's decode steps and verification rows take it; the fused decode step
(kernels/fused/decode_step._deltanet_phase) calls the same helpers on each worker's share
(_conv_silu_channels over a range of channels, _deltanet_value_head per value head), so its bits are
these. The sigmoid gates of Qwen3.5's attention output and shared expert are here too
(sigmoid, _sigmoid1), for the same reason.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.cpu import AVX512F
from sparrow.kernels.elementwise import exp_parts, over_one_plus_exp
from sparrow.kernels.ir import I8, V16F, c64, fma, fma32, lane_dot, splat16
from sparrow.kernels.options import KW as _KW
from sparrow.kernels.parallel import run_parallel

DECAY, MID, LAST = 0, 1, 2  # a pass's kind (_rule_pass)


def _rule_pass(nvec):
    """An intrinsic pass(kind, S, j0, ka, qa, kb, x, acc1, acc2, d) over every row i of S [Dk,
    Dv] (C order) in columns j0 .. j0 + 16 nvec - 1, the accumulators acc1 / acc2 (1-D f32,
    same columns) held in registers across the rows and stored back after; ka, qa, kb, x 1-D
    f32 (contiguous), d f32. Each element sees the rule's operations as _rule_run lists them:
      DECAY: s = S * d;  S = s;  acc1 += s * ka_i                      (x, qa, kb, acc2 unused)
      MID:   s = S + ka_i * x;  acc1 += s * qa_i;  s = s * d;  S = s;  acc2 += s * kb_i
      LAST:  s = S + ka_i * x;  S = s;  acc1 += s * qa_i              (kb, acc2 unused)
    (+= an fma). A numba loop over j inside the loop over i kept o and the next token's k @ S
    in memory, a load and a store each per row: 1.23 ms for a head's 512 tokens at Dk = Dv =
    128 on a Zen 5 core; with them in registers 0.44 ms."""

    def emit(b, kind, args):
        S, j0, pk, pq, pn, px, p1, p2, d = args
        base = b.bitcast(S.data, I8.as_pointer())
        rows, stride = b.extract_value(S.shape, 0), b.extract_value(S.strides, 0)
        dv = splat16(b, d)

        def at(p, v):  # <16 x float>* to columns j0 + 16 v .. of a 1-D array
            return b.bitcast(b.gep(p, [b.add(j0, c64(16 * v))]), V16F.as_pointer())

        xs = [b.load(at(px, v), align=4) for v in range(nvec)] if kind != DECAY else []
        accs = [[cgutils.alloca_once(b, V16F) for _ in range(nvec)] for _ in range(2 if kind == MID else 1)]
        for slots, p in zip(accs, (p1, p2)):
            for v, slot in enumerate(slots):
                b.store(b.load(at(p, v), align=4), slot)
        col = b.mul(j0, c64(4))
        with cgutils.for_range(b, rows) as loop:
            i = loop.index
            row = b.gep(base, [b.add(b.mul(i, stride), col)])
            ki = splat16(b, b.load(b.gep(pk, [i])))
            qi = splat16(b, b.load(b.gep(pq, [i]))) if kind != DECAY else None
            kn = splat16(b, b.load(b.gep(pn, [i]))) if kind == MID else None
            for v in range(nvec):
                sp = b.bitcast(b.gep(row, [c64(64 * v)]), V16F.as_pointer())
                s = b.load(sp, align=4)
                a1 = accs[0][v]
                if kind == DECAY:
                    s = b.fmul(s, dv)
                    b.store(s, sp, align=4)
                    b.store(fma(b, s, ki, b.load(a1)), a1)
                elif kind == MID:
                    s = fma(b, ki, xs[v], s)
                    b.store(fma(b, s, qi, b.load(a1)), a1)
                    s = b.fmul(s, dv)
                    b.store(s, sp, align=4)
                    b.store(fma(b, s, kn, b.load(accs[1][v])), accs[1][v])
                else:
                    s = fma(b, ki, xs[v], s)
                    b.store(s, sp, align=4)
                    b.store(fma(b, s, qi, b.load(a1)), a1)
        for slots, p in zip(accs, (p1, p2)):
            for v, slot in enumerate(slots):
                b.store(b.load(slot), at(p, v), align=4)

    def rule_pass(typingctx, kind, S, j0, ka, qa, kb, x, acc1, acc2, d):
        f32 = types.Array(types.float32, 1, "C")
        arrays_ok = S == types.Array(types.float32, 2, "C") and all(a == f32 for a in (ka, qa, kb, x, acc1, acc2))
        scalars_ok = isinstance(kind, types.Integer) and isinstance(j0, types.Integer) and d == types.float32
        if not (arrays_ok and scalars_ok):
            return None
        sig = types.none(kind, S, j0, ka, qa, kb, x, acc1, acc2, d)

        def codegen(context, b, signature, args):
            arrs = [context.make_array(t)(context, b, v) for t, v in zip(signature.args[3:9], args[3:9])]
            S = context.make_array(signature.args[1])(context, b, args[1])
            j0 = context.cast(b, args[2], signature.args[2], types.int64)
            parts = (S, j0, *(a.data for a in arrs), args[9])
            kind = context.cast(b, args[0], signature.args[0], types.int64)
            with b.if_else(b.icmp_signed("==", kind, c64(DECAY))) as (decay, other):
                with decay:
                    emit(b, DECAY, parts)
                with other:
                    with b.if_else(b.icmp_signed("==", kind, c64(MID))) as (mid, last):
                        with mid:
                            emit(b, MID, parts)
                        with last:
                            emit(b, LAST, parts)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(rule_pass)


# columns a wide pass takes: 4 zmm a row on AVX-512 (mid: 12 of 32 registers live), 2 <16 x
# float> on AVX2 (each two ymm: 12 of 16 live); the bits do not depend on it
RULE_VECS = 4 if AVX512F else 2
RULE_COLS = 16 * RULE_VECS
_PASS_WIDE, _PASS_16 = _rule_pass(RULE_VECS), _rule_pass(1)


@njit(**_KW)
def _pass(kind, S, j0, w, ka, qa, kb, x, acc1, acc2, d):
    # one pass of `kind` over columns j0 .. j0 + w - 1 (w: RULE_COLS, 16 or fewer than 16)
    if w == RULE_COLS:
        _PASS_WIDE(kind, S, j0, ka, qa, kb, x, acc1, acc2, d)
    elif w == 16:
        _PASS_16(kind, S, j0, ka, qa, kb, x, acc1, acc2, d)
    else:
        for i in range(S.shape[0]):
            Si = S[i, j0 : j0 + w]
            for jj in range(w):
                j = j0 + jj
                if kind == DECAY:
                    s = Si[jj] * d
                    Si[jj] = s
                    acc1[j] = fma32(s, ka[i], acc1[j])
                elif kind == MID:
                    s = fma32(ka[i], x[j], Si[jj])
                    acc1[j] = fma32(s, qa[i], acc1[j])
                    s = s * d
                    Si[jj] = s
                    acc2[j] = fma32(s, kb[i], acc2[j])
                else:
                    s = fma32(ka[i], x[j], Si[jj])
                    Si[jj] = s
                    acc1[j] = fma32(s, qa[i], acc1[j])


@njit(**_KW)
def _rule_columns(S, Q, K, V, dec, beta, O, mem, nxt, j0, w):
    # tokens 0..T-1 of the rule on columns j0 .. j0 + w - 1 of S: a column of S, its delta and
    # its outputs never read another column, so the columns run one group after another, each
    # group's part of S staying in L1 over the whole run
    T = Q.shape[0]
    j1 = j0 + w
    for j in range(j0, j1):
        mem[j] = np.float32(0)
    _pass(DECAY, S, j0, w, K[0], K[0], K[0], mem, mem, mem, dec[0])  # k @ S
    for t in range(T):
        b = beta[t]
        o = O[t]
        for j in range(j0, j1):
            mem[j] = (V[t, j] - mem[j]) * b  # delta
            o[j] = np.float32(0)
        if t + 1 < T:
            for j in range(j0, j1):
                nxt[j] = np.float32(0)
            _pass(MID, S, j0, w, K[t], Q[t], K[t + 1], mem, o, nxt, dec[t + 1])
            mem, nxt = nxt, mem
        else:
            _pass(LAST, S, j0, w, K[t], Q[t], K[t], mem, o, o, np.float32(0))


@njit(**_KW)
def _rule_run(S, Q, K, V, dec, beta, O, mem, nxt):
    # tokens 0..T-1 of the gated delta rule on S [Dk, Dv] (Q, K [T, Dk], V [T, Dv], dec and
    # beta [T]) -> O [T, Dv]; mem, nxt [Dv] scratch. Token t's update and output and token
    # t+1's decay and k @ S share one pass over S (half the state's memory traffic), and every
    # element and every sum sees the operations of the rule as written above, in its order:
    #   decay and k @ S:  s = S * d;  S = s;  mem += s * k_i        (fma, i ascending)
    #   update, output:   s = S + k_i * delta;  S = s;  o += s * q_i (fma, i ascending)
    dv = S.shape[1]
    if Q.shape[0] == 0:
        return
    j0 = 0
    while j0 < dv:
        left = dv - j0
        w = RULE_COLS if left >= RULE_COLS else 16 if left >= 16 else left
        _rule_columns(S, Q, K, V, dec, beta, O, mem, nxt, j0, w)
        j0 += w


@njit(**_KW)
def _sigmoid1(x):
    # 1 / (1 + exp(-x)) with exp by exp_parts, as elementwise.over_one_plus_exp (Qwen3.5's
    # attention output gate and shared expert gate)
    p, k = exp_parts(min(max(-x, np.float32(-87.0)), np.float32(88.0)))
    two_k = np.float32(math.ldexp(1.0, int(k)))
    return np.float32(1) / fma32(p, two_k, np.float32(1))


@njit(**_KW)
def _sigmoid_rows(x, out):
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            out[t, i] = _sigmoid1(x[t, i])


def sigmoid(x: np.ndarray) -> np.ndarray:
    """sigmoid(x) in f32 (a new array), each value by _sigmoid1: the fused decode step gates
    with the same helper."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1] if x.ndim else 1)
    out = np.empty(x2.shape, np.float32)
    _sigmoid_rows(x2, out)
    return out.reshape(x.shape)


@njit(**_KW)
def _conv_silu_channels(x, w, state, out, c0, c1):
    # channels [c0, c1) of the causal conv of x [T, C] (new inputs) after state [K-1, C] (the
    # K-1 inputs before x, zeros at the start; advanced to the last K-1 inputs), then SiLU ->
    # out [T, C]; w [C, K]. Channels are independent: a range gives each channel the bits of
    # the whole run (the fused step splits them between its workers). Each output is
    # 0 + w_0 x_0 + w_1 x_1 + ... in tap order, the channel loop innermost so that it vectorises
    K = w.shape[1]
    T = x.shape[0]
    n = c1 - c0
    wt = np.empty((K, n), np.float32)  # [K, channels]: taps as rows, read contiguously
    for c in range(c0, c1):
        for j in range(K):
            wt[j, c - c0] = w[c, j]
    raw = np.empty(n, np.float32)
    pbuf = np.empty(n, np.float32)
    ebits = np.empty(n, np.int32)
    for t in range(T):
        for c in range(n):
            raw[c] = np.float32(0)
        for j in range(K):
            r = t + j - (K - 1)  # input row: < 0 reads the state
            src = state[K - 1 + r, c0:c1] if r < 0 else x[r, c0:c1]
            wj = wt[j]
            for c in range(n):
                raw[c] += wj[c] * src[c]
        over_one_plus_exp(raw, raw, out[t, c0:c1], n, pbuf, ebits)  # silu
    # the state becomes the last K-1 inputs
    for c in range(c0, c1):
        if T >= K - 1:
            for j in range(K - 1):
                state[j, c] = x[T - (K - 1) + j, c]
        else:
            for j in range(K - 1 - T):
                state[j, c] = state[j + T, c]
            for j in range(T):
                state[K - 1 - T + j, c] = x[j, c]


@njit(**_KW)
def _inv_norm(x, eps):
    return np.float32(1) / np.float32(math.sqrt(lane_dot(x, x) + eps))


@njit(**_KW)
def _deltanet_value_head(h, inputs, weights, state, y):
    # value head h of gated_deltanet over the run's tokens: each token's normalised q and k and
    # its gates, then the rule over the run, then the gated RMSNorm of each output; inputs
    # (c, z, b, a) as gated_deltanet's after the conv, weights (neg_A, dt_bias, norm_w,
    # key_head, dims, eps)
    c, z, b, a = inputs
    neg_A, dt_bias, norm_w, key_head, dims, eps = weights
    hk, dk, dv = dims[0], dims[1], dims[2]
    kh = key_head[h]
    T = c.shape[0]
    Q = np.empty((T, dk), np.float32)
    K = np.empty((T, dk), np.float32)
    dec = np.empty(T, np.float32)
    beta = np.empty(T, np.float32)
    q_scale = np.float32(1) / np.float32(math.sqrt(dk))
    for t in range(T):
        qs = c[t, kh * dk : (kh + 1) * dk]
        ks = c[t, (hk + kh) * dk : (hk + kh + 1) * dk]
        qn = _inv_norm(qs, np.float32(1e-6))
        kn = _inv_norm(ks, np.float32(1e-6))
        for i in range(dk):
            Q[t, i] = qs[i] * qn * q_scale
            K[t, i] = ks[i] * kn
        beta[t] = np.float32(1) / (np.float32(1) + np.float32(math.exp(-b[t, h])))
        x = a[t, h] + dt_bias[h]
        sp = x if x > np.float32(20) else np.float32(math.log1p(math.exp(x)))  # torch's softplus
        dec[t] = np.float32(math.exp(neg_A[h] * sp))
    v0 = 2 * hk * dk + h * dv
    O = np.empty((T, dv), np.float32)
    mem = np.empty(dv, np.float32)
    nxt = np.empty(dv, np.float32)
    _rule_run(state[h], Q, K, c[:, v0 : v0 + dv], dec, beta, O, mem, nxt)
    gate = np.empty(dv, np.float32)
    ebits = np.empty(dv, np.int32)
    for t in range(T):
        zt = z[t, h * dv : (h + 1) * dv]
        over_one_plus_exp(zt, zt, gate, dv, mem, ebits)  # silu(z), mem as scratch
        o = O[t]
        inv = np.float32(1) / np.float32(math.sqrt(lane_dot(o, o) / np.float32(dv) + eps))
        for j in range(dv):
            y[t, h * dv + j] = ((o[j] * inv) * norm_w[j]) * gate[j]


CONV_CHUNK = 512  # channels a work item of the staged convolution takes


@njit(**_KW)
def _conv_silu_chunk(i, x, w, state, out):
    c0 = i * CONV_CHUNK
    _conv_silu_channels(x, w, state, out, c0, min(c0 + CONV_CHUNK, x.shape[1]))


def gated_deltanet(proj, layer, conv_state, state):
    """A Gated DeltaNet layer's mixing for T tokens of one sequence, from its projections proj
    (qkv [T, C], z [T, Hv*Dv], b, a [T, Hv]) and the layer's weights and shapes layer (conv_w
    [C, K], neg_A, dt_bias [Hv], norm_w [Dv], key_head [Hv], hk, dk, eps): returns y [T,
    Hv*Dv] (the input of out_proj) and advances conv_state [K-1, C] and state [Hv, Dk, Dv] in
    place."""
    qkv, z, b, a = proj
    conv_w, neg_A, dt_bias, norm_w, key_head, hk, dk, eps = layer
    T, Hv = b.shape
    dv = state.shape[2]
    c = np.empty(qkv.shape, np.float32)
    n_chunks = (c.shape[1] + CONV_CHUNK - 1) // CONV_CHUNK
    run_parallel(n_chunks, _conv_silu_chunk, (np.ascontiguousarray(qkv), conv_w, conv_state, c))
    y = np.empty((T, Hv * dv), np.float32)
    dims = np.array([hk, dk, dv], np.int64)
    inputs = (c, np.ascontiguousarray(z), np.ascontiguousarray(b), np.ascontiguousarray(a))
    weights = (neg_A, dt_bias, norm_w, key_head, dims, np.float32(eps))
    run_parallel(Hv, _deltanet_value_head, (inputs, weights, state, y))
    return y
