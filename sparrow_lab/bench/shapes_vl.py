"""The random-weight mmproj GGUF that goes with a vision shape (bench/shapes.py, e.g.
qwen3-vl-2b): Qwen3-VL's vision tower with its real sizes under llama.cpp's mmproj names and
clip.* metadata. Matrices are f16 with values of standard deviation 0.02 (the learned position
grid f32 with 0.5, so it shows in the activations), norms ones, biases zeros. Written once into the
shapes cache directory next to the text file, atomically."""

from __future__ import annotations

import os

import numpy as np

from .shapes import _shape, cache_dir, gguf_writer


def mmproj_path(name: str) -> str:
    return os.path.join(cache_dir(), f"mmproj-{name}-f16.gguf")


def plan(shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in file order."""
    s = _shape(shape)
    v = s["vision"]
    h, f, p, m = v["hidden"], v["ffn"], v["patch"], v["merge"]
    big = h * m * m
    out = [
        ("v.patch_embd.weight", (h, 3, p, p)),
        ("v.patch_embd.weight.1", (h, 3, p, p)),
        ("v.patch_embd.bias", (h,)),
        ("v.position_embd.weight", (v["positions"], h)),
    ]
    for i in range(v["depth"]):
        b = f"v.blk.{i}."
        out += [
            (b + "ln1.weight", (h,)),
            (b + "ln1.bias", (h,)),
            (b + "attn_qkv.weight", (3 * h, h)),
            (b + "attn_qkv.bias", (3 * h,)),
            (b + "attn_out.weight", (h, h)),
            (b + "attn_out.bias", (h,)),
            (b + "ln2.weight", (h,)),
            (b + "ln2.bias", (h,)),
            (b + "ffn_up.weight", (f, h)),
            (b + "ffn_up.bias", (f,)),
            (b + "ffn_down.weight", (h, f)),
            (b + "ffn_down.bias", (h,)),
        ]
    out += [("v.post_ln.weight", (h,)), ("v.post_ln.bias", (h,))]
    out += [("mm.0.weight", (big, big)), ("mm.0.bias", (big,)), ("mm.2.weight", (s["hidden"], big))]
    out += [("mm.2.bias", (s["hidden"],))]
    for layer in v["deepstack"]:
        d = f"v.deepstack.{layer}."
        out += [(d + "norm.weight", (big,)), (d + "norm.bias", (big,))]
        out += [(d + "fc1.weight", (big, big)), (d + "fc1.bias", (big,))]
        out += [(d + "fc2.weight", (s["hidden"], big)), (d + "fc2.bias", (s["hidden"],))]
    return out


def _dtype(name: str, shape) -> np.dtype:
    # f32: vectors, and the position grid (llama.cpp interpolates it in f32 and asserts so)
    return np.dtype(np.float32) if len(shape) == 1 or name.startswith("v.position_embd") else np.dtype(np.float16)


def _values(rng, name: str, shape) -> np.ndarray:
    if len(shape) == 1:
        fill = 1.0 if ".weight" in name and ("ln" in name or "norm" in name) else 0.0
        return np.full(shape, fill, np.float32)
    std = 0.5 if name.startswith("v.position_embd") else 0.02
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(_dtype(name, shape))


def ensure_mmproj(name: str, log=None) -> str:
    """The cached mmproj for the vision shape `name`, written first if missing."""

    s = _shape(name)
    v = s["vision"]
    path = mmproj_path(name)
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    if log:
        log(f"writing {path} (once; reused afterwards)\n")
    tensors = plan(s)
    with gguf_writer(path, "clip") as w:
        w.add_name(f"{name} vision shape, random weights (f16)")
        w.add_clip_has_vision_encoder(True)
        w.add_clip_projector_type("qwen3vl_merger")
        w.add_vision_patch_size(v["patch"])
        w.add_vision_image_size(int(round(v["positions"] ** 0.5)) * v["patch"])
        w.add_vision_embedding_length(v["hidden"])
        w.add_vision_feed_forward_length(v["ffn"])
        w.add_vision_projection_dim(s["hidden"])
        w.add_vision_block_count(v["depth"])
        w.add_vision_head_count(v["heads"])
        w.add_vision_attention_layernorm_eps(1e-6)
        w.add_vision_image_mean([0.5, 0.5, 0.5])
        w.add_vision_image_std([0.5, 0.5, 0.5])
        w.add_vision_spatial_merge_size(v["merge"])
        w.add_vision_use_gelu(True)
        w.add_vision_is_deepstack_layers([i in v["deepstack"] for i in range(v["depth"])])
        for tname, shp in tensors:
            dt = _dtype(tname, shp)
            w.add_tensor_info(tname, shp, dt, int(np.prod(shp)) * dt.itemsize)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        rng = np.random.default_rng(0)
        for tname, shp in tensors:
            w.write_padding(fout, fout.tell())
            a = _values(rng, tname, shp)
            a.tofile(fout)
            w.write_padding(fout, a.nbytes)
    return path
