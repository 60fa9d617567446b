"""LLVM IR building blocks shared by the vector-IR kernels (widen, gemm, attention.rows), and
the f32 reductions of the plain kernels in one fixed lane order (lane_dot, lane_sum; fma32).

Plain Python run at compile time; what they emit is part of those kernels' machine code (the
numba cache directory is keyed on every kernel source file, so editing this recompiles them).

Why the reductions are IR: a numba loop compiled with fastmath reassociation is vectorised by
LLVM at the target's own width (16 lanes on AVX-512, 8 on AVX2, 4 on NEON, interleaved by
its cost model), so its summation order, and its bits, followed the CPU (RMSNorm: 11% of
outputs differed between the same host's AVX-512 and AVX2 builds, 32% against aarch64). Here
the lanes are explicit <16 x float> vectors, which every target computes lane by lane (one zmm,
two ymm, four NEON q registers, or scalar code), so every CPU sums in the same order; and the
multiply-adds are llvm.fma, fused on every target (a libm call where the CPU has no FMA),
never left to the backend to contract where it can.
"""

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.cpu import AVX512F

F32, I8, I16, I32, I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V8F, V16F = (ir.VectorType(F32, n) for n in (8, 16))
V4I32, V8I32, V16I32, V32I32 = (ir.VectorType(I32, n) for n in (4, 8, 16, 32))
V8I16, V16I16, V32I16 = (ir.VectorType(I16, n) for n in (8, 16, 32))
V8I8, V16I8, V32I8, V64I8 = (ir.VectorType(I8, n) for n in (8, 16, 32, 64))


def call(builder, name, ret, args):
    """A call of the LLVM intrinsic (or function) `name` returning ret, declared on first use."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def c64(v):
    """An i64 constant."""
    return ir.Constant(I64, v)


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


def barrier(builder, *ptrs):
    """A compiler barrier over the memory at ptrs: it may have changed here, so LLVM loads
    again what it had stored there. Keeps a scalar stored as part of a vector a load from
    memory, which x86 folds into the instruction that uses it (vbroadcastss, an fma's
    {1to16} operand) instead of extracting and broadcasting it with shuffles."""
    fnty = ir.FunctionType(ir.VoidType(), [p.type for p in ptrs])
    fn = ir.InlineAsm(fnty, "", ",".join(["r"] * len(ptrs) + ["~{memory}"]), side_effect=True)
    builder.call(fn, list(ptrs))


def opaque(builder, v):
    """v, laundered through an empty inline asm: the same value, which LLVM can no longer
    derive from anything. A loop addressing a block's rows as opaque(p) + constant offsets
    keeps one register for them, where loop strength reduction would keep (and spill) a
    pointer per row."""
    fn = ir.InlineAsm(ir.FunctionType(v.type, [v.type]), "", "=r,0")
    return builder.call(fn, [v])


def nibbles_f32(builder, q):
    """<16 x i32> q -> float(q & 15) per lane. With AVX-512 one vpermps against the table
    0..15 (it reads only an index's low 4 bits), else and + convert: the same values."""
    if AVX512F:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(V16F, [V16F, V16I32]), "llvm.x86.avx512.permvar.sf.512"
        )
        return builder.call(fn, [ir.Constant(V16F, [float(i) for i in range(16)]), q])
    return builder.uitofp(builder.and_(q, ir.Constant(V16I32, [15] * 16)), V16F)


def zeroed(builder, ty):
    """A stack slot of type ty set to zero here (not once at function entry, as
    cgutils.alloca_once_value is): accumulators of a body that make_rows runs once per row."""
    slot = cgutils.alloca_once(builder, ty)
    builder.store(ir.Constant(ty, None), slot)
    return slot


def prefetch_lines(builder, p, n, locality=3):
    """Hint the cache lines of bytes p .. p + n - 1 (n: i64) into L1 (locality 3: prefetcht0)
    or L2 (2: prefetcht1)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0i8"
    )
    with cgutils.for_range_slice(builder, c64(0), n, c64(64)) as (i, _):
        builder.call(fn, [builder.gep(p, [i]), ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])


ROWS_AHEAD = 1  # make_rows prefetches the row this many ahead (0: none)
LANE_ACCS = 4  # 16-lane accumulators of lane_fold (chunk c goes to c % 4: four independent fma chains)


def lane_fold(builder, n, chunk, tail):
    """The fixed order of an f32 reduction over n values (i64 n): chunk c (values 16c ..
    16c+15) is folded into accumulator c % LANE_ACCS by chunk(acc, first index) -> acc, lane by
    lane; then (acc0 + acc1) + (acc2 + acc3) lane by lane, the pairwise tree hsum16, and the
    values after the last whole chunk one at a time, in order, by tail(s, index) -> s. The
    order depends on n only: not on the CPU, the vector width or the caller."""
    i64 = lambda v: ir.Constant(I64, v)  # noqa: E731
    accs = [zeroed(builder, V16F) for _ in range(LANE_ACCS)]
    nch = builder.lshr(n, i64(4))

    def fold(j, c):
        builder.store(chunk(builder.load(accs[j]), builder.shl(c, i64(4))), accs[j])

    with cgutils.for_range(builder, builder.lshr(nch, i64(2))) as loop:
        c0 = builder.shl(loop.index, i64(2))
        for j in range(LANE_ACCS):
            fold(j, builder.add(c0, i64(j)))
    left = builder.and_(nch, i64(LANE_ACCS - 1))
    c0 = builder.sub(nch, left)
    for j in range(LANE_ACCS - 1):  # the last whole chunks, fewer than LANE_ACCS
        with builder.if_then(builder.icmp_unsigned(">", left, i64(j))):
            fold(j, builder.add(c0, i64(j)))
    a = [builder.load(acc) for acc in accs]
    tot = cgutils.alloca_once(builder, F32)
    builder.store(hsum16(builder, builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3]))), tot)
    with cgutils.for_range_slice(builder, builder.shl(nch, i64(4)), n, i64(1)) as (i, _):
        builder.store(tail(builder.load(tot), i), tot)
    return builder.load(tot)


def _f32_vector(t):
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32


class _Elements:
    """Loads of a 1-D f32 array's elements: 16 at a time (a vector load where the array is
    contiguous, else 16 strided loads into the same lanes) or one."""

    def __init__(self, context, builder, ty, value):
        arr = context.make_array(ty)(context, builder, value)
        self.b, self.contiguous = builder, ty.layout == "C"
        self.base = builder.bitcast(arr.data, I8.as_pointer())
        self.stride = builder.extract_value(arr.strides, 0)
        self.n = builder.extract_value(arr.shape, 0)

    def at(self, i):
        return self.b.bitcast(self.b.gep(self.base, [self.b.mul(i, self.stride)]), F32.as_pointer())

    def load16(self, i, vector):
        if vector:
            return self.b.load(self.b.bitcast(self.at(i), V16F.as_pointer()), align=4)
        v = ir.Constant(V16F, ir.Undefined)
        for lane in range(16):
            x = self.b.load(self.at(self.b.add(i, c64(lane))))
            v = self.b.insert_element(v, x, ir.Constant(I32, lane))
        return v

    def load1(self, i):
        return self.b.load(self.at(i))


def _by_layout(builder, arrays, emit):
    """emit(vector loads?) once where every array is contiguous by its type, else a run-time
    choice between the two (rows of a strided view): the same lanes either way."""
    if all(a.contiguous for a in arrays):
        return emit(True)
    ok = builder.icmp_signed("==", arrays[0].stride, c64(4))
    for a in arrays[1:]:
        ok = builder.and_(ok, builder.icmp_signed("==", a.stride, c64(4)))
    out = cgutils.alloca_once(builder, F32)
    with builder.if_else(ok) as (vec, strided):
        with vec:
            builder.store(emit(True), out)
        with strided:
            builder.store(emit(False), out)
    return builder.load(out)


@intrinsic
def lane_dot(typingctx, a, b):
    """sum of a[i] * b[i] over a's length (b at least as long), f32, in lane_fold's order:
    acc = fma(a, b, acc) lane by lane, s = fma(a[i], b[i], s) for the tail."""
    if not (_f32_vector(a) and _f32_vector(b)):
        return None

    def codegen(context, builder, signature, args):
        x, y = (_Elements(context, builder, t, v) for t, v in zip(signature.args, args))

        def emit(vector):
            return lane_fold(
                builder,
                x.n,
                lambda acc, i: fma(builder, x.load16(i, vector), y.load16(i, vector), acc),
                lambda s, i: fma(builder, x.load1(i), y.load1(i), s),
            )

        return _by_layout(builder, [x, y], emit)

    return types.float32(a, b), codegen


@intrinsic
def lane_sum(typingctx, a, n):
    """sum of a[:n] (n <= len(a)), f32, in lane_fold's order: acc + a lane by lane, then s + a[i]."""
    if not (_f32_vector(a) and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        x = _Elements(context, builder, signature.args[0], args[0])
        cnt = context.cast(builder, args[1], signature.args[1], types.int64)

        def emit(vector):
            return lane_fold(
                builder,
                cnt,
                lambda acc, i: builder.fadd(acc, x.load16(i, vector)),
                lambda s, i: builder.fadd(s, x.load1(i)),
            )

        return _by_layout(builder, [x], emit)

    return types.float32(a, n), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """fma(a, b, c) on f32 scalars, rounded once on every target (llvm.fma: a loop of them
    vectorises; where the CPU has no FMA it is a libm call, never a separate multiply and add)."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None
    return types.float32(a, b, c), lambda context, builder, signature, args: fma(builder, *args)


ROW_CHUNK = 16  # rows a batched block matvec does for each x row before the next rows


@njit(cache=True, nogil=True)
def row_step(o0, o1, t_n):
    """How many of rows o0..o1-1 a block matvec over t_n x rows does for each x row before the
    next rows: all of them for one x row (one make_rows call), else ROW_CHUNK, so a batch reads
    each row from cache; at least 1 (a range step)."""
    return max(o1 - o0, 1) if t_n == 1 else ROW_CHUNK


def make_rows(emit, n_in, ahead=ROWS_AHEAD, together=1):
    """An intrinsic rows(data, o0, o1, in_1 .. in_n, y): y[o] = emit's value for row o of
    data (stored bytes [O, row bytes], each row contiguous) for o0 <= o < o1; in_1 .. in_n
    are 1-D arrays (one x row and what goes with it), y 1-D f32 of any stride.
    emit(builder, [row pointers i8*], [in_i data pointers as i8*], [in_i lengths]) -> [f32
    per row]: `together` rows at a time (then the rest one by one), each row's operations
    those it has alone, interleaved block by block.

    The row loop runs in compiled code: a numba-level call per row (array views, their
    reference counts, the format dispatch) cost ~30% of a Q4_0 matvec streaming from memory
    (6.8 vs 9.5 GB/s on one core, Qwen3-1.7B's lm_head). Before each row it prefetches the
    row `ahead` rows on (clamped to data's last row): the hardware prefetcher alone kept one
    core's Q4_0 / Q4_K rows at ~5 / ~4 GB/s from memory on an AMX Xeon, with it ~9-10. Rows
    taken two together (q4_0 / q4_1, whose constant term is one scalar fma chain a row, 4
    cycles of latency a block: two rows' chains overlap) are prefetched into L2, not L1: the
    two rows' 36 lines hinted at once overflowed a Zen 4 core's L1 miss buffers, the hints were
    dropped, and the dots ran from memory at half their speed."""
    locality = 3 if together == 1 else 2

    def typer(typingctx, data, o0, o1, *rest):
        ins = rest[:-1]  # then y
        ok = isinstance(data, types.Array) and data.ndim == 2 and len(ins) == n_in
        if not (ok and all(isinstance(a, types.Array) and a.ndim == 1 for a in rest)):
            return None
        sig = types.none(data, o0, o1, *rest)

        def codegen(context, builder, signature, args):
            b = builder
            arrs = [context.make_array(t)(context, b, a) for t, a in zip(signature.args[3:], args[3:])]
            d = context.make_array(signature.args[0])(context, b, args[0])
            stride = b.extract_value(d.strides, 0)
            base = b.bitcast(d.data, I8.as_pointer())
            ptrs = [b.bitcast(a.data, I8.as_pointer()) for a in arrs[:-1]]
            lens = [b.extract_value(a.shape, 0) for a in arrs[:-1]]
            yp, ystride = b.bitcast(arrs[-1].data, I8.as_pointer()), b.extract_value(arrs[-1].strides, 0)
            row_bytes = b.extract_value(d.shape, 1)
            last = b.sub(b.extract_value(d.shape, 0), c64(1))  # any row of data

            def rows_from(o, n):  # rows o .. o + n - 1, their results stored
                if ahead:
                    for j in range(n):
                        nxt = b.add(o, c64(ahead * n + j))
                        nxt = b.select(b.icmp_signed("<", nxt, last), nxt, last)
                        prefetch_lines(b, b.gep(base, [b.mul(nxt, stride)]), row_bytes, locality)
                rps = [b.gep(base, [b.mul(b.add(o, c64(j)), stride)]) for j in range(n)]
                for j, v in enumerate(emit(b, rps, ptrs, lens)):
                    at = b.gep(yp, [b.mul(b.add(o, c64(j)), ystride)])
                    b.store(v, b.bitcast(at, F32.as_pointer()))

            o0, o1 = args[1], args[2]
            n_together = b.sdiv(b.sub(o1, o0), c64(together))
            with cgutils.for_range(b, n_together) as loop:
                rows_from(b.add(o0, b.mul(loop.index, c64(together))), together)
            if together > 1:
                with cgutils.for_range_slice(b, b.add(o0, b.mul(n_together, c64(together))), o1, c64(1)) as (o, _):
                    rows_from(o, 1)
            return context.get_dummy_value()

        return sig, codegen

    # numba's @intrinsic reads the argument names: one spelled-out wrapper per arity
    if n_in == 2:  # f32 x rows: x, its 32-block sums

        def rows(typingctx, data, o0, o1, x, sx, y):
            return typer(typingctx, data, o0, o1, x, sx, y)

    elif n_in == 4:  # quantised x rows: codes, scales, scaled code sums, lane sums

        def rows(typingctx, data, o0, o1, xq, dx, sx, xs, y):
            return typer(typingctx, data, o0, o1, xq, dx, sx, xs, y)

    else:
        raise ValueError(f"make_rows: {n_in} inputs")
    return intrinsic(rows)


MULTI_T = 8  # x rows one call of a multi-row dot takes (kernels.linear.SMALL_T)
MULTI_R = 3  # x rows that share each decoded block: more are taken in groups of this many


class XRows:
    """R x rows (r0 .. r0 + R - 1, R known at compile time) of a multi-row dot (make_rows_x),
    as IR: x [T, K] and its 32-value sums [T, K / 32]; each row's two <16 x float>
    accumulators and scalar one are stack slots of the function's entry, which LLVM keeps in
    registers (constant indices)."""

    def __init__(self, b, xp, xs, sp, ss, r0, accs):
        self.b, self.xp, self.xs, self.sp, self.ss, self.r0 = b, xp, xs, sp, ss, r0
        self._accs = accs  # [(acc 0, acc 1, accm)] a row

    def each(self):
        """The rows' indices 0 .. R - 1 (Python ints: the body is emitted once a row)."""
        return range(len(self._accs))

    def x16(self, t, at):
        b = self.b
        row = b.add(self.r0, c64(t))
        return b.load(b.bitcast(b.gep(self.xp, [b.add(b.mul(row, self.xs), at)]), V16F.as_pointer()), align=4)

    def sx(self, t, at):
        b = self.b
        return b.load(b.gep(self.sp, [b.add(b.mul(b.add(self.r0, c64(t)), self.ss), at)]))

    def acc(self, t, j):
        """Row t's vector accumulator j (0 or 1)."""
        return self._accs[t][j]

    def accm(self, t):
        """Row t's scalar accumulator (the constant terms)."""
        return self._accs[t][2]


def make_rows_x(emit):
    """An intrinsic rows_x(data, o0, o1, x, sx, y): y[t, o] for rows o0 <= o < o1 of data
    (stored bytes [O, row bytes]) and every x row t (x [T, K] and its 32-value sums sx [T, K /
    32], rows contiguous, 1 <= T; y [T, O] f32 of any strides).

    emit(builder, row pointer i8*, xr: XRows, number of sums a row) adds every block's terms
    into xr's accumulators, decoding each block once for xr's rows; each row's result is then
    hsum16(acc 0 + acc 1) + accm, the single-row dots' final tree. The x rows go MULTI_R at a
    time (then the 1-3 left), each group over the weight row while it is in L1. The row loop
    prefetches the next row, as make_rows does."""

    def rows_x(typingctx, data, o0, o1, x, sx, y):
        if not all(isinstance(a, types.Array) and a.ndim == 2 for a in (data, x, sx, y)):
            return None
        sig = types.none(data, o0, o1, x, sx, y)

        def codegen(context, builder, signature, args):
            b = builder
            arrs = [context.make_array(signature.args[i])(context, b, args[i]) for i in (0, 3, 4, 5)]
            d_arr, x_arr, s_arr, y_arr = arrs
            base = b.bitcast(d_arr.data, I8.as_pointer())
            stride, row_bytes = b.extract_value(d_arr.strides, 0), b.extract_value(d_arr.shape, 1)
            last = b.sub(b.extract_value(d_arr.shape, 0), c64(1))
            T = b.extract_value(x_arr.shape, 0)
            xp, sp = b.bitcast(x_arr.data, F32.as_pointer()), b.bitcast(s_arr.data, F32.as_pointer())
            xs = b.lshr(b.extract_value(x_arr.strides, 0), c64(2))  # f32 elements a row
            ss = b.lshr(b.extract_value(s_arr.strides, 0), c64(2))
            nsums = b.extract_value(s_arr.shape, 1)
            yp = b.bitcast(y_arr.data, I8.as_pointer())
            ys0, ys1 = b.extract_value(y_arr.strides, 0), b.extract_value(y_arr.strides, 1)
            zv, zs = ir.Constant(V16F, [0.0] * 16), ir.Constant(F32, 0.0)
            slots = {
                R: [(cgutils.alloca_once(b, V16F), cgutils.alloca_once(b, V16F), cgutils.alloca_once(b, F32))
                    for _ in range(R)]
                for R in range(1, MULTI_R + 1)
            }  # fmt: skip
            with cgutils.for_range_slice(b, args[1], args[2], c64(1)) as (o, _):
                nxt = b.add(o, c64(1))
                nxt = b.select(b.icmp_signed("<", nxt, last), nxt, last)
                prefetch_lines(b, b.gep(base, [b.mul(nxt, stride)]), row_bytes)
                rp = b.gep(base, [b.mul(o, stride)])
                with cgutils.for_range_slice(b, c64(0), T, c64(MULTI_R)) as (r0, _):
                    left = b.sub(T, r0)
                    n = b.select(b.icmp_signed("<", left, c64(MULTI_R)), left, c64(MULTI_R))
                    for R in range(1, MULTI_R + 1):
                        with b.if_then(b.icmp_signed("==", n, c64(R))):
                            for a0, a1, am in slots[R]:
                                b.store(zv, a0)
                                b.store(zv, a1)
                                b.store(zs, am)
                            emit(b, rp, XRows(b, xp, xs, sp, ss, r0, slots[R]), nsums)
                            for t, (a0, a1, am) in enumerate(slots[R]):
                                v = b.fadd(b.load(a0), b.load(a1))
                                res = b.fadd(hsum16(b, v), b.load(am))
                                at = b.add(b.mul(b.add(r0, c64(t)), ys0), b.mul(o, ys1))
                                b.store(res, b.bitcast(b.gep(yp, [at]), F32.as_pointer()))
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(rows_x)


@intrinsic
def f16_bits(typingctx, x):
    """float32 -> IEEE half (round to nearest even, like numpy's astype(float16)) as uint16 bits."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(h, I16)

    return types.uint16(types.float32), codegen
