"""A typed client of etcd's v3 JSON gateway (``/v3/kv/*``, ``/v3/lease/*``, ``/v3/watch``) on the standard library.

Why not a client from PyPI: the comparison in docs/control_plane.md ("Choosing the client", measured by
``benchmarks/etcd_clients.py``) found the grpc clients no faster per request here, 15-28 MB of dependencies
(grpcio, protobuf) and, for the 2020 ``etcd3``, broken on today's protobuf; ``etcd3gw`` (the maintained
JSON-gateway client) talks to one endpoint only (no failover: the member it names is a single point) and
pulls in requests/futurist/pbr. What this module adds over ``http.client`` is exactly what the control
plane needs and none of them does together: every member as an endpoint with failover within a deadline,
TLS with client certificates, and per-call bounds.

A request goes to the current member; on a connection failure, a timeout of one try, or etcd's
"unavailable" answers (no leader, leader changed) it moves to the next member and tries again until
the call's deadline, then raises :class:`EtcdUnavailable`. A try is short (``try_timeout``, 0.25 s)
for the first few times it times out, then twice as long each time (up to 2 s): when the leader dies,
a follower that still believes in it forwards the proposal into the void and never answers, so only
a new try after the election gets through (with a 1 s try, a leader's SIGKILL stalled every writer
1.03 s; with 0.25 s, 0.85 s: ``benchmarks/figures/etcdperf.md``); the longer tries after that keep a
slow but working cluster making progress. Retrying is safe for what the store does:
puts and deletes are idempotent, compare-and-set transactions return the value now stored, and
counters carry a token that tells whether an unanswered try was applied (see ``etcd_store``).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from lightning_recover.errors import RecoverError

#: gRPC codes etcd answers with while the cluster cannot serve right now (retried on another member).
_RETRY_CODES = {2, 4, 14}  # UNKNOWN ("leader changed"), DEADLINE_EXCEEDED, UNAVAILABLE
#: Tries of one request that may time out at ``try_timeout`` before each next try waits twice as long.
QUICK_TRIES = 5
#: The longest one try waits for its answer.
MAX_TRY_TIMEOUT = 2.0
#: Connecting a watch stream.
_CONNECT_TIMEOUT = 1.0


class EtcdUnavailable(RecoverError):
    """No etcd member served a request within its deadline (lost majority, partition, all members down)."""


class EtcdRequestError(RecoverError):
    """etcd refused a request (bad request, permission): retrying elsewhere would not help."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: Optional[str]) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"


def tls_context(cacert: Optional[str], cert: Optional[str], key: Optional[str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cacert)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class EtcdClient:
    """One connection at a time to one of ``endpoints`` (``HOST:PORT``); not thread-safe (use :meth:`clone`).

    ``tls`` None means plain http (refused unless ``allow_insecure``); otherwise an ``ssl.SSLContext``
    or the CA/cert/key paths.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        cacert: Optional[str] = None,
        cert: Optional[str] = None,
        key: Optional[str] = None,
        context: Optional[ssl.SSLContext] = None,
        timeout: float = 5.0,
        try_timeout: float = 0.25,
        allow_insecure: bool = False,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = list(endpoints)
        if context is None and (cacert or cert):
            context = tls_context(cacert, cert, key)
        if context is None and not allow_insecure:
            raise RecoverError(
                "refusing plain-text etcd. HINT: give the CA and client certificate "
                "(--etcd-cacert/--etcd-cert/--etcd-key), or etcd+insecure:// on loopback for experiments"
            )
        self.context = context
        self.timeout = timeout
        self.try_timeout = try_timeout
        self._current = 0
        self._conn: Optional[http.client.HTTPConnection] = None
        self._stream: Optional[http.client.HTTPConnection] = None  # the connection watch_messages reads
        self.requests = 0  # requests sent (load figures)
        #: the highest Raft term in any answer (etcd's ``header.raft_term``): it grows with every leader election
        self.raft_term = 0

    def clone(self) -> EtcdClient:
        return EtcdClient(
            self.endpoints,
            context=self.context,
            timeout=self.timeout,
            try_timeout=self.try_timeout,
            allow_insecure=self.context is None,
        )

    def warm(self) -> None:
        """Open the connection now (TCP and the TLS handshake), so that the first request does not wait for it.
        A failure is left to that request, which fails over as usual."""
        if self._conn is None:
            try:
                self._conn = self._connect(self.timeout)
            except (OSError, http.client.HTTPException):
                self._next_endpoint()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ transport
    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        host, _, port = self.endpoints[self._current].rpartition(":")
        host = host.strip("[]")
        if self.context is not None:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, int(port), timeout=timeout, context=self.context
            )
        else:
            conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _next_endpoint(self) -> None:
        self.close()
        self._current = (self._current + 1) % len(self.endpoints)

    def try_timeout_after(self, timed_out: int) -> float:
        """How long the next try of a request waits, after ``timed_out`` of its tries timed out."""
        return min(MAX_TRY_TIMEOUT, self.try_timeout * 2 ** max(0, timed_out - QUICK_TRIES + 1))

    def request(self, path: str, body: dict, timeout: Optional[float] = None) -> dict:
        """POST ``body`` to ``/v3/{path}``; fail over between members until ``timeout`` (default: the client's)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        payload = json.dumps(body).encode()
        last: object = None
        tried = timed_out = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and tried:
                raise EtcdUnavailable(
                    f"no etcd member of {','.join(self.endpoints)} answered /v3/{path} within "
                    f"{self.timeout if timeout is None else timeout:g}s (last: {last}). HINT: check that a majority "
                    "of the etcd members run and that this host reaches them (LIGHTNING_RECOVER_CONTROL_PLANE)"
                )
            tried += 1
            try_for = max(0.05, min(left, self.try_timeout_after(timed_out)))
            try:
                if self._conn is None:
                    self._conn = self._connect(try_for)
                self._conn.sock.settimeout(try_for)
                self._conn.request("POST", f"/v3/{path}", payload, {"Content-Type": "application/json"})
                self.requests += 1
                resp = self._conn.getresponse()
                data = resp.read()
            except ssl.SSLCertVerificationError as exc:
                self.close()
                raise EtcdRequestError(
                    f"TLS verification of etcd at {self.endpoints[self._current]} failed: {exc}. HINT: "
                    "--etcd-cacert must be the CA that signed the members' certificates, whose SANs must "
                    "name the address used"
                ) from None
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, TLS alert
                timed_out += isinstance(exc, TimeoutError)
                last = f"{self.endpoints[self._current]}: {type(exc).__name__}: {exc}"
                self._next_endpoint()
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
                continue
            try:
                answer = json.loads(data) if data else {}
            except ValueError:
                answer = {"error": data[:200].decode(errors="replace"), "code": 2}
            if resp.status == 200 and "error" not in answer:
                self.raft_term = max(self.raft_term, int((answer.get("header") or {}).get("raft_term") or 0))
                return answer
            code = int(answer.get("code", 14 if resp.status >= 500 else 3))
            message = answer.get("message") or answer.get("error") or f"HTTP {resp.status}"
            if code in _RETRY_CODES or resp.status in (502, 503, 504):
                last = f"{self.endpoints[self._current]}: {message}"
                self._next_endpoint()
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
                continue
            raise EtcdRequestError(f"etcd refused /v3/{path}: {message} (code {code})")

    # ------------------------------------------------------------------ key-value
    def range(
        self,
        key: bytes,
        range_end: Optional[bytes] = None,
        *,
        revision: int = 0,
        count_only: bool = False,
        keys_only: bool = False,
        serializable: bool = False,
    ) -> dict:
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if revision:
            body["revision"] = revision
        if count_only:
            body["count_only"] = True
        if keys_only:
            body["keys_only"] = True
        if serializable:
            body["serializable"] = True
        return self.request("kv/range", body)

    def get(self, key: bytes) -> tuple[Optional[bytes], int]:
        """``(value or None, the store's revision)`` (linearizable)."""
        r = self.range(key)
        kvs = r.get("kvs") or []
        return (unb64(kvs[0].get("value")) if kvs else None), int(r["header"]["revision"])

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.request("kv/put", body)["header"]["revision"])

    def delete(self, key: bytes, range_end: Optional[bytes] = None) -> int:
        body = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        return int(self.request("kv/deleterange", body).get("deleted", 0))

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] = ()) -> dict:  # type: ignore[assignment]
        """A transaction of raw gateway ops (see the ``op_*``/``cmp_*`` helpers); the answer as JSON."""
        return self.request("kv/txn", {"compare": compare, "success": list(success), "failure": list(failure)})

    # ------------------------------------------------------------------ leases and status
    def lease_grant(self, ttl: int) -> int:
        return int(self.request("lease/grant", {"TTL": str(ttl)})["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """Renew ``lease``; its remaining TTL (0 or less: it expired)."""
        answer = self.request("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        try:
            self.request("lease/revoke", {"ID": str(lease)}, timeout=min(self.timeout, 2.0))
        except EtcdRequestError:
            pass  # already expired

    def status(self) -> dict:
        return self.request("maintenance/status", {})

    # ------------------------------------------------------------------ watch
    def watch(
        self, key: bytes, start_revision: int, timeout: float, range_end: Optional[bytes] = None
    ) -> Iterator[dict]:
        """Events on ``key`` from ``start_revision`` on, for up to ``timeout`` seconds (then it just ends).

        A watch stream of its own (one HTTP connection to the current member); reading it is bounded
        by ``timeout``, so a member that stops answering ends the watch, never blocks the caller.
        """
        deadline = time.monotonic() + timeout
        body: dict[str, Any] = {"create_request": {"key": b64(key), "start_revision": start_revision}}
        if range_end is not None:
            body["create_request"]["range_end"] = b64(range_end)
        try:
            conn = self._connect(max(0.05, min(timeout, _CONNECT_TIMEOUT)))
        except OSError:
            self._next_endpoint()
            return
        try:
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), {"Content-Type": "application/json"})
            self.requests += 1
            resp = conn.getresponse()
            if resp.status != 200:
                return
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                conn.sock.settimeout(left)
                line = resp.readline()
                if not line:
                    return
                msg = json.loads(line).get("result", {})
                if msg.get("canceled"):
                    return
                yield from msg.get("events") or []
        except (OSError, http.client.HTTPException, ValueError):
            return  # timed out or the member went away: the caller re-checks
        finally:
            conn.close()

    def watch_messages(self, key: bytes, range_end: bytes, start_revision: int, read_timeout: float) -> Iterator[dict]:
        """Every message of a watch on ``[key, range_end)`` from ``start_revision`` on (``result``: header,
        events, ``compact_revision``, ``canceled``), for as long as the stream lives.

        Unlike :meth:`watch` it has no deadline: it ends (returns) when the member closes the stream, and
        raises ``OSError`` when no message came for ``read_timeout`` seconds, so the caller (a watch cache,
        :mod:`~lightning_recover.control_plane.etcd_watch`) can tell a silent stream from a quiet one.
        """
        body = {"create_request": {"key": b64(key), "range_end": b64(range_end), "start_revision": start_revision}}
        try:
            conn = self._connect(max(0.05, min(read_timeout, _CONNECT_TIMEOUT)))
        except OSError:
            self._next_endpoint()
            raise
        self._stream = conn
        try:
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), {"Content-Type": "application/json"})
            self.requests += 1
            resp = conn.getresponse()
            if resp.status != 200:
                self._next_endpoint()
                raise OSError(f"etcd watch answered HTTP {resp.status}")
            while True:
                conn.sock.settimeout(read_timeout)
                line = resp.readline()
                if not line:
                    return
                msg = json.loads(line)
                if "error" in msg:
                    raise OSError(f"etcd watch stream error: {msg['error']}")
                yield msg.get("result", {})
        finally:
            self._stream = None
            conn.close()

    def end_stream(self) -> None:
        """End the stream :meth:`watch_messages` is reading (from another thread): its read returns now, not
        after its ``read_timeout``."""
        conn = self._stream
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed


# ---------------------------------------------------------------------------- transaction ops


def cmp_version(key: bytes, version: int) -> dict:
    return {"key": b64(key), "target": "VERSION", "result": "EQUAL", "version": str(version)}


def cmp_value(key: bytes, value: bytes) -> dict:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def cmp_mod(key: bytes, mod_revision: int) -> dict:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


def cmp_lease(key: bytes, lease: int) -> dict:
    return {"key": b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)}


def op_put(key: bytes, value: bytes, lease: int = 0) -> dict:
    req: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def op_get(key: bytes, count_only: bool = False) -> dict:
    req: dict[str, Any] = {"key": b64(key)}
    if count_only:
        req["count_only"] = True
    return {"request_range": req}


def op_delete(key: bytes, range_end: Optional[bytes] = None) -> dict:
    req = {"key": b64(key)}
    if range_end is not None:
        req["range_end"] = b64(range_end)
    return {"request_delete_range": req}


def first_kv(response: dict) -> Optional[dict]:
    """The key-value of a txn's ``response_range`` (None when the key was absent)."""
    kvs = (response.get("response_range") or {}).get("kvs") or []
    return kvs[0] if kvs else None
