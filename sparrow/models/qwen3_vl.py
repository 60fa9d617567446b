"""Qwen3-VL: the Qwen3 decoder with interleaved M-RoPE plus the vision tower (ImageInput, which
Qwen3.5's image model, qwen3_5.Qwen3_5VL, shares).

A prompt's images are encoded once, when its sequence is created (`prepare`); the result, a
`MultimodalPrompt`, travels with the sequence's slot. Each prefill chunk takes its slice
(`SegmentVision`): the M-RoPE positions of its tokens, and the image embeddings and DeepStack
features of the image pads inside it. Decode steps only shift their rope position by the
prompt's rope delta.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import SparrowError
from ..vision.config import VisionConfig
from ..vision.encoder import VisionTower
from ..vision.positions import rope_positions
from .decoder import Decoder, WeightSource


@dataclass
class SegmentVision:
    """What one forward segment needs from its prompt's images."""

    positions: np.ndarray  # [3, T] (t, h, w) rope positions
    rows: np.ndarray  # [m] indices of image pads within the segment
    embeds: np.ndarray  # [m, E] their image embeddings
    deepstack: np.ndarray  # [K, m, E] added after text layers 0..K-1


@dataclass
class MultimodalPrompt:
    positions: np.ndarray  # [3, P] rope positions of the whole prompt
    rope_delta: int  # rope position - cache position of every generated token
    pad_rows: np.ndarray  # [n] prompt indices of the image pads, ascending
    embeds: np.ndarray  # [n, E]
    deepstack: np.ndarray  # [K, n, E]
    timings: list[dict] = field(default_factory=list)  # per image: {"ms", "tokens", "grid"}

    def segment(self, start: int, stop: int) -> SegmentVision:
        a, b = np.searchsorted(self.pad_rows, [start, stop])
        return SegmentVision(
            self.positions[:, start:stop], self.pad_rows[a:b] - start, self.embeds[a:b], self.deepstack[:, a:b]
        )


class ImageInput:
    """What a decoder with a vision tower adds, shared by Qwen3-VL and Qwen3.5 (qwen3_5.Qwen3_5VL):
    the tower, the image-pad count of an image (`image_tokens`) and the encoding of a prompt's
    images over its pads (`prepare`, which the runner looks for: a model without it is text-only)."""

    @staticmethod
    def check_vision(cfg, vision: VisionConfig) -> None:
        """Refuses a tower that does not fit the text model (before the text model is built)."""
        if vision.out_hidden_size != cfg.hidden_size:
            raise SparrowError(
                f"the vision tower outputs {vision.out_hidden_size} features, the text model takes {cfg.hidden_size}"
            )

    def attach_vision(self, tensors, vision: VisionConfig) -> None:
        self.vision_config = vision
        # --quantize applies to the text model: the vision tower runs once per image, in stored form
        self.vision = VisionTower(vision, WeightSource(tensors, None))

    def image_tokens(self, grid: tuple[int, int, int]) -> int:
        return self.vision.tokens(grid)

    def prepare(self, prompt: np.ndarray, images: list) -> MultimodalPrompt | None:
        """Encodes the images (each with .pixels [N, K] and .grid (t, h, w), in prompt order)
        and lays them over the prompt's image pads; None for a prompt without either."""
        vc = self.vision_config
        pos, delta, runs = rope_positions(prompt, vc.image_token_id, [im.grid for im in images], vc.spatial_merge_size)
        if not images:
            return None
        embeds, deep, timings = [], [], []
        for im in images:
            t0 = time.perf_counter()
            e, d = self.vision(im.pixels, im.grid)  # [n, E] [K, n, E]
            timings.append({"ms": (time.perf_counter() - t0) * 1e3, "tokens": len(e), "grid": tuple(im.grid)})
            embeds.append(e)
            deep.append(d)
        rows = np.concatenate([np.arange(a, b) for a, b in runs]).astype(np.int64)
        return MultimodalPrompt(pos, delta, rows, np.concatenate(embeds), np.concatenate(deep, axis=1), timings)


class Qwen3VL(ImageInput, Decoder):
    def __init__(self, cfg, tensors, vision: VisionConfig, quantize=None, progress=None, activations="f32"):
        self.check_vision(cfg, vision)
        if len(vision.deepstack_visual_indexes) > cfg.num_hidden_layers:
            raise SparrowError("more DeepStack mergers than text layers")
        super().__init__(cfg, tensors, quantize=quantize, progress=progress, activations=activations)
        self.attach_vision(tensors, vision)
