"""file:// images under --allowed-local-media-path, read without telling anything about the
rest of the file system.

Inside or outside is decided from the path alone, before any system call touches it: the path
is normalised (`.`, `..`, repeated slashes) and must lie under the allowed folder as configured
or as resolved. Every path outside gets one error text (REFUSED), whatever exists there: a
file, a directory, a device or nothing (the old code opened first and its errors said which).

A path inside is then walked from the folder one component at a time, each opened with
O_NOFOLLOW relative to the directory before it, so no symlink (and no race that swaps one in)
can lead the walk outside. A symlink met on the way is read with readlink (it lies inside),
its target put in its place and the path checked again as above: a link that stays inside is
followed, one that leads outside is REFUSED. The last component is looked at (fstatat, no
follow) before it is opened, so a FIFO or a device is never opened, and checked again once
open (the same file, a regular one, at most max_bytes) before a byte is read.

The server reads file:// parts here and hands the vision code the bytes (`resolve`), so the
media module's own file:// reading is never reached with a request's path.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import urllib.parse

from ..errors import SparrowError
from ..vision.media import DEFAULT_MAX_IMAGES, MAX_IMAGE_BYTES

REFUSED = "file:// image path is outside the allowed media path"
DISABLED = "file:// image URLs are disabled (start the server with --allowed-local-media-path)"
MAX_LINKS = 40  # symlinks followed in one path (Linux's own limit)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FILE = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
_FILE |= getattr(os, "O_CLOEXEC", 0)


def _refused() -> SparrowError:
    return SparrowError(REFUSED)


def _relative(path: str, roots: tuple[str, ...]) -> tuple[str, str] | None:
    """(the root, path relative to it) when the normalised path lies under one of roots."""
    if not path.startswith("/"):
        return None
    norm = posixpath.normpath("/" + path.lstrip("/"))  # "//x" stays "//x" in normpath: one slash
    for root in roots:
        if norm == root:
            return root, ""
        if norm.startswith(root.rstrip("/") + "/"):
            return root, norm[len(root.rstrip("/")) + 1 :]
    return None


def _roots(allowed: str) -> tuple[str, ...]:
    """The folder as configured (normalised) and as resolved: a client may name either."""
    given = posixpath.normpath(os.path.abspath(allowed))
    real = os.path.realpath(allowed)
    return (real,) if given == real else (real, given)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a device")


def read_under(allowed: str, path: str, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at path (a file:// URL's decoded path), which must lie under
    the folder `allowed`; at most max_bytes (None: vision.media.MAX_IMAGE_BYTES)."""
    max_bytes = MAX_IMAGE_BYTES if max_bytes is None else max_bytes
    if "\x00" in path:
        raise SparrowError("an image path may not hold a NUL character")
    roots = _roots(allowed)
    real_root = roots[0]
    where = _relative(path, roots)
    if where is None:  # decided before any system call on the path
        raise _refused()
    shown = path  # the client's own path, named in errors about what lies inside
    rest = [p for p in where[1].split("/") if p]
    links = 0
    while True:  # one walk from the folder; a symlink restarts it with its target in its place
        done, rest, links = _walk(real_root, roots, rest, links, max_bytes, shown)
        if done is not None:
            return done


def _walk(real_root, roots, parts, links, max_bytes, shown):
    """Walks parts from the folder: (the file's bytes, ...) or (None, the parts to walk again
    after a symlink was replaced by its target, links followed so far)."""
    fd = os.open(real_root, _DIR)
    try:
        if not parts:
            raise SparrowError(f"image {shown} is not a regular file (it is a directory)")
        walked: list[str] = []
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as e:
                raise SparrowError(f"cannot read image {shown}: {e.strerror or e}") from None
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise SparrowError(f"cannot read image {shown}: too many levels of symbolic links")
                target = os.readlink(name, dir_fd=fd)
                base = "/".join([real_root.rstrip("/"), *walked])
                joined = posixpath.join(base, target, *parts[i + 1 :])  # an absolute target replaces base
                where = _relative(joined, roots)
                if where is None:
                    raise _refused()
                return None, [p for p in where[1].split("/") if p], links
            if not last:
                if not stat.S_ISDIR(st.st_mode):
                    raise SparrowError(f"cannot read image {shown}: {os.strerror(errno.ENOTDIR)}")
                nxt = os.open(name, _DIR | _NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nxt
                walked.append(name)
                continue
            if not stat.S_ISREG(st.st_mode):  # a FIFO or a device is never opened
                raise SparrowError(f"image {shown} is not a regular file (it is {_kind(st.st_mode)})")
            if st.st_size > max_bytes:
                raise SparrowError(f"image file {shown} is {st.st_size} bytes, over the limit of {max_bytes}")
            return _read_file(fd, name, st, max_bytes, shown), None, links
        raise AssertionError("unreachable")
    except OSError as e:  # a component swapped while walking (ELOOP, ENOTDIR, ...)
        raise SparrowError(f"cannot read image {shown}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _read_file(dir_fd: int, name: str, seen: os.stat_result, max_bytes: int, shown: str) -> bytes:
    fd = os.open(name, _FILE, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino) or not stat.S_ISREG(st.st_mode):
            raise SparrowError(f"image {shown} changed while it was opened")
        if st.st_size > max_bytes:
            raise SparrowError(f"image file {shown} is {st.st_size} bytes, over the limit of {max_bytes}")
        chunks, n = [], 0
        while n <= max_bytes:  # the file may have grown since fstat
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > max_bytes:
            raise SparrowError(f"image file {shown} is over the limit of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _file_path(value) -> str | None:
    """The decoded path of a file:// URL, else None."""
    if not isinstance(value, str) or value[:5].lower() != "file:":
        return None
    parsed = urllib.parse.urlparse(value)
    if parsed.netloc not in ("", "localhost"):
        return ""  # another host's path: outside, whatever it names
    return urllib.parse.unquote(parsed.path)


def resolve(messages: list[dict], allowed: str | None, max_bytes: int | None, max_images: int | None) -> list[dict]:
    """messages with each file:// image part replaced by {"type": "image", "image": <bytes>},
    read under `allowed` (None: file:// is refused). Image parts past max_images (None: the
    vision default) are refused before any file is read. An error names its part in `param`."""
    limit = DEFAULT_MAX_IMAGES if max_images is None else max_images
    out, seen = [], 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image", "image_url"):
                parts.append(part)
                continue
            seen += 1
            ref = part.get("image_url") if kind == "image_url" else part.get("image")
            url = ref.get("url") if isinstance(ref, dict) else ref
            path = _file_path(url)
            try:
                if seen > limit:
                    raise SparrowError(f"too many images: at most {limit} per request")
                if path is None:
                    parts.append(part)
                    continue
                if allowed is None:
                    raise SparrowError(DISABLED)
                parts.append({"type": "image", "image": read_under(allowed, path, max_bytes)})
            except SparrowError as e:
                e.param = f"messages[{i}].content[{j}]"
                raise
        out.append({**m, "content": parts})
    return out
