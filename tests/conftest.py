"""Session-wide fixtures: the default model (loaded once) and the tiny reference models.

Tiny models (see reference_models.py) are built once per session into a temporary folder;
each fixture value carries the HF folder and the f32 transformers model that made it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import reference_models as rm  # noqa: E402

ARCHS = ("qwen3", "qwen2", "llama")


@dataclass
class Tiny:
    arch: str
    folder: str  # HF folder: config.json, model.safetensors (f32), tokenizer files
    hf: object  # transformers model (f32, eval) the folder was saved from

    def ref_logits(self, ids, model=None) -> np.ndarray:
        """transformers' logits [T, V] f32 for ids (of `model` if given, e.g. rounded weights)."""
        import torch

        with torch.no_grad():
            return (model or self.hf)(torch.tensor(np.asarray(ids, np.int64))[None]).logits[0].float().numpy()


def prompt(n: int, seed: int = 0) -> np.ndarray:
    """n token ids, random but fixed, avoiding the special ids 0..16 (eos/bos/etc.)."""
    return np.random.default_rng(seed).integers(17, rm.VOCAB, n).astype(np.int64)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tokenizer"))
    rm.save_default_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, Tiny]:
    out = {}
    for arch in ARCHS:
        d = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
        out[arch] = Tiny(arch, d, rm.build_tiny(arch, d, tokenizer_dir))
    return out


@pytest.fixture(scope="session")
def default_llm():
    """sparrow's default model (SmolLM2-135M-Instruct Q4_1 GGUF), loaded once per session."""
    import sparrow

    return sparrow.load()


def decode_logits(llm, ids, kv_dtype: str = "f32", prefill: int = 4) -> np.ndarray:
    """Logits [T, V] from a short prefill then one Decoder.forward per token (decode kernel, KV
    cache), i.e. the path generation takes; row t predicts token t + 1 like a full forward."""
    from sparrow.api import set_threads
    from sparrow.models.decoder import Segment

    set_threads(llm.threads)
    ids = np.asarray(ids, np.int64)
    cache = llm.model.new_cache(len(ids), kv_dtype)
    rows = [llm.model.forward([Segment(ids[:prefill], cache, 0)], all_logits=True)]  # [prefill, V]
    for i in range(prefill, len(ids)):
        rows.append(llm.model.forward([Segment(ids[i : i + 1], cache, i, decode=True)]))  # [1, V]
    return np.concatenate(rows)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| relative to max |ref| (logits are O(1..10), so this reads as a percentage)."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def top1_agreement(got: np.ndarray, ref: np.ndarray) -> float:
    return float((got.argmax(-1) == ref.argmax(-1)).mean())


def rms_err(got: np.ndarray, ref: np.ndarray) -> float:
    """RMS of the difference relative to the RMS of the reference: steadier than the max for lossy paths."""
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
