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
    import json

    import torch
    from tokenizers import AddedToken, Tokenizer
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
