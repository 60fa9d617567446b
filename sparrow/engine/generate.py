"""Single-sequence generation as a generator: chunked prefill, then one token per step.

The CLI and the Python API iterate `generate_step`; the server's scheduler drives the same
`Sequence` objects, batching their decode steps.
"""

from __future__ import annotations

import time
from typing import Iterator

from ..params import SparseParams
from ..models.decoder import Timer
from .sampling import Sampler, SamplingParams
from .sequence import Sequence, StepOutput, check_context

PREFILL_CHUNK = 512


def new_sequence(model, tokenizer, prompt_ids: list[int], params: SamplingParams, ctx: int,
                 kv_dtype: str = "f32", sparse: SparseParams | None = None, trace: bool = False) -> Sequence:
    """Validates the request against the context and allocates exactly the KV it can use."""
    params.validate()
    check_context(len(prompt_ids), params.max_tokens, ctx)
    cache = model.new_cache(len(prompt_ids) + params.max_tokens, kv_dtype)
    sampler = Sampler(params, model.config.vocab_size)
    sampler.observe_prompt(prompt_ids)
    return Sequence(
        prompt=list(prompt_ids), params=params, cache=cache, sampler=sampler,
        detok=tokenizer.incremental_decoder(skip_special_tokens=True),
        eos_ids=set(tokenizer.eos_token_ids), sparse=sparse, trace=[] if trace else None,
    )


def generate_step(model, seq: Sequence, timings: bool = False, prefill_chunk: int = PREFILL_CHUNK) -> Iterator[StepOutput]:
    """Yields one StepOutput per generated token until the sequence finishes.

    With timings, the first output's `timing` holds prefill stats and every output holds its
    own decode step split: {"total", "attn", "mlp"} in ms.
    """
    t0 = time.perf_counter()
    logits = None
    while not seq.prefill_done:
        logits = model.forward([seq.prefill_segment(prefill_chunk)])
    prefill_s = time.perf_counter() - t0
    out = seq.accept(logits[0])
    if timings:
        out.timing = {"prefill_ms": prefill_s * 1e3, "prefill_tokens": len(seq.prompt)}
    yield out
    while not seq.done:
        timer = Timer() if timings else None
        logits = model.forward([seq.decode_segment()], timer=timer)
        out = seq.accept(logits[0])
        if timer:
            out.timing = {"total": timer.total * 1e3, "attn": timer.attn * 1e3, "mlp": timer.mlp * 1e3}
        yield out
