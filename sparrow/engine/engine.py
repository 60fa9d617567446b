"""The engine thread: one thread owns the model and serves queued requests.

`Scheduler` decides what runs next, `Runner` runs it, and this module only moves requests
between client threads and the engine thread: submission, cancellation, shutdown, and the
outputs, which leave through each request's `emit(kind, payload)` callback, called on this
thread (the server turns it into loop.call_soon_threadsafe(queue.put_nowait, ...)).

Determinism under load: prefill chunks depend only on their own sequence, decode forwards are
cut where the kernels stay row-independent (see runner.py), and each request samples with its
own RNG, so a seeded request gives the same tokens alone or beside any other traffic.

Memory: every cache is charged to one KV budget (kv_budget.py). A request is admitted (its
prompt's KV allocated) only when it fits; a running sequence that cannot grow preempts the
newest holder of KV (possibly itself): its KV is freed and, when it is admitted again, its
prompt is prefilled in the same chunks and its sampled tokens are fed back one decode step each
(`Sequence.next_input`), the same forwards that made them, so its K/V, logits and tokens are
bit-identical to an uninterrupted run. Finished requests leave their prompt's KV to the prefix
cache (prefix_cache.py), which the budget evicts first.
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
from .kv_budget import KVPool, default_budget, format_size, pages, probe_of
from .prefix_cache import Hit, PrefixCache, prefix_key
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
    deadline: float | None = None  # time.monotonic() past which it fails with a timeout
    # Prefix-cache hook for inputs that are not token ids (images): a salt naming them (e.g. a hash
    # of their bytes) so only requests with the same inputs share KV; cacheable=False opts out.
    cache_salt: str | None = None
    cacheable: bool = True
    images: list | None = None  # the prompt's preprocessed images (vision.preprocess.PixelImage)
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
    ):
        self.llm = llm
        self.runner = runner or llm.runner
        self.scheduler = Scheduler(max_batch)
        self.metrics = metrics
        self.pool = KVPool(kv_budget or default_budget())
        self.prefix = PrefixCache(self.pool, self.runner.prefill_chunk, prefix_cache)
        self.pool.evictor = self.prefix.evict_one
        self.max_queue = max_queue
        self.timeout = timeout  # seconds per request unless it says otherwise
        self.preemptions = 0
        self._templates: dict = {}  # kv dtype -> a 1-position cache that prices capacities
        self._incoming: list[Request] = []
        self._waiting = 0  # queue length as of the engine's last step (read by submit)
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
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
        *,
        timeout: float | None = None,
        cache_salt: str | None = None,
        cacheable: bool = True,
        images: list | None = None,
    ) -> Request:
        """Queues a request. Raises EngineBusy when the queue is full or the engine is draining,
        SparrowError when prompt + max_tokens cannot fit in the whole KV budget."""
        self.check_fits(len(prompt_ids), params.max_tokens, kv_dtype, sparse)
        timeout = timeout if timeout is not None else self.timeout
        deadline = time.monotonic() + timeout if timeout else None
        req = Request(list(prompt_ids), params, sparse, emit, kv_dtype, constraint, deadline, cache_salt, cacheable)
        req.images = images or None
        with self._cv:
            if self._draining or self._stop:
                raise EngineBusy("the server is shutting down", retry_after=5)
            if self.max_queue is not None and len(self._incoming) + self._waiting >= self.max_queue:
                raise EngineBusy(f"the request queue is full ({self.max_queue} waiting); retry shortly")
            self._incoming.append(req)
            self._cv.notify()
        return req

    def kv_bytes(self, positions: int, kv_dtype: str | None = None, sparse: SparseParams | None = None) -> int:
        """What a cache of `positions` (rounded up to pages) is charged."""
        dtype = kv_dtype or self.llm.kv_dtype
        t = self._templates.get(dtype)
        if t is None:
            t = self._templates[dtype] = self.runner.model.new_cache(1, dtype)
        return t.bytes_at(pages(positions), probe_of(sparse))

    def check_fits(self, n_prompt: int, max_tokens: int, kv_dtype=None, sparse=None) -> None:
        """A request must fit in the budget alone, so that preemption can always make room for it."""
        need = self.kv_bytes(n_prompt + max_tokens, kv_dtype, sparse)
        if need > self.pool.budget:
            raise SparrowError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) need {format_size(need)} of KV cache, "
                f"more than the server's whole KV budget of {format_size(self.pool.budget)}"
            )

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

    def _prefix_key(self, req: Request):
        """prefix_cache.prefix_key of req (None: never share its KV)."""
        seq = req.seq
        has_images = getattr(req, "images", None) or (seq is not None and getattr(seq.slot, "mm", None) is not None)
        if not req.cacheable:
            return None
        return prefix_key(req.kv_dtype or self.llm.kv_dtype, req.sparse, req.cache_salt, bool(has_images))

    def _free(self, req: Request) -> None:
        """Drops req's sequence; its KV goes to the prefix cache (which keeps what it can reuse)."""
        seq, req.seq = req.seq, None
        cache = seq.slot.cache if seq is not None else None
        if cache is None:
            return
        seq.slot.cache = None
        key = self._prefix_key(req)
        if key is None:
            self.pool.release(cache)
        else:
            self.prefix.insert(key, seq.slot.prompt, cache, seq.slot.snapshots)

    def _emit(self, req: Request, kind: str, payload) -> None:
        try:
            req.emit(kind, payload)
        except Exception:  # e.g. the receiving event loop is gone: nobody can read this request
            log.exception("request %d: delivering its %s failed; cancelling it", req.id, kind)
            req.cancelled = True

    def _fail(self, req: Request, message: str) -> None:
        req.finished = True
        self._free(req)
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
            self._free(req)

    def _admit(self, req: Request) -> bool:
        """Gives req's sequence a KV cache for its prompt (and the tokens it already sampled, if
        it was preempted), from the prefix cache where it can; False if the budget is full."""
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
                allocate=False,
                images=req.images,
            )
        seq, slot = req.seq, req.seq.slot
        if slot.cache is not None:
            return True
        n_prompt, n_out = len(slot.prompt), len(seq.output)
        capacity = min(n_prompt + req.params.max_tokens, pages(n_prompt + max(1, n_out)))
        key = self._prefix_key(req)
        for use_prefix in (True, False):  # a pinned entry may be what is in the way: retry without it
            hit = self.prefix.lookup(key, slot.prompt) if use_prefix and key is not None else Hit()
            snapshots = hit.entry.snapshots if hit.entry is not None else {}
            cache = self.prefix.take(hit)
            if cache is not None:  # the whole entry is this request's now (no copy)
                slot.snapshots = {b: v for b, v in snapshots.items() if b <= hit.tokens}
                if n_out == 0:
                    req.cached_tokens = hit.tokens
                if not self.pool.resize(cache, capacity, probe_of(req.sparse)):
                    self.pool.release(cache)
                    slot.snapshots, req.cached_tokens = {}, 0
                    return False
                slot.cache = cache
                self.prefix.stats.lookups += 1
                return True
            cache = self.runner.model.new_cache(1, req.kv_dtype or self.llm.kv_dtype)
            ok = self.pool.resize(cache, capacity, probe_of(req.sparse))
            if ok and hit.entry is not None:
                e, n = hit.entry, hit.tokens
                cache.copy_prefix(e.cache, n, e.snapshots[n])
                slot.snapshots = {b: v for b, v in e.snapshots.items() if b <= n}
                if n_out == 0:
                    req.cached_tokens = n
            self.prefix.unpin(hit, ok)
            if ok:
                slot.cache = cache
                self.prefix.stats.lookups += key is not None
                return True
            if hit.entry is None:
                return False
        return False

    def _prefill(self, req: Request) -> bool:
        """One prefill chunk of req; False when it waits for KV (nothing ran)."""
        try:
            if not self._admit(req):
                if self.scheduler.running or self._admitted_head() not in (None, req):
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

    def _admitted_head(self) -> Request | None:
        """The waiting head if it holds KV (part-way through its prefill)."""
        w = self.scheduler.waiting
        if w and w[0].seq is not None and w[0].seq.slot.cache is not None:
            return w[0]
        return None

    def _preempt(self, req: Request) -> None:
        """Frees req's KV; it goes back to the front of the queue and resumes exactly."""
        slot = req.seq.slot
        self.pool.release(slot.cache)
        slot.cache, slot.snapshots = None, {}
        head = self._admitted_head()
        self.scheduler.preempt(req, behind_head=head is not None and head is not req)
        self.preemptions += 1
        log.info("request %d preempted (KV budget full); it resumes later", req.id)

    def _make_room(self, reqs: list[Request]) -> list[Request]:
        """Grows each cache (oldest request first) by the position its next step writes; a cache
        that cannot grow preempts the newest holder of KV: a head in prefill, then the newest
        running request, which may be itself. Returns the requests that still decode."""
        for r in reqs:
            slot = r.seq.slot if r.seq is not None else None
            if slot is None or slot.cache is None:
                continue
            ceiling = len(slot.prompt) + r.params.max_tokens
            while not self.pool.grow(slot.cache, slot.cache.length + 1, ceiling, probe_of(r.sparse)):
                holders = [h for h in self.scheduler.running if h.seq.slot.cache is not None]
                victim = self._admitted_head() or holders[-1]
                if victim is r and len(holders) == 1:  # check_fits makes this unreachable
                    raise SparrowError("the KV budget cannot hold this request")
                self._preempt(victim)
                if victim is r:
                    break
        return [r for r in reqs if r.seq is not None and r.seq.slot.cache is not None]

    def _decode(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        try:
            reqs = self._make_room(reqs)
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
