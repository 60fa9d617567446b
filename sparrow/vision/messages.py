"""Chat messages with image parts -> text messages with Qwen3-VL's image placeholder, the
images in order, and the placeholder expanded to one pad per image token after encoding.

A message whose content lists image parts becomes one string, the parts concatenated in
order with each image as `<|vision_start|><|image_pad|><|vision_end|>` (what Qwen3-VL's own
chat template writes for a list of parts), so any template renders it.
"""

from __future__ import annotations

import numpy as np

from ..errors import SparrowError
from .media import DEFAULT_MAX_IMAGES, MAX_PIXELS_PER_REQUEST, PixelBudget, image_from_url, load_image

IMAGE_TYPES = ("image", "image_url")


def has_images(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_TYPES for p in m["content"])
        for m in messages
    )


def split_images(
    messages: list[dict],
    placeholder: str | None,
    max_images: int | None = DEFAULT_MAX_IMAGES,
    allowed_local_path: str | None = None,
    local_files: bool = True,
    max_bytes: int | None = None,
    max_pixels: int | None = MAX_PIXELS_PER_REQUEST,
) -> tuple[list[dict], list]:
    """-> (messages with image parts replaced by `placeholder` text, PIL images in order).
    placeholder None: the model takes no images (an error if any is given). max_bytes: a local
    file's size limit (None: media.MAX_IMAGE_BYTES); max_pixels: all images together, from their
    headers (None: no limit). An image's error carries the part it is about in `param`."""
    out, images = [], []
    budget = PixelBudget(max_pixels)
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") in IMAGE_TYPES for p in content
        ):
            out.append(m)
            continue
        if placeholder is None:
            raise SparrowError("this model is text-only: it does not take images")
        pieces = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                pieces.append(str(part.get("text", "")))
                continue
            if kind not in IMAGE_TYPES:
                raise SparrowError(
                    f"messages[{i}].content[{j}]: unsupported part type {kind!r} (text, image_url, image)"
                )
            try:
                if max_images is not None and len(images) >= max_images:
                    raise SparrowError(f"too many images: at most {max_images} per request")
                images.append(_image(part, allowed_local_path, local_files, max_bytes, budget))
            except SparrowError as e:
                e.param = f"messages[{i}].content[{j}]"
                raise
            pieces.append(placeholder)
        out.append({**m, "content": "".join(pieces)})
    return out, images


def _image(part: dict, allowed_local_path, local_files, max_bytes, budget):
    if part["type"] == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        return image_from_url(url, allowed_local_path, local_files, max_bytes, budget)
    if "image" not in part:
        raise SparrowError("an image part needs an 'image' (path, bytes or PIL image)")
    return load_image(part["image"], allowed_local_path, local_files, max_bytes, budget)


def expand_pads(ids: list[int], pad_id: int, counts: list[int]) -> list[int]:
    """Each single image pad in ids -> counts[i] pads (the i-th image's tokens)."""
    arr = np.asarray(ids, np.int64)
    where = np.flatnonzero(arr == pad_id)
    if len(where) != len(counts):
        raise SparrowError(f"the prompt has {len(where)} image placeholders but {len(counts)} images")
    out, prev = [], 0
    for w, n in zip(where, counts):
        out.extend(ids[prev:w])
        out.extend([pad_id] * n)
        prev = w + 1
    out.extend(ids[prev:])
    return out
