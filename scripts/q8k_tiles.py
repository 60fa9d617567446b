"""How fast the q8 mode's K-quant prefill tiles could run in another order (issue 34 item 5).

Times today's zmm pair tiles for q4_k and q6_k (kernels/matmul/q8/pair_tiles.py) beside two
variants built from the same loads, unpacking and `vpdpbusd` dot products, on one thread:

- "q8_K order": a speed prototype of llama.cpp's Q4_K x Q8_K order in these tiles. A
  super-block's sub-block sums are scaled and added as integers (`vpmulld`; the q4_k mins and
  the q6_k -32 offset by `vpdpwssd` against x's 16-bit block sums), with one float step a
  super-block. Its sums are wrong, since x still has a scale per 32 values and the block sums
  are stand-ins; only its speed means anything.
- "no epilogue": each x row's dot products go straight into integer accumulators, with no
  scale, min or offset step. This is the most any order of these products could reach.

    python scripts/q8k_tiles.py [--k 2048] [--rows 6144] [--t 512] [--passes 5]

Needs AVX512-VNNI (the pair tiles). Prints GMAC/s for each variant. The measurements and what
they mean for item 5 are in docs/benchmarks/zen4-epyc.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils

from sparrow.kernels.intdot import VNNI512, bcast4, dpbusd16, splat
from sparrow.kernels.ir import V8I8, V16F, V16I8, V16I32, V32I8, V32I16, V64I8, c64, call, fma, shuffle, splat16, zeroed
from sparrow.kernels.matmul.q8 import pair_tiles as pt
from sparrow.kernels.matmul.q8.groups import GROUP, GROUP_BYTES, V8H, nibble
from sparrow.kernels.matmul.q8.quantized import GROUP_CHUNK, Q8Weight, quantize, x_sums
from sparrow.quant import Weight
from sparrow_lab.bench.rows import random_rows


def _dpwssd(b, acc, u, v):
    """acc + pairwise products of 16-bit lanes, summed in 32-bit lanes (vpdpwssd)."""
    return call(b, "llvm.x86.avx512.vpdpwssd.512", V16I32, [acc, b.bitcast(u, V16I32), b.bitcast(v, V16I32)])


def _scale_q4_k(b, p0, p1, i, blks, sums, iacc, macc, xps, mr):
    """The prototype's integer step for sub-blocks 2i and 2i + 1: sums times their 6-bit scales
    into iacc, the mins against (stand-in) 16-bit block sums of x into macc."""
    j0 = b.shl(i, c64(1))
    mp = pt._pair(b, p0, p1, b.add(c64(96), b.shl(j0, c64(3))), V16I8)  # mins of j0, j0 + 1
    mw = b.zext(shuffle(b, mp, mp, [k for r in range(16) for k in (r, r + 16)]), V32I16)
    for h in (0, 1):
        j = b.add(j0, c64(h))
        sc = b.zext(pt._pair(b, p0, p1, b.add(c64(32), b.shl(j, c64(3))), V8I8), V16I32)
        for t in range(mr):
            b.store(b.add(b.load(iacc[t][0]), b.mul(sums[t][h], sc)), iacc[t][0])
    for t in range(mr):
        bsp = b.bitcast(b.gep(xps[t], [b.mul(blks[0], c64(32))]), ir.IntType(32).as_pointer())
        b.store(_dpwssd(b, b.load(macc[t]), mw, splat(b, b.load(bsp), V16I32)), macc[t])


def _q4_k(mr, scaled):
    """q4_k pair tile body: scaled=True the q8_K prototype, False no epilogue."""
    gb = GROUP_BYTES["q4_k"]

    def emit(b, g0p, g1p, xps, dxps, sxps, bsps, nb):
        acc, accm = [zeroed(b, V16F) for _ in range(mr)], [zeroed(b, V16F) for _ in range(mr)]
        iacc = [[zeroed(b, V16I32) for _ in (0, 1)] for _ in range(mr)]
        macc = [zeroed(b, V16I32) for _ in range(mr)]
        with cgutils.for_range(b, b.udiv(nb, c64(8))) as loop:
            n = loop.index
            p0, p1 = b.gep(g0p, [b.mul(n, c64(gb))]), b.gep(g1p, [b.mul(n, c64(gb))])
            d, dmin = b.fpext(pt._pair(b, p0, p1, 0, V8H), V16F), b.fpext(pt._pair(b, p0, p1, 16, V8H), V16F)
            if scaled:
                for t in range(mr):
                    b.store(ir.Constant(V16I32, None), iacc[t][0])
                    b.store(ir.Constant(V16I32, None), macc[t])
            with cgutils.for_range(b, c64(4)) as sub:
                i = sub.index  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
                blks = [b.add(b.mul(n, c64(8)), b.add(b.shl(i, c64(1)), c64(h))) for h in (0, 1)]
                at = b.add(c64(pt._K_CODES), b.mul(i, c64(256)))
                sums = [[None if scaled else b.load(iacc[t][h]) for h in (0, 1)] for t in range(mr)]
                for c in range(8):
                    v = pt._pair(b, p0, p1, b.add(at, c64(32 * c)), V32I8)
                    for h in (0, 1):
                        w = nibble(b, v, h)
                        for t in range(mr):
                            xb = b.gep(xps[t], [b.add(b.mul(blks[h], c64(32)), c64(4 * c))])
                            sums[t][h] = dpbusd16(b, sums[t][h], w, bcast4(b, xb, 16))
                if not scaled:
                    for t in range(mr):
                        for h in (0, 1):
                            b.store(sums[t][h], iacc[t][h])
                else:
                    _scale_q4_k(b, p0, p1, i, blks, sums, iacc, macc, xps, mr)
            if scaled:
                for t in range(mr):
                    dxs = splat16(b, b.load(b.gep(dxps[t], [b.mul(n, c64(8))])))
                    b.store(fma(b, b.sitofp(b.load(iacc[t][0]), V16F), b.fmul(d, dxs), b.load(acc[t])), acc[t])
                    b.store(fma(b, b.sitofp(b.load(macc[t]), V16F), b.fmul(dmin, dxs), b.load(accm[t])), accm[t])
        if scaled:
            return [b.fsub(b.load(acc[t]), b.load(accm[t])) for t in range(mr)]
        return [b.sitofp(b.add(b.load(iacc[t][0]), b.load(iacc[t][1])), V16F) for t in range(mr)]

    return emit


def _q6_k(mr, scaled):
    """q6_k pair tile body: scaled=True the q8_K prototype, False no epilogue."""
    gb = GROUP_BYTES["q6_k"]

    def emit(b, g0p, g1p, xps, dxps, sxps, bsps, nb):
        acc = [zeroed(b, V16F) for _ in range(mr)]
        iacc = [[zeroed(b, V16I32) for _ in (0, 1)] for _ in range(mr)]
        m15, m48 = (ir.Constant(V64I8, [v] * 64) for v in (15, 48))
        with cgutils.for_range(b, b.udiv(nb, c64(8))) as loop:
            n = loop.index
            p0, p1 = b.gep(g0p, [b.mul(n, c64(gb))]), b.gep(g1p, [b.mul(n, c64(gb))])
            d = b.fpext(pt._pair(b, p0, p1, 0, V8H), V16F)
            if scaled:
                for t in range(mr):
                    b.store(ir.Constant(V16I32, None), iacc[t][0])
            for j in range(8):  # as pair_tiles.emit_pair_q6_k
                blk = b.add(b.mul(n, c64(8)), c64(j))
                sums = [[None if scaled else b.load(iacc[t][k]) for k in (0, 1)] for t in range(mr)]
                for c in range(8):
                    u = pt.q6_codes(b, p0, p1, j, c, m15, m48)
                    for t in range(mr):
                        xb = b.gep(xps[t], [b.add(b.mul(blk, c64(32)), c64(4 * c))])
                        sums[t][c // 4] = dpbusd16(b, sums[t][c // 4], u, bcast4(b, xb, 16))
                if not scaled:
                    for t in range(mr):
                        for k in (0, 1):
                            b.store(sums[t][k], iacc[t][k])
                    continue
                pr = pt._pair(b, p0, p1, pt._Q6_SC + 16 * j, V16I8)  # (sc[2j], sc[2j + 1]) a row
                scw = b.mul(b.sext(pr, V32I16), ir.Constant(V32I16, [-32] * 32))
                scs = [b.sext(shuffle(b, pr, pr, range(k, 32, 2)), V16I32) for k in (0, 1)]
                for t in range(mr):
                    v = b.add(b.load(iacc[t][0]), b.mul(sums[t][0], scs[0]))
                    v = b.add(v, b.mul(sums[t][1], scs[1]))
                    bsp = b.bitcast(b.gep(bsps[t], [b.shl(blk, c64(1))]), ir.IntType(32).as_pointer())
                    b.store(_dpwssd(b, v, scw, splat(b, b.load(bsp), V16I32)), iacc[t][0])
            if scaled:
                for t in range(mr):
                    dxs = splat16(b, b.load(b.gep(dxps[t], [b.mul(n, c64(8))])))
                    b.store(fma(b, b.sitofp(b.load(iacc[t][0]), V16F), b.fmul(d, dxs), b.load(acc[t])), acc[t])
        if scaled:
            return [b.load(acc[t]) for t in range(mr)]
        return [b.sitofp(b.add(b.load(iacc[t][0]), b.load(iacc[t][1])), V16F) for t in range(mr)]

    return emit


def _driver(pairs):
    """Every x row against groups 0 .. g1 - 1, GROUP_CHUNK groups at a time (as x8_rows takes them)."""

    @njit(cache=False, nogil=True)
    def run(data, g1, xq, dx, sx, bs, y):
        t_n = xq.shape[0]
        for c in range(0, g1, GROUP_CHUNK):
            for t0 in range(0, t_n, pt.PAIR_X_ROWS):
                pairs(data, c, min(g1, c + GROUP_CHUNK), (xq, dx, sx, bs), y, t0, min(pt.PAIR_X_ROWS, t_n - t0))

    return run


VARIANTS = {
    "today's order": {"q4_k": pt.emit_pair_q4_k, "q6_k": pt.emit_pair_q6_k},
    "q8_K order": {"q4_k": lambda mr: _q4_k(mr, True), "q6_k": lambda mr: _q6_k(mr, True)},
    "no epilogue": {"q4_k": lambda mr: _q4_k(mr, False), "q6_k": lambda mr: _q6_k(mr, False)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2048, help="row length (a multiple of 256)")
    ap.add_argument("--rows", type=int, default=6144, help="weight rows (a multiple of 16)")
    ap.add_argument("--t", type=int, default=512, help="x rows")
    ap.add_argument("--passes", type=int, default=5, help="timed passes, best kept")
    a = ap.parse_args()
    if not VNNI512:
        sys.exit("q8k_tiles: this CPU has no AVX512-VNNI, so sparrow has no zmm pair tiles to compare")
    if a.k % 256 or a.rows % (2 * GROUP):
        ap.error("--k must be a multiple of 256 and --rows of 16")
    x = np.random.default_rng(0).standard_normal((a.t, a.k)).astype(np.float32)
    xq, dx, sx = quantize(x)
    y = np.empty((a.t, a.rows), np.float32)
    macs = a.t * a.k * a.rows
    print(f"{a.rows} x {a.k} weights against {a.t} x rows, one thread, best of {a.passes}, GMAC/s:")
    for qtype in ("q4_k", "q6_k"):
        w = Q8Weight(Weight(qtype, random_rows(qtype, a.rows, a.k), (a.rows, a.k)))
        bs = x_sums(w.kind, xq)
        cells = []
        for name, emits in VARIANTS.items():
            run = _driver(pt.make_pairs(emits[qtype]))
            args = (w.rows, a.rows // GROUP, xq, dx, sx, bs, y)
            run(*args)  # compiles
            best = float("inf")
            for _ in range(a.passes):
                t0 = time.perf_counter()
                run(*args)
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{name} {macs / best / 1e9:.0f}")
        print(f"{qtype}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
