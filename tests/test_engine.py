"""The engine without a model: scheduling policy, the engine thread's error paths, the runner's
chunking rule. A stub model stands in for the decoder (it predicts "previous token + 1")."""

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from sparrow.engine.engine import Engine
from sparrow.engine.handle import ModelHandle
from sparrow.engine.runner import Runner, Slot
from sparrow.engine.scheduler import Scheduler
from sparrow.params import SamplingParams
from sparrow.request import GenerationRequest
from sparrow.state.cache import KVCache

V = 16


class StubModel:
    def __init__(self, fail_at=None):
        self.config = SimpleNamespace(vocab_size=V)
        self.calls = []  # (start, n_tokens, decode) per segment, in order
        self.fail_at = fail_at

    def new_cache(self, capacity, kv_dtype="f32"):
        cache = KVCache(1, 1, 1, capacity, kv_dtype)  # a real one: the engine's KV budget resizes it
        cache.kv_dtype = kv_dtype
        return cache

    def forward(self, segments, all_logits=False):
        rows = []
        for s in segments:
            self.calls.append((s.start, len(s.tokens), s.decode))
            if self.fail_at is not None and s.start >= self.fail_at:
                raise RuntimeError("stub failure")
            s.cache.length = s.start + len(s.tokens)
            row = np.zeros(V, np.float32)
            row[(int(s.tokens[-1]) + 1) % V] = 1.0
            rows.append(row)
        return np.stack(rows)  # [B, V]


class StubTokenizer:
    eos_token_ids = [V - 1]

    def incremental_decoder(self, skip_special_tokens=True):
        return SimpleNamespace(push=lambda t: f"<{t}>", flush=lambda: "")

    def encode(self, text, add_special_tokens=False):
        return list(range(1, 9))


def _llm(model, ctx=1000, kv="f32"):
    return ModelHandle(Runner(model, prefill_chunk=4), StubTokenizer(), ctx, kv, 1)


# ---------------------------------------------------------------------- scheduler policy
def _req():
    return SimpleNamespace(cancelled=False, finished=False)


def test_scheduler_alternates_prefill_and_decode_and_caps_the_batch():
    s = Scheduler(max_batch=2)
    a, b, c = _req(), _req(), _req()
    s.add([a, b, c])
    step = s.next_step()
    assert (step.kind, step.reqs) == ("prefill", [a])
    assert s.next_step().reqs == [a]  # nothing running yet: keep prefilling the head
    s.prefill_done(a)
    assert (s.running, list(s.waiting)) == ([a], [b, c])
    assert s.next_step().kind == "decode"  # after a prefill step, running requests get a step
    step = s.next_step()
    assert (step.kind, step.reqs) == ("prefill", [b])
    s.prefill_done(b)
    assert [s.next_step().kind for _ in range(3)] == ["decode"] * 3  # batch full: c waits
    a.finished = True
    s.retire()
    assert s.running == [b]
    assert s.next_step().reqs == [c]


def test_scheduler_drops_cancelled_and_skips_finished_prefills():
    s = Scheduler(max_batch=4)
    a, b, c = _req(), _req(), _req()
    s.add([a, b, c])
    b.cancelled = True
    assert s.drop_cancelled() == [b] and list(s.waiting) == [a, c]
    a.finished = True  # e.g. its first token was EOS
    s.prefill_done(a)
    assert s.running == [] and list(s.waiting) == [c]
    s.prefill_failed(c)
    assert not s.has_work
    s.add([b])
    assert s.drain() == [b] and not s.has_work
    with pytest.raises(ValueError):
        Scheduler(0)


# ---------------------------------------------------------------------- runner
def test_runner_prefill_chunks_follow_the_cache_and_end():
    m = StubModel()
    r = Runner(m, prefill_chunk=4)
    slot = r.new_slot(list(range(10)), 20)
    assert r.prefill(slot, end=6) is not None
    assert m.calls == [(0, 4, False), (4, 2, False)]
    m.calls.clear()
    logits = r.prefill(slot)
    assert m.calls == [(6, 4, False)] and slot.prefill_done and int(np.argmax(logits)) == 10
    assert r.prefill(slot) is None  # nothing left to run
    out = r.decode([slot], [3])
    assert m.calls[-1] == (10, 1, True) and out.shape == (1, V)


def test_runner_decode_groups_follow_small_t(monkeypatch):
    from sparrow.kernels import linear

    monkeypatch.setattr(linear, "SMALL_T", 2)
    m = StubModel()
    r = Runner(m)
    slots = [Slot(np.array([1]), m.new_cache(4)) for _ in range(5)]
    for s in slots:
        s.cache.length = 1
    out = r.decode(slots, [1, 2, 3, 4, 5])
    assert [int(np.argmax(row)) for row in out] == [2, 3, 4, 5, 6]
    assert [len(g) for g in r.decode_groups(5)] == [2, 2, 1]
    with pytest.raises(ValueError):
        r.decode(slots, [1])


# ---------------------------------------------------------------------- engine thread
def _run(engine, submits, timeout=30):
    """Submits (ids, params, emit) tuples, runs the engine until every request ended."""
    engine.start(warmup=False)
    try:
        reqs = [engine.submit(GenerationRequest(ids, p), emit) for ids, p, emit in submits]
        deadline = threading.Event()
        for _ in range(int(timeout * 100)):
            if all(r.finished for r in reqs):
                break
            deadline.wait(0.01)
        return reqs
    finally:
        engine.stop()


def test_engine_generates_through_the_runner():
    got = []
    eng = Engine(_llm(StubModel()), max_batch=4)
    reqs = _run(eng, [([1, 2, 3, 4, 5], SamplingParams(max_tokens=3), lambda k, o: got.append((k, o.token_id)))])
    assert reqs[0].finished and got == [("token", 6), ("token", 7), ("token", 8)]


def test_failing_emit_is_logged_and_cancels_only_its_request(caplog):
    good = []

    def bad_emit(kind, out):
        raise RuntimeError("receiver gone")

    eng = Engine(_llm(StubModel()), max_batch=4)
    with caplog.at_level(logging.ERROR, logger="sparrow.engine"):
        reqs = _run(
            eng,
            [
                ([1, 2], SamplingParams(max_tokens=5), bad_emit),
                ([3, 4], SamplingParams(max_tokens=3), lambda k, o: good.append(o.token_id)),
            ],
        )
    assert [r.finished for r in reqs] == [True, True]
    assert reqs[0].cancelled and not reqs[1].cancelled
    assert good == [5, 6, 7]
    recs = [r for r in caplog.records if r.name == "sparrow.engine"]
    assert recs and "receiver gone" in str(recs[0].exc_info[1])


def test_internal_error_fails_the_request_and_is_logged(caplog):
    msgs = []
    eng = Engine(_llm(StubModel(fail_at=3)), max_batch=4)
    with caplog.at_level(logging.ERROR, logger="sparrow.engine"):
        _run(eng, [([1, 2], SamplingParams(max_tokens=5), lambda k, o: msgs.append((k, o)))])
    assert msgs[-1][0] == "error" and "internal error: RuntimeError: stub failure" in msgs[-1][1]
    assert any(r.exc_info for r in caplog.records if r.name == "sparrow.engine")


def test_engine_applies_the_requests_kv_dtype():
    m = StubModel()
    eng = Engine(_llm(m, kv="f32"), max_batch=4)
    seen = []
    free = eng.kv.free

    def freeing(req):  # the cache the request ran with, as it is handed back
        seen.append(req.seq.slot.cache.kv_dtype)
        free(req)

    eng.kv.free = freeing
    eng.start(warmup=False)
    try:
        done = threading.Event()
        eng.submit(GenerationRequest([1, 2], SamplingParams(max_tokens=1), kv_dtype="int8"), lambda k, o: done.set())
        assert done.wait(30)
    finally:
        eng.stop()
    assert seen == ["int8"]
