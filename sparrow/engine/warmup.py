"""Compiling ahead of the first request: each path a run may take is run once on a tiny
input, so numba compiles its kernels (or loads them from the disk cache) now, not inside
the request that first needs them, where the server would freeze every other stream.

Which kernels a path compiles is decided by types, not values (kernels/fused/decode_step.py):
the fused step of exact requests never compiles the block selection, so a server that may
see sparse requests compiles both. `sparrow serve` warms every path its flags allow
(SERVER_PATHS), `sparrow compile` the ones asked for, a CLI run only what it uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..kernels import linear as _linear
from ..kernels.elementwise import PAR_ROWS
from ..params import V3_KEY_BITS, SparseParams

# name -> what it compiles (in the order a server warms them)
PATHS = {
    "exact": "prefill (also returning every position's logits: prompt logprobs) and one sequence's decode, exact",
    "batched": "decode of several sequences in one forward",
    "seed": "sparse decode with the seed selector, one sequence and several",
    "v2": "sparse decode with the v2 selector, one sequence and several",
    "v3": "sparse decode with the v3 selector on int8 and 4-bit key codes (auto's), one sequence and several",
    "sparse-prefill": "sparse prefill (--sparse-prefill, the request's sparse_prefill)",
}
SERVER_PATHS = tuple(PATHS)  # any request may ask for sparse attention

# tokens: past SMALL_T, so prefill takes the GEMM path, and past 2 PAR_ROWS, so the element
# kernels take their parallel chunks
_PROMPT = max(3 * _linear.SMALL_T, 2 * PAR_ROWS + 8)
_SHORT = max(_linear.SMALL_T // 2, 2)  # a prompt short enough for the row dots' prefill path
_SPARSE = dict(k=1, block=8)  # blocks of 8 in the prompt: k < blocks, so blocks are selected


def _ids(tokenizer, n: int = _PROMPT) -> np.ndarray:
    ids = list(tokenizer.encode("Hello there. " * n) or [0])
    return np.resize(np.asarray(ids, np.int64), n)  # repeated to n tokens


def _run(runner, ids, kv_dtype, sparse, n_seqs):
    """Prefills n_seqs copies of ids, then decodes two tokens for all of them together and a
    third on the staged path, which a step takes beside a traced sequence or while the fused
    path backs off after contention (models/fused.py)."""
    slots = [runner.new_slot(ids, len(ids) + 3, kv_dtype, sparse) for _ in range(n_seqs)]
    tokens = []
    for s in slots:
        tokens.append(int(np.argmax(runner.prefill(s))))
    for _ in range(2):
        tokens = list(np.argmax(runner.decode(slots, tokens), axis=-1))
    fused = getattr(runner.model, "use_fused", None)
    if fused:
        runner.model.use_fused = False
        try:
            runner.decode(slots, tokens)
        finally:
            runner.model.use_fused = fused


def _path(name: str, runner, ids, kv_dtype) -> None:
    if name == "exact":
        _run(runner, ids, kv_dtype, None, 1)
        _run(runner, ids[:_SHORT], kv_dtype, None, 1)
        runner.prefill_step(runner.new_slot(ids, len(ids), kv_dtype), rows=[])  # the head over every row
    elif name == "batched":
        _run(runner, ids, kv_dtype, None, 2)
    elif name in ("seed", "v2"):
        sp = SparseParams(select=name, **_SPARSE)
        _run(runner, ids, kv_dtype, sp, 1)
        _run(runner, ids, kv_dtype, sp, 2)
    elif name == "v3":
        for bits in V3_KEY_BITS:  # their copies' packing differs; the kernels' types do not
            sp = SparseParams(select="v3", key_bits=bits, **_SPARSE)
            _run(runner, ids, kv_dtype, sp, 1)
            _run(runner, ids, kv_dtype, sp, 2)
    elif name == "sparse-prefill":
        for select in ("seed", "v2"):
            _run(runner, ids, kv_dtype, SparseParams(select=select, prefill=True, **_SPARSE), 1)
    else:
        raise ValueError(f"unknown warm-up path {name!r} (one of {', '.join(PATHS)})")


def warm(
    runner, tokenizer, kv_dtype: str, paths=SERVER_PATHS, report: Callable[[str, int, int, float], None] | None = None
) -> list[tuple[str, float]]:
    """Runs each of `paths` once; returns [(name, seconds)]. report(name, i, n, seconds) is
    called after each (i counts from 1), for progress lines."""
    ids = _ids(tokenizer)
    done = []
    for i, name in enumerate(paths, 1):
        t0 = time.perf_counter()
        _path(name, runner, ids, kv_dtype)
        done.append((name, time.perf_counter() - t0))
        if report is not None:
            report(name, i, len(paths), done[-1][1])
    return done
