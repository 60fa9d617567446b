"""Memory-mapped safetensors reader (single file or sharded), without torch."""

from __future__ import annotations

import json
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
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise SparrowError(f"{name}: cannot read safetensors header: {e}") from None
    base = 8 + hlen
    out: dict[str, StoredTensor] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > base else None
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        dt = info.get("dtype")
        if dt not in _DTYPES:
            raise SparrowError(f"{name}: tensor {tname} has unsupported dtype {dt} (supported: F32, F16, BF16)")
        kind, npdt = _DTYPES[dt]
        start, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        n = int(np.prod(shape)) if shape else 1
        if base + end > size or end - start != n * np.dtype(npdt).itemsize:
            raise SparrowError(
                f"{name}: truncated or corrupt file: tensor {tname} needs bytes {base + start}..{base + end}, "
                f"file has {size}"
            )
        data = mm[base + start : base + end].view(npdt).reshape(shape)
        out[tname] = StoredTensor(tname, data, kind, shape)
    return out


def read_safetensors_dir(path: str) -> dict[str, StoredTensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
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
