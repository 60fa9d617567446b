"""Rotary position embeddings in one place: the frequency tables (plain, linear, llama3 and YaRN
scaling, partial rotary through the rotated width the model passes), the cos/sin cache per
position (Rope), and per-token rows for M-RoPE or shifted positions (RowRope). The rotation
itself is the numba kernel kernels.elementwise.rope; a partial-rotary family (Qwen3.5) rotates
the first `rotary_dim` dims of each head with a Rope built for that width."""

from __future__ import annotations

import math

import numpy as np

from ..config import yarn_attention_factor
from ..kernels.elementwise import rope, rope_powers

__all__ = ["Rope", "RowRope", "model_rope"]


def model_rope(cfg) -> Rope:
    """The model's Rope: over the rotated width (rotary_dim where the family rotates part of
    each head, partial_rotary_factor; else head_dim), with its theta, scaling and M-RoPE sections."""
    return Rope(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.mrope_section)


class Rope:
    """Rotate-half rotary embedding, cos/sin cached per position in f32 like transformers (YaRN's
    attention factor included: transformers scales cos and sin by it, not the scores)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, mrope_section=()):
        self.mrope_section = tuple(mrope_section)
        self._shift = (None, None, None)  # (delta, table length, (cos, sin)) of the latest shifted()
        # transformers: inv_freq = 1 / theta ** (arange(0, d, 2) / d) in f32 (the power rounded once from f64)
        powers = rope_powers(theta, head_dim)  # [D/2]
        inv = np.float32(1) / powers  # [D/2]
        self.attention_factor = 1.0
        if scaling and scaling["rope_type"] == "yarn":
            self.inv_freq = _yarn_inv_freq(powers, scaling, head_dim, theta)
            self.attention_factor = yarn_attention_factor(scaling)
        else:
            self.inv_freq = _scale_inv_freq(inv, scaling)
        self.cos = np.zeros((0, head_dim // 2), np.float32)
        self.sin = np.zeros((0, head_dim // 2), np.float32)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * len(self.cos), 256)
        pos = np.arange(n, dtype=np.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [n, D/2] f32 product, as torch does
        self.cos, self.sin = self._cos_sin(freqs)

    def _cos_sin(self, freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
        if self.attention_factor != 1.0:  # f32 times the factor rounded to f32, as torch multiplies
            cos *= np.float32(self.attention_factor)
            sin *= np.float32(self.attention_factor)
        return cos, sin

    def ensure(self, n: int) -> None:
        """cos/sin rows exist for positions 0..n-1."""
        if n > len(self.cos):
            self._grow(n)

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: [T, H, D] at the given absolute positions [T]; returns a new array."""
        self.ensure(int(positions.max()) + 1)
        return rope(x, self.cos, self.sin, positions)

    def table(self, pos3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin rows [N, D/2] for per-token (t, h, w) positions pos3 [3, N] (Qwen3-VL's
        interleaved M-RoPE: frequency i follows axis h if i % 3 == 1 and i < 3 * s_h, w if
        i % 3 == 2 and i < 3 * s_w, else t; plain RoPE of pos3[0] without an mrope_section)."""
        freqs = pos3[0].astype(np.float32)[:, None] * self.inv_freq[None, :]  # [N, D/2]
        if self.mrope_section:
            for axis in (1, 2):
                idx = slice(axis, 3 * self.mrope_section[axis], 3)
                freqs[:, idx] = pos3[axis].astype(np.float32)[:, None] * self.inv_freq[None, idx]
        return self._cos_sin(freqs)

    def shifted(self, delta: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin tables whose row p holds position p + delta, for p < n (a decode step after
        images: its rope position is its cache position plus the prompt's rope delta)."""
        self.ensure(n + max(delta, 0))
        if delta == 0:
            return self.cos, self.sin
        d, length, tabs = self._shift
        if d != delta or length != len(self.cos):
            if delta > 0:
                tabs = self.cos[delta:], self.sin[delta:]
            else:  # rows p < -delta are never read: positions after a prompt are >= 0
                pad = np.zeros((-delta, self.cos.shape[1]), np.float32)
                tabs = np.concatenate([pad, self.cos]), np.concatenate([pad, self.sin])
            self._shift = (delta, len(self.cos), tabs)
        return tabs


class RowRope:
    """Rope with one cos/sin row per token of a forward (M-RoPE or shifted positions); apply()
    takes the row index of each token."""

    def __init__(self, cos: np.ndarray, sin: np.ndarray):
        self.cos, self.sin = cos, sin  # [N, D/2]

    def apply(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return rope(x, self.cos, self.sin, rows)


def _scale_inv_freq(inv: np.ndarray, scaling: dict | None) -> np.ndarray:
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    # llama3: long wavelengths slowed by `factor`, short kept, smooth blend in between.
    factor = float(scaling["factor"])
    lo = float(scaling.get("low_freq_factor", 1.0))
    hi = float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * np.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(is_mid, mid, scaled).astype(np.float32)


def _yarn_inv_freq(powers: np.ndarray, scaling: dict, dim: int, theta: float) -> np.ndarray:
    """transformers' _compute_yarn_parameters: frequencies that turn fewer than beta_slow times
    over the original context are interpolated (divided by factor), those that turn more than
    beta_fast times kept, a linear ramp over the dimensions in between; op for op in f32 after
    powers, theta ** exps (rope_powers)."""
    factor = float(scaling["factor"])
    orig = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: avoids dividing by zero
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolated = (np.float32(1) - np.clip(ramp, 0, 1)).astype(np.float32)  # [D/2], 1 = kept
    # torch's f32 power is off by one ulp from rope_powers' for ~1% of frequencies; the rest is
    # IEEE f32 arithmetic, the same on every CPU
    kept = (np.float32(1) / powers).astype(np.float32)
    interpolated = (np.float32(1) / (np.float32(factor) * powers)).astype(np.float32)
    out = interpolated * (np.float32(1) - extrapolated) + kept * extrapolated
    return out.astype(np.float32)
