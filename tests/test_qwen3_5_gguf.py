"""Qwen3.5 GGUF files as llama.cpp's own converter writes them (qwen35, qwen35moe) against the same
weights as a Hugging Face folder and against transformers.

The converter (convert_hf_to_gguf.py with its conversion/ package and gguf-py, from the
llama-cpp-python 0.3.36 sdist) is found at $SPARROW_LLAMA_CONVERTER; .ci/run fetches it and sets
SPARROW_REQUIRE_CONVERTER, so CI fails rather than skips without it. What the file changes, which
the loader undoes (loaders/names.py): Mamba-style tensor names, norms holding 1 + weight,
A = -exp(A_log) stored, the value heads tiled over the key heads instead of grouped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_qwen3_5 import PROMPT, _build, _prefill_then_decode
from test_qwen3_5_mtp import _add_mtp, _head_logits, _hidden_rows, _mtp_layer_model, _random_head

import sparrow
from reference_models import rewrite_config, save_default_tokenizer
from sparrow.errors import SparrowError

torch = pytest.importorskip("torch")
CONVERTER = os.environ.get("SPARROW_LLAMA_CONVERTER", os.path.expanduser("~/.cache/sparrow/llama-cpp-python-0.3.36"))
SCRIPT = os.path.join(CONVERTER, "convert_hf_to_gguf.py")
if not os.path.isfile(SCRIPT):
    if os.environ.get("SPARROW_REQUIRE_CONVERTER"):
        raise RuntimeError(f"llama.cpp's converter is not at {SCRIPT} (.ci/run fetches it)")
    pytest.skip("llama.cpp's converter is not installed (see .ci/run)", allow_module_level=True)


def convert(folder: str, out: str, outtype: str = "f32", mmproj: bool = False, mtp: bool = False) -> str:
    """The text GGUF, or with mmproj the vision tower's GGUF (test_qwen3_5_vision.py). mtp: keep
    the folder's MTP layer (the converter asserts where there is none)."""
    env = dict(os.environ, PYTHONPATH=os.path.join(CONVERTER, "gguf-py"))
    mode = ["--mmproj"] if mmproj else [] if mtp else ["--no-mtp"]
    cmd = [sys.executable, SCRIPT, folder, "--outfile", out, "--outtype", outtype, *mode]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def for_converter(folder: str, dst: str) -> str:
    """A copy of folder at dst whose config names the model type qwen3_5_text: transformers
    gives other Qwen3.5 model types Qwen3.5's own pre-tokenizer whatever tokenizer.json says,
    whose hash the converter does not know for the test vocabulary; the converter picks its
    model class from `architectures`, so the copy converts the same weights."""
    shutil.copytree(folder, dst)
    rewrite_config(dst, lambda cfg: cfg.update(model_type="qwen3_5_text"))
    return dst


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (HF folder, GGUF path, transformers' logits over PROMPT)."""
    root = tmp_path_factory.mktemp("qwen3_5_gguf")
    save_default_tokenizer(str(root / "tok"))
    out = {}
    for kind in ("dense", "moe"):
        folder = str(root / kind)
        model = _build(kind, folder, str(root / "tok"))
        with torch.no_grad():
            ref = model(torch.tensor(PROMPT[None])).logits[0].numpy()
        src = folder
        if kind == "moe":
            # transformers gives qwen3_5_moe_text folders Qwen3.5's own pre-tokenizer whatever
            # tokenizer.json says, whose hash the converter does not know for this vocabulary;
            # the converter picks its model class from `architectures`, so a copy that names
            # the dense model type converts the same MoE weights with the file's tokenizer
            src = for_converter(folder, str(root / "moe_for_converter"))
        out[kind] = (folder, convert(src, str(root / f"{kind}.gguf")), ref)
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_converted_gguf_equals_the_hf_folder(converted, kind):
    folder, path, ref = converted[kind]
    llm = sparrow.load(path, threads=2)
    cfg = llm.config
    assert cfg.architecture == ("qwen3_5_moe" if kind == "moe" else "qwen3_5") and cfg.gguf_layout
    hf = sparrow.load(folder, threads=2).config
    for key in ("layer_types", "rotary_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim"):
        assert getattr(cfg, key) == getattr(hf, key), key
    assert (cfg.linear_value_head_dim, cfg.shared_expert_intermediate_size, cfg.num_experts) == (
        hf.linear_value_head_dim,
        hf.shared_expert_intermediate_size,
        hf.num_experts,
    )
    got, _ = _prefill_then_decode(llm.model, PROMPT, 120)
    want, _ = _prefill_then_decode(sparrow.load(folder, threads=2).model, PROMPT, 120)
    # the same values; sums over tiled value heads run in another order than over grouped ones
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    assert np.array_equal(got.argmax(1), ref.argmax(1))


def test_a_gguf_missing_a_deltanet_tensor_names_it(converted, tmp_path):
    import gguf

    _, path, _ = converted["dense"]
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), "qwen35")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        if t.name != "blk.2.ssm_out.weight":
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SparrowError, match="missing tensor model.layers.2.linear_attn.out_proj.weight") as e:
        sparrow.load(str(tmp_path / "broken.gguf"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_gguf_with_the_mtp_layer_loads_the_head_of_the_hf_folder(converted, kind, tmp_path):
    """llama.cpp's converter, without --no-mtp, writes the MTP layer as block num_hidden_layers
    (nextn.* and the layer's usual names, norms holding 1 + weight): the head sparrow builds from
    it is the HF folder's, bit for bit on the same hidden rows; a file without it has none."""
    save_default_tokenizer(str(tmp_path / "tok"))
    folder = str(tmp_path / kind)
    _build(kind, folder, str(tmp_path / "tok"))
    _, layer = _mtp_layer_model(kind, 107, 1.0, str(tmp_path / "one"))
    _add_mtp(folder, {**layer, **_random_head(np.random.default_rng(207))})
    src = folder
    if kind == "moe":  # the dense model type for the converter's tokenizer check (converted's note)
        src = for_converter(folder, str(tmp_path / "moe_for_converter"))
    gguf_llm = sparrow.load(convert(src, str(tmp_path / "mtp.gguf"), mtp=True), threads=2)
    hf = sparrow.load(folder, threads=2).model
    cfg = gguf_llm.config
    n = hf.config.num_hidden_layers
    assert (cfg.num_hidden_layers, cfg.mtp_layers, cfg.layer_types) == (n, 1, hf.config.layer_types)
    got, want = gguf_llm.model.mtp, hf.mtp
    assert got is not None and want is not None
    for name in ("norm_e", "norm_h", "norm"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    hidden = _hidden_rows(hf, PROMPT)
    a = _head_logits(gguf_llm.model, PROMPT, hidden, 90)
    b = _head_logits(hf, PROMPT, hidden, 90)
    assert np.array_equal(a, b)
    plain = sparrow.load(converted[kind][1], threads=2).model  # the same model converted with --no-mtp
    assert plain.mtp is None
    # the MTP block is not run as one more decoder layer: the model's logits are the plain file's
    with_mtp, _ = _prefill_then_decode(gguf_llm.model, PROMPT, 140)
    assert np.array_equal(with_mtp, _prefill_then_decode(plain, PROMPT, 140)[0])
