"""`sparrow bench fidelity`: how closely block-sparse decode attention tracks exact attention.

Needs no retrieval skill: on the same prompts, the exact greedy continuation is fed to each
sparse configuration (teacher forcing) and compared step by step: mean KL(exact || sparse),
top-1 agreement, the first generated token that would differ, and the share of the exact
softmax mass inside the selected blocks (per layer: median and 5th percentile over heads and
steps). Decode attention and total ms/token for every configuration.

    sparrow bench fidelity --lengths 2K --ks 32,16,8,4,2,1
"""

from __future__ import annotations

import argparse

from .needle import add_common_args, run


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="sparrow bench fidelity", description=__doc__.split("\n\n")[0])
    add_common_args(p, lengths="2K", depths="50", ks="32,16,8,4,2,1", tokens=32)
    a = p.parse_args(argv)
    return run(a, "fidelity", True, "Sparse fidelity", argv)


if __name__ == "__main__":
    main()
