"""A real HTTP server on 127.0.0.1 that serves one folder and counts the files it sent whole (downloads)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class _Counting(http.server.SimpleHTTPRequestHandler):
    gets: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        # torchvision's download first opens the URL to follow redirects (a GET marked with a "Method: HEAD"
        # header) and closes it: a probe, not a download.
        probe = self.headers.get("Method") == "HEAD"
        try:
            super().do_GET()
        except (BrokenPipeError, ConnectionResetError):
            return
        if not probe:
            type(self).gets.append(self.path)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serving(root: Path) -> Iterator[tuple[str, list[str]]]:
    """``(base URL, the path of every file sent whole so far)`` while ``root`` is served; the server stops after."""
    handler = type("Handler", (_Counting,), {"gets": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler.gets
    finally:
        httpd.shutdown()
        httpd.server_close()
