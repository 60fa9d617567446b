"""Decode matvecs with activations quantised to 8 bits: the named mode activations="q8".

llama.cpp's arithmetic for q8_0 / q4_0 / q4_1 / q5_0 / q5_1 weights (and, in _kq8.py, the
K-quants q4_k / q5_k / q6_k on the same quantised x): each 32-value block of x becomes int8
codes and one f32 scale, and each block's dot product is an exact integer sum. It reads the
same weight bytes as the exact path (kernels._widen) with about 40% fewer vector
instructions a block, so on a compute-bound core it decodes faster (single core, weights in
cache: q4_0 18.4 vs 13.5 GMAC/s, q8_0 24.8 vs 16.3). It is not exact: on SmolLM2-135M (Q4_1)
its decode logits differ from the f32 path by KL 3.1e-3 on average and agree on the top
token at 97% of 400 positions, which is why it is a mode and never the default.

Per x row and block b (32 values): a = max |x|, dx = a / 127, codes q = rint(x * 127 / a)
(all 0 when a == 0), sx = dx * sum(q). Per weight row, block b with scale d:
  s = sum over the block of code_w * q, an exact int32, kept as 8 lane sums <8 x i32>
      (lane j holds elements 4j..4j+3, the split of x86's pmaddubsw + pmaddwd);
  acc[b % 2] = fma(float(s), d * dx, acc[b % 2])          <8 x float>
  q4_1 / q5_1 only: accm[b % 2] = fma(m, sx, accm[b % 2])  (m: the block's offset)
  q4_0 codes are the nibbles minus 8 (signed), q4_1's the nibbles, q8_0's the bytes; q5_0 /
  q5_1 add the fifth bit (bit j of qh for element j) as 16, and q5_0 subtracts 16.
Result: pairwise tree (lane i + i + n/2) of acc[0] + acc[1], plus accm[0] + accm[1]. Integer
sums are exact, so every CPU path (AVX2's pmaddubsw or the generic vector code numba emits
elsewhere) gives the same bits, whatever T, batch or thread count.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from sparrow.kernels._ir import F32, I8, I64, fma, hsum16, shuffle, splat16
from sparrow.kernels._kq8 import AVX2, V8F, V16I8, V32I8, dot4, rowdot_q4_k, rowdot_q5_k, rowdot_q6_k
from sparrow.kernels._kq8 import call as _call
from sparrow.kernels._widen import _ROWS, KIND, PARALLEL_MIN_MACS, _half_at, call_slp
from sparrow.kernels.gemm import CPU_FEATURES

KW = dict(cache=True, nogil=True)
# q8_0, q4_0, q4_1, q5_0, q5_1 here; q4_k, q5_k, q6_k in _kq8 (kernels._widen.KIND)
BLOCK_KINDS = (0, 1, 2, 6, 7, 8, 9, 10)
__all__ = ["AVX2", "CPU_FEATURES", "matvec_q8", "quantize", "rows_q8", "supports"]

_BB = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
V4I8 = ir.VectorType(I8, 4)
BITS = [1 << (j % 8) for j in range(32)]  # element j's bit in byte j // 8 of qh


def _make_rowdot(qtype):
    @intrinsic
    def rowdot(typingctx, row, xq, dx, sx):
        """row: stored bytes [nb * bb] uint8; xq: int8 codes [nb * 32]; dx, sx: f32 [nb]."""
        sig = types.float32(row, xq, dx, sx)

        def codegen(context, builder, signature, args):
            b = builder
            arrs = [context.make_array(t)(context, b, a) for t, a in zip(signature.args, args)]
            rp = b.bitcast(arrs[0].data, I8.as_pointer())
            xp = b.bitcast(arrs[1].data, I8.as_pointer())
            dxp = b.bitcast(arrs[2].data, F32.as_pointer())
            sxp = b.bitcast(arrs[3].data, F32.as_pointer())
            nb = b.extract_value(arrs[2].shape, 0)

            def c64(v):
                return ir.Constant(I64, v)

            accs = [cgutils.alloca_once_value(b, ir.Constant(V8F, [0.0] * 8)) for _ in range(2)]
            accm = [cgutils.alloca_once_value(b, ir.Constant(F32, 0.0)) for _ in range(2)]

            def block(blk, i):
                p = b.mul(blk, c64(_BB[qtype]))
                d = _half_at(b, rp, p)
                x = b.load(b.bitcast(b.gep(xp, [b.mul(blk, c64(32))]), V32I8.as_pointer()), align=1)
                if qtype == "q8_0":
                    w = b.load(b.bitcast(b.gep(rp, [b.add(p, c64(2))]), V32I8.as_pointer()), align=1)
                else:
                    off = 2 if qtype in ("q4_0", "q5_0") else 4
                    q5 = qtype in ("q5_0", "q5_1")
                    q = b.load(b.bitcast(b.gep(rp, [b.add(p, c64(off + 4 * q5))]), V16I8.as_pointer()), align=1)
                    lo = b.and_(q, ir.Constant(V16I8, [15] * 16))
                    hi = b.lshr(q, ir.Constant(V16I8, [4] * 16))
                    w = shuffle(b, lo, hi, range(32))  # element j (low nibbles), then 16 + j
                    if q5:  # element j's fifth bit: bit j of the little-endian u32 qh
                        qh = b.load(b.bitcast(b.gep(rp, [b.add(p, c64(off))]), V4I8.as_pointer()), align=1)
                        hb = b.and_(shuffle(b, qh, qh, [j // 8 for j in range(32)]), ir.Constant(V32I8, BITS))
                        zero = ir.Constant(V32I8, [0] * 32)
                        if qtype == "q5_0":  # code - 16 at once: nibble | 0xF0 (-16) where the bit is clear
                            fifth = b.select(b.icmp_unsigned("==", hb, zero), ir.Constant(V32I8, [-16] * 32), zero)
                        else:
                            fifth = b.select(b.icmp_unsigned("!=", hb, zero), ir.Constant(V32I8, [16] * 32), zero)
                        w = b.or_(w, fifth)
                    elif qtype == "q4_0":
                        w = b.sub(w, ir.Constant(V32I8, [8] * 32))
                s = b.sitofp(dot4(b, w, x), V8F)
                dd = splat16(b, b.fmul(d, b.load(b.gep(dxp, [blk]))), 8)
                b.store(_call(b, "llvm.fma.v8f32", V8F, [s, dd, b.load(accs[i])]), accs[i])
                if qtype in ("q4_1", "q5_1"):
                    m = _half_at(b, rp, b.add(p, c64(2)))
                    b.store(fma(b, m, b.load(b.gep(sxp, [blk])), b.load(accm[i])), accm[i])

            one = c64(1)
            with cgutils.for_range(b, b.lshr(nb, one)) as loop:
                b0 = b.shl(loop.index, one)
                block(b0, 0)
                block(b.add(b0, one), 1)
            with b.if_then(b.trunc(nb, ir.IntType(1))):
                block(b.sub(nb, one), 0)
            v = hsum16(b, b.fadd(b.load(accs[0]), b.load(accs[1])))  # 8 lanes
            return b.fadd(v, b.fadd(b.load(accm[0]), b.load(accm[1])))

        return sig, codegen

    return rowdot


rowdot_q8_0 = _make_rowdot("q8_0")
rowdot_q4_0 = _make_rowdot("q4_0")
rowdot_q4_1 = _make_rowdot("q4_1")
rowdot_q5_0 = _make_rowdot("q5_0")
rowdot_q5_1 = _make_rowdot("q5_1")


@njit(**KW)
def quantize_rows(x, xq, dx, sx):
    """x f32 [T, K] -> codes xq int8 [T, K], scales dx and scaled code sums sx f32 [T, K/32]."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            a = np.float32(0)
            for j in range(32):
                a = max(a, abs(x[t, b * 32 + j]))
            inv = np.float32(0) if a == 0 else np.float32(127) / a
            tot = 0
            for j in range(32):
                c = np.int8(np.rint(x[t, b * 32 + j] * inv))
                xq[t, b * 32 + j] = c
                tot += c
            dx[t, b] = a / np.float32(127)
            sx[t, b] = dx[t, b] * np.float32(tot)


@njit(**KW)
def quantize(x):
    t_n, k = x.shape
    xq = np.empty((t_n, k), np.int8)
    dx = np.empty((t_n, k // 32), np.float32)
    sx = np.empty((t_n, k // 32), np.float32)
    quantize_rows(x, xq, dx, sx)
    return xq, dx, sx


@njit(**KW)
def rows_q8(data, kind, xq, dx, sx, y, o0, o1):
    """y[t, o] for rows o0..o1-1 of stored block rows `data` against quantised x rows."""
    for o in range(o0, o1):
        for t in range(xq.shape[0]):
            if kind == 8:
                y[t, o] = rowdot_q4_k(data[o], xq[t], dx[t], sx[t])
            elif kind == 10:
                y[t, o] = rowdot_q6_k(data[o], xq[t], dx[t], sx[t])
            elif kind == 9:
                y[t, o] = rowdot_q5_k(data[o], xq[t], dx[t], sx[t])
            elif kind == 6:
                y[t, o] = rowdot_q5_0(data[o], xq[t], dx[t], sx[t])
            elif kind == 7:
                y[t, o] = rowdot_q5_1(data[o], xq[t], dx[t], sx[t])
            elif kind == 2:
                y[t, o] = rowdot_q4_1(data[o], xq[t], dx[t], sx[t])
            elif kind == 1:
                y[t, o] = rowdot_q4_0(data[o], xq[t], dx[t], sx[t])
            else:
                y[t, o] = rowdot_q8_0(data[o], xq[t], dx[t], sx[t])


@njit(parallel=True, **KW)
def _mv_q8(data, kind, x, y):
    xq, dx, sx = quantize(x)
    o_n = data.shape[0]
    for c in prange((o_n + _ROWS - 1) // _ROWS):
        rows_q8(data, kind, xq, dx, sx, y, c * _ROWS, min(o_n, (c + 1) * _ROWS))


@njit(**KW)
def _mv_q8_serial(data, kind, x, y):
    xq, dx, sx = quantize(x)
    rows_q8(data, kind, xq, dx, sx, y, 0, data.shape[0])


def supports(w) -> bool:
    return KIND.get(w.qtype, -1) in BLOCK_KINDS


def matvec_q8(x, w, out):
    """out [T, out] = q8(x) @ W.T for a Weight of a BLOCK_KINDS format and small T."""
    small = x.shape[0] * w.data.shape[0] * x.shape[1] < PARALLEL_MIN_MACS
    call_slp(_mv_q8_serial if small else _mv_q8, w.data, KIND[w.qtype], x, out)
    return out
