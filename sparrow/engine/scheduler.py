"""The engine thread: one thread owns the model and runs continuous batching.

Each step is either one prefill chunk of the oldest waiting sequence (its own forward) or one
batched decode step of every running sequence; the two alternate while both have work, so a
new request starts between decode steps instead of waiting for the batch to drain.

Batch invariance: a decode row must be bit-identical whether it runs alone or beside others.
The linear kernels guarantee that only up to `kernels.linear.SMALL_T` rows per forward (above
it they switch to the prefill path), so a decode step runs its sequences in forwards of at
most SMALL_T rows. Prefill chunks depend only on the sequence itself. Sampling uses each
request's own RNG, so a seeded request gives the same tokens under any load.

Outputs leave through `emit(kind, payload)` callbacks, called on this thread; the server turns
them into loop.call_soon_threadsafe(queue.put_nowait, ...).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..kernels import linear as _linear
from ..kernels import set_threads
from ..params import SparseParams
from .generate import PREFILL_CHUNK, new_sequence
from .sampling import SamplingParams
from .sequence import Sequence

_ids = itertools.count(1)


@dataclass
class Request:
    """One generation in the engine; the caller keeps it to cancel."""

    prompt_ids: list[int]
    params: SamplingParams
    sparse: SparseParams | None
    emit: Callable[[str, object], None]  # ("token", StepOutput) | ("error", message)
    kv_dtype: str | None = None
    id: int = field(default_factory=lambda: next(_ids))
    seq: Sequence | None = None
    cancelled: bool = False  # set by the client side; the engine drops it before its next step
    finished: bool = False


def decode_groups(n: int, rows: int) -> list[range]:
    """Splits n sequences into the fewest forwards of at most `rows`, sizes as even as possible."""
    if n == 0:
        return []
    k = -(-n // max(1, rows))
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


class Engine:
    def __init__(self, llm, max_batch: int = 16, prefill_chunk: int = PREFILL_CHUNK, metrics=None):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.llm = llm
        self.model = llm.model
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics
        self.waiting: deque[Request] = deque()  # queued, or part-way through prefill (head only)
        self.running: list[Request] = []
        self._incoming: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._last_prefill = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ client side (any thread)
    def start(self, warmup: bool = True, on_ready: Callable[[], None] | None = None) -> None:
        self._thread = threading.Thread(target=self._main, args=(warmup, on_ready), name="sparrow-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, sparse: SparseParams | None,
               emit: Callable[[str, object], None], kv_dtype: str | None = None) -> Request:
        req = Request(list(prompt_ids), params, sparse, emit, kv_dtype)
        with self._cv:
            self._incoming.append(req)
            self._cv.notify()
        return req

    def cancel(self, req: Request) -> None:
        if not req.finished:
            req.cancelled = True
            with self._cv:
                self._cv.notify()

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _main(self, warmup: bool, on_ready) -> None:
        set_threads(self.llm.threads)  # numba's thread count is per thread
        if warmup:
            self._warmup()
        if on_ready is not None:
            on_ready()
        while True:
            with self._cv:
                while not (self._stop or self._incoming or self.waiting or self.running):
                    self._cv.wait()
                if self._stop:
                    break
                self.waiting.extend(self._incoming)
                self._incoming.clear()
            self._drop_cancelled()
            self._publish()
            prefill = bool(self.waiting) and len(self.running) < self.max_batch and (
                not self.running or not self._last_prefill)
            if prefill:
                self._prefill_step()
            elif self.running:
                self._decode_step()
            self._last_prefill = prefill
            self._publish()
        for req in list(self.waiting) + self.running + self._incoming:
            self._fail(req, "the server is shutting down")

    def _warmup(self) -> None:
        """One short generation so numba's compiled kernels are loaded before the first request."""
        try:
            tok = self.llm.tokenizer
            # Longer than SMALL_T so that both linear paths (prefill and decode) get loaded.
            ids = (tok.encode("Hello there. " * 8) or [0] * 16)[: 2 * _linear.SMALL_T]
            seq = new_sequence(self.model, tok, ids, SamplingParams(max_tokens=2), len(ids) + 2, self.llm.kv_dtype)
            logits = self.model.forward([seq.prefill_segment(self.prefill_chunk)])
            seq.accept(logits[0])
            self.model.forward([seq.decode_segment()])
        except Exception:  # a failed warm-up only costs speed on the first request
            traceback.print_exc(file=sys.stderr)

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self.running), len(self.waiting) + len(self._incoming))

    def _drop_cancelled(self) -> None:
        gone = [r for r in self.waiting if r.cancelled] + [r for r in self.running if r.cancelled]
        if not gone:
            return
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        self.running = [r for r in self.running if not r.cancelled]
        for r in gone:
            r.seq = None  # frees its KV cache now
            r.finished = True
        if self.metrics is not None:
            self.metrics.add(cancelled=len(gone))

    def _emit(self, req: Request, kind: str, payload) -> None:
        try:
            req.emit(kind, payload)
        except Exception:  # the receiving loop is gone (server shutting down): drop the request
            req.cancelled = True

    def _fail(self, req: Request, message: str) -> None:
        req.finished = True
        req.seq = None
        self._emit(req, "error", message)

    def _deliver(self, req: Request, out) -> None:
        if self.metrics is not None:
            self.metrics.add(generation_tokens=1)
            if out.finish_reason:
                self.metrics.finish(out.finish_reason)
        if out.finish_reason:
            req.finished = True
        self._emit(req, "token", out)
        if req.finished:
            req.seq = None

    def _prefill_step(self) -> None:
        req = self.waiting[0]
        try:
            if req.seq is None:
                req.seq = new_sequence(self.model, self.llm.tokenizer, req.prompt_ids, req.params, self.llm.ctx,
                                       req.kv_dtype or self.llm.kv_dtype, req.sparse)
            seq = req.seq
            t0 = time.perf_counter()
            seg = seq.prefill_segment(self.prefill_chunk)
            logits = self.model.forward([seg])  # [1, V]
            if self.metrics is not None:
                self.metrics.prefill(len(seg.tokens), time.perf_counter() - t0)
            if not seq.prefill_done:
                return
            self.waiting.popleft()
            if self.metrics is not None:
                self.metrics.add(prompt_tokens=len(seq.prompt))
            out = seq.accept(logits[0])
        except Exception as e:
            if self.waiting and self.waiting[0] is req:
                self.waiting.popleft()
            self._internal_error([req], e)
            return
        if not out.finish_reason:
            self.running.append(req)
        self._deliver(req, out)

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        rows = _linear.SMALL_T  # read each step: the kernels' threshold may change
        groups = decode_groups(len(self.running), rows)
        produced = 0
        for g in groups:
            batch = [self.running[i] for i in g]
            try:
                logits = self.model.forward([r.seq.decode_segment() for r in batch])  # [B, V]
                outs = [r.seq.accept(logits[j]) for j, r in enumerate(batch)]
            except Exception as e:
                self._internal_error(batch, e)
                continue
            produced += len(batch)
            for r, out in zip(batch, outs):
                self._deliver(r, out)
        if self.metrics is not None:
            self.metrics.decode(produced, time.perf_counter() - t0, len(groups))
        self.running = [r for r in self.running if not r.finished]

    def _internal_error(self, reqs: list[Request], e: Exception) -> None:
        from ..errors import SparrowError

        if not isinstance(e, SparrowError):
            traceback.print_exc(file=sys.stderr)
        msg = str(e) if isinstance(e, SparrowError) else f"internal error: {type(e).__name__}: {e}"
        for r in reqs:
            self._fail(r, msg)
