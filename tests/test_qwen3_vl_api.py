"""Qwen3-VL through the public API: image preprocessing against transformers' image
processor, messages with image parts (data URL, path, bytes, PIL) in logits / generate /
stream, several turns, sparse attention over image tokens, and one-line errors for bad input."""

import base64
import io

import numpy as np
import pytest
import vl_reference as vr
from PIL import Image

import sparrow
from sparrow.errors import SparrowError
from sparrow.vision.config import VisionConfig
from sparrow.vision.preprocess import preprocess


def _picture(w, h, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)  # smooth-ish, like a photo


def _data_url(im: Image.Image, fmt="PNG") -> str:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory, tokenizer_dir):
    d = str(tmp_path_factory.mktemp("tiny_qwen3_vl_api"))
    return d, vr.build_tiny_vl(d, tokenizer_dir)


@pytest.fixture(scope="module")
def vl_llm(tiny_vl):
    return sparrow.load(tiny_vl[0])


@pytest.mark.parametrize("size", [(100, 70), (37, 150), (300, 260), (64, 64)])  # (w, h): up, down, square
def test_preprocess_matches_transformers(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = VisionConfig(48, 80, 4, 3, 64, (0,), min_pixels=64 * 64, max_pixels=160 * 160)
    ref = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 64 * 64, "longest_edge": 160 * 160},
    )  # fmt: skip
    im = _picture(*size, seed=size[0])
    out = ref(images=[im], return_tensors="np")
    ours = preprocess(im, cfg)
    assert list(ours.grid) == out["image_grid_thw"][0].tolist()
    assert ours.pixels.shape == out["pixel_values"].shape
    assert np.abs(ours.pixels - out["pixel_values"]).max() < 1e-5


def _hf_inputs(vl_llm, messages):
    """ids from sparrow's prompt_ids and pixels from transformers' image processor, for the
    reference forward."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    p = vr.PREPROCESSOR
    proc = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=p["image_mean"], image_std=p["image_std"],
        size=p["size"],
    )  # fmt: skip
    ims = [part["pil"] for m in messages if isinstance(m["content"], list) for part in m["content"] if "pil" in part]
    out = proc(images=ims, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def _conversation():
    a, b = _picture(100, 70, 1), _picture(40, 130, 2)
    return [
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": _data_url(a)}, "pil": a},
            {"type": "text", "text": " with "},
            {"type": "image", "image": b, "pil": b},
        ]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": "How?"},
    ]  # fmt: skip


def test_messages_logits_match_transformers(tiny_vl, vl_llm):
    """Two images (one resized up, one with a tall grid), several turns: prompt_ids expands the
    pads, logits(messages) match transformers fed the same ids and its own processor's pixels."""
    msgs = _conversation()
    ids = vl_llm.prompt_ids(msgs)
    pixels, grids = _hf_inputs(vl_llm, msgs)
    n_pads = [int(t * h * w // 4) for t, h, w in grids]
    assert ids.count(vr.PAD) == sum(n_pads) and ids.count(vr.START) == 2
    ref = vr.hf_logits(tiny_vl[1], ids, pixels, grids)
    ours = vl_llm.logits(msgs)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-3


def test_generate_sparse_k_covering_all_blocks_equals_exact(vl_llm):
    msgs = _conversation()
    exact = [o.token_id for o in vl_llm.stream(msgs, chat=True, max_tokens=12, ignore_eos=True)]
    n = len(vl_llm.prompt_ids(msgs)) + 12
    sparse = [
        o.token_id
        for o in vl_llm.stream(
            msgs, chat=True, max_tokens=12, ignore_eos=True, sparse_attn=True, sparse_k=n // 8 + 1, sparse_block=8
        )
    ]
    assert sparse == exact


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def _png_bytes(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _bomb_png() -> bytes:
    """A valid PNG header claiming 10000 x 10000 pixels (the decoder must refuse before decoding)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", 10000, 10000, 8, 2, 0, 0, 0)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "part, match",
    [
        ({"type": "image", "image": b"definitely not an image"}, "not an image"),
        ({"type": "image", "image": _png_bytes(_picture(64, 64))[:200]}, "cannot decode image"),  # truncated
        ({"type": "image", "image": Image.new("RGB", (0, 0))}, "zero size"),
        ({"type": "image", "image": _bomb_png()}, "too large"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "not fetched"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "invalid base64"),
        ({"type": "image", "image": "/nonexistent/cat.png"}, "cannot read image"),
        ({"type": "image", "image": _picture(2000, 8)}, "aspect ratio"),
        ({"type": "audio", "audio": "x"}, "unsupported"),
    ],
)
def test_bad_images_are_one_line_errors(vl_llm, part, match):
    with pytest.raises(SparrowError, match=match) as e:
        list(vl_llm.generate(_user({"type": "text", "text": "hi"}, part), max_tokens=1))
    assert "\n" not in str(e.value)


def test_too_many_images_and_pad_mismatch(vl_llm):
    im = {"type": "image", "image": _picture(64, 64)}
    vl_llm.max_images = 2
    try:
        with pytest.raises(SparrowError, match="too many images: at most 2"):
            vl_llm.prompt_ids(_user(im, im, im))
    finally:
        vl_llm.max_images = 16
    typed = [{"role": "user", "content": "look: <|image_pad|>"}]
    assert vr.PAD not in vl_llm.prompt_ids(typed)  # a user's text is text, not an image placeholder
    with pytest.raises(SparrowError, match="1 image placeholders but 0 images"):
        vl_llm.prompt_and_images(typed, special_tokens_in_content=True)
    ids = vl_llm.prompt_ids(_user(im))
    with pytest.raises(SparrowError, match="image placeholders but 0 images"):
        list(vl_llm.stream(ids, max_tokens=1))  # token ids with pads, no images
    with pytest.raises(SparrowError, match="needs 4 image pad tokens, the prompt has 3"):
        from sparrow.vision.preprocess import preprocess as prep

        one_short = ids[: ids.index(vr.PAD)] + ids[ids.index(vr.PAD) + 1 :]
        vl_llm.runner.new_slot(one_short, 64, images=[prep(_picture(64, 64), vl_llm.vision)])


def test_image_to_text_only_model(tiny_models):
    llm = sparrow.load(tiny_models["qwen3"].folder)
    with pytest.raises(SparrowError, match="text-only"):
        llm.prompt_ids(_user({"type": "image", "image": _picture(64, 64)}))


def test_cli_generate_with_image_and_timings(tiny_vl, vl_llm, tmp_path, capsys, monkeypatch):
    """`sparrow generate --image PATH -p ... --timings`: the answer equals the API's for the same
    messages, and a [VISION] line gives the image's size after resizing, tokens and time."""
    from sparrow import cli

    path = str(tmp_path / "pic.png")
    _picture(100, 70, 9).save(path)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    rc = cli.main(["generate", "--model", tiny_vl[0], "--image", path, "-p", "Describe it", "-n", "5", "--timings"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    msgs = _user({"type": "image", "image": path}, {"type": "text", "text": "Describe it"})
    want = "".join(vl_llm.generate(msgs, chat=True, max_tokens=5))
    assert out.out.rstrip("\n") == want
    grid = preprocess(Image.open(path), vl_llm.vision).grid
    line = next(x for x in out.err.splitlines() if x.startswith("[VISION]"))
    assert f"image 1: {grid[2] * 16}x{grid[1] * 16} px, {grid[1] * grid[2] // 4} tokens" in line
    rc = cli.main(["generate", "--model", tiny_vl[0], "--image", str(tmp_path / "missing.png"), "-p", "x", "-n", "1"])
    assert rc == 1 and "cannot read image" in capsys.readouterr().err
