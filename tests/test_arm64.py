"""aarch64 as a target, checked on any host (issue 40): the f16 table without an FP exception,
the spin-wait hint per architecture, the q8 mode's integer dots compiled for aarch64 CPUs
(llvmlite's aarch64 target machine: the assembly holds sdot where the CPU has dotprod), and
the thread count and placement on CPUs whose cores are unequal (a faked sysfs tree).

What runs on aarch64 itself (the kernel suites, each CPU path against the others bit for bit,
`sparrow generate`) is scripts/arm64_qemu.sh's job: it takes ~30 min under emulation.
"""

import llvmlite.binding as ll
import numpy as np
import pytest
from llvmlite import ir

from sparrow.kernels import cpu, default_threads
from sparrow.kernels.fused import sync
from sparrow.kernels.ir import F32, I8, I32, I64
from sparrow.kernels.matmul import widen
from sparrow.kernels.matmul.q8 import groups
from sparrow.kernels.matmul.q8 import ir as q8ir

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


def _target_machine(triple, cpu_name="generic", features=""):
    ll.initialize_all_targets()
    ll.initialize_all_asmprinters()
    return ll.Target.from_triple(triple).create_target_machine(cpu=cpu_name, features=features, opt=3)


def _assembly(module: ir.Module, tm) -> str:
    """module optimised at O3 and compiled by tm."""
    mod = ll.parse_assembly(str(module))
    mod.triple, mod.data_layout = tm.triple, str(tm.target_data)
    mod.verify()
    pb = ll.create_pass_builder(tm, ll.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    return tm.emit_assembly(mod)


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
    tm = _target_machine(triple)
    asm = _assembly(_spin_module(triple), tm)
    assert hint in asm, asm
    other = {"pause": "isb", "isb": "pause"}[hint]
    assert other not in asm


def test_spin_calibration_times_the_barriers_loop():
    """spin_rounds times rounds of an atomic load and the pause, as the barrier spins: a loop
    LLVM cannot delete on a CPU whose pause hint is no instruction (the rounds stay finite
    and measured, not ~0 s)."""
    n = sync.spin_rounds(1.0)
    assert n == sync.spin_rounds(1.0)  # measured once per process
    irs = "".join(sync._pause_rounds.inspect_llvm().values())
    assert "load atomic" in irs
    assert 1 <= sync.spin_rounds(1e-3) < n


# ------------------------------------------------------------ the q8 mode's dots on aarch64


def _q8_tile_module(qtype, mr):
    """One group of 8 rows against mr x rows (q8.groups.emit_tile, the kernels' own IR) as a
    function of pointers, for an aarch64 target."""
    m = ir.Module(qtype)
    m.triple = AARCH64
    p8, pf, pi = I8.as_pointer(), F32.as_pointer(), I32.as_pointer()
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [p8] + [p8, pf, pf, pi] * mr + [pf, I64]), "tile")
    b = ir.IRBuilder(fn.append_basic_block())
    a = list(fn.args)
    per = [a[1 + 4 * t : 5 + 4 * t] for t in range(mr)]
    xs, dxs, sxs, bss = ([p[k] for p in per] for k in range(4))
    vs = groups.emit_tile(qtype, mr)(b, a[0], xs, dxs, sxs, bss, a[-1])
    for t, v in enumerate(vs):
        b.store(v, b.bitcast(b.gep(a[-2], [ir.Constant(I64, 8 * t)]), v.type.as_pointer()), align=4)
    b.ret_void()
    return m


@pytest.fixture
def aarch64_flags(monkeypatch):
    """set(dotprod): the q8 IR builders emit for an aarch64 CPU with or without dotprod (the
    flags kernels/cpu.py reads from the target CPU, as the modules that emit took them)."""

    def set_(dotprod):
        for mod in (q8ir, groups):
            monkeypatch.setattr(mod, "AVX2", False)
        monkeypatch.setattr(q8ir, "VNNI", False)
        monkeypatch.setattr(q8ir, "DOTPROD", dotprod)
        monkeypatch.setattr(groups, "DOT4", dotprod)

    return set_


Q8_GROUP_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


@pytest.mark.parametrize("target", ["cortex-a76", "neoverse-n2"])
@pytest.mark.parametrize("qtype", Q8_GROUP_FORMATS)
def test_q8_dots_compile_to_sdot_with_dotprod(aarch64_flags, target, qtype):
    aarch64_flags(True)
    asm = _assembly(_q8_tile_module(qtype, 2), _target_machine(AARCH64, target))
    # per block: q8_0 8 chunks, q4 / q5 4 chunks of low and high nibbles; 2 halves, 2 x rows
    assert asm.count("sdot\tv") == 32, asm.count("sdot")
    assert "smull" not in asm  # no widening multiplies left: every product is in an sdot


@pytest.mark.parametrize("qtype", Q8_GROUP_FORMATS)
def test_q8_dots_without_dotprod_compile_for_generic_aarch64(aarch64_flags, qtype):
    aarch64_flags(False)
    asm = _assembly(_q8_tile_module(qtype, 2), _target_machine(AARCH64, "generic"))
    assert "sdot" not in asm and "mull" in asm  # widening multiplies, the plain vector IR


def test_paths_line_names_sdot():
    d = dict(cpu.describe(), name="cortex-a76", avx2=False, vnni=False, vnni512=False, dotprod=True, amx=False)
    assert "q8 integer dots by sdot (dotprod)" in cpu.paths_line(d)


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
