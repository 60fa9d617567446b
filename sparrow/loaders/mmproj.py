"""llama.cpp's mmproj GGUF for Qwen3-VL and Qwen3.5 (clip.projector_type qwen3vl_merger; Qwen3.5's
without DeepStack): the vision tower's config and tensors under Hugging Face names, to go with a
qwen3vl, qwen35 or qwen35moe text GGUF (loaders/__init__.py refuses a pair that does not fit)."""

from __future__ import annotations

import os

import numpy as np

from ..errors import SparrowError
from ..quant import gguf_support
from .gguf import open_gguf
from .names import MMPROJ_PATCH_FRAMES, MMPROJ_PATCH_HF, mmproj_to_hf
from .tensor import StoredTensor

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def open_mmproj(path: str, tokenizer) -> tuple[object, dict[str, StoredTensor]]:
    """-> (VisionConfig, tensors by HF name). The image token ids come from the text model's
    tokenizer (the mmproj file does not carry them)."""
    import gguf

    from ..vision.config import vision_config_from_gguf

    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise SparrowError(f"mmproj file not found: {path}")
    reader, meta = open_gguf(path)
    flags = list(meta.get("clip.vision.is_deepstack_layers", ()))
    deepstack = [i for i, f in enumerate(flags) if f]
    native = {gguf.GGMLQuantizationType.F32: "f32", gguf.GGMLQuantizationType.F16: "f16"}
    tensors: dict[str, StoredTensor] = {}
    frames = {}
    for t in reader.tensors:
        if t.tensor_type not in native and gguf_support(t.tensor_type) is None:
            raise SparrowError(f"{name}: tensor {t.name!r} has GGML type {t.tensor_type.name}, unsupported")
        shape = tuple(int(s) for s in reversed(t.shape))  # ggml order is (in, out, ...)
        st = StoredTensor(t.name, t.data, native.get(t.tensor_type, "gguf"), shape, t.tensor_type)
        if t.name in MMPROJ_PATCH_FRAMES:
            frames[MMPROJ_PATCH_FRAMES.index(t.name)] = st
            continue
        hf = mmproj_to_hf(t.name, deepstack)
        if hf is not None:
            tensors[hf] = StoredTensor(hf, st.data, st.dtype, shape, t.tensor_type)
    if len(frames) != len(MMPROJ_PATCH_FRAMES):
        raise SparrowError(f"{name}: missing the patch embedding ({' and '.join(MMPROJ_PATCH_FRAMES)})")
    # The Conv3d [hid, C, 2, p, p] rebuilt from its two temporal Conv2d slices [hid, C, p, p].
    conv = np.stack([frames[i].to_array().reshape(frames[i].shape) for i in range(2)], axis=2)
    tensors[MMPROJ_PATCH_HF] = StoredTensor(MMPROJ_PATCH_HF, np.ascontiguousarray(conv), "f32", conv.shape)
    ids = {tok: tokenizer.token_to_id(tok) for tok in VISION_TOKENS}
    try:
        cfg = vision_config_from_gguf(meta, {k: t.shape for k, t in tensors.items()}, ids)
    except (KeyError, TypeError, ValueError) as e:
        raise SparrowError(f"{name}: corrupt mmproj metadata: {type(e).__name__}: {e}") from None
    return cfg, tensors
