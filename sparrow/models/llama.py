"""Llama (SmolLM2, Llama 3.x): the shared decoder (decoder.py) as it is.

Config flags (sparrow/config.py): no q/k/v bias, no q/k norm.
Layers: RMSNorm and the SwiGLU MLP (layers.py), attention over the KV cache (decoder.Attention,
attention.py) with RoPE (rope.py: plain, linear, llama3 or YaRN scaling).
"""

from __future__ import annotations

from .decoder import Decoder


class Llama(Decoder):
    """A Llama checkpoint: every layer the shared DecoderLayer with its dense SwiGLU MLP."""
