"""The partition probe on the wire: an authenticated TCP exchange with a replica's probe server, many at once.

A probe connects to a replica's :class:`ProbeServer` (bound to the address its data traffic uses), sends a fresh
nonce and expects, within its timeout, an HMAC of it under the job's secret bound to the replica id and incarnation:
an unrelated process listening on a reused address never counts as the peer, and a TCP exchange needs both
directions, so one probe tests both. Its outcome (:data:`REACHED`, :data:`CUT`, :data:`NO_ANSWER`) and what
happened are what ``reachability.py`` decides a partition from.

A round of every link among N members is N x (N-1) probes (a larger group's first round probes a sample:
:func:`round_peers`). Both ends are one thread each whatever N is, where a thread per connection would make
thousands on a host of many replicas: the server answers every connection from one selector loop, and
:func:`probe_all` drives up to :data:`PROBES_IN_FLIGHT` probes at once from one, so a member's report is ready after
about one probe timeout up to that many peers (:func:`probe_waves`). Each prober starts with the members after
itself (:func:`probe_order`): the members' first probes spread over the servers instead of all reaching the lowest
id at once, where a full accept queue drops handshakes, and a connect that times out reads as a cut.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import os
import secrets
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Optional

from lightning_recover.protocol.messages import JobSecret

#: A probe's outcomes: the peer proved who it is; no connection to it (evidence of a partition); connected
#: but no answer in time (a starved or frozen peer: no evidence either way).
REACHED, CUT, NO_ANSWER = "reached", "cut", "no answer"
#: Probes one member has open at once: a round's report is ready within ``probe_waves(N)`` probe timeouts.
PROBES_IN_FLIGHT = 256
#: Peers each member probes in a sampled round (``reachability.py``: the first round of a group of more members).
SAMPLE_PEERS = 16
_HELLO = b"LRP1"
_NONCE = 16
_ANSWER = 32  # bytes of the HMAC-SHA256 answer
_BACKLOG = 1024  # handshakes the kernel completes before the server accepts them (capped by somaxconn)
_MAX_OPEN = 1024  # connections a server holds at once: more are closed unanswered (a flood costs nothing)
_HELLO_WITHIN = 2.0  # a connection that has not sent its hello by then is closed
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def answer(key: bytes, nonce: bytes, replica: int, incarnation: int) -> bytes:
    """What ``replica``'s incarnation ``incarnation`` answers to ``nonce`` under the job's ``key``."""
    return hmac.new(key, b"lr-probe\x00" + nonce + f"{replica}:{incarnation}".encode(), hashlib.sha256).digest()


def probe_order(me: Optional[int], others: Iterable[int]) -> list[int]:
    """``others`` in the order ``me`` probes them: the ids after ``me`` ascending, then those before it, so that
    every member starts with a different server (``me`` None: ascending)."""
    return sorted(others, key=lambda r: (me is not None and r <= me, r))


def round_peers(me: int, members: Iterable[int], sample: int, number: int) -> list[int]:
    """Whom ``me`` probes in round ``number``: every other member, or where ``sample`` is smaller than their count,
    ``sample`` of them: those ``k`` places after ``me`` in the ring of sorted ids for ``sample`` consecutive ``k``,
    starting ``number x sample`` places on. Each member is then probed by ``sample`` others, and the rounds numbered
    ``m`` to ``m + ceil((N - 1) / sample) - 1`` together probe every link."""
    ring = sorted(members)
    n = len(ring)
    if not sample or sample >= n - 1:
        return [r for r in ring if r != me]
    i = ring.index(me)
    return [ring[(i + (number * sample + j) % (n - 1) + 1) % n] for j in range(sample)]


def probe_waves(members: int) -> int:
    """How many probe timeouts a member's probes of the ``members - 1`` others take at most."""
    return max(1, math.ceil((members - 1) / PROBES_IN_FLIGHT))


class Target(NamedTuple):
    """A replica's published probe server: what a probe connects to and whom it expects to answer."""

    replica: int
    host: str
    port: int
    incarnation: int


class ProbeServer:
    """Answers authenticated probes on ``host`` (the address this replica's data traffic uses), from one thread."""

    def __init__(self, host: str, secret: JobSecret, replica: int, incarnation: int) -> None:
        self._key = secret.key
        self.replica, self.incarnation = replica, incarnation
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # only the data address, never every interface
        self._sock.listen(_BACKLOG)
        self._sock.setblocking(False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._wake, self._waker = socket.socketpair()  # close() writes to _waker: the loop ends at once
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"lr-probe-server-{replica}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        selector.register(self._wake, selectors.EVENT_READ)
        opened: dict[socket.socket, tuple[float, bytearray]] = {}  # connection -> (hello due by, hello so far)
        accepting = True
        try:
            while not self._closed:
                due = min((d for d, _ in opened.values()), default=None)
                wait = 0.5 if due is None else max(0.0, min(0.5, due - time.monotonic()))
                for key, _ in selector.select(wait):
                    if key.fileobj is self._wake:
                        return
                    if key.fileobj is self._sock:
                        if not self._accept(selector, opened):  # out of descriptors: wait for one to close
                            selector.unregister(self._sock)
                            accepting = False
                    else:
                        self._read_hello(selector, opened, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, (d, _) in opened.items() if d <= now]:
                    _close(selector, opened, conn)
                if not accepting and len(opened) < _MAX_OPEN:
                    selector.register(self._sock, selectors.EVENT_READ)
                    accepting = True
        finally:
            for conn in list(opened):
                conn.close()
            selector.close()
            self._sock.close()

    def _accept(self, selector: selectors.BaseSelector, opened: dict) -> bool:
        """Take every pending connection; False when the process is out of descriptors."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return True
            except OSError as exc:
                if exc.errno in _NO_FDS:
                    return False
                if exc.errno == errno.ECONNABORTED:
                    continue  # the peer gave up before we accepted: the next one
                return True  # anything else is not mended by asking again at once
            if len(opened) >= _MAX_OPEN:
                conn.close()  # the prober reads no answer: no evidence either way
                continue
            conn.setblocking(False)
            opened[conn] = (time.monotonic() + _HELLO_WITHIN, bytearray())
            selector.register(conn, selectors.EVENT_READ)

    def _read_hello(self, selector: selectors.BaseSelector, opened: dict, conn: socket.socket) -> None:
        _, hello = opened[conn]
        try:
            chunk = conn.recv(len(_HELLO) + _NONCE - len(hello))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""  # a probe that went away: nothing to answer
        if not chunk:
            _close(selector, opened, conn)
            return
        hello += chunk
        if len(hello) < len(_HELLO) + _NONCE:
            return
        if hello.startswith(_HELLO):
            try:
                conn.send(answer(self._key, bytes(hello[len(_HELLO) :]), self.replica, self.incarnation))
            except OSError:
                pass  # 32 bytes into a new connection's empty buffer: only a connection already gone refuses them
        _close(selector, opened, conn)

    def close(self) -> None:
        """Stop answering; the port refuses connections once this returns."""
        self._closed = True
        try:
            self._waker.send(b"x")
        except OSError:
            pass
        self._thread.join(5.0)
        self._sock.close()  # (the loop closed it; again in case it had not ended)
        self._wake.close()
        self._waker.close()


class _Probe:
    """One probe in flight: its target, nonce, deadline, socket, and the answer so far (None while connecting)."""

    __slots__ = ("target", "nonce", "deadline", "sock", "got")

    def __init__(self, target: Target, sock: socket.socket, deadline: float) -> None:
        self.target, self.sock, self.deadline = target, sock, deadline
        self.nonce = secrets.token_bytes(_NONCE)
        self.got: Optional[bytearray] = None

    def where(self) -> str:
        return f"{self.target.host}:{self.target.port}"


def probe_all(
    targets: Sequence[Target], secret: JobSecret, timeout: float, in_flight: int = PROBES_IN_FLIGHT
) -> dict[int, tuple[str, str]]:
    """Probe every target (at most ``in_flight`` at once, started in the given order), each within ``timeout`` of
    its start; ``{replica: (outcome, what happened)}``. What happened is "" for :data:`REACHED`, else the
    operator's evidence ("connection refused", "connect timed out")."""
    waiting = deque(targets)
    outcomes: dict[int, tuple[str, str]] = {}
    active: dict[socket.socket, _Probe] = {}
    selector = selectors.DefaultSelector()
    try:
        while waiting or active:
            while waiting and len(active) < in_flight:
                target = waiting.popleft()
                try:
                    started = _connect(target, timeout)
                except OSError as exc:
                    if exc.errno not in _NO_FDS:  # e.g. a name that does not resolve: nothing to connect to
                        outcomes[target.replica] = (
                            CUT,
                            f"connect to {target.host}:{target.port}: {exc.strerror or exc}",
                        )
                    elif active:
                        waiting.appendleft(target)  # out of descriptors here: once a probe in flight ends
                        break
                    else:  # this process's shortage says nothing about the network
                        outcomes[target.replica] = (NO_ANSWER, f"no probe of {target.host}:{target.port}: {exc}")
                    continue
                if isinstance(started, tuple):
                    outcomes[target.replica] = started
                    continue
                active[started.sock] = started
                selector.register(started.sock, selectors.EVENT_WRITE, started)
            if not active:
                continue
            wait = max(0.0, min(p.deadline for p in active.values()) - time.monotonic())
            for key, _ in selector.select(wait):
                p = key.data
                outcome = _advance(selector, p, secret)
                if outcome is not None:
                    _close(selector, active, p.sock)
                    outcomes[p.target.replica] = outcome
            now = time.monotonic()
            for p in [p for p in active.values() if p.deadline <= now]:
                _close(selector, active, p.sock)
                if p.got is None:
                    outcomes[p.target.replica] = (CUT, f"connect to {p.where()} timed out after {timeout:g}s")
                else:
                    outcomes[p.target.replica] = (NO_ANSWER, f"connected to {p.where()}, no answer (timed out)")
    finally:
        for p in list(active.values()):
            _close(selector, active, p.sock)
        selector.close()
    return outcomes


def _connect(target: Target, timeout: float) -> _Probe | tuple[str, str]:
    """A probe started (its connection under way), or its outcome if the connection failed at once."""
    family = socket.AF_INET6 if ":" in target.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        err = sock.connect_ex((target.host, target.port))
    except OSError:
        sock.close()  # (a name that does not resolve): the caller says so
        raise
    if err not in (0, errno.EINPROGRESS):
        sock.close()
        return CUT, f"connect to {target.host}:{target.port}: {os.strerror(err)}"
    return _Probe(target, sock, time.monotonic() + timeout)


def _advance(selector: selectors.BaseSelector, p: _Probe, secret: JobSecret) -> Optional[tuple[str, str]]:
    """Take the probe's next event: the connection made (send the hello) or answer bytes; its outcome once known."""
    if p.got is None:
        err = p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            return CUT, f"connect to {p.where()}: {os.strerror(err)}"
        try:
            p.sock.send(_HELLO + p.nonce)  # 20 bytes into a new connection's empty buffer
        except OSError as exc:
            return NO_ANSWER, f"connected to {p.where()}, no answer ({exc.strerror or exc})"
        p.got = bytearray()
        selector.modify(p.sock, selectors.EVENT_READ, p)
        return None
    try:
        chunk = p.sock.recv(_ANSWER - len(p.got))
    except BlockingIOError:
        return None
    except OSError as exc:  # the peer closed the connection unanswered (it is ending, or flooded)
        return NO_ANSWER, f"connected to {p.where()}, no answer ({exc.strerror or exc})"
    if not chunk:
        return NO_ANSWER, f"connected to {p.where()}, no answer (closed)"
    p.got += chunk
    if len(p.got) < _ANSWER:
        return None
    t = p.target
    if hmac.compare_digest(bytes(p.got), answer(secret.key, p.nonce, t.replica, t.incarnation)):
        return REACHED, ""
    return CUT, f"{p.where()} answered, but not as this job's replica {t.replica} (incarnation {t.incarnation})"


def _close(selector: selectors.BaseSelector, table: dict, sock: socket.socket) -> None:
    """Close a connection the selector watches and forget it (a server's connection, a probe in flight)."""
    selector.unregister(sock)
    del table[sock]
    sock.close()


def probe(host: str, port: int, secret: JobSecret, replica: int, incarnation: int, timeout: float) -> tuple[str, str]:
    """Whether the server at ``host:port`` proved, within ``timeout``, that it is ``replica``'s incarnation
    ``incarnation`` of this job: :func:`probe_all` of that one target."""
    return probe_all([Target(replica, host, port, incarnation)], secret, timeout)[replica]
