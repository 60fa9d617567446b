"""q8-mode prefill on Intel AMX tiles (Sapphire Rapids and later): the same bits, more MACs.

A q8-mode prefill multiplies T quantised x rows by a q8_0 / q4_0 / q4_1 / q4_k / q6_k matrix. The
vector path (q8.groups groups, vpdpbusd) reaches ~86 GMAC/s on two cores of an AMX Xeon; one AMX
tdpbssd multiplies a 16 x 32 int8 tile by a 32 x 16 one (8192 exact integer MACs) in ~16
cycles. Here a 16-row panel of weights (two q8.groups groups) is unpacked once to int8 codes in
the B-tile layout (4 bytes of a row a column: the q8.groups chunks side by side) and swept by
every 16-row tile of x:

  per block b (32 values): C = A_b B_b (tdpbssd / tdpbsud: C[t, r] = the exact int32 sum
  of code_x * code_w over the block; q6_k: two tiles, one per 16-value half); then, per x
  row t and weight row r (16 lanes),
    acc = fma(float(s), d * dx[t, b], acc)            s = C[t, r] (q4_k: times the
    q4_1 only: accm = fma(m, sx[t, b], accm)          sub-block's 6-bit scale; q6_k:
    q4_k only: accm = fma(-(dmin m_j), sx[t, b], accm)   sc[2j] C0 + sc[2j + 1] C1)

which is q8.groups's and q8.kquant_groups's documented order, operation for operation: integer sums are exact
whichever instruction forms them, so this path gives the vector path's bits (tests compare
them) and a row's bits stay independent of T, the tile and the thread count. q4_0's codes
enter as nibble - 8 (signed), so its s needs no -8 sum(code_x) correction.

Tiles need the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, once per process); where
it is refused, where the CPU lacks amx-int8, or with SPARROW_AMX=0, nothing here runs.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from sparrow.kernels import cpu
from sparrow.kernels.dispatch import by_kind
from sparrow.kernels.formats import AMX_FORMATS, KIND, Q4_1, Q4_K, Q6_K
from sparrow.kernels.intdot import splat
from sparrow.kernels.ir import F32, I8, I16, I32, V16F, V16I16, V16I32, V32I8, c64, call, fma, opaque, splat16
from sparrow.kernels.matmul.q8.groups import GROUP_BYTES, REGIONS, load, nibble
from sparrow.kernels.matmul.q8.kquant_groups import _CODES, _Q6_QH, _Q6_QL, _Q6_SC
from sparrow.kernels.matmul.widen import F16_LUT
from sparrow.kernels.options import KW

TILE = 16  # x rows and weight rows a tile covers
FORMATS = AMX_FORMATS  # q8_0, q4_0, q4_1, q4_k, q6_k


AMX = cpu.AMX  # the CPU has tiles, SPARROW_AMX is not 0 and Linux grants them (kernels/cpu.py)


def _config(shapes):
    """The 64-byte tile configuration (palette 1) giving tmm0, tmm1, ... these (rows, bytes)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    for t, (r, c) in enumerate(shapes):
        rows[t], colsb[t] = r, c
    cfg.flags.writeable = False
    return cfg


# tmm0 .. tmm3 C [16 x 16 i32], one per block in flight (block b: tmm b % 4); tmm4 / tmm5 A [16 x
# 32 i8] and tmm6 / tmm7 B [8 x 64 i8] for even / odd blocks; q6_k (a scale per 16 values): tmm0
# / tmm1 C, tmm2 / tmm3 A [16 x 16 i8], tmm4 / tmm5 B [4 x 64 i8] for a block's first and last 16
# values
CONFIG = _config([(16, 64)] * 4 + [(16, 32)] * 2 + [(8, 64)] * 2)
# Blocks whose tdp (and the store of its sums) is issued before the block being scaled, so the
# scaling does not wait for them (3 measured faster than 1: docs/kernels.md). q6_k stays 1
# ahead: a second pair of C tiles was no faster.
AHEAD = 3
assert 0 < AHEAD < 4  # four C tiles: the one being scaled and AHEAD in flight
CONFIG_Q6_K = _config([(16, 64)] * 2 + [(16, 16)] * 2 + [(4, 64)] * 2)

# ------------------------------------------------------------------ panels (numba)


@njit(**KW)
def _f16(p, at, lut):
    return lut[np.int32(p[at]) | (np.int32(p[at + 1]) << 8)]


def _unpack(qtype):
    """An intrinsic unpack(row, nb, bpan, h): the codes of one q8.groups group row (its bytes, nb x
    blocks of 32) into columns 32 h .. 32 h + 31 of the B tiles bpan [nb, 8, 64], as vector
    code (the numba loop it replaced ran as long as the tiles on q4_0)."""
    gb = GROUP_BYTES[qtype]
    codes = 8 * REGIONS[qtype][-1][1]  # q8_0 / q4_x: where a group block's code chunks start

    def unpack(typingctx, row, nb, bpan, h):
        sig = types.void(row, nb, bpan, h)

        def codegen(context, b, signature, args):
            rp = b.bitcast(context.make_array(signature.args[0])(context, b, args[0]).data, I8.as_pointer())
            bp = b.bitcast(context.make_array(signature.args[2])(context, b, args[2]).data, I8.as_pointer())
            col = b.mul(args[3], c64(32))
            with cgutils.for_range(b, args[1]) as loop:
                blk = loop.index
                dst = b.gep(bp, [b.add(b.mul(blk, c64(512)), col)])
                if qtype == "q4_k":  # super-block blk // 8, sub-block j: chunks 8 (j // 2) .. of its codes
                    j = b.urem(blk, c64(8))
                    at = b.add(c64(_CODES["q4_k"]), b.mul(b.udiv(j, c64(2)), c64(256)))
                    src = b.gep(rp, [b.add(b.mul(b.udiv(blk, c64(8)), c64(gb)), at)])
                    high = b.icmp_unsigned("!=", b.urem(j, c64(2)), c64(0))
                    for c in range(8):
                        v = load(b, src, 32 * c, V32I8)
                        b.store(b.select(high, nibble(b, v, 1), nibble(b, v, 0)), _at(b, dst, 64 * c))
                elif qtype == "q6_k":  # sub-block j of super-block n: half j // 4, quarter q = j % 4
                    n, j = b.udiv(blk, c64(8)), b.urem(blk, c64(8))
                    half, q = b.udiv(j, c64(4)), b.urem(j, c64(4))
                    sb = b.gep(rp, [b.mul(n, c64(gb))])
                    # ql chunks 16 half + 8 (q % 2) + c (nibble q // 2), qh chunks 8 half + c (bits 2 q)
                    chunk = b.add(b.mul(half, c64(16)), b.mul(b.urem(q, c64(2)), c64(8)))
                    ql = b.gep(sb, [b.add(c64(_Q6_QL), b.mul(c64(32), chunk))])
                    qh = b.gep(sb, [b.add(c64(_Q6_QH), b.mul(c64(256), half))])
                    s_lo = splat(b, b.trunc(b.mul(b.udiv(q, c64(2)), c64(4)), I16), V16I16)
                    s_hi = splat(b, b.trunc(b.mul(q, c64(2)), I16), V16I16)
                    for c in range(8):
                        lo = _shr_mask(b, load(b, ql, 32 * c, V32I8), s_lo, 15)
                        hi = _shr_mask(b, load(b, qh, 32 * c, V32I8), s_hi, 3)
                        v = b.sub(b.or_(lo, b.shl(hi, ir.Constant(V32I8, [4] * 32))), ir.Constant(V32I8, [32] * 32))
                        b.store(v, _at(b, dst, 64 * c))
                elif qtype == "q8_0":
                    src = b.gep(rp, [b.add(b.mul(blk, c64(gb)), c64(codes))])
                    for c in range(8):
                        b.store(load(b, src, 32 * c, V32I8), _at(b, dst, 64 * c))
                else:  # chunk c: low nibbles elements 4 c .., high ones 16 + 4 c ..; q4_0 minus 8
                    src = b.gep(rp, [b.add(b.mul(blk, c64(gb)), c64(codes))])
                    for c in range(4):
                        v = load(b, src, 32 * c, V32I8)
                        lo, hi = nibble(b, v, 0), nibble(b, v, 1)
                        if qtype == "q4_0":
                            lo, hi = b.sub(lo, _EIGHT), b.sub(hi, _EIGHT)
                        b.store(lo, _at(b, dst, 64 * c))
                        b.store(hi, _at(b, dst, 64 * (4 + c)))
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(unpack)


_EIGHT = ir.Constant(V32I8, [8] * 32)


def _shr_mask(b, v, sh, mask):
    """(v >> sh) & mask for each byte of <32 x i8> v (shifted as 16-bit lanes, then masked)."""
    v = b.bitcast(b.lshr(b.bitcast(v, V16I16), sh), V32I8)
    return b.and_(v, ir.Constant(V32I8, [mask] * 32))


def _at(b, p, off):
    return b.bitcast(b.gep(p, [c64(off)]), V32I8.as_pointer())


# _unpack_row(kind, row, nb, bpan, h): row's codes -> half h of B tiles bpan, each AMX format's
_unpack_row = by_kind("amx_unpack", {KIND[q]: _unpack(q) for q in FORMATS})


@njit(**KW)
def panel(kind, data, g, bb, lut, bpan, dpan, mpan, span):
    """Groups g, g + 1 of q8.groups's layout (the second absent past the last) -> B tiles bpan [nb,
    8, 64] int8 (element 4 k4 + i of weight row r at [k4, 4 r + i]), d and the offset term
    (q4_1: m; q4_k: -(dmin m_j)) per block and row in dpan / mpan [nb, 16], the block's
    scales in span [nb, 2, 16] (q4_k: its 6-bit scale; q6_k: those of its two halves)."""
    nb = dpan.shape[0]
    for h in range(2):
        if g + h >= data.shape[0]:
            bpan[:, :, 32 * h : 32 * h + 32] = 0
            dpan[:, 8 * h : 8 * h + 8] = 0
            mpan[:, 8 * h : 8 * h + 8] = 0
            span[:, :, 8 * h : 8 * h + 8] = 0
            continue
        row = data[g + h]
        _unpack_row(kind, row, nb, bpan, h)
        for b in range(nb):
            if kind == Q6_K:  # q6_k: super-block b // 8, its scales 2 j, 2 j + 1 (int8)
                p, j = (b // 8) * bb, b % 8
                for r in range(8):
                    dpan[b, 8 * h + r] = _f16(row, p + 2 * r, lut)
                    mpan[b, 8 * h + r] = 0
                    for i in range(2):
                        v = np.int32(row[p + _Q6_SC + 16 * j + 2 * r + i])
                        span[b, i, 8 * h + r] = v - 256 if v > 127 else v
                continue
            if kind == Q4_K:  # q4_k: super-block b // 8, sub-block j = b % 8
                p, j = (b // 8) * bb, b % 8
                for r in range(8):
                    dpan[b, 8 * h + r] = _f16(row, p + 2 * r, lut)
                    dmin = _f16(row, p + 16 + 2 * r, lut)
                    span[b, 0, 8 * h + r] = row[p + 32 + 8 * j + r]
                    mpan[b, 8 * h + r] = -(dmin * np.float32(row[p + 96 + 8 * j + r]))
                continue
            p = b * bb
            for r in range(8):
                dpan[b, 8 * h + r] = _f16(row, p + 2 * r, lut)
                mpan[b, 8 * h + r] = _f16(row, p + 16 + 2 * r, lut) if kind == Q4_1 else 0


# ------------------------------------------------------------------ the tile loop (IR)


def _tmm(i):
    """Tile register i, as the AMX intrinsics take it (an i8 immediate)."""
    return ir.Constant(I8, i)


def _tiles(qtype):
    """An intrinsic tiles(cfg, xa, bpan, dpan, mpan, span, dx, sx, cbuf, y, o0, t_n): y[t, o0 ..
    o0 + 15] (those below y's width) for every x row t < t_n = its x tile (xa: tile_major's
    int8 [tiles, nb, 16, 32], dx / sx tile_major's f32 [tiles, nb, 16]) against the panel, in the module
    docstring's order; block b's sums go through C tile b % 4 to cbuf slot b % 4, issued AHEAD
    blocks before they are scaled (q6_k: its two C tiles, one a half-block, to two slots of
    cbuf, one block ahead), so tdps run while earlier sums are scaled (cbuf [5 x 16, 16] i32:
    the four slots, then the offset term's 16 x 16 f32). One call sweeps every x tile of a panel,
    so the tile configuration is loaded once a panel instead of once a tile, and it stores
    into y directly (docs/kernels.md: a third less time for q8_0)."""
    signed_w = qtype in ("q8_0", "q4_0", "q6_k")  # q4_1 / q4_k codes are unsigned nibbles
    dp_name = "llvm.x86.tdpbssd" if signed_w else "llvm.x86.tdpbsud"
    with_m = qtype in ("q4_1", "q4_k")

    def tiles(typingctx, cfg, xa, bpan, dpan, mpan, span, dx, sx, cbuf, y, o0, t_n):
        sig = types.void(cfg, xa, bpan, dpan, mpan, span, dx, sx, cbuf, y, o0, t_n)

        def codegen(context, b, signature, args):
            a = [context.make_array(signature.args[i])(context, b, args[i]) if i < 10 else None for i in range(12)]
            ptr = lambda i, ty=I8: b.bitcast(a[i].data, ty.as_pointer())  # noqa: E731
            o0, t_n = args[10], args[11]
            n_tiles = b.extract_value(a[1].shape, 0)
            nb = b.extract_value(a[6].shape, 1)
            ds = b.extract_value(a[6].strides, 0)  # bytes of a tile's scales: nb x 16 f32
            ys = b.extract_value(a[9].strides, 0)
            width = b.sub(b.extract_value(a[9].shape, 1), o0)
            full = b.icmp_signed(">=", width, c64(TILE))
            bp, cb, xp = ptr(2), ptr(8), ptr(1)
            mb = b.gep(cb, [c64(4096)])  # cbuf's last 1 KB: the offset term of the tile's rows
            dpf, mpf, spi = ptr(3, F32), ptr(4, F32), ptr(5, I32)
            yrow0 = b.gep(ptr(9), [b.mul(o0, c64(4))])
            call(b, "llvm.x86.ldtilecfg", ir.VoidType(), [ptr(0)])
            acc = [cgutils.alloca_once(b, V16F) for _ in range(TILE)]
            accm = [cgutils.alloca_once(b, V16F) for _ in range(TILE)] if with_m else None

            with cgutils.for_range(b, n_tiles) as tl:
                ti = tl.index
                t0 = b.mul(ti, c64(TILE))
                xbase = b.gep(xp, [b.mul(b.mul(ti, nb), c64(512))])
                dxb = b.gep(ptr(6), [b.mul(ti, ds)])
                sxb = b.gep(ptr(7), [b.mul(ti, ds)])
                for v in acc:
                    b.store(ir.Constant(V16F, None), v)

                def issue(blk, slot):  # C = A_blk B_blk in tile `slot`, stored to cbuf slot `slot`
                    tc, ta, tb = _tmm(slot), _tmm(4 + slot % 2), _tmm(6 + slot % 2)
                    call(b, "llvm.x86.tilezero", ir.VoidType(), [tc])
                    xa_ = b.gep(xbase, [b.mul(blk, c64(512))])
                    call(b, "llvm.x86.tileloadd64", ir.VoidType(), [ta, xa_, c64(32)])
                    call(b, "llvm.x86.tileloadd64", ir.VoidType(), [tb, b.gep(bp, [b.mul(blk, c64(512))]), c64(64)])
                    call(b, dp_name, ir.VoidType(), [tc, ta, tb])
                    call(b, "llvm.x86.tilestored64", ir.VoidType(), [tc, b.gep(cb, [c64(1024 * slot)]), c64(64)])

                def issue_q6(blk, slot):  # a block's halves on tiles 0 and 1, to cbuf slot `slot`
                    for h in range(2):
                        tc, ta, tb = _tmm(h), _tmm(2 + h), _tmm(4 + h)
                        call(b, "llvm.x86.tilezero", ir.VoidType(), [tc])
                        xa_ = b.gep(xbase, [b.add(b.mul(blk, c64(512)), c64(16 * h))])
                        call(b, "llvm.x86.tileloadd64", ir.VoidType(), [ta, xa_, c64(32)])
                        wb = b.gep(bp, [b.add(b.mul(blk, c64(512)), c64(256 * h))])
                        call(b, "llvm.x86.tileloadd64", ir.VoidType(), [tb, wb, c64(64)])
                        call(b, dp_name, ir.VoidType(), [tc, ta, tb])
                        at = c64(2048 * slot + 1024 * h)
                        call(b, "llvm.x86.tilestored64", ir.VoidType(), [tc, b.gep(cb, [at]), c64(64)])

                def vec(p, ty, blk, at=0):
                    return b.load(
                        b.bitcast(b.gep(p, [b.add(b.mul(blk, c64(32 if p is spi else 16)), c64(at))]), ty.as_pointer()),
                        align=4,
                    )

                def scale(blk, h):  # the block's sums (cbuf slot h; q6_k: slot pair h) into the accumulators
                    base = 2048 * h if qtype == "q6_k" else 1024 * h
                    d = vec(dpf, V16F, blk)
                    # the 6-bit scales times the sums in f32: exact (|I| < 2^24, so float(I) is
                    # the integer), and one dual-port op where vpmulld takes two on one port
                    if qtype in ("q4_k", "q6_k"):
                        sc = b.sitofp(vec(spi, V16I32, blk), V16F)
                    if qtype == "q6_k":
                        sc1 = b.sitofp(vec(spi, V16I32, blk, 16), V16F)
                    dxp = opaque(b, b.gep(dxb, [b.mul(blk, c64(64))]))  # the block's 16 dx
                    for t in range(TILE):
                        sp = b.gep(cb, [c64(base + 64 * t)])
                        s = b.sitofp(b.load(b.bitcast(sp, V16I32.as_pointer()), align=4), V16F)
                        if qtype == "q4_k":
                            s = b.fmul(s, sc)
                        elif qtype == "q6_k":  # I = sc[2j] s(first 16) + sc[2j + 1] s(last 16)
                            s1 = b.load(b.bitcast(b.gep(cb, [c64(base + 1024 + 64 * t)]), V16I32.as_pointer()), align=4)
                            s = fma(b, b.sitofp(s1, V16F), sc1, b.fmul(s, sc))
                        dxt = b.load(b.bitcast(b.gep(dxp, [c64(4 * t)]), F32.as_pointer()))
                        dd = b.fmul(d, splat16(b, dxt))
                        b.store(fma(b, s, dd, b.load(acc[t])), acc[t])

                # the offset term's chain runs on its own, before the blocks (same order, so the
                # same bits), sparing the block loop 16 more accumulators
                if with_m:
                    for v in accm:
                        b.store(ir.Constant(V16F, None), v)
                    with cgutils.for_range(b, nb) as loop:
                        m = vec(mpf, V16F, loop.index)
                        sxp = opaque(b, b.gep(sxb, [b.mul(loop.index, c64(64))]))
                        for t in range(TILE):
                            sxt = b.load(b.bitcast(b.gep(sxp, [c64(4 * t)]), F32.as_pointer()))
                            b.store(fma(b, m, splat16(b, sxt), b.load(accm[t])), accm[t])
                    for t in range(TILE):
                        b.store(b.load(accm[t]), b.bitcast(b.gep(mb, [c64(64 * t)]), V16F.as_pointer()), align=4)
                if qtype == "q6_k":  # block b + 1's two tdps issued before block b is scaled
                    pairs = b.udiv(nb, c64(2))
                    issue_q6(c64(0), 0)
                    with cgutils.for_range(b, pairs) as loop:
                        b0 = b.mul(loop.index, c64(2))
                        b1 = b.add(b0, c64(1))
                        issue_q6(b1, 1)
                        scale(b0, 0)
                        with b.if_then(b.icmp_unsigned("<", b.add(b1, c64(1)), nb)):
                            issue_q6(b.add(b1, c64(1)), 0)
                        scale(b1, 1)
                    with b.if_then(b.icmp_unsigned("!=", b.mul(pairs, c64(2)), nb)):
                        scale(b.sub(nb, c64(1)), 0)
                else:  # block b + AHEAD issued before block b is scaled; four blocks a turn (tile
                    # registers are immediates)
                    for j in range(AHEAD):
                        with b.if_then(b.icmp_unsigned("<", c64(j), nb)):
                            issue(c64(j), j)
                    with cgutils.for_range(b, b.udiv(b.add(nb, c64(3)), c64(4))) as loop:
                        for j in range(4):
                            blk = b.add(b.mul(loop.index, c64(4)), c64(j))
                            with b.if_then(b.icmp_unsigned("<", blk, nb)):
                                with b.if_then(b.icmp_unsigned("<", b.add(blk, c64(AHEAD)), nb)):
                                    issue(b.add(blk, c64(AHEAD)), (j + AHEAD) % 4)
                                scale(blk, j)
                for t in range(TILE):  # rows past t_n are padding; lanes past y's width too
                    row = b.add(t0, c64(t))
                    with b.if_then(b.icmp_signed("<", row, t_n)):
                        v = b.load(acc[t])
                        if with_m:
                            v = b.fadd(v, b.load(b.bitcast(b.gep(mb, [c64(64 * t)]), V16F.as_pointer()), align=4))
                        yp = b.gep(yrow0, [b.mul(row, ys)])
                        with b.if_else(full) as (whole, part):
                            with whole:
                                b.store(v, b.bitcast(yp, V16F.as_pointer()), align=4)
                            with part:
                                yf = b.bitcast(yp, F32.as_pointer())
                                with cgutils.for_range(b, width) as lane:
                                    b.store(b.extract_element(v, lane.index), b.gep(yf, [lane.index]))
            call(b, "llvm.x86.tilerelease", ir.VoidType(), [])
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(tiles)


_format_tiles = by_kind("amx_tiles", {KIND[q]: _tiles(q) for q in FORMATS})  # each AMX format's tiles


@njit(**KW)
def _run_tiles(kind, cfg, x, pan, cbuf, y, o0, t_n):
    # the tiles of kind: x (xa, dx, sx) in tile_major's layout, pan (bpan, dpan, mpan, span) panel's
    xa, dx, sx = x
    bpan, dpan, mpan, span = pan
    _format_tiles(kind, cfg, xa, bpan, dpan, mpan, span, dx, sx, cbuf, y, o0, t_n)


def tile_major(xq, dx, sx):
    """quantize's row-major (xq, dx, sx), T a multiple of 16, in the tiles' layout:
    xq int8 [T, K] -> [T / 16, K / 32, 16, 32], each 16-row tile's 32-value block contiguous, so
    an A tile loads 8 whole cache lines (from xq's rows it took 16 half lines); dx, sx f32 [T, K
    / 32] -> [T / 16, K / 32, 16], a tile's scales for a block side by side, so the scaling loop
    finds row t's at a constant offset from one register. q8.quantized.quantize_tiles writes
    this layout directly; this is the reference its tests compare with."""
    tp, k = xq.shape
    xa = np.ascontiguousarray(xq.reshape(tp // TILE, TILE, k // 32, 32).transpose(0, 2, 1, 3))
    return (xa, *(np.ascontiguousarray(v.reshape(tp // TILE, TILE, k // 32).transpose(0, 2, 1)) for v in (dx, sx)))


@njit(parallel=True, **KW)
def _matmul(kind, cfg, data, bb, lut, xa, dx, sx, y):
    """y [T, O] for every x row (xa, dx, sx: tile_major's layout, pad rows zero) and
    q8.groups groups data, 16 weight rows (two groups) a parallel item."""
    t_n = y.shape[0]
    nb = dx.shape[1]
    for pi in prange((data.shape[0] + 1) // 2):
        bpan = np.empty((nb, 8, 64), np.int8)
        dpan = np.empty((nb, TILE), np.float32)
        mpan = np.empty((nb, TILE), np.float32)
        span = np.empty((nb, 2, TILE), np.int32)
        cbuf = np.empty((5 * TILE, TILE), np.int32)
        panel(kind, data, 2 * pi, bb, lut, bpan, dpan, mpan, span)
        _run_tiles(kind, cfg, (xa, dx, sx), (bpan, dpan, mpan, span), cbuf, y, TILE * pi, t_n)


def matmul(xa, dxa, sxa, data, qtype, y):
    """y [T, O] = the q8-mode product of quantised x rows in the tiles' layout (tile_major's,
    which q8.quantized.quantize_tiles writes; pad rows zero) and a weight's q8.groups groups
    data (qtype one of FORMATS; O at most 8 per group)."""
    cfg = CONFIG_Q6_K if qtype == "q6_k" else CONFIG
    _matmul(KIND[qtype], cfg, data, GROUP_BYTES[qtype], F16_LUT, xa, dxa, sxa, y)
    return y
