"""x86's forms of intdot's integer-dot pieces: pmaddubsw / pmaddwd / psignb (AVX2) and vpdpbusd
(AVX-VNNI, AVX512-VNNI). intdot.emitter picks them where the target CPU has the instructions;
each gives the integers of intdot's generic form."""

from llvmlite import ir

from sparrow.kernels.ir import V8I32, V16I16, V16I32, V32I8, call

_FALSE = ir.Constant(ir.IntType(1), 0)


def absb(b, w):
    """|w| of <32 x i8> (AVX2 only: maddbs's u, shared by the x rows that meet one w)."""
    return call(b, "llvm.abs.v32i8", V32I8, [w, _FALSE])


def maddubs(b, u, s):
    """pmaddubsw (AVX2)."""
    return call(b, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [u, s])


def maddbs(b, w, s, u=None):
    """|w| (u, when the caller has it) against s with w's sign (psignb), by pmaddubsw (AVX2)."""
    u = absb(b, w) if u is None else u
    return maddubs(b, u, call(b, "llvm.x86.avx2.psign.b", V32I8, [s, w]))


def maddwd(b, v, c):
    """pmaddwd (AVX2)."""
    return call(b, "llvm.x86.avx2.pmadd.wd", V8I32, [v, c])


def dpbusd(b, acc, u, s):
    """One ymm vpdpbusd (AVX-VNNI / AVX512-VNNI)."""
    acc = ir.Constant(V8I32, None) if acc is None else acc
    return call(b, "llvm.x86.avx512.vpdpbusd.256", V8I32, [acc, b.bitcast(u, V8I32), b.bitcast(s, V8I32)])


def dpbusd16(b, acc, u, s):
    """One zmm vpdpbusd (AVX512-VNNI)."""
    acc = ir.Constant(V16I32, None) if acc is None else acc
    return call(b, "llvm.x86.avx512.vpdpbusd.512", V16I32, [acc, b.bitcast(u, V16I32), b.bitcast(s, V16I32)])


def dpbssd(b, acc, w, s, u=None):
    """|w| (u, when the caller has it) against s with w's sign (psignb), by vpdpbusd (VNNI)."""
    u = absb(b, w) if u is None else u
    return dpbusd(b, acc, u, call(b, "llvm.x86.avx2.psign.b", V32I8, [s, w]))
