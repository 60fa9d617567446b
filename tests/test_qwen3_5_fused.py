"""Qwen3.5's decode steps in the fused decode step (models/fused.py's _Hybrid, decode_step's
StepHybrid and _deltanet_phase) give the staged path's bits: a sequence's steps, a batch of
sequences' rows, verification's rows (with the recurrent state kept after each row, to roll
back to) and speculative decoding, in both activations modes and with sparse attention on the
full-attention layers; the fused path is checked to have run (FusedDecode's counters).

One tiny block-shaped model (test_qwen3_5.BLOCK_SHAPED: Gated DeltaNet and gated full attention
layers, partial rotary, more value heads than key heads), quantised at load, and tiny qwen35 /
qwen35moe files (the MoE layers: routed experts and a shared expert): four compiled variants
of the step (exact, q8 activations, exact with block selection, exact MoE)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_qwen3_5 import PROMPT, REPEATING, _run, save_block_shaped

import sparrow
from sparrow.kernels.runtime import set_threads
from sparrow.models import fused as fused_mod
from sparrow.models.attention import Selections
from sparrow.models.decoder import Segment
from sparrow.params import SamplingParams, SparseParams, SpeculativeParams
from sparrow_lab.bench import shapes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    """A busy test machine must not send the fused steps these tests compare to the staged path."""
    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_block_shaped(tmp_path_factory.mktemp("qwen3_5_fused"))[0]


# a qwen35 file as llama.cpp's converter lays it out (sparrow_lab.bench.shapes, random weights),
# small: layers 1 and 3 full attention, 16 of 64 dims rotated
TINY = dict(
    shapes._QWEN35, hidden=256, layers=4, heads=2, kv_heads=1, head_dim=64, rotary_dim=16, mrope_section=(3, 3, 2),
    ffn=512, vocab=512, bpe_tokens=480, tied=False, context=256, full_attention_interval=2, linear_k_heads=2,
    linear_v_heads=4, linear_key_dim=32, linear_value_dim=32,
)  # fmt: skip
# and a qwen35moe one: every layer's MLP routed experts plus a shared expert with its sigmoid gate
TINY_MOE = dict(TINY, ffn=None, arch="qwen35moe", experts=4, experts_used=2, expert_ffn=128, shared_ffn=96)


@pytest.fixture(scope="module")
def llms(folder, tmp_path_factory):
    """name -> the loaded model, on 2 threads: the HF model quantised to q8_0 at load, exact
    ("q8_0") and with q8 activations ("q8act"); the qwen35 files in q4_0 and q4_k_m (q4_k and
    q6_k, and a DeltaNet in_proj whose parts differ in format); the qwen35moe file in q8_0 and
    q4_k_m ("moe_q8_0", "moe_q4_k_m")."""
    root = tmp_path_factory.mktemp("qwen35_files")
    out = {
        "q8_0": sparrow.load(folder, quantize="q8_0", threads=2, activations="f32"),
        "q8act": sparrow.load(folder, quantize="q8_0", threads=2, activations="q8"),
    }
    for q in ("q4_0", "q4_k_m"):
        out[q] = sparrow.load(shapes.write_gguf(str(root / f"tiny-{q}.gguf"), TINY, q, name="tiny"), threads=2)
    for q in ("q8_0", "q4_k_m"):
        path = shapes.write_gguf(str(root / f"tiny-moe-{q}.gguf"), TINY_MOE, q, name="tiny")
        out["moe_" + q] = sparrow.load(path, threads=2)
    assert out["q4_k_m"].model.layers[2].deltanet.proj.fused is None  # q6_k qkv beside q4_k z, b, a
    assert all(type(lay.mlp).__name__ == "SharedExpertMoE" for lay in out["moe_q8_0"].model.layers)
    assert out["moe_q8_0"].model.fused_step().moe is not None
    return out


def _ids(name, n):
    """n prompt ids for the model `name` (the files' vocabulary is small)."""
    return PROMPT[:n] if name.startswith("q8") else np.random.default_rng(n).integers(0, 480, n)


def _plan(llm):
    plan = llm.model.fused_step()
    assert plan is not None and plan.hybrid is not None  # Qwen3.5's layers planned into the fused step
    plan.backoff = 0
    return plan


def _decode(llm, ids, n_prefill, fused, sparse=None):
    """(logits [len(ids) - n_prefill, V] of decode steps after a prefill, the cache)."""
    model = llm.model
    model.use_fused = fused
    plan = _plan(llm)
    before = plan.steps
    try:
        cache = model.new_cache(len(ids) + 8)
        model.forward([Segment(ids[:n_prefill], cache, 0)])
        rows = [
            model.forward([Segment(ids[i : i + 1], cache, i, sparse, decode=True)])[0]
            for i in range(n_prefill, len(ids))
        ]
        assert plan.steps - before == (len(ids) - n_prefill if fused else 0)  # every step took the path meant
        return np.stack(rows), cache
    finally:
        model.use_fused = True


def _same_state(a, b) -> bool:
    return (
        np.array_equal(a.conv, b.conv)
        and np.array_equal(a.ssm, b.ssm)
        and all(np.array_equal(x.k[:, : a.length], y.k[:, : a.length]) for x, y in zip(a.layers, b.layers))
        and all(np.array_equal(x.v[:, : a.length], y.v[:, : a.length]) for x, y in zip(a.layers, b.layers))
    )


@pytest.mark.parametrize("key", ["q8_0", "q8act", "q4_0", "q4_k_m", "moe_q8_0", "moe_q4_k_m"])
def test_decode_steps_run_fused_with_the_staged_bits(llms, key):
    """A sequence's decode steps: the logits and the state left behind (conv, delta rule state,
    K/V of the full-attention layers) bit for bit the staged path's, on 2 threads and on 1."""
    llm = llms[key]
    ids = _ids(key, 60)
    fused, fc = _decode(llm, ids, 40, fused=True)
    staged, sc = _decode(llm, ids, 40, fused=False)
    assert fused.tobytes() == staged.tobytes()
    assert _same_state(fc, sc)
    try:
        set_threads(1)
        one, oc = _decode(llm, ids, 40, fused=True)
    finally:
        set_threads(llm.threads)
    assert one.tobytes() == fused.tobytes()
    assert _same_state(oc, fc)


@pytest.mark.parametrize(
    "sp",
    [SparseParams(k=1, block=8, probe=4), SparseParams(k=2, block=8, select="v2", dense_layers=1)],
    ids=["k1", "v2k2d1"],
)
def test_sparse_decode_runs_fused_with_the_staged_bits(llms, sp):
    """Block-sparse attention on the full-attention layers (k small against the blocks read;
    v2 with the first full-attention layer exact): the fused steps select and attend as the
    staged ones, and differ from exact attention (the selection is in effect)."""
    llm = llms["q8_0"]
    ids = PROMPT[:60]
    fused, _ = _decode(llm, ids, 40, fused=True, sparse=sp)
    staged, _ = _decode(llm, ids, 40, fused=False, sparse=sp)
    assert fused.tobytes() == staged.tobytes()
    exact, _ = _decode(llm, ids, 40, fused=True)
    assert not np.array_equal(fused, exact)
    # the selections a trace records (models.attention.Selections, the server's sparse_trace):
    # one row per full-attention layer, the same from either path
    got = {}
    for path in (True, False):
        model = llm.model
        model.use_fused = path
        try:
            cache = model.new_cache(64)
            model.forward([Segment(ids[:50], cache, 0)])
            trace = Selections()
            before = _plan(llm).steps
            model.forward([Segment(ids[50:51], cache, 50, sp, decode=True, trace=trace)])
            assert _plan(llm).steps == before + path  # the traced step took the path meant
            got[path] = trace.take()
        finally:
            model.use_fused = True
    sel, stages, nsel = got[True]
    assert sel.shape[0] == 2 and (nsel[1] > 0).all()  # two full-attention layers; the second selects
    for layer in (0, 1) if sp.dense_layers == 0 else (1,):  # v2's exact first layer: unspecified rows
        n = nsel[layer]
        assert np.array_equal(n, got[False][2][layer])
        for h in range(len(n)):
            assert np.array_equal(sel[layer, h, : n[h]], got[False][0][layer, h, : n[h]])
            assert np.array_equal(stages[layer, h, : n[h]], got[False][1][layer, h, : n[h]])


def _batch(llm, seqs, fused, sparse=None):
    """One decode row of each sequence after its prefill, in one forward -> logits [B, V], caches."""
    model = llm.model
    model.use_fused = fused
    try:
        caches = [model.new_cache(len(ids) + 1) for ids in seqs]
        for ids, c in zip(seqs, caches):
            model.forward([Segment(ids[:-1], c, 0)])
        segs = [Segment(ids[-1:], c, len(ids) - 1, sparse, decode=True) for ids, c in zip(seqs, caches)]
        return model.forward(segs), caches
    finally:
        model.use_fused = True


@pytest.mark.parametrize("key", ["q8_0", "q8act", "q4_k_m", "moe_q8_0"])
def test_a_batch_runs_fused_with_each_sequence_s_own_bits(llms, key):
    """Rows of three sequences (different lengths: positions, states and caches) in one fused
    step: each row's logits and its sequence's state are those of its step alone and of the
    staged batch; exact, and with every row's sparse settings (the same for all)."""
    llm = llms[key]
    plan = _plan(llm)
    seqs = [_ids(key, n) for n in (9, 23, 41)]
    for sp in (None, SparseParams(k=1, block=8, probe=4)) if key == "q8_0" else (None,):
        staged, sc = _batch(llm, seqs, fused=False, sparse=sp)
        before = plan.batched
        fused, fc = _batch(llm, seqs, fused=True, sparse=sp)
        assert plan.batched == before + 1  # the batch took the fused step
        assert fused.tobytes() == staged.tobytes()
        assert all(_same_state(a, b) for a, b in zip(fc, sc))
        alone = np.concatenate([_batch(llm, [ids], fused=True, sparse=sp)[0] for ids in seqs])
        assert alone.tobytes() == fused.tobytes()


@pytest.mark.parametrize("key", ["q8_0", "q8act", "q4_k_m", "moe_q4_k_m"])
def test_verification_rows_keep_each_row_s_state_and_roll_back_to_plain_decoding(llms, key):
    """A sequence's rows in one fused verification step: each row's logits those of plain decode
    steps, the state kept after every row (keep_every_row) equal to plain decoding's state at
    that position, and after a rollback into the rows the next steps equal plain decoding's."""
    llm = llms[key]
    model = llm.model
    plan = _plan(llm)
    ids = _ids(key, 48)
    n = 40
    plain, pc = _decode(llm, ids, n, fused=False)  # logits of rows n.. as plain (staged) steps
    states = {}  # position -> plain decoding's (conv, ssm) after it
    cache = model.new_cache(len(ids) + 8)
    model.forward([Segment(ids[:n], cache, 0)])
    model.use_fused = False
    try:
        for i in range(n, len(ids)):
            model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])
            states[i + 1] = (cache.conv.copy(), cache.ssm.copy())
    finally:
        model.use_fused = True
    cache = model.new_cache(len(ids) + 8)
    model.forward([Segment(ids[:n], cache, 0)])
    before = plan.verified
    with cache.keeping_every_row():  # as the runner's verification
        rows = model.forward([Segment(ids[i : i + 1], cache, i, decode=True) for i in range(n, n + 6)])
    assert plan.verified == before + 1  # one fused verification step
    assert rows.tobytes() == plain[:6].tobytes()
    for p in range(n + 1, n + 7):
        conv, ssm = cache.state_at(p)
        assert np.array_equal(conv, states[p][0]) and np.array_equal(ssm, states[p][1]), p
    cache.rollback(n + 2)  # the third draft refused
    assert np.array_equal(cache.ssm, states[n + 2][1]) and np.array_equal(cache.conv, states[n + 2][0])
    again = np.stack(
        [model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])[0] for i in range(n + 2, len(ids))]
    )
    assert again.tobytes() == plain[2:].tobytes()
    assert _same_state(cache, pc)


def test_verification_rows_of_several_sequences_run_as_one_fused_batch(llms):
    """Speculating sequences verified together (Runner.verify with several slots): each
    sequence's rows at consecutive positions beside another's go through one fused batch step,
    every row with the bits of a decode step at its position and each sequence's state kept
    after each of its rows, as plain decoding leaves it."""
    llm = llms["moe_q8_0"]
    model = llm.model
    plan = _plan(llm)
    seqs = [_ids("moe", n) for n in (12, 20)]
    feed = [_ids("moe", 4), _ids("moe", 5)]
    counts = (3, 2)
    plain, states, caches = [], {}, []  # plain: staged decode steps
    for s, (ids, toks, n) in enumerate(zip(seqs, feed, counts)):
        cache = model.new_cache(len(ids) + n)
        model.forward([Segment(ids, cache, 0)])
        caches.append(copy.deepcopy(cache))
        model.use_fused = False
        try:
            for j in range(n):
                plain.append(model.forward([Segment(toks[j : j + 1], cache, len(ids) + j, decode=True)])[0])
                states[s, len(ids) + j + 1] = (cache.conv.copy(), cache.ssm.copy())
        finally:
            model.use_fused = True
    segs = [Segment(toks[j : j + 1], cache, len(ids) + j, decode=True)
            for ids, toks, n, cache in zip(seqs, feed, counts, caches) for j in range(n)]  # fmt: skip
    before = plan.batched
    with caches[0].keeping_every_row(), caches[1].keeping_every_row():
        rows = model.forward(segs)
    assert plan.batched == before + 1
    assert rows.tobytes() == np.stack(plain).tobytes()
    for (s, p), (conv, ssm) in states.items():
        got = caches[s].state_at(p)
        assert np.array_equal(got[0], conv) and np.array_equal(got[1], ssm), (s, p)


def test_speculative_decoding_on_the_fused_step_equals_plain(llms):
    """Speculative decoding through the engine (the sparse self-drafter: drafts by sparse
    attention, verified by the fused step with exact attention, refused drafts rolled back in
    the recurrent state) gives plain decoding's tokens and logits bits. (The ngram drafter
    finds no drafts in this random model's continuations.)"""
    spec = SpeculativeParams(method="sparse", tokens=3, sparse=SparseParams(k=1, block=16))
    llm = llms["q8_0"]
    plan = _plan(llm)
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain_toks, plain_logits, _ = _run(llm, REPEATING, sampling)
    before = plan.verified + plan.batched
    toks, logits, _ = _run(llm, REPEATING, sampling, spec=spec)
    assert plan.verified + plan.batched > before  # drafts were verified on the fused step
    assert toks == plain_toks
    assert logits.tobytes() == plain_logits.tobytes()


def test_sparrow_fused_0_takes_the_staged_path(folder, monkeypatch):
    """SPARROW_FUSED=0 (read where the model is built) leaves Qwen3.5's decode steps staged."""
    monkeypatch.setenv("SPARROW_FUSED", "0")
    llm = sparrow.load(folder, quantize="q8_0", threads=2)
    assert not llm.model.use_fused
    plan = llm.model.fused_step()
    cache = llm.model.new_cache(24)
    llm.model.forward([Segment(PROMPT[:16], cache, 0)])
    for i in range(16, 20):
        llm.model.forward([Segment(PROMPT[i : i + 1], cache, i, decode=True)])
    assert plan.steps == 0
