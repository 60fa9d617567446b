"""What block-sparse attention keeps beside one layer's K/V (SparseState): the prefill
importance of each position, and the copies sparse decode reads instead of K: the seed
selector's probe keys (ProbeKeys), v2's block summaries (BlockSummaries) and v3's int8 or
4-bit key codes (KeyCodes, KeyCodes4). They describe the
cache's contents, so rewriting or dropping positions clears them there. Also the rule that
thins the prefill's importance snapshots (and a recurrent state's copies) at chunk boundaries.
"""

import numpy as np

from ..kernels.attention.crossover import sparse_from


def sparse_at(sparse, context: int, head_dim: int):
    """The settings a step whose queries attend over `context` positions of a cache of
    `head_dim` runs with: `sparse` itself, or None (exact attention, bit for bit) while context
    is below its from_context (None: auto, the CPU's crossover, kernels/attention/crossover.py)."""
    if sparse is None or sparse.from_context == 0:
        return sparse
    start = sparse_from(head_dim) if sparse.from_context is None else sparse.from_context
    return sparse if context >= start else None


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
            p.clear_past()

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
        return self._copy(layer, (block, n_probe), lambda: ProbeKeys(layer, block, n_probe), seq_len)

    def copy_for(self, layer, sparse, seq_len):
        """(copy, n) of what `sparse`'s selector reads: probe_keys for the seed, block_summaries
        for v2, the int8 key codes (KeyCodes) or 4-bit ones (KeyCodes4) for v3
        (SparseParams.copy_key names it)."""
        block, what = sparse.copy_key
        if what == "v2":
            return self.block_summaries(layer, block, seq_len)
        if what == "v3":
            return self._copy(layer, (block, "v3"), lambda: KeyCodes(layer, block), seq_len)
        if what == "v3q4":
            return self._copy(layer, (block, "v3q4"), lambda: KeyCodes4(layer, block), seq_len)
        return self.probe_keys(layer, block, what, seq_len)

    def _copy(self, layer, key, make, seq_len):
        """(copy, n): the copy kept under key (made by make() on first use), extended to layer's
        full blocks below seq_len, and how many of its blocks a decode over 0..seq_len-1 reads."""
        p = self._probes.get(key)
        if p is None:
            p = self._probes[key] = make()
        full = seq_len // p.block
        p.extend(layer, full)
        return p, min(p.blocks, full)

    def block_summaries(self, layer, block, seq_len):
        """(summaries, n): v2's per-block key mean and variance of layer's full blocks
        (BlockSummaries), and how many of them a decode over 0..seq_len-1 may read. Kept
        beside the probe copies (same invalidation), filled once per block on first use."""
        return self._copy(layer, (block, "v2"), lambda: BlockSummaries(layer, block), seq_len)

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


class _RowCopy:
    """A copy of `per_block` rows a full block (rows [KVH, n, ...], scale [KVH, n | 1]), the
    first `blocks` valid."""

    aliases_cache = False  # a copy of its own (KeyCodes of an int8 cache are K itself)

    def clear_past(self):
        """Zeroes the rows past the valid blocks (a copy never extended there holds zeros)."""
        if not self.aliases_cache:
            self.rows[:, self.blocks * self.per_block :] = 0
            self.scale[:, self.blocks * self.per_block :] = 0


class ProbeKeys(_RowCopy):
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


class BlockSummaries(_RowCopy):
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


class KeyCodes(_RowCopy):
    """v3's int8 key codes (docs/SPARSE_SELECT_V3.md): rows[kh, t] and scale[kh, t] for the rows
    of the first `blocks` full blocks, as the int8 cache stores a key (absmax / 127 per row).
    A float cache's keys are quantised once per block, on first use (D + 4 bytes a key: 1/4 of
    an f32 K, 1/2 of an f16 one); an int8 cache's own K and scales are the codes (no copy)."""

    def __init__(self, layer, block):
        self.block, self.per_block = block, block
        self.aliases_cache = layer.scaled
        if self.aliases_cache:
            self.rows, self.scale = layer.k, layer.k_scale  # [KVH, C, D] int8, [KVH, C]
        else:
            n = (layer.capacity // block) * block
            self.rows = np.zeros((layer.n_kv_heads, n, layer.head_dim), np.int8)  # [KVH, n, D]
            self.scale = np.zeros((layer.n_kv_heads, n), np.float32)  # [KVH, n]
        self.blocks = 0

    def extend(self, layer, full_blocks):
        """Quantise the keys of blocks blocks..full_blocks-1 of layer (nothing if already there)."""
        from sparrow.kernels.attention.select import quantize_keys
        from sparrow.kernels.matmul.widen import F16_LUT

        if full_blocks > self.blocks:
            if not self.aliases_cache:
                quantize_keys(
                    layer.k, layer.k_scale, F16_LUT, self.block, self.blocks, full_blocks, self.rows, self.scale
                )
            self.blocks = full_blocks

    @property
    def nbytes(self):
        return 0 if self.aliases_cache else self.rows.nbytes + self.scale.nbytes

    @staticmethod
    def bytes_at(layer_kind, n_kv_heads, head_dim, capacity, block):
        """nbytes of KeyCodes(layer, block) for a layer of `capacity` (0 for an int8 cache)."""
        return 0 if layer_kind.scaled else n_kv_heads * (capacity // block) * block * (head_dim + 4)

    def resized(self, layer, blocks):
        """A copy for `layer` (resized) keeping the first `blocks` full blocks."""
        out = KeyCodes(layer, self.block)
        blocks = min(blocks, layer.capacity // self.block)
        if not out.aliases_cache:
            r = blocks * self.block
            out.rows[:, :r], out.scale[:, :r] = self.rows[:, :r], self.scale[:, :r]
        out.blocks = blocks
        return out


class KeyCodes4:
    """v3's 4-bit key codes (key_bits 4, docs/SPARSE_SELECT_V3.md): rows[kh] ([ceil(n / 16),
    padded(D) * 8] int8 tiles, kernels/attention/codes4's layout) and scale[kh, t] for the keys of the first `blocks`
    full blocks, made once per block on first use from the keys as stored (every KV kind: an
    int8 cache's codes are not these). D / 2 + 4 bytes a key per KV head: 1/8 of an f32 K, 1/4
    of an f16 one, about half of an int8 one."""

    def __init__(self, layer, block):
        from sparrow.kernels.attention.codes4 import TILE, padded

        self.block, self.per_block = block, block
        n = (layer.capacity // block) * block
        tiles, width = -(-n // TILE), padded(layer.head_dim) * 8
        self.rows = np.zeros((layer.n_kv_heads, tiles, width), np.int8)  # [KVH, tiles, 8 padded(D)]
        self.scale = np.zeros((layer.n_kv_heads, self.rows.shape[1] * TILE), np.float32)  # [KVH, 16 tiles]
        self.blocks = 0

    def extend(self, layer, full_blocks):
        """Codes of the keys of blocks blocks..full_blocks-1 of layer (nothing if already there)."""
        from sparrow.kernels.attention.codes4 import pack_keys4
        from sparrow.kernels.matmul.widen import F16_LUT

        if full_blocks > self.blocks:
            r0, r1 = self.blocks * self.block, full_blocks * self.block
            pack_keys4(layer.k, layer.k_scale, F16_LUT, r0, r1, self.rows, self.scale)
            self.blocks = full_blocks

    @property
    def nbytes(self):
        return self.rows.nbytes + self.scale.nbytes

    def clear_past(self):
        """Zeroes the lanes of the keys past the valid blocks (a copy never extended there holds
        zeros), in the tile that holds the last valid key too."""
        from sparrow.kernels.attention.codes4 import CHUNK, TILE

        r = self.blocks * self.block
        t = r // TILE
        if r % TILE:  # [KVH, chunks, 16 keys, 4 bytes]: the tile's keys r % 16 .. 15
            kvh, width = self.rows.shape[0], self.rows.shape[2]
            self.rows[:, t].reshape(kvh, width // CHUNK, TILE, 4)[:, :, r % TILE :] = 0
            t += 1
        self.rows[:, t:] = 0
        self.scale[:, r:] = 0

    @staticmethod
    def bytes_at(n_kv_heads, head_dim, capacity, block):
        """nbytes of KeyCodes4(layer, block) for a layer of `capacity`."""
        from sparrow.kernels.attention.codes4 import TILE, padded

        tiles = -(-((capacity // block) * block) // TILE)
        return n_kv_heads * tiles * TILE * (padded(head_dim) // 2 + 4)

    def resized(self, layer, blocks):
        """A copy for `layer` (resized) keeping the first `blocks` full blocks."""
        from sparrow.kernels.attention.codes4 import TILE

        out = KeyCodes4(layer, self.block)
        blocks = min(blocks, layer.capacity // self.block)
        r = blocks * self.block
        t = -(-r // TILE)  # the tiles holding rows 0..r-1
        out.rows[:, :t], out.scale[:, :r] = self.rows[:, :t], self.scale[:, :r]
        out.blocks = blocks
        out.clear_past()  # the last tile's lanes past row r-1, as a copy never extended there
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
