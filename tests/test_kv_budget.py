"""The KV budget: caches grow in pages, requests wait when it is full, running sequences are
preempted and resumed, and every seeded output (tokens and logits bits) equals a solo run's.

The default model runs in-process through the engine; a recording runner keeps the logits of
every position each sequence computes, so a preempted sequence's re-run positions are checked
against the first run too."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sparrow.engine.engine import Engine, EngineBusy
from sparrow.engine.generate import generate_step
from sparrow.engine.runner import Runner
from sparrow.engine.sequence import Sequence
from sparrow.errors import SparrowError
from sparrow.params import SamplingParams
from sparrow.request import GenerationRequest
from sparrow.state.budget import PAGE, KVPool, pages, parse_size
from sparrow.state.cache import KVCache


class Recording(Runner):
    """A Runner that keeps the logits [V] of each (prompt, position) it computes and checks that
    a position computed twice (a preempted sequence rebuilding its KV) gives the same bits."""

    def __init__(self, model, chunk):
        super().__init__(model, chunk)
        self.logits: dict = {}
        self.importance: dict = {}  # prompt -> [L, P] prefill importance when its prefill ended
        self.repeats = 0

    def _keep(self, slot, row):
        key = (tuple(slot.prompt.tolist()), slot.cache.length)
        if key in self.logits:
            self.repeats += 1
            assert self.logits[key].tobytes() == row.tobytes(), f"position {key[1]} changed on re-run"
        self.logits[key] = row.copy()

    def prefill_step(self, slot, end=None):
        out = super().prefill_step(slot, end)
        if out is not None and slot.prefill_done:
            self._keep(slot, out)
            self.importance[tuple(slot.prompt.tolist())] = slot.cache.importance_snapshot()
        return out

    def decode(self, slots, tokens):
        out = super().decode(slots, tokens)  # [B, V]
        for s, row in zip(slots, out):
            self._keep(s, row)
        return out


def solo(llm, runner, ids, params):
    """Tokens of one request run alone through generate_step (the CLI / API path)."""
    seq = Sequence.create(runner, llm.tokenizer, list(ids), params, llm.ctx, llm.kv_dtype)
    return [o.token_id for o in generate_step(runner, seq)]


def run_engine(engine, jobs, timeout=300):
    """Submits (ids, params) jobs at once; returns each one's token ids (or error) when all end."""
    outs = [[] for _ in jobs]
    errors = [None] * len(jobs)
    done = threading.Semaphore(0)

    def emit_for(i):
        def emit(kind, out):
            if kind == "token":
                outs[i].append(out.token_id)
                if out.finish_reason:
                    done.release()
            else:
                errors[i] = out
                done.release()

        return emit

    engine.start(warmup=False)
    try:
        for i, (ids, params) in enumerate(jobs):
            engine.submit(GenerationRequest(ids, params), emit_for(i))
        for _ in jobs:
            assert done.acquire(timeout=timeout), "the engine stalled"
    finally:
        engine.stop()
    return outs, errors


# ---------------------------------------------------------------------- no model needed
def test_parse_size():
    assert parse_size("512M") == 512 << 20 and parse_size("4G") == 4 << 30 and parse_size("1.5k") == 1536
    assert parse_size("300000") == 300000 and parse_size("2GiB") == 2 << 30
    for bad in ("", "lots", "-1G", "0", "4X"):
        with pytest.raises(SparrowError):
            parse_size(bad)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_pool_grows_in_pages_and_keeps_rows(dtype):
    rng = np.random.default_rng(0)
    cache = KVCache(2, 3, 8, 1, dtype)
    pool = KVPool(budget=cache.bytes_at(4 * PAGE, (32, 8)))
    assert pool.grow(cache, 20, ceiling=1000, probe=(32, 8)) and cache.capacity == PAGE
    assert pool.used == cache.bytes_at(PAGE, (32, 8)) == cache.charged
    k = rng.standard_normal((20, 3, 8)).astype(np.float32)
    for i in range(2):
        cache.append(i, 0, k, -k)
    cache.length = 20
    cache.sparse[0].importance[:20] = np.arange(20)
    keys = [cache.layers[i].keys_f32(1, 20).copy() for i in range(2)]
    assert pool.grow(cache, PAGE + 1, ceiling=1000, probe=(32, 8)) and cache.capacity == 2 * PAGE
    assert pool.grow(cache, 2 * PAGE + 1, ceiling=70, probe=(32, 8)) and cache.capacity == 70  # never past the ceiling
    assert [(cache.layers[i].keys_f32(1, 20) == keys[i]).all() for i in range(2)] == [True, True]
    assert (cache.sparse[0].importance[:20] == np.arange(20)).all()
    assert not pool.grow(cache, 5 * PAGE, ceiling=1000, probe=(32, 8))  # over budget: refused, cache untouched
    assert cache.capacity == 70 and pool.used == cache.charged == cache.bytes_at(70, (32, 8))
    pool.release(cache)
    pool.release(cache)  # idempotent
    assert pool.used == 0 and pool.peak == cache.bytes_at(70, (32, 8))
    assert pages(1) == PAGE and pages(PAGE) == PAGE and pages(PAGE + 1) == 2 * PAGE


# ---------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def _jobs(llm, n, n_prompt, max_tokens):
    rng = np.random.default_rng(7)
    jobs = []
    for i in range(n):
        ids = rng.integers(100, 40000, n_prompt).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=100 + i, ignore_eos=True, logprobs=0)
        jobs.append((ids, params))
    return jobs


def test_tiny_budget_preempts_and_every_output_equals_its_solo_run(llm):
    jobs = _jobs(llm, 5, 20, 40)  # 60 positions each: one page at admission, two to finish
    runner = Recording(llm.model, 16)
    per_seq = runner.model.new_cache(1).bytes_at(60)
    engine = Engine(llm.handle, max_batch=8, runner=runner, kv_budget=int(per_seq * 1.6), prefix_cache=False)
    outs, errors = run_engine(engine, jobs)
    assert errors == [None] * len(jobs)
    assert engine.preemptions > 0 and runner.repeats > 0  # sequences were preempted and re-ran positions
    assert engine.pool.peak <= engine.pool.budget and engine.pool.used == 0
    under_load = dict(runner.logits)
    runner.logits.clear()
    for (ids, params), got in zip(jobs, outs):
        assert got == solo(llm, runner, ids, params)
    assert set(under_load) == set(runner.logits)
    assert all(under_load[k].tobytes() == runner.logits[k].tobytes() for k in under_load)


def test_requests_larger_than_the_budget_are_refused_and_the_queue_is_bounded(llm):
    budget = llm.model.new_cache(1).bytes_at(64)
    engine = Engine(llm.handle, runner=Runner(llm.model, 16), kv_budget=budget, max_queue=2)
    with pytest.raises(SparrowError, match="KV budget"):
        engine.submit(GenerationRequest(list(range(100, 140)), SamplingParams(max_tokens=30)), lambda k, o: None)
    ok = [
        engine.submit(GenerationRequest(list(range(100, 110)), SamplingParams(max_tokens=4)), lambda k, o: None)
        for _ in range(2)
    ]
    with pytest.raises(EngineBusy) as e:  # not started: both wait in the queue
        engine.submit(GenerationRequest(list(range(100, 110)), SamplingParams(max_tokens=4)), lambda k, o: None)
    assert e.value.retry_after >= 1 and len(ok) == 2


def test_request_timeout_fails_the_request_and_frees_its_kv(llm):
    engine = Engine(llm.handle, runner=Runner(llm.model, 16), kv_budget=1 << 28, prefix_cache=False, timeout=0.5)
    got = []
    done = threading.Event()

    def emit(kind, out):
        got.append(kind)
        if kind != "token" or out.finish_reason:
            done.set()

    engine.start(warmup=False)
    try:
        engine.submit(GenerationRequest(list(range(100, 140)), SamplingParams(max_tokens=4000, ignore_eos=True)), emit)
        assert done.wait(600)  # a hang guard: a cold numba cache compiles first
    finally:
        engine.stop()
    assert got[-1] == "timeout" and engine.pool.used == 0
