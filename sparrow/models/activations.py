"""Which activations mode a model runs when the user does not say: the one place that decides it.

The rule (measured, docs/benchmarks/zen4-epyc.md#the-default-activations-mode-2026-12-03): exact f32
activations, unless the model's exact decode would trail llama.cpp's by more than 10%, where
the q8 mode (llama.cpp's own int8-activation arithmetic) runs instead. The exact row dots widen
every weight to f32 in vector lanes, which costs more instructions a byte for 4- to 6-bit
formats than for q8_0; on small models per-token overheads hide that, on larger ones it
decides the speed. The measurements behind the rule (exact and q8 against llama.cpp on the
135M model and the Qwen3-0.6B / 1.7B shapes) are in docs/benchmarks/zen4-epyc.md and the
README's speed table: exact runs at 0.62-0.93x on the 0.6B shape's Q4_0 and Q4_K_M, keeps
pace on its Q8_0, and leads on the 135M Q4_1 model.

So: q8 where most of the bytes the q8 mode would read are in formats of TRAILS and those bytes
reach Q8_FROM_BYTES; exact everywhere else (q8_0, f16 / bf16 / f32 files, small models).
MoE experts never count: they stay exact in both modes (models/qwen3_moe.py).
`--activations f32|q8` (load(activations=...)) overrides the rule either way.

The two numbers are tabulated per CPU vector path (RULES), each row from measurements on that
path; the reason the loaded model gives (`--timings`, `/v1/models`, `bench speed`) names it.
"""

from __future__ import annotations

from ..kernels.cpu import VECTOR_PATH
from ..kernels.formats import X8_KIND

# Formats whose exact row dots trail llama.cpp's decode by more than 10% on the CPUs measured
# (q4_0, q4_k measured; q4_1 / q5_0 / q5_1 / q5_k / q6_k share their arithmetic per byte:
# nibbles or 5 / 6-bit codes widened to f32, where q8_0's bytes widen in one step).
TRAILS = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# From this many bytes of such weights exact decode trails: between the 135M model's ~80 MB,
# where exact leads, and the 0.6B shape's ~330-370 MB, where it trails.
Q8_FROM_BYTES = 256 << 20

# CPU vector path -> (formats whose exact decode trails, bytes of them from which it does)
RULES = {
    # Zen 4 (docs/benchmarks/zen4-epyc.md) and Xeons with AMX: the measurements above
    "avx512": (TRAILS, Q8_FROM_BYTES),
    # Zen 5 compiled for haswell beside an AVX2-only llama.cpp (docs/benchmarks/zen5-avx2-path.md):
    # the 135M Q4_1 model's exact decode 1.15-1.32x llama.cpp's, the 1.7B shape's Q4_0 / Q4_K_M
    # 0.61 / 0.60x exact and 1.22 / 1.23x in the q8 mode; a Zen 3 (docs/benchmarks/zen3-epyc.md):
    # the 135M model's exact decode 0.90-0.96x, at the rule's 10%
    "avx2": (TRAILS, Q8_FROM_BYTES),
}
# paths with no measurement (NEON, generic vector IR) take the AVX2 row


def rule_for(path: str) -> tuple[tuple[str, ...], int]:
    """The rule's (TRAILS, Q8_FROM_BYTES) for a CPU vector path."""
    return RULES.get(path, RULES["avx2"])


def _format(t) -> str:
    return t.ggml_type.name.lower() if t.dtype == "gguf" else t.dtype


def default_activations(tensors, quantize: str | None = None, path: str = VECTOR_PATH) -> tuple[str, str]:
    """(mode, why) for a checkpoint's tensors ({name: StoredTensor}) loaded with `quantize`, on
    the CPU vector path `path` (this CPU's by default)."""
    trails_fmts, from_bytes = rule_for(path)
    mode, why = _decide(tensors, quantize, trails_fmts, from_bytes)
    if path in RULES:
        return mode, f"{why} (the rule measured on the {path} path this CPU takes)"
    return mode, f"{why} (the avx2 path's rule: this CPU's {path} path was not measured)"


def _decide(tensors, quantize, trails_fmts, from_bytes) -> tuple[str, str]:
    by_format: dict[str, int] = {}
    for name, t in tensors.items():
        if len(t.shape) != 2 or ".experts." in name:
            continue  # norms and biases; MoE experts (always exact)
        if name.endswith("embed_tokens.weight") and "lm_head.weight" in tensors:
            continue  # embedding rows are looked up; a tied model multiplies them as its head
        fmt = quantize if quantize and t.dtype in ("f32", "f16", "bf16") else _format(t)
        if fmt in X8_KIND:
            by_format[fmt] = by_format.get(fmt, 0) + t.data.nbytes
    if not by_format:
        return "f32", "no weights the q8 mode runs"
    trails = sum(n for f, n in by_format.items() if f in trails_fmts)
    names = "/".join(sorted(f for f in by_format if f in trails_fmts))
    if 2 * trails <= sum(by_format.values()):
        fmt = max(by_format, key=lambda f: (by_format[f], f))
        return "f32", f"mostly {fmt} weights: exact decode keeps pace with llama.cpp"
    if trails < from_bytes:
        return "f32", f"{names} weights, few enough that exact decode keeps pace with llama.cpp"
    return "q8", f"exact decode of this many {names} weights trails llama.cpp's; --activations f32 keeps it exact"
