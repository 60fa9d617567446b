"""`sparrow bench long-context` on the default model (llama.cpp is not needed; CI has none): one
prefilled context and one synthesised cache, each engine in its own process, and sparrow's
resident memory within the bound the bench states."""

import json

from sparrow.bench import long_context
from sparrow.kv_cache import SNAPSHOT_COPIES


def test_long_context_bench_memory_within_bound(tmp_path, capsys):
    out = tmp_path / "lc.json"
    # f32 KV at 16K on SmolLM2 (30 layers, 3 KV heads of 64) is 737 MiB of cache, so the cache,
    # not the process's baseline, decides whether the peak stays within the bound
    long_context.main(
        ["--contexts", "256", "--synth", "16384", "--kv", "f32", "--rounds", "1", "--decode", "2", "--json", str(out)]
    )
    rec = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert "| 16384 (synthesised cache) | sparrow, sparse v2 k=32 |" in table
    assert "| 256 | sparrow, exact |" in table
    row = rec["contexts"]["256"]
    assert set(row["tok_s"]["sparrow"]) == {"exact", "seed", "v2"}
    assert all(v > 0 for v in row["tok_s"]["sparrow"].values())
    assert row["ttft_s"]["sparrow"] > 0
    mem = rec["synth"]["16384"]["memory"]["sparrow"]
    # K/V f32, importance, and the prefix cache's importance snapshots (at most SNAPSHOT_COPIES arrays)
    kv = (30 * 3 * 64 * 2 * 4 + 30 * 4 * (1 + SNAPSHOT_COPIES)) * (16384 + 2) / 2**20
    assert abs(mem["kv_mib"] - kv) < 1e-6
    assert mem["side_mib"]["seed"] > 0 and mem["side_mib"]["v2"] > 0
    # the synthesised cache is written whole, so the measured peak sees all of it ...
    assert mem["peak_mib"] - mem["base_mib"] >= 0.95 * mem["kv_mib"]
    # ... and stays within the stated bound: no second copy of the cache anywhere
    assert mem["within_bound"] and mem["peak_mib"] <= mem["bound_mib"]
    assert mem["bound_mib"] < mem["base_mib"] + 2 * mem["kv_mib"]


def test_bad_contexts_are_one_line_errors():
    import pytest

    from sparrow.errors import SparrowError

    for args in (["--contexts", "8K"], ["--contexts", "", "--synth", "0"], ["--shape", "qwen3-0.6b", "--model", "x"]):
        with pytest.raises(SparrowError):
            long_context.main(args)
