"""LLVM IR pieces of the activations="q8" mode's integer dot products (q8.quantized, q8.groups, q8.kquant_groups).

Every piece computes exact integers, so x86's vpdpbusd (AVX-VNNI / AVX512-VNNI), pmaddubsw /
pmaddwd / psignb (AVX2), aarch64's sdot (dotprod) and the plain vector IR of the generic path
give the same values: the q8 mode's bits never depend on which one a CPU takes (tests compile
the other paths for other CPUs and compare; tests/test_arm64.py checks the aarch64 assembly).
"""

from llvmlite import ir
from numba.core import cgutils

from sparrow.kernels.cpu import AVX2, DOTPROD, I8MM, VNNI, VNNI512  # noqa: F401 (this module's face: which IR it emits)
from sparrow.kernels.ir import F32, I8, I16, I32, V16I32, shuffle

V8F = ir.VectorType(F32, 8)
V8I32 = ir.VectorType(I32, 8)
V8I8 = ir.VectorType(I8, 8)
V8I16 = ir.VectorType(I16, 8)
V16I16 = ir.VectorType(I16, 16)
V16I8 = ir.VectorType(I8, 16)
V32I8 = ir.VectorType(I8, 32)
V32I16 = ir.VectorType(I16, 32)
V32I32 = ir.VectorType(I32, 32)
V64I8 = ir.VectorType(I8, 64)
V4I32 = ir.VectorType(I32, 4)
_FALSE = ir.Constant(ir.IntType(1), 0)
# dpbusd / dpbssd in one instruction a 4-byte group: x86's vpdpbusd or aarch64's sdot
DOT4 = VNNI or DOTPROD


def call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def splat(b, v, vty):
    """The scalar v in every lane of a vector of type vty."""
    und = ir.Constant(vty, ir.Undefined)
    return shuffle(b, b.insert_element(und, v, ir.Constant(I32, 0)), und, [0] * vty.count)


def bcast4(b, p, lanes=8):
    """The 4 bytes at p (i8*) repeated in all `lanes` i32 lanes, as <4 lanes x i8>."""
    v = splat(b, b.load(b.bitcast(p, I32.as_pointer()), align=1), ir.VectorType(I32, lanes))
    return b.bitcast(v, ir.VectorType(I8, 4 * lanes))


def maddubs(b, u, s):
    """pmaddubsw without its saturation (every caller's pair sums fit int16): <32 x i8> u
    unsigned, s signed -> <16 x i16>, element i = u[2i] s[2i] + u[2i+1] s[2i+1]."""
    if AVX2:
        return call(b, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [u, s])
    p = b.mul(b.zext(u, V32I16), b.sext(s, V32I16))
    return b.add(shuffle(b, p, p, range(0, 32, 2)), shuffle(b, p, p, range(1, 32, 2)))


def absb(b, w):
    """|w| of <32 x i8> (AVX2 only: maddbs's u, shared by the x rows that meet one w)."""
    return call(b, "llvm.abs.v32i8", V32I8, [w, _FALSE])


def maddbs(b, w, s, u=None):
    """maddubs for signed w (|w| <= 128): on AVX2 |w| (u, when the caller has it) against s
    with w's sign (psignb), the same products w s."""
    if AVX2:
        u = absb(b, w) if u is None else u
        return maddubs(b, u, call(b, "llvm.x86.avx2.psign.b", V32I8, [s, w]))
    p = b.mul(b.sext(w, V32I16), b.sext(s, V32I16))
    return b.add(shuffle(b, p, p, range(0, 32, 2)), shuffle(b, p, p, range(1, 32, 2)))


def maddwd(b, v, c=None):
    """pmaddwd: <16 x i16> v, c (all 1 when None) -> <8 x i32>, lane j = v[2j] c[2j] +
    v[2j+1] c[2j+1]."""
    c = ir.Constant(V16I16, [1] * 16) if c is None else c
    if AVX2:
        return call(b, "llvm.x86.avx2.pmadd.wd", V8I32, [v, c])
    p = b.mul(b.sext(v, V16I32), b.sext(c, V16I32))
    return b.add(shuffle(b, p, p, range(0, 16, 2)), shuffle(b, p, p, range(1, 16, 2)))


def dpbusd(b, acc, u, s):
    """acc (<8 x i32>, or None for 0) + lane j = sum of u[4j + i] s[4j + i], i < 4: <32 x i8>
    u unsigned, s signed. One vpdpbusd with VNNI, else pmaddubsw + pmaddwd (+ paddd): the
    same integers, as the products' pair sums fit int16 for every caller's codes."""
    if VNNI:
        acc = ir.Constant(V8I32, None) if acc is None else acc
        return call(b, "llvm.x86.avx512.vpdpbusd.256", V8I32, [acc, b.bitcast(u, V8I32), b.bitcast(s, V8I32)])
    if DOTPROD:  # every caller's u is below 128 (codes of 6 bits at most): the same as signed
        return sdot(b, acc, u, s)
    s4 = maddwd(b, maddubs(b, u, s))
    return s4 if acc is None else b.add(acc, s4)


def dpbusd16(b, acc, u, s):
    """dpbusd on 16 lanes: acc (<16 x i32>, or None for 0) + lane j = sum of u[4j + i]
    s[4j + i], i < 4, <64 x i8> u unsigned and s signed. One zmm vpdpbusd with VNNI512, else
    dpbusd on each half (the same integers)."""
    if VNNI512:
        acc = ir.Constant(V16I32, None) if acc is None else acc
        return call(b, "llvm.x86.avx512.vpdpbusd.512", V16I32, [acc, b.bitcast(u, V16I32), b.bitcast(s, V16I32)])
    halves = []
    for k in (0, 1):  # lanes 8k .. 8k + 7, bytes 32k .. 32k + 31
        a = None if acc is None else shuffle(b, acc, acc, range(8 * k, 8 * k + 8))
        h = range(32 * k, 32 * k + 32)
        halves.append(dpbusd(b, a, shuffle(b, u, u, h), shuffle(b, s, s, h)))
    return shuffle(b, halves[0], halves[1], range(16))


def dpbssd(b, acc, w, s, u=None):
    """dpbusd for signed w (|w| <= 128): |w| (u, when the caller has it) against s with w's
    sign, the same products w s."""
    if VNNI:
        u = absb(b, w) if u is None else u
        return dpbusd(b, acc, u, call(b, "llvm.x86.avx2.psign.b", V32I8, [s, w]))
    if DOTPROD:  # signed by signed: no sign transfer
        return sdot(b, acc, w, s)
    s4 = maddwd(b, maddbs(b, w, s, u))
    return s4 if acc is None else b.add(acc, s4)


def sdot(b, acc, w, s):
    """acc (<8 x i32>, or None for 0) + lane j = sum of w[4j + i] s[4j + i], i < 4, <32 x i8>
    w and s signed: aarch64's sdot on each 128-bit half (lanes 0-3 from bytes 0-15, 4-7 from
    16-31). Exact int32 sums, the integers of dpbusd / dpbssd."""
    halves = []
    for k in (0, 1):
        a = ir.Constant(V4I32, None) if acc is None else shuffle(b, acc, acc, range(4 * k, 4 * k + 4))
        h = range(16 * k, 16 * k + 16)
        halves.append(
            call(b, "llvm.aarch64.neon.sdot.v4i32.v16i8", V4I32, [a, shuffle(b, w, w, h), shuffle(b, s, s, h)])
        )
    return shuffle(b, halves[0], halves[1], range(8))


def smmla(b, acc, w, x):
    """aarch64's smmla (i8mm): acc (<4 x i32>, or None for 0) + the 2 x 2 products of w's two
    rows of 8 s8 (bytes 0-7, 8-15 of a <16 x i8>) with x's two rows of 8: lanes (w0 x0, w0 x1,
    w1 x0, w1 x1), exact int32 sums."""
    acc = ir.Constant(V4I32, None) if acc is None else acc
    return call(b, "llvm.aarch64.neon.smmla.v4i32.v16i8", V4I32, [acc, w, x])
