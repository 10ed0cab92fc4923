"""A typed client of etcd's v3 JSON gateway (``/v3/kv/*``, ``/v3/lease/*``, ``/v3/watch``) on the standard library.

Why not a client from PyPI: the comparison in docs/control_plane.md ("Choosing the client", measured by
``benchmarks/etcd_clients.py``) found the grpc clients no faster per request here, 15-28 MB of dependencies
(grpcio, protobuf) and, for the 2020 ``etcd3``, broken on today's protobuf; ``etcd3gw`` (the maintained
JSON-gateway client) talks to one endpoint only (no failover: the member it names is a single point) and
pulls in requests/futurist/pbr. What this module adds over ``http.client`` is exactly what the control
plane needs and none of them does together: every member as an endpoint with failover within a deadline,
TLS with client certificates, and per-call bounds.

A request goes to the current member; on a connection failure, a timeout of one try, a certificate the
client refuses (or that refuses the client), or etcd's "unavailable" answers (no leader, leader changed)
it moves to the next member and tries again until the call's deadline, then raises :class:`EtcdUnavailable`
(or :class:`EtcdCertificateError` when every member's certificate was the problem, naming each member and
its problem). The deadline bounds the whole call: every read of an answer waits at most until it, so a
member trickling bytes cannot stretch a call. After every member failed once, the next round waits a
jittered, doubling pause (``BACKOFF_MIN`` to ``BACKOFF_MAX``): clients of a recovering cluster do not
retry in step. Answers are bounded too (``MAX_ANSWER_BYTES``, ``MAX_LINE_BYTES`` for a watch message).

etcd's ``RESOURCE_EXHAUSTED`` (gRPC code 8) has two meanings: "too many requests" (its apply lags its
log; transient) is retried like "unavailable"; "database space exceeded" (the NOSPACE alarm: every
write fails until an operator compacts, defragments and disarms) raises :class:`EtcdNoSpace` at once,
with those commands in its HINT. A try is short (``try_timeout``, 0.25 s, or longer where the members'
answers take longer: :class:`AnswerTimes`) for the first few times it times out, then twice as long each
time (up to 2 s): when the leader dies, a follower that still believes in it forwards the proposal into
the void and never answers, so only a new try after the election gets through (with a 1 s try, a
leader's SIGKILL stalled every writer 1.03 s; with 0.25 s, 0.85 s: ``benchmarks/figures/etcdperf.md``);
the longer tries after that keep a slow but working cluster making progress. Retrying is safe for what the store does:
puts and deletes are idempotent, compare-and-set transactions return the value now stored, and
counters carry a token that tells whether an unanswered try was applied (see ``etcd_store``).
"""

from __future__ import annotations

import base64
import datetime
import functools
import http.client
import io
import json
import random
import socket
import ssl
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, Optional

from lightning_recover.control_plane.answer_times import MAX_TRY_TIMEOUT, AnswerTimes
from lightning_recover.errors import RecoverError

#: gRPC codes etcd answers with while the cluster cannot serve right now (retried on another member).
_RETRY_CODES = {2, 4, 14}  # UNKNOWN ("leader changed"), DEADLINE_EXCEEDED, UNAVAILABLE
#: RESOURCE_EXHAUSTED: "too many requests" (retried) or "database space exceeded" (EtcdNoSpace).
_EXHAUSTED = 8
#: The pause after a whole round of members failed starts here and doubles per round, up to BACKOFF_MAX
#: (each drawn from its upper half at random).
BACKOFF_MIN = 0.02
BACKOFF_MAX = 0.5
#: The largest answer (body) read from a member: a job's own keys are far below it; beyond it a member
#: (or whoever holds its address) could make the client allocate without bound.
MAX_ANSWER_BYTES = 64 << 20
#: The largest watch message (one line of the stream).
MAX_LINE_BYTES = 64 << 20
#: Tries of one request that may time out at ``try_timeout`` before each next try waits twice as long.
QUICK_TRIES = 5
#: Connecting a watch stream.
_CONNECT_TIMEOUT = 1.0


class EtcdUnavailable(RecoverError):
    """No etcd member served a request within its deadline (lost majority, partition, all members down)."""


class EtcdRequestError(RecoverError):
    """etcd refused a request (bad request, permission): retrying elsewhere would not help."""


class EtcdNoSpace(EtcdRequestError):
    """etcd's space quota is full (its NOSPACE alarm): every write fails until an operator frees space."""


class EtcdCertificateError(EtcdUnavailable):
    """Every member's TLS handshake failed on a certificate: theirs refused by this client, or this client's
    refused by them (each member and its problem named)."""


class EtcdClientCertificateExpired(RecoverError):
    """This host's etcd client certificate is outside its validity period."""


def certificate_validity(path: str) -> tuple[datetime.datetime, datetime.datetime]:
    """``(notBefore, notAfter)`` of the first certificate of the PEM file ``path`` (UTC), read from its DER
    encoding (the standard library decodes only a peer's certificate, not a file's)."""
    with open(path) as f:
        pem = f.read()
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    der = ssl.PEM_cert_to_DER_cert(pem[pem.index(begin) : pem.index(end) + len(end)])

    def tlv(at: int) -> tuple[int, int, int]:  # tag, where its value starts, where it ends
        tag, n = der[at], der[at + 1]
        at += 2
        if n & 0x80:
            width = n & 0x7F
            n = int.from_bytes(der[at : at + width], "big")
            at += width
        return tag, at, at + n

    at = tlv(tlv(0)[1])[1]  # into Certificate, then into TBSCertificate
    tag, _, end_of = tlv(at)
    if tag == 0xA0:  # [0] version
        at = end_of
    for _ in range(3):  # serialNumber, signature, issuer
        at = tlv(at)[2]
    at = tlv(at)[1]  # into validity
    times = []
    for _ in range(2):
        tag, start, stop = tlv(at)
        fmt = "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ"  # UTCTime or GeneralizedTime
        times.append(datetime.datetime.strptime(der[start:stop].decode(), fmt).replace(tzinfo=datetime.timezone.utc))
        at = stop
    return times[0], times[1]


def check_client_certificate(path: str) -> None:
    """Refuse a client certificate outside its validity period now, by name, rather than as members that
    "do not answer" (each would refuse the handshake).

    Raises:
        EtcdClientCertificateExpired: ``path`` expired (or is not valid yet).
    """
    try:
        not_before, not_after = certificate_validity(path)
    except (OSError, ValueError, IndexError):
        return  # not readable as one PEM certificate: loading it into the TLS context says why
    now = datetime.datetime.now(datetime.timezone.utc)
    if now > not_after or now < not_before:
        state = f"expired on {not_after:%Y-%m-%d %H:%M} UTC" if now > not_after else f"is valid from {not_before}"
        raise EtcdClientCertificateExpired(
            f"the etcd client certificate {path} {state}: every member would refuse it. HINT: issue a new client "
            "certificate from the cluster's CA (--etcd-cert/--etcd-key, or LIGHTNING_RECOVER_ETCD_CERT/_KEY); "
            "`lightning-recover etcd up` makes certificates valid for 30 days"
        )


class DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read waiting at most until ``deadline.at``: the whole answer is bounded, not
    each read (a peer sending one byte per second would otherwise hold a reader forever)."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline.at - time.monotonic()
        if left > 0:
            self._sock.settimeout(left)
            return self._sock.recv_into(buffer)
        # Past the deadline: what the member already sent is still taken (this thread may not have run for a
        # while on a loaded host, the member answering in time meanwhile); only an answer not there is late.
        self._sock.settimeout(0.0)
        try:
            return self._sock.recv_into(buffer)
        except (BlockingIOError, ssl.SSLWantReadError):
            raise TimeoutError("the member's answer did not arrive within the request's deadline") from None


class Deadline:
    """The time (monotonic) the answer being read must be complete by."""

    def __init__(self) -> None:
        self.at = float("inf")


class _BoundedResponse(http.client.HTTPResponse):
    """An HTTP answer read through a :class:`DeadlineReader` (its status line and headers too)."""

    def __init__(self, sock: socket.socket, *args: Any, deadline: Deadline, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # the plain reader http.client made (closing it leaves the socket open)
        self.fp = io.BufferedReader(DeadlineReader(sock, deadline))


class _ClientCertificateRefused(Exception):
    """The member refused this client's certificate, found out after its alert was lost (the reason: the alert)."""


def _alert(exc: ssl.SSLError) -> bool:
    """A TLS alert from the member about this client's certificate (it refused it)."""
    return "ALERT" in str(exc.reason or "") and "CERTIFICATE" in str(exc.reason or "")


def backoff(round_: int) -> float:
    """The jittered pause after ``round_`` (1, 2, ...) whole rounds of members failed."""
    top = min(BACKOFF_MAX, BACKOFF_MIN * 2 ** max(0, round_ - 1))
    return random.uniform(top / 2, top)


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
        check_client_certificate(cert)
        ctx.load_cert_chain(cert, key)
    return ctx


class _Transport:
    """How one request reaches a member: a connection at a time, failover, bounds (see the module doc)."""

    endpoints: list[str]
    context: Optional[ssl.SSLContext]
    timeout: float
    try_timeout: float
    answer_times: AnswerTimes
    requests: int
    raft_term: int
    _current: int
    _conn: Optional[http.client.HTTPConnection]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _address(self) -> tuple[str, int]:
        """The current member's host (without an IPv6 address's brackets) and port."""
        host, _, port = self.endpoints[self._current].rpartition(":")
        return host.strip("[]"), int(port)

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        host, port = self._address()
        if self.context is not None:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self.context
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        deadline = Deadline()
        conn.response_class = functools.partial(_BoundedResponse, deadline=deadline)  # type: ignore[assignment]
        conn.lr_deadline = deadline  # type: ignore[attr-defined]
        conn.connect()  # the TLS handshake is bounded by ``timeout`` as a whole (CPython's own deadline)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _next_endpoint(self) -> None:
        self.close()
        self._current = (self._current + 1) % len(self.endpoints)

    def try_timeout_after(self, timed_out: int) -> float:
        """How long the next try of a request waits, after ``timed_out`` of its tries timed out."""
        first = self.answer_times.first_try(self.try_timeout)
        return min(MAX_TRY_TIMEOUT, first * 2 ** max(0, timed_out - QUICK_TRIES + 1))

    def _exchange(self, path: str, payload: bytes, try_for: float) -> tuple[int, bytes]:
        """One try: ``(HTTP status, body)`` of POST ``/v3/{path}`` to the current member, within ``try_for``."""
        until = time.monotonic() + try_for
        fresh = self._conn is None or self._conn.sock is None  # none yet, or the member closed it after an answer
        if fresh:
            self.close()
            self._conn = self._connect(try_for)
        assert self._conn is not None
        self._conn.sock.settimeout(max(0.001, until - time.monotonic()))
        self._conn.lr_deadline.at = until  # type: ignore[attr-defined]
        sent = time.monotonic()
        try:
            self._conn.request("POST", f"/v3/{path}", payload, {"Content-Type": "application/json"})
            self.requests += 1
            resp = self._conn.getresponse()
        except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError) as exc:
            refusal = self._refusal_of_this_client(until - time.monotonic()) if fresh else None
            if refusal is not None:
                raise _ClientCertificateRefused(refusal) from exc
            raise
        if resp.length is not None and resp.length > MAX_ANSWER_BYTES:
            self.close()
            raise EtcdRequestError(self._too_large(path, f"{resp.length} bytes"))
        data = resp.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            self.close()
            raise EtcdRequestError(self._too_large(path, "a longer answer"))
        self.answer_times.observe(time.monotonic() - sent)
        return resp.status, data

    def _refusal_of_this_client(self, timeout: float) -> Optional[str]:
        """The alert of the current member refusing this client's certificate, or None when it did not refuse it.

        A member that refuses the certificate sends an alert and closes. When the request was already sent, the
        close can overtake the alert (an EOF or a reset is all the client sees), so a connection that ends right
        after its handshake is asked again: a handshake followed by a read with nothing sent, which receives the
        alert whenever there is one. A member that accepted the certificate sends nothing: the read ends at
        ``timeout`` and the original problem stands.
        """
        if self.context is None or timeout <= 0:
            return None
        host, port = self._address()
        try:
            with socket.create_connection((host, port), timeout=timeout) as raw:
                with self.context.wrap_socket(raw, server_hostname=host) as tls:
                    tls.recv(1)
        except ssl.SSLError as exc:
            return str(exc.reason) if _alert(exc) else None
        except OSError:
            return None
        return None

    def _too_large(self, path: str, what: str) -> str:
        return (
            f"etcd at {self.endpoints[self._current]} answered /v3/{path} with {what}, over the "
            f"{MAX_ANSWER_BYTES} bytes this client reads. HINT: a job's keys are far smaller: check that the address "
            "is the job's etcd and that nothing else writes under the job's prefix"
        )

    def request(self, path: str, body: dict, timeout: Optional[float] = None) -> dict:
        """POST ``body`` to ``/v3/{path}``; fail over between members until ``timeout`` (default: the client's).

        Raises:
            EtcdUnavailable: no member answered within the deadline (each member's last problem named).
            EtcdCertificateError: every member's TLS handshake failed on a certificate (named per member).
            EtcdNoSpace: etcd's space quota is full (NOSPACE alarm).
            EtcdRequestError: etcd refused the request (retrying would not help).
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        payload = json.dumps(body).encode()
        problems: dict[str, str] = {}  # member -> its last problem in this call
        certificate: dict[str, str] = {}  # member -> the certificate problem of its handshake
        tried = timed_out = 0
        while True:
            left = deadline - time.monotonic()
            if tried and (left <= 0 or len(certificate) == len(self.endpoints)):
                raise self._gave_up(path, limit, problems, certificate)
            tried += 1
            member = self.endpoints[self._current]
            try:
                status, data = self._exchange(path, payload, max(0.05, min(left, self.try_timeout_after(timed_out))))
            except ssl.SSLCertVerificationError as exc:
                problems[member] = certificate[member] = f"its certificate was refused: {exc.verify_message}"
            except _ClientCertificateRefused as exc:
                problems[member] = certificate[member] = f"it refused this client's certificate ({exc})"
            except ssl.SSLError as exc:
                if _alert(exc):
                    problems[member] = certificate[member] = f"it refused this client's certificate ({exc.reason})"
                else:
                    problems[member] = f"TLS: {exc}"
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
                timed_out += isinstance(exc, TimeoutError)
                problems[member] = f"{type(exc).__name__}: {exc}"
            else:
                answer = _answer_of(status, data)
                if status == 200 and "error" not in answer:
                    self.raft_term = max(self.raft_term, int((answer.get("header") or {}).get("raft_term") or 0))
                    return answer
                code = int(answer.get("code", 14 if status >= 500 else 3))
                message = str(answer.get("message") or answer.get("error") or f"HTTP {status}").strip()
                if code == _EXHAUSTED and "too many requests" not in message:
                    raise EtcdNoSpace(
                        f"etcd at {member} refused /v3/{path}: {message} (its NOSPACE alarm: every write fails "
                        "until space is freed). HINT: compact, defragment, disarm: `etcdctl compact <revision from "
                        "etcdctl endpoint status -w json>`, `etcdctl defrag --cluster`, `etcdctl alarm disarm`; then "
                        "turn on compaction (--auto-compaction-retention) or raise --quota-backend-bytes"
                    )
                if "CommonName of client" in message:  # etcd's auth is on: its JSON gateway cannot serve it
                    raise EtcdRequestError(
                        f"etcd at {member} refused /v3/{path}: {message}. HINT: the cluster runs with authentication "
                        "(`etcdctl auth enable`), whose certificate identities etcd's JSON gateway (what this client "
                        "talks to) ignores: run the job on a cluster without --auth, one per trust domain "
                        "(docs/control_plane.md, 'A shared cluster')"
                    )
                if code not in _RETRY_CODES and code != _EXHAUSTED and status not in (502, 503, 504):
                    raise EtcdRequestError(f"etcd refused /v3/{path}: {message} (code {code})")
                problems[member] = message
            self._next_endpoint()
            if tried % len(self.endpoints) == 0:  # every member failed once more: pause before the next round
                time.sleep(min(backoff(tried // len(self.endpoints)), max(0.0, deadline - time.monotonic())))

    def _gave_up(self, path: str, limit: float, problems: dict[str, str], certificate: dict[str, str]) -> RecoverError:
        named = "; ".join(f"{m}: {p}" for m, p in problems.items())
        if certificate and len(certificate) == len(problems):
            return EtcdCertificateError(
                f"no etcd member of {','.join(self.endpoints)} could be reached for /v3/{path}: every TLS handshake "
                f"failed on a certificate ({named}). HINT: --etcd-cacert must be the CA that signed the members' "
                "certificates (whose SANs must name the address used), and the members must trust the CA of "
                "--etcd-cert; a member with a rotated or expired certificate needs a new one"
            )
        return EtcdUnavailable(
            f"no etcd member of {','.join(self.endpoints)} answered /v3/{path} within {limit:g}s ({named}). "
            "HINT: check that a majority of the etcd members run and that this host reaches them "
            "(LIGHTNING_RECOVER_CONTROL_PLANE)"
        )


class EtcdClient(_Transport):
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
        answer_times: Optional[AnswerTimes] = None,
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
        self.answer_times = answer_times if answer_times is not None else AnswerTimes()
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
            answer_times=self.answer_times,
        )

    def warm(self) -> None:
        """Open the connection now (TCP and the TLS handshake), so that the first request does not wait for it.
        A failure is left to that request, which fails over as usual."""
        if self._conn is None:
            try:
                self._conn = self._connect(self.timeout)
            except (OSError, http.client.HTTPException):
                self._next_endpoint()

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
        limit: int = 0,
        newest_first: bool = False,
    ) -> dict:
        """etcd's ``kv/range``; ``newest_first`` sorts by ``mod_revision``, newest first (with ``limit=1``:
        the range's most recently written key, and ``count`` still counts the whole range)."""
        body: dict[str, Any] = {"key": b64(key)}
        if limit:
            body["limit"] = str(limit)
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
        if newest_first:
            body["sort_order"], body["sort_target"] = "DESCEND", "MOD"
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

    def compact(self, revision: int) -> bool:
        """Compact etcd's history up to ``revision`` (the whole cluster's: etcd keeps one); False when it was
        compacted further already (by another client, or the members' own auto-compaction). Returns once the
        member removed the old revisions (``physical``): compactions never pile up behind a busy member."""
        try:
            self.request("kv/compaction", {"revision": str(revision), "physical": True})
        except EtcdRequestError as exc:
            if "compacted" in str(exc):
                return False
            raise
        return True

    # ------------------------------------------------------------------ watch
    def watch(
        self, key: bytes, start_revision: int, timeout: float, range_end: Optional[bytes] = None
    ) -> Generator[dict, None, None]:
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
            conn.lr_deadline.at = deadline  # type: ignore[attr-defined]
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), {"Content-Type": "application/json"})
            self.requests += 1
            resp = conn.getresponse()
            if resp.status != 200:
                return
            while True:
                if deadline - time.monotonic() <= 0:
                    return
                line = resp.readline(MAX_LINE_BYTES + 1)
                if not line or len(line) > MAX_LINE_BYTES:
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
            conn.lr_deadline.at = time.monotonic() + read_timeout  # type: ignore[attr-defined]
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), {"Content-Type": "application/json"})
            self.requests += 1
            resp = conn.getresponse()
            if resp.status != 200:
                self._next_endpoint()
                raise OSError(f"etcd watch answered HTTP {resp.status}")
            while True:
                conn.lr_deadline.at = time.monotonic() + read_timeout  # type: ignore[attr-defined]
                line = resp.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_LINE_BYTES:
                    raise OSError(f"an etcd watch message over {MAX_LINE_BYTES} bytes")
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


def _answer_of(status: int, data: bytes) -> dict:
    """A member's answer as JSON (a body that is not JSON: an error of code 2, retried elsewhere)."""
    try:
        answer = json.loads(data) if data else {}
    except ValueError:
        return {"error": data[:200].decode(errors="replace"), "code": 2}
    return answer if isinstance(answer, dict) else {"error": f"not a JSON object (HTTP {status})", "code": 2}


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


def in_lease(kv: dict, lease: int) -> bool:
    """Whether key-value ``kv`` (as etcd answers it) is attached to ``lease``. A create-if-absent transaction whose
    answer came late is sent again by :meth:`EtcdClient.request`, and the second finds the key the first wrote:
    the claim is its sender's all the same."""
    try:
        return int(kv.get("lease") or 0) == lease != 0
    except (TypeError, ValueError):
        return False


def created_in(answer: dict, lease: int) -> bool:
    """Whether a create-if-absent transaction (compare version 0, put in ``lease``, else get the key) holds the key
    now: it succeeded, or its get found the key in ``lease`` (an earlier try of the same request, see
    :func:`in_lease`)."""
    if answer.get("succeeded"):
        return True
    kv = first_kv(answer["responses"][0]) if answer.get("responses") else None
    return kv is not None and in_lease(kv, lease)


def first_kv(response: dict) -> Optional[dict]:
    """The key-value of a txn's ``response_range`` (None when the key was absent)."""
    kvs = (response.get("response_range") or {}).get("kvs") or []
    return kvs[0] if kvs else None
