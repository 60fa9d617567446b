"""The prefix cache: KV of finished requests, reused by later requests that start the same way
(the next turn of a chat, a shared system prompt), so only the rest of a prompt is prefilled.

Exactness: a reused prefix ends on a prefill-chunk boundary and was itself computed by whole
chunks starting at multiples of the chunk size, so the chunks left to run are exactly those a
fresh run would run, over bit-identical K/V. The sparse prefill importance of the reused
positions is restored as it stood at that boundary (later chunks add mass to earlier
positions), from the snapshots the engine takes after each aligned chunk. Positions written by
decode steps are never reused: decode computes K/V through other kernels than prefill.

Entries are keyed by what changes prefill's K/V besides the tokens: the KV dtype, the sparse
prefill settings, and a salt for inputs that are not token ids. A request with images must pass
a salt that names them (a hash of their bytes; Request.cache_salt), or opt out
(Request.cacheable = False): token ids alone do not say which image a placeholder stands for.

Entries are charged to the KV budget like running caches and evicted least recently used when
a charge does not fit (KVPool's evictor). An entry keeps its request's storage, charged at its
capacity, when the positions past its prefix are at most 1/KEEP_SLACK of it: shrinking means
copying the whole cache into new memory (2.1-2.5 s for 4K positions of a Qwen3-1.7B shape's
f32 KV on an AMD EPYC Zen 4 under KVM), which stalled each long request's end and, in the
server, every other stream with it; a short prompt with a large max_tokens is still shrunk,
where the copy is small and the memory saved large.

With a disk cache (disk.py) every entry is also written to disk when it is made, and a
lookup that finds a longer prefix on disk than in memory loads it as a new entry first: after
a restart, in another process, or once memory evicted it. (The engine's admission reads it
off the engine thread instead, into the request's own cache: KVManager.) Positions an entry covers are never
rewritten (a request that takes an entry over only appends past it), which lets the disk
writer read them on its own thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import SparrowError

KEEP_SLACK = 4  # an entry keeps its request's storage while at most 1/4 of its prefix is unused beyond it


@dataclass(eq=False)
class Entry:
    key: str  # prefix_key
    tokens: np.ndarray  # [B] int64: the prefix whose K/V `cache` holds (B = its last boundary)
    cache: object  # KVCache, length B
    snapshots: dict  # boundary b -> [L, b] float32 prefill importance when the prefill stood at b
    pins: int = 0  # lookups copying from it right now: not evictable


@dataclass
class Hit:
    entry: Entry | None = None
    tokens: int = 0  # positions to reuse (a multiple of the chunk size)


@dataclass
class PrefixStats:
    lookups: int = 0  # requests admitted with a key (not admission attempts that waited for room)
    hits: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    entries: int = 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    eq = a[:n] == b[:n]  # [n]
    return n if eq.all() else int(np.argmin(eq))


def reusable(tokens: np.ndarray, snapshots: dict, prompt: np.ndarray) -> int:
    """How many positions of KV computed for `tokens` (prefilled, with importance snapshots at
    the chunk boundaries in `snapshots`) a prompt can reuse: the last boundary within their
    common prefix, leaving at least one prompt token to run (its logits start decoding)."""
    n = min(common_prefix(tokens, prompt), len(prompt) - 1)
    return max((b for b in snapshots if b <= n), default=0)


def prefix_key(kv_dtype: str, sparse, salt=None, has_images: bool = False) -> str | None:
    """What besides the tokens must match for KV to be shared, or None (never share): the KV
    dtype, the sparse prefill settings (decode-only settings leave prefill's K/V alone), and the
    salt naming non-token inputs. Images without a salt are never matched on token ids alone.
    A string (the repr of those), so that the disk cache stores it as it is."""
    if has_images and salt is None:
        return None
    return repr((kv_dtype, sparse if sparse is not None and sparse.prefill else None, salt))


def check_disk_setting(prefix_cache: bool, disk: bool) -> None:
    """A disk cache stores the prefix cache's entries: it needs the prefix cache on."""
    if disk and not prefix_cache:
        raise SparrowError("--prompt-cache keeps the prefix cache's entries: it cannot go with --no-prefix-cache")


class PrefixCache:
    def __init__(self, pool, chunk: int, enabled: bool = True, max_entries: int | None = None, disk=None):
        self.pool = pool
        self.disk = disk  # disk.DiskCache, or None
        self.chunk = chunk
        self.enabled = enabled
        self.max_entries = max_entries  # None: as many as the budget holds
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id -> entry, least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(getattr(e.cache, "charged", 0) for e in self._entries.values())

    def lookup(self, key: str, prompt: np.ndarray, disk: bool = True) -> Hit:
        """The entry sharing the longest reusable prefix with prompt, pinned (call unpin after
        copying). At least one prompt token is always left to run: its logits start decoding.
        disk: a longer prefix in the disk cache is read first, on this thread (the engine's
        admission reads off its thread instead: KVManager, disk.read_async)."""
        if not self.enabled:
            return Hit()
        if disk and self.disk is not None:
            self._load_from_disk(key, prompt)
        with self._lock:
            best = self._longest(key, prompt)
            if best.entry is not None:
                best.entry.pins += 1
                self._entries.move_to_end(id(best.entry))
            return best

    def longest(self, key: str, prompt: np.ndarray) -> int:
        """How many positions of prompt the entries in memory could give (0 when disabled)."""
        if not self.enabled:
            return 0
        with self._lock:
            return self._longest(key, prompt).tokens

    def _longest(self, key, prompt) -> Hit:
        best = Hit()
        for e in self._entries.values():
            if e.key != key:
                continue
            n = reusable(e.tokens, e.snapshots, prompt)
            if n > best.tokens:
                best = Hit(e, n)
        return best

    def _load_from_disk(self, key, prompt) -> None:
        """Adds the disk's entry for prompt when it reaches further than memory's (nothing when
        the budget or the file does not allow it; the disk cache logs a bad file)."""
        with self._lock:
            have = self._longest(key, prompt).tokens
        f, n = self.disk.best(key, prompt, self.chunk, have)
        if f is None:
            return
        cache = self.disk.new_cache(n, f.header["__metadata__"]["kv_dtype"])
        if not self.pool.charge_new(cache):
            return
        snapshots = self.disk.load(f, n, cache)
        if snapshots is None:
            self.pool.release(cache)
            return
        self.add(f.key, f.tokens[:n], cache, snapshots)

    def add(self, key: str, tokens: np.ndarray, cache, snapshots: dict) -> None:
        """Adds a loaded entry (cache charged to the pool, length len(tokens), a chunk multiple)
        as the most recently used."""
        entry = Entry(key, np.asarray(tokens, np.int64).copy(), cache, snapshots)
        with self._lock:
            self._entries[id(entry)] = entry
            self.stats.entries = len(self._entries)
        while self.max_entries is not None and len(self._entries) > self.max_entries and self.evict_one():
            pass

    def seed(self, key, slot) -> int:
        """Copies the longest reusable prefix of slot's prompt into its (empty, allocated) cache;
        returns how many positions it holds now (0: no hit)."""
        hit = self.lookup(key, slot.prompt) if key is not None else Hit()
        self.stats.lookups += key is not None
        if hit.entry is not None:
            e, n = hit.entry, hit.tokens
            slot.cache.copy_prefix(e.cache, n, e.snapshots[n])
            slot.snapshots = {b: v for b, v in e.snapshots.items() if b <= n}
        self.unpin(hit, hit.entry is not None)
        return hit.tokens

    def take(self, hit: Hit):
        """Hands a hit's entry over to its request when the request's prompt extends the whole
        entry (a chat's next turn; its own KV will supersede the entry) and nobody else is
        copying from it: the request keeps the cache instead of a copy, so a budget that holds
        one conversation serves its next turn. Returns the cache (length hit.tokens, importance
        as at that boundary, still charged), or None when the entry must be copied instead."""
        e = hit.entry
        with self._lock:
            if e is None or hit.tokens != len(e.tokens) or e.pins != 1:
                return None
            del self._entries[id(e)]
            self.stats.entries = len(self._entries)
            e.pins = 0
            self.stats.hits += 1
            self.stats.cached_tokens += hit.tokens
        cache, e.cache = e.cache, None
        cache.truncate(hit.tokens)
        cache.restore_importance(e.snapshots[hit.tokens])
        return cache

    def unpin(self, hit: Hit, used: bool) -> None:
        if hit.entry is None:
            return
        with self._lock:
            hit.entry.pins -= 1
            if used:
                self.stats.hits += 1
                self.stats.cached_tokens += hit.tokens

    def insert(self, key: str, prompt: np.ndarray, cache, snapshots: dict) -> None:
        """Takes over a finished request's cache: keeps its longest snapshotted prefix (shrinking
        the cache to it) unless another entry already covers it; otherwise refunds it."""
        b = max((b for b in snapshots if b <= cache.length), default=0)
        if not self.enabled or b == 0:
            self.pool.release(cache)
            return
        tokens = np.asarray(prompt[:b], np.int64)
        with self._lock:
            for e in list(self._entries.values()):
                if e.key != key:
                    continue
                n = common_prefix(e.tokens, tokens)
                if n == b:  # already held (by an entry at least as long)
                    self._entries.move_to_end(id(e))
                    self.pool.release(cache)
                    return
                if n == len(e.tokens) and e.pins == 0:  # the new entry covers this one
                    self._drop(e)
        cache.truncate(b)
        if self.disk is not None:
            self.disk.save(key, tokens, cache, snapshots)
        # Shrinking the storage to b positions copies the whole cache (KVCache.resize), on the
        # thread that serves every stream; keep it when what that would free is small beside it.
        capacity = cache.capacity if cache.capacity - b <= b // KEEP_SLACK else b
        if not self.pool.resize(cache, capacity):  # a refund for the engine's caches; a charge for the API's
            self.pool.release(cache)
            return
        entry = Entry(key, tokens, cache, {k: v for k, v in snapshots.items() if k <= b})
        with self._lock:
            self._entries[id(entry)] = entry
            self.stats.entries = len(self._entries)
        while self.max_entries is not None and len(self._entries) > self.max_entries and self.evict_one():
            pass

    def evict_one(self) -> bool:
        """Frees the least recently used unpinned entry; False if there is none."""
        with self._lock:
            for e in self._entries.values():
                if e.pins == 0:
                    self._drop(e)
                    self.stats.evictions += 1
                    return True
        return False

    def clear(self) -> None:
        while self.evict_one():
            pass

    def _drop(self, e: Entry) -> None:
        del self._entries[id(e)]
        self.stats.entries = len(self._entries)
        self.pool.release(e.cache)
        e.cache = None
