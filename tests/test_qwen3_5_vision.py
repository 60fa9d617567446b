"""Qwen3.5 with images (dense and MoE) against transformers' Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration: tiny odd-shaped models with Qwen3-VL's vision tower without
DeepStack (vl_reference.py), a conversation of two turns with two images that need resizing.
The prompt ids (image pads included) equal those of transformers' processor for Qwen3.5
(Qwen3VLProcessor), the logits are within the Qwen3-VL tests' tolerance, greedy decoding with
prefill chunks that cut through the images equals transformers' generate; the prefix cache and
the disk prompt cache give a conversation with images the fresh bits; llama.cpp's converter's
text GGUF and mmproj equal the folder."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest
import vl_reference as vr
from PIL import Image

import sparrow
from sparrow.errors import SparrowError
from sparrow.params import SamplingParams
from sparrow.vision.positions import rope_positions

torch = pytest.importorskip("torch")


def _picture(w, h, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)


def _data_url(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# 100x70 rounds to 96x64 (resized), 40x130 to 32x128: a wide and a tall grid
PICTURES = [_picture(100, 70, 1), _picture(40, 130, 2)]


def _conversation(image_part=None):
    """Two turns; image_part(i) gives the i-th image's content part (default: data URL, PIL)."""
    a, b = PICTURES
    part = image_part or (
        lambda i: [{"type": "image_url", "image_url": {"url": _data_url(a)}}, {"type": "image", "image": b}][i]
    )  # noqa: E501
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Compare "}, part(0), {"type": "text", "text": " with "}, part(1)],
        },  # noqa: E501
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": "How?"},
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir):
    """kind -> (folder, transformers model)."""
    out = {}
    for kind in ("dense", "moe"):
        d = str(tmp_path_factory.mktemp(f"tiny_qwen3_5_vl_{kind}"))
        out[kind] = (d, vr.build_tiny_qwen3_5_vl(d, tokenizer_dir, kind))
    return out


@pytest.fixture(scope="module")
def llms(tiny):
    return {k: sparrow.load(v[0], threads=2) for k, v in tiny.items()}


def _processor_inputs(llm, folder):
    """transformers' processor for Qwen3.5 (Qwen3VLProcessor with Qwen2VLImageProcessor) over the
    conversation rendered by the same chat template, one placeholder per image."""
    from transformers import PreTrainedTokenizerFast, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    p = vr.PREPROCESSOR
    images = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=p["image_mean"], image_std=p["image_std"],
        size=p["size"],
    )  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, argument):  # the check wants torchvision's video classes
            return type(argument)

    proc = Processor(image_processor=images, tokenizer=tok)
    placeholder = lambda i: {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}  # noqa: E731
    msgs = [
        dict(m, content="".join(c["text"] for c in m["content"])) if isinstance(m["content"], list) else m
        for m in _conversation(placeholder)
    ]
    text = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    return proc(text=[text], images=PICTURES, return_tensors="pt")


def test_rope_positions_match_transformers(tiny, llms):
    """Qwen3.5's get_rope_index over the conversation: the same (t, h, w) positions and delta."""
    folder, model = tiny["dense"]
    inp = _processor_inputs(llms["dense"], folder)
    ids = inp["input_ids"][0].numpy()
    grids = [tuple(int(x) for x in g) for g in inp["image_grid_thw"]]
    ours, delta, _ = rope_positions(ids, vr.PAD, grids, 2)
    ref, ref_delta = model.model.get_rope_index(inp["input_ids"], inp["mm_token_type_ids"], inp["image_grid_thw"])
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta) and delta < 0


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_conversation_with_images_matches_transformers(tiny, llms, kind):
    """Prompt ids equal the processor's (image-token counts included); prompt logits within the
    Qwen3-VL tests' tolerance; greedy tokens, with prefill chunks of 7 that cut through both
    images then decode steps after the rope delta, equal transformers' generate."""
    folder, model = tiny[kind]
    llm = llms[kind]
    msgs = _conversation()
    ids = llm.prompt_ids(msgs)
    inp = _processor_inputs(llm, folder)
    assert ids == inp["input_ids"][0].tolist()
    grids = inp["image_grid_thw"].tolist()
    assert grids == [[1, 4, 6], [1, 8, 2]] and ids.count(vr.PAD) == 6 + 4  # both resized
    with torch.no_grad():
        ref = model(**inp).logits[0].numpy()
    got = llm.logits(msgs)
    # the Qwen3-VL tests' tolerance; measured 6.5e-4 (dense) and 1.6e-4 (MoE) on logits up to 8.2
    assert np.abs(got - ref).max() < 1e-3, np.abs(got - ref).max()
    assert np.array_equal(got.argmax(1), ref.argmax(1))
    with torch.no_grad():
        want = model.generate(**inp, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    chunk = llm.runner.prefill_chunk
    llm.runner.prefill_chunk = 7
    try:
        out = [o.token_id for o in llm.stream(msgs, chat=True, max_tokens=16, temperature=0.0, ignore_eos=True)]
    finally:
        llm.runner.prefill_chunk = chunk
    assert out == want


def test_decode_after_images_runs_fused_with_the_staged_bits(tokenizer_dir, tmp_path, monkeypatch):
    """A q8_0 model (shapes the fused step takes) answering the conversation with images: its
    decode steps after the rope delta take the fused step (text rows: every M-RoPE section at
    position + delta, one rotation on the rotary dims) with the staged path's tokens and logprob
    bits."""
    from sparrow.models import fused as fused_mod

    monkeypatch.setattr(fused_mod, "BACKOFF_STEPS", 0)  # a busy machine must not send steps to the staged path
    vr.build_tiny_qwen3_5_vl(str(tmp_path), tokenizer_dir, "blocks")
    llm = sparrow.load(str(tmp_path), quantize="q8_0", threads=2, activations="f32")
    plan = llm.model.fused_step()
    assert plan is not None and plan.hybrid is not None
    msgs = _conversation()

    def run(fused):
        llm.model.use_fused, plan.backoff, before = fused, 0, plan.steps
        try:
            out = list(llm.stream(msgs, chat=True, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True))
        finally:
            llm.model.use_fused = True
        assert plan.steps - before == (11 if fused else 0)  # every decode step took the path meant
        return [o.token_id for o in out], np.array([o.logprob for o in out], np.float32)

    fused_ids, fused_lp = run(True)
    staged_ids, staged_lp = run(False)
    assert fused_ids == staged_ids and fused_lp.tobytes() == staged_lp.tobytes()


def _engine_run(llm, ids, pixels, params, disk=None):
    import threading

    from sparrow.engine.engine import Engine
    from sparrow.engine.runner import Runner
    from sparrow.request import GenerationRequest
    from sparrow.vision.preprocess import image_salt

    engine = Engine(llm.handle, runner=Runner(llm.model, 16), kv_budget=1 << 28, disk_cache=disk)
    engine.start(warmup=False)
    outs = []
    try:
        for _ in range(2):
            got, done = [], threading.Event()

            def emit(kind, out, got=got, done=done):
                assert kind == "token", out
                got.append(out)
                if out.finish_reason:
                    done.set()

            engine.submit(GenerationRequest(ids, params, images=pixels, cache_salt=image_salt(pixels)), emit)
            assert done.wait(300)
            outs.append(([o.token_id for o in got], [o.logprob for o in got], got[0].cached_tokens))
    finally:
        engine.stop()
    if disk is not None:
        disk.flush()
    return outs


def test_prefix_and_disk_caches_give_a_conversation_with_images_the_fresh_bits(llms, tmp_path):
    """The same request twice through one engine (the second from the prefix cache, image pads
    and the recurrent state at the kept boundary included), then in a new engine from the disk
    prompt cache: tokens and logprobs bit-identical to the first, fresh run."""
    from sparrow.state import disk as dc

    llm = llms["moe"]
    ids, pixels = llm.prompt_and_images(_conversation(), chat=True)
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=3, ignore_eos=True, logprobs=0)

    def disk():  # a new process's view of the folder
        return dc.DiskCache(str(tmp_path), 1 << 30, dc.identity_for(llm.checkpoint, llm.model, 16), llm.model.new_cache)

    (fresh, again) = _engine_run(llm, ids, pixels, params, disk())
    assert fresh[2] == 0 and again[2] >= len(ids) - 16 > 0
    assert again[:2] == fresh[:2]
    d = disk()
    (from_disk, _) = _engine_run(llm, ids, pixels, params, d)
    assert from_disk[2] == again[2] and d.stats["hits"] == 1
    assert from_disk[:2] == fresh[:2]
    other = [_picture(100, 70, 5), PICTURES[1]]  # the same pads, another picture: no reuse
    ids2, pixels2 = llm.prompt_and_images(_conversation(lambda i: {"type": "image", "image": other[i]}), chat=True)
    assert ids2 == ids
    (first, _) = _engine_run(llm, ids2, pixels2, params)
    assert first[2] == 0 and first[1] != fresh[1]


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """llama.cpp's converter on the dense folder: (text GGUF, mmproj GGUF)."""

    from test_qwen3_5_gguf import convert, for_converter  # skips (or, in CI, fails) without the converter

    root = tmp_path_factory.mktemp("qwen3_5_vl_gguf")
    src = for_converter(tiny["dense"][0], str(root / "src"))  # still Qwen3_5ForConditionalGeneration
    return convert(src, str(root / "text.gguf")), convert(src, str(root / "mmproj.gguf"), mmproj=True)


def test_converted_gguf_and_mmproj_equal_the_folder(llms, converted):
    """The pair llama.cpp's converter writes (qwen35 text GGUF, qwen3vl_merger mmproj, f32): the
    same tower config (but the pixel limits, which the converter does not write: the mmproj
    gets Qwen3.5's own, 65536 .. 16777216), the same image embeddings bit for bit, and the
    conversation's logits in prefill and decode within test_qwen3_5_gguf.py's tolerance."""
    import dataclasses

    from sparrow.models.qwen3_5 import Qwen3_5VL
    from sparrow.vision.config import MAX_PIXELS, MIN_PIXELS

    hf = llms["dense"]
    llm = sparrow.load(converted[0], mmproj=converted[1], threads=2)
    assert isinstance(llm.model, Qwen3_5VL) and llm.config.gguf_layout
    assert llm.config.mrope_section == hf.config.mrope_section == (2, 1, 3)
    assert (llm.vision.min_pixels, llm.vision.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    assert dataclasses.replace(llm.vision, min_pixels=4096, max_pixels=160 * 160) == hf.vision
    ids, pixels = hf.prompt_and_images(_conversation(), chat=True)
    for im in pixels:
        np.testing.assert_array_equal(llm.model.vision(im.pixels, im.grid)[0], hf.model.vision(im.pixels, im.grid)[0])
    more = [101, 202, 303, 404]

    def run(m):
        slot = m.runner.new_slot(ids, len(ids) + len(more), images=pixels)
        rows = [m.runner.prefill(slot)] + [m.runner.decode([slot], [t])[0] for t in more]
        assert slot.mm.rope_delta < 0
        return np.stack(rows)

    got, want = run(llm), run(hf)
    # the same values; sums over tiled value heads run in another order than over grouped ones
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    assert np.array_equal(got.argmax(1), want.argmax(1))


def test_an_mmproj_of_another_model_is_refused(converted, tokenizer_dir, tmp_path):
    """Qwen3-VL's mmproj (DeepStack mergers) with the Qwen3.5 text GGUF, Qwen3.5's with a Qwen3-VL
    text GGUF (same hidden size, 64) or with a text GGUF that takes no images: one-line errors
    before the model is built."""
    vl = vr.build_tiny_vl(str(tmp_path / "vl"), tokenizer_dir)
    vl_text, vl_mmproj = str(tmp_path / "vl.gguf"), str(tmp_path / "mmproj-vl.gguf")
    vr.write_vl_gguf(vl, vl_text, vl_mmproj)
    qwen3_text = str(tmp_path / "qwen3.gguf")  # the same text weights as a plain qwen3 GGUF
    vr.write_vl_gguf(vl, qwen3_text, str(tmp_path / "unused.gguf"), text_arch="qwen3")
    for text, mmproj, match in (
        (converted[0], vl_mmproj, "its vision tower has 2 DeepStack mergers, the text model takes 0 .an mmproj of"),
        (vl_text, converted[1], "its vision tower has 0 DeepStack mergers, the text model takes 2 .an mmproj of"),
        (qwen3_text, converted[1], "goes with a Qwen3-VL or Qwen3.5 text GGUF; qwen3.gguf is 'qwen3'"),
    ):
        with pytest.raises(SparrowError, match=match) as e:
            sparrow.load(text, mmproj=mmproj)
        assert "\n" not in str(e.value)


def test_images_through_the_server_and_the_cli(tiny, llms, tmp_path, capsys, monkeypatch):
    """Chat completions with two images (a data URL and a file:// URL inside the allowed media
    folder) answer as the Python API does, count the image pads in usage, and a second identical
    request comes from the prefix cache with the same answer; /v1/responses and /v1/messages
    answer the same; `sparrow generate --image` too."""
    import anthropic
    import httpx
    import openai
    from inprocess_server import serving

    from sparrow import cli
    from sparrow.engine.runner import Runner
    from sparrow.server.app import ServerState

    folder = tiny["dense"][0]
    media = tmp_path / "media"
    media.mkdir()
    PICTURES[1].save(media / "b.png")
    url = _data_url(PICTURES[0])
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": f"file://{media}/b.png"}},
        {"type": "text", "text": "What is this?"},
    ]
    msgs = [{"role": "user", "content": parts}]
    api_msgs = [{"role": "user", "content": [{"type": "image", "image": p} for p in PICTURES] + parts[2:]}]
    llm = llms["dense"]
    ids = llm.prompt_ids(api_msgs)
    want = "".join(llm.generate(api_msgs, chat=True, max_tokens=6))
    served = sparrow.load(folder, threads=2)
    # prefill chunks of 16: the prefix cache keeps whole chunks of the short prompt
    state = ServerState(allowed_local_media_path=str(media), runner=Runner(served.model, 16))
    with serving(state, served) as base:
        body = {"messages": msgs, "max_tokens": 6, "temperature": 0}
        rs = [httpx.post(base + "/v1/chat/completions", json=body, timeout=300) for _ in range(2)]
        for r in rs:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want
            assert r.json()["usage"]["prompt_tokens"] == len(ids) and ids.count(vr.PAD) == 10
        cached = [r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens") for r in rs]
        assert not cached[0] and cached[1] > 0, cached
        name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        o = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        inputs = [
            {"type": "input_image", "image_url": url},
            {"type": "input_image", "image_url": f"file://{media}/b.png"},
        ]
        inputs.append({"type": "input_text", "text": "What is this?"})
        r = o.responses.create(
            model=name, input=[{"role": "user", "content": inputs}], max_output_tokens=6, temperature=0
        )
        assert r.output_text == want
        a = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=300)
        data = url.split(",", 1)[1]
        blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]
        blocks.append({"type": "image", "source": {"type": "url", "url": f"file://{media}/b.png"}})
        m = a.messages.create(
            model=name,
            max_tokens=6,
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": blocks + [{"type": "text", "text": "What is this?"}]}],
        )
        assert m.content[0].text == want  # the same images: the prompt's chunks from the prefix cache
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    PICTURES[0].save(tmp_path / "a.png")
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    argv = ["generate", "--model", folder, "--image", str(tmp_path / "a.png"), "--image", str(media / "b.png")]
    assert cli.main(argv + ["-p", "What is this?", "-n", "6"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want


def test_a_folder_whose_tower_has_deepstack_is_refused(tiny, tmp_path):
    """Qwen3.5's text model adds no DeepStack features: a vision_config naming DeepStack mergers
    is refused rather than run without them."""
    import shutil

    import reference_models as rm

    folder = str(tmp_path / "deepstack")
    shutil.copytree(tiny["dense"][0], folder)
    rm.rewrite_config(folder, lambda cfg: cfg["vision_config"].update(deepstack_visual_indexes=[1, 2]))
    with pytest.raises(SparrowError, match="Qwen3.5's vision tower has no DeepStack mergers; this one has 2"):
        sparrow.load(folder)
