"""The q8 mode's zmm prefill tiles over pairs of interleaved groups (kernels/matmul/q8/pair_tiles.py; q8_0,
q4_0, q4_1, q5_0, q5_1, q4_k, q6_k): the documented order's bits (the float64 emulations of
tests/test_q8act.py and test_kquants_q8.py) for any T, group count, last group and thread
count, and the path really taken where the CPU has AVX512-VNNI (the AVX2 and generic
children of those suites compare the same prefills against this host)."""

import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest
from test_gemm import bits
from test_kquants import make_kq
from test_kquants_q8 import extreme_weight, extreme_x, reference
from test_q8act import q8_outputs, rowdot_reference

from sparrow.kernels import intdot as _q8ir
from sparrow.kernels.formats import BLOCK_BYTES
from sparrow.kernels.linear import linear, prepare
from sparrow.kernels.matmul.q8 import groups as _x8
from sparrow.kernels.matmul.q8 import pair_tiles as _x16
from sparrow.kernels.matmul.q8 import quantized as _q8act
from sparrow.quant import Weight
from weights import acts, make

needs_vnni512 = pytest.mark.skipif(not _q8ir.VNNI512, reason="this CPU has no AVX512-VNNI")

# (format, [out, in], T): one pair and one block; 17 groups (8 pairs, then one group on the
# ymm tiles); a part-padding last group; T not a multiple of PAIR_X_ROWS, or below it but above TILE_X_ROWS;
# more groups than one chunk (_q8act.GROUP_CHUNK)
CASES = [
    ("q4_0", (16, 32), 7),
    ("q4_1", (16, 32), 5),
    ("q4_0", (136, 96), 13),
    ("q4_1", (45, 512), 37),
    ("q4_0", (300, 2048), 70),
    ("q4_1", (272, 256), 6),
    ("q4_k", (16, 256), 7),
    ("q4_k", (136, 768), 13),
    ("q4_k", (300, 2048), 70),
    ("q6_k", (16, 256), 7),
    ("q6_k", (136, 768), 13),
    ("q6_k", (300, 2048), 70),
    ("q5_0", (136, 96), 13),
    ("q5_0", (300, 2048), 70),
    ("q5_1", (45, 512), 37),
    ("q5_1", (16, 32), 5),
    ("q8_0", (16, 32), 7),
    ("q8_0", (136, 96), 13),
    ("q8_0", (300, 2048), 70),
    ("q8_0", (45, 512), 37),
]


def _weight(q, shape, seed):
    return make(q, shape, seed=seed) if q in ("q4_0", "q4_1", "q8_0") else make_kq(q, shape, seed=seed)


@needs_vnni512
def test_pair_tiles_follow_the_documented_order():
    out = q8_outputs(CASES, _weight)
    for i, (q, shape, t) in enumerate(CASES):
        ref = reference(acts(t, shape[1], seed=7), _weight(q, shape, seed=8))
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            assert np.array_equal(bits(out[f"c{i}_{n}"]), bits(ref)), (q, shape, t, n)


@needs_vnni512
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q5_0", "q5_1"])
def test_pairs_extreme_codes_and_scales(qtype):
    """The largest sums (codes and scales at their extremes against x at +-127): q4_k's and
    q6_k's float(s) * float(sc) must stay exact, below 2^24, q6_k's offset codes must not
    overflow; and an all-zero x row gives 0."""
    w, x = extreme_weight(qtype, 16), extreme_x(_x8.TILE_X_ROWS + 3)
    y = linear(x, prepare(w, "q8"))
    assert np.array_equal(bits(y), bits(reference(x, w)))
    assert np.all(y[-1] == 0)


@needs_vnni512
def test_q8_0_pairs_at_the_extreme_codes():
    """q8_0's codes enter vpdpbusd as code + 128: codes -128 and 127 (the stored byte's ends;
    ggml writes -127 .. 127) against x at +-127, the largest sums of code + 128 (32 * 255 * 127),
    and an all-zero x row."""
    o_n, k = 16, 512
    raw = make("q8_0", (o_n, k), seed=3).data.copy().reshape(o_n, k // 32, BLOCK_BYTES["q8_0"])
    raw[: o_n // 2, :, 2:] = 0x80  # -128
    raw[o_n // 2 :, :, 2:] = 0x7F  # 127
    w = Weight("q8_0", raw.reshape(o_n, -1), (o_n, k))
    x = extreme_x(_x8.TILE_X_ROWS + 3)
    y = linear(x, prepare(w, "q8"))
    assert np.array_equal(bits(y), bits(reference(x, w)))
    assert np.all(y[-1] == 0) and np.all(y[0] != 0)


@needs_vnni512
def test_pairs_write_exactly_their_rows_of_a_strided_output():
    """x8_rows into columns off .. off + O of a wider y (as the fused decode step's pieces
    are): the pair tiles store whole 16-row vectors, so nothing left or right of them moves."""
    q, (o_n, k), t = "q4_0", (45, 256), 9
    x, w = acts(t, k, seed=5), make(q, (o_n, k), seed=6)
    w8 = _q8act.Q8Weight(w)
    data, kind = w8.rows, w8.kind
    xq, dx, sx = _q8act.quantize(x)
    y = np.full((t, o_n + 40), np.float32(7))
    _q8act.rows_q8(data, kind, xq, dx, sx, y[:, 20 : 20 + o_n], 0, data.shape[0])
    assert np.array_equal(bits(y[:, 20 : 20 + o_n]), bits(rowdot_reference(x, w)))
    assert (y[:, :20] == 7).all() and (y[:, 20 + o_n :] == 7).all()


@needs_vnni512
def test_prefill_takes_the_zmm_tiles():
    """Where the CPU has AVX512-VNNI the pair tiles are zmm vpdpbusd (compiled afresh here:
    a kernel loaded from numba's cache has no assembly to show)."""
    fresh = numba.njit(_q8act._pair_tiles.py_func)
    for q in ("q4_0", "q8_0"):
        x, w = acts(_x8.TILE_X_ROWS + 1, 64), make(q, (16, 64))
        w8 = _q8act.Q8Weight(w)
        data, kind = w8.rows, w8.kind
        xq, dx, sx = _q8act.quantize(x)
        y = np.empty((x.shape[0], 16), np.float32)
        fresh(data, kind, 0, 2, xq, dx, sx, _q8act.x_sums(kind, xq), y)
        assert np.array_equal(bits(y), bits(rowdot_reference(x, w))), q
    asm = "".join(fresh.inspect_asm().values())
    assert "vpdpbusd" in asm and "zmm" in asm
    assert _x16.PAIR_X_ROWS > _x8.TILE_X_ROWS


def test_q8k_tiles_script_builds_its_variants_from_these_tiles():
    """scripts/q8k_tiles.py (issue 34 item 5's measurement) builds a q8_K-order prototype and an
    epilogue-free variant of the q4_k / q6_k pair tiles from this module's pieces: it runs and
    prints a figure for each of the three variants of both formats, or, on a CPU without
    AVX512-VNNI, says why in one line."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "q8k_tiles.py")
    args = [sys.executable, script, "--k", "256", "--rows", "32", "--t", "12", "--passes", "1"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if not _q8ir.VNNI512:
        assert r.returncode != 0 and "no AVX512-VNNI" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    for qtype in ("q4_k", "q6_k"):
        line = next(x for x in r.stdout.splitlines() if x.startswith(qtype + ":"))
        got = re.findall(r"(today's order|q8_K order|no epilogue) (\d+)", line)
        assert [name for name, _ in got] == ["today's order", "q8_K order", "no epilogue"], line
