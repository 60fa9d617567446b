"""The Gated DeltaNet's recurrence (Qwen3.5's linear-attention layers): the gated delta rule over
a run of tokens, one value head per parallel item, and its depthwise causal convolution.

The rule, per value head with state S [Dk, Dv] (f32, updated in place), for each token t:

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
prefix-cache checkpoints and speculative rollbacks are exact. Its price is prefill time: the
rule is only Dk * Dv * 4 flops a token and head (~1% of a prefill's projection flops at
Qwen3.5's shapes), but at vector-loop speed it is ~37% of a 512-token prefill at the 0.8B
shapes (docs/qwen3_5.md).

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

from sparrow.kernels.elementwise import exp_parts
from sparrow.kernels.ir import fma32, lane_dot
from sparrow.kernels.options import KW as _KW
from sparrow.kernels.parallel import run_parallel


@njit(**_KW)
def _rule_step(S, q, k, v, d, b, mem, o):
    # one token of the gated delta rule on state S [Dk, Dv]: o [Dv] and S advanced; mem [Dv] scratch
    dk, dv = S.shape
    for j in range(dv):
        mem[j] = np.float32(0)
    for i in range(dk):
        ki = k[i]
        for j in range(dv):
            s = S[i, j] * d
            S[i, j] = s
            mem[j] = fma32(s, ki, mem[j])
    for j in range(dv):
        mem[j] = (v[j] - mem[j]) * b  # delta
    for j in range(dv):
        o[j] = np.float32(0)
    for i in range(dk):
        ki, qi = k[i], q[i]
        for j in range(dv):
            s = fma32(ki, mem[j], S[i, j])
            S[i, j] = s
            o[j] = fma32(s, qi, o[j])


@njit(**_KW)
def _conv_channels(x, w, state, out, c0, c1):
    # channels [c0, c1) of the causal conv: x [T, C] new inputs; w [C, K]; state [K-1, C] the
    # K-1 inputs before x (zeros at the start), advanced to the last K-1 inputs. Channels are
    # independent: a range gives each channel the bits of the whole run (the fused step splits
    # them between its workers)
    K = w.shape[1]
    T = x.shape[0]
    for t in range(T):
        for c in range(c0, c1):
            acc = np.float32(0)
            for j in range(K):
                r = t + j - (K - 1)  # input row: < 0 reads the state
                xv = state[K - 1 + r, c] if r < 0 else x[r, c]
                acc += w[c, j] * xv
            out[t, c] = acc
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
def _silu1(x):
    # x / (1 + exp(-x)) with exp by exp_parts (elementwise.silu_mul's form)
    p, k = exp_parts(min(max(-x, np.float32(-87.0)), np.float32(88.0)))
    two_k = np.float32(math.ldexp(1.0, int(k)))  # exact: k in [-126, 128]
    return x / fma32(p, two_k, np.float32(1))


@njit(**_KW)
def _sigmoid1(x):
    # 1 / (1 + exp(-x)) with exp by exp_parts, as _silu1 (Qwen3.5's attention output gate and
    # shared expert gate)
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
    # channels [c0, c1) of the causal conv of x [T, C] after state [K-1, C] (advanced), then
    # SiLU -> out [T, C]
    _conv_channels(x, w, state, out, c0, c1)
    for t in range(out.shape[0]):
        for c in range(c0, c1):
            out[t, c] = _silu1(out[t, c])


@njit(**_KW)
def _inv_norm(x, eps):
    return np.float32(1) / np.float32(math.sqrt(lane_dot(x, x) + eps))


@njit(**_KW)
def _deltanet_value_head(h, inputs, weights, state, y):
    # value head h of gated_deltanet over the run's tokens: inputs (c, z, b, a) as
    # gated_deltanet's after the conv, weights (neg_A, dt_bias, norm_w, key_head, dims, eps)
    c, z, b, a = inputs
    neg_A, dt_bias, norm_w, key_head, dims, eps = weights
    hk, dk, dv = dims[0], dims[1], dims[2]
    kh = key_head[h]
    S = state[h]
    q = np.empty(dk, np.float32)
    k = np.empty(dk, np.float32)
    mem = np.empty(dv, np.float32)
    o = np.empty(dv, np.float32)
    q_scale = np.float32(1) / np.float32(math.sqrt(dk))
    for t in range(c.shape[0]):
        qs = c[t, kh * dk : (kh + 1) * dk]
        ks = c[t, (hk + kh) * dk : (hk + kh + 1) * dk]
        vs = c[t, 2 * hk * dk + h * dv : 2 * hk * dk + (h + 1) * dv]
        qn = _inv_norm(qs, np.float32(1e-6))
        kn = _inv_norm(ks, np.float32(1e-6))
        for i in range(dk):
            q[i] = qs[i] * qn * q_scale
            k[i] = ks[i] * kn
        beta = np.float32(1) / (np.float32(1) + np.float32(math.exp(-b[t, h])))
        x = a[t, h] + dt_bias[h]
        sp = x if x > np.float32(20) else np.float32(math.log1p(math.exp(x)))  # torch's softplus
        decay = np.float32(math.exp(neg_A[h] * sp))
        _rule_step(S, q, k, vs, decay, beta, mem, o)
        inv = np.float32(1) / np.float32(math.sqrt(lane_dot(o, o) / np.float32(dv) + eps))
        for j in range(dv):
            y[t, h * dv + j] = ((o[j] * inv) * norm_w[j]) * _silu1(z[t, h * dv + j])


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
    _conv_silu_channels(np.ascontiguousarray(qkv), conv_w, conv_state, c, 0, c.shape[1])
    y = np.empty((T, Hv * dv), np.float32)
    dims = np.array([hk, dk, dv], np.int64)
    inputs = (c, np.ascontiguousarray(z), np.ascontiguousarray(b), np.ascontiguousarray(a))
    weights = (neg_A, dt_bias, norm_w, key_head, dims, np.float32(eps))
    run_parallel(Hv, _deltanet_value_head, (inputs, weights, state, y))
    return y
