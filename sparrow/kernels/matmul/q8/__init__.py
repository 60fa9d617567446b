"""The activations="q8" mode: x quantised to 8 bits per 32 values, products summed as exact
integers over rows interleaved in groups of 8 (quantized: the entry points; groups and
kquant_groups: the ymm tiles; pair_tiles: zmm pairs on AVX512-VNNI; amx: AMX tiles; their integer dots
are kernels/intdot.py's IR, which every path shares, so all give the same bits)."""
