"""q8-mode prefill tiles over two interleaved groups at once: 16 weight rows a zmm register.

kernels/matmul/q8/groups.py (q8_0 / q4_0 / q4_1 / q5_0 / q5_1) and q8.kquant_groups.py (q4_k / q6_k) keep rows in
groups of 8 and dot a group against up to TILE_X_ROWS = 4 x rows in ymm registers. On CPUs with AVX512-VNNI
(intdot.VNNI512) a prefill here takes groups g and g + 1 side by side in one <64 x i8>, so each vpdpbusd covers
16 rows, and PAIR_X_ROWS = 6 x rows share each unpacked chunk. Lane r of every vector is row
8 g + r (r < 8: group g, else row r - 8 of group g + 1). q8_0's signed codes enter vpdpbusd as
code + 128 (one xor a chunk, shared by the x rows; zmm has no vpsignb, which the ymm tiles use
per x row) and 128 sum(code_x) a block is subtracted after, the same exact integer. Why these
shapes (6 x rows, not 4 or 8; the unrolled q6_k tile): the measurements are in docs/kernels.md,
"zmm prefill tiles".

The order is q8.groups's and q8.kquant_groups's, lane by lane (their docstrings), so a row's bits do not depend
on which tile computed it (tests/test_x16.py)."""

from functools import partial

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.intdot import bcast4, dpbusd16, splat
from sparrow.kernels.ir import I8, V8I8, V16F, V16I8, V16I32, V32I8, V64I8, c64, fma, shuffle, splat16, zeroed
from sparrow.kernels.matmul.q8.groups import (
    CODES_AT,
    GROUP,
    GROUP_BYTES,
    M_ROWS,
    OFFSET_SHIFT,
    QH_AT,
    V8H,
    codes5,
    load,
    nibble,
    tile_arrays,
    tile_rows,
)
from sparrow.kernels.matmul.q8.kquant_groups import _CODES, _Q6_QH, _Q6_QL, _Q6_SC

PAIR_X_ROWS = 6  # x rows a pair tile reads each unpacked chunk for


def _pair(b, p0, p1, at, ty):
    """ty at byte `at` of group blocks p0 and p1, joined: p0's lanes first."""
    lo, hi = load(b, p0, at, ty), load(b, p1, at, ty)
    return shuffle(b, lo, hi, range(2 * ty.count))


def emit_pair(qtype, mr):
    """emit(b, group g block pointer, group g + 1's, [x codes], [dx], [sx], [x_sums: 8 sum(code_x)
    a block for q4_0 and q5_0, 128 sum(code_x) for q8_0], nb) -> [<16 x float>] per x row, in the
    module docstring's order (q8_0 / q4_0 / q4_1 / q5_0 / q5_1)."""
    gb, at = GROUP_BYTES[qtype], CODES_AT[qtype]

    def emit(b, g0p, g1p, xps, dxps, sxps, bsps, nb):
        acc, accm = [zeroed(b, V16F) for _ in range(mr)], [zeroed(b, V16F) for _ in range(mr)]
        with cgutils.for_range(b, nb) as loop:
            blk = loop.index
            p0, p1 = b.gep(g0p, [b.mul(blk, c64(gb))]), b.gep(g1p, [b.mul(blk, c64(gb))])
            xbs = [b.gep(xp, [b.mul(blk, c64(32))]) for xp in xps]
            los, his = [None] * mr, [None] * mr  # two vpdpbusd chains (each dot waits on the last)
            if qtype == "q8_0":  # chunks 0-3, then 4-7; codes + 128, unsigned
                for c in range(8):
                    u = b.xor(_pair(b, p0, p1, at + 32 * c, V32I8), ir.Constant(V64I8, [-128] * 64))
                    chain = los if c < 4 else his
                    for t in range(mr):
                        chain[t] = dpbusd16(b, chain[t], u, bcast4(b, b.gep(xbs[t], [c64(4 * c)]), 16))
            else:  # low and high nibbles
                qh = _pair(b, p0, p1, QH_AT[qtype], V32I8) if qtype in QH_AT else None
                for c in range(4):
                    v = _pair(b, p0, p1, at + 32 * c, V32I8)
                    lo, hi = codes5(b, v, qh, c, 0), codes5(b, v, qh, c, 1)
                    for t in range(mr):
                        los[t] = dpbusd16(b, los[t], lo, bcast4(b, b.gep(xbs[t], [c64(4 * c)]), 16))
                        his[t] = dpbusd16(b, his[t], hi, bcast4(b, b.gep(xbs[t], [c64(16 + 4 * c)]), 16))
            d = b.fpext(_pair(b, p0, p1, 0, V8H), V16F)
            m = b.fpext(_pair(b, p0, p1, 16, V8H), V16F) if qtype in M_ROWS else None
            for t in range(mr):
                s = b.add(los[t], his[t])
                if qtype in OFFSET_SHIFT or qtype == "q8_0":  # minus (8, 16, 128) sum(code_x)
                    bs = splat(b, b.load(b.gep(bsps[t], [blk])), V16I32)
                    s = b.sub(s, b.shl(bs, ir.Constant(V16I32, [OFFSET_SHIFT.get(qtype, 0)] * 16)))
                dd = b.fmul(d, splat16(b, b.load(b.gep(dxps[t], [blk]))))
                b.store(fma(b, b.sitofp(s, V16F), dd, b.load(acc[t])), acc[t])
                if m is not None:
                    b.store(fma(b, m, splat16(b, b.load(b.gep(sxps[t], [blk]))), b.load(accm[t])), accm[t])
        if m is not None:
            return [b.fadd(b.load(acc[t]), b.load(accm[t])) for t in range(mr)]
        return [b.load(acc[t]) for t in range(mr)]

    return emit


_K_CODES = _CODES["q4_k"]  # q4_k: group offset of the nibble chunks, 256 bytes a sub-block pair


def emit_pair_q4_k(mr):
    """emit for q4_k (emit_pair's signature), in q8.kquant_groups's order: per row and sub-block j of
    super-block n (x block b = 8 n + j), I = sc[j] * sum(code_w * code_x) (exact: float(s) *
    float(sc) is below 2^24), acc = fma(float(I), d * dx[b], acc), accm = fma(-(dmin * m[j]),
    sx[b], accm); result acc + accm. Sub-blocks 2i and 2i + 1 (low and high nibbles of the
    same bytes) are dotted together, then added to acc in order."""
    gb = GROUP_BYTES["q4_k"]

    def emit(b, g0p, g1p, xps, dxps, sxps, bsps, nb):
        acc, accm = [zeroed(b, V16F) for _ in range(mr)], [zeroed(b, V16F) for _ in range(mr)]
        with cgutils.for_range(b, b.udiv(nb, c64(8))) as loop:
            n = loop.index
            p0, p1 = b.gep(g0p, [b.mul(n, c64(gb))]), b.gep(g1p, [b.mul(n, c64(gb))])
            d, dmin = b.fpext(_pair(b, p0, p1, 0, V8H), V16F), b.fpext(_pair(b, p0, p1, 16, V8H), V16F)
            with cgutils.for_range(b, c64(4)) as sub:
                i = sub.index  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
                blks = [b.add(b.mul(n, c64(8)), b.add(b.shl(i, c64(1)), c64(h))) for h in (0, 1)]
                at = b.add(c64(_K_CODES), b.mul(i, c64(256)))
                sums = [[None, None] for _ in range(mr)]
                for c in range(8):
                    v = _pair(b, p0, p1, b.add(at, c64(32 * c)), V32I8)
                    for h in (0, 1):
                        w = nibble(b, v, h)
                        for t in range(mr):
                            xb = b.gep(xps[t], [b.add(b.mul(blks[h], c64(32)), c64(4 * c))])
                            sums[t][h] = dpbusd16(b, sums[t][h], w, bcast4(b, xb, 16))
                for h in (0, 1):
                    j = b.add(b.shl(i, c64(1)), c64(h))
                    sc = b.uitofp(_pair(b, p0, p1, b.add(c64(32), b.shl(j, c64(3))), V8I8), V16F)  # scales j
                    m = b.uitofp(_pair(b, p0, p1, b.add(c64(96), b.shl(j, c64(3))), V8I8), V16F)  # mins j
                    neg_m = b.fneg(b.fmul(dmin, m))
                    for t in range(mr):
                        big = b.fmul(b.sitofp(sums[t][h], V16F), sc)  # = float(sc * s), exact
                        dd = b.fmul(d, splat16(b, b.load(b.gep(dxps[t], [blks[h]]))))
                        b.store(fma(b, big, dd, b.load(acc[t])), acc[t])
                        sx = splat16(b, b.load(b.gep(sxps[t], [blks[h]])))
                        b.store(fma(b, neg_m, sx, b.load(accm[t])), accm[t])
        return [b.fadd(b.load(acc[t]), b.load(accm[t])) for t in range(mr)]

    return emit


def _shift16(b, v, k):
    """<64 x i8> v shifted by the constant k (left if k > 0, right if k < 0) in 16-bit lanes:
    callers mask the bits that crossed from the neighbouring byte."""
    if k == 0:
        return v
    w = ir.VectorType(ir.IntType(16), 32)
    n = ir.Constant(w, [abs(k)] * 32)
    x = b.bitcast(v, w)
    return b.bitcast(b.shl(x, n) if k > 0 else b.lshr(x, n), V64I8)


def q6_codes(b, p0, p1, j, c, m15, m48):
    """q6_k chunk c of sub-block j for the 16 rows of group blocks p0 and p1 (j: half h = j // 4,
    quarter s = j % 4, q8.kquant_groups.emit_q6_k's layout): the stored 6-bit values u = code +
    32 of values 128 h + 32 s + 4 c .. + 3, ((ql >> nib) & 15) | ((qh >> hsh) & 3) << 4, as
    <64 x i8> (m15, m48: those byte masks). j and c are constants, so every shift is."""
    h, s = j // 4, j % 4
    ql_at = _Q6_QL + 32 * (16 * h + 8 * (s & 1)) + 32 * c
    qh_at = _Q6_QH + 256 * h + 32 * c
    nib, hsh = 4 * (s >> 1), 2 * s
    lo = b.and_(_shift16(b, _pair(b, p0, p1, ql_at, V32I8), -nib), m15)
    hq = b.and_(_shift16(b, _pair(b, p0, p1, qh_at, V32I8), 4 - hsh), m48)
    return b.or_(lo, hq)


def emit_pair_q6_k(mr):
    """emit for q6_k (emit_pair's signature; bsps: x's 32 sum(code_x) per 16 values, from
    q8.quantized.code_sums), in q8.kquant_groups's order: sub-block j of super-block n (x block b = 8 n + j),
    I = sc[2j] (S0 - X0) + sc[2j + 1] (S1 - X1), S the dot of x's codes with the stored
    6-bit values u = code + 32 (vpdpbusd takes them unsigned) over each 16, X x's 32 sum;
    acc = fma(float(I), d * dx[b], acc), sub-block after sub-block. float(S - X) * float(sc)
    and the sum of two are exact integers below 2^24 (|S - X| <= 16 * 32 * 127, |sc| <= 128),
    so float(I) is q8.kquant_groups's sitofp(I). The 8 sub-blocks are unrolled, so every shift
    that unpacks u is a constant (a run-time byte shift cost LLVM several instructions a
    chunk)."""
    gb = GROUP_BYTES["q6_k"]

    def emit(b, g0p, g1p, xps, dxps, sxps, bsps, nb):
        acc = [zeroed(b, V16F) for _ in range(mr)]
        m15, m48 = (ir.Constant(V64I8, [v] * 64) for v in (15, 48))
        with cgutils.for_range(b, b.udiv(nb, c64(8))) as loop:
            n = loop.index
            p0, p1 = b.gep(g0p, [b.mul(n, c64(gb))]), b.gep(g1p, [b.mul(n, c64(gb))])
            d = b.fpext(_pair(b, p0, p1, 0, V8H), V16F)
            for j in range(8):
                blk = b.add(b.mul(n, c64(8)), c64(j))
                sums = [[None, None] for _ in range(mr)]
                for c in range(8):
                    u = q6_codes(b, p0, p1, j, c, m15, m48)
                    for t in range(mr):
                        xb = b.gep(xps[t], [b.add(b.mul(blk, c64(32)), c64(4 * c))])
                        sums[t][c // 4] = dpbusd16(b, sums[t][c // 4], u, bcast4(b, xb, 16))
                pr = _pair(b, p0, p1, _Q6_SC + 16 * j, V16I8)  # (sc[2j], sc[2j + 1]) a row
                scs = [b.sitofp(shuffle(b, pr, pr, range(k, 32, 2)), V16F) for k in (0, 1)]
                for t in range(mr):
                    at = [b.gep(bsps[t], [b.add(b.shl(blk, c64(1)), c64(k))]) for k in (0, 1)]
                    f = [b.sitofp(b.sub(sums[t][k], splat(b, b.load(at[k]), V16I32)), V16F) for k in (0, 1)]
                    big = fma(b, f[1], scs[1], b.fmul(f[0], scs[0]))  # = float(I), exact
                    dd = b.fmul(d, splat16(b, b.load(b.gep(dxps[t], [blk]))))
                    b.store(fma(b, big, dd, b.load(acc[t])), acc[t])
        return [b.load(acc[t]) for t in range(mr)]

    return emit


def make_pairs(emit_for):
    """An intrinsic pairs(data, g0, g1, x8, y, t0, mr): y[t, 8 g0 .. 8 g1 - 1] for
    x rows t0 .. t0 + mr - 1 (1 <= mr <= PAIR_X_ROWS), groups g0 .. g1 - 1 of data taken two at a
    time: g1 - g0 even, every row of those groups a row of y, y's rows contiguous (arguments
    as q8.groups.make_groups', which covers what this does not)."""

    def pairs(typingctx, data, g0, g1, x8, y, t0, mr):
        if not (isinstance(data, types.Array) and data.ndim == 2 and isinstance(x8, types.BaseTuple)):
            return None
        sig = types.none(data, g0, g1, x8, y, t0, mr)

        def codegen(context, builder, signature, args):
            b = builder
            d = context.make_array(signature.args[0])(context, b, args[0])
            arrs = tile_arrays(context, b, signature.args[3:5], args[3:5])
            stride, base = b.extract_value(d.strides, 0), b.bitcast(d.data, I8.as_pointer())
            nb = b.extract_value(arrs[1].shape, 1)
            for m in range(1, PAIR_X_ROWS + 1):
                with b.if_then(b.icmp_signed("==", args[6], c64(m))):
                    _pair_loop(b, emit_for(m), m, (base, stride, args[1], args[2], nb), arrs, args[5])
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(pairs)


def _pair_loop(b, emit, mr, sweep, arrs, t0):
    """The IR of make_pairs' loop over pairs of groups for mr x rows (sweep: as q8.groups._tile_loop's)."""
    base, stride, g0, g1, nb = sweep
    xps, dxps, sxps, bsps, yps = tile_rows(b, arrs, t0, mr)
    with cgutils.for_range(b, b.sdiv(b.sub(g1, g0), c64(2))) as loop:
        g = b.add(g0, b.shl(loop.index, c64(1)))
        gp = b.gep(base, [b.mul(g, stride)])
        vs = emit(b, gp, b.gep(gp, [stride]), xps, dxps, sxps, bsps, nb)
        o = b.mul(g, c64(4 * GROUP))  # byte offset of row 8 g in a y row
        for v, yp in zip(vs, yps):
            b.store(v, b.bitcast(b.gep(yp, [o]), V16F.as_pointer()), align=4)


# pairs(data, g0, g1, x8, y, t0, mr) of each format claiming zmm pair tiles (formats.py's zmm_pairs)
PAIRS = {q: make_pairs(partial(emit_pair, q)) for q in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")}
PAIRS["q4_k"] = make_pairs(emit_pair_q4_k)
PAIRS["q6_k"] = make_pairs(emit_pair_q6_k)
