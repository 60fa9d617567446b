"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE and an explicit head_dim.

Config flags (sparrow/config.py): qk_norm (decoder.Attention.qkv applies q_norm / k_norm per
head, over head_dim); no q/k/v bias.
Layers: as Llama (llama.py): RMSNorm, SwiGLU MLP (layers.py), RoPE (rope.py). Qwen3-MoE
(qwen3_moe.py) swaps the MLP for its MoE block; Qwen3-VL (qwen3_vl.py) adds M-RoPE and the
vision tower.
"""

from __future__ import annotations

from .decoder import Decoder


class Qwen3(Decoder):
    """A Qwen3 checkpoint: the shared DecoderLayer, its attention with q/k norm."""
