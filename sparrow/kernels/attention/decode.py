"""Attention kernels (wrapped by sparrow.models.attention, which hands them a cache's arrays):
decode and sparse prefill (exact prefill: attention.prefill).

Per KV head, the query heads of its group select blocks (all of them for exact attention)
and attend over them; a block's K/V rows are read from memory once for the whole group.
Everything here is serial per KV head and sums in orders fixed by the code (the row kernels
in attention.rows), so results do not depend on the thread count; exact attention is sparse
attention with every block.

Arguments that travel together come as tuples, unpacked where a kernel starts:
- queries: (q, qa, qs) [H, D], [H, D], [H]: the probe queries (raw, or int8 codes), the
  attention queries (times the scale for float caches, else the codes again) and the codes'
  scales; (qa, qs) where only attention reads them.
- kv: (K, V, ks, vs, int8): the cache's rows [KVH, C, D] and int8 scales [KVH, C] (or one KV
  head's, [C, D] and [C]), int8 whether K / V hold int8 codes.
- settings: (scale, bs, sparse, k_blocks, n_probe, flags, lut): the request's attention
  (flags 0: the seed selector, else v2's bits; lut widens f16 keys).
- side: (reserved, P, ps, per_block, n_copied): what the selector keeps of the sequence beside
  its K/V: the stage codes after the importance reservation (all -1 without importance) and
  the contiguous copy of the probe keys (seed) or block summaries (v2) of its first n_copied
  blocks, per_block rows each, with their int8 scales.
- selection: (sel [H, nb], stages [H, nb], nsel [H]): the blocks each head read and the rule
  that chose each, as the kernels write them.
- marks: (mark [G, nb], ntok [G]): the blocks each attention row reads, and how many keys
  that makes for the row.
- probs: (want_p, pacc [H, C]): whether each row's softmax probabilities are added to pacc.
"""

import math

import numpy as np
from numba import njit, prange

from sparrow.kernels.attention.codes4 import OFFSET, TILE, TOP, padded, tile_scores4
from sparrow.kernels.attention.rows import accum, dots, exp_sum, max_at, prefetch, row_max, widen
from sparrow.kernels.attention.select import (
    STAGE_PROBE,
    STAGE_SCORE,
    fill_probe_nb,
    key_f32,
    quantize_key_rows,
    reserve_importance_nb,
    select_v2_nb,
    select_v3_nb,
    summarise_block,
    v2_query,
    v3_query,
)
from sparrow.kernels.elementwise import quantize_row
from sparrow.params import V2_ON, V3_KEY4, V3_ON

# ---------------------------------------------------------------- one KV head's group


@njit(cache=True, nogil=True)
def _scale_rows(s, i, n, f, rs, r0, step):
    """s[i + j] *= f * rs[r0 + j * step]: int8 scores get the query and key scales."""
    for j in range(n):
        s[i + j] = s[i + j] * (f * rs[r0 + j * step])


@njit(cache=True, nogil=True)
def _prefetch_jump(X2, b, nxt, nb, bs, seq_len):
    # a jump ahead is prefetched; consecutive blocks are left to the hardware prefetcher
    # (software prefetching them too made exact attention ~15% slower)
    if nxt < nb and nxt != b + 1:
        prefetch(X2, nxt * bs, min(nxt * bs + bs, seq_len))


@njit(cache=True, nogil=True)
def _ahead_end(b, nxt, bs, end, seq_len):
    """The row below which reading block b may prefetch (rows.AHEAD_BYTES ahead): through the
    next block when it is read next (b + 1), else the block's own end (a jump is prefetched
    whole by _prefetch_jump)."""
    return min(seq_len, (b + 2) * bs) if nxt == b + 1 else end


# Rows marking a block from which f16 / int8 K and V rows are widened once into a float32 copy
# for all of them (attention.rows: the same bits); fewer read the stored rows themselves. Two
# rows (decode on 16 q / 8 KV heads) showed no clear gain shared, on a busy 2-core machine.
_SHARE_MIN = 3


@njit(cache=True, nogil=True)
def _block_users(mark, lens, b, p0, bs, G):
    """(rows marking block b, the end of the block's rows the longest of them reads)."""
    users, end = 0, p0
    for g in range(G):
        if mark[g, b]:
            users += 1
            end = max(end, min(p0 + bs, lens[g]))
    return users, end


@njit(cache=True, nogil=True)
def attend_group(queries, kv, h0, seq_len, scale, bs, marks, out, probs):
    """Softmax attention of query heads h0..h0+G-1 (G: marks' rows) over their marked blocks
    of positions 0..seq_len-1 of one KV head (kv): attend_rows with every head seeing seq_len keys."""
    lens = np.full(marks[0].shape[0], seq_len, dtype=np.int64)
    attend_rows(queries, kv, h0, lens, scale, bs, marks, out, probs)


@njit(cache=True, nogil=True)
def attend_rows(queries, kv, h0, lens, scale, bs, marks, out, probs):
    """Softmax attention of query rows h0..h0+G-1 (queries (qa, qs), G: marks' rows) over their
    marked blocks (mark [G, nb]) of one KV head (kv), row g over positions below lens[g] only
    (a marked block is cut at lens[g]).

    qa: queries pre-multiplied by `scale` (float caches), or int8 codes as float32 whose
    scores get (qs * ks[t]) then `scale`. Blocks are visited in ascending order and, inside
    each, the rows in turn, so a block's rows come from memory once; each row's scores are
    packed in ascending position order, its arithmetic the same as if alone. The rows are the
    query heads of one KV group (decode), or those of several positions of one sequence
    (verification: verify_head), each with its own length. f16 / int8 blocks that
    _SHARE_MIN or more rows mark are widened to float32 once (wide) and every row reads that."""
    qa, qs = queries
    K2, V2, ks, vs, int8 = kv
    mark, ntok = marks
    want_p, pacc = probs
    G, nb, D = mark.shape[0], mark.shape[1], K2.shape[1]
    narrow = K2.itemsize < 4  # f16 bits or int8 codes (K and V alike)
    wide = np.empty((bs if narrow else 0, D), dtype=np.float32)  # [bs, D] a block of K, then of V
    seq_len = lens.max()
    s = np.empty((G, max(1, ntok.max())), dtype=np.float32)  # packed scores, then weights
    m = np.full(G, -np.inf, dtype=np.float32)
    cnt = np.zeros(G, dtype=np.int64)
    used = np.empty(nb + 1, dtype=np.int64)  # blocks any row marks, ascending, then nb
    nu = 0
    for b in range(nb):
        for g in range(G):
            if mark[g, b]:
                used[nu] = b
                nu += 1
                break
    used[nu] = nb
    for j in range(nu):
        b, nxt = used[j], used[j + 1]
        p0 = b * bs
        _prefetch_jump(K2, b, nxt, nb, bs, seq_len)
        if nxt == nb and used[0] != 0:  # the value pass starts with a jump back
            prefetch(V2, used[0] * bs, min(used[0] * bs + bs, seq_len))
        users, end = _block_users(mark, lens, b, p0, bs, G)
        shared = narrow and users >= _SHARE_MIN
        if shared:
            widen(K2, p0, end, wide)
        ahead = _ahead_end(b, nxt, bs, end, seq_len)  # the first row to read the block prefetches
        for g in range(G):
            if mark[g, b]:
                p1 = min(p0 + bs, lens[g])
                i = cnt[g]
                if shared:
                    n = dots(qa[h0 + g], wide, 0, p1 - p0, 1, s[g], i, 0)
                else:
                    n = dots(qa[h0 + g], K2, p0, p1, 1, s[g], i, ahead)
                    ahead = p0
                if int8:
                    _scale_rows(s[g], i, n, qs[h0 + g] * scale, ks, p0, 1)
                m[g] = max(m[g], row_max(s[g], i, n))
                cnt[g] = i + n
    inv = np.empty(G, dtype=np.float32)
    for g in range(G):
        inv[g] = np.float32(1.0) / exp_sum(s[g], m[g], ntok[g], s[g])  # s[g][ntok:] is unused
    acc = np.zeros((G, 4, D), dtype=np.float32)
    w = np.empty(s.shape[1], dtype=np.float32) if int8 else s[0]
    cnt[:] = 0
    for j in range(nu):
        b, nxt = used[j], used[j + 1]
        p0 = b * bs
        _prefetch_jump(V2, b, nxt, nb, bs, seq_len)
        users, end = _block_users(mark, lens, b, p0, bs, G)
        shared = narrow and users >= _SHARE_MIN
        if shared:
            widen(V2, p0, end, wide)
        ahead = _ahead_end(b, nxt, bs, end, seq_len)
        for g in range(G):
            if mark[g, b]:
                p1 = min(p0 + bs, lens[g])
                i = cnt[g]
                if int8:  # fold each value row's scale into its weight
                    for j in range(p1 - p0):
                        w[i + j] = s[g, i + j] * vs[p0 + j]
                    wg = w
                else:
                    wg = s[g]
                if shared:
                    accum(wg, i, wide, 0, p1 - p0, acc[g], 0)
                else:
                    accum(wg, i, V2, p0, p1, acc[g], ahead)
                    ahead = p0
                if want_p:
                    for j in range(p1 - p0):
                        pacc[h0 + g, p0 + j] += s[g, i + j] * inv[g]
                cnt[g] = i + p1 - p0
    for g in range(G):
        a = acc[g]
        for d in range(D):
            out[h0 + g, d] = ((a[0, d] + a[1, d]) + (a[2, d] + a[3, d])) * inv[g]


@njit(cache=True, nogil=True)
def verify_head(kh, queries, kv, start, scale, G, bs, out):
    """Exact attention of KV head kh's query heads at R consecutive positions of one sequence
    (queries (qa [R, H, D], qs [R, H]): positions start..start+R-1, whose K/V are in kv's
    already) -> out [R, H, D]: row r over positions 0..start+r, the bits a decode step at
    start+r gives.

    The R x G (position, head) rows go to attend_rows as one group, so each block of K/V is
    read from memory once for all of them rather than once per position; each row's marks,
    length and key count are its own decode step's (exact: every block up to its position)."""
    qa, qs = queries
    K, V, ks, vs, int8 = kv
    R, D = qa.shape[0], qa.shape[2]
    RG = R * G
    nb = (start + R + bs - 1) // bs
    lens = np.empty(RG, dtype=np.int64)
    mark = np.zeros((RG, nb), dtype=np.bool_)
    rq = np.empty((RG, D), dtype=np.float32)  # row r * G + g: position start + r, head kh * G + g
    rs = np.empty(RG, dtype=np.float32)
    for r in range(R):
        n = start + r + 1
        for g in range(G):
            row = r * G + g
            lens[row] = n
            for b in range((n + bs - 1) // bs):
                mark[row, b] = True
            for d in range(D):
                rq[row, d] = qa[r, kh * G + g, d]
            rs[row] = qs[r, kh * G + g]
    ro = np.empty((RG, D), dtype=np.float32)
    pdummy = np.zeros((1, 1), dtype=np.float32)
    attend_rows((rq, rs), (K[kh], V[kh], ks[kh], vs[kh], int8), 0, lens, scale, bs, (mark, lens), ro, (False, pdummy))
    for r in range(R):
        for g in range(G):
            for d in range(D):
                out[r, kh * G + g, d] = ro[r * G + g, d]


_PROBE_CHUNK = 256  # probe-key rows scored by every head of a group in turn: 128 KB at D=256 f16, L2-resident


@njit(cache=True, nogil=True)
def _probe_group(q, qs, h0, kv, seq_len, bs, n_probe, side, probe):
    """probe[g, b] = max over block b's probe keys of q[h0 + g] . K (int8: times qs * ks), spec
    stage 1, for the G query heads of one KV head (kv). Blocks below n_copied read side's
    contiguous copy P2 in chunks that every head of the group dots while the chunk is in cache
    (the group reads the copy once, not G times); each dot is the one a whole-copy call gives,
    so the chunks never change a bit. Later blocks: strided reads of K."""
    K2, _, ks, _, int8 = kv
    _, P2, ps, per_block, n_copied = side
    G, nb = probe.shape
    rows = n_copied * per_block
    tmp = np.empty((G, max(bs, rows)), dtype=np.float32)  # [G, rows] each head's probe scores
    for c0 in range(0, rows, _PROBE_CHUNK):
        c1 = min(c0 + _PROBE_CHUNK, rows)
        for g in range(G):
            n = dots(q[h0 + g], P2, c0, c1, 1, tmp[g], c0, min(c1 + _PROBE_CHUNK, rows) if g == 0 else c0)
            if int8:
                _scale_rows(tmp[g], c0, n, qs[h0 + g], ps, c0, 1)
    for g in range(G):
        for b in range(n_copied):
            probe[g, b] = max(np.float32(-1e30), max_at(tmp[g], b * per_block, per_block))
        for b in range(n_copied, nb):  # blocks without a copy: strided reads of K
            p0 = b * bs
            p1 = min(p0 + bs, seq_len)
            step = max(1, (p1 - p0) // n_probe)
            n = dots(q[h0 + g], K2, p0, p1, step, tmp[g], 0, p0)
            if int8:
                _scale_rows(tmp[g], 0, n, qs[h0 + g], ks, p0, step)
            probe[g, b] = max(np.float32(-1e30), max_at(tmp[g], 0, n))


_V2_CHUNK = 64  # summary rows scored by every head of a group in turn: 32 KB at D=128, L2-resident


@njit(cache=True, nogil=True)
def _v2_scores(q, qs, kv, h0, seq_len, settings, side, score):
    """score[g, b] = u_g . [mean, var] of block b for query heads h0 + g (docs/SPARSE_SELECT_V2.md):
    blocks below n_summ from the summary copy S2 [n, 2D] (side's P and n_copied), walked in
    chunks that every head of the group dots while the chunk is in cache (the group reads the
    copy once); later blocks are summarised here with the same arithmetic, so the copy never
    changes a bit of the result."""
    K2, _, ks, _, int8 = kv
    scale, bs, _, _, _, _, lut = settings
    _, S2, _, _, n_summ = side
    G, nb = score.shape
    U = np.empty((G, 2 * q.shape[1]), dtype=np.float32)  # each head's u
    row = np.empty((1, 2 * q.shape[1]), dtype=np.uint16)  # a block summarised here
    for g in range(G):
        v2_query(q[h0 + g], qs[h0 + g], int8, scale, U[g])
    for c0 in range(0, n_summ, _V2_CHUNK):
        c1 = min(c0 + _V2_CHUNK, n_summ)
        for g in range(G):
            dots(U[g], S2, c0, c1, 1, score[g], c0, n_summ if g == 0 else c0)
    for b in range(n_summ, nb):
        summarise_block(K2, ks, lut, b * bs, min(b * bs + bs, seq_len), row[0])
        for g in range(G):
            dots(U[g], row, 0, 1, 1, score[g], b, 0)


_V3_CHUNK = 256  # key-code rows scored by every head of a group in turn: 32 KB at D=128, L1/L2-resident


@njit(cache=True, nogil=True)
def _v3_scores(query, keys, codes, seq_len, bs, mass):
    """mass[g, b] = v3's estimated log softmax mass of block b for query head h0 + g
    (docs/SPARSE_SELECT_V3.md): every key scored with int8 codes of the query and the key,
    then per block max + log(sum of exp(score - max)).

    query (q, qs, int8, scale, h0): the probe queries as select_and_attend takes them; keys (K2, ks, lut):
    the cache's rows; codes (P2, ps, n_copied): the key codes of the first n_copied full blocks
    ([n, D] int8 and their scales: state.sparse.KeyCodes), walked in chunks that every head of
    the group dots while the chunk is in cache. Later rows are quantised here with the same
    arithmetic, so the copy never changes a bit of the result."""
    q, qs, int8, scale, h0 = query
    K2, ks, lut = keys
    P2, ps, n_copied = codes
    G = mass.shape[0]
    D = q.shape[1]
    qc = np.empty((G, D), dtype=np.float32)  # [G, D] query codes as exact float32 integers
    f = np.empty(G, dtype=np.float32)  # query scale * softmax scale
    for g in range(G):
        f[g] = v3_query(q[h0 + g], qs[h0 + g], int8, qc[g]) * scale
    c_end = n_copied * bs
    tail = np.empty((seq_len - c_end, D), dtype=np.int8)  # [n, D] the rows past the copy
    tail_scale = np.empty(seq_len - c_end, dtype=np.float32)
    quantize_key_rows(K2, ks, lut, c_end, seq_len, tail, tail_scale)
    est = np.empty((G, seq_len), dtype=np.float32)  # [G, S] every key's estimated score
    for c0 in range(0, c_end, _V3_CHUNK):
        c1 = min(c0 + _V3_CHUNK, c_end)
        for g in range(G):
            n = dots(qc[g], P2, c0, c1, 1, est[g], c0, min(c1 + _V3_CHUNK, c_end) if g == 0 else c0)
            _scale_rows(est[g], c0, n, f[g], ps, c0, 1)
    for g in range(G):
        n = dots(qc[g], tail, 0, seq_len - c_end, 1, est[g], c_end, 0)
        _scale_rows(est[g], c_end, n, f[g], tail_scale, 0, 1)
    _block_masses(est, seq_len, bs, mass, 0, mass.shape[1])


_V3_TILES = 16  # 4-bit tiles scored by every head of a group in turn: 256 keys, 16 KB at D=128


@njit(cache=True, nogil=True)
def _v3_scores4(query, keys, codes, seq_len, bs, mass):
    """_v3_scores on 4-bit key codes (v3's key_bits 4): every key's estimate from the int8 query
    codes and the key's 4-bit ones, then the blocks' log masses as there.

    codes (T2, ps, n_copied): the tiles of the first n_copied full blocks' keys ([n_tiles, D * 8]
    int8, attention.codes4) and their scales: state.sparse.KeyCodes4. Its whole tiles are
    scored 16 keys a vector; later keys are quantised here by the same rule and dotted one by
    one, the same integers, so the copy never changes a bit of the result."""
    q, qs, int8, scale, h0 = query
    K2, ks, lut = keys
    T2, ps, n_copied = codes
    G = mass.shape[0]
    D = q.shape[1]
    qc = np.zeros((G, padded(D)), dtype=np.int8)  # [G, padded(D)] query codes, zeros past D
    corr = np.empty(G, dtype=np.int32)  # OFFSET * sum(qc): what the tiles' offset codes add
    f = np.empty(G, dtype=np.float32)  # query scale * softmax scale
    qf = np.empty(D, dtype=np.float32)
    for g in range(G):
        f[g] = v3_query(q[h0 + g], qs[h0 + g], int8, qf) * scale
        total = 0
        for d in range(D):
            qc[g, d] = np.int8(qf[d])
            total += qc[g, d]
        corr[g] = OFFSET * total
    n_tiles = n_copied * bs // TILE
    est = np.empty((G, seq_len), dtype=np.float32)  # [G, S] every key's estimated score
    done = 0  # blocks whose masses are taken, each as soon as its keys are scored (still in cache)
    for t0 in range(0, n_tiles, _V3_TILES):
        t1 = min(t0 + _V3_TILES, n_tiles)
        for g in range(G):
            tile_scores4(T2, t0, t1, qc[g], corr[g], f[g], ps, est[g])
        _block_masses(est, seq_len, bs, mass, done, t1 * TILE // bs)
        done = t1 * TILE // bs
    row = np.empty(D, dtype=np.float32)
    c4 = np.empty(D, dtype=np.int8)
    for t in range(n_tiles * TILE, seq_len):  # past the copy's whole tiles
        for d in range(D):
            row[d] = key_f32(K2, ks, lut, t, d)
        s4 = quantize_row(row, c4, TOP)
        for g in range(G):
            dot = 0
            for d in range(D):
                dot += np.int32(c4[d]) * np.int32(qc[g, d])
            est[g, t] = np.float32(dot) * (f[g] * s4)
    _block_masses(est, seq_len, bs, mass, done, mass.shape[1])


@njit(cache=True, nogil=True)
def _block_masses(est, seq_len, bs, mass, b0, b1):
    """mass[g, b] = max + log(sum of exp(est - max)) over block b's keys of row g of est (its
    exp weights overwrite the scores), for blocks b0 <= b < b1."""
    for g in range(mass.shape[0]):
        for b in range(b0, b1):
            p0, p1 = b * bs, min(b * bs + bs, seq_len)
            m = row_max(est[g], p0, p1 - p0)
            total = exp_sum(est[g][p0:p1], m, p1 - p0, est[g][p0:p1])
            mass[g, b] = m + np.float32(math.log(np.float64(total)))


@njit(cache=True, nogil=True)
def select_and_attend(queries, kv, h0, G, seq_len, settings, side, out, selection, select):
    """Select blocks for query heads h0..h0+G-1 of one KV head (all of them unless sparse) and
    attend. side: for v2 (flags' V2 bits), P holds the block summaries [n, 2D]
    (state.sparse.BlockSummaries), for v3 (flags' V3 word) the int8 key codes [n * bs, D] with
    their scales in ps (state.sparse.KeyCodes), with V3_KEY4 the 4-bit ones in tiles of 16 keys
    (state.sparse.KeyCodes4); n_copied <= seq_len // bs, so only full blocks
    below seq_len are read from the copy, later blocks are probed in K itself.
    select: None where no caller ever selects (the fused step of exact requests): a type,
    so numba prunes the selection code before typing it; True elsewhere, `sparse` decides."""
    bs = settings[1]
    nb = (seq_len + bs - 1) // bs
    mark = np.zeros((G, nb), dtype=np.bool_)
    ntok = np.zeros(G, dtype=np.int64)
    _select(queries, kv, h0, seq_len, settings, side, selection + (mark, ntok), select)
    pdummy = np.zeros((1, 1), dtype=np.float32)
    attend_group(queries[1:], kv, h0, seq_len, settings[0], bs, (mark, ntok), out, (False, pdummy))


@njit(cache=True, nogil=True)
def _select(queries, kv, h0, seq_len, settings, side, picks, select):
    """select_and_attend's selection: picks (sel, stages, nsel, mark, ntok) for heads
    h0..h0+G-1 (G: mark's rows), mark [G, >= nb] (all False on entry) and ntok [G] (0 on
    entry) as the attention takes them."""
    q, _, qs = queries
    scale, bs, sparse, k_blocks, n_probe, flags, lut = settings
    reserved, _, _, _, n_copied = side
    sel, stages, nsel, mark, ntok = picks
    G = mark.shape[0]
    nb = (seq_len + bs - 1) // bs
    if select is not None and sparse and k_blocks < nb:  # with k >= nb every block is taken whatever the probes say
        scores = np.empty((G, nb), dtype=np.float32)  # [G, nb] probe maxima (seed), scores (v2), masses (v3)
        if flags & V3_ON:
            K2, _, ks, _, int8 = kv
            _, P2, ps, _, _ = side
            if flags & V3_KEY4:
                # the tiles as bytes: the kernel is typed for every selector's copy, v3-q4's is int8
                T2 = P2.view(np.int8)
                _v3_scores4((q, qs, int8, scale, h0), (K2, ks, lut), (T2, ps, n_copied), seq_len, bs, scores)
            else:
                _v3_scores((q, qs, int8, scale, h0), (K2, ks, lut), (P2, ps, n_copied), seq_len, bs, scores)
        elif flags & V2_ON:
            _v2_scores(q, qs, kv, h0, seq_len, settings, side, scores)
        else:
            _probe_group(q, qs, h0, kv, seq_len, bs, n_probe, side, scores)
        for g in range(G):
            h = h0 + g
            if flags & V3_ON:
                n = select_v3_nb(scores[g], flags, k_blocks, sel[h], stages[h])
            elif flags & V2_ON:
                n = select_v2_nb(scores[g], flags, k_blocks, sel[h], stages[h])
            else:
                n = fill_probe_nb(scores[g], reserved, k_blocks, sel[h], stages[h])
            nsel[h] = n
            for j in range(n):
                b = sel[h, j]
                mark[g, b] = True
                ntok[g] += min(b * bs + bs, seq_len) - b * bs
    else:
        every = STAGE_SCORE if flags else STAGE_PROBE  # the stage an all-blocks selection reports
        for g in range(G):
            for b in range(nb):
                sel[h0 + g, b] = b
                stages[h0 + g, b] = reserved[b] if sparse and reserved[b] >= 0 else every
                mark[g, b] = True
            nsel[h0 + g] = nb
            ntok[g] = seq_len


@njit(cache=True, nogil=True)
def importance_per_block(imp, seq_len, bs):
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
def decode_kernel(queries, kv, imp, seq_len, G, settings, copy, out, selection, attend):
    """Decode attention of one query position over positions 0..seq_len-1 of a cache (kv),
    every KV head's group in turn: queries [H, D] -> out [H, D], the selection in selection.
    imp: the cache's prefill importance per position (seed selector only); copy: (P [KVH, n,
    D | 2D], ps, per_block, n_copied), the probe-key copy, block summaries or key codes (side's
    tail; v3's 4-bit codes are tiles, [KVH, tiles, 8 padded(D)]).
    attend False: the selection alone, out untouched (what a selector costs a token)."""
    # Serial over KV heads: with 3 KV heads on 2 cores a prange over them measured slower at
    # every context up to 7K and every KV type (sparse f32 at 7K: 16.5 vs 12.6 ms a token,
    # workers pinned), the launch and the 2:1 split costing more than the second core gives.
    K, V, ks, vs, int8 = kv
    P, ps, per_block, n_copied = copy
    _, bs, sparse, k_blocks, _, flags, _ = settings
    nb = (seq_len + bs - 1) // bs
    # a copy made for a longer seq_len holds blocks at or past seq_len: never read them
    # (unchecked indexing would write past `probe`); the caller passes a clamped count too
    n_copied = min(n_copied, seq_len // bs)
    if sparse and not flags:
        reserved = reserve_importance_nb(importance_per_block(imp, seq_len, bs), k_blocks, nb)
    else:  # exact, or v2 (which does not use importance)
        reserved = np.full(nb, -1, dtype=np.int8)
    for kh in range(K.shape[0]):
        side = (reserved, P[kh], ps[kh], per_block, n_copied)
        head_kv = (K[kh], V[kh], ks[kh], vs[kh], int8)
        if attend:
            select_and_attend(queries, head_kv, kh * G, G, seq_len, settings, side, out, selection, True)
        else:
            picks = selection + (np.zeros((G, nb), dtype=np.bool_), np.zeros(G, dtype=np.int64))
            _select(queries, head_kv, kh * G, seq_len, settings, side, picks, True)


# queries of a sparse prefill attended together (sparse_prefill_kernel): their G heads each
# make R * G rows of one attend_rows pass, which reads (and widens) a block once for every row
# that selected it
_PREFILL_ROWS = 8


@njit(cache=True, nogil=True, parallel=True)
def sparse_prefill_kernel(queries, kv, start, G, settings, summaries, out, probs):
    """Sparse attention of queries [T, H, D] at positions start..start+T-1 (their K/V in kv
    already) -> out [T, H, D]. summaries: (P [KVH, n, 2D], n_summ), v2's block summaries of
    the full blocks below start + T (flags set); the seed probes K itself (P unused).

    Each query selects its blocks over its own causal prefix as a decode step at its position
    would (_select, no importance), and runs of _PREFILL_ROWS queries attend in one
    attend_rows pass, each (query, head) row with its own marks and length: each row's bits
    are its own decode step's. A row's probabilities land in pacc[head] in query order, as one
    query at a time would add them (each goes to a zeroed row first: 0 + p is p)."""
    q, qa, qs = queries
    K, V, ks, vs, int8 = kv
    scale, bs, _, k_blocks, n_probe, flags, lut = settings
    P, n_summ = summaries
    want_p, pacc = probs
    T, H = q.shape[0], q.shape[1]
    S = start + T
    nbmax = (S + bs - 1) // bs
    R = _PREFILL_ROWS
    for kh in prange(K.shape[0]):
        sel = np.empty((H, nbmax), dtype=np.int64)
        stages = np.empty((H, nbmax), dtype=np.int8)
        nsel = np.empty(H, dtype=np.int64)
        mark = np.zeros((R * G, nbmax), dtype=np.bool_)
        ntok = np.zeros(R * G, dtype=np.int64)
        lens = np.zeros(R * G, dtype=np.int64)
        rq = np.empty((R * G, q.shape[2]), dtype=np.float32)
        rs = np.empty(R * G, dtype=np.float32)
        ro = np.empty((R * G, q.shape[2]), dtype=np.float32)
        rp = np.zeros((R * G if want_p else 1, S if want_p else 1), dtype=np.float32)
        none = np.full(nbmax, -1, dtype=np.int8)  # prefill: no importance (_select reads a query's blocks only)
        head_kv = (K[kh], V[kh], ks[kh], vs[kh], int8)
        for t0 in range(0, T, R):
            n_rows = min(R, T - t0) * G
            for r in range(n_rows // G):
                t = t0 + r
                n = start + t + 1
                rows = mark[r * G : r * G + G]
                rows[:] = False
                ntok[r * G : r * G + G] = 0
                side = (none, P[kh], ks[kh], 1, min(n_summ, n // bs) if flags else 0)
                _select((q[t], qa[t], qs[t]), head_kv, kh * G, n, settings, side,
                        (sel, stages, nsel, rows, ntok[r * G : r * G + G]), True)  # fmt: skip
                for g in range(G):
                    lens[r * G + g] = n
                    rq[r * G + g] = qa[t, kh * G + g]
                    rs[r * G + g] = qs[t, kh * G + g]
            nb = (start + t0 + n_rows // G + bs - 1) // bs
            attend_rows((rq[:n_rows], rs[:n_rows]), head_kv, 0, lens[:n_rows], scale, bs,
                        (mark[:n_rows], ntok[:n_rows]), ro, (want_p, rp))  # fmt: skip
            for r in range(n_rows // G):
                for g in range(G):
                    row = r * G + g
                    out[t0 + r, kh * G + g] = ro[row]
                    if want_p:  # this row's probabilities into its head's, then the row zeroed again
                        for b in range(nb):
                            if mark[row, b]:
                                for p in range(b * bs, min(b * bs + bs, lens[row])):
                                    pacc[kh * G + g, p] += rp[row, p]
                                    rp[row, p] = 0
