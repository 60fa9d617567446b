"""Images through the OpenAI-compatible server (tiny Qwen3-VL, in-process uvicorn): base64 data
URLs answer as the Python API does, image tokens count in usage.prompt_tokens and /tokenize,
and bad image input is a 400 naming `messages`: http(s) URLs, file:// outside
--allowed-local-media-path, more than --max-images-per-request, bytes that are not an image."""

from __future__ import annotations

import base64
import io
import os

import httpx
import numpy as np
import pytest
import vl_reference as vr
from inprocess_server import serving
from PIL import Image

import sparrow
from sparrow.server.app import ServerState

MAX_FILE = 1 << 20  # the served --max-image-file-size


def _png(seed: int, w=100, h=70) -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _msgs(*urls, text="What is this?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_dir):
    folder = str(tmp_path_factory.mktemp("tiny_vl_served"))
    vr.build_tiny_vl(folder, tokenizer_dir)
    media = tmp_path_factory.mktemp("media")
    (media / "a.png").write_bytes(_png(1))
    os.mkfifo(media / "pipe.png")  # opening it for reading used to wait for a writer, for good
    with open(media / "big.png", "wb") as f:
        f.truncate(2 * MAX_FILE)  # sparse
    state = ServerState(
        allowed_local_media_path=str(media),
        max_images_per_request=2,
        max_image_bytes=MAX_FILE,
        max_pixels_per_request=20_000,
    )
    llm = sparrow.load(folder)
    with serving(state, llm) as base:
        yield base, llm, media


def _chat(base, messages, **kw):
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=600)


def test_data_url_answer_and_usage_match_the_api(served):
    base, llm, _ = served
    msgs = _msgs(_url(_png(2)), _url(_png(3, 40, 130)))
    r = _chat(base, msgs)
    assert r.status_code == 200, r.text
    ids = llm.prompt_ids(msgs)
    assert r.json()["usage"]["prompt_tokens"] == len(ids) and ids.count(vr.PAD) > 0
    want = "".join(llm.generate(msgs, chat=True, max_tokens=6))
    assert r.json()["choices"][0]["message"]["content"] == want
    t = httpx.post(base + "/tokenize", json={"messages": msgs}, timeout=600).json()
    assert t["count"] == len(ids) and t["tokens"] == ids


def test_allowed_local_file_url(served):
    base, llm, media = served
    r = _chat(base, _msgs(f"file://{media}/a.png"))
    assert r.status_code == 200, r.text
    same = _chat(base, _msgs(_url(_png(1))))
    assert r.json()["choices"][0]["message"]["content"] == same.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "urls, match, part",
    [
        (["https://example.com/cat.png"], "not fetched", 0),
        (["file:///etc/passwd"], "outside the allowed media path", 0),
        ([_url(_png(4))] * 3, "too many images: at most 2", 2),
        (["data:image/png;base64," + base64.b64encode(b"not a png").decode()], "not an image", 0),
        ([_url(_png(5)[:150])], "cannot decode image", 0),
        (["file://{media}/pipe.png"], "not a regular file (it is a FIFO)", 0),
        (["file://{media}"], "not a regular file (it is a directory)", 0),
        (["file://{media}/big.png"], f"over the limit of {MAX_FILE}", 0),
        (["file://{media}/a%00.png"], "NUL", 0),
        ([_url(_png(6, 120, 90)), _url(_png(7, 120, 90))], "over the limit of 20000 per request", 1),
    ],
)
def test_bad_images_are_400(served, urls, match, part):
    """Each a 400 naming the image part, answered at once (a FIFO used to block a worker thread
    for good, a big file was read whole, many large images were all decoded)."""
    r = _chat(served[0], _msgs(*(u.format(media=served[2]) for u in urls)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["param"] == f"messages[0].content[{part}]" and "\n" not in err["message"]


def test_nul_in_an_image_url_is_400_naming_it(served):
    r = _chat(served[0], _msgs(f"file://{served[2]}/a\x00.png"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
