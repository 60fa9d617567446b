"""All tensor renaming lives here: sparrow uses Hugging Face names everywhere else."""

from __future__ import annotations

import re

import numpy as np

# GGUF (llama.cpp converter) -> Hugging Face names.
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    # Stacked experts [E, out, in]; HF keeps one tensor per expert, the MoE block accepts both.
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf(name: str) -> str | None:
    """HF name for a GGUF tensor, or None for tensors sparrow does not use (e.g. rope_freqs)."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _BLK.match(name)
    if not m or m.group(2) not in _GGUF_BLOCK:
        return None
    return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"


def normalize_hf(name: str) -> str:
    """Checkpoint-specific prefixes -> the plain causal-LM names (Qwen3-VL nests the text model)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def llama_unpermute_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved -> rotate-half RoPE layout)."""
    # The converter stored row (h, 2*i + j) from original row (h, j*hd/2 + i); gather it back.
    rows = np.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2)
    return rows.swapaxes(1, 2).reshape(-1)
