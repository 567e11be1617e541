"""A load balancer in front of several servers, for the rolling-restart test: what a Kubernetes Service behind a
gateway (Envoy, nginx) does, in a few lines.

It sends each request to the next backend whose `GET /health` answered 200 at its last poll (every POLL_S), round
robin. A backend that refuses the connection or answers 503 (draining, stopping, or not started: the server did no
work for that request) is marked not ready and the request goes to another one: Envoy's `retry_on:
connect-failure,retriable-status-codes` with 503, nginx's `proxy_next_upstream error http_503`. Any other answer goes
back to the client as it is. Bodies are relayed whole (no streaming), which is all the test's greedy requests need.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

POLL_S = 0.5  # like a gateway, it learns of a draining server a while after SIGTERM: refused requests meanwhile
RETRY_PAUSE_S = 0.05  # between tries when no backend is ready
RETRY_FOR_S = 60.0  # a request waits this long for some backend to be ready before it gets the 503 itself


class HealthProxy:
    def __init__(self, backends: list[str]):
        self.backends = list(backends)  # base URLs; set_backend replaces one (a restarted pod has a new address)
        self.ready = [False] * len(backends)
        self.retries = 0  # requests sent again to another backend
        self._lock = threading.Lock()
        self._cursor = 0
        self._stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                         threading.Thread(target=self._poll, daemon=True)]
        for thread in self._threads:
            thread.start()

    def set_backend(self, index: int, url: str) -> None:
        with self._lock:
            self.backends[index] = url
            self.ready[index] = False  # until its first 200

    def _poll(self) -> None:
        while not self._stop.is_set():
            for index, url in enumerate(list(self.backends)):
                try:
                    ok = requests.get(url + "/health", timeout=1).status_code == 200
                except requests.RequestException:
                    ok = False
                with self._lock:
                    if self.backends[index] == url:
                        self.ready[index] = ok
            self._stop.wait(POLL_S)

    def _pick(self) -> tuple[int, str] | None:
        with self._lock:
            n = len(self.backends)
            for step in range(n):
                index = (self._cursor + step) % n
                if self.ready[index]:
                    self._cursor = (index + 1) % n
                    return index, self.backends[index]
        return None

    def _mark_down(self, index: int, url: str) -> None:
        with self._lock:
            if self.backends[index] == url:
                self.ready[index] = False

    def forward(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
        deadline = time.monotonic() + RETRY_FOR_S
        tried = False
        while True:
            picked = self._pick()
            if picked is not None:
                index, url = picked
                if tried:
                    self.retries += 1
                tried = True
                try:
                    resp = requests.request(method, url + path, data=body, headers=headers, timeout=120)
                except requests.ConnectionError:
                    self._mark_down(index, url)
                    continue
                if resp.status_code != 503:
                    return resp.status_code, resp.headers.get("Content-Type", "application/json"), resp.content
                self._mark_down(index, url)
            if time.monotonic() > deadline:
                return 503, "application/json", b'{"error": {"message": "no backend ready"}}'
            time.sleep(RETRY_PAUSE_S)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                status, content_type, content = proxy.forward(self.command, self.path, body, headers)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = _relay

            def log_message(self, *args: object) -> None:  # quiet: the test reports what matters
                pass

        return Handler

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
