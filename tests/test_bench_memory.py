"""`sparrow bench memory`: its measured process, its table and its errors (the bound itself is
measured on the Qwen3 shapes, docs/benchmarks; no test asserts a machine's memory)."""

import sys

import pytest

from sparrow.errors import SparrowError
from sparrow_lab.bench import memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_one_request_in_a_fresh_process(tmp_path, capsys):
    """The default model through a short request: every figure present and in order (the load's
    end within its peak, the request's end within its peak, the KV of prompt + decode positions),
    the table's row and the bound line printed."""
    rec = memory.main(["--prompt", "40", "--decode", "2", "--activations", "auto", "--json", str(tmp_path / "m.json")])
    s = rec["sparrow"]
    assert s["mode"] == "f32" and s["peak_reset"]
    assert 0 < s["load_end"] <= s["load_peak"] and 0 < s["end"] <= s["peak"]
    assert s["file"] > 0 and s["kv"] > 0
    out = capsys.readouterr().out
    assert "| sparrow (f32) |" in out and "the bound by" in out
    assert (tmp_path / "m.json").exists()
    small = memory.main(["--prompt", "20", "--decode", "2", "--activations", "auto"])["sparrow"]
    assert small["kv"] == pytest.approx(s["kv"] * 22 / 42)  # KV for prompt + decode positions


@pytest.mark.parametrize("argv,param", [(["--prompt", "0"], "--prompt"), (["--decode", "-1"], "--decode")])
def test_bad_options_are_one_line_errors(argv, param):
    with pytest.raises(SparrowError, match=param):
        memory.main(argv)
