"""Qwen2 (Qwen2.5): the Llama decoder with q/k/v biases.

Config flags (sparrow/config.py): attention_bias (the biases are added after the fused q/k/v
projection, decoder.Attention.qkv); no q/k norm.
Layers: as Llama (llama.py): RMSNorm, SwiGLU MLP (layers.py), RoPE (rope.py).
"""

from __future__ import annotations

from .decoder import Decoder


class Qwen2(Decoder):
    """A Qwen2 checkpoint: the shared DecoderLayer, its attention with q/k/v biases."""
