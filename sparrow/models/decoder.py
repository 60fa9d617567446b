"""The decoder shared by Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim).

One forward runs a batch of *segments*: each segment is a run of consecutive tokens of one
sequence (a prefill chunk, or the single token of a decode step). Linear layers see all rows
at once; attention runs per segment against that sequence's KV cache.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..errors import SparrowError
from ..kernels.linear import linear, prepare
from ..loaders.tensor import StoredTensor
from ..memory import MADV_DONTNEED, MADV_RANDOM, advise_mapped_pages, release_memory
from ..params import SparseParams
from ..quant import Weight
from ..state.cache import KVCache
from ..state.sparse import sparse_at
from .attention import Selections, decode_attention, prefill_attention, verify_attention
from .fused import FusedDecode
from .layers import MLP, FusedLinear, rms_norm
from .rope import RowRope, model_rope
from .step import BACKOFF, FUSED, FUSED_BATCH, choose


@dataclass
class Segment:
    """Tokens [start, start + len(tokens)) of one sequence."""

    tokens: np.ndarray  # [T] int
    cache: KVCache
    start: int
    sparse: SparseParams | None = None
    decode: bool = False  # a single new token attending over its cache (decode kernel)
    # decode only, with sparse: a list receives (layer, per-head selection records with their
    # softmax mass), a Selections the step's selections as arrays (models.attention)
    trace: list | Selections | None = None
    vision: object | None = None  # models.qwen3_vl.SegmentVision: M-RoPE positions, image embeddings
    rope_delta: int = 0  # rope position minus cache position (decode after an image prompt)

    def __post_init__(self):
        # sparse settings that start at a context length (auto) are exact below it
        self.sparse = sparse_at(self.sparse, self.start + len(self.tokens), self.cache.head_dim)


def _verify_run(segments: list[Segment], j: int) -> int:
    """How many segments from j on are single-token decode rows of one sequence at consecutive
    positions, untraced (Runner.verify's rows). Their exact attention runs as one pass
    (verify_attention): appending all their K/V first changes nothing a row reads, since row r
    reads positions up to its own only, and the exact path keeps no state about positions."""
    s = segments[j]
    if not s.decode or s.trace is not None:
        return 1
    n = 1
    for t in segments[j + 1 :]:
        same = t.cache is s.cache and t.sparse is s.sparse and t.start == s.start + n
        if not same or not t.decode or t.trace is not None:
            break
        n += 1
    return n


class Attention:
    def __init__(self, cfg: ModelConfig, get, prefix: str):
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.qkv_proj = FusedLinear([get.weight(prefix + f"{n}_proj.weight") for n in "qkv"], get.activations)
        self.o = prepare(get.weight(prefix + "o_proj.weight"), get.activations)
        bias = cfg.attention_bias
        self.q_b = get.array(prefix + "q_proj.bias") if bias else None
        self.k_b = get.array(prefix + "k_proj.bias") if bias else None
        self.v_b = get.array(prefix + "v_proj.bias") if bias else None
        self.q_norm = get.array(prefix + "q_norm.weight") if cfg.qk_norm else None
        self.k_norm = get.array(prefix + "k_norm.weight") if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def qkv(self, x: np.ndarray, rope, positions: np.ndarray):
        T, H, KV, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        q, k, v = self.qkv_proj(x)  # [T, H*D] [T, KV*D] [T, KV*D]
        if self.q_b is not None:
            q = q + self.q_b
            k = k + self.k_b
            v = v + self.v_b
        q = q.reshape(T, H, D)
        k = k.reshape(T, KV, D)
        v = np.ascontiguousarray(v).reshape(T, KV, D)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)  # per head, over D
            k = rms_norm(k, self.k_norm, self.eps)
        return rope.apply(q, positions), rope.apply(k, positions), v  # [T,H,D] [T,KV,D] [T,KV,D]


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, get, i: int, mlp_factory):
        p = f"model.layers.{i}."
        self.index = i
        self.input_norm = get.array(p + "input_layernorm.weight")
        self.post_norm = get.array(p + "post_attention_layernorm.weight")
        self.attn = Attention(cfg, get, p + "self_attn.")
        self.mlp = mlp_factory(cfg, get, i, p + "mlp.")
        self.eps = cfg.rms_norm_eps


def dense_mlp(cfg: ModelConfig, get, i: int, prefix: str) -> MLP:
    return MLP(
        get.weight(prefix + "gate_proj.weight"),
        get.weight(prefix + "up_proj.weight"),
        get.weight(prefix + "down_proj.weight"),
        get.activations,
    )


def _release_file_pages(tensors: dict[str, StoredTensor]) -> None:
    """Drops memory-mapped checkpoint pages from this process's resident set (madvise
    DONTNEED on the file mapping; the data stays in the page cache and comes back on the next
    touch). Building a layer reads q/k/v and gate/up once to fuse them into new arrays; without
    this their file pages would stay resident next to the fused copies, and peak RSS would be
    about the file size more than needed."""
    import mmap

    seen = set()
    for t in tensors.values():
        obj = t.data
        for _ in range(8):  # view -> ... -> np.memmap holding the mmap
            mm = getattr(obj, "_mmap", None)
            if mm is not None or obj is None:
                break
            obj = getattr(obj, "base", None)
        if mm is None or id(mm) in seen:
            continue
        seen.add(id(mm))
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, ValueError, OSError):  # no madvise here, or a closed map
            pass


class WeightSource:
    """Looks tensors up by HF name, converting on demand; reports missing tensors clearly.
    Carries the model's build settings: `quantize` (stored weights converted at load) and
    `activations`, the mode the layers prepare their weights for (kernels.linear.prepare, which
    rejects any other mode)."""

    def __init__(self, tensors: dict[str, StoredTensor], quantize: str | None, activations: str = "f32"):
        self.tensors = tensors
        self.quantize = quantize
        self.activations = activations

    def stored(self, name: str) -> StoredTensor:
        t = self.tensors.get(name)
        if t is None:
            raise SparrowError(f"checkpoint is missing tensor {name}")
        return t

    def weight(self, name: str) -> Weight:
        w = self.stored(name).to_weight()
        if self.quantize and w.qtype in ("f32", "f16", "bf16"):
            w = w.quantize(self.quantize)
        return w

    def array(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.stored(name).to_array(), dtype=np.float32)

    def has(self, name: str) -> bool:
        return name in self.tensors


class Decoder:
    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict[str, StoredTensor],
        quantize: str | None = None,
        mlp_factory=dense_mlp,
        progress=None,
        activations: str = "f32",
    ):
        get = WeightSource(tensors, quantize, activations)
        self.config = cfg
        # kernels.linear.ACTIVATIONS: "f32" (exact) or the named faster mode "q8" (decode
        # matvecs over block-quantised weights, and prefill over most of them, with 8-bit
        # activations, as llama.cpp's). Fixed at build: every weight is prepared for it.
        self.activations = activations
        self.quantize = quantize  # --quantize: the block format f32 / f16 / bf16 weights became
        self.embed = get.stored("model.embed_tokens.weight").to_weight()  # rows looked up, never multiplied
        layers = range(cfg.num_hidden_layers)
        if progress is not None:
            layers = progress(layers)
        self.layers = []
        for i in layers:
            self.layers.append(self.build_layer(cfg, get, i, mlp_factory))
            _release_file_pages(tensors)
        self.norm = self.norm_weight(get, "model.norm.weight")
        release_memory()  # before the head's copy, the build's largest: the layers' transients
        if cfg.tie_word_embeddings or not get.has("lm_head.weight"):
            self.lm_head = prepare(self.embed, activations)
        else:
            self.lm_head = prepare(get.weight("lm_head.weight"), activations)
        # Where the head has its own rows (untied, or the q8 mode's copy), the table is only
        # looked up, a row per token: embed_rows then keeps its file pages out of the resident
        # set, which a few hundred random tokens' page faults (each mapping the readahead
        # window or large folio around its row) had filled with most of it (~190 MiB of
        # Qwen3-1.7B's 166 MiB table and its neighbours) beside the head's copy.
        self._lookup_only = self.lm_head is not self.embed and advise_mapped_pages(self.embed.data, MADV_RANDOM)
        self.rope = model_rope(cfg)
        # The fused decode step (models/fused.py), planned at the first decode; use_fused=False
        # keeps every forward on the staged path (models.build_model sets it from SPARROW_FUSED;
        # models.step.choose reads it).
        self.use_fused = True
        self._fused: FusedDecode | None | bool = False  # False: not planned yet
        # Verification rows of one sequence attend in one pass over its K/V (_verify_run);
        # False attends them one by one, as decode steps would, on the staged path (the
        # benchmark's old path).
        self.verify_one_pass = True
        # models.timing.Timer while a forward is timed, else None: each stage checks it once and
        # reports its seconds (Timer.add)
        self.timer = None
        release_memory()  # the build's transient arrays (fused and interleaved copies' sources)

    # What a model family changes (models/qwen3_5.py): its layers and how its norms store weights.
    @staticmethod
    def build_layer(cfg: ModelConfig, get: WeightSource, i: int, mlp_factory):
        return DecoderLayer(cfg, get, i, mlp_factory)

    @staticmethod
    def norm_weight(get: WeightSource, name: str) -> np.ndarray:
        return get.array(name)

    def embed_rows(self, tokens) -> np.ndarray:
        """The embeddings of tokens [N] -> [N, E] f32, a new array."""
        x = np.array(self.embed.rows(tokens), dtype=np.float32)
        if self._lookup_only:  # madvise DONTNEED on the table: cheap where few pages are mapped
            advise_mapped_pages(self.embed.data, MADV_DONTNEED)
        return x

    def fused_step(self) -> FusedDecode | None:
        """The model's fused decode step, planned once (FusedDecode.plan decides whether the
        model can fuse at all: None where it cannot; a family with no fused step returns None)."""
        if self._fused is False:
            self._fused = FusedDecode.plan(self)
        return self._fused

    def new_cache(self, capacity: int, kv_dtype: str = "f32") -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity, kv_dtype)

    def forward(self, segments: list[Segment], all_logits: bool = False, with_last: bool = False):
        """Runs the segments; returns logits [sum(T), V] if all_logits else [len(segments), V]
        for each segment's last token. Advances each cache's length. with_last (with
        all_logits): (every position's [sum(T), V], the last tokens' [len(segments), V] with
        the bits the forward without all_logits gives: the head's summation order depends on
        how many rows it takes).

        A single sequence's decode step, or the decode rows of one or several sequences
        (verification's rows included) runs fused instead when the model allows it (same bits):
        models.step.choose decides."""
        path = choose(self, segments, all_logits)
        t0 = time.perf_counter()
        if path == FUSED:
            out = self._fused(segments[0])  # [1, V]
        elif path == FUSED_BATCH:  # [R, V]: decode rows of several sequences, or one sequence's verification rows
            out = self._fused.batch(segments)
        elif path == BACKOFF:  # a step the fused path would take, staged after contention (models/fused.py)
            out = self._fused.staged_step(self._staged, segments)
        else:
            out = self._staged(segments, all_logits, with_last)
        if self.timer is not None:
            self.timer.forward(path, t0)
        return out

    @staticmethod
    def staged_inputs(segments: list[Segment]):
        """tokens [N], positions [N] and segment bounds [B + 1] of a staged forward's rows;
        a segment past its cache's capacity is refused."""
        tokens = np.concatenate([s.tokens for s in segments]).astype(np.int64)  # [N]
        positions = np.concatenate([np.arange(s.start, s.start + len(s.tokens)) for s in segments])  # [N]
        bounds = np.cumsum([0] + [len(s.tokens) for s in segments])  # [B + 1]
        for s in segments:
            end = s.start + len(s.tokens)
            if end > s.cache.capacity:
                raise SparrowError(f"sequence of {end} tokens exceeds the KV cache capacity {s.cache.capacity}")
        return tokens, positions, bounds

    def start_traces(self, segments: list[Segment]) -> None:
        """Sparse decode rows that record their selections as arrays: one row per KV layer."""
        for s in segments:
            if s.decode and isinstance(s.trace, Selections) and s.sparse is not None:  # arrays attend fills
                n_kv = len(self.config.full_attention_layers)
                s.trace.start(n_kv, self.config.num_attention_heads, -(-(s.start + 1) // s.sparse.block))

    def staged_logits(self, segments: list[Segment], x: np.ndarray, bounds, all_logits: bool, with_last: bool):
        """Advances each cache's length and runs the head: [B, V] for each segment's last row,
        or every row's [N, V] (with with_last, also the last rows' own [B, V]). A cache whose
        `hidden` is a dict gets each of its rows' final-normed hidden state (the head's input)."""
        for j, s in enumerate(segments):
            s.cache.length = s.start + len(s.tokens)
            if s.cache.hidden is not None:  # the rows the head normalises, kept for an MTP drafter
                rows = rms_norm(x[bounds[j] : bounds[j + 1]], self.norm, self.config.rms_norm_eps)  # [T, E]
                s.cache.hidden.update(zip(range(s.start, s.start + len(rows)), rows))
        last = x[bounds[1:] - 1]  # [B, E] last token of each segment
        if not all_logits:
            return self.head(last)  # [B, V]
        return (self.head(x), self.head(last)) if with_last else self.head(x)  # [N, V] (, [B, V])

    def _staged(self, segments: list[Segment], all_logits: bool = False, with_last: bool = False):
        tokens, positions, bounds = self.staged_inputs(segments)
        x = self.embed_rows(tokens)  # [N, E]
        rope = None
        vis = [(bounds[j], s.vision) for j, s in enumerate(segments) if s.vision is not None]
        if vis or any(s.rope_delta for s in segments):  # Qwen3-VL after images only
            x, rope, positions = self._multimodal_inputs(segments, bounds, x, vis)
        self.start_traces(segments)
        for layer in self.layers:
            # Each stage's inputs are dropped once used, so that a prefill chunk's arrays are
            # not all resident at the MLP's peak (x is this forward's own: added in place).
            h = rms_norm(x, layer.input_norm, layer.eps)  # [N, E]
            q, k, v = self.project_qkv(layer, h, positions, rope)  # [N, H, D] [N, KV, D] [N, KV, D]
            del h
            out = self.attend(layer, segments, bounds, q, k, v)  # [N, H, D]
            del q, k, v
            x += self.project_out(layer, out)  # [N, E]
            del out
            x += self.mlp_block(layer, x)  # [N, E]
            if vis:
                self._deepstack(layer.index, x, vis)
        return self.staged_logits(segments, x, bounds, all_logits, with_last)

    def _multimodal_inputs(self, segments, bounds, x, vis):
        """Image embeddings scattered over their pad tokens, and a per-token M-RoPE table:
        (x [N, E], RowRope, row index [N])."""
        pos3 = []
        for s in segments:
            if s.vision is not None:
                pos3.append(s.vision.positions)  # [3, T]
            else:
                p = np.arange(s.start, s.start + len(s.tokens)) + s.rope_delta
                pos3.append(np.broadcast_to(p, (3, len(p))))
        cos, sin = self.rope.table(np.concatenate(pos3, axis=1))  # [N, D/2] each
        x = np.array(x, np.float32)  # [N, E] a private copy
        for a, v in vis:
            x[a + v.rows] = v.embeds
        return x, RowRope(cos, sin), np.arange(len(x))

    @staticmethod
    def _deepstack(i: int, x: np.ndarray, vis) -> None:
        """Qwen3-VL DeepStack: after text layer i, image tokens add the i-th DeepStack features."""
        for a, v in vis:
            if i < len(v.deepstack):
                x[a + v.rows] += v.deepstack[i]

    # ------------------------------------------------------------------ stages
    # Each reports its seconds to self.timer when one is set (models.timing): one check a stage.
    def project_qkv(self, layer: DecoderLayer, h: np.ndarray, positions: np.ndarray, rope=None):
        """q, k, v with bias, q/k norm and RoPE applied: [N, H, D] [N, KV, D] [N, KV, D] (and,
        for a layer whose attention is gated, Qwen3.5's, the gate [N, H*D])."""
        t0 = time.perf_counter()
        out = layer.attn.qkv(h, rope or self.rope, positions)
        if self.timer is not None:
            self.timer.add("project_qkv", t0)
        return out

    def attend(self, layer: DecoderLayer, segments: list[Segment], bounds: np.ndarray, q, k, v) -> np.ndarray:
        """Appends each segment's k, v to its cache and attends its queries over it -> [N, H, D]."""
        t0 = time.perf_counter()
        out = np.empty_like(q)  # [N, H, D]
        j = 0
        while j < len(segments):
            s = segments[j]
            sp = s.sparse.for_layer(layer.index) if s.sparse is not None else None  # v2: early layers exact
            run = _verify_run(segments, j) if sp is None and self.verify_one_pass else 1
            if run > 1:  # one sequence's consecutive exact decode rows (verification): one read of its K/V
                a, b = bounds[j], bounds[j + run]
                s.cache.append(layer.index, s.start, k[a:b], v[a:b])
                out[a:b] = verify_attention(q[a:b], s.cache.layers[layer.index], s.start, layer.attn.scale)
                j += run
                continue
            j += 1
            a, b = bounds[j - 1], bounds[j]
            s.cache.append(layer.index, s.start, k[a:b], v[a:b])
            kv, st = s.cache.layers[layer.index], s.cache.sparse[layer.index]
            if s.decode:
                tr = [] if isinstance(s.trace, list) else None
                into = None
                if isinstance(s.trace, Selections) and sp is not None:
                    into = tuple(rows[layer.index] for rows in s.trace.step)  # this layer's rows
                out[a] = decode_attention(q[a], kv, st, s.start + 1, layer.attn.scale, sp, tr, into)
                if tr is not None and sp is not None:
                    s.trace.append((layer.index, tr))
            else:
                out[a:b] = prefill_attention(q[a:b], kv, st, s.start, layer.attn.scale, sp)
        if self.timer is not None:
            self.timer.add("attend", t0)
        return out

    def project_out(self, layer: DecoderLayer, out: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        y = linear(out.reshape(len(out), -1), layer.attn.o)  # [N, H*D] -> [N, E]
        if self.timer is not None:
            self.timer.add("project_out", t0)
        return y

    def mlp_block(self, layer: DecoderLayer, x: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        y = layer.mlp(rms_norm(x, layer.post_norm, layer.eps))  # [N, E]
        if self.timer is not None:
            self.timer.add("mlp_block", t0)
        return y

    def head(self, x: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)  # [*, E]
        y = linear(np.ascontiguousarray(x), self.lm_head)  # [*, V]
        if self.timer is not None:
            self.timer.add("head", t0)
        return y
