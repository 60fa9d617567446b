"""One decode token of a dense decoder as a single compiled call, on every thread; or the R
rows speculative verification checks (R consecutive positions of one sequence, exact attention).

The staged path (models/decoder.py) makes ~20 Python-level calls per layer, and its decode
matvecs run on one core because a numba parallel launch (~100 us here) costs more than a
0.5M multiply-add matvec takes. Here the whole token is one parallel region: each worker
takes its share of every matvec's rows, of the query heads and of the KV heads, and the
workers meet at a spin barrier (sync.barrier, ~0.2 us) between dependent phases:

    per layer: rmsnorm (each worker, redundantly) -> qkv rows | -> bias, q/k norm, RoPE, query
    form, K/V append | -> attention per query head | -> o rows, residual | -> rmsnorm
    (redundantly) -> gate/up rows | -> silu*up (redundantly) -> down rows, residual |
    then: final rmsnorm -> lm_head rows.
    A MoE layer (Qwen3-MoE) runs moe_phase.py's phases after its rmsnorm instead of gate/up/down.

Bit-identical to the staged path: every value is computed by the same compiled helpers on
arrays of the same types (rows by rowdot_*, norms by _rms_rows, RoPE by _rope, silu by
_silu_mul, attention by select_and_attend or, for exact requests, its kernel attend_group on
every block, as select_and_attend gives it), and splitting rows or heads between workers never changes
what one row or head computes. Verification's R rows go through each phase together: the row
dots take them as one x [R, E] (each row's bits those of its own dot, ir.make_rows_x), each
KV head's K/V is read once for all of them (attention.decode.verify_head, a decode step's
bits at each position), and every elementwise helper works row by row. Block formats run
here: q8_0, q4_0, q4_1, and q5_0, q5_1 and the K-quants (q4_k, q5_k, q6_k) through
kernels/matmul/kquants.py's row dots.

Qwen3.5 (StepHybrid, None for every other family): a Gated DeltaNet layer runs
_deltanet_phase in place of the attention (in_proj rows | conv + SiLU by channel | the delta
rule by value head, kernels/deltanet.py's helpers | out_proj rows, residual |), a gated
full-attention layer takes queries of twice the width (query, then gate, per head), rotates
the first rotary dims and multiplies each head's output by sigmoid(gate) before o_proj, and a
MoE layer with a shared expert adds routed + shared * sigmoid(gate . h) (_shared_residual).
"""

import functools
from typing import NamedTuple

import numpy as np
from numba import njit, typeof, types

from sparrow.kernels.attention.decode import attend_group, importance_per_block, select_and_attend, verify_head
from sparrow.kernels.attention.select import reserve_importance_nb
from sparrow.kernels.deltanet import _conv_silu_channels, _deltanet_value_head, _sigmoid1
from sparrow.kernels.elementwise import _quant_rows, _rms_rows, _rope, _silu_mul
from sparrow.kernels.formats import X8_FIRST
from sparrow.kernels.fused.moe_phase import moe_phase
from sparrow.kernels.fused.sync import barrier
from sparrow.kernels.ir import f16_bits
from sparrow.kernels.matmul.q8.groups import GROUP
from sparrow.kernels.matmul.q8.quantized import quantize as _q8_quantize
from sparrow.kernels.matmul.q8.quantized import rows_address as _q8_rows_address
from sparrow.kernels.matmul.q8.quantized import x_sums as _q8_x_sums
from sparrow.kernels.matmul.widen import dot, exact_sums
from sparrow.kernels.matmul.widen import exact_rows_address as _exact_rows_address
from sparrow.kernels.matmul.widen import kq_rows_address as _kq_rows_address
from sparrow.kernels.native_call import address_checked, call_checked, call_native, view
from sparrow.kernels.options import KW

KV_F32, KV_F16, KV_INT8 = 0, 1, 2  # storage kinds of the KV cache arrays
_ROWS_LIKE = np.zeros((0, 0), np.uint8)  # the weight rows' type (read-only bytes), for view()
_ROWS_LIKE.flags.writeable = False


@njit(**KW)
def _share(n, tid, nt):
    """Rows [a, b) of n that worker tid takes: contiguous, sizes differing by at most one."""
    return n * tid // nt, n * (tid + 1) // nt


@njit(**KW)
def _matvec(w, kind, x, y, tid, nt, q8, exact):
    """y[0, o] = row o of w . x[0] for this worker's rows (the staged path's row dots: exact
    when q8 is None, else with x quantised to 8 bits, the activations="q8" mode). q8 is None
    or the address of q8.quantized.rows_q8_xs (q8_rows_address): numba prunes the branch a
    None never takes before typing it, so the exact step never compiles the q8 kernels, and
    the q8 step calls their tiles through that address instead of compiling them again.
    exact: (the address of widen.rows_exact, its kq: exact_rows_address), called the same
    way: the exact row dots compile once, for the staged matvecs and this step."""
    a, b = _share(w.shape[0], tid, nt)
    if b > a:
        if q8 is not None:
            xq, dx, sx = _q8_quantize(x)
            xs = _q8_x_sums(kind, xq)
            call_native(q8, (w, np.int64(kind), xq, dx, sx, xs, y, np.int64(a), np.int64(b)))
        else:  # the staged path's exact row loop, for every block format
            xc = np.ascontiguousarray(x)  # the type exact_rows_address compiled for (x is C: a no-op)
            sx = exact_sums(xc, kind, True)
            call_native(exact[0], (w, np.int64(kind), xc, sx, y, np.int64(a), np.int64(b), exact[1]))


@njit(**KW)
def _matvec_at(w, kind, x, y, off, n, tid, nt, q8, exact):
    """_matvec into y[0, off : off + n], n the rows of w's output (a piece of a group whose
    formats differ, as q/k/v in Q4_K_M files); nothing for a piece with no rows. Every matvec
    of the step goes through here, so _matvec compiles for one layout of y, not two."""
    if n > 0:
        _matvec(w, kind, x, y[:, off : off + n], tid, nt, q8, exact)


@njit(**KW)
def _own_rows(w, kind, n, tid, nt):
    """The output rows [a, b) of n that worker tid's _matvec over w wrote (w's rows are groups
    of 8 for the q8.groups kinds)."""
    a, b = _share(w.shape[0], tid, nt)
    if kind >= X8_FIRST:
        return min(GROUP * a, n), min(GROUP * b, n)
    return a, b


@njit(**KW)
def _store_kv(X, XS, kv_kind, kh, pos, row, one, codes, sc):
    """Writes the f32 row [D] (one: its [1, D] buffer) as KV head kh's entry at pos.
    Copies here and in fused_decode_step are element loops: numba's shape-checked array assignment
    costs seconds of compile."""
    D = row.shape[0]
    if kv_kind == KV_F32:
        for d in range(D):
            X[kh, pos, d] = row[d]
    elif kv_kind == KV_F16:
        for d in range(D):
            X[kh, pos, d] = f16_bits(row[d])
    else:
        for d in range(D):
            one[0, d] = row[d]
        _quant_rows(one, codes, sc)
        for d in range(D):
            X[kh, pos, d] = codes[0, d]
        XS[kh, pos] = sc[0]


class StepModel(NamedTuple):
    """The model's side of a fused step (built once per activations mode by models/fused.py)."""

    wtab: np.ndarray  # [L, 7, 3] (address, rows, bytes a row) of each layer's weight rows (rows):
    # q/k/v as one piece (then two empty pieces) or q, k, v; o; gate/up as one piece or gate, up; down
    kinds: np.ndarray  # [L, 7] formats.KIND (or X8_KIND in the q8 mode) of those pieces
    offs: np.ndarray  # [L, 5] output offsets of the q/k/v and gate/up pieces
    rows: np.ndarray  # [L, 5] their output rows (0: no piece)
    in_norm: np.ndarray  # [L, E]
    post_norm: np.ndarray  # [L, E]
    eps: np.float32
    bias: np.ndarray  # [L, QKV] or [L, 0]
    q_norm: np.ndarray  # [L, D] or [L, 0]
    k_norm: np.ndarray
    cos: np.ndarray  # [> every row's rope position, D/2], row p: rope position p
    sin: np.ndarray
    H: int
    KV: int
    D: int
    F: int
    scale: np.float32
    head_norm: np.ndarray  # [E]
    head_w: np.ndarray  # lm_head rows
    head_kind: int  # their kind; -1: the head runs staged


class StepCache(NamedTuple):
    """One sequence's KV cache as the step reads and appends it: per layer, the (address,
    dimensions) of its arrays, which view() turns into arrays of the *_like arrays' types."""

    kvtab: np.ndarray  # [S, L, 2, 4]: per sequence s (one, but for a batch) K, V [KVH, C, D]
    stab: np.ndarray  # [S, L, 3, 3]: the int8 scales KS, VS [KVH, C | 1] (unused for f32 / f16), and
    # the prefill importance per position [1, C]
    ptab: np.ndarray  # [S, L, 2, 4]: probe copies P [KVH, n, D | 2D] (K when nothing is probed), their scales PS
    kv_like: np.ndarray  # [0, 0, 0] of K's and V's dtype
    p_like: np.ndarray  # [0, 0, 0] of P's dtype
    s_like: np.ndarray  # [0, 0] float32
    n_copied: np.ndarray  # [S, L] blocks of P already copied
    per_block: int
    kv_kind: int  # KV_F32, KV_F16, KV_INT8


class StepAttention(NamedTuple):
    """The request's attention settings."""

    sparse_on: bool
    k_blocks: int
    block: int
    n_probe: int
    flags: int  # 0: the seed's selector, else v2's (attention.select.V2_*)
    dense: int  # v2: layers 0..dense-1 exact
    lut: np.ndarray  # f16 bits -> f32


class StepScratch(NamedTuple):
    """Buffers the workers share, and the logits, for R rows (1 for a decode step)."""

    qkv: np.ndarray  # [R, QKV]
    att: np.ndarray  # [R, H, D]
    att_flat: np.ndarray  # [R, H*D], att's memory
    qd: np.ndarray  # [R, H, D]: the queries as the attention kernel takes them (int8 KV: codes)
    qa: np.ndarray  # [R, H, D]: times the scale (float KV), or the codes again
    qs: np.ndarray  # [R, H]: the codes' scales (int8 KV)
    gu: np.ndarray  # [R, 2F]
    y: np.ndarray  # [R, E]
    logits: np.ndarray  # [R, Vocab]
    # each layer's block selection, as attention.decode.select_and_attend writes it: [L, ...] when the
    # step is traced (models.attention.Selections keeps every layer's), else [1, ...], one
    # reused by every layer: the same types either way, so tracing compiles nothing more
    sel: np.ndarray  # [L | 1, H, nb] int64: head h read blocks sel[., h, :nsel[., h]], ascending
    stages: np.ndarray  # [L | 1, H, nb] int8: the rule that chose each (attention.select.STAGE_*)
    nsel: np.ndarray  # [L | 1, H] int64


class StepHybrid(NamedTuple):
    """Qwen3.5's layers (models/fused.py builds it; None for every other family, whose step
    then compiles none of this): Gated DeltaNet layers and gated full attention."""

    full: np.ndarray  # [L] int64: 1 for a gated full-attention layer, 0 for a Gated DeltaNet one
    index: np.ndarray  # [L] int64: the layer's slot in its kind's state (the KV cache's layers, or conv / ssm)
    dwtab: np.ndarray  # [L, 5, 3] a DeltaNet layer's rows as StepModel.wtab: the in_proj pieces
    # (qkv | z | b | a as one piece, then three empty ones, or each), out_proj
    dkinds: np.ndarray  # [L, 5]
    doffs: np.ndarray  # [L, 4] output offsets of the in_proj pieces in proj
    drows: np.ndarray  # [L, 4] their output rows (0: no piece)
    conv_w: np.ndarray  # [Ll, C, K]
    neg_A: np.ndarray  # [Ll, Hv]
    dt_bias: np.ndarray  # [Ll, Hv]
    norm: np.ndarray  # [Ll, Dv]
    key_head: np.ndarray  # [Ll, Hv] int64
    dims: np.ndarray  # [3] int64: Hk, Dk, Dv
    C: int  # conv channels (q | k | v)
    VD: int  # Hv * Dv
    Hv: int
    proj: np.ndarray  # [>= R, C + VD + 2 Hv] the in_proj outputs: qkv | z | b | a
    conv: np.ndarray  # [>= R, C] after the conv and SiLU
    yv: np.ndarray  # [>= R, VD] out_proj's input
    stab: np.ndarray  # [S, 2, 5] per sequence: its HybridCache's conv [Ll, K-1, C] and ssm [Ll, Hv, Dk, Dv]
    keep: np.ndarray  # [R, 2, 5] per row: where the state after it is kept (HybridCache.row_states), 0: nowhere
    like3: np.ndarray  # [0, 0, 0] float32, writable: the type view() gives a conv state (a global would be read-only)
    like4: np.ndarray  # [0, 0, 0, 0] float32: a delta rule state's
    shared: np.ndarray  # [L] int64: 1 where the MLP is a MoE block with a shared expert (its rows in StepModel's
    # gate/up/down slots)
    sgate: np.ndarray  # [L, E] f32: that expert's gate row (zeros elsewhere)
    moe_out: np.ndarray  # [>= R, E] the routed experts' sum


@njit(**KW)
def _deltanet_phase(team, layer, h, x, at, y, eps, hyb, q8, exact):
    """Layer `layer`'s Gated DeltaNet mixing for worker tid of team (tid, nt, sync) over the
    rows of h and x [R, E] (x gets out_proj's output added, y [R, E] its scratch); False, doing
    nothing, where the layer is full attention.
    Three phases, as kernels/deltanet.gated_deltanet runs one row of a sequence: in_proj rows
    | -> conv + SiLU, each worker its channels, row after row | -> per value head
    (deltanet._deltanet_value_head, each worker its heads, row after row) | -> out_proj rows, residual |.
    A row's state is its own sequence's (at[r, 0]); rows of one sequence (verification) follow
    each other in a channel's and a head's state, which one worker owns, and the state after a
    row is copied where keep says (the staged path's HybridCache.keep_row)."""
    if hyb.full[layer]:
        return False
    tid, nt, sync = team
    li = hyb.index[layer]
    R, E = x.shape[0], x.shape[1]
    C, VD, Hv = hyb.C, hyb.VD, hyb.Hv
    proj, conv, yv = hyb.proj[:R], hyb.conv[:R], hyb.yv[:R]
    for j in range(4):
        _matvec_at(_w(hyb.dwtab, layer, j), hyb.dkinds[layer, j], h, proj, hyb.doffs[layer, j], hyb.drows[layer, j],
                   tid, nt, q8, exact)  # fmt: skip
    barrier(sync, nt)
    c0, c1 = _share(C, tid, nt)
    w = hyb.conv_w[li]
    for r in range(R):
        st = _at3(hyb.stab, at[r, 0], 0, hyb.like3)[li]  # [K-1, C]
        _conv_silu_channels(proj[r : r + 1, :C], w, st, conv[r : r + 1], c0, c1)
        if hyb.keep[r, 0, 0] != 0:
            kept = _at3(hyb.keep, r, 0, hyb.like3)[li]
            for j in range(st.shape[0]):
                for c in range(c0, c1):
                    kept[j, c] = st[j, c]
    barrier(sync, nt)
    v0, v1 = _share(Hv, tid, nt)
    for r in range(R):
        S = _at4(hyb.stab, at[r, 0], 1, hyb.like4)[li]  # [Hv, Dk, Dv]
        for hh in range(v0, v1):
            inputs = (conv[r : r + 1], proj[r : r + 1, C : C + VD], proj[r : r + 1, C + VD : C + VD + Hv],
                      proj[r : r + 1, C + VD + Hv : C + VD + 2 * Hv])  # fmt: skip
            weights = (hyb.neg_A[li], hyb.dt_bias[li], hyb.norm[li], hyb.key_head[li], hyb.dims, eps)
            _deltanet_value_head(hh, inputs, weights, S, yv[r : r + 1])
            if hyb.keep[r, 1, 0] != 0:
                kept = _at4(hyb.keep, r, 1, hyb.like4)[li, hh]
                for i in range(S.shape[1]):
                    for j in range(S.shape[2]):
                        kept[i, j] = S[hh, i, j]
    barrier(sync, nt)
    _matvec_at(_w(hyb.dwtab, layer, 4), hyb.dkinds[layer, 4], yv, y, np.int64(0), E, tid, nt, q8, exact)
    a, b = _own_rows(_w(hyb.dwtab, layer, 4), hyb.dkinds[layer, 4], E, tid, nt)
    for r in range(R):
        for o in range(a, b):
            x[r, o] = x[r, o] + y[r, o]
    barrier(sync, nt)
    return True


@njit(**KW)
def _zeroed(buf, R, tid, nt):
    """buf[:R] with this worker's share of its columns zeroed (moe_phase's combine adds each
    worker's share of the columns into it, after barriers)."""
    out = buf[:R]
    a, b = _share(out.shape[1], tid, nt)
    for r in range(R):
        for o in range(a, b):
            out[r, o] = np.float32(0)
    return out


@njit(**KW)
def _shared_residual(x, y, h, a, b, shared, layer, hyb):
    """Columns [a, b) of the residual after Qwen3.5's MLP: x + y for a dense MLP; for a MoE
    layer with a shared expert (y its output), x + (routed + y * sigmoid(gate . h)), the sum
    the staged SharedExpertMoE returns (the gate row dotted by widen.dot, as linear's f32 rows)."""
    for r in range(x.shape[0]):
        if shared:
            g = _sigmoid1(dot(hyb.sgate[layer], h[r]))
            for o in range(a, b):
                x[r, o] = x[r, o] + (hyb.moe_out[r, o] + y[r, o] * g)
        else:
            for o in range(a, b):
                x[r, o] = x[r, o] + y[r, o]


@njit(**KW)
def _at3(tab, i, j, like):
    """The 3-d array tab[i, j] describes (address, dimensions), of like's type (native_call.view)."""
    return view(tab[i, j, 0], (tab[i, j, 1], tab[i, j, 2], tab[i, j, 3]), like)


@njit(**KW)
def _at4(tab, i, j, like):
    """The 4-d array tab[i, j] describes (a delta rule state)."""
    return view(tab[i, j, 0], (tab[i, j, 1], tab[i, j, 2], tab[i, j, 3], tab[i, j, 4]), like)


@njit(**KW)
def _at2(tab, i, j, like):
    """The 2-d array tab[i, j] describes."""
    return view(tab[i, j, 0], (tab[i, j, 1], tab[i, j, 2]), like)


@njit(**KW)
def _w(wtab, i, j):
    """Piece j of layer i's weight rows (StepModel.wtab), read-only bytes."""
    return view(wtab[i, j, 0], (wtab[i, j, 1], wtab[i, j, 2]), _ROWS_LIKE)


@njit(**KW)
def fused_decode_step(tid, nt, sync, x, at, step, q8, select, moe, hybrid):
    """Worker tid of nt: decodes the token at position at[0, 1] of sequence 0 (at [R, 3]: each
    row's sequence, an index into cache's tables, its position there, and its rope position:
    the position plus its prompt's rope delta, Qwen3-VL after images), x [1, E] being its embedding
    (the residual stream, updated in place); or, x [R, E] with 1 < R <= SMALL_T, either
    verification's rows at consecutive positions of one sequence with exact attention, or a
    batch: R sequences' decode rows, one each, with the same attention settings (each row
    selects from its own cache's state). step: (model, cache, attn, scratch, calls), the records
    above (StepModel, StepCache, StepAttention, StepScratch), built by models/fused.py, and calls
    (below). Two types choose what is compiled (numba prunes the branches a None never
    takes before typing them): q8, None for exact activations or the q8 row kernel's address
    (see _matvec); select, None for exact attention (no selection code) or True where attn's
    settings may select; moe, None for a dense model or its MoE layers (moe_phase.StepMoE),
    which run moe_phase; hybrid, None but for Qwen3.5 (StepHybrid: its Gated DeltaNet layers
    run _deltanet_phase, its full-attention layers gate their output, rotate the first
    2 cos.shape[1] dims of each head and read the KV cache's layer hybrid.index[layer]).
    calls: (the exact row dots' address and their kq
    (exact_rows_address), used where q8 is None; the address and type key of the attention
    for these types (attention_call)): called through them, the row dots and the attention
    compile once on their own, not again into this function (kernels/native_call.py); then
    the address and type key of verify_head for these types (verify_call), or zeros where R
    is 1. sync[4] is set where a key does not match."""
    model, cache, attn, scratch, calls = step
    # by name, so the records' field order is nobody's concern
    wtab = model.wtab
    kinds, offs, rows, bias, q_norm, k_norm = (
        model.kinds,
        model.offs,
        model.rows,
        model.bias,
        model.q_norm,
        model.k_norm,
    )
    in_norm, post_norm, eps, cos, sin = model.in_norm, model.post_norm, model.eps, model.cos, model.sin
    H, KV, D, F, scale = model.H, model.KV, model.D, model.F, model.scale
    head_norm, head_w, head_kind = model.head_norm, model.head_w, model.head_kind
    kvtab, stab, ptab = cache.kvtab, cache.stab, cache.ptab
    kv_like, p_like, s_like = cache.kv_like, cache.p_like, cache.s_like
    n_copied, per_block, kv_kind = cache.n_copied, cache.per_block, cache.kv_kind
    sparse_on, k_blocks, bs, n_probe = attn.sparse_on, attn.k_blocks, attn.block, attn.n_probe
    flags, dense, lut = attn.flags, attn.dense, attn.lut
    qkv, att3, att_flat, qd3, qa3, qs2 = scratch.qkv, scratch.att, scratch.att_flat, scratch.qd, scratch.qa, scratch.qs
    gu, y, logits = scratch.gu, scratch.y, scratch.logits
    sel3, stages3, nsel2 = scratch.sel, scratch.stages, scratch.nsel
    exact = (calls[0], calls[1])
    R, E = x.shape[0], x.shape[1]  # rows: 1, a batch's or verification's
    G = H // KV
    qw = 1  # a query head's width in qkv, in heads: 2 where a gate follows each query (Qwen3.5)
    if hybrid is not None:
        qw = 2
    QO, KO = qw * H * D, qw * H * D + KV * D
    r2 = 2 * cos.shape[1]  # the rotated dims of a head (D but for partial rotary)
    h = np.empty((R, E), np.float32)  # this worker's normed copy of x
    act = np.empty((R, F), np.float32)  # silu(gate) * up, each worker its own full copy
    one = np.empty((1, D), np.float32)  # one head's row, for the row-wise helpers
    normed = np.empty((1, D), np.float32)
    rot = np.empty((1, 1, D), np.float32)
    src = np.empty((1, 1, D), np.float32)
    codes = np.empty((1, D), np.int8)
    sc = np.empty(1, np.float32)
    pos = at[0, 1]  # the first row's position
    batch = kvtab.shape[0] > 1  # rows of several sequences
    positions = np.full(1, at[0, 2], np.int64)  # the RoPE position of the row at hand
    pdummy = np.zeros((1, 1), np.float32)
    h0, h1 = _share(H, tid, nt)  # this worker's query heads
    k0, k1 = _share(KV, tid, nt)  # and KV heads
    has_bias = bias.shape[1] > 0
    has_norm = q_norm.shape[1] > 0
    for layer in range(wtab.shape[0]):
        _rms_rows(x, in_norm[layer], eps, h)
        mixed = False  # a Gated DeltaNet layer's mixing ran (Qwen3.5)
        kl = layer  # the KV cache's layer
        if hybrid is not None:
            mixed = _deltanet_phase((tid, nt, sync), layer, h, x, at, y, eps, hybrid, q8, exact)
            kl = hybrid.index[layer]
        if not mixed:
            _matvec_at(_w(wtab, layer, 0), kinds[layer, 0], h, qkv, offs[layer, 0], rows[layer, 0], tid, nt, q8, exact)
            _matvec_at(_w(wtab, layer, 1), kinds[layer, 1], h, qkv, offs[layer, 1], rows[layer, 1], tid, nt, q8, exact)
            _matvec_at(_w(wtab, layer, 2), kinds[layer, 2], h, qkv, offs[layer, 2], rows[layer, 2], tid, nt, q8, exact)
            barrier(sync, nt)
            for r in range(R):
                positions[0] = at[r, 2]
                kvr, str_ = kvtab[at[r, 0]], stab[at[r, 0]]  # the row's sequence's cache
                # q heads: bias, q norm, RoPE, then the form the attention kernel takes
                for hh in range(h0, h1):
                    for d in range(D):
                        v = qkv[r, hh * qw * D + d]
                        src[0, 0, d] = v + bias[layer, hh * D + d] if has_bias else v
                    if has_norm:
                        _rms_rows(src[0], q_norm[layer], eps, normed)
                        for d in range(D):
                            src[0, 0, d] = normed[0, d]
                    _rope(src, cos, sin, positions, rot)
                    for d in range(r2, D):  # partial rotary: the rest as it is
                        rot[0, 0, d] = src[0, 0, d]
                    if kv_kind == KV_INT8:
                        _quant_rows(rot[0], codes, sc)
                        for d in range(D):
                            qd3[r, hh, d] = np.float32(codes[0, d])
                            qa3[r, hh, d] = qd3[r, hh, d]
                        qs2[r, hh] = sc[0]
                    else:
                        for d in range(D):
                            qd3[r, hh, d] = rot[0, 0, d]
                            qa3[r, hh, d] = rot[0, 0, d] * scale
                        qs2[r, hh] = np.float32(0)
                # KV heads: bias, k norm, RoPE for k; bias for v; append at the row's position
                for kh in range(k0, k1):
                    for d in range(D):
                        v = qkv[r, QO + kh * D + d]
                        src[0, 0, d] = v + bias[layer, QO + kh * D + d] if has_bias else v
                    if has_norm:
                        _rms_rows(src[0], k_norm[layer], eps, normed)
                        for d in range(D):
                            src[0, 0, d] = normed[0, d]
                    _rope(src, cos, sin, positions, rot)
                    for d in range(r2, D):  # partial rotary: the rest as it is
                        rot[0, 0, d] = src[0, 0, d]
                    _store_kv(_at3(kvr, kl, 0, kv_like), _at2(str_, kl, 0, s_like), kv_kind, kh, at[r, 1],
                              rot[0, 0], one, codes, sc)  # fmt: skip
                    for d in range(D):
                        v = qkv[r, KO + kh * D + d]
                        one[0, d] = v + bias[layer, KO + kh * D + d] if has_bias else v
                    _store_kv(_at3(kvr, kl, 1, kv_like), _at2(str_, kl, 1, s_like), kv_kind, kh, at[r, 1],
                              one[0].copy(), one, codes, sc)  # fmt: skip
            barrier(sync, nt)
            # attention of this worker's query heads, in runs that share a KV head (v2: the first
            # `dense` layers exact)
            sparse = sparse_on and kl >= dense
            t = min(kl, sel3.shape[0] - 1)  # where this layer's selection goes (StepScratch.sel)
            sel, stages, nsel = sel3[t], stages3[t], nsel2[t]
            int8 = kv_kind == KV_INT8
            if R > 1 and not batch:  # verification: this worker's KV heads, each reading its K/V once for all rows
                Kl, Vl = _at3(kvtab[0], kl, 0, kv_like), _at3(kvtab[0], kl, 1, kv_like)
                KSl, VSl = _at2(stab[0], kl, 0, s_like), _at2(stab[0], kl, 1, s_like)
                for kh in range(k0, k1):
                    if not call_checked(calls[4], calls[5], (np.int64(kh), (qa3, qs2), (Kl, Vl, KSl, VSl, int8), pos,
                                                             scale, np.int64(G), bs, att3)):  # fmt: skip
                        sync[4] = 1
            else:  # a decode step's row, or a batch's rows, one a sequence: this worker's query heads,
                # over the row's cache
                for r in range(R):
                    c, n_r = at[r, 0], at[r, 1] + 1  # the row's sequence and length
                    nb_r = (n_r + bs - 1) // bs
                    Kr, Vr = _at3(kvtab[c], kl, 0, kv_like), _at3(kvtab[c], kl, 1, kv_like)
                    KSr, VSr = _at2(stab[c], kl, 0, s_like), _at2(stab[c], kl, 1, s_like)
                    Pr, PSr = _at3(ptab[c], kl, 0, p_like), _at2(ptab[c], kl, 1, s_like)
                    if select is not None and sparse and not flags:
                        imp = _at2(stab[c], kl, 2, s_like)[0]
                        reserved = reserve_importance_nb(importance_per_block(imp, n_r, bs), k_blocks, nb_r)
                    else:
                        reserved = np.full(nb_r, -1, dtype=np.int8)
                    nc = min(n_copied[c, kl], n_r // bs)
                    settings = (scale, bs, sparse, k_blocks, n_probe, flags, lut)
                    hh = h0
                    while hh < h1:
                        kh = hh // G
                        n = min(h1, (kh + 1) * G) - hh
                        kv = (Kr[kh], Vr[kh], KSr[kh], VSr[kh], int8)
                        if select is not None:  # block selection, then attention (attention.decode.select_and_attend)
                            side = (reserved, Pr[kh], PSr[kh], per_block, nc)
                            called = call_checked(calls[2], calls[3], ((qd3[r], qa3[r], qs2[r]), kv, hh, n, n_r,
                                                  settings, side, att3[r], (sel, stages, nsel), select))  # fmt: skip
                        else:  # every block, as select_and_attend marks them when nothing selects: the kernel
                            mark = np.ones((n, nb_r), np.bool_)
                            ntok = np.full(n, n_r, np.int64)
                            called = call_checked(calls[2], calls[3], ((qa3[r], qs2[r]), kv, hh, n_r, scale, bs,
                                                  (mark, ntok), att3[r], (False, pdummy)))  # fmt: skip
                        if not called:
                            sync[4] = 1  # the caller raises
                        hh += n
            if hybrid is not None:  # Qwen3.5: each head's output times sigmoid(its gate), heads this worker wrote
                g0, g1 = h0, h1
                if R > 1 and not batch:  # verify_head wrote this worker's KV heads' query heads
                    g0, g1 = k0 * G, k1 * G
                for r in range(R):
                    for hh in range(g0, g1):
                        for d in range(D):
                            att3[r, hh, d] = att3[r, hh, d] * _sigmoid1(qkv[r, (2 * hh + 1) * D + d])
            barrier(sync, nt)
            _matvec_at(_w(wtab, layer, 3), kinds[layer, 3], att_flat, y, np.int64(0), E, tid, nt, q8, exact)
            a, b = _own_rows(_w(wtab, layer, 3), kinds[layer, 3], E, tid, nt)
            for r in range(R):
                for o in range(a, b):
                    x[r, o] = x[r, o] + y[r, o]
            barrier(sync, nt)
        _rms_rows(x, post_norm[layer], eps, h)
        sparse_mlp = False
        shared = False  # Qwen3.5-MoE: the routed experts' sum goes to hybrid.moe_out, the shared expert follows
        if moe is not None:
            if hybrid is not None:
                shared = hybrid.shared[layer] != 0
            if shared:
                sparse_mlp = moe_phase(tid, nt, sync, layer, h, _zeroed(hybrid.moe_out, R, tid, nt), moe)
            else:
                sparse_mlp = moe_phase(tid, nt, sync, layer, h, x, moe)
        if not sparse_mlp or shared:  # the dense MLP, or the shared expert (its rows in the same slots)
            _matvec_at(_w(wtab, layer, 4), kinds[layer, 4], h, gu, offs[layer, 3], rows[layer, 3], tid, nt, q8, exact)
            _matvec_at(_w(wtab, layer, 5), kinds[layer, 5], h, gu, offs[layer, 4], rows[layer, 4], tid, nt, q8, exact)
            barrier(sync, nt)
            _silu_mul(gu, F, act)
            _matvec_at(_w(wtab, layer, 6), kinds[layer, 6], act, y, np.int64(0), E, tid, nt, q8, exact)
            a, b = _own_rows(_w(wtab, layer, 6), kinds[layer, 6], E, tid, nt)
            if hybrid is not None:
                _shared_residual(x, y, h, a, b, shared, layer, hybrid)
            else:
                for r in range(R):
                    for o in range(a, b):
                        x[r, o] = x[r, o] + y[r, o]
            barrier(sync, nt)
    if head_kind >= 0:
        _rms_rows(x, head_norm, eps, h)
        _matvec_at(head_w, head_kind, h, logits, np.int64(0), logits.shape[1], tid, nt, q8, exact)


@functools.cache
def q8_rows_address() -> int:
    """What the q8 step passes as q8: the address of q8.quantized.rows_q8_xs for the types
    _matvec calls it with (read-only C rows, an output row slice, whose layout is "A")."""
    return _q8_rows_address(_ROWS_LIKE)


@functools.cache
def exact_rows_address(kquants: bool) -> tuple[int, int]:
    """What the step's _matvec takes as exact: the addresses of widen.rows_exact and of its
    K-quant row loop (0 where the model has no K-quant rows: kquants False), for read-only C
    rows (the weights the step reads, models/fused.py) and the types _matvec passes."""
    return _exact_rows_address(_ROWS_LIKE), (_kq_rows_address(_ROWS_LIKE) if kquants else 0)


def attention_call(args) -> tuple[int, int]:
    """(address, type key) of the attention fused_decode_step calls, for the argument types it
    calls it with, args being its own (models/fused.py's, records flat):
    attention.decode.select_and_attend where the request may select blocks, else its kernel,
    attend_group (call_checked verifies the types when fused_decode_step compiles: a mismatch
    sets sync[4] instead of calling)."""
    cache, attn, scratch = _record_types(args)
    i64, f32, b = types.int64, types.float32, types.boolean

    def head(like):  # a[i] of a C array a typed like (view(..., like)[kh], scratch.sel[t]): one dimension fewer
        return _c_array(like, like.ndim - 1)

    def arr(dtype, nd):
        return types.Array(dtype, nd, "C")

    tup = types.BaseTuple.from_types
    K, S, P = head(cache["kv_like"]), head(cache["s_like"]), head(cache["p_like"])
    kv = tup((K, K, S, S, b))
    scale, select = typeof(args[5].scale), typeof(args[10])
    qd, qa, qs, att = (head(scratch[n]) for n in ("qd", "qa", "qs", "att"))  # the step's row 0
    if args[10] is None:
        marks, probs = tup((arr(b, 2), arr(i64, 1))), tup((b, arr(f32, 2)))
        sig = (tup((qa, qs)), kv, i64, i64, scale, attn["block"], marks, att, probs)
        return address_checked(attend_group, sig)
    settings = tup((scale, attn["block"], b, attn["k_blocks"], attn["n_probe"], attn["flags"], attn["lut"]))
    side = tup((arr(types.int8, 1), P, S, cache["per_block"], i64))
    selection = tup((head(scratch["sel"]), head(scratch["stages"]), head(scratch["nsel"])))
    sig = (tup((qd, qa, qs)), kv, i64, i64, i64, settings, side, att, selection, select)
    return address_checked(select_and_attend, sig)


def verify_call(args) -> tuple[int, int]:
    """(address, type key) of attention.decode.verify_head for the types fused_decode_step calls
    it with on verification's rows (R > 1), args as attention_call's."""
    cache, attn, scratch = _record_types(args)
    i64 = types.int64
    tup = types.BaseTuple.from_types
    K, S = _c_array(cache["kv_like"], 3), _c_array(cache["s_like"], 2)  # a layer's arrays, as _at3 / _at2 view them
    sig = (i64, tup((scratch["qa"], scratch["qs"])), tup((K, K, S, S, types.boolean)), i64, typeof(args[5].scale),
           i64, attn["block"], scratch["att"])  # fmt: skip
    return address_checked(verify_head, sig)


def _record_types(args) -> tuple[dict, dict, dict]:
    """The numba types of fused_decode_step's StepCache, StepAttention and StepScratch (args[6:9]) by field."""
    return tuple(dict(zip(typeof(a).fields, typeof(a).types)) for a in args[6:9])


def _c_array(like, nd):
    """The type of a C array of nd dimensions with like's dtype and read-only flag."""
    return types.Array(like.dtype, nd, "C", readonly=not like.mutable)
