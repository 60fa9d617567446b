"""The engine thread: one thread owns the model and serves queued requests.

`Scheduler` decides what runs next, `Runner` runs it, and this module only moves requests
between client threads and the engine thread: submission, cancellation, shutdown, and the
outputs, which leave through each request's `emit(kind, payload)` callback, called on this
thread (the server turns it into loop.call_soon_threadsafe(queue.put_nowait, ...)).

Determinism under load: prefill chunks depend only on their own sequence, decode forwards are
cut where the kernels stay row-independent (see runner.py), and each request samples with its
own RNG, so a seeded request gives the same tokens alone or beside any other traffic.

Memory: `KVManager` (kv_manager.py) admits requests against the KV budget, grows running
caches and preempts when one cannot grow; finished requests leave their prompt's KV to the
prefix cache (prefix_cache.py), which the budget evicts first.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SparrowError
from ..kernels import set_threads
from ..params import SamplingParams, SparseParams
from .kv_manager import KVManager
from .runner import Runner
from .scheduler import Scheduler
from .sequence import Sequence, StepOutput
from .warmup import SERVER_PATHS, warm

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
    deadline: float | None = None  # time.monotonic() past which it fails with a timeout
    # Prefix-cache hook for inputs that are not token ids (images): a salt naming them (e.g. a hash
    # of their bytes) so only requests with the same inputs share KV; cacheable=False opts out.
    cache_salt: str | None = None
    cacheable: bool = True
    images: list | None = None  # the prompt's preprocessed images (vision.preprocess.PixelImage)
    trace: bool = False  # sparse decode: each output carries its step's block selections (StepOutput.trace)
    id: int = field(default_factory=lambda: next(_ids))
    seq: Sequence | None = None
    cancelled: bool = False  # set by the client side; the engine drops it before its next step
    timed_out: bool = False
    finished: bool = False
    cached_tokens: int = 0  # prompt positions whose KV came from the prefix cache


class EngineBusy(SparrowError):
    """Not taking work now (the queue is full, or the server is draining): retry later."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Engine:
    def __init__(
        self,
        llm,
        max_batch: int = 16,
        runner: Runner | None = None,
        metrics=None,
        kv_budget: int | None = None,
        max_queue: int | None = None,
        prefix_cache: bool = True,
        timeout: float | None = None,
        disk_cache=None,
    ):
        self.llm = llm
        self.runner = runner or llm.runner
        self.scheduler = Scheduler(max_batch)
        self.metrics = metrics
        self.kv = KVManager(llm, self.runner, self.scheduler, kv_budget, prefix_cache, disk_cache)
        self.pool, self.prefix = self.kv.pool, self.kv.prefix
        self.max_queue = max_queue
        self.timeout = timeout  # seconds per request unless it says otherwise
        self._incoming: list[Request] = []
        self._waiting = 0  # queue length as of the engine's last step (read by submit)
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ client side (any thread)
    def start(
        self,
        warmup: bool | tuple[str, ...] = True,
        on_ready: Callable[[], None] | None = None,
        on_warm: Callable[[str, int, int, float], None] | None = None,
    ) -> None:
        """Starts the engine thread. warmup: True runs every path a request may take
        (warmup.SERVER_PATHS) before on_ready, a tuple those paths, False none; on_warm(name,
        i, n, seconds) follows each path's warm-up."""
        if warmup is True:
            warmup = SERVER_PATHS
        self._thread = threading.Thread(
            target=self._main, args=(warmup, on_ready, on_warm), name="sparrow-engine", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sparse: SparseParams | None,
        emit: Callable[[str, object], None],
        kv_dtype: str | None = None,
        constraint=None,
        *,
        timeout: float | None = None,
        cache_salt: str | None = None,
        cacheable: bool = True,
        images: list | None = None,
        trace: bool = False,
    ) -> Request:
        """Queues a request. Raises EngineBusy when the queue is full or the engine is draining,
        SparrowError when prompt + max_tokens cannot fit in the whole KV budget. trace: with
        sparse, each decoded output carries the blocks its step read (StepOutput.trace; the
        step takes the staged path, same bits)."""
        self.kv.check_fits(len(prompt_ids), params.max_tokens, kv_dtype, sparse)
        timeout = timeout if timeout is not None else self.timeout
        deadline = time.monotonic() + timeout if timeout else None
        req = Request(list(prompt_ids), params, sparse, emit, kv_dtype, constraint, deadline, cache_salt, cacheable)
        req.images = images or None
        req.trace = bool(trace and sparse is not None)
        with self._cv:
            if self._draining or self._stop:
                raise EngineBusy("the server is shutting down", retry_after=5)
            if self.max_queue is not None and len(self._incoming) + self._waiting >= self.max_queue:
                raise EngineBusy(f"the request queue is full ({self.max_queue} waiting); retry shortly")
            self._incoming.append(req)
            self._cv.notify()
        return req

    @property
    def preemptions(self) -> int:
        return self.kv.preemptions

    @property
    def idle(self) -> bool:
        return not (self._incoming or self.scheduler.has_work)

    def drain(self, grace: float) -> bool:
        """Stops admitting requests and waits up to `grace` seconds for the ones in flight to
        finish; True if they all did. stop() then fails whatever is left."""
        with self._cv:
            self._draining = True
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if self.idle:
                return True
            time.sleep(0.02)
        return self.idle

    def cancel(self, req: Request) -> None:
        if not req.finished:
            req.cancelled = True
            with self._cv:
                self._cv.notify()

    def alive(self) -> bool:
        """Whether the engine thread is running (a replica's health check)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _main(self, warmup, on_ready, on_warm) -> None:
        set_threads(self.llm.threads)  # numba's thread count is per thread
        if warmup:
            self._warmup(warmup, on_warm)
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
            self._expire()
            self._drop_cancelled()
            self._publish()
            step = sched.next_step()
            if step is not None and step.kind == "prefill":
                if not self._prefill(step.reqs[0]) and sched.running:  # waits for KV: decode instead
                    self._decode(list(sched.running))
            elif step is not None:
                self._decode(step.reqs)
            self._publish()
        with self._cv:
            left = sched.drain() + self._incoming
            self._incoming = []
        for req in left:
            self._fail(req, "the server is shutting down")
        self.prefix.clear()

    def _warmup(self, paths, on_warm) -> None:
        """Runs each path a request may take once (engine/warmup.py), so that no request
        compiles kernels while others stream."""
        try:
            warm(self.runner, self.llm.tokenizer, self.llm.kv_dtype, paths, on_warm)
        except Exception:  # a failed warm-up only costs speed on the first request
            log.exception("warm-up failed")

    def _publish(self) -> None:
        s = self.scheduler
        self._waiting = len(s.waiting)
        if self.metrics is not None:
            self.metrics.set_queue(len(s.running), len(s.waiting) + len(self._incoming))
            st = self.prefix.stats
            self.metrics.set_kv(
                used=self.pool.used,
                budget=self.pool.budget,
                peak=self.pool.peak,
                prefix_bytes=self.prefix.nbytes,
                prefix_entries=len(self.prefix),
                prefix_lookups=st.lookups,
                prefix_hits=st.hits,
                cached_tokens=st.cached_tokens,
                prefix_evictions=st.evictions,
                preemptions=self.preemptions,
                **(self.prefix.disk.metrics() if self.prefix.disk is not None else {}),
            )

    def _expire(self) -> None:
        now = time.monotonic()
        for r in list(self.scheduler.waiting) + self.scheduler.running:
            if r.deadline is not None and now > r.deadline and not r.finished:
                r.timed_out = r.cancelled = True

    def _drop_cancelled(self) -> None:
        gone = self.scheduler.drop_cancelled()
        for r in gone:
            self.kv.free(r)  # frees its KV cache now (or hands it to the prefix cache)
            r.finished = True
            if r.timed_out:
                self._emit(r, "timeout", "the request timed out (the server's --request-timeout)")
        if gone and self.metrics is not None:
            n_timeout = sum(r.timed_out for r in gone)
            self.metrics.add(cancelled=len(gone) - n_timeout, timeouts=n_timeout)

    def _emit(self, req: Request, kind: str, payload) -> None:
        try:
            req.emit(kind, payload)
        except Exception:  # e.g. the receiving event loop is gone: nobody can read this request
            log.exception("request %d: delivering its %s failed; cancelling it", req.id, kind)
            req.cancelled = True

    def _fail(self, req: Request, message: str) -> None:
        req.finished = True
        self.kv.free(req)
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
            self.kv.free(req)

    def _prefill(self, req: Request) -> bool:
        """One prefill chunk of req; False when it waits for KV (nothing ran)."""
        try:
            if not self.kv.admit(req):
                if self.scheduler.running or self.kv.admitted_head() not in (None, req):
                    return False
                raise SparrowError("the KV budget cannot hold this request")  # check_fits makes this unreachable
            seq = req.seq
            slot = seq.slot
            t0, n0 = time.perf_counter(), slot.cache.length
            logits = self.runner.prefill_step(slot)  # [V]
            if self.metrics is not None:
                self.metrics.prefill(slot.cache.length - n0, time.perf_counter() - t0)
            if not slot.prefill_done:
                return True
            if seq.output:  # resumed after a preemption: decode steps feed back what it sampled
                self.scheduler.prefill_done(req)
                return True
            if self.metrics is not None:
                self.metrics.add(prompt_tokens=len(slot.prompt))
            out = seq.accept(logits)
            out.cached_tokens = req.cached_tokens
        except Exception as e:
            self.scheduler.prefill_failed(req)
            self._internal_error([req], e)
            return True
        if out.finish_reason:
            req.finished = True
        self.scheduler.prefill_done(req)
        self._deliver(req, out)
        return True

    def _decode(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        try:
            reqs = self.kv.make_room(reqs)
        except Exception as e:
            self._internal_error(reqs, e)
            self.scheduler.retire()
            return
        groups = self.runner.decode_groups(len(reqs))
        produced = 0
        for g in groups:  # one forward each; a failure fails only its own forward's requests
            batch = [reqs[i] for i in g]
            try:
                live = [r.seq.caught_up for r in batch]  # False: replaying a token it sampled before
                tokens = [r.seq.next_input for r in batch]
                logits = self.runner.decode([r.seq.slot for r in batch], tokens)  # [B, V]
                outs = [(r, r.seq.accept(logits[j])) for j, r in enumerate(batch) if live[j]]
                for r, out in outs:
                    if r.trace:
                        out.trace = list(r.seq.trace)
                for r in batch:  # a replayed step's selections are dropped with it
                    if r.trace:
                        r.seq.trace.clear()
            except Exception as e:
                self._internal_error(batch, e)
                continue
            produced += len(outs)
            for r, out in outs:
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
