"""A hybrid model's sequence state (Qwen3.5): K/V for its full-attention layers and a
fixed-size recurrent state for its Gated DeltaNet layers, with the copies of that state that
prefix reuse, the disk cache and speculative rollback return to. It joins the engine through
KVCache's per-sequence interface only (the package's __init__.py).
"""

import numpy as np

from sparrow.errors import SparrowError

from .cache import KVCache
from .sparse import SNAPSHOT_COPIES, thin_snapshots


class HybridCache(KVCache):
    """A hybrid model's sequence state (Qwen3.5): K/V for its full-attention layers (the
    KVCache part, indexed by full-attention layer), and for each Gated DeltaNet layer a
    fixed-size recurrent state: the convolution's last K-1 inputs conv [Ll, K-1, C] and the
    delta rule's state ssm [Ll, Hv, Dk, Dv], both f32 whatever the KV dtype.

    A recurrent state cannot be cut back like K/V rows, so the cache keeps copies of it at
    positions it may return to (`states`, position -> (conv, ssm)): the prefill's chunk
    boundaries the prefix cache reuses (checkpoint(), thinned by the snapshots' rule) and
    each row of a speculative verification (kernels/deltanet.py: a state has the same bits
    whichever way its tokens were split). truncate / rollback / copy_prefix to a position
    restore its copy, and refuse a position that has none."""

    state_parts = ("conv", "ssm")

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity, dtype, conv_shape, ssm_shape):
        super().__init__(n_layers, n_kv_heads, head_dim, capacity, dtype)
        self.conv = np.zeros(conv_shape, np.float32)  # [Ll, K-1, C]
        self.ssm = np.zeros(ssm_shape, np.float32)  # [Ll, Hv, Dk, Dv]
        self.states: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # chunk boundaries
        self.row_states: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the latest forward's rows

    @property
    def state_nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    @property
    def nbytes(self):
        return super().nbytes + self.state_nbytes * (1 + len(self.states) + len(self.row_states))

    def bytes_at(self, capacity, probe=None):
        # the live state, the boundary copies (at most SNAPSHOT_COPIES) and a verification's rows
        return super().bytes_at(capacity, probe) + self.state_nbytes * (1 + SNAPSHOT_COPIES + 8)

    def _copy(self) -> tuple[np.ndarray, np.ndarray]:
        return self.conv.copy(), self.ssm.copy()

    def state_at(self, n: int) -> tuple:
        """(conv, ssm) after n positions: the live state at the current length, a kept copy
        (a verification row's or a chunk boundary's), zeros at 0; SparrowError where none is
        kept. The live arrays are returned as they are, not copied."""
        if n == self.length:
            return self.conv, self.ssm
        st = self.row_states.get(n) or self.states.get(n)
        if st is not None:
            return st
        if n == 0:
            return np.float32(0), np.float32(0)
        raise SparrowError(f"recurrent state: no copy at position {n} (the state stands at {self.length})")

    def draft_mark(self):
        return self.length, self._copy()

    def drop_draft(self, mark) -> None:
        length, state = mark
        self.row_states[length] = state
        self.truncate(length)

    def checkpoint(self, chunk: int) -> None:
        """Keeps a copy of the state at a prefill chunk boundary (the current length); the
        copies are thinned by the prefix snapshots' rule (thin_snapshots)."""
        self.states[self.length] = self._copy()
        thin_snapshots(self.states, chunk)

    def keep_row(self, position: int, layer: int) -> None:
        """Keeps a copy of Gated DeltaNet layer `layer`'s state after `position` tokens: each
        row of a forward whose cache keeps every row (verification, a draft model's cache);
        the next truncate clears them."""
        st = self.row_states.get(position)
        if st is None:
            st = self.row_states[position] = (np.empty_like(self.conv), np.empty_like(self.ssm))
        st[0][layer], st[1][layer] = self.conv[layer], self.ssm[layer]

    def _restore(self, n: int) -> None:
        if n != self.length:
            conv, ssm = self.state_at(n)
            self.conv[:], self.ssm[:] = conv, ssm
            for b in [b for b in self.states if b > n]:
                del self.states[b]
        self.row_states.clear()

    def truncate(self, n):  # rollback truncates too
        n = max(0, min(int(n), self.length))
        self._restore(n)
        super().truncate(n)

    def states_at(self, bounds) -> dict:
        """Copies of the state at each position of `bounds` (the disk prompt cache's file)."""
        return {b: self._copy() if b == self.length else self.state_at(b) for b in bounds}

    def live_state(self) -> tuple:
        return self.conv, self.ssm

    def load_states(self, states: dict, n: int) -> None:
        """The states read back from a file ({b: (conv, ssm)}), the one at n made live and
        kept, as checkpoint() keeps it at a boundary: a request that takes this cache over
        returns to n when it leaves its prompt to the prefix cache (truncate)."""
        self.states = {b: st for b, st in states.items() if b <= n}
        self.row_states.clear()
        self.conv[:], self.ssm[:] = states[n]

    def copy_prefix(self, src, n, importance):
        conv, ssm = src.state_at(n)
        super().copy_prefix(src, n, importance)
        self.conv[:], self.ssm[:] = conv, ssm
        self.states = {b: (c.copy(), s.copy()) for b, (c, s) in src.states.items() if b <= n}
        self.row_states.clear()
