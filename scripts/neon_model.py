"""The exact mode's NEON kernels against LLVM's scheduling model of an Arm core, on any host.

No Arm board was at hand to tune the exact mode's decode row dots and the f32 prefill GEMM for
NEON (issue 40), so this compiles sparrow's own IR for them with llvmlite for aarch64 and asks
llvm-mca (LLVM 17 or later: its Neoverse N1 model, the Cortex-A76's server twin, as in the
RK3588 and the Raspberry Pi 5) how many cycles their loops take:

- each stored format's row dot as x86 takes it (q4_0 / q4_1 / q4_k / q5_k two rows at a time,
  q4_0 / q4_1 scales in 16-block groups) and one row at a time (q4_0 / q4_1: each scale with
  its block, kernels.cpu.row_dot_shape's aarch64 choice), as cycles a 32-value block and bytes
  of weights a cycle (times the clock: the rate one core dots rows at if memory keeps up);
- the q8 mode's decode dots (a group of 8 interleaved rows against one x row, on `sdot`) in
  the same units, for comparison;
- micro-tiles (MR x NW x LANES) of the prefill GEMM as fmas a cycle (8 is two 128-bit fma
  pipes' peak).

The model is LLVM's, not silicon: `sparrow bench speed` on a board is the measurement. Usage:
  python scripts/neon_model.py [--mca llvm-mca-19] [--cpu neoverse-n1] [--ghz 2.4]
"""

import argparse
import re
import shutil
import subprocess

from llvmlite import ir

import sparrow.kernels.ir as kir
from sparrow.kernels import intdot as q8ir
from sparrow.kernels.ir import F32, I8, I64
from sparrow.kernels.matmul import gemm, kquants, widen
from sparrow.kernels.matmul.q8 import groups
from sparrow_lab import cross

AARCH64 = "aarch64-unknown-linux-gnu"
FEATURES = "+neon,+fp-armv8,+fullfp16,+dotprod"
# bytes of weights a 32-value block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q4_k": 18, "q5_k": 22, "q6_k": 26.25}
# (emitter module, rows make_rows takes together on x86, 32-value blocks one loop pass takes a row)
ROW_DOTS = {
    "q8_0": (widen, 1, 2),
    "q4_0": (widen, 2, 16),
    "q4_1": (widen, 2, 16),
    "q5_0": (kquants, 1, 2),
    "q5_1": (kquants, 1, 2),
    "q4_k": (kquants, 2, 8),
    "q5_k": (kquants, 2, 8),
    "q6_k": (kquants, 1, 8),
}
GEMM_TILES = [(4, 3, 8), (8, 3, 4), (4, 6, 4), (6, 4, 4), (12, 2, 4), (8, 2, 4), (4, 4, 4)]


def loop_of(module: ir.Module, cpu: str, triple: str = AARCH64, features: str = FEATURES) -> list[str]:
    """The longest loop of module compiled at O3 for cpu (an aarch64 one unless triple and
    features say otherwise); loops not unrolled, so that a loop pass covers the blocks the IR
    gives it (unrolling repeats the same code a block)."""
    return cross.longest_loop(cross.assembly(module, cross.target_machine(triple, cpu, features), unroll=False))


def cycles(body: list[str], mca: str, cpu: str, iterations: int = 200, triple: str = "aarch64") -> float:
    out = subprocess.run(
        [mca, f"-mtriple={triple}", f"-mcpu={cpu}", f"-iterations={iterations}"],
        input="\n".join(body),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(re.search(r"Total Cycles:\s+(\d+)", out).group(1)) / iterations


def row_dot_module(emit, rows: int, triple: str = AARCH64) -> ir.Module:
    """rows rows dotted with one f32 x (make_rows' emitter interface) as a function of pointers."""
    m = ir.Module("rows")
    m.triple = triple
    p8, pf = I8.as_pointer(), F32.as_pointer()
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [p8] * rows + [p8, p8, I64, I64, pf]), "rows")
    b = ir.IRBuilder(fn.append_basic_block())
    a = list(fn.args)
    for i, v in enumerate(emit(b, a[:rows], [a[rows], a[rows + 1]], [a[rows + 2], a[rows + 3]])):
        b.store(v, b.gep(a[-1], [ir.Constant(I64, i)]))
    b.ret_void()
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mca", default="llvm-mca-19", help="llvm-mca of LLVM 17 or later")
    ap.add_argument("--cpu", default="neoverse-n1", help="the model's CPU (default: the Cortex-A76's twin)")
    ap.add_argument("--ghz", type=float, default=2.4, help="clock for GB/s (RK3588 and Pi 5 big cores: 2.4)")
    args = ap.parse_args()
    if shutil.which(args.mca) is None:
        ap.error(f"--mca {args.mca}: not found (LLVM 17 or later's llvm-mca; Debian: apt install llvm-19)")
    kir.AVX512F = False  # emit as for an aarch64 CPU whatever the host (the IR builders read these)
    print(f"exact decode row dots, {args.cpu} model, one core at {args.ghz} GHz:")
    print("format | as on x86: cycles a block, B/cycle | one row at a time: cycles a block, B/cycle")
    for qtype, (mod, together, blocks) in ROW_DOTS.items():
        cells = []
        for rows, grouped in ((together, True), (1, False)):
            widen.ROW_DOT_GROUPS = grouped  # q4_0 / q4_1 only: their per-block scales take 2 a pass
            emit = mod._emit_rowdot(qtype)
            per_pass = (blocks if grouped or qtype not in ("q4_0", "q4_1") else 2) * rows
            cyc = cycles(loop_of(row_dot_module(emit, rows), args.cpu), args.mca, args.cpu)
            bpc = BLOCK_BYTES[qtype] * per_pass / cyc
            cells.append(f"{cyc / per_pass:5.1f}, {bpc:.2f} ({bpc * args.ghz:.1f} GB/s)")
        print(f"{qtype} | " + " | ".join(cells))
    print(f"\nq8 mode decode dots (8 rows a group, sdot), {args.cpu} model:")
    for mod in (q8ir, groups):  # emit as for an aarch64 CPU with dotprod (kernels/cpu.py's flags)
        mod.AVX2 = False
    q8ir.VNNI, q8ir.DOTPROD, groups.DOT4, groups.I8MM = False, True, True, False
    for qtype in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        cyc = cycles(loop_of(groups.tile_module(qtype, 1, AARCH64), args.cpu), args.mca, args.cpu)
        bpc = BLOCK_BYTES[qtype] * 8 / cyc  # a loop pass: one block of each of the 8 rows
        print(f"{qtype}: {cyc / 8:5.1f} cycles a row's block, {bpc:.2f} B/cycle ({bpc * args.ghz:.1f} GB/s)")
    print(f"\nprefill GEMM micro-tiles, {args.cpu} model (peak 8 fmas a cycle):")
    for mr, nw, lanes in GEMM_TILES:
        body = loop_of(gemm.tile_module(mr, nw, lanes, AARCH64), args.cpu)
        spills = sum(1 for line in body if "[sp" in line)
        cyc = cycles(body, args.mca, args.cpu)
        print(f"{mr}x{nw}x{lanes}: {mr * nw * lanes / cyc:.2f} fmas a cycle, {spills} stack accesses in the loop")


if __name__ == "__main__":
    main()
