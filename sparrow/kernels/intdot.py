"""LLVM IR pieces of integer dot products: the activations="q8" mode's (matmul.q8.quantized,
q8.groups, q8.kquant_groups, q8.pair_tiles) and selector v3's scores on 4-bit key codes
(attention.codes4).

Every piece computes exact integers, so x86's vpdpbusd (AVX-VNNI / AVX512-VNNI), pmaddubsw /
pmaddwd / psignb (AVX2), aarch64's sdot (dotprod) and the plain vector IR of the generic path
give the same values: the bits never depend on which one a CPU takes (tests compile the other
paths for other CPUs and compare; tests/test_arm64.py checks the aarch64 assembly). The generic
forms are here; the architectures' own are in kernels/arch (x86.py, arm64.py), and emitter() is
the one place that picks a piece's form from the target CPU's features.
"""

from llvmlite import ir

from sparrow.kernels.arch import arm64, x86
from sparrow.kernels.cpu import AVX2, DOTPROD, I8MM, VNNI, VNNI512  # noqa: F401 (this module's face: which IR it emits)
from sparrow.kernels.ir import I8, I32, V16I16, V16I32, V32I16, shuffle

# dpbusd / dpbssd in one instruction a 4-byte group: x86's vpdpbusd or aarch64's sdot
DOT4 = VNNI or DOTPROD


def splat(b, v, vty):
    """The scalar v in every lane of a vector of type vty."""
    und = ir.Constant(vty, ir.Undefined)
    return shuffle(b, b.insert_element(und, v, ir.Constant(I32, 0)), und, [0] * vty.count)


def bcast4(b, p, lanes=8):
    """The 4 bytes at p (i8*) repeated in all `lanes` i32 lanes, as <4 lanes x i8>."""
    v = splat(b, b.load(b.bitcast(p, I32.as_pointer()), align=1), ir.VectorType(I32, lanes))
    return b.bitcast(v, ir.VectorType(I8, 4 * lanes))


# ---------------------------------------------------------------- the generic forms


def _pair_sums(b, p, n):
    """<n x i32 or i16> lane j = p[2j] + p[2j + 1] of the 2n products p."""
    return b.add(shuffle(b, p, p, range(0, 2 * n, 2)), shuffle(b, p, p, range(1, 2 * n, 2)))


def _maddubs(b, u, s):
    return _pair_sums(b, b.mul(b.zext(u, V32I16), b.sext(s, V32I16)), 16)


def _maddbs(b, w, s, u=None):
    return _pair_sums(b, b.mul(b.sext(w, V32I16), b.sext(s, V32I16)), 16)


def _maddwd(b, v, c):
    return _pair_sums(b, b.mul(b.sext(v, V16I32), b.sext(c, V16I32)), 8)


def _dpbusd(b, acc, u, s):
    s4 = maddwd(b, maddubs(b, u, s))
    return s4 if acc is None else b.add(acc, s4)


def _dpbusd16(b, acc, u, s):
    halves = []
    for k in (0, 1):  # lanes 8k .. 8k + 7, bytes 32k .. 32k + 31
        a = None if acc is None else shuffle(b, acc, acc, range(8 * k, 8 * k + 8))
        h = range(32 * k, 32 * k + 32)
        halves.append(dpbusd(b, a, shuffle(b, u, u, h), shuffle(b, s, s, h)))
    return shuffle(b, halves[0], halves[1], range(16))


def _dpbssd(b, acc, w, s, u=None):
    s4 = maddwd(b, maddbs(b, w, s, u))
    return s4 if acc is None else b.add(acc, s4)


_GENERIC = {
    "maddubs": _maddubs,
    "maddbs": _maddbs,
    "maddwd": _maddwd,
    "dpbusd": _dpbusd,
    "dpbusd16": _dpbusd16,
    "dpbssd": _dpbssd,
}
# A piece's architecture forms, in order of preference: the flag (this module's, read when the
# IR is emitted) of the CPU feature each needs, and the module that emits it
_BY_FEATURE = {
    "maddubs": (("AVX2", x86),),
    "maddbs": (("AVX2", x86),),
    "maddwd": (("AVX2", x86),),
    "dpbusd": (("VNNI", x86), ("DOTPROD", arm64)),
    "dpbusd16": (("VNNI512", x86),),
    "dpbssd": (("VNNI", x86), ("DOTPROD", arm64)),
}


def emitter(piece: str):
    """The IR emitter of `piece` for the target CPU: its architecture's form where the CPU has
    the instructions, else the generic one."""
    for flag, arch in _BY_FEATURE[piece]:
        if globals()[flag]:
            return getattr(arch, piece)
    return _GENERIC[piece]


# ---------------------------------------------------------------- the pieces


def absb(b, w):
    """|w| of <32 x i8> (AVX2 only: maddbs's u, shared by the x rows that meet one w)."""
    return x86.absb(b, w)


def maddubs(b, u, s):
    """pmaddubsw without its saturation (every caller's pair sums fit int16): <32 x i8> u
    unsigned, s signed -> <16 x i16>, element i = u[2i] s[2i] + u[2i+1] s[2i+1]."""
    return emitter("maddubs")(b, u, s)


def maddbs(b, w, s, u=None):
    """maddubs for signed w (|w| <= 128): on AVX2 |w| (u, when the caller has it) against s
    with w's sign (psignb), the same products w s."""
    return emitter("maddbs")(b, w, s, u)


def maddwd(b, v, c=None):
    """pmaddwd: <16 x i16> v, c (all 1 when None) -> <8 x i32>, lane j = v[2j] c[2j] +
    v[2j+1] c[2j+1]."""
    c = ir.Constant(V16I16, [1] * 16) if c is None else c
    return emitter("maddwd")(b, v, c)


def dpbusd(b, acc, u, s):
    """acc (<8 x i32>, or None for 0) + lane j = sum of u[4j + i] s[4j + i], i < 4: <32 x i8>
    u unsigned, s signed. One vpdpbusd with VNNI, sdot with dotprod (every caller's u is below
    128), else pmaddubsw + pmaddwd (+ paddd): the same integers, as the products' pair sums
    fit int16 for every caller's codes."""
    return emitter("dpbusd")(b, acc, u, s)


def dpbusd16(b, acc, u, s):
    """dpbusd on 16 lanes: acc (<16 x i32>, or None for 0) + lane j = sum of u[4j + i]
    s[4j + i], i < 4, <64 x i8> u unsigned and s signed. One zmm vpdpbusd with VNNI512, else
    dpbusd on each half (the same integers)."""
    return emitter("dpbusd16")(b, acc, u, s)


def dpbssd(b, acc, w, s, u=None):
    """dpbusd for signed w (|w| <= 128): |w| (u, when the caller has it) against s with w's
    sign, the same products w s (dotprod: sdot, signed by signed)."""
    return emitter("dpbssd")(b, acc, w, s, u)
