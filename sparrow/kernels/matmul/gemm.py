"""Prefill GEMM: y [T, O] = x [T, K] @ W.T for stored weights (large-T path of linear).

Each panel of NR weight rows is widened once to f32 (q8_0 / q4_0 / q4_1 by vector IR,
f16 / bf16 by widen_row; values bit-identical to Weight.dequantize(), the same f32
operations) and transposed, LANES x LANES in registers, into NS = NR / NK packed sub-panels
[K, NK]. x is packed once per call into MR-row blocks [K, MR]. Every block is multiplied
with each sub-panel by an outer-product micro-kernel written as LLVM vector IR: MR x NK
accumulators live in vector registers, and for each k the NK weights are loaded as NW
vectors of LANES f32 and x[t, k] is broadcast for each of the MR rows. Numba alone will not
keep such a register tile, hence the IR.

The tile follows the CPU numba compiles for (micro_tile): with AVX-512, 8 x 48 in 24 zmm
(~100 GFLOP/s a Zen 4 core, near its one 512-bit FMA a cycle); without (AVX2's 16 ymm,
ARM64), 4 x 24 in 12 ymm, ~90 GFLOP/s a Zen 3 core (two 256-bit FMAs a cycle); the 8 x 48
tile spilled there (48 ymm) and ran at ~20.

Summation order: every y[t, o] is one lane of one accumulator, acc = fma(x[t, k], w[o, k],
acc) for k = 0 .. K - 1 in sequence, starting from 0. That depends only on K: not on T,
on where t or o falls in a tile (tails run the same kernel on zero-padded copies), nor
on the thread count (threads split the panels, never k). Results are bit-identical for a
row alone or in a batch and for any number of threads.

One parallel region per call (a launch costs 50-180 us here); threads claim weight panels
from a shared counter; each packs its panel (K x NR f32, 110 KiB at K = 576) and sweeps
all of x with it, one x block (L1) against the NS sub-panels (L2 or streamed) at a time.
The packing buffers are reused from call to call (_scratch_arrays).
f16 / bf16 / f32 rows are packed by widen.widen_row (this module imports widen, never the
other way round). The numba cache directory is keyed on a hash of all kernel sources
(kernels/runtime.py, _cache_dir), so an edit to widen_row recompiles the kernels here too.
"""

import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels import cpu
from sparrow.kernels.cpu import micro_tile
from sparrow.kernels.formats import KIND, KQ_KIND
from sparrow.kernels.ir import F32, I32, I64, fma
from sparrow.kernels.matmul.widen import F16_LUT, call_slp, widen_row
from sparrow.kernels.native_call import address_for, call_native
from sparrow.kernels.options import KW
from sparrow.kernels.parallel import run_parallel

NR = 48  # weight rows per panel (a multiple of NK, the columns of one micro-kernel call)


CPU_NAME, CPU_FEATURES = cpu.NAME, cpu.FEATURES
MR, NW, LANES = micro_tile(CPU_FEATURES)  # x rows, vectors a row, lanes a vector (cpu.micro_tile)
NK = NW * LANES  # panel columns per micro-kernel call: a panel is NS sub-panels [K, NK]
NS = NR // NK
assert NR % NK == 0 and NK % LANES == 0

_VK = ir.VectorType(F32, LANES)


def _f32_c2d(t):
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype == types.float32


def emit_tile(builder, x0, b0, k_n, crow, mr=MR, nw=NW, lanes=LANES):
    """The micro-kernel's loop in IR: mr x nw vectors of `lanes` f32 accumulators, each from 0
    one fma chain over k = 0 .. k_n - 1 in order (x value x0[k mr + i] broadcast, times the nw
    vectors of b row k at b0 + k nw lanes, into row i's); then row i's vectors stored at the f32
    pointer crow(i). _kernel emits it with this CPU's tile; scripts/neon_model.py with others."""
    vk = ir.VectorType(F32, lanes)
    c64 = lambda v: ir.Constant(k_n.type, v)  # noqa: E731
    zero = ir.Constant(vk, [0.0] * lanes)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(nw)] for _ in range(mr)]
    splat = ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
    undef = ir.Constant(vk, ir.Undefined)
    with cgutils.for_range(builder, k_n) as loop:
        k = loop.index
        brow = builder.gep(b0, [builder.mul(k, c64(nw * lanes))])
        xrow = builder.gep(x0, [builder.mul(k, c64(mr))])
        bv = [
            builder.load(builder.bitcast(builder.gep(brow, [c64(lanes * j)]), vk.as_pointer()), align=4)
            for j in range(nw)
        ]
        for i in range(mr):
            xs = builder.load(builder.gep(xrow, [c64(i)]))
            xv = builder.shuffle_vector(builder.insert_element(undef, xs, ir.Constant(I32, 0)), undef, splat)
            for j in range(nw):
                builder.store(fma(builder, xv, bv[j], builder.load(accs[i][j])), accs[i][j])
    for i in range(mr):
        ci = crow(i)
        for j in range(nw):
            ptr = builder.bitcast(builder.gep(ci, [c64(lanes * j)]), vk.as_pointer())
            builder.store(builder.load(accs[i][j]), ptr, align=4)


def tile_module(mr: int, nw: int, lanes: int, triple: str) -> ir.Module:
    """emit_tile's loop for an mr x nw x lanes tile as a module for triple: a function
    tile(x0, b0, c0, ldc, k_n) of f32 pointers, for compiling to other CPUs
    (sparrow_lab/cross.py: tests/test_arm64.py, scripts/neon_model.py)."""
    m = ir.Module("gemm")
    m.triple = triple
    pf = F32.as_pointer()
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [pf, pf, pf, I64, I64]), "tile")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x0, b0, c0, ldc, k_n = fn.args
    emit_tile(b, x0, b0, k_n, lambda i: b.gep(c0, [b.mul(ir.Constant(I64, i), ldc)]), mr, nw, lanes)
    b.ret_void()
    return m


@intrinsic
def _kernel(typingctx, xp, xb, bp, br, c, cr, cc):
    """c[cr + i, cc + j] = sum_k xp[xb, k MR + i] * bp[br + k, j] for i < MR, j < NK, each
    element one fma chain over k = 0 .. K - 1 in order, starting from 0 (emit_tile).

    xp: f32 C [*, K MR] (x packed by _pack_x), bp: f32 C [*, NK] (sub-panel rows br ..
    br + K - 1), c: f32 C [*, ldc]; the caller keeps every index in bounds.
    """
    if not (_f32_c2d(xp) and _f32_c2d(bp) and _f32_c2d(c)):
        return None
    sig = types.void(xp, types.intp, bp, types.intp, c, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        ba = context.make_array(signature.args[2])(context, builder, args[2])
        ca = context.make_array(signature.args[4])(context, builder, args[4])
        xb_, br_, cr_, cc_ = args[1], args[3], args[5], args[6]
        c64 = lambda v: ir.Constant(xb_.type, v)  # noqa: E731
        ldx = builder.extract_value(xa.shape, 1)
        ldc = builder.extract_value(ca.shape, 1)
        k_n = builder.udiv(ldx, c64(MR))
        x0 = builder.gep(xa.data, [builder.mul(xb_, ldx)])
        b0 = builder.gep(ba.data, [builder.mul(br_, c64(NK))])

        def crow(i):
            return builder.gep(ca.data, [builder.add(builder.mul(builder.add(cr_, c64(i)), ldc), cc_)])

        emit_tile(builder, x0, b0, k_n, crow)
        return context.get_dummy_value()

    return sig, codegen


@njit(**KW)
def _pack_x(x, xp):
    # xp[t // MR, k MR + t % MR] = x[t, k]: each MR-row block of x as [K, MR], so the
    # kernel broadcasts its MR values for one k from one place; rows past T are 0
    t_n, k_n = x.shape
    for tb in range(t_n // MR):
        for k in range(k_n):
            for i in range(MR):
                xp[tb, k * MR + i] = x[tb * MR + i, k]
    tb = t_n // MR
    if tb < xp.shape[0]:
        for k in range(k_n):
            for i in range(MR):
                xp[tb, k * MR + i] = x[tb * MR + i, k] if tb * MR + i < t_n else np.float32(0)


@njit(**KW)
def _panel_tiles(bp, xp, y, o0, n):
    # y[:, o0 : o0 + n] = x @ W[o0 : o0 + n].T from the packed panel bp, one x block at a
    # time (it stays in L1 across the NS sub-panels). Partial tiles (the last x block, a
    # panel of fewer than NR rows) go through c, computed from zero-padded copies, so every
    # element still takes the one kernel (and the one summation order).
    t_n = y.shape[0]
    k = bp.shape[0] // NS
    full = t_n // MR
    c = np.empty((MR, NR), np.float32)  # [MR, NR]
    for tb in range(full):
        if n == NR:
            for s in range(NS):
                _kernel(xp, tb, bp, s * k, y, tb * MR, o0 + s * NK)
        else:
            for s in range((n + NK - 1) // NK):
                _kernel(xp, tb, bp, s * k, c, 0, s * NK)
            _copy_tile(c, y, tb * MR, MR, o0, n)
    if full * MR < t_n:
        for s in range((n + NK - 1) // NK):
            _kernel(xp, full, bp, s * k, c, 0, s * NK)
        _copy_tile(c, y, full * MR, t_n - full * MR, o0, n)


@njit(**KW)
def _copy_tile(c, y, t0, m, o0, n):
    # y[t0 : t0 + m, o0 : o0 + n] = c[:m, :n] as element loops: numba's shape-checked array
    # assignment costs ~3 s of compile
    for i in range(m):
        for j in range(n):
            y[t0 + i, o0 + j] = c[i, j]


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
def _tl(typingctx, src, sr, sc, dst, dr, dc):
    """dst[dr + i, dc + j] = src[sr + j, sc + i] for i, j < LANES (f32 C arrays, in bounds).

    LANES row loads, then an in-register transpose in log2(LANES) rounds of two-source
    shuffles (round s swaps bit s of the row and column index), then LANES row stores.
    """
    if not (_f32_c2d(src) and _f32_c2d(dst)):
        return None
    sig = types.void(src, types.intp, types.intp, dst, types.intp, types.intp)
    n = LANES

    def codegen(context, builder, signature, args):
        sa = context.make_array(signature.args[0])(context, builder, args[0])
        da = context.make_array(signature.args[3])(context, builder, args[3])
        lds, ldd = builder.extract_value(sa.shape, 1), builder.extract_value(da.shape, 1)

        def row(arr, ld, r0, c0, i):
            off = builder.add(builder.mul(builder.add(r0, ir.Constant(r0.type, i)), ld), c0)
            return builder.bitcast(builder.gep(arr.data, [off]), _VK.as_pointer())

        v = [builder.load(row(sa, lds, args[1], args[2], i), align=4) for i in range(n)]
        for bit in range(n.bit_length() - 1):
            h = 1 << bit
            lo = [c if not c & h else n + c - h for c in range(n)]
            hi = [c + h if not c & h else n + c for c in range(n)]
            nv = list(v)
            for r in range(n):
                if not r & h:
                    a_, b_ = v[r], v[r | h]
                    nv[r] = builder.shuffle_vector(a_, b_, ir.Constant(ir.VectorType(I32, n), lo))
                    nv[r | h] = builder.shuffle_vector(a_, b_, ir.Constant(ir.VectorType(I32, n), hi))
            v = nv
        for i in range(n):
            builder.store(v[i], row(da, ldd, args[4], args[5], i), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**KW)
def _transpose_into(rows, n, bp):
    # bp[(j // NK) K + k, j % NK] = rows[j, k] for j < n (sub-panel j // NK is W rows
    # [j // NK * NK, +NK) as [K, NK]): LANES x LANES blocks in registers, scalar edges
    k_n = bp.shape[0] // NS
    kf = k_n - k_n % LANES
    nf = n - n % LANES
    for j in range(0, nf, LANES):
        for kk in range(0, kf, LANES):
            _tl(rows, j, kk, bp, j // NK * k_n + kk, j % NK)
    for kk in range(kf, k_n):
        for j in range(nf):
            bp[j // NK * k_n + kk, j % NK] = rows[j, kk]
    for kk in range(k_n):
        for j in range(nf, n):
            bp[j // NK * k_n + kk, j % NK] = rows[j, kk]


@njit(**KW)
def _pack_panel(data, kind, lut, o0, n, tmp, bp, kq):
    bits = tmp.view(np.uint32)
    for j in range(n):
        widen_row(data[o0 + j], kind, lut, tmp[j], bits[j], kq)
    _transpose_into(tmp, n, bp)


# One launch per thread (kernels/parallel.py), each claiming panels from a shared counter until
# none are left: the cores are shared with other processes, and with a static split a thread
# that loses its core for a while holds up the whole call. Which thread computes a panel never
# changes its bits.


@njit(**KW)
def _gemm_panels(i, weight, y, scratch, counter, calls):
    """Thread i of matmul_widened: claims panels from the counter (nxt, n_p) until none of n_p
    are left, packing each panel of weight (data, kind, lut, kq) into its own scratch bps[i] /
    tmps[i] (scratch: (xp, bps, tmps)) and sweeping x over it. calls: the addresses of
    _pack_panel and _panel_tiles (panel_addresses), called through them so that each compiles
    once, not again here (kernels/native_call.py)."""
    data, kind, lut, kq = weight
    xp, bps, tmps = scratch
    nxt, n_p = counter
    bp, tmp = bps[i], tmps[i]
    o_n = data.shape[0]
    p = _claim(nxt)
    while p < n_p:
        o0 = p * NR
        n = min(NR, o_n - o0)
        if n < NR:
            bp[:] = 0
        call_native(calls[0], (data, kind, lut, np.int64(o0), np.int64(n), tmp, bp, kq))  # _pack_panel
        call_native(calls[1], (bp, xp, y, np.int64(o0), np.int64(n)))  # _panel_tiles
        p = _claim(nxt)


# Scratch for matmul_widened, kept per calling thread and grown as needed: fresh arrays on
# every call cost page faults (~60k of them in one 512-token SmolLM2 prefill, ~15% of its
# GEMM time).
_scratch = threading.local()


def _scratch_arrays(*shapes):
    """C-contiguous f32 arrays of these shapes, each 64-byte aligned, in one reused buffer."""
    sizes = [-(-int(np.prod(s)) // 16) * 16 for s in shapes]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < sum(sizes) + 16:
        buf = _scratch.buf = np.empty(sum(sizes) + 16, np.float32)
    at = (-buf.ctypes.data % 64) // 4
    out = []
    for shape, size in zip(shapes, sizes):
        out.append(buf[at : at + int(np.prod(shape))].reshape(shape))
        at += size
    return out


def panel_addresses(data, kind, y, xp, bps, tmps, kq) -> tuple[int, int]:
    """The addresses of _pack_panel and _panel_tiles for the types _gemm_panels calls them with
    (a thread's scratch is bps[i] / tmps[i], a C row of each), compiled with SLP as the
    rest of the GEMM: each compiles once, not again into _gemm_panels."""
    pack = address_for(_pack_panel, (data, kind, F16_LUT, 0, 0, tmps[0], bps[0], kq), slp=True)
    return pack, address_for(_panel_tiles, (bps[0], xp, y, 0, 0), slp=True)


def matmul_widened(x, w, out):
    """out [T, out] = x @ W.T for large T (prefill): packed f32 panels, outer-product GEMM.
    Rows data [O, *] of format kind (formats.KIND; f32 rows come as their uint32 bits,
    widened by a copy); scratch (contents ignored): xp [ceil(T / MR), K MR] for packed x, and
    per thread bps [P, NS K, NK] for a packed panel, tmps [P, NR, K] for its rows widened; P
    threads at most. kq: None unless kind is a K-quant or q5 format (see widen.widen_row)."""
    data = w.data.view(np.uint32) if w.qtype == "f32" else w.data  # f32 rows as their bits
    t_n, k = x.shape
    p_n = max(1, min((w.shape[0] + NR - 1) // NR, numba.get_num_threads()))
    xp, bps, tmps = _scratch_arrays(((t_n + MR - 1) // MR, k * MR), (p_n, NS * k, NK), (p_n, NR, k))
    kq = True if w.qtype in KQ_KIND else None
    kind, n_p = KIND[w.qtype], (w.shape[0] + NR - 1) // NR
    call_slp(_pack_x, x, xp)
    calls = panel_addresses(data, kind, out, xp, bps, tmps, kq)
    nxt = np.zeros(1, np.int64)  # the panel counter
    weight, scratch = (data, kind, F16_LUT, kq), (xp, bps, tmps)
    run_parallel(p_n, _gemm_panels, (weight, out, scratch, (nxt, n_p), calls), slp=True)
    return out
