"""A tiny random Qwen3-VL built with transformers, with odd sizes: vision hidden 48 (not a
power of two) over 3 heads, DeepStack after vision blocks 0 and 2 (non-consecutive), a 6x6
learned position grid, mrope_section [4, 6, 6] (not the default), 3 text layers. Its folder
carries the default model's tokenizer plus Qwen3-VL's three vision tokens (ids 49152..49154)."""

from __future__ import annotations

import os

import numpy as np

import reference_models as rm

VOCAB = rm.VOCAB + 8
START, END, PAD = rm.VOCAB, rm.VOCAB + 1, rm.VOCAB + 2  # <|vision_start|> <|vision_end|> <|image_pad|>
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=5e6,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 6, 6], "mrope_interleaved": True},
)
VISION = dict(
    depth=4,
    hidden_size=48,
    intermediate_size=80,
    num_heads=3,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=36,
    deepstack_visual_indexes=[0, 2],
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 64 * 64, "longest_edge": 160 * 160},
}


def build_tiny_vl(out_dir: str, tokenizer_dir: str):
    """Saves the seeded model (f32 safetensors), the tokenizer and preprocessor_config.json to
    out_dir; returns the transformers model (f32, eval)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(13)
    cfg = Qwen3VLConfig(
        text_config=TEXT, vision_config=VISION, image_token_id=PAD, vision_start_token_id=START, vision_end_token_id=END
    )
    model = Qwen3VLForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2 if "language_model" in name or "lm_head" in name else 0.08)
            elif "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.05)  # non-trivial norms and biases
    model.save_pretrained(out_dir)
    _tokenizer_and_preprocessor(out_dir, tokenizer_dir)
    return model


def _tokenizer_and_preprocessor(out_dir: str, tokenizer_dir: str) -> None:
    """The default model's tokenizer plus the three vision tokens, and preprocessor_config.json."""
    import json

    from tokenizers import AddedToken, Tokenizer

    rm.copy_tokenizer(tokenizer_dir, out_dir)
    tj = os.path.join(out_dir, "tokenizer.json")
    tok = Tokenizer.from_file(tj)
    added = tok.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")]
    )
    assert added == 3 and tok.token_to_id("<|image_pad|>") == PAD
    tok.save(tj)
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f)


# Qwen3.5 with images: the hybrid text decoder (odd sizes as tests/test_qwen3_5.py's: more value
# heads than key heads, key and value head dims that differ, 12 of 24 head dims rotating) and
# Qwen3-VL's vision tower without DeepStack. The dense model names mrope_section [2, 1, 3] (not
# the default); the MoE model names none, so transformers' default [11, 11, 10] applies.
QWEN3_5_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=80,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=12,
    linear_value_head_dim=10,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    tie_word_embeddings=False,
)
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
QWEN3_5_SPECS = {
    "dense": dict(QWEN3_5_TEXT, rope_parameters=dict(QWEN3_5_ROPE, mrope_section=[2, 1, 3], mrope_interleaved=True)),
    "moe": dict(
        QWEN3_5_TEXT,
        rope_parameters=dict(QWEN3_5_ROPE),
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    # every projection's input a multiple of 32, so a q8_0 model takes the fused decode step
    "blocks": dict(
        QWEN3_5_TEXT,
        rope_parameters=dict(QWEN3_5_ROPE, mrope_section=[3, 3, 2], mrope_interleaved=True),
        intermediate_size=96,
        num_attention_heads=2,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
}
QWEN3_5_VISION = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}


def build_tiny_qwen3_5_vl(out_dir: str, tokenizer_dir: str, kind: str = "dense"):
    """Qwen3_5ForConditionalGeneration (kind "dense") or Qwen3_5MoeForConditionalGeneration
    ("moe"; "blocks": dense with block-format-friendly shapes), seeded, saved as build_tiny_vl saves
    its model; returns the transformers model."""
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    cfg_cls, model_cls = {
        "dense": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
        "moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration),
        "blocks": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
    }[kind]
    torch.manual_seed(17 if kind == "dense" else 18)
    cfg = cfg_cls(
        text_config=QWEN3_5_SPECS[kind],
        vision_config=QWEN3_5_VISION,
        image_token_id=PAD,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.3, 3.0)))
            elif p.dim() >= 2:
                p.normal_(0.0, 0.2 if "language_model" in name or "lm_head" in name else 0.08)
            else:  # norms (1 + w in the text model), biases, dt_bias
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    _tokenizer_and_preprocessor(out_dir, tokenizer_dir)
    return model


def hf_logits(model, ids, pixel_values=None, grids=None) -> np.ndarray:
    """transformers' logits [T, V] for ids (image pads expanded) and the images' pixels."""
    import torch

    ids_t = torch.tensor(np.asarray(ids, np.int64))[None]
    kw = {}
    if pixel_values is not None:
        kw = dict(
            pixel_values=torch.from_numpy(np.asarray(pixel_values, np.float32)),
            image_grid_thw=torch.tensor(np.asarray(grids, np.int64)),
            mm_token_type_ids=(ids_t == PAD).int(),
        )
    with torch.no_grad():
        return model(input_ids=ids_t, **kw).logits[0].float().numpy()


class _TextPart:
    """The text model of a Qwen3VLForConditionalGeneration as reference_models.write_gguf reads
    a causal LM: .config and .state_dict() under model.layers.* names."""

    def __init__(self, model):
        self.config = model.config.text_config
        self.config.tie_word_embeddings = model.config.tie_word_embeddings
        self._model = model

    def state_dict(self):
        out = {}
        for k, v in self._model.state_dict().items():
            if k.startswith("model.language_model."):
                out["model." + k[len("model.language_model.") :]] = v
            elif k == "lm_head.weight":
                out[k] = v
        return out


def write_vl_gguf(model, text_path: str, mmproj_path: str, text_arch: str = "qwen3vl") -> None:
    """llama.cpp's pair for the model: a qwen3vl text GGUF (F16 matrices; the default model's
    tokenizer plus the three vision tokens) and an mmproj GGUF (clip.* metadata, v.*/mm.*
    tensors, F16 matrices, the Conv3d split into its two temporal slices), named and laid out
    as convert_hf_to_gguf.py writes them."""
    import gguf

    tok = rm.default_tokenizer_metadata()
    extra_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    extra_tokens += [f"[PAD{i}]" for i in range(VOCAB - rm.VOCAB - 3)]
    tok = dict(
        tok,
        tokens=list(tok["tokens"]) + extra_tokens,
        token_type=list(tok["token_type"]) + [3, 3, 3] + [5] * (VOCAB - rm.VOCAB - 3),
    )
    sec = list(TEXT["rope_parameters"]["mrope_section"]) + [0]
    n_ds = len(VISION["deepstack_visual_indexes"])

    def text_meta(w):
        w.add_rope_dimension_sections(sec)
        w.add_num_deepstack_layers(n_ds)

    rm.write_gguf(_TextPart(model), text_arch, text_path, "F16", tok, extra=text_meta)

    v = model.config.vision_config
    w = gguf.GGUFWriter(mmproj_path, "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("qwen3vl_merger")
    w.add_vision_patch_size(v.patch_size)
    w.add_vision_embedding_length(v.hidden_size)
    w.add_vision_feed_forward_length(v.intermediate_size)
    w.add_vision_projection_dim(v.out_hidden_size)
    w.add_vision_block_count(v.depth)
    w.add_vision_head_count(v.num_heads)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean(PREPROCESSOR["image_mean"])
    w.add_vision_image_std(PREPROCESSOR["image_std"])
    w.add_vision_spatial_merge_size(v.spatial_merge_size)
    w.add_vision_use_gelu(True)
    w.add_vision_is_deepstack_layers([i in v.deepstack_visual_indexes for i in range(v.depth)])
    w.add_vision_min_pixels(PREPROCESSOR["size"]["shortest_edge"])
    w.add_vision_max_pixels(PREPROCESSOR["size"]["longest_edge"])
    block = {"attn.qkv": "attn_qkv", "attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2"}
    block.update({"mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"})
    for name, t in model.state_dict().items():
        if not name.startswith("model.visual."):
            continue
        a = t.detach().float().numpy()
        n = name[len("model.visual.") :]
        if n == "patch_embed.proj.weight":
            parts = [("v.patch_embd.weight", a[:, :, 0]), ("v.patch_embd.weight.1", a[:, :, 1])]
        elif n == "patch_embed.proj.bias":
            parts = [("v.patch_embd.bias", a)]
        elif n == "pos_embed.weight":
            parts = [("v.position_embd.weight", a)]
        elif n.startswith("merger."):
            sub, kind = n[len("merger.") :].rsplit(".", 1)
            parts = [({"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[sub] + "." + kind, a)]
        elif n.startswith("deepstack_merger_list."):
            _, j, sub, kind = n.split(".")
            layer = v.deepstack_visual_indexes[int(j)]
            short = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}[sub]
            parts = [(f"v.deepstack.{layer}.{short}.{kind}", a)]
        else:
            _, i, rest = n.split(".", 2)
            sub, kind = rest.rsplit(".", 1)
            parts = [(f"v.blk.{i}.{block[sub]}.{kind}", a)]
        for gname, arr in parts:
            arr = np.ascontiguousarray(arr)
            w.add_tensor(gname, arr.astype(np.float32) if arr.ndim == 1 else arr.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
