"""The public Python API shared by the CLI, the server and users.

    llm = sparrow.load()                      # default model; or a folder / .gguf path
    ids = llm.tokenizer.encode("Hello")
    logits = llm.logits(ids)                  # [len(ids), vocab] float32, exact attention
    for piece in llm.generate("Hi!", max_tokens=32, sparse_attn=True):
        print(piece, end="")
"""

from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np

from .engine.generate import generate_step, new_sequence
from .params import SamplingParams
from .engine.sequence import StepOutput
from .errors import SparrowError
from .kernels import set_threads
from .params import KV_DTYPES, SparseParams
from .loaders import open_checkpoint


def sparse_params(sparse_attn: bool = False, sparse_k: int = 32, sparse_block: int = 32,
                  sparse_probe: int = 8, sparse_prefill: bool = False) -> SparseParams | None:
    if not sparse_attn:
        return None
    return SparseParams(k=sparse_k, block=sparse_block, probe=sparse_probe, prefill=sparse_prefill)


class LLM:
    def __init__(self, checkpoint, model, kv_dtype: str, threads: int, ctx: int, load_seconds: float):
        self.checkpoint = checkpoint
        self.model = model
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.name = checkpoint.name
        self.kv_dtype = kv_dtype
        self.threads = threads
        self.ctx = ctx
        self.load_seconds = load_seconds

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, prompt, chat: bool | None = None, system: str | None = None,
                   chat_template_kwargs: dict | None = None, assistant_prefix: str = "") -> list[int]:
        """A string is a raw completion prompt unless chat=True; a list is chat messages."""
        tok = self.tokenizer
        if isinstance(prompt, str) and not chat:
            return tok.encode(prompt, add_special_tokens=True)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if system is not None:
            messages = [{"role": "system", "content": system}] + [m for m in messages if m.get("role") != "system"]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **(chat_template_kwargs or {}))
        # The template already holds any bos it needs; encode special tokens as written.
        return tok.encode(text + assistant_prefix, add_special_tokens=False)

    # ------------------------------------------------------------------ forward
    def logits(self, token_ids, sparse_attn: bool = False, sparse_k: int = 32, sparse_block: int = 32,
               sparse_probe: int = 8, sparse_prefill: bool = False, kv_dtype: str | None = None) -> np.ndarray:
        """One full forward over token_ids; float32 logits [len(token_ids), vocab]."""
        set_threads(self.threads)
        ids = np.asarray(token_ids, np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise SparrowError("token_ids must be a non-empty 1-D sequence")
        if len(ids) > self.ctx:
            raise SparrowError(f"{len(ids)} tokens exceed the context length {self.ctx}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise SparrowError(f"token id out of range [0, {self.config.vocab_size})")
        from .models.decoder import Segment

        cache = self.model.new_cache(len(ids), kv_dtype or self.kv_dtype)
        sparse = sparse_params(sparse_attn, sparse_k, sparse_block, sparse_probe, sparse_prefill)
        return self.model.forward([Segment(ids, cache, 0, sparse)], all_logits=True)

    # ------------------------------------------------------------------ generation
    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, seed: int | None = None,
               stop=None, logprobs: int | None = None, chat: bool | None = None, system: str | None = None,
               chat_template_kwargs: dict | None = None, assistant_prefix: str = "",
               sparse_attn: bool = False, sparse_k: int = 32, sparse_block: int = 32, sparse_probe: int = 8,
               sparse_prefill: bool = False, kv_dtype: str | None = None, timings: bool = False,
               trace: list | None = None) -> Iterator[StepOutput]:
        """Like generate() but yields StepOutput (token id, text delta, logprobs, finish reason)."""
        set_threads(self.threads)
        ids = prompt if _is_token_ids(prompt) else self.prompt_ids(prompt, chat, system, chat_template_kwargs, assistant_prefix)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
            min_p=float(min_p), repetition_penalty=float(repetition_penalty),
            presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty), seed=seed,
            stop=[stop] if isinstance(stop, str) else list(stop or []), logprobs=logprobs,
        )
        kv = kv_dtype or self.kv_dtype  # an unknown dtype is reported when the cache is made
        sparse = sparse_params(sparse_attn, sparse_k, sparse_block, sparse_probe, sparse_prefill)
        seq = new_sequence(self.model, self.tokenizer, list(ids), params, self.ctx, kv, sparse, trace is not None)
        for out in generate_step(self.model, seq, timings=timings):
            if trace is not None and seq.trace:
                trace.append(list(seq.trace))
                seq.trace.clear()
            yield out

    def generate(self, prompt, **kwargs) -> Iterator[str]:
        """Yields text pieces as they become final. Accepts the options of stream()."""
        for out in self.stream(prompt, **kwargs):
            if out.text:
                yield out.text


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0 and isinstance(prompt[0], (int, np.integer))


def load(path: str | None = None, kv_dtype: str = "f32", threads: int | None = None,
         quantize: str | None = None, ctx: int | None = None, progress: bool = False) -> LLM:
    """Loads a HF folder, a .gguf file, or (path None) the default SmolLM2-135M-Instruct GGUF."""
    from .models import build_model

    if kv_dtype not in KV_DTYPES:
        raise SparrowError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if quantize not in (None, "q8_0"):
        raise SparrowError(f"--quantize supports q8_0, got {quantize!r}")
    threads = set_threads(threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")
    except ImportError:
        pass
    t0 = time.perf_counter()
    ckpt = open_checkpoint(os.path.expanduser(path) if path else None)
    model = build_model(ckpt, quantize=quantize, progress=progress)
    max_ctx = ckpt.config.max_position_embeddings
    if ctx is not None and (not isinstance(ctx, int) or ctx < 1):
        raise SparrowError(f"ctx must be a positive integer, got {ctx!r}")
    return LLM(ckpt, model, kv_dtype, threads, ctx or max_ctx, time.perf_counter() - t0)
