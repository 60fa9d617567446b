"""The stored weight formats the kernels run: one record each, with its ids and what it supports.

Two ids number a format's rows, one range each:
- `kind` (0-10): its rows as stored, read by the exact f32 path (widen_row, the row dots, the
  prefill GEMM, the MoE experts);
- `x8` (11-18): its rows interleaved in groups of 8 for the q8 mode (kernels/matmul/q8/groups.py and
  q8.kquant_groups.py), or None where the q8 mode has no kernel for it (the format stays exact).
Kernels branch on the named constants below (Q4_0, X8_Q4_K, ...), never on literal numbers;
numba freezes module-level ints into the compiled code, so a named branch costs nothing. Every
x8 id is above every kind id, so `kind >= X8_FIRST` tells interleaved rows from stored ones
(checked at import). Kernel modules dispatch on these ids through tables built from the records
(kernels/dispatch.by_kind: each module's table holds the kernels of the formats claiming them), so
a new format is one record here plus its kernels; tests/test_formats.py walks this table and
checks that each dispatch table holds exactly the formats that claim the capability.
"""

from typing import NamedTuple


class Format(NamedTuple):
    name: str  # ggml's name (GGUF tensor type, lower case)
    kind: int  # id of the stored rows
    block_values: int  # weights a block holds (1: not a block format)
    block_bytes: int
    row_dot: str  # the exact decode's row dot: "blocks" (widen), "kquants" (kquants), "widened" (widen, then dot)
    x8: int | None  # id of the q8 mode's interleaved rows; None: no q8 kernel
    q8_prefill: bool  # the q8 mode's prefill runs on the interleaved groups (else the f32 GEMM)
    zmm_pairs: bool  # q8.pair_tiles's zmm pair tiles for prefill (AVX512-VNNI CPUs)
    amx: bool  # q8.amx's tiles for the q8 mode's prefill (AMX CPUs)


FORMATS = (
    Format("q8_0", 0, 32, 34, "blocks", 11, True, True, True),
    Format("q4_0", 1, 32, 18, "blocks", 12, True, True, True),
    Format("q4_1", 2, 32, 20, "blocks", 13, True, True, True),
    Format("f16", 3, 1, 2, "widened", None, False, False, False),
    Format("bf16", 4, 1, 2, "widened", None, False, False, False),
    Format("f32", 5, 1, 4, "widened", None, False, False, False),  # rows as their uint32 bits
    Format("q5_0", 6, 32, 22, "kquants", 17, True, True, False),
    Format("q5_1", 7, 32, 24, "kquants", 18, True, True, False),
    Format("q4_k", 8, 256, 144, "kquants", 14, True, True, True),
    Format("q5_k", 9, 256, 176, "kquants", 15, False, False, False),
    Format("q6_k", 10, 256, 210, "kquants", 16, True, True, True),
)
BY_NAME = {f.name: f for f in FORMATS}

# ids of the stored rows
# (FP16 / FP32, not F16 / F32: those name LLVM's float types in the IR kernels)
Q8_0, Q4_0, Q4_1, FP16, BF16, FP32, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = (f.kind for f in FORMATS)
# ids of the q8 mode's interleaved rows
X8_Q8_0, X8_Q4_0, X8_Q4_1, X8_Q5_0, X8_Q5_1, X8_Q4_K, X8_Q5_K, X8_Q6_K = (
    BY_NAME[q].x8 for q in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
)

KIND = {f.name: f.kind for f in FORMATS}  # every format the kernels run
BLOCK_BYTES = {f.name: f.block_bytes for f in FORMATS if f.block_values > 1}  # the block formats: a block's bytes
BLOCK_VALUES = {f.name: f.block_values for f in FORMATS if f.block_values > 1}  # and the weights it holds
KQ_KIND = {f.name: f.kind for f in FORMATS if f.row_dot == "kquants"}  # q5_0, q5_1, K-quants
KQ_FIRST = min(KQ_KIND.values())  # kinds from here to X8_FIRST have their row dots in kquants
BLOCK_KINDS = tuple(f.kind for f in FORMATS if f.x8 is not None)  # formats the q8 mode runs
X8_KIND = {f.name: f.x8 for f in FORMATS if f.x8 is not None}
X8_FIRST = min(X8_KIND.values())  # kinds from here on are interleaved groups
PREFILL_FORMATS = tuple(f.name for f in FORMATS if f.q8_prefill)
AMX_FORMATS = tuple(f.name for f in FORMATS if f.amx)
ZMM_PAIR_KINDS = tuple(f.x8 for f in FORMATS if f.zmm_pairs)  # interleaved kinds with zmm pair tiles

assert len(set(KIND.values())) == len(FORMATS) and max(KIND.values()) < X8_FIRST
assert len(set(X8_KIND.values())) == len(X8_KIND)
assert all(f.kind >= KQ_FIRST for f in FORMATS if f.row_dot == "kquants")
assert all(f.kind < KQ_FIRST for f in FORMATS if f.row_dot != "kquants")
