"""aarch64's forms of intdot's integer-dot pieces: sdot (dotprod) and smmla (i8mm). intdot.emitter
picks them where the target CPU has the instructions (tests/test_arm64.py checks the assembly);
each gives the integers of intdot's generic form."""

from llvmlite import ir

from sparrow.kernels.ir import V4I32, call, shuffle


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


def dpbusd(b, acc, u, s):
    """sdot: every caller's u is below 128 (codes of 6 bits at most), the same as signed."""
    return sdot(b, acc, u, s)


def dpbssd(b, acc, w, s, u=None):
    """sdot: signed by signed, no sign transfer (u unused)."""
    return sdot(b, acc, w, s)
