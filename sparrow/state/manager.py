"""Who holds KV memory: admission against the KV budget, growth and preemption of running
sequences, and the prefix cache that finished requests leave their prompts' KV to.

The engine thread calls these between steps; the scheduler decides the order, this decides
whether memory allows it. A request is admitted (its prompt's KV allocated) only when it fits;
a running sequence that cannot grow preempts the newest holder of KV (possibly itself): its KV
is freed and, when it is admitted again, its prompt is prefilled in the same chunks and its
sampled tokens are fed back one decode step each (`Sequence.next_input`), the same forwards
that made them, so its K/V, logits and tokens are bit-identical to an uninterrupted run.

A prompt whose longest reusable prefix is in the disk cache (disk.py) is read off the engine
thread: admission finds the file, charges the request's cache, and a reader thread fills it;
until the read is done the request stays at the head of the queue and admit answers False,
so the engine decodes the running requests meanwhile (with none running it waits for the
read). The cache is then the request's, as a prefix-cache entry taken over is (the same bits
as a fresh prefill: disk.py).
"""

from __future__ import annotations

import logging

from ..errors import SparrowError
from ..params import SparseParams
from .budget import GROW_FRACTION, KVPool, default_budget, format_size, pages, probe_of
from .prefix import Hit, PrefixCache, check_disk_setting, prefix_key, reusable

log = logging.getLogger("sparrow.engine")


class KVManager:
    """Works on the engine's Request objects (engine.py) and its scheduler's queues, duck-typed:
    new_sequence(req) makes a request's Sequence with no cache (the engine's, so this package
    imports nothing of the engine)."""

    def __init__(
        self,
        llm,
        runner,
        scheduler,
        new_sequence,
        kv_budget: int | None = None,
        prefix_cache: bool = True,
        disk_cache=None,
    ):
        self.llm, self.runner, self.scheduler, self.new_sequence = llm, runner, scheduler, new_sequence
        self.pool = KVPool(kv_budget or default_budget())
        check_disk_setting(prefix_cache, disk_cache is not None)
        self.prefix = PrefixCache(self.pool, runner.prefill_chunk, prefix_cache, disk=disk_cache)
        self.pool.evictor = self.prefix.evict_one
        self.preemptions = 0
        self._templates: dict = {}  # kv dtype -> a 1-position cache that prices capacities
        self._reads: dict = {}  # request id -> disk.PendingRead of its prefix, its cache charged

    def kv_bytes(
        self, positions: int, kv_dtype: str | None = None, sparse: SparseParams | None = None, speculative=None
    ) -> int:
        """What a cache of `positions` (rounded up to pages) is charged."""
        t = self._template(kv_dtype or self.llm.kv_dtype)
        return t.bytes_at(pages(positions), probe_of(sparse, speculative, positions, t.head_dim))

    def _template(self, dtype: str):
        """A 1-position cache of kv kind dtype: what prices capacities."""
        t = self._templates.get(dtype)
        if t is None:
            t = self._templates[dtype] = self.runner.model.new_cache(1, dtype)
        return t

    def _copies(self, req) -> list:
        """The selector copies a request's cache is charged for (budget.probe_of): none for
        settings that start past the most positions it can hold."""
        t = self._template(req.kv_dtype or self.llm.kv_dtype)
        return probe_of(req.sparse, req.speculative, len(req.seq.slot.prompt) + req.params.max_tokens, t.head_dim)

    def check_fits(self, n_prompt: int, max_tokens: int, kv_dtype=None, sparse=None, speculative=None) -> None:
        """A request must fit in the budget alone, so that preemption can always make room for it."""
        need = self.kv_bytes(n_prompt + max_tokens, kv_dtype, sparse, speculative)
        if need > self.pool.budget:
            raise SparrowError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) need {format_size(need)} of KV cache, "
                f"more than the server's whole KV budget of {format_size(self.pool.budget)}"
            )

    def key(self, req):
        """prefix.prefix_key of req (None: never share its KV)."""
        seq = req.seq
        has_images = getattr(req, "images", None) or (seq is not None and getattr(seq.slot, "mm", None) is not None)
        if not req.cacheable:
            return None
        return prefix_key(req.kv_dtype or self.llm.kv_dtype, req.sparse, req.cache_salt, bool(has_images))

    def free(self, req) -> None:
        """Drops req's sequence; its KV goes to the prefix cache (which keeps what it can reuse)."""
        self._drop_read(req.id)
        seq, req.seq = req.seq, None
        cache = seq.slot.cache if seq is not None else None
        if cache is None:
            return
        seq.slot.cache = None
        key = self.key(req)
        if key is None:
            self.pool.release(cache)
        else:
            self.prefix.insert(key, seq.slot.prompt, cache, seq.slot.snapshots)

    def admit(self, req) -> bool:
        """Gives req's sequence a KV cache for its prompt (and the tokens it already sampled, if
        it was preempted), from the prefix cache where it can; False if the budget is full."""
        if req.seq is None:
            req.seq = self.new_sequence(req)
        seq, slot = req.seq, req.seq.slot
        if slot.cache is not None:
            return True
        n_out = len(seq.output)
        capacity = self._first_capacity(req, n_out)
        key = self.key(req)
        # Scoring the prompt needs the logits of every position: none of it may come from the cache.
        scoring = getattr(req, "prompt_logprobs", None) is not None and n_out == 0
        if not scoring and key is not None and self.prefix.disk is not None and self.prefix.enabled:
            from_disk = self._from_disk(req, key, capacity)
            if from_disk is not None:
                return from_disk
        for use_prefix in (not scoring, False):  # a pinned entry may be what is in the way: retry without it
            hit = self.prefix.lookup(key, slot.prompt, disk=False) if use_prefix and key is not None else Hit()
            live = self._running_prefix(req, key, hit.tokens) if use_prefix and key is not None else None
            if live is not None:  # a running request's prompt reaches further than any entry
                self.prefix.unpin(hit, False)
                hit = Hit()
            snapshots = hit.entry.snapshots if hit.entry is not None else {}
            cache = self.runner.model.new_cache(1, req.kv_dtype or self.llm.kv_dtype)
            ok = self.pool.resize(cache, capacity, self._copies(req))
            # No room for a copy of the hit: the whole entry becomes this request's where it can
            # (its prompt extends the entry, nobody else copies from it: a chat's next turn in a
            # budget that holds one conversation). Copying while there is room keeps the entry
            # for the requests that share the prefix beside this one.
            taken = None if ok else self.prefix.take(hit)
            if taken is not None:
                slot.snapshots = {b: v for b, v in snapshots.items() if b <= hit.tokens}
                if n_out == 0:
                    req.cached_tokens = hit.tokens
                if not self.pool.resize(taken, capacity, self._copies(req)):
                    self.pool.release(taken)
                    slot.snapshots, req.cached_tokens = {}, 0
                    return False
                slot.cache = taken
                self.prefix.stats.lookups += 1
                return True
            source = (hit.entry.cache, hit.tokens, hit.entry.snapshots) if hit.entry is not None else live
            if ok and source is not None:
                src, n, snaps = source
                cache.copy_prefix(src, n, snaps[n])
                slot.snapshots = {b: v for b, v in snaps.items() if b <= n}
                if n_out == 0:
                    req.cached_tokens = n
                if live is not None:
                    self.prefix.stats.hits += 1
                    self.prefix.stats.cached_tokens += n
            self.prefix.unpin(hit, ok)
            if ok:
                slot.cache = cache
                self.prefix.stats.lookups += key is not None
                return True
            if hit.entry is None:
                return False
        return False

    def _from_disk(self, req, key, capacity: int) -> bool | None:
        """Admission from the disk cache: True when req's cache holds the prefix read from disk;
        False while the read runs on the reader thread (with no request running, it waits for
        it: nothing else would step meanwhile); None when the disk has nothing longer than
        memory or a running request, no room for the cache, or the read failed (logged): admit
        as without the disk."""
        read = self._reads.get(req.id)
        if read is None:
            prompt = req.seq.slot.prompt
            have = self.prefix.longest(key, prompt)
            live = self._running_prefix(req, key, have)
            entry, n = self.prefix.disk.best(key, prompt, self.prefix.chunk, live[1] if live is not None else have)
            if entry is None:
                return None
            cache = self.runner.model.new_cache(1, req.kv_dtype or self.llm.kv_dtype)
            if not self.pool.resize(cache, capacity, self._copies(req)):
                return None
            read = self._reads[req.id] = self.prefix.disk.read_async(entry, n, cache)
        if self.scheduler.running and not read.done.is_set():
            return False
        read.done.wait()
        del self._reads[req.id]
        cache, n, snapshots = read.cache, read.n, read.snapshots
        if snapshots is None:
            self.pool.release(cache)
            return None
        cache.restore_importance(snapshots[n])  # as a taken entry's (PrefixCache.take)
        slot = req.seq.slot
        slot.cache, slot.snapshots = cache, {b: v for b, v in snapshots.items() if b <= n}
        if not req.seq.output:
            req.cached_tokens = n
        st = self.prefix.stats
        st.lookups, st.hits, st.cached_tokens = st.lookups + 1, st.hits + 1, st.cached_tokens + n
        return True

    def _drop_read(self, req_id: int) -> bool:
        """Gives up req's read from disk, if any, and refunds its cache; whether there was one."""
        read = self._reads.pop(req_id, None)
        if read is None:
            return False
        read.stop.set()  # the reader stops before its next chunk
        self.pool.release(read.cache)
        return True

    def _running_prefix(self, req, key, longer_than: int):
        """(cache, positions, snapshots) of the running request whose prompt's prefilled K/V
        shares the longest reusable prefix with req's prompt, if longer than `longer_than`
        positions, else None. Requests that share a prompt and arrive together are prefilled one
        after another (the scheduler admits one prefill at a time), so each after the first
        copies what the first computed instead of prefilling it again: the same whole chunks
        from position 0 over the same tokens and settings (key), so the same bits, as from a
        prefix-cache entry. Positions a request's decode steps wrote are never reused."""
        prompt = req.seq.slot.prompt
        best = None
        for r in self.scheduler.running:
            s = r.seq.slot if r.seq is not None else None
            if s is None or s.cache is None or not s.snapshots or self.key(r) != key:
                continue
            b = reusable(s.prompt[: s.cache.length], s.snapshots, prompt)
            if b > (best[1] if best is not None else longer_than):
                best = (s.cache, b, s.snapshots)
        return best

    def _first_capacity(self, req, n_out: int) -> int:
        # The first growth step is taken now, while the prefill is still to run: growing later
        # copies the whole cache on the engine thread, between two decode steps of every stream
        # (3.4 s at token 34 of a 4K prompt on a Qwen3-1.7B shape, f32 KV, against 134-ms steps).
        # Positions past the prompt are untouched pages until decode writes them.
        n_prompt = len(req.seq.slot.prompt)
        need = n_prompt + max(1, n_out)
        return min(n_prompt + req.params.max_tokens, pages(need + need // GROW_FRACTION))

    def fork(self, parent, child) -> bool:
        """Gives child (another choice of parent's prompt, child.seq made by Sequence.fork with
        no cache) a copy of parent's prompt KV, right after parent's prefill: the prompt is
        prefilled once for all n choices. False (child keeps no cache, to be prefilled again
        like a preempted request) when the budget has no room."""
        src = parent.seq.slot.cache
        cache = self.runner.model.new_cache(1, child.kv_dtype or self.llm.kv_dtype)
        if not self.pool.resize(cache, self._first_capacity(child, 0), self._copies(child)):
            return False
        n = src.length
        cache.copy_prefix(src, n, src.importance_snapshot())
        child.seq.slot.cache = cache
        return True

    def admitted_head(self) -> object | None:
        """The waiting head if it holds KV (part-way through its prefill)."""
        w = self.scheduler.waiting
        if w and w[0].seq is not None and w[0].seq.slot.cache is not None:
            return w[0]
        return None

    def preempt(self, req) -> None:
        """Frees req's KV; it goes back to the front of the queue and resumes exactly."""
        slot = req.seq.slot
        self.pool.release(slot.cache)
        slot.cache, slot.snapshots = None, {}
        head = self.admitted_head()
        self.scheduler.preempt(req, behind_head=head is not None and head is not req)
        self.preemptions += 1
        log.info("request %d preempted (KV budget full); it resumes later", req.id)

    def charge_drafter(self, req) -> bool:
        """Charges the KV cache req's drafter keeps of its own (a draft model's, made at its
        capacity) for as long as req lives; False, nothing charged, when it does not fit
        (speculation is never worth another request's KV)."""
        cache = req.spec.drafter.own_cache
        return cache is None or self.pool.charge_new(cache)

    def release_drafter(self, req) -> None:
        cache = req.spec.drafter.own_cache
        if cache is not None:
            self.pool.release(cache)

    def room_for(self, req, n: int) -> int:
        """How many of n drafted tokens req may verify in its next step: its cache grows to
        hold them where the budget allows without preempting anyone (speculation is never
        worth another request's KV)."""
        cache = req.seq.slot.cache
        ceiling = len(req.seq.slot.prompt) + req.params.max_tokens
        while n > 0 and not self.pool.grow(cache, cache.length + 1 + n, ceiling, self._copies(req)):
            n = min(n - 1, cache.capacity - cache.length - 1)
        return max(0, n)

    def make_room(self, reqs: list) -> list:
        """Grows each cache (oldest request first) by the position its next step writes; a cache
        that cannot grow preempts the newest holder of KV: a head in prefill, then the newest
        running request, which may be itself. Returns the requests that still decode."""
        for r in reqs:
            slot = r.seq.slot if r.seq is not None else None
            if slot is None or slot.cache is None:
                continue
            ceiling = len(slot.prompt) + r.params.max_tokens
            while not self.pool.grow(slot.cache, slot.cache.length + 1, ceiling, self._copies(r)):
                if self._reads and self._drop_read(next(reversed(self._reads))):
                    continue  # the head's read from disk first: it reads again when admitted
                holders = [h for h in self.scheduler.running if h.seq.slot.cache is not None]
                victim = self.admitted_head() or holders[-1]
                if victim is r and len(holders) == 1:  # check_fits makes this unreachable
                    raise SparrowError("the KV budget cannot hold this request")
                self.preempt(victim)
                if victim is r:
                    break
        return [r for r in reqs if r.seq is not None and r.seq.slot.cache is not None]
