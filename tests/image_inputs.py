"""Bad and good image inputs for the frontend's image tests, and a local HTTP server that serves images (and bad
answers) on 127.0.0.1 (no tests here)."""

from __future__ import annotations

import base64
import importlib.util
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.vision_models import png_bytes, test_image

# The workers' Qwen2.5-VL (its vision encoder: issue 35's worker side). Without it, tests serve build_vision_standin.
HAS_VL_WORKER = importlib.util.find_spec("loraplex.worker.model.qwen2_5_vl") is not None


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


def build_vision_standin(out_dir) -> None:
    """A text-only tiny Qwen2 whose directory reads to the frontend as a Qwen-VL checkpoint: the VL tokenizer (vision
    tokens, chat template with image parts), the image processor, and config.json's vision_config and image token
    (no M-RoPE). The workers serve its language model and ignore the images: what the frontend does with images is
    tested whole while the vision encoder is elsewhere."""
    import json
    from pathlib import Path

    from tests.builders import build_tiny_model
    from tests.vision_models import IMAGE_PAD, MERGE, make_image_processor, make_tokenizer

    out_dir = Path(out_dir)
    tokenizer = make_tokenizer()
    build_tiny_model(out_dir, arch="qwen2", with_tokenizer=False, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(out_dir)
    make_image_processor().save_pretrained(out_dir)
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((out_dir / "config.json").read_text())
    config["vision_config"] = {"spatial_merge_size": MERGE}
    config["image_token_id"] = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    (out_dir / "config.json").write_text(json.dumps(config))
