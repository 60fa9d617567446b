"""The kernels compiled for other CPUs than this one (issue 11, issue 40): a subprocess with
NUMBA_CPU_NAME=haswell (its features without AVX-512) and one compiled for the generic x86
path (Ivy Bridge: AVX without FMA or AVX2) run the prefill GEMM (every storage format), the
decode matvecs (q8_0 / q4_0 / q4_1 row dots; q5_x and K-quants in the AVX2 child; f32 / f16 /
bf16 rows), the f32 reductions
outside the matmuls (RMSNorm, softmax sums), silu and exp, and the default model's logits
(prefill and fused decode steps). Their results must equal, bit for bit, the same calls in
this process (whatever this CPU is) and, where one is documented, a float64 emulation of the
summation order.

numba compiles for the host unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise, and
gemm picks its micro-kernel tile from the features numba compiles for, so the AVX2 child takes
the AVX2 tile (and AVX2 code: its assembly is checked for ymm and no zmm registers).
"""

import json
import math
import os
import platform
import subprocess
import sys
from decimal import Decimal, localcontext

import numba
import numpy as np
import pytest
from test_gemm import bits, fma32, fma_order_reference

import sparrow
from sparrow.kernels import deltanet as _dn
from sparrow.kernels import elementwise as _el
from sparrow.kernels.attention import codes4 as _codes4
from sparrow.kernels.attention import rows as _rows
from sparrow.kernels.linear import SMALL_T, linear
from sparrow.kernels.matmul import gemm as gemm
from sparrow.kernels.matmul import widen as _widen
from sparrow.quant import Weight
from sparrow_lab.bench.rows import random_rows
from weights import acts, make

HASWELL = (  # an AVX2-only x86 CPU (and no AVX-512, whatever the host has)
    "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,"
    "+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,-avx512f"
)
# The q8 mode's integer code paths other than the host's, for tests/test_q8act.py and
# test_kquants_q8.py to compile in a child and compare bit for bit: name -> (CPU, features,
# and the values the child's kernels/cpu.py must read, of the flags PATH_FLAGS names). The
# host's own path (VNNI's vpdpbusd where it has AVX-VNNI or AVX512-VNNI) runs in the tests'
# own process.
X86_Q8_PATHS = {
    "generic": (  # Ivy Bridge: AVX and F16C (the kernels widen f16 scales with it), no AVX2
        "ivybridge",
        "+64bit,+avx,+cx16,+cx8,+f16c,+fxsr,+mmx,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,-avx2,-avx512f",
        False,
        False,
    ),
    "avx2": ("haswell", HASWELL, True, False),  # pmaddubsw + pmaddwd, no vpdpbusd
}
_ARMV8 = "+neon,+fp-armv8,+crc,+lse,+rdm,+fullfp16,+rcpc"
# aarch64 (the qemu script, scripts/arm64_qemu.sh, runs these: under qemu-user LLVM reads the
# x86 host's /proc/cpuinfo and compiles the tests' own process for "generic")
ARM_Q8_PATHS = {
    "generic": ("generic", "+neon,+fp-armv8,-dotprod,-i8mm", False, False),  # plain vector IR
    "cortex-a76": ("cortex-a76", _ARMV8 + ",+dotprod", True, False),  # sdot (RK3588, Raspberry Pi 5)
    "neoverse-n2": ("neoverse-n2", _ARMV8 + ",+dotprod,+i8mm,+bf16,+sve,+sve2", True, True),  # sdot, i8mm, SVE2
}
ARM = platform.machine().lower() in ("aarch64", "arm64")
Q8_PATHS = ARM_Q8_PATHS if ARM else X86_Q8_PATHS if platform.machine().lower() in ("x86_64", "amd64") else {}
PATH_FLAGS = ("dotprod", "i8mm") if ARM else ("avx2", "vnni")
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sparrow.__file__)))  # the children import this sparrow
BLOCKS = ("q8_0", "q4_0", "q4_1")
# GEMM: a full panel and a partial one, T = 13 (x-block tails for MR 4 and 8), K from 1 block
# to more than one k-block (608); K = 50 (not a multiple of the vector width) for float rows
GEMM_CASES = [(q, (gemm.NR + 7, k), 13) for q in FORMATS for k in (96, 608)] + [
    (q, (gemm.NR + 7, 50), 13) for q in ("f32", "f16", "bf16")
]
DECODE_CASES = [(q, shape, t) for q in BLOCKS for shape in ((37, 96), (21, 608)) for t in (1, 3)]
# the K-quant and 5-bit row dots (kernels/matmul/kquants.py): 4-bit codes take vpermps where
# AVX-512 is, and-and-convert elsewhere; the same bits either way (their order: test_kquants.py)
KQ_DECODE_CASES = [(q, (21, 512), t) for q in ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k") for t in (1, 3)]
# f32 / f16 / bf16 rows at decode: one lane_dot a row; K = 50 and 613 end in a partial chunk
FLOAT_DECODE_CASES = [(q, (19, k), t) for q in ("f32", "f16", "bf16") for k in (50, 613) for t in (1, 3)]
NORM_ROWS = (64, 2048)  # RMSNorm rows: 11% of these outputs differed between AVX-512 and AVX2 builds
SUM_LENGTHS = (1, 15, 16, 17, 63, 64, 65, 200, 4099)  # softmax sums: partial chunks, 4-chunk groups
MODEL_PROMPT, MODEL_DECODE = 12, 3  # tokens: the prompt passes the 8 rows where GEMM and prefill attention start

CHILD = r"""
import json, sys
import numba, numpy as np
sys.path.insert(0, sys.argv[1])
import sparrow
from sparrow.kernels.matmul import widen as _widen
from sparrow.quant import Weight
from sparrow.kernels.matmul import gemm as gemm
from sparrow.kernels.linear import linear
from test_cpu_paths import DECODE_CASES, GEMM_CASES, compute, model_logits
from weights import acts, make

info = dict(cpu=gemm.CPU_NAME, avx512f="+avx512f" in gemm.CPU_FEATURES.split(","), tile=[gemm.MR, gemm.NW, gemm.LANES])
info.update(sparrow=sparrow.__file__)
if sys.argv[3:] == ["asm"]:  # a fresh cache: the code compiled here, not loaded; one GEMM and one decode
    for q, shape, t in (GEMM_CASES[0], DECODE_CASES[0]):
        linear(acts(t, shape[1]), make(q, shape))
    asm = "".join(gemm._panel_tiles.inspect_asm().values()) + "".join(_widen._rows_blocks.inspect_asm().values())
    info.update(ymm="ymm" in asm, zmm="zmm" in asm)
    out = {}
else:
    out = compute()
    out["model"], info["fused_steps"] = model_logits()
np.savez(sys.argv[2], **out)
print("INFO " + json.dumps(info))
"""


def reduction_inputs():
    """(RMSNorm rows, its weight, softmax scores, silu's [gate | up]): fixed random values."""
    rng = np.random.default_rng(40)
    x = rng.standard_normal(NORM_ROWS).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(NORM_ROWS[1])).astype(np.float32)
    s = -np.abs(rng.standard_normal(max(SUM_LENGTHS)) * 8).astype(np.float32)  # exp(s - 0) in (0, 1]
    gu = (rng.standard_normal((5, 2 * 300)) * 6).astype(np.float32)
    return x, w, s, gu


def compute():
    """The GEMM and decode results of the cases on 1 and on 2 threads, and reductions()
    ({name: array})."""
    out = {}
    old = numba.get_num_threads()
    try:
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            numba.set_num_threads(n)
            for i, (q, shape, t) in enumerate(GEMM_CASES):
                out[f"gemm{i}_{n}"] = linear(acts(t, shape[1], seed=4), make(q, shape, seed=3))
            for i, (q, shape, t) in enumerate(DECODE_CASES):
                x = acts(t, shape[1], seed=5)
                out[f"decode{i}_{n}"] = linear(x, make(q, shape, seed=6))
                out[f"sx{i}"] = _widen._x_block_sums(x)
            for i, (q, shape, t) in enumerate(KQ_DECODE_CASES):
                w = Weight(q, random_rows(q, shape[0], shape[1], seed=8), shape)
                out[f"kq{i}_{n}"] = linear(acts(t, shape[1], seed=7), w)
    finally:
        numba.set_num_threads(old)
    return out | reductions()


@numba.njit
def softmax_step(s, n):
    """[max, sum, weights] of attention's softmax step over s[:n] (rows.row_max, rows.exp_sum
    with m = 0, zeros past n)."""
    w = np.empty(len(s) + 2, np.float32)
    w[0] = _rows.row_max(s, 0, n)
    w[1] = _rows.exp_sum(s, np.float32(0), n, w[2:])
    return w


def reductions():
    """The f32 reductions outside the matmul tiles (f32 / f16 / bf16 row dots at decode,
    RMSNorm, softmax sums) and the elementwise kernels with fmas of their own (exp, silu):
    {name: array}."""
    out = {}
    for i, (q, shape, t) in enumerate(FLOAT_DECODE_CASES):
        out[f"fdecode{i}"] = linear(acts(t, shape[1], seed=7), make(q, shape, seed=8))
    x, w, s, gu = reduction_inputs()
    out["rms"] = _el.rms_norm(x, w, 1e-6)
    out["sums"] = np.array([_rows.sum_f32(s, n) for n in SUM_LENGTHS], np.float32)
    out["softmax"] = np.concatenate([softmax_step(s, n) for n in SUM_LENGTHS])  # attention's exp_sum, row_max
    e = s.copy()
    _rows.exp_shifted(e, np.float32(0), len(e), np.empty(len(e), np.int32))
    out["exp"] = e
    out["silu"] = _el.silu_mul(gu, gu.shape[1] // 2)
    for dk, dv in ((24, 120), (128, 128)):  # the delta rule's column groups: wide, 16, fewer
        rng = np.random.default_rng(dv)
        Q, K, V = (rng.normal(0, 0.3, (5, n)).astype(np.float32) for n in (dk, dk, dv))
        dec, beta = rng.uniform(0.7, 1.0, 5).astype(np.float32), rng.uniform(0, 1, 5).astype(np.float32)
        S, O = rng.normal(size=(dk, dv)).astype(np.float32), np.empty((5, dv), np.float32)
        _dn._rule_run(S, Q, K, V, dec, beta, O, np.empty(dv, np.float32), np.empty(dv, np.float32))
        out[f"rule{dv}"], out[f"rule_state{dv}"] = O, S
    out["tiles4"] = tile_scores4_case()
    return out


@numba.njit
def _tile_scores4(tiles, n_tiles, qc, corr, f, ks, out):
    _codes4.tile_scores4(tiles, 0, n_tiles, qc, corr, f, ks, out)


def tile_scores4_case():
    """v3's 4-bit key codes (attention.codes4) of 40 random keys of head_dim 44 (two tiles and
    a half, the dims padded to 48) scored against random int8 query codes: vpdpbusd, pmaddubsw
    + pmaddwd or the generic vector IR by the CPU path, the same integers and floats."""
    rng = np.random.default_rng(44)
    K = (rng.standard_normal((1, 48, 44)) * 3).astype(np.float32)  # [KVH, C, D]
    tiles = np.zeros((1, 3, 8 * _codes4.padded(44)), np.int8)
    scale = np.zeros((1, 48), np.float32)
    _codes4.pack_keys4(K, np.zeros((1, 48), np.float32), np.zeros(1, np.float32), 0, 40, tiles, scale)
    qc = np.zeros(48, np.int8)
    qc[:44] = rng.integers(-127, 128, 44)
    out = np.zeros(48, np.float32)
    _tile_scores4(tiles[0], 3, qc, np.int32(8 * int(qc.sum(dtype=np.int64))), np.float32(0.0371), scale[0], out)
    return out


def model_logits():
    """The default model's logits [MODEL_PROMPT + MODEL_DECODE, V] in the exact mode: a prefill
    of MODEL_PROMPT fixed token ids (the GEMM, prefill attention), then MODEL_DECODE decode
    steps (the fused step); and how many fused steps ran."""
    from sparrow.models import fused
    from sparrow.models.decoder import Segment

    llm = sparrow.load(activations="f32", threads=2)
    ids = np.random.default_rng(40).integers(17, 49152, MODEL_PROMPT + MODEL_DECODE)
    plan = llm.model.fused_step()
    plan.backoff, before = 0, plan.steps
    old, fused.BACKOFF_STEPS = fused.BACKOFF_STEPS, 0  # a busy machine must not skip the fused step
    try:
        cache = llm.model.new_cache(len(ids), "f32")
        rows = [llm.model.forward([Segment(ids[:MODEL_PROMPT], cache, 0)], all_logits=True)]
        for i in range(MODEL_PROMPT, len(ids)):
            rows.append(llm.model.forward([Segment(ids[i : i + 1], cache, i, decode=True)]))
    finally:
        fused.BACKOFF_STEPS = old
    return np.concatenate(rows), plan.steps - before


BB = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def _f32(v):
    return np.asarray(v, np.float64).astype(np.float32)


def block_sums_reference(x):
    """sx[t, b] = x[t, 32 b] + x[t, 32 b + 1] + ... in order, one f32 add each."""
    blocks = x.reshape(x.shape[0], -1, 32)
    s = np.zeros(blocks.shape[:2], np.float32)
    for j in range(32):
        s = _f32(s.astype(np.float64) + blocks[:, :, j])
    return s


def rowdot_reference(x, w, sx):
    """The decode order of _widen.rowdot_* (q8_0 / q4_0 / q4_1) in float64-emulated f32.

    Per block b, in 16 lanes: t = fma(hi, x_hi, lo * x_lo) (codes as f32, q4 nibbles without
    the -8), acc[b % 2] = fma(t, d, acc[b % 2]); scalar accm = fma(c, sx[b], accm) with
    c = m (q4_1) or -8 d (q4_0). Result: pairwise tree (lane i + i + n/2) of acc[0] + acc[1],
    plus accm."""
    t_n, k = x.shape
    nb = k // 32
    blk = w.data.reshape(w.shape[0], nb, BB[w.qtype])  # [O, nb, bb]

    def half(at):
        return blk[:, :, at : at + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [O, nb]

    d = half(0)
    if w.qtype == "q8_0":
        q = blk[:, :, 2:].view(np.int8).astype(np.float32)  # [O, nb, 32]
        lo, hi = q[:, :, :16], q[:, :, 16:]
    else:
        q = blk[:, :, 2 if w.qtype == "q4_0" else 4 :].astype(np.int32)  # [O, nb, 16]
        lo, hi = (q & 15).astype(np.float32), (q >> 4).astype(np.float32)
    acc = [np.zeros((t_n, w.shape[0], 16), np.float32) for _ in range(2)]  # [T, O, 16]
    accm = np.zeros((t_n, w.shape[0]), np.float32)  # [T, O]
    x64 = x.astype(np.float64)
    for b in range(nb):
        xl, xh = x64[:, None, b * 32 : b * 32 + 16], x64[:, None, b * 32 + 16 : b * 32 + 32]  # [T, 1, 16]
        t = fma32(hi[None, :, b].astype(np.float64) * xh, _f32(lo[None, :, b].astype(np.float64) * xl))
        acc[b % 2] = fma32(t.astype(np.float64) * d[None, :, b, None], acc[b % 2])
        if w.qtype != "q8_0":
            c = half(2)[:, b] if w.qtype == "q4_1" else _f32(d[:, b].astype(np.float64) * -8.0)
            accm = fma32(c[None, :].astype(np.float64) * sx[:, None, b], accm)
    v = _f32(acc[0].astype(np.float64) + acc[1])
    n = 16
    while n > 1:
        v = _f32(v[..., : n // 2].astype(np.float64) + v[..., n // 2 : n])
        n //= 2
    return _f32(v[..., 0].astype(np.float64) + accm)


def lane_fold_reference(a, b=None):
    """The fixed lane order of the f32 reductions outside the matmuls (kernels/ir.py,
    lane_fold) in float64-emulated f32: chunk c (values 16c..16c+15) into accumulator c % 4,
    lane by lane (fma(a, b, acc) for a dot, acc + a for a sum); then (acc0 + acc1) + (acc2 +
    acc3), the pairwise tree 16 -> 8 -> 4 -> 2 -> 1 (lane i + lane i + n/2), then the values
    after the last whole chunk in order."""
    a = np.asarray(a, np.float32)
    n, nch = len(a), len(a) // 16
    acc = np.zeros((4, 16), np.float32)
    for c in range(nch):
        sl = slice(16 * c, 16 * c + 16)
        if b is None:
            acc[c % 4] = _f32(acc[c % 4].astype(np.float64) + a[sl])
        else:
            acc[c % 4] = fma32(a[sl].astype(np.float64) * b[sl].astype(np.float64), acc[c % 4])
    v = _f32(_f32(acc[0].astype(np.float64) + acc[1]).astype(np.float64) + _f32(acc[2].astype(np.float64) + acc[3]))
    while len(v) > 1:
        v = _f32(v[: len(v) // 2].astype(np.float64) + v[len(v) // 2 :])
    s = v[0]
    for i in range(16 * nch, n):
        s = _f32(np.float64(s) + a[i]) if b is None else fma32(np.float64(a[i]) * np.float64(b[i]), s)
    return np.float32(s)


def rms_norm_reference(x, w, eps):
    """RMSNorm's documented order: ssq = lane_fold of x * x; inv = 1 / sqrt(ssq / n + eps); out
    = (x inv) w, every step one f32 rounding."""
    out = np.empty(x.shape, np.float32)
    n, eps = np.float32(x.shape[1]), np.float32(eps)
    for t, row in enumerate(x):
        ms = np.float32(np.float32(lane_fold_reference(row, row) / n) + eps)
        inv = np.float32(1) / np.float32(math.sqrt(ms))
        out[t] = (row * inv) * w
    return out


def float_rowdot_reference(x, w):
    """f32 / f16 / bf16 rows at decode: each row widened to f32, lane_fold of row * x."""
    wf = w.dequantize()
    return np.array([[lane_fold_reference(r, xr) for r in wf] for xr in x], np.float32)


def test_reductions_follow_the_lane_order():
    # the emulated orders hold here (so a mismatch in a child points at its CPU path)
    x, w, s, _ = reduction_inputs()
    assert np.array_equal(bits(_el.rms_norm(x, w, 1e-6)), bits(rms_norm_reference(x, w, 1e-6)))
    want = [lane_fold_reference(s[:n]) for n in SUM_LENGTHS]
    assert np.array_equal(bits([_rows.sum_f32(s, n) for n in SUM_LENGTHS]), bits(want))
    for q, shape, t in FLOAT_DECODE_CASES:
        xa, wq = acts(t, shape[1], seed=7), make(q, shape, seed=8)
        assert np.array_equal(bits(linear(xa, wq)), bits(float_rowdot_reference(xa, wq))), (q, shape, t)
    view = np.random.default_rng(3).standard_normal((3, 50)).astype(np.float32)[:, 5:38]  # rows not contiguous
    assert np.array_equal(bits(_el.rms_norm(view, w[:33], 1e-5)), bits(rms_norm_reference(view, w[:33], 1e-5)))


def test_rowdot_reference_matches_this_process():
    # the emulated decode order holds here too (so a mismatch below points at the CPU path)
    for q, shape, t in DECODE_CASES:
        x, w = acts(t, shape[1], seed=5), make(q, shape, seed=6)
        assert t <= SMALL_T
        sx = block_sums_reference(x)
        assert np.array_equal(bits(_widen._x_block_sums(x)), bits(sx))
        assert np.array_equal(bits(linear(x, w)), bits(rowdot_reference(x, w, sx))), (q, shape, t)


def run_compiled_for(tmp_path, cpu, features, code, fresh=False, args=()):
    """Runs `code` (argv: the tests folder, an .npz path it writes) in a child process whose
    numba compiles for `cpu` / `features`; returns (the INFO json the child printed, its arrays).
    The children of one CPU path share sparrow's own kernel cache, whose folder is keyed on the
    kernel sources and the CPU the child compiles for (kernels/runtime.py; numba's index keys
    each entry on the target CPU too), so each kernel compiles once per path and source
    version, not once per test file or run; fresh=True gives the child an empty cache of its
    own (code that inspects what it compiled); args: more arguments for `code`."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features)
    if fresh:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, here] + [p for p in [env.get("PYTHONPATH")] if p])
    res = subprocess.run(
        [sys.executable, "-c", code, here, str(tmp_path / "out.npz"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    info = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("INFO "))[5:])
    return info, dict(np.load(tmp_path / "out.npz"))


COMPUTE_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from sparrow.kernels import cpu
from MODULE import compute

out = compute()
np.savez(sys.argv[2], **out)
print("INFO " + json.dumps(dict(cpu=cpu.describe())))
"""


def q8_path_matches_here(tmp_path, path, compute):
    """The q8 mode's code path `path` (a Q8_PATHS name) in a child that runs compute() (a
    function of a test module here) and prints INFO {cpu: kernels.cpu.describe()}: it took that
    path, and its arrays equal this process's compute() bit for bit (tests/test_q8act.py,
    test_kquants_q8.py)."""
    cpu, feats, *flags = Q8_PATHS[path]
    code = COMPUTE_CHILD.replace("MODULE", compute.__module__.rsplit(".", 1)[-1])
    info, child = run_compiled_for(tmp_path, cpu, feats, code)
    assert tuple(info["cpu"][f] for f in PATH_FLAGS) == tuple(flags), info
    here_out = compute()
    assert set(child) == set(here_out)
    for name in child:
        assert np.array_equal(bits(child[name]), bits(here_out[name])), name


def _same_as_here(child, info):
    """The child's arrays equal this process's, bit for bit, and its fused steps ran."""
    here_out = compute()
    here_out["model"], steps = model_logits()
    assert info["fused_steps"] == steps == MODEL_DECODE, info
    assert set(child) == set(here_out)
    for name in child:
        assert np.array_equal(bits(child[name]), bits(here_out[name])), name


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 CPU names")
def test_avx2_code_path_bit_for_bit(tmp_path):
    # the AVX2 code: the narrow tile, ymm registers, no zmm (a child with a fresh cache, which
    # compiles what it inspects; the one below shares the AVX2 path's cache across runs)
    info, _ = run_compiled_for(tmp_path, "haswell", HASWELL, CHILD, fresh=True, args=["asm"])
    assert info["cpu"] == "haswell" and not info["avx512f"], info
    assert info["tile"] == list(gemm.micro_tile(HASWELL)) and info["tile"][2] == 8, info
    assert info["ymm"] and not info["zmm"], info
    assert os.path.samefile(info["sparrow"], sparrow.__file__), info  # this checkout, not another install
    info, child = run_compiled_for(tmp_path, "haswell", HASWELL, CHILD)
    assert info["cpu"] == "haswell" and info["tile"][2] == 8, info
    _same_as_here(child, info)  # the AVX2 path equals this process's path, bit for bit
    for i, (q, shape, t) in enumerate(GEMM_CASES):
        ref = fma_order_reference(acts(t, shape[1], seed=4), make(q, shape, seed=3).dequantize())
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            assert np.array_equal(bits(child[f"gemm{i}_{n}"]), bits(ref)), (q, shape, t, n)
    for i, (q, shape, t) in enumerate(DECODE_CASES):
        x, w = acts(t, shape[1], seed=5), make(q, shape, seed=6)
        assert np.array_equal(bits(child[f"sx{i}"]), bits(block_sums_reference(x))), (q, shape, t)
        ref = rowdot_reference(x, w, block_sums_reference(x))
        for n in (1, 2)[: numba.config.NUMBA_NUM_THREADS]:
            assert np.array_equal(bits(child[f"decode{i}_{n}"]), bits(ref)), (q, shape, t, n)
    x, w, s, _ = reduction_inputs()
    assert np.array_equal(bits(child["rms"]), bits(rms_norm_reference(x, w, 1e-6)))
    assert np.array_equal(bits(child["sums"]), bits([lane_fold_reference(s[:n]) for n in SUM_LENGTHS]))


WIDE_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from sparrow.kernels import cpu
from test_cpu_paths import reductions

np.savez(sys.argv[2], **reductions())
print("INFO " + json.dumps(dict(cpu=cpu.NAME)))
"""


# LLVM's tuning flags for the width it vectorises loops with: every x86 CPU numba names here
# (haswell, the AVX-512 ones) prefers 256-bit vectors, so their builds of a reassociated loop
# agreed; without that preference an AVX-512 build takes 512-bit vectors, and 128-bit ones are
# NEON's width (RMSNorm's old loop: 10% and 29% of these outputs differed from this host's)
VECTOR_WIDTHS = {"512-bit": "-prefer-256-bit", "128-bit": "+prefer-128-bit"}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 tuning flags")
@pytest.mark.parametrize("width", VECTOR_WIDTHS)
def test_other_vector_widths_reductions_bit_for_bit(tmp_path, width):
    """This CPU's features, compiled with LLVM's loop vectoriser at another width: the
    reductions, which followed the vector width while they were reassociated loops, equal
    this process's and their documented order bit for bit."""
    if width == "512-bit" and "+avx512f" not in gemm.CPU_FEATURES.split(","):
        pytest.skip("512-bit vectors need AVX-512")
    feats = gemm.CPU_FEATURES + "," + VECTOR_WIDTHS[width]
    info, child = run_compiled_for(tmp_path, gemm.CPU_NAME, feats, WIDE_CHILD)
    assert info["cpu"] == gemm.CPU_NAME, info
    here_out = reductions()
    assert set(child) == set(here_out)
    for name in child:
        assert np.array_equal(bits(child[name]), bits(here_out[name])), name
    x, w, s, _ = reduction_inputs()
    assert np.array_equal(bits(child["rms"]), bits(rms_norm_reference(x, w, 1e-6)))


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 CPU names")
def test_generic_code_path_bit_for_bit(tmp_path):
    """The generic x86 path (the q8 suites' "generic" CPU: AVX without FMA, so every fma of the
    documented orders is llvm.fma's exact one, a libm call, and no loop may contract a multiply
    and an add on its own): the same cases and the default model's logits, bit for bit."""
    cpu, feats, *_ = X86_Q8_PATHS["generic"]
    info, child = run_compiled_for(tmp_path, cpu, feats, CHILD)
    assert info["cpu"] == cpu and not info["avx512f"] and info["tile"][2] == 8, info
    _same_as_here(child, info)


WIDE = r"""
import importlib.util, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("gemm_tile", sys.argv[2])
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)
from test_cpu_paths import GEMM_CASES
from weights import acts, make

assert (g.MR, g.NW, g.LANES) == tuple(int(v) for v in sys.argv[4].split(","))
out = {}
for i, (q, shape, t) in enumerate(GEMM_CASES):
    y = np.empty((t, shape[0]), np.float32)
    out[f"gemm{i}"] = g.matmul_widened(acts(t, shape[1], seed=4), make(q, shape, seed=3), y)
np.savez(sys.argv[3], **out)
"""


TILES = [(8, 3, 16), (4, 3, 8)]  # the AVX-512 and the AVX2 micro-kernel tiles


def test_other_tile_bit_for_bit(tmp_path):
    # The tile this CPU does not take (the tests above cover its own), on this CPU all the
    # same (a 16-lane vector is two ymm registers on AVX2, slow but exact): a copy of gemm.py
    # with the tile fixed, in a fresh numba cache.
    tile = next(t for t in TILES if t != (gemm.MR, gemm.NW, gemm.LANES))
    src = open(gemm.__file__).read()
    line = "MR, NW, LANES = micro_tile(CPU_FEATURES)"
    assert line in src
    path = tmp_path / "gemm_tile.py"
    path.write_text(src.replace(line, "MR, NW, LANES = " + ", ".join(map(str, tile))))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env["PYTHONPATH"] = os.pathsep.join([ROOT, here] + [p for p in [env.get("PYTHONPATH")] if p])
    res = subprocess.run(
        [sys.executable, "-c", WIDE, here, str(path), str(tmp_path / "out.npz"), ",".join(map(str, tile))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    child = np.load(tmp_path / "out.npz")
    for i, (q, shape, t) in enumerate(GEMM_CASES):
        ref = fma_order_reference(acts(t, shape[1], seed=4), make(q, shape, seed=3).dequantize())
        assert np.array_equal(bits(child[f"gemm{i}"]), bits(ref)), (tile, q, shape, t)


def test_one_cpu_description_names_the_paths_taken():
    """kernels/cpu.py is the one reader of the target CPU: the GEMM tile, the q8 mode's integer
    dots and tiles and AMX all come from it, and `sparrow bench speed` prints which it takes."""
    from sparrow.kernels import cpu
    from sparrow.kernels import intdot as _q8ir
    from sparrow.kernels.matmul.q8 import amx as _amx

    d = cpu.describe()
    assert (gemm.MR, gemm.NW, gemm.LANES) == cpu.GEMM_TILE == cpu.micro_tile(cpu.FEATURES)
    assert (d["avx2"], d["vnni"], d["vnni512"], d["amx"]) == (_q8ir.AVX2, _q8ir.VNNI, _q8ir.VNNI512, _amx.AMX)
    assert gemm.CPU_FEATURES == cpu.FEATURES and d["name"] == gemm.CPU_NAME
    haswell = dict(name="haswell", avx2=True, avx512f=False, vnni=False, vnni512=False, amx=False, gemm_tile="4x3x8")
    line = cpu.paths_line(haswell)
    assert "by pmaddubsw (AVX2)" in line and "prefill on ymm tiles" in line and "micro-tile 4x3x8 [" in line
    assert "q4_1 decode row dots two rows at a time [" in line  # no arch given: x86's
    generic = dict(haswell, name="x86-64", avx2=False)
    assert "by generic vector IR" in cpu.paths_line(generic)
    amx = dict(haswell, name="sapphirerapids", vnni=True, vnni512=True, amx=True, gemm_tile="8x3x16")
    assert "by vpdpbusd (VNNI)" in cpu.paths_line(amx) and "prefill on AMX tiles" in cpu.paths_line(amx)


# (theta, head_dim): SmolLM2 (its default model), Qwen3, Llama 3, the tiny models', a head size
# that is not a power of two (its exponents 2i / d are rounded to f32, as transformers does)
ROPE_CASES = [(1e5, 64), (1e6, 128), (5e5, 128), (1e4, 64), (1e6, 32), (1e6, 80)]


@pytest.mark.parametrize("theta,head_dim", ROPE_CASES)
def test_rope_frequencies_do_not_depend_on_the_cpu(theta, head_dim):
    """RoPE's powers theta ** e_i (e_i = f32(2 i) / f32(d), as transformers computes them) are
    rounded to f32 once, and each exact power lies far enough from the midpoints between f32
    neighbours (2^-40 relative) that any float64 evaluation within 2^10 f64 ulps rounds to the
    same f32; inv_freq is then 1 / power in f32 (IEEE): the table does not depend on the CPU's
    or numpy's pow (numpy's f32 power, taken before, dispatched to SVML on AVX-512 and was 1 ulp
    off for 5 of SmolLM2's 32 frequencies)."""
    from sparrow.kernels.elementwise import rope_powers
    from sparrow.models.rope import Rope

    powers = rope_powers(theta, head_dim)
    assert np.array_equal(Rope(head_dim, theta, None).inv_freq, np.float32(1) / powers)
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    with localcontext() as ctx:
        ctx.prec = 60
        for i, e in enumerate(exps):
            exact = Decimal(theta) ** Decimal(float(e))  # e is exact in f64
            f = np.float32(float(exact))
            near = [f, np.nextafter(f, np.float32(0)), np.nextafter(f, np.float32(np.inf))]
            best = min(near, key=lambda c: abs(Decimal(float(c)) - exact))
            assert powers[i] == best, (i, powers[i], best)
            for other in near[1:]:  # the midpoints on both sides
                mid = (Decimal(float(best)) + Decimal(float(other))) / 2
                assert abs(exact - mid) / exact > Decimal(2) ** -40, (i, exact)
