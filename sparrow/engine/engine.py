"""The engine thread: one thread owns the model and serves queued requests.

`Scheduler` decides what runs next, `Runner` runs it, and this module only moves requests
between client threads and the engine thread: submission, cancellation, shutdown, and the
outputs, which leave through each request's `emit(kind, payload)` callback, called on this
thread (the server turns it into loop.call_soon_threadsafe(queue.put_nowait, ...)).

Determinism under load: prefill chunks depend only on their own sequence, decode forwards are
cut where the kernels stay row-independent (see runner.py), and each request samples with its
own RNG, so a seeded request gives the same tokens alone or beside any other traffic.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SparrowError
from ..kernels import linear as _linear
from ..kernels import set_threads
from ..params import SamplingParams, SparseParams
from .runner import Runner
from .scheduler import Scheduler
from .sequence import Sequence, StepOutput

log = logging.getLogger("sparrow.engine")
_ids = itertools.count(1)


@dataclass
class Request:
    """One generation in the engine; the caller keeps it to cancel."""

    prompt_ids: list[int]
    params: SamplingParams
    sparse: SparseParams | None
    emit: Callable[[str, object], None]  # ("token", StepOutput) | ("error", message)
    kv_dtype: str | None = None  # None: the model's default
    constraint: object | None = None  # structured output: the grammar state Sequence applies (see sequence.py)
    id: int = field(default_factory=lambda: next(_ids))
    seq: Sequence | None = None
    cancelled: bool = False  # set by the client side; the engine drops it before its next step
    finished: bool = False


class Engine:
    def __init__(self, llm, max_batch: int = 16, runner: Runner | None = None, metrics=None):
        self.llm = llm
        self.runner = runner or llm.runner
        self.scheduler = Scheduler(max_batch)
        self.metrics = metrics
        self._incoming: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ client side (any thread)
    def start(self, warmup: bool = True, on_ready: Callable[[], None] | None = None) -> None:
        self._thread = threading.Thread(target=self._main, args=(warmup, on_ready), name="sparrow-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sparse: SparseParams | None,
        emit: Callable[[str, object], None],
        kv_dtype: str | None = None,
        constraint=None,
    ) -> Request:
        req = Request(list(prompt_ids), params, sparse, emit, kv_dtype, constraint)
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
        sched = self.scheduler
        while True:
            with self._cv:
                while not (self._stop or self._incoming or sched.has_work):
                    self._cv.wait()
                if self._stop:
                    break
                sched.add(self._incoming)
                self._incoming.clear()
            self._drop_cancelled()
            self._publish()
            step = sched.next_step()
            if step is not None and step.kind == "prefill":
                self._prefill(step.reqs[0])
            elif step is not None:
                self._decode(step.reqs)
            self._publish()
        with self._cv:
            left = sched.drain() + self._incoming
            self._incoming = []
        for req in left:
            self._fail(req, "the server is shutting down")

    def _warmup(self) -> None:
        """A short generation so numba's compiled kernels are loaded before the first request;
        its prompt is longer than SMALL_T rows so that both linear paths (GEMM and the row-wise
        decode kernels) get loaded."""
        try:
            tok = self.llm.tokenizer
            ids = (tok.encode("Hello there. " * 8) or [0] * 16)[: 2 * _linear.SMALL_T]
            seq = Sequence.create(self.runner, tok, ids, SamplingParams(max_tokens=2), len(ids) + 2, self.llm.kv_dtype)
            seq.accept(self.runner.prefill(seq.slot))
            self.runner.decode([seq.slot], [seq.last_token])
        except Exception:  # a failed warm-up only costs speed on the first request
            log.exception("warm-up failed")

    def _publish(self) -> None:
        if self.metrics is not None:
            s = self.scheduler
            self.metrics.set_queue(len(s.running), len(s.waiting) + len(self._incoming))

    def _drop_cancelled(self) -> None:
        gone = self.scheduler.drop_cancelled()
        for r in gone:
            r.seq = None  # frees its KV cache now
            r.finished = True
        if gone and self.metrics is not None:
            self.metrics.add(cancelled=len(gone))

    def _emit(self, req: Request, kind: str, payload) -> None:
        try:
            req.emit(kind, payload)
        except Exception:  # e.g. the receiving event loop is gone: nobody can read this request
            log.exception("request %d: delivering its %s failed; cancelling it", req.id, kind)
            req.cancelled = True

    def _fail(self, req: Request, message: str) -> None:
        req.finished = True
        req.seq = None
        self._emit(req, "error", message)

    def _deliver(self, req: Request, out: StepOutput) -> None:
        if self.metrics is not None:
            self.metrics.add(generation_tokens=1)
            if out.finish_reason:
                self.metrics.finish(out.finish_reason)
        if out.finish_reason:
            req.finished = True
        self._emit(req, "token", out)
        if req.finished:
            req.seq = None

    def _prefill(self, req: Request) -> None:
        try:
            if req.seq is None:
                req.seq = Sequence.create(
                    self.runner,
                    self.llm.tokenizer,
                    req.prompt_ids,
                    req.params,
                    self.llm.ctx,
                    req.kv_dtype or self.llm.kv_dtype,
                    req.sparse,
                    constraint=req.constraint,
                )
            slot = req.seq.slot
            t0, n0 = time.perf_counter(), slot.cache.length
            logits = self.runner.prefill_step(slot)  # [V]
            if self.metrics is not None:
                self.metrics.prefill(slot.cache.length - n0, time.perf_counter() - t0)
            if not slot.prefill_done:
                return
            if self.metrics is not None:
                self.metrics.add(prompt_tokens=len(slot.prompt))
            out = req.seq.accept(logits)
        except Exception as e:
            self.scheduler.prefill_failed(req)
            self._internal_error([req], e)
            return
        if out.finish_reason:
            req.finished = True
        self.scheduler.prefill_done(req)
        self._deliver(req, out)

    def _decode(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        groups = self.runner.decode_groups(len(reqs))
        produced = 0
        for g in groups:  # one forward each; a failure fails only its own forward's requests
            batch = [reqs[i] for i in g]
            try:
                logits = self.runner.decode([r.seq.slot for r in batch], [r.seq.last_token for r in batch])  # [B, V]
                outs = [r.seq.accept(logits[j]) for j, r in enumerate(batch)]
            except Exception as e:
                self._internal_error(batch, e)
                continue
            produced += len(batch)
            for r, out in zip(batch, outs):
                self._deliver(r, out)
        if self.metrics is not None:
            self.metrics.decode(produced, time.perf_counter() - t0, len(groups))
        self.scheduler.retire()

    def _internal_error(self, reqs: list[Request], e: Exception) -> None:
        if isinstance(e, SparrowError):
            msg = str(e)
        else:
            log.error("internal error in the engine", exc_info=e)
            msg = f"internal error: {type(e).__name__}: {e}"
        for r in reqs:
            self._fail(r, msg)
