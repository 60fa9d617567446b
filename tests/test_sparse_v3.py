"""The v3 selector and its top-p budget against a reference written from docs/SPARSE_SELECT_V3.md.

The reference restates v3's rule in float64 Python: the int8 codes of the query and of every
key, each key's estimated score, each block's log-sum-exp, then top k or top p. From sparrow it
takes only what is stored (the cache's K/V rows and int8 scales) and, for the attention over a
selection, the seed reference's `spec_attend` (v3 keeps that rule). The kernel sums the exps in
float32 with the row kernel's exp; the reference in float64 chooses the same blocks except
where two estimates (or the mass covered and its target) lie within rounding of each other,
which random caches do not produce.
"""

import math

import numpy as np
import pytest
from test_sparse_reference import filled, spec_attend, spec_mass, stored_rows
from test_sparse_v2 import decoded_growing, one_head_cache

from sparrow.errors import SparrowError
from sparrow.models.attention import decode_attention, prefill_attention
from sparrow.params import KV_DTYPES, SparseParams

H, KVH, D = 4, 2, 32
G = H // KVH
SCALE = 1 / math.sqrt(D)


# ---------------------------------------------------------------- the reference, from the doc
def ref_codes(x, top=127):
    """Rows float32 [n, D] -> (codes float64 [n, D], scales float64 [n]): the int8 cache's rule,
    scale = absmax / 127 in float32, codes = rint(x / scale) within +-127 (zero rows: 0, 0);
    top=7: the 4-bit rule, the same with 7."""
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(axis=1) / np.float32(top)  # float32
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(x / safe[:, None]), -top, top)
    return codes.astype(np.float64), scale.astype(np.float64)


def ref_key_codes(layer, kh, seq_len, bits=8):
    """An int8 cache's stored codes and scales; float keys (f16 widened) quantised as above.
    4 bits: every kind's keys as float32 (an int8 key: code times scale in float32), by the
    4-bit rule."""
    if bits == 4:
        if layer.kind == "int8":
            keys = layer.k[kh, :seq_len].astype(np.float32) * layer.k_scale[kh, :seq_len, None]
        else:
            keys = stored_rows(layer, layer.k, layer.k_scale, kh, seq_len)[0].astype(np.float32)
        return ref_codes(keys, top=7)
    if layer.kind == "int8":
        return layer.k[kh, :seq_len].astype(np.float64), layer.k_scale[kh, :seq_len].astype(np.float64)
    return ref_codes(stored_rows(layer, layer.k, layer.k_scale, kh, seq_len)[0])


def ref_block_mass(qh, layer, kh, seq_len, block, bits=8):
    """Per block: the log of sum over its keys of exp(estimated score), estimated score =
    (query codes . key codes) * query scale * key scale * softmax scale; key codes of `bits`."""
    qc, qs = ref_codes(qh[None])
    kc, ks = ref_key_codes(layer, kh, seq_len, bits)
    est = (kc @ qc[0]) * qs[0] * ks * SCALE  # [S]
    out = []
    for p0 in range(0, seq_len, block):
        e = est[p0 : p0 + block]
        out.append(e.max() + math.log(np.exp(e - e.max()).sum()))
    return out


def ref_select(mass, k, p=None, min_blocks=1):
    """Blocks by falling mass (ties to the smaller index): the first k, or (p) until their share
    of the total exp(mass) reaches p, at least min_blocks and at most k. k >= blocks: all."""
    n = len(mass)
    if k >= n:
        return list(range(n))
    order = sorted(range(n), key=lambda b: (-mass[b], b))
    if p is None:
        return sorted(order[:k])
    share = [math.exp(m - mass[order[0]]) for m in mass]
    target, covered, taken = p * sum(share), 0.0, []
    for b in order[: min(k, n)]:
        if len(taken) >= min_blocks and covered >= target:
            break
        taken.append(b)
        covered += share[b]
    return sorted(taken)


def check_v3(cache, qv, seq_len, sp):
    """One v3 decode step against the reference: blocks per head, output and mass."""
    layer, st = cache.layers[0], cache.sparse[0]
    trace = []
    out = decode_attention(qv, layer, st, seq_len, SCALE, sp, trace)
    assert [rec[0] for rec in trace] == list(range(H))
    p = None if sp.p is None else round(sp.p * 65536) / 65536  # the doc: p to 2**-16
    for h, blocks, stages, mass in trace:
        mass_h = ref_block_mass(qv[h], layer, h // G, seq_len, sp.block, sp.key_bits)
        want = ref_select(mass_h, sp.k, p, sp.min_blocks)
        assert blocks == want, (seq_len, h)
        assert stages == ["score"] * len(blocks)
        ref, _, _ = spec_attend(qv[h], layer, h // G, seq_len, blocks, sp.block, SCALE)
        np.testing.assert_allclose(out[h], ref, rtol=1e-5, atol=1e-6)
        assert mass == pytest.approx(spec_mass(qv[h], layer, h // G, seq_len, blocks, sp.block, SCALE), rel=1e-5)
    return out, trace


# ---------------------------------------------------------------- hand-built cases
def test_reference_reads_the_doc():
    assert ref_select([1.0, 3.0, 3.0, 2.0], 2) == [1, 2]  # ties to the smaller index
    assert ref_select([1.0, 3.0, 3.0, 2.0], 1) == [1]
    assert ref_select([1.0, 2.0], 2) == [0, 1]  # k >= blocks: all
    heavy = [0.0, 10.0, 0.0, 0.0]  # block 1 holds ~all the mass
    assert ref_select(heavy, 3, p=0.9) == [1]
    assert ref_select(heavy, 3, p=0.9, min_blocks=2) == [0, 1]
    flat = [0.0] * 4
    assert ref_select(flat, 3, p=0.5) == [0, 1]  # 2 of 4 equal blocks reach a half
    assert ref_select(flat, 3, p=1.0) == [0, 1, 2]  # at most k


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_mass_finds_the_needle_and_p_takes_what_it_needs(dtype):
    # block 1 holds one key far along q among keys against it; block 2 is uniform, mildly along
    # q (the higher mean): the needle's block has the most mass and k=1 takes it alone. With
    # p, one block covers 0.5 of the estimated mass; 0.999 needs the uniform block too.
    keys = np.zeros((16, D), np.float32)
    keys[4:8, 0] = [-3.0, -3.0, 6.0, -2.0]
    keys[8:12, 0] = 2.0
    cache = one_head_cache(keys, dtype)
    q = np.zeros((H, D), np.float32)
    q[:, 0] = 4.0
    layer, st = cache.layers[0], cache.sparse[0]
    for sp, want in [
        (SparseParams(k=1, block=4, select="v3"), [1]),
        (SparseParams(k=3, block=4, select="v3", p=0.5), [1]),
        (SparseParams(k=3, block=4, select="v3", p=0.5, min_blocks=2), [1, 2]),
        (SparseParams(k=3, block=4, select="v3", p=0.999999), [0, 1, 2]),  # blocks 0 and 3 tie: 0
        (SparseParams(k=2, block=4, select="v3", p=0.999999), [1, 2]),  # capped at k
    ]:
        trace = []
        decode_attention(q, layer, st, 16, SCALE, sp, trace)
        assert trace[0][1] == want, sp
        assert trace[0][1] == ref_select(ref_block_mass(q[0], layer, 0, 16, 4), sp.k, sp.p, sp.min_blocks)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_identical_blocks_tie_to_the_lower_index(dtype):
    # blocks 1, 2 and 3 hold the same small-integer keys, blocks 0 and 4 zeros: the three
    # estimates are equal bits, and the lower indices win
    same = np.random.default_rng(5).integers(-2, 3, (4, D)).astype(np.float32)
    zeros = np.zeros((4, D), np.float32)
    cache = one_head_cache(np.concatenate([zeros, same, same, same, zeros]), dtype)
    q = np.tile(np.sign(same[0]), (H, 1)).astype(np.float32)  # along the blocks' first key
    for k, want in [(1, [1]), (2, [1, 2])]:
        trace = []
        decode_attention(q, cache.layers[0], cache.sparse[0], 20, SCALE, SparseParams(k=k, block=4, select="v3"), trace)
        assert trace[0][1] == want


# ---------------------------------------------------------------- against the reference
@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("k,p,min_blocks", [(1, None, 1), (3, None, 1), (8, None, 1), (6, 0.5, 1), (9, 0.9, 2)])
@pytest.mark.parametrize("block", [16, 26])
@pytest.mark.parametrize("bits", [8, 4])
def test_decode_matches_reference(dtype, k, p, min_blocks, block, bits):
    # 4 bits at block 26: whole tiles of 16 keys end inside blocks, the keys past them are coded on the fly
    S = 200  # block 16: 12 full blocks and a short one; 26: 7 full and one of 18
    cache, q, _, _ = filled(dtype, S, seed=41 + k)
    q[-1] *= 3  # peaked attention, so that p takes fewer than k blocks on some heads
    sp = SparseParams(k=k, block=block, select="v3", p=p, min_blocks=min_blocks, key_bits=bits)
    check_v3(cache, q[-1], S, sp)


def test_p_chooses_a_budget_per_head():
    cache, q, _, _ = filled("f32", 200, seed=8)
    qv = q[-1] * np.array([0.2, 1.0, 3.0, 6.0], np.float32)[:, None]  # flat to peaked heads
    _, trace = check_v3(cache, qv, 200, SparseParams(k=12, block=16, select="v3", p=0.8))  # of 13 blocks
    counts = [len(rec[1]) for rec in trace]
    assert len(set(counts)) > 1 and max(counts) <= 12, counts


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("bits", [8, 4])
def test_growing_cache_step_by_step_equals_a_fresh_cache(dtype, bits):
    # the key-code copy grows block by block; rows not in it yet are quantised on the fly:
    # either way the same bits as a fresh cache decoded once
    sp = SparseParams(k=3, block=24 if bits == 4 else 16, select="v3", p=0.7, key_bits=bits)
    grow, q = decoded_growing(dtype, 100, sp)
    check_v3(grow, q[-1], 100, sp)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_k_covering_every_block_is_exact_bit_for_bit(dtype):
    cache, q, _, _ = filled(dtype, 170, seed=12)
    exact = decode_attention(q[-1], cache.layers[0], cache.sparse[0], 170, SCALE, None)
    for sp in (
        SparseParams(k=11, block=16, select="v3"),
        SparseParams(k=64, block=16, select="v3", p=0.5),
        SparseParams(k=11, block=16, select="v3", key_bits=4),
    ):
        assert np.array_equal(decode_attention(q[-1], cache.layers[0], cache.sparse[0], 170, SCALE, sp), exact)


def test_int8_codes_are_the_cache_itself():
    cache, q, _, _ = filled("int8", 96, seed=4)
    st, layer = cache.sparse[0], cache.layers[0]
    codes, n = st.copy_for(layer, SparseParams(k=2, block=16, select="v3"), 96)
    assert n == 6 and codes.rows is layer.k and codes.nbytes == 0
    cache32, _, _, _ = filled("f32", 96, seed=4)
    codes32, _ = cache32.sparse[0].copy_for(cache32.layers[0], SparseParams(k=2, block=16, select="v3"), 96)
    want, want_scale = ref_key_codes(cache32.layers[0], 1, 96)
    assert np.array_equal(codes32.rows[1, :96], want) and np.array_equal(codes32.scale[1, :96], want_scale)
    assert codes32.nbytes == cache32.bytes_at(cache32.capacity, (16, "v3")) - cache32.bytes_at(cache32.capacity)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_4bit_codes_copy_and_tile_scores(dtype):
    """KeyCodes4 holds the 4-bit rule's codes in the tile layout (attention.codes4's docstring,
    unpacked here by that text), charged by the KV budget as it measures; the tiles' scores are
    v3's estimate, (query codes . key codes) * ((query scale * softmax scale) * key scale) in
    float32, bit for bit (tests/test_cpu_paths.py compares them on the other CPU paths)."""
    from test_cpu_paths import _tile_scores4

    cache, q, _, _ = filled(dtype, 100, seed=6)
    layer, st = cache.layers[0], cache.sparse[0]
    codes, n = st.copy_for(layer, SparseParams(k=2, block=24, select="v3", key_bits=4), 100)
    assert n == 4 and codes.blocks == 4  # 96 keys: 6 whole tiles
    assert codes.nbytes == cache.bytes_at(cache.capacity, (24, "v3q4")) - cache.bytes_at(cache.capacity)
    qc, qs = ref_codes(q[-1, :1])
    for kh in range(KVH):
        want, want_scale = ref_key_codes(layer, kh, 96, bits=4)
        t = codes.rows[kh, :6].view(np.uint8).reshape(6, D // 8, 16, 4)  # [tile, chunk, key, byte]
        lo, hi = (t & 15).astype(np.int64) - 8, (t >> 4).astype(np.int64) - 8
        got = np.concatenate([lo, hi], axis=3).transpose(0, 2, 1, 3).reshape(96, D)  # dims 8c..8c+7 of chunk c
        assert np.array_equal(got, want) and np.array_equal(codes.scale[kh, :96], want_scale.astype(np.float32))
        f = np.float32(np.float32(qs[0]) * np.float32(SCALE))
        out = np.empty(96, np.float32)
        qc8 = qc[0].astype(np.int8)
        _tile_scores4(codes.rows[kh], 6, qc8, np.int32(8 * int(qc8.sum(dtype=np.int64))), f, codes.scale[kh], out)
        dots = (want @ qc[0]).astype(np.float32)  # exact integers
        assert np.array_equal(out, dots * (f * codes.scale[kh, :96]))


@pytest.mark.parametrize("block", [20, 32])
def test_4bit_codes_after_a_rollback_are_a_shorter_cache_s(block):
    """KVCache.rollback (a speculative step's refused drafts) leaves the 4-bit copy as decoding
    the shorter cache alone makes it: the lanes of the dropped keys zeroed, in a tile shared
    with kept keys too (block 20: 40 keys kept, tile 2 half full); the next step the same bits."""
    from sparrow.state.cache import KVCache

    _, q, K, V = filled("f16", 100, seed=13)
    sp = SparseParams(k=2, block=block, select="v3", key_bits=4)
    long, short = KVCache(1, KVH, D, 100, "f16"), KVCache(1, KVH, D, 100, "f16")
    long.append(0, 0, K[:100], V[:100])
    long.length = 100  # the model's step sets it
    decode_attention(q[-1], long.layers[0], long.sparse[0], 100, SCALE, sp)  # the copy: 100 // block blocks
    long.rollback(50)
    short.append(0, 0, K[:50], V[:50])
    decode_attention(q[49], short.layers[0], short.sparse[0], 50, SCALE, sp)
    a, b = (c.sparse[0].copy_for(c.layers[0], sp, 50)[0] for c in (long, short))
    assert a.blocks == b.blocks == 50 // block
    assert np.array_equal(a.rows, b.rows) and np.array_equal(a.scale, b.scale)
    for c in (long, short):
        c.append(0, 50, K[50:51], V[50:51])
    outs = [decode_attention(q[50], c.layers[0], c.sparse[0], 51, SCALE, sp) for c in (long, short)]
    assert outs[0].tobytes() == outs[1].tobytes()


def test_the_selection_alone_is_the_one_attention_takes():
    """decode_attention(attend=False), what `sparrow bench attention` times as a selector's cost,
    writes the blocks and stages a full call takes, and returns nothing."""
    cache, q, _, _ = filled("f16", 200, seed=5)
    layer, st = cache.layers[0], cache.sparse[0]
    sps = (SparseParams(k=3, block=16, select="v3", key_bits=4, p=0.8), SparseParams(k=3, block=16, select="v2"))
    for sp in (*sps, SparseParams(k=3, block=16)):
        got, want = ((np.full((H, 13), -1), np.full((H, 13), -1, np.int8), np.zeros(H, np.int64)) for _ in "ab")
        assert decode_attention(q[-1], layer, st, 200, SCALE, sp, into=got, attend=False) is None
        decode_attention(q[-1], layer, st, 200, SCALE, sp, into=want)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)) and got[2].min() >= 1, sp


def test_4bit_codes_pad_a_head_dim_off_eight():
    """head_dim 20 (not a multiple of 8): its tiles keep 24 dims, the last 4 zero codes against
    zero query codes; the blocks are the reference's."""
    from sparrow.state.cache import KVCache

    rng = np.random.default_rng(3)
    cache = KVCache(1, 1, 20, 64, "f16")
    cache.append(
        0, 0, rng.standard_normal((64, 1, 20), dtype=np.float32), rng.standard_normal((64, 1, 20), dtype=np.float32)
    )
    qv = rng.standard_normal((2, 20), dtype=np.float32) * 3
    sp = SparseParams(k=2, block=8, select="v3", key_bits=4)
    trace = []
    decode_attention(qv, cache.layers[0], cache.sparse[0], 64, 1 / math.sqrt(20), sp, trace)
    assert cache.sparse[0].copy_for(cache.layers[0], sp, 64)[0].rows.shape == (1, 4, 8 * 24)
    for h, blocks, _, _ in trace:
        qc, qs = ref_codes(qv[h][None])
        kc, ks = ref_key_codes(cache.layers[0], 0, 64, bits=4)
        est = (kc @ qc[0]) * qs[0] * ks / math.sqrt(20)
        mass = [
            est[p : p + 8].max() + math.log(np.exp(est[p : p + 8] - est[p : p + 8].max()).sum())
            for p in range(0, 64, 8)
        ]
        assert blocks == ref_select(mass, 2)


@pytest.mark.parametrize("dtype,bits", [("f32", 8), ("int8", 8), ("f16", 4)])
def test_sparse_prefill_matches_reference(dtype, bits):
    cache, q, _, _ = filled(dtype, 90, seed=23)
    layer = cache.layers[0]
    sp = SparseParams(k=3, block=16, prefill=True, select="v3", p=0.6, key_bits=bits)
    out = prefill_attention(q[60:], layer, cache.sparse[0], 60, SCALE, sp)  # [30, H, D]
    for t in range(30):
        n = 61 + t
        for h in range(H):
            mass = ref_block_mass(q[60 + t, h], layer, h // G, n, 16, bits)
            blocks = ref_select(mass, 3, round(0.6 * 65536) / 65536)
            ref, _, _ = spec_attend(q[60 + t, h], layer, h // G, n, blocks, 16, SCALE)
            np.testing.assert_allclose(out[t, h], ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- settings
def test_settings_are_validated_naming_the_field():
    with pytest.raises(SparrowError, match="sparse_p is a v3 setting"):
        SparseParams(select="v2", p=0.9)
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(SparrowError, match="sparse_p must be"):
            SparseParams(select="v3", p=bad)
    with pytest.raises(SparrowError, match="sparse_min_blocks must be"):
        SparseParams(select="v3", p=0.9, min_blocks=0)
    with pytest.raises(SparrowError, match="sparse_min_blocks needs sparse_p"):
        SparseParams(select="v3", min_blocks=2)
    with pytest.raises(SparrowError, match=r"sparse_min_blocks \(9\) must not exceed sparse_k \(8\)"):
        SparseParams(select="v3", k=8, p=0.9, min_blocks=9)
    with pytest.raises(SparrowError, match="v3 forces no block"):
        SparseParams(select="v3", sink=False)
    assert SparseParams(select="v3").dense_layers == 2
    for label in ("v3", "v3-p0.95", "v3-p0.9-min4", "v3-dense0", "v3-q4", "v3-q4-p0.95"):
        assert SparseParams.from_label(label, k=8).label == label
    for bad in (2, 16, 8.0, True, "4"):
        with pytest.raises(SparrowError, match="sparse_key_bits must be 8 or 4"):
            SparseParams(select="v3", key_bits=bad)
    with pytest.raises(SparrowError, match="sparse_key_bits is a v3 setting"):
        SparseParams(select="v2", key_bits=4)
    assert SparseParams.from_options(sparse_attn="auto", sparse_key_bits=4).copy_key == (32, "v3q4")
    with pytest.raises(SparrowError, match="unknown selector modifier"):
        SparseParams.from_label("v2-p0.9")
    sp = SparseParams.from_options(sparse_attn=True, sparse_select="v3", sparse_p=0.95, sparse_min_blocks=2)
    assert (sp.select, sp.p, sp.min_blocks, sp.copy_key) == ("v3", 0.95, 2, (32, "v3"))


def test_flags_word_round_trips():
    from sparrow.kernels.attention.select import v3_budget
    from sparrow.params import V3_ON

    sp = SparseParams(select="v3", k=40, p=0.95, min_blocks=3)
    assert sp.flags & V3_ON and not sp.flags & 7  # no v2 bit
    assert v3_budget(sp.flags) == (3, round(0.95 * 65536))
    assert v3_budget(SparseParams(select="v3", p=1.0).flags) == (1, 65536)
    assert v3_budget(SparseParams(select="v3", p=1e-9).flags) == (1, 1)  # p never rounds to "fixed k"
    assert v3_budget(SparseParams(select="v3").flags) == (1, 0)
    from sparrow.params import V3_KEY4

    four = SparseParams(select="v3", k=40, p=0.95, min_blocks=3, key_bits=4).flags
    assert four == sp.flags | V3_KEY4 and not sp.flags & V3_KEY4 and v3_budget(four) == (3, round(0.95 * 65536))


# ---------------------------------------------------------------- the model's decode paths
V3_MODEL = (
    SparseParams(k=3, select="v3"),
    SparseParams(k=5, block=16, select="v3", p=0.8, min_blocks=2),
    SparseParams(k=4, block=24, select="v3", p=0.9, key_bits=4),
)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_fused_equals_staged_on_both_thread_counts(default_llm, monkeypatch, kv):
    """The fused step (its own compiled selection) gives the staged path's bits, on 1 and 2
    threads, with the key codes copied (f32, f16) or the cache's own (int8)."""
    import numba
    from test_fused_decode import _decode

    from sparrow.kernels.runtime import set_threads
    from sparrow.models import fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a busy machine must not send steps staged
    ids = np.asarray(default_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:300])
    try:
        for sp in V3_MODEL:
            staged = _decode(default_llm, ids, 280, sp, fused=False, kv=kv)
            for threads in (1, 2):
                set_threads(threads)
                assert numba.get_num_threads() == threads
                assert _decode(default_llm, ids, 280, sp, fused=True, kv=kv).tobytes() == staged.tobytes(), sp
    finally:
        set_threads(default_llm.threads)


def test_a_sequence_alone_equals_it_in_a_batch(default_llm, monkeypatch):
    """Rows of a batch (different lengths and caches) select on their own: each row's logits are
    its sequence's alone, fused or staged."""
    from test_fused_decode import _batch_step

    from sparrow.models import fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)
    tok = default_llm.tokenizer
    seqs = [np.asarray(tok.encode(f"{w} and so on, " * n)) for w, n in (("Alpha", 30), ("Beta gamma", 45))]
    for sp in V3_MODEL:
        alone = np.concatenate([_batch_step(default_llm, [ids], "f16", fused=True, sparse=sp) for ids in seqs])
        for fused in (True, False):
            both = _batch_step(default_llm, seqs, "f16", fused=fused, sparse=sp, every=True)
            assert both.tobytes() == alone.tobytes(), (sp, fused)


# ---------------------------------------------------------------- the edges: CLI and server fields
def test_cli_flags_and_server_fields_reach_the_settings():
    from sparrow.cli import build_parser
    from sparrow.request import sampling_from_flags
    from sparrow.server.protocol import APIError, parse_chat

    argv = ["generate", "--prompt", "x", "--sparse-attn", "--sparse-select", "v3", "--sparse-p", "0.9"]
    sp = sampling_from_flags(build_parser().parse_args(argv + ["--sparse-min-blocks", "2", "--sparse-key-bits", "4"]))[
        1
    ]
    assert (sp.select, sp.p, sp.min_blocks, sp.k, sp.key_bits) == ("v3", 0.9, 2, 32, 4)
    chat = [{"role": "user", "content": "hi"}]
    body = {"messages": chat, "sparse_attn": True, "sparse_select": "v3", "sparse_p": 0.8, "sparse_min_blocks": 3}
    sp = parse_chat(body).sparse
    assert (sp.select, sp.p, sp.min_blocks, sp.key_bits) == ("v3", 0.8, 3, 8)
    assert parse_chat({**body, "sparse_key_bits": 4}).sparse.key_bits == 4
    for bad, param in [
        ({"sparse_p": 1.5}, "sparse_p"),
        ({"sparse_p": 0}, "sparse_p"),
        ({"sparse_min_blocks": 0}, "sparse_min_blocks"),
        ({"sparse_key_bits": 2}, "sparse_key_bits"),
        ({"sparse_key_bits": "4"}, "sparse_key_bits"),
        ({"sparse_select": "v2"}, "sparse_attn"),  # p with another selector: SparseParams says so
    ]:
        with pytest.raises(APIError) as e:
            parse_chat({**body, **bad})
        assert e.value.param == param, bad


def test_the_oracle_gap_is_read_at_as_many_blocks():
    from sparrow_lab.eval.report import oracle_gap

    oracle = [{"selector": "oracle", "blocks": b, "kl": kl} for b, kl in ((8.0, 0.04), (16.0, 0.01), (32.0, 0.001))]
    at = lambda blocks, kl, sel="v3": oracle_gap({"selector": sel, "blocks": blocks, "kl": kl}, oracle)  # noqa: E731
    assert at(16.0, 0.02) == pytest.approx(2.0)  # an oracle row at exactly as many blocks
    assert at(math.sqrt(8 * 16), 0.02) == pytest.approx(0.02 / math.sqrt(0.04 * 0.01))  # halfway in log(blocks)
    assert at(32.0, 0.001) == pytest.approx(1.0)
    assert at(4.0, 0.1) is None and at(40.0, 0.1) is None  # outside the oracle rows
    assert at(16.0, 0.02, sel="oracle") is None and oracle_gap({"selector": None, "kl": 0.0}, oracle) is None


def test_top_p_walks_the_prefix_of_the_full_ranking():
    """select_v3_nb's ranking of the k candidates (one pass for the k-th largest, then a sort of
    k) is the first k entries of a stable argsort of -mass, repeats and ties included."""
    from sparrow.kernels.attention.select import _top_in_order

    rng = np.random.default_rng(17)
    for trial in range(500):
        n = int(rng.integers(1, 300))
        mass = (rng.integers(-3, 4, n) if trial % 2 else rng.standard_normal(n)).astype(np.float32)
        want = int(rng.integers(1, n + 1))
        assert np.array_equal(_top_in_order(mass, want), np.argsort(-mass, kind="stable")[:want]), (trial, n, want)
