"""`sparrow bench rows`: the exact decode's row dots, format by format, against a plain read.

One f32 x row is dotted with every stored row of a matrix (`widen.rows_exact`, the row loop
the fused decode step and the staged matvecs call) for each block format, on 1 and 2
threads, from a matrix that stays in cache (L2 and L3 sized) and from one far larger than the
last-level cache (--memory-mib, 2 GiB by default). Each cell is the best of --passes timed
passes; a pass calls the rows enough times to run at least --min-ms, each thread looping over
its own half of the rows inside one launch, so a pass times the row dots and not the thread
pool. It prints GB/s of stored bytes, GMAC/s and, beside them, a STREAM-like read
(`bench.bandwidth`) over a buffer of the same size on the same threads, and the row dots' share
of it.

    sparrow bench rows                              # every format, K = 2048
    sparrow bench rows --types q4_0,q4_k --threads 1 --sizes l2,memory

The rows are random codes with sane f16 scales (values ~0.01..0.5, as tests/test_kquants.py
makes them): the speed of a row dot does not depend on its values, but subnormal or NaN scales
could, so none are written.
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np
from numba import njit

from sparrow.errors import SparrowError
from sparrow.kernels.formats import BY_NAME
from sparrow.kernels.native_call import call_native
from sparrow.kernels.options import KW

TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
MIB = 1 << 20
# where the matrix lives: its size in MiB (memory: --memory-mib)
SIZES = {"l2": 1, "l3": 96, "memory": None}


def _f16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).view(np.uint8).reshape(np.shape(a) + (2,))


def random_rows(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of random codes with sane f16 scales (no subnormal, inf or NaN);
    a 256-row pattern repeated, so a matrix of gigabytes is written in a second."""
    fmt = BY_NAME[qtype]
    nb = k // fmt.block_values
    n = min(rows, 256)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, nb, fmt.block_bytes), dtype=np.uint8)
    u = lambda lo, hi: rng.uniform(lo, hi, (n, nb)) * rng.choice([-1, 1], (n, nb))  # noqa: E731
    if qtype == "q6_k":
        raw[:, :, 208:210] = _f16(u(2e-4, 1e-3))
    elif qtype in ("q4_k", "q5_k"):
        raw[:, :, 0:2] = _f16(np.abs(u(1e-3, 1e-2)))
        raw[:, :, 2:4] = _f16(np.abs(u(1e-3, 1e-2)))
    else:
        raw[:, :, 0:2] = _f16(u(5e-3, 2e-2))
        if qtype in ("q4_1", "q5_1"):
            raw[:, :, 2:4] = _f16(u(0, 0.2))
    pattern = raw.reshape(n, -1)
    out = np.empty((rows, pattern.shape[1]), np.uint8)
    for r in range(0, rows, n):
        out[r : r + n] = pattern[: rows - r]
    return out


@njit(**KW)
def _repeat(i, parts, reps, addrs, data, kind, x, sx, y):
    # part i of the rows, reps times: rows_exact through its address, as the decode calls it
    n = data.shape[0]
    o0, o1 = np.int64(i * n // parts), np.int64((i + 1) * n // parts)
    ya = y[:, 0 : y.shape[1]]
    for _ in range(reps):
        call_native(addrs[0], (data, np.int64(kind), x, sx, ya, o0, o1, addrs[1]))


@njit(fastmath=True, **KW)
def _sum(a):
    s = np.float32(0.0)
    for i in range(a.size):
        s += a[i]
    return s


@njit(**KW)
def _read(i, parts, reps, a, out):
    # part i of a summed reps times: the plain read the row dots are set against
    n = a.size
    s = np.float32(0)
    for _ in range(reps):
        s += _sum(a[i * n // parts : (i + 1) * n // parts])
    out[i] = s


def _timed(run, reps: int, passes: int, min_s: float) -> tuple[float, int]:
    """(best seconds a rep over passes, reps a pass), reps grown until a pass takes min_s."""
    run(1)  # compile / load, first touch
    while True:
        t0 = time.perf_counter()
        run(reps)
        dt = time.perf_counter() - t0
        if dt >= min_s or reps >= 1 << 20:
            break
        reps = max(reps * 2, int(reps * min_s / max(dt, 1e-6) * 1.2))
    best = dt / reps
    for _ in range(passes - 1):
        t0 = time.perf_counter()
        run(reps)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best, reps


def rows_runner(addrs, data, kind, x, sx, threads):
    """run(reps): every row of data dotted with x reps times on `threads` threads, one launch."""
    from sparrow.kernels.parallel import run_parallel

    y = np.empty((1, data.shape[0]), np.float32)

    def run(reps):
        run_parallel(threads, _repeat, (np.int64(threads), np.int64(reps), addrs, data, kind, x, sx, y))

    return run


def measure(qtypes, threads, sizes, k, memory_mib, passes, min_ms, log=print) -> list[dict]:
    from sparrow.kernels.matmul import widen
    from sparrow.kernels.parallel import run_parallel

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, k)).astype(np.float32)
    results = []
    prev = numba.get_num_threads()
    try:
        for size in sizes:
            mib = SIZES[size] or memory_mib
            buf = np.ones(mib * MIB // 4, np.float32)
            out = np.zeros(max(threads), np.float32)
            reads = {}
            for t in threads:
                numba.set_num_threads(t)

                def run(reps, t=t, buf=buf, out=out):
                    run_parallel(t, _read, (np.int64(t), np.int64(reps), buf, out))

                reads[t] = buf.nbytes / _timed(run, 1, passes, min_ms / 1e3)[0] / 1e9
            del buf
            for q in qtypes:
                fmt = BY_NAME[q]
                row_bytes = k // fmt.block_values * fmt.block_bytes
                data = random_rows(q, max(2 * 256, mib * MIB // row_bytes), k)
                kq = True if fmt.row_dot == "kquants" else None
                sx = widen.exact_sums(x, fmt.kind, kq)
                addrs = (widen.exact_rows_address(data), widen.kq_rows_address(data) if kq else 0)
                for t in threads:
                    numba.set_num_threads(t)
                    s, _ = _timed(rows_runner(addrs, data, fmt.kind, x, sx, t), 1, passes, min_ms / 1e3)
                    r = {
                        "type": q,
                        "size": size,
                        "mib": round(data.nbytes / MIB, 1),
                        "threads": t,
                        "gb_s": data.nbytes / s / 1e9,
                        "gmac_s": data.shape[0] * k / s / 1e9,
                        "read_gb_s": reads[t],
                    }
                    r["of_read"] = r["gb_s"] / reads[t]
                    results.append(r)
                    log(
                        f"{q:<5} {size:<6} {r['mib']:>7.1f} MiB  {t} thr  {r['gb_s']:6.1f} GB/s  "
                        f"{r['gmac_s']:6.1f} GMAC/s  read {reads[t]:6.1f} GB/s  {100 * r['of_read']:5.1f}%",
                    )
                del data
    finally:
        numba.set_num_threads(prev)
    return results


def _list(text: str, allowed, what: str) -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SparrowError(f"--{what}: {', '.join(bad) or 'nothing'} is not one of {', '.join(map(str, allowed))}")
    return items


def main(argv=None) -> list[dict]:
    from .host import cpu_info, load_avg

    p = argparse.ArgumentParser(prog="sparrow bench rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(TYPES), help=f"comma-separated formats (default {','.join(TYPES)})")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--sizes", default="l2,l3,memory", help="where the rows live: l2 (1 MiB), l3 (96 MiB), memory")
    p.add_argument("--memory-mib", type=int, default=2048, help="the from-memory matrix's size (default 2048)")
    p.add_argument("--k", type=int, default=2048, help="row length, a multiple of 256 (default 2048)")
    p.add_argument("--passes", type=int, default=5, help="timed passes a cell, best kept (default 5)")
    p.add_argument("--min-ms", type=float, default=200.0, help="a pass runs at least this long (default 200)")
    p.add_argument("--json", default=None, help="also write the cells to this file")
    a = p.parse_args(argv)
    qtypes = _list(a.types, TYPES, "types")
    sizes = _list(a.sizes, tuple(SIZES), "sizes")
    allowed = [str(i) for i in range(1, numba.config.NUMBA_NUM_THREADS + 1)]
    threads = [int(t) for t in _list(a.threads, allowed, "threads")]
    if a.k <= 0 or a.k % 256:
        raise SparrowError(f"--k: {a.k} is not a positive multiple of 256")
    cpu = cpu_info()
    print(f"{cpu['model']} ({cpu['cpus']} CPUs, L2 {cpu['l2_per_core']} a core; {' '.join(cpu['extensions'])})")
    print(f"load average at start {load_avg()}")
    results = measure(qtypes, threads, sizes, a.k, a.memory_mib, a.passes, a.min_ms)
    print(f"load average at end {load_avg()}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results
