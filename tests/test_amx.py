"""The q8 mode's prefill on AMX tiles (kernels/matmul/q8/amx.py): the vector path's bits (the _x8 /
_kq8 groups, whose order tests/test_q8act.py and test_kquants_q8.py check against a float64
emulation), for any T, padding, panel and thread count; used only where the CPU has it."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from test_cpu_paths import ROOT
from test_gemm import bits
from test_kquants import make_kq
from test_q8act import rowdot_reference

from sparrow.kernels.linear import AMX_MIN_T, linear, prepare
from sparrow.kernels.matmul.q8 import amx as _amx
from sparrow.kernels.matmul.q8 import quantized as _q8act
from weights import acts, make

needs_amx = pytest.mark.skipif(not _amx.AMX, reason="this CPU (or its kernel) gives no AMX tiles")


def _weight(qtype, shape, seed):
    return make_kq(qtype, shape, seed=seed) if qtype.endswith("_k") else make(qtype, shape, seed=seed)


def _vector_path(x, w):
    """The q8 mode's product on the _x8 / _kq8 groups (no tiles), every row of x."""
    w8 = _q8act.Q8Weight(w)
    data, kind = w8.rows, w8.kind
    xq, dx, sx = _q8act.quantize(x)
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    _q8act.rows_q8(data, kind, xq, dx, sx, y, 0, data.shape[0])
    return y


# (format, [out, in], T): whole and partial 16-row tiles of x; a last panel with one group
# (3 groups) or a partial one (45 rows); block counts of every remainder mod 4 (the tile loop
# takes four blocks a turn) and below amx.AHEAD + 1 (1, 2, 3: fewer blocks than it issues ahead),
# odd ones for q6_k (the unpaired last block); q4_k's and q6_k's 256-value super-blocks (q6_k:
# two tiles a block)
CASES = [
    ("q8_0", (45, 512), 37),
    ("q4_0", (45, 512), 37),
    ("q4_1", (45, 512), 37),
    ("q4_k", (45, 512), 37),
    ("q8_0", (20, 96), 16),
    ("q4_0", (20, 96), 1),
    ("q4_1", (16, 32), 17),
    ("q4_0", (24, 32), 33),
    ("q4_k", (20, 768), 16),
    ("q4_k", (8, 256), 5),
    ("q4_0", (300, 2048), 70),
    ("q4_1", (16, 64), 20),
    ("q8_0", (24, 160), 19),
    ("q4_0", (20, 224), 33),
    ("q4_1", (40, 192), 16),
    ("q6_k", (45, 512), 37),
    ("q6_k", (20, 768), 16),
    ("q6_k", (8, 256), 5),
]


@needs_amx
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1][0]}x{c[1][1]}-T{c[2]}")
def test_tiles_give_the_vector_paths_bits_on_any_thread_count(case):
    qtype, shape, t_n = case
    w, x = _weight(qtype, shape, seed=3), acts(t_n, shape[1], seed=4)
    want = _vector_path(x, w)
    w8 = _q8act.Q8Weight(w)
    data, _ = w8.rows, w8.kind
    old = numba.get_num_threads()
    try:
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            numba.set_num_threads(n)
            got = _amx.matmul(*_q8act.quantize_tiles(x), data, qtype, np.empty_like(want))
            assert np.array_equal(bits(got), bits(want)), (case, n)
    finally:
        numba.set_num_threads(old)


def test_quantize_tiles_writes_the_tiles_layout():
    # any T (whole and partial tiles, pad rows zero), any thread count; no AMX needed
    for t_n, k in ((1, 32), (16, 64), (37, 512), (70, 2048)):
        x = acts(t_n, k, seed=t_n)
        want = _amx.tile_major(*_q8act.quantize_padded(x, _amx.TILE))
        old = numba.get_num_threads()
        try:
            for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
                numba.set_num_threads(n)
                for got, ref in zip(_q8act.quantize_tiles(x), want):
                    assert got.shape == ref.shape and np.array_equal(bits(got), bits(ref)), (t_n, k, n)
        finally:
            numba.set_num_threads(old)


@needs_amx
def test_prefill_takes_the_tiles_and_keeps_the_documented_order(monkeypatch):
    """linear() in the q8 mode sends T >= AMX_MIN_T rows of an AMX format to the tiles (seen
    by counting calls), and the result is the float64 emulation's bits."""
    x, w = acts(37, 512, seed=11), make("q4_0", (45, 512), seed=12)
    calls = []
    real = _amx.matmul
    monkeypatch.setattr(_amx, "matmul", lambda *a: calls.append(1) or real(*a))
    w8 = prepare(w, "q8")
    got = linear(x, w8)
    linear(x[: AMX_MIN_T - 1], w8)
    assert calls == [1]
    assert np.array_equal(bits(got), bits(rowdot_reference(x, w)))


CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from sparrow.kernels.matmul.q8 import amx as _amx
from sparrow.kernels.linear import linear, prepare
from test_amx import CASES, _weight
from weights import acts

assert not _amx.AMX
out = {}
for i, (q, shape, t) in enumerate(CASES):
    out[f"c{i}"] = linear(acts(t, shape[1], seed=4), prepare(_weight(q, shape, seed=3), "q8"))
np.savez(sys.argv[2], **out)
"""


def test_switched_off_gives_the_same_bits(tmp_path):
    """SPARROW_AMX=0 keeps the tiles off (here in a child process); its q8 prefills give this
    process's bits, tiles or not."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, SPARROW_AMX="0", PYTHONPATH=os.pathsep.join([ROOT, tests]))
    out = tmp_path / "off.npz"
    subprocess.run([sys.executable, "-c", CHILD, tests, str(out)], env=env, check=True, timeout=900)
    child = np.load(out)
    for i, (q, shape, t) in enumerate(CASES):
        here = linear(acts(t, shape[1], seed=4), prepare(_weight(q, shape, seed=3), "q8"))
        assert np.array_equal(bits(child[f"c{i}"]), bits(here)), CASES[i]
