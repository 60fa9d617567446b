"""Makes the README's two pictures of the web page: docs/img/webui-chat.png and webui-sparse.png.

A development script (not part of the package): it starts `sparrow serve` on the default model,
drives Debian's headless chromium with selenium (`apt-get install chromium chromium-driver`,
`pip install selenium`), and writes the PNGs.

    python docs/screenshots.py
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

OUT = Path(__file__).resolve().parent / "img"


def _server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", "serve", "--port", str(port)], stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(2400):
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not become ready")


def _browser(width, height):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def _until(check, timeout=300):
    deadline = time.time() + timeout
    while not (got := check()):
        if time.time() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.1)
    return got


def _ask(d, text):
    from selenium.webdriver.common.keys import Keys

    n = len(d.find_elements("css selector", ".msg.assistant"))
    box = d.find_element("id", "input")
    d.execute_script("arguments[0].value = arguments[1]", box, text)
    box.send_keys(Keys.ENTER)
    _until(lambda: len(d.find_elements("css selector", ".msg.assistant[data-finish]")) > n)


def _set(d, **fields):
    for name, value in fields.items():
        d.execute_script(
            "const e = document.getElementById(arguments[0]);"
            "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];",
            name.replace("_", "-"),
            value,
        )


def main():
    import sparrow
    from sparrow_lab.eval.prompts import make_prompt

    OUT.mkdir(exist_ok=True)
    proc, base = _server()
    try:
        d = _browser(1100, 1000)
        d.get(base + "/")
        _until(lambda: d.find_element("id", "model").get_attribute("data-ready"))
        _set(d, temperature="0", max_tokens="120")
        d.find_element("id", "settings-toggle").click()
        _ask(d, "Name three rivers in Europe, one line each.")
        _ask(d, "Which of them is the longest?")
        d.save_screenshot(str(OUT / "webui-chat.png"))
        d.quit()

        d = _browser(1100, 1400)
        d.get(base + "/")
        _until(lambda: d.find_element("id", "model").get_attribute("data-ready"))
        _set(d, temperature="0", max_tokens="12", sparse=True, sparse_k="32", sparse_trace=True)
        llm = sparrow.load()
        needle = make_prompt(llm.tokenizer, "needle", 2048, 0.5, 0, answer_prefix=False).messages[-1]["content"]
        _ask(d, needle)
        d.find_element("css selector", ".msg.assistant button.show-sparse").click()
        d.find_element("id", "sv-find").send_keys("favorite food is ramen")
        _until(lambda: d.find_element("id", "sv-block").get_attribute("data-block"))
        d.execute_script("document.getElementById('sparse-view').scrollIntoView({block: 'start'})")
        d.save_screenshot(str(OUT / "webui-sparse.png"))
        d.quit()
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"wrote {OUT / 'webui-chat.png'} and {OUT / 'webui-sparse.png'}")


if __name__ == "__main__":
    main()
