"""The CPU the kernels compile for, read once: numba's target name and features, and every
choice the kernels make from them. Other modules ask here and never read the CPU themselves.

numba compiles for the host unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise (the
tests' AVX2 and generic children set them); the features string wins over the name. The
choices never change a result's bits, only which instructions compute it.
"""

import os
import platform

import numba

from sparrow.memory import libc


def _target() -> tuple[str, str]:
    """(name, features) numba compiles for: its JIT codegen's own, else what NUMBA_CPU_NAME /
    NUMBA_CPU_FEATURES or the host say."""
    try:
        from numba.core.registry import cpu_target

        cg = cpu_target.target_context.codegen()
        return cg._get_host_cpu_name(), cg._tm_features
    except Exception:  # pragma: no cover - numba internals moved
        import llvmlite.binding as ll

        name = numba.config.CPU_NAME or ll.get_host_cpu_name()
        feats = numba.config.CPU_FEATURES
        return name, (ll.get_host_cpu_features().flatten() if feats is None else feats)


NAME, FEATURES = _target()
_FEATS = set(FEATURES.split(","))

AVX2 = "+avx2" in _FEATS  # the q8 mode: pmaddubsw / pmaddwd / psignb, else generic IR
AVX512F = "+avx512f" in _FEATS  # the prefill GEMM's 16-lane micro-tile
# vpdpbusd on ymm: 4 u8 x s8 products summed into an int32 lane in one instruction, where
# AVX2 takes pmaddubsw + pmaddwd + paddd. AVX-VNNI (its VEX form) or AVX512-VNNI with VL.
VNNI = AVX2 and ("+avxvnni" in _FEATS or {"+avx512vnni", "+avx512vl"} <= _FEATS)
# vpdpbusd on zmm (AVX512-VNNI, with AVX512-BW for the byte and word lanes): 16 rows a vector
# in the q8 mode's prefill tiles (kernels/matmul/q8/pair_tiles.py)
VNNI512 = AVX2 and {"+avx512vnni", "+avx512bw"} <= _FEATS
# aarch64's sdot (Armv8.2 dotprod: Cortex-A76 / A78 / X1, Neoverse N1 and later, Apple M1):
# 4 s8 x s8 products summed into an int32 lane, the q8 mode's dots where x86 takes vpdpbusd
DOTPROD = "+dotprod" in _FEATS
I8MM = "+i8mm" in _FEATS  # aarch64's smmla (Armv8.6 i8mm: Neoverse N2 / V1, Cortex-A710, Apple M2)


AARCH64 = platform.machine().lower() in ("aarch64", "arm64")  # 64-bit Arm (row_dot_shape)
# the vector path, for the choices measured per path (models/activations.py's default mode,
# kernels/attention/crossover.py): 16-lane AVX-512, 8-lane AVX2, NEON, or generic vector IR
VECTOR_PATH = "avx512" if AVX512F else "avx2" if AVX2 else "neon" if AARCH64 else "generic"


def row_dot_shape(aarch64: bool) -> tuple[int, bool]:
    """(rows, grouped) of the exact mode's q4_0 / q4_1 decode row dots (kernels/matmul/widen.py):
    rows taken `rows` at a time, one block of each in turn, and their scales widened 16 blocks
    at a time (grouped) or each with its block. Neither changes a row's operations or their
    order, so neither changes a bit.

    x86: two rows, grouped (measured on Zen 4: docs/kernels.md). aarch64: one row, a block's
    scale with its block. Chosen against LLVM 19's scheduling model of the Neoverse N1 (the
    Cortex-A76's server twin; scripts/neon_model.py), with no board at hand: a 16-lane value
    takes four of NEON's 32 registers, two rows and the 16-block groups spill, and the model
    gives q4_0 0.69 -> 0.84 and q4_1 0.75 -> 0.97 bytes a cycle (docs/arm64.md)."""
    return (1, False) if aarch64 else (2, True)


ROW_DOTS, ROW_DOT_GROUPS = row_dot_shape(AARCH64)


def micro_tile(features: str) -> tuple[int, int, int]:
    """(MR, NW, LANES) of the prefill GEMM's micro-kernel (kernels/matmul/gemm.py): x rows, vectors a
    row and f32 lanes a vector.

    With avx512f (32 zmm): 8 x 3 <16 x float> accumulators (8 x 48). Otherwise (AVX2's 16
    ymm, or anything else): 4 x 3 <8 x float> (4 x 24), so 12 accumulators + 3 weight
    vectors + 1 broadcast fill the 16 registers without spilling, and 12 independent fma
    chains cover the fma latency."""
    if "+avx512f" in features.split(","):
        return 8, 3, 16
    return 4, 3, 8


GEMM_TILE = micro_tile(FEATURES)


def attention_tile(features: str) -> tuple[int, int, int]:
    """(MR, NW, LANES) of prefill attention's tile (kernels/attention/tile.py): query rows,
    vectors a row and f32 lanes a vector.

    With avx512f: 8 x 2 <16 x float> (8 x 32; 16 of the 32 zmm hold accumulators, and each
    broadcast A value rides in its fma as a memory operand). Otherwise 4 x 2 <8 x float>
    (4 x 16: 8 accumulators of AVX2's 16 ymm; NEON's 32 registers hold them as 16)."""
    if "+avx512f" in features.split(","):
        return 8, 2, 16
    return 4, 2, 8


ATTENTION_TILE = attention_tile(FEATURES)


SYSFS_CPU = "/sys/devices/system/cpu"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def core_speeds(cpus, root: str = SYSFS_CPU) -> dict[int, int]:
    """{cpu: how fast its core is} for the CPU ids `cpus`, from the sysfs tree at root: the
    scheduler's cpu_capacity (1024 for the fastest core; Arm big.LITTLE boards such as the
    RK3588's 4 Cortex-A76 + 4 Cortex-A55 give 1024 and ~400), else cpufreq's
    cpuinfo_max_freq; {} when a CPU has neither (every core counts as equal then)."""
    for name in ("cpu_capacity", "cpufreq/cpuinfo_max_freq"):
        speeds = {c: _read_int(os.path.join(root, f"cpu{c}", name)) for c in cpus}
        if speeds and None not in speeds.values():
            return speeds
    return {}


def fast_first(cpus, root: str = SYSFS_CPU) -> list[int]:
    """The CPU ids `cpus` fastest core first (core_speeds; ties by id): where numba's workers
    are pinned, so a thread count below the CPU count runs on the fast cores."""
    speeds = core_speeds(cpus, root)
    return sorted(cpus, key=lambda c: (-speeds.get(c, 0), c))


def fast_cores(cpus, root: str = SYSFS_CPU) -> list[int]:
    """The CPUs of `cpus` whose cores are of the fastest kind (all of them on a CPU whose cores
    are equal): the default thread count. The fused decode step splits every matvec evenly
    and meets at a barrier between phases, so one thread on a slow core makes every other
    thread wait for it: on an RK3588, 4 threads on the A76 cores, not 8."""
    speeds = core_speeds(cpus, root)
    if not speeds:
        return sorted(cpus)
    top = max(speeds.values())
    # cores within 10% of the fastest count as fast (boost clocks differ slightly per core)
    return sorted(c for c, v in speeds.items() if v * 10 >= top * 9)


def _amx_permitted() -> bool:
    """Whether the q8 mode's prefill may use AMX tiles: the CPU has them, SPARROW_AMX is not 0,
    and Linux grants this process the tile state."""
    if os.environ.get("SPARROW_AMX", "1") == "0" or not {"+amx-tile", "+amx-int8"} <= _FEATS:
        return False
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): tiles for every thread of this process
        return libc().syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


AMX = _amx_permitted()


def paths_line(d: dict | None = None) -> str:
    """One sentence: every code path the kernels have, and the one this CPU takes (d: a
    describe() dict, this process's by default)."""
    d = d or describe()
    rows, _ = row_dot_shape(d.get("arch", "x86_64") in ("aarch64", "arm64"))
    if d.get("dotprod"):
        dots = "sdot (dotprod)"
    else:
        dots = "vpdpbusd (VNNI)" if d["vnni"] else ("pmaddubsw (AVX2)" if d["avx2"] else "generic vector IR")
    if d.get("i8mm"):
        tiles = "smmla tiles (i8mm)"
    elif d["vnni512"]:
        tiles = "zmm pair tiles (AVX512-VNNI)"
    else:  # 8 lanes a vector: one ymm register on x86, two of NEON's 128-bit ones on aarch64
        tiles = "ymm tiles" if d.get("arch", "x86_64") in ("x86_64", "amd64") else "8-lane vector tiles"
    return (
        f"sparrow's code paths on this CPU (numba target {d['name']}): q8 integer dots by {dots} "
        "[of: vpdpbusd, pmaddubsw, sdot, generic]; q8 prefill on "
        f"{'AMX tiles' if d['amx'] else tiles} [of: AMX tiles, zmm pair tiles, ymm tiles, smmla tiles, "
        "8-lane vector tiles]; "
        f"prefill GEMM micro-tile {d['gemm_tile']} [of: 8x3x16 (AVX-512), 4x3x8]; "
        f"exact q4_0 / q4_1 decode row dots {'one row' if rows == 1 else 'two rows'} at a time [of: two rows, "
        "one row (aarch64)]; "
        f"prefill attention tile {d.get('attention_tile', '4x2x8')} [of: 8x2x16 (AVX-512), 4x2x8]."
    )


def describe() -> dict:
    """The CPU and the code paths this process takes on it (`sparrow bench speed` prints it)."""
    return dict(
        name=NAME,
        arch=platform.machine().lower(),
        vector_path=VECTOR_PATH,
        avx2=AVX2,
        avx512f=AVX512F,
        vnni=VNNI,
        vnni512=VNNI512,
        dotprod=DOTPROD,
        i8mm=I8MM,
        amx=AMX,
        gemm_tile="x".join(map(str, GEMM_TILE)),
        attention_tile="x".join(map(str, ATTENTION_TILE)),
    )
