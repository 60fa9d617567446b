"""Kernels that widen stored weight rows to f32 and work in f32 (used by kernels.linear,
kernels.matmul.gemm and kernels.moe; this module imports none of them).

- widen_row: one stored row -> f32, bit-identical to Weight.dequantize() (same f32
  operations: d * q, then + m).
- matvec_widened: small T. q8_0 / q4_0 / q4_1 rows are dotted with f32 x straight from
  their blocks (rowdot_*: LLVM vector IR, see below); f32 / f16 / bf16 rows (f16 / bf16
  widened once) are dotted by ir.lane_dot. Either way each row's summation order depends only
  on its length (batch, thread and CPU invariant). Small matvecs skip the thread pool.
Large T (prefill) is sparrow.kernels.matmul.gemm.matmul_widened, which packs rows with widen_row.
Edits here reach every cached kernel that inlines these helpers: the numba cache directory
is keyed on a hash of all kernel sources (kernels/runtime.py, _cache_dir).
"""

import numba.core.config as _nbconfig
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.cpu import ROW_DOT_GROUPS, ROW_DOTS
from sparrow.kernels.dispatch import by_kind
from sparrow.kernels.formats import BF16, BY_NAME, FORMATS, FP16, FP32, KQ_FIRST
from sparrow.kernels.ir import (
    F32,
    I8,
    I32,
    I64,
    MULTI_T,
    V16F,
    V16I32,
    barrier,
    c64,
    hsum16,
    lane_dot,
    make_rows,
    make_rows_x,
    nibbles_f32,
    row_step,
    shuffle,
    splat16,
    zeroed,
)
from sparrow.kernels.ir import fma as _fma
from sparrow.kernels.matmul.kquants import rows_chunked as kq_rows
from sparrow.kernels.matmul.kquants import sums as kq_sums
from sparrow.kernels.matmul.kquants import widen_kq
from sparrow.kernels.native_call import address_for, call_native
from sparrow.kernels.options import KW, PARALLEL_MIN_MACS
from sparrow.kernels.options import ROWS as _ROWS
from sparrow.kernels.parallel import run_parallel


def f16_table() -> np.ndarray:
    """f16 bit pattern -> f32 value (numba has no float16 on CPU), built from the bits: sign,
    exponent rebased from 15 to 127, mantissa shifted up 13; subnormals as mantissa * 2^-24
    (exact in f32). A NaN keeps its payload and its quiet bit: numpy's cast gives these bits on
    x86, while aarch64's fcvt quiets signalling NaNs and raises the invalid flag (a
    RuntimeWarning at every import), so the table is the same on every architecture."""
    h = np.arange(65536, dtype=np.uint32)
    sign, exp, man = (h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF
    bits = sign | ((exp + (127 - 15)) << 23) | (man << 13)  # normal numbers
    bits = np.where(exp == 0x1F, sign | 0x7F800000 | (man << 13), bits)  # inf, NaN
    sub = (man.astype(np.float32) * np.float32(2.0**-24)).view(np.uint32)  # zero, subnormals
    bits = np.where(exp == 0, sign | sub, bits)
    return bits.astype(np.uint32).view(np.float32)


F16_LUT = f16_table()
F16_LUT.flags.writeable = False


def call_slp(kernel, *args):
    """Call a numba kernel, compiling it (first call only) with LLVM's SLP vectoriser on.

    Numba leaves SLP off by default (miscompilations in old LLVMs); the block kernels need
    it to turn each 32-element block into vector code, and tests check them bit-exactly.
    """
    if kernel.overloads:
        return kernel(*args)
    old = _nbconfig.SLP_VECTORIZE
    _nbconfig.SLP_VECTORIZE = 1
    try:
        return kernel(*args)
    finally:
        _nbconfig.SLP_VECTORIZE = old


@njit(**KW)
def dot(w, x):
    # f32 row . x in ir.lane_fold's order (16 lanes, fma, fixed tree): it depends only on the
    # length, so every (t, o) is summed in the same order whatever T, the thread count or the CPU
    return lane_dot(w, x)


@njit(**KW)
def widen_row(row, kind, lut, out, out_bits, kq):
    """One stored row -> f32 out [K] (out_bits: out viewed as uint32, for bf16 and f32 bits).
    kq: True where kind may be one of kquants' (KQ_FIRST and up), None where it never is: a type,
    so numba prunes the K-quant widening (5 vector-IR kernels) before typing it."""
    k = out.shape[0]
    if kq is not None and kind >= KQ_FIRST:
        widen_kq(kind, row, out)
        return
    if kind == FP32:
        for i in range(k):
            out_bits[i] = np.uint32(row[i])
        return
    if kind == FP16:
        for i in range(k):
            out[i] = lut[row[i]]
        return
    if kind == BF16:
        for i in range(k):
            out_bits[i] = np.uint32(row[i]) << np.uint32(16)
        return
    widen_blocks(kind, row, out)


@njit(parallel=True, **KW)
def _mv_f32(w, x, y):
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, o] = dot(w[o], x[t])


# ---------------------------------------------------------------- block row dots (decode)
# Written as LLVM vector IR: numba promotes small integers to int64, which halves the SIMD
# width of nibble unpacking, and LLVM will not keep a vector accumulator across blocks
# when each block has its own scale. Per block: codes -> f32 lanes, t = q . x in 16 lanes,
# acc += d * t (two accumulators, even / odd blocks, to hide FMA latency); the constant part
# (q4_1: m * sum(x), q4_0: -8 d * sum(x)) goes to a scalar accumulator in block order. At
# the end acc_even + acc_odd is summed by a fixed pairwise tree. Each row's order depends
# only on its length: bit-identical whatever T, the row's batch or the thread count.
# What makes them fast without touching that order (sparrow bench rows measures them; the
# figures are in docs/kernels.md and docs/benchmarks/zen4-epyc.md):
# - make_rows prefetches the next row: a loop this slow a byte leaves the hardware prefetcher
#   too little ahead, and rows from memory ran at half their in-cache speed without it.
# - q4_0 / q4_1 widen the f16 scales of 16 blocks at once (_group_scales) and keep them on
#   the stack, so each block's d is a broadcast load folded into its fma, and a nibble
#   becomes a float in one vpermps (ir.nibbles_f32). The scalar constant-term fma (4 cycles
#   of latency a block) is then the critical path,
# - so make_rows takes q4_0 / q4_1 rows two at a time, a block of each in turn: the two rows'
#   chains overlap, each row's operations unchanged. q8_0 (no constant term) ran no faster.
#   kquants.py takes q4_k / q5_k rows two at a time likewise, one 32-value unit of each in turn.
# - on aarch64 neither (kernels.cpu.row_dot_shape): a 16-lane value takes four of NEON's
#   registers, and the groups and row pairs spilled there.

_BB = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
_GROUP = 16  # blocks whose scales are widened together


def _half_at(builder, rp, off):
    ptr = builder.bitcast(builder.gep(rp, [off]), ir.HalfType().as_pointer())
    return builder.fpext(builder.load(ptr, align=1), F32)


def _group_scales(builder, qtype, rp, b0, dbuf, cbuf):
    """The f16 scales of blocks b0 .. b0 + 15 as f32 into dbuf [16], and their constant
    term's coefficient into cbuf [16] (q4_0: -8 d, q4_1: m): one load of the 16 blocks, a
    shuffle that picks the f16 bytes, one conversion, in place of a scalar conversion and a
    broadcast a block. The same f32 values as _half_at's."""
    bb = _BB[qtype]
    raw = builder.load(builder.bitcast(builder.gep(rp, [builder.mul(b0, c64(bb))]),
                                       ir.VectorType(I8, 16 * bb).as_pointer()), align=1)  # fmt: skip

    def halves(off):
        pick = shuffle(builder, raw, raw, [bb * i + off + j for i in range(_GROUP) for j in (0, 1)])
        return builder.fpext(builder.bitcast(pick, ir.VectorType(ir.HalfType(), _GROUP)), V16F)

    d = halves(0)
    builder.store(d, builder.bitcast(dbuf, V16F.as_pointer()), align=4)
    if qtype == "q4_0":
        c = builder.fmul(d, ir.Constant(V16F, [-8.0] * 16))
        builder.store(c, builder.bitcast(cbuf, V16F.as_pointer()), align=4)
    elif qtype == "q4_1":
        builder.store(halves(2), builder.bitcast(cbuf, V16F.as_pointer()), align=4)


def _block_codes(builder, qtype, rp, b):
    """(low half's codes, high half's codes) of block b as <16 x float> (q4_0 / q4_1: 0..15,
    their offset left to the constant term)."""
    p = builder.mul(b, c64(_BB[qtype]))
    if qtype == "q8_0":
        v16i8 = ir.VectorType(I8, 16)
        lo = builder.load(builder.bitcast(builder.gep(rp, [builder.add(p, c64(2))]), v16i8.as_pointer()), align=1)
        hi = builder.load(builder.bitcast(builder.gep(rp, [builder.add(p, c64(18))]), v16i8.as_pointer()), align=1)
        return builder.sitofp(lo, V16F), builder.sitofp(hi, V16F)
    off = 4 if qtype == "q4_1" else 2
    qp = builder.bitcast(builder.gep(rp, [builder.add(p, c64(off))]), ir.VectorType(I8, 16).as_pointer())
    q = builder.zext(builder.load(qp, align=1), V16I32)
    return nibbles_f32(builder, q), nibbles_f32(builder, builder.lshr(q, ir.Constant(V16I32, [4] * 16)))


def _block_scales(builder, qtype, rp, b):
    """(d, the constant term's coefficient) of block b read from the block: q4_0 -8 d, q4_1 m,
    q8_0 None (no constant term)."""
    p = builder.mul(b, c64(_BB[qtype]))
    d = _half_at(builder, rp, p)
    if qtype == "q4_1":
        return d, _half_at(builder, rp, builder.add(p, c64(2)))
    if qtype == "q4_0":
        return d, builder.fmul(d, ir.Constant(F32, -8.0))
    return d, None


def _block_terms(builder, qtype, rp, xp, sp, b, scales=None):
    """(vector q . x for block b, d, (coefficient, sum of x over the block) or None) as LLVM
    values; scales: (d, its constant coefficient) already widened (_group_scales), else read
    from the block."""
    lo, hi = _block_codes(builder, qtype, rp, b)
    d, coef = _block_scales(builder, qtype, rp, b) if scales is None else scales
    xo = builder.mul(b, c64(32))
    xl = builder.load(builder.bitcast(builder.gep(xp, [xo]), V16F.as_pointer()), align=4)
    xh = builder.load(builder.bitcast(builder.gep(xp, [builder.add(xo, c64(16))]), V16F.as_pointer()), align=4)
    t = _fma(builder, hi, xh, builder.fmul(lo, xl))
    return t, d, None if coef is None else (coef, builder.load(builder.gep(sp, [b])))


def _emit_rowdot(qtype):
    """Rows dotted with f32 x, as ir.make_rows calls it (inputs: x [nb * 32], sx [nb]), each
    row alone in its order: q4_0 / q4_1 blocks go in groups of 16 whose scales are widened
    together (_group_scales; x86, kernels.cpu.row_dot_shape), then the rest (q8_0, and every
    block on aarch64) one by one; either way block b adds to
    accumulator b % 2 and to accm in block order. Several rows' blocks are interleaved, one
    block of each in turn, so their accm chains overlap."""

    def emit(builder, rps, ptrs, lens):
        xp, sp = builder.bitcast(ptrs[0], F32.as_pointer()), builder.bitcast(ptrs[1], F32.as_pointer())
        nb = lens[1]
        n = len(rps)
        accs = [[zeroed(builder, V16F) for _ in range(2)] for _ in range(n)]
        accm = [zeroed(builder, F32) for _ in range(n)]
        bufs = [[cgutils.alloca_once(builder, ir.ArrayType(F32, _GROUP)) for _ in range(2)] for _ in range(n)]
        dbuf = [builder.bitcast(bb[0], F32.as_pointer()) for bb in bufs]
        cbuf = [builder.bitcast(bb[1], F32.as_pointer()) for bb in bufs]

        def block(r, b, j, scales=None):
            t, d, const = _block_terms(builder, qtype, rps[r], xp, sp, b, scales)
            dv = splat16(builder, d)
            builder.store(_fma(builder, t, dv, builder.load(accs[r][j])), accs[r][j])
            if const is not None:
                builder.store(_fma(builder, const[0], const[1], builder.load(accm[r])), accm[r])

        # q8_0 keeps a scale per block: its 34-byte blocks' shuffle cost more than it saved
        grouped = qtype != "q8_0" and ROW_DOT_GROUPS
        groups = builder.udiv(nb, c64(_GROUP)) if grouped else c64(0)
        with cgutils.for_range(builder, groups) as loop:
            b0 = builder.mul(loop.index, c64(_GROUP))
            for r in range(n):
                _group_scales(builder, qtype, rps[r], b0, dbuf[r], cbuf[r])
            barrier(builder, *dbuf, *cbuf)  # each block's d is then a broadcast load, not a shuffle
            for i in range(_GROUP):
                at = ir.Constant(I64, i)
                for r in range(n):
                    scales = builder.load(builder.gep(dbuf[r], [at])), builder.load(builder.gep(cbuf[r], [at]))
                    block(r, builder.add(b0, at), i % 2, scales)
        one = ir.Constant(I64, 1)
        done = builder.mul(groups, c64(_GROUP))  # even: the rest keep block b's accumulator b % 2
        with cgutils.for_range(builder, builder.lshr(builder.sub(nb, done), one)) as loop:
            b1 = builder.add(done, builder.shl(loop.index, one))
            for r in range(n):
                block(r, b1, 0)
            for r in range(n):
                block(r, builder.add(b1, one), 1)
        with builder.if_then(builder.trunc(builder.sub(nb, done), ir.IntType(1))):
            for r in range(n):
                block(r, builder.sub(nb, one), 0)
        out = []
        for r in range(n):
            v = builder.fadd(builder.load(accs[r][0]), builder.load(accs[r][1]))
            out.append(builder.fadd(hsum16(builder, v), builder.load(accm[r])))
        return out

    return emit


def _emit_rowdot_x(qtype):
    """One row dotted with several x rows, as ir.make_rows_x calls it: each block's codes and
    scales decoded once, then for every x row _emit_rowdot's operations in its order (q . x as
    fmul then fma, acc[b % 2] += d * (q . x), the constant term into the scalar in block order,
    the same groups of 16 and tails): each x row gets the bits it gets alone. In the exact mode
    a row dot is bound by decoding, not by reading the weights, so T rows this way cost far
    less than T single rows (a verification's or a batch's rows)."""

    def emit(builder, rp, xr, nb):
        b = builder
        bufs = [cgutils.alloca_once(b, ir.ArrayType(F32, _GROUP)) for _ in range(2)]
        dbuf, cbuf = (b.bitcast(a, F32.as_pointer()) for a in bufs)

        def block(bi, j, scales=None):
            lo, hi = _block_codes(b, qtype, rp, bi)
            d, coef = _block_scales(b, qtype, rp, bi) if scales is None else scales
            dv = splat16(b, d)
            xo = b.mul(bi, c64(32))
            for t in xr.each():
                tt = _fma(b, hi, xr.x16(t, b.add(xo, c64(16))), b.fmul(lo, xr.x16(t, xo)))
                b.store(_fma(b, tt, dv, b.load(xr.acc(t, j))), xr.acc(t, j))
                if coef is not None:
                    b.store(_fma(b, coef, xr.sx(t, bi), b.load(xr.accm(t))), xr.accm(t))

        groups = b.udiv(nb, c64(_GROUP)) if qtype != "q8_0" else c64(0)
        with cgutils.for_range(b, groups) as loop:
            b0 = b.mul(loop.index, c64(_GROUP))
            _group_scales(b, qtype, rp, b0, dbuf, cbuf)
            barrier(b, dbuf, cbuf)
            for i in range(_GROUP):
                at = ir.Constant(I64, i)
                block(b.add(b0, at), i % 2, (b.load(b.gep(dbuf, [at])), b.load(b.gep(cbuf, [at]))))
        one = c64(1)
        done = b.mul(groups, c64(_GROUP))
        with cgutils.for_range(b, b.lshr(b.sub(nb, done), one)) as loop:
            b1 = b.add(done, b.shl(loop.index, one))
            block(b1, 0)
            block(b.add(b1, one), 1)
        with b.if_then(b.trunc(b.sub(nb, done), ir.IntType(1))):
            block(b.sub(nb, one), 0)

    return emit


def _make_widen(qtype):
    """widen(row, out): one stored q8_0 / q4_0 / q4_1 row -> f32 out [K], a block per step in
    vector IR: d * q, then + m (no fma), Weight.dequantize's f32 operations and bits."""
    bb, off = BY_NAME[qtype].block_bytes, ("q8_0", "q4_0", "q4_1").index(qtype)

    @intrinsic
    def widen(typingctx, row, out):
        sig = types.void(row, out)

        def codegen(context, builder, signature, args):
            ra = context.make_array(signature.args[0])(context, builder, args[0])
            oa = context.make_array(signature.args[1])(context, builder, args[1])
            rp = builder.bitcast(ra.data, I8.as_pointer())
            v16i8 = ir.VectorType(I8, 16)
            undef = ir.Constant(V16F, ir.Undefined)
            splat0 = ir.Constant(ir.VectorType(I32, 16), [0] * 16)

            def half(at):
                ptr = builder.bitcast(builder.gep(rp, [at]), ir.HalfType().as_pointer())
                h = builder.fpext(builder.load(ptr, align=1), F32)
                return builder.shuffle_vector(builder.insert_element(undef, h, ir.Constant(I32, 0)), undef, splat0)

            def bytes16(at):
                return builder.load(builder.bitcast(builder.gep(rp, [at]), v16i8.as_pointer()), align=1)

            nb = builder.lshr(builder.extract_value(oa.shape, 0), c64(5))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.mul(b, c64(bb))
                d = half(p)
                if off == 0:
                    lo = builder.sitofp(bytes16(builder.add(p, c64(2))), V16F)
                    hi = builder.sitofp(bytes16(builder.add(p, c64(18))), V16F)
                else:
                    q = builder.zext(bytes16(builder.add(p, c64(2 if off == 1 else 4))), ir.VectorType(I32, 16))
                    lo = builder.and_(q, ir.Constant(ir.VectorType(I32, 16), [15] * 16))
                    hi = builder.lshr(q, ir.Constant(ir.VectorType(I32, 16), [4] * 16))
                    if off == 1:
                        eight = ir.Constant(ir.VectorType(I32, 16), [8] * 16)
                        lo, hi = (builder.sitofp(builder.sub(v, eight), V16F) for v in (lo, hi))
                    else:
                        lo, hi = (builder.uitofp(v, V16F) for v in (lo, hi))
                lo, hi = builder.fmul(d, lo), builder.fmul(d, hi)
                if off == 2:
                    m = half(builder.add(p, c64(2)))
                    lo, hi = builder.fadd(lo, m), builder.fadd(hi, m)
                dst = builder.gep(oa.data, [builder.mul(b, c64(32))])
                builder.store(lo, builder.bitcast(dst, V16F.as_pointer()), align=4)
                builder.store(hi, builder.bitcast(builder.gep(dst, [c64(16)]), V16F.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return widen


# The block formats' kernels (row_dot "blocks"), dispatched on their kind (kernels/dispatch.py):
# widen_blocks(kind, row, out): one stored row -> f32 out [K];
# rows_blocks(kind, data, o0, o1, x, sx, y): y[o] = row o . x for o0 <= o < o1 (the row loop
#   compiled, ir.make_rows); q4_0 / q4_1 ROW_DOTS rows together (their constant terms' fma
#   chains overlap), q8_0 one at a time (no constant term: one at a time was faster);
# rows_x_blocks(kind, data, o0, o1, x, sx, y): y[t, o] for every x row (up to MULTI_T).
_BLOCKS = {f.name: f.kind for f in FORMATS if f.row_dot == "blocks"}
_TOGETHER = {"q4_0": ROW_DOTS, "q4_1": ROW_DOTS}
widen_blocks = by_kind("widen_blocks", {k: _make_widen(q) for q, k in _BLOCKS.items()})
rows_blocks = by_kind(
    "rows_blocks", {k: make_rows(_emit_rowdot(q), 2, together=_TOGETHER.get(q, 1)) for q, k in _BLOCKS.items()}
)
rows_x_blocks = by_kind("rows_x_blocks", {k: make_rows_x(_emit_rowdot_x(q)) for q, k in _BLOCKS.items()})


@njit(**KW)
def _x_row_block_sums(xr, sxr):
    # sxr[b] = sum of xr over block b, one add at a time in order (no fastmath: LLVM may not
    # reorder it, so every CPU sums alike; it vectorises across blocks)
    for b in range(sxr.shape[0]):
        a = np.float32(0)
        for j in range(32):
            a += xr[b * 32 + j]
        sxr[b] = a


@njit(**KW)
def _x_block_sums(x):
    sx = np.empty((x.shape[0], x.shape[1] // 32), np.float32)  # [T, nb]
    for t in range(x.shape[0]):
        _x_row_block_sums(x[t], sx[t])
    return sx


@njit(**KW)
def _rows_blocks(data, kind, x, sx, y, o0, o1):
    if 1 < x.shape[0] <= MULTI_T:  # each block decoded once for every x row (the same bits)
        rows_x_blocks(kind, data, o0, o1, x, sx, y)
        return
    step = row_step(o0, o1, x.shape[0])
    for c in range(o0, o1, step):
        e = min(o1, c + step)
        for t in range(x.shape[0]):
            rows_blocks(kind, data, c, e, x[t], sx[t], y[t])


@njit(**KW)
def exact_sums(x, kind, kq):
    """x's 32-value sums [T, K / 32] in the order kind's row dots take them: the block row dots'
    (lanes, fastmath) or, where kq is not None and kind is kquants', its sequential one. kq is a
    type, as in widen_row: None prunes the K-quant branch before typing."""
    if kq is not None and kind >= KQ_FIRST:
        return kq_sums(x)
    return _x_block_sums(x)


@njit(**KW)
def rows_exact(data, kind, x, sx, y, o0, o1, kq):
    """y[t, o] = stored row o . x[t] for o0 <= o < o1 and every x row, in the exact row dots'
    order (the block row dots here, kquants' for KQ_KIND kinds); sx from exact_sums. kq: the
    address of kquants' row loop for these types (kq_rows_address), or 0 where no K-quant
    row comes: called through it, the K-quant kernels compile only for models that have
    them. The one row loop of the exact decode: the staged matvec and the fused step call it
    through exact_rows_address."""
    if kind >= KQ_FIRST:
        if kq == 0:
            raise ValueError("rows_exact: K-quant rows without their row loop's address")
        xc, sxc, ya = np.ascontiguousarray(x), np.ascontiguousarray(sx), y[:, 0 : y.shape[1]]  # the address's types
        call_native(kq, (data, np.int64(kind), xc, sxc, ya, np.int64(o0), np.int64(o1)))
    else:
        _rows_blocks(data, kind, x, sx, y, o0, o1)


_X = np.zeros((1, 32), np.float32)  # the types the row loops' addresses are for: x and its sums,
_Y = np.zeros((2, 4), np.float32)[:, 1:3]  # and an output column slice (layout "A": two rows, strided)


def exact_rows_address(data) -> int:
    """The address of rows_exact compiled for rows like data (its dtype, layout and flags), f32
    x and sums [T, n] (C order), an output column slice and kq an int64: the one compile of
    the exact row dots that the staged matvecs here and the fused decode step call through
    kernels/native_call.py, rather than each compiling them into its own code. Callers pass
    exactly these types: x as np.ascontiguousarray types it, y sliced as y[:, a:b]."""
    return address_for(rows_exact, (data, np.int64(0), _X, _X, _Y, np.int64(0), np.int64(0), np.int64(0)))


def kq_rows_address(data) -> int:
    """rows_exact's kq for rows like data: the address of kquants' row loop for its types."""
    return address_for(kq_rows, (data, np.int64(0), _X, _X, _Y, np.int64(0), np.int64(0)))


@njit(**KW)
def _rows_chunk(c, addrs, data, kind, x, sx, y):
    # rows [c ROWS, (c + 1) ROWS) of _matvec_rows, through rows_exact's address (addrs: it and its kq)
    xc, ya = np.ascontiguousarray(x), y[:, 0 : y.shape[1]]  # the types exact_rows_address compiled for
    o0, o1 = np.int64(c * _ROWS), np.int64(min(data.shape[0], (c + 1) * _ROWS))
    call_native(addrs[0], (data, np.int64(kind), xc, sx, ya, o0, o1, addrs[1]))


def _matvec_rows(addrs, data, kind, x, y, kq):
    """y = x @ data.T on every thread, in chunks of ROWS output rows (parallel over output rows
    only, so each y[t, o] has one summation order whatever T and the thread count); addrs:
    (rows_exact's address, its kq), kq: which sums it takes (exact_sums)."""
    sx = exact_sums(x, kind, kq)
    run_parallel((data.shape[0] + _ROWS - 1) // _ROWS, _rows_chunk, (addrs, data, kind, x, sx, y))


@njit(**KW)
def _matvec_rows_serial(addrs, data, kind, x, y, kq):
    # the same rows without the thread pool: a parallel launch costs ~50-180 us here
    xc, ya = np.ascontiguousarray(x), y[:, 0 : y.shape[1]]
    call_native(addrs[0], (data, np.int64(kind), xc, exact_sums(xc, kind, kq), ya, np.int64(0),
                           np.int64(data.shape[0]), addrs[1]))  # fmt: skip


@njit(parallel=True, **KW)
def _matvec_stored(data, kind, lut, x, y):
    # Each stored row is widened to f32 once (bit-identical to Weight.dequantize()), then
    # dotted with each x row in f32: activations are never quantised, so decode matches the
    # prefill path and the f32 reference to rounding (int8 activations, as llama.cpp does,
    # visibly change SmolLM2-135M's greedy output).
    o_n, k = data.shape[0], x.shape[1]
    for c in prange((o_n + _ROWS - 1) // _ROWS):
        bits = np.empty(k, np.uint32)
        row = bits.view(np.float32)
        for o in range(c * _ROWS, min(o_n, (c + 1) * _ROWS)):
            widen_row(data[o], kind, lut, row, bits, None)  # f16 / bf16 only (matvec_widened)
            for t in range(x.shape[0]):
                y[t, o] = dot(row, x[t])


def matvec_widened(x, w, out):
    """out [T, out] = x @ W.T for small T and every format (batch and thread invariant)."""
    fmt = BY_NAME[w.qtype]
    if fmt.kind == FP32:
        _mv_f32(w.data, x, out)
    elif fmt.row_dot == "widened":  # f16, bf16
        call_slp(_matvec_stored, w.data, fmt.kind, F16_LUT, x, out)
    else:  # the block row dots here or kquants'
        small = x.shape[0] * w.data.shape[0] * x.shape[1] < PARALLEL_MIN_MACS
        kq = True if fmt.row_dot == "kquants" else None
        addrs = (exact_rows_address(w.data), kq_rows_address(w.data) if kq else 0)
        (_matvec_rows_serial if small else _matvec_rows)(addrs, w.data, fmt.kind, x, out, kq)
    return out
