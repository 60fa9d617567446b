"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file.

transformers dequantises the GGUF to f32 (`from_pretrained(dir, gguf_file=..., dtype=f32)`) and
undoes llama.cpp's q/k permutation itself, so this checks sparrow's Q4_1/Q8_0 kernels, its
un-permutation and the whole decoder on the real model. Tolerance: max |diff| <= 5e-4 over
the logits [measured 5.7e-5], top-1 identical at all 50 positions (smallest reference top-2
margin there: 0.028).
"""

from __future__ import annotations

import numpy as np
import pytest

import reference_models as rm
from conftest import decode_logits

TEXT = (
    "The history of the city of Paris goes back more than two thousand years. Long before it became "
    "the capital of France, a Celtic people known as the Parisii settled on an island in the river "
    "Seine, where they traded, fished and minted their own gold coins."
)
TOL = 5e-4

# Greedy chat answers (max 32 tokens) from transformers 5.2x / torch 2.13 CPU f32 on the same
# GGUF, default system prompt from the chat template.
GOLDEN = {
    "What is the capital of France?": (
        [504, 3575, 282, 4649, 314, 7042, 30, 2],  # ends with <|im_end|>
        "The capital of France is Paris.",
    ),
    "Give me three tips for staying healthy.": (
        [
            33,
            30,
            13138,
            22892,
            42,
            26883,
            7568,
            282,
            913,
            28,
            2117,
            981,
            260,
            2817,
            30,
            216,
            34,
            30,
            16478,
            253,
            8609,
            2714,
            42,
            330,
            8609,
            2714,
            416,
            724,
            469,
            1248,
            2951,
            2458,
        ],
        "1. Stay hydrated: Drink plenty of water, especially during the heat. 2. Eat a balanced diet: "
        "A balanced diet can help your body stay healthy",
    ),
}


@pytest.fixture(scope="module")
def hf_default():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        rm.default_gguf_dir(), gguf_file=rm.DEFAULT_GGUF_NAME, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def text_ids(default_llm):
    ids = default_llm.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) >= 50
    return np.asarray(ids[:50], np.int64)


def _hf_logits(hf, ids):
    import torch

    with torch.no_grad():
        return hf(torch.tensor(ids)[None]).logits[0].float().numpy()


def test_default_model_config(default_llm):
    c = default_llm.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (c.head_dim, c.vocab_size, c.tie_word_embeddings, c.rope_theta) == (64, 49152, True, 100000.0)


def test_default_logits_match_transformers(default_llm, hf_default, text_ids):
    ref = _hf_logits(hf_default, text_ids)
    # The decode path (one token per forward, KV cache) over the first 24 positions.
    dec = decode_logits(default_llm, text_ids[:24], prefill=4)
    for what, got, want in (("prefill", default_llm.logits(text_ids), ref), ("decode", dec, ref[:24])):
        err = np.abs(got - want).max()
        assert err <= TOL, f"{what}: max |diff| {err:.3g}"
        assert np.array_equal(got.argmax(-1), want.argmax(-1)), f"{what}: top-1 differs"


def test_golden_is_transformers_greedy(default_llm, hf_default):
    """The pinned golden really is transformers' greedy output (the short one, to save time)."""
    import torch

    q = "What is the capital of France?"
    ids = default_llm.prompt_ids(q, chat=True)
    with torch.no_grad():
        out = hf_default.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
    assert out == GOLDEN[q][0]


@pytest.mark.parametrize("question", list(GOLDEN))
def test_default_greedy_chat_golden(default_llm, question):
    want_ids, want_text = GOLDEN[question]
    outs = list(default_llm.stream(question, chat=True, max_tokens=32, temperature=0.0))
    assert [o.token_id for o in outs] == want_ids
    assert "".join(o.text for o in outs) == want_text
    assert outs[-1].finish_reason == ("stop" if want_ids[-1] == 2 else "length")
