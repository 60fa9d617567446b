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
# Qwen3.5 (qwen35 / qwen35moe): llama.cpp's converter names the Gated DeltaNet's tensors after
# Mamba's. Its values differ from HF's in three ways the model reads from the config
# (ModelConfig.gguf_layout): norms other than the DeltaNet's store 1 + weight, ssm_a stores
# A = -exp(A_log), and with more value heads than key heads the value heads are tiled.
_GGUF_BLOCK.update(
    {
        "post_attention_norm": "post_attention_layernorm",
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_conv1d": "linear_attn.conv1d",
        "ssm_norm": "linear_attn.norm",
        "ssm_out": "linear_attn.out_proj",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    }
)
# Qwen3.5's MTP layer: llama.cpp's converter writes it as block num_hidden_layers (its decoder
# layer under the usual names, the head's own tensors under nextn.); HF keeps it under mtp.
_GGUF_NEXTN = {
    "eh_proj": "mtp.fc",
    "enorm": "mtp.pre_fc_norm_embedding",
    "hnorm": "mtp.pre_fc_norm_hidden",
    "shared_head_norm": "mtp.norm",
}
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.([a-z0-9_]+)\.weight$")
_GGUF_BARE = {"ssm_a": "linear_attn.A", "ssm_dt.bias": "linear_attn.dt_bias"}  # no .weight / .bias in HF
_BARE = re.compile(r"^blk\.(\d+)\.(ssm_a|ssm_dt\.bias)$")
_BLK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")


def gguf_to_hf(name: str, mtp_block: int | None = None) -> str | None:
    """HF name for a GGUF tensor, or None for tensors sparrow does not use (e.g. rope_freqs).
    mtp_block: the block that holds Qwen3.5's MTP layer (its tensors become mtp.*), if any."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _NEXTN.match(name)
    if m:
        ok = mtp_block is not None and int(m.group(1)) == mtp_block and m.group(2) in _GGUF_NEXTN
        return _GGUF_NEXTN[m.group(2)] + ".weight" if ok else None
    m = _BARE.match(name) or _BLK.match(name)
    if not m:
        return None
    block = "mtp.layers.0" if mtp_block is not None and int(m.group(1)) == mtp_block else f"model.layers.{m.group(1)}"
    if m.re is _BARE:
        return f"{block}.{_GGUF_BARE[m.group(2)]}"
    if m.group(2) not in _GGUF_BLOCK:
        return None
    return f"{block}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"


def normalize_hf(name: str) -> str:
    """Checkpoint-specific prefixes -> the plain causal-LM names (Qwen3-VL nests the text model;
    Qwen3.5's MTP layer is mtp.*, model.mtp.* in some exports)."""
    if name.startswith("model.mtp."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def llama_unpermute_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved -> rotate-half RoPE layout)."""
    # The converter stored row (h, 2*i + j) from original row (h, j*hd/2 + i); gather it back.
    rows = np.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2)
    return rows.swapaxes(1, 2).reshape(-1)


# llama.cpp mmproj (clip.projector_type qwen3vl_merger) -> Hugging Face names of Qwen3-VL's vision tower.
_MMPROJ_GLOBAL = {
    "v.position_embd.weight": "model.visual.pos_embed.weight",
    "v.patch_embd.bias": "model.visual.patch_embed.proj.bias",
    "v.post_ln.weight": "model.visual.merger.norm.weight",
    "v.post_ln.bias": "model.visual.merger.norm.bias",
    "mm.0.weight": "model.visual.merger.linear_fc1.weight",
    "mm.0.bias": "model.visual.merger.linear_fc1.bias",
    "mm.2.weight": "model.visual.merger.linear_fc2.weight",
    "mm.2.bias": "model.visual.merger.linear_fc2.bias",
}
_MMPROJ_BLOCK = {
    "attn_qkv": "attn.qkv",
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_up": "mlp.linear_fc1",
    "ffn_down": "mlp.linear_fc2",
}
_MMPROJ_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
# The Conv3d patch embedding is stored as one Conv2d weight per temporal frame.
MMPROJ_PATCH_FRAMES = ("v.patch_embd.weight", "v.patch_embd.weight.1")
MMPROJ_PATCH_HF = "model.visual.patch_embed.proj.weight"
_V_BLK = re.compile(r"^v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_V_DS = re.compile(r"^v\.deepstack\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")


def mmproj_to_hf(name: str, deepstack_layers: list[int]) -> str | None:
    """HF name for an mmproj tensor (None: not used, or a patch-embedding frame, see
    MMPROJ_PATCH_FRAMES). v.deepstack.N is named by vision layer N; HF numbers the mergers
    0.. in the order of deepstack_visual_indexes."""
    if name in _MMPROJ_GLOBAL:
        return _MMPROJ_GLOBAL[name]
    m = _V_BLK.match(name)
    if m and m.group(2) in _MMPROJ_BLOCK:
        return f"model.visual.blocks.{m.group(1)}.{_MMPROJ_BLOCK[m.group(2)]}.{m.group(3)}"
    m = _V_DS.match(name)
    if m and m.group(2) in _MMPROJ_DEEPSTACK and int(m.group(1)) in deepstack_layers:
        j = deepstack_layers.index(int(m.group(1)))
        return f"model.visual.deepstack_merger_list.{j}.{_MMPROJ_DEEPSTACK[m.group(2)]}.{m.group(3)}"
    return None
