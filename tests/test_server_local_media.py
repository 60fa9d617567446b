"""--allowed-local-media-path is decided from the path before anything opens or stats it (issue 69,
fault 2): every path outside gets one error text, whatever exists there (a file, nothing, a
directory, a device), and nothing outside is opened. Inside, files are read walking from the
folder with O_NOFOLLOW; symlinks that stay inside are followed, those that lead out refused."""

from __future__ import annotations

import os
import threading

import pytest

from sparrow.errors import SparrowError
from sparrow.server import local_media
from sparrow.server.local_media import REFUSED, read_under, resolve

OUTSIDE = ["/etc/passwd", "/etc/no-such-file", "/root", "/dev/zero", "/dev/null", "/proc/self/environ"]


@pytest.fixture
def folder(tmp_path):
    inside = tmp_path / "media"
    (inside / "sub").mkdir(parents=True)
    (inside / "a.png").write_bytes(b"png-a")
    (inside / "sub" / "b.png").write_bytes(b"png-b")
    (tmp_path / "secret.png").write_bytes(b"secret")
    return inside


def _error(fn) -> str:
    with pytest.raises(SparrowError) as e:
        fn()
    return str(e.value)


def test_every_outside_path_gets_one_error_before_any_system_call(folder, monkeypatch):
    calls = []
    for name in ("open", "stat", "lstat", "readlink", "listdir", "scandir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _n=name, _r=real, **kw: calls.append((_n, a)) or _r(*a, **kw))
    tricks = [
        *OUTSIDE,
        f"{folder}/../secret.png",
        f"{folder}/sub/../../secret.png",
        f"{folder}-sibling/a.png",
        f"{folder}/./../media/../secret.png",
        "//etc/passwd",
        "relative/a.png",
        "",
    ]
    texts = set()
    for path in tricks:
        calls.clear()
        texts.add(_error(lambda p=path: read_under(str(folder), p)))
        touched = [c for c in calls if any(str(a).startswith(("/etc", "/root", "/dev", "/proc")) for a in c[1])]
        assert not touched, (path, calls)
        assert not any(c[0] == "open" for c in calls if str(folder) not in str(c[1][0])), (path, calls)
    assert texts == {REFUSED}


def test_outside_urls_answer_alike_through_resolve(folder):
    texts = set()
    for path in OUTSIDE + ["//otherhost/etc/passwd"]:
        url = "file://" + path if not path.startswith("//") else "file:" + path
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(SparrowError) as e:
            resolve(msgs, str(folder), None, None)
        assert e.value.param == "messages[0].content[0]"
        texts.add(str(e.value))
    assert texts == {REFUSED}


def test_inside_files_are_read_and_links_followed_only_inside(folder, tmp_path):
    assert read_under(str(folder), f"{folder}/a.png") == b"png-a"
    assert read_under(str(folder), f"{folder}//sub/./b.png") == b"png-b"
    (folder / "ok.png").symlink_to(folder / "a.png")
    (folder / "rel.png").symlink_to("sub/b.png")
    (folder / "subdir").symlink_to("sub")
    assert read_under(str(folder), f"{folder}/ok.png") == b"png-a"
    assert read_under(str(folder), f"{folder}/rel.png") == b"png-b"
    assert read_under(str(folder), f"{folder}/subdir/b.png") == b"png-b"
    (folder / "out.png").symlink_to(tmp_path / "secret.png")
    (folder / "up.png").symlink_to("../secret.png")
    (folder / "etc").symlink_to("/etc")
    (folder / "loop.png").symlink_to("loop.png")
    for name in ("out.png", "up.png", "etc/passwd"):
        assert _error(lambda n=name: read_under(str(folder), f"{folder}/{n}")) == REFUSED
    assert "symbolic links" in _error(lambda: read_under(str(folder), f"{folder}/loop.png"))
    # the folder named through a symlink to it is the same folder
    alias = tmp_path / "alias"
    alias.symlink_to(folder)
    assert read_under(str(alias), f"{folder}/a.png") == read_under(str(alias), f"{alias}/a.png") == b"png-a"


def test_inside_non_files_are_refused_without_opening(folder, monkeypatch):
    os.mkfifo(folder / "pipe.png")
    opened = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **kw: opened.append(p) or real(p, *a, **kw))
    result = {}
    pipe = f"{folder}/pipe.png"
    t = threading.Thread(target=lambda: result.setdefault("e", _error(lambda: read_under(str(folder), pipe))))
    t.start()
    t.join(10)
    assert not t.is_alive(), "a FIFO blocked"
    assert "not a regular file (it is a FIFO)" in result["e"] and "pipe.png" not in opened
    assert "it is a directory" in _error(lambda: read_under(str(folder), f"{folder}/sub"))
    assert "it is a directory" in _error(lambda: read_under(str(folder), str(folder)))
    assert "No such file" in _error(lambda: read_under(str(folder), f"{folder}/none.png"))
    assert "Not a directory" in _error(lambda: read_under(str(folder), f"{folder}/a.png/x"))
    assert "NUL" in _error(lambda: read_under(str(folder), f"{folder}/a\x00.png"))
    with open(folder / "big.png", "wb") as f:
        f.truncate(1000)
    assert "over the limit of 999" in _error(lambda: read_under(str(folder), f"{folder}/big.png", 999))


def test_resolve_replaces_file_parts_with_bytes_and_counts_images(folder):
    url = {"type": "image_url", "image_url": {"url": f"file://{folder}/a.png"}}
    data = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [url, {"type": "text", "text": "x"}, data]}]
    out = resolve(msgs, str(folder), None, 4)
    assert out[1]["content"] == [{"type": "image", "image": b"png-a"}, msgs[1]["content"][1], data]
    assert msgs[1]["content"][0] is url  # the request's own messages are left as they were
    with pytest.raises(SparrowError, match="disabled") as e:
        resolve(msgs, None, None, None)
    many = [{"role": "user", "content": [url] * 3}]
    with pytest.raises(SparrowError, match="too many images: at most 2") as e:
        resolve(many, str(folder), None, 2)
    assert e.value.param == "messages[0].content[2]"
    assert local_media.resolve([{"role": "user", "content": "x"}], None, None, None) == [
        {"role": "user", "content": "x"}
    ]


# Through the server (the tiny Qwen3-VL): tests/test_qwen3_vl_server.py, which shares its model.
