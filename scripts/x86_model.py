"""The x86 kernels' loops as their AVX2 (ymm) and AVX-512 (zmm) code against LLVM's scheduling
models of x86 cores, on any x86 or other host (issue 71 item 1: where the 16 ymm registers of
an AVX2 CPU cost what 32 zmm registers did not).

sparrow's IR is written in <16 x float> vectors (one zmm, or two ymm on AVX2) and its tiles were
shaped on AVX-512 machines. This compiles the same IR twice with llvmlite, as the engine's
numba build would for each path (kernels/cpu.py's flags: AVX2's emitters with no AVX-512 and no
VNNI, then AVX-512's with VNNI), and asks llvm-mca (scripts/neon_model.py's method) how many cycles a
loop pass takes on a core of each kind, and how often the loop touches the stack (spills):

- each stored format's exact decode row dot (a 32-value block's cycles, and bytes of weights a
  cycle: the rate one core dots rows at if memory keeps up);
- the q8 mode's decode dots (a group of 8 interleaved rows against one x row: vpdpbusd with
  VNNI, pmaddubsw + pmaddwd without);
- the prefill GEMM's micro-tiles (fmas a cycle: two 256-bit fma pipes give 16, two 512-bit 32).

The model is LLVM's, not silicon: `sparrow bench speed` on the CPU is the measurement. Usage:
  python scripts/x86_model.py [--mca llvm-mca-19] [--avx2 znver3,alderlake] [--avx512 znver4] [--ghz 3.5]
"""

import argparse
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import neon_model as nm  # noqa: E402

import sparrow.kernels.ir as kir  # noqa: E402
from sparrow.kernels import intdot as q8ir  # noqa: E402
from sparrow.kernels.matmul import gemm, widen  # noqa: E402
from sparrow.kernels.matmul.q8 import groups  # noqa: E402

X86 = "x86_64-unknown-linux-gnu"
_BASE = "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt"
PATHS = {  # path -> (features, the emitters' flags: ir.AVX512F, the q8 mode's VNNI)
    "avx2": (_BASE + ",-avx512f,-avxvnni", False, False),
    "avx512": (_BASE + ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512vnni", True, True),
}
GEMM_TILE = {"avx2": gemm.micro_tile("+avx2"), "avx512": gemm.micro_tile("+avx512f")}


def spills(body: list[str]) -> int:
    """Loop instructions with a memory operand on the stack pointer (a register spilled or
    reloaded, or a buffer the IR keeps on the stack on purpose)."""
    return sum(1 for line in body if re.search(r"\(%rsp[,)]", line))


def emit_as(path: str) -> str:
    """Sets the emitters' flags for path; returns its features."""
    feats, avx512, vnni = PATHS[path]
    kir.AVX512F = avx512
    q8ir.VNNI = groups.DOT4 = q8ir.DOT4 = q8ir.VNNI512 = vnni
    q8ir.AVX2 = groups.AVX2 = True
    q8ir.DOTPROD = groups.I8MM = q8ir.I8MM = False
    return feats


def model(path: str, cpu: str, mca: str, ghz: float) -> list[str]:
    feats = emit_as(path)

    def run(module):
        body = nm.loop_of(module, cpu, X86, feats)
        return nm.cycles(body, mca, cpu, triple="x86_64"), spills(body)

    rows = [f"### {path} code on the {cpu} model (one core at {ghz} GHz)", ""]
    rows += ["| kernel | cycles a block | weight bytes a cycle (GB/s) | stack accesses a loop pass |"]
    rows += ["|---|---|---|---|"]
    for qtype, (mod, together, blocks) in nm.ROW_DOTS.items():
        widen.ROW_DOT_GROUPS = True
        cyc, sp = run(nm.row_dot_module(mod._emit_rowdot(qtype), together, X86))
        per_pass = blocks * together
        bpc = nm.BLOCK_BYTES[qtype] * per_pass / cyc
        rate = f"{bpc:.2f} ({bpc * ghz:.1f})"
        rows.append(f"| exact {qtype} row dot ({together} rows) | {cyc / per_pass:.1f} | {rate} | {sp} |")
    for qtype in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        cyc, sp = run(groups.tile_module(qtype, 1, X86))
        bpc = nm.BLOCK_BYTES[qtype] * 8 / cyc  # a loop pass: one block of each of the 8 rows
        rows.append(f"| q8 mode {qtype} dot (8 rows) | {cyc / 8:.1f} | {bpc:.2f} ({bpc * ghz:.1f}) | {sp} |")
    mr, nw, lanes = GEMM_TILE[path]
    cyc, sp = run(gemm.tile_module(mr, nw, lanes, X86))
    rows.append(f"| prefill GEMM tile {mr}x{nw}x{lanes} | {mr * nw * lanes / cyc:.1f} fmas a cycle | | {sp} |")
    return rows + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mca", default="llvm-mca-19", help="llvm-mca (LLVM 17 or later for znver4)")
    ap.add_argument("--avx2", default="znver3,alderlake", help="cores whose model runs the AVX2 code")
    ap.add_argument("--avx512", default="znver4", help="cores whose model runs the AVX-512 code")
    ap.add_argument("--ghz", type=float, default=3.5, help="clock for GB/s")
    args = ap.parse_args()
    if shutil.which(args.mca) is None:
        ap.error(f"--mca {args.mca}: not found (Debian: apt install llvm-19)")
    for path, cpus in (("avx2", args.avx2), ("avx512", args.avx512)):
        for cpu in filter(None, cpus.split(",")):
            print("\n".join(model(path, cpu, args.mca, args.ghz)))


if __name__ == "__main__":
    main()
