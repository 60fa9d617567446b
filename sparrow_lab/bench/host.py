"""The machine a benchmark runs on: CPU model and vector extensions, load and busy CPUs,
resident memory, library versions (sparrow bench speed's header and its busy warning)."""

import os
import resource
import sys
import time

import numpy as np

MB = 1 << 20


def load_avg():
    return round(os.getloadavg()[0], 2)


def rss_peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak; Linux: KiB


def status_mib(field: str) -> float | None:
    """A memory field of /proc/self/status (VmRSS now, VmHWM the peak since reset_peak) in MiB,
    or None where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith(field + ":")) / 1024
    except (OSError, StopIteration):
        return None


def rss_now_mb():
    return status_mib("VmRSS")


def reset_peak() -> bool:
    """Starts a new peak: VmHWM back to the current VmRSS (Linux: writing 5 to clear_refs);
    False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# vector extensions worth naming (x86 /proc/cpuinfo "flags", ARM "Features"; asimddp = dotprod)
_EXTENSIONS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx512vbmi",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "asimdhp",
    "i8mm",
    "bf16",
    "sve",
    "sve2",
)


def cpu_info() -> dict:
    """CPU model, vector extensions, CPU count and L2 size per core, from /proc/cpuinfo and sysfs."""
    import platform

    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    model = (
        fields.get("model name")
        or fields.get("Model")
        or fields.get("Hardware")
        or platform.processor()
        or platform.machine()
    )
    if "model name" not in fields and "CPU part" in fields:  # ARM: implementer/part ids
        model = f"{model} (implementer {fields.get('CPU implementer')}, part {fields['CPU part']})"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    l2 = None
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            l2 = f.read().strip()
    except OSError:
        pass
    return {
        "model": model,
        "extensions": [e for e in _EXTENSIONS if e in flags],
        "cpus": os.cpu_count(),
        "l2_per_core": l2,
        "machine": platform.machine(),
    }


def llama_cpp_importable() -> bool:
    """Whether llama.cpp's bindings can be compared against (a note on stderr when not)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not importable: measuring sparrow only", file=sys.stderr)
        return False
    return True


def cpu_busy(interval=1.0) -> float | None:
    """Fraction of all CPUs' time spent busy (not idle/iowait) over `interval` s, from /proc/stat."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)

    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(1 - (i1 - i0) / max(1, t1 - t0), 3)


def busy_threshold(cpus=None) -> float:
    """1-minute load above which the machine counts as busy: a quarter of a CPU each, at least 0.5."""
    return max(0.5, 0.25 * (cpus or os.cpu_count() or 1))


def versions(compare) -> dict:
    from sparrow import __version__

    out = {"sparrow": __version__, "numpy": np.__version__}
    try:
        import numba

        out["numba"] = numba.__version__
    except ImportError:
        pass
    if compare:
        import llama_cpp

        out["llama_cpp_python"] = llama_cpp.__version__
        try:
            info = llama_cpp.llama_print_system_info()
            out["llama_cpp_system_info"] = (info.decode() if isinstance(info, bytes) else str(info)).strip()
        except Exception:  # noqa: BLE001 - informational only
            pass
    return out


def machine_counters() -> dict:
    """This process's minor faults and involuntary switches, and the machine's stolen CPU ticks."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"minor_faults": ru.ru_minflt, "involuntary_switches": ru.ru_nivcsw, "steal_ticks": 0}
    try:
        with open("/proc/stat") as f:
            v = f.readline().split()
        out["steal_ticks"] = int(v[8]) if len(v) > 8 else 0
    except (OSError, ValueError):
        pass
    return out
