"""A fault-injecting member in front of a real etcd member, for the faults a real member makes only under
conditions a test cannot hold steady: etcd's transient "too many requests" (its apply lagging its log), a
peer that trickles its answer byte by byte, a member that refuses watch streams.

:class:`FaultyMember` is a TLS HTTP server on loopback (port 0) with the cluster's own server certificate:
the client under test sees a member like the others. Every request it does not fault is forwarded to the
real member (with the cluster's client certificate) and its answer relayed unchanged. Ended by ``close``
(also as a context manager), as the fixture that started it must.
"""

from __future__ import annotations

import http.client
import http.server
import json
import ssl
import threading
import time


class FaultyMember:
    """A member at :attr:`endpoint` that forwards to ``target`` (``HOST:PORT`` of a real member), except:

    * ``exhausted``: the next that many requests are answered as etcd does when its apply lags its log
      (HTTP 429, gRPC code 8, "etcdserver: too many requests");
    * ``trickle``: seconds between the bytes of every answer (the status line, headers and body);
    * ``refuse_watch``: watch requests are answered 503 at once.
    """

    def __init__(self, target: str, tls: dict[str, str], server_cert: str, server_key: str) -> None:
        self.target, self.tls = target, tls
        self.exhausted = 0
        self.trickle = 0.0
        self.refuse_watch = False
        self.requests = 0
        self.watches_refused = 0
        self._lock = threading.Lock()
        member = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                member.serve(self, body)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(server_cert, server_key)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.endpoint = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-member", daemon=True)
        self._thread.start()

    def serve(self, handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
        with self._lock:
            self.requests += 1
            exhausted = self.exhausted > 0
            self.exhausted -= exhausted
        if handler.path == "/v3/watch" and self.refuse_watch:
            with self._lock:
                self.watches_refused += 1
            self._answer(handler, 503, b'{"error":"no watches here","code":14}')
            return
        if exhausted:
            message = "etcdserver: too many requests"
            self._answer(handler, 429, json.dumps({"error": message, "code": 8, "message": message}).encode())
            return
        host, _, port = self.target.rpartition(":")
        context = ssl.create_default_context(cafile=self.tls["cacert"])
        context.load_cert_chain(self.tls["cert"], self.tls["key"])
        conn = http.client.HTTPSConnection(host, int(port), timeout=10, context=context)
        try:
            conn.request("POST", handler.path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self._answer(handler, resp.status, resp.read())
        finally:
            conn.close()

    def _answer(self, handler: http.server.BaseHTTPRequestHandler, status: int, data: bytes) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        out = head.encode() + data
        try:
            if not self.trickle:
                handler.wfile.write(out)
                return
            for i in range(len(out)):
                handler.wfile.write(out[i : i + 1])
                handler.wfile.flush()
                time.sleep(self.trickle)
        except OSError:
            pass  # the client gave up on this answer

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FaultyMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
