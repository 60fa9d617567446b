"""The fused decode step: one compiled call per token on every thread (kernels/fused/decode_step.py),
for a single sequence's decode when the model allows it, and for the rows speculative
verification checks of one sequence with exact attention (FusedDecode.verify); everything else
takes the staged path (Decoder.forward's stage methods), which gives the same bits.

It applies to decoders (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3.5 dense and MoE) whose projections are stored in a block
format (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k) with matching formats inside each
fused group (q/k/v, gate/up); MoE layers whose experts are in a block format run
kernels/fused/moe_phase.py's phases (models/qwen3_moe.step_moe builds their tables).
Qwen3.5's layers come as one more record, _Hybrid's decode_step.StepHybrid (None for the other
families, whose step compiles none of it): its Gated DeltaNet layers (in_proj group and
out_proj in a block format; conv and delta rule state read and advanced in its HybridCache,
and kept after each row where the cache keeps every row, as the staged path's keep_row), its
gated full attention and its shared experts.
A batch, one decode row of each of several sequences (the server's steps), runs fused too
(FusedDecode.batch): one step for the rows that share their attention settings and KV storage,
the weights read once for all of them (a MoE layer's routed experts once for the rows they
serve). Not here: f16/bf16/f32 projections or experts, batches with traced rows (staged),
sparse traces with each head's softmax mass (a list of records; a trace without it,
models.attention.Selections, is filled here), and timing by stage (a models.timing.Timer
with stages runs the staged path, whose stages report to it; models.step.choose).
"""

from __future__ import annotations

import time

import numba
import numpy as np

from ..errors import SparrowError
from ..kernels.elementwise import rms_norm
from ..kernels.formats import FORMATS, KIND, KQ_FIRST, X8_FIRST
from ..kernels.fused import decode_step as _ds
from ..kernels.fused import sync
from ..kernels.linear import SMALL_T, Q8Weight
from ..kernels.matmul.widen import F16_LUT
from ..kernels.parallel import launcher
from .layers import MLP

BLOCK_FORMATS = tuple(f.name for f in FORMATS if f.row_dot != "widened")  # names; formats.BLOCK_KINDS are ids
_KV_KIND = {"f32": _ds.KV_F32, "f16": _ds.KV_F16, "int8": _ds.KV_INT8}
_DEFAULT_BLOCK = 32  # the block the exact-attention kernel walks (models.attention)
# Contention: the workers meet at 6 barriers a layer and spin there. When another process
# takes a core, a worker waits for a descheduled partner (past sync.SPIN_SECONDS the
# barrier yields the CPU and counts the wait); past 1 in CONTENDED such waits in a step,
# the next BACKOFF_STEPS steps the fused path would take (a sequence's, a batch's or a
# verification's) take the staged path, whose parallel launches sleep instead of spin.
# Both paths give the same bits, so this changes speed only. A contended fused step backs
# off only while the staged steps measured last time were faster, per row: on Qwen3-1.7B a contended
# fused step (~95 ms here) still beat a staged one (~180 ms), on the 135M model it did not.
# The same measurement covers unequal cores (threads asked for beyond a big.LITTLE CPU's big
# cores, kernels.runtime.default_threads): the fast workers' waits for the slow ones count as long
# waits, and the fused step stays while it beats the staged one.
CONTENDED = 8
BACKOFF_STEPS = 64


def _entry(a, n=2) -> list:
    """A table entry for a C-contiguous array of at most n dimensions: its address and its
    dimensions, padded to n with 0 (a piece with no rows: all zero)."""
    if a.size == 0:
        return [0] * (n + 1)
    if not a.flags.c_contiguous or a.ndim > n:
        raise SparrowError(f"fused decode: an array of shape {a.shape} is not C-contiguous of <= {n} dimensions")
    return [a.ctypes.data, *a.shape, *[0] * (n - a.ndim)]


def _block_weight(w) -> bool:
    return w is not None and w.qtype in BLOCK_FORMATS


def _group_ok(fl) -> bool:
    """A FusedLinear the fused step runs: one fused block weight, or block-format parts."""
    return _block_weight(fl.fused) if fl.fused is not None else all(_block_weight(w) for w in fl.parts)


def _pieces(fl, n):
    """n (weight or None, output offset) of a FusedLinear: its fused weight and n - 1 empty
    pieces, or its parts (formats differ, as q/k/v in Q4_K_M files)."""
    if fl.fused is not None:
        return [(fl.fused, 0)] + [(None, fl.fused.shape[0])] * (n - 1)
    offs = np.concatenate([[0], np.cumsum(fl.sizes)[:-1]])
    return [(w, int(o)) for w, o in zip(fl.parts, offs)]


_EMPTY = np.zeros((0, 0), np.uint8)
_EMPTY.flags.writeable = False  # the same array type as the weights' read-only rows


def _readonly(a):
    """A read-only view: weights mapped from a file are read-only and weights quantised at
    load are not, and numba types the two apart, so one model's fused step would not reuse
    another's compiled code (~30 s a specialisation)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _rows_kind(w):
    """(rows, kind) the fused step reads for a weight piece, read-only: as stored, or for a
    weight prepared for the q8 mode its interleaved groups (kernels.linear.Q8Weight)."""
    if w is None:
        return _EMPTY, 0
    rows, kind = (w.rows, w.kind) if isinstance(w, Q8Weight) else (w.data, KIND[w.qtype])
    return _readonly(rows), kind


def _n(w):
    return w.shape[0] if w is not None else 0


def _shared_expert(mlp):
    """The shared expert (an MLP) of a Qwen3.5-MoE block (qwen3_5.SharedExpertMoE), else None."""
    return getattr(mlp, "shared", None) if hasattr(mlp, "routed") else None


def _dense_mlp(mlp):
    """The MLP whose rows take the step's gate/up/down slots: a dense layer's, or a shared expert."""
    return mlp if isinstance(mlp, MLP) else _shared_expert(mlp)


class FusedDecode:
    """Built once per Decoder (None when its weights do not allow the fused step)."""

    @classmethod
    def plan(cls, model) -> FusedDecode | None:
        from .qwen3_moe import fused_moe_ok, step_moe

        for layer in model.layers:
            a, m = layer.attn, layer.mlp
            dn = getattr(layer, "deltanet", None)  # Qwen3.5's Gated DeltaNet layers: no attn
            shared = _shared_expert(m)  # Qwen3.5-MoE: routed experts and a shared expert
            if shared is not None:
                g = m.gate.data
                if not (_group_ok(shared.gate_up) and _block_weight(shared.down) and m.gate.qtype == "f32"):
                    return None
                if g.dtype != np.float32 or g.shape[0] != 1:
                    return None
                m = m.routed
            dense = isinstance(m, MLP) and _group_ok(m.gate_up) and _block_weight(m.down)
            if dn is not None:
                mixer = _group_ok(dn.proj) and _block_weight(dn.out)
            else:
                mixer = _group_ok(a.qkv_proj) and _block_weight(a.o)
            if not ((dense or fused_moe_ok(m)) and mixer):
                return None
        try:
            moe = step_moe(model.layers)  # None for a dense model
        except ValueError:  # MoE layers the step's one record cannot describe
            return None
        return cls(model, moe)

    def __init__(self, model, moe=None):
        cfg, layers = model.config, model.layers
        a0 = next(lay.attn for lay in layers if lay.attn is not None)
        self.model = model
        # Qwen3.5 (HybridLayer): Gated DeltaNet layers beside gated full attention (_Hybrid)
        self.hybrid = _Hybrid(layers) if any(getattr(lay, "deltanet", None) is not None for lay in layers) else None
        qw = 2 if self.hybrid is not None else 1  # a query head's width in q_proj: the query, then its gate
        self.H, self.KV, self.D = a0.n_heads, a0.n_kv, a0.head_dim
        dense = [_dense_mlp(lay.mlp) for lay in layers if _dense_mlp(lay.mlp) is not None]
        self.F = dense[0].gate_up.sizes[0] if dense else 0
        self.moe = moe  # the MoE layers' record (kernels/fused/moe_phase.StepMoE), None for a dense model
        self.E = cfg.hidden_size
        self.eps = np.float32(cfg.rms_norm_eps)
        self.scale = np.float32(a0.scale)
        self._qkv = [
            _pieces(lay.attn.qkv_proj, 3) if lay.attn is not None else [(None, 0)] * 3 for lay in layers
        ]  # [(weight | None, offset)] x 3
        self._gu = [
            _pieces(_dense_mlp(lay.mlp).gate_up, 2) if _dense_mlp(lay.mlp) is not None else [(None, 0)] * 2
            for lay in layers
        ]
        self.offs = np.array(
            [[off for _, off in q] + [off for _, off in g] for q, g in zip(self._qkv, self._gu)], np.int64
        )  # [L, 5]
        self.rows = np.array(
            [[_n(w) for w, _ in q] + [_n(w) for w, _ in g] for q, g in zip(self._qkv, self._gu)], np.int64
        )  # [L, 5]: output rows of each piece
        self._weights = None  # the weight tuple the fused step reads (weights)
        self.kquants = False  # whether any of them takes kquants' row dots (set by weights)
        self.in_norm = np.stack([lay.input_norm for lay in layers]).astype(np.float32)  # [L, E]
        self.post_norm = np.stack([lay.post_norm for lay in layers]).astype(np.float32)  # [L, E]
        L, QKV = len(layers), (qw * self.H + 2 * self.KV) * self.D
        if getattr(a0, "q_b", None) is not None:
            self.bias = np.stack([np.concatenate([lay.attn.q_b, lay.attn.k_b, lay.attn.v_b]) for lay in layers])
        else:
            self.bias = np.zeros((L, 0), np.float32)
        self.bias = self.bias.astype(np.float32)  # [L, QKV | 0]
        if a0.q_norm is not None:  # a DeltaNet layer's rows: zeros, never read
            zero = np.zeros(self.D, np.float32)
            self.q_norm = np.stack([lay.attn.q_norm if lay.attn else zero for lay in layers]).astype(np.float32)
            self.k_norm = np.stack([lay.attn.k_norm if lay.attn else zero for lay in layers]).astype(np.float32)
        else:
            self.q_norm = self.k_norm = np.zeros((L, 0), np.float32)
        head = model.lm_head
        self.head_norm = model.norm
        self.V, self.QKV = head.shape[0], QKV
        self._buffers = {}  # rows -> the scratch the workers share (one thread owns the model: one set a size)
        self.nsel = np.empty((1, self.H), np.int64)
        self.sync = np.zeros(5, np.int64)  # barrier: arrivals, generation, long waits, spin rounds; a failed call
        self.sync[3] = sync.spin_rounds()
        self.backoff = 0  # staged steps left before the fused step is tried again
        self.staged_s = None  # seconds a row of the latest staged step taken while backing off
        self.steps = 0  # fused steps run (tests check the path they meant to test ran)
        self.verified = 0  # of them, verification steps of several rows
        self.batched = 0  # and steps of several sequences

    def buffers(self, R: int) -> dict:
        """StepScratch's arrays for R rows but the logits and the selections."""
        got = self._buffers.get(R)
        if got is None:
            H, D = self.H, self.D
            att = np.empty((R, H, D), np.float32)  # attention out, also read as [R, H*D]
            got = self._buffers[R] = dict(
                qkv=np.empty((R, self.QKV), np.float32), att=att, att_flat=att.reshape(R, -1),
                qd=np.empty((R, H, D), np.float32), qa=np.empty((R, H, D), np.float32), qs=np.empty((R, H), np.float32),
                gu=np.empty((R, 2 * self.F), np.float32), y=np.empty((R, self.E), np.float32),
            )  # fmt: skip
        return got

    def staged_step(self, staged, segments) -> np.ndarray:
        """One step the fused path would take, on the staged path while backing off, timed per row."""
        self.backoff -= 1
        t0 = time.perf_counter()
        logits = staged(segments)
        self.staged_s = (time.perf_counter() - t0) / len(segments)
        return logits

    def weights(self):
        """(wtab [L, 7, 3], kinds [L, 7], lm_head rows, its kind or -1), built once: the rows the
        model's weights were prepared with for its activations mode (stored, or the q8 mode's
        interleaved groups) as a table of (address, rows, bytes a row) for the q/k/v pieces, o,
        the gate/up pieces and down (decode_step.StepModel); self._rows keeps them alive."""
        got = self._weights
        if got is None:
            layers = self.model.layers
            pieces = [
                [w for w, _ in q]
                + [lay.attn.o if lay.attn else None]
                + [w for w, _ in g]
                + [getattr(_dense_mlp(lay.mlp), "down", None)]
                for q, g, lay in zip(self._qkv, self._gu, layers)
            ]  # [L][7]
            self._rows = [[_rows_kind(w) for w in ws] for ws in pieces]
            kinds = np.array([[k for _, k in rs] for rs in self._rows], np.int64)  # [L, 7]
            wtab = np.array([[_entry(r) for r, _ in rs] for rs in self._rows], np.int64)  # [L, 7, 3]
            head = self.model.lm_head
            if head.qtype in BLOCK_FORMATS:
                head_w, head_kind = _rows_kind(head)
            else:
                head_w, head_kind = _readonly(np.zeros((1, 1), np.uint8)), -1  # the head runs staged
            if numba.typeof(head_w) != numba.typeof(_EMPTY):  # the type the row kernels' addresses are for
                raise SparrowError("fused decode: the head's rows are not a read-only C array of bytes")
            got = self._weights = (wtab, kinds, head_w, head_kind)
            every = np.append(kinds.ravel(), head_kind)
            if self.hybrid is not None:
                every = np.append(every, self.hybrid.weights()[1].ravel())
            self.kquants = bool(((every >= KQ_FIRST) & (every < X8_FIRST)).any())  # K-quant row dots
        return got

    # ------------------------------------------------------------------ per cache
    def _arrays(self, cache, probe_key):
        """The cache's per-layer arrays as (address, dimensions) tables, with arrays of their
        types and the arrays themselves, which the memo keeps alive (built once per cache and
        probe setting; KVCache.resize drops the memo)."""
        memo = cache.__dict__.setdefault("_fused_lists", {})
        got = memo.get(probe_key)
        if got is None:
            layers, states = cache.layers, cache.sparse
            kv = [(lc.k, lc.v) for lc in layers]
            sc = [(lc.k_scale, lc.v_scale, st.importance.reshape(1, -1)) for lc, st in zip(layers, states)]
            if probe_key is None:  # nothing is probed: K stands in for the copy, never read
                pr, per_block = [(lc.k, lc.k_scale) for lc in layers], 1
            else:
                copies = [st._probes[probe_key] for st in states]
                pr, per_block = [(p.rows, p.scale) for p in copies], copies[0].per_block
            kvtab = np.array([[[_entry(a, 3) for a in row] for row in kv]], np.int64)  # [1, L, 2, 4]
            stab = np.array([[[_entry(a) for a in row] for row in sc]], np.int64)  # [1, L, 3, 3]
            ptab = np.array([[[_entry(p, 3), _entry(ps, 3)] for p, ps in pr]], np.int64)  # [1, L, 2, 4]
            likes = tuple(np.zeros((0,) * nd, a.dtype) for a, nd in ((kv[0][0], 3), (pr[0][0], 3), (sc[0][0], 2)))
            if {a.dtype for row in kv for a in row} != {likes[0].dtype} or {p.dtype for p, _ in pr} != {likes[1].dtype}:
                raise SparrowError("fused decode: the cache's layers differ in dtype")
            got = memo[probe_key] = (kvtab, stab, ptab, *likes, per_block, (kv, sc, pr))
        return got

    def _run(self, cache, args) -> None:
        """`fused_decode_step` on every thread (kernels/parallel.py's launcher), or on this one alone;
        args: its arguments with the records flat and without `calls` (its step tuple takes the
        records and calls), which are the exact row dots' addresses (0 in the q8 mode) and the
        attention's address and type key (decode_step.attention_call). The
        addresses and the launcher are memoised in the cache: the argument types are fixed by
        the cache's dtypes, the activations mode, the selection switch, the probe copies' dtype
        and the RoPE tables' layout, which make the key (typing the arguments costs ~0.3 ms,
        numba's dispatch ~0.17 ms a step)."""
        model_t, cache_t, mode, select = args[5], args[6], args[9], args[10]  # args[12]: hybrid
        cos, sin = model_t.cos, model_t.sin
        key = (id(self), mode, select, cache_t.p_like.dtype, cos.flags.c_contiguous, sin.flags.c_contiguous)
        memo = cache.__dict__.setdefault("_fused_entries", {})
        got = memo.get(key)
        if got is None:
            exact = _ds.exact_rows_address(self.kquants) if mode is None else (0, 0)
            got = memo[key] = [(*exact, *_ds.attention_call(args), 0, 0), None]
        calls, nt = got[0], args[1]
        verifying = args[3].shape[0] > 1 and cache_t.kvtab.shape[0] == 1  # several rows of one sequence
        if verifying and calls[4] == 0:  # verification's rows: verify_head's address too
            calls = got[0] = (*calls[:4], *_ds.verify_call(args))
        step = (*args[5:9], calls)  # fused_decode_step's step: the records and calls
        kernel_args = (*args[1:5], step, *args[9:])
        if nt == 1:
            _ds.fused_decode_step(0, *kernel_args)
        else:
            if got[1] is None:
                got[1] = launcher(_ds.fused_decode_step, kernel_args)
            got[1](nt, kernel_args)
        if self.sync[4]:
            raise SparrowError("fused decode: the attention kernel's argument types do not match its address")

    def verifies(self, segments) -> bool:
        """Whether verify takes one sequence's verification rows (single-token decode rows at
        consecutive positions, untraced, as batches accepts them): 2 to SMALL_T of them, with
        exact attention, no images."""
        s = segments[0]
        return (
            1 < len(segments) <= SMALL_T
            and s.sparse is None
            and all(t.vision is None and t.rope_delta == s.rope_delta and len(t.tokens) == 1 for t in segments)
        )

    def batches(self, segments) -> bool:
        """Whether batch takes these decode rows: 2 to SMALL_T untraced single-token rows, no
        images (a row after an image prompt brings its rope delta), one row a sequence or, with
        exact attention, several: a sequence's verification rows at consecutive positions in
        order (Runner.verify's, of one sequence or several speculating together)."""
        if not 1 < len(segments) <= SMALL_T:
            return False
        last = {}  # cache -> the position of its latest row
        for s in segments:
            if not (s.decode and s.trace is None and s.vision is None and len(s.tokens) == 1):
                return False
            prev = last.get(id(s.cache))
            if prev is not None and (s.sparse is not None or prev[1] is not None or s.start != prev[0] + 1):
                return False
            last[id(s.cache)] = (s.start, s.sparse)
        return True

    @staticmethod
    def settings_groups(segments) -> list[list[int]]:
        """The rows of segments by shared attention settings and KV storage, in order of first
        appearance: what one fused step can take together (its kernel's types and selection
        switch follow them)."""
        groups, keys = [], []
        for i, s in enumerate(segments):
            key = (s.sparse, s.cache.dtype)
            for g, k in zip(groups, keys):
                if k == key:
                    g.append(i)
                    break
            else:
                groups.append([i])
                keys.append(key)
        return groups

    def batch(self, segments) -> np.ndarray:
        """Decode rows of several sequences (batches(segments)) -> logits [B, V], row b the bits
        a decode step of segments[b] alone gives: one step for each group of rows that share
        their settings (settings_groups); a lone row is a sequence's own step, one sequence's
        rows its verification step."""
        groups = self.settings_groups(segments)
        if len(groups) == 1:
            return self._group_step(segments)
        out = np.empty((len(segments), self.V), np.float32)  # [B, V]
        for rows in groups:
            out[rows] = self._group_step([segments[i] for i in rows])
        return out

    def _group_step(self, segments) -> np.ndarray:
        """Rows that share their settings: one sequence's one row is its decode step, its several
        rows its verification step (each KV head's K/V read once for all rows, unless
        Decoder.verify_one_pass is off); rows of several sequences a batch step, each row
        attending as its own decode step."""
        if len(segments) == 1:
            return self(segments[0])
        if len({id(s.cache) for s in segments}) == 1 and self.model.verify_one_pass and self.verifies(segments):
            return self.verify(segments)
        return self._batch_step(segments)

    def _batch_step(self, segments) -> np.ndarray:
        """One step over rows that share their settings -> logits [B, V]."""
        self.batched += 1
        return self._step(segments[0], np.concatenate([s.tokens for s in segments]), segments)

    def __call__(self, seg) -> np.ndarray:
        """Decodes seg (one token at seg.start over its cache) -> logits [1, V]; with sparse
        settings and a trace (a models.attention.Selections) writes its step's selections."""
        return self._step(seg, seg.tokens)

    def verify(self, segments) -> np.ndarray:
        """Verification's rows (verifies(segments)) in one step -> logits [R, V], row r the bits
        a decode step at segments[r].start gives."""
        self.verified += 1
        return self._step(segments[0], np.concatenate([s.tokens for s in segments]))

    def _step(self, seg, tokens, batch=None) -> np.ndarray:
        """The tokens [R] at positions seg.start.. of seg's cache, with seg's settings (R > 1:
        exact attention only, verifies); or, batch (batches), token r at position
        batch[r].start of its cache -> logits [R, V]."""
        model, cache, pos, sp = self.model, seg.cache, int(seg.start), seg.sparse
        R = len(tokens)
        segs = batch or [seg]
        for s in segs:
            end = int(s.start) + (R if batch is None else 1)
            if end > s.cache.capacity:
                raise SparrowError(f"sequence of {end} tokens exceeds the KV cache capacity {s.cache.capacity}")
        if batch is None:  # [R, 3]: sequence 0, position, rope position
            at = np.stack([np.zeros(R, np.int64), np.arange(pos, pos + R), np.arange(pos, pos + R) + seg.rope_delta], 1)
        else:  # [R, 3]: each row's sequence, position, rope position
            at = np.array([[i, int(s.start), int(s.start) + s.rope_delta] for i, s in enumerate(batch)], np.int64)
        L = len(model.layers)
        seq_len = pos + 1  # the first row's
        bs = sp.block if sp is not None else _DEFAULT_BLOCK
        top = int(at[:, 1].max()) + 1  # past the last row's position
        nb = ((seq_len if batch is None else top) + bs - 1) // bs  # a batch: its longest row's blocks
        # a sequence alone reads the selector's copies only with more blocks than it selects; a
        # batch's rows all take their tables (one type for every row; a row selecting every
        # block reads none of it)
        probed = sp is not None and (batch is not None or sp.k < nb)
        n_copied = np.zeros((len(segs), L), np.int64)
        for c, s in enumerate(segs):
            start = int(s.start)
            for i, st in enumerate(s.cache.sparse):
                st.rewritten(start, start + (R if batch is None else 1))  # what KVCache.append does (staged)
                if probed:  # the full blocks already in the cache; a block this token completes is read in K
                    _, n_copied[c, i] = st.copy_for(s.cache.layers[i], sp, start)
        tabs = [self._arrays(s.cache, sp.copy_key if probed else None) for s in segs]
        kvtab, stab, ptab, kv_like, p_like, s_like, per_block, _ = tabs[0]
        if batch is not None:  # every sequence's tables; each cache's memo keeps its arrays alive
            kvtab, stab, ptab = (np.concatenate([t[j] for t in tabs]) for j in range(3))
        cos, sin = model.rope.shifted(0, int(at[:, 2].max()) + 1)  # [> every rope position, D/2]
        x = model.embed_rows(tokens)  # [R, E], a private copy
        logits = np.empty((R, self.V), np.float32)  # [R, V]
        q8 = model.activations == "q8"
        wtab, kinds, head_w, head_kind = self.weights()
        model_t = _ds.StepModel(
            wtab=wtab, kinds=kinds, offs=self.offs,
            rows=self.rows, in_norm=self.in_norm, post_norm=self.post_norm, eps=self.eps, bias=self.bias,
            q_norm=self.q_norm, k_norm=self.k_norm, cos=cos, sin=sin, H=self.H, KV=self.KV, D=self.D, F=self.F,
            scale=self.scale, head_norm=self.head_norm, head_w=head_w, head_kind=head_kind,
        )  # fmt: skip
        cache_t = _ds.StepCache(
            kvtab=kvtab, stab=stab, ptab=ptab, kv_like=kv_like, p_like=p_like, s_like=s_like, n_copied=n_copied,
            per_block=per_block, kv_kind=_KV_KIND[cache.dtype],
        )  # fmt: skip
        if sp is not None:  # plain ints: the kernel's types must not depend on how sp was built
            attn_t = _ds.StepAttention(
                sparse_on=True, k_blocks=int(sp.k), block=int(bs), n_probe=int(sp.probe), flags=int(sp.flags),
                dense=int(sp.dense_layers), lut=F16_LUT,
            )  # fmt: skip
        else:
            attn_t = _ds.StepAttention(
                sparse_on=False, k_blocks=int(nb), block=int(bs), n_probe=1, flags=0, dense=0, lut=F16_LUT
            )
        if seg.trace is not None and sp is not None:  # traced: every KV layer's selection, kept
            sel, stages, nsel = seg.trace.start(len(cache.layers), self.H, nb)
        else:  # one layer's, reused (the same types: tracing compiles nothing more)
            sel, stages, nsel = np.empty((1, self.H, nb), np.int64), np.empty((1, self.H, nb), np.int8), self.nsel
        scratch = _ds.StepScratch(**self.buffers(R), logits=logits, sel=sel, stages=stages, nsel=nsel)
        # types to the kernel: each activation mode compiles only its own matvecs, and exact
        # requests no block selection
        mode, select = (_ds.q8_rows_address() if q8 else None), (True if sp is not None else None)
        nt = numba.get_num_threads()
        self.sync[:3] = self.sync[4] = 0
        t0 = time.perf_counter()
        hybrid = self.hybrid.step(segs, at, batch is None) if self.hybrid is not None else None
        self._run(cache, (0, nt, self.sync, x, at, model_t, cache_t, attn_t, scratch, mode, select, self.moe, hybrid))
        if batch is None:
            cache.length = pos + R
        else:
            for s in batch:
                s.cache.length = int(s.start) + 1
        self._keep_hidden(segs, x, pos if batch is None else None)
        self.steps += 1
        if self.sync[2] * CONTENDED > 6 * L:  # more than 1/CONTENDED of the barriers waited long
            if self.staged_s is None or self.staged_s < (time.perf_counter() - t0) / R:
                self.backoff = BACKOFF_STEPS
        if head_kind < 0:
            return model.head(x)
        return logits

    def _keep_hidden(self, segs, x, pos) -> None:
        """Where a cache keeps its hidden rows (KVCache.hidden, an MTP drafter's), each row's
        final-normed hidden state, as the staged head writes them (x [R, E]: the step's final
        residual rows; pos: the first row's position for one sequence's rows, None for a batch,
        one row a sequence)."""
        model = self.model
        for r, s in enumerate(segs):
            if s.cache.hidden is None:
                continue
            rows = x if pos is not None else x[r : r + 1]
            first = pos if pos is not None else int(s.start)
            normed = rms_norm(rows, model.norm, model.config.rms_norm_eps)  # [R | 1, E]
            s.cache.hidden.update(zip(range(first, first + len(normed)), normed))


class _Hybrid:
    """Qwen3.5's side of a fused step (decode_step.StepHybrid): the Gated DeltaNet layers'
    weights and parameters, built once, and each step's state tables (step)."""

    def __init__(self, layers):
        self.layers = layers
        self.full = np.array([lay.attn is not None for lay in layers], np.int64)  # [L]
        self.index = np.array([lay.index for lay in layers], np.int64)  # [L]
        dns = [lay.deltanet for lay in layers if lay.deltanet is not None]
        d0 = dns[0]
        self.pieces = [_pieces(lay.deltanet.proj, 4) if lay.deltanet else [(None, 0)] * 4 for lay in layers]
        self.offs = np.array([[o for _, o in p] for p in self.pieces], np.int64)  # [L, 4]
        self.rows = np.array([[_n(w) for w, _ in p] for p in self.pieces], np.int64)  # [L, 4]
        self.conv_w = np.ascontiguousarray(np.stack([d.conv_w for d in dns]), np.float32)  # [Ll, C, K]
        self.neg_A = np.ascontiguousarray(np.stack([d.neg_A for d in dns]), np.float32)  # [Ll, Hv]
        self.dt_bias = np.ascontiguousarray(np.stack([d.dt_bias for d in dns]), np.float32)
        self.norm = np.ascontiguousarray(np.stack([d.norm for d in dns]), np.float32)  # [Ll, Dv]
        self.key_head = np.ascontiguousarray(np.stack([d.key_head for d in dns]), np.int64)  # [Ll, Hv]
        self.dims = np.array([d0.Hk, d0.Dk, d0.Dv], np.int64)
        self.C, self.VD, self.Hv = d0.channels, d0.Hv * d0.Dv, d0.Hv
        R = SMALL_T
        self.proj = np.empty((R, self.C + self.VD + 2 * self.Hv), np.float32)
        self.conv = np.empty((R, self.C), np.float32)
        self.yv = np.empty((R, self.VD), np.float32)
        self.like3, self.like4 = np.zeros((0, 0, 0), np.float32), np.zeros((0, 0, 0, 0), np.float32)
        E = layers[0].input_norm.shape[0]
        self.shared = np.array([_shared_expert(lay.mlp) is not None for lay in layers], np.int64)  # [L]
        self.sgate = np.zeros((len(layers), E), np.float32)  # [L, E]
        for i, lay in enumerate(layers):
            if self.shared[i]:
                self.sgate[i] = lay.mlp.gate.data.reshape(-1)
        self.moe_out = np.empty((R, E), np.float32)
        self._weights = None

    def weights(self):
        """(dwtab [L, 5, 3], dkinds [L, 5]): the in_proj pieces and out_proj as FusedDecode.weights."""
        if self._weights is None:
            pieces = [
                [w for w, _ in p] + [lay.deltanet.out if lay.deltanet else None]
                for p, lay in zip(self.pieces, self.layers)
            ]  # [L][5]
            self._rows = [[_rows_kind(w) for w in ws] for ws in pieces]
            kinds = np.array([[k for _, k in rs] for rs in self._rows], np.int64)
            wtab = np.array([[_entry(r) for r, _ in rs] for rs in self._rows], np.int64)
            self._weights = (wtab, kinds)
        return self._weights

    def step(self, segs, at, one_sequence: bool):
        """The StepHybrid of a step over rows `at` (FusedDecode._step's [R, 3]) of segs' caches:
        each sequence's conv / ssm, and where each row's state is kept: after every row of a
        cache that keeps every row (verification, a draft model's cache), as the staged path's
        keep_row, in the cache's row_states."""
        stab = np.array([[_entry(s.cache.conv, 4), _entry(s.cache.ssm, 4)] for s in segs], np.int64)  # [S, 2, 5]
        keep = np.zeros((len(at), 2, 5), np.int64)  # [R, 2, 5]
        for r in range(len(at)):
            cache = segs[0 if one_sequence else r].cache
            if cache.keep_every_row:
                p = int(at[r, 1]) + 1
                st = cache.row_states.get(p)
                if st is None:
                    st = cache.row_states[p] = (np.empty_like(cache.conv), np.empty_like(cache.ssm))
                keep[r] = [_entry(st[0], 4), _entry(st[1], 4)]
        wtab, kinds = self.weights()
        return _ds.StepHybrid(
            full=self.full, index=self.index, dwtab=wtab, dkinds=kinds, doffs=self.offs, drows=self.rows,
            conv_w=self.conv_w, neg_A=self.neg_A, dt_bias=self.dt_bias, norm=self.norm, key_head=self.key_head,
            dims=self.dims, C=self.C, VD=self.VD, Hv=self.Hv, proj=self.proj, conv=self.conv, yv=self.yv,
            stab=stab, keep=keep, like3=self.like3, like4=self.like4, shared=self.shared, sgate=self.sgate,
            moe_out=self.moe_out,
        )  # fmt: skip
