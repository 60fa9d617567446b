"""The engine thread: one thread owns the model and serves queued requests.

`Scheduler` decides what runs next, `Runner` runs it, and this module only moves requests
between client threads and the engine thread: submission, cancellation, shutdown, and the
outputs, which leave through each request's `emit(kind, payload)` callback, called on this
thread (the server turns it into loop.call_soon_threadsafe(queue.put_nowait, ...)).

Determinism under load: prefill chunks depend only on their own sequence, decode forwards are
cut where the kernels stay row-independent (see runner.py), and each request samples with its
own RNG, so a seeded request gives the same tokens alone or beside any other traffic.

Memory: `KVManager` (state/manager.py) admits requests against the KV budget, grows running
caches and preempts when one cannot grow; finished requests leave their prompt's KV to the
prefix cache (state/prefix.py), which the budget evicts first.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import SparrowError
from ..kernels.runtime import set_threads
from ..params import SamplingParams, SparseParams, SpeculativeParams
from ..request import GenerationRequest
from ..state.manager import KVManager
from .handle import ModelHandle
from .runner import Runner
from .sampling import prompt_logprobs
from .scheduler import Scheduler
from .sequence import Sequence, StepOutput
from .speculative import Speculator, accept_drafts, check_mtp, make_speculator
from .warmup import SERVER_PATHS, warm

log = logging.getLogger("sparrow.engine")
_ids = itertools.count(1)


@dataclass
class Request:
    """One choice of a generation in the engine; the caller keeps choice 0's to cancel them all.
    Its settings are `request`'s (sparrow/request.py); what changes per choice (the seed, the
    grammar state, speculation turned off for want of KV) and the engine's bookkeeping are here."""

    request: GenerationRequest
    emit: Callable[[str, object], None]  # ("token", StepOutput) | ("error", message)
    params: SamplingParams  # request.sampling, with choice i's seed
    constraint: object | None = None  # structured output: the grammar state Sequence applies (see sequence.py)
    speculative: SpeculativeParams | None = None  # None: plain decoding
    deadline: float | None = None  # time.monotonic() past which it fails with a timeout
    spec: Speculator | None = None  # its drafter and counts, made at its first decode step
    id: int = field(default_factory=lambda: next(_ids))
    seq: Sequence | None = None
    cancelled: bool = False  # set by the client side; the engine drops it before its next step
    timed_out: bool = False
    finished: bool = False
    cached_tokens: int = 0  # prompt positions whose KV came from the prefix cache
    # n choices of one prompt: choice 0 prefills the prompt once; after the prefill it forks
    # choices 1..n-1 (their own Requests, in `family`) from its KV (_fork).
    index: int = 0
    family: list = field(default_factory=list)  # every choice's Request, this one first
    scored: list = field(default_factory=list)  # prompt logprobs so far (StepOutput.prompt_logprobs)

    # the request's settings, as the KV manager (state/manager.py) and the scheduler read them
    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def sparse(self) -> SparseParams | None:
        return self.request.sparse

    @property
    def kv_dtype(self) -> str | None:
        return self.request.kv_dtype

    @property
    def images(self) -> list | None:
        return self.request.images or None

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def cacheable(self) -> bool:
        return self.request.cacheable

    # choice 0's alone: it forks the others, and the prompt is scored and traced once
    @property
    def n(self) -> int:
        return self.request.n if self.index == 0 else 1

    @property
    def prompt_logprobs(self) -> int | None:
        return self.request.prompt_logprobs if self.index == 0 else None

    @property
    def score_only(self) -> bool:
        return self.request.score_only and self.index == 0

    @property
    def trace(self) -> bool:
        return self.request.traced and self.index == 0


class EngineBusy(SparrowError):
    """Not taking work now (the queue is full, or the server is draining): retry later."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Engine:
    def __init__(
        self,
        model: ModelHandle,
        max_batch: int = 16,
        runner: Runner | None = None,
        metrics=None,
        kv_budget: int | None = None,
        max_queue: int | None = None,
        prefix_cache: bool = True,
        timeout: float | None = None,
        disk_cache=None,
    ):
        self.model = model  # api.LLM.handle: runner, tokenizer, context, KV storage, draft models
        self.runner = runner or model.runner
        self.scheduler = Scheduler(max_batch)
        self.metrics = metrics
        self.kv = KVManager(model, self.runner, self.scheduler, self._new_sequence, kv_budget, prefix_cache, disk_cache)
        self.pool, self.prefix = self.kv.pool, self.kv.prefix
        self.max_queue = max_queue
        self.timeout = timeout  # seconds per request unless it says otherwise
        self._incoming: list[Request] = []
        self._waiting = 0  # queue length as of the engine's last step (read by submit)
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
        self._thread: threading.Thread | None = None

    def _new_sequence(self, req: Request) -> Sequence:
        """req's Sequence, with no KV cache yet (the KV manager admits it and gives it one)."""
        return Sequence.create(
            self.runner,
            self.model.tokenizer,
            req.prompt_ids,
            req.params,
            self.model.ctx,
            req.kv_dtype or self.model.kv_dtype,
            req.sparse,
            constraint=req.constraint,
            allocate=False,
            images=req.images,
            trace=req.trace,
            trace_mass=False,  # a live view needs the blocks only: arrays, on the fused path too
        )

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

    def submit(self, request: GenerationRequest, emit: Callable[[str, object], None]) -> Request:
        """Queues a request; its outputs leave through emit(kind, payload), called on the engine
        thread. Raises EngineBusy when the queue is full or the engine is draining,
        SparrowError when prompt + max_tokens cannot fit in the whole KV budget.

        n: choices of the prompt, sharing its prefill; each choice's outputs carry its `index`.
        Choice i samples with seed + i (vLLM's rule): each choice is the answer a request of
        n=1 with that seed gets. The queue limit counts the n choices as n requests.
        prompt_logprobs: the first output carries each prompt token's logprob with that many
        alternatives (the prefix cache is not used for such a prompt: every position's logits
        are needed). score_only: nothing is generated; one output per choice, finish_reason
        "length", no token. trace: with sparse, each decoded output carries the blocks its step
        read (StepOutput.trace: a models.attention.Selections step; same bits)."""
        r, n = request, request.n
        if r.speculative is not None and r.speculative.method == "mtp":
            try:
                check_mtp(self.runner.model)
            except SparrowError as e:
                e.param = "speculative"
                raise
        self.kv.check_fits(len(r.prompt_ids), r.sampling.max_tokens, r.kv_dtype, r.sparse, r.speculative)
        if self.max_queue is not None and n > self.max_queue:
            e = SparrowError(f"n={n} choices exceed the server's queue limit of {self.max_queue} (--max-queue)")
            e.param = "n"
            raise e
        timeout = r.timeout if r.timeout is not None else self.timeout
        deadline = time.monotonic() + timeout if timeout else None
        constraint = r.constraints[0] if r.constraints is not None else None
        req = Request(r, emit, r.sampling, constraint, r.speculative, deadline)
        req.family = [req]
        with self._cv:
            if self._draining or self._stop:
                raise EngineBusy("the server is shutting down", retry_after=5)
            queued = sum(r.n for r in self._incoming) + self._waiting
            if self.max_queue is not None and queued + n > self.max_queue:
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
        """Cancels req and, for n > 1, every choice forked from it."""
        for r in req.family or [req]:  # choices forked later copy req.cancelled
            if not r.finished:
                r.cancelled = True
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
        set_threads(self.model.threads)  # numba's thread count is per thread
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
            warm(self.runner, self.model.tokenizer, self.model.kv_dtype, paths, on_warm)
        except Exception:  # a failed warm-up only costs speed on the first request
            log.exception("warm-up failed")

    def _publish(self) -> None:
        s = self.scheduler
        # queued choices as of this step (read by submit): a request counts its n until it forks
        self._waiting = sum(1 if r.seq is not None and r.seq.output else r.n for r in s.waiting)
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
            self._free(r)  # frees its KV cache now (or hands it to the prefix cache)
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

    def _free(self, req: Request) -> None:
        if req.spec is not None:
            self.kv.release_drafter(req)
            req.spec.release()
        slot = getattr(req.seq, "slot", None)
        if slot is not None and slot.cache is not None:
            slot.cache.hidden = None  # set at its prefill for an MTP drafter that may never have come
        self.kv.free(req)

    def _fail(self, req: Request, message: str) -> None:
        req.finished = True
        self._free(req)
        self._emit(req, "error", message)

    def _deliver(self, req: Request, out: StepOutput) -> None:
        out.index = req.index
        if self.metrics is not None:
            self.metrics.add(generation_tokens=int(out.token_id is not None))
            if out.finish_reason:
                self.metrics.finish(out.finish_reason)
        if out.finish_reason:
            req.finished = True
        if req.finished:  # first: whoever reads the last token finds its prompt in the prefix cache
            self._free(req)
        self._emit(req, "token", out)

    def _prefill(self, req: Request) -> bool:
        """One prefill chunk of req; False when it waits for KV (nothing ran)."""
        try:
            if not self.kv.admit(req):
                if self.scheduler.running or self.kv.admitted_head() not in (None, req):
                    return False
                raise SparrowError("the KV budget cannot hold this request")  # check_fits makes this unreachable
            seq = req.seq
            slot = seq.slot
            if req.speculative is not None and req.speculative.method == "mtp" and slot.cache.hidden is None:
                slot.cache.hidden = {}  # the prompt's hidden rows, for the MTP drafter made after the prefill
            t0, n0 = time.perf_counter(), slot.cache.length
            scoring = req.prompt_logprobs is not None and not seq.output
            rows: list = []
            logits = self.runner.prefill_step(slot, rows=rows) if scoring else self.runner.prefill_step(slot)  # [V]
            if self.metrics is not None:
                self.metrics.prefill(slot.cache.length - n0, time.perf_counter() - t0)
            if scoring:
                self._score(req, n0, rows[0])
            if not slot.prefill_done:
                return True
            if seq.output:  # resumed after a preemption: decode steps feed back what it sampled
                self.scheduler.prefill_done(req)
                return True
            if self.metrics is not None:
                self.metrics.add(prompt_tokens=len(slot.prompt))
            if req.score_only:
                outs = [StepOutput(None, "", finish_reason="length", index=i) for i in range(req.n)]
            else:
                outs = [seq.accept(logits)]
            out = outs[0]
            out.cached_tokens = req.cached_tokens
            if scoring:
                out.prompt_logprobs, req.scored = req.scored, []
        except Exception as e:
            self.scheduler.prefill_failed(req)
            self._internal_error([req], e)
            return True
        if out.finish_reason:
            req.finished = True
        self.scheduler.prefill_done(req)
        forked = self._fork(req, logits) if req.n > 1 and not req.score_only else []
        self._deliver(req, out)
        for extra in outs[1:]:  # score_only: choices 1..n-1 finish as choice 0 does
            self._emit(req, "token", extra)
        for child, child_out in forked:
            self._deliver(child, child_out)
        return True

    def _score(self, req: Request, start: int, rows: np.ndarray) -> None:
        """Adds the logprobs of the prompt tokens that follow positions start.. (rows [T, V])."""
        if start == 0:  # (again, after a preemption part-way through the prefill)
            req.scored = []
        req.scored += prompt_logprobs(req.seq.slot.prompt, start, rows, req.prompt_logprobs)

    def _fork(self, req: Request, logits) -> list[tuple[Request, StepOutput]]:
        """Choices 1..n-1 of req, right after its prefill: each a Request of its own with a copy of
        the prompt's KV, sampling its first token from the same logits. Choices that find no room
        (the batch is full, or the KV budget) wait at the front of the queue without KV and are
        prefilled again when room frees (the same bits: prefill depends only on the prompt)."""
        sched, out = self.scheduler, []
        waiting = 0
        for i in range(1, req.n):
            seed = None if req.params.seed is None else (req.params.seed + i) % 2**64
            constraint = req.request.constraints[i] if req.request.constraints is not None else None
            params = replace(req.params, seed=seed)
            child = Request(req.request, req.emit, params, constraint, req.speculative, req.deadline, index=i)
            child.family = req.family
            req.family.append(child)
            child.cancelled = req.cancelled  # after joining the family: cancel() sees it or this does
            child.seq = req.seq.fork(self.model.tokenizer, child.params, child.constraint, None)
            if len(sched.running) < sched.max_batch and not waiting and self.kv.fork(req, child):
                child_out = child.seq.accept(logits)
                if not child_out.finish_reason:
                    sched.running.append(child)
                out.append((child, child_out))
            else:
                sched.waiting.insert(waiting, child)
                waiting += 1
        return out

    def _decode(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        try:
            reqs = self.kv.make_room(reqs)
        except Exception as e:
            self._internal_error(reqs, e)
            self.scheduler.retire()
            return
        if any(r.speculative is not None for r in reqs):
            return self._decode_speculative(reqs, t0)
        # one forward a group; a failure fails only its own forward's requests
        for g in self.runner.decode_groups(len(reqs)):
            batch = [reqs[i] for i in g]
            outs = []
            try:
                live = [r.seq.caught_up for r in batch]  # False: replaying a token it sampled before
                tokens = [r.seq.next_input for r in batch]
                logits = self.runner.decode([r.seq.slot for r in batch], tokens)  # [B, V]
                outs = [(r, r.seq.accept(logits[j])) for j, r in enumerate(batch) if live[j]]
                for r, out in outs:
                    if r.trace:
                        out.trace = r.seq.trace.take()
                for r in batch:  # a replayed step's selections are dropped with it
                    if r.trace:
                        r.seq.trace.take()
            except Exception as e:
                self._internal_error(batch, e)
                outs = []
            t0 = self._count_decode(t0, len(outs), 1)
            for r, out in outs:
                self._deliver(r, out)
        self.scheduler.retire()

    def _count_decode(self, t0: float, tokens: int, forwards: int, drafted: int = 0, accepted: int = 0) -> float:
        """Adds a forward's tokens and time since t0 to the metrics before its tokens are
        delivered (a scrape right after a response counts its last step); returns now."""
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.decode(tokens, now - t0, forwards)
            if drafted:
                self.metrics.add(spec_drafted_tokens=drafted, spec_accepted_tokens=accepted)
        return now

    def _decode_speculative(self, reqs: list[Request], t0: float) -> None:
        """A decode step in which some requests speculate: each drafts (its budget capped by
        the KV it can grow into without preempting anyone), then every request's rows go
        through Runner.verify in forwards of at most SMALL_T rows, and each samples along its
        rows (speculative.py). The rows are plain decode rows, so requests that do not
        speculate, and those that do, get plain decoding's bits."""
        items = []  # (req, draft, start, live, the token at start)
        for r in reqs:
            try:
                seq = r.seq
                # read before drafting: the sparse drafter moves the cache's length on
                live, start, first, draft = seq.caught_up, seq.slot.cache.length, seq.next_input, []
                if live and r.speculative is not None and r.spec is None:
                    r.spec = make_speculator(self.model, self.runner, r.speculative, seq, seq.slot.cache.dtype)
                    if not self.kv.charge_drafter(r):  # no room for a draft model's cache: decode plainly
                        log.info("request %d: no KV budget for its draft model's cache; not speculating", r.id)
                        r.spec.release()
                        r.spec, r.speculative = None, None
                if live and r.speculative is not None:
                    n = self.kv.room_for(r, r.spec.budget(seq))
                    draft = r.spec.propose(seq, n)
                items.append((r, draft, start, live, first))
            except Exception as e:
                self._internal_error([r], e)
        for group in _row_groups(items, self.runner.decode_groups):
            batch = [it[0] for it in group]
            drafted = accepted = forwards = 0
            done = []
            try:
                tokens = [[first, *d] for _, d, _, _, first in group]
                forwards = len(self.runner.decode_groups(sum(map(len, tokens))))
                logits = self.runner.verify([r.seq.slot for r in batch], tokens, [it[2] for it in group])
                for (r, draft, _, live, _), lg in zip(group, logits):
                    if not live:
                        continue
                    outs, kept = accept_drafts(r.seq, draft, lg)
                    if r.spec is not None and draft:
                        r.spec.settle(r.seq, draft, kept)
                        drafted, accepted = drafted + len(draft), accepted + kept
                    done.append((r, outs))
            except Exception as e:
                self._internal_error(batch, e)
                done = []
            t0 = self._count_decode(t0, sum(len(outs) for _, outs in done), forwards, drafted, accepted)
            for r, outs in done:
                for out in outs:
                    if out.finish_reason and r.spec is not None:
                        out.speculative = r.spec.counts
                    self._deliver(r, out)
        self.scheduler.retire()

    def _internal_error(self, reqs: list[Request], e: Exception) -> None:
        if isinstance(e, SparrowError):
            msg = str(e)
        else:
            log.error("internal error in the engine", exc_info=e)
            msg = f"internal error: {type(e).__name__}: {e}"
        for r in reqs:
            self._fail(r, msg)


def _row_groups(items: list, decode_groups) -> list[list]:
    """Consecutive runs of items (req, draft, ...) whose rows (1 + len(draft) each) fill one
    forward (decode_groups(rows) is a single range) where they can; a larger item goes alone,
    Runner.verify cutting its rows into several forwards."""
    groups, cur, rows = [], [], 0
    for it in items:
        n = 1 + len(it[1])
        if cur and len(decode_groups(rows + n)) > 1:
            groups.append(cur)
            cur, rows = [], 0
        cur.append(it)
        rows += n
    if cur:
        groups.append(cur)
    return groups
