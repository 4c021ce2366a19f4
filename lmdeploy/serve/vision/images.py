"""Loading user images: PIL images, file paths, `file://` / `http(s)://` / `data:` URLs, and OpenAI-style content
parts. Every failure is a `ValueError` naming the problem (the server answers it with a 400 for that request).

Local files are read only under `allowed_local_media_path` (off by default, as in vLLM: a server must not read its
own disk on a client's behalf). Remote fetches and data URLs are capped at `max_image_bytes`; decoded images at
`max_image_pixels` (a decompression-bomb guard, checked before the pixels are decoded).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from PIL import Image

DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageLoadConfig:
    """Where images may come from and how large they may be."""
    allowed_local_media_path: str | None = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_s: float = _FETCH_TIMEOUT_S


def _decode(data: bytes, config: ImageLoadConfig, what: str) -> Image.Image:
    if len(data) > config.max_image_bytes:
        raise ValueError(f'{what} is {len(data)} bytes; the limit is {config.max_image_bytes}')
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > config.max_image_pixels:
            raise ValueError(f'{what} is {image.width}x{image.height} pixels; the limit is {config.max_image_pixels}')
        image.load()
    except ValueError:
        raise
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f'{what} is not a readable image: {exc}') from None
    return image.convert('RGB')


def _from_data_url(url: str, config: ImageLoadConfig) -> Image.Image:
    header, sep, payload = url.partition(',')
    if not sep or not header.startswith('data:'):
        raise ValueError('malformed data URL (expected data:<mime>;base64,<data>)')
    mime = header[5:].split(';')[0]
    if mime.startswith('video/'):
        raise ValueError('video input is not supported')
    if mime and not mime.startswith('image/'):
        raise ValueError(f'data URL of type {mime!r} is not an image')
    if ';base64' not in header:
        raise ValueError('only base64 data URLs are supported')
    if len(payload) > 4 * config.max_image_bytes // 3 + 4:
        raise ValueError(f'data URL image is larger than {config.max_image_bytes} bytes')
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError('data URL holds invalid base64') from None
    return _decode(data, config, 'data URL image')


def _from_file(path: str, config: ImageLoadConfig) -> Image.Image:
    root = config.allowed_local_media_path
    if root is None:
        raise ValueError('local image files are not allowed (set allowed_local_media_path to allow a folder)')
    real, allowed = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, allowed]) != allowed:
        raise ValueError(f'image file {path!r} is outside the allowed folder')
    if not os.path.isfile(real):
        raise ValueError(f'image file {path!r} does not exist')
    if os.path.getsize(real) > config.max_image_bytes:
        raise ValueError(f'image file {path!r} is larger than {config.max_image_bytes} bytes')
    with open(real, 'rb') as f:
        return _decode(f.read(), config, f'image file {path!r}')


def _from_http(url: str, config: ImageLoadConfig) -> Image.Image:
    import httpx
    try:
        with httpx.stream('GET', url, timeout=config.fetch_timeout_s, follow_redirects=True) as response:
            if response.status_code != 200:
                raise ValueError(f'fetching image {url!r} failed: HTTP {response.status_code}')
            content_type = response.headers.get('content-type', '')
            if content_type.startswith('video/'):
                raise ValueError('video input is not supported')
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > config.max_image_bytes:
                    raise ValueError(f'image {url!r} is larger than {config.max_image_bytes} bytes')
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise ValueError(f'fetching image {url!r} failed: {exc}') from None
    return _decode(b''.join(chunks), config, f'image {url!r}')


def load_image(source, config: ImageLoadConfig) -> Image.Image:
    """An RGB PIL image from a PIL image, a path, or a file / http(s) / data URL."""
    if isinstance(source, Image.Image):
        return source.convert('RGB')
    if not isinstance(source, str) or not source:
        raise ValueError(f'an image must be a PIL image, a path or a URL, got {type(source).__name__}')
    scheme = urlparse(source).scheme.lower()
    if scheme == 'data':
        return _from_data_url(source, config)
    if scheme in ('http', 'https'):
        return _from_http(source, config)
    if scheme == 'file':
        return _from_file(unquote(urlparse(source).path), config)
    if scheme and len(scheme) > 1:
        raise ValueError(f'unsupported image URL scheme {scheme!r}')
    return _from_file(source, config)


def image_source_of_part(part: dict):
    """The image source of an OpenAI-style content part (`image_url` / `image`), or None for other parts; video
    parts are refused."""
    kind = part.get('type')
    if kind in ('video', 'video_url', 'input_video'):
        raise ValueError('video input is not supported')
    if kind == 'image_url':
        value = part.get('image_url')
        url = value.get('url') if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError("an image_url part needs {'url': <string>}")
        return url
    if kind == 'image':
        if 'image' not in part:
            raise ValueError("an image part needs an 'image' (a PIL image, a path or a URL)")
        return part['image']
    return None
