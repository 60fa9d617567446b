"""Integer-dot IR (kernels/intdot.py) in the instructions of one architecture (x86: AVX2, VNNI;
arm64: dotprod, i8mm), beside the generic forms in intdot, which picks one per piece
(intdot.emitter): every form gives the same integers."""
