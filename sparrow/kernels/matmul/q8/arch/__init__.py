"""The q8 mode's integer-dot IR in the instructions of one architecture (x86: AVX2, VNNI;
arm64: dotprod, i8mm), beside the generic forms in q8.ir, which picks one per piece
(q8.ir.emitter): every form gives the same integers."""
