"""Qwen3.5 (dense and MoE): a hybrid of Gated DeltaNet layers (linear attention with a fixed-size
recurrent state per sequence) and gated full attention (a KV cache), as transformers'
`models/qwen3_5` and `qwen3_5_moe` compute them.

What differs from Qwen3, layer by layer:
- RMSNorm multiplies by (1 + weight) (the model's, the layers' and q/k norms): the build stores
  1 + weight, so the shared rms_norm kernel applies it as is.
- Full attention: q_proj gives, per head, the query and an output gate ([T, H, 2, D]); q/k
  RMSNorm; rotary on the first rotary_dim dims of each head only (partial_rotary_factor; text
  tokens see plain positions, where interleaved M-RoPE equals RoPE; image pads and the tokens
  after them, Qwen3_5VL's 3-axis M-RoPE positions); the attention output is
  multiplied by sigmoid(gate) before o_proj. Its K/V and attention are sparrow's own (exact or
  block-sparse), indexed by full-attention layer.
- Gated DeltaNet: in_proj_qkv / z / b / a of the same input (one fused projection), a depthwise
  causal conv1d (kernel 4) with SiLU over q|k|v, L2-normalised q and k (q also scaled by
  Dk^-1/2), decay g = -exp(A_log) * softplus(a + dt_bias), update gate beta = sigmoid(b), the
  gated delta rule per value head (kernels/deltanet.py; key heads shared by
  Hv / Hk value heads each), then RMSNorm over Dv gated by silu(z) (weight as is), out_proj.
- MoE layers add a shared expert whose output is scaled by sigmoid(shared_expert_gate(x)).

Decode steps (a sequence's, a batch's, verification's) take the fused step where the weights
allow it (models/fused.py: its StepHybrid record runs the DeltaNet layers through
kernels/deltanet.py's helpers and gates the attention), with the staged forward's bits;
prefill and everything else run the staged forward below.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..config import ModelConfig
from ..errors import SparrowError
from ..kernels.deltanet import gated_deltanet, sigmoid
from ..kernels.linear import linear, prepare
from ..quant import Weight
from ..state.recurrent import HybridCache
from .decoder import Decoder, Segment, WeightSource, dense_mlp
from .layers import MLP, FusedLinear, rms_norm
from .qwen3_vl import ImageInput


def _check(get: WeightSource, name: str, shape: tuple) -> None:
    got = tuple(get.stored(name).shape)
    if got != tuple(shape):
        raise SparrowError(f"tensor {name} has shape {got}, expected {tuple(shape)}")


def _offset_norm(get: WeightSource, name: str, cfg: ModelConfig) -> np.ndarray:
    """A (1 + weight) norm's multiplier: computed in f32 as transformers does, or as stored
    (llama.cpp's converter adds the 1: cfg.gguf_layout)."""
    w = get.array(name)
    return w if cfg.gguf_layout else (np.float32(1) + w).astype(np.float32)


class GatedAttention:
    """Full attention with a sigmoid output gate; `index` is its layer in the KV cache."""

    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str):
        H, KV, D, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim, self.rotary = H, KV, D, cfg.rotary_dim
        for name, shape in (("q_proj", (2 * H * D, E)), ("k_proj", (KV * D, E)), ("v_proj", (KV * D, E))):
            _check(get, prefix + name + ".weight", shape)
        _check(get, prefix + "o_proj.weight", (E, H * D))
        self.qkv_proj = FusedLinear([get.weight(prefix + f"{n}_proj.weight") for n in "qkv"], get.activations)
        self.o = prepare(get.weight(prefix + "o_proj.weight"), get.activations)
        self.q_norm = _offset_norm(get, prefix + "q_norm.weight", cfg)
        self.k_norm = _offset_norm(get, prefix + "k_norm.weight", cfg)
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(D)

    def qkv(self, x: np.ndarray, rope, positions: np.ndarray):
        """q [T, H, D], k [T, KV, D], v [T, KV, D] (normed, rotated), and the gate [T, H*D]."""
        T, H, KV, D, r = x.shape[0], self.n_heads, self.n_kv, self.head_dim, self.rotary
        qg, k, v = self.qkv_proj(x)  # [T, 2*H*D] [T, KV*D] [T, KV*D]
        qg = qg.reshape(T, H, 2, D)  # per head: query, then gate
        gate = np.ascontiguousarray(qg[:, :, 1]).reshape(T, H * D)
        q = rms_norm(np.ascontiguousarray(qg[:, :, 0]), self.q_norm, self.eps)  # [T, H, D], per head
        k = rms_norm(np.ascontiguousarray(k).reshape(T, KV, D), self.k_norm, self.eps)
        q[..., :r] = rope.apply(np.ascontiguousarray(q[..., :r]), positions)
        k[..., :r] = rope.apply(np.ascontiguousarray(k[..., :r]), positions)
        return q, k, np.ascontiguousarray(v).reshape(T, KV, D), gate


class GatedDeltaNet:
    """Linear attention with the gated delta rule; `index` is its slot in HybridCache.conv / ssm."""

    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str, index: int):
        E = cfg.hidden_size
        self.index = index
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.Dk, self.Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.K = cfg.linear_conv_kernel_dim
        kd, vd = self.Hk * self.Dk, self.Hv * self.Dv
        self.channels = 2 * kd + vd
        gguf = cfg.gguf_layout  # loaders/names.py: llama.cpp's qwen35 layout
        shapes = {
            "in_proj_qkv.weight": (self.channels, E),
            "in_proj_z.weight": (vd, E),
            "in_proj_b.weight": (self.Hv, E),
            "in_proj_a.weight": (self.Hv, E),
            "conv1d.weight": (self.channels, self.K) if gguf else (self.channels, 1, self.K),
            "A" if gguf else "A_log": (self.Hv,),
            "dt_bias": (self.Hv,),
            "norm.weight": (self.Dv,),
            "out_proj.weight": (E, vd),
        }
        for name, shape in shapes.items():
            _check(get, prefix + name, shape)
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.proj = FusedLinear([get.weight(prefix + n + ".weight") for n in names], get.activations)
        self.conv_w = np.ascontiguousarray(get.array(prefix + "conv1d.weight").reshape(self.channels, self.K))
        if gguf:  # A = -exp(A_log) as stored
            self.neg_A = get.array(prefix + "A")  # [Hv]
        else:
            self.neg_A = (-np.exp(get.array(prefix + "A_log"))).astype(np.float32)  # [Hv]
        # the key head each value head reads: HF groups a key head's value heads together,
        # llama.cpp's converter tiles them (all key heads' first value heads, then the seconds)
        heads = np.arange(self.Hv, dtype=np.int64)
        self.key_head = heads % self.Hk if gguf else heads // (self.Hv // self.Hk)
        self.dt_bias = get.array(prefix + "dt_bias")  # [Hv]
        self.norm = get.array(prefix + "norm.weight")  # [Dv], applied as is
        self.out = prepare(get.weight(prefix + "out_proj.weight"), get.activations)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: np.ndarray, segments: list[Segment], bounds: np.ndarray, rows: set) -> np.ndarray:
        """x [N, E] (normed) -> [N, E]; advances each segment's recurrent state. rows: the caches
        whose state is kept after each of their rows (several rows of one sequence: verification)."""
        qkv, z, b, a = self.proj(x)  # [N, C] [N, Hv*Dv] [N, Hv] [N, Hv]
        y = np.empty((len(x), self.Hv * self.Dv), np.float32)  # [N, Hv*Dv]
        for j, s in enumerate(segments):
            lo, hi = bounds[j], bounds[j + 1]
            cache, i = s.cache, self.index
            proj = (qkv[lo:hi], z[lo:hi], b[lo:hi], a[lo:hi])
            layer = (self.conv_w, self.neg_A, self.dt_bias, self.norm, self.key_head, self.Hk, self.Dk, self.eps)
            y[lo:hi] = gated_deltanet(proj, layer, cache.conv[i], cache.ssm[i])
            if id(cache) in rows:
                cache.keep_row(s.start + hi - lo, i)
        return linear(y, self.out)  # [N, E]


class SharedExpertMoE:
    """Qwen3.5-MoE's block: the routed experts (qwen3_moe.MoEBlock) plus a shared expert scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, routed, shared: MLP, gate: Weight):
        self.routed, self.shared, self.gate = routed, shared, gate

    def __call__(self, x: np.ndarray) -> np.ndarray:
        shared = self.shared(x) * sigmoid(linear(x, self.gate))  # [T, E] * [T, 1]
        return self.routed(x) + shared


def qwen3_5_mlp(cfg: ModelConfig, get: WeightSource, i: int, prefix: str):
    if not cfg.is_moe:
        return dense_mlp(cfg, get, i, prefix)
    from .qwen3_moe import moe_mlp_factory

    routed = moe_mlp_factory(cfg, get, i, prefix)
    if not cfg.shared_expert_intermediate_size:
        return routed
    shared = dense_mlp(cfg, get, i, prefix + "shared_expert.")
    _check(get, prefix + "shared_expert_gate.weight", (1, cfg.hidden_size))
    return SharedExpertMoE(routed, shared, Weight.from_array(get.array(prefix + "shared_expert_gate.weight")))


class HybridLayer:
    """One Qwen3.5 layer: `attn` (GatedAttention) or `deltanet` (GatedDeltaNet), then the MLP.
    `index` is the layer's slot in its kind of per-sequence state."""

    def __init__(self, cfg: ModelConfig, get: WeightSource, i: int, mlp_factory):
        p = f"model.layers.{i}."
        self.full = cfg.layer_types[i] == "full_attention"
        self.index = sum(1 for t in cfg.layer_types[:i] if t == cfg.layer_types[i])
        self.input_norm = _offset_norm(get, p + "input_layernorm.weight", cfg)
        self.post_norm = _offset_norm(get, p + "post_attention_layernorm.weight", cfg)
        self.attn = GatedAttention(cfg, get, p + "self_attn.") if self.full else None
        self.deltanet = None if self.full else GatedDeltaNet(cfg, get, p + "linear_attn.", self.index)
        self.mlp = mlp_factory(cfg, get, i, p + "mlp.")
        self.eps = cfg.rms_norm_eps


class Qwen3_5(Decoder):
    """The hybrid decoder. Decoder gives it the embedding, head, attention over the KV cache,
    the forward's dispatch and the fused decode step (FusedDecode plans Qwen3.5's layers too).
    `mtp`: its MTP layer (qwen3_5_mtp.MTPHead, set by models.build_model), None where the
    checkpoint has none."""

    mtp = None

    def __init__(self, cfg: ModelConfig, tensors, quantize=None, progress=None, activations="f32"):
        super().__init__(cfg, tensors, quantize, qwen3_5_mlp, progress, activations)

    @staticmethod
    def build_layer(cfg, get, i, mlp_factory):
        return HybridLayer(cfg, get, i, mlp_factory)

    def norm_weight(self, get: WeightSource, name: str) -> np.ndarray:
        return _offset_norm(get, name, self.config)

    def new_cache(self, capacity: int, kv_dtype: str = "f32") -> HybridCache:
        c = self.config
        n_full = len(c.full_attention_layers)
        n_lin = c.num_hidden_layers - n_full
        channels = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        )
        return HybridCache(
            n_full,
            c.num_key_value_heads,
            c.head_dim,
            capacity,
            kv_dtype,
            conv_shape=(n_lin, c.linear_conv_kernel_dim - 1, channels),
            ssm_shape=(n_lin, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
        )

    def _staged(self, segments: list[Segment], all_logits: bool = False, with_last: bool = False):
        tokens, positions, bounds = self.staged_inputs(segments)
        # caches that keep the state after each decoded row, to roll back to (verification, a
        # draft model's cache: KVCache.keep_every_row)
        rows = {id(s.cache) for s in segments if s.decode and s.cache.keep_every_row}
        self.start_traces(segments)
        x = self.embed_rows(tokens)  # [N, E]
        rope = None
        vis = [(bounds[j], s.vision) for j, s in enumerate(segments) if s.vision is not None]
        if vis or any(s.rope_delta for s in segments):  # after images (Qwen3_5VL): M-RoPE rows, no DeepStack
            x, rope, positions = self._multimodal_inputs(segments, bounds, x, vis)
        for layer in self.layers:
            h = rms_norm(x, layer.input_norm, layer.eps)  # [N, E]
            if layer.full:  # the stages report to self.timer (models.timing)
                q, k, v, gate = self.project_qkv(layer, h, positions, rope)  # [N, H, D] [N, KV, D] x2, [N, H*D]
                out = self.attend(layer, segments, bounds, q, k, v).reshape(len(x), -1)  # [N, H*D]
                del q, k, v
                x += self.project_out(layer, out * sigmoid(gate))  # [N, E]
            else:
                t0 = time.perf_counter()
                x += layer.deltanet(h, segments, bounds, rows)  # [N, E]
                if self.timer is not None:  # the DeltaNet's mixing counts as attention
                    self.timer.add("attend", t0)
            del h
            x += self.mlp_block(layer, x)  # [N, E]
        return self.staged_logits(segments, x, bounds, all_logits, with_last)


class Qwen3_5VL(ImageInput, Qwen3_5):
    """Qwen3.5 with its vision tower (Qwen3-VL's without DeepStack): image embeddings replace the
    image pads before the first layer, so the Gated DeltaNet layers just see them; the gated
    full-attention layers take the 3-axis M-RoPE positions on their rotary dims."""

    def __init__(self, cfg, tensors, vision, quantize=None, progress=None, activations="f32"):
        self.check_vision(cfg, vision)
        if vision.deepstack_visual_indexes:
            ds = vision.deepstack_visual_indexes
            raise SparrowError(f"Qwen3.5's vision tower has no DeepStack mergers; this one has {len(ds)}")
        super().__init__(cfg, tensors, quantize, progress, activations)
        self.attach_vision(tensors, vision)
