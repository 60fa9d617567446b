"""Per-sequence KV cache: one storage class per kind behind one interface, and beside each
layer's storage the state block-sparse attention keeps about its positions (SparseState).

Layout per layer: k, v are [KVH, capacity, D] so one KV head's keys are contiguous rows (the
decode kernel streams them; prefill slices [:S] and hands them to BLAS).

Storage kinds (LayerCache subclasses):
- F32Layer: float32.
- F16Layer: IEEE half stored as uint16 bit patterns (numba has no float16 type on the CPU; the
  kernels widen the bits with an LLVM fpext). `layer.k.view(np.float16)` gives the values.
- Int8Layer: symmetric per (head, position) quantisation: scale = absmax/127 over D,
  q = rint(x / scale) in [-127, 127]; an all-zero row gets scale 0 and codes 0.

Every kind hands the attention kernels the same things: k, v, k_scale, v_scale, `scaled`
(whether dots and values take the per-row scales) and `query()`, the query in the form its
dots need. Float kinds have no scales; their k_scale / v_scale are one [KVH, 1] placeholder,
made once, that the kernels never read.
"""

import numpy as np

from sparrow.errors import SparrowError
from sparrow.kernels.elementwise import quantize_int8_rows, store_f16_rows
from sparrow.params import KV_DTYPES


def quantize_int8(x):
    """x float32 [..., D] -> (codes int8 [..., D], scale float32 [...]) with scale = absmax/127."""
    return quantize_int8_rows(x)


class LayerCache:
    """K/V rows of one layer of one sequence; subclasses fix the storage kind."""

    kind = ""  # "f32" | "f16" | "int8"
    storage = np.float32  # element type of k, v
    scaled = False  # rows carry per-(head, position) scales

    def __init__(self, n_kv_heads, head_dim, capacity):
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        shape = (n_kv_heads, capacity, head_dim)
        self.k = np.zeros(shape, dtype=self.storage)  # [KVH, C, D]
        self.v = np.zeros(shape, dtype=self.storage)  # [KVH, C, D]
        # placeholder for the kernels' scale arguments (Int8Layer replaces it)
        self.k_scale = self.v_scale = np.zeros((n_kv_heads, 1), dtype=np.float32)  # [KVH, 1]

    def append(self, start, k, v):
        """Write float32 k, v [T, KVH, D] at positions start..start+T-1 (storage only:
        KVCache.append also clears the sparse state of the rewritten positions)."""
        k = np.asarray(k, dtype=np.float32)
        v = np.asarray(v, dtype=np.float32)
        T = k.shape[0]
        if k.shape != (T, self.n_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"append expects [T, {self.n_kv_heads}, {self.head_dim}], got {k.shape} / {v.shape}")
        if start < 0 or start + T > self.capacity:
            raise SparrowError(f"KV cache overflow: positions {start}..{start + T - 1} exceed capacity {self.capacity}")
        self._store(self.k, self.k_scale, start, k.transpose(1, 0, 2))  # [KVH, T, D]
        self._store(self.v, self.v_scale, start, v.transpose(1, 0, 2))  # [KVH, T, D]

    def _store(self, dst, scale, start, x):
        """Encode x float32 [KVH, T, D] into dst[:, start:start+T] (and its scales)."""
        raise NotImplementedError

    def _rows_f32(self, x, scale, kh, n):
        """Rows 0..n-1 of KV head kh of x (k or v) as float32 [n, D]."""
        raise NotImplementedError

    def keys_f32(self, kh, n):
        """Dequantised keys of KV head kh for positions 0..n-1 as float32 [n, D]."""
        return self._rows_f32(self.k, self.k_scale, kh, n)

    def values_f32(self, kh, n):
        """Dequantised values of KV head kh for positions 0..n-1 as float32 [n, D]."""
        return self._rows_f32(self.v, self.v_scale, kh, n)

    def query(self, q, scale):
        """q float32 [..., H, D] -> (probe queries, attention queries, per-head scales [..., H])
        as the attention kernels take them. Float kinds: q for the probes (the spec's raw
        q . K) and q * scale for the scores, which saves a multiply per key; no scales."""
        return q, q * np.float32(scale), np.zeros(q.shape[:-1], np.float32)

    @property
    def nbytes(self):
        n = self.k.nbytes + self.v.nbytes
        if self.scaled:
            n += self.k_scale.nbytes + self.v_scale.nbytes
        return n

    def resized(self, capacity, n):
        """A layer of the same kind with `capacity` positions holding this one's rows 0..n-1."""
        out = type(self)(self.n_kv_heads, self.head_dim, capacity)
        out.k[:, :n], out.v[:, :n] = self.k[:, :n], self.v[:, :n]
        if self.scaled:
            out.k_scale[:, :n], out.v_scale[:, :n] = self.k_scale[:, :n], self.v_scale[:, :n]
        return out

    @classmethod
    def bytes_at(cls, n_kv_heads, head_dim, capacity):
        """nbytes of a layer of this kind with `capacity` positions."""
        per_row = 2 * head_dim * np.dtype(cls.storage).itemsize + (8 if cls.scaled else 0)
        return n_kv_heads * capacity * per_row


class F32Layer(LayerCache):
    kind, storage = "f32", np.float32

    def _store(self, dst, scale, start, x):
        dst[:, start : start + x.shape[1]] = x

    def _rows_f32(self, x, scale, kh, n):
        return x[kh, :n]  # a view, no copy


class F16Layer(LayerCache):
    kind, storage = "f16", np.uint16

    def _store(self, dst, scale, start, x):
        store_f16_rows(x, dst, start)

    def _rows_f32(self, x, scale, kh, n):
        return x[kh, :n].view(np.float16).astype(np.float32)


class Int8Layer(LayerCache):
    kind, storage, scaled = "int8", np.int8, True

    def __init__(self, n_kv_heads, head_dim, capacity):
        super().__init__(n_kv_heads, head_dim, capacity)
        self.k_scale = np.zeros((n_kv_heads, capacity), dtype=np.float32)  # [KVH, C]
        self.v_scale = np.zeros((n_kv_heads, capacity), dtype=np.float32)  # [KVH, C]

    def _store(self, dst, scale, start, x):
        end = start + x.shape[1]
        dst[:, start:end], scale[:, start:end] = quantize_int8(x)

    def _rows_f32(self, x, scale, kh, n):
        return x[kh, :n].astype(np.float32) * scale[kh, :n, None]

    def query(self, q, scale):
        """The int8 codes of q (same absmax/127 rule as the cache) as float32, exact small
        integers, so every dot is the exact int8 x int8 dot, for both uses; the kernels apply
        the query, key and softmax scales."""
        codes, qscale = quantize_int8(q)  # [..., H, D], [..., H]
        codes = codes.astype(np.float32)
        return codes, codes, qscale


LAYER_KINDS = {cls.kind: cls for cls in (F32Layer, F16Layer, Int8Layer)}


def layer_cache(kind, n_kv_heads, head_dim, capacity):
    """A LayerCache of the named storage kind ("f32", "f16", "int8")."""
    if kind not in LAYER_KINDS:
        raise SparrowError(f"unknown KV cache dtype {kind!r} (choose from {', '.join(KV_DTYPES)})")
    return LAYER_KINDS[kind](n_kv_heads, head_dim, capacity)


class SparseState:
    """What block-sparse attention keeps about one layer's positions, beside its LayerCache:
    the prefill importance of each position and the probe-key copies sparse decode reads.
    Both describe cache contents, so rewriting or dropping positions clears them there."""

    def __init__(self, capacity):
        self.importance = np.zeros(capacity, dtype=np.float32)  # [C]
        self._probes = {}  # (block, n_probe) -> ProbeKeys

    def rewritten(self, start, end):
        """Positions start..end-1 hold new K/V: their prefill mass and probe copies are stale."""
        self.importance[start:end] = 0.0
        self._forget_blocks_from(start)

    def truncate(self, n):
        """Positions >= n are dropped."""
        self.importance[n:] = 0.0
        self._forget_blocks_from(n)

    def clear_copies_past(self):
        """Zeroes each copy's rows past its valid blocks (KVCache.rollback)."""
        for p in self._probes.values():
            p.rows[:, p.blocks * p.per_block :] = 0
            p.scale[:, p.blocks * p.per_block :] = 0

    def _forget_blocks_from(self, pos):
        for p in self._probes.values():
            p.blocks = min(p.blocks, pos // p.block)

    def probe_keys(self, layer, block, n_probe, seq_len):
        """(copy, n): the probe keys of layer's full blocks copied contiguously (ProbeKeys), and
        how many of its blocks a decode over positions 0..seq_len-1 may read: only full blocks
        below seq_len (the copy may hold more after a decode at a longer seq_len).

        Sparse decode reads n_probe of every block's keys each step; straight from K that is a
        strided walk (one row in four by default) that ran ~5x slower per byte than a
        contiguous read here. The copy costs n_probe / block of K's bytes and is filled once
        per block, on first use."""
        p = self._probes.get((block, n_probe))
        if p is None:
            p = self._probes[(block, n_probe)] = ProbeKeys(layer, block, n_probe)
        full = seq_len // block
        p.extend(layer, full)
        return p, min(p.blocks, full)

    def copy_for(self, layer, sparse, seq_len):
        """(copy, n) of what `sparse`'s selector reads: probe_keys for the seed, block_summaries
        for v2 (SparseParams.copy_key names it)."""
        block, what = sparse.copy_key
        if what == "v2":
            return self.block_summaries(layer, block, seq_len)
        return self.probe_keys(layer, block, what, seq_len)

    def block_summaries(self, layer, block, seq_len):
        """(summaries, n): v2's per-block key mean and variance of layer's full blocks
        (BlockSummaries), and how many of them a decode over 0..seq_len-1 may read. Kept
        beside the probe copies (same invalidation), filled once per block on first use."""
        p = self._probes.get((block, "v2"))
        if p is None:
            p = self._probes[(block, "v2")] = BlockSummaries(layer, block)
        full = seq_len // block
        p.extend(layer, full)
        return p, min(p.blocks, full)

    @property
    def nbytes(self):
        return self.importance.nbytes

    @property
    def probe_nbytes(self):
        """Bytes of the probe-key copies and block summaries sparse decode made."""
        return sum(p.nbytes for p in self._probes.values())

    def resized(self, layer, n):
        """The state for `layer` (this state's layer resized) keeping positions 0..n-1."""
        out = SparseState(layer.capacity)
        out.importance[:n] = self.importance[:n]
        for key, p in self._probes.items():
            out._probes[key] = p.resized(layer, min(p.blocks, n // p.block))
        return out


class ProbeKeys:
    """Probe rows of full blocks: rows[kh, b * per_block + j] = K[kh, b * block + j * step]
    (step = max(1, block // n_probe), the spec's probe positions of a full block), with their
    int8 scales; the first `blocks` full blocks are valid."""

    def __init__(self, layer, block, n_probe):
        self.block, self.n_probe, self.step = block, n_probe, max(1, block // n_probe)
        self.per_block = len(range(0, block, self.step))
        n = (layer.capacity // block) * self.per_block
        self.rows = np.zeros((layer.n_kv_heads, n, layer.head_dim), layer.k.dtype)  # [KVH, n, D]
        self.scale = np.zeros((layer.n_kv_heads, n if layer.scaled else 1), np.float32)  # [KVH, n | 1]
        self.blocks = 0

    def extend(self, layer, full_blocks):
        """Copy blocks blocks..full_blocks-1 from layer (nothing if already there)."""
        if full_blocks <= self.blocks:
            return
        b0, b1 = self.blocks, full_blocks
        pos = (np.arange(b0, b1)[:, None] * self.block + np.arange(0, self.block, self.step)).ravel()
        r0, r1 = b0 * self.per_block, b1 * self.per_block
        self.rows[:, r0:r1] = layer.k[:, pos]
        if layer.scaled:
            self.scale[:, r0:r1] = layer.k_scale[:, pos]
        self.blocks = full_blocks

    @property
    def nbytes(self):
        return self.rows.nbytes + self.scale.nbytes

    def resized(self, layer, blocks):
        """A copy for `layer` (resized) keeping the first `blocks` full blocks."""
        out = ProbeKeys(layer, self.block, self.n_probe)
        blocks = min(blocks, out.rows.shape[1] // self.per_block)
        r = blocks * self.per_block
        out.rows[:, :r] = self.rows[:, :r]
        if layer.scaled:
            out.scale[:, :r] = self.scale[:, :r]
        out.blocks = blocks
        return out

    @staticmethod
    def bytes_at(layer_kind, n_kv_heads, head_dim, capacity, block, n_probe):
        """nbytes of the copy ProbeKeys(layer, block, n_probe) makes for a layer of `capacity`."""
        step = max(1, block // n_probe)
        n = (capacity // block) * len(range(0, block, step))
        row = head_dim * np.dtype(layer_kind.storage).itemsize
        return n_kv_heads * (n * row + 4 * (n if layer_kind.scaled else 1))


class BlockSummaries:
    """v2's block summaries: rows[kh, b] = [mean, variance] of the keys of full block b,
    float16 bits [2D] (sparse_select.summarise_block), so a block's score is one 2D-wide dot;
    the first `blocks` full blocks are valid. 2 rows of f16 per block: 1/32 of an f32 K and
    1/8 of an int8 one, where the seed's probe copy is 1/4 of K's bytes."""

    per_block = 1

    def __init__(self, layer, block):
        self.block = block
        n = layer.capacity // block
        self.rows = np.zeros((layer.n_kv_heads, n, 2 * layer.head_dim), np.uint16)  # [KVH, n, 2D] f16 bits
        self.scale = np.zeros((layer.n_kv_heads, 1), np.float32)  # [KVH, 1], never read
        self.blocks = 0

    def extend(self, layer, full_blocks):
        """Summarise blocks blocks..full_blocks-1 of layer (nothing if already there)."""
        from sparrow.kernels.attention.select import summarise_blocks
        from sparrow.kernels.matmul.widen import F16_LUT

        if full_blocks > self.blocks:
            summarise_blocks(layer.k, layer.k_scale, F16_LUT, self.block, self.blocks, full_blocks, self.rows)
            self.blocks = full_blocks

    @property
    def nbytes(self):
        return self.rows.nbytes

    @staticmethod
    def bytes_at(n_kv_heads, head_dim, capacity, block):
        """nbytes of BlockSummaries(layer, block) for a layer of `capacity`."""
        return n_kv_heads * (capacity // block) * 2 * head_dim * 2

    def resized(self, layer, blocks):
        """A copy for `layer` (resized) keeping the first `blocks` full blocks."""
        out = BlockSummaries(layer, self.block)
        blocks = min(blocks, out.rows.shape[1])
        out.rows[:, :blocks] = self.rows[:, :blocks]
        out.blocks = blocks
        return out


# Prefill importance snapshots (engine/runner.py takes one [L, b] copy at each chunk boundary b
# so that the prefix cache can restore the importance a reused prefix had there, bit for bit).
# One per boundary would grow with the square of the prompt: 1.9 GB for a 128K prompt of a
# 28-layer model. thin_snapshots keeps the SNAPSHOT_RECENT newest boundaries, where reuse
# happens (a chat's next turn, another question about the same document), and the boundaries at
# powers of two chunks, so a prefix shared further back still reuses at least half of itself.
# The kept copies sum to under SNAPSHOT_COPIES importance arrays of the cache's capacity.
SNAPSHOT_RECENT = 8
SNAPSHOT_COPIES = SNAPSHOT_RECENT + 2  # + the powers of two: 1 + 2 + 4 + ... < 2 arrays


def thin_snapshots(snapshots: dict, chunk: int) -> None:
    """Drops, in place, the boundaries of `snapshots` ({b: [L, b]}) that the rule above does not keep."""
    recent = sorted(snapshots)[-SNAPSHOT_RECENT:]
    for b in list(snapshots):
        n = b // chunk
        if b not in recent and n & (n - 1):
            del snapshots[b]


class KVCache:
    """All layers of one sequence: layers[i] (K/V storage) and sparse[i] (its SparseState).
    `length` is advanced by the model after each forward."""

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity, dtype="f32"):
        if capacity < 1:
            raise SparrowError(f"KV cache capacity must be >= 1 (got {capacity})")
        self.dtype = dtype
        self.capacity = capacity
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
        a copy; the KV budget (engine/kv_budget.py) grows capacity geometrically in whole pages
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
        n_probe), v2's block summaries when probe = (block, "v2"); probe may be a list of such
        keys (a sparse target and its sparse drafter), each copy charged once."""
        kind = type(self.layers[0])
        kvh, d = self.layers[0].n_kv_heads, self.layers[0].head_dim
        per_layer = kind.bytes_at(kvh, d, capacity) + 4 * capacity * (1 + SNAPSHOT_COPIES)
        keys = probe if isinstance(probe, list) else [] if probe is None else [probe]
        for key in dict.fromkeys(keys):  # SparseState keeps one copy per key
            if key[1] == "v2":
                per_layer += BlockSummaries.bytes_at(kvh, d, capacity, key[0])
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

    # A recurrent state beside the K/V (HybridCache) needs copies to return to a position;
    # K/V alone needs none.
    recurrent = False
    keep_every_row = False

    def checkpoint(self, chunk: int) -> None:
        """A prefill chunk boundary at the current length (HybridCache keeps its state there)."""

    def state(self):
        """What truncating back to the current length needs beyond K/V: None here."""
        return None

    def restore(self, length: int, state) -> None:
        """Returns to `length` positions with the state() taken there (drafting on this cache)."""
        self.truncate(length)


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

    recurrent = True

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

    def state(self):
        return self.conv.copy(), self.ssm.copy()

    def restore(self, length: int, state) -> None:
        self.row_states[length] = state
        self.truncate(length)

    def checkpoint(self, chunk: int) -> None:
        """Keeps a copy of the state at a prefill chunk boundary (the current length); the
        copies are thinned by the prefix snapshots' rule (thin_snapshots)."""
        self.states[self.length] = (self.conv.copy(), self.ssm.copy())
        thin_snapshots(self.states, chunk)

    def keep_row(self, position: int, layer: int) -> None:
        """Keeps a copy of Gated DeltaNet layer `layer`'s state after `position` tokens: each
        row of a forward that runs several rows of this sequence (verification); the forward
        clears the previous rows' copies first."""
        st = self.row_states.get(position)
        if st is None:
            st = self.row_states[position] = (np.empty_like(self.conv), np.empty_like(self.ssm))
        st[0][layer], st[1][layer] = self.conv[layer], self.ssm[layer]

    def _restore(self, n: int) -> None:
        if n != self.length:
            if n == 0:
                self.conv[:] = 0
                self.ssm[:] = 0
            elif n in self.row_states or n in self.states:
                conv, ssm = self.row_states.get(n) or self.states[n]
                self.conv[:], self.ssm[:] = conv, ssm
            else:
                raise SparrowError(f"recurrent state: no copy at position {n} to return to (at {self.length})")
            for b in [b for b in self.states if b > n]:
                del self.states[b]
        self.row_states.clear()

    def truncate(self, n):  # rollback truncates too
        n = max(0, min(int(n), self.length))
        self._restore(n)
        super().truncate(n)

    def states_at(self, bounds) -> dict:
        """Copies of the state at each position of `bounds` (the disk prompt cache's file)."""
        out = {}
        for b in bounds:
            if b == self.length:
                out[b] = (self.conv.copy(), self.ssm.copy())
            elif b in self.states:
                out[b] = self.states[b]
            else:
                raise SparrowError(f"recurrent state: no copy at position {b}")
        return out

    def load_states(self, states: dict, n: int) -> None:
        """The states read back from a file ({b: (conv, ssm)}), the one at n made live."""
        self.states = {b: st for b, st in states.items() if b < n}
        self.row_states.clear()
        self.conv[:], self.ssm[:] = states[n]

    def copy_prefix(self, src, n, importance):
        if n == src.length:
            conv, ssm = src.conv, src.ssm
        elif n in src.states or n in src.row_states:
            conv, ssm = src.states.get(n) or src.row_states[n]
        elif n == 0:
            conv, ssm = 0, 0
        else:
            raise SparrowError(f"recurrent state: the source holds no copy at position {n}")
        super().copy_prefix(src, n, importance)
        self.conv[:], self.ssm[:] = conv, ssm
        self.states = {b: (c.copy(), s.copy()) for b, (c, s) in src.states.items() if b <= n}
        self.row_states.clear()
