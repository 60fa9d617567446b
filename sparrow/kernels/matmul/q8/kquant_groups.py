"""K-quant matvecs with activations quantised to 8 bits (the activations="q8" mode) over
q4_k, q5_k and q6_k rows in groups of 8, interleaved (layout: q8.groups.REGIONS; kernels/matmul/q8/groups.py
does the same for q8_0 / q4_0 / q4_1, q8.quantized.py quantises x and dispatches every format).

x comes as q8.quantized.quantize gives it: per 32-value block b, int8 codes, scale dx[b] and
sx[b] = dx[b] * sum(codes). A super-block n of 256 weights covers x blocks 8 n .. 8 n + 7;
its sub-block j (32 values) meets block b = 8 n + j. Per row, block after block:
  q4_k / q5_k: I = sc[j] * sum(code_w * code_x) over sub-block j, code_w the nibble
               (q5_k: plus 16 for the fifth bit); an exact int32
  q6_k:        I = sc[2j] * sum over its first 16 values + sc[2j + 1] * the last 16,
               code_w the stored 6-bit value minus 32 (exact int32, |I| < 2^24)
  acc  = fma(float(I), d * dx[b], acc)
  q4_k / q5_k only: accm = fma(-(dmin * m[j]), sx[b], accm)   (m: the 6-bit mins)
from acc = accm = 0; result acc + accm (q6_k: acc). Integer sums are exact, so every CPU
path gives the same bits, and a row's order depends only on its length: the same bits
whatever its group, T or thread count. The 6-bit scales and mins are unpacked as ggml does,
once, when the groups are built (q8.groups._k_scales).

Lane r of every vector is row 8 g + r: a chunk of 4 code bytes per row meets 4 bytes of x
broadcast to all lanes (pmaddubsw), products add up in int16 while they fit (q4_k: a whole
sub-block, 16 x 15 x 127 = 30480; q5_k and q6_k: 16 values, 8 x 31 x 127 and 8 x 32 x 127),
and pmaddwd against the row's scale turns them into I. Unlike llama.cpp's q8_K (one
activation scale per 256 values), x keeps one scale per 32 values, the same quantised x as
the q8_0 / q4_x / q5_x row dots, so one Q4_K_M model mixes formats on one quantisation of
each activation row.
"""

from functools import partial

from llvmlite import ir
from numba.core import cgutils

from sparrow.kernels.intdot import AVX2, absb, bcast4, maddbs, maddubs, maddwd, splat
from sparrow.kernels.ir import I16, V8F, V8I8, V8I16, V16I8, V16I16, V32I8, c64, call, fma, shuffle, splat16, zeroed
from sparrow.kernels.matmul.q8.groups import GROUP_BYTES, V8H, load, make_groups

_CODES = {"q4_k": 160, "q5_k": 416}  # group offsets of the nibble chunks (q5_k: after 8 qh chunks)
_QH = 160  # q5_k's high-bit chunks
_Q6_SC, _Q6_QL, _Q6_QH = 16, 144, 1168  # q6_k: scale pairs, low-nibble chunks, 2-bit chunks


def _v(ty, vals):
    return ir.Constant(ty, list(vals))


def _dup16(b, v8):
    """<8 x i16> -> <16 x i16> with each element twice (pmaddwd's factor for row r's pair)."""
    return shuffle(b, v8, v8, [i // 2 for i in range(16)])


def _shr(b, v, n):
    """<m x i8> v (m even) shifted right by the run-time i64 n < 8 (one 16-bit shift: callers
    mask the bits that crossed from the next byte)."""
    w = ir.VectorType(I16, v.type.count // 2)
    return b.bitcast(b.lshr(b.bitcast(v, w), splat(b, b.trunc(n, I16), w)), v.type)


def _prefetch(b, p, j, gb):
    """Sub-block j's share of the next super-block's cache lines (p + gb ..) into L1. q6_k
    visits a super-block's chunks out of order (its two nibble halves and 2-bit chunks, each
    twice), which the hardware prefetcher follows badly: without the hints q6_k rows streamed
    from memory at half the speed. q4_k / q5_k read theirs in order and gain nothing."""
    per = -(-gb // (64 * 8))  # lines each of the 8 sub-blocks asks for (q6_k: 4)
    for i in range(per):
        at = b.gep(p, [b.add(c64(gb + 64 * i), b.mul(j, c64(64 * per)))])
        args = [at] + [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)]  # read, keep, data
        call(b, "llvm.prefetch.p0i8", ir.VoidType(), args)


def _accumulate(b, tots, part, i):
    tots[i] = part if tots[i] is None else b.add(tots[i], part)


def _sub_blocks(b, n, xps, dxps, body):
    """A run-time loop over super-block n's 8 sub-blocks (unrolled, LLVM kept every chunk of
    all 8 live and spilled): body(j, [x pointers of sub-block j], [dx of block 8 n + j]) per j."""
    with cgutils.for_range(b, c64(8)) as loop:
        j = loop.index
        blk = b.add(b.mul(n, c64(8)), j)
        xs = [b.gep(xp, [b.mul(blk, c64(32))]) for xp in xps]
        body(j, blk, xs, [b.load(b.gep(dxp, [blk])) for dxp in dxps])


def emit_k(qtype, mr):
    """emit(b, group pointer, [x codes], [dx], [sx], [unused], nb) -> [<8 x float>] per x row
    for q4_k / q5_k, in the module docstring's order (nb: x's 32-blocks)."""
    gb, codes = GROUP_BYTES[qtype], _CODES[qtype]
    m15, one = _v(V32I8, [15] * 32), _v(V32I8, [1] * 32)

    def emit(b, gp, xps, dxps, sxps, bsps, nb):
        acc, accm = [zeroed(b, V8F) for _ in range(mr)], [zeroed(b, V8F) for _ in range(mr)]
        with cgutils.for_range(b, b.udiv(nb, c64(8))) as loop:
            n = loop.index
            p = b.gep(gp, [b.mul(n, c64(gb))])
            d, dmin = b.fpext(load(b, p, 0, V8H), V8F), b.fpext(load(b, p, 16, V8H), V8F)

            def body(j, blk, xs, dxs):
                sc = _dup16(b, b.zext(load(b, p, b.add(c64(32), b.shl(j, c64(3))), V8I8), V8I16))
                neg_m = b.fneg(b.fmul(dmin, b.uitofp(load(b, p, b.add(c64(96), b.shl(j, c64(3))), V8I8), V8F)))
                pair = b.gep(p, [b.add(c64(codes), b.mul(b.lshr(j, c64(1)), c64(256)))])  # sub-blocks 2i, 2i + 1
                shift = b.shl(b.and_(j, c64(1)), c64(2))  # high nibbles for odd j
                tots = [[None, None] for _ in range(mr)]
                for c in range(8):  # the pair's bytes 4c .. 4c + 3: elements 4c .. of sub-block j
                    w = b.and_(_shr(b, load(b, pair, 32 * c, V32I8), shift), m15)
                    if qtype == "q5_k":  # bit j of qh byte i is element i's fifth bit
                        hb = b.and_(_shr(b, load(b, p, _QH + 32 * c, V32I8), j), one)
                        w = b.or_(w, b.shl(hb, _v(V32I8, [4] * 32)))
                    for t in range(mr):
                        part = maddubs(b, w, bcast4(b, b.gep(xs[t], [c64(4 * c)])))
                        _accumulate(b, tots[t], part, c // 4 if qtype == "q5_k" else 0)
                for t in range(mr):
                    i = maddwd(b, tots[t][0], sc)
                    if tots[t][1] is not None:
                        i = b.add(i, maddwd(b, tots[t][1], sc))
                    dd = b.fmul(d, splat16(b, dxs[t], 8))
                    b.store(fma(b, b.sitofp(i, V8F), dd, b.load(acc[t])), acc[t])
                    sx = splat16(b, b.load(b.gep(sxps[t], [blk])), 8)
                    b.store(fma(b, neg_m, sx, b.load(accm[t])), accm[t])

            _sub_blocks(b, n, xps, dxps, body)
        return [b.fadd(b.load(acc[t]), b.load(accm[t])) for t in range(mr)]

    return emit


def emit_q6_k(mr):
    """emit for q6_k (emit_k's signature). Per row, a super-block's half h of 128 values:
    ql bytes 64h + l (low nibble: element l, high: l + 64) and 64h + 32 + l (l + 32, l + 96),
    qh byte 32h + l holding the 2 high bits of l, l + 32, l + 64, l + 96 (bits 0-1, 2-3, ...)."""
    gb = GROUP_BYTES["q6_k"]
    m15, m3, k32 = _v(V32I8, [15] * 32), _v(V32I8, [3] * 32), _v(V32I8, [32] * 32)

    def emit(b, gp, xps, dxps, sxps, bsps, nb):
        acc = [zeroed(b, V8F) for _ in range(mr)]
        with cgutils.for_range(b, b.udiv(nb, c64(8))) as loop:
            n = loop.index
            p = b.gep(gp, [b.mul(n, c64(gb))])
            d = b.fpext(load(b, p, 0, V8H), V8F)

            def body(j, blk, xs, dxs):  # x block 8 n + j: half h = j // 4, quarter s = j % 4
                h, s = b.lshr(j, c64(2)), b.and_(j, c64(3))
                _prefetch(b, p, j, gb)
                pairs = b.sext(load(b, p, b.add(c64(_Q6_SC), b.shl(j, c64(4))), V16I8), V16I16)  # sc[2j], sc[2j+1]
                scs = [shuffle(b, pairs, pairs, [2 * (i // 2) + u for i in range(16)]) for u in (0, 1)]
                ql_at = b.add(c64(_Q6_QL), b.mul(b.add(b.shl(h, c64(4)), b.shl(b.and_(s, c64(1)), c64(3))), c64(32)))
                ql, qh = b.gep(p, [ql_at]), b.gep(p, [b.add(c64(_Q6_QH), b.shl(h, c64(8)))])
                nib, hsh = b.shl(b.lshr(s, c64(1)), c64(2)), b.shl(s, c64(1))
                tots = [[None, None] for _ in range(mr)]
                for c in range(8):  # values 128h + 32s + 4c .. + 3
                    lo = b.and_(_shr(b, load(b, ql, 32 * c, V32I8), nib), m15)
                    hi = b.shl(b.and_(_shr(b, load(b, qh, 32 * c, V32I8), hsh), m3), _v(V32I8, [4] * 32))
                    w = b.sub(b.or_(lo, hi), k32)  # -32 .. 31
                    u = absb(b, w) if AVX2 else None
                    for t in range(mr):
                        _accumulate(b, tots[t], maddbs(b, w, bcast4(b, b.gep(xs[t], [c64(4 * c)])), u), c // 4)
                for t in range(mr):
                    i = b.add(maddwd(b, tots[t][0], scs[0]), maddwd(b, tots[t][1], scs[1]))
                    dd = b.fmul(d, splat16(b, dxs[t], 8))
                    b.store(fma(b, b.sitofp(i, V8F), dd, b.load(acc[t])), acc[t])

            _sub_blocks(b, n, xps, dxps, body)
        return [b.load(acc[t]) for t in range(mr)]

    return emit


# tiles(data, g0, g1, x8, y, t0, mr, o_n) of each K-quant the q8 mode runs
GROUPS = {"q4_k": make_groups(partial(emit_k, "q4_k")), "q5_k": make_groups(partial(emit_k, "q5_k"))}
GROUPS["q6_k"] = make_groups(emit_q6_k)
