"""Golden bits: hashes of linear()'s outputs for every stored format, activations mode and
T class (decode, a batch of rows, prefill), of the fused decode step's logits, and of the
default model's logits (a prefill and fused decode steps, tests/test_cpu_paths.py's
model_logits), as they are today. Moving or renaming kernels (issue 33) must leave every hash
as it is; a change of a documented numerical order (or, for the fused table, of the tiny
model's weights) is the only reason to regenerate them, in its own commit: `python
tests/test_golden_bits.py` prints the tables to paste below.

The same bits hold on every CPU path (the AVX2, generic and AMX-off children of
test_cpu_paths.py, test_q8act.py, test_kquants_q8.py and test_amx.py compare their outputs
with this process's bit for bit), so one table serves every x86 machine. The orders outside
the matmuls (RMSNorm, softmax sums, the RoPE table) are fixed too, so the default model's hash
needs no torch and is meant to hold on aarch64 as well (docs/arm64.md: the emulated run checks
it).
"""

from __future__ import annotations

import hashlib

import numba
import numpy as np
import pytest
from test_kquants import make_kq

from sparrow.kernels.linear import SMALL_T, linear, prepare
from sparrow.kernels.runtime import set_threads
from weights import acts, make

FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16", "f32")
Q8_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")  # the q8 mode's
T_CLASSES = {"decode": 1, "batch": SMALL_T - 3, "prefill": 24}  # 24: past SMALL_T and AMX's 16 rows
SHAPE = (80, 512)  # rows not a multiple of any tile or group; two K-quant super-blocks a row


def _weight(qtype):
    if qtype in ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k"):
        return make_kq(qtype, SHAPE, seed=11)
    return make(qtype, SHAPE, seed=11)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def linear_hashes() -> dict[str, str]:
    """{format/mode/T class: hash of linear()'s output}, on 2 threads where there are 2."""
    out = {}
    for q in FORMATS:
        w = _weight(q)
        for mode in ("f32", "q8") if q in Q8_FORMATS else ("f32",):
            for name, t in T_CLASSES.items():
                out[f"{q}/{mode}/{name}"] = _digest(linear(acts(t, SHAPE[1], seed=12), prepare(w, mode)))
    return out


# The fused step's (activations mode, KV kind, attention) combinations the golden covers. Each
# (mode, KV kind, "may select") triple is a compile of its own (exact ~30 s, q8 ~90 s cold), so
# the table takes every KV kind x attention kind in exact mode (test_fused_decode.py compiles
# the same ones) and the q8 mode's row dots with f32 and f16 KV (test_q8act.py and
# test_bench_shapes.py compile those) plus its selection on f32 KV: the KV kind reaches only the
# attention and the mode only the row dots, so a change in either shows in this table.
FUSED_CASES = tuple((kv, "f32") for kv in ("f32", "f16", "int8")) + (("f32", "q8"), ("f16", "q8"))
# v2 at k=2 takes the last block and block 0 alone; at k=3 it also scores blocks 1-3, so its
# summaries and their order (docs/SPARSE_SELECT_V2.md, steps 2-4) reach the hash
FUSED_ATTENTION = {
    "exact": None,
    "seed": dict(k=2, block=8),
    "v2": dict(k=2, block=8, select="v2"),
    "v2-scored": dict(k=3, block=8, select="v2"),
}


def _fused_attention(kv, mode):
    """The attention kinds the table holds for (kv, mode): all three, or exact alone."""
    if mode == "q8" and kv != "f32":
        return ("exact",)
    return tuple(FUSED_ATTENTION)


def fused_hashes(tiny_folder) -> dict[str, str]:
    """{kv/mode/attention: hash of the fused step's logits over 8 decode steps} on a tiny q8_0
    Llama (the fused step's own bits equal the staged path's: test_fused_decode.py)."""
    import sparrow
    from sparrow.models.decoder import Segment
    from sparrow.params import SparseParams

    llms = {m: sparrow.load(tiny_folder, quantize="q8_0", threads=2, activations=m) for m in ("f32", "q8")}
    ids = np.random.default_rng(5).integers(0, 200, 40)
    out = {}
    for kv, mode in FUSED_CASES:
        for name in _fused_attention(kv, mode):
            sp = FUSED_ATTENTION[name] and SparseParams(**FUSED_ATTENTION[name])
            llm = llms[mode]
            plan = llm.model.fused_step()
            plan.backoff, before = 0, plan.steps
            cache = llm.model.new_cache(len(ids), kv)
            llm.model.forward([Segment(ids[:32], cache, 0)])
            rows = [llm.model.forward([Segment(ids[i : i + 1], cache, i, sp, decode=True)])[0] for i in range(32, 40)]
            assert plan.steps - before == 8  # the fused step ran
            out[f"{kv}/{mode}/{name}"] = _digest(np.stack(rows))
    return out


# generated 2026-12-03 on an AMD EPYC Zen 4 (2 threads)
GOLDEN_LINEAR = {
    "q8_0/f32/decode": "39998aa1350ccb63",
    "q8_0/f32/batch": "c288794d79ec24b3",
    "q8_0/f32/prefill": "8e4103f53cc3522c",
    "q8_0/q8/decode": "0ee478f7252423d8",
    "q8_0/q8/batch": "59dd817632a8dea6",
    "q8_0/q8/prefill": "e48b6349938859bf",
    "q4_0/f32/decode": "5aaf4d6be8204506",
    "q4_0/f32/batch": "79f106673d302a7f",
    "q4_0/f32/prefill": "a82884b575fe246a",
    "q4_0/q8/decode": "60d54e76f736849f",
    "q4_0/q8/batch": "82b9aeab27971692",
    "q4_0/q8/prefill": "ec6bea3aa85c78a7",
    "q4_1/f32/decode": "f52e138969feaa41",
    "q4_1/f32/batch": "59bcc836d57e7bf9",
    "q4_1/f32/prefill": "c41a931ab1d4435b",
    "q4_1/q8/decode": "bc4b309376fb3e4f",
    "q4_1/q8/batch": "7d4d37525d043b1b",
    "q4_1/q8/prefill": "b9cb120a62fd489f",
    "q5_0/f32/decode": "19ab0dc28737b97b",
    "q5_0/f32/batch": "2a3b78c1dd7ea117",
    "q5_0/f32/prefill": "5b89cc15e2c115e8",
    "q5_0/q8/decode": "d08005ab66c67a46",
    "q5_0/q8/batch": "e2335e11abe02b0c",
    "q5_0/q8/prefill": "dd3786289025ef66",
    "q5_1/f32/decode": "7e7b4143cc1ea9b2",
    "q5_1/f32/batch": "10f8673c598d81ce",
    "q5_1/f32/prefill": "68f49282f8c1f248",
    "q5_1/q8/decode": "be19b222382b7fd5",
    "q5_1/q8/batch": "c291f41e6824873f",
    "q5_1/q8/prefill": "6785debd2ee0ed52",
    "q4_k/f32/decode": "8aa2a90ac9c33c5b",
    "q4_k/f32/batch": "179f6647a1a37ae3",
    "q4_k/f32/prefill": "8f56545b9de4e525",
    "q4_k/q8/decode": "3a24e0ac7d573705",
    "q4_k/q8/batch": "56149d4ff253ae02",
    "q4_k/q8/prefill": "611305446ac3d90c",
    "q5_k/f32/decode": "6dc7eb7318761e7d",
    "q5_k/f32/batch": "8928384ddbcc75c8",
    "q5_k/f32/prefill": "cb95488544e71254",
    "q5_k/q8/decode": "33cb2f5e28498f13",
    "q5_k/q8/batch": "7484bc972738f9ad",
    "q5_k/q8/prefill": "cb95488544e71254",
    "q6_k/f32/decode": "2babd0047774c33c",
    "q6_k/f32/batch": "fe1e1af018aad11e",
    "q6_k/f32/prefill": "7fa1da30aaeb3dd6",
    "q6_k/q8/decode": "9e5e170d5b8b24f1",
    "q6_k/q8/batch": "a2263b254a107871",
    "q6_k/q8/prefill": "3974e92df2593fe8",
    "f16/f32/decode": "a1c71c22cd42a90d",
    "f16/f32/batch": "6c0e9314578b9408",
    "f16/f32/prefill": "505b6162da6b2a48",
    "bf16/f32/decode": "5ff7f71ec04a64f8",
    "bf16/f32/batch": "81f8af8e8b4d0fae",
    "bf16/f32/prefill": "5b65fb1470b44179",
    "f32/f32/decode": "5bbde32f74c825f4",
    "f32/f32/batch": "dc95603c73514258",
    "f32/f32/prefill": "dace14bda84c4d6a",
}
# the fused step on the tiny Llama (weights from reference_models.seed_weights): generated
# 2026-12-05 on an AMD EPYC Zen 4 (2 threads)
GOLDEN_FUSED = {
    "f32/f32/exact": "96980d6acbcce73a",
    "f32/f32/seed": "b5dc28410afcbdfc",
    "f32/f32/v2": "220a3a9d39318dd0",
    "f32/f32/v2-scored": "857d7327e44ca2e1",
    "f16/f32/exact": "591e70a9769f3598",
    "f16/f32/seed": "d85d7a1dfeeab7b4",
    "f16/f32/v2": "7e73ccd9dd2fc134",
    "f16/f32/v2-scored": "5216e9850fe2f14a",
    "int8/f32/exact": "01fd124fc8184594",
    "int8/f32/seed": "99b6bb96acff255f",
    "int8/f32/v2": "583c89fc3d770fb2",
    "int8/f32/v2-scored": "62639426b7c296fc",
    "f32/q8/exact": "f54d87ff32b4ed8a",
    "f32/q8/seed": "3e65a33e4ac5361e",
    "f32/q8/v2": "6d6eb8eabca269e8",
    "f32/q8/v2-scored": "478943d36b0ffae1",
    "f16/q8/exact": "fd62e3b0b6870994",
}


# the default model's logits (test_cpu_paths.model_logits): generated 2026-12-03 on an AMD EPYC Zen 4
GOLDEN_MODEL = "25507c08e84c60f8"


def model_hash() -> str:
    from test_cpu_paths import model_logits

    return _digest(model_logits()[0])


@pytest.fixture
def two_threads():
    old = numba.get_num_threads()
    set_threads(2)
    yield
    set_threads(old)


def test_linear_bits_are_the_golden_ones(two_threads):
    got = linear_hashes()
    assert set(got) == set(GOLDEN_LINEAR)
    changed = {k: (GOLDEN_LINEAR[k], v) for k, v in got.items() if GOLDEN_LINEAR[k] != v}
    assert not changed, f"linear() bits changed: {changed}"


# The tiny Llama's weights (tests/reference_models.build_tiny, drawn by numpy: the same on any
# transformers / torch); the fused goldens are of these.
GOLDEN_TINY_LLAMA = "24b9b9f57fc33d56"


def tiny_weights_hash(folder) -> str:
    """Hash of a tiny model folder's tensors (values in name order; not the file's bytes)."""
    import os

    from safetensors.numpy import load_file

    t = load_file(os.path.join(folder, "model.safetensors"))
    return _digest(np.concatenate([np.ascontiguousarray(t[k]).ravel().view(np.uint8) for k in sorted(t)]))


def test_fused_step_bits_are_the_golden_ones(tiny_models, monkeypatch):
    from sparrow.models import fused

    folder = tiny_models["llama"].folder
    assert tiny_weights_hash(folder) == GOLDEN_TINY_LLAMA, (
        "the tiny Llama's weights changed (reference_models.seed_weights), so the fused goldens do not apply"
    )
    monkeypatch.setattr(fused, "BACKOFF_STEPS", 0)  # a busy machine must not send steps to the staged path
    got = fused_hashes(folder)
    assert set(got) == set(GOLDEN_FUSED)
    changed = {k: (GOLDEN_FUSED[k], v) for k, v in got.items() if GOLDEN_FUSED[k] != v}
    assert not changed, f"fused step bits changed: {changed}"


def test_default_model_logits_are_the_golden_ones():
    assert model_hash() == GOLDEN_MODEL, "the default model's logits changed"


if __name__ == "__main__":  # prints the tables (a documented order changed: its own commit)
    import sys
    import tempfile

    import reference_models as rm
    from sparrow.models import fused

    fused.BACKOFF_STEPS = 0  # as the test: a busy machine must not send steps to the staged path
    set_threads(2)
    print("GOLDEN_LINEAR =", linear_hashes())
    tok, d = tempfile.mkdtemp(), tempfile.mkdtemp()
    rm.save_default_tokenizer(tok)
    rm.build_tiny("llama", d, tok)
    print("GOLDEN_FUSED =", fused_hashes(d))
    print("GOLDEN_MODEL =", repr(model_hash()))
    sys.exit(0)
