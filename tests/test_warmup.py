"""The server's warm-up runs every path a request may take, so no request compiles kernels
while other streams wait (a first sparse request used to freeze every stream for ~70 s)."""

from __future__ import annotations

import sys
import threading

import pytest
from numba.core.dispatcher import Dispatcher

from sparrow.engine.engine import Engine
from sparrow.engine.warmup import PATHS, SERVER_PATHS, warm
from sparrow.errors import SparrowError
from sparrow.params import SamplingParams, SparseParams
from sparrow.request import GenerationRequest

WARM = True


def _overloads() -> dict[str, int]:
    """How many compiled signatures each of sparrow's kernels holds in this process (a
    signature is added when a call compiles it, or loads it from the disk cache)."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith("sparrow."):
            for attr, v in list(vars(mod).items()):
                if isinstance(v, Dispatcher):
                    out[f"{name}.{attr}"] = len(v.overloads)
    return out


def _run_together(eng, group):
    """Submits every (ids, sparse[, trace]) of group at once; returns when all have finished."""
    done = [threading.Event() for _ in group]
    errors = []

    def emit(i):
        def f(kind, out):
            if kind == "error":
                errors.append(out)
            if kind == "error" or getattr(out, "finish_reason", None):
                done[i].set()

        return f

    for i, (ids, sp, *trace) in enumerate(group):
        eng.submit(GenerationRequest(ids, SamplingParams(max_tokens=4), sp, trace=bool(trace)), emit(i))
    assert all(d.wait(600) for d in done) and not errors, errors


def test_no_request_compiles_after_the_servers_warm_up(default_llm):
    """After Engine.start's warm-up, a mix of every request kind (exact, a short prompt,
    batched, every selector (v3 on both key codes), sparse prefill, the sparse_trace field's traced decode, alone and
    together) compiles or loads no kernel: each would be a compile inside a request on a cold
    cache."""
    ready = threading.Event()
    warmed = []
    eng = Engine(default_llm.handle, max_batch=4)
    eng.start(warmup=WARM, on_ready=ready.set, on_warm=lambda name, i, n, s: warmed.append((name, i, n)))
    try:
        assert ready.wait(1800)  # a cold cache compiles every path first
        assert [w[0] for w in warmed] == list(SERVER_PATHS if WARM is True else WARM)
        tok = default_llm.tokenizer
        long_ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)  # ~120 tokens
        kinds = [
            (long_ids, None),
            (long_ids[:3], None),  # shorter than the GEMM threshold
            (long_ids, SparseParams(k=2, block=16)),
            (long_ids, SparseParams(k=2, block=16, select="v2")),
            (long_ids, SparseParams(k=2, block=16, prefill=True)),
            (long_ids[:40], SparseParams(k=1, block=8, select="v2", prefill=True)),
            (long_ids, SparseParams(k=2, block=16), "traced"),  # fused alone, staged beside others
            (long_ids, SparseParams(k=2, block=16, select="v2"), "traced"),
            (long_ids, SparseParams(k=2, block=16, select="v3")),
            (long_ids, SparseParams(k=2, block=24, select="v3", key_bits=4, p=0.9)),  # auto's codes
        ]
        before = _overloads()
        for batch in ([k] for k in kinds), [kinds]:  # each alone, then all at once
            for group in batch:
                _run_together(eng, group)
        after = _overloads()
        grew = sorted(k for k, n in after.items() if n > before.get(k, 0))
        assert grew == [], f"kernels compiled (or loaded) for a request after the warm-up: {grew}"
    finally:
        eng.stop()


def test_warm_reports_each_path_and_rejects_unknown_ones(default_llm):
    got = []
    done = warm(default_llm.runner, default_llm.tokenizer, "f32", ("exact",), lambda *a: got.append(a))
    assert [d[0] for d in done] == ["exact"] and got[0][:3] == ("exact", 1, 1)
    assert set(SERVER_PATHS) == set(PATHS)
    with pytest.raises(ValueError, match="unknown warm-up path 'fast'"):
        warm(default_llm.runner, default_llm.tokenizer, "f32", ("fast",))


def test_compile_command_names_unknown_paths():
    from sparrow.cli import main

    with pytest.raises(SystemExit):
        main(["compile", "--kv-dtype", "bf16"])  # argparse: not a KV storage
    assert main(["compile", "--paths", "exact,turbo"]) == 1  # one line, no traceback


def test_sparrow_error_is_what_unknown_paths_raise():
    from sparrow.cli import build_parser, cmd_compile

    a = build_parser().parse_args(["compile", "--paths", "turbo"])
    with pytest.raises(SparrowError, match="unknown path 'turbo'"):
        cmd_compile(a)


def test_compile_progress_listens_once_per_process():
    """Each `announce_compiles` call (the CLI's, the server's, a test's) replaces the writer of
    one numba listener: a compile is reported once, not once per call."""
    from numba.core import event

    from sparrow.kernels import runtime as K

    first, second = [], []
    K.announce_compiles(first.append)
    K.announce_compiles(second.append)
    ours = [lst for lst in event._registered["numba:compile"] if lst is K._progress]
    assert len(ours) == 1 and K._progress.write == second.append


def test_the_cli_names_the_compile_a_cold_cache_faces(capsys):
    """The notice follows the cache's state before the load (a q8-mode load compiles its
    interleaving, so after it the cache is no longer cold) and the mode's own estimate."""
    from sparrow.cli import _compile_notice
    from sparrow.kernels import runtime as K

    _compile_notice(cold=True, activations="q8")
    _compile_notice(cold=True, activations="f32")
    _compile_notice(cold=False, activations="q8")
    assert capsys.readouterr().err.splitlines() == [K.COMPILE_NOTICE_Q8, K.COMPILE_NOTICE]
