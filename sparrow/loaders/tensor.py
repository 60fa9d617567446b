"""A tensor as stored in a checkpoint: a memory-mapped view plus how to read it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SparrowError
from ..quant import Weight


@dataclass
class StoredTensor:
    name: str
    data: np.ndarray  # memory-mapped view: f32/f16 values, bf16 as uint16, or raw GGUF blocks
    dtype: str  # "f32" | "f16" | "bf16" | "gguf"
    shape: tuple[int, ...]  # logical shape, Hugging Face order (out, in)
    ggml_type: object = None  # gguf.GGMLQuantizationType when dtype == "gguf"

    def to_weight(self) -> Weight:
        """Keep a 2-D matrix in its stored form (no f32 expansion)."""
        if self.dtype == "gguf":
            return Weight.from_gguf(self.data, self.ggml_type, self.shape, self.name)
        if self.dtype == "bf16":
            return Weight.from_bf16(self.data.reshape(self.shape))
        return Weight.from_array(self.data.reshape(self.shape))

    def to_array(self) -> np.ndarray:
        """Small tensors (norms, biases): a float32 copy, never a view of the file mapping. A
        view would fault the file's pages back into the resident set on every read (a large
        folio around each: ~45 MiB over Qwen3-1.7B's norms), after the model builder dropped them."""
        if self.dtype == "bf16":
            return (self.data.astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        a = self.to_weight().dequantize() if self.dtype == "gguf" else self.data
        return np.array(a, dtype=np.float32).reshape(self.shape)

    def rows(self, idx: np.ndarray) -> StoredTensor:
        """A row-permuted copy (GGUF llama q/k un-permutation); rows are independent blocks."""
        data = self.data.reshape(self.shape[0], -1)[idx]
        return StoredTensor(self.name, np.ascontiguousarray(data), self.dtype, self.shape, self.ggml_type)

    def expert(self, e: int) -> StoredTensor:
        """Expert e of a stacked [E, out, in] tensor as a 2-D view (no copy: stays memory-mapped)."""
        if len(self.shape) != 3 or not 0 <= e < self.shape[0]:
            raise SparrowError(f"{self.name}: no expert {e} in a tensor of shape {self.shape}")
        return StoredTensor(f"{self.name}[{e}]", self.data[e], self.dtype, self.shape[1:], self.ggml_type)
