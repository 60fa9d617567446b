"""A sequence's cache (KVCache): every layer's K/V storage (storage.py) and, beside each, what
block-sparse attention keeps about its positions (sparse.py); and the per-sequence interface the
engine, the KV budget and the prefix and disk caches call on any kind of sequence state (the
package's __init__.py is its map). `length` is advanced by the model after each forward.
"""

from collections.abc import Mapping
from contextlib import contextmanager
from types import MappingProxyType

import numpy as np

from sparrow.errors import SparrowError

from .sparse import SNAPSHOT_COPIES, BlockSummaries, KeyCodes, KeyCodes4, ProbeKeys, SparseState
from .storage import layer_cache


class KVCache:
    """All layers of one sequence: layers[i] (K/V storage) and sparse[i] (its SparseState).
    `length` is advanced by the model after each forward."""

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity, dtype="f32"):
        if capacity < 1:
            raise SparrowError(f"KV cache capacity must be >= 1 (got {capacity})")
        self.dtype = dtype
        self.capacity = capacity
        self.head_dim = head_dim
        self.layers = [layer_cache(dtype, n_kv_heads, head_dim, capacity) for _ in range(n_layers)]
        self.sparse = [SparseState(capacity) for _ in range(n_layers)]
        self.length = 0

    def append(self, i, start, k, v):
        """Write float32 k, v [T, KVH, D] of layer i at positions start..start+T-1."""
        self.layers[i].append(start, k, v)
        self.sparse[i].rewritten(start, start + len(k))

    @property
    def nbytes(self):
        """K/V storage and importance (not the probe copies: probe_nbytes)."""
        return sum(layer.nbytes + st.nbytes for layer, st in zip(self.layers, self.sparse))

    @property
    def probe_nbytes(self):
        return sum(st.probe_nbytes for st in self.sparse)

    def truncate(self, n):
        """Drop positions >= n (their K/V are simply overwritten later; the sparse state of
        each layer forgets them now)."""
        n = max(0, min(int(n), self.length))
        self.length = n
        for st in self.sparse:
            st.truncate(n)
        if self.hidden:
            for p in [p for p in self.hidden if p >= n]:
                del self.hidden[p]

    def rollback(self, n):
        """Drops positions >= n as truncate does and zeroes their K/V rows (and scales), so that
        after a speculative step's rejected positions the cache holds exactly what plain
        decoding's holds: the copies sparse decode keeps are cut back to the full blocks below
        n and cleared past them (they are rebuilt from K on their next use)."""
        n = max(0, min(int(n), self.length))
        end = self.length
        self.truncate(n)
        if end > n:
            for layer in self.layers:
                layer.k[:, n:end] = 0
                layer.v[:, n:end] = 0
                if layer.scaled:
                    layer.k_scale[:, n:end] = 0
                    layer.v_scale[:, n:end] = 0
            for st in self.sparse:
                st.clear_copies_past()

    def resize(self, capacity):
        """Moves the cache into storage of `capacity` positions (at least 1), keeping positions
        below min(length, capacity) and their sparse state.

        The kernels take each layer's K/V as one contiguous [KVH, C, D] array, so growing means
        a copy; the KV budget (state/budget.py) grows capacity geometrically in whole pages
        so the copies stay a small share of decode time (measured there)."""
        capacity = max(1, int(capacity))
        n = min(self.length, capacity)
        self.layers = [lc.resized(capacity, n) for lc in self.layers]
        self.sparse = [st.resized(lc, n) for st, lc in zip(self.sparse, self.layers)]
        self.capacity, self.length = capacity, n
        self.__dict__.pop("_fused_lists", None)  # models/fused.py's typed lists name the old arrays

    def bytes_at(self, capacity, probe=None):
        """Bytes this cache takes at `capacity` positions: K/V storage and importance, the
        importance snapshots kept for the prefix cache (at most SNAPSHOT_COPIES importance
        arrays), plus the copies sparse decode makes: the seed's probe keys when probe = (block,
        n_probe), v2's block summaries when probe = (block, "v2"), v3's key codes when (block,
        "v3") or (block, "v3q4"); probe may be a list of such keys (a sparse target and its
        sparse drafter), each copy charged once."""
        kind = type(self.layers[0])
        kvh, d = self.layers[0].n_kv_heads, self.layers[0].head_dim
        per_layer = kind.bytes_at(kvh, d, capacity) + 4 * capacity * (1 + SNAPSHOT_COPIES)
        keys = probe if isinstance(probe, list) else [] if probe is None else [probe]
        for key in dict.fromkeys(keys):  # SparseState keeps one copy per key
            if key[1] == "v2":
                per_layer += BlockSummaries.bytes_at(kvh, d, capacity, key[0])
            elif key[1] == "v3":
                per_layer += KeyCodes.bytes_at(kind, kvh, d, capacity, key[0])
            elif key[1] == "v3q4":
                per_layer += KeyCodes4.bytes_at(kvh, d, capacity, key[0])
            else:
                per_layer += ProbeKeys.bytes_at(kind, kvh, d, capacity, *key)
        return len(self.layers) * per_layer

    def copy_prefix(self, src, n, importance):
        """Positions 0..n-1 from cache `src` (same shape and kind), with the per-layer prefill
        importance [L, n] they had when the prefill stood at n (later chunks add mass to them)."""
        if n > self.capacity:
            raise SparrowError(f"KV cache overflow: {n} positions exceed capacity {self.capacity}")
        for dst, s, st, imp in zip(self.layers, src.layers, self.sparse, importance):
            dst.k[:, :n], dst.v[:, :n] = s.k[:, :n], s.v[:, :n]
            if dst.scaled:
                dst.k_scale[:, :n], dst.v_scale[:, :n] = s.k_scale[:, :n], s.v_scale[:, :n]
            st.truncate(0)
            st.importance[:n] = imp[:n]
        self.length = n

    def restore_importance(self, importance):
        """Sets the prefill importance of positions 0..n-1 to importance [L, n] (and clears the rest)."""
        n = importance.shape[1]
        for st, imp in zip(self.sparse, importance):
            st.importance[:n] = imp
            st.importance[n:] = 0.0

    def importance_snapshot(self):
        """The per-layer prefill importance of positions 0..length-1 as [L, length] float32."""
        return np.stack([st.importance[: self.length] for st in self.sparse])  # [L, n]

    # ------------------------------------------------------------------ the per-sequence interface
    # Beyond K/V (sparrow/state/__init__.py says who calls what). K/V is cut back by truncate /
    # rollback alone; a state that cannot be (HybridCache's) keeps copies at the positions the
    # engine may return to. These defaults are K/V's: nothing to keep, nothing to restore.
    state_parts: tuple[str, ...] = ()  # names of a fixed-size state's arrays (f32), in order
    states: Mapping[int, tuple] = MappingProxyType({})  # prefill boundary -> copies of those arrays
    keep_every_row = False  # the model keeps a copy after each row of this cache (verification)
    # position -> the model's final-normed hidden row there ([E] f32), written by each forward
    # while this is a dict (the `mtp` drafter's, which takes them; models.Decoder.staged_logits
    # and the fused step's FusedDecode._keep_hidden)
    hidden: dict | None = None

    def checkpoint(self, chunk: int) -> None:
        """A prefill chunk boundary at the current length (the runner, after each whole chunk)."""

    @contextmanager
    def keeping_every_row(self):
        """keep_every_row for the forwards inside (the runner's verification: rows it may roll back to)."""
        kept, self.keep_every_row = self.keep_every_row, True
        try:
            yield
        finally:
            self.keep_every_row = kept

    def draft_mark(self):
        """What drafting on this very cache returns to (speculative decoding's sparse drafter):
        None for K/V alone, whose drafted rows the verification rewrites from the same start."""
        return None

    def drop_draft(self, mark) -> None:
        """Back to draft_mark()'s position, with the state it had there (None: nothing to do)."""

    def states_at(self, bounds) -> dict:
        """{b: copies of the state_parts arrays at b} for each b of bounds (the disk cache's
        file, copied when the entry is queued); {} for K/V alone."""
        return {}

    def live_state(self) -> tuple:
        """The state_parts arrays as they are now (no copy); () for K/V alone."""
        return ()

    def load_states(self, states: dict, n: int) -> None:
        """The states read back from a file ({b: arrays}, b <= n), the one at n made live."""
