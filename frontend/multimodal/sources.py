"""An image's bytes from where a request says they are: a `data:` URL (base64), a `file://` URL or a plain path
(only inside --allowed-local-media-path, symlinks resolved first), an `http(s)://` URL (fetched with a size limit, a
timeout, and redirects followed only on the same host), or, in SGLang's image_data, raw base64.

Every refusal is an InputError (400) whose message starts with `what`, the part of the request it is about.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit

from loraplex.frontend.errors import InputError

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image's encoded size, however it comes
FETCH_TIMEOUT_S = 10.0  # one http(s) fetch, redirects included
MAX_REDIRECTS = 3
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")


@dataclass(frozen=True)
class MediaAccess:
    """Where images may come from: the local directory file:// paths must resolve inside (None: none may), and
    whether a bare string may be a path or raw base64 (SGLang's image_data; OpenAI's image_url takes URLs only)."""

    local_root: str | None = None
    max_bytes: int = MAX_IMAGE_BYTES
    timeout_s: float = FETCH_TIMEOUT_S


async def image_bytes(source: str, what: str, access: MediaAccess, *, bare: bool = False) -> bytes:
    """The encoded image `source` names. bare: a string that is no URL is a local path or raw base64."""
    if not isinstance(source, str) or not source:
        raise InputError(f"{what}: an image must be given as a non-empty string (a URL or base64)")
    scheme = source.split(":", 1)[0].lower() if ":" in source[:16] else ""
    if scheme == "data":
        return data_url_bytes(source, what, access.max_bytes)
    if scheme == "file":
        return local_file_bytes(unquote(urlsplit(source).path), what, access)
    if scheme in ("http", "https"):
        return await fetch_bytes(source, what, access)
    if scheme or not bare:
        raise InputError(f"{what}: unsupported image URL {_short(source)!r}: give a data:, http(s):// or file:// URL")
    if _looks_like_path(source):
        return local_file_bytes(source, what, access)
    return _b64decode(source, what, access.max_bytes)


def data_url_bytes(url: str, what: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise InputError(f"{what}: a data: URL needs a comma before its data")
    media_type, *params = header[len("data:"):].split(";")
    if not media_type.lower().startswith("image/"):
        raise InputError(f"{what}: the data: URL's MIME type {media_type or '(none)'!r} is not an image type "
                         "(image/png, image/jpeg, ...)")  # fmt: skip
    if "base64" not in (p.lower() for p in params):
        raise InputError(f"{what}: an image data: URL must be base64 (data:{media_type};base64,...)")
    return _b64decode(payload, what, max_bytes)


def _b64decode(text: str, what: str, max_bytes: int) -> bytes:
    if len(text) * 3 // 4 > max_bytes:
        raise InputError(f"{what}: the image is larger than {max_bytes} bytes")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(f"{what}: the image is not valid base64 ({e})") from e


def _looks_like_path(text: str) -> bool:
    """A bare string read as a local path: raw base64 of a JPEG starts with '/9j/' too, so a string of base64's
    alphabet counts as a path only when such a file exists."""
    if len(text) > 4096 or not text.startswith(("/", "./", "../", "~")):
        return False
    return not _BASE64.fullmatch(text) or os.path.isfile(os.path.expanduser(text))


def local_file_bytes(path: str, what: str, access: MediaAccess) -> bytes:
    if access.local_root is None:
        raise InputError(f"{what}: local image files are refused: the server was not started with "
                         "--allowed-local-media-path")  # fmt: skip
    root = os.path.realpath(access.local_root)
    real = os.path.realpath(os.path.expanduser(path))
    if os.path.commonpath([root, real]) != root:
        raise InputError(f"{what}: {path!r} is outside --allowed-local-media-path")
    if not os.path.isfile(real):
        raise InputError(f"{what}: no image file at {path!r}")
    if os.path.getsize(real) > access.max_bytes:
        raise InputError(f"{what}: the image is larger than {access.max_bytes} bytes")
    with open(real, "rb") as f:
        return f.read(access.max_bytes + 1)


async def fetch_bytes(url: str, what: str, access: MediaAccess) -> bytes:
    """GET url: 200 only, at most max_bytes, within timeout_s; a redirect is followed only to the same scheme, host
    and port (another host could be anything the server reaches that the client cannot)."""
    import aiohttp

    origin = _origin(url)
    timeout = aiohttp.ClientTimeout(total=access.timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(MAX_REDIRECTS + 1):
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308):
                        target = urljoin(url, resp.headers.get("Location", ""))
                        if _origin(target) != origin:
                            raise InputError(f"{what}: {_short(url)} redirects to another host ({_short(target)}), "
                                             "which is refused")  # fmt: skip
                        url = target
                        continue
                    if resp.status != 200:
                        raise InputError(f"{what}: fetching {_short(url)} gave HTTP {resp.status}")
                    if (resp.content_length or 0) > access.max_bytes:
                        raise InputError(f"{what}: the image at {_short(url)} is larger than {access.max_bytes} "
                                         "bytes")  # fmt: skip
                    body = await resp.content.read(access.max_bytes + 1)
                    if len(body) > access.max_bytes:
                        raise InputError(f"{what}: the image at {_short(url)} is larger than {access.max_bytes} "
                                         "bytes")  # fmt: skip
                    return body
            raise InputError(f"{what}: {_short(url)} redirects more than {MAX_REDIRECTS} times")
    except TimeoutError as e:
        raise InputError(f"{what}: fetching {_short(url)} took longer than {access.timeout_s:g} s") from e
    except aiohttp.ClientError as e:
        raise InputError(f"{what}: could not fetch {_short(url)} ({type(e).__name__}: {e})") from e


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        port = None
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
