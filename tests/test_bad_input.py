"""Bad input ends in one clear line: SparrowError from the API, `error: ...` + exit status 1 from
the CLI, never a traceback."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import reference_models as rm
import sparrow
from sparrow.errors import SparrowError

LONG_PROMPT = "hi " * 400  # > 256 tokens: the tiny models' max_position_embeddings


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


@pytest.fixture(scope="module")
def bad_models(tiny_models, tmp_path_factory):
    """name -> (model path, a word the one-line message must contain)."""
    src = tiny_models["qwen3"].folder
    root = tmp_path_factory.mktemp("bad")
    out = {}

    d = _copy(src, root / "truncated")
    st = os.path.join(d, "model.safetensors")
    with open(st, "r+b") as f:
        f.truncate(os.path.getsize(st) // 2)
    out["truncated_safetensors"] = (d, "truncated")

    p = root / "wrong_magic.gguf"
    p.write_bytes(b"GGML" + bytes(range(256)) * 4)
    out["gguf_wrong_magic"] = (str(p), "not a GGUF")

    p = root / "corrupt.gguf"
    garbage = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 7, 5) + garbage)  # version, n_tensors, n_kv
    out["gguf_corrupt"] = (str(p), "corrupt")

    d = _copy(src, root / "unknown_arch")

    def gpt2(cfg):
        cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"

    rm.rewrite_config(d, gpt2)
    out["unknown_architecture"] = (d, "GPT2LMHeadModel")

    d = _copy(src, root / "missing_tensor")
    from safetensors.numpy import load_file, save_file

    st = os.path.join(d, "model.safetensors")
    tensors = load_file(st)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, st, metadata={"format": "pt"})
    out["missing_tensor"] = (d, "model.layers.1.mlp.up_proj.weight")
    return out


CASES = ["truncated_safetensors", "gguf_wrong_magic", "gguf_corrupt", "unknown_architecture", "missing_tensor"]


def _one_line(msg: str, must_contain: str):
    assert msg and "\n" not in msg.strip(), f"not one line: {msg!r}"
    assert must_contain.lower() in msg.lower(), f"{must_contain!r} not in {msg!r}"


@pytest.mark.parametrize("case", CASES)
def test_api_bad_model(case, bad_models):
    path, word = bad_models[case]
    with pytest.raises(SparrowError) as e:
        sparrow.load(path)
    _one_line(str(e.value), word)


def test_api_overlong_prompt(tiny_models):
    llm = sparrow.load(tiny_models["qwen3"].folder)
    assert llm.ctx == 256
    with pytest.raises(SparrowError) as e:
        llm.logits(np.arange(100, 100 + llm.ctx + 1))
    _one_line(str(e.value), "context")
    with pytest.raises(SparrowError) as e:
        next(iter(llm.stream(LONG_PROMPT, max_tokens=4)))
    _one_line(str(e.value), "context")


def _cli(model: str, prompt: str):
    cmd = [sys.executable, "-m", "sparrow.cli", "generate", "--model", model, "--prompt", prompt, "-n", "4"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", CASES + ["overlong_prompt"])
def test_cli_bad_input(case, bad_models, tiny_models):
    if case == "overlong_prompt":
        r, word = _cli(tiny_models["qwen3"].folder, LONG_PROMPT), "context"
    else:
        path, word = bad_models[case]
        r = _cli(path, "hi")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    _one_line(lines[0], word)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--activations", "int4", "--prompt", "hi"],
        ["bench", "long-context", "--activations", "int4"],
        ["bench", "speed", "--activations", "int4"],
    ],
    ids=["generate", "bench-long-context", "bench-speed"],
)
def test_cli_bad_activations(argv):
    """An unknown --activations mode stops before any model loads: argparse's usage line, then one
    line naming the option and the modes it takes, exit status 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "sparrow.cli", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "--activations" in last and "invalid choice: 'int4'" in last, r.stderr
    assert "f32" in last and "q8" in last, r.stderr
