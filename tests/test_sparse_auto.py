"""--sparse-attn auto: sparse settings that start at a context length (SparseParams.from_context),
the per-CPU crossover table that auto starts from, and the edges that accept the mode."""

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.kernels.attention import crossover
from sparrow.params import AUTO_K, AUTO_P, SPARSE_ATTN_DEFAULT, SparseParams
from sparrow.state.sparse import sparse_at


def test_auto_is_v3_on_4bit_codes_with_top_p_from_the_crossover():
    auto = SparseParams.from_options(sparse_attn="auto")
    assert (auto.select, auto.k, auto.p, auto.key_bits, auto.from_context) == ("v3", AUTO_K, AUTO_P, 4, None)
    assert auto.label == "v3-q4-p0.95-fromauto"
    assert SparseParams.from_label(auto.label) == auto
    assert SparseParams.from_label("seed-from4096").from_context == 4096
    # the other options refine auto's settings; on keeps its seed default
    assert SparseParams.from_options(sparse_attn="auto", sparse_k=64).k == 64
    assert SparseParams.from_options(sparse_attn="auto", sparse_select="v2").p is None
    assert SparseParams.from_options(sparse_attn="auto", sparse_select="v2").key_bits == 8
    assert SparseParams.from_options(sparse_attn="auto", sparse_key_bits=8).label == "v3-p0.95-fromauto"
    assert SparseParams.from_options(sparse_attn="on", sparse_select="v3").key_bits == 8
    assert SparseParams.from_options(sparse_attn="on").select == "seed"
    assert SparseParams.from_options(sparse_attn=False) is None and SparseParams.from_options(sparse_attn="off") is None
    default = SparseParams.from_options()
    assert (default is None) == (SPARSE_ATTN_DEFAULT == "off")
    with pytest.raises(SparrowError, match="sparse_attn must be"):
        SparseParams.from_options(sparse_attn="maybe")
    with pytest.raises(SparrowError, match="sparse_from_context must be"):
        SparseParams(from_context=-1)
    with pytest.raises(SparrowError, match="from<N>, fromauto"):
        SparseParams.from_label("v3-fromsoon")


def test_sparse_at_turns_on_at_the_context_the_table_gives(monkeypatch):
    monkeypatch.setitem(crossover.SPARSE_FROM, crossover.vector_path(), {64: 600, 128: 400, 256: 300})
    # a head_dim between rows takes the smaller head_dim's row; below the first, the first
    assert [crossover.sparse_from(d) for d in (32, 64, 96, 128, 200, 256, 512)] == [600, 600, 600, 400, 400, 300, 300]
    auto = SparseParams.auto()
    assert sparse_at(auto, 399, 128) is None and sparse_at(auto, 400, 128) is auto
    fixed = SparseParams(from_context=50)
    assert sparse_at(fixed, 49, 64) is None and sparse_at(fixed, 50, 64) is fixed
    assert sparse_at(None, 10**6, 64) is None
    plain = SparseParams()
    assert sparse_at(plain, 1, 64) is plain
    assert all(sorted(rows) == sorted(rows, key=rows.get, reverse=True) for rows in crossover.SPARSE_FROM.values())


@pytest.mark.parametrize("fused", [True, False])
def test_exact_below_from_context_bit_for_bit_and_sparse_from_it(default_llm, fused, monkeypatch):
    """Steps attending over fewer positions than from_context are exact attention's bits; the
    first step at from_context selects (k=2 blocks leave most of the context out)."""
    from test_fused_decode import _decode

    from sparrow.models import fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a busy machine must not send steps staged

    ids = np.asarray(default_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:300])
    at = 290  # the step at position 289 attends over 290 positions
    sp = SparseParams(select="v3", k=2, from_context=at)
    exact = _decode(default_llm, ids, 280, None, fused=fused)
    late = _decode(default_llm, ids, 280, sp, fused=fused)
    first = at - 1 - 280  # row of position 289
    assert late[:first].tobytes() == exact[:first].tobytes()
    assert not np.array_equal(late[first], exact[first])


def test_the_budget_charges_the_codes_only_where_auto_turns_on(default_llm, monkeypatch):
    from sparrow.state.budget import probe_of

    monkeypatch.setitem(crossover.SPARSE_FROM, crossover.vector_path(), {64: 1024})
    auto = SparseParams.auto()
    assert probe_of(auto, None, 1023, 64) == [] and probe_of(auto, None, 1024, 64) == [(32, "v3q4")]
    from sparrow.engine.engine import Engine

    engine = Engine(default_llm.handle)  # its manager prices a request with the model's head_dim
    try:
        assert default_llm.config.head_dim == 64
        assert engine.kv.kv_bytes(1000, "f32", auto) == engine.kv.kv_bytes(1000, "f32", None)
        assert engine.kv.kv_bytes(2048, "f32", auto) > engine.kv.kv_bytes(2048, "f32", None)
        assert engine.kv.kv_bytes(2048, "int8", auto) > engine.kv.kv_bytes(2048, "int8", None)  # a copy for int8 too
    finally:
        engine.stop()


def test_cli_and_server_take_the_mode():
    from sparrow.cli import build_parser
    from sparrow.request import sampling_from_flags
    from sparrow.server.protocol import APIError, parse_chat

    def cli(*flags):
        return sampling_from_flags(build_parser().parse_args(["generate", "--prompt", "x", *flags]))[1]

    assert cli("--sparse-attn").select == "seed"  # alone: on, as before
    assert cli("--sparse-attn", "auto").from_context is None
    assert cli("--sparse-attn", "off") is None
    assert cli("--sparse-attn", "--sparse-select", "v2", "--sparse-dense-layers", "0").dense_layers == 0
    assert (cli() is None) == (SPARSE_ATTN_DEFAULT == "off")
    chat = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": chat, "sparse_attn": "auto"}).sparse == SparseParams.auto()
    assert parse_chat({"messages": chat, "sparse_attn": True}).sparse.select == "seed"
    assert parse_chat({"messages": chat, "sparse_attn": "off"}).sparse is None
    assert parse_chat({"messages": chat, "sparse_attn": "auto", "sparse_dense_layers": 0}).sparse.dense_layers == 0
    for bad, param in [
        ({"sparse_attn": "maybe"}, "sparse_attn"),
        ({"sparse_attn": True, "sparse_dense_layers": 1}, "sparse_attn"),  # the seed has no exact layers
        ({"sparse_attn": True, "sparse_select": "v2", "sparse_dense_layers": -1}, "sparse_dense_layers"),
    ]:
        with pytest.raises(APIError) as e:
            parse_chat({"messages": chat, **bad})
        assert e.value.param == param, bad
