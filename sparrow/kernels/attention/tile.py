"""C += A @ B on small float32 tiles that sit in L1, as LLVM vector IR (prefill attention).

mm_add(A, B, C, n): C[r, c] += sum over k < n of A[r, k] * B[k, c], for every row r of A and C
and every column c of B and C (float32 2-D arrays whose rows are contiguous: C-contiguous, or
column slices of such arrays, as a block of a transposed key matrix).

MR rows and NW vectors of LANES columns at a time (kernels.cpu.ATTENTION_TILE: 8 x 2 x 16 with
AVX-512, else 4 x 2 x 8): per k, NW loads of B's row feed MR * NW fmas (MR broadcast A values),
so the accumulators stay in registers and a key or value row read from L1 serves MR query rows.
numba's loops kept the accumulator row in memory (a load and a store per fma), which halved the
rate. Row tails go 4 rows, then one, at a time; column tails one vector, then 8 lanes, then one
column at a time.

Every element is one fma chain from C's value, k ascending: the same bits whatever the tile
shape or vector width, so a row's result depends only on that row's data.
"""

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.cpu import ATTENTION_TILE
from sparrow.kernels.ir import F32, I64, fma, splat16

MR, NW, LANES = ATTENTION_TILE


def _c(v):
    return ir.Constant(I64, v)


def _at(b, base, stride, row, col):
    return b.gep(base, [b.add(b.mul(row, stride), col)])


def _load(b, ptr, lanes):
    if lanes > 1:
        return b.load(b.bitcast(ptr, ir.VectorType(F32, lanes).as_pointer()), align=4)
    return b.load(ptr)


def _store(b, val, ptr, lanes):
    if lanes > 1:
        b.store(val, b.bitcast(ptr, ir.VectorType(F32, lanes).as_pointer()), align=4)
    else:
        b.store(val, ptr)


def _tile(b, mats, r0, c0, n, rows, nvec, lanes):
    """C[r0:r0+rows, c0:c0+nvec*lanes] += A[r0:r0+rows, :n] @ B[:n, c0:c0+nvec*lanes] (lanes 1:
    scalar columns). mats: (ap, bp, cp, sa, sb, sc), A's, B's and C's float pointers and row
    strides (in elements)."""
    ap, bp, cp, sa, sb, sc = mats
    cptrs = [[_at(b, cp, sc, b.add(r0, _c(i)), b.add(c0, _c(lanes * v))) for v in range(nvec)] for i in range(rows)]
    accs = [[cgutils.alloca_once_value(b, _load(b, p, lanes)) for p in row] for row in cptrs]
    with cgutils.for_range(b, n) as loop:
        k = loop.index
        bv = [_load(b, _at(b, bp, sb, k, b.add(c0, _c(lanes * v))), lanes) for v in range(nvec)]
        for i in range(rows):
            a = b.load(_at(b, ap, sa, b.add(r0, _c(i)), k))
            a = splat16(b, a, lanes) if lanes > 1 else a
            for v in range(nvec):
                b.store(fma(b, a, bv[v], b.load(accs[i][v])), accs[i][v])
    for i in range(rows):
        for v in range(nvec):
            _store(b, b.load(accs[i][v]), cptrs[i][v], lanes)


def _columns(b, mats, r0, n, cols, rows):
    """All columns of rows r0..r0+rows-1: NW * LANES at a time, then LANES, then 8, then one."""
    width = NW * LANES
    nw = b.udiv(cols, _c(width))
    with cgutils.for_range(b, nw) as loop:
        _tile(b, mats, r0, b.mul(loop.index, _c(width)), n, rows, NW, LANES)
    done = b.mul(nw, _c(width))
    for lanes in sorted({LANES, 8}, reverse=True):  # one vector at a time, wide then 8 lanes
        if lanes >= width:
            continue
        with cgutils.for_range_slice(b, done, b.sub(cols, _c(lanes - 1)), _c(lanes)) as (c, _):
            _tile(b, mats, r0, c, n, rows, 1, lanes)
        left = b.sub(cols, done)
        done = b.add(done, b.mul(b.udiv(left, _c(lanes)), _c(lanes)))
    with cgutils.for_range_slice(b, done, cols, _c(1)) as (c, _):
        _tile(b, mats, r0, c, n, rows, 1, 1)


def _rows(b, mats, n, cols, r0, r1, mr):
    """Rows r0..r1-1 in tiles of mr rows; returns the first row not done."""
    nt = b.udiv(b.sub(r1, r0), _c(mr))
    with cgutils.for_range(b, nt) as loop:
        _columns(b, mats, b.add(r0, b.mul(loop.index, _c(mr))), n, cols, mr)
    return b.add(r0, b.mul(nt, _c(mr)))


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
        pointers = tuple(b.bitcast(x.data, F32.as_pointer()) for x in arrs)
        strides = tuple(b.lshr(b.extract_value(x.strides, 0), _c(2)) for x in arrs)  # row strides
        mats = pointers + strides
        cols = b.extract_value(arrs[1].shape, 1)
        rows = b.extract_value(arrs[0].shape, 0)
        n = args[3]
        r = _c(0)
        for mr in sorted({MR, 4, 1}, reverse=True):
            r = _rows(b, mats, n, cols, r, rows, mr)
        return context.get_dummy_value()

    return sig, codegen
