"""Row kernels of attention as LLVM vector IR, and the softmax pieces (attention.decode, .prefill).

- dots(q, K2, t0, t1, step, s, off, ahead): s[off + j] = q . K2[t0 + j * step] for t0 + j * step < t1.
- accum(w, off, V2, t0, t1, acc, ahead): acc[(off + j) % 4] += w[off + j] * V2[t0 + j] for t0 + j < t1.
  ahead: rows below it may be fetched into L1 while these rows compute (see AHEAD_BYTES); pass
  t0 for none. Only the caller knows which rows it reads next (the next block, or a jump).
- widen(X2, t0, t1, out): out[:t1 - t0] = rows t0..t1-1 as float32.
- prefetch(X2, t0, t1): hint rows t0..t1-1 into L2.
- exp_shifted, sum_f32, max_at: vectorised exp(s - m), sum and max over packed scores (the sum
  in ir.lane_fold's order, the same on every CPU).
- exp_sum(s, m, n, out), row_max(s, i, n): the same exp-and-sum and max in one vector-IR pass
  over a contiguous row, with the same bits (attention's softmax step; as numba loops the exp
  never ran 16 lanes wide).

K2 / V2 are one KV head's rows [C, D] stored as float32, IEEE half bits (uint16) or int8 codes;
q, w and acc are float32. Rows are widened 16 lanes at a time; a head_dim that is not a
multiple of 16 finishes with scalar fma; head_dim 64 and 128 have unrolled paths that keep q
(dots) and the accumulators (accum) in registers, with the same arithmetic as the loop.

Why IR: numba's loops leave a dot's accumulator in one scalar chain and keep the weighted
sum's accumulator in memory (a store-to-load dependency on every row), which made exact
decode attention ~5x slower than its arithmetic. Here a dot is sum over 16-lane chunks with
fma into one vector, then a fixed pairwise tree 16 -> 1; the weighted sum keeps four vector
accumulators per chunk in registers, row i of the packed score list going to accumulator
i % 4. Both orders depend only on D and on the packed position i, never on how the caller
splits rows into calls (blocks), so exact attention and sparse attention with every block
selected give the same bits, and the thread count never enters.

Widening (f16 -> f32, int8 -> f32) is exact, so dots / accum over widen's float32 copy of rows
t0..t1-1 (as rows 0..t1-t0-1) give the bits they give over the stored rows. Several query rows
that read one block (a KV group's heads, verification's positions) widen it once that way
instead of once per query row: past a row or two the widening, not memory, bounds the kernels.
"""

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.elementwise import _LN2_HI, _LN2_LO, _LOG2E, exp_parts
from sparrow.kernels.ir import F32 as _F32
from sparrow.kernels.ir import I8 as _I8
from sparrow.kernels.ir import I16 as _I16
from sparrow.kernels.ir import I32 as _I32
from sparrow.kernels.ir import I64 as _I64
from sparrow.kernels.ir import V16F as _V16F
from sparrow.kernels.ir import fma as _fma
from sparrow.kernels.ir import hsum16 as _hsum
from sparrow.kernels.ir import lane_fold, lane_sum
from sparrow.kernels.ir import splat16 as _splat

_ZERO = ir.Constant(_V16F, [0.0] * 16)


def _kind(dtype):
    return {types.float32: "f32", types.uint16: "f16", types.int8: "i8"}.get(dtype)


def _elem(kind):
    return {"f32": _F32, "f16": _I16, "i8": _I8}[kind]


_ALIGN = {"f32": 4, "f16": 2, "i8": 1}


def _load16(builder, kind, base, idx):
    """16 consecutive elements at base[idx] widened to <16 x float>."""
    elem = _elem(kind)
    ptr = builder.bitcast(builder.gep(base, [idx]), ir.VectorType(elem, 16).as_pointer())
    v = builder.load(ptr, align=_ALIGN[kind])
    if kind == "f32":
        return v
    if kind == "f16":
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 16)), _V16F)
    return builder.sitofp(v, _V16F)


def _load1(builder, kind, base, idx):
    v = builder.load(builder.gep(base, [idx]))
    if kind == "f32":
        return v
    if kind == "f16":
        return builder.fpext(builder.bitcast(v, ir.HalfType()), _F32)
    return builder.sitofp(v, _F32)


def _ptr(context, builder, ty, val, elem):
    arr = context.make_array(ty)(context, builder, val)
    return builder.bitcast(arr.data, elem.as_pointer()), arr


# How far ahead of the rows being computed dots and accum prefetch (prefetcht0), on the row
# kernels' unrolled paths: a decode step streams a long cache from DRAM once, and the hardware
# prefetcher alone stays too close to a loop this short. 1-3 KB measured best, 4 KB and more no
# better than none (docs/kernels.md, "Decode attention").
AHEAD_BYTES = 2048


def _prefetch_lines(builder, base, nbytes):
    """prefetcht0 the cache lines of nbytes (a constant) from the byte pointer base."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8"
    )
    for line in range(0, nbytes, 64):
        ptr = builder.gep(base, [ir.Constant(_I64, line)])
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _ahead_rows(kind, dim):
    """Rows of dim elements of `kind` that make AHEAD_BYTES (at least one)."""
    return max(1, AHEAD_BYTES // (dim * _ALIGN[kind]))


def _prefetch_group(builder, kind, base, dim, row, limit):
    """Prefetch rows row..row+3 (dim elements of `kind` each, contiguous) of base when row <= limit."""
    rb = dim * _ALIGN[kind]
    with builder.if_then(builder.icmp_signed("<=", row, limit), likely=True):
        at = builder.gep(builder.bitcast(base, _I8.as_pointer()), [builder.mul(row, ir.Constant(_I64, rb))])
        _prefetch_lines(builder, at, 4 * rb)


def _hsum4(builder, a):
    """The four _hsum results of vectors a[0..3] as <4 x float>, with the same additions
    (lane i + lane i+8, then i+4, i+2, i+1) but shuffled so four rows share each add."""

    def sh(x, y, idx):
        return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(idx)), idx))

    lo8, hi8 = list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))
    x01 = builder.fadd(sh(a[0], a[1], lo8), sh(a[0], a[1], hi8))
    x23 = builder.fadd(sh(a[2], a[3], lo8), sh(a[2], a[3], hi8))
    lo4 = [i + o for o in (0, 8, 16, 24) for i in range(4)]
    y = builder.fadd(sh(x01, x23, lo4), sh(x01, x23, [i + 4 for i in lo4]))
    z = builder.fadd(sh(y, y, [0, 1, 4, 5, 8, 9, 12, 13]), sh(y, y, [2, 3, 6, 7, 10, 11, 14, 15]))
    return builder.fadd(sh(z, z, [0, 2, 4, 6]), sh(z, z, [1, 3, 5, 7]))


def _dots_generic(builder, kind, ptrs, d, walk, j0, n):
    """Rows j0..n-1: one row at a time, any head_dim. ptrs: (qp, kp, sp), the query's, the
    rows' and the scores' pointers; walk: (t0v, stepv, offv), the first row, the step between
    rows and the first score's index."""
    qp, kp, sp = ptrs
    t0v, stepv, offv = walk
    nch = builder.lshr(d, ir.Constant(_I64, 4))
    acc = cgutils.alloca_once_value(builder, _ZERO)
    tot = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
    with cgutils.for_range_slice(builder, j0, n, ir.Constant(_I64, 1)) as (j, _):
        base = builder.mul(builder.add(t0v, builder.mul(j, stepv)), d)
        builder.store(_ZERO, acc)
        with cgutils.for_range(builder, nch) as ch:
            c = builder.shl(ch.index, ir.Constant(_I64, 4))
            qv = _load16(builder, "f32", qp, c)
            kv = _load16(builder, kind, kp, builder.add(base, c))
            builder.store(_fma(builder, qv, kv, builder.load(acc)), acc)
        builder.store(_hsum(builder, builder.load(acc)), tot)
        with cgutils.for_range_slice(builder, builder.shl(nch, ir.Constant(_I64, 4)), d, ir.Constant(_I64, 1)) as (
            e,
            _,
        ):
            qe = _load1(builder, "f32", qp, e)
            ke = _load1(builder, kind, kp, builder.add(base, e))
            builder.store(_fma(builder, qe, ke, builder.load(tot)), tot)
        builder.store(builder.load(tot), builder.gep(sp, [builder.add(offv, j)]))


def _dots_fixed(builder, kind, ptrs, dim, walk, n, aheadv):
    """head_dim == dim (a multiple of 16): q stays in registers and rows go four at a time
    through _hsum4; the same fma chain and tree as _dots_generic, so the same bits. With step
    1, each group of four prefetches the four rows _ahead_rows later, while they are below
    aheadv. ptrs, walk: as _dots_generic's."""
    qp, kp, sp = ptrs
    t0v, stepv, offv = walk
    i64 = lambda x: ir.Constant(_I64, x)  # noqa: E731
    qv = [_load16(builder, "f32", qp, i64(c * 16)) for c in range(dim // 16)]
    ngroups = builder.lshr(n, i64(2))
    la = _ahead_rows(kind, dim)
    limit = builder.select(  # the last first-row-of-four to prefetch, relative to t0; -1: none
        builder.icmp_signed("==", stepv, i64(1)), builder.sub(builder.sub(aheadv, t0v), i64(la + 4)), i64(-1)
    )
    rows_at = builder.gep(kp, [builder.mul(t0v, i64(dim))])  # row t0
    with cgutils.for_range(builder, ngroups) as grp:
        j0 = builder.shl(grp.index, i64(2))
        _prefetch_group(builder, kind, rows_at, dim, builder.add(j0, i64(la)), limit)
        accs = []
        for r in range(4):
            base = builder.mul(builder.add(t0v, builder.mul(builder.add(j0, i64(r)), stepv)), i64(dim))
            acc = _ZERO
            for c in range(dim // 16):
                acc = _fma(builder, qv[c], _load16(builder, kind, kp, builder.add(base, i64(c * 16))), acc)
            accs.append(acc)
        out = builder.bitcast(builder.gep(sp, [builder.add(offv, j0)]), ir.VectorType(_F32, 4).as_pointer())
        builder.store(_hsum4(builder, accs), out, align=4)
    _dots_generic(builder, kind, ptrs, i64(dim), walk, builder.shl(ngroups, i64(2)), n)


@intrinsic
def dots(typingctx, q, K2, t0, t1, step, s, off, ahead):
    """Raw dot products of q with rows t0, t0+step, ... < t1 of K2 into s[off:]; returns the count.
    Rows below `ahead` (K2's, contiguous: step 1) may be prefetched meanwhile."""
    kind = _kind(K2.dtype)
    if kind is None or K2.ndim != 2 or K2.layout != "C":
        return None
    sig = types.int64(q, K2, types.int64, types.int64, types.int64, s, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        qp, _ = _ptr(context, builder, signature.args[0], args[0], _F32)
        kp, karr = _ptr(context, builder, signature.args[1], args[1], _elem(kind))
        sp, _ = _ptr(context, builder, signature.args[5], args[5], _F32)
        t0v, t1v, stepv, offv = args[2], args[3], args[4], args[6]
        ptrs, walk = (qp, kp, sp), (t0v, stepv, offv)
        d = builder.extract_value(karr.shape, 1)
        span = builder.sub(t1v, t0v)
        n = builder.sdiv(builder.add(span, builder.sub(stepv, ir.Constant(_I64, 1))), stepv)
        n = builder.select(builder.icmp_signed(">", span, ir.Constant(_I64, 0)), n, ir.Constant(_I64, 0))
        with builder.if_else(builder.icmp_signed("==", d, ir.Constant(_I64, 64))) as (d64, other):
            with d64:
                _dots_fixed(builder, kind, ptrs, 64, walk, n, args[7])
            with other:
                with builder.if_else(builder.icmp_signed("==", d, ir.Constant(_I64, 128))) as (d128, rest):
                    with d128:
                        _dots_fixed(builder, kind, ptrs, 128, walk, n, args[7])
                    with rest:
                        with builder.if_else(builder.icmp_signed("==", d, ir.Constant(_I64, 256))) as (d256, other2):
                            with d256:
                                _dots_fixed(builder, kind, ptrs, 256, walk, n, args[7])
                            with other2:
                                _dots_generic(builder, kind, ptrs, d, walk, ir.Constant(_I64, 0), n)
        return n

    return sig, codegen


@intrinsic
def widen(typingctx, X2, t0, t1, out):
    """out[:t1 - t0] = rows t0..t1-1 of X2 as float32 (exact for f16 bits and int8 codes).
    out [n, D] must have X2's D and at least t1 - t0 rows (unchecked, like the other kernels)."""
    kind = _kind(X2.dtype)
    if kind is None or X2.ndim != 2 or X2.layout != "C":
        return None
    if not isinstance(out, types.Array) or out.dtype != types.float32 or out.ndim != 2 or out.layout != "C":
        return None
    sig = types.none(X2, types.int64, types.int64, out)

    def codegen(context, builder, signature, args):
        i64 = lambda x: ir.Constant(_I64, x)  # noqa: E731
        xp, xarr = _ptr(context, builder, signature.args[0], args[0], _elem(kind))
        op, _ = _ptr(context, builder, signature.args[3], args[3], _F32)
        d = builder.extract_value(xarr.shape, 1)
        base = builder.mul(args[1], d)
        total = builder.mul(builder.sub(args[2], args[1]), d)  # the rows are contiguous in both
        total = builder.select(builder.icmp_signed(">", total, i64(0)), total, i64(0))
        nch = builder.lshr(total, i64(4))
        with cgutils.for_range(builder, nch) as ch:
            c = builder.shl(ch.index, i64(4))
            ptr = builder.bitcast(builder.gep(op, [c]), _V16F.as_pointer())
            builder.store(_load16(builder, kind, xp, builder.add(base, c)), ptr, align=4)
        with cgutils.for_range_slice(builder, builder.shl(nch, i64(4)), total, i64(1)) as (e, _):
            builder.store(_load1(builder, kind, xp, builder.add(base, e)), builder.gep(op, [e]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch(typingctx, X2, t0, t1):
    """Hint the cache lines of rows t0..t1-1 of X2 into L2 (prefetcht1).

    Sparse attention jumps between blocks, which the hardware prefetcher cannot guess, so
    each block asks for the next selected block's rows while it computes."""
    kind = _kind(X2.dtype)
    if kind is None or X2.ndim != 2 or X2.layout != "C":
        return None
    sig = types.none(X2, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        xp, xarr = _ptr(context, builder, signature.args[0], args[0], _I8)
        i64 = lambda x: ir.Constant(_I64, x)  # noqa: E731
        row_bytes = builder.mul(builder.extract_value(xarr.shape, 1), i64(_ALIGN[kind]))
        b0 = builder.mul(args[1], row_bytes)
        nbytes = builder.sub(builder.mul(args[2], row_bytes), b0)
        nlines = builder.sdiv(builder.add(nbytes, i64(63)), i64(64))
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8"
        )
        with cgutils.for_range(builder, nlines) as ln:
            ptr = builder.gep(xp, [builder.add(b0, builder.shl(ln.index, i64(6)))])
            builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _accum_chunks(builder, kind, ptrs, d, offv, t0v, n, chunks, ahead=None):
    """acc += weighted rows for the 16-lane chunks `chunks` (constants, at most 4, so the
    4 x len(chunks) accumulators stay in registers and each weight is splat once per row).
    ptrs: (wp, vp, ap), the weights', the rows' and the accumulators' pointers.
    ahead (head_dim d a constant, the first pass over the rows): each group of four prefetches
    the four rows _ahead_rows later, while they are below it."""
    wp, vp, ap = ptrs
    i64 = lambda x: ir.Constant(_I64, x)  # noqa: E731
    rot = builder.and_(offv, i64(3))
    # regs[j][c] holds accumulator (off + j) % 4, so row j of every group of four is static
    slots = [builder.mul(builder.and_(builder.add(rot, i64(j)), i64(3)), d) for j in range(4)]
    regs = [[cgutils.alloca_once_value(builder, _ZERO) for _ in chunks] for _ in range(4)]
    for j in range(4):
        for r, c in zip(regs[j], chunks):
            builder.store(_load16(builder, "f32", ap, builder.add(slots[j], c)), r)

    def row(j, r):  # r: row index relative to t0
        wv = _splat(builder, builder.load(builder.gep(wp, [builder.add(offv, r)])))
        base = builder.mul(builder.add(t0v, r), d)
        for reg, c in zip(regs[j], chunks):
            vv = _load16(builder, kind, vp, builder.add(base, c))
            builder.store(_fma(builder, wv, vv, builder.load(reg)), reg)

    ngroups = builder.lshr(n, i64(2))
    if ahead is not None:
        la = _ahead_rows(kind, d.constant)
        limit = builder.sub(builder.sub(ahead, t0v), i64(la + 4))
        rows_at = builder.gep(vp, [builder.mul(t0v, d)])
    with cgutils.for_range(builder, ngroups) as grp:
        r0 = builder.shl(grp.index, i64(2))
        if ahead is not None:
            _prefetch_group(builder, kind, rows_at, d.constant, builder.add(r0, i64(la)), limit)
        for j in range(4):
            row(j, builder.add(r0, i64(j)))
    last = builder.shl(ngroups, i64(2))
    tail = builder.and_(n, i64(3))
    for j in range(3):
        with builder.if_then(builder.icmp_unsigned(">", tail, i64(j))):
            row(j, builder.add(last, i64(j)))
    for j in range(4):
        for r, c in zip(regs[j], chunks):
            ptr = builder.bitcast(builder.gep(ap, [builder.add(slots[j], c)]), _V16F.as_pointer())
            builder.store(builder.load(r), ptr, align=4)


@intrinsic
def accum(typingctx, w, off, V2, t0, t1, acc, ahead):
    """acc [4, D] += the rows t0..t1-1 of V2 weighted by w[off:], row i of w to acc[i % 4].
    Rows of V2 below `ahead` may be prefetched meanwhile."""
    kind = _kind(V2.dtype)
    if kind is None or V2.ndim != 2 or V2.layout != "C":
        return None
    sig = types.none(w, types.int64, V2, types.int64, types.int64, acc, types.int64)

    def codegen(context, builder, signature, args):
        wp, _ = _ptr(context, builder, signature.args[0], args[0], _F32)
        vp, varr = _ptr(context, builder, signature.args[2], args[2], _elem(kind))
        ap, _ = _ptr(context, builder, signature.args[5], args[5], _F32)
        offv, t0v, t1v = args[1], args[3], args[4]
        ptrs = (wp, vp, ap)
        i64 = lambda x: ir.Constant(_I64, x)  # noqa: E731
        d = builder.extract_value(varr.shape, 1)
        nch = builder.lshr(d, i64(4))
        n = builder.sub(t1v, t0v)
        n = builder.select(builder.icmp_signed(">", n, i64(0)), n, i64(0))
        # head_dim 64 / 128 (all real models here): chunks unrolled; others: a chunk loop
        with builder.if_else(builder.icmp_signed("==", d, i64(64))) as (d64, other):
            with d64:
                chunks = [i64(c * 16) for c in range(4)]
                _accum_chunks(builder, kind, ptrs, i64(64), offv, t0v, n, chunks, args[6])
            with other:
                with builder.if_else(builder.icmp_signed("==", d, i64(128))) as (d128, rest):
                    with d128:
                        for half in (0, 4):  # the first pass over the rows prefetches
                            chunks = [i64((half + c) * 16) for c in range(4)]
                            ahead = args[6] if half == 0 else None
                            _accum_chunks(builder, kind, ptrs, i64(128), offv, t0v, n, chunks, ahead)
                    with rest:
                        with cgutils.for_range(builder, nch) as ch:
                            _accum_chunks(builder, kind, ptrs, d, offv, t0v, n, [builder.shl(ch.index, i64(4))])
        with cgutils.for_range(builder, n) as r:  # head_dim tail (not a multiple of 16)
            wr = builder.load(builder.gep(wp, [builder.add(offv, r.index)]))
            slot = builder.mul(builder.and_(builder.add(offv, r.index), i64(3)), d)
            rb = builder.mul(builder.add(t0v, r.index), d)
            with cgutils.for_range_slice(builder, builder.shl(nch, i64(4)), d, i64(1)) as (e, _):
                ae = builder.gep(ap, [builder.add(slot, e)])
                builder.store(_fma(builder, wr, _load1(builder, kind, vp, builder.add(rb, e)), builder.load(ae)), ae)
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------- softmax pieces


@njit(cache=True, nogil=True)
def exp_shifted(s, m, n, ebits):
    """s[:n] = exp(s[:n] - m) (all arguments <= 0), vectorised (libm expf is a scalar call).

    exp(x) = p * 2**k from elementwise.exp_parts; 2**k is built in the exponent bits of ebits.
    Arguments below -70 give 0: such weights (< 4e-31 of the maximum's) cannot change an f32
    sum, and the tiny products they would make with V are subnormal, which x86 handles ~100x
    slower (this made sparse decode on real model queries slower than exact).
    """
    fb = ebits.view(np.float32)
    for i in range(n):
        x = max(s[i] - m, np.float32(-87.0))
        p, k = exp_parts(x)
        s[i] = p
        e = (np.int32(k) + np.int32(127)) << np.int32(23)
        ebits[i] = e if x > np.float32(-70.0) else np.int32(0)  # bits 0 = +0.0
    for i in range(n):
        s[i] = s[i] * fb[i]


@njit(cache=True, nogil=True)
def sum_f32(a, n):
    # sum of a[:n] in ir.lane_fold's order: it depends on n only (the same for exact and
    # all-blocks sparse attention) and is the same on every CPU
    return lane_sum(a, n)


@njit(fastmath=True, cache=True, nogil=True)
def max_at(s, i, n):
    # max is exact in any order, so the vector reduction fastmath allows changes no bits (a
    # max of -0 and +0 may come out either way; exp(s - m) and the comparisons treat them alike)
    m = np.float32(-np.inf)
    for j in range(i, i + n):
        m = max(m, s[j])
    return m


def _exp_ir(builder, s, m):
    """exp(s - m) with exp_shifted's operations (exp_parts' fmas, 2**k in exponent bits, 0 for
    arguments at or below -70), on an f32 or a <16 x float>: the same bits lane by lane."""
    b = builder
    vec = isinstance(s.type, ir.VectorType)
    ity = ir.VectorType(_I32, 16) if vec else _I32

    def f(v):
        return ir.Constant(s.type, [float(v)] * 16 if vec else float(v))

    def i(v):
        return ir.Constant(ity, [v] * 16 if vec else v)

    x = b.fsub(s, _splat(b, m) if vec else m)
    x = b.select(b.fcmp_ordered(">", f(-87.0), x), f(-87.0), x)  # max(x, -87) as numba computes it
    floor = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(s.type, [s.type]), "llvm.floor.v16f32" if vec else "llvm.floor.f32"
    )
    k = b.call(floor, [_fma(b, x, f(_LOG2E), f(0.5))])
    nk = b.fsub(f(-0.0), k)
    r = _fma(b, nk, f(_LN2_LO), _fma(b, nk, f(_LN2_HI), x))
    p = f(np.float32(1.0 / 720))
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = _fma(b, p, r, f(np.float32(c)))
    e = b.shl(b.add(b.fptosi(k, ity), i(127)), i(23))
    e = b.select(b.fcmp_ordered(">", x, f(-70.0)), e, i(0))
    return b.fmul(p, b.bitcast(e, s.type))


def _f32_row(t):
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32 and t.layout == "C"


@intrinsic
def exp_sum(typingctx, s, m, n, out):
    """out[:n] = exp(s[:n] - m) as exp_shifted computes it and out[n:] = 0 (out may be s);
    returns sum_f32(out, n), lane_fold's order. One pass over contiguous rows, in registers:
    attention's softmax step (prefill and decode)."""
    if not (_f32_row(s) and _f32_row(out) and m == types.float32 and isinstance(n, types.Integer)):
        return None
    sig = types.float32(s, m, types.int64, out)

    def codegen(context, builder, signature, args):
        b = builder
        sp, _ = _ptr(context, b, signature.args[0], args[0], _F32)
        op, oarr = _ptr(context, b, signature.args[3], args[3], _F32)
        m, n = args[1], args[2]

        def vptr(p, i):
            return b.bitcast(b.gep(p, [i]), _V16F.as_pointer())

        def chunk(acc, i):
            e = _exp_ir(b, b.load(vptr(sp, i), align=4), m)
            b.store(e, vptr(op, i), align=4)
            return b.fadd(acc, e)

        def tail(t, i):
            e = _exp_ir(b, b.load(b.gep(sp, [i])), m)
            b.store(e, b.gep(op, [i]))
            return b.fadd(t, e)

        total = lane_fold(b, n, chunk, tail)
        with cgutils.for_range_slice(b, n, b.extract_value(oarr.shape, 0), ir.Constant(_I64, 1)) as (j, _):
            b.store(ir.Constant(_F32, 0.0), b.gep(op, [j]))
        return total

    return sig, codegen


@intrinsic
def row_max(typingctx, s, i, n):
    """max of s[i:i+n] (-inf for n = 0), 16 lanes at a time: max_at's value (exact in any
    order; the same caveat for -0 and +0)."""
    if not (_f32_row(s) and isinstance(i, types.Integer) and isinstance(n, types.Integer)):
        return None
    sig = types.float32(s, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        b = builder
        base, _ = _ptr(context, b, signature.args[0], args[0], _F32)
        sp, n = b.gep(base, [args[1]]), args[2]
        acc = cgutils.alloca_once_value(b, ir.Constant(_V16F, [float("-inf")] * 16))
        nch = b.lshr(n, ir.Constant(_I64, 4))
        with cgutils.for_range(b, nch) as loop:
            v = b.load(b.bitcast(b.gep(sp, [b.shl(loop.index, ir.Constant(_I64, 4))]), _V16F.as_pointer()), align=4)
            a = b.load(acc)
            b.store(b.select(b.fcmp_ordered(">", v, a), v, a), acc)
        v = b.load(acc)
        w = 16
        while w > 1:
            w //= 2
            hi = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), list(range(w, 2 * w)) + [0] * (16 - w)))
            v = b.select(b.fcmp_ordered(">", hi, v), hi, v)
        out = cgutils.alloca_once_value(b, b.extract_element(v, ir.Constant(_I32, 0)))
        with cgutils.for_range_slice(b, b.shl(nch, ir.Constant(_I64, 4)), n, ir.Constant(_I64, 1)) as (j, _):
            x, t = b.load(b.gep(sp, [j])), b.load(out)
            b.store(b.select(b.fcmp_ordered(">", x, t), x, t), out)
        return b.load(out)

    return sig, codegen


@njit(cache=True, nogil=True)
def softmax_step(row, n, w, r, m, den, O):
    """Query row r's step of the online softmax over a block of keys (the text prefill's
    attention and the vision tower's): where the max of the scores row[:n] passes m[r], O[r]
    and den[r] are scaled by exp(m[r] - max) and m[r] becomes it; then w[:n] = exp(row - m[r]),
    w[n:] = 0 (w may be row) and den[r] += their sum in exp_sum's order."""
    mx = row_max(row, 0, n)
    if mx > m[r]:
        if m[r] > -np.inf:
            c = np.float32(np.exp(m[r] - mx))
            for d in range(O.shape[1]):
                O[r, d] *= c
            den[r] *= c
        m[r] = mx
    den[r] += exp_sum(row, m[r], n, w)
