"""C += A @ B on small float32 tiles that sit in L1, as LLVM vector IR (prefill attention).

mm_add(A, B, C, n): C[r, c] += sum over k < n of A[r, k] * B[k, c], for every row r of A and C
and every column c of B and C (float32 2-D arrays whose rows are contiguous: C-contiguous, or
column slices of such arrays, as a block of a transposed key matrix).

Four rows and sixteen columns at a time: per k, two 8-lane loads of B's row feed eight fmas
(four broadcast A values), so the accumulators stay in registers and a key or value row read
from L1 serves four query rows. numba's loops kept the accumulator row in memory (a load and a
store per fma), which halved the rate. Column tails go 8 lanes, then one column, at a time;
row tails one row at a time.

Every element is one fma chain from C's value, k ascending: the same bits whatever the tile
grouping, so a row's result depends only on that row's data.
"""

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.ir import F32, I64, fma, splat16

V8F = ir.VectorType(F32, 8)


def _c(v):
    return ir.Constant(I64, v)


def _at(b, base, stride, row, col):
    return b.gep(base, [b.add(b.mul(row, stride), col)])


def _load(b, ptr, vec):
    if vec:
        return b.load(b.bitcast(ptr, V8F.as_pointer()), align=4)
    return b.load(ptr)


def _store(b, val, ptr, vec):
    if vec:
        b.store(val, b.bitcast(ptr, V8F.as_pointer()), align=4)
    else:
        b.store(val, ptr)


def _tile(b, ap, bp, cp, sa, sb, sc, r0, c0, n, rows, nvec):
    """C[r0:r0+rows, c0:c0+width] += A[r0:r0+rows, :n] @ B[:n, c0:c0+width] with width 8 * nvec
    (nvec 0: one column)."""
    vec = nvec > 0
    lanes = max(nvec, 1)
    cptrs = [[_at(b, cp, sc, b.add(r0, _c(i)), b.add(c0, _c(8 * v))) for v in range(lanes)] for i in range(rows)]
    accs = [[cgutils.alloca_once_value(b, _load(b, p, vec)) for p in row] for row in cptrs]
    with cgutils.for_range(b, n) as loop:
        k = loop.index
        bv = [_load(b, _at(b, bp, sb, k, b.add(c0, _c(8 * v))), vec) for v in range(lanes)]
        for i in range(rows):
            a = b.load(_at(b, ap, sa, b.add(r0, _c(i)), k))
            a = splat16(b, a, 8) if vec else a
            for v in range(lanes):
                b.store(fma(b, a, bv[v], b.load(accs[i][v])), accs[i][v])
    for i in range(rows):
        for v in range(lanes):
            _store(b, b.load(accs[i][v]), cptrs[i][v], vec)


def _columns(b, ap, bp, cp, sa, sb, sc, r0, n, cols, rows):
    """All columns of rows r0..r0+rows-1: 16 at a time, then 8, then one at a time."""
    n16 = b.lshr(cols, _c(4))
    with cgutils.for_range(b, n16) as loop:
        _tile(b, ap, bp, cp, sa, sb, sc, r0, b.shl(loop.index, _c(4)), n, rows, 2)
    done = b.shl(n16, _c(4))
    with b.if_then(b.icmp_signed(">=", b.sub(cols, done), _c(8))):
        _tile(b, ap, bp, cp, sa, sb, sc, r0, done, n, rows, 1)
    with cgutils.for_range_slice(b, b.and_(cols, _c(~7)), cols, _c(1)) as (c, _):
        _tile(b, ap, bp, cp, sa, sb, sc, r0, c, n, rows, 0)


@intrinsic
def mm_add(typingctx, A, B, C, n):
    """C += A[:, :n] @ B[:n] (float32 2-D; each row contiguous, the caller's promise)."""
    for arr in (A, B, C):
        if not isinstance(arr, types.Array) or arr.dtype != types.float32 or arr.ndim != 2:
            return None
    sig = types.none(A, B, C, types.int64)

    def codegen(context, builder, signature, args):
        b = builder
        arrs = [context.make_array(t)(context, b, a) for t, a in zip(signature.args[:3], args[:3])]
        ap, bp, cp = (b.bitcast(x.data, F32.as_pointer()) for x in arrs)
        sa, sb, sc = (b.lshr(b.extract_value(x.strides, 0), _c(2)) for x in arrs)  # row strides
        cols = b.extract_value(arrs[1].shape, 1)
        rows = b.extract_value(arrs[0].shape, 0)
        n = args[3]
        n4 = b.lshr(rows, _c(2))
        with cgutils.for_range(b, n4) as loop:
            _columns(b, ap, bp, cp, sa, sb, sc, b.shl(loop.index, _c(2)), n, cols, 4)
        with cgutils.for_range_slice(b, b.shl(n4, _c(2)), rows, _c(1)) as (r, _):
            _columns(b, ap, bp, cp, sa, sb, sc, r, n, cols, 1)
        return context.get_dummy_value()

    return sig, codegen
