"""y = x @ W.T on stored weights: widening rows to f32 and the exact row dots (widen, kquants),
the prefill GEMM (gemm), and the q8 mode's integer products (q8/). kernels/linear.py picks
among them; kernels/formats.py says which formats each one runs."""
