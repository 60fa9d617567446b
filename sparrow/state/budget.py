"""The KV memory budget: every sequence's cache is charged to one pool, in 32-token pages.

A cache starts at its prompt plus the first growth step below, in whole pages (the KV manager
reserves it at admission, so an answer of up to an eighth of its prompt's length never grows
its cache), and grows as it decodes. Growing means a copy (the kernels take each layer's K/V as
one contiguous [KVH, C, D] array; see storage.py), so capacity grows by the larger of one page
and an eighth of what it holds, rounded up to whole pages and never past what the request can
use (prompt + max_tokens). Copied into memory the process has not touched before, a growth
costs far more than the copy itself: 3.4 s for the 0.9 GB f32 cache of a 4K prompt on a
Qwen3-1.7B shape (AMD EPYC Zen 4 under KVM), against 134-ms decode steps. Measured on the default
model (f32 KV, 2 threads, a busy machine, `python -m sparrow.bench.kv_growth`): at 4104
positions a decode step took 145 ms and one resize copy of the cache 139 ms, so growing one page
at a time would add 3.0% to decode time (more as the cache grows), an eighth at a time 0.19%,
at a cost of at most 1/8 of a cache's bytes charged before they are written. True paging (a
block table read by every kernel) would avoid the copies but change the kernels' inner loops,
which this keeps as they are.

Charges are what the arrays take (KVCache.bytes_at): K/V, int8 scales, prefill importance and,
for sparse requests and sparse drafting, the probe-key copies sparse decode makes; a draft
model's own cache is charged on its own while the request lives (KVManager.charge_drafter).
When a charge does not fit, the pool first asks its evictor (the prefix cache) to free
entries, least recently used first.
"""

from __future__ import annotations

import re
import threading

from ..errors import SparrowError
from .sparse import sparse_at

PAGE = 32  # positions; the sparse attention block size
GROW_FRACTION = 8  # a growing cache adds at least 1/GROW_FRACTION of its capacity
DEFAULT_FRACTION = 0.5  # of MemAvailable when the server starts (docs/serving.md, "Reliability under load")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text, what: str = "KV budget") -> int:
    """'512M', '4G', '1.5G', '300000' (bytes; K/M/G/T are powers of 1024) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise SparrowError(f"{what} must be a size such as 512M or 4G, got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise SparrowError(f"{what} must be positive, got {text!r}")
    return n


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_budget() -> int:
    """DEFAULT_FRACTION of the memory available now (1 GiB where /proc/meminfo is missing)."""
    avail = available_memory()
    return int(avail * DEFAULT_FRACTION) if avail else 1 << 30


def format_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f}{unit}"
    return str(n)


def pages(n: int) -> int:
    """n positions rounded up to whole pages."""
    return -(-int(n) // PAGE) * PAGE


def probe_of(sparse, speculative=None, positions: int | None = None, head_dim: int = 0) -> list:
    """What a request's decode copies beside its KV (KVCache.bytes_at's keys): (block, n_probe)
    for the seed's probe keys, (block, "v2") for v2's block summaries, (block, "v3") and (block,
    "v3q4") for v3's int8 and 4-bit key codes, for its sparse attention and for its sparse
    drafter (speculative 'sparse': the drafter's selector copies are made in the same cache, an
    exact target's too); empty for exact attention without. positions: the most the request
    holds in a cache of head_dim; settings that start at a longer context (auto below its
    crossover) copy nothing (None: count them)."""
    drafter = speculative.sparse if speculative is not None and speculative.method == "sparse" else None
    used = [sp if positions is None else sparse_at(sp, positions, head_dim) for sp in (sparse, drafter)]
    return [sp.copy_key for sp in used if sp is not None]


class KVPool:
    """Bytes charged against a budget. Thread-safe; each cache records its own charge."""

    def __init__(self, budget: int, evictor=None):
        self.budget = int(budget)
        self.used = 0
        self.peak = 0
        self.evictor = evictor  # () -> bool: frees something (an unused prefix entry) if it can
        self._lock = threading.Lock()

    def _take(self, n: int) -> bool:
        while True:
            with self._lock:
                if self.used + n <= self.budget:
                    self.used += n
                    self.peak = max(self.peak, self.used)
                    return True
            if self.evictor is None or not self.evictor():
                return False

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n

    def fits_alone(self, cache_bytes: int) -> bool:
        return cache_bytes <= self.budget

    def grow(self, cache, need: int, ceiling: int, probe=None) -> bool:
        """Makes cache hold at least `need` positions (never more than `ceiling`, the most the
        request can use), charging the growth; False (cache untouched) when it does not fit."""
        if need <= cache.capacity:
            return True
        cap = min(max(ceiling, need), pages(max(need, cache.capacity + cache.capacity // GROW_FRACTION)))
        return self.resize(cache, cap, probe)

    def resize(self, cache, capacity: int, probe=None) -> bool:
        """Moves cache to `capacity` positions, charging or refunding the difference."""
        old = getattr(cache, "charged", 0)
        new = cache.bytes_at(capacity, probe)
        if new > old and not self._take(new - old):
            return False
        if new < old:
            self.give(old - new)
        if capacity != cache.capacity:
            cache.resize(capacity)
        cache.charged = new
        return True

    def charge_new(self, cache, probe=None) -> bool:
        """Charges a cache just made (at its capacity); False if it does not fit."""
        n = cache.bytes_at(cache.capacity, probe)
        if not self._take(n):
            return False
        cache.charged = n
        return True

    def release(self, cache) -> None:
        """Refunds everything cache was charged (idempotent)."""
        n = getattr(cache, "charged", 0)
        if n:
            cache.charged = 0
            self.give(n)
