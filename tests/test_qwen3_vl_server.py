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
from sparrow.server.local_media import REFUSED

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


# ---------------------------------------------------------------------- issue 69
# file:// is decided from the path before anything opens it (sparrow/server/local_media.py, unit
# tests in tests/test_server_local_media.py); images through /v1/messages and /v1/responses.
OUTSIDE = ["/etc/passwd", "/etc/no-such-file", "/root", "/dev/zero", "/dev/null", "/proc/self/environ"]


def test_server_answers_outside_paths_alike(served):
    base, _, media = served
    answers = set()
    for path in OUTSIDE + [f"{media}/../a.png"]:
        for route, body in (
            ("/v1/chat/completions", {"max_tokens": 1}),
            ("/tokenize", {}),
        ):
            msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}}]}]
            r = httpx.post(base + route, json={"messages": msgs, **body}, timeout=300)
            assert r.status_code == 400, r.text
            answers.add((r.json()["error"]["message"], r.json()["error"]["param"]))
    assert answers == {(REFUSED, "messages[0].content[0]")}
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{media}/a.png"}}]}]
    assert httpx.post(base + "/tokenize", json={"messages": msgs}, timeout=300).status_code == 200


def test_images_through_the_new_apis_equal_chat(served):
    """An image as an Anthropic image block and as a Responses input_image (a data URL, or a
    file:// URL inside the folder) answers as the chat endpoint does; outside, the same refusal."""
    import base64

    import anthropic
    import openai

    base, _, media = served
    data = base64.b64encode(_png(2)).decode()
    url = "data:image/png;base64," + data
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    want = httpx.post(base + "/v1/chat/completions", json={"messages": chat, "max_tokens": 4, "temperature": 0},
                      timeout=300).json()  # fmt: skip
    text = want["choices"][0]["message"]["content"]
    name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    a = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=300)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    ask = [{"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}]
    m = a.messages.create(model=name, max_tokens=4, extra_body={"temperature": 0}, messages=ask)
    assert m.content[0].text == text and m.usage.input_tokens == want["usage"]["prompt_tokens"]
    o = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    for image in (url, f"file://{media}/b.png"):
        if image.startswith("file:"):
            (media / "b.png").write_bytes(_png(2))
        parts = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": "What is this?"}]
        r = o.responses.create(model=name, input=[{"role": "user", "content": parts}], max_output_tokens=4,
                               temperature=0)  # fmt: skip
        assert r.output_text == text
    outside = {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=name, max_tokens=4, messages=[{"role": "user", "content": [outside]}])
    assert e.value.body["error"]["message"] == REFUSED
