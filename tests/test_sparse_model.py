"""Block-sparse top-k attention inside the model: equivalence with exact attention when every
block is selected, the article's k=32 claim on the default model, determinism and tracing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numba
import numpy as np

from conftest import prompt
from sparrow.api import set_threads
from sparrow.models.decoder import Segment
from sparrow.params import SparseParams


def decode_steps(llm, ids, n_prefill, sparse=None, trace=None):
    """Logits [len(ids) - n_prefill, V] of decode steps after an exact prefill of n_prefill ids."""
    ids = np.asarray(ids, np.int64)
    cache = llm.model.new_cache(len(ids), "f32")
    llm.model.forward([Segment(ids[:n_prefill], cache, 0)])
    rows = []
    for i in range(n_prefill, len(ids)):
        seg = Segment(ids[i : i + 1], cache, i, sparse, decode=True, trace=trace)
        rows.append(llm.model.forward([seg])[0])
    return np.stack(rows)


def test_all_blocks_selected_is_bitwise_exact_on_tiny_qwen3(tiny_models):
    import sparrow

    llm = sparrow.load(tiny_models["qwen3"].folder)
    ids = prompt(140, seed=5)
    exact = decode_steps(llm, ids, 100)
    n_blocks = -(-140 // 32)
    for k in (n_blocks, n_blocks + 7):
        sparse = decode_steps(llm, ids, 100, SparseParams(k=k))
        assert sparse.tobytes() == exact.tobytes()
    # ...and a real selection (k=2 of 5 blocks) does change the logits, so the test can fail
    assert decode_steps(llm, ids, 100, SparseParams(k=2, block=16)).tobytes() != exact.tobytes()


def test_all_blocks_selected_is_bitwise_exact_on_default_model(default_llm):
    ids = default_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:300]
    exact = decode_steps(default_llm, ids, 290)
    sparse = decode_steps(default_llm, ids, 290, SparseParams(k=10))  # 10 blocks >= ceil(300/32)
    assert sparse.tobytes() == exact.tobytes()


def _long_chat(llm, n_tokens=2000):
    """A ~2K-token chat prompt of varied filler facts with one fact to recall."""
    rng = np.random.default_rng(7)
    towns = ["Oakton", "Riverside", "Maplewood", "Brookfield", "Fairview", "Lakeside", "Hillcrest"]
    places = ["library", "bakery", "museum", "post office", "market", "pool", "cinema"]
    facts = []
    while True:
        facts.append(f"The {rng.choice(places)} in {rng.choice(towns)} opens at {rng.integers(6, 11)} am.")
        if len(facts) % 20 == 0 and len(llm.tokenizer.encode(" ".join(facts))) > n_tokens - 60:
            break
    facts.insert(len(facts) // 2, "Zara's favorite food is ramen.")
    question = " ".join(facts) + "\n\nWhat is Zara's favorite food?"
    return llm.prompt_ids([{"role": "user", "content": question}], chat=True)


def test_k32_follows_exact_on_2k_needle_prompt(default_llm):
    """The article's claim on our model: with k=32 (of ~66 blocks) the needle answer is
    token-identical to exact attention. Measured: on SmolLM2-135M the two agree on the answer
    and drift apart later in the rambling continuation (first difference at token 14 here),
    which is weaker than the article's 32 identical tokens on its 2B/8B models."""
    llm = default_llm
    ids = _long_chat(llm) + llm.tokenizer.encode("Zara's favorite food is")  # the article's answer prefix
    assert 1900 <= len(ids) <= 2200
    exact = list(llm.stream(ids, max_tokens=32))
    trace = []
    sparse = list(llm.stream(ids, max_tokens=32, sparse_attn=True, sparse_k=32, trace=trace))
    ex_ids, sp_ids = [o.token_id for o in exact], [o.token_id for o in sparse]
    first_diff = next((i for i, (a, b) in enumerate(zip(ex_ids, sp_ids)) if a != b), min(len(ex_ids), len(sp_ids)))
    assert first_diff >= 8, (first_diff, llm.tokenizer.decode(ex_ids), llm.tokenizer.decode(sp_ids))
    answer = llm.tokenizer.decode(sp_ids[:8])
    assert "ramen" in answer and answer == llm.tokenizer.decode(ex_ids[:8])
    # the selection really was sparse: 32 of ceil(len/32) blocks per head
    _layer, heads = trace[0][0]
    assert all(len(blocks) == 32 for _, blocks, _, _ in heads)
    assert all(0.0 < mass <= 1.0 for *_, mass in heads)


SELECT = ("seed", "v2")


def sparse_decode_thread_runs(llm):
    """Sparse decode logits with 1 thread, then twice with 2: really 2 (set_threads caps quietly)."""
    ids = llm.tokenizer.encode("Once upon a time, in a land far away, " * 40)[:400]
    runs = []
    try:
        for threads in (1, 2, 2):
            set_threads(threads)
            assert numba.get_num_threads() == threads
            # the seed and v2 selectors (v2: dense first layers, block summaries)
            runs.append(b"".join(decode_steps(llm, ids, 392, SparseParams(k=4, select=s)).tobytes() for s in SELECT))
    finally:
        set_threads(llm.threads)
    return runs


THREADS_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import sparrow
from test_sparse_model import sparse_decode_thread_runs
runs = sparse_decode_thread_runs(sparrow.load())
assert runs[0] == runs[1] == runs[2], "sparse decode logits differ between 1 and 2 threads"
print("identical")
"""


def test_sparse_decode_deterministic_across_threads_and_runs(default_llm):
    if numba.config.NUMBA_NUM_THREADS >= 2:
        runs = sparse_decode_thread_runs(default_llm)
        assert runs[0] == runs[1] == runs[2]
    else:  # this process has one numba thread: compare in one that has two
        env = dict(os.environ, NUMBA_NUM_THREADS="2")
        r = subprocess.run(
            [sys.executable, "-c", THREADS_CHILD, os.path.dirname(os.path.abspath(__file__))],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert r.returncode == 0 and r.stdout.split()[-1:] == ["identical"], r.stdout + r.stderr


def test_k1_trace_picks_only_importance(default_llm):
    ids = default_llm.tokenizer.encode("Numbers: " + " ".join(str(i) for i in range(150)))
    trace = []
    outs = list(default_llm.stream(ids, max_tokens=3, sparse_attn=True, sparse_k=1, trace=trace))
    assert len(trace) == len(outs) - 1  # the first token comes from prefill, which is exact
    # the one slot goes to the block with the largest importance sum (ties: the lower index);
    # importance comes from the exact prefill (one chunk, as the stream's for this prompt)
    set_threads(default_llm.threads)
    cache = default_llm.model.new_cache(len(ids) + len(outs), "f32")
    default_llm.model.forward([Segment(np.asarray(ids, np.int64), cache, 0)])
    for i, step in enumerate(trace):
        assert len(step) == default_llm.config.num_hidden_layers
        seq_len = len(ids) + i + 1  # decode step i attends over the prompt and i + 1 new tokens
        for layer, heads in step:
            imp = cache.sparse[layer].importance[:seq_len].astype(np.float64)  # new tokens: 0
            sums = [imp[b : b + 32].sum() for b in range(0, seq_len, 32)]
            assert len(heads) == default_llm.config.num_attention_heads
            assert all(stages == ["importance"] and blocks == [int(np.argmax(sums))] for _, blocks, stages, _ in heads)


def test_cli_sparse_trace_file(tmp_path):
    out = tmp_path / "trace.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparrow.cli",
            "generate",
            "--prompt",
            "Count: 1 2 3 4 5 6 7 8 9 10 " * 8,
            "--max-tokens",
            "3",
            "--sparse-attn",
            "--sparse-k",
            "2",
            "--sparse-select",
            "v2",
            "--sparse-trace",
            str(out),
            "--timings",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs and {"token", "selector", "layer", "head", "blocks", "stages", "mass"} <= set(recs[0])
    assert all(len(r["blocks"]) == 2 and r["stages"] == ["sink", "recency"] for r in recs)  # v2 at k=2
    assert {r["selector"] for r in recs} == {"v2"} and min(r["layer"] for r in recs) == 2  # layers 0, 1 exact
    assert "[DEC-SINGLE] tok=1 total=" in r.stderr and "attn=" in r.stderr
    assert "activations f32 (q4_1 weights, few enough" in r.stderr  # --timings names the mode and why


def test_sparse_settings_are_validated_once(default_llm):
    import pytest

    from sparrow.errors import SparrowError

    for bad in (dict(sparse_k=0), dict(sparse_k=2.5), dict(sparse_block=True), dict(sparse_probe=-1)):
        with pytest.raises(SparrowError, match="sparse attention needs integer"):
            list(default_llm.generate("hi", max_tokens=1, sparse_attn=True, **bad))
    with pytest.raises(SparrowError, match="kv_dtype must be one of f32, f16, int8"):
        list(default_llm.generate("hi", max_tokens=1, kv_dtype="q4"))
