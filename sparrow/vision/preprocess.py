"""Qwen3-VL's image processor (transformers' Qwen2VLImageProcessor with Qwen3-VL's settings):
smart_resize to multiples of patch * merge within [min_pixels, max_pixels], bicubic resize
with Pillow, rescale to [0, 1], normalise, two identical temporal frames, and patches
flattened in 2x2 merge-block order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import SparrowError
from .config import VisionConfig

MAX_ASPECT = 200


@dataclass
class PixelImage:
    """One preprocessed image: what the vision tower takes."""

    pixels: np.ndarray  # [t*h*w, C * temporal * patch * patch] f32, merge-block order
    grid: tuple[int, int, int]  # patch grid (t, h, w)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of factor, keep the aspect ratio as closely as possible and hold
    between min_pixels and max_pixels pixels (transformers' smart_resize)."""
    if min(height, width) < 1:
        raise SparrowError(f"image is empty ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise SparrowError(f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds {MAX_ASPECT}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(image, cfg: VisionConfig) -> PixelImage:
    """A PIL image -> PixelImage for the vision tower."""
    from PIL import Image

    rgb = image.convert("RGB")
    h, w = smart_resize(rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (h, w) != (rgb.height, rgb.width):
        rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
    x = np.asarray(rgb, np.float32).transpose(2, 0, 1) * np.float32(1 / 255)  # [C, H, W]
    mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, np.float32)[:, None, None]
    x = (x - mean) / std
    return PixelImage(_patchify(x, cfg), (1, h // cfg.patch_size, w // cfg.patch_size))


def _patchify(x: np.ndarray, cfg: VisionConfig) -> np.ndarray:
    """[C, H, W] -> [gh*gw, C * temporal * p * p] patches in merge-block order, each patch
    repeated over the temporal frames (a still image is two identical frames)."""
    C, H, W = x.shape
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    gh, gw = H // p, W // p
    patches = x.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [bh, bw, m, m, C, p, p]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
    return np.ascontiguousarray(patches.reshape(gh * gw, C * tp * p * p), np.float32)


def image_salt(images: list[PixelImage]) -> str | None:
    """A digest naming the images' pixels, so that the prefix cache shares KV only between
    prompts with the same images (their pad tokens are the same whatever the picture)."""
    if not images:
        return None
    import hashlib

    h = hashlib.sha256()
    for im in images:
        h.update(repr(im.grid).encode())
        h.update(np.ascontiguousarray(im.pixels).tobytes())
    return h.hexdigest()
