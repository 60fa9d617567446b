"""Kernels for ggml's 5-bit and K-quant blocks: q5_0, q5_1 (blocks of 32) and q4_k, q5_k,
q6_k (super-blocks of 256); layouts in sparrow.quant's docstring.

- widen_kq: one stored row -> f32 in vector IR, bit-identical to Weight.dequantize() (the
  same f32 operations in the same order: (d * sc) * q - dmin * m, no fma). widen.widen_row
  hands these kinds here, so the prefill GEMM (gemm.py packs panels with widen_row) and the
  MoE expert kernels run them unchanged.
- rows_kq / rows_chunked: small T (decode; widen.py's matvec and the fused step run them).
  Each row is dotted with f32 x straight from its blocks by a
  rowdot written as LLVM vector IR (numba promotes small integers to int64, halving the SIMD
  width of the unpacking; see widen's block row dots). Per sub-block of 32 values
  (q6_k: per 16), t = q . x in 16 lanes, then acc = fma(t, d * sc, acc), two vector
  accumulators (even / odd sub-blocks); the offset part (q4_k / q5_k: -dmin * m * sum(x),
  q5_1: m * sum(x), q5_0: -16 d * sum(x)) goes to a scalar accumulator in sub-block order,
  with sum(x) over each 32 values taken sequentially. At the end the two accumulators are
  added and summed by a fixed pairwise tree, then the scalar one is added. Every row's order
  depends only on its length: bit-identical whatever T, the row's batch or the thread count.
Both are generated from one description of each layout (_emit_block), so the row dots and
the widening decode the same codes and scales. q4_k / q5_k's 6-bit scales and mins are
unpacked 8 lanes at a time (scales_mins8; the scalar unpack was ~40% of the row dot's
instructions), then d * sc and -(dmin * m) are the same f32 products per lane, kept on the
stack (_spilled) so each sub-block's scale is a broadcast load, not a lane shuffled out; 4-bit
codes become floats in one vpermps (ir.nibbles_f32, with AVX-512). The row loop prefetches
the next row (ir.make_rows).
This module imports only ir and formats of the other kernel modules (widen imports it); the numba
cache directory is keyed on every kernel source, so an edit here recompiles their kernels.
"""

from itertools import zip_longest

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.dispatch import by_kind
from sparrow.kernels.formats import BY_NAME, KQ_KIND
from sparrow.kernels.ir import (
    F32,
    I8,
    I32,
    MULTI_T,
    V16F,
    V16I32,
    barrier,
    c64,
    hsum16,
    make_rows,
    make_rows_x,
    nibbles_f32,
    row_step,
    splat16,
    zeroed,
)
from sparrow.kernels.ir import fma as _fma
from sparrow.kernels.options import KW

# ---------------------------------------------------------------- vector IR: block decoding, row dots, widening

_BB = {q: BY_NAME[q].block_bytes for q in KQ_KIND}  # bytes a (super-)block
_V16I8 = ir.VectorType(I8, 16)
_V8I32 = ir.VectorType(I32, 8)
_V8F = ir.VectorType(F32, 8)


def _vi32(vals):
    return ir.Constant(V16I32, list(vals))


class _Row:
    """IR helpers over one stored row (rp: i8*), x (xp: f32*) and the block sums (sp: f32*)."""

    def __init__(self, builder, rp, xp, sp):
        self.b, self.rp, self.xp, self.sp = builder, rp, xp, sp

    def byte(self, at):  # zero-extended to i32
        return self.b.zext(self.b.load(self.b.gep(self.rp, [at])), I32)

    def half(self, at):
        ptr = self.b.bitcast(self.b.gep(self.rp, [at]), ir.HalfType().as_pointer())
        return self.b.fpext(self.b.load(ptr, align=1), F32)

    def bytes16(self, at):  # 16 bytes zero-extended to <16 x i32>
        ptr = self.b.bitcast(self.b.gep(self.rp, [at]), _V16I8.as_pointer())
        return self.b.zext(self.b.load(ptr, align=1), V16I32)

    def x16(self, at):
        return self.b.load(self.b.bitcast(self.b.gep(self.xp, [at]), V16F.as_pointer()), align=4)

    def sx(self, at):
        return self.b.load(self.b.gep(self.sp, [at]))

    def dot32(self, lo, hi, xo):
        """q . x over 32 values in 16 lanes: fma(hi, x[xo + 16:], lo * x[xo:])."""
        b = self.b
        return _fma(b, hi, self.x16(b.add(xo, c64(16))), b.fmul(lo, self.x16(xo)))


def scales_mins8(b, sb):
    """The 12 scale bytes of a q4_k / q5_k super-block (sb: <16 x i8>, bytes 12..15 unused) ->
    (sc, m) <8 x i32>, ggml's get_scale_min_k4 8 lanes at a time: j < 4: q[j] & 63,
    q[j + 4] & 63; j >= 4: (q[j + 4] & 15) | (q[j - 4] >> 6) << 4, (q[j + 4] >> 4) | (q[j] >> 6) << 4."""
    z = lambda idx: b.zext(b.shuffle_vector(sb, sb, ir.Constant(_V8I32, idx)), _V8I32)  # noqa: E731
    v = lambda vals: ir.Constant(_V8I32, vals)  # noqa: E731
    top = v([0] * 4 + [48] * 4)  # (q >> 6) << 4 == (q >> 2) & 48 for a byte q
    two = v([2] * 8)
    sc = b.or_(b.and_(z([0, 1, 2, 3, 8, 9, 10, 11]), v([63] * 4 + [15] * 4)),
               b.and_(b.lshr(z([0, 1, 2, 3, 0, 1, 2, 3]), two), top))  # fmt: skip
    lo = b.lshr(z([4, 5, 6, 7, 8, 9, 10, 11]), v([0] * 4 + [4] * 4))
    m = b.or_(b.and_(lo, v([63] * 8)), b.and_(b.lshr(z([4, 5, 6, 7, 4, 5, 6, 7]), two), top))
    return sc, m


class _Nibbles:
    """Codes in the low 4 bits of each lane of v (<16 x i32>; the bits above are not codes):
    to_f32 converts them (ir.nibbles_f32: one vpermps with AVX-512)."""

    def __init__(self, v):
        self.v = v


def to_f32(b, c):
    """Codes -> <16 x float>: a <16 x i32> of signed codes, or _Nibbles."""
    return nibbles_f32(b, c.v) if isinstance(c, _Nibbles) else b.sitofp(c, V16F)


def _spilled(b, v):
    """v's lanes in a stack slot (f32*), behind a compiler barrier: loads of them stay loads."""
    slot = cgutils.alloca_once(b, v.type)
    b.store(v, slot, align=4)
    p = b.bitcast(slot, F32.as_pointer())
    barrier(b, p)
    return p


def _emit_block(qtype, r, blk, step):
    """Emit the decoding of one block (q5_*: 32 values) or super-block (K types: 256) at index
    blk, yielding after each unit (so that two rows can take turns, _emit_rowdot). For each
    unit of values with one scale, in order, step(codes, at, scale, offset) gets the integer
    codes as one or two <16 x i32> (values at .. at + 15, at + 16 .. at + 31),
    at (i64, the first value's index in the row), the f32 scale and the offset term (f32
    coefficient, i64 index of its 32-value block) or None. value = scale * code + coefficient
    for q5_1 and the K types (coefficient m, or -dmin m), scale * (code - 16) for q5_0 (its
    coefficient: -16 d), scale * code for q6_k (codes already signed)."""
    b = r.b
    p = b.mul(blk, c64(_BB[qtype]))
    if qtype in ("q5_0", "q5_1"):
        d = r.half(p)
        o = 2 if qtype == "q5_0" else 4
        qhp = b.bitcast(b.gep(r.rp, [b.add(p, c64(o))]), I32.as_pointer())
        qh = b.load(qhp, align=1)
        undef = ir.Constant(V16I32, ir.Undefined)
        qhv = b.shuffle_vector(b.insert_element(undef, qh, ir.Constant(I32, 0)), undef, _vi32([0] * 16))
        q = r.bytes16(b.add(p, c64(o + 4)))
        # bit i of qh -> 16 in lane i: a mask test and a select (per-lane variable shifts are
        # slower on AVX2)
        zero, sixteen = _vi32([0] * 16), _vi32([16] * 16)

        def fifth(bits):
            return b.select(b.icmp_unsigned("!=", b.and_(qhv, _vi32([1 << i for i in bits])), zero), sixteen, zero)

        lo = b.or_(b.and_(q, _vi32([15] * 16)), fifth(range(16)))
        hi = b.or_(b.lshr(q, _vi32([4] * 16)), fifth(range(16, 32)))
        coef = b.fmul(d, ir.Constant(F32, -16.0)) if qtype == "q5_0" else r.half(b.add(p, c64(2)))
        step((lo, hi), b.mul(blk, c64(32)), d, (coef, blk))
        yield
        return
    x0 = b.mul(blk, c64(256))
    s0 = b.mul(blk, c64(8))  # first 32-value block of this super-block
    if qtype in ("q4_k", "q5_k"):
        d, dmin = r.half(p), r.half(b.add(p, c64(2)))
        qo = 16 if qtype == "q4_k" else 48
        if qtype == "q5_k":
            qh = (r.bytes16(b.add(p, c64(16))), r.bytes16(b.add(p, c64(32))))
        # d * sc and -(dmin * m) of the 8 sub-blocks in vector lanes: the same f32 products
        # a scalar unpack gives, in a fifth of its instructions
        sbp = b.bitcast(b.gep(r.rp, [b.add(p, c64(4))]), _V16I8.as_pointer())
        scv, mv = scales_mins8(b, b.load(sbp, align=1))
        dsc = b.fmul(splat16(b, d, 8), b.uitofp(scv, _V8F))
        nml = b.fsub(ir.Constant(_V8F, [-0.0] * 8), b.fmul(splat16(b, dmin, 8), b.uitofp(mv, _V8F)))
        # each sub-block's scale and offset are then loads a broadcast or an fma takes as its
        # operand, not a lane extracted and broadcast by shuffles
        dsc, nml = _spilled(b, dsc), _spilled(b, nml)
        for s in range(8):
            q0 = b.add(p, c64(qo + 32 * (s // 2)))
            codes = []
            for i, q in enumerate((r.bytes16(q0), r.bytes16(b.add(q0, c64(16))))):
                v = b.lshr(q, _vi32([4 * (s % 2)] * 16))
                if qtype == "q5_k":
                    v = b.and_(v, _vi32([15] * 16))
                    hb = b.and_(b.lshr(qh[i], _vi32([s] * 16)), _vi32([1] * 16))
                    v = b.or_(v, b.shl(hb, _vi32([4] * 16)))
                else:
                    v = _Nibbles(v)  # the low 4 bits of each lane: step converts them
                codes.append(v)
            offset = (b.load(b.gep(nml, [c64(s)])), b.add(s0, c64(s)))
            step(codes, b.add(x0, c64(32 * s)), b.load(b.gep(dsc, [c64(s)])), offset)
            yield
        return
    # q6_k: units of 16 values, each its own int8 scale; no offset term
    d = r.half(b.add(p, c64(208)))
    scp = b.bitcast(b.gep(r.rp, [b.add(p, c64(192))]), _V16I8.as_pointer())
    dsc = b.fmul(splat16(b, d), b.sitofp(b.load(scp, align=1), V16F))  # d * sc of the 16 units, one lane each
    dsc = _spilled(b, dsc)  # as for q4_k: each unit's scale a load
    for h in range(2):
        for s in range(4):
            for g in range(2):
                j = 16 * g
                ql = r.bytes16(b.add(p, c64(64 * h + 32 * (s & 1) + j)))
                qh = r.bytes16(b.add(p, c64(128 + 32 * h + j)))
                lo = b.and_(b.lshr(ql, _vi32([4 * (s >> 1)] * 16)), _vi32([15] * 16))
                hi = b.shl(b.and_(b.lshr(qh, _vi32([2 * s] * 16)), _vi32([3] * 16)), _vi32([4] * 16))
                q = b.sub(b.or_(lo, hi), _vi32([32] * 16))
                sc = b.load(b.gep(dsc, [c64(8 * h + 2 * s + g)]))
                step((q,), b.add(x0, c64(128 * h + 32 * s + j)), sc, None)
                yield


def _units(qtype, r, blk, step):
    """_emit_block's units, all of them (it yields after each, so rows can take turns)."""
    for _ in _emit_block(qtype, r, blk, step):
        pass


def _blocks_loop(builder, qtype, nb, emit):
    """emit(block index) for every (super-)block; q5_* two a time, then an odd last one.
    emit is called at the start of each group, so a caller can reset per-group state."""
    if qtype in ("q5_0", "q5_1"):
        one = c64(1)
        with cgutils.for_range(builder, builder.lshr(nb, one)) as loop:
            b0 = builder.shl(loop.index, one)
            emit(b0, True)
            emit(builder.add(b0, one), False)
        with builder.if_then(builder.trunc(nb, ir.IntType(1))):
            emit(builder.sub(nb, one), True)
    else:
        with cgutils.for_range(builder, nb) as loop:
            emit(loop.index, True)


def _emit_rowdot(qtype):
    """Rows dotted with f32 x, as ir.make_rows calls it (inputs: x [nb * size], sx
    [nb * size / 32], the sums of x over each 32 values), each row alone in its order;
    several rows' units (one scale's values: 32, q6_k 16) are interleaved, one of each in turn,
    so their accm chains overlap."""
    per = 1 if qtype in ("q5_0", "q5_1") else 8  # 32-value block sums per (super-)block

    def emit(builder, rps, ptrs, lens):
        xp, sp = builder.bitcast(ptrs[0], F32.as_pointer()), builder.bitcast(ptrs[1], F32.as_pointer())
        rows = [_Row(builder, rp, xp, sp) for rp in rps]
        nb = builder.udiv(lens[1], c64(per))
        accs = [[zeroed(builder, V16F) for _ in range(2)] for _ in rps]
        accm = [zeroed(builder, F32) for _ in rps]
        turn = [0] * len(rps)  # a row's units alternate between its two vector accumulators

        def step_of(i):
            r = rows[i]

            def step(codes, at, scale, offset):
                q = [to_f32(builder, c) for c in codes]
                t = builder.fmul(q[0], r.x16(at))
                if len(q) == 2:
                    t = _fma(builder, q[1], r.x16(builder.add(at, c64(16))), t)
                acc = accs[i][turn[i] % 2]
                turn[i] += 1
                builder.store(_fma(builder, t, splat16(builder, scale), builder.load(acc)), acc)
                if offset is not None:
                    builder.store(_fma(builder, offset[0], r.sx(offset[1]), builder.load(accm[i])), accm[i])

            return step

        steps = [step_of(i) for i in range(len(rps))]

        def emit_block(blk, first):
            if first:
                turn[:] = [0] * len(rps)
            # the rows' units in turn: one unit of each, so their chains overlap
            for _ in zip_longest(*(_emit_block(qtype, rows[i], blk, steps[i]) for i in range(len(rps)))):
                pass

        _blocks_loop(builder, qtype, nb, emit_block)
        out = []
        for i in range(len(rps)):
            v = builder.fadd(builder.load(accs[i][0]), builder.load(accs[i][1]))
            out.append(builder.fadd(hsum16(builder, v), builder.load(accm[i])))
        return out

    return emit


def _emit_rowdot_x(qtype):
    """One row dotted with several x rows, as ir.make_rows_x calls it: each unit's codes and
    scale decoded once, then for every x row _emit_rowdot's operations in its order (the same
    units, accumulators and offset terms): each x row gets the bits it gets alone."""
    per = 1 if qtype in ("q5_0", "q5_1") else 8

    def emit(builder, rp, xr, nsums):
        b = builder
        r = _Row(b, rp, None, None)
        turn = [0]

        def step(codes, at, scale, offset):
            q = [to_f32(b, c) for c in codes]
            sv = splat16(b, scale)
            j = turn[0] % 2
            turn[0] += 1
            for t in xr.each():
                tt = b.fmul(q[0], xr.x16(t, at))
                if len(q) == 2:
                    tt = _fma(b, q[1], xr.x16(t, b.add(at, c64(16))), tt)
                b.store(_fma(b, tt, sv, b.load(xr.acc(t, j))), xr.acc(t, j))
                if offset is not None:
                    b.store(_fma(b, offset[0], xr.sx(t, offset[1]), b.load(xr.accm(t))), xr.accm(t))

        def emit_block(blk, first):
            if first:
                turn[0] = 0
            _units(qtype, r, blk, step)

        _blocks_loop(b, qtype, b.udiv(nsums, c64(per)), emit_block)

    return emit


def _make_widen(qtype):
    size = 32 if qtype in ("q5_0", "q5_1") else 256

    @intrinsic
    def widen(typingctx, row, out):
        """row: stored bytes uint8 [nb * bb] -> out f32 [nb * size]: value = scale * code, then
        + coefficient (q5_0: scale * (code - 16)), separate roundings as the reference's."""
        sig = types.void(row, out)

        def codegen(context, builder, signature, args):
            ra = context.make_array(signature.args[0])(context, builder, args[0])
            oa = context.make_array(signature.args[1])(context, builder, args[1])
            r = _Row(builder, builder.bitcast(ra.data, I8.as_pointer()), None, None)
            op = builder.bitcast(oa.data, F32.as_pointer())
            nb = builder.udiv(builder.extract_value(oa.shape, 0), c64(size))

            def step(codes, at, scale, offset):
                sv = splat16(builder, scale)
                for i, c in enumerate(codes):
                    if qtype == "q5_0":
                        c = builder.sub(c, _vi32([16] * 16))
                    v = builder.fmul(sv, to_f32(builder, c))
                    if offset is not None and qtype != "q5_0":
                        v = builder.fadd(v, splat16(builder, offset[0]))
                    dst = builder.gep(op, [builder.add(at, c64(16 * i))])
                    builder.store(v, builder.bitcast(dst, V16F.as_pointer()), align=4)

            _blocks_loop(builder, qtype, nb, lambda blk, first: _units(qtype, r, blk, step))
            return context.get_dummy_value()

        return sig, codegen

    return widen


# Each KQ_KIND format's kernels, dispatched on its kind (kernels/dispatch.py):
# widen_kq(kind, row, out): one stored row -> f32 out [K];
# rows_kq(kind, data, o0, o1, x, sx, y): y[o] = row o . x for o0 <= o < o1, one f32 x row; sx:
#   x's 32-value sums (sums()). The row loop is compiled (ir.make_rows): q4_k / q5_k two rows
#   together, q6_k one at a time (two were 14% slower from memory on Zen 4);
# _rows_x(kind, data, o0, o1, x, sx, y): y[t, o] for every x row, each block decoded once (ir.make_rows_x).
_KQ, _TOGETHER = KQ_KIND.items(), {"q4_k": 2, "q5_k": 2}
widen_kq = by_kind("widen_kq", {k: _make_widen(q) for q, k in _KQ})
rows_kq = by_kind("rows_kq", {k: make_rows(_emit_rowdot(q), 2, together=_TOGETHER.get(q, 1)) for q, k in _KQ})
_rows_x = by_kind("rows_x_kq", {k: make_rows_x(_emit_rowdot_x(q)) for q, k in _KQ})


@njit(**KW)
def sums(x):
    """x's sums over each 32 values [T, K / 32], one sequential loop (no fastmath: a fixed order)."""
    sx = np.empty((x.shape[0], x.shape[1] // 32), np.float32)  # [T, K / 32]
    for t in range(x.shape[0]):
        for b in range(sx.shape[1]):
            a = np.float32(0)
            for j in range(32):
                a += x[t, b * 32 + j]
            sx[t, b] = a
    return sx


@njit(**KW)
def rows_chunked(data, kind, x, sx, y, o0, o1):
    """rows_kq for every x row (sx: sums(x)): 2..MULTI_T x rows share each decoded block
    (rows_x_*, the same bits), more go in chunks of rows so a batch reads each from cache."""
    if 1 < x.shape[0] <= MULTI_T:
        _rows_x(kind, data, o0, o1, x, sx, y)
        return
    step = row_step(o0, o1, x.shape[0])
    for c in range(o0, o1, step):
        for t in range(x.shape[0]):
            rows_kq(kind, data, c, min(o1, c + step), x[t], sx[t], y[t])
