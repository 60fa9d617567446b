"""`sparrow bench long-context` on the default model (llama.cpp is not needed; CI has none): one
prefilled context and one synthesised cache, each engine in its own process, and sparrow's
resident memory within the bound the bench states."""

import json

import pytest

from sparrow.state.sparse import SNAPSHOT_COPIES
from sparrow_lab.bench import long_context


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
    assert "| 16384 (synthesised cache) | sparrow, sparse v3-p0.95 k=32 |" in table
    assert "| 256 | sparrow, exact |" in table
    row = rec["contexts"]["256"]
    assert set(row["tok_s"]["sparrow"]) == {"exact", "seed", "v2", "v3-p0.95"}
    assert all(v > 0 for v in row["tok_s"]["sparrow"].values())
    assert row["ttft_s"]["sparrow"] > 0
    mem = rec["synth"]["16384"]["memory"]["sparrow"]
    # K/V f32, importance, and the prefix cache's importance snapshots (at most SNAPSHOT_COPIES arrays)
    kv = (30 * 3 * 64 * 2 * 4 + 30 * 4 * (1 + SNAPSHOT_COPIES)) * (16384 + 2) / 2**20
    assert abs(mem["kv_mib"] - kv) < 1e-6
    assert mem["side_mib"]["seed"] > 0 and mem["side_mib"]["v2"] > 0
    codes = 30 * 3 * (64 + 4) * 16416 / 2**20  # v3: int8 codes and a scale a key
    assert mem["side_mib"]["v3-p0.95"] == pytest.approx(codes, rel=0.01)
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


def test_long_context_bench_sparse_prefill_child(tmp_path, capsys):
    """--sparse-prefill adds a child that prefills sparse: its time to first token beside exact's,
    the ratio table, its decode in its selector's mode only, and its memory within its bound."""
    out = tmp_path / "lc.json"
    args = ["--contexts", "256", "--synth", "", "--kv", "f16", "--rounds", "1", "--decode", "2"]
    long_context.main([*args, "--sparse-prefill", "v2", "--json", str(out)])
    rec = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert rec["config"]["sparse_prefill"] == "v2"
    row = rec["contexts"]["256"]
    assert set(row["tok_s"]) == {"sparrow", long_context.SPARSE_PREFILL}
    assert set(row["tok_s"][long_context.SPARSE_PREFILL]) == {"v2"}
    t = row["ttft_s"]
    assert t["sparrow"] > 0 and t[long_context.SPARSE_PREFILL] > 0
    r = row["ttft_ratio_sparse_prefill"]
    assert r["vs_exact"] == t["sparrow"] / t[long_context.SPARSE_PREFILL] and r["vs_llama"] is None
    assert "| 256 | sparrow, sparse prefill v2 k=32, then sparse v2 k=32 |" in table
    assert (
        f"| 256 | {t['sparrow']:.2f} | {t[long_context.SPARSE_PREFILL]:.2f} | {r['vs_exact']:.2f}x | - | - |" in table
    )
    mem = row["memory"][long_context.SPARSE_PREFILL]
    assert set(mem["side_mib"]) == {"v2"}  # only its own selector's copy is charged
    assert mem["within_bound"] and mem["peak_mib"] <= mem["bound_mib"]
    assert "| 256, sparse prefill v2 |" in table


def test_sparse_prefill_engine_prefills_with_its_selector():
    """The sparse-prefill child's engine runs the runner's sparse prefill: with k=2 blocks of 32
    over a 300-token prompt its cache is the runner's own sparse prefill's, bit for bit, and not
    the exact prefill's."""
    import numpy as np

    from sparrow.engine.runner import Slot
    from sparrow.loaders import default_model_path
    from sparrow.params import SparseParams

    eng = long_context.SparrowEngine(default_model_path(), 2, "f32", 2, "v2")
    eng.start(300, 2)
    eng.prefill(0, 300)
    runner, model = eng.llm.runner, eng.model
    caches = {}
    for name, sp in (("sparse", SparseParams(k=2, select="v2", prefill=True)), ("exact", None)):
        caches[name] = model.new_cache(302, "f32")
        runner.prefill(Slot(eng.prompt[:300], caches[name], sp))
    last = len(eng.cache.layers) - 1
    got = eng.cache.layers[last].k[:, :300]
    assert np.array_equal(got, caches["sparse"].layers[last].k[:, :300])
    assert not np.array_equal(got, caches["exact"].layers[last].k[:, :300])


def test_long_context_bench_q8_activations(tmp_path, capsys):
    """--activations q8 loads sparrow's child in the q8 mode (what a 4-bit file gets by default),
    says so in the table, and its memory stays within the bound (the interleaved weight copy is
    part of the baseline the bound starts from)."""
    out = tmp_path / "lc.json"
    args = ["--contexts", "256", "--synth", "", "--kv", "f16", "--rounds", "1", "--decode", "2"]
    long_context.main([*args, "--activations", "q8", "--json", str(out)])
    rec = json.loads(out.read_text())
    assert rec["config"]["activations"] == "q8"
    assert "sparrow with q8 activations" in capsys.readouterr().out
    row = rec["contexts"]["256"]
    assert all(v > 0 for v in row["tok_s"]["sparrow"].values())
    assert row["memory"]["sparrow"]["within_bound"]
