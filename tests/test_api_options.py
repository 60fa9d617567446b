"""Options as objects at the edge (API keywords, CLI flags), load-time validation, and timing
that lives outside the model code."""

import numpy as np
import pytest

import sparrow
from sparrow.errors import SparrowError
from sparrow.models.timing import STAGES, timed
from sparrow.params import SamplingParams, SparseParams, options_to_params


def test_load_checks_settings_before_the_slow_load(tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")  # would fail only once loading starts
    for kw, word in (
        ({"ctx": 0}, "ctx"),
        ({"ctx": True}, "ctx"),
        ({"kv_dtype": "q4"}, "kv_dtype"),
        ({"quantize": "q4_0"}, "quantize"),
    ):
        with pytest.raises(SparrowError) as e:
            sparrow.load(missing, **kw)
        assert word in str(e.value) and "--" not in str(e.value), str(e.value)  # API words, not CLI flags


def test_options_to_params_builds_both_objects_once():
    sampling, sparse = options_to_params(
        {"max_tokens": 3, "stop": "x", "temperature": 1, "sparse_attn": True, "sparse_k": 4}
    )
    assert sampling == SamplingParams(max_tokens=3, stop=["x"], temperature=1.0)
    assert isinstance(sampling.temperature, float)
    assert sparse == SparseParams(k=4)
    assert options_to_params({"sparse_k": 4})[1] is None  # sparse_attn is what turns it on
    v2 = options_to_params({"sparse_attn": True, "sparse_select": "v2"})[1]
    assert v2 == SparseParams(select="v2") and v2.dense_layers == 2
    with pytest.raises(SparrowError, match="sparse_select must be one of seed, v2"):
        options_to_params({"sparse_attn": True, "sparse_select": "quest"})
    with pytest.raises(SparrowError, match="unknown option"):
        options_to_params({"max_token": 3})


def test_stream_takes_objects_or_keywords_not_both(default_llm):
    ids = default_llm.tokenizer.encode("The capital of France is")
    by_kw = [
        o.token_id for o in default_llm.stream(ids, max_tokens=4, temperature=0.7, seed=3, sparse_attn=True, sparse_k=1)
    ]
    by_obj = [
        o.token_id
        for o in default_llm.stream(
            ids, sampling=SamplingParams(max_tokens=4, temperature=0.7, seed=3), sparse=SparseParams(k=1)
        )
    ]
    assert by_kw == by_obj
    with pytest.raises(SparrowError, match="not both"):
        next(default_llm.stream(ids, sampling=SamplingParams(), max_tokens=3))
    with pytest.raises(SparrowError, match="not both"):
        next(default_llm.stream(ids, sparse=SparseParams(), sparse_k=3))
    with pytest.raises(SparrowError, match="unknown option"):
        next(default_llm.stream(ids, max_tokenz=3))
    with pytest.raises(SparrowError, match="temperature"):
        next(default_llm.stream(ids, temperature=-1))
    with pytest.raises(SparrowError, match="repetition_penalty"):  # > 0, but 0 as a float32
        next(default_llm.stream(ids, repetition_penalty=1e-320))


def test_timing_is_outside_the_model_and_changes_nothing(default_llm):
    model = default_llm.model
    ids = default_llm.tokenizer.encode("Timing must not change a single bit")
    plain = default_llm.logits(ids)
    with timed(model) as timer:
        timed_logits = default_llm.logits(ids)
        with timed(model) as inner:  # nested blocks each see the time
            default_llm.logits(ids[:4])
    assert timed_logits.tobytes() == plain.tobytes()
    assert timer.total > inner.total > 0 and timer.matmul > 0 and timer.attn > 0 and timer.mlp > 0
    assert timer.total >= timer.matmul + timer.attn
    assert model.timer is None and not any(name in model.__dict__ for name in STAGES)  # nothing replaced; off again
    assert np.array_equal(default_llm.logits(ids), plain)
