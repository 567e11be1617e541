"""Bad and good image inputs for the frontend's image tests, and a local HTTP server that serves images (and bad
answers) on 127.0.0.1 (no tests here)."""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.vision_models import png_bytes, test_image


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header claims width x height pixels: a decompression bomb made cheaply."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(
        b"IEND", b"")


def tiff_bytes() -> bytes:
    buffer = io.BytesIO()
    test_image().save(buffer, format="TIFF")
    return buffer.getvalue()


GOOD_PNG = png_bytes(test_image())

# Encoded files each refused by decoding (frontend/multimodal/decode.py), with a word of the message it gets.
BAD_FILES: dict[str, tuple[bytes, str]] = {
    "truncated PNG": (GOOD_PNG[: len(GOOD_PNG) // 2], "truncated"),
    "1x1 image": (png_bytes(test_image(1, 1)), "too small"),
    "20k x 20k header": (png_header_only(20_000, 20_000), "too large"),
    "not an image": (b"%PDF-1.7\n" + b"0" * 200, "not an image"),
    "unsupported format": (tiff_bytes(), "unsupported image format"),
    "empty file": (b"", "not an image"),
}


class ImageServer:
    """127.0.0.1 on a free port: /ok.png, /same-host (a redirect to /ok.png), /other-host (a redirect to
    localhost), /huge (a Content-Length past any limit), /slow (3 s late), /missing (404)."""

    def __init__(self):
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path
                if path == "/ok.png":
                    self._send(200, GOOD_PNG, "image/png")
                elif path == "/same-host":
                    self._redirect(f"http://127.0.0.1:{served.port}/ok.png")
                elif path == "/other-host":
                    self._redirect(f"http://localhost:{served.port}/ok.png")
                elif path == "/slow":  # answers after any test's fetch timeout
                    time.sleep(3)
                    self._send(200, GOOD_PNG, "image/png")
                elif path == "/huge":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(1 << 30))
                    self.end_headers()
                    self.wfile.write(GOOD_PNG[:64])
                else:
                    self._send(404, b"no such image", "text/plain")

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> ImageServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
