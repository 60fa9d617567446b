"""GGUF checkpoints: config, tensors (memory-mapped, HF names) from sparrow's lean GGUF reader."""

from __future__ import annotations

import math
import os
import struct

from ..config import ModelConfig
from ..errors import SparrowError
from ..quant import gguf_support
from .gguf_file import GGUFFile
from .names import gguf_to_hf, llama_unpermute_rows
from .tensor import StoredTensor


def open_gguf(path: str):
    """Returns (GGUFFile, metadata dict). A file that is not GGUF is a one-line SparrowError."""
    name = os.path.basename(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SparrowError(f"{name}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFFile(path)
    except SparrowError as e:
        raise SparrowError(f"{name}: {e}") from None
    except (ValueError, OverflowError, UnicodeDecodeError, struct.error, TypeError, MemoryError) as e:
        # garbage where numbers should be
        raise SparrowError(f"{name}: corrupt GGUF file: {type(e).__name__}: {_line(e)}") from None
    return reader, reader.meta


def gguf_tensors(reader, cfg: ModelConfig) -> dict[str, StoredTensor]:
    import gguf

    native = {gguf.GGMLQuantizationType.F32: "f32", gguf.GGMLQuantizationType.F16: "f16"}
    out: dict[str, StoredTensor] = {}
    mtp_block = cfg.num_hidden_layers if cfg.mtp_layers else None  # Qwen3.5's MTP layer, after the decoder's
    for t in reader.tensors:
        hf = gguf_to_hf(t.name, mtp_block)
        if hf is None:
            continue
        if t.tensor_type not in native and gguf_support(t.tensor_type) is None:
            # before any weight is built: the one line names the file's tensor, not its HF name
            raise SparrowError(
                f"{os.path.basename(reader.path)}: tensor {t.name!r} has GGML type {t.tensor_type.name}, "
                "which sparrow cannot run (README: GGUF tensor types)"
            )
        shape = tuple(int(s) for s in reversed(t.shape))  # ggml order is (in, out, ...)
        kind = native.get(t.tensor_type, "gguf")
        st = StoredTensor(hf, t.data, kind, shape, t.tensor_type)
        # llama.cpp permutes llama q/k rows so that its interleaved RoPE works; sparrow uses
        # rotate-half RoPE everywhere, so undo it here (rows are whole quant blocks).
        if cfg.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in t.name else cfg.num_key_value_heads
            st = st.rows(llama_unpermute_rows(heads, cfg.head_dim))
        out[hf] = st
    return out


def gguf_config(reader, meta: dict) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise SparrowError("GGUF has no token_embd.weight tensor")
    vocab = int(emb.shape[-1])
    name = os.path.basename(reader.path)
    try:
        cfg = ModelConfig.from_gguf(meta, names, vocab)
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, OverflowError, AttributeError) as e:
        # a key missing or of the wrong type (a flipped type tag, a string where a count should be)
        raise SparrowError(f"{name}: corrupt GGUF metadata: {type(e).__name__}: {_line(e)}") from None
    _check_sizes(cfg, {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}, name)
    return cfg


def _check_sizes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], name: str) -> None:
    """Sizes the model is built from, checked against the tensors before anything is allocated
    for them: a float read where an int was written rounds to 0, a flipped bit makes a layer count
    in the billions or a head 2^31 wide (12 GiB of tables before the first token)."""
    names = shapes.keys()
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    for key in (*sizes, "max_position_embeddings"):
        if getattr(cfg, key) < 1:
            raise SparrowError(f"{name}: corrupt GGUF metadata: {key} is {getattr(cfg, key)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise SparrowError(
            f"{name}: corrupt GGUF metadata: {cfg.num_attention_heads} heads over {cfg.num_key_value_heads} KV heads"
        )
    if f"blk.{cfg.num_hidden_layers - 1}.attn_norm.weight" not in names:
        raise SparrowError(f"{name}: corrupt GGUF metadata: {cfg.num_hidden_layers} layers, tensors for fewer")
    if not (math.isfinite(cfg.rms_norm_eps) and math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise SparrowError(
            f"{name}: corrupt GGUF metadata: rms_norm_eps {cfg.rms_norm_eps}, rope_theta {cfg.rope_theta}"
        )
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    if cfg.is_hybrid:
        q *= 2  # Qwen3.5: each head's query and output gate
    # ggml order: (inputs, outputs); a tensor the architecture lacks is not checked
    for tensor, want in (
        ("token_embd.weight", (cfg.hidden_size, cfg.vocab_size)),
        ("blk.0.attn_q.weight", (cfg.hidden_size, q)),
        ("blk.0.attn_k.weight", (cfg.hidden_size, kv)),
        ("blk.0.attn_v.weight", (cfg.hidden_size, kv)),
        ("blk.0.ffn_up.weight", (cfg.hidden_size, cfg.intermediate_size)),
    ):
        got = shapes.get(tensor)
        if got is not None and got[:2] != want:
            raise SparrowError(
                f"{name}: corrupt GGUF metadata: {tensor} has shape {got}, the header's sizes say {want}"[:300]
            )


def _line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]
