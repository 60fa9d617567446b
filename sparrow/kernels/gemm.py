"""Prefill GEMM: y [T, O] = x [T, K] @ W.T for stored weights (large-T path of linear).

Each panel of NR weight rows is widened once to f32 (q8_0 / q4_0 / q4_1 by vector IR,
f16 / bf16 by widen_row; values bit-identical to Weight.dequantize(), the same f32
operations) and transposed, 16 x 16 in registers, into packed form bp [K, NR]. Every
MR-row block of x is then multiplied with it by an outer-product micro-kernel written as
LLVM vector IR: MR x NR accumulators live in vector registers, and for each k the NR
weights are loaded as NR / 16 vectors and x[t, k] is broadcast for each of the MR rows.
Numba alone will not keep such a register tile, hence the IR (~100 GFLOP/s a Zen 4 core,
near its one 512-bit FMA a cycle).

Summation order: every y[t, o] is one lane of one accumulator, acc = fma(x[t, k], w[o, k],
acc) for k = 0 .. K - 1 in sequence, starting from 0. That depends only on K: not on T,
on where t or o falls in a tile (tails run the same kernel on zero-padded copies), nor
on the thread count (threads split the panels, never k). Results are bit-identical for a
row alone or in a batch and for any number of threads.

One parallel region per call (a launch costs 50-180 us here); threads claim weight panels
from a shared counter; each packs its panel (K x NR f32 <= 288 KiB, stays in L2) and
sweeps all of x with it.
f16 / bf16 / f32 rows are packed by _widen.widen_row (this module imports _widen, never the
other way round). The numba cache directory is keyed on a hash of all kernel sources
(kernels/__init__.py, _cache_dir), so an edit to widen_row recompiles the kernels here too.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels._ir import F32, I8, I32, V16F
from sparrow.kernels._ir import fma as _fma
from sparrow.kernels._widen import F16_LUT, KIND, call_slp, widen_row

KW = dict(cache=True, nogil=True)
MR = 8  # x rows per micro-kernel call
NV = 3  # 16-lane vectors per panel row
NR = 16 * NV  # weight rows per panel

_F32, _I8, _I32, _V16F = F32, I8, I32, V16F


def _f32_c2d(t):
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype == types.float32


@intrinsic
def _kernel(typingctx, x, xr, bp, c, cr, cc):
    """c[cr + i, cc + j] = sum_k x[xr + i, k] * bp[k, j] for i < MR, j < NR.

    x: f32 C [*, K], bp: f32 C [K, NR] (NR columns exactly), c: f32 C [*, ldc];
    the caller keeps every index in bounds.
    """
    if not (_f32_c2d(x) and _f32_c2d(bp) and _f32_c2d(c)):
        return None
    sig = types.void(x, types.intp, bp, c, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        ba = context.make_array(signature.args[2])(context, builder, args[2])
        ca = context.make_array(signature.args[3])(context, builder, args[3])
        xr_, cr_, cc_ = args[1], args[4], args[5]
        i64 = xr_.type
        k_n = builder.extract_value(xa.shape, 1)
        ldc = builder.extract_value(ca.shape, 1)
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        xrows = [builder.gep(xa.data, [builder.mul(builder.add(xr_, c64(i)), k_n)]) for i in range(MR)]
        zero = ir.Constant(_V16F, [0.0] * 16)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(NV)] for _ in range(MR)]
        splat = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
        undef = ir.Constant(_V16F, ir.Undefined)
        with cgutils.for_range(builder, k_n) as loop:
            k = loop.index
            brow = builder.gep(ba.data, [builder.mul(k, c64(NR))])
            bv = [
                builder.load(builder.bitcast(builder.gep(brow, [c64(16 * j)]), _V16F.as_pointer()), align=4)
                for j in range(NV)
            ]
            for i in range(MR):
                xs = builder.load(builder.gep(xrows[i], [k]))
                xv = builder.shuffle_vector(builder.insert_element(undef, xs, ir.Constant(_I32, 0)), undef, splat)
                for j in range(NV):
                    builder.store(_fma(builder, xv, bv[j], builder.load(accs[i][j])), accs[i][j])
        for i in range(MR):
            crow = builder.gep(ca.data, [builder.add(builder.mul(builder.add(cr_, c64(i)), ldc), cc_)])
            for j in range(NV):
                ptr = builder.bitcast(builder.gep(crow, [c64(16 * j)]), _V16F.as_pointer())
                builder.store(builder.load(accs[i][j]), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**KW)
def _sweep(bp, x, y, o0, n):
    # y[:, o0 : o0 + n] = x @ bp[:, :n]; partial tiles go through zero-padded copies so
    # every element still takes the one kernel (and the one summation order).
    t_n, k = x.shape
    full = t_n - t_n % MR
    c = np.empty((MR, NR), np.float32)  # [MR, NR]
    for t in range(0, full, MR):
        if n == NR:
            _kernel(x, t, bp, y, t, o0)
        else:
            _kernel(x, t, bp, c, 0, 0)
            y[t : t + MR, o0 : o0 + n] = c[:, :n]
    if full < t_n:
        xpad = np.zeros((MR, k), np.float32)  # [MR, K]
        xpad[: t_n - full] = x[full:]
        _kernel(xpad, 0, bp, c, 0, 0)
        y[full:, o0 : o0 + n] = c[: t_n - full, :n]


@intrinsic
def _claim(typingctx, counter):
    """Atomically counter[0] += 1, returning the old value (counter: int64 [1])."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", arr.data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen


@intrinsic
def _t16(typingctx, src, sr, sc, dst, dr, dc):
    """dst[dr + i, dc + j] = src[sr + j, sc + i] for i, j < 16 (f32 C arrays, in bounds).

    Sixteen row loads, then an in-register transpose in 4 rounds of two-source shuffles
    (round s swaps bit s of the row and column index), then sixteen row stores.
    """
    if not (_f32_c2d(src) and _f32_c2d(dst)):
        return None
    sig = types.void(src, types.intp, types.intp, dst, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        sa = context.make_array(signature.args[0])(context, builder, args[0])
        da = context.make_array(signature.args[3])(context, builder, args[3])
        lds, ldd = builder.extract_value(sa.shape, 1), builder.extract_value(da.shape, 1)

        def row(arr, ld, r0, c0, i):
            off = builder.add(builder.mul(builder.add(r0, ir.Constant(r0.type, i)), ld), c0)
            return builder.bitcast(builder.gep(arr.data, [off]), _V16F.as_pointer())

        v = [builder.load(row(sa, lds, args[1], args[2], i), align=4) for i in range(16)]
        for bit in range(4):
            h = 1 << bit
            lo = [c if not c & h else 16 + c - h for c in range(16)]
            hi = [c + h if not c & h else 16 + c for c in range(16)]
            nv = list(v)
            for r in range(16):
                if not r & h:
                    a_, b_ = v[r], v[r | h]
                    nv[r] = builder.shuffle_vector(a_, b_, ir.Constant(ir.VectorType(_I32, 16), lo))
                    nv[r | h] = builder.shuffle_vector(a_, b_, ir.Constant(ir.VectorType(_I32, 16), hi))
            v = nv
        for i in range(16):
            builder.store(v[i], row(da, ldd, args[4], args[5], i), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**KW)
def _transpose_into(rows, r0, n, bp):
    # bp[k, j] = rows[r0 + j, k] for j < n: 16 x 16 blocks in registers, scalar edges
    k_n = bp.shape[0]
    kf = k_n - k_n % 16
    nf = n - n % 16
    for j in range(0, nf, 16):
        for kk in range(0, kf, 16):
            _t16(rows, r0 + j, kk, bp, kk, j)
    for kk in range(kf, k_n):
        for j in range(nf):
            bp[kk, j] = rows[r0 + j, kk]
    for kk in range(k_n):
        for j in range(nf, n):
            bp[kk, j] = rows[r0 + j, kk]


def _make_widen(bb, off):
    """Vector widen of one q8_0 (off 0) / q4_0 (off 1) / q4_1 (off 2) row, bb bytes a block.

    The same f32 operations as widen_row (d * q, then + m; no fma), so the same bits.
    """

    @intrinsic
    def widen(typingctx, row, out):
        sig = types.void(row, out)

        def codegen(context, builder, signature, args):
            ra = context.make_array(signature.args[0])(context, builder, args[0])
            oa = context.make_array(signature.args[1])(context, builder, args[1])
            rp = builder.bitcast(ra.data, _I8.as_pointer())
            i64 = ir.IntType(64)
            c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
            v16i8 = ir.VectorType(_I8, 16)
            undef = ir.Constant(_V16F, ir.Undefined)
            splat0 = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)

            def half(at):
                ptr = builder.bitcast(builder.gep(rp, [at]), ir.HalfType().as_pointer())
                h = builder.fpext(builder.load(ptr, align=1), _F32)
                return builder.shuffle_vector(builder.insert_element(undef, h, ir.Constant(_I32, 0)), undef, splat0)

            def bytes16(at):
                return builder.load(builder.bitcast(builder.gep(rp, [at]), v16i8.as_pointer()), align=1)

            nb = builder.lshr(builder.extract_value(oa.shape, 0), c64(5))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                p = builder.mul(b, c64(bb))
                d = half(p)
                if off == 0:
                    lo = builder.sitofp(bytes16(builder.add(p, c64(2))), _V16F)
                    hi = builder.sitofp(bytes16(builder.add(p, c64(18))), _V16F)
                else:
                    q = builder.zext(bytes16(builder.add(p, c64(2 if off == 1 else 4))), ir.VectorType(_I32, 16))
                    lo = builder.and_(q, ir.Constant(ir.VectorType(_I32, 16), [15] * 16))
                    hi = builder.lshr(q, ir.Constant(ir.VectorType(_I32, 16), [4] * 16))
                    if off == 1:
                        eight = ir.Constant(ir.VectorType(_I32, 16), [8] * 16)
                        lo, hi = (builder.sitofp(builder.sub(v, eight), _V16F) for v in (lo, hi))
                    else:
                        lo, hi = (builder.uitofp(v, _V16F) for v in (lo, hi))
                lo, hi = builder.fmul(d, lo), builder.fmul(d, hi)
                if off == 2:
                    m = half(builder.add(p, c64(2)))
                    lo, hi = builder.fadd(lo, m), builder.fadd(hi, m)
                dst = builder.gep(oa.data, [builder.mul(b, c64(32))])
                builder.store(lo, builder.bitcast(dst, _V16F.as_pointer()), align=4)
                builder.store(hi, builder.bitcast(builder.gep(dst, [c64(16)]), _V16F.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return widen


_widen_q8_0 = _make_widen(34, 0)
_widen_q4_0 = _make_widen(18, 1)
_widen_q4_1 = _make_widen(20, 2)


@njit(**KW)
def _pack_stored(data, kind, lut, o0, n, tmp, bp):
    bits = tmp.view(np.uint32)
    for j in range(n):
        if kind == 2:
            _widen_q4_1(data[o0 + j], tmp[j])
        elif kind == 1:
            _widen_q4_0(data[o0 + j], tmp[j])
        elif kind == 0:
            _widen_q8_0(data[o0 + j], tmp[j])
        else:
            widen_row(data[o0 + j], kind, lut, tmp[j], bits[j])
    _transpose_into(tmp, 0, n, bp)


# One prange iteration per thread, each claiming panels from a shared counter until none
# are left: the cores are shared with other processes, and with numba's static split a
# thread that loses its core for a while holds up the whole call. Which thread computes a
# panel never changes its bits.


@njit(parallel=True, **KW)
def gemm_stored(data, kind, lut, x, y, threads):
    """y [T, O] = x [T, K] @ W.T for stored rows data [O, *] of format kind (_widen.KIND;
    f32 rows come as their uint32 bits, widened by a copy)."""
    o_n, k = data.shape[0], x.shape[1]
    n_p = (o_n + NR - 1) // NR
    nxt = np.zeros(1, np.int64)
    for _ in prange(min(n_p, threads)):
        bp = np.zeros((k, NR), np.float32)  # [K, NR]
        tmp = np.empty((NR, k), np.float32)  # [NR, K] rows widened in place, then transposed
        p = _claim(nxt)
        while p < n_p:
            o0 = p * NR
            n = min(NR, o_n - o0)
            if n < NR:
                bp[:] = 0
            _pack_stored(data, kind, lut, o0, n, tmp, bp)
            _sweep(bp, x, y, o0, n)
            p = _claim(nxt)


def matmul_widened(x, w, out):
    """out [T, out] = x @ W.T for large T (prefill): packed f32 panels, outer-product GEMM."""
    data = w.data.view(np.uint32) if w.qtype == "f32" else w.data  # f32 rows as their bits
    call_slp(gemm_stored, data, KIND[w.qtype], F16_LUT, x, out, numba.get_num_threads())
    return out
