"""Bit-exact reproducibility: the same input gives the same token ids and the same logits bytes
on a second run and with 1 versus 2 compute threads (kernels parallelise over independent
outputs only, never over a reduction), for prefill, decode and greedy generation."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import sparrow
from conftest import decode_logits, prompt


def _with_threads(llm, n):
    """The same loaded model run with n threads (LLM.threads is applied on every call)."""
    other = copy.copy(llm)
    other.threads = n
    return other


def _run(llm, ids, chat_prompt=None, n_decode=20):
    """(prefill logits, decode-path logits, greedy token ids) for one model / thread count."""
    full = llm.logits(ids)
    dec = decode_logits(llm, ids[: 3 + n_decode], prefill=3)
    gen = [o.token_id for o in llm.stream(chat_prompt or ids[:8].tolist(), chat=chat_prompt is not None, max_tokens=12)]
    return full, dec, gen


def _assert_same(a, b):
    assert a[0].tobytes() == b[0].tobytes(), "prefill logits differ"
    assert a[1].tobytes() == b[1].tobytes(), "decode logits differ"
    assert a[2] == b[2], "greedy tokens differ"


@pytest.fixture(scope="module")
def tiny_qwen3_variants(tiny_models):
    folder = tiny_models["qwen3"].folder
    return {
        "f32": sparrow.load(folder, threads=2),
        "q8_0+int8kv": sparrow.load(folder, threads=2, quantize="q8_0", kv_dtype="int8"),
    }


@pytest.mark.parametrize("variant", ["f32", "q8_0+int8kv"])
def test_tiny_qwen3_repeat_and_threads(variant, tiny_qwen3_variants):
    llm = tiny_qwen3_variants[variant]
    assert llm.threads == 2
    ids = prompt(40, seed=21)
    first = _run(llm, ids)
    _assert_same(first, _run(llm, ids))
    _assert_same(first, _run(_with_threads(llm, 1), ids))


def test_load_threads_argument(tiny_models):
    """load(threads=1) is a separate load path; its results equal a 2-thread load's."""
    folder = tiny_models["qwen3"].folder
    ids = prompt(20, seed=22)
    one, two = sparrow.load(folder, threads=1), sparrow.load(folder, threads=2)
    assert one.threads == 1 and two.threads == 2
    assert one.logits(ids).tobytes() == two.logits(ids).tobytes()


def test_default_model_repeat_and_threads(default_llm):
    ids = np.asarray(
        default_llm.tokenizer.encode(
            "Once upon a time, in a small village by the sea, there lived an old "
            "fisherman who told stories to every child that passed by his boat.",
            add_special_tokens=False,
        ),
        np.int64,
    )
    assert len(ids) >= 24
    kw = dict(chat_prompt="Tell me a story.", n_decode=8)
    first = _run(default_llm, ids, **kw)
    assert len(first[2]) == 12
    _assert_same(first, _run(default_llm, ids, **kw))
    other = 1 if default_llm.threads != 1 else 2
    _assert_same(first, _run(_with_threads(default_llm, other), ids, **kw))
