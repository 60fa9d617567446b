"""Turning an image reference into a checked PIL image, with one-line errors.

Accepted: a PIL image, raw bytes, a local path, a `data:image/...;base64,...` URL, and
`file://` URLs (only under an allowed folder when one is required, as the server does).
http(s) URLs are refused: sparrow has no network at run time.

A local file is opened first and what was opened is checked, never the path before opening it
(a symlink flipped between the check and the open would let the open reach any file): it must
be a regular file (a FIFO or a device is opened without blocking and refused, so no thread waits
on one), its real path must lie under the allowed folder, and its size must be at most
MAX_IMAGE_BYTES, all before a byte is read. Each image's pixels are read from its header and
counted against the request's PixelBudget before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
import warnings
from dataclasses import dataclass

from ..errors import SparrowError

MAX_IMAGE_PIXELS = 40_000_000  # decoded size limit (a decompression bomb is refused before decoding)
DEFAULT_MAX_IMAGES = 16  # images per prompt unless the caller says otherwise
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a local image file's size limit, checked before reading it
# All images of one request together (from their headers, before decoding): sixteen images of 39.6
# megapixels took 11.8 s and 575 MiB to decode; 64 megapixels decode to ~190 MB of RGB.
MAX_PIXELS_PER_REQUEST = 64_000_000


@dataclass(frozen=True)
class MediaRules:
    """Where a prompt's images may come from and how much of them, built once by the caller:
    the Python API's defaults, or a server's flags."""

    allowed_local_path: str | None = None  # local files only under this folder (None: anywhere)
    local_files: bool = True  # False: file paths are refused (the server reads file:// itself, local_media.py)
    max_images: int | None = None  # per prompt (None: the LLM's max_images)
    max_image_bytes: int | None = None  # a local image file's size limit (None: MAX_IMAGE_BYTES)
    max_pixels: int | None = MAX_PIXELS_PER_REQUEST  # the images' pixels together (None: no limit)


class PixelBudget:
    """The pixels one request's images may hold together; spent from each header before decoding."""

    def __init__(self, limit: int | None = MAX_PIXELS_PER_REQUEST):
        self.limit, self.used = limit, 0

    def spend(self, width: int, height: int) -> None:
        self.used += width * height
        if self.limit is not None and self.used > self.limit:
            raise SparrowError(
                f"the request's images hold {self.used} pixels or more, over the limit of {self.limit} per request"
            )


def image_from_url(
    url: str,
    allowed_local_path: str | None = None,
    local_files: bool = False,
    max_bytes: int | None = None,
    budget: PixelBudget | None = None,
):
    """A data URL, or file:// when local_files or under allowed_local_path -> PIL image."""
    if not isinstance(url, str) or not url:
        raise SparrowError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return image_from_bytes(_data_url_bytes(url), budget)
    if scheme in ("http", "https"):
        raise SparrowError(
            "image URLs are not fetched (the server has no network): send the image as a base64 data URL"
        )
    if scheme == "file":
        path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
        if not local_files and allowed_local_path is None:
            raise SparrowError("file:// image URLs are disabled (start the server with --allowed-local-media-path)")
        root = None if local_files else allowed_local_path
        return image_from_bytes(read_image_file(path, root, max_bytes), budget)
    raise SparrowError(f"unsupported image URL scheme {scheme or url[:16]!r}: use a data:image/...;base64 URL")


def image_from_path(path: str, max_bytes: int | None = None, budget: PixelBudget | None = None):
    return image_from_bytes(read_image_file(path, None, max_bytes), budget)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def read_image_file(path: str, allowed_root: str | None = None, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at path, at most max_bytes (None: MAX_IMAGE_BYTES); with
    allowed_root, only when the file opened lies under it (symlinks resolved)."""
    max_bytes = MAX_IMAGE_BYTES if max_bytes is None else max_bytes
    if "\x00" in path:
        raise SparrowError("an image path may not hold a NUL character")
    # O_NONBLOCK: opening a FIFO would otherwise wait for a writer, for good; regular files ignore it
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise SparrowError(f"cannot read image {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "a device")
            raise SparrowError(f"image {path} is not a regular file (it is {kind})")
        if allowed_root is not None:
            _check_under(fd, st, path, allowed_root)
        if st.st_size > max_bytes:
            raise SparrowError(f"image file {path} is {st.st_size} bytes, over the limit of {max_bytes}")
        data = _read_fd(fd, max_bytes + 1)  # the file may have grown since fstat
        if len(data) > max_bytes:
            raise SparrowError(f"image file {path} is over the limit of {max_bytes} bytes")
        return data
    except OSError as e:
        raise SparrowError(f"cannot read image {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _check_under(fd: int, st: os.stat_result, path: str, allowed_root: str) -> None:
    """The file open as fd lies under allowed_root. Linux names an open file's real path in
    /proc/self/fd; elsewhere the path is resolved again and must lead to the same file (device
    and inode) as fd."""
    root = os.path.realpath(allowed_root)
    proc = f"/proc/self/fd/{fd}"
    if os.path.islink(proc):
        real = os.path.realpath(proc)
    else:
        real = os.path.realpath(path)
        try:
            now = os.stat(real)
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise SparrowError(f"image {path} changed while it was opened")
    if os.path.commonpath([root, real]) != root:
        raise SparrowError(f"file:// image path is outside the allowed media path {allowed_root}")


def _read_fd(fd: int, limit: int) -> bytes:
    chunks, n = [], 0
    while n < limit:
        chunk = os.read(fd, min(1 << 20, limit - n))
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


def image_from_bytes(data: bytes, budget: PixelBudget | None = None):
    """Decodes and fully loads the image (so a truncated file fails here, not later); its pixels
    are spent from budget, read from the header, before decoding."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise SparrowError("image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))  # reads the header only
            check_image(im, budget)
            im.load()
    except SparrowError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise SparrowError(f"image is too large (over {MAX_IMAGE_PIXELS} pixels)") from None
    except UnidentifiedImageError:
        raise SparrowError("not an image (Pillow cannot identify the data; PNG, JPEG and WebP are supported)") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise SparrowError(f"cannot decode image: {' '.join(str(e).split())}") from None
    return im


def check_image(im, budget: PixelBudget | None = None) -> None:
    w, h = im.size
    if w < 1 or h < 1:
        raise SparrowError(f"image has zero size ({w}x{h})")
    if w * h > MAX_IMAGE_PIXELS:
        raise SparrowError(f"image is too large: {w}x{h} is over {MAX_IMAGE_PIXELS} pixels")
    if budget is not None:
        budget.spend(w, h)


def load_image(
    src,
    allowed_local_path: str | None = None,
    local_files: bool = True,
    max_bytes: int | None = None,
    budget: PixelBudget | None = None,
):
    """Any accepted reference (see module doc) -> a checked PIL image."""
    from PIL import Image

    if isinstance(src, Image.Image):
        check_image(src, budget)
        return src
    if isinstance(src, (bytes, bytearray, memoryview)):
        return image_from_bytes(bytes(src), budget)
    if isinstance(src, os.PathLike) or (isinstance(src, str) and ":" not in src.split("/", 1)[0]):
        if not local_files:
            raise SparrowError("local image paths are not accepted here")
        return image_from_path(os.fspath(src), max_bytes, budget)
    if isinstance(src, str):
        return image_from_url(src, allowed_local_path, local_files, max_bytes, budget)
    raise SparrowError(
        f"unsupported image value of type {type(src).__name__}: give a path, bytes, a PIL image or a data URL"
    )


def _data_url_bytes(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
        raise SparrowError("a data URL must look like data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise SparrowError("the image data URL holds invalid base64") from None
