"""GGUF loading: the tiny transformers models written as llama.cpp's converter writes them.

Each tiny model is written with gguf.GGUFWriter (llama.cpp tensor names, ggml shapes, the
converter's metadata keys, the default model's tokenizer), matrices as F16 or Q8_0, norms and
biases F32; the llama GGUF has its q/k rows permuted like llama.cpp's converter does.

Tolerances (measured in brackets):
- against transformers run on the same rounded weights (f16 or Q8_0 dequantised), prefill
  and decode: max |diff| <= 1e-4 [~2e-5], top-1 identical (exact arithmetic on stored values).
- against sparrow on the f32 safetensors folder (the quantisation's own error): F16 max
  relative <= 1e-2 [2e-3..4e-3], top-1 >= 0.95 [1.0]; Q8_0 RMS relative <= 0.12 [0.033..0.053],
  top-1 >= 0.75 over 64 positions [0.89..0.97] (random models amplify weight rounding).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import reference_models as rm
import sparrow
from conftest import decode_logits, prompt, rel_err, rms_err, top1_agreement

EXACT = 1e-4
T = 64


@pytest.fixture(scope="module")
def gguf_llms(tiny_models, tmp_path_factory):
    """(arch, qtype) -> (sparrow LLM loaded from the GGUF, its GGUF path)."""
    meta = rm.default_tokenizer_metadata()
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, qtype in (("qwen2", "F16"), ("qwen2", "Q8_0"), ("qwen3", "F16"), ("qwen3", "Q8_0"), ("llama", "F16")):
        path = str(d / f"tiny-{arch}-{qtype}.gguf")
        rm.write_gguf(tiny_models[arch].hf, arch, path, qtype, meta)
        out[arch, qtype] = (sparrow.load(path), path)
    return out


@pytest.fixture(scope="module")
def folder_logits(tiny_models):
    ids = prompt(T, seed=11)
    return ids, {a: sparrow.load(tiny_models[a].folder).logits(ids) for a in ("qwen2", "qwen3")}


def assert_exact(got, ref, what):
    err = np.abs(got - ref).max()
    assert err <= EXACT, f"{what}: max |diff| {err:.3g} > {EXACT}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1)), f"{what}: top-1 differs"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_gguf_config_matches_folder(arch, gguf_llms, tiny_models):
    got = dataclasses.asdict(gguf_llms[arch, "F16"][0].config)
    want = dataclasses.asdict(sparrow.load(tiny_models[arch].folder).config)
    # GGUF stores the epsilon as float32.
    assert got.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)
    assert got == want


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_f16(arch, gguf_llms, tiny_models, folder_logits):
    llm = gguf_llms[arch, "F16"][0]
    assert llm.model.layers[0].attn.o.qtype == "f16"
    ids, folder = folder_logits
    got = llm.logits(ids)
    tiny = tiny_models[arch]
    assert_exact(got, tiny.ref_logits(ids, rm.rounded_copy(tiny.hf, "f16", rm.is_matrix)), f"{arch} F16")
    assert rel_err(got, folder[arch]) <= 1e-2
    assert top1_agreement(got, folder[arch]) >= 0.95


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_q8_0(arch, gguf_llms, tiny_models, folder_logits):
    llm = gguf_llms[arch, "Q8_0"][0]
    assert llm.model.layers[0].attn.o.qtype == "q8_0" and llm.model.embed.qtype == "q8_0"
    ids, folder = folder_logits
    got = llm.logits(ids)
    tiny = tiny_models[arch]
    ref = tiny.ref_logits(ids, rm.rounded_copy(tiny.hf, "q8_0", rm.is_matrix))
    assert_exact(got, ref, f"{arch} Q8_0")
    assert rms_err(got, folder[arch]) <= 0.12
    assert top1_agreement(got, folder[arch]) >= 0.75
    assert_exact(decode_logits(llm, ids), ref, f"{arch} Q8_0 decode")


def test_llama_gguf_unpermutes_q_k(gguf_llms, tiny_models):
    """llama.cpp permutes llama q/k rows for its interleaved RoPE; the default model relies on
    sparrow undoing it. Without the un-permutation top-1 agreement drops to chance."""
    llm = gguf_llms["llama", "F16"][0]
    tiny = tiny_models["llama"]
    ids = prompt(32, seed=12)
    ref = tiny.ref_logits(ids, rm.rounded_copy(tiny.hf, "f16", rm.is_matrix))
    assert_exact(llm.logits(ids), ref, "llama F16 GGUF")
    assert_exact(decode_logits(llm, ids), ref, "llama F16 GGUF decode")


def test_gguf_tokenizer_metadata(gguf_llms):
    tok = gguf_llms["qwen3", "F16"][0].tokenizer
    assert 2 in tok.eos_token_ids
    assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
