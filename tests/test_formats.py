"""The weight-format table (kernels/formats.py) is the one place the kernels' format ids and
capabilities come from: sparrow.quant's storage reads it, every branch chain handles
exactly the formats that claim what the chain does, and no kernel branches on a literal id."""

import os
import re

import numpy as np
import pytest
from test_kquants import make_kq

from sparrow import quant
from sparrow.kernels import formats
from sparrow.kernels.formats import FORMATS, KIND, X8_FIRST
from sparrow.kernels.linear import (
    EXACT_GEMM,
    EXACT_ROWS,
    Q8_AMX,
    Q8_ROWS,
    SMALL_T,
    Q8Weight,
    choose,
    prepare,
)
from sparrow.kernels.matmul.q8 import amx as _amx
from sparrow.kernels.matmul.q8 import quantized as _q8act
from sparrow.kernels.matmul.widen import F16_LUT, call_slp, widen_row
from weights import make

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sparrow", "kernels")


def _weight(f, shape=(9, 512)):
    if f.row_dot == "kquants":
        return make_kq(f.name, shape, seed=3)
    return make(f.name, shape, seed=3)


def test_table_matches_the_stored_formats():
    assert set(KIND) == set(quant.QTYPES)  # every format a Weight can hold has kernels, and no more
    for f in FORMATS:
        w = _weight(f)
        assert w.qtype == f.name and w.data.nbytes == w.shape[0] * 512 // f.block_values * f.block_bytes, f
    # ids: the stored kinds 0..n-1 in table order, the interleaved ones above them all
    assert [f.kind for f in FORMATS] == list(range(len(FORMATS)))
    assert all(f.x8 is None or f.x8 >= X8_FIRST > max(KIND.values()) for f in FORMATS)


@pytest.mark.parametrize("f", FORMATS, ids=lambda f: f.name)
def test_each_chain_takes_exactly_the_formats_claiming_it(f):
    w = _weight(f)
    # widen_row (prefill GEMM, MoE experts, f16/bf16/f32 matvec): every kind, Weight.dequantize's bits
    data = w.data.view(np.uint32) if f.name == "f32" else w.data
    out = np.empty((w.shape[0], w.shape[1]), np.float32)
    for o in range(len(out)):
        call_slp(widen_row, data[o], f.kind, F16_LUT, out[o], out[o].view(np.uint32), True)
    assert np.array_equal(out.view(np.uint32), w.dequantize().view(np.uint32)), f.name
    # the q8 mode: which formats it runs, which it interleaves, which prefill on its groups
    w8 = prepare(w, "q8")
    assert isinstance(w8, Q8Weight) == (f.x8 is not None)
    assert choose(w8, 1) == (Q8_ROWS if f.x8 is not None else EXACT_ROWS)
    assert (choose(w8, SMALL_T + 1) in (Q8_ROWS, Q8_AMX)) == f.q8_prefill
    if f.x8 is not None:  # the stored rows stay only for a prefill the q8 mode leaves exact
        assert (w8.stored is None) == f.q8_prefill
    assert choose(w, 1) == EXACT_ROWS and choose(w, SMALL_T + 1) == EXACT_GEMM  # stored: the exact mode
    assert (f.name in _amx.FORMATS) == f.amx
    if f.x8 is not None:
        rows, kind = w8.rows, w8.kind
        assert kind == f.x8 and rows.shape[0] == -(-w.shape[0] // 8)  # groups of 8 rows
        # zmm pair tiles: the formats claiming them, on CPUs with AVX512-VNNI, past TILE_X_ROWS rows
        assert _q8act.takes_pairs(f.x8, 64) == (_q8act.VNNI512 and f.zmm_pairs)
        assert not _q8act.takes_pairs(f.x8, 1)


def test_no_kernel_branches_on_a_literal_format_id():
    """`kind == 3` would mean f16 in one place and q4_k in another (the AMX numbering did):
    the kernels compare kinds with formats.py's named ids only."""
    pattern = re.compile(r"\b(kind|kinds\[[^\]]*\]|qtype_id)\s*(==|!=|<=|>=|<|>)\s*\d+\b")  # head_kind < 0: no head
    found = []
    for folder, _, files in os.walk(KERNELS):
        for name in files:
            if name.endswith(".py") and name != "formats.py":
                with open(os.path.join(folder, name)) as fh:
                    for n, line in enumerate(fh, 1):
                        if pattern.search(line):
                            found.append(f"{name}:{n}: {line.strip()}")
    assert not found, found
    # the check sees a literal when there is one
    assert pattern.search("    if kind == 11:") and not pattern.search("    if kind == X8_Q8_0:")


def test_named_ids_are_the_table_ids():
    for f in FORMATS:
        assert getattr(formats, {"f16": "FP16", "f32": "FP32"}.get(f.name, f.name.upper())) == f.kind
        if f.x8 is not None:
            assert getattr(formats, "X8_" + f.name.upper()) == f.x8


def test_each_dispatch_table_holds_exactly_the_formats_claiming_it():
    """The kernels dispatch on a format's id through tables (kernels/dispatch.by_kind) built from
    the format records: each table's kinds are those of the records claiming its kernels."""
    from sparrow.kernels.matmul import kquants
    from sparrow.kernels.matmul import widen as _widen

    def claiming(pred, field="kind"):
        return sorted(getattr(f, field) for f in FORMATS if pred(f))

    for table in (kquants.widen_kq, kquants.rows_kq, kquants._rows_x):
        assert sorted(table.kinds) == claiming(lambda f: f.row_dot == "kquants")
    for table in (_widen.widen_blocks, _widen.rows_blocks, _widen.rows_x_blocks):
        assert sorted(table.kinds) == claiming(lambda f: f.row_dot == "blocks")
    assert sorted(_q8act._group_tiles.kinds) == claiming(lambda f: f.x8 is not None, "x8")
    assert sorted(_q8act._pairs.kinds) == claiming(lambda f: f.zmm_pairs, "x8")
    for table in (_amx._unpack_row, _amx._format_tiles):
        assert sorted(table.kinds) == claiming(lambda f: f.amx)


def test_a_dispatch_table_calls_the_kernel_of_its_kind():
    import numba

    from sparrow.kernels.dispatch import by_kind

    @numba.njit
    def add(x, y):
        y[0] = x[0] + 1

    @numba.njit
    def times(x, y):
        y[0] = x[0] * 10

    @numba.njit
    def other(x, y):
        y[0] = -1

    table = by_kind("test_formats_table", {3: add, 7: times}, default=other)
    x, y = np.array([2.0]), np.zeros(1)
    assert table.kinds == (3, 7)
    for kind, want in ((3, 3.0), (7, 20.0), (5, -1.0)):
        table(kind, x, y)
        assert y[0] == want, kind
    with pytest.raises(ValueError, match="second dispatcher"):
        by_kind("test_formats_table", {3: add})
    for name, table in (("not a name", {3: add}), ("test_formats_empty", {})):
        with pytest.raises(ValueError, match="needs a Python name and at least one kernel"):
            by_kind(name, table)
