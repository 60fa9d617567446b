"""Request options as typed, validated objects: sampling, block-sparse attention, KV storage.

They are built once at the edge (CLI arguments, an HTTP request, `LLM` keyword arguments) and
passed down as objects; nothing below the edge re-validates or rebuilds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import SparrowError

KV_DTYPES = ("f32", "f16", "int8")


def check_kv_dtype(name: str) -> str:
    """Returns name if it is a KV cache storage kind, else raises SparrowError."""
    if name not in KV_DTYPES:
        raise SparrowError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return name


@dataclass
class SparseParams:
    """Per-request block-sparse attention settings (None instead of this means exact)."""

    k: int = 32  # blocks selected per query head
    block: int = 32  # tokens per block
    probe: int = 8  # probe keys per block
    prefill: bool = False  # also select blocks for prefill queries (causal prefix, no importance)

    def __post_init__(self):
        for name in ("k", "block", "probe"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SparrowError(
                    f"sparse attention needs integer k, block and probe >= 1 (got k={self.k!r}, "
                    f"block={self.block!r}, probe={self.probe!r})"
                )


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/llama.cpp style: divides positive logits, multiplies negative ones
    presence_penalty: float = 0.0  # OpenAI style, subtracted once per seen token
    frequency_penalty: float = 0.0  # OpenAI style, subtracted per occurrence
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report (0 = only the chosen token)

    def validate(self) -> "SamplingParams":
        def bad(msg):
            raise SparrowError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"top_logprobs must be in [0, 20], got {self.logprobs}")
        return self
