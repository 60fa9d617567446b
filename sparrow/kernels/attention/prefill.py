"""Exact causal prefill attention in one pass over K/V (online softmax), tile by tile.

The numpy/BLAS path this replaced wrote each score tile to memory and read it back four times
(mask/max/exp/sum, the value product, the importance); the 2 MiB tiles did not fit this CPU's
512 KiB L2, and on SmolLM2-135M at 2K it spent ~110 ms a layer there (BLAS scoring with a
64-long inner dimension ran at 24 GMAC/s, the softmax at 1.4-3.7 ns a score). Here a work
item is qt consecutive queries of every head (items_of); for each KV head, its group's qt * group query
rows take the keys BK at a time: scores by a register-tiled product (kernels.attention.tile.mm_add)
against the block's keys stored transposed, then the running max and sum, then the weighted
values by the same product, so scores stay in L1.

Per query row, blocks b = 0, 1, ... up to the row's position, in order:
  s = q' K_b^T (q' = q * scale)           one fma chain per score, d ascending
  mx = max(s); if mx > m: c = exp(m - mx), o *= c, l *= c, m = mx
  e = exp_shifted(s - m) (0 past the query's position); l += sum(e); o += e V_b (keys ascending)
  out = o * (1 / l)
Importance (the spec's prefill probabilities, summed over heads and queries): each block's e
is kept with the m it used, and position t of block b gets e * exp(m_b - m) / l, summed over
the item's rows in order into the item's own row of `pacc`; the caller sums those rows in item
order. Every row's arithmetic depends only on its own query and the keys it sees, so results
are the same for any thread count, work split or prefill chunking.
"""

import numpy as np
from numba import njit

from sparrow.kernels.attention.rows import exp_shifted, prefetch, softmax_step
from sparrow.kernels.attention.tile import mm_add
from sparrow.kernels.native_call import address_for, call_native
from sparrow.kernels.parallel import run_parallel

SUB = 8  # queries of an importance row: each SUB consecutive queries sum into their own row
QT_MAX = 64  # queries per work item at most: a key block read from memory serves QT * group rows
BK = 64  # keys per step (SmolLM2 at 2K: 64 ms a layer vs 72 with 32; 128 overflows L1)


def items_of(T: int) -> int:
    """Queries per work item for a chunk of T: the most (QT_MAX, 32, 16 or SUB) that still
    gives at least 8 items, so both threads stay busy on short chunks. Results do not depend on
    it. 64 queries (128 rows of a 2-query group) rather than 32 read each key block half as
    often, which gains ~1.1x on a 512-query chunk over an 8K prefix, where they come from L3."""
    qt = QT_MAX
    while qt > SUB and (T + qt - 1) // qt < 8:
        qt //= 2
    return qt


@njit(cache=True, nogil=True)
def _prefill_attention_item(qa, kv, start, group, t0, t1, out, probs):
    """Queries t0..t1-1 (positions start + t) of every head over kv (KT, V), keys as
    key_blocks gives them and values [KVH, S, D]; with probs (want_p, pacc), adds importance
    into the rows of pacc [chunk queries / SUB, S] of its SUB-query groups (t0 is a multiple
    of SUB).

    Rows of one KV head go by SUB-query group s, then head g of the group, then query i of the
    group, so each group's rows are contiguous and in the order an item of just those queries
    has: its importance row is summed in the same order whatever the item size."""
    KT, V = kv
    want_p, pacc = probs
    D = qa.shape[2]
    nq = t1 - t0
    R = group * nq
    rq = np.empty(R, np.int64)  # row -> query of the item
    rh = np.empty(R, np.int64)  # row -> head of the group
    for r in range(R):
        s = r // (group * SUB)
        ns = min(SUB, nq - s * SUB)  # queries of group s
        rem = r - s * group * SUB
        rq[r] = s * SUB + rem % ns
        rh[r] = rem // ns
    last = start + t1  # keys 0..last-1 are visible to some query of the item
    nblk = (last + BK - 1) // BK
    Q = np.empty((R, D), np.float32)
    S = np.empty((R, BK), np.float32)  # scores, then (without importance) the weights
    O = np.empty((R, D), np.float32)
    m = np.empty(R, np.float32)
    den = np.empty(R, np.float32)
    keep = np.empty((nblk, R, BK) if want_p else (1, 1, 1), np.float32)  # each block's weights
    mb = np.empty((R, nblk) if want_p else (1, 1), np.float32)  # the max each block's weights used
    fT = np.empty((nblk, R) if want_p else (1, 1), np.float32)  # exp(m_b - m) / den per block, row
    fb = np.empty(nblk, np.float32)
    fbits = np.empty(nblk, np.int32)
    for kh in range(KT.shape[0]):
        KT2, V2 = KT[kh], V[kh]
        for r in range(R):  # element loops, not array assignment: numba's shape-checked copy costs ~5 s of compile
            q = qa[t0 + rq[r], kh * group + rh[r]]
            for d in range(D):
                Q[r, d] = q[d]
        O[:] = 0
        m[:] = -np.inf
        den[:] = 0
        for b in range(nblk):
            k0 = b * BK
            kn = min(BK, last - k0)
            if b + 1 < nblk:  # the next step's keys and values, into L2 while this one computes
                prefetch(KT2[b + 1], 0, D)
                prefetch(V2, k0 + BK, min(last, k0 + 2 * BK))
            S[:] = 0
            mm_add(Q, KT2[b], S, D)  # [R, BK]
            W = keep[b] if want_p else S  # [R, BK] the weights: kept for the importance, or in place
            for r in range(R):
                row, w = S[r], W[r]
                nv = min(kn, start + t0 + rq[r] + 1 - k0)  # keys of the block this query sees
                if nv <= 0:
                    w[:] = 0
                    if want_p:
                        mb[r, b] = -np.inf  # weight 0 (exp_shifted's clamp)
                    continue
                softmax_step(row, nv, w, r, m, den, O)  # w[:nv] = exp(row - m), w[nv:] = 0
                if want_p:
                    mb[r, b] = m[r]
            mm_add(W, V2[k0 : k0 + kn], O, kn)  # [R, D]
        for r in range(R):
            inv = np.float32(1.0) / den[r]
            o = out[t0 + rq[r], kh * group + rh[r]]
            for d in range(D):
                o[d] = O[r, d] * inv
            if want_p:
                for b in range(nblk):
                    fb[b] = max(mb[r, b] - m[r], np.float32(-87.0))
                exp_shifted(fb, np.float32(0.0), nblk, fbits)  # [nblk] exp(m_b - m)
                for b in range(nblk):
                    fT[b, r] = fb[b] * inv
        if want_p:  # importance: each group's row, block b += fT[b] @ keep[b] over its rows in order
            for s in range((nq + SUB - 1) // SUB):
                a, n = group * SUB * s, group * min(SUB, nq - s * SUB)
                prow2 = pacc[t0 // SUB + s, : nblk * BK].reshape((nblk, BK))
                for b in range(nblk):
                    mm_add(fT[b : b + 1, a : a + n], keep[b, a : a + n], prow2[b : b + 1], n)


@njit(cache=True, nogil=True)
def _prefill_item_pair(j, items, qa, kv, start, group, out, probs):
    """Query item j of n (items (n, qt, addr): qt queries each) and its mirror n-1-j (the
    middle item of an odd count runs once): their key counts add up to the same total, so any
    split of the pairs between threads is balanced. addr: _prefill_attention_item's machine code for these types
    (item_address), called through it so that it compiles once, not again here
    (kernels/native_call.py)."""
    n, qt, addr = items
    T = qa.shape[0]
    for k in range(1 if n - 1 - j == j else 2):
        it = j if k == 0 else n - 1 - j
        t0, t1 = np.int64(it * qt), np.int64(min(T, it * qt + qt))
        call_native(addr, (qa, kv, start, group, t0, t1, out, probs))


def item_address(qa, kv, start, group, out, probs) -> int:
    """The address of _prefill_attention_item for the types _prefill_item_pair calls it with."""
    return address_for(_prefill_attention_item, (qa, kv, start, group, 0, 0, out, probs))


def key_blocks(K, S):
    """Keys 0..S-1 of K [KVH, >= S, D] float32 as [KVH, nblk, D, BK]: block b transposed, so a
    block's scores are a product with contiguous rows; zeros past S."""
    KVH, _, D = K.shape
    nblk = (S + BK - 1) // BK
    KT = np.empty((KVH, nblk, D, BK), np.float32)  # [KVH, nblk, D, BK]
    full = S // BK
    KT[:, :full] = K[:, : full * BK].reshape(KVH, full, BK, D).transpose(0, 1, 3, 2)
    if full < nblk:
        KT[:, full] = 0
        KT[:, full, :, : S - full * BK] = K[:, full * BK : S].transpose(0, 2, 1)
    return KT


@njit(cache=True, nogil=True)
def _widen_block(i, kv, lut, S, KT, Vf):
    """Block i % nblk of KV head i // nblk from f16 or int8 storage (kv: (K, V, ks, vs,
    scaled), as attention.decode's): keys widened to float32 and transposed into KT[kh, b]
    ([D, BK], zeros past S), values widened into Vf[kh]. f16 bits go through lut (exact); an
    int8 code becomes float32(code) * its row's scale, the product LayerCache.keys_f32 /
    values_f32 give, so the attention sees the same floats."""
    K, V, ks, vs, scaled = kv
    nblk = KT.shape[1]
    kh, b = i // nblk, i % nblk
    D = K.shape[2]
    for j in range(BK):
        p = b * BK + j
        if p >= S:
            for d in range(D):
                KT[kh, b, d, j] = 0
        elif scaled:
            sk, sv = ks[kh, p], vs[kh, p]
            for d in range(D):
                KT[kh, b, d, j] = np.float32(K[kh, p, d]) * sk
                Vf[kh, p, d] = np.float32(V[kh, p, d]) * sv
        else:
            for d in range(D):
                KT[kh, b, d, j] = lut[K[kh, p, d]]
                Vf[kh, p, d] = lut[V[kh, p, d]]


def widened_blocks(K, V, ks, vs, scaled, lut, S):
    """(key blocks as key_blocks gives them, values [KVH, S, D] float32) from f16 (uint16 bits)
    or int8 storage, in one parallel pass. Every chunk widens the whole prefix, so this pass is
    a prefill's only cost that grows with the square of its length besides the attention
    itself; numpy's float16 conversion made it most of a short chunk's time over a long cache
    (docs/benchmarks/zen4-epyc.md, "Prefill over a long cache")."""
    KVH, _, D = K.shape
    nblk = (S + BK - 1) // BK
    KT = np.empty((KVH, nblk, D, BK), np.float32)
    Vf = np.empty((KVH, S, D), np.float32)
    run_parallel(KVH * nblk, _widen_block, ((K, V, ks, vs, bool(scaled)), lut, int(S), KT, Vf))
    return KT, Vf


def prefill_attention(qa, K, V, start, group, want_p, ks=None, vs=None, scaled=False, lut=None):
    """(out [T, H, D], importance [start + T] or None): exact causal attention of qa (q *
    scale) over keys and values [KVH, >= start+T, D] already holding the chunk: float32, or f16
    bits (uint16, with lut = F16_LUT) or int8 codes with their scales ks, vs [KVH, >= start+T]
    (scaled), widened here to the float32 values LayerCache.keys_f32 / values_f32 give."""
    T, H, D = qa.shape
    S = start + T
    if K.dtype == np.float32:
        KT = key_blocks(K, S)  # [KVH, nblk, D, BK]
    else:
        KT, V = widened_blocks(K, V, ks, vs, scaled, lut, S)
    out = np.empty((T, H, D), np.float32)
    pacc = np.zeros(((T + SUB - 1) // SUB, KT.shape[1] * BK) if want_p else (1, 1), np.float32)
    args = (np.ascontiguousarray(qa, np.float32), (KT, V), int(start), int(group), out, (bool(want_p), pacc))
    qt = items_of(T)
    n = (T + qt - 1) // qt  # query items of qt rows, run in pairs
    run_parallel((n + 1) // 2, _prefill_item_pair, ((n, qt, item_address(*args)), *args))
    return out, (pacc.sum(axis=0)[:S] if want_p else None)
