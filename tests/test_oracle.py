"""The exact-block-mass oracle (sparrow_lab.eval.oracle), the reference the selectors are measured
against: its blocks are the heaviest k by brute force, its output is attention over exactly
those blocks, and in a fidelity run it replaces only sparse decode attention, for its own rows."""

import itertools

import numpy as np
import pytest

from sparrow.models import decoder
from sparrow.state.cache import KVCache
from sparrow_lab.eval import fidelity as fid
from sparrow_lab.eval import oracle

KVH, H, D, BLOCK = 2, 4, 16, 8


def _layer(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    cache = KVCache(1, KVH, D, 64, dtype)
    cache.append(0, 0, rng.standard_normal((n, KVH, D)).astype(np.float32) * 2, rng.standard_normal((n, KVH, D)))
    return cache.layers[0], rng.standard_normal((H, D)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("n, k", [(45, 2), (48, 3), (41, 6)])
def test_oracle_takes_the_heaviest_blocks(dtype, n, k):
    layer, q = _layer(n, dtype)
    scale = 0.25
    trace = []
    out = oracle.attend(q, layer, n, scale, k, BLOCK, trace)
    nb = -(-n // BLOCK)
    for h, blocks, stages, mass in trace:
        K = layer.keys_f32(h // (H // KVH), n).astype(np.float64)
        V = layer.values_f32(h // (H // KVH), n).astype(np.float64)
        p = np.exp(K @ q[h] * scale)
        block_mass = [p[b * BLOCK : (b + 1) * BLOCK].sum() for b in range(nb)]
        best = max(itertools.combinations(range(nb), min(k, nb)), key=lambda c: sum(block_mass[b] for b in c))
        assert blocks == list(best) and stages == ["oracle"] * len(best)
        assert mass == pytest.approx(sum(block_mass[b] for b in best) / p.sum(), rel=1e-9)
        rows = np.concatenate([np.arange(b * BLOCK, min(n, (b + 1) * BLOCK)) for b in best])
        w = p[rows] / p[rows].sum()
        np.testing.assert_allclose(out[h], w @ V[rows], rtol=1e-5, atol=1e-6)
    assert [t[0] for t in trace] == list(range(H))


def test_oracle_rows_in_a_fidelity_run():
    """On the default model: the oracle row is labelled as such, keeps more exact softmax mass
    than k=2 of v2 on the same prompt (it chooses by that mass), and the model's own attention
    and fused step are back afterwards."""
    import sparrow
    from sparrow.params import SparseParams
    from sparrow_lab.eval import prompts

    llm = sparrow.load()
    p = prompts.make_prompt(llm.tokenizer, "needle", 400, 0.5, seed=2)
    configs = [None, SparseParams(k=2, select="v2"), oracle.oracle_params(k=2), oracle.oracle_params(k=64)]
    rows = fid.run_prompt(llm, p.ids, configs, n_tokens=4, fidelity=True)
    by = {r["config"]: r for r in rows}
    assert set(by) == {"exact", "v2 k=2", "oracle k=2", "oracle k=64"}
    assert by["oracle k=2"]["mass"]["median"] > by["v2 k=2"]["mass"]["median"]
    # k=64 blocks cover the 400-token prompt: the oracle falls back to the model's exact attention
    assert by["oracle k=64"]["tokens"] == by["exact"]["tokens"] and by["oracle k=64"]["kl_mean"] == 0.0
    from sparrow.models.attention import decode_attention

    assert decoder.decode_attention is decode_attention and llm.model.use_fused


def test_oracle_label_takes_its_dense_layers():
    """`oracle-dense<N>` (a hybrid model's few attending layers all selecting) is the oracle with
    N exact first KV layers; its rows are the oracle's when a run prints KL over the oracle's."""
    from sparrow.errors import SparrowError
    from sparrow_lab.eval.report import oracle_gap

    o = oracle.oracle_from_label("oracle-dense0", k=8)
    assert (o.label, o.dense_layers, o.k) == ("oracle-dense0", 0, 8)
    assert oracle.oracle_from_label("oracle", k=8) == oracle.oracle_params(k=8)
    for bad in ("oracle-nosink", "oracle-dense", "oracle-dense0-dense1"):
        with pytest.raises(SparrowError, match="unknown oracle"):
            oracle.oracle_from_label(bad)
    rows = [{"selector": "oracle-dense0", "blocks": b, "kl": kl} for b, kl in ((8.0, 0.04), (16.0, 0.01))]
    assert oracle_gap({"selector": "v3-dense0", "blocks": 16.0, "kl": 0.02}, rows) == pytest.approx(2.0)
    assert oracle_gap(rows[0], rows) is None
    both = rows + [{"selector": "oracle", "blocks": 16.0, "kl": 0.005}]  # each row meets its own oracle
    assert oracle_gap({"selector": "v3-dense0", "blocks": 16.0, "kl": 0.02}, both) == pytest.approx(2.0)
    assert oracle_gap({"selector": "v3", "blocks": 16.0, "kl": 0.02}, both) == pytest.approx(4.0)
