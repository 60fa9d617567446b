"""The chat page at / in a real browser: headless Debian chromium driven by selenium, against a
live `sparrow serve` (one server process and one browser for the module).

The browser tests skip only where chromium or chromedriver is not installed and
SPARROW_REQUIRE_BROWSER is unset; .ci/run installs both and sets it, so in CI a missing browser
fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from sparrow.server.app import ServerState, create_app
from sparrow.server.sparse_trace import decode

KEY = "sk-web-ui-test"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
INJECTION = '<img src=x onerror="window.__pwned=1"><b id="pwn">bold</b>'


# ---------------------------------------------------------------------- without a browser
def test_page_and_assets_served_without_key_and_off_with_no_web_ui():
    client = TestClient(create_app(ServerState(api_key=KEY)))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    for path, kind in (("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.content) > 1000
    assert client.get("/ui/missing.js").status_code == 401  # only the page's own files are public
    assert client.get("/ui/missing.js", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert client.get("/v1/models").status_code == 401  # the API still needs the key
    off = TestClient(create_app(ServerState(api_key=KEY, web_ui=False)))
    assert off.get("/").status_code == 401  # no page: / is an API path like any other
    assert TestClient(create_app(ServerState(web_ui=False))).get("/").status_code == 404
    from sparrow.cli import build_parser
    from sparrow.server.app import state_from_args

    assert state_from_args(build_parser().parse_args(["serve"])).web_ui
    assert not state_from_args(build_parser().parse_args(["serve", "--no-web-ui"])).web_ui
    # nothing in the page's files points outside the server
    html = page.text + client.get("/ui/app.js").text + client.get("/ui/style.css").text
    assert "http://" not in html and "https://" not in html and "//cdn" not in html


# ---------------------------------------------------------------------- the live server and browser
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chromium():
    """Skips (before a server starts) where the browser is not installed, unless CI requires it."""
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("SPARROW_REQUIRE_BROWSER"):
            pytest.fail("SPARROW_REQUIRE_BROWSER is set but chromium or chromedriver is missing")
        pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    pytest.importorskip("selenium")


@pytest.fixture(scope="module")
def server(chromium):
    port = _free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", "serve", "--port", str(port), "--api-key", KEY],
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited: {log.read()}")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not become ready"
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def chrome(width: int = 1280, height: int = 1000):
    """Headless Debian chromium with its performance log (every request the page makes)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.fixture(scope="module")
def browser(server):
    driver = chrome()
    driver.implicitly_wait(0)
    urls = []  # every URL the page requested, from the performance log
    driver.requested = urls
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(autouse=True)
def _drain_performance_log(request):
    """Reads the browser's request log after each test that used it (the log is a buffer)."""
    yield
    if "browser" in request.fixturenames:
        requests_seen(request.getfixturevalue("browser"))


def requests_seen(driver) -> list[str]:
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            driver.requested.append(msg["params"]["request"]["url"])
    return driver.requested


def wait(driver, condition, timeout: float = 120, what: str = "the condition"):
    deadline = time.time() + timeout
    while True:
        got = condition()
        if got:
            return got
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def by_id(driver, name):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def set_field(driver, name, value):
    """A settings control as a user leaves it (the settings form is opened by the test that needs it)."""
    driver.execute_script(
        "const e = document.getElementById(arguments[0]);"
        "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];"
        "e.dispatchEvent(new Event('change'));",
        name,
        value,
    )


def open_page(driver, server):
    """The page, loaded and past the key dialog (each test may run alone)."""
    if not driver.current_url.startswith(server):
        driver.get(server + "/")
    if not driver.execute_script("return sessionStorage.getItem('sparrow-api-key')"):
        wait(driver, lambda: by_id(driver, "key-dialog").get_attribute("open"))
        by_id(driver, "key-input").send_keys(KEY + "\n")
    wait(driver, lambda: by_id(driver, "model").get_attribute("data-ready"))


def new_chat(driver):
    by_id(driver, "new-chat").click()
    assert driver.find_elements("css selector", ".msg") == []


def last_answer(driver):
    return driver.find_elements("css selector", ".msg.assistant")[-1]


def finished(driver):
    """The last answer once it is complete: (its element, its finish)."""
    msg = last_answer(driver)
    finish = msg.get_attribute("data-finish")
    return (msg, finish) if finish else None


def type_message(driver, text: str):
    """Puts text in the message box (long prompts through the DOM, typing takes seconds) and
    presses Enter, as a keyboard user sends."""
    from selenium.webdriver.common.keys import Keys

    box = by_id(driver, "input")
    if len(text) > 200:
        driver.execute_script("arguments[0].value = arguments[1]", box, text)
        box.send_keys(Keys.END)
    else:
        box.send_keys(text)
    box.send_keys(Keys.ENTER)


def api_chat(server, body) -> dict:
    r = httpx.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_key_asked_once_then_model_name(server, browser):
    browser.get(server + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    dialog = wait(browser, lambda: by_id(browser, "key-dialog").get_attribute("open") and by_id(browser, "key-dialog"))
    by_id(browser, "key-input").send_keys(KEY + "\n")  # Enter submits: keyboard only
    model = wait(browser, lambda: by_id(browser, "model").get_attribute("data-ready") and by_id(browser, "model"))
    assert model.text.startswith("SmolLM2-135M-Instruct")
    assert not dialog.get_attribute("open")
    assert browser.execute_script("return sessionStorage.getItem('sparrow-api-key')") == KEY
    assert browser.execute_script("return localStorage.length") == 0  # kept in this tab's session only
    browser.refresh()  # the same tab: not asked again
    wait(browser, lambda: by_id(browser, "model").get_attribute("data-ready"))
    assert not by_id(browser, "key-dialog").get_attribute("open")


def test_streamed_answer_equals_the_api(server, browser):
    open_page(browser, server)
    settings = {"temperature": "0.8", "max-tokens": "40", "seed": "11"}
    for name, value in settings.items():
        set_field(browser, name, value)
    # every change of the answer's text, recorded in the page as it streams
    browser.execute_script(
        "window.__lengths = []; new MutationObserver(() => {"
        "  const c = document.querySelectorAll('.msg.assistant .content');"
        "  if (c.length) window.__lengths.push(c[c.length - 1].textContent.length);"
        "}).observe(document.getElementById('chat'), {subtree: true, childList: true, characterData: true});"
    )
    question = "Write two sentences about the sea."
    type_message(browser, question)
    msg, finish = wait(browser, lambda: finished(browser), what="the answer")
    shown = msg.find_element("css selector", ".content").text
    want = api_chat(
        server,
        {"messages": [{"role": "user", "content": question}], "temperature": 0.8, "max_tokens": 40, "seed": 11},
    )
    n_tokens, want = want["usage"]["completion_tokens"], want["choices"][0]
    assert finish == want["finish_reason"]
    assert shown  # rendered, not only in the DOM
    assert msg.find_element("css selector", ".content").get_attribute("textContent") == want["message"]["content"]
    lengths = browser.execute_script("return window.__lengths")
    partial = {n for n in lengths if 0 < n < len(want["message"]["content"])}
    assert len(partial) >= 3, lengths  # it appeared piece by piece, not at once
    stats = msg.find_element("css selector", ".stats").text
    assert "TTFT" in stats and "tok/s" in stats and f"{n_tokens} tokens" in stats
    # the second turn carries the first: the page sends the history
    type_message(browser, "Now one more.")
    wait(browser, lambda: len(browser.find_elements("css selector", ".msg.assistant")) == 2 and finished(browser))
    second = last_answer(browser).find_element("css selector", ".content").get_attribute("textContent")
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": want["message"]["content"]},
        {"role": "user", "content": "Now one more."},
    ]
    again = api_chat(server, {"messages": history, "temperature": 0.8, "max_tokens": 40, "seed": 11})
    assert second == again["choices"][0]["message"]["content"]


def test_stop_a_generation(server, browser):
    open_page(browser, server)
    new_chat(browser)
    set_field(browser, "max-tokens", "2000")
    set_field(browser, "seed", "")
    type_message(browser, "Write a very long story about a lighthouse keeper.")
    stop = wait(browser, lambda: by_id(browser, "stop").is_displayed() and by_id(browser, "stop"))
    content = last_answer(browser).find_element("css selector", ".content")
    wait(browser, lambda: len(content.get_attribute("textContent")) > 20, what="some text")
    stop.click()
    msg, finish = wait(browser, lambda: finished(browser))
    assert finish == "stopped"
    n = len(content.get_attribute("textContent"))
    time.sleep(0.5)
    assert len(content.get_attribute("textContent")) == n  # nothing more arrives
    assert "stopped" in msg.find_element("css selector", ".stats").text
    assert by_id(browser, "send").is_displayed() and not by_id(browser, "stop").is_displayed()
    # Escape stops too (keyboard)
    from selenium.webdriver.common.keys import Keys

    type_message(browser, "And another long one, please.")
    wait(browser, lambda: by_id(browser, "stop").is_displayed())
    # at once, not after some text: a random-seeded answer can end on its own while the test
    # waits for text (it did in a warm suite run); the mid-stream stop is checked above
    by_id(browser, "input").send_keys(Keys.ESCAPE)
    _, finish = wait(browser, lambda: finished(browser))
    assert finish == "stopped"
    # the server is not left generating: the next request is answered at once
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    assert api_chat(server, body)["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------- the sparse view
@pytest.fixture(scope="module")
def needle():
    """The article's needle prompt: ~2K tokens (65 blocks), "Zara's favorite food is ramen." at
    half depth."""
    import sparrow
    from sparrow_lab.eval.prompts import make_prompt

    llm = sparrow.load()
    p = make_prompt(llm.tokenizer, "needle", 2048, 0.5, 0, answer_prefix=False)
    return p.messages[-1]["content"]


def _api_needle(server, text, k):
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
        "sparse_attn": True,
        "sparse_k": k,
        "sparse_trace": True,
    }
    tr = api_chat(server, body)["choices"][0]["sparse_trace"]
    block = next(b for b, t in enumerate(tr["prompt_blocks"]) if "favorite food is ramen" in t)
    codes = decode(tr["steps"][1], len(tr["layers"]), tr["heads"])  # [layers, heads, blocks]
    return block, (codes[:, :, block] >= 0).sum(axis=1)  # heads of each layer that read it


def _page_needle(browser, text, k):
    """Asks through the page with sparse attention at k; the per-layer heads the sparse view shows
    for the block that `find` locates, and the grid's pixel colours there."""
    new_chat(browser)
    for name, value in (("temperature", "0"), ("max-tokens", "4"), ("seed", ""), ("sparse-k", str(k))):
        set_field(browser, name, value)
    set_field(browser, "sparse", True)
    set_field(browser, "sparse-trace", True)
    type_message(browser, text)
    msg, finish = wait(browser, lambda: finished(browser), what="the needle answer")
    msg.find_element("css selector", "button.show-sparse").click()
    view = by_id(browser, "sparse-view")
    assert view.is_displayed()
    assert by_id(browser, "sv-token").get_attribute("value") == "1"  # the first decoded token
    find = by_id(browser, "sv-find")
    find.clear()
    find.send_keys("favorite food is ramen")
    block = int(wait(browser, lambda: by_id(browser, "sv-block").get_attribute("data-block")))
    assert "favorite food is ramen." in by_id(browser, "sv-block-text").get_attribute("textContent")
    heads = [
        int(li.get_attribute("data-heads")) for li in by_id(browser, "sv-layers").find_elements("css selector", "li")
    ]
    return block, np.array(heads)


def _grid_cell(browser, layer: int, head: int, block: int) -> list[int]:
    """RGB of one cell of the grid canvas, at the geometry the page gives its canvas."""
    return browser.execute_script(
        "const c = document.getElementById('sv-grid'); const d = c.dataset;"
        "const H = arguments[1], w = +d.cellW, h = +d.rowH, g = +d.gap;"
        "const x = +d.x0 + arguments[3] * w + Math.floor(w / 2), y = arguments[0] * (H * h + g) + arguments[2] * h + 1;"
        "return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3));",
        layer,
        9,
        head,
        block,
    )


UNREAD = [0xE7, 0xE5, 0xE4]


def test_sparse_view_shows_the_needle_block_read_at_k32_not_at_k1(server, browser, needle):
    api_block, api32 = _api_needle(server, needle, 32)
    _, api1 = _api_needle(server, needle, 1)
    open_page(browser, server)
    layer = int(np.argmax(api32 * (api1 == 0)))
    assert api32[layer] > 0 and api1[layer] == 0  # the API shows it: the page must too
    block, page32 = _page_needle(browser, needle, 32)
    assert block == api_block
    assert page32.tolist() == api32.tolist()  # the page decodes the trace as the server's reader does
    head = next(h for h in range(9) if _grid_cell(browser, layer, h, block) != UNREAD)
    assert _grid_cell(browser, layer, head, block) in ([0xD9, 0x77, 0x06], [0x25, 0x63, 0xEB], [0x16, 0xA3, 0x4A])
    # keyboard: the grid takes focus, arrows move its cursor, Enter shows the block under it
    from selenium.webdriver.common.keys import Keys

    grid = by_id(browser, "sv-grid")
    grid.send_keys(Keys.ARROW_RIGHT)
    grid.send_keys(Keys.ENTER)
    assert int(by_id(browser, "sv-block").get_attribute("data-block")) == block + 1
    assert f"block {block + 1}" in by_id(browser, "sv-hover").text
    _, page1 = _page_needle(browser, needle, 1)
    assert page1.tolist() == api1.tolist() and page1[layer] == 0
    assert all(_grid_cell(browser, layer, h, block) == UNREAD for h in range(9))


def test_sparse_view_shows_the_budget_each_head_took(server, browser, needle):
    """v3 with top-p (on 4-bit key codes): each head reads what its attention needs; the page says
    how many blocks the heads read at a token, as the server's trace counts them."""
    body = {
        "messages": [{"role": "user", "content": needle}],
        "max_tokens": 3,
        "temperature": 0,
        "sparse_attn": True,
        "sparse_select": "v3",
        "sparse_p": 0.5,
        "sparse_key_bits": 4,
        "sparse_trace": True,
    }
    tr = api_chat(server, body)["choices"][0]["sparse_trace"]
    assert tr["p"] == 0.5
    counts = (decode(tr["steps"][1], len(tr["layers"]), tr["heads"]) >= 0).sum(axis=2)  # [layers, heads]
    assert counts.min() < counts.max() <= 32  # budgets differ between heads
    open_page(browser, server)
    new_chat(browser)
    for name, value in (("temperature", "0"), ("max-tokens", "3"), ("seed", ""), ("sparse-k", "32")):
        set_field(browser, name, value)
    set_field(browser, "sparse", True)
    set_field(browser, "sparse-trace", True)
    set_field(browser, "sparse-select", "v3")
    set_field(browser, "sparse-p", "0.5")
    set_field(browser, "sparse-key-bits", "4")
    browser.execute_script(  # what the page sends, passed on unchanged
        "window.realFetch = window.fetch; window.sentBodies = [];"
        "window.fetch = (url, opts) => { if (url.endsWith('/v1/chat/completions')) window.sentBodies.push(opts.body);"
        "  return window.realFetch(url, opts); };"
    )
    type_message(browser, needle)
    msg, _ = wait(browser, lambda: finished(browser), what="the v3 answer")
    sent = json.loads(browser.execute_script("window.fetch = window.realFetch; return window.sentBodies.pop()"))
    assert {k: sent[k] for k in ("sparse_select", "sparse_p", "sparse_key_bits")} == {
        "sparse_select": "v3",
        "sparse_p": 0.5,
        "sparse_key_bits": 4,
    }
    msg.find_element("css selector", "button.show-sparse").click()
    label = by_id(browser, "sv-token-label").text
    want = f"heads read {counts.min()}\u2013{counts.max()} blocks, {counts.mean():.1f} on average"
    assert want in label, (want, label)
    set_field(browser, "sparse-select", "seed")  # as the other tests expect the form
    set_field(browser, "sparse-p", "")
    set_field(browser, "sparse-key-bits", "8")


# ---------------------------------------------------------------------- robustness
def test_model_output_is_never_html(server, browser):
    """The model's text, reasoning and the prompt's text come back as text: the answer stream is
    replaced in the page's fetch (the network as the page sees it) with chunks holding markup;
    innerHTML would make elements of them."""
    open_page(browser, server)
    new_chat(browser)
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "think " + INJECTION}}]},
        {"choices": [{"index": 0, "delta": {"content": "Here: " + INJECTION}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    browser.execute_script(
        "const real = window.fetch, body = arguments[0];"
        "window.fetch = (url, opts) => url.endsWith('/v1/chat/completions')"
        "  ? Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}))"
        "  : real(url, opts);",
        sse,
    )
    type_message(browser, "Say " + INJECTION)
    msg, _ = wait(browser, lambda: finished(browser))
    assert msg.find_element("css selector", ".content").get_attribute("textContent") == "Here: " + INJECTION
    reasoning = msg.find_element("css selector", "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded away
    assert reasoning.find_element("css selector", ".text").get_attribute("textContent") == "think " + INJECTION
    user = browser.find_elements("css selector", ".msg.user .content")[-1]
    assert user.get_attribute("textContent") == "Say " + INJECTION
    assert browser.find_elements("css selector", "#chat img, #pwn") == []
    assert browser.execute_script("return window.__pwned") is None


def test_prompt_text_in_the_sparse_view_is_never_html(server, browser):
    """The real server path: the prompt's blocks and the tokens come back in sparse_trace."""
    browser.refresh()
    wait(browser, lambda: by_id(browser, "model").get_attribute("data-ready"))
    for name, value in (("temperature", "0"), ("max-tokens", "3"), ("seed", ""), ("sparse-k", "1")):
        set_field(browser, name, value)
    set_field(browser, "sparse", True)
    type_message(browser, "Repeat this: " + INJECTION)
    msg, _ = wait(browser, lambda: finished(browser))
    msg.find_element("css selector", "button.show-sparse").click()
    by_id(browser, "sv-find").send_keys("onerror")
    wait(browser, lambda: by_id(browser, "sv-block").get_attribute("data-block"))
    assert 'onerror="window.__pwned=1"><b id="pwn">' in by_id(browser, "sv-block-text").get_attribute("textContent")
    assert browser.find_elements("css selector", "#sparse-view img, #pwn, #chat img") == []
    assert browser.execute_script("return window.__pwned") is None


def test_image_is_sent_as_a_data_url(server, browser, tmp_path):
    """An attached image goes out as an image_url part holding a data: URL; the default model is
    text-only, so the server's 400 for that part comes back into the answer."""
    from PIL import Image

    open_page(browser, server)
    new_chat(browser)
    path = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(path)
    by_id(browser, "file").send_keys(str(path))
    thumb = wait(browser, lambda: browser.find_elements("css selector", "#attachments img"))[0]
    url = thumb.get_attribute("src")
    assert url.startswith("data:image/png;base64,")
    type_message(browser, "What colour is this?")
    msg, finish = wait(browser, lambda: finished(browser))
    assert finish == "error"
    assert "must be a text part" in msg.find_element("css selector", ".error").text
    sent = browser.find_elements("css selector", ".msg.user img")[-1]
    assert sent.get_attribute("src") == url
    assert browser.find_elements("css selector", "#attachments img") == []  # sent, so no longer waiting


def test_narrow_width_and_keyboard_settings(server, browser):
    from selenium.webdriver.common.keys import Keys

    browser.set_window_size(360, 800)
    try:
        browser.refresh()
        wait(browser, lambda: by_id(browser, "model").get_attribute("data-ready"))
        toggle = by_id(browser, "settings-toggle")
        toggle.send_keys(Keys.ENTER)  # a button: Enter opens the settings
        assert by_id(browser, "settings").is_displayed() and toggle.get_attribute("aria-expanded") == "true"
        wide = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert wide <= 0, f"the page is {wide} px wider than a 360 px window"
        for name in ("input", "send", "settings-toggle", "temperature"):
            rect = browser.execute_script("return arguments[0].getBoundingClientRect().toJSON()", by_id(browser, name))
            assert 0 <= rect["left"] and rect["right"] <= 360, (name, rect)
        toggle.send_keys(Keys.ENTER)
        assert not by_id(browser, "settings").is_displayed()
    finally:
        browser.set_window_size(1280, 1000)


def test_no_request_leaves_the_server(server, browser):
    """Last: over everything the tests above made the page do."""
    urls = requests_seen(browser)
    assert any(u.endswith("/v1/chat/completions") for u in urls) and any(u.endswith("/ui/app.js") for u in urls)
    outside = [u for u in urls if not (u.startswith(server + "/") or u.startswith("data:"))]
    assert outside == []
