"""The activations="q8" mode (kernels/matmul/q8/quantized.py): its documented order bit for bit, on this
CPU's path and on the generic one, batch and thread invariant, the same bits fused and
staged, and never on unless asked for."""

import platform

import numba
import numpy as np
import pytest
from test_cpu_paths import Q8_PATHS, q8_path_matches_here, run_compiled_for
from test_gemm import bits, fma32

import sparrow
from sparrow.errors import SparrowError
from sparrow.kernels.linear import SMALL_T, activations, linear
from sparrow.kernels.matmul.q8 import quantized as _q8act
from sparrow.models.decoder import Segment
from weights import acts, make

BB = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
# (format, [out, in], T): odd and even block counts, one block, T up to SMALL_T, rows past
# the serial threshold (the parallel matvec); rows that fill groups of 8 (kernels/matmul/q8/groups.py)
# and rows whose last group is part padding, fewer rows than a group; two prefills (T > SMALL_T:
# AMX tiles or _x16's zmm tiles where this host has them, so the children of
# test_other_code_paths check them)
CASES = [
    ("q4_1", (45, 512), 37),
    ("q4_0", (45, 512), 37),
    ("q8_0", (40, 96), 1),
    ("q4_0", (40, 96), 3),
    ("q4_1", (40, 96), 8),
    ("q8_0", (24, 32), 2),
    ("q4_0", (33, 256), 1),
    ("q4_1", (17, 224), 5),
    ("q8_0", (7, 64), 4),
    ("q4_0", (2048, 2048), 1),
    ("q4_1", (1540, 2048), 2),
    ("q8_0", (2052, 2048), 1),
]


def _f32(v):
    return np.asarray(v, np.float64).astype(np.float32)


def quantize_reference(x):
    """Per 32-block: a = max |x|, codes rint(x * (127 / a)) (0 when a == 0), dx = a / 127,
    sx = dx * sum(codes); every product and quotient one f32 rounding."""
    t_n, k = x.shape
    blk = x.reshape(t_n, k // 32, 32)
    a = np.abs(blk).max(axis=2)  # [T, nb]
    with np.errstate(divide="ignore"):
        inv = np.where(a == 0, np.float32(0), np.float32(127) / a).astype(np.float32)
    xq = np.rint(blk * inv[..., None]).astype(np.int8)  # [T, nb, 32]
    dx = (a / np.float32(127)).astype(np.float32)
    sx = (dx * xq.astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float32)
    return xq.reshape(t_n, k), dx, sx


def rowdot_reference(x, w):
    """The documented order (kernels/matmul/q8/groups.py) in float64-emulated f32, for q8_0 / q4_0 / q4_1 /
    q5_0 / q5_1: per row an exact integer sum s a block, acc = fma(s, d * dx, acc), q4_1 /
    q5_1's accm = fma(m, sx, accm), result acc + accm."""
    t_n, k = x.shape
    nb = k // 32
    xq, dx, sx = quantize_reference(x)
    blk = w.data.reshape(w.shape[0], nb, BB[w.qtype])  # [O, nb, bb]

    def half(at):
        return blk[:, :, at : at + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [O, nb]

    d = half(0)
    if w.qtype == "q8_0":
        codes = blk[:, :, 2:].view(np.int8).astype(np.int64)  # [O, nb, 32]
    elif w.qtype in ("q4_0", "q4_1"):
        q = blk[:, :, 2 if w.qtype == "q4_0" else 4 :].astype(np.int64)  # [O, nb, 16]
        codes = np.concatenate([q & 15, q >> 4], axis=2) - (8 if w.qtype == "q4_0" else 0)
    else:  # q5_0 / q5_1: the nibbles plus bit j of the u32 qh as 16; q5_0 minus 16
        at = 2 if w.qtype == "q5_0" else 4
        qh = blk[:, :, at : at + 4].copy().view(np.uint32).astype(np.int64)  # [O, nb, 1]
        q = blk[:, :, at + 4 :].astype(np.int64)  # [O, nb, 16]
        codes = np.concatenate([q & 15, q >> 4], axis=2) | (((qh >> np.arange(32)) & 1) << 4)
        codes -= 16 if w.qtype == "q5_0" else 0
    prod = codes[None] * xq.reshape(t_n, 1, nb, 32).astype(np.int64)  # [T, O, nb, 32]
    m = half(2) if w.qtype in ("q4_1", "q5_1") else None
    sums = prod.sum(axis=3).astype(np.float64)  # [T, O, nb] exact
    acc = accm = np.zeros((t_n, w.shape[0]), np.float32)
    for b in range(nb):
        dd = _f32(d[None, :, b].astype(np.float64) * dx[:, None, b])  # [T, O]
        acc = fma32(sums[:, :, b] * dd, acc)
        if m is not None:
            accm = fma32(m[None, :, b].astype(np.float64) * sx[:, None, b], accm)
    return _f32(acc.astype(np.float64) + accm) if m is not None else acc


def q8_outputs(cases, build):
    """{name: q8-mode linear() output} for cases (qtype, shape, T) on 1 and 2 threads, the
    weights from build(qtype, shape, seed) (also the K-quant tests')."""
    out = {}
    old = numba.get_num_threads()
    try:
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            numba.set_num_threads(n)
            for i, (q, shape, t) in enumerate(cases):
                with activations("q8"):
                    out[f"c{i}_{n}"] = linear(acts(t, shape[1], seed=7), build(q, shape, seed=8))
    finally:
        numba.set_num_threads(old)
    return out


def compute():
    return q8_outputs(CASES, make)


def test_quantize_matches_reference():
    for t, k in ((1, 32), (3, 96), (8, 2048)):
        x = acts(t, k, seed=t)
        x[0, :32] *= 1e-30  # a tiny block
        for got, want in zip(_q8act.quantize(x), quantize_reference(x)):
            assert np.array_equal(got, want)
    x = acts(37, 512, seed=5)  # the prefill's parallel chunks of 16 rows, zero pad rows after
    for got, want in zip(_q8act.quantize_padded(x, 16), quantize_reference(x)):
        assert got.shape[0] == 48 and np.array_equal(got[:37], want) and not got[37:].any()


def test_documented_order_bit_for_bit_any_threads_and_batch():
    # decode cases, and prefills of formats whose q8 prefill keeps the order
    assert SMALL_T == 8 and all(t <= SMALL_T or q in _q8act.PREFILL_FORMATS for q, _, t in CASES)
    out = compute()
    for i, (q, shape, t) in enumerate(CASES):
        x, w = acts(t, shape[1], seed=7), make(q, shape, seed=8)
        ref = rowdot_reference(x, w)
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            assert np.array_equal(bits(out[f"c{i}_{n}"]), bits(ref)), (q, shape, t, n)
        with activations("q8"):  # a row alone equals that row in the batch
            assert np.array_equal(bits(linear(np.ascontiguousarray(x[-1:]), w)), bits(ref[-1:]))


def test_q8_is_not_f32_and_is_scoped():
    x, w = acts(2, 256, seed=1), make("q4_1", (64, 256), seed=2)
    exact = linear(x, w)
    with activations("q8"):
        q8 = linear(x, w)
    assert not np.array_equal(q8, exact)  # the mode really changes the arithmetic
    assert np.array_equal(linear(x, w), exact)  # and ends with its block
    np.testing.assert_allclose(q8, exact, rtol=0, atol=0.05 * np.abs(exact).max())
    f16 = make("f16", (64, 256), seed=2)
    xp = acts(SMALL_T + 1, 256, seed=3)
    want16, want16p = linear(x, f16), linear(xp, f16)
    with activations("q8"):  # formats without a q8 kernel stay exact, decode and prefill
        assert np.array_equal(linear(x, f16), want16)
        assert np.array_equal(linear(xp, f16), want16p)
    with pytest.raises(ValueError):
        with activations("int4"):
            pass


@pytest.mark.parametrize("qtype", _q8act.PREFILL_FORMATS[:3])
def test_prefill_in_q8_mode_follows_the_documented_order(qtype):
    """Prefill (T > SMALL_T) over q8_0 / q4_0 / q4_1 in the q8 mode runs the interleaved
    groups too: the reference's bits for every row, so a row's logits do not depend on
    whether it came in a prefill or a decode step; not the f32 GEMM's."""
    x, w = acts(37, 512, seed=11), make(qtype, (45, 512), seed=12)
    with activations("q8"):
        got = linear(x, w)
    assert np.array_equal(bits(got), bits(rowdot_reference(x, w)))
    assert not np.array_equal(got, linear(x, w))


def test_load_option(tmp_path):
    with pytest.raises(SparrowError, match="activations"):
        sparrow.load(str(tmp_path / "missing.gguf"), activations="int8")


def test_default_model_fused_equals_staged_and_default_is_exact(default_llm, monkeypatch):
    from sparrow.models import fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a busy machine must not turn fused steps staged
    model = default_llm.model
    model.fused_step().backoff = 0
    assert model.activations == "f32"
    ids = np.asarray(default_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40])

    def decode(fused, mode):
        model.use_fused, model.activations = fused, mode
        plan = model.fused_step()
        before = plan.steps
        try:
            cache = model.new_cache(len(ids), "f32")
            model.forward([Segment(ids[:24], cache, 0)])
            rows = [model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])[0] for i in range(24, len(ids))]
            assert (plan.steps - before > 0) == fused  # the path meant to run did
            return np.stack(rows)
        finally:
            model.use_fused, model.activations = True, "f32"

    q8 = decode(True, "q8")
    assert q8.tobytes() == decode(False, "q8").tobytes()
    exact = decode(True, "f32")
    assert exact.tobytes() == decode(False, "f32").tobytes()
    assert not np.array_equal(q8, exact)


GENERIC_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from sparrow.kernels.matmul.q8 import quantized as _q8act
from sparrow.kernels.matmul.q8 import ir as _q8ir
from test_q8act import compute

out = compute()
np.savez(sys.argv[2], **out)
print("INFO " + json.dumps(dict(avx2=_q8ir.AVX2, vnni=_q8ir.VNNI, features=_q8act.CPU_FEATURES)))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 CPU names")
@pytest.mark.parametrize("path", sorted(Q8_PATHS))
def test_other_code_paths_give_the_same_bits(tmp_path, path):
    """Compiled for an older CPU, the same bits: "generic" (no AVX2: plain vector IR instead of
    pmaddubsw) and "avx2" (pmaddubsw + pmaddwd where a VNNI host takes vpdpbusd)."""
    q8_path_matches_here(tmp_path, path, GENERIC_CHILD, compute)


VNNI_CHILD = r"""
import json, sys
import numpy as np
from numba import typeof, types
sys.path.insert(0, sys.argv[1])
from sparrow.kernels.matmul.q8 import quantized as _q8act
from sparrow.kernels.matmul.q8 import ir as _q8ir

# compiled, never run: this host may lack the instructions
data = typeof(np.zeros((1, 1), np.uint8)).copy(readonly=True)
m2 = lambda dt: typeof(np.zeros((1, 1), dt))
f32, i64 = m2(np.float32), types.int64
sig = (data, i64, m2(np.int8), f32, f32, m2(np.int32), f32, i64, i64)
_q8act.x8_rows.compile(sig)
asm = "".join(_q8act.x8_rows.inspect_asm().values())
np.savez(sys.argv[2], none=np.zeros(0))
print("INFO " + json.dumps(dict(vnni=_q8ir.VNNI, vpdpbusd=asm.count("vpdpbusd"), pmaddubsw=asm.count("vpmaddubsw"))))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 CPU names")
def test_vnni_cpus_take_vpdpbusd(tmp_path):
    """Compiled for a CPU with AVX-VNNI, the q8_0 / q4_x groups' integer dots are vpdpbusd (the
    host's own tests check their bits where it has VNNI; the "avx2" child above, the rest)."""
    cpu, feats, _, _ = Q8_PATHS["avx2"]
    info, _ = run_compiled_for(tmp_path, cpu, feats + ",+avxvnni", VNNI_CHILD, fresh=True)
    assert info["vnni"] and info["vpdpbusd"] > 0, info  # (the K-quant groups keep pmaddubsw)
    info, _ = run_compiled_for(tmp_path / "avx2", cpu, feats, VNNI_CHILD, fresh=True)
    assert not info["vnni"] and info["vpdpbusd"] == 0 and info["pmaddubsw"] > 0, info


def test_dropping_mapped_pages_keeps_the_bytes(tmp_path):
    """After the interleaved copy, the stored rows' pages leave the resident set: a read-only
    file mapping gives the same bytes again (faulted back in); anonymous memory (a converted
    weight) and writable mappings are never touched."""
    import mmap

    raw = np.random.default_rng(0).integers(0, 256, 6 * mmap.PAGESIZE, dtype=np.uint8)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[100:].reshape(-1, 4)  # rows of a tensor, not page-aligned
    assert int(view.sum()) == int(raw[100:].sum())  # touched: resident
    assert _q8act.drop_mapped_pages(view) is True
    assert np.array_equal(view.ravel(), raw[100:])
    anon = raw.copy()
    assert _q8act.drop_mapped_pages(anon) is False and np.array_equal(anon, raw)
    rw = np.memmap(path, dtype=np.uint8, mode="r+")
    assert _q8act.drop_mapped_pages(rw) is False and np.array_equal(rw, raw)


def test_the_q8_copy_releases_a_mapped_weights_pages(monkeypatch):
    w = make("q4_0", (64, 256), seed=3)
    seen = []
    monkeypatch.setattr(_q8act, "drop_mapped_pages", lambda a: seen.append(a) or False)
    data, _ = _q8act.q8_rows(w)
    assert data is w.x8 and len(seen) == 1 and seen[0] is w.data
    _q8act.q8_rows(w)  # once per weight
    assert len(seen) == 1
