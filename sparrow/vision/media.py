"""Turning an image reference into a checked PIL image, with one-line errors.

Accepted: a PIL image, raw bytes, a local path, a `data:image/...;base64,...` URL, and
`file://` URLs (only under an allowed folder when one is required, as the server does).
http(s) URLs are refused: sparrow has no network at run time.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import warnings

from ..errors import SparrowError

MAX_IMAGE_PIXELS = 40_000_000  # decoded size limit (a decompression bomb is refused before decoding)
DEFAULT_MAX_IMAGES = 16  # images per prompt unless the caller says otherwise


def image_from_url(url: str, allowed_local_path: str | None = None, local_files: bool = False):
    """A data URL, or file:// when local_files or under allowed_local_path -> PIL image."""
    if not isinstance(url, str) or not url:
        raise SparrowError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return image_from_bytes(_data_url_bytes(url))
    if scheme in ("http", "https"):
        raise SparrowError(
            "image URLs are not fetched (the server has no network): send the image as a base64 data URL"
        )
    if scheme == "file":
        path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
        if not local_files:
            if allowed_local_path is None:
                raise SparrowError("file:// image URLs are disabled (start the server with --allowed-local-media-path)")
            root = os.path.realpath(allowed_local_path)
            real = os.path.realpath(path)
            if os.path.commonpath([root, real]) != root:
                raise SparrowError(f"file:// image path is outside the allowed media path {allowed_local_path}")
        return image_from_path(path)
    raise SparrowError(f"unsupported image URL scheme {scheme or url[:16]!r}: use a data:image/...;base64 URL")


def image_from_path(path: str):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SparrowError(f"cannot read image {path}: {e.strerror or e}") from None
    return image_from_bytes(data)


def image_from_bytes(data: bytes):
    """Decodes and fully loads the image (so a truncated file fails here, not later)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise SparrowError("image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            check_image(im)
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


def check_image(im) -> None:
    w, h = im.size
    if w < 1 or h < 1:
        raise SparrowError(f"image has zero size ({w}x{h})")
    if w * h > MAX_IMAGE_PIXELS:
        raise SparrowError(f"image is too large: {w}x{h} is over {MAX_IMAGE_PIXELS} pixels")


def load_image(src, allowed_local_path: str | None = None, local_files: bool = True):
    """Any accepted reference (see module doc) -> a checked PIL image."""
    from PIL import Image

    if isinstance(src, Image.Image):
        check_image(src)
        return src
    if isinstance(src, (bytes, bytearray, memoryview)):
        return image_from_bytes(bytes(src))
    if isinstance(src, os.PathLike) or (isinstance(src, str) and ":" not in src.split("/", 1)[0]):
        if not local_files:
            raise SparrowError("local image paths are not accepted here")
        return image_from_path(os.fspath(src))
    if isinstance(src, str):
        return image_from_url(src, allowed_local_path, local_files)
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
