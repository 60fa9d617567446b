"""LLVM IR building blocks shared by the vector-IR kernels (_widen, gemm, _attn_rows).

Plain Python run at compile time; what they emit is part of those kernels' machine code (the
numba cache directory is keyed on every kernel source file, so editing this recompiles them).
"""

from llvmlite import ir
from numba.core import cgutils

F32, I8, I16, I32, I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V16F = ir.VectorType(F32, 16)
V16I32 = ir.VectorType(I32, 16)


def fma(builder, a, b, c):
    """a * b + c rounded once (llvm.fma), scalar f32 or <n x float>."""
    ty = a.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]), name)
    return builder.call(fn, [a, b, c])


def shuffle(builder, x, y, idx):
    return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, len(idx)), list(idx)))


def hsum16(builder, v):
    """Sum of a <n x float> (16 or 8 lanes) by the fixed pairwise tree n -> n/2 -> ... -> 1
    (lane i + i+n/2)."""
    n = v.type.count
    while n > 1:
        h = n // 2
        v = builder.fadd(shuffle(builder, v, v, range(h)), shuffle(builder, v, v, range(h, n)))
        n = h
    return builder.extract_element(v, ir.Constant(I32, 0))


def splat16(builder, x, n=16):
    """A scalar f32 broadcast to <n x float> (16 lanes unless n says otherwise)."""
    undef = ir.Constant(ir.VectorType(F32, n), ir.Undefined)
    v = builder.insert_element(undef, x, ir.Constant(I32, 0))
    return shuffle(builder, v, undef, [0] * n)
