"""Qwen3-VL's vision tower in sparrow's kernels: patch embedding, interpolated learned
positions, 2-D rotary attention blocks, the 2x2 patch merger and the DeepStack mergers.

Weights use Hugging Face names under `model.visual.` (mmproj GGUF names are mapped in
loaders/names.py); projections stay in stored form and run through kernels.linear.
"""

from __future__ import annotations

import numpy as np

from ..kernels.elementwise import rope, rope_powers
from ..kernels.linear import linear
from ..kernels.vision import attention, gelu, layer_norm
from ..loaders.tensor import StoredTensor
from .config import VisionConfig

PREFIX = "model.visual."


class _Linear:
    """A projection with bias: y = x @ W.T + b."""

    def __init__(self, get, name: str):
        self.w = get.weight(name + ".weight")
        self.b = get.array(name + ".bias")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return linear(np.ascontiguousarray(x), self.w) + self.b  # [T, out]


class _Norm:
    def __init__(self, get, name: str, eps: float):
        self.w, self.b, self.eps = get.array(name + ".weight"), get.array(name + ".bias"), eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return layer_norm(x, self.w, self.b, self.eps)


class _Block:
    def __init__(self, cfg: VisionConfig, get, p: str):
        eps = cfg.layer_norm_eps
        self.norm1, self.norm2 = _Norm(get, p + "norm1", eps), _Norm(get, p + "norm2", eps)
        self.qkv, self.proj = _Linear(get, p + "attn.qkv"), _Linear(get, p + "attn.proj")
        self.fc1, self.fc2 = _Linear(get, p + "mlp.linear_fc1"), _Linear(get, p + "mlp.linear_fc2")
        self.act = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, frames: list[slice]) -> np.ndarray:
        N, H, d = len(x), self.heads, self.head_dim
        qkv = self.qkv(self.norm1(x)).reshape(N, 3, H, d)  # [N, 3, H, d]
        rows = np.arange(N)
        q = rope(np.ascontiguousarray(qkv[:, 0]), cos, sin, rows)  # [N, H, d]
        k = rope(np.ascontiguousarray(qkv[:, 1]), cos, sin, rows)  # [N, H, d]
        v = qkv[:, 2]  # [N, H, d]
        out = np.empty((N, H, d), np.float32)
        for f in frames:  # full, non-causal attention within each frame
            out[f] = attention(q[f], k[f], v[f], d**-0.5)
        x = x + self.proj(out.reshape(N, H * d))  # [N, hid]
        return x + self.fc2(gelu(self.fc1(self.norm2(x)), self.act))  # [N, hid]


class _Merger:
    """LayerNorm, 2x2 neighbours concatenated (4 consecutive tokens), fc1, exact GELU, fc2.
    DeepStack mergers (post=True) normalise after the concatenation."""

    def __init__(self, cfg: VisionConfig, get, p: str, post: bool):
        self.norm = _Norm(get, p + "norm", cfg.layer_norm_eps)
        self.fc1, self.fc2 = _Linear(get, p + "linear_fc1"), _Linear(get, p + "linear_fc2")
        self.group = cfg.spatial_merge_size**2
        self.post = post

    def __call__(self, x: np.ndarray) -> np.ndarray:
        n = len(x) // self.group
        if self.post:
            x = self.norm(x.reshape(n, -1))  # [n, 4 hid]
        else:
            x = self.norm(x).reshape(n, -1)  # [n, 4 hid]
        return self.fc2(gelu(self.fc1(x), "none"))  # [n, out]


class VisionTower:
    def __init__(self, cfg: VisionConfig, get):
        self.config = cfg
        conv = get.stored(PREFIX + "patch_embed.proj.weight")  # [hid, C, kt, p, p]
        flat = StoredTensor(conv.name, conv.data, conv.dtype, (conv.shape[0], int(np.prod(conv.shape[1:]))))
        self.patch = flat.to_weight()  # [hid, C * kt * p * p]: the Conv3d as one matmul
        self.patch_b = get.array(PREFIX + "patch_embed.proj.bias")
        self.pos_embed = get.array(PREFIX + "pos_embed.weight")  # [side * side, hid]
        self.blocks = [_Block(cfg, get, f"{PREFIX}blocks.{i}.") for i in range(cfg.depth)]
        self.merger = _Merger(cfg, get, PREFIX + "merger.", post=False)
        self.deepstack = [
            _Merger(cfg, get, f"{PREFIX}deepstack_merger_list.{j}.", post=True)
            for j in range(len(cfg.deepstack_visual_indexes))
        ]
        half = cfg.head_dim // 2  # rotary: half the head follows rows, half columns
        self.inv_freq = np.float32(1) / rope_powers(cfg.rope_theta, half)  # [d/4]

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Merged tokens (image pads) of an image with patch grid (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.config.spatial_merge_size**2

    def __call__(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        """pixels [t*h*w, C*kt*p*p] in merge-block order -> (embeddings [n, out], DeepStack
        features [len(deepstack), n, out]) with n = t*h*w/4."""
        t, h, w = grid
        x = linear(np.ascontiguousarray(pixels, np.float32), self.patch) + self.patch_b  # [N, hid]
        row, col = _block_order(t, h, w, self.config.spatial_merge_size)  # [N] each
        x = x + self._positions(row, col, h, w)  # [N, hid]
        freqs = np.concatenate(
            [row.astype(np.float32)[:, None] * self.inv_freq, col.astype(np.float32)[:, None] * self.inv_freq], axis=1
        )  # [N, d/2]
        cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
        frames = [slice(i * h * w, (i + 1) * h * w) for i in range(t)]
        feats = []
        ds = self.config.deepstack_visual_indexes
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames)
            if i in ds:
                feats.append(self.deepstack[ds.index(i)](x))
        out_dim = self.config.out_hidden_size
        deep = np.stack(feats) if feats else np.zeros((0, len(x) // 4, out_dim), np.float32)
        return self.merger(x), deep  # [n, out] [K, n, out]

    def _positions(self, row: np.ndarray, col: np.ndarray, h: int, w: int) -> np.ndarray:
        """The learned square grid resampled bilinearly (align_corners=True) at each patch -> [N, hid]."""
        side = int(round(len(self.pos_embed) ** 0.5))
        rt, rw = _taps(row, h, side)  # [N, 2] each
        ct, cw = _taps(col, w, side)
        out = np.zeros((len(row), self.pos_embed.shape[1]), np.float32)
        for i in range(2):
            for j in range(2):
                wt = (rw[:, i] * cw[:, j]).astype(np.float32)  # [N]
                out += self.pos_embed[rt[:, i] * side + ct[:, j]] * wt[:, None]
        return out


def _taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped) and weights on a `side` grid for positions
    0..size-1 spread over it corner to corner; f32 as transformers computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))  # [N]
    floor = np.floor(src)
    offs = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offs, 0, side - 1)  # [N, 2]
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offs.astype(np.float32)), 0)
    return taps, weights.astype(np.float32)


def _block_order(t: int, h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Patch (row, col) of each token in merge-block order (block row, block col, in-row,
    in-col), repeated for each of the t frames -> [t*h*w] each."""
    r = np.arange(h).reshape(h // m, m)[:, None, :, None]  # [bh, 1, m, 1]
    c = np.arange(w).reshape(w // m, m)[None, :, None, :]  # [1, bw, 1, m]
    rows, cols = np.broadcast_arrays(r, c)  # [bh, bw, m, m]
    return np.tile(rows.reshape(-1), t), np.tile(cols.reshape(-1), t)
