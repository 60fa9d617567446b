"""Speculative decoding gives plain decoding's tokens, logits bits and KV cache, bit for bit.

The reference is always sparrow's own plain decoding of the same request (one decode step per
token): speculation must change nothing but the number of forwards.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from sparrow.engine.generate import generate_step
from sparrow.engine.sequence import Sequence
from sparrow.engine.speculative import (
    NgramDrafter,
    Speculator,
    lookup,
    make_speculator,
)
from sparrow.errors import SparrowError
from sparrow.loaders import default_model_path
from sparrow.models.decoder import Segment
from sparrow.params import SamplingParams, SparseParams, SpeculativeParams
from sparrow.request import GenerationRequest

TEXT = (
    "The committee met on Tuesday to review the budget. It agreed that the library would stay open "
    "on Sundays, that the pool would close for repairs in March, and that the park would get new "
    "benches. The committee met again on Friday to review the budget and agreed the same."
)
SEED, SPARSE = SparseParams(k=2, block=16), SparseParams(k=2, block=16, select="v2")
V3Q4 = SparseParams(k=2, block=24, select="v3", key_bits=4, p=0.9)  # blocks of 24: tiles shared across blocks


def _prompt(llm, repeat: int = 3) -> list[int]:
    msg = "Copy this text exactly, twice:\n\n" + " ".join([TEXT] * repeat)
    return llm.prompt_ids([{"role": "user", "content": msg}], chat=True)


def _with_threads(llm, n):
    other = copy.copy(llm)
    other.threads = n
    return other


def _run(llm, ids, sampling, kv="f32", sparse=None, spec=None, constraint=None):
    """(tokens, logits [n, V] each position sampled from, the final cache, speculator)."""
    from sparrow.api import set_threads

    set_threads(llm.threads)
    seq = Sequence.create(llm.runner, llm.tokenizer, ids, sampling, llm.ctx, kv, sparse, constraint=constraint)
    seen = []
    accept = seq.accept
    seq.accept = lambda logits: (seen.append(np.array(logits)), accept(logits))[1]
    speculator = make_speculator(llm.handle, llm.runner, spec, seq, kv) if spec is not None else None
    toks = [o.token_id for o in generate_step(llm.runner, seq, spec=speculator)]
    return toks, np.stack(seen), seq.slot.cache, speculator


def _assert_same_cache(a, b):
    """K/V (and int8 scales) over the whole capacity and the prefill importance, bit for bit;
    and the copies sparse decode keeps beside K (the seed's probe keys, v2's block summaries,
    v3's int8 or 4-bit key codes).

    Those copies are built lazily from K, and how far depends on the path, not on speculation:
    the fused single-sequence step copies the full blocks below its position in every layer,
    the staged path those below seq_len in the sparse layers only. So each copy's valid blocks
    must equal a fresh build from the final K (equal on both sides); what lies past them is
    never read, and is compared as its clear_past leaves it (zeros, as a fresh copy's)."""
    assert a.length == b.length and a.capacity == b.capacity
    for la, lb, sa, sb in zip(a.layers, b.layers, a.sparse, b.sparse):
        assert np.array_equal(la.k, lb.k) and np.array_equal(la.v, lb.v)
        assert np.array_equal(la.k_scale, lb.k_scale) and np.array_equal(la.v_scale, lb.v_scale)
        assert np.array_equal(sa.importance.view(np.uint32), sb.importance.view(np.uint32))
        for st in (sa, sb):
            for key, have in st._probes.items():
                own = isinstance(key[1], str)  # v2's and v3's copies: (layer, block)
                fresh = type(have)(la, have.block) if own else type(have)(la, have.block, have.n_probe)
                fresh.extend(la, have.blocks)
                assert have.blocks <= a.length // have.block, key
                kept = copy.deepcopy(have)
                kept.clear_past()
                assert np.array_equal(kept.rows, fresh.rows), key
                assert np.array_equal(kept.scale, fresh.scale), key


def _check(llm, ids, sampling, spec, kv="f32", sparse=None):
    plain = _run(llm, ids, sampling, kv, sparse)
    got = _run(llm, ids, sampling, kv, sparse, spec)
    assert got[0] == plain[0]
    assert np.array_equal(got[1].view(np.uint32), plain[1].view(np.uint32))
    _assert_same_cache(got[2], plain[2])
    return got[3]


GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=7)
PENALISED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.1)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
@pytest.mark.parametrize("sparse", [None, SEED, SPARSE], ids=["exact", "seed", "v2"])
def test_verify_rows_are_decode_steps(default_llm, kv, sparse):
    """The premise: tokens fed as decode rows of one forward give the logits and cache of one
    decode step each (the fused single-sequence step included)."""
    llm = default_llm
    ids = np.asarray(_prompt(llm, 1), np.int64)
    extra = [int(t) for t in np.random.default_rng(0).integers(20, 40000, 6)]
    runs = []
    for verify in (False, True):
        slot = llm.runner.new_slot(ids, len(ids) + 8, kv, sparse)
        llm.runner.prefill(slot)
        if verify:
            logits = llm.runner.verify([slot], [extra], [slot.cache.length])[0]
        else:
            logits = np.stack([llm.runner.decode([slot], [t])[0] for t in extra])
        runs.append((logits, slot.cache))
    assert np.array_equal(runs[0][0].view(np.uint32), runs[1][0].view(np.uint32))
    _assert_same_cache(runs[0][1], runs[1][1])


def _counting(monkeypatch, name):
    """Counts the calls Decoder.attend makes to models.attention's `name` (verify_attention:
    one-pass verification; decode_attention: a row attended alone)."""
    import sparrow.models.decoder as decoder

    calls = []
    inner = getattr(decoder, name)
    monkeypatch.setattr(decoder, name, lambda *a, **k: (calls.append(1), inner(*a, **k))[1])
    return calls


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("path", ["fused", "staged"])
def test_one_pass_verification_equals_decode_steps(default_llm, monkeypatch, kv, threads, path):
    """Exact verification rows of one sequence run in one step: the fused step over all rows
    (models/fused.FusedDecode.verify), or on the staged path with each KV head attending in one
    pass over its K/V (attention.verify_attention). For K = 1..8 rows, their logits and the
    cache after a rollback to any kept count equal plain decode steps' (the fused step), bit
    for bit; and the path named is what ran: no row of a verification attended alone."""
    import sparrow.models.fused as fused_mod
    from sparrow.api import set_threads

    llm = _with_threads(default_llm, threads)
    set_threads(threads)
    # K == 1 must take the fused step: a contended step here or in an earlier test (a busy
    # machine) would send the next ones to the staged path, which attends row by row
    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)
    plan = llm.model.fused_step()
    assert plan is not None  # the default model's block formats take the fused step
    plan.backoff = 0
    ids = np.asarray(_prompt(llm, 2), np.int64)
    extra = [int(t) for t in np.random.default_rng(1).integers(20, 40000, 8)]
    slot = llm.runner.new_slot(ids, len(ids) + 8, kv)
    llm.runner.prefill(slot)
    L = slot.cache.length
    prefilled = copy.deepcopy(slot.cache)
    plain, caches = [], [copy.deepcopy(slot.cache)]  # caches[r]: plain decoding after r tokens
    for t in extra:
        plain.append(llm.runner.decode([slot], [t])[0])
        caches.append(copy.deepcopy(slot.cache))
    plain = np.stack(plain)  # [8, V]
    one_pass, alone = _counting(monkeypatch, "verify_attention"), _counting(monkeypatch, "decode_attention")
    if path == "staged":
        monkeypatch.setattr(llm.model, "use_fused", False)
    layers = len(llm.model.layers)
    for K in range(1, 9):
        slot.cache = copy.deepcopy(prefilled)
        del one_pass[:], alone[:]
        fused_before, verified_before = plan.steps, plan.verified
        logits = llm.runner.verify([slot], [extra[:K]], [L])[0]  # [K, V]
        assert np.array_equal(logits.view(np.uint32), plain[:K].view(np.uint32)), K
        if path == "fused":  # one fused step, a verification one for K > 1
            assert plan.steps - fused_before == 1 and plan.verified - verified_before == (K > 1), K
            assert not one_pass and not alone, K
        else:  # K == 1 attends alone, as a staged decode step
            assert plan.steps == fused_before, K
            assert len(one_pass) == (layers if K > 1 else 0) and len(alone) == (layers if K == 1 else 0), K
        keep = K // 2
        slot.cache.rollback(L + keep)
        _assert_same_cache(slot.cache, caches[keep])


@pytest.fixture(scope="module")
def tiny_k_quant(tmp_path_factory):
    """A Q4_K_M-style tiny Qwen3 file (q4_k and q6_k rows, q/k norms), in both activation modes."""
    import sparrow
    from sparrow_lab.bench import shapes

    tiny = dict(
        hidden=256, layers=3, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512, tied=True,
        rope_theta=1e6, rms_eps=1e-6, context=128,
    )  # fmt: skip
    path = shapes.write_gguf(str(tmp_path_factory.mktemp("kq") / "tiny-k.gguf"), tiny, "q4_k_m", name="tiny")
    llm = sparrow.load(path)
    return {m: llm.with_activations(m).model for m in ("f32", "q8")}


@pytest.mark.parametrize("mode", ["f32", "q8"])
@pytest.mark.parametrize("kv", ["f16", "int8"])
def test_fused_verification_of_k_quants_in_both_modes(tiny_k_quant, monkeypatch, mode, kv):
    """The fused verification step over K-quant rows, exact or q8 activations: rows 2..8 give
    the bits of the fused decode steps at their positions, and it is the step that ran."""
    import sparrow.models.fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)
    model = tiny_k_quant[mode]
    plan = model.fused_step()
    plan.backoff = 0
    ids = np.random.default_rng(5).integers(0, 486, 40)
    P = 30
    cache = model.new_cache(len(ids), kv)
    model.forward([Segment(ids[:P], cache, 0)])
    prefilled = copy.deepcopy(cache)
    steps = plan.steps
    plain = np.stack([model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])[0] for i in range(P, len(ids))])
    assert plan.steps - steps == len(ids) - P
    for R in (2, 3, 8):
        cache = copy.deepcopy(prefilled)
        verified = plan.verified
        rows = model.forward([Segment(ids[P + r : P + r + 1], cache, P + r, decode=True) for r in range(R)])
        assert plan.verified == verified + 1, R
        assert rows.tobytes() == plain[:R].tobytes(), R


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_verify_attention_equals_decode_attention(kv):
    """The kernel alone, on a random cache: rows at positions start..start+R-1, from the first
    position on and across block edges, each equal decode_attention at its position."""
    from sparrow.models.attention import decode_attention, verify_attention
    from sparrow.state.cache import KVCache

    rng = np.random.default_rng(3)
    H, KVH, D, C = 6, 2, 64, 120
    cache = KVCache(1, KVH, D, C, kv)
    cache.append(0, 0, rng.standard_normal((C, KVH, D), np.float32), rng.standard_normal((C, KVH, D), np.float32))
    layer, state = cache.layers[0], cache.sparse[0]
    for start, R in ((0, 5), (27, 8), (31, 2), (64, 9), (100, 20)):
        q = rng.standard_normal((R, H, D), np.float32)
        got = verify_attention(q, layer, start, 0.125)
        for r in range(R):
            want = decode_attention(q[r], layer, state, start + r + 1, 0.125)
            assert np.array_equal(got[r].view(np.uint32), want.view(np.uint32)), (start, r)


def test_a_prefill_chunk_is_not_a_decode_step(default_llm):
    """Why verification feeds decode rows: a prefill chunk over the same tokens runs another
    attention kernel (online softmax in 64-key steps), whose bits differ."""
    llm = default_llm
    ids = np.asarray(_prompt(llm, 1), np.int64)
    extra = np.random.default_rng(0).integers(20, 40000, 6)
    slot = llm.runner.new_slot(ids, len(ids) + 8)
    llm.runner.prefill(slot)
    L = slot.cache.length
    rows = llm.runner.verify([slot], [extra.tolist()], [L])[0]
    chunk = llm.model.forward([Segment(extra, slot.cache, L)], all_logits=True)
    assert not np.array_equal(rows, chunk)
    assert np.abs(rows - chunk).max() < 1e-2  # the same function, summed in another order


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_ngram_greedy_equals_plain(default_llm, kv, k):
    spec = _check(default_llm, _prompt(default_llm), GREEDY, SpeculativeParams("ngram", k), kv)
    assert spec.accepted > 0  # the answer quotes the prompt: drafts were kept


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ngram_sparse_target_equals_plain(default_llm, k, sampling):
    _check(default_llm, _prompt(default_llm), sampling, SpeculativeParams("ngram", k), "f16", SEED)
    _check(default_llm, _prompt(default_llm), sampling, SpeculativeParams("ngram", k), "int8", SPARSE)
    _check(default_llm, _prompt(default_llm), sampling, SpeculativeParams("ngram", k), "f16", V3Q4)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_seeded_sampling_equals_plain(default_llm, kv):
    spec = _check(default_llm, _prompt(default_llm), SEEDED, SpeculativeParams("ngram", 4), kv)
    assert spec.accepted > 0  # drafts kept where the draw picked the drafted token


@pytest.mark.parametrize("kv", ["f32", "int8"])
@pytest.mark.parametrize("drafter", [SEED, SPARSE], ids=["seed", "v2"])
@pytest.mark.parametrize("k", [2, 5])
def test_sparse_drafting_equals_plain(default_llm, kv, drafter, k):
    spec = SpeculativeParams("sparse", k, sparse=drafter)
    for sampling in (GREEDY, PENALISED):
        s = _check(default_llm, _prompt(default_llm), sampling, spec, kv)
        assert s.drafted > 0
    _check(default_llm, _prompt(default_llm), GREEDY, spec, kv, SEED)  # a sparse target too


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_draft_model_equals_plain(default_llm, tiny_models, kv):
    """The default model drafting for itself (its drafts are the target's tokens: all kept) and
    a tiny random model sharing its tokenizer (drafts almost never kept): plain decoding's
    output either way."""
    ids = _prompt(default_llm)
    same = _check(default_llm, ids, GREEDY, SpeculativeParams("draft", 4, draft_model=default_model_path()), kv)
    assert same.accepted == same.drafted > 0
    s = _check(default_llm, ids, SEEDED, SpeculativeParams("draft", 4, draft_model=default_model_path()), kv)
    assert s.accepted > 0  # the drafter samples with the target's draws: it agrees where the logits do
    tiny = SpeculativeParams("draft", 3, draft_model=tiny_models["qwen3"].folder)
    _check(default_llm, ids, GREEDY, tiny, kv)


def test_threads_one_and_two(default_llm):
    ids = _prompt(default_llm)
    for spec in (SpeculativeParams("ngram", 4), SpeculativeParams("sparse", 3, sparse=SEED)):
        one = _run(_with_threads(default_llm, 1), ids, SEEDED, "f16", None, spec)
        two = _run(_with_threads(default_llm, 2), ids, SEEDED, "f16", None, spec)
        assert one[0] == two[0] and np.array_equal(one[1].view(np.uint32), two[1].view(np.uint32))
        _assert_same_cache(one[2], two[2])


def test_adaptive_k_backs_off_when_drafts_fail(default_llm):
    """A drafter that is always wrong: drafting starts at 2 tokens, and each failed verification
    halves K and pauses drafting for twice as many plain steps as the last, so useless drafts
    cost few rows; the output is unchanged."""

    class Wrong(NgramDrafter):
        def propose(self, seq, n):
            return [(seq.last_token + 1 + i) % 1000 + 20 for i in range(n)]

    llm = default_llm
    ids = _prompt(llm, 1)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = _run(llm, ids, sampling)
    seq = Sequence.create(llm.runner, llm.tokenizer, ids, sampling, llm.ctx)
    spec = Speculator(SpeculativeParams("ngram", 8), Wrong(3))
    toks = [o.token_id for o in generate_step(llm.runner, seq, spec=spec)]
    assert toks == plain[0]
    assert spec.accepted == 0 and spec.drafted == 2 + 1 + 1  # 2, pause 8, 1, pause 16, 1, pause 32
    _assert_same_cache(seq.slot.cache, plain[2])


def test_lookup_finds_the_latest_longest_match():
    ctx = np.array([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], np.int64)
    assert lookup(ctx, 3, 4) == [9, 2, 3, 4]  # [1, 2, 3] occurred at 0
    assert lookup(ctx, 2, 4) == [4, 1, 2, 3]  # [2, 3]: its latest earlier occurrence, at 4
    assert lookup(ctx, 3, 2) == [9, 2]
    assert lookup(np.array([5, 6, 7, 5], np.int64), 3, 8) == [6, 7, 5]  # up to the end
    assert lookup(np.array([1, 2, 3], np.int64), 3, 4) == []  # nothing repeats


def test_api_keywords_and_usage(default_llm):
    ids = _prompt(default_llm, 1)
    plain = [o.token_id for o in default_llm.stream(ids, max_tokens=24)]
    outs = list(default_llm.stream(ids, max_tokens=24, speculative="ngram", spec_tokens=3))
    assert [o.token_id for o in outs] == plain
    assert set(outs[-1].speculative) == {"drafted_tokens", "accepted_tokens"}
    with pytest.raises(SparrowError, match="speculative must be one of"):
        list(default_llm.stream(ids, speculative="medusa"))
    with pytest.raises(SparrowError, match="needs a draft model"):
        list(default_llm.stream(ids, speculative="draft"))
    with pytest.raises(SparrowError, match=r"spec_tokens must be an integer in \[1, 32\]"):
        list(default_llm.stream(ids, speculative="ngram", spec_tokens=0))
    with pytest.raises(SparrowError, match="only used with speculative 'sparse'"):
        list(default_llm.stream(ids, speculative="ngram", spec_sparse_k=4))
    with pytest.raises(SparrowError, match="does not share the tokenizer"):
        from sparrow.engine.speculative import check_draft_model

        other = copy.copy(default_llm)
        other.tokenizer = type("T", (), {"encode": lambda self, s: [1], "eos_token_ids": [2]})()
        check_draft_model(default_llm, other)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_missing_draft_model_fails_before_the_target_loads(command, monkeypatch, capsys):
    import sparrow.api
    import sparrow.cli

    def no_load(*a, **k):
        raise AssertionError("the target model was loaded first")

    monkeypatch.setattr(sparrow.api, "load", no_load)
    monkeypatch.setattr(sparrow.cli, "_load", no_load)
    args = [command, "--speculative", "draft", "--draft-model", "/nonexistent/draft.gguf"]
    if command == "generate":
        args += ["--prompt", "hi"]
    assert sparrow.cli.main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --draft-model path not found: /nonexistent/draft.gguf"


def test_structured_output_with_speculation(default_llm):
    """A grammar's mask applies at each verified position: a JSON answer equals plain decoding's
    and parses."""
    import json

    fmt = {"type": "json_object"}
    msgs = [{"role": "user", "content": "Give a JSON object with the keys a and b: " + TEXT}]
    plain = "".join(o.text for o in default_llm.stream(msgs, chat=True, max_tokens=40, response_format=fmt))
    got = "".join(
        o.text for o in default_llm.stream(msgs, chat=True, max_tokens=40, response_format=fmt, speculative="ngram")
    )
    assert got == plain and got.lstrip().startswith("{")
    try:
        json.loads(got)
    except json.JSONDecodeError:  # cut by max_tokens: a prefix of an object, which the grammar kept valid
        assert len(default_llm.tokenizer.encode(got)) >= 35


# ---------------------------------------------------------------------- the engine and the server
def _engine_run(engine, jobs, timeout=600):
    """Submits (ids, params, speculative, kv_dtype) jobs at once -> each one's StepOutputs."""
    import threading

    outs = [[] for _ in jobs]
    errors = [None] * len(jobs)
    done = threading.Semaphore(0)

    def emit_for(i):
        def emit(kind, out):
            if kind == "token":
                outs[i].append(out)
                if out.finish_reason:
                    done.release()
            else:
                errors[i] = out
                done.release()

        return emit

    engine.start(warmup=False)
    try:
        for i, (ids, params, spec, kv) in enumerate(jobs):
            engine.submit(GenerationRequest(ids, params, None, spec, kv), emit_for(i))
        for _ in jobs:
            assert done.acquire(timeout=timeout), "the engine stalled"
    finally:
        engine.stop()
    assert errors == [None] * len(jobs)
    return outs


def _solo(llm, ids, params, kv):
    return [(o.token_id, o.logprob, o.text) for o in llm.stream(ids, sampling=params, kv_dtype=kv)]


def _jobs(llm):
    ids = _prompt(llm, 2)
    greedy = SamplingParams(max_tokens=30, logprobs=2)
    seeded = SamplingParams(max_tokens=30, temperature=0.9, seed=11, logprobs=0)
    stop = SamplingParams(max_tokens=30, stop=["library"])
    return [
        (ids, greedy, SpeculativeParams("ngram", 4), "f32"),
        (ids, seeded, None, "f32"),
        (ids, seeded, SpeculativeParams("sparse", 3, sparse=SEED), "f16"),
        (ids, stop, SpeculativeParams("ngram", 6), "int8"),
        (_prompt(llm, 1), seeded, SpeculativeParams("ngram", 2), "f32"),
    ]


def test_engine_batch_equals_solo_runs(default_llm):
    """Speculating and plain requests decoded together (continuous batching, rows of several
    sequences in one forward): each equals its plain solo run, logprobs and stop strings included."""
    from sparrow.engine.engine import Engine
    from sparrow.server.metrics import Metrics

    llm, metrics = default_llm, Metrics()
    jobs = _jobs(llm)
    outs = _engine_run(Engine(llm.handle, max_batch=8, metrics=metrics, kv_budget=1 << 28), jobs)
    for (ids, params, spec, kv), got in zip(jobs, outs):
        assert [(o.token_id, o.logprob, o.text) for o in got] == _solo(llm, ids, params, kv)
        if spec is not None and len(got) > 1:
            assert got[-1].speculative is not None
    assert "library" not in "".join(o.text for o in outs[3]) and outs[3][-1].finish_reason == "stop"
    snap = metrics.snapshot()
    assert snap["spec_drafted_tokens"] >= snap["spec_accepted_tokens"] > 0


def _metrics_at_last_token(llm, spec):
    """An engine's metrics when a request's last token reaches its client, and after it stopped."""
    from sparrow.engine.engine import Engine
    from sparrow.server.metrics import Metrics

    metrics, seen = Metrics(), []
    engine = Engine(llm.handle, metrics=metrics, kv_budget=1 << 28)
    submit = engine.submit

    def watching(request, emit):
        def on_token(kind, out):
            if kind == "token" and out.finish_reason:
                seen.append(metrics.snapshot())
            emit(kind, out)

        return submit(request, on_token)

    engine.submit = watching
    (outs,) = _engine_run(engine, [(_prompt(llm, 1), SamplingParams(max_tokens=24, ignore_eos=True), spec, "f32")])
    assert len(outs) == 24 and len(seen) == 1
    return seen[0], metrics.snapshot()


@pytest.mark.parametrize("spec", [None, SpeculativeParams("ngram", 4)], ids=["plain", "ngram"])
def test_metrics_count_a_step_before_its_tokens_arrive(default_llm, spec):
    """/metrics scraped the moment a response ends already counts its last decode step, plain
    and speculating (drafted and accepted tokens)."""
    at_last, final = _metrics_at_last_token(default_llm, spec)
    keys = ("generation_tokens", "decode_tokens", "spec_drafted_tokens", "spec_accepted_tokens")
    assert final["decode_tokens"] == 23  # the prefill samples the first
    assert (final["spec_drafted_tokens"] > 0) == (spec is not None)
    assert {k: at_last[k] for k in keys} == {k: final[k] for k in keys}


def test_engine_tight_kv_budget(default_llm):
    """A KV budget that preempts: speculation only drafts into KV it can grow into without
    preempting, and every output still equals its solo run."""
    from sparrow.engine.engine import Engine

    llm = default_llm
    jobs = _jobs(llm)[:4]
    per_seq = llm.model.new_cache(1).bytes_at(len(jobs[0][0]) + 40)
    engine = Engine(llm.handle, max_batch=8, kv_budget=int(per_seq * 2.2), prefix_cache=False)
    outs = _engine_run(engine, jobs)
    for (ids, params, _spec, kv), got in zip(jobs, outs):
        assert [(o.token_id, o.logprob, o.text) for o in got] == _solo(llm, ids, params, kv)
    assert engine.pool.used == 0


def test_engine_charges_a_draft_models_cache(default_llm, tiny_models):
    """A draft model's cache is charged to the KV budget while its request lives; where the
    budget cannot hold it the request decodes plainly (the same output, nothing drafted)."""
    from sparrow.engine.engine import Engine

    llm = default_llm
    from sparrow.state.budget import pages

    ids = _prompt(llm, 1)
    params = SamplingParams(max_tokens=pages(len(ids) + 12) - len(ids))  # whole pages: check_fits charges pages
    spec = SpeculativeParams("draft", 3, draft_model=tiny_models["qwen3"].folder)
    target = llm.model.new_cache(1).bytes_at(len(ids) + params.max_tokens)
    draft = llm.draft_llm(spec.draft_model).model.new_cache(1).bytes_at(len(ids) + params.max_tokens + spec.tokens)
    want = _solo(llm, ids, params, "f32")
    for budget, drafts in ((target + draft, True), (target + draft - 1, False)):
        engine = Engine(llm.handle, max_batch=8, kv_budget=budget, prefix_cache=False)
        got = _engine_run(engine, [(ids, params, spec, "f32")])[0]
        assert [(o.token_id, o.logprob, o.text) for o in got] == want
        assert engine.pool.peak == (target + draft if drafts else target) and engine.pool.used == 0
        assert (got[-1].speculative is not None) == drafts


def test_server_speculative_options_usage_and_metrics(default_llm):
    import httpx
    from inprocess_server import serving

    from sparrow.server.app import ServerState
    from sparrow.server.metrics import parse_prometheus

    llm = default_llm
    text = "Copy this text exactly:\n\n" + TEXT
    ref = "".join(o.text for o in llm.stream([{"role": "user", "content": text}], chat=True, max_tokens=24))
    state = ServerState(speculative=SpeculativeParams("ngram", 3), kv_budget=1 << 28)
    with serving(state, llm) as url:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0}
        # spec_tokens alone tunes the server's default (ngram); spec_sparse_k is ignored by ngram
        for extra in (
            {},
            {"speculative": "ngram", "spec_tokens": 5},
            {"spec_tokens": 2, "spec_sparse_k": 4},
            {"speculative": "none"},
        ):
            r = httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=300).json()
            assert r["choices"][0]["message"]["content"] == ref
            details = r["usage"].get("completion_tokens_details")
            if extra.get("speculative") == "none":
                assert details is None
            else:
                assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
        for bad, param in (
            ({"speculative": "draft"}, "speculative"),  # no --draft-model
            ({"speculative": "medusa"}, "speculative"),
            ({"speculative": "ngram", "spec_tokens": 99}, "spec_tokens"),
            ({"speculative": "sparse", "spec_sparse_k": 0}, "spec_sparse_k"),
        ):
            r = httpx.post(url + "/v1/chat/completions", json={**body, **bad}, timeout=60)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == param, (bad, r.json())
        m = parse_prometheus(httpx.get(url + "/metrics", timeout=60).text)
        assert m["sparrow_spec_draft_tokens_total"] >= m["sparrow_spec_accepted_tokens_total"] > 0
