"""aarch64 as a target, checked on any host (issue 40): the f16 table without an FP exception,
the spin-wait hint per architecture, the q8 mode's integer dots compiled for aarch64 CPUs
(llvmlite's aarch64 target machine: the assembly holds sdot where the CPU has dotprod), and
the thread count and placement on CPUs whose cores are unequal (a faked sysfs tree).

What runs on aarch64 itself (the kernel suites, each CPU path against the others bit for bit,
`sparrow generate`) is scripts/arm64_qemu.sh's job: it takes ~30 min under emulation.
"""

import json
import os
import subprocess
import sys

import llvmlite.binding as ll
import numpy as np
import pytest
from llvmlite import ir
from numba import njit

from sparrow.kernels import cpu
from sparrow.kernels import intdot as q8ir
from sparrow.kernels.fused import sync
from sparrow.kernels.ir import I64
from sparrow.kernels.matmul import gemm, widen
from sparrow.kernels.matmul.q8 import groups
from sparrow.kernels.runtime import default_threads
from sparrow_lab import cross

AARCH64 = "aarch64-unknown-linux-gnu"


def _bits(a):
    return np.asarray(a).view(np.uint32)


def test_f16_table_is_numpys_widening_without_an_fp_exception():
    with np.errstate(all="raise"):  # aarch64's fcvt raised `invalid` on signalling NaNs
        table = widen.f16_table()
    assert np.array_equal(_bits(table), _bits(widen.F16_LUT))
    codes = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        ref = _bits(codes.view(np.float16).astype(np.float32))
    got = _bits(table)
    exp, man = (codes >> 10) & 0x1F, codes & 0x3FF
    snan = (exp == 0x1F) & (man != 0) & (man & 0x200 == 0)
    assert snan.sum() == 2 * 511
    # every code but the signalling NaNs: numpy's value, bit for bit (zeros, subnormals, inf)
    assert np.array_equal(got[~snan], ref[~snan])
    # signalling NaNs keep sign, payload and quiet bit (x86's numpy gives exactly these; aarch64's
    # sets the quiet bit): the table is the same on every architecture
    quiet = np.uint32(0x400000)
    assert np.array_equal(got[snan] | quiet, ref[snan] | quiet)
    assert not np.any(got[snan] & quiet)
    assert np.array_equal(got[snan] & 0x3FFFFF, man[snan].astype(np.uint32) << 13)


@pytest.mark.parametrize(
    "triple, cpu_name, features, fma",
    [(AARCH64, "neoverse-n1", "+neon", "fmla"), ("x86_64-unknown-linux-gnu", "znver4", "+avx512f", "vfmadd")],
)
def test_prefill_gemm_micro_tile_keeps_its_accumulators_in_registers(triple, cpu_name, features, fma):
    """The prefill GEMM's micro-kernel loop (gemm.emit_tile) at the tile cpu.micro_tile picks for
    that CPU (aarch64: 4 x 3 <8 x float>, AVX-512: 8 x 3 <16 x float>), compiled for it: one fma
    a vector register of accumulators a k step, and no stack access in the loop (a spilled
    accumulator would be one)."""
    mr, nw, lanes = cpu.micro_tile(features)
    tm = cross.target_machine(triple, cpu_name, features)
    loop = cross.longest_loop(cross.assembly(gemm.tile_module(mr, nw, lanes, triple), tm, unroll=False))
    width = 4 if triple == AARCH64 else 16  # f32 lanes a register: NEON's 128 bits, a zmm's 512
    assert sum(1 for x in loop if x.split()[0].startswith(fma)) == mr * nw * lanes // width
    assert not [x for x in loop if "sp]" in x or "[sp" in x or "%rsp" in x]


def _spin_module(triple):
    """A function spinning n rounds of emit_pause for triple, as the barrier's loop does."""
    m = ir.Module("spin")
    m.triple = triple
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [I64]), "spin")
    b = ir.IRBuilder(fn.append_basic_block())
    i = b.alloca(I64)
    b.store(ir.Constant(I64, 0), i)
    head, body, end = fn.append_basic_block(), fn.append_basic_block(), fn.append_basic_block()
    b.branch(head)
    b.position_at_end(head)
    b.cbranch(b.icmp_signed("<", b.load(i), fn.args[0]), body, end)
    b.position_at_end(body)
    sync.emit_pause(b, triple)
    b.store(b.add(b.load(i), ir.Constant(I64, 1)), i)
    b.branch(head)
    b.position_at_end(end)
    b.ret_void()
    return m


@pytest.mark.parametrize(
    "triple, hint",
    [("x86_64-unknown-linux-gnu", "pause"), (AARCH64, "isb"), ("arm64-apple-macosx", "isb")],
)
def test_spin_hint_per_architecture(triple, hint):
    """x86 spins on `pause`, aarch64 on `isb` (before, a no-op: the calibrated empty loop
    took ~0 s and the spin limit came out ~1000 times too long)."""
    tm = cross.target_machine(triple)
    asm = cross.assembly(_spin_module(triple), tm)
    assert hint in asm, asm
    other = {"pause": "isb", "isb": "pause"}[hint]
    assert other not in asm


def test_spin_calibration_times_the_barriers_loop():
    """spin_rounds times rounds of an atomic load and the pause, as the barrier spins: a loop
    LLVM cannot delete on a CPU whose pause hint is no instruction (the rounds stay finite
    and measured, not ~0 s)."""
    n = sync.spin_rounds(1.0)
    assert n == sync.spin_rounds(1.0)  # measured once per process
    fresh = njit(sync._pause_rounds.py_func)  # uncached: numba cannot inspect cached code
    fresh(np.zeros(4, np.int64), 1)
    irs = "".join(fresh.inspect_llvm().values())
    assert "load atomic" in irs
    assert 1 <= sync.spin_rounds(1e-3) < n


# ------------------------------------------------------------ the q8 mode's dots on aarch64


def _q8_tile_module(qtype, mr):
    return groups.tile_module(qtype, mr, AARCH64)


def _set_q8_flags(monkeypatch, avx2=False, vnni=False, dotprod=False, i8mm=False):
    """The q8 IR builders emit for a CPU with these features (the flags kernels/cpu.py reads
    from the target CPU, as the modules that emit took them)."""
    for mod in (q8ir, groups):
        monkeypatch.setattr(mod, "AVX2", avx2)
    monkeypatch.setattr(q8ir, "VNNI", vnni)
    monkeypatch.setattr(q8ir, "DOTPROD", dotprod)
    monkeypatch.setattr(groups, "DOT4", vnni or dotprod)
    monkeypatch.setattr(groups, "I8MM", i8mm)


@pytest.fixture
def aarch64_flags(monkeypatch):
    """set(dotprod, i8mm=False): _set_q8_flags for an aarch64 CPU."""

    def set_(dotprod, i8mm=False):
        _set_q8_flags(monkeypatch, dotprod=dotprod, i8mm=i8mm)

    return set_


Q8_GROUP_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


@pytest.mark.parametrize("target", ["cortex-a76", "neoverse-n2"])
@pytest.mark.parametrize("qtype", Q8_GROUP_FORMATS)
def test_q8_dots_compile_to_sdot_with_dotprod(aarch64_flags, target, qtype):
    aarch64_flags(True)
    asm = cross.assembly(_q8_tile_module(qtype, 2), cross.target_machine(AARCH64, target))
    # per block: q8_0 8 chunks, q4 / q5 4 chunks of low and high nibbles; 2 halves, 2 x rows
    assert asm.count("sdot\tv") == 32, asm.count("sdot")
    assert "smull" not in asm  # no widening multiplies left: every product is in an sdot


@pytest.mark.parametrize("qtype", Q8_GROUP_FORMATS)
def test_q8_prefill_tiles_compile_to_smmla_with_i8mm(aarch64_flags, qtype):
    aarch64_flags(True, i8mm=True)
    tm = cross.target_machine(AARCH64, "neoverse-n2")
    # 4 x rows: 2 pairs x 4 row pairs x 4 runs of 8 elements a block, all smmla
    asm = cross.assembly(_q8_tile_module(qtype, 4), tm)
    assert asm.count("smmla\tv") == 32 and "sdot" not in asm and "smull" not in asm
    # 3 x rows: a pair on smmla, the third on sdot (2 halves x 8 runs of 4 elements)
    asm = cross.assembly(_q8_tile_module(qtype, 3), tm)
    assert asm.count("smmla\tv") == 16 and asm.count("sdot\tv") == 16
    # 1 x row (decode): sdot only
    asm = cross.assembly(_q8_tile_module(qtype, 1), tm)
    assert "smmla" not in asm and asm.count("sdot\tv") == 16


@pytest.mark.parametrize("qtype", Q8_GROUP_FORMATS)
def test_q8_dots_without_dotprod_compile_for_generic_aarch64(aarch64_flags, qtype):
    aarch64_flags(False)
    asm = cross.assembly(_q8_tile_module(qtype, 2), cross.target_machine(AARCH64, "generic"))
    assert "sdot" not in asm and "mull" in asm  # widening multiplies, the plain vector IR


def test_paths_line_names_the_aarch64_paths():
    a76 = dict(cpu.describe(), name="cortex-a76", arch="aarch64", avx2=False, vnni=False, vnni512=False)
    a76.update(dotprod=True, i8mm=False, amx=False)
    line = cpu.paths_line(a76)
    assert "q8 integer dots by sdot (dotprod)" in line and "q8 prefill on 8-lane vector tiles [" in line
    assert "q4_1 decode row dots one row at a time [" in line
    n2 = cpu.paths_line(dict(a76, name="neoverse-n2", i8mm=True))
    assert "q8 prefill on smmla tiles (i8mm) [" in n2
    generic = cpu.paths_line(dict(a76, name="generic", dotprod=False))
    assert "by generic vector IR" in generic and "on 8-lane vector tiles" in generic


# ------------------------------------------------------------ the exact row dots' shape on aarch64

_ROW_SHAPE_CHILD = """
import json, platform, sys
import numpy as np
platform.machine = lambda: "aarch64"  # kernels.cpu then chooses aarch64's shape as sparrow loads
from sparrow.kernels import cpu
from sparrow.kernels.linear import linear, prepare
from sparrow.kernels.matmul import widen
from test_golden_bits import SHAPE, _digest, _weight
from weights import acts
got = {q: _digest(linear(acts(1, SHAPE[1], seed=12), prepare(_weight(q), "f32"))) for q in ("q4_0", "q4_1")}
print("INFO " + json.dumps(dict(got, shape=[cpu.AARCH64, widen.ROW_DOTS, widen.ROW_DOT_GROUPS])))
np.savez(sys.argv[2])
"""


def test_aarch64_row_dot_shape_gives_the_golden_bits(tmp_path):
    """aarch64 takes q4_0 / q4_1 exact decode rows one at a time, each scale with its block
    (cpu.row_dot_shape); x86 two rows, scales in 16-block groups. Same operations in the same
    order: a child building the kernels in aarch64's shape here (its own kernel cache) gives
    the golden decode bits of test_golden_bits."""
    from test_cpu_paths import run_compiled_for
    from test_golden_bits import GOLDEN_LINEAR

    assert cpu.row_dot_shape(False) == (2, True) and cpu.row_dot_shape(True) == (1, False)
    info, _ = run_compiled_for(tmp_path, cpu.NAME, cpu.FEATURES, _ROW_SHAPE_CHILD, fresh=True)
    assert info.pop("shape") == [True, 1, False]
    assert info == {q: GOLDEN_LINEAR[f"{q}/f32/decode"] for q in ("q4_0", "q4_1")}


def test_neon_model_script_names_a_missing_llvm_mca():
    """scripts/neon_model.py without its llvm-mca: one line naming the option, exit status 2."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "neon_model.py")
    res = subprocess.run([sys.executable, script, "--mca", "no-such-llvm-mca"], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .endswith("--mca no-such-llvm-mca: not found (LLVM 17 or later's llvm-mca; Debian: apt install llvm-19)")
    )


def test_x86_model_script_compiles_each_paths_code():
    """scripts/x86_model.py hands llvm-mca the AVX2 path's loops in ymm registers only and the
    AVX-512 path's in zmm (in a child: it sets the emitters' flags); without its llvm-mca, one
    line naming the option, exit status 2."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "x86_model.py")
    child = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import x86_model as xm, neon_model as nm\n"
        "from sparrow.kernels.matmul import widen\n"
        "from sparrow.kernels.matmul.q8 import groups\n"
        "out = {}\n"
        "for path in ('avx2', 'avx512'):\n"
        "    feats = xm.emit_as(path)\n"
        "    for name, m in (('rows', nm.row_dot_module(widen._emit_rowdot('q4_0'), 2, xm.X86)),\n"
        "                    ('q8', groups.tile_module('q4_0', 1, xm.X86))):\n"
        "        body = ' '.join(nm.loop_of(m, 'znver4' if path == 'avx512' else 'znver3', xm.X86, feats))\n"
        "        out[path + '/' + name] = ['zmm' in body, 'ymm' in body, 'vpdpbusd' in body, 'vpmaddubsw' in body]\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run([sys.executable, "-c", child, os.path.dirname(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["avx2/rows"][:2] == [False, True] and got["avx2/q8"] == [False, True, False, True], got
    assert got["avx512/rows"][0] and got["avx512/q8"][2] and not got["avx512/q8"][3], got
    res = subprocess.run([sys.executable, script, "--mca", "no-such-llvm-mca"], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.endswith("--mca no-such-llvm-mca: not found (Debian: apt install llvm-19)")


# ------------------------------------------------------------ big.LITTLE: threads and placement


def _sysfs(tmp_path, **per_cpu):
    """A fake /sys/devices/system/cpu: per_cpu = {file: [value of cpu0, cpu1, ...]}."""
    for name, values in per_cpu.items():
        for c, v in enumerate(values):
            f = tmp_path / f"cpu{c}" / name.replace("__", "/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"{v}\n")
    return str(tmp_path)


RK3588 = [414] * 4 + [1024] * 4  # cpu_capacity: 4 Cortex-A55, then 4 Cortex-A76


def test_big_little_by_capacity(tmp_path):
    root = _sysfs(tmp_path, cpu_capacity=RK3588)
    assert cpu.fast_cores(range(8), root) == [4, 5, 6, 7]
    assert cpu.fast_first(range(8), root) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert cpu.fast_cores([0, 1, 5], root) == [5]  # only the CPUs this process may use count
    assert cpu.fast_cores([0, 1], root) == [0, 1]  # none of them big: the fastest allowed


def test_big_little_by_max_frequency(tmp_path):
    # no cpu_capacity (older kernels): the cores' maximum clocks; a Raspberry Pi 5 (4 x A76)
    # has equal cores, and per-core boost clocks within 10% count as one kind
    root = _sysfs(tmp_path, cpufreq__cpuinfo_max_freq=[1800000] * 2 + [2400000] * 6)
    assert cpu.fast_cores(range(8), root) == [2, 3, 4, 5, 6, 7]
    assert cpu.fast_first(range(8), root)[:6] == [2, 3, 4, 5, 6, 7]
    even = _sysfs(tmp_path / "pi5", cpufreq__cpuinfo_max_freq=[2400000] * 4)
    assert cpu.fast_cores(range(4), even) == [0, 1, 2, 3]
    boost = _sysfs(tmp_path / "boost", cpufreq__cpuinfo_max_freq=[5700000, 5500000, 5300000, 5400000])
    assert cpu.fast_cores(range(4), boost) == [0, 1, 2, 3]


def test_no_sysfs_counts_every_core_equal(tmp_path):
    assert cpu.core_speeds(range(4), str(tmp_path)) == {}
    assert cpu.fast_cores([3, 1, 2], str(tmp_path)) == [1, 2, 3]
    assert cpu.fast_first([3, 1, 2], str(tmp_path)) == [1, 2, 3]
    partial = _sysfs(tmp_path / "partial", cpu_capacity=[1024, 512])  # cpu2 unreadable: no ranking
    assert cpu.fast_cores(range(3), partial) == [0, 1, 2]


def test_default_threads_one_per_fast_core(tmp_path, monkeypatch):
    import numba

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 8)
    assert default_threads(_sysfs(tmp_path, cpu_capacity=RK3588)) == 4
    assert default_threads(_sysfs(tmp_path / "even", cpu_capacity=[1024] * 8)) == 8
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 2)  # the user's cap wins
    assert default_threads(_sysfs(tmp_path / "cap", cpu_capacity=RK3588)) == 2


# ------------------------------------------------------------ the paths run here, bit for bit

_ARMV8 = "+neon,+fp-armv8,+crc,+lse,+rdm,+fullfp16,+rcpc"
# path -> (flags, target machine CPU and features), per host architecture
RUN_PATHS = {
    "aarch64": {
        "generic": ({}, "generic", "+neon,+fp-armv8"),
        "sdot": (dict(dotprod=True), "cortex-a76", _ARMV8 + ",+dotprod"),
        "smmla": (dict(dotprod=True, i8mm=True), "neoverse-n2", _ARMV8 + ",+dotprod,+i8mm"),
    },
    "x86_64": {
        "generic": ({}, "ivybridge", "+avx,+f16c,+sse4.2,+popcnt,-avx2,-avx512f"),
        "pmaddubsw": (dict(avx2=True), "haswell", "+avx,+avx2,+f16c,+fma,+sse4.2,+popcnt,+bmi2,-avx512f"),
        # AVX-VNNI's VEX form; a CPU with AVX512-VNNI only (Zen 4) runs the EVEX one (vpdpbusd512)
        "vpdpbusd": (dict(avx2=True, vnni=True), "haswell", "+avx,+avx2,+f16c,+fma,+sse4.2,+popcnt,+bmi2,+avxvnni"),
        "vpdpbusd512": (
            dict(avx2=True, vnni=True),
            "haswell",
            "+avx,+avx2,+f16c,+fma,+sse4.2,+popcnt,+bmi2,+avx512f,+avx512bw,+avx512vl,+avx512vnni",
        ),
    },
}
# /proc/cpuinfo's flags a path needs
NEEDS = {
    "sdot": {"asimddp"},
    "smmla": {"i8mm"},
    "pmaddubsw": {"avx2"},
    "vpdpbusd": {"avx_vnni"},
    "vpdpbusd512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
}


def _runnable(path):
    """Whether this CPU runs path's instructions: /proc/cpuinfo says so, or SPARROW_ALL_CPU_PATHS=1
    (scripts/arm64_qemu.sh: qemu's CPU has them all, while its /proc/cpuinfo is the host's)."""
    import os

    if path not in NEEDS or os.environ.get("SPARROW_ALL_CPU_PATHS") == "1":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        return False
    return NEEDS[path] <= words


def _run_tile(monkeypatch, qtype, mr, path, arch, args):
    import ctypes

    flags, name, feats = RUN_PATHS[arch][path]
    with monkeypatch.context() as m:
        _set_q8_flags(m, **flags)
        module = _q8_tile_module(qtype, mr)
    triple = ll.get_process_triple()
    module.triple = triple
    tm = cross.target_machine(triple, name, feats)
    engine = ll.create_mcjit_compiler(cross.optimised(module, tm), tm)
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * (len(args) - 1) + [ctypes.c_int64]))(
        engine.get_function_address("tile")
    )
    out = args[-2]
    out[:] = np.nan
    fn(*[a.ctypes.data for a in args[:-1]], args[-1])
    return out.copy(), engine  # the engine owns the code: kept alive until the call is done


@pytest.mark.parametrize("mr", [1, 2, 3, 4])
@pytest.mark.parametrize("qtype", Q8_GROUP_FORMATS)
def test_q8_tile_paths_give_the_same_bits_here(monkeypatch, qtype, mr):
    """One group of 8 rows against mr x rows, each CPU path this host runs (the generic vector
    IR and, on aarch64, sdot and smmla; on x86, pmaddubsw and vpdpbusd) compiled by llvmlite
    here and run on the same bytes: the same f32 bits (the integer sums are exact)."""
    import platform

    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(platform.machine().lower(), platform.machine().lower())
    if arch not in RUN_PATHS:
        pytest.skip(f"no CPU paths listed for {arch}")
    rng = np.random.default_rng(mr * 31 + len(qtype))
    nb = 3
    gb = groups.GROUP_BYTES[qtype]
    data = rng.integers(0, 256, (nb, gb), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (nb, 16)).astype(np.float16)  # d (and m): finite f16
    data[:, :32] = scales.view(np.uint8)
    args = [data]
    for _ in range(mr):
        xq = rng.integers(-127, 128, nb * 32, dtype=np.int8)
        args += [xq, rng.uniform(0.01, 0.1, nb).astype(np.float32), rng.standard_normal(nb).astype(np.float32)]
        args += [(8 * xq.reshape(nb, 32).astype(np.int32).sum(1)).astype(np.int32)]
    args += [np.empty(8 * mr, np.float32), np.int64(nb)]
    paths = [p for p in RUN_PATHS[arch] if _runnable(p)]
    assert "generic" in paths and len(paths) >= 2, paths  # something to compare
    want, _ = _run_tile(monkeypatch, qtype, mr, "generic", arch, args)
    assert np.isfinite(want).all()
    for path in paths[1:]:
        got, _ = _run_tile(monkeypatch, qtype, mr, path, arch, args)
        assert np.array_equal(_bits(got), _bits(want)), (path, got, want)
