"""The prefix cache: a request that starts like an earlier one reuses its KV and prefills only the
rest, with the same tokens and logits bits as with the cache off; LRU eviction under the budget;
requests with non-token inputs are never matched on token ids alone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_kv_budget import Recording, solo

from sparrow.engine.engine import Engine
from sparrow.engine.runner import Runner
from sparrow.params import SamplingParams, SparseParams
from sparrow.request import GenerationRequest
from sparrow.server.metrics import Metrics
from sparrow.state.budget import KVPool
from sparrow.state.cache import KVCache
from sparrow.state.prefix import PrefixCache, prefix_key

CHUNK = 16


# ---------------------------------------------------------------------- no model needed
def _finished(n, chunk=CHUNK, tokens=None):
    """A cache as a finished request leaves it: n positions, snapshots at each chunk boundary."""
    cache = KVCache(1, 1, 4, n)
    cache.length = n
    snaps = {b: np.full((1, b), b, np.float32) for b in range(chunk, n + 1, chunk)}
    return (np.arange(n) if tokens is None else np.asarray(tokens)), cache, snaps


def test_lookup_reuses_whole_chunks_and_leaves_a_token_to_run():
    pool = KVPool(1 << 20)
    pc = PrefixCache(pool, CHUNK)
    key = prefix_key("f32", None)
    pc.insert(key, *_finished(40))  # boundaries 16, 32
    assert len(pc) == 1 and pc.nbytes == pool.used > 0
    for prompt, want in [(np.arange(60), 32), (np.arange(33), 32), (np.arange(32), 16), (np.arange(16), 0)]:
        hit = pc.lookup(key, prompt)
        pc.unpin(hit, hit.entry is not None)
        assert hit.tokens == want, (len(prompt), hit.tokens)
    other = np.r_[np.arange(20), [999] * 20]  # diverges at 20: only the first chunk is shared
    hit = pc.lookup(key, other)
    assert hit.tokens == 16
    pc.unpin(hit, True)
    assert pc.lookup(prefix_key("f16", None), np.arange(60)).entry is None  # another dtype never matches
    assert (pc.stats.hits, pc.stats.cached_tokens) == (4, 32 + 32 + 16 + 16)


def test_keys_keep_images_and_sparse_prefill_apart():
    assert prefix_key("f32", None, has_images=True) is None  # images without a salt: never matched
    assert prefix_key("f32", None, "img-a", True) != prefix_key("f32", None, "img-b", True)
    assert prefix_key("f32", SparseParams(k=4)) == prefix_key("f32", None)  # decode-only settings
    assert prefix_key("f32", SparseParams(k=4, prefill=True)) != prefix_key("f32", None)


def test_lru_eviction_under_the_budget_and_covered_entries_are_dropped():
    one = KVCache(1, 1, 4, 1).bytes_at(32)
    pool = KVPool(2 * one)
    pc = PrefixCache(pool, CHUNK)
    pool.evictor = pc.evict_one
    key = prefix_key("f32", None)
    a, b = _finished(32, tokens=np.arange(32)), _finished(32, tokens=np.arange(32) + 100)
    pc.insert(key, *a)
    pc.insert(key, *b)
    hit = pc.lookup(key, np.arange(40))  # touches a: b is now the least recently used
    pc.unpin(hit, True)
    assert pool.charge_new(KVCache(1, 1, 4, 32)) and len(pc) == 1  # room made by evicting b
    assert pc.lookup(key, np.arange(40) + 100).entry is None and pc.stats.evictions == 1
    longer = _finished(48, tokens=np.arange(48))
    pool.budget *= 2
    pc.insert(key, *longer)  # covers a's prefix: a is dropped, not kept twice
    assert len(pc) == 1 and pc.lookup(key, np.arange(60)).tokens == 48


# ---------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def _params(seed, n=6):
    return SamplingParams(max_tokens=n, temperature=0.7, seed=seed, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("sparse", [None, SparseParams(k=2, block=16)], ids=["exact", "sparse"])
def test_second_turn_reuses_kv_and_matches_the_cache_off_bits(llm, sparse):
    rng = np.random.default_rng(3)
    first = rng.integers(100, 40000, 90).tolist()
    runner, metrics = Recording(llm.model, CHUNK), Metrics()
    engine = Engine(llm.handle, runner=runner, metrics=metrics, kv_budget=1 << 28)
    engine.start(warmup=False)
    try:
        (out1,), _ = _submit_one(engine, first, _params(1), sparse)
        second = first + out1 + rng.integers(100, 40000, 23).tolist()  # the next turn: reply and a new message
        before = metrics.snapshot()["prefill_tokens"]
        (out2,), cached2 = _submit_one(engine, second, _params(2), sparse)  # takes the first's entry over
        prefilled = metrics.snapshot()["prefill_tokens"] - before
        third = first[:40] + rng.integers(100, 40000, 30).tolist()  # shares 2 chunks: copies from the second's
        (out3,), cached3 = _submit_one(engine, third, _params(3), sparse)
    finally:
        engine.stop()
    assert cached2 == 80 and prefilled == len(second) - 80  # 5 whole chunks of the first prompt reused
    assert cached3 == 32 and engine.prefix.stats.hits == 2
    off = Recording(llm.model, CHUNK)
    for ids, params, out in ((second, _params(2), out2), (third, _params(3), out3)):
        assert solo_sparse(llm, off, ids, params, sparse) == out
        with_cache = {k: v for k, v in runner.logits.items() if k[0] == tuple(ids)}
        alone = {k: v for k, v in off.logits.items() if k[0] == tuple(ids)}
        assert set(with_cache) == set(alone)
        assert all(with_cache[k].tobytes() == alone[k].tobytes() for k in with_cache)
        assert runner.importance[tuple(ids)].tobytes() == off.importance[tuple(ids)].tobytes()


def solo_sparse(llm, runner, ids, params, sparse):
    if sparse is None:
        return solo(llm, runner, ids, params)
    from sparrow.engine.generate import generate_step
    from sparrow.engine.sequence import Sequence

    seq = Sequence.create(runner, llm.tokenizer, list(ids), params, llm.ctx, llm.kv_dtype, sparse)
    return [o.token_id for o in generate_step(runner, seq)]


def _submit_many(engine, prompts, params, sparse=None):
    """Submits every prompt at once -> each one's (tokens, cached tokens)."""
    import threading

    got = [([], []) for _ in prompts]
    done = [threading.Event() for _ in prompts]
    for (toks, cached), ev, ids in zip(got, done, prompts):

        def emit(kind, out, toks=toks, cached=cached, ev=ev):
            assert kind == "token", out
            toks.append(out.token_id)
            if out.cached_tokens is not None:
                cached.append(out.cached_tokens)
            if out.finish_reason:
                ev.set()

        engine.submit(GenerationRequest(ids, params, sparse), emit)
    assert all(ev.wait(300) for ev in done)
    return [(toks, cached[0]) for toks, cached in got]


def _submit_one(engine, ids, params, sparse):
    ((toks, cached),) = _submit_many(engine, [ids], params, sparse)
    return (toks,), cached


def test_the_prefix_cache_holds_a_request_when_its_last_token_arrives(llm):
    """A client that sends the next turn (or /v1/cache/save that waits for the disk write) right
    after the last token must find the finished prompt's entry already taken."""
    ids = np.random.default_rng(7).integers(100, 40000, 40).tolist()
    engine = Engine(llm.handle, runner=Runner(llm.model, CHUNK), kv_budget=1 << 28)
    held = []
    submit = engine.submit

    def watching(request, emit):
        def on_token(kind, out):
            if kind == "token" and out.finish_reason:
                held.append(len(engine.prefix))
            emit(kind, out)

        return submit(request, on_token)

    engine.submit = watching
    engine.start(warmup=False)
    try:
        _submit_one(engine, ids, _params(1, 2), None)
    finally:
        engine.stop()
    assert held == [1]


def test_requests_sharing_a_cached_prompt_all_reuse_it(llm):
    """Several requests with the same cached prompt at once each copy the entry while the
    budget has room (the first no longer takes it over, leaving the others to prefill it all),
    or the first one's running copy, which reaches as far."""
    ids = np.random.default_rng(11).integers(100, 40000, 90).tolist()
    engine = Engine(llm.handle, runner=Runner(llm.model, CHUNK), kv_budget=1 << 28)
    engine.start(warmup=False)
    try:
        (first,), _ = _submit_one(engine, ids, _params(1), None)
        got = _submit_many(engine, [ids] * 3, _params(1))
    finally:
        engine.stop()
    assert [c for _, c in got] == [80, 80, 80] and engine.prefix.stats.hits == 3
    assert all(toks == first for toks, _ in got)


def test_requests_arriving_together_copy_the_first_one_s_prefill(llm):
    """Requests sharing a prompt that arrive together, nothing cached: the scheduler prefills
    them one after another, and each after the first copies the whole chunks the first one's
    prefill computed (it is running, not finished), with the bits of a run alone."""
    rng = np.random.default_rng(13)
    ids = rng.integers(100, 40000, 90).tolist()
    other = ids[:40] + rng.integers(100, 40000, 30).tolist()  # shares two chunks
    engine = Engine(llm.handle, runner=Runner(llm.model, CHUNK), kv_budget=1 << 28)
    engine.start(warmup=False)
    try:
        got = _submit_many(engine, [ids, ids, other], _params(1))
    finally:
        engine.stop()
    assert [c for _, c in got] == [0, 80, 32] and engine.prefix.stats.hits == 2
    assert got[0][0] == got[1][0] == solo(llm, Runner(llm.model, CHUNK), ids, _params(1))
    assert got[2][0] == solo(llm, Runner(llm.model, CHUNK), other, _params(1))


def test_a_budget_holding_one_conversation_serves_its_next_turn(llm):
    """Where the budget has no room for a copy of the entry beside it, the next turn takes the
    entry over (no copy) instead of prefilling its whole prompt."""
    rng = np.random.default_rng(12)
    first = rng.integers(100, 40000, 90).tolist()
    budget = llm.model.new_cache(1).bytes_at(160)  # the first's 96 positions, or the second's 125: not both
    engine = Engine(llm.handle, runner=Runner(llm.model, CHUNK), kv_budget=budget)
    engine.start(warmup=False)
    try:
        (out1,), _ = _submit_one(engine, first, _params(1), None)
        second = first + out1 + rng.integers(100, 40000, 23).tolist()
        (out2,), cached = _submit_one(engine, second, _params(2), None)
    finally:
        engine.stop()
    assert cached == 80 and engine.prefix.stats.hits == 1
    assert out2 == solo(llm, Runner(llm.model, CHUNK), second, _params(2))


def test_opted_out_requests_are_not_matched(llm):
    ids = np.random.default_rng(5).integers(100, 40000, 40).tolist()
    engine = Engine(llm.handle, runner=Runner(llm.model, CHUNK), kv_budget=1 << 28)
    submit = engine.submit
    engine.submit = lambda request, emit: submit(replace(request, cacheable=False), emit)  # as unsalted images
    engine.start(warmup=False)
    try:
        (out,), _ = _submit_one(engine, ids, _params(1, 2), None)
        (_,), cached = _submit_one(engine, ids + out, _params(1, 2), None)
    finally:
        engine.stop()
    assert cached == 0 and engine.prefix.stats.hits == 0 and len(engine.prefix) == 0


def test_api_second_chat_turn_reuses_the_first(llm):
    system = "You are a careful assistant. " * 90  # > 512 tokens: one whole default prefill chunk
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    kw = dict(max_tokens=4, temperature=0.0, logprobs=3)
    llm.prefix.clear()
    first = llm.chat(msgs, **kw)["content"]
    turn2 = msgs + [{"role": "assistant", "content": first}, {"role": "user", "content": "And a colour?"}]
    n_prompt = len(llm.prompt_ids(turn2, chat=True))
    cached = list(llm.stream(turn2, chat=True, timings=True, **kw))
    llm.prefix.enabled = False
    try:
        fresh = list(llm.stream(turn2, chat=True, **kw))
    finally:
        llm.prefix.enabled = True
    assert cached[0].cached_tokens == 512 and cached[0].timing["prefill_tokens"] == n_prompt - 512
    assert fresh[0].cached_tokens == 0
    assert [(o.token_id, o.logprob, o.top_logprobs) for o in cached] == [
        (o.token_id, o.logprob, o.top_logprobs) for o in fresh
    ]


def test_an_entry_keeps_its_storage_unless_much_of_it_is_unused():
    """Shrinking a finished cache to its prefix copies all of it: an entry keeps the request's
    arrays (charged at their capacity) while the slack is at most 1/KEEP_SLACK of the prefix,
    and is shrunk (a copy, charged at the prefix) past that."""
    from sparrow.state.prefix import KEEP_SLACK

    pool = KVPool(1 << 24)
    pc = PrefixCache(pool, CHUNK)
    key = prefix_key("f32", None)

    def finished(slack, offset):  # a 64-position prefix in storage with `slack` positions more
        tokens, cache, snaps = _finished(64, tokens=np.arange(64) + offset)
        cache.resize(64 + slack)
        return tokens, cache, snaps

    tokens, kept, snaps = finished(64 // KEEP_SLACK, 0)
    k_before = kept.layers[0].k
    pc.insert(key, tokens, kept, snaps)
    assert kept.layers[0].k is k_before and kept.capacity == 80 and kept.length == 64
    assert pool.used == kept.charged == kept.bytes_at(80)
    tokens, shrunk, snaps = finished(64 // KEEP_SLACK + 1, 500)
    k_before = shrunk.layers[0].k
    pc.insert(key, tokens, shrunk, snaps)
    assert shrunk.layers[0].k is not k_before and shrunk.capacity == 64 and shrunk.length == 64
    assert pool.used == kept.bytes_at(80) + shrunk.bytes_at(64) and len(pc) == 2
