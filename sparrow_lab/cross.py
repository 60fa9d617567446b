"""Kernel IR compiled for a CPU other than this one (an aarch64 core from an x86 host, or an
x86 path this host's CPU lacks). tests/test_arm64.py reads the assembly and runs what this host
can; scripts/neon_model.py and x86_model.py hand the loops to llvm-mca. It is lab tooling,
outside the engine package: numba compiles the kernels the engine runs for this CPU.
"""

import re

import llvmlite.binding as ll
from llvmlite import ir


def target_machine(triple: str, cpu: str = "generic", features: str = "") -> ll.TargetMachine:
    """LLVM's target machine for triple and cpu (with extra features), at O3."""
    ll.initialize_all_targets()
    ll.initialize_all_asmprinters()
    return ll.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features, opt=3)


def optimised(module: ir.Module, tm: ll.TargetMachine, unroll: bool = True) -> ll.ModuleRef:
    """module parsed for tm's target, verified and run through the O3 pipeline. unroll=False
    keeps loops as written, so a loop pass covers the blocks the IR gives it (for llvm-mca)."""
    mod = ll.parse_assembly(str(module))
    mod.triple, mod.data_layout = tm.triple, str(tm.target_data)
    mod.verify()
    options = ll.create_pipeline_tuning_options(speed_level=3)
    options.loop_unrolling = unroll
    pb = ll.create_pass_builder(tm, options)
    pb.getModulePassManager().run(mod, pb)
    return mod


def assembly(module: ir.Module, tm: ll.TargetMachine, unroll: bool = True) -> str:
    """module optimised at O3 (optimised) and compiled by tm, as assembly text."""
    return tm.emit_assembly(optimised(module, tm, unroll))


def longest_loop(asm: str) -> list[str]:
    """The instructions of the longest loop in assembly text (x86 or aarch64): from a label to
    the branch back to it, directives and comments left out."""
    lines = asm.splitlines()
    loops = []
    for i, line in enumerate(lines):
        m = re.match(r"\s+(?:j\w+|b(?:\.\w+)?|cbn?z\s+\w+,)\s+(\.LBB\S+)$", line)
        if not m:
            continue
        start = next((j for j, x in enumerate(lines) if x.startswith(m.group(1) + ":")), None)
        if start is not None and start < i:
            body = lines[start + 1 : i + 1]
            loops.append([x for x in body if x.strip() and not x.strip().startswith((".", "//", "#"))])
    return max(loops, key=len)
