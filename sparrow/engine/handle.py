"""What the engine needs of a loaded model, handed down by the layer that loaded it.

The engine (engine.py) and speculative decoding (speculative.py) take a `ModelHandle`, not the
public `api.LLM`: the runner that does every forward, the tokenizer, the context length, the
default KV storage and thread count, and a factory for draft models (speculative 'draft'), so
nothing below the API reaches back up to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .runner import Runner


@dataclass(frozen=True)
class ModelHandle:
    runner: Runner  # every forward goes through it (chunked prefill, decode batches)
    tokenizer: object  # sparrow.tokenizer.Tokenizer
    ctx: int  # the context length a sequence may reach
    kv_dtype: str  # the KV storage of requests that do not say
    threads: int  # numba's thread count for the thread that runs it
    # speculative 'draft': the draft model at a path, as a handle (loaded once, checked to share
    # the tokenizer); None: no draft models
    draft: Callable[[str], ModelHandle] | None = None
