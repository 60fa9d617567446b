"""Selector v3's 4-bit key codes (docs/SPARSE_SELECT_V3.md, `key_bits` 4): the rule that makes
them, the tiles they are kept in, and the integer dots that score a query against them.

A key's codes: `scale = max |x| / 7`, `code = rint(x / scale)` clipped to [-7, 7] (x the key as
float32). They are kept per KV head in tiles of TILE = 16 keys; a tile is D / 8 chunks of 64
bytes, and chunk c holds 4 bytes a key (key j at bytes 4j .. 4j + 3), byte i = (code[8c + i] +
8) | (code[8c + 4 + i] + 8) << 4. One 64-byte load then holds 16 keys' dims 8c .. 8c + 3 in its
low nibbles and 8c + 4 .. 8c + 7 in its high ones, and a vpdpbusd of each against the query's 4
int8 codes broadcast adds them to one int32 lane a key: 16 keys a vector, no horizontal sums,
half the bytes of v3's int8 codes. The lanes hold sum((code + 8) q) = dot + 8 sum(q), exact
integers on every path (VNNI, pmaddubsw + pmaddwd: the pair sums are at most 2 * 15 * 127, the
generic vector IR, sdot), so the scores are the same bits whichever a CPU takes. A head_dim
that is not a multiple of 8 is padded with zero codes (`padded`).
"""

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels.attention.select import key_f32
from sparrow.kernels.elementwise import quantize_row
from sparrow.kernels.intdot import bcast4, dpbusd16, splat
from sparrow.kernels.ir import F32, V16F, V16I32, V64I8, c64, splat16, zeroed

TILE = 16  # keys a tile
TOP = 7  # codes in [-TOP, TOP]
CHUNK = 64  # bytes of a tile chunk: 4 bytes of each of its 16 keys
OFFSET = 8  # a code is kept as code + OFFSET, in 4 unsigned bits


@njit(cache=True, nogil=True, inline="always")
def put4(tiles, t, codes):
    """Key t's codes (int8 [padded(D)], in [-7, 7]) into its lanes of tiles ([n_tiles,
    padded(D) * 8] int8)."""
    row, lane = tiles[t // TILE], 4 * (t % TILE)
    for c in range(codes.shape[0] // 8):
        for i in range(4):
            lo, hi = codes[8 * c + i] + OFFSET, codes[8 * c + 4 + i] + OFFSET
            row[CHUNK * c + lane + i] = np.int8(np.uint8(lo | (hi << 4)))


@njit(cache=True, nogil=True)
def padded(head_dim):
    """The dims a tile keeps a key's codes for: head_dim up to a multiple of 8, the codes past
    it 0 (as the query's are there, so they add nothing)."""
    return -(-head_dim // 8) * 8


@intrinsic
def tile_scores4(typingctx, tiles, t0, t1, qc, corr, f, ks, out):
    """out[16 T + j] = (lane j's dot - corr) * (f * ks[16 T + j]) for tiles t0 <= T < t1 of
    tiles ([n_tiles, D * 8] int8, C order): qc the query's int8 codes [D], corr = 8 sum(qc),
    f the query's scale times the softmax scale; the float arithmetic of v3's estimate."""
    ok = (
        isinstance(tiles, types.Array) and tiles.ndim == 2 and tiles.dtype == types.int8 and tiles.layout == "C"
        and isinstance(qc, types.Array) and qc.dtype == types.int8
        and all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" for a in (ks, out))
    )  # fmt: skip
    if not ok:
        return None
    sig = types.void(tiles, types.int64, types.int64, qc, types.int32, types.float32, ks, out)

    def codegen(context, b, signature, args):
        t_arr = context.make_array(signature.args[0])(context, b, args[0])
        base, stride = t_arr.data, b.extract_value(t_arr.strides, 0)
        chunks = b.udiv(b.extract_value(t_arr.shape, 1), c64(CHUNK))
        qp = context.make_array(signature.args[3])(context, b, args[3]).data
        ksp = b.bitcast(context.make_array(signature.args[6])(context, b, args[6]).data, F32.as_pointer())
        op = b.bitcast(context.make_array(signature.args[7])(context, b, args[7]).data, F32.as_pointer())
        corr_v, f_v = splat(b, args[4], V16I32), splat16(b, args[5])
        low, four = ir.Constant(V64I8, [15] * CHUNK), ir.Constant(V64I8, [4] * CHUNK)
        with cgutils.for_range_slice(b, args[1], args[2], c64(1)) as (T, _):
            p = b.gep(base, [b.mul(T, stride)])
            acc_lo, acc_hi = zeroed(b, V16I32), zeroed(b, V16I32)  # two chains: each vpdpbusd waits on its last
            with cgutils.for_range(b, chunks) as loop:
                c = loop.index
                v = b.load(b.bitcast(b.gep(p, [b.mul(c, c64(CHUNK))]), V64I8.as_pointer()), align=1)
                lo, hi = b.and_(v, low), b.and_(b.lshr(v, four), low)
                q = b.gep(qp, [b.mul(c, c64(8))])
                b.store(dpbusd16(b, b.load(acc_lo), lo, bcast4(b, q, 16)), acc_lo)
                b.store(dpbusd16(b, b.load(acc_hi), hi, bcast4(b, b.gep(q, [c64(4)]), 16)), acc_hi)
            dot = b.sub(b.add(b.load(acc_lo), b.load(acc_hi)), corr_v)
            at = b.mul(T, c64(TILE))
            k16 = b.load(b.bitcast(b.gep(ksp, [at]), V16F.as_pointer()), align=4)
            e = b.fmul(b.sitofp(dot, V16F), b.fmul(f_v, k16))
            b.store(e, b.bitcast(b.gep(op, [at]), V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def pack_keys4(K, ks, lut, r0, r1, tiles, scale):
    """tiles[kh], scale[kh, t] = the 4-bit codes of rows r0 <= t < r1 of every KV head of a
    cache (K [KVH, C, D] as stored, ks its int8 scales): state.sparse.KeyCodes4's copy."""
    row = np.empty(K.shape[2], dtype=np.float32)
    codes = np.zeros(tiles.shape[2] // 8, dtype=np.int8)  # [padded(D)], zeros past D
    for kh in range(K.shape[0]):
        for t in range(r0, r1):
            for d in range(K.shape[2]):
                row[d] = key_f32(K[kh], ks[kh], lut, t, d)
            scale[kh, t] = quantize_row(row, codes[: K.shape[2]], TOP)
            put4(tiles[kh], t, codes)
