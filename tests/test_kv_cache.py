"""The KV cache: one storage class per kind behind one interface, and the sparse state beside
it (importance, probe-key copies) following the cache's writes and truncation."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from sparrow.errors import SparrowError
from sparrow.models.attention import decode_attention
from sparrow.params import KV_DTYPES, SparseParams
from sparrow.state.budget import probe_of
from sparrow.state.cache import KVCache
from sparrow.state.sparse import SNAPSHOT_COPIES, SNAPSHOT_RECENT, thin_snapshots
from sparrow.state.storage import F16Layer, F32Layer, Int8Layer, LayerCache, layer_cache, quantize_int8

KVH, D = 2, 32


def rows(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, KVH, D)).astype(np.float32)  # [n, KVH, D]


@pytest.mark.parametrize("kind,cls", [("f32", F32Layer), ("f16", F16Layer), ("int8", Int8Layer)])
def test_one_class_per_storage_kind(kind, cls):
    cache = KVCache(2, KVH, D, 64, kind)
    assert set(KV_DTYPES) == {"f32", "f16", "int8"}
    assert all(type(layer) is cls and isinstance(layer, LayerCache) for layer in cache.layers)
    assert type(layer_cache(kind, KVH, D, 8)) is cls
    layer = cache.layers[0]
    k, v = rows(10), rows(10, 1)
    cache.append(0, 3, k, v)
    assert layer.k.shape == layer.v.shape == (KVH, 64, D)
    for kh in range(KVH):
        got_k, got_v = layer.keys_f32(kh, 13)[3:], layer.values_f32(kh, 13)[3:]  # [10, D]
        assert got_k.dtype == got_v.dtype == np.float32
        if kind == "f32":
            assert np.array_equal(got_k, k[:, kh]) and np.array_equal(got_v, v[:, kh])
        elif kind == "f16":
            assert np.array_equal(got_k, k[:, kh].astype(np.float16).astype(np.float32))
            assert np.array_equal(layer.k[kh, 3:13].view(np.float16), k[:, kh].astype(np.float16))
        else:
            codes, scale = quantize_int8(k[:, kh])
            assert np.array_equal(layer.k[kh, 3:13], codes) and np.array_equal(layer.k_scale[kh, 3:13], scale)
            assert np.array_equal(got_k, codes.astype(np.float32) * scale[:, None])
    assert not layer.k[:, :3].any() and not layer.k[:, 13:].any()  # nothing else written


def test_f16_store_rounds_as_numpy():
    """The f16 kind's compiled store gives numpy's astype(float16) bits: ties to even, the
    subnormal range, overflow to inf, signed zeros and infinities, from a strided view."""
    rng = np.random.default_rng(3)
    vals = np.concatenate(
        [
            rng.standard_normal(4000).astype(np.float32) * np.float32(1e3),
            rng.standard_normal(4000).astype(np.float32) * np.float32(1e-6),  # f16 subnormals
            np.float32([65504, 65519.99, 65520, 1e6, -1e6, 0.0, -0.0, np.inf, -np.inf, 5.96e-8, 2.98e-8, 2.99e-8]),
            np.arange(1024, 2048, dtype=np.float32) + np.float32(0.5),  # halfway between two float16s: ties
        ]
    )
    n = vals.size // (KVH * D) * (KVH * D)
    x = vals[:n].reshape(-1, KVH, D)  # [T, KVH, D]
    cache = KVCache(1, KVH, D, len(x) + 4, "f16")
    cache.append(0, 2, x, x)
    with np.errstate(over="ignore"):  # numpy warns where it rounds to inf
        want = x.transpose(1, 0, 2).astype(np.float16).view(np.uint16)
    assert np.array_equal(cache.layers[0].k[:, 2 : 2 + len(x)], want)
    assert np.array_equal(cache.layers[0].v[:, 2 : 2 + len(x)], want)


def test_kernel_arguments_per_kind():
    q = rows(1)[0].repeat(2, 0)  # [H=4, D]
    for kind in KV_DTYPES:
        layer = layer_cache(kind, KVH, D, 16)
        qd, qa, qs = layer.query(q, 0.25)
        assert qs.shape == (4,) and qd.dtype == qa.dtype == np.float32
        if layer.scaled:  # int8: codes for both uses, the per-head scales separately
            codes, scale = quantize_int8(q)
            assert np.array_equal(qd, codes.astype(np.float32)) and qa is qd and np.array_equal(qs, scale)
            assert layer.k_scale.shape == layer.v_scale.shape == (KVH, 16)
        else:  # float kinds: q for probes, q * scale for scores, and one unread scale placeholder
            assert qd is q and np.array_equal(qa, q * np.float32(0.25)) and not qs.any()
            assert layer.k_scale.shape == (KVH, 1) and layer.k_scale is layer.v_scale
            assert layer.nbytes == layer.k.nbytes + layer.v.nbytes


def test_bad_kind_and_overflow():
    with pytest.raises(SparrowError, match="unknown KV cache dtype"):
        KVCache(1, 1, 4, 8, "bf16")
    with pytest.raises(SparrowError, match="capacity"):
        KVCache(1, 1, 4, 0)
    cache = KVCache(1, KVH, D, 8)
    cache.sparse[0].importance[:] = 1.0
    with pytest.raises(SparrowError, match="overflow"):
        cache.append(0, 4, rows(5), rows(5))
    assert cache.sparse[0].importance.all()  # a refused write changes nothing
    with pytest.raises(ValueError):
        cache.append(0, 0, rows(2)[:, :1], rows(2)[:, :1])


def _sparse_cache(kind="f32"):
    cache = KVCache(2, KVH, D, 256, kind)
    k, v = rows(200), rows(200, 1)
    for i in range(2):
        cache.append(i, 0, k, v)
    cache.length = 200
    return cache, k, v


def test_sparse_state_truncates_with_the_cache():
    cache, k, v = _sparse_cache()
    q = rows(2, 5).reshape(4, D)  # [H, D]
    sp = SparseParams(k=2, block=16, probe=4)
    for i in range(2):
        cache.sparse[i].importance[:200] = 1.0
        decode_attention(q, cache.layers[i], cache.sparse[i], 200, 0.25, sp)
    assert cache.probe_nbytes > 0
    copy, n = cache.sparse[0].probe_keys(cache.layers[0], 16, 4, 200)
    assert copy.blocks == n == 12
    cache.truncate(100)
    for st in cache.sparse:
        assert st.importance[:100].all() and not st.importance[100:].any()
        assert all(p.blocks == 100 // 16 for p in st._probes.values())  # blocks past 100 forgotten
    # rewriting a position forgets the blocks from its block on, and its importance
    cache.append(0, 40, k[40:41], v[40:41])
    assert copy.blocks == 2 and cache.sparse[0].importance[39] == 1 and cache.sparse[0].importance[40] == 0
    assert cache.sparse[1].importance[40] == 1  # other layers untouched


@pytest.mark.parametrize("kind", ["f32", "f16", "int8"])
def test_budget_charges_a_sparse_drafters_copies(kind):
    """Sparse drafting for an exact target makes the drafter's selector copy in the target's
    cache: probe_of charges it (and a sparse target's own copy too, once where they coincide)."""
    from sparrow.params import SpeculativeParams

    cache, k, v = _sparse_cache(kind)
    seed = SparseParams(k=2, block=16, probe=4)
    v2 = SparseParams(k=2, block=16, select="v2")
    spec = SpeculativeParams("sparse", 4, sparse=seed)
    q = rows(2, 5).reshape(4, D)  # [H, D]
    for i in range(2):  # what the drafter's steps make
        decode_attention(q, cache.layers[i], cache.sparse[i], 200, 0.25, seed)
    snapshots = SNAPSHOT_COPIES * 4 * cache.capacity * len(cache.layers)
    assert probe_of(None, spec) == [seed.copy_key] and probe_of(None) == []
    assert cache.nbytes + cache.probe_nbytes + snapshots == cache.bytes_at(cache.capacity, probe_of(None, spec))
    assert cache.bytes_at(cache.capacity, probe_of(seed, spec)) == cache.bytes_at(cache.capacity, seed.copy_key)
    for i in range(2):  # a v2 target drafted for by the seed: both copies
        decode_attention(q, cache.layers[i], cache.sparse[i], 200, 0.25, v2)
    assert cache.nbytes + cache.probe_nbytes + snapshots == cache.bytes_at(cache.capacity, probe_of(v2, spec))
    assert probe_of(v2, SpeculativeParams("ngram", 4)) == [v2.copy_key]


@pytest.mark.parametrize("kind", ["f32", "f16", "int8"])
@pytest.mark.parametrize("select", ["seed", "v2"])
def test_budget_charge_is_what_sparse_decode_allocates(kind, select):
    # the KV budget charges bytes_at(capacity, probe_of(sparse)): the seed's probe keys or v2's
    # block summaries, as decode really makes them; v2's summaries truncate with the cache
    cache, k, v = _sparse_cache(kind)
    sp = SparseParams(k=2, block=16, probe=4, select=select)
    q = rows(2, 5).reshape(4, D)  # [H, D]
    for i in range(2):
        decode_attention(q, cache.layers[i], cache.sparse[i], 200, 0.25, sp)
    assert cache.probe_nbytes > 0
    snapshots = SNAPSHOT_COPIES * 4 * cache.capacity * len(cache.layers)  # the prefix cache's importance copies
    assert cache.nbytes + cache.probe_nbytes + snapshots == cache.bytes_at(cache.capacity, probe_of(sp))
    cache.truncate(100)
    assert all(p.blocks == 100 // 16 for st in cache.sparse for p in st._probes.values())


def test_snapshots_kept_are_the_newest_and_powers_of_two():
    """thin_snapshots keeps the SNAPSHOT_RECENT newest boundaries and those at 2^i chunks, so the
    copies stay under SNAPSHOT_COPIES importance arrays of the prompt's length."""
    c, snaps, total = 16, {}, []
    for n in range(1, 41):
        snaps[n * c] = np.zeros((2, n * c), np.float32)
        thin_snapshots(snaps, c)
        want = {b * c for b in range(1, n + 1) if b > n - SNAPSHOT_RECENT or b & (b - 1) == 0}
        assert set(snaps) == want
        total.append(sum(a.size for a in snaps.values()) / (2 * n * c))
    assert max(total) < SNAPSHOT_COPIES
    assert set(snaps) == {16, 32, 64, 128, 256, 512} | {b * c for b in range(33, 41)}


def test_nbytes_counts_storage_and_importance():
    for kind, per in (("f32", 2 * 4 * D), ("f16", 2 * 2 * D), ("int8", 2 * (D + 4))):
        cache = KVCache(3, KVH, D, 64, kind)
        assert cache.nbytes == 3 * (KVH * 64 * per + 64 * 4)
        assert cache.probe_nbytes == 0


def test_decode_at_a_shorter_seq_len_stays_in_bounds(tmp_path):
    # The reproducer: append 200 positions, sparse decode at 200 (block 16, k=2) copies the
    # probe keys of 12 blocks; a decode at 100 must read only the 6 full blocks below 100.
    # NUMBA_BOUNDSCHECK must be set before numba compiles, and a fresh cache directory makes
    # it compile the kernels again with the checks in.
    script = """
import numpy as np
from sparrow.state.cache import KVCache
from sparrow.models.attention import decode_attention
from sparrow.params import SparseParams

rng = np.random.default_rng(0)
k = rng.standard_normal((200, 2, 32)).astype(np.float32)
v = rng.standard_normal((200, 2, 32)).astype(np.float32)
q = rng.standard_normal((4, 32)).astype(np.float32)
sp = SparseParams(k=2, block=16, probe=4)
cache = KVCache(1, 2, 32, 256)
cache.append(0, 0, k, v)
decode_attention(q, cache.layers[0], cache.sparse[0], 200, 0.25, sp)
got = decode_attention(q, cache.layers[0], cache.sparse[0], 100, 0.25, sp)
fresh = KVCache(1, 2, 32, 256)
fresh.append(0, 0, k[:100], v[:100])
want = decode_attention(q, fresh.layers[0], fresh.sparse[0], 100, 0.25, sp)
assert np.array_equal(got, want), "differs from a fresh cache"
print("in bounds")
"""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and "in bounds" in r.stdout, r.stderr[-3000:]


def test_cache_copies_independently():
    # the fidelity evaluation decodes from deep copies of one prefilled cache
    import copy

    cache, _, _ = _sparse_cache("int8")
    q = rows(2, 5).reshape(4, D)
    sp = SparseParams(k=2, block=16, probe=4)
    a = decode_attention(q, cache.layers[0], cache.sparse[0], 200, 1 / math.sqrt(D), sp)
    twin = copy.deepcopy(cache)
    twin.truncate(50)
    assert cache.length == 200 and twin.length == 50
    assert np.array_equal(a, decode_attention(q, cache.layers[0], cache.sparse[0], 200, 1 / math.sqrt(D), sp))
