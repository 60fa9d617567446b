"""Side-by-side speed of the f32 reductions in their fixed lane order (kernels/ir.py, lane_dot and
lane_sum, issue 40) against the reassociated numba loops they replaced (re-declared here as they
were), in one process, interleaved, best of N rounds: RMSNorm rows, the softmax denominator and
an f32 row dot, at decode and prefill sizes.

    python scripts/bench_reductions.py [--rounds 7]

Prints microseconds a call for each variant and the ratio new / old (below 1: faster).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from numba import njit

from sparrow.kernels import elementwise as el
from sparrow.kernels.attention import rows
from sparrow.kernels.matmul import widen

FM = {"reassoc", "contract"}


@njit(fastmath=FM, cache=False, nogil=True)
def _old_ssq(r):
    s = np.float32(0)
    for i in range(r.shape[0]):
        s += r[i] * r[i]
    return s


@njit(cache=False, nogil=True)
def _old_rms_rows(x, w, eps, out):
    n = np.float32(x.shape[1])
    for t in range(x.shape[0]):
        inv = np.float32(1) / np.float32(math.sqrt(_old_ssq(x[t]) / n + eps))
        for i in range(x.shape[1]):
            out[t, i] = (x[t, i] * inv) * w[i]


@njit(fastmath=FM, cache=False, nogil=True)
def _old_sum(a, n):
    t = np.float32(0.0)
    for i in range(n):
        t += a[i]
    return t


@njit(fastmath=FM, cache=False, nogil=True)
def _old_dot(w, x):
    s = np.float32(0)
    for i in range(w.shape[0]):
        s += w[i] * x[i]
    return s


@njit(cache=False, nogil=True)
def _sums(f, a, n, reps):  # reps calls in compiled code: the call overhead of Python left out
    t = np.float32(0)
    for r in range(reps):
        t += f(a[r % 16 :], n)  # another start each call: LLVM may not hoist the sum
    return t


@njit(cache=False, nogil=True)
def _dots(f, w, x, reps):
    t = np.float32(0)
    for r in range(reps):
        t += f(w[r % w.shape[0]], x)
    return t


@njit(cache=False, nogil=True)
def _norms(f, x, w, out, reps):
    for _ in range(reps):
        f(x, w, np.float32(1e-6), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = []
    for t, d, reps in ((1, 576, 20000), (1, 2048, 10000), (512, 2048, 10)):
        x = rng.standard_normal((t, d)).astype(np.float32)
        w = rng.standard_normal(d).astype(np.float32)
        out = np.empty_like(x)
        cases.append(
            (
                f"RMSNorm {t} x {d}",
                reps * t,
                lambda x=x, w=w, out=out, reps=reps: _norms(_old_rms_rows, x, w, out, reps),
                lambda x=x, w=w, out=out, reps=reps: _norms(el._rms_rows, x, w, out, reps),
            )
        )
    for n in (64, 1000, 4096):
        a = rng.random(4096 + 16).astype(np.float32)
        reps = 4_000_000 // n
        cases.append(
            (
                f"softmax sum n={n}",
                reps,
                lambda a=a, n=n, reps=reps: _sums(_old_sum, a, n, reps),
                lambda a=a, n=n, reps=reps: _sums(rows.sum_f32, a, n, reps),
            )
        )
    for k in (576, 2048):
        wr = rng.standard_normal((64, k)).astype(np.float32)
        x = rng.standard_normal(k).astype(np.float32)
        reps = 4_000_000 // k
        cases.append(
            (
                f"f32 row dot k={k}",
                reps,
                lambda wr=wr, x=x, reps=reps: _dots(_old_dot, wr, x, reps),
                lambda wr=wr, x=x, reps=reps: _dots(widen.dot, wr, x, reps),
            )
        )
    for _, _, old, new in cases:  # compile
        old()
        new()
    print(f"{'case':24} {'old us':>9} {'new us':>9} {'new/old':>8}")
    for name, calls, old, new in cases:
        best = [math.inf, math.inf]
        for _ in range(args.rounds):
            for i, f in enumerate((old, new)):
                t0 = time.perf_counter()
                f()
                best[i] = min(best[i], time.perf_counter() - t0)
        o, n = (b / calls * 1e6 for b in best)
        print(f"{name:24} {o:9.4f} {n:9.4f} {n / o:8.2f}")


if __name__ == "__main__":
    main()
