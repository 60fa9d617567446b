"""The vision tower's settings: from a Qwen3-VL or Qwen3.5 config.json (+ preprocessor_config.json) or an
mmproj GGUF's clip.* metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SparrowError

# Qwen3-VL's defaults (transformers Qwen3VLConfig / the Hub's preprocessor_config.json).
IMAGE_TOKEN_ID = 151655
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
MIN_PIXELS = 65536
MAX_PIXELS = 16777216
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    out_hidden_size: int  # the text model's hidden size
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    image_token_id: int = IMAGE_TOKEN_ID
    vision_start_token_id: int = VISION_START_TOKEN_ID
    vision_end_token_id: int = VISION_END_TOKEN_ID
    # image processor (preprocessor_config.json)
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, ...] = field(default=(0.5, 0.5, 0.5))
    image_std: tuple[float, ...] = field(default=(0.5, 0.5, 0.5))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def factor(self) -> int:
        """Image sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.spatial_merge_size

    def check(self) -> VisionConfig:
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise SparrowError(
                f"vision hidden size {self.hidden_size} / {self.num_heads} heads: head dim must be a multiple of 4"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise SparrowError(
                f"unsupported vision activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise SparrowError(f"num_position_embeddings {self.num_position_embeddings} is not a square grid")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise SparrowError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} outside 0..{self.depth - 1}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise SparrowError(f"bad image pixel limits: min_pixels {self.min_pixels}, max_pixels {self.max_pixels}")
        return self

    @classmethod
    def from_hf(cls, cfg: dict, preprocessor: dict | None = None) -> VisionConfig:
        """cfg: the whole Qwen3-VL config.json; preprocessor: preprocessor_config.json or None."""
        v = cfg["vision_config"]
        rope = v.get("rope_parameters") or {}
        pre = preprocessor or {}
        size = pre.get("size") or {}
        return cls(
            hidden_size=int(v["hidden_size"]),
            intermediate_size=int(v["intermediate_size"]),
            depth=int(v["depth"]),
            num_heads=int(v["num_heads"]),
            out_hidden_size=int(v["out_hidden_size"]),
            deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes") or ()),
            patch_size=int(v.get("patch_size", 16)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            in_channels=int(v.get("in_channels", 3)),
            num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            image_token_id=int(cfg.get("image_token_id", IMAGE_TOKEN_ID)),
            vision_start_token_id=int(cfg.get("vision_start_token_id", VISION_START_TOKEN_ID)),
            vision_end_token_id=int(cfg.get("vision_end_token_id", VISION_END_TOKEN_ID)),
            min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS),
            max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS),
            image_mean=tuple(float(x) for x in pre.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(x) for x in pre.get("image_std", (0.5, 0.5, 0.5))),
        ).check()


def vision_config_from_gguf(meta: dict, shapes: dict[str, tuple[int, ...]], token_ids: dict[str, int | None]):
    """An mmproj GGUF's clip.* metadata (and its tensor shapes, HF names) -> VisionConfig.
    token_ids: the text model tokenizer's ids of <|vision_start|>, <|image_pad|>, <|vision_end|>."""
    kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if kind != "qwen3vl_merger":
        raise SparrowError(f"unsupported mmproj projector {kind!r}: sparrow runs qwen3vl_merger (Qwen3-VL, Qwen3.5)")
    v = "clip.vision."
    depth = int(meta[v + "block_count"])
    flags = list(meta.get(v + "is_deepstack_layers", ()))
    pos = shapes.get("model.visual.pos_embed.weight")
    if pos is None:
        raise SparrowError("mmproj has no v.position_embd.weight")
    missing = [k for k, i in token_ids.items() if i is None]
    if missing:
        raise SparrowError(f"the text model's tokenizer lacks Qwen3-VL's vision tokens {missing}")
    return VisionConfig(
        hidden_size=int(meta[v + "embedding_length"]),
        intermediate_size=int(meta[v + "feed_forward_length"]),
        depth=depth,
        num_heads=int(meta[v + "attention.head_count"]),
        out_hidden_size=int(shapes["model.visual.merger.linear_fc2.weight"][0]),
        deepstack_visual_indexes=tuple(i for i, f in enumerate(flags) if f),
        patch_size=int(meta.get(v + "patch_size", 16)),
        spatial_merge_size=int(meta.get(v + "spatial_merge_size", 2)),
        num_position_embeddings=int(pos[0]),
        # clip.use_gelu is ggml's gelu, the tanh form (HF: gelu_pytorch_tanh); the LayerNorm eps is
        # 1e-6 in transformers whatever the converter copied into attention.layer_norm_epsilon.
        hidden_act="gelu_pytorch_tanh",
        image_token_id=int(token_ids["<|image_pad|>"]),
        vision_start_token_id=int(token_ids["<|vision_start|>"]),
        vision_end_token_id=int(token_ids["<|vision_end|>"]),
        min_pixels=int(meta.get(v + "image_min_pixels") or MIN_PIXELS),
        max_pixels=int(meta.get(v + "image_max_pixels") or MAX_PIXELS),
        image_mean=tuple(float(x) for x in meta.get(v + "image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(float(x) for x in meta.get(v + "image_std", (0.5, 0.5, 0.5))),
    ).check()
