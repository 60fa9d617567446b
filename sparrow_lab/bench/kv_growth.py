"""How much a KV cache's growth costs decode (the figure quoted in state/budget.py):
a decode step at ~4K positions beside one resize copy of that cache, on the default model.

`python -m sparrow_lab.bench.kv_growth`
"""

import time

import numpy as np

import sparrow
from sparrow.engine.runner import Runner, Slot
from sparrow.state.budget import GROW_FRACTION, PAGE


def main() -> None:
    llm = sparrow.load(threads=2)
    runner = Runner(llm.model)
    n = 4096
    cache = llm.model.new_cache(n + 64)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 40000, n)
    slot = Slot(np.asarray(ids, np.int64), cache)
    runner.prefill(slot)
    steps = []
    for _ in range(8):
        t0 = time.perf_counter()
        runner.decode([slot], [100])
        steps.append(time.perf_counter() - t0)
    copies = []
    for _ in range(4):
        t0 = time.perf_counter()
        cache.resize(cache.capacity + PAGE)
        copies.append(time.perf_counter() - t0)
    step, copy = float(np.median(steps)), float(np.median(copies))
    print(f"at {cache.length} positions: decode step {step * 1e3:.1f} ms, resize copy {copy * 1e3:.1f} ms")
    print(f"one page per growth: {copy / (PAGE * step):.2%} of decode time")
    print(f"1/{GROW_FRACTION} per growth: {copy / (cache.length / GROW_FRACTION * step):.2%} of decode time")


if __name__ == "__main__":
    main()
