"""Qwen3-VL with images against transformers' Qwen3VLForConditionalGeneration (tiny random
model with odd sizes, see vl_reference.py): the vision tower, DeepStack and M-RoPE in prefill
(chunks that cut through an image) and decode (rope delta), two images with non-square
grids, and sparse attention with k >= blocks giving exact's greedy tokens."""

import numpy as np
import pytest
import torch
import vl_reference as vr

import sparrow
from sparrow.engine.runner import Runner
from sparrow.vision.positions import rope_positions
from sparrow.vision.preprocess import PixelImage

GRIDS = [(1, 4, 6), (1, 6, 2)]  # patch grids: 2x3 and 3x1 merged tokens


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory, tokenizer_dir):
    d = str(tmp_path_factory.mktemp("tiny_qwen3_vl"))
    return d, vr.build_tiny_vl(d, tokenizer_dir)


@pytest.fixture(scope="module")
def vl_llm(tiny_vl):
    return sparrow.load(tiny_vl[0])


def _images(seed=0):
    rng = np.random.default_rng(seed)
    return [
        PixelImage(rng.standard_normal((t * h * w, 3 * 2 * 16 * 16)).astype(np.float32), g)
        for g in GRIDS
        for t, h, w in [g]
    ]


def _prompt(seed=1):
    """text, image 1 (6 pads), text, image 2 (3 pads), text."""
    rng = np.random.default_rng(seed)
    text = lambda n: list(rng.integers(17, 2000, n))  # noqa: E731
    img = lambda n: [vr.START] + [vr.PAD] * n + [vr.END]  # noqa: E731
    return text(5) + img(6) + text(4) + img(3) + text(6)


def _ref(model, ids, images):
    return vr.hf_logits(model, ids, np.concatenate([im.pixels for im in images]), [im.grid for im in images])


def test_rope_positions_match_transformers(tiny_vl):
    model = tiny_vl[1]
    ids = np.array(_prompt())
    ours, delta, _ = rope_positions(ids, vr.PAD, GRIDS, 2)
    ids_t = torch.tensor(ids)[None]
    ref, ref_delta = model.model.get_rope_index(ids_t, (ids_t == vr.PAD).int(), torch.tensor(GRIDS))
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta) and delta < 0


@pytest.mark.parametrize("chunk", [512, 7])  # 7: prefill chunks cut through both images
def test_prefill_and_decode_logits_match_transformers(tiny_vl, vl_llm, chunk):
    """Prompt logits from prefill (chunked), then each further token fed through decode steps
    (rope delta): all rows within 1e-3 of transformers' one forward over the whole sequence."""
    model = tiny_vl[1]
    images = _images()
    prompt = _prompt()
    more = list(np.random.default_rng(5).integers(17, 2000, 6))
    ref = _ref(model, prompt + more, images)  # [P + 6, V]
    runner = Runner(vl_llm.model, prefill_chunk=chunk)
    slot = runner.new_slot(prompt, len(prompt) + len(more), images=images)
    rows = []
    while not slot.prefill_done:
        start = slot.cache.length
        rows.append(runner.prefill_step(slot))
        assert rows[-1] is not None and slot.cache.length > start
    got = [runner.prefill_step(slot)] + [runner.decode([slot], [t])[0] for t in more]
    assert got[0] is None
    assert np.abs(rows[-1] - ref[len(prompt) - 1]).max() < 1e-3
    dec = np.stack(got[1:])  # rows P .. P + 5 predict what follows each fed token
    assert np.abs(dec - ref[len(prompt) :]).max() < 1e-3
    assert (dec.argmax(-1) == ref[len(prompt) :].argmax(-1)).all()


def test_all_prompt_logits_match_transformers(tiny_vl, vl_llm):
    model = tiny_vl[1]
    images, prompt = _images(3), _prompt(4)
    ref = _ref(model, prompt, images)
    from sparrow.models.decoder import Segment

    mm = vl_llm.model.prepare(np.array(prompt), images)
    cache = vl_llm.model.new_cache(len(prompt))
    got = vl_llm.model.forward(
        [Segment(np.array(prompt), cache, 0, vision=mm.segment(0, len(prompt)))], all_logits=True
    )
    assert np.abs(got - ref).max() < 1e-3


@pytest.mark.parametrize("rows", [64, 5])  # 5: attention in several work items of query rows
def test_vision_tower_matches_transformers(tiny_vl, vl_llm, rows, monkeypatch):
    """Embeddings and DeepStack features of one image, directly."""
    from sparrow.kernels import vision

    monkeypatch.setattr(vision, "QT", rows)
    model = tiny_vl[1]
    im = _images(7)[0]
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(im.pixels), grid_thw=torch.tensor([im.grid]), return_dict=True)
    emb, deep = vl_llm.model.vision(im.pixels, im.grid)
    assert np.abs(emb - out.pooler_output.numpy()).max() < 1e-4
    assert len(deep) == 2
    for ours, ref in zip(deep, out.deepstack_features):
        assert np.abs(ours - ref.numpy()).max() < 1e-4


def test_vision_attention_over_several_key_blocks():
    """The tower's attention kernel against float64 softmax(q k^T / sqrt(d)) v with 150 patches
    (key blocks of 64: two full, one partial), the same bits on one thread as on two."""
    import numba

    from sparrow.kernels.vision import attention

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((150, 3, 40), dtype=np.float32) * 2 for _ in range(3))
    s = np.einsum("nhd,mhd->hnm", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(40)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hnm,mhd->nhd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = attention(q, k, v, 40**-0.5)
    finally:
        numba.set_num_threads(old)
    two = attention(q, k, v, 40**-0.5)
    assert np.abs(two - ref).max() < 5e-5  # f32 scores of size ~8: a few ulps
    assert np.array_equal(one, two)


def test_gguf_and_mmproj_twins_match(tiny_vl, tmp_path):
    """llama.cpp's pair (qwen3vl text GGUF + mmproj GGUF, F16 matrices) written from the same
    weights: logits within 1e-3 of transformers run on the same f16-rounded weights, over a
    prompt with two images and decode steps after it."""
    import reference_models as rm

    model = tiny_vl[1]
    text, mmproj = str(tmp_path / "tiny-vl.gguf"), str(tmp_path / "mmproj-tiny-vl.gguf")
    vr.write_vl_gguf(model, text, mmproj)
    ref_model = rm.rounded_copy(model, "f16", lambda name, p: p.ndim >= 2)
    llm = sparrow.load(text, mmproj=mmproj)
    assert llm.vision is not None and llm.vision.deepstack_visual_indexes == (0, 2)
    assert llm.config.mrope_section == (4, 6, 6) and llm.vision.image_token_id == vr.PAD
    images, prompt = _images(), _prompt()
    more = list(np.random.default_rng(6).integers(17, 2000, 4))
    ref = _ref(ref_model, prompt + more, images)
    slot = llm.runner.new_slot(prompt, len(prompt) + len(more), images=images)
    first = llm.runner.prefill(slot)
    dec = np.stack([llm.runner.decode([slot], [t])[0] for t in more])
    assert np.abs(first - ref[len(prompt) - 1]).max() < 1e-3
    assert np.abs(dec - ref[len(prompt) :]).max() < 1e-3


def test_mmproj_needs_a_text_gguf(tiny_vl):
    from sparrow.errors import SparrowError

    with pytest.raises(SparrowError, match="--mmproj goes with a text GGUF"):
        sparrow.load(tiny_vl[0], mmproj="unused.gguf")


def test_hub_config_spelling_gives_the_same_logits(tiny_vl, vl_llm, tmp_path):
    """The Hub's config.json spells rope as rope_scaling (with mrope_section) + rope_theta;
    transformers 5 saves rope_parameters. Both load to the same model."""
    import shutil

    import reference_models as rm

    hub = str(tmp_path / "hub")
    shutil.copytree(tiny_vl[0], hub)

    def respell(cfg):
        text = cfg["text_config"]
        rope = text.pop("rope_parameters")
        text["rope_theta"] = rope.pop("rope_theta")
        text["rope_scaling"] = rope

    rm.rewrite_config(hub, respell)
    llm = sparrow.load(hub)
    assert llm.config.mrope_section == (4, 6, 6) and llm.config.rope_theta == 5e6
    images, prompt = _images(), _prompt()
    want = vl_llm.runner.prefill(vl_llm.runner.new_slot(prompt, len(prompt), images=images))
    got = llm.runner.prefill(llm.runner.new_slot(prompt, len(prompt), images=images))
    np.testing.assert_array_equal(got, want)


def test_fused_decode_after_images_equals_staged(tiny_vl):
    """Decode after an image prompt shifts the rope position by the prompt's rope delta: the
    fused decode step (q8_0 weights) gives the staged path's bits."""
    llm = sparrow.load(tiny_vl[0], quantize="q8_0")
    images, prompt = _images(), _prompt()
    more = [101, 202, 303, 404]
    runs = []
    for fused in (True, False):
        llm.model.use_fused = fused
        steps = llm.model.fused_step().steps
        slot = llm.runner.new_slot(prompt, len(prompt) + len(more), images=images)
        llm.runner.prefill(slot)
        runs.append(np.stack([llm.runner.decode([slot], [t])[0] for t in more]))
        assert (llm.model.fused_step().steps > steps) == fused  # the path meant ran
    assert slot.mm.rope_delta < 0
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_batch_after_images_runs_fused_with_each_row_s_own_bits(tiny_vl, monkeypatch):
    """Decode rows of sequences whose prompts held images or none (rope deltas that differ:
    each row's rope position is its own) go through one fused batch step, each row
    with its sequence's own step's bits and the staged batch's."""
    import sparrow.models.fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a contended step must not send the next ones staged
    llm = sparrow.load(tiny_vl[0], quantize="q8_0")
    plan = llm.model.fused_step()
    images = _images()
    rng = np.random.default_rng(7)
    img = [vr.START] + [vr.PAD] * 6 + [vr.END]  # the first image's pads (rope delta -3 each)
    twice = list(rng.integers(17, 2000, 4)) + img + list(rng.integers(17, 2000, 3)) + img + [42]
    seqs = [(_prompt(), images), (twice, images[:1] * 2), (list(rng.integers(17, 2000, 19)), None)]
    more = [101, 202, 303]

    def run(group, fused):
        llm.model.use_fused = fused
        try:
            slots = [llm.runner.new_slot(p, len(p) + len(more), images=im) for p, im in group]
            for s in slots:
                llm.runner.prefill(s)
            steps = [llm.runner.decode(slots, [t] * len(slots)) for t in more]  # [B, V] each
            return np.stack(steps, 1), slots  # [B, steps, V]
        finally:
            llm.model.use_fused = True

    batched = plan.batched
    fused, slots = run(seqs, True)
    assert plan.batched == batched + len(more)  # every step took the fused batch step
    deltas = [s.mm.rope_delta if s.mm is not None else 0 for s in slots]
    assert len(set(deltas)) == 3 and min(deltas) < 0, deltas
    staged, _ = run(seqs, False)
    alone = np.concatenate([run([sq], True)[0] for sq in seqs])
    assert fused.tobytes() == staged.tobytes()
    assert fused.tobytes() == alone.tobytes()
