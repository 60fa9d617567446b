"""Memory-mapped safetensors reader (single file or sharded), without torch."""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from ..errors import SparrowError
from .tensor import StoredTensor

_DTYPES = {"F32": ("f32", np.float32), "F16": ("f16", np.float16), "BF16": ("bf16", np.uint16)}


def read_safetensors(path: str) -> dict[str, StoredTensor]:
    """Map every tensor of one .safetensors file; validates offsets against the file size."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SparrowError(f"{name}: not a safetensors file (too short)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > size - 8 or hlen > 100_000_000:
                raise SparrowError(f"{name}: corrupt safetensors header (length {hlen}, file {size} bytes)")
            header = json.loads(f.read(hlen))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested without end
        raise SparrowError(f"{name}: cannot read safetensors header: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(header, dict):
        raise SparrowError(f"{name}: corrupt safetensors header (not a JSON object)")
    base = 8 + hlen
    out: dict[str, StoredTensor] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > base else None
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        kind, npdt, shape, start, end = _entry(name, tname, info)
        n = math.prod(shape)  # Python ints: a corrupt shape must not wrap around
        if base + end > size or end - start != n * np.dtype(npdt).itemsize:
            raise SparrowError(
                f"{name}: truncated or corrupt file: tensor {tname!r:.100} needs bytes {base + start}..{base + end}, "
                f"file has {size}"[:300]
            )
        data = (mm[base + start : base + end] if n else np.zeros(0, np.uint8)).view(npdt).reshape(shape)
        out[tname] = StoredTensor(tname, data, kind, shape)
    return out


def _entry(name: str, tname: str, info) -> tuple:
    """One header entry checked for types and signs: (kind, numpy dtype, shape, start, end)."""

    def bad(why):
        raise SparrowError(f"{name}: corrupt safetensors header: tensor {tname!r:.100} {why}")

    if not isinstance(info, dict):
        bad("is not an object")
    dt = info.get("dtype")
    if not isinstance(dt, str) or dt not in _DTYPES:
        bad(f"has unsupported dtype {dt!r:.40} (supported: F32, F16, BF16)")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_nonneg_int(s) for s in shape):
        bad(f"has shape {shape!r:.60}, not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_nonneg_int(o) for o in offsets):
        bad(f"has data_offsets {offsets!r:.60}, not [start, end]")
    start, end = offsets
    if start > end:
        bad(f"has data_offsets {offsets!r:.60}, ending before they start")
    kind, npdt = _DTYPES[dt]
    return kind, npdt, tuple(shape), start, end


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_safetensors_dir(path: str) -> dict[str, StoredTensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        bad = SparrowError(f"{index}: corrupt index (expected a weight_map of tensor -> shard file)")
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise bad from None
        if not all(isinstance(fn, str) and os.path.basename(fn) == fn for fn in files):
            raise bad
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise SparrowError(f"{path}: no *.safetensors files")
    tensors: dict[str, StoredTensor] = {}
    for fn in files:
        fp = os.path.join(path, fn)
        if not os.path.exists(fp):
            raise SparrowError(f"{path}: shard {fn} listed in the index is missing")
        tensors.update(read_safetensors(fp))
    return tensors
