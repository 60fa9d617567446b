"""The decode roofline: this machine's read bandwidth and the bytes a decode step reads.

A decode step on a CPU is bound by memory: it reads every weight matrix once (the active
experts' only, in an MoE layer) and the KV rows attention looks at. `read_bandwidth` measures
what the machine can stream (a STREAM-like sum over a buffer far larger than the last-level
cache, on the bench's thread count, the best of several passes); `weight_bytes` and
`kv_read_bytes` count what one token reads. bytes x tokens/s over the bandwidth is the
fraction of the roofline an engine reaches, which `sparrow bench speed` prints for both engines.
"""

from __future__ import annotations

import os
import time

import numba
import numpy as np
from numba import njit, prange

MIB = 1 << 20


@njit(fastmath=True, cache=True)
def _sum(a):  # fastmath: the sum vectorises into several accumulators
    s = np.float32(0.0)
    for i in range(a.size):
        s += a[i]
    return s


@njit(parallel=True, fastmath=True, cache=True)
def _sum_chunks(a, parts):
    """a [N] float32 summed in `parts` contiguous chunks, one a thread. The chunk's loop is its
    own function: inside the parallel loop's body numba's lowering kept it from vectorising
    (15 vs 32 GB/s on two Zen 4 cores)."""
    n = a.size
    out = np.zeros(parts, np.float64)
    for t in prange(parts):
        out[t] = _sum(a[t * n // parts : (t + 1) * n // parts])
    return out.sum()


def buffer_bytes() -> int:
    """The read buffer: 512 MiB (16x a 32 MiB L3), 256 MiB where less than 4 GiB is available."""
    from sparrow.state.budget import available_memory

    avail = available_memory()
    return 256 * MIB if avail and avail < 4 * (1 << 30) else 512 * MIB


def read_bandwidth(threads: int, passes: int = 10, nbytes: int | None = None) -> dict:
    """{"gb_s": best pass's read GB/s (1e9 bytes), "buffer_mib", "threads", "passes"} on `threads` threads."""
    nbytes = nbytes or buffer_bytes()
    a = np.ones(nbytes // 4, np.float32)  # written once, so every page is resident before timing
    prev = numba.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        _sum_chunks(a[:1024], threads)  # compile / load outside the timing
        best = 0.0
        for _ in range(passes):
            t0 = time.perf_counter()
            _sum_chunks(a, threads)
            best = max(best, a.nbytes / (time.perf_counter() - t0))
    finally:
        numba.set_num_threads(prev)
    return {"gb_s": best / 1e9, "buffer_mib": a.nbytes / MIB, "threads": threads, "passes": passes}


# ---------------------------------------------------------------------------------------------- weights


def weight_bytes(path: str) -> int | None:
    """Bytes of weights one decode step reads, from the file's tensor table (read by sparrow's
    own loaders, mapped, not loaded): every tensor but the token embedding (one row of it is
    read), the embedding counted when it doubles as the output matrix (tied), and expert
    tensors scaled by experts used / experts. None when the format is not recognised."""
    from sparrow.errors import SparrowError

    try:
        if os.path.isfile(path) and path.endswith(".gguf"):
            return _gguf_weight_bytes(path)
        if os.path.isdir(path):
            return _safetensors_weight_bytes(path)
    except (OSError, ValueError, KeyError, SparrowError):
        return None
    return None


def _gguf_weight_bytes(path: str) -> int:
    from sparrow.loaders.gguf_file import GGUFFile

    f = GGUFFile(path)
    arch = f.meta.get("general.architecture", "")
    used, experts = f.meta.get(f"{arch}.expert_used_count"), f.meta.get(f"{arch}.expert_count")
    sizes = {t.name: t.data.nbytes for t in f.tensors}
    return _read_per_token(sizes, "token_embd.weight", "output.weight", "_exps.", used, experts)


def _safetensors_weight_bytes(folder: str) -> int:
    import json

    from sparrow.loaders.safetensors import read_safetensors_dir

    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    cfg = cfg.get("text_config", cfg)
    sizes = {k: t.data.nbytes for k, t in read_safetensors_dir(folder).items() if "visual" not in k}
    embed = next((k for k in sizes if k.endswith("embed_tokens.weight")), None)
    head = next((k for k in sizes if k.endswith("lm_head.weight")), None)
    return _read_per_token(sizes, embed, head, ".experts.", cfg.get("num_experts_per_tok"), cfg.get("num_experts"))


def _read_per_token(sizes: dict, embed, head, expert_mark: str, used, experts) -> int:
    """Sum of sizes less the embedding when an output matrix exists, experts at used / experts."""
    total = 0
    for name, n in sizes.items():
        if name == embed and head in sizes:
            continue
        if expert_mark in name and used and experts:
            n = n * used // experts
        total += n
    return total


# ---------------------------------------------------------------------------------------------- KV


def kv_bytes_per_position(config, kv_dtype: str) -> int:
    """K and V bytes of one position in one layer (int8: the per-head scales too), as the
    cache's storage kind counts them."""
    from sparrow.state.storage import LAYER_KINDS

    return LAYER_KINDS[kv_dtype].bytes_at(config.num_key_value_heads, config.head_dim, 1)


def kv_layers(config) -> int:
    """Layers with a KV cache: all, or a hybrid model's (Qwen3.5) full-attention layers (its
    Gated DeltaNet layers keep a fixed-size recurrent state instead)."""
    types = getattr(config, "layer_types", None)
    return sum(t == "full_attention" for t in types) if types else config.num_hidden_layers


def kv_read_bytes(config, context: int, kv_dtype: str, sparse=None, copy_bytes_per_position: float = 0.0) -> float:
    """KV bytes a decode step at `context` positions reads over all layers: every position with
    exact attention; with sparse attention k blocks in the sparse layers (the dense ones read
    all), plus the selector's copy (probe keys or block summaries, copy_bytes_per_position over
    all layers, as KVCache.probe_nbytes / capacity gives it)."""
    per = kv_bytes_per_position(config, kv_dtype)
    layers = kv_layers(config)
    if sparse is None:
        return float(layers * context * per)
    dense = min(layers, sparse.dense_layers or 0)
    read = min(context, sparse.k * sparse.block)
    return float(dense * context * per + (layers - dense) * read * per + copy_bytes_per_position * context)


def fraction(bytes_per_token: float | None, tok_s: float | None, gb_s: float | None) -> float | None:
    """The share of the measured read bandwidth that tok_s tokens of bytes_per_token each reach."""
    if not (bytes_per_token and tok_s and gb_s):
        return None
    return bytes_per_token * tok_s / (gb_s * 1e9)
