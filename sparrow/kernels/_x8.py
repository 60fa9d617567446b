"""q8-mode decode matvecs over q8_0 / q4_0 / q4_1 rows kept in groups of 8, interleaved.

A block dot product against one row ends in 8 int32 lanes that still have to be summed
across; llama.cpp's AVX2 "repack" kernels avoid that by storing 8 rows' blocks side by side.
Here, likewise, group g holds rows 8 g .. 8 g + 7 and its block b is, for 8 rows at once:
  the 8 f16 scales d (row r at byte 2 r), then q4_1 only the 8 f16 offsets m, then the
  codes in chunks of 4 bytes: chunk c holds row r's stored code bytes 4 c .. 4 c + 3 at
  byte 4 r (4 chunks of a q4 block's 16 nibble bytes, 8 of a q8_0 block's 32 bytes).
Each chunk meets 4 bytes of x broadcast to all 8 lanes, so pmaddubsw + pmaddwd leave lane r
holding row r's sum: no horizontal sums, x read once for 8 rows. A q4 chunk's low nibbles
are elements 4c..4c+3 and its high nibbles 16 + 4c..; a block's 4 chunks, low and high, add
up in int16 (16 products of |15 * 127| each, <= 30480), so one pmaddwd a block.
One core, Qwen3-1.7B's lm_head in cache: q4_0 51.6 vs 20.5 GMAC/s for the row-at-a-time
kernel (_q8act.emit_row); streaming from memory 14.9 vs 10.8 GB/s.

The order (the documented one of activations="q8" for these formats; x quantised as
_q8act.quantize does), per row and block b:
  s = sum over the block of code_w * code_x, an exact integer (q4_0's codes are the
      nibbles minus 8: s = sum(nibble * code_x) - 8 sum(code_x); q4_1's the nibbles; q8_0's
      the bytes)
  acc  = fma(float(s), d * dx[b], acc)
  q4_1 only: accm = fma(m, sx[b], accm)
block after block from acc = accm = 0; result acc (q4_1: acc + accm). Integer sums are
exact, so every CPU path (AVX2 or the generic vector code) gives the same bits, and a row's
order depends only on its length: the same bits whatever its group, T or thread count.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels._ir import F32, I8, I16, I32, I64, shuffle, splat16, zeroed
from sparrow.kernels._kq8 import AVX2, V8F, V8I32, V16I16, V32I8, V32I32
from sparrow.kernels._kq8 import call as _call

# the x8 kinds continue _widen.KIND (0-10); X8_KIND[qtype] is the interleaved form of qtype
X8_KIND = {"q8_0": 11, "q4_0": 12, "q4_1": 13}
X8_FIRST = min(X8_KIND.values())  # kinds from here on are interleaved groups
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # one row's block, as stored
GROUP = 8
_V8H = ir.VectorType(ir.HalfType(), 8)
_V32I16 = ir.VectorType(I16, 32)


def interleave(data: np.ndarray, qtype: str) -> np.ndarray:
    """Stored rows [O, nb * bb] -> groups [ceil(O / 8), nb * 8 * bb] in the layout above (the
    last group padded with zero rows, whose scales 0 make them 0)."""
    o_n, row_bytes = data.shape
    bb = BLOCK_BYTES[qtype]
    out = np.zeros((-(-o_n // GROUP), row_bytes * GROUP), np.uint8)
    _interleave(data, out, bb, 4 if qtype == "q4_1" else 2)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _interleave(data, out, bb, head):
    """data's rows into out's groups; head: bytes of scales ahead of a block's codes (d, or d
    and m), which go 2 bytes a row, then the codes 4 bytes a row (1.7B's weights: ~1 GB/s,
    numpy's transposes ~0.15)."""
    o_n = data.shape[0]
    nb = data.shape[1] // bb
    for g in prange(out.shape[0]):
        for r in range(min(GROUP, o_n - GROUP * g)):
            row = data[GROUP * g + r]
            for blk in range(nb):
                src, dst = blk * bb, blk * bb * GROUP
                for j in range(head // 2):  # d, then m
                    out[g, dst + 16 * j + 2 * r] = row[src + 2 * j]
                    out[g, dst + 16 * j + 2 * r + 1] = row[src + 2 * j + 1]
                for c in range((bb - head) // 4):
                    for i in range(4):
                        out[g, dst + 8 * head + 32 * c + 4 * r + i] = row[src + head + 4 * c + i]


# ------------------------------------------------------------------ IR


def _c64(v):
    return ir.Constant(I64, v)


def _splat(b, v, vty):
    und = ir.Constant(vty, ir.Undefined)
    return shuffle(b, b.insert_element(und, v, ir.Constant(I32, 0)), und, [0] * vty.count)


def _bcast4(b, p):
    """The 4 bytes at p (i8*) repeated in all 8 i32 lanes, as <32 x i8>."""
    return b.bitcast(_splat(b, b.load(b.bitcast(p, I32.as_pointer()), align=1), V8I32), V32I8)


def _maddubs(b, u, s):
    """pmaddubsw without its saturation (every caller's pair sums fit int16): <32 x i8> u
    unsigned, s signed -> <16 x i16>, element i = u[2i] s[2i] + u[2i+1] s[2i+1]."""
    if AVX2:
        return _call(b, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [u, s])
    p = b.mul(b.zext(u, _V32I16), b.sext(s, _V32I16))
    return b.add(shuffle(b, p, p, range(0, 32, 2)), shuffle(b, p, p, range(1, 32, 2)))


def _pairs32(b, v):
    """<16 x i16> -> <8 x i32>, lane j = v[2j] + v[2j + 1] (pmaddwd by ones)."""
    if AVX2:
        return _call(b, "llvm.x86.avx2.pmadd.wd", V8I32, [v, ir.Constant(V16I16, [1] * 16)])
    w = b.sext(v, ir.VectorType(I32, 16))
    return b.add(shuffle(b, w, w, range(0, 16, 2)), shuffle(b, w, w, range(1, 16, 2)))


def _block_sums(qtype, b, p, xbs):
    """[<8 x i32>] per x row: lane r = row r's sum of code_w * code_x over the block at p
    (i8*), that x row's codes at xbs[t] (before q4_0's -8 sum(code_x)). The weight bytes are
    loaded and unpacked once for all x rows."""
    if qtype == "q8_0":
        tots = [None] * len(xbs)
        for c in range(8):
            w = b.load(b.bitcast(b.gep(p, [_c64(16 + 32 * c)]), V32I8.as_pointer()), align=1)
            u = _call(b, "llvm.abs.v32i8", V32I8, [w, ir.Constant(ir.IntType(1), 0)]) if AVX2 else None
            for t, xb in enumerate(xbs):
                x = _bcast4(b, b.gep(xb, [_c64(4 * c)]))
                if AVX2:  # |w| * (x with w's sign): |w| <= 128 enters pmaddubsw unsigned
                    s = _pairs32(b, _maddubs(b, u, _call(b, "llvm.x86.avx2.psign.b", V32I8, [x, w])))
                else:
                    pr = b.mul(b.sext(w, V32I32), b.sext(x, V32I32))
                    q = [shuffle(b, pr, pr, range(i, 32, 4)) for i in range(4)]
                    s = b.add(b.add(q[0], q[1]), b.add(q[2], q[3]))
                tots[t] = s if tots[t] is None else b.add(tots[t], s)  # int32: pair sums reach 32512
        return tots
    at = 16 if qtype == "q4_0" else 32
    m15 = ir.Constant(V32I8, [15] * 32)
    tots = [None] * len(xbs)
    for c in range(4):
        v = b.load(b.bitcast(b.gep(p, [_c64(at + 32 * c)]), V32I8.as_pointer()), align=1)
        lo = b.and_(v, m15)  # elements 4c .. 4c + 3 of each row
        hi = b.and_(b.bitcast(b.lshr(b.bitcast(v, V16I16), ir.Constant(V16I16, [4] * 16)), V32I8), m15)  # 16 + 4c ..
        for t, xb in enumerate(xbs):
            s = b.add(_maddubs(b, lo, _bcast4(b, b.gep(xb, [_c64(4 * c)]))),
                      _maddubs(b, hi, _bcast4(b, b.gep(xb, [_c64(16 + 4 * c)]))))  # fmt: skip
            tots[t] = s if tots[t] is None else b.add(tots[t], s)  # int16: |tot| <= 16 * 15 * 127
    return [_pairs32(b, tot) for tot in tots]


def emit_tile(qtype, mr):
    """emit(b, group pointer, [x codes], [dx], [sx], [8 sum(code_x) per block] (mr x rows'),
    nb) -> [<8 x float>] per x row (lane r: row 8 g + r), in the order of the module
    docstring: each (x row, weight row) the same whatever mr."""
    gb = GROUP * BLOCK_BYTES[qtype]

    def emit(b, gp, xps, dxps, sxps, bsps, nb):
        acc, accm = [zeroed(b, V8F) for _ in range(mr)], [zeroed(b, V8F) for _ in range(mr)]
        with cgutils.for_range(b, nb) as loop:
            blk = loop.index
            p = b.gep(gp, [b.mul(blk, _c64(gb))])
            sums = _block_sums(qtype, b, p, [b.gep(xp, [b.mul(blk, _c64(32))]) for xp in xps])
            d = b.fpext(b.load(b.bitcast(p, _V8H.as_pointer()), align=1), V8F)
            if qtype == "q4_1":
                m = b.fpext(b.load(b.bitcast(b.gep(p, [_c64(16)]), _V8H.as_pointer()), align=1), V8F)
            for t in range(mr):
                s = sums[t]
                if qtype == "q4_0":
                    s = b.sub(s, _splat(b, b.load(b.gep(bsps[t], [blk])), V8I32))
                dd = b.fmul(d, splat16(b, b.load(b.gep(dxps[t], [blk])), 8))
                b.store(_call(b, "llvm.fma.v8f32", V8F, [b.sitofp(s, V8F), dd, b.load(acc[t])]), acc[t])
                if qtype == "q4_1":
                    sx = splat16(b, b.load(b.gep(sxps[t], [blk])), 8)
                    b.store(_call(b, "llvm.fma.v8f32", V8F, [m, sx, b.load(accm[t])]), accm[t])
        if qtype == "q4_1":
            return [b.fadd(b.load(acc[t]), b.load(accm[t])) for t in range(mr)]
        return [b.load(acc[t]) for t in range(mr)]

    return emit


MR = 4  # x rows a tile reads each unpacked weight chunk for (batched decode, prefill)


def make_groups(qtype):
    """An intrinsic groups(data, g0, g1, xq, dx, sx, bs, y, t0, mr, o_n): y[t, o] for x rows
    t0 .. t0 + mr - 1 (1 <= mr <= MR) and the rows o < o_n of groups g0 .. g1 - 1 of data
    (interleave's [G, group bytes]); xq int8 [T, K], dx / sx f32 and bs int32 (8 sum(code_x)
    per block, read by q4_0) [T, K / 32] as _q8act.quantize gives them, y f32 [T, >= o_n].
    Each mr has its own loop (its accumulators in registers), chosen at run time."""

    def groups(typingctx, data, g0, g1, xq, dx, sx, bs, y, t0, mr, o_n):
        if not (isinstance(data, types.Array) and data.ndim == 2):
            return None
        sig = types.none(data, g0, g1, xq, dx, sx, bs, y, t0, mr, o_n)

        def codegen(context, builder, signature, args):
            b = builder
            d = context.make_array(signature.args[0])(context, b, args[0])
            arrs = [context.make_array(t)(context, b, a) for t, a in zip(signature.args[3:8], args[3:8])]
            t0, o_n = args[8], args[10]
            stride = b.extract_value(d.strides, 0)
            base = b.bitcast(d.data, I8.as_pointer())
            nb = b.extract_value(arrs[1].shape, 1)
            ystride = b.extract_value(arrs[4].strides, 1)
            for m in range(1, MR + 1):
                with b.if_then(b.icmp_signed("==", args[9], _c64(m))):
                    _tile_loop(b, emit_tile(qtype, m), m, base, stride, arrs, t0, args[1], args[2], nb, ystride, o_n)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(groups)


def _tile_loop(b, emit, mr, base, stride, arrs, t0, g0, g1, nb, ystride, o_n):
    """The IR of make_groups' loop over groups for mr x rows."""

    def rows(arr, ty):  # pointers to rows t0 .. t0 + mr - 1 of a 2-D array
        at, st = b.bitcast(arr.data, I8.as_pointer()), b.extract_value(arr.strides, 0)
        return [b.bitcast(b.gep(at, [b.mul(b.add(t0, _c64(t)), st)]), ty) for t in range(mr)]

    xps = rows(arrs[0], I8.as_pointer())
    dxps, sxps = rows(arrs[1], F32.as_pointer()), rows(arrs[2], F32.as_pointer())
    bsps, yps = rows(arrs[3], I32.as_pointer()), rows(arrs[4], I8.as_pointer())
    with cgutils.for_range_slice(b, g0, g1, _c64(1)) as (g, _):
        vs = emit(b, b.gep(base, [b.mul(g, stride)]), xps, dxps, sxps, bsps, nb)
        o = b.mul(g, _c64(GROUP))
        full = b.and_(b.icmp_signed("<=", b.add(o, _c64(GROUP)), o_n), b.icmp_signed("==", ystride, _c64(4)))
        with b.if_else(full) as (then, other):
            with then:
                for v, yp in zip(vs, yps):
                    b.store(v, b.bitcast(b.gep(yp, [b.mul(o, _c64(4))]), V8F.as_pointer()), align=4)
            with other:  # the padded last group, or a strided y: lane by lane
                n = b.sub(o_n, o)
                with cgutils.for_range(b, b.select(b.icmp_signed("<", n, _c64(GROUP)), n, _c64(GROUP))) as lp:
                    for v, yp in zip(vs, yps):
                        at = b.gep(yp, [b.mul(b.add(o, lp.index), ystride)])
                        b.store(b.extract_element(v, lp.index), b.bitcast(at, F32.as_pointer()))


groups_q8_0, groups_q4_0, groups_q4_1 = (make_groups(q) for q in ("q8_0", "q4_0", "q4_1"))


@njit(cache=True, nogil=True)
def _tile(data, kind, g0, g1, xq, dx, sx, bs, y, t0, mr, o_n):
    """y[t0 : t0 + mr, rows of groups g0 .. g1 - 1] (mr <= MR)."""
    if kind == 12:
        groups_q4_0(data, g0, g1, xq, dx, sx, bs, y, t0, mr, o_n)
    elif kind == 13:
        groups_q4_1(data, g0, g1, xq, dx, sx, bs, y, t0, mr, o_n)
    else:
        groups_q8_0(data, g0, g1, xq, dx, sx, bs, y, t0, mr, o_n)


GROUP_CHUNK = 16  # groups (128 rows) a tile pass covers before the next x rows, when T > MR


@njit(cache=True, nogil=True)
def x8_rows(data, kind, xq, dx, sx, bs, y, g0, g1):
    """y[t, o] for every x row t and the rows o < y.shape[1] of groups g0 .. g1 - 1: x rows
    in tiles of MR (the last one smaller), a chunk of groups at a time so it stays in cache
    while the tiles pass."""
    t_n, o_n = xq.shape[0], y.shape[1]
    step = max(g1 - g0, 1) if t_n <= MR else GROUP_CHUNK
    for c in range(g0, g1, step):
        for t0 in range(0, t_n, MR):
            _tile(data, kind, c, min(g1, c + step), xq, dx, sx, bs, y, t0, min(MR, t_n - t0), o_n)
