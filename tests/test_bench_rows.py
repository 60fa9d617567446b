"""`sparrow bench rows`: its matrices, its cells and its errors (speed itself is never asserted)."""

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.quant import Weight
from sparrow_lab.bench import rows


@pytest.mark.parametrize("qtype", rows.TYPES)
def test_random_rows_have_finite_values(qtype):
    # sane scales: no subnormal, inf or NaN value could make one format's row dot slower
    data = rows.random_rows(qtype, 300, 512, seed=3)
    w = Weight(qtype, data, (300, 512)).dequantize()
    assert np.isfinite(w).all() and np.abs(w).max() > 0
    assert np.array_equal(data[256:], data[: 300 - 256])  # the 256-row pattern, repeated


def test_cells_name_format_size_and_threads():
    cells = rows.measure(["q4_0", "q4_k"], [1], ["l2"], 256, 64, passes=1, min_ms=1, log=lambda s: None)
    assert [(c["type"], c["size"], c["threads"]) for c in cells] == [("q4_0", "l2", 1), ("q4_k", "l2", 1)]
    for c in cells:
        assert c["gb_s"] > 0 and c["gmac_s"] > 0 and c["read_gb_s"] > 0
        assert c["of_read"] == pytest.approx(c["gb_s"] / c["read_gb_s"])


@pytest.mark.parametrize(
    "argv,param",
    [
        (["--types", "q4_0,q9_9"], "--types"),
        (["--sizes", "l1"], "--sizes"),
        (["--threads", "0"], "--threads"),
        (["--k", "100"], "--k"),
    ],
)
def test_bad_options_are_one_line_errors(argv, param):
    with pytest.raises(SparrowError, match=param):
        rows.main(argv)
