"""Attention over one layer's KV cache: exact and block-sparse top-k (spec: shared/SPARSE_ATTENTION.md).

The cache-aware side of attention: it takes a LayerCache (K/V storage of one kind) and its
SparseState (importance, probe-key copies) and hands their arrays to the kernels in
sparrow.kernels.attention.decode, which know nothing of caches.

Decode runs one serial numba kernel, sparse prefill one parallel kernel (prange over KV heads
only); both attend each query head over its list of selected blocks, the query heads of a GQA
group sharing the K/V reads. Exact attention is the same kernel with every block selected, so
sparse with k >= n_blocks is bit-identical to exact.

Accumulation order, per query head:
1. each score is q' . K[t] (q' = q * scale for f32/f16 caches; int8: the int8 x int8 dot,
   exact since its float32 partial sums are integers below 2**24, times qs * ks[t], times
   scale), fma over 16-lane chunks into one vector, then a fixed pairwise tree 16 -> 1;
2. scores are packed for the selected blocks in ascending position order;
3. m = max; e_t = exp(s_t - m); den = sum of e_t in vector lanes, an order fixed by the count;
4. four accumulators acc[i % 4] += e_i * V[t_i] over the packed list (int8: e_i * vs[t_i]),
   out = ((acc0 + acc1) + (acc2 + acc3)) * (1 / den).
Nothing is split across threads, so results do not depend on the thread count. Probes are the
spec's raw q . K[p] (int8: with the scales); sparse decode reads the probe keys of full blocks
below seq_len from a contiguous copy kept in the SparseState (state.sparse.ProbeKeys).

Exact prefill runs kernels.attention.prefill: online softmax over 64-key steps, a few queries of
every head per work item, scores in L1; f16/int8 keys and values are dequantised to f32 for it.
"""

import numpy as np

from ..kernels.attention.decode import decode_kernel, sparse_prefill_kernel, verify_head
from ..kernels.attention.prefill import prefill_attention as exact_prefill_kernel
from ..kernels.attention.select import STAGE_NAMES
from ..kernels.matmul.widen import F16_LUT
from ..kernels.parallel import run_parallel
from ..params import SparseParams  # noqa: F401  (type of the sparse argument)

_DEFAULT_BLOCK = 32


class Selections:
    """One decode step's block selections as arrays, where a trace needs no softmax mass (the
    server's sparse_trace): the fused step (models/fused.py) and the staged path write them
    straight from the attention kernel, so tracing adds no per-head work and keeps the fused
    step. A trace with the mass (api.stream's, the CLI's --sparse-trace, eval.fidelity) is a
    list of per-head records instead, on the staged path (decode_attention).

    step: (sel [L, H, nb] int64, stages [L, H, nb] int8, nsel [L, H] int64) of the latest
    step, None before one: head h of layer l read blocks sel[l, h, :nsel[l, h]], ascending,
    each chosen by the rule stages[l, h, j] (attention.select.STAGE_*). Rows of a layer that
    does not select (v2's exact first layers: SparseParams.for_layer is None) are unspecified."""

    def __init__(self):
        self.step = None

    def start(self, layers: int, heads: int, blocks: int) -> tuple:
        """Fresh arrays for a step over `blocks` blocks; the kernels fill them."""
        self.step = (
            np.empty((layers, heads, blocks), np.int64),
            np.empty((layers, heads, blocks), np.int8),
            np.zeros((layers, heads), np.int64),
        )
        return self.step

    def take(self) -> tuple | None:
        """The latest step's arrays (None if no sparse step ran since the last take)."""
        step, self.step = self.step, None
        return step


def _check_heads(H, layer):
    if H % layer.n_kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {layer.n_kv_heads} KV heads")
    return H // layer.n_kv_heads


def decode_attention(q, layer, state, seq_len, scale, sparse=None, trace=None, into=None, attend=True):
    """Attention of q [H, D] (position seq_len-1, already appended) over positions
    0..seq_len-1 of the layer cache -> [H, D].

    state: the layer's SparseState (importance state.importance[:seq_len], probe copies).
    sparse: SparseParams for block-sparse top-k, None for exact attention.
    trace: with sparse, appends (head, block ids ascending, stage names, mass) per query head,
    mass being the share of the exact softmax mass inside the selected blocks; exact attention
    records nothing. into: (sel [H, nb], stages [H, nb], nsel [H]), this layer's rows of a
    Selections step, which the kernel writes the selection to. attend=False: the selection
    alone (into, if given, receives it), returns None: what `sparrow bench attention` times
    as a selector's cost a token.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)  # [H, D]
    H, D = q.shape
    group = _check_heads(H, layer)
    if not 1 <= seq_len <= layer.capacity:
        raise ValueError(f"seq_len {seq_len} outside 1..{layer.capacity}")
    qd, qa, qs = layer.query(q, scale)  # [H, D], [H, D], [H]
    bs = sparse.block if sparse is not None else _DEFAULT_BLOCK
    nb = (seq_len + bs - 1) // bs
    if into is None:
        sel, stages, nsel = np.empty((H, nb), np.int64), np.empty((H, nb), np.int8), np.empty(H, np.int64)
    else:
        sel, stages, nsel = into
    out = np.empty((H, D), np.float32)
    if sparse is not None and sparse.k < nb:
        pk, n_copied = state.copy_for(layer, sparse, seq_len)  # seed: probe keys; v2: summaries; v3: key codes
        probe_rows, probe_scale, per_block = pk.rows, pk.scale, pk.per_block  # [KVH, n, D | 2D], [KVH, n | 1]
    else:  # nothing is probed: K stands in for the copy (n_copied 0, never read)
        probe_rows, probe_scale, per_block, n_copied = layer.k, layer.k_scale, 1, 0
    copy = (probe_rows, probe_scale, per_block, n_copied)
    settings = _settings(scale, bs, sparse, nb)
    selection = (sel, stages, nsel)
    decode_kernel((qd, qa, qs), _kv(layer), state.importance, seq_len, group, settings, copy, out, selection, attend)
    if not attend:
        return None
    if trace is not None and sparse is not None:
        for h in range(H):
            n = nsel[h]
            blocks = sel[h, :n].tolist()
            share = _selected_mass(q[h], layer, h // group, seq_len, scale, bs, blocks)
            trace.append((h, blocks, [STAGE_NAMES[c] for c in stages[h, :n]], share))
    return out


def verify_attention(q, layer, start, scale):
    """Exact attention of q [R, H, D] at positions start..start+R-1 of one sequence (their K/V
    already appended), row r over positions 0..start+r -> [R, H, D], each row the bits
    decode_attention gives at its position alone.

    Verification of R drafted tokens (engine/speculative.py): R decode steps would read the
    whole K/V R times; here each KV head reads it once for all R positions (kernel verify_head).
    KV heads run in parallel, each serial, so the thread count never enters."""
    q = np.ascontiguousarray(q, dtype=np.float32)  # [R, H, D]
    R, H, D = q.shape
    group = _check_heads(H, layer)
    if start < 0 or start + R > layer.capacity:
        raise ValueError(f"verify positions {start}..{start + R - 1} outside capacity {layer.capacity}")
    _, qa, qs = layer.query(q, scale)  # [R, H, D], [R, H]
    out = np.empty((R, H, D), np.float32)
    args = ((qa, qs), _kv(layer), int(start), np.float32(scale), int(group), _DEFAULT_BLOCK, out)
    run_parallel(layer.n_kv_heads, verify_head, args)
    return out


def _kv(layer):
    """The layer's cache as the attention kernels take it (attention.decode: kv)."""
    return layer.k, layer.v, layer.k_scale, layer.v_scale, layer.scaled


def _settings(scale, bs, sparse, nb):
    """The request's attention settings as the kernels take them (attention.decode: settings);
    exact attention (sparse None) as k = nb blocks, every block taken."""
    if sparse is None:
        return np.float32(scale), bs, False, nb, 1, 0, F16_LUT
    return np.float32(scale), bs, True, sparse.k, sparse.probe, sparse.flags, F16_LUT


def _selected_mass(qh, layer, kh, seq_len, scale, bs, blocks):
    """Share of the exact softmax mass (f32 keys) that falls inside the selected blocks.
    Only computed when tracing: it costs a full exact pass over the head."""
    s = (layer.keys_f32(kh, seq_len) @ qh) * np.float32(scale)  # [S]
    p = np.exp(s - s.max())
    inside = np.zeros(seq_len, bool)
    for b in blocks:
        inside[b * bs : (b + 1) * bs] = True
    return float(p[inside].sum() / p.sum())


def prefill_attention(q, layer, state, start, scale, sparse=None, record_importance=True):
    """Causal attention of q [T, H, D] (positions start..start+T-1, already appended) -> [T, H, D].

    Query t sees cache positions 0..start+t. With sparse.prefill each query selects blocks over
    its own causal prefix (no importance). record_importance adds the probabilities each
    position received (summed over heads and queries) to state.importance[:start+T].
    """
    q = np.ascontiguousarray(q, dtype=np.float32)  # [T, H, D]
    T, H, D = q.shape
    group = _check_heads(H, layer)
    S = start + T
    if start < 0 or S > layer.capacity:
        raise ValueError(f"prefill positions {start}..{S - 1} outside capacity {layer.capacity}")
    scale = np.float32(scale)
    if sparse is not None and sparse.prefill:
        qd, qa, qs = layer.query(q, scale)  # [T, H, D], [T, H, D], [T, H]
        out = np.empty((T, H, D), np.float32)
        pacc = np.zeros((H, S) if record_importance else (H, 1), np.float32)
        if sparse.select == "v2":  # v2 scores blocks by their summaries: those of the full blocks below S
            summ, n_summ = state.block_summaries(layer, sparse.block, S)
            P = summ.rows  # [KVH, n, 2D]
        else:  # the seed probes K itself; v3 quantises each prefix's keys as it scores them
            P, n_summ = layer.k, 0
        settings = _settings(scale, sparse.block, sparse, None)
        sparse_prefill_kernel((qd, qa, qs), _kv(layer), start, group, settings, (P, n_summ), out,
                              (record_importance, pacc))  # fmt: skip
        if record_importance:
            state.importance[:S] += pacc.sum(axis=0)
        return out
    return _exact_prefill(q, layer, state, start, scale, group, record_importance)


def _exact_prefill(q, layer, state, start, scale, group, record_importance):
    S = start + q.shape[0]
    out, imp = exact_prefill_kernel(  # [T, H, D], [S]; f16 / int8 storage is widened by the kernel
        q * scale,
        layer.k,
        layer.v,
        start,
        group,
        record_importance,
        layer.k_scale,
        layer.v_scale,
        layer.scaled,
        F16_LUT,
    )
    if imp is not None:
        state.importance[:S] += imp
    return out
