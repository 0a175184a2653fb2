"""Images in chat messages: OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` content parts made into PIL
images, with a 400 that says what is wrong for each bad one.

A ``data:image/png;base64,...`` URL (also JPEG, WebP and GIF, as OpenAI takes them) is decoded with Pillow. An
``http(s)://`` URL is refused unless the server runs with ``--allow-remote-images``; then it is fetched with a size
limit (``--max-image-bytes``) and a time limit (``--image-fetch-timeout``) over the whole download. OpenAI's ``detail``
(``auto`` / ``low`` / ``high``) is accepted and has no effect: the model's processor decides the resolution.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

from .schema import APIError

#: The image formats a part may hold (Pillow's names), as OpenAI lists them: PNG, JPEG, WebP, non-animated GIF.
FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}
#: ``data:[<mime type>][;<parameter>]*;base64,<data>`` (RFC 2397).
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True)
class ImageLimits:
    """What the server takes as an image part.

    Attributes:
        max_image_bytes: an image's encoded size at most, in bytes (a data URL's decoded payload, a download's body).
        allow_remote: fetch ``http(s)://`` URLs (off: a 400 that names ``--allow-remote-images``).
        fetch_timeout_s: seconds a whole download may take.
    """

    max_image_bytes: int = 20 * 2**20
    allow_remote: bool = False
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_image_bytes < 1:
            raise ValueError(f"--max-image-bytes must be a positive number of bytes, got {self.max_image_bytes}.")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"--image-fetch-timeout must be a positive number of seconds, got {self.fetch_timeout_s}.")


async def load_image(url: str, limits: ImageLimits, param: str):
    """The RGB ``PIL.Image.Image`` an ``image_url`` part's ``url`` holds or points at.

    Args:
        url: a ``data:`` URL with base64 data, or (``limits.allow_remote``) an ``http://`` / ``https://`` URL.
        limits: what is taken.
        param: where the part is in the request (``messages[1].content[0].image_url.url``), named by the 400.

    Raises:
        APIError: 400 for a URL of another scheme, a remote URL while they are off, bad base64, data that is not an
            image of :data:`FORMATS`, an image over ``limits.max_image_bytes``, a download that fails or takes
            longer than ``limits.fetch_timeout_s``.
    """
    # Decoding runs in a thread: a large image would hold the event loop (every other request's stream) meanwhile.
    if url.startswith("data:"):
        return await asyncio.to_thread(lambda: open_image(_decoded(url, limits, param), limits, param))
    if url.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise APIError(400, f"{param}: remote image URLs are off on this server; send the image inline as a "
                           "data: URL (data:image/png;base64,...), or start the server with --allow-remote-images.",
                           param=param)
        return await asyncio.to_thread(open_image, await _fetched(url, limits, param), limits, param)
    raise APIError(400, f"{param}: an image URL must be a data: URL with base64 data (data:image/png;base64,...) or, "
                   f"with --allow-remote-images, an http(s) URL; got {url[:40]!r}.", param=param)


def _decoded(url: str, limits: ImageLimits, param: str) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise APIError(400, f"{param}: a data URL must read data:image/<format>;base64,<data> (only base64 data "
                       "is taken).", param=param)
    mime = match["mime"].strip().lower()
    if mime and not mime.startswith("image/"):
        raise APIError(400, f"{param}: the data URL holds {mime!r}, not an image (send image/png, image/jpeg, "
                       "image/webp or image/gif).", param=param)
    data = re.sub(r"\s+", "", match["data"])
    if len(data) // 4 * 3 > limits.max_image_bytes + 2:  # before decoding: base64 takes 4 characters per 3 bytes
        raise _too_large(len(data) // 4 * 3, limits, param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as problem:
        raise APIError(400, f"{param}: the data URL's data is not valid base64 ({problem}).", param=param) from None


async def _fetched(url: str, limits: ImageLimits, param: str) -> bytes:
    import httpx

    async def download() -> bytes:
        async with httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise APIError(400, f"{param}: fetching the image gave HTTP {response.status_code}.", param=param)
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limits.max_image_bytes:
                    raise _too_large(int(declared), limits, param)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limits.max_image_bytes:
                        raise _too_large(len(body), limits, param, "at least ")
                return bytes(body)

    try:
        return await asyncio.wait_for(download(), limits.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise APIError(400, f"{param}: the image did not arrive within {limits.fetch_timeout_s:g} s "
                       "(--image-fetch-timeout); send it inline as a data: URL.", param=param) from None
    except httpx.HTTPError as problem:
        raise APIError(400, f"{param}: the image could not be fetched ({type(problem).__name__}: {problem}).",
                       param=param) from None


def _too_large(size: int, limits: ImageLimits, param: str, prefix: str = "") -> APIError:
    return APIError(400, f"{param}: the image is {prefix}{size} bytes, over this server's limit of "
                    f"{limits.max_image_bytes} bytes (--max-image-bytes); send a smaller image.", param=param)


def open_image(data: bytes, limits: ImageLimits, param: str):
    """``data`` decoded by Pillow into an RGB image.

    Raises:
        APIError: 400 when ``data`` is over the size limit, is not an image of :data:`FORMATS`, or is a
            decompression bomb (more pixels than Pillow's ``MAX_IMAGE_PIXELS``).
    """
    from PIL import Image

    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), limits, param)
    try:
        image = Image.open(io.BytesIO(data))
        kind = image.format
        image.load()
    except Image.DecompressionBombError as problem:
        raise APIError(400, f"{param}: the image has too many pixels ({problem}).", param=param) from None
    except Exception:  # noqa: BLE001 - Pillow raises several kinds for data it cannot read
        raise APIError(400, f"{param}: the data is not an image Pillow can read (send PNG, JPEG, WebP or GIF).",
                       param=param) from None
    if kind not in FORMATS:
        raise APIError(400, f"{param}: {kind} images are not taken; send PNG, JPEG, WebP or GIF.", param=param)
    return image.convert("RGB")


def image_digest(image) -> bytes:
    """SHA-256 over a PIL image's mode, size and pixels: what names it in the reply memory's keys
    (:class:`~hf_hybridcache.serve.prompts.ReplyMemory`)."""
    h = hashlib.sha256(f"{image.mode}|{image.size}|".encode())
    h.update(image.tobytes())
    return h.digest()
