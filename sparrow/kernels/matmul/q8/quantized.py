"""Decode matvecs with activations quantised to 8 bits: the named mode activations="q8".

llama.cpp's arithmetic: each 32-value block of x becomes int8 codes and one f32 scale, and
each block's dot product with a weight block is an exact integer sum. It reads the same
weight bytes as the exact path (kernels.matmul.widen) with a fraction of the vector instructions
a block, so on a compute-bound core it decodes faster. Every format it covers (q8_0, q4_0,
q4_1, q5_0, q5_1 in q8/groups.py; the K-quants q4_k, q5_k, q6_k in q8/kquant_groups.py) is read
as rows interleaved in groups of 8, built once per weight (docs/kernels.md has the speeds
against the exact rows); q8.groups and q8.kquant_groups document the
order, intdot holds the IR pieces they share, this module quantises x and dispatches. It is
not exact: on SmolLM2-135M (Q4_1) its decode logits differ from the f32 path by KL 3.1e-3 on
average and agree on the top token at 98% of 400 positions, which is why it is a mode, the
default only where exact decode would trail llama.cpp's (models/activations.py).

Per x row and block b (32 values): a = max |x|, dx = a / 127, codes q = rint(x * 127 / a)
(all 0 where 127 / a overflows: a == 0, or a block of values below ~3.7e-37, whose infinite
scale x86 turned into codes 0 and aarch64 would have saturated), sx = dx * sum(q). Integer
sums are exact, so every CPU path (AVX2's pmaddubsw, VNNI's vpdpbusd or the generic vector
code numba emits elsewhere) gives the same bits, whatever T, batch or thread count.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from sparrow.kernels.cpu import FEATURES as CPU_FEATURES
from sparrow.kernels.dispatch import by_kind
from sparrow.kernels.elementwise import PAR_ROWS
from sparrow.kernels.formats import (
    BY_NAME,
    FORMATS,
    X8_FIRST,
    X8_KIND,
    X8_Q4_0,
    X8_Q5_0,
    X8_Q6_K,
    X8_Q8_0,
    ZMM_PAIR_KINDS,
)
from sparrow.kernels.intdot import AVX2, VNNI512
from sparrow.kernels.ir import F32, I8, I32, V16F, V16I8, V16I32, c64, call, shuffle, splat16
from sparrow.kernels.matmul.q8 import amx, kquant_groups, pair_tiles
from sparrow.kernels.matmul.q8 import groups as _groups
from sparrow.kernels.matmul.q8.groups import GROUP, TILE_X_ROWS, interleave
from sparrow.kernels.matmul.q8.pair_tiles import PAIR_X_ROWS
from sparrow.kernels.matmul.widen import call_slp
from sparrow.kernels.native_call import address_for, call_native
from sparrow.kernels.options import KW, PARALLEL_MIN_MACS
from sparrow.kernels.options import ROWS as _ROWS
from sparrow.kernels.parallel import run_parallel
from sparrow.memory import MADV_DONTNEED, advise_mapped_pages

__all__ = ["AVX2", "CPU_FEATURES", "Q8Weight", "matmul_amx", "matvec_q8", "quantize", "rows_q8"]


@intrinsic
def _quantize_row(typingctx, x, xq, dx, sx, q0, qstep, s0, sstep):
    """One contiguous row x f32 [K]: block b's 32 codes to xq's elements q0 + b qstep .., its
    dx and sx to elements s0 + b sstep of dx and sx (of their data, whatever their shape: a
    row-major row, or the AMX tiles' layout), in the module docstring's order in two 16-lane
    vectors a block: a is folded as max(a, |x|) from 0 (a NaN never wins, as in a scalar fold),
    by a tree (max is exact in any order); x * inv is one f32 multiply, rounded half to even
    (llvm.rint) and converted. Written out in IR because numba's scalar loop does not
    vectorise (its max is a select chain); docs/kernels.md has the speeds."""
    if any(not isinstance(a, types.Array) or a.layout != "C" for a in (x, xq, dx, sx)) or x.ndim != 1:
        return None
    sig = types.void(x, xq, dx, sx, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, b, signature, args):
        xa, qa, da, sa = (context.make_array(t)(context, b, v) for t, v in zip(signature.args[:4], args[:4]))
        q0, qstep, s0, sstep = args[4:]
        xp, qp = b.bitcast(xa.data, F32.as_pointer()), b.bitcast(qa.data, I8.as_pointer())
        dp, sp = b.bitcast(da.data, F32.as_pointer()), b.bitcast(sa.data, F32.as_pointer())

        def bigger(u, v):  # max(v, u) as the scalar fold takes it: u only where u > v
            return b.select(b.fcmp_ordered(">", u, v), u, v)

        with cgutils.for_range(b, b.udiv(b.extract_value(xa.shape, 0), c64(32))) as loop:
            i = loop.index
            xs = [
                b.load(b.bitcast(b.gep(xp, [b.add(b.mul(i, c64(32)), c64(16 * h))]), V16F.as_pointer()), align=4)
                for h in (0, 1)
            ]
            m = ir.Constant(V16F, None)
            for v in xs:
                m = bigger(call(b, "llvm.fabs.v16f32", V16F, [v]), m)
            n = 16
            while n > 1:
                m = bigger(shuffle(b, m, m, range(n // 2, n)), shuffle(b, m, m, range(n // 2)))
                n //= 2
            a = b.extract_element(m, ir.Constant(I32, 0))
            inv = b.fdiv(ir.Constant(F32, 127.0), a)  # 0 where it overflows (a == 0, or a < ~3.7e-37)
            inv = b.select(b.fcmp_ordered("<", inv, ir.Constant(F32, float("inf"))), inv, ir.Constant(F32, 0.0))
            codes = []
            for h, v in enumerate(xs):
                c = b.trunc(b.fptosi(call(b, "llvm.rint.v16f32", V16F, [b.fmul(v, splat16(b, inv))]), V16I32), V16I8)
                dst = b.gep(qp, [b.add(b.add(q0, b.mul(i, qstep)), c64(16 * h))])
                b.store(c, b.bitcast(dst, V16I8.as_pointer()), align=1)
                codes.append(b.sext(c, V16I32))  # the stored codes (a NaN's too) are summed
            tot = call(b, "llvm.vector.reduce.add.v16i32", I32, [b.add(*codes)])
            d = b.fdiv(a, ir.Constant(F32, 127.0))
            at = b.add(s0, b.mul(i, sstep))
            b.store(d, b.gep(dp, [at]))
            b.store(b.fmul(d, b.sitofp(tot, F32)), b.gep(sp, [at]))
        return context.get_dummy_value()

    return sig, codegen


@njit(**KW)
def quantize_rows(x, xq, dx, sx):
    """x f32 [T, K] -> codes xq int8 [T, K], scales dx and scaled code sums sx f32 [T, K/32]."""
    x = np.ascontiguousarray(x)
    for t in range(x.shape[0]):
        _quantize_row(x[t], xq[t], dx[t], sx[t], 0, 32, 0, 1)


@njit(**KW)
def _quantize_tiles_chunk(c, x, xa, dxa, sxa):
    # rows [c PAR_ROWS, (c + 1) PAR_ROWS) of quantize_tiles's x, straight into the tiles' layout
    nb = x.shape[1] // 32
    for t in range(c * PAR_ROWS, min((c + 1) * PAR_ROWS, x.shape[0])):
        at = (t // amx.TILE) * nb * amx.TILE + t % amx.TILE  # row t's slot in its tile's block 0
        _quantize_row(x[t], xa, dxa, sxa, at * 32, amx.TILE * 32, at, amx.TILE)


@njit(**KW)
def _quantize_chunk(c, x, xq, dx, sx):
    # rows [c PAR_ROWS, (c + 1) PAR_ROWS) of quantize_padded's x, one launch each
    # (kernels/parallel.py): serially, quantising x was a visible share of a q8 prefill; the
    # same bits a row
    r = slice(c * PAR_ROWS, (c + 1) * PAR_ROWS)
    quantize_rows(x[r], xq[r], dx[r], sx[r])


@njit(**KW)
def quantize(x):
    t_n, k = x.shape
    xq = np.empty((t_n, k), np.int8)
    dx = np.empty((t_n, k // 32), np.float32)
    sx = np.empty((t_n, k // 32), np.float32)
    quantize_rows(x, xq, dx, sx)
    return xq, dx, sx


@njit(**KW)
def code_sums(xq, n, times):
    """int8 codes [T, K] -> int32 [T, K / n]: `times` times the code sum of each n values.
    q4_0 / q5_0 groups subtract 8 (q5_0: 16) sum(code_x) per block of 32 (code_sums(xq, 32,
    8)); q6_k's pair tiles take its codes unsigned, plus 32, and subtract 32 sum(code_x) per
    16 values (code_sums(xq, 16, 32)), q8_0's plus 128 and 128 sum(code_x) per block
    (code_sums(xq, 32, 128): at most 128 * 32 * 127, well inside int32)."""
    t_n, k = xq.shape
    out = np.empty((t_n, k // n), np.int32)
    for t in range(t_n):
        for b in range(k // n):
            s = np.int32(0)
            for j in range(n):
                s += np.int32(xq[t, n * b + j])
            out[t, b] = times * s
    return out


# Each interleaved format's tiles (formats.py's X8_KIND: q8_0, q4_0, q4_1, q5_0, q5_1 in q8.groups;
# the K-quants in q8.kquant_groups) and zmm pair tiles (those claiming zmm_pairs), by x8 kind.
_X8_TILES = {**_groups.GROUPS, **kquant_groups.GROUPS}
# _group_tiles(kind, data, g0, g1, x8, y, t0, mr, o_n): y[t0 : t0 + mr, rows of groups g0 .. g1 - 1]
# (mr <= q8.groups.TILE_X_ROWS); x8: (xq, dx, sx, bs), the quantised x rows and their sums
_group_tiles = by_kind("q8_group_tiles", {k: _X8_TILES[q] for q, k in X8_KIND.items()})
_pairs = by_kind("q8_pair_tiles", {f.x8: pair_tiles.PAIRS[f.name] for f in FORMATS if f.zmm_pairs})


GROUP_CHUNK = 16  # groups (128 rows) a tile pass covers before the next x rows, when T > TILE_X_ROWS


@njit(**KW)
def _pair_tiles(data, kind, g0, g1, xq, dx, sx, bs, y):
    """q8.pair_tiles's tiles over groups g0 .. g1 - 1 (an even count of full groups), every x row."""
    t_n = xq.shape[0]
    x8 = (xq, dx, sx, bs)
    for t0 in range(0, t_n, PAIR_X_ROWS):
        mr = min(PAIR_X_ROWS, t_n - t0)
        _pairs(kind, data, g0, g1, x8, y, t0, mr)


@njit(**KW)
def x8_rows(data, kind, xq, dx, sx, bs, y, g0, g1):
    """y[t, o] for every x row t and the rows o < y.shape[1] of groups g0 .. g1 - 1: x rows
    in tiles of TILE_X_ROWS (the last one smaller), a chunk of groups at a time so it stays in cache
    while the tiles pass. Where takes_pairs, groups go in pairs through q8.pair_tiles's zmm tiles (the
    same bits), the rest as before."""
    t_n, o_n = xq.shape[0], y.shape[1]
    x8 = (xq, dx, sx, bs)
    step = max(g1 - g0, 1) if t_n <= TILE_X_ROWS else GROUP_CHUNK
    pairs = takes_pairs(kind, t_n) and y.strides[1] == 4
    for c in range(g0, g1, step):
        e = min(g1, c + step)
        p = c
        if pairs:  # an even count of groups whose rows are all in y
            p = c + max(min(e, o_n // GROUP) - c, 0) // 2 * 2
            _pair_tiles(data, kind, c, p, xq, dx, sx, bs, y)
        if p < e:
            for t0 in range(0, t_n, TILE_X_ROWS):
                _group_tiles(kind, data, p, e, x8, y, t0, min(TILE_X_ROWS, t_n - t0), o_n)


@njit(**KW)
def takes_pairs(kind, t_n):
    """Whether t_n x rows of an interleaved kind go through q8.pair_tiles's zmm pair tiles: more than
    TILE_X_ROWS of them, a CPU with AVX512-VNNI, and a kind with pair tiles (formats.py's zmm_pairs)."""
    return VNNI512 and t_n > TILE_X_ROWS and kind in ZMM_PAIR_KINDS


@njit(**KW)
def x_sums(kind, xq):
    """What a kind's rows read of x besides its codes and scales: q4_0 / q5_0 groups 8
    sum(code_x) per block, the zmm pair tiles of q8_0 128 sum(code_x) per block and of q6_k
    32 sum(code_x) per 16 values (where they run), other kinds nothing (code_sums)."""
    if kind == X8_Q4_0 or kind == X8_Q5_0:
        return code_sums(xq, 32, 8)
    if kind == X8_Q8_0 and takes_pairs(kind, xq.shape[0]):
        return code_sums(xq, 32, 128)
    if kind == X8_Q6_K and takes_pairs(kind, xq.shape[0]):
        return code_sums(xq, 16, 32)
    return np.empty((xq.shape[0], 0), np.int32)


@njit(**KW)
def rows_q8(data, kind, xq, dx, sx, y, o0, o1):
    """y[t, o] for rows o0..o1-1 of stored block rows `data` against quantised x rows; for
    the q8.groups kinds (interleaved q8_0 / q4_0 / q4_1 / K-quants) data's rows, o0 and o1 count
    groups of 8 rows of y's (the last group may be partly padding)."""
    rows_q8_xs(data, kind, xq, dx, sx, x_sums(kind, xq), y, o0, o1)


@njit(**KW)
def rows_q8_xs(data, kind, xq, dx, sx, xs, y, o0, o1):
    """rows_q8 with x_sums(kind, xq) given: a parallel matvec computes them once, not once a
    chunk of rows (recomputed for each chunk, a prefill's sums took half its time)."""
    if kind < X8_FIRST:  # every q8 format is read interleaved (Q8Weight)
        raise ValueError("rows_q8: weights not in the q8 mode's groups")
    x8_rows(data, kind, xq, dx, sx, xs, y, o0, o1)


@njit(**KW)
def _q8_chunk(c, addr, data, kind, xq, dx, sx, xs, y):
    # rows [c ROWS, (c + 1) ROWS) of matvec_q8 through addr, rows_q8_xs's machine code for
    # these types (rows_address), so that its tiles compile once, not again here nor in the
    # fused step (kernels/native_call.py); y is taken as a column slice, the layout the fused
    # step's outputs have, so one compile serves both
    ya = y[:, 0 : y.shape[1]]
    o0, o1 = np.int64(c * _ROWS), np.int64(min(data.shape[0], (c + 1) * _ROWS))
    call_native(addr, (data, np.int64(kind), xq, dx, sx, xs, ya, o0, o1))


# arrays of the types the q8 kernels give quantize's results and x_sums' (C-contiguous, writable),
# and an output's column slice (layout "A"), as they pass y
_XQ, _DX, _XS = np.zeros((1, 32), np.int8), np.zeros((1, 1), np.float32), np.zeros((1, 0), np.int32)
_Y = np.zeros((2, 4), np.float32)[:, 1:3]


def rows_address(rows) -> int:
    """The address of rows_q8_xs compiled for interleaved rows like `rows` (read-only), a
    column slice of an output (_Y) and the quantised x the q8 kernels make: the one compile
    of the q8 tiles that the matvecs here and the fused decode step call."""
    return address_for(rows_q8_xs, (rows, np.int64(0), _XQ, _DX, _DX, _XS, _Y, np.int64(0), np.int64(0)), slp=True)


@njit(**KW)
def _mv_q8_serial(addr, data, kind, x, y):
    xq, dx, sx = quantize(x)
    xs, ya = x_sums(kind, xq), y[:, 0 : y.shape[1]]  # ya: the layout _q8_chunk passes (rows_address)
    call_native(addr, (data, np.int64(kind), xq, dx, sx, xs, ya, np.int64(0), np.int64(data.shape[0])))


class Q8Weight:
    """A weight prepared for the q8 mode (kernels.linear.prepare, once, by whoever builds the
    model in that mode): its rows interleaved in groups of 8 (q8.groups.interleave), which
    every q8 kernel reads. The stored weight is kept only where the mode leaves a path exact (the
    prefill of a format without q8 prefill tiles, formats.py's q8_prefill: q5_k); otherwise
    `stored` is None, so no second copy stays resident: a weight concatenated at load (q/k/v,
    gate/up) is freed, and a file-mapped one's pages leave the resident set (drop_mapped_pages).
    Model code sees qtype and shape, as for a Weight."""

    __slots__ = ("stored", "rows", "kind", "qtype", "shape")

    def __init__(self, w):
        if w.qtype not in X8_KIND:
            raise ValueError(f"the q8 mode has no kernel for {w.qtype} weights")
        rows = interleave(w.data, w.qtype, drop_mapped_pages)  # each chunk's pages dropped once copied
        rows.flags.writeable = False  # the same array type as the stored (read-only) rows
        drop_mapped_pages(w.data)  # and the pages chunk edges shared
        self.stored = None if BY_NAME[w.qtype].q8_prefill else w
        self.rows, self.kind = rows, X8_KIND[w.qtype]
        self.qtype, self.shape = w.qtype, w.shape

    @property
    def nbytes(self):
        return self.rows.nbytes

    def __repr__(self):
        return f"Q8Weight({self.qtype}, shape={self.shape})"


# Formats whose prefill (T > linear.SMALL_T) also runs on the interleaved groups in the q8
# mode (formats.py's q8_prefill), tiles of 4 x rows sharing each unpacked chunk, or AMX tiles
# (kernels/matmul/q8/amx.py) where the CPU has them; the same bits either way, and the same as
# a decode step's. q5_k keeps the f32 GEMM: it ran slower even on the ymm tiles, and has
# neither AMX nor zmm tiles. Speeds per format: docs/kernels.md.


def drop_mapped_pages(a) -> bool:
    """Takes the whole pages under a C-contiguous view a of a read-only file mapping out of
    this process's resident set (madvise MADV_DONTNEED: the file's pages stay in the page
    cache, and a later read faults them back in with the same bytes). Once the q8 mode has
    its interleaved copy, the stored rows it was made from are read only by the exact mode,
    so the copy no longer doubles resident weights. Anonymous memory (a converted weight)
    is never touched, since DONTNEED would zero it. True when pages were dropped."""
    return advise_mapped_pages(a, MADV_DONTNEED)


PARALLEL_QUANTIZE_ROWS = 32  # fewer x rows are quantised on the calling thread (a launch costs more)


def quantize_padded(x, rows):
    """quantize's (xq, dx, sx) in arrays of a multiple of `rows` rows, the pad rows zero; rows in
    chunks of PAR_ROWS on every thread (the same bits a row: a 512-row prefill's x quantised
    serially was ~4% of the Qwen3-1.7B shape's q8 prefill)."""
    t_n, k = x.shape
    tp = -(-t_n // rows) * rows
    xq, dx, sx = np.zeros((tp, k), np.int8), np.zeros((tp, k // 32), np.float32), np.zeros((tp, k // 32), np.float32)
    run_parallel((t_n + PAR_ROWS - 1) // PAR_ROWS, _quantize_chunk, (x, xq[:t_n], dx[:t_n], sx[:t_n]))
    return xq, dx, sx


def quantize_tiles(x):
    """quantize's (xq, dx, sx) of x [T, K], written in the AMX tiles' layout (amx.tile_major's):
    xq int8 [n, K / 32, 16, 32], dx and sx f32 [n, K / 32, 16] for n = ceil(T / 16) tiles of x
    rows, the pad rows zero; rows in chunks of PAR_ROWS on every thread (the same bits a row)."""
    x = np.ascontiguousarray(x)
    t_n, k = x.shape
    n, nb = -(-t_n // amx.TILE), k // 32
    xa = np.zeros((n, nb, amx.TILE, 32), np.int8)
    dxa, sxa = np.zeros((n, nb, amx.TILE), np.float32), np.zeros((n, nb, amx.TILE), np.float32)
    run_parallel((t_n + PAR_ROWS - 1) // PAR_ROWS, _quantize_tiles_chunk, (x, xa, dxa, sxa))
    return xa, dxa, sxa


def matmul_amx(x, w, out):
    """out [T, out] = q8(x) @ W.T on AMX tiles for a Q8Weight of an amx.FORMATS format."""
    return amx.matmul(*quantize_tiles(x), w.rows, w.qtype, out)


def matvec_q8(x, w, out):
    """out [T, out] = q8(x) @ W.T for a Q8Weight, on the ymm / zmm group tiles."""
    small = x.shape[0] * w.shape[0] * x.shape[1] < PARALLEL_MIN_MACS
    if small:
        call_slp(_mv_q8_serial, rows_address(w.rows), w.rows, w.kind, x, out)
    else:  # x quantised once (a prefill's rows on every thread), then the rows in chunks on every thread
        xq, dx, sx = quantize(x) if x.shape[0] < PARALLEL_QUANTIZE_ROWS else quantize_padded(x, 1)
        xs = x_sums(w.kind, xq)
        args = (rows_address(w.rows), w.rows, w.kind, xq, dx, sx, xs, out)
        run_parallel((w.rows.shape[0] + _ROWS - 1) // _ROWS, _q8_chunk, args, slp=True)
    return out
