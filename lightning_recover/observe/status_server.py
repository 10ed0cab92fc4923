"""The monitor's HTTP server: ``/metrics`` (Prometheus' text format), ``/status`` (JSON) and ``/`` (a page).

Off unless asked for (``--status-address``, ``status_address=``); bound to loopback unless given another
address; read-only (GET and HEAD only); nothing secret in it (no key, no path of a credential). On etcd
every launcher binds its address when it starts, and serves the job while it holds the monitor role: the
others answer 503 and name the holder, so a takeover moves the page to the new holder's address.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from lightning_recover.observe.address import parse_address
from lightning_recover.observe.board import StatusBoard
from lightning_recover.observe.page import render_page

log = logging.getLogger(__name__)

#: Prometheus' text exposition format, version 0.0.4.
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StatusServer:
    """Serves ``board`` (None: this process does not monitor the job now; ``absent()`` says why) on a
    daemon thread until :meth:`close`."""

    def __init__(self, address: str, board: Optional[StatusBoard] = None, absent: Callable[[], str] = str) -> None:
        host, port = parse_address(address)
        self.board = board
        self.absent = absent
        handler = type("Handler", (_Handler,), {"server_of": self})
        try:
            self._httpd = _Server((host, port), handler)
        except OSError as exc:
            raise ValueError(
                f"cannot serve the status page on {host}:{port}: {exc.strerror}. HINT: pick another --status-address "
                "port (0 = any free port) or an address of this machine"
            ) from None
        bound = self._httpd.server_address
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}/"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.2,), name="lr-status", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: tuple) -> None:
        # A reader that went away mid-answer (a scraper's timeout, a closed tab) is not the monitor's error:
        # no traceback on the job's stderr.
        log.debug("status: the request of %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server_of: StatusServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        board = self.server_of.board
        if path not in ("/", "/status", "/metrics"):
            return self._send(
                404, "text/plain; charset=utf-8", b"not found: / (page), /status (JSON), /metrics\n", send_body
            )
        if board is None:
            why = self.server_of.absent() or "the job's monitor does not run here"
            return self._send(503, "text/plain; charset=utf-8", f"{why}\n".encode(), send_body)
        if path == "/metrics":
            return self._send(200, METRICS_TYPE, board.render_metrics(), send_body)
        status = board.snapshot()
        if path == "/status":
            return self._send(200, "application/json", json.dumps(status).encode(), send_body)
        return self._send(200, "text/html; charset=utf-8", render_page(status), send_body)

    def _send(self, code: int, kind: str, body: bytes, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the reader left: nothing to answer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        log.debug("status %s: " + format, self.address_string(), *args)
