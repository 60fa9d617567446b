"""The activations="q8" mode (kernels/matmul/q8/quantized.py): its documented order bit for bit, on this
CPU's path and on the generic one, batch and thread invariant, the same bits fused and
staged, and never on unless asked for."""

import mmap
import platform
import sys

import numba
import numpy as np
import pytest
from test_cpu_paths import Q8_PATHS, q8_path_matches_here, run_compiled_for
from test_gemm import bits, fma32

import sparrow
from sparrow.errors import SparrowError
from sparrow.kernels.formats import PREFILL_FORMATS
from sparrow.kernels.linear import SMALL_T, linear, prepare
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
    """Per 32-block: a = max |x|, codes rint(x * (127 / a)) (0 where 127 / a overflows: a == 0
    or a < ~3.7e-37), dx = a / 127, sx = dx * sum(codes); every product and quotient one f32
    rounding."""
    t_n, k = x.shape
    blk = x.reshape(t_n, k // 32, 32)
    a = np.abs(blk).max(axis=2)  # [T, nb]
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.float32(127) / a
    inv = np.where(np.isfinite(inv), inv, np.float32(0)).astype(np.float32)
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
                out[f"c{i}_{n}"] = linear(acts(t, shape[1], seed=7), prepare(build(q, shape, seed=8), "q8"))
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


def test_quantize_edge_values_match_reference():
    # the vector quantiser's max is a tree and its rounding llvm.rint: ties (x * inv exactly
    # k + 0.5 rounds to even), all-zero and -0 blocks, subnormal and huge values, a block whose
    # max comes first, last or twice, and a row that is not contiguous in memory
    rng = np.random.default_rng(3)
    x = acts(9, 256, seed=9)
    x[0, :32] = np.arange(32) - 15.5  # half-integer values, max 15.5
    x[1, :32] = (np.arange(32) - 16) * np.float32(0.5)  # multiples of 0.5, max 8
    x[1, 32:64] = np.float32(127) / 2 * rng.choice([-1, 1], 32).astype(np.float32)
    x[1, 33] = 127  # inv 1: each +-63.5 is a tie, rounded to +-64
    x[2, :32], x[2, 32:64] = 0, -0.0
    x[3, :32] = np.float32(1e-45) * rng.integers(-3, 4, 32)  # subnormal: 127 / a overflows
    x[3, 32:64] = np.float32(1e-37) * rng.uniform(-1, 1, 32).astype(np.float32)  # so does this one
    x[4, :32] = np.float32(1e36) * rng.uniform(-1, 1, 32).astype(np.float32)  # huge, sx still finite
    x[5, 0], x[5, 31], x[5, 40], x[5, 50] = 9, -9, 7, -7  # max first, last and twice
    for got, want in zip(_q8act.quantize(x), quantize_reference(x)):
        assert np.array_equal(bits(got), bits(want))
    strided = acts(9, 512, seed=4)[:, ::2]
    for got, want in zip(_q8act.quantize(strided), quantize_reference(np.ascontiguousarray(strided))):
        assert np.array_equal(bits(got), bits(want))


def test_documented_order_bit_for_bit_any_threads_and_batch():
    # decode cases, and prefills of formats whose q8 prefill keeps the order
    assert SMALL_T == 8 and all(t <= SMALL_T or q in PREFILL_FORMATS for q, _, t in CASES)
    out = compute()
    for i, (q, shape, t) in enumerate(CASES):
        x, w = acts(t, shape[1], seed=7), make(q, shape, seed=8)
        ref = rowdot_reference(x, w)
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            assert np.array_equal(bits(out[f"c{i}_{n}"]), bits(ref)), (q, shape, t, n)
        # a row alone equals that row in the batch
        assert np.array_equal(bits(linear(np.ascontiguousarray(x[-1:]), prepare(w, "q8"))), bits(ref[-1:]))


def test_q8_is_not_f32_and_lives_in_the_prepared_weight():
    x, w = acts(2, 256, seed=1), make("q4_1", (64, 256), seed=2)
    exact = linear(x, w)
    q8w = prepare(w, "q8")
    assert isinstance(q8w, _q8act.Q8Weight) and prepare(q8w, "q8") is q8w
    assert q8w.stored is None  # q4_1 prefills on the groups too: no second copy stays
    q8 = linear(x, q8w)
    assert not np.array_equal(q8, exact)  # the mode really changes the arithmetic
    assert np.array_equal(linear(x, w), exact)  # and the stored weight stays exact
    assert prepare(w, "f32") is w
    np.testing.assert_allclose(q8, exact, rtol=0, atol=0.05 * np.abs(exact).max())
    f16 = make("f16", (64, 256), seed=2)
    assert prepare(f16, "q8") is f16  # formats without a q8 kernel stay exact, decode and prefill
    with pytest.raises(ValueError, match="activations"):
        prepare(w, "int4")


@pytest.mark.parametrize("qtype", PREFILL_FORMATS[:3])
def test_prefill_in_q8_mode_follows_the_documented_order(qtype):
    """Prefill (T > SMALL_T) over q8_0 / q4_0 / q4_1 in the q8 mode runs the interleaved
    groups too: the reference's bits for every row, so a row's logits do not depend on
    whether it came in a prefill or a decode step; not the f32 GEMM's."""
    x, w = acts(37, 512, seed=11), make(qtype, (45, 512), seed=12)
    got = linear(x, prepare(w, "q8"))
    assert np.array_equal(bits(got), bits(rowdot_reference(x, w)))
    assert not np.array_equal(got, linear(x, w))


def test_load_option(tmp_path):
    with pytest.raises(SparrowError, match="activations"):
        sparrow.load(str(tmp_path / "missing.gguf"), activations="int8")


def test_default_model_fused_equals_staged_and_default_is_exact(default_llm, monkeypatch):
    from sparrow.models import fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a busy machine must not turn fused steps staged
    assert default_llm.model.activations == "f32"
    models = {m: default_llm.with_activations(m).model for m in ("f32", "q8")}
    ids = np.asarray(default_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40])

    def decode(fused, mode):
        model = models[mode]
        model.use_fused = fused
        plan = model.fused_step()
        plan.backoff, before = 0, plan.steps
        try:
            cache = model.new_cache(len(ids), "f32")
            model.forward([Segment(ids[:24], cache, 0)])
            rows = [model.forward([Segment(ids[i : i + 1], cache, i, decode=True)])[0] for i in range(24, len(ids))]
            assert (plan.steps - before > 0) == fused  # the path meant to run did
            return np.stack(rows)
        finally:
            model.use_fused = True

    q8 = decode(True, "q8")
    assert q8.tobytes() == decode(False, "q8").tobytes()
    exact = decode(True, "f32")
    assert exact.tobytes() == decode(False, "f32").tobytes()
    assert not np.array_equal(q8, exact)


@pytest.mark.skipif(not Q8_PATHS, reason="CPU names of x86 and aarch64 only")
@pytest.mark.parametrize("path", sorted(Q8_PATHS))
def test_other_code_paths_give_the_same_bits(tmp_path, path):
    """Compiled for another CPU, the same bits: on x86 "generic" (no AVX2: plain vector IR
    instead of pmaddubsw) and "avx2" (pmaddubsw + pmaddwd where a VNNI host takes vpdpbusd);
    on aarch64 "generic", "cortex-a76" (sdot) and "neoverse-n2" (sdot, i8mm, SVE2)."""
    q8_path_matches_here(tmp_path, path, compute)


VNNI_CHILD = r"""
import json, sys
import numpy as np
from numba import typeof, types
sys.path.insert(0, sys.argv[1])
from sparrow.kernels.matmul.q8 import quantized as _q8act
from sparrow.kernels import intdot as _q8ir

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


@pytest.mark.parametrize("qtype", ["q4_0", "q5_1", "q8_0", "q4_k", "q6_k"])
def test_interleave_in_chunks_equals_one_pass(monkeypatch, qtype):
    """interleave copies rows in chunks of whole groups, reporting each once copied (the q8
    mode drops its file pages there): the same groups as one pass over every row."""
    from sparrow.kernels.matmul.q8 import groups
    from sparrow_lab.bench.rows import random_rows

    data = random_rows(qtype, 70, 256, seed=4)  # 8 full groups and one of 6 rows
    whole = groups.interleave(data, qtype)
    monkeypatch.setattr(groups, "CHUNK_BYTES", 1)  # one group a chunk
    seen = []
    chunked = groups.interleave(data, qtype, seen.append)
    assert np.array_equal(chunked, whole)
    assert [len(r) for r in seen] == [8] * 8 + [6] and all(r.base is not None for r in seen)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_interleave_moves_each_region_as_its_table_says(qtype):
    """groups._interleave (one unaligned move per run of 4 or 2 bytes) against a byte-by-byte
    reading of groups.REGIONS: run f of a region's bytes (src, dst, length, width) in row r's
    block b goes to the group's block b at 8 dst + width r + 8 width f."""
    from sparrow.kernels.formats import BLOCK_BYTES
    from sparrow.kernels.matmul.q8 import groups
    from sparrow_lab.bench.rows import random_rows

    data = random_rows(qtype, 21, 512, seed=6)  # 2 full groups and one of 5 rows
    bb, gb = BLOCK_BYTES[qtype], groups.GROUP_BYTES[qtype]
    want = np.zeros((3, data.shape[1] // bb * gb), np.uint8)
    for r in range(len(data)):
        for b in range(data.shape[1] // bb):
            for src, dst, n, w in groups.REGIONS[qtype]:
                for f in range(n // w):
                    at = b * gb + 8 * dst + w * (r % 8) + 8 * w * f
                    want[r // 8, at : at + w] = data[r, b * bb + src + w * f : b * bb + src + w * f + w]
    got = np.zeros_like(want)
    groups._interleave(data, got, bb, gb, np.array(groups.REGIONS[qtype], np.int64))
    assert np.array_equal(got, want)


def test_the_q8_copy_releases_a_mapped_weights_pages(monkeypatch):
    w = make("q4_0", (64, 256), seed=3)
    seen = []
    monkeypatch.setattr(_q8act, "drop_mapped_pages", lambda a: seen.append(a) or False)
    q8w = prepare(w, "q8")
    # each chunk once copied (one here: a small matrix), then the whole matrix for the pages
    # chunk edges share
    assert len(seen) == 2 and np.shares_memory(seen[0], w.data) and seen[0].shape == w.data.shape
    assert seen[1] is w.data
    assert prepare(q8w, "q8") is q8w and len(seen) == 2  # once per weight


def _resident_kib(a) -> int:
    """Resident KiB of this process's mapping (smaps VMA) that holds a's first byte."""
    addr, vma = a.ctypes.data, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and ":" not in parts[0]:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                vma = lo <= addr < hi
            elif vma and parts[0] == "Rss:":
                return int(parts[1])
    raise AssertionError("no mapping holds the array")


def _resident_pages_kib(a) -> int:
    """Resident KiB of the pages under a's bytes (/proc/self/pagemap's present bit), whatever
    mapping (VMA) holds them."""
    page = mmap.PAGESIZE
    first, last = a.ctypes.data // page, (a.ctypes.data + a.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype="<u8")
    return int(np.count_nonzero(entries >> np.uint64(63))) * page // 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps and madvise: Linux")
def test_q8_mode_keeps_the_files_pages_out_of_the_resident_set(tmp_path):
    """Once the q8 mode has its copies, the file's pages stay out of this process's resident
    set through a prefill and decode steps: small tensors (norms) are copies, not views of the
    mapping, and the embedding table, only looked up where the head has its own rows, gives
    back the pages each lookup faulted in. Exact mode with a tied head reads the table itself."""
    from sparrow.memory import _mapping
    from sparrow.models.decoder import Segment
    from sparrow_lab.bench import shapes

    tiny = dict(
        hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=4096, tied=True,
        rope_theta=1e6, rms_eps=1e-6, context=256,
    )  # fmt: skip
    path = shapes.write_gguf(str(tmp_path / "tiny.gguf"), tiny, "q4_0", name="tiny")
    llm = sparrow.load(path, activations="q8")
    model = llm.model
    assert model._lookup_only and all(_mapping(lay.input_norm) is None for lay in model.layers)
    layers = llm.checkpoint.tensors["model.layers.1.mlp.down_proj.weight"].data  # in the layers' mapping
    before = _resident_kib(layers)  # the file's header, read at load, may share it
    ids = np.random.default_rng(0).integers(0, 4096, 200)
    cache = model.new_cache(len(ids) + 8, "f32")
    model.forward([Segment(ids, cache, 0)])
    for i in range(4):
        model.forward([Segment(ids[i : i + 1], cache, len(ids) + i, decode=True)])
    # the table's own pages: on Linux its MADV_RANDOM gives it a mapping of its own, but
    # qemu-user ignores that advice, so there the file's header and the next tensor's pages,
    # faulted in at load, share its mapping
    assert _resident_pages_kib(model.embed.data) == 0  # 200 random rows of a 576 KiB table
    assert _resident_kib(layers) == before  # the norms are copies: nothing faulted back in
    assert not sparrow.load(path, activations="f32").model._lookup_only  # the tied head reads it


_HEAP_CHILD = """
import numpy as np
from sparrow.memory import trim_heap
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) // 1024
big = np.ones(24 << 18, np.float32); del big  # a freed 24 MiB mapping: glibc's threshold rises to it
arrays = [np.ones(6 << 18, np.float32) for _ in range(12)]  # 6 MiB each, now from the heap
pin = np.ones(1 << 18, np.float32)  # 1 MiB from the heap's top, above them: it cannot shrink past
del arrays
held = anon()
trim_heap()
print(held - anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_gives_freed_arrays_back():
    """A prefill's freed arrays stay resident in the C heap (glibc's raised mmap threshold)
    until trim_heap, which release_memory calls after each prefill chunk and in the decoder's
    build: 72 MiB freed below a live array leave the resident set only through it."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _HEAP_CHILD], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 64, out.stdout


_COMPILER_CHILD = """
import numpy as np
from numba import njit
from sparrow import memory

def llvm_rss():  # KiB resident in llvmlite's library mappings
    kib, ours = 0, False
    for line in open("/proc/self/smaps"):
        f = line.split()
        if f and "-" in f[0] and not f[0].endswith(":"):
            ours = len(f) > 5 and "libllvmlite" in f[5]
        elif ours and f[0] == "Rss:":
            kib += int(f[1])
    return kib

@njit(cache=False)
def first(x):
    return x.sum() * 2
first(np.arange(4.0))  # LLVM compiles: its code pages are touched
held = llvm_rss()
memory.release_memory()
dropped = llvm_rss()
memory.drop_compiler_pages()  # the compiler did not run since: nothing to do
@njit(cache=False)
def second(x):
    return x.max() + 1
assert second(np.arange(5.0)) == 5.0  # compiling again works: the pages fault back in
again = llvm_rss()
memory.drop_compiler_pages()
print(held, dropped, again, llvm_rss(), len(memory._compiler_segments()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps, madvise")
def test_compiler_pages_leave_the_resident_set_and_come_back_for_a_compile():
    """llvmlite's code pages, touched while numba compiles or loads kernels (55-69 MiB), leave
    the resident set at release_memory (after a build and each prefill chunk) and at
    drop_compiler_pages after a step that compiled; a later compile still works (the segments
    with relocated, copied-on-write pages are never advised)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _COMPILER_CHILD], capture_output=True, text=True, check=True)
    held, dropped, again, last, segments = map(int, out.stdout.split())
    assert segments >= 1
    assert held >= 16 << 10 and dropped < held // 4, out.stdout  # most of it gone
    assert again > dropped and last < again // 2, out.stdout  # back for the compile, then gone


def _stored(name, fmt, nbytes, shape=(64, 64)):
    """A StoredTensor of `nbytes` bytes that allocates none (a broadcast view)."""
    import gguf

    from sparrow.loaders.tensor import StoredTensor

    data = np.broadcast_to(np.zeros(1, np.uint8), (nbytes,))
    if fmt in ("f32", "f16", "bf16"):
        return StoredTensor(name, data, fmt, shape)
    return StoredTensor(name, data, "gguf", shape, gguf.GGMLQuantizationType[fmt.upper()])


def test_default_activations_rule():
    """models/activations.py: q8 where most q8-mode bytes are in a format whose exact decode
    trails llama.cpp's and there are enough of them; exact otherwise; experts never count."""
    from sparrow.kernels.cpu import VECTOR_PATH
    from sparrow.models.activations import Q8_FROM_BYTES, RULES, TRAILS, default_activations

    big, small = Q8_FROM_BYTES, Q8_FROM_BYTES // 4

    def rule(*tensors, quantize=None):
        return default_activations({t.name: t for t in tensors}, quantize)

    # the table per CPU path: each measured path's row, and the answer it gives for the default
    # model (~80 MB of q4_1: exact) and the 1.7B shape's Q4_0 (~1 GB: q8), named in the reason
    assert RULES["avx512"] == (TRAILS, Q8_FROM_BYTES) and RULES["avx2"] == (TRAILS, Q8_FROM_BYTES)
    for path in (*RULES, "neon", "generic"):
        small_model = default_activations({"w": _stored("w", "q4_1", 80 << 20)}, None, path)
        big_model = default_activations({"w": _stored("w", "q4_0", 1 << 30)}, None, path)
        assert (small_model[0], big_model[0]) == ("f32", "q8"), path
        assert f"{path} path" in small_model[1] and ("not measured" in big_model[1]) == (path not in RULES)
    assert f"the {VECTOR_PATH} path" in rule(_stored("w", "q4_0", big))[1]

    for fmt in TRAILS:
        assert rule(_stored("model.layers.0.mlp.down_proj.weight", fmt, big))[0] == "q8", fmt
        assert rule(_stored("model.layers.0.mlp.down_proj.weight", fmt, small))[0] == "f32", fmt
    assert rule(_stored("model.layers.0.mlp.down_proj.weight", "q8_0", 4 * big))[0] == "f32"
    # most bytes decide, counting every format that trails together (a Q4_K_M file's q6_k too)
    assert rule(_stored("a.weight", "q4_k", big), _stored("b.weight", "q8_0", 2 * big))[0] == "f32"
    assert rule(_stored("a.weight", "q4_k", small), _stored("b.weight", "q6_k", big - small))[0] == "q8"
    assert rule(_stored("a.weight", "q4_k", small), _stored("b.weight", "q6_k", small))[0] == "f32"
    # f16 weights: exact, unless --quantize made them a format that trails (q8_0 does not)
    f16 = _stored("model.layers.0.mlp.down_proj.weight", "f16", 4 * big)
    assert rule(f16)[1].startswith("no weights the q8 mode runs")
    assert rule(f16, quantize="q8_0")[0] == "f32"
    # MoE experts stay exact in both modes, so they do not count; a tied embedding is the head
    assert rule(_stored("model.layers.0.mlp.experts.3.up_proj.weight", "q4_k", 4 * big))[0] == "f32"
    embed = _stored("model.embed_tokens.weight", "q4_0", big)
    assert rule(embed)[0] == "q8"
    assert rule(embed, _stored("lm_head.weight", "q8_0", small))[0] == "f32"
    mode, why = rule(_stored("x.weight", "q4_0", big))
    assert "llama.cpp" in why and "--activations f32" in why


def test_the_default_model_loads_exact_and_says_why(default_llm):
    # 135M parameters of q4_1: exact decode leads llama.cpp's there (models/activations.py)
    assert default_llm.model.activations == "f32"
    assert "q4_1" in default_llm.activations_why
    assert default_llm.with_activations("q8").activations_why == "asked for"
    with pytest.raises(SparrowError, match="activations"):
        default_llm.with_activations("int8")
