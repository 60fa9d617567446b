"""Attention over a LayerCache: exact and block-sparse top-k (spec: shared/SPARSE_ATTENTION.md).

Decode runs one serial numba kernel, sparse prefill one parallel kernel (prange over KV heads
only); both attend each query head over its list of selected blocks, the query heads of a GQA
group sharing the K/V reads. Exact attention is the same kernel with every block selected,
so sparse with k >= n_blocks is bit-identical to exact.

Accumulation order of the numba kernel, per query head:
1. each score is one dot product q . K[t] over head_dim, SIMD-reassociated in an order fixed
   by the compiled code (int8: the int8 x int8 dot, exact since its float32 partial sums are
   integers below 2**24), times the int8 scales if any, then times `scale`;
2. scores are produced for the selected blocks in ascending block order, ascending position
   inside a block, i.e. in ascending position order overall;
3. m = max; e_t = exp(s_t - m); den = sum of e_t sequentially in that same order;
4. acc[d] = sum over t, in that order, of e_t * V[t, d] (float32), out = acc * (1 / den).
Nothing is split across threads, so results do not depend on the thread count.

Exact prefill uses numpy/BLAS per KV-head group, tiled over queries so the score tile stays
small (about _TILE_ELEMS floats); f16/int8 keys and values are dequantised to f32 for it.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from sparrow.kernels.sparse_select import STAGE_NAMES, select_blocks_nb
from sparrow.kv_cache import SparseParams, quantize_int8  # noqa: F401  (SparseParams re-exported)

_TILE_ELEMS = 1 << 19  # floats per prefill score tile (2 MiB: its passes stay in L2)
_DOT_FM = {"reassoc", "contract"}  # lets LLVM vectorise the dot; order is fixed per build
_DEFAULT_BLOCK = 32


@intrinsic
def _half_to_f32(typingctx, bits):
    """Widen IEEE half bits (uint16) to float32 (vcvtph2ps with F16C)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def _raw_dot(qf, qi, qs, krow, ks, kh, t):
    """q . K[kh, t] (krow is that row) with storage scales applied: the probe value; times
    `scale` it is the score."""


def _add_row(acc, w, vrow, vs, kh, t):
    """acc += w * V[kh, t] dequantised (vrow is that row)."""


@overload(_raw_dot, jit_options={"fastmath": _DOT_FM})
def _ov_raw_dot(qf, qi, qs, krow, ks, kh, t):
    if krow.dtype == types.float32:
        def impl(qf, qi, qs, krow, ks, kh, t):
            acc = np.float32(0.0)
            for d in range(qf.shape[0]):
                acc += qf[d] * krow[d]
            return acc
    elif krow.dtype == types.uint16:
        def impl(qf, qi, qs, krow, ks, kh, t):
            acc = np.float32(0.0)
            for d in range(qf.shape[0]):
                acc += qf[d] * _half_to_f32(krow[d])
            return acc
    elif krow.dtype == types.int8:
        # int8 x int8 summed in float32: every partial sum is an integer below 2**24 (|code| <=
        # 127, head_dim <= 1024), so this is exactly the int32 dot, in any order, and it
        # vectorises 16 wide where numba's int64-promoted integer loop would not.
        def impl(qf, qi, qs, krow, ks, kh, t):
            acc = np.float32(0.0)
            for d in range(qi.shape[0]):
                acc += np.float32(qi[d]) * np.float32(krow[d])
            return acc * (qs * ks[kh, t])
    else:
        return None
    return impl


@overload(_add_row)
def _ov_add_row(acc, w, vrow, vs, kh, t):
    if vrow.dtype == types.float32:
        def impl(acc, w, vrow, vs, kh, t):
            for d in range(acc.shape[0]):
                acc[d] += w * vrow[d]
    elif vrow.dtype == types.uint16:
        def impl(acc, w, vrow, vs, kh, t):
            for d in range(acc.shape[0]):
                acc[d] += w * _half_to_f32(vrow[d])
    elif vrow.dtype == types.int8:
        def impl(acc, w, vrow, vs, kh, t):
            ws = w * vs[kh, t]
            for d in range(acc.shape[0]):
                acc[d] += ws * np.float32(vrow[d])
    else:
        return None
    return impl


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so k * _LN2_HI is exact for |k| < 2**9
_LN2_LO = np.float32(-2.12194440e-4)


@njit(fastmath=_DOT_FM, cache=True, nogil=True)
def _exp_shifted(s, m, n, ebits):
    """s[:n] = exp(s[:n] - m) (all arguments <= 0), vectorised (libm expf is a scalar call).

    exp(x) = 2**k * e**r with k = round(x / ln 2), |r| <= ln 2 / 2, e**r by its degree-6
    Taylor polynomial (relative error < 2e-7); 2**k is built in the exponent bits of ebits.
    Arguments below -70 give 0: such weights (< 4e-31 of the maximum's) cannot change an f32
    sum, and the tiny products they would make with V are subnormal, which x86 handles ~100x
    slower (this made sparse decode on real model queries slower than exact).
    """
    fb = ebits.view(np.float32)
    for i in range(n):
        x = s[i] - m
        x = max(x, np.float32(-87.0))
        k = np.floor(x * _LOG2E + np.float32(0.5))
        r = (x - k * _LN2_HI) - k * _LN2_LO
        p = np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        s[i] = p
        e = (np.int32(k) + np.int32(127)) << np.int32(23)
        ebits[i] = e if x > np.float32(-70.0) else np.int32(0)  # bits 0 = +0.0
    for i in range(n):
        s[i] = s[i] * fb[i]


@njit(fastmath=_DOT_FM, cache=True, nogil=True)
def _sum_f32(a, n):
    # vector-lane sum; the order depends only on n (same for exact and all-blocks sparse)
    t = np.float32(0.0)
    for i in range(n):
        t += a[i]
    return t


@njit(cache=True, nogil=True)
def _attend_group(qf, qi, qs, K, V, ks, vs, kh, h0, G, seq_len, scale, bs, mark, ntok, out,
                  want_p, pacc):
    """Softmax attention of query heads h0..h0+G-1 (all on KV head kh) over their marked blocks.

    Heads are interleaved block by block so a block's K/V rows are read from memory once for the
    group, but each head's arithmetic runs in ascending position order exactly as if alone.
    """
    nb = mark.shape[1]
    s = np.empty((G, max(1, ntok.max())), dtype=np.float32)
    m = np.full(G, -np.inf, dtype=np.float32)
    cnt = np.zeros(G, dtype=np.int64)
    for b in range(nb):
        p0 = b * bs
        p1 = min(p0 + bs, seq_len)
        for g in range(G):
            if mark[g, b]:
                qfh, qih, qsh = qf[h0 + g], qi[h0 + g], qs[h0 + g]
                i = cnt[g]
                for t in range(p0, p1):
                    x = _raw_dot(qfh, qih, qsh, K[kh, t], ks, kh, t) * scale
                    s[g, i] = x
                    if x > m[g]:
                        m[g] = x
                    i += 1
                cnt[g] = i
    inv = np.empty(G, dtype=np.float32)
    ebits = np.empty(s.shape[1], dtype=np.int32)
    for g in range(G):
        _exp_shifted(s[g], m[g], ntok[g], ebits)
        inv[g] = np.float32(1.0) / _sum_f32(s[g], ntok[g])
    acc = np.zeros((G, out.shape[1]), dtype=np.float32)
    cnt[:] = 0
    for b in range(nb):
        p0 = b * bs
        p1 = min(p0 + bs, seq_len)
        for g in range(G):
            if mark[g, b]:
                i = cnt[g]
                accg = acc[g]
                for t in range(p0, p1):
                    _add_row(accg, s[g, i], V[kh, t], vs, kh, t)
                    if want_p:
                        pacc[h0 + g, t] += s[g, i] * inv[g]
                    i += 1
                cnt[g] = i
    for g in range(G):
        for d in range(out.shape[1]):
            out[h0 + g, d] = acc[g, d] * inv[g]


@njit(cache=True, nogil=True)
def _group(qf, qi, qs, K, V, ks, vs, kh, G, seq_len, scale, sparse, use_imp, isum, k_blocks, bs,
           n_probe, out, sel, stages, nsel, want_p, pacc):
    """Select blocks (all of them unless sparse) for the G query heads of KV head kh, attend.
    isum: per-block importance sums (used when use_imp)."""
    h0 = kh * G
    nb = (seq_len + bs - 1) // bs
    mark = np.zeros((G, nb), dtype=np.bool_)
    ntok = np.zeros(G, dtype=np.int64)
    if sparse:
        probe = np.full((G, nb), np.float32(-1e30), dtype=np.float32)
        # with k >= nb every block is taken whatever the probes say: skip reading them
        for b in range(nb if k_blocks < nb else 0):
            p0 = b * bs
            p1 = min(p0 + bs, seq_len)
            step = max(1, (p1 - p0) // n_probe)
            for ps in range(p0, p1, step):
                for g in range(G):
                    x = _raw_dot(qf[h0 + g], qi[h0 + g], qs[h0 + g], K[kh, ps], ks, kh, ps)
                    if x > probe[g, b]:
                        probe[g, b] = x
        for g in range(G):
            n = select_blocks_nb(probe[g], isum, use_imp, k_blocks, sel[h0 + g], stages[h0 + g])
            nsel[h0 + g] = n
            for j in range(n):
                b = sel[h0 + g, j]
                mark[g, b] = True
                ntok[g] += min(b * bs + bs, seq_len) - b * bs
    else:
        for g in range(G):
            for b in range(nb):
                sel[h0 + g, b] = b
                stages[h0 + g, b] = 1
                mark[g, b] = True
            nsel[h0 + g] = nb
            ntok[g] = seq_len
    _attend_group(qf, qi, qs, K, V, ks, vs, kh, h0, G, seq_len, scale, bs, mark, ntok, out,
                  want_p, pacc)


@njit(cache=True, nogil=True)
def _block_sums(imp, seq_len, bs):
    """Per-block float32 sums of imp[:seq_len], each summed in position order."""
    nb = (seq_len + bs - 1) // bs
    out = np.zeros(nb, dtype=np.float32)
    for b in range(nb):
        a = np.float32(0.0)
        for p in range(b * bs, min(b * bs + bs, seq_len)):
            a += imp[p]
        out[b] = a
    return out


@njit(cache=True, nogil=True)
def _decode_kernel(qf, qi, qs, K, V, ks, vs, imp, seq_len, scale, G, sparse, k_blocks, bs,
                   n_probe, out, sel, stages, nsel):
    # Serial over KV heads: a parallel launch costs 50-180 us of wall time here, and with
    # 3 KV heads on 2 shared cores prange measured slower at every context up to 7K
    # (exact 1.6 vs 1.2 ms per layer, sparse 0.95 vs 0.53).
    pdummy = np.zeros((1, 1), dtype=np.float32)
    isum = _block_sums(imp, seq_len, bs) if sparse else np.zeros(1, dtype=np.float32)
    for kh in range(K.shape[0]):
        _group(qf, qi, qs, K, V, ks, vs, kh, G, seq_len, scale, sparse, True, isum, k_blocks, bs,
               n_probe, out, sel, stages, nsel, False, pdummy)


@njit(cache=True, nogil=True, parallel=True)
def _sparse_prefill_kernel(qf, qi, qs, K, V, ks, vs, start, scale, G, k_blocks, bs, n_probe,
                           out, pacc, want_p):
    T, H = qf.shape[0], qf.shape[1]
    nbmax = (start + T + bs - 1) // bs
    idummy = np.zeros(1, dtype=np.float32)
    for kh in prange(K.shape[0]):
        sel = np.empty((H, nbmax), dtype=np.int64)
        stages = np.empty((H, nbmax), dtype=np.int8)
        nsel = np.empty(H, dtype=np.int64)
        for t in range(T):
            _group(qf[t], qi[t], qs[t], K, V, ks, vs, kh, G, start + t + 1, scale, True, False,
                   idummy, k_blocks, bs, n_probe, out[t], sel, stages, nsel, want_p, pacc)


def _query_codes(q, layer):
    """Per-head int8 query codes and scales for an int8 cache, else small dummies."""
    if layer.dtype == "int8":
        # same absmax/127 rule as the cache: [..., H, D], [..., H]; the codes go in as f32
        # (exact small integers) so the score loop converts only the cache's int8 codes
        codes, scale = quantize_int8(q)
        return codes.astype(np.float32), scale
    return np.zeros(q.shape[:-1] + (1,), np.int8), np.zeros(q.shape[:-1], np.float32)


def _scales(layer):
    if layer.k_scale is not None:
        return layer.k_scale, layer.v_scale
    dummy = np.zeros((1, 1), np.float32)
    return dummy, dummy


def _check_heads(H, layer):
    if H % layer.n_kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {layer.n_kv_heads} KV heads")
    return H // layer.n_kv_heads


def decode_attention(q, layer, seq_len, scale, sparse=None, trace=None):
    """Attention of q [H, D] (position seq_len-1, already appended) over the cache -> [H, D].

    sparse: SparseParams for block-sparse top-k (importance from layer.importance[:seq_len]).
    trace: with sparse, appends (head, block ids ascending, stage names, mass) per query head,
    mass being the share of the exact softmax mass inside the selected blocks; exact
    attention records nothing.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)  # [H, D]
    H, D = q.shape
    group = _check_heads(H, layer)
    if not 1 <= seq_len <= layer.capacity:
        raise ValueError(f"seq_len {seq_len} outside 1..{layer.capacity}")
    qi, qs = _query_codes(q, layer)
    ks, vs = _scales(layer)
    bs = sparse.block if sparse is not None else _DEFAULT_BLOCK
    nb = (seq_len + bs - 1) // bs
    sel = np.empty((H, nb), np.int64)
    stages = np.empty((H, nb), np.int8)
    nsel = np.empty(H, np.int64)
    out = np.empty((H, D), np.float32)
    _decode_kernel(q, qi, qs, layer.k, layer.v, ks, vs, layer.importance, seq_len,
                   np.float32(scale), group, sparse is not None,
                   sparse.k if sparse is not None else nb, bs,
                   sparse.probe if sparse is not None else 1, out, sel, stages, nsel)
    if trace is not None and sparse is not None:
        for h in range(H):
            n = nsel[h]
            blocks = sel[h, :n].tolist()
            mass = _selected_mass(q[h], layer, h // group, seq_len, scale, bs, blocks)
            trace.append((h, blocks, [STAGE_NAMES[c] for c in stages[h, :n]], mass))
    return out


def _selected_mass(qh, layer, kh, seq_len, scale, bs, blocks):
    """Share of the exact softmax mass (f32 keys) that falls inside the selected blocks.
    Only computed when tracing: it costs a full exact pass over the head."""
    s = (layer.keys_f32(kh, seq_len) @ qh) * np.float32(scale)  # [S]
    p = np.exp(s - s.max())
    inside = np.zeros(seq_len, bool)
    for b in blocks:
        inside[b * bs:(b + 1) * bs] = True
    return float(p[inside].sum() / p.sum())


def prefill_attention(q, layer, start, scale, sparse=None, record_importance=True):
    """Causal attention of q [T, H, D] (positions start..start+T-1, already appended) -> [T, H, D].

    Query t sees cache positions 0..start+t. With sparse.prefill each query selects blocks over
    its own causal prefix (no importance). record_importance adds the probabilities each
    position received (summed over heads and queries) to layer.importance[:start+T].
    """
    q = np.ascontiguousarray(q, dtype=np.float32)  # [T, H, D]
    T, H, D = q.shape
    group = _check_heads(H, layer)
    S = start + T
    if start < 0 or S > layer.capacity:
        raise ValueError(f"prefill positions {start}..{S - 1} outside capacity {layer.capacity}")
    scale = np.float32(scale)
    if sparse is not None and sparse.prefill:
        qi, qs = _query_codes(q, layer)
        ks, vs = _scales(layer)
        out = np.empty((T, H, D), np.float32)
        pacc = np.zeros((H, S) if record_importance else (H, 1), np.float32)
        _sparse_prefill_kernel(q, qi, qs, layer.k, layer.v, ks, vs, start, scale, group, sparse.k,
                               sparse.block, sparse.probe, out, pacc, record_importance)
        if record_importance:
            layer.importance[:S] += pacc.sum(axis=0)
        return out
    return _exact_prefill(q, layer, start, scale, group, record_importance)


def _exact_prefill(q, layer, start, scale, group, record_importance):
    T, H, D = q.shape
    S = start + T
    out = np.empty((T, H, D), np.float32)
    imp = np.zeros(S, np.float32) if record_importance else None
    tile = max(1, min(T, _TILE_ELEMS // (group * S)))
    for kh in range(layer.n_kv_heads):
        Kf = layer.keys_f32(kh, S)  # [S, D]
        Vf = layer.values_f32(kh, S)  # [S, D]
        hs = slice(kh * group, (kh + 1) * group)
        for t0 in range(0, T, tile):
            t1 = min(T, t0 + tile)
            n, sk = t1 - t0, start + t1  # queries in tile, keys they can see
            qt = q[t0:t1, hs].transpose(1, 0, 2).reshape(group * n, D) * scale  # [G*n, D]
            sc = qt @ Kf[:sk].T  # [G*n, sk]
            # causal mask only touches the tile's own diagonal band
            band = sc.reshape(group, n, sk)[:, :, start + t0:]  # [G, n, n]
            band[:, np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
            sc -= sc.max(axis=1, keepdims=True)
            np.exp(sc, out=sc)
            rinv = np.float32(1) / sc.sum(axis=1)  # [G*n]; normalise the small outputs, not sc
            o = (sc @ Vf[:sk]) * rinv[:, None]  # [G*n, D]
            out[t0:t1, hs] = o.reshape(group, n, D).transpose(1, 0, 2)
            if imp is not None:
                imp[:sk] += rinv @ sc
    if imp is not None:
        layer.importance[:S] += imp
    return out
