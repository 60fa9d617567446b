"""`sparrow bench speculative`: --synth end to end on the default model (as both the acceptance
model and the cost rows' model): every part runs, each speculative run is checked against plain
decoding inside the bench, and the table has its rows. --compare llama-cpp: the cross-engine
ratios and the table on made-up rates, llama.cpp's drafted / accepted counting, the errors, and a
short run beside llama.cpp where llama-cpp-python is installed."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow_lab.bench import speculative


def test_cost_side_runs_on_a_small_synthesised_cache(capsys):
    speculative.main(
        ["--synth", "256", "--shape", "", "--acceptance-contexts", "300", "--max-tokens", "8", "--tokens", "2",
         "--draft-k", "8", "--selectors", "v2", "--rounds", "1", "--e2e-tokens", "3"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "| sparse v2 k=8 | 2 |" in out  # an acceptance row
    rows = [line for line in out.splitlines() if line.startswith("| 256 | sparse v2 k=8 | 2 |")]
    assert len(rows) == 1 and rows[0].count("x |") == 4  # new, old, every draft kept, all rejected
    assert "# where the time goes at 256: 3 rows verified" in out
    assert "# end to end at 256: plain:" in out


# --compare llama-cpp (the rewrite row beside llama.cpp's plain decoding and prompt lookup)


def _fake_rows():
    """A rewrite row of both engines with made-up rates: sparrow 10 / 20 / 30 tok/s (plain, K=2,
    K=4), llama.cpp 20 / 25 / 40 / 32 (plain, lookup K=2, K=4, K=10)."""
    task = "rewrite (9-token prompt)"
    counts = {"drafted_tokens": 10, "accepted_tokens": 8}
    sparrow = [("plain", 10.0, None), ("ngram K=2", 20.0, counts), ("ngram K=4", 30.0, counts)]
    llama = [
        ("plain", 20.0, None),
        ("lookup K=2", 25.0, counts),
        ("lookup K=4", 40.0, counts),
        ("lookup K=10", 32.0, None),
    ]
    rows = [speculative._row(task, "sparrow", v, 16, r, 10.0, c) for v, r, c in sparrow]
    rows += [speculative._row(task, "llama.cpp", v, 16, r, 20.0, c, same=v != "lookup K=4") for v, r, c in llama]
    return rows


def test_cross_engine_ratios_and_table():
    rows = _fake_rows()
    summary = speculative.cross_engine(rows)
    by = {(r["engine"], r["variant"]): r for r in rows}
    # each sparrow row over llama.cpp's of the same K; llama.cpp's rows have no such ratio
    assert [by["sparrow", v]["vs_llama_cpp"] for v in ("plain", "ngram K=2", "ngram K=4")] == [0.5, 0.8, 0.75]
    assert all(r["vs_llama_cpp"] is None for r in rows if r["engine"] == "llama.cpp")
    assert by["llama.cpp", "lookup K=4"]["speedup"] == 2.0  # over the same engine's plain decoding
    assert summary["plain"] == 0.5
    assert summary["best_speculative"] == 0.75  # sparrow's fastest (K=4, 30) over llama.cpp's (K=4, 40)
    assert (summary["sparrow_best"], summary["llama_cpp_best"]) == ("ngram K=4", "lookup K=4")
    assert summary["llama_cpp_same_as_plain"] == {"lookup K=2": True, "lookup K=4": False, "lookup K=10": True}
    summary.update(plain_common_start=7, plain_tokens=[16, 16])
    lines = speculative.table(rows, summary)
    assert lines[0].startswith("| task | engine | variant |") and "| vs llama.cpp |" in lines[0]
    assert "| rewrite (9-token prompt) | sparrow | plain | 16 | 10.0 | 1.00x | 0.50x | 0 | 0 |  | yes |" in lines
    assert "| rewrite (9-token prompt) | llama.cpp | lookup K=4 | 16 | 40.0 | 2.00x |  | 10 | 8 | 80% | no |" in lines
    best = "best speculative 0.75x (sparrow ngram K=4 30.0, llama.cpp lookup K=4 40.0 tok/s)"
    assert lines[-3].endswith(f"plain 0.50x (10.0 / 20.0 tok/s); {best}")
    assert lines[-2].endswith("lookup K=2 yes, lookup K=4 no, lookup K=10 yes")
    assert lines[-1] == "# plain outputs: sparrow 16 tokens, llama.cpp 16, the same for the first 7"
    json.dumps(summary)  # the --json mode prints it as one object


def test_table_without_llama_cpp_keeps_its_columns():
    rows = [r for r in _fake_rows() if r["engine"] == "sparrow"]
    assert speculative.cross_engine(rows) is None
    lines = speculative.table(rows)
    assert lines[0] == "| task | variant | tokens | decode tok/s | vs plain | drafted | accepted | acceptance |"
    assert lines[-1] == "| rewrite (9-token prompt) | ngram K=4 | 16 | 30.0 | 3.00x | 10 | 8 | 80% |"


def test_counting_drafter_counts_what_the_output_repeats():
    proposals = iter([[2, 3, 9], [5, 6, 7], []])
    drafter = speculative.CountingDrafter(lambda ids: np.array(next(proposals), np.intc))
    prompt, out = [11, 12, 13, 14, 15], [1, 2, 3, 4, 5, 6]
    drafter(np.array(prompt + out[:1], np.intc))  # drafts positions 6..8: out[1:4] = 2, 3, 4 keeps two
    drafter(np.array(prompt + out[:4], np.intc))  # drafts out[4:7]: 5, 6 kept, the third is past the output
    drafter(np.array(prompt + out[:6], np.intc))  # nothing found
    assert drafter.counts(len(prompt), out) == {"drafted_tokens": 6, "accepted_tokens": 4}


def test_draft_and_lookup_lengths():
    assert speculative.draft_lengths("2,4,8") == [2, 4, 8]
    for bad in ("", "2,x", "0", "4,-1"):
        with pytest.raises(SparrowError, match="--tokens"):
            speculative.draft_lengths(bad)
    assert speculative.lookup_lengths([8, 2, 4], 10) == [2, 4, 8, 10]
    assert speculative.lookup_lengths([10, 4], 10) == [4, 10]
    assert speculative.common_start([1, 2, 3], [1, 2, 4, 5]) == 2


def test_compare_without_llama_cpp_is_a_one_line_error(monkeypatch, capsys):
    from sparrow import cli

    for name in ("llama_cpp", "llama_cpp.llama_speculative"):  # both: an imported submodule is found first
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SparrowError, match="needs llama-cpp-python"):
        speculative.main(["--compare", "llama-cpp"])
    capsys.readouterr()
    assert cli.main(["bench", "speculative", "--compare", "llama-cpp", "--skip", "worst,sparse"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == ["error: --compare llama-cpp needs llama-cpp-python, which is not importable here "
                   "(pip install llama-cpp-python)"]  # fmt: skip


def test_compare_needs_the_rewrite_row():
    with pytest.raises(SparrowError, match="rewrite row"):
        speculative.main(["--compare", "llama-cpp", "--skip", "rewrite"])
    with pytest.raises(SparrowError, match="--synth"):
        speculative.main(["--compare", "llama-cpp", "--synth", "256"])
    with pytest.raises(SystemExit):
        speculative.main(["--compare", "vllm"])


def test_compare_llama_cpp_end_to_end(capsys):
    """A short --json run beside llama.cpp: every variant of both engines has its row, llama.cpp's
    counts are consistent, and both engines were given the same prompt (their greedy outputs start
    alike)."""
    pytest.importorskip("llama_cpp")
    speculative.main(
        ["--skip", "worst,sparse", "--max-tokens", "6", "--repeats", "1", "--tokens", "2", "--compare", "llama-cpp",
         "--json"]
    )  # fmt: skip
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    rows, summary = objs[:-1], objs[-1]
    assert [(r["engine"], r["variant"]) for r in rows] == [
        ("sparrow", "plain"), ("sparrow", "ngram K=2"),
        ("llama.cpp", "plain"), ("llama.cpp", "lookup K=2"), ("llama.cpp", "lookup K=10"),
    ]  # fmt: skip
    assert all(r["tok_s"] > 0 and 0 <= r["accepted"] <= r["drafted"] for r in rows)
    assert all(r["tokens"] == 6 for r in rows)  # code to copy: no answer stops before 6 tokens
    assert summary["compare"] == "llama-cpp" and summary["plain"] > 0 and summary["best_speculative"] > 0
    assert set(summary["llama_cpp_same_as_plain"]) == {"lookup K=2", "lookup K=10"}
    assert summary["plain_common_start"] >= 1


def test_draft_model_cost_side_runs(capsys):
    """--draft-model: the default model drafting for itself (the same tokenizer, every draft
    kept): the cost rows, and an end-to-end run whose tokens the bench checks against plain."""
    from sparrow.loaders import default_model_path

    speculative.main(
        ["--shape", "", "--draft-model", default_model_path(), "--draft-context", "48", "--tokens", "2,4",
         "--rounds", "1", "--e2e-tokens", "6", "--max-tokens", "8"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "# plain step" in out and "draft step" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 2 |", "| 4 |"))]
    assert len(rows) == 2 and all(r.count("x |") == 6 for r in rows)  # 4 rates, every draft kept, all rejected
    assert "# end to end: draft K=4:" in out and "drafts kept, same tokens" in out


def test_draft_cost_options_are_exclusive():
    with pytest.raises(SparrowError, match="--draft-shape or --draft-model"):
        speculative.main(["--draft-shape", "qwen3-0.6b", "--draft-model", "x.gguf"])
    with pytest.raises(SparrowError, match="--synth"):
        speculative.main(["--synth", "256", "--draft-model", "x.gguf"])
