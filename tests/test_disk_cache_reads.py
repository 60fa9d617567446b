"""A disk prompt-cache hit is read off the engine thread (state/manager.py, disk.read_async):
while one request's prefix is read from the --prompt-cache folder, the running streams keep
stepping at their usual pace, and the request then answers as a fresh prefill would.

The read is slowed on purpose (read_chunks sleeps first), so the test measures the engine's
behaviour, not the disk: before, the engine thread did the read and every stream stopped for
all of it."""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import pytest
from test_disk_cache import CHUNK, _disk

from sparrow.engine.engine import Engine
from sparrow.engine.runner import Runner
from sparrow.params import SamplingParams
from sparrow.request import GenerationRequest
from sparrow.state import disk as dc

SLOW = 2.0  # seconds each read of a file's chunks sleeps first


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


class Stream:
    """One submitted request's outputs, with the time each arrived."""

    def __init__(self, engine, ids, params):
        self.tokens, self.times, self.cached, self.error = [], [], None, None
        self.done = threading.Event()
        self.started = threading.Event()  # its first few tokens are out

        def emit(kind, out):
            if kind != "token":  # e.g. a stream still running at engine.stop()
                self.error = out
                self.done.set()
                return
            self.tokens.append(out.token_id)
            self.times.append(time.perf_counter())
            if out.cached_tokens is not None:
                self.cached = out.cached_tokens
            if len(self.tokens) >= 5:
                self.started.set()
            if out.finish_reason:
                self.done.set()

        self.req = engine.submit(GenerationRequest(ids, params), emit)


def _engine(llm, disk):
    engine = Engine(llm.handle, runner=Runner(llm.model, CHUNK), kv_budget=1 << 28, disk_cache=disk)
    engine.start(warmup=False)
    return engine


@pytest.fixture()
def on_disk(llm, tmp_path):
    """(folder, the prompt whose 5 chunks a first process wrote there)."""
    first = np.random.default_rng(7).integers(100, 40000, 90).tolist()
    disk = _disk(llm, tmp_path)
    engine = _engine(llm, disk)
    try:
        s = Stream(engine, first, SamplingParams(max_tokens=1))
        assert s.done.wait(300)
    finally:
        engine.stop()
    disk.flush()
    return tmp_path, first


@pytest.fixture()
def slow_reads(monkeypatch):
    """Each read of chunks sleeps SLOW seconds first; yields the (start, end) of each read."""
    spans = []
    read = dc.read_chunks

    def slow(*a, **kw):
        t0 = time.perf_counter()
        time.sleep(SLOW)
        try:
            return read(*a, **kw)
        finally:
            spans.append((t0, time.perf_counter()))

    monkeypatch.setattr(dc, "read_chunks", slow)
    return spans


def test_running_streams_keep_stepping_while_a_disk_hit_is_read(llm, on_disk, slow_reads):
    folder, first = on_disk
    second = first[:70] + np.random.default_rng(8).integers(100, 40000, 21).tolist()
    sampled = SamplingParams(max_tokens=4, temperature=0.7, seed=3, ignore_eos=True)
    disk = _disk(llm, folder)  # a new process: memory empty, the first prompt's chunks on disk
    engine = _engine(llm, disk)
    try:
        stream = Stream(engine, list(range(200, 220)), SamplingParams(max_tokens=3000, ignore_eos=True))
        assert stream.started.wait(300)
        hit = Stream(engine, second, sampled)
        assert hit.done.wait(300)
        engine.cancel(stream.req)
    finally:
        engine.stop()
    assert hit.error is None and hit.cached == 64 and disk.stats["hits"] == 1 and len(slow_reads) == 1
    (t0, t1), times = slow_reads[0], stream.times
    before = np.diff([t for t in times if t < t0])
    during = [t for t in times if t0 <= t <= t1]
    # the stream's steps across the whole read: the tokens just before and after it included
    around = np.diff([max(t for t in times if t < t0), *during, min(t for t in times if t > t1)])
    # It kept producing tokens all through the read, at its usual pace (the engine thread never
    # waited on the read: before, one step lasted the whole read).
    assert len(during) >= 5, (len(during), statistics.median(before))
    assert around.max() < SLOW / 2, (around.max(), statistics.median(before))
    assert statistics.median(around) < 3 * statistics.median(before) + 0.01, (around, before)
    print(
        f"\nstep before the read: median {statistics.median(before) * 1e3:.1f} ms; during the {t1 - t0:.2f}-s read:"
        f" {len(during)} tokens, median {statistics.median(around) * 1e3:.1f} ms, longest {around.max() * 1e3:.1f} ms"
    )
    fresh_engine = _engine(llm, None)
    try:
        fresh = Stream(fresh_engine, second, sampled)
        assert fresh.done.wait(300)
    finally:
        fresh_engine.stop()
    assert fresh.cached == 0 and hit.tokens == fresh.tokens


def test_a_request_cancelled_while_its_prefix_is_read_gives_its_memory_back(llm, on_disk, slow_reads):
    folder, first = on_disk
    disk = _disk(llm, folder)
    engine = _engine(llm, disk)
    try:
        stream = Stream(engine, list(range(300, 320)), SamplingParams(max_tokens=3000, ignore_eos=True))
        assert stream.started.wait(300)
        hit = Stream(engine, first + [5], SamplingParams(max_tokens=4))
        deadline = time.monotonic() + 60
        while not engine.kv._reads and time.monotonic() < deadline:  # its read has started
            time.sleep(0.01)
        (read,) = engine.kv._reads.values()
        engine.cancel(hit.req)
        assert read.done.wait(60) and read.stop.is_set() and read.snapshots is None
        engine.cancel(stream.req)
        while not engine.idle and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert not engine.kv._reads and not hit.tokens
    assert engine.pool.used == engine.prefix.nbytes  # only the prefix cache's entries hold KV
    assert disk.stats["hits"] == 0 and disk.stats["rejected"] == 0  # given up, not counted as damaged
