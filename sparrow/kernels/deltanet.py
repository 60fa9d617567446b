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
into 64-token chunks (torch_chunk_gated_delta_rule) to feed GPU matmuls; on a CPU the rule is
Dk * Dv * 4 flops a token and head, ~1% of a prefill's projection flops at Qwen3.5's shapes,
and its state stays in L2, so the recurrent order costs little and buys one property: a
token's output and the state after it have the same bits whether the token came in a prefill
chunk of any length, a decode step or a speculative verification. Prefix-cache checkpoints
and speculative rollbacks are therefore exact.

Heads are independent, so a run's bits do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from sparrow.kernels.options import KW as _KW
from sparrow.kernels.parallel import run_parallel


@njit(**_KW)
def _head(h, q, k, v, decay, beta, key_head, state, out):
    # value head h over tokens [T]: q, k [T, Hk, Dk] (head key_head[h]), v [T, Hv, Dv],
    # decay (exp(g)) and beta [T, Hv], state [Hv, Dk, Dv], out [T, Hv, Dv]
    kh = key_head[h]
    S = state[h]
    dk, dv = S.shape
    mem = np.empty(dv, np.float32)
    for t in range(q.shape[0]):
        d = decay[t, h]
        for j in range(dv):
            mem[j] = np.float32(0)
        for i in range(dk):
            ki = k[t, kh, i]
            for j in range(dv):
                s = S[i, j] * d
                S[i, j] = s
                mem[j] += s * ki
        b = beta[t, h]
        for j in range(dv):
            mem[j] = (v[t, h, j] - mem[j]) * b  # delta
        o = out[t, h]
        for j in range(dv):
            o[j] = np.float32(0)
        for i in range(dk):
            ki, qi = k[t, kh, i], q[t, kh, i]
            for j in range(dv):
                s = S[i, j] + ki * mem[j]
                S[i, j] = s
                o[j] += s * qi


def gated_delta_rule(q, k, v, decay, beta, key_head, state) -> np.ndarray:
    """q, k [T, Hk, Dk] (L2-normalised, q scaled), v [T, Hv, Dv], decay = exp(g) and beta [T, Hv],
    all f32; key_head [Hv] int64, the key head each value head reads; state [Hv, Dk, Dv] f32,
    advanced in place over the T tokens. Returns [T, Hv, Dv]."""
    T, Hv, Dv = v.shape
    out = np.empty((T, Hv, Dv), np.float32)
    run_parallel(Hv, _head, (q, k, v, decay, beta, key_head, state, out))
    return out


@njit(**_KW)
def _conv_rows(x, w, state, out):
    # x [T, C] new inputs; w [C, K]; state [K-1, C] the K-1 inputs before x (zeros at the start)
    K = w.shape[1]
    T, C = x.shape
    for t in range(T):
        for c in range(C):
            acc = np.float32(0)
            for j in range(K):
                r = t + j - (K - 1)  # input row: < 0 reads the state
                xv = state[K - 1 + r, c] if r < 0 else x[r, c]
                acc += w[c, j] * xv
            out[t, c] = acc
    # the state becomes the last K-1 inputs
    if T >= K - 1:
        state[:] = x[T - (K - 1) :]
    else:
        state[: K - 1 - T] = state[T:].copy()
        state[K - 1 - T :] = x


def causal_conv(x: np.ndarray, w: np.ndarray, state: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution of x [T, C] with w [C, K] after the inputs in state
    [K-1, C] (advanced in place); returns [T, C] before the activation. Row t's sum runs over
    the K taps in order, so its bits do not depend on how the tokens were split into calls."""
    out = np.empty(x.shape, np.float32)
    _conv_rows(np.ascontiguousarray(x, dtype=np.float32), w, state, out)
    return out
