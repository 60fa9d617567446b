"""Qwen3.5's multi-token-prediction (MTP) layer: the draft head its checkpoints carry
(`mtp_num_hidden_layers` 1; HF tensors under `mtp.`, llama.cpp's converter writes them as the
block after the decoder's, `blk.N.nextn.*` and the layer's usual names: loaders/names.py).

What it computes (vLLM's Qwen3_5MultiTokenPredictor, the facts llama.cpp's converter agrees
with): for position i, with h_i the target's hidden state after its final norm (the row its
head turns into the logits of token i + 1) and t_{i+1} the token that followed,

    x = fc(concat(norm_e(embed(t_{i+1})), norm_h(h_i)))        fc: [E, 2E], embedding first
    x = a full-attention Qwen3.5 decoder layer (gated attention, partial rotary at position i,
        its own K/V cache; then its MLP, MoE in MoE models)
    y = norm(x);  logits = the target's lm_head(y)               the logits of token i + 2

All three norms are Qwen3.5's (1 + weight). The embedding and lm_head are the target's. A
further draft step feeds its own y as the next h (vLLM's MTP proposer does the same).
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..kernels.linear import linear, prepare
from ..state.cache import KVCache
from .decoder import Segment, WeightSource
from .layers import rms_norm
from .qwen3_5 import GatedAttention, _check, _offset_norm, qwen3_5_mlp, sigmoid

PREFIX = "mtp."


def has_mtp(get: WeightSource) -> bool:
    """Whether the checkpoint carries the MTP layer (its fc; the rest is then required)."""
    return get.has(PREFIX + "fc.weight")


class MTPLayer:
    """The MTP's decoder layer: always full attention, index 0 of the head's own cache."""

    full = True
    index = 0

    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str):
        E = cfg.hidden_size
        for name in ("input_layernorm", "post_attention_layernorm"):
            _check(get, prefix + name + ".weight", (E,))
        self.input_norm = _offset_norm(get, prefix + "input_layernorm.weight", cfg)
        self.post_norm = _offset_norm(get, prefix + "post_attention_layernorm.weight", cfg)
        self.attn = GatedAttention(cfg, get, prefix + "self_attn.")
        if not cfg.is_moe:
            I = cfg.intermediate_size  # noqa: E741
            for name, shape in (("gate_proj", (I, E)), ("up_proj", (I, E)), ("down_proj", (E, I))):
                _check(get, prefix + "mlp." + name + ".weight", shape)
        self.mlp = qwen3_5_mlp(cfg, get, cfg.num_hidden_layers, prefix + "mlp.")
        self.eps = cfg.rms_norm_eps


class MTPHead:
    """The MTP layer of a Qwen3.5 model (model.mtp), run against the target model's embedding,
    RoPE, attention stages and lm_head."""

    def __init__(self, cfg: ModelConfig, get: WeightSource):
        E = cfg.hidden_size
        _check(get, PREFIX + "fc.weight", (E, 2 * E))
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            _check(get, PREFIX + name + ".weight", (E,))
        self.fc = prepare(get.weight(PREFIX + "fc.weight"), get.activations)
        self.norm_e = _offset_norm(get, PREFIX + "pre_fc_norm_embedding.weight", cfg)
        self.norm_h = _offset_norm(get, PREFIX + "pre_fc_norm_hidden.weight", cfg)
        self.norm = _offset_norm(get, PREFIX + "norm.weight", cfg)
        self.layer = MTPLayer(cfg, get, PREFIX + "layers.0.")
        self.eps = cfg.rms_norm_eps
        self.config = cfg

    def new_cache(self, capacity: int, kv_dtype: str = "f32") -> KVCache:
        c = self.config
        return KVCache(1, c.num_key_value_heads, c.head_dim, capacity, kv_dtype)

    def forward(self, model, tokens, hidden: np.ndarray, cache: KVCache, start: int, positions, last_only=True):
        """Rows for positions `positions` [T] (consecutive): tokens [T] (t_{i+1}), hidden [T, E]
        (h_i), written to `cache` at rows start.. (the cache's row = position minus where the
        head's cache began). -> (logits [1, V] of the last row, or [T, V] without last_only;
        y [T, E], the next step's hidden)."""
        T, layer = len(tokens), self.layer
        tokens = np.asarray(tokens, np.int64)
        e = rms_norm(model.embed_rows(tokens), self.norm_e, self.eps)  # [T, E]
        h = rms_norm(np.ascontiguousarray(hidden, dtype=np.float32), self.norm_h, self.eps)  # [T, E]
        x = linear(np.concatenate([e, h], axis=1), self.fc)  # [T, 2E] -> [T, E]
        del e, h
        hn = rms_norm(x, layer.input_norm, layer.eps)
        q, k, v, gate = layer.attn.qkv(hn, model.rope, np.asarray(positions, np.int64))
        seg = Segment(tokens, cache, start, decode=T == 1)
        out = model.attend(layer, [seg], np.array([0, T]), q, k, v).reshape(T, -1)  # [T, H*D]
        x += model.project_out(layer, out * sigmoid(gate))
        x += model.mlp_block(layer, x)
        cache.length = start + T
        y = rms_norm(x, self.norm, self.eps)  # [T, E]
        logits = linear(np.ascontiguousarray(y[-1:] if last_only else y), model.lm_head)
        return logits, y
