"""`sparrow bench speculative --synth` end to end on the default model (as both the acceptance
model and the cost rows' model): every part runs, each speculative run is checked against plain
decoding inside the bench, and the table has its rows."""

from __future__ import annotations

from sparrow.bench import speculative


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
