"""Qwen3-VL folders: sparrow runs the text decoder (model.language_model.*) and must match
transformers' Qwen3VLForConditionalGeneration on text-only input (M-RoPE with equal
t/h/w positions reduces to plain RoPE; no image means no deepstack injection)."""

import numpy as np
import torch

import reference_models as rm
import sparrow


def test_tiny_qwen3_vl_text_logits_match_transformers(tmp_path, tokenizer_dir):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(
        vocab_size=rm.VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=5e6,
        max_position_embeddings=512,
        rope_scaling={"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True},
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        deepstack_visual_indexes=[0],
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)  # clear top-1 margins
    model.save_pretrained(tmp_path)
    rm.copy_tokenizer(tokenizer_dir, str(tmp_path))
    ids = np.random.default_rng(0).integers(17, rm.VOCAB, 24)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)[None]).logits[0].numpy()
    llm = sparrow.load(str(tmp_path))
    assert llm.config.architecture == "qwen3" and llm.config.rope_theta == 5e6
    ours = llm.logits(ids)
    assert np.abs(ours - ref).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
