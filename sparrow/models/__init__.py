"""Model families, one file each (llama.py, qwen2.py, qwen3.py, qwen3_moe.py, qwen3_vl.py,
qwen3_5.py), composed from the shared decoder (decoder.py) and layers (layers.py, rope.py,
attention.py); build_model picks the family from FAMILIES by the config's architecture."""

from __future__ import annotations

from ..config import HYBRID
from ..errors import SparrowError
from .decoder import Decoder, WeightSource
from .llama import Llama
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .qwen3_5 import Qwen3_5, Qwen3_5VL
from .qwen3_5_mtp import MTPHead, has_mtp
from .qwen3_moe import moe_mlp_factory
from .qwen3_vl import Qwen3VL
from .step import fused_switch


def build_model(ckpt, quantize: str | None = None, progress: bool = False, activations: str = "f32") -> Decoder:
    """The checkpoint's model, its weights prepared for activations mode `activations`
    (kernels.linear.ACTIVATIONS; fixed for the model's life). SPARROW_FUSED=0 builds it with
    the fused decode step off (models.step.fused_switch)."""
    model = _build(ckpt, quantize, progress, activations)
    model.use_fused = model.use_fused and fused_switch()
    return model


def _qwen3_moe(cfg, tensors, **kw) -> Decoder:
    """Qwen3-MoE (qwen3_moe.py): the shared decoder with its MoE block as the MLP. A factory rather
    than a Decoder subclass in qwen3_moe.py: the fused step (fused.py) reads that module's MoE
    tables, and the decoder imports the fused step, so qwen3_moe.py cannot import the decoder."""
    return Decoder(cfg, tensors, mlp_factory=moe_mlp_factory, **kw)


def _qwen3_5(cfg, tensors, **kw) -> Qwen3_5:
    """Qwen3.5 (qwen3_5.py), with its MTP layer (qwen3_5_mtp.py: model.mtp, the `mtp` drafter's
    head) where the checkpoint carries one. Built here, after the decoder: the head is built from
    the MTP module, which imports the family's layers."""
    return _with_mtp(Qwen3_5(cfg, tensors, **kw), cfg, tensors, kw)


def _with_mtp(model, cfg, tensors, kw):
    get = WeightSource(tensors, kw.get("quantize"), kw.get("activations", "f32"))
    model.mtp = MTPHead(cfg, get) if has_mtp(get) else None
    return model


# architecture (ModelConfig.architecture) -> the family that builds it
FAMILIES = {
    "llama": Llama,
    "qwen2": Qwen2,
    "qwen3": Qwen3,
    "qwen3_moe": _qwen3_moe,
    **{arch: _qwen3_5 for arch in HYBRID},
}


def _build(ckpt, quantize, progress, activations) -> Decoder:
    cfg = ckpt.config
    bar = None
    if progress:
        from tqdm import tqdm

        bar = lambda it: tqdm(it, desc="loading layers", unit="layer", leave=False)  # noqa: E731

    kw = dict(quantize=quantize, progress=bar, activations=activations)
    if getattr(ckpt, "vision", None) is not None:  # a checkpoint with a vision tower: Qwen3-VL or Qwen3.5
        if cfg.architecture in HYBRID:  # every real Qwen3.5 checkpoint, with its MTP layer
            return _with_mtp(Qwen3_5VL(cfg, ckpt.tensors, ckpt.vision, **kw), cfg, ckpt.tensors, kw)
        return Qwen3VL(cfg, ckpt.tensors, ckpt.vision, **kw)
    family = FAMILIES.get(cfg.architecture)
    if family is None:
        raise SparrowError(f"unsupported architecture {cfg.architecture!r}")
    return family(cfg, ckpt.tensors, **kw)
