"""Model families. Llama, Qwen2 and Qwen3 share one decoder; Qwen3-MoE swaps in its MoE block;
Qwen3.5 (qwen3_5.py) builds its hybrid layers on the same decoder."""

from __future__ import annotations

from ..errors import SparrowError
from .decoder import Decoder
from .step import fused_switch


def build_model(ckpt, quantize: str | None = None, progress: bool = False, activations: str = "f32") -> Decoder:
    """The checkpoint's model, its weights prepared for activations mode `activations`
    (kernels.linear.ACTIVATIONS; fixed for the model's life). SPARROW_FUSED=0 builds it with
    the fused decode step off (models.step.fused_switch)."""
    model = _build(ckpt, quantize, progress, activations)
    model.use_fused = model.use_fused and fused_switch()
    return model


def _build(ckpt, quantize, progress, activations) -> Decoder:
    cfg = ckpt.config
    bar = None
    if progress:
        from tqdm import tqdm

        bar = lambda it: tqdm(it, desc="loading layers", unit="layer", leave=False)  # noqa: E731

    if getattr(ckpt, "vision", None) is not None:
        from .qwen3_vl import Qwen3VL

        return Qwen3VL(cfg, ckpt.tensors, ckpt.vision, quantize=quantize, progress=bar, activations=activations)
    if cfg.architecture in ("llama", "qwen2", "qwen3"):
        return Decoder(cfg, ckpt.tensors, quantize=quantize, progress=bar, activations=activations)
    if cfg.is_hybrid:
        from .qwen3_5 import Qwen3_5

        return Qwen3_5(cfg, ckpt.tensors, quantize=quantize, progress=bar, activations=activations)
    if cfg.architecture == "qwen3_moe":
        from .qwen3_moe import moe_mlp_factory

        return Decoder(
            cfg, ckpt.tensors, quantize=quantize, mlp_factory=moe_mlp_factory, progress=bar, activations=activations
        )
    raise SparrowError(f"unsupported architecture {cfg.architecture!r}")
