"""K-quant row dots with activations quantised to 8 bits (the activations="q8" mode) for
q4_k, q5_k and q6_k weights; kernels/_q8act.py quantises x and dispatches every format.

x comes as _q8act.quantize gives it: per 32-value block b, int8 codes, scale dx[b] and
sx[b] = dx[b] * sum(codes). A super-block of 256 weights covers 8 such blocks, so its
integer dot products land in 8 lanes, lane j for block 8 n + j of super-block n:
  q4_k / q5_k: I[j] = sc[j] * sum(code_w * code_x) over sub-block j (exact int32);
  q6_k:        I[j] = sc[2j] * sum over the first 16 values + sc[2j + 1] * the last 16,
               code_w the stored 6-bit value minus 32 (exact int32, |I| < 2^24);
  acc  = fma(float(I), d * dx[8 n : 8 n + 8], acc)                   <8 x float>
  q4_k / q5_k only: accm = fma(-(dmin * m), sx[8 n : 8 n + 8], accm)  (m: the 6-bit mins)
super-block after super-block. Result: the pairwise tree (lane i + i + n/2) of acc + accm
(q6_k: of acc). Integer sums are exact, so how a CPU groups them (x86's pmaddubsw +
pmaddwd, or the generic vector code numba emits elsewhere) never changes a bit, and every
row's order depends only on its length: the same bits whatever T, batch or thread count.
The 6-bit scales and mins are unpacked as ggml does, 8 lanes at a time.

Unlike llama.cpp's q8_K (one activation scale per 256 values), x keeps one scale per 32
values, the same quantised x as the q8_0 / q4_x / q5_x row dots, so one Q4_K_M model mixes
formats on one quantisation of each activation row.
"""

from llvmlite import ir
from numba.core import cgutils

from sparrow.kernels._ir import F32, I8, I16, I32, I64, fma, hsum16, make_rows, shuffle, splat16, zeroed
from sparrow.kernels._kquants import scales_mins8
from sparrow.kernels.gemm import CPU_FEATURES

AVX2 = "+avx2" in CPU_FEATURES.split(",")  # pmaddubsw / pmaddwd / psignb, else generic IR

V8F = ir.VectorType(F32, 8)
V8I32 = ir.VectorType(I32, 8)
V8I8 = ir.VectorType(I8, 8)
V16I16 = ir.VectorType(I16, 16)
V16I8 = ir.VectorType(I8, 16)
V32I8 = ir.VectorType(I8, 32)
V32I32 = ir.VectorType(I32, 32)
_FALSE = ir.Constant(ir.IntType(1), 0)
_BB = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


def call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def dot4(builder, w, x, c=None, unsigned=False):
    """<32 x i8> w, signed x -> <8 x i32>, lane j = sum of w[4j + i] * x[4j + i] * c[2j + i // 2]
    for i < 4 (c: <16 x i16> factors, all 1 when None; w signed unless unsigned). Needs
    |w| <= 128 (unsigned: w <= 255) and every pair sum w x + w x within int16, as every
    caller's codes give."""
    c = ir.Constant(V16I16, [1] * 16) if c is None else c
    if AVX2:  # signed w: |w| * (x with w's sign) in pmaddubsw (|w| <= 128, |x| <= 127)
        if unsigned:
            p = call(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [w, x])
        else:
            u = call(builder, "llvm.abs.v32i8", V32I8, [w, _FALSE])
            s = call(builder, "llvm.x86.avx2.psign.b", V32I8, [x, w])
            p = call(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [u, s])
        return call(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [p, c])
    c32 = builder.sext(shuffle(builder, c, c, [i // 2 for i in range(32)]), V32I32)
    w32 = builder.zext(w, V32I32) if unsigned else builder.sext(w, V32I32)
    pr = builder.mul(builder.mul(w32, builder.sext(x, V32I32)), c32)
    parts = [shuffle(builder, pr, pr, range(i, 32, 4)) for i in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _lane_sums(b, vs):
    """8 <8 x i32> -> <8 x i32> whose lane j is the sum of vs[j]'s lanes (exact: any order)."""
    g = 8  # lanes each source vector still has; a register holds 8 / g of them, in order
    while len(vs) > 1:
        half = [i for k in range(0, 8, g) for i in range(k, k + g // 2)]
        lo = half + [8 + i for i in half]
        hi = [i + g // 2 for i in lo]
        vs = [b.add(shuffle(b, a, c, lo), shuffle(b, a, c, hi)) for a, c in zip(vs[::2], vs[1::2])]
        g //= 2
    return vs[0]


def _c64(v):
    return ir.Constant(I64, v)


def _v(ty, vals):
    return ir.Constant(ty, list(vals))


def _load(b, base, at, ty):
    return b.load(b.bitcast(b.gep(base, [at]), ty.as_pointer()), align=1)


def _half(b, rp, at):
    return b.fpext(_load(b, rp, at, ir.HalfType()), F32)


def _superblock(qtype, b, rp, xp, blk):
    """(I: <8 x i32> per the module doc, d, dmin or None, m <8 x i32> or None) of super-block blk."""
    p = b.mul(blk, _c64(_BB[qtype]))
    x0 = b.mul(blk, _c64(256))
    xs = [_load(b, xp, b.add(x0, _c64(32 * j)), V32I8) for j in range(8)]
    if qtype == "q6_k":
        d = _half(b, rp, b.add(p, _c64(208)))
        sc = b.sext(_load(b, rp, b.add(p, _c64(192)), V16I8), V16I16)
        lanes = []
        for h in range(2):
            qh = _load(b, rp, b.add(p, _c64(128 + 32 * h)), V32I8)
            for s in range(4):
                ql = _load(b, rp, b.add(p, _c64(64 * h + 32 * (s & 1))), V32I8)
                lo = b.and_(b.lshr(ql, _v(V32I8, [4 * (s >> 1)] * 32)), _v(V32I8, [15] * 32))
                hi = b.shl(b.and_(b.lshr(qh, _v(V32I8, [2 * s] * 32)), _v(V32I8, [3] * 32)), _v(V32I8, [4] * 32))
                w = b.sub(b.or_(lo, hi), _v(V32I8, [32] * 32))
                j = 4 * h + s
                lanes.append(dot4(b, w, xs[j], shuffle(b, sc, sc, [2 * j] * 8 + [2 * j + 1] * 8)))
        return _lane_sums(b, lanes), d, None, None
    d, dmin = _half(b, rp, p), _half(b, rp, b.add(p, _c64(2)))
    sc, m = scales_mins8(b, _load(b, rp, b.add(p, _c64(4)), V16I8))
    qo = 16 if qtype == "q4_k" else 48
    if qtype == "q5_k":
        qh = _load(b, rp, b.add(p, _c64(16)), V32I8)
    lanes = []
    for j in range(8):
        q = _load(b, rp, b.add(p, _c64(qo + 32 * (j // 2))), V32I8)
        w = b.and_(b.lshr(q, _v(V32I8, [4 * (j % 2)] * 32)), _v(V32I8, [15] * 32))
        if qtype == "q5_k":
            hb = b.and_(b.lshr(qh, _v(V32I8, [j] * 32)), _v(V32I8, [1] * 32))
            w = b.or_(w, b.shl(hb, _v(V32I8, [4] * 32)))
        lanes.append(dot4(b, w, xs[j], unsigned=True))  # codes 0..15 (q5_k: 0..31)
    return b.mul(_lane_sums(b, lanes), sc), d, dmin, m


def emit_row(qtype):
    """The IR of one row's dot product, as _ir.make_rows calls it (inputs: x's codes, dx, sx,
    lane sums; the last unused here)."""

    def emit(b, rp, ptrs, lens):
        xp, dxp, sxp = ptrs[0], b.bitcast(ptrs[1], F32.as_pointer()), b.bitcast(ptrs[2], F32.as_pointer())
        nb = b.udiv(lens[1], _c64(8))
        acc, accm = zeroed(b, V8F), zeroed(b, V8F)
        with cgutils.for_range(b, nb) as loop:
            blk = loop.index
            i, d, dmin, m = _superblock(qtype, b, rp, xp, blk)
            coef = b.fmul(splat16(b, d, 8), _load(b, dxp, b.mul(blk, _c64(8)), V8F))
            b.store(fma(b, b.sitofp(i, V8F), coef, b.load(acc)), acc)
            if m is not None:
                neg_ml = b.fneg(b.fmul(splat16(b, dmin, 8), b.uitofp(m, V8F)))
                b.store(fma(b, neg_ml, _load(b, sxp, b.mul(blk, _c64(8)), V8F), b.load(accm)), accm)
        v = b.load(acc) if qtype == "q6_k" else b.fadd(b.load(acc), b.load(accm))
        return hsum16(b, v)

    return emit


rows_q4_k = make_rows(emit_row("q4_k"), 4)
rows_q5_k = make_rows(emit_row("q5_k"), 4)
rows_q6_k = make_rows(emit_row("q6_k"), 4)
