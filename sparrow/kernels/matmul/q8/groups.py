"""q8-mode matvecs over q8_0 / q4_0 / q4_1 / q5_0 / q5_1 rows kept in groups of 8, interleaved.

A block dot product against one row ends in 8 int32 lanes that still have to be summed
across; llama.cpp's AVX2 "repack" kernels avoid that by storing 8 rows' blocks side by side.
Here, likewise, group g holds rows 8 g .. 8 g + 7 and its block b is, for 8 rows at once:
  the 8 f16 scales d (row r at byte 2 r), then q4_1 / q5_1 only the 8 f16 offsets m, then
  q5 only the 8 rows' 32 high bits (qh, row r's u32 at 4 r), then the codes in chunks of 4
  bytes: chunk c holds row r's stored code bytes 4 c .. 4 c + 3 at byte 4 r (4 chunks of a
  q4 / q5 block's 16 nibble bytes, 8 of a q8_0 block's 32 bytes).
Each chunk meets 4 bytes of x broadcast to all 8 lanes, so pmaddubsw + pmaddwd leave lane r
holding row r's sum: no horizontal sums, x read once for 8 rows. A q4 chunk's low nibbles
are elements 4c..4c+3 and its high nibbles 16 + 4c..; a block's 4 chunks, low and high, add
up in int16 (16 products of |15 * 127| each, <= 30480), so one pmaddwd a block (q5: one per
2 chunks, codes up to 31). q5's fifth bits come from qh by a byte shuffle and a bit test.
CPUs with AVX-VNNI or AVX512-VNNI take vpdpbusd instead (pmaddubsw + pmaddwd + paddd in one
instruction, the same integers), aarch64 CPUs with dotprod sdot (intdot.DOT4), in two
accumulator chains a block since each dot waits for the last. The K-quant groups
(q8.kquant_groups) gained nothing from vpdpbusd and keep pmaddubsw. Speeds against a
row-at-a-time kernel and between these instruction choices: docs/kernels.md.

The order (the documented one of activations="q8" for these formats; x quantised as
q8.quantized.quantize does), per row and block b:
  s = sum over the block of code_w * code_x, an exact integer (q4_0's codes are the
      nibbles minus 8: s = sum(nibble * code_x) - 8 sum(code_x); q4_1's the nibbles; q5_1's
      the nibbles plus 16 for the fifth bit (bit j of qh for element j), q5_0's those minus
      16; q8_0's the bytes)
  acc  = fma(float(s), d * dx[b], acc)
  q4_1 / q5_1 only: accm = fma(m, sx[b], accm)
block after block from acc = accm = 0; result acc (q4_1 / q5_1: acc + accm). Integer sums are
exact, so every CPU path (AVX2 or the generic vector code) gives the same bits, and a row's
order depends only on its length: the same bits whatever its group, T or thread count.
"""

from functools import partial

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.arch.arm64 import smmla
from sparrow.kernels.formats import BLOCK_BYTES  # one row's block, as stored
from sparrow.kernels.intdot import AVX2, DOT4, I8MM, absb, bcast4, dpbssd, dpbusd, maddubs, maddwd, splat
from sparrow.kernels.ir import F32, I8, I32, I64, V8F, V8I32, V32I8, c64, fma, shuffle, splat16, zeroed

GROUP = 8
# A stored block's byte ranges (src, dst, length, width): bytes src .. src + length - 1 of a
# row's block go, `width` bytes a row, to offset 8 dst of the group's block (the 8 rows' first
# width bytes, then their next width bytes, ...). q4_k / q5_k's 12 packed scale bytes are
# written apart, unpacked (_k_scales): group bytes 32 + 8 j + r (scale j of row r), 96 + 8 j
# + r (min j). q6_k moves d and its 16 scales (pairs: 2 j, 2 j + 1) ahead of the codes.
REGIONS = {
    "q8_0": ((0, 0, 2, 2), (2, 2, 32, 4)),
    "q4_0": ((0, 0, 2, 2), (2, 2, 16, 4)),
    "q4_1": ((0, 0, 4, 2), (4, 4, 16, 4)),
    "q5_0": ((0, 0, 2, 2), (2, 2, 4, 4), (6, 6, 16, 4)),
    "q5_1": ((0, 0, 4, 2), (4, 4, 4, 4), (8, 8, 16, 4)),
    "q4_k": ((0, 0, 4, 2), (16, 20, 128, 4)),
    "q5_k": ((0, 0, 4, 2), (16, 20, 32, 4), (48, 52, 128, 4)),
    "q6_k": ((208, 0, 2, 2), (192, 2, 16, 2), (0, 18, 128, 4), (128, 146, 64, 4)),
}
GROUP_BYTES = {q: GROUP * (r[-1][1] + r[-1][2]) for q, r in REGIONS.items()}  # a group's block
assert all(w in (2, 4) for rs in REGIONS.values() for *_, w in rs)  # the widths _interleave copies


CHUNK_BYTES = 32 << 20  # stored bytes interleave reads between two calls of its `done`


def interleave(data: np.ndarray, qtype: str, done=None) -> np.ndarray:
    """Stored rows [O, nb * bb] -> groups [ceil(O / 8), nb * group bytes] in the layout above
    (the last group padded with zero rows, whose scales 0 make them 0). Rows go in chunks of
    about CHUNK_BYTES, done(rows) hearing of each once it is copied: the q8 mode drops a file
    mapping's pages there, so a large matrix (a tied head: the embedding table) is never
    resident twice at load."""
    o_n, row_bytes = data.shape
    nb = row_bytes // BLOCK_BYTES[qtype]
    out = np.zeros((-(-o_n // GROUP), nb * GROUP_BYTES[qtype]), np.uint8)
    regions = np.array(REGIONS[qtype], np.int64)
    step = max(1, CHUNK_BYTES // max(1, GROUP * row_bytes)) * GROUP  # whole groups
    for a in range(0, o_n, step):
        rows, groups = data[a : a + step], out[a // GROUP : (a + step) // GROUP]
        _interleave(rows, groups, BLOCK_BYTES[qtype], GROUP_BYTES[qtype], regions)
        if qtype in ("q4_k", "q5_k"):
            _k_scales(rows, groups, BLOCK_BYTES[qtype], GROUP_BYTES[qtype])
        if done is not None:
            done(rows)
    return out


def _mover(bits):
    """An intrinsic move(src, s, dst, d): the `bits`-bit value at byte s of uint8 array src to
    byte d of dst, one unaligned load and store (a numba byte loop made each access a separate
    byte move with its own negative-index check: ~1 GB/s against ~2.3-3x that here)."""

    @intrinsic
    def move(typingctx, src, s, dst, d):
        def codegen(context, builder, signature, args):
            sa = context.make_array(signature.args[0])(context, builder, args[0])
            da = context.make_array(signature.args[2])(context, builder, args[2])
            ptr = ir.IntType(bits).as_pointer()
            v = builder.load(builder.bitcast(builder.gep(sa.data, [args[1]]), ptr), align=1)
            builder.store(v, builder.bitcast(builder.gep(da.data, [args[3]]), ptr), align=1)
            return context.get_dummy_value()

        return types.void(src, types.int64, dst, types.int64), codegen

    return move


_move4, _move2 = _mover(32), _mover(16)


@njit(parallel=True, cache=True, nogil=True)
def _interleave(data, out, bb, gb, regions):
    """data's rows into out's groups, region by region: each region's runs of 4 (or 2) bytes a
    row, one move each (_mover). One core, warm buffers: q4_0 1.1 -> 2.3 GB/s, q4_k 1.3 -> 3.9,
    q6_k 1.2 -> 3.9."""
    o_n = data.shape[0]
    nb = data.shape[1] // bb
    for g in prange(out.shape[0]):
        orow = out[g]
        for r in range(min(GROUP, o_n - GROUP * g)):
            row = data[GROUP * g + r]
            for k in range(regions.shape[0]):
                s0, d0, n, w = regions[k, 0], GROUP * regions[k, 1], regions[k, 2], regions[k, 3]
                for blk in range(nb):
                    s, o = s0 + blk * bb, d0 + w * r + blk * gb
                    if w == 4:
                        for f in range(n // 4):
                            _move4(row, s + 4 * f, orow, o + GROUP * 4 * f)
                    else:  # width 2
                        for f in range(n // 2):
                            _move2(row, s + 2 * f, orow, o + GROUP * 2 * f)


@njit(parallel=True, cache=True, nogil=True)
def _k_scales(data, out, bb, gb):
    """q4_k / q5_k: each block's 6-bit scales and mins (bytes 4 .. 15), unpacked as ggml's
    get_scale_min_k4, to group bytes 32 + 8 j + r and 96 + 8 j + r."""
    o_n = data.shape[0]
    for g in prange(out.shape[0]):
        for r in range(min(GROUP, o_n - GROUP * g)):
            row = data[GROUP * g + r]
            for blk in range(data.shape[1] // bb):
                q, o = row[blk * bb + 4 : blk * bb + 16], blk * gb
                for j in range(8):
                    if j < 4:
                        sc, m = q[j] & 63, q[j + 4] & 63
                    else:
                        sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4)
                        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
                    out[g, o + 32 + 8 * j + r] = sc
                    out[g, o + 96 + 8 * j + r] = m


# ------------------------------------------------------------------ IR

V8H = ir.VectorType(ir.HalfType(), 8)


def load(b, p, at, ty):
    """A value of type ty at byte `at` (an int, or a run-time i64) of p (i8*), unaligned."""
    at = c64(at) if isinstance(at, int) else at
    return b.load(b.bitcast(b.gep(p, [at]), ty.as_pointer()), align=1)


CODES_AT = {"q8_0": 16, "q4_0": 16, "q4_1": 32, "q5_0": 48, "q5_1": 64}  # a group block's code chunks
QH_AT = {"q5_0": 16, "q5_1": 32}  # q5's high bits: row r's little-endian u32 at 4 r


def fifth_bits(b, qh, c, high):
    """q5's fifth bits for chunk c's low (high = 0) or high nibbles, as 16 or 0 per byte:
    qh holds each row's u32 in 4 bytes (<4 n x i8>, n rows); byte k of row r becomes bit
    16 high + 4 c + k of that u32, which is in its byte 2 high + c // 2."""
    n = qh.type.count
    at = 2 * high + c // 2
    v = shuffle(b, qh, qh, [4 * (i // 4) + at for i in range(n)])  # the byte to every lane of its row
    bits = b.and_(v, ir.Constant(qh.type, [1 << (4 * (c % 2) + i % 4) for i in range(n)]))
    zero = ir.Constant(qh.type, [0] * n)
    return b.select(b.icmp_unsigned("!=", bits, zero), ir.Constant(qh.type, [16] * n), zero)


def codes5(b, v, qh, c, high):
    """Chunk c's q4 / q5 codes, unsigned: the low or high nibbles of v, plus the fifth bits
    when qh (q5) is given."""
    w = nibble(b, v, high)
    return w if qh is None else b.or_(w, fifth_bits(b, qh, c, high))


def _block_dots(qtype, b, p, xbs):
    """[<8 x i32>] per x row: lane r = row r's sum of code_w * code_x over the block at p
    (i8*), that x row's codes at xbs[t] (q4 / q5 codes unsigned: before q4_0's -8 sum(code_x)
    and q5_0's -16). The weight bytes are loaded and unpacked once for all x rows. With i8mm,
    pairs of x rows take smmla (_block_mmla), an odd last one sdot."""
    if I8MM and len(xbs) >= 2:
        n = len(xbs) // 2 * 2
        return _block_mmla(qtype, b, p, xbs[:n]) + (_block_dots_dot(qtype, b, p, xbs[n:]) if n < len(xbs) else [])
    return _block_dots_dot(qtype, b, p, xbs)


def _code_chunks(qtype, b, p):
    """A block's weight codes as 8 chunks (k, <32 x i8>): row r's elements k .. k + 3 at bytes
    4 r .. 4 r + 3 (q4 / q5 unsigned, unpacked from the nibbles and qh)."""
    if qtype == "q8_0":
        return [(4 * c, load(b, p, CODES_AT[qtype] + 32 * c, V32I8)) for c in range(8)]
    at = CODES_AT[qtype]
    qh = load(b, p, QH_AT[qtype], V32I8) if qtype in QH_AT else None
    out = []
    for c in range(4):
        v = load(b, p, at + 32 * c, V32I8)
        out += [(4 * c, codes5(b, v, qh, c, 0)), (16 + 4 * c, codes5(b, v, qh, c, 1))]
    return sorted(out, key=lambda kc: kc[0])


def _block_mmla(qtype, b, p, xbs):
    """_block_dots for an even count of x rows by smmla: chunks k and k + 4 give each row 8
    consecutive elements; rows (r, r + 1) of them against x rows (t, t + 1)'s 8 bytes each
    make one smmla, 2 x 2 exact sums (the integers of the sdot path, the same f32 after)."""
    chunks = dict(_code_chunks(qtype, b, p))
    pairs = len(xbs) // 2
    acc = [[None] * 4 for _ in range(pairs)]  # [x pair][row pair]
    for k in range(0, 32, 8):
        lo, hi = chunks[k], chunks[k + 4]
        xs = []
        for t in range(pairs):
            x0, x1 = (load(b, xbs[2 * t + i], k, ir.VectorType(I8, 8)) for i in (0, 1))
            xs.append(shuffle(b, x0, x1, range(16)))
        for rp in range(4):  # rows 2 rp, 2 rp + 1: their 4 bytes of chunk k, then of chunk k + 4
            r0, r1 = 8 * rp, 8 * rp + 4
            idx = [*range(r0, r0 + 4), *range(32 + r0, 32 + r0 + 4), *range(r1, r1 + 4), *range(32 + r1, 32 + r1 + 4)]
            w = shuffle(b, lo, hi, idx)
            for t in range(pairs):
                acc[t][rp] = smmla(b, acc[t][rp], w, xs[t])
    out = []
    for t in range(pairs):  # lanes (w0 x0, w0 x1, w1 x0, w1 x1) -> row r's sum in lane r
        a = acc[t]
        for i in (0, 1):
            lo4 = shuffle(b, a[0], a[1], [i, 2 + i, 4 + i, 6 + i])
            hi4 = shuffle(b, a[2], a[3], [i, 2 + i, 4 + i, 6 + i])
            out.append(shuffle(b, lo4, hi4, range(8)))
    return out


def _block_dots_dot(qtype, b, p, xbs):
    """_block_dots by vpdpbusd / sdot (DOT4), pmaddubsw (AVX2) or the plain vector IR."""
    if qtype == "q8_0":
        tots = [None] * len(xbs)
        for c in range(8):
            w = load(b, p, CODES_AT[qtype] + 32 * c, V32I8)
            u = absb(b, w) if AVX2 else None
            for t, xb in enumerate(xbs):  # |w| <= 128 enters unsigned, x takes w's sign
                tots[t] = dpbssd(b, tots[t], w, bcast4(b, b.gep(xb, [c64(4 * c)])), u)  # int32 lanes
            if c == 3:  # two chains: chunks 0-3, then 4-7 (vpdpbusd waits on its accumulator)
                firsts, tots = tots, [None] * len(xbs)
        return [b.add(f, t) for f, t in zip(firsts, tots)]
    at = CODES_AT[qtype]
    qh = load(b, p, QH_AT[qtype], V32I8) if qtype in QH_AT else None
    tots = [None] * len(xbs)
    if DOT4:  # vpdpbusd / sdot into int32 lanes (AVX2: int16 sums, then pmaddwd); low and high
        his = [None] * len(xbs)  # nibbles in two chains, each dot waiting on the last
        for c in range(4):
            v = load(b, p, at + 32 * c, V32I8)
            lo, hi = codes5(b, v, qh, c, 0), codes5(b, v, qh, c, 1)
            for t, xb in enumerate(xbs):
                tots[t] = dpbusd(b, tots[t], lo, bcast4(b, b.gep(xb, [c64(4 * c)])))
                his[t] = dpbusd(b, his[t], hi, bcast4(b, b.gep(xb, [c64(16 + 4 * c)])))
        return [b.add(lo, hi) for lo, hi in zip(tots, his)]
    # int16 sums hold 4 chunks' products of q4 codes (16 * 15 * 127 = 30480), 2 of q5's (31)
    per = 4 if qh is None else 2
    out = [None] * len(xbs)
    for c in range(4):
        v = load(b, p, at + 32 * c, V32I8)
        lo, hi = codes5(b, v, qh, c, 0), codes5(b, v, qh, c, 1)  # elements 4c .. 4c + 3 of each row, 16 + 4c ..
        for t, xb in enumerate(xbs):
            s = b.add(maddubs(b, lo, bcast4(b, b.gep(xb, [c64(4 * c)]))),
                      maddubs(b, hi, bcast4(b, b.gep(xb, [c64(16 + 4 * c)]))))  # fmt: skip
            tots[t] = s if c % per == 0 else b.add(tots[t], s)
            if c % per == per - 1:
                out[t] = maddwd(b, tots[t]) if out[t] is None else b.add(out[t], maddwd(b, tots[t]))
    return out


def nibble(b, v, high):
    """The low (high = 0) or high nibbles of <n x i8> v (n even), as bytes 0..15."""
    n = v.type.count
    if high:  # no byte shifts on x86: shift 16-bit lanes, then mask
        w = ir.VectorType(ir.IntType(16), n // 2)
        v = b.bitcast(b.lshr(b.bitcast(v, w), ir.Constant(w, [4] * (n // 2))), v.type)
    return b.and_(v, ir.Constant(v.type, [15] * n))


def emit_tile(qtype, mr):
    """emit(b, group pointer, [x codes], [dx], [sx], [8 sum(code_x) per block] (mr x rows'),
    nb) -> [<8 x float>] per x row (lane r: row 8 g + r), in the order of the module
    docstring: each (x row, weight row) the same whatever mr."""
    gb = GROUP_BYTES[qtype]

    def emit(b, gp, xps, dxps, sxps, bsps, nb):
        acc, accm = [zeroed(b, V8F) for _ in range(mr)], [zeroed(b, V8F) for _ in range(mr)]
        with cgutils.for_range(b, nb) as loop:
            blk = loop.index
            p = b.gep(gp, [b.mul(blk, c64(gb))])
            sums = _block_dots(qtype, b, p, [b.gep(xp, [b.mul(blk, c64(32))]) for xp in xps])
            d = b.fpext(load(b, p, 0, V8H), V8F)
            if qtype in M_ROWS:
                m = b.fpext(load(b, p, 16, V8H), V8F)
            for t in range(mr):
                s = sums[t]
                if qtype in OFFSET_SHIFT:  # minus 8 (q5_0: 16) sum(code_x)
                    bs = splat(b, b.load(b.gep(bsps[t], [blk])), V8I32)
                    s = b.sub(s, b.shl(bs, ir.Constant(V8I32, [OFFSET_SHIFT[qtype]] * 8)))
                dd = b.fmul(d, splat16(b, b.load(b.gep(dxps[t], [blk])), 8))
                b.store(fma(b, b.sitofp(s, V8F), dd, b.load(acc[t])), acc[t])
                if qtype in M_ROWS:
                    sx = splat16(b, b.load(b.gep(sxps[t], [blk])), 8)
                    b.store(fma(b, m, sx, b.load(accm[t])), accm[t])
        if qtype in M_ROWS:
            return [b.fadd(b.load(acc[t]), b.load(accm[t])) for t in range(mr)]
        return [b.load(acc[t]) for t in range(mr)]

    return emit


def tile_module(qtype, mr, triple):
    """One group of 8 rows against mr x rows (emit_tile) as a function of pointers in a
    module for `triple`, to compile for another CPU with llvmlite (tests/test_arm64.py,
    scripts/neon_model.py): tile(group, (x codes, dx, sx, block sums) per x row, out, nb)."""
    m = ir.Module(qtype)
    m.triple = triple
    p8, pf, pi = I8.as_pointer(), F32.as_pointer(), I32.as_pointer()
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [p8] + [p8, pf, pf, pi] * mr + [pf, I64]), "tile")
    b = ir.IRBuilder(fn.append_basic_block())
    a = list(fn.args)
    per = [a[1 + 4 * t : 5 + 4 * t] for t in range(mr)]
    xs, dxs, sxs, bss = ([p[k] for p in per] for k in range(4))
    vs = emit_tile(qtype, mr)(b, a[0], xs, dxs, sxs, bss, a[-1])
    for t, v in enumerate(vs):
        b.store(v, b.bitcast(b.gep(a[-2], [ir.Constant(I64, 8 * t)]), v.type.as_pointer()), align=4)
    b.ret_void()
    return m


M_ROWS = ("q4_1", "q5_1")  # formats with an offset m a block (f16, after the 8 scales)
OFFSET_SHIFT = {"q4_0": 0, "q5_0": 1}  # their codes minus 8 sum(code_x) (bs) shifted left by this


TILE_X_ROWS = 4  # x rows a tile reads each unpacked weight chunk for (batched decode, prefill)


def make_groups(emit_for):
    """An intrinsic groups(data, g0, g1, x8, y, t0, mr, o_n): y[t, o] for x rows t0 .. t0 + mr -
    1 (1 <= mr <= TILE_X_ROWS) and the rows o < o_n of groups g0 .. g1 - 1 of data (interleave's
    [G, group bytes]); x8 (xq, dx, sx, bs): xq int8 [T, K], dx / sx f32 and bs int32 (8
    sum(code_x) per block, read by q4_0) [T, K / 32] as q8.quantized.quantize gives them, y f32
    [T, >= o_n]. emit_for(mr) gives the IR of one group against mr x rows (emit_tile's
    signature); each mr has its own loop (its accumulators in registers), chosen at run time."""

    def groups(typingctx, data, g0, g1, x8, y, t0, mr, o_n):
        if not (isinstance(data, types.Array) and data.ndim == 2 and isinstance(x8, types.BaseTuple)):
            return None
        sig = types.none(data, g0, g1, x8, y, t0, mr, o_n)

        def codegen(context, builder, signature, args):
            b = builder
            d = context.make_array(signature.args[0])(context, b, args[0])
            arrs = tile_arrays(context, b, signature.args[3:5], args[3:5])
            t0, o_n = args[5], args[7]
            stride = b.extract_value(d.strides, 0)
            base = b.bitcast(d.data, I8.as_pointer())
            nb = b.extract_value(arrs[1].shape, 1)
            ystride = b.extract_value(arrs[4].strides, 1)
            for m in range(1, TILE_X_ROWS + 1):
                with b.if_then(b.icmp_signed("==", args[6], c64(m))):
                    _tile_loop(b, emit_for(m), m, (base, stride, args[1], args[2], nb), arrs, t0, ystride, o_n)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(groups)


def tile_arrays(context, b, tys, vals):
    """The arrays [xq, dx, sx, bs, y] of a tile intrinsic's (x8, y) arguments (types, values)."""
    x8 = cgutils.unpack_tuple(b, vals[0], len(tys[0]))
    return [context.make_array(t)(context, b, v) for t, v in zip((*tys[0], tys[1]), (*x8, vals[1]))]


def tile_rows(b, arrs, t0, mr):
    """Pointers to rows t0 .. t0 + mr - 1 of a tile's arrays [xq, dx, sx, bs, y] (as i8*, f32*,
    f32*, i32*, i8*): one list each."""

    def rows(arr, ty):
        at, st = b.bitcast(arr.data, I8.as_pointer()), b.extract_value(arr.strides, 0)
        return [b.bitcast(b.gep(at, [b.mul(b.add(t0, c64(t)), st)]), ty) for t in range(mr)]

    tys = (I8.as_pointer(), F32.as_pointer(), F32.as_pointer(), I32.as_pointer(), I8.as_pointer())
    return [rows(a, ty) for a, ty in zip(arrs, tys)]


def _tile_loop(b, emit, mr, sweep, arrs, t0, ystride, o_n):
    """The IR of make_groups' loop over groups for mr x rows; sweep: (base, stride, g0, g1,
    nb), data's byte pointer and row stride, the groups g0 .. g1 - 1 and the blocks a row."""
    base, stride, g0, g1, nb = sweep
    xps, dxps, sxps, bsps, yps = tile_rows(b, arrs, t0, mr)
    with cgutils.for_range_slice(b, g0, g1, c64(1)) as (g, _):
        vs = emit(b, b.gep(base, [b.mul(g, stride)]), xps, dxps, sxps, bsps, nb)
        o = b.mul(g, c64(GROUP))
        full = b.and_(b.icmp_signed("<=", b.add(o, c64(GROUP)), o_n), b.icmp_signed("==", ystride, c64(4)))
        with b.if_else(full) as (then, other):
            with then:
                for v, yp in zip(vs, yps):
                    b.store(v, b.bitcast(b.gep(yp, [b.mul(o, c64(4))]), V8F.as_pointer()), align=4)
            with other:  # the padded last group, or a strided y: lane by lane
                n = b.sub(o_n, o)
                with cgutils.for_range(b, b.select(b.icmp_signed("<", n, c64(GROUP)), n, c64(GROUP))) as lp:
                    for v, yp in zip(vs, yps):
                        at = b.gep(yp, [b.mul(b.add(o, lp.index), ystride)])
                        b.store(b.extract_element(v, lp.index), b.bitcast(at, F32.as_pointer()))


# tiles(data, g0, g1, x8, y, t0, mr, o_n) of each format of 32-value blocks the q8 mode runs
GROUPS = {q: make_groups(partial(emit_tile, q)) for q in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")}
