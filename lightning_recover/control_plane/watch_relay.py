"""One watch of the job's keys per host: a relay that serves its view to the host's processes.

Why: every process's :class:`~lightning_recover.control_plane.etcd_watch.WatchView` is a watch stream of its
own, so etcd sends every change of the job's keys once per process: a step's commit to N views, and each of N
joins at start-up to N views (N^2 events through etcd's gateway). etcd's own answer, ``etcd grpc-proxy``, coalesces watches on the same range,
but it speaks gRPC only, and this client speaks etcd's JSON gateway. The launcher of a host therefore runs a
:class:`WatchRelay`: one ``WatchView`` of the job's keys, followed by each local process over a Unix socket in
the job's private directory (0700). etcd then sends each change once per host.

What a follower (:class:`RelayedView`) may rely on is what a ``WatchView`` promises (a consistent past state,
never older than one it served, nothing while not known to be current): the relay sends its view's state (a
snapshot) and then every change in its view's order, each with the monotonic time the relay heard it from etcd
(one clock: a Unix socket joins processes of one host), so a follower is current exactly while the relay's view
is. A follower that falls too far behind is dropped and reconnects, as does one whose relay fell silent (a
relay on a starved host is slow, not gone); a follower that finds no relay (no socket, or refused) watches etcd
itself from then on, as it would without one. What crosses the socket is JSON
(nothing of it becomes code) and every value the protocol acts on is sealed by the job's secret, so a process of
another user could not forge one; the directory's mode keeps them from connecting at all.

Relays can follow a relay: a host's relay started with ``upstream=(host, port)`` follows a relay that serves over
TCP (``listen=``; ``lightning-recover watch-relay`` runs one, say one per rack) instead of watching etcd, so etcd
sends each change once per upstream relay, not once per host. Across hosts both ends prove they hold the job's
secret (an HMAC of the other's nonce) before anything is sent, each batch ends with an HMAC under a key of the
link's nonces (checked before any of its lines is applied), and the two hosts' monotonic clocks differ: each batch
starts with the relay's clock, and the follower dates a line with the least (receipt - clock) the link has shown
(as a view takes a message from etcd as heard when it arrives; a batch held back is not made newer). A host
relay whose upstream is gone (refused, or no proof within ``RELAY_SILENT_AFTER``) watches etcd itself and tries
the upstream again after ``UPSTREAM_RETRY_AFTER``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Optional, Protocol, Union

from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.etcd_watch import MAX_SYNC_KEYS, STALE_AFTER, WatchView
from lightning_recover.errors import RecoverError

#: Bytes a follower may have waiting in the relay before it is dropped (it reconnects and gets a snapshot).
BACKLOG_LIMIT = 64 << 20
#: Seconds a follower waits for a relay's next line before it connects again: longer than the relay's quietest
#: healthy gap (its view hears etcd at least every ``STALE_AFTER``, or confirms).
RELAY_SILENT_AFTER = 4 * STALE_AFTER
#: The longest line a follower reads: a snapshot of ``MAX_SYNC_KEYS`` keys of the job's size.
MAX_RELAY_LINE = 1 << 30
#: The longest path a Unix socket can be bound at (Linux: 108 bytes with the terminating zero).
MAX_SOCKET_PATH = 107
#: Seconds a relay whose upstream relay is gone watches etcd itself before it tries that relay again.
UPSTREAM_RETRY_AFTER = 30.0
_RETRY_MIN, _RETRY_MAX = 0.02, 0.5
_NONCE_BYTES = 16
_HELLO_LINE = 4096


class UpstreamChoice(Protocol):
    """Whom a relay follows over TCP, asked before each connection (rack_relay.RackRelayRole elects one per rack)."""

    def choose(self) -> Optional[tuple[str, int]]:
        """The relay to follow now; None where this relay is the one to watch etcd (it serves the others)."""
        ...

    def serving(self) -> bool:
        """Whether this relay still serves the others (asked often: no request)."""
        ...


#: Where a follower finds its relay: a Unix socket's path on this host, ``(host, port)`` of a relay over TCP, or
#: an :class:`UpstreamChoice` that names one before each connection.
RelayAddress = Union[str, tuple[str, int], UpstreamChoice]


def relay_proof(key: bytes, role: bytes, prefix: bytes, theirs: bytes, mine: bytes) -> str:
    """What one end of a TCP relay link sends to prove it holds the job's ``key``: an HMAC of the other end's
    nonce (``theirs``) with its own, bound to its ``role`` (``b"relay"``, ``b"follower"``) and the ``prefix``."""
    text = b"lr-watch-relay\x00" + role + b"\x00" + prefix + b"\x00" + theirs + mine
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def relay_session(key: bytes, prefix: bytes, follower_nonce: bytes, relay_nonce: bytes) -> bytes:
    """The key of one TCP link's batch MACs, from both ends' nonces: a batch of another link or an earlier one on
    this link does not pass."""
    text = b"lr-watch-relay-session\x00" + prefix + b"\x00" + follower_nonce + relay_nonce
    return hmac.new(key, text, hashlib.sha256).digest()


def batch_mac(session: bytes, number: int, batch: bytes) -> str:
    """The MAC a relay sends after the ``number``-th batch of a link (its lines, the ``clock`` line first)."""
    return hmac.new(session, number.to_bytes(8, "big") + batch, hashlib.sha256).hexdigest()


def past_backlog(queued: int, head: Optional[int], line: int, limit: int) -> bool:
    """Whether a follower whose queue holds ``queued`` bytes, ``head`` of them its first line (None: empty), is
    dropped rather than given a ``line`` more. The backlog is what waits behind the line being sent: the batch in
    flight and the head of the queue (the next batch's first line) do not count, so a snapshot larger than the
    limit is delivered even when changes arrive before the follower's thread has taken it."""
    return head is not None and queued - head + line > limit


class RelayPathTooLong(ValueError):
    """The relay's socket path is longer than a Unix socket can be bound at."""


class _RelayGone(Exception):
    """No relay answered at its address (or none proved itself): the follower watches etcd itself."""


class _ServesUpstream(Exception):
    """This relay's :class:`UpstreamChoice` says it is the one to watch etcd (it serves the others)."""


def _read_line(sock: socket.socket, limit: int) -> bytes:
    """One line read byte by byte (nothing past it is taken from the socket); ``ValueError`` past ``limit``."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            break
        line += byte
        if len(line) > limit:
            raise ValueError("a handshake line over the limit")
    return bytes(line)


def address_text(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _peer_name(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "?"
    return address_text(host, port)


class _Follower:
    """One process following the relay's view: its lines wait in a queue a thread of its own sends. A follower on
    another host (its link's ``session`` key given) gets each batch after a ``clock`` line (this host's monotonic
    time as it is sent) and before a ``mac`` line (:func:`batch_mac`)."""

    def __init__(self, conn: socket.socket, on_end, session: Optional[bytes] = None) -> None:
        self.conn = conn
        self.remote = session is not None
        self._session = session
        self._batches = 0  # batches sent on the link (each MAC covers its number)
        self.peer = _peer_name(conn) if self.remote else "this host"
        self._on_end = on_end
        self._cond = threading.Condition()
        self._lines: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._ended = False
        self._thread = threading.Thread(target=self._send, name="lr-watch-relay-send", daemon=True)

    def push(self, line: bytes) -> None:
        """Queue ``line`` (called under the view's lock: never blocks); past the backlog limit
        (:func:`past_backlog`), drop the follower."""
        with self._cond:
            if self._ended:
                return
            head = len(self._lines[0]) if self._lines else None
            if past_backlog(self._queued, head, len(line), BACKLOG_LIMIT):
                # It reconnects and starts again from a snapshot; the shutdown ends a send it blocks.
                self._ended = True
                with contextlib.suppress(OSError):
                    self.conn.shutdown(socket.SHUT_RDWR)
            else:
                self._lines.append(line)
                self._queued += len(line)
            self._cond.notify()

    def start(self) -> None:
        self._thread.start()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify()
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _send(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._lines and not self._ended:
                        self._cond.wait()
                    if self._ended:
                        return
                    batch = b"".join(self._lines)
                    self._lines.clear()
                    self._queued = 0
                if self._session is not None:
                    batch = json.dumps({"clock": time.monotonic()}).encode() + b"\n" + batch
                    mac = batch_mac(self._session, self._batches, batch)
                    batch += json.dumps({"mac": mac}).encode() + b"\n"
                    self._batches += 1
                self.conn.sendall(batch)
        except OSError:
            pass  # the follower went away
        finally:
            self.conn.close()
            self._on_end(self)


class WatchRelay:
    """A watch of ``prefix`` served to followers: over the Unix socket at ``path`` to this host's processes whose
    :class:`RelayedView` names it, and where ``listen`` is given (``(host, port)``, port 0: any free one), over
    TCP to relays on other hosts that prove they hold the job's key (``secret_key``). Its view watches etcd through
    ``client`` (its own stream and re-reads), or with ``upstream`` follows the relay there (TCP, the same key),
    falling back to etcd while that relay is gone. ``say``: a line for each relay that starts or stops following."""

    def __init__(
        self,
        client: ec.EtcdClient,
        prefix: bytes,
        path: Optional[str] = None,
        stale_after: float = STALE_AFTER,
        *,
        listen: Optional[tuple[str, int]] = None,
        upstream: Optional[Union[tuple[str, int], UpstreamChoice]] = None,
        secret_key: Optional[bytes] = None,
        say: Optional[Callable[[str], object]] = None,
    ) -> None:
        if path is None and listen is None:
            raise ValueError("a watch relay serves a Unix socket (path=) or TCP (listen=), or both")
        if (listen is not None or upstream is not None) and not secret_key:
            raise ValueError("a watch relay that serves or follows over TCP needs the job's secret (secret_key=)")
        if path is not None and len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise RelayPathTooLong(
                f"the watch relay's socket path {path} is over {MAX_SOCKET_PATH} bytes. "
                "HINT: set TMPDIR to a shorter directory"
            )
        self.path = path
        self._key = secret_key
        self._say = say
        if upstream is not None:
            self.view: WatchView = RelayedView(upstream, client, prefix, stale_after, secret_key=secret_key, say=say)
        else:
            self.view = WatchView(client, prefix, stale_after)
        self._lock = threading.Lock()
        self._followers: list[_Follower] = []
        self.served = 0  # followers that connected (load figures)
        self._closed = threading.Event()
        self._listeners: list[tuple[socket.socket, bool]] = []  # (listener, remote followers)
        try:
            if path is not None:
                unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listeners.append((unix, False))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a relay of an earlier run on this host left it (its directory is the job's)
                unix.bind(path)
                os.chmod(path, 0o600)
                unix.listen(128)
            self.address: Optional[tuple[str, int]] = None
            if listen is not None:
                host, port = listen
                tcp = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
                self._listeners.append((tcp, True))
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((host, port))
                tcp.listen(128)
                self.address = (host, tcp.getsockname()[1])
        except BaseException:
            for listener, _ in self._listeners:
                listener.close()
            raise
        self._accepting = [
            threading.Thread(target=self._accept, args=(listener, remote), name="lr-watch-relay", daemon=True)
            for listener, remote in self._listeners
        ]

    def start(self) -> WatchRelay:
        self.view.start()
        for thread in self._accepting:
            thread.start()
        return self

    @property
    def followers(self) -> int:
        with self._lock:
            return len(self._followers)

    def close(self) -> None:
        """Stop serving (followers then watch etcd themselves) and stop the view."""
        self._closed.set()
        for listener, _ in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for thread in self._accepting:
            if thread.is_alive():
                thread.join(2.0)
        with self._lock:
            followers, self._followers = list(self._followers), []
        for follower in followers:
            self.view.unfollow(follower.push)
            follower.end()
        for follower in followers:
            follower.join(2.0)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.view.close()

    def _accept(self, listener: socket.socket, remote: bool) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            greet = self._greet_remote if remote else self._greet
            threading.Thread(target=greet, args=(conn,), name="lr-watch-relay-greet", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        """Read the follower's hello (the prefix it wants); serve it if that is this relay's prefix."""
        try:
            conn.settimeout(RELAY_SILENT_AFTER)
            hello = json.loads(conn.makefile("rb").readline(_HELLO_LINE) or b"{}")
            conn.settimeout(None)
            wanted = ec.unb64(hello.get("prefix")) if isinstance(hello, dict) else b""
            if wanted != self.view.prefix:
                self._refuse(conn, wanted)
                return
        except (OSError, ValueError):
            conn.close()
            return
        self._serve(conn, None)

    def _greet_remote(self, conn: socket.socket) -> None:
        """A relay on another host: each end proves it holds the job's secret (:func:`relay_proof`) before the
        prefix is looked at; a follower that cannot is closed unanswered."""
        assert self._key is not None
        try:
            conn.settimeout(RELAY_SILENT_AFTER)
            lines = conn.makefile("rb")
            hello = json.loads(lines.readline(_HELLO_LINE) or b"{}")
            wanted = ec.unb64(hello["prefix"])
            theirs = bytes.fromhex(hello["nonce"])
            mine = os.urandom(_NONCE_BYTES)
            proof = relay_proof(self._key, b"relay", wanted, theirs, mine)
            conn.sendall(json.dumps({"nonce": mine.hex(), "proof": proof}).encode() + b"\n")
            reply = json.loads(lines.readline(_HELLO_LINE) or b"{}")
            expected = relay_proof(self._key, b"follower", wanted, mine, theirs)
            if not hmac.compare_digest(str(reply.get("proof", "")), expected):
                conn.close()
                return
            conn.settimeout(None)
            if wanted != self.view.prefix:
                self._refuse(conn, wanted)
                return
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            conn.close()
            return
        self._serve(conn, relay_session(self._key, wanted, theirs, mine))

    def _refuse(self, conn: socket.socket, wanted: bytes) -> None:
        refusal = f"this relay serves {self.view.prefix!r}, not {wanted!r}"
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"refused": refusal}).encode() + b"\n")
        conn.close()

    def _serve(self, conn: socket.socket, session: Optional[bytes]) -> None:
        """Serve ``conn``: a follower of this host, or of another whose link's MAC key is ``session``."""
        follower = _Follower(conn, self._ended, session)
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._followers.append(follower)
            self.served += 1
            self.view.follow(follower.push)
            count = len(self._followers)
        follower.start()
        if follower.remote and self._say is not None:
            self._say(f"a relay at {follower.peer} follows this one ({count} followers)")

    def _ended(self, follower: _Follower) -> None:
        self.view.unfollow(follower.push)
        with self._lock:
            if follower in self._followers:
                self._followers.remove(follower)
            count = len(self._followers)
        if follower.remote and self._say is not None and not self._closed.is_set():
            self._say(f"the relay at {follower.peer} stopped following this one ({count} followers)")


class RelayedView(WatchView):
    """A :class:`WatchView` fed by a :class:`WatchRelay` at ``relay`` (this host's Unix socket, or ``(host, port)``
    of a relay over TCP, which needs the job's ``secret_key``) instead of a watch stream of its own; where no relay
    answers, it watches etcd through ``client`` as a ``WatchView`` does (for good on a Unix socket: the host's relay
    is gone with its launcher; for ``UPSTREAM_RETRY_AFTER`` at a time over TCP)."""

    def __init__(
        self,
        relay: RelayAddress,
        client: ec.EtcdClient,
        prefix: bytes,
        stale_after: float = STALE_AFTER,
        secret_key: Optional[bytes] = None,
        say: Optional[Callable[[str], object]] = None,
    ):
        super().__init__(client, prefix, stale_after)
        if not isinstance(relay, str) and not secret_key:
            raise ValueError("following a relay over TCP needs the job's secret (secret_key=)")
        self.relay = relay
        self._target = relay if isinstance(relay, tuple) else None  # the TCP relay followed, or last chosen
        self._key = secret_key
        self.relayed = True  # False while it watches etcd itself
        self._sock: Optional[socket.socket] = None
        self._offset = 0.0  # this host's monotonic clock less the relay's (0 on one host; see _take)
        self._session: Optional[bytes] = None  # the TCP link's MAC key, from its handshake
        self._say = say  # a line each time it leaves a relay over TCP for etcd, and comes back
        self.found_gone = 0  # tries that found its TCP relay gone (each followed by UPSTREAM_RETRY_AFTER on etcd)
        #: what it last said: None (nothing yet), the relay it follows, or False (it left it for etcd)
        self._announced: Union[None, bool, tuple[str, int]] = None

    def close(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        super().close()

    def _run(self) -> None:
        delay = _RETRY_MIN
        while not self._stop.is_set():
            try:
                if self._follow_relay():
                    delay = _RETRY_MIN
            except _RelayGone as gone:
                self.relayed = False
                if isinstance(self.relay, str):
                    super()._run()
                    return
                self.found_gone += 1
                if self._say is not None and self._announced is not False:  # once per leave, not each retry
                    self._say(f"watching etcd itself, trying the relay again every {UPSTREAM_RETRY_AFTER:g}s: {gone}")
                self._announced = False
                super()._run(until=time.monotonic() + UPSTREAM_RETRY_AFTER)
                self.relayed = True
                continue
            except _ServesUpstream:
                self.relayed = False
                self._announced = None  # its choice said so; following a relay again is said again
                super()._run(until=time.monotonic() + UPSTREAM_RETRY_AFTER)  # and on while it serves
                self.relayed = True
                continue
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a relay dropped this follower, or sent what it should not: reconnect
            self._lose()
            self._stop.wait(delay)
            delay = min(delay * 2, _RETRY_MAX)

    def _keep_watching(self, until: float) -> bool:
        serves = not isinstance(self.relay, (str, tuple)) and self.relay.serving()
        return serves or super()._keep_watching(until)

    def _connect(self) -> socket.socket:
        """A connection to the relay, hello sent (over TCP, the relay proved itself and this end did); ``_RelayGone``
        when none answers. Kept in ``self._sock`` (``close`` shuts it down)."""
        if isinstance(self.relay, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock = sock
            sock.settimeout(RELAY_SILENT_AFTER)
            try:
                sock.connect(self.relay)
            except OSError as exc:
                raise _RelayGone(str(exc)) from exc
            sock.sendall(json.dumps({"prefix": ec.b64(self.prefix)}).encode() + b"\n")
            return sock
        assert self._key is not None
        if not isinstance(self.relay, tuple):
            try:
                self._target = self.relay.choose()
            except (RecoverError, ValueError) as exc:
                raise _RelayGone(f"no relay chosen: {exc}") from exc
            if self._target is None:
                raise _ServesUpstream()
        assert self._target is not None
        where = f"{self._target[0]}:{self._target[1]}"
        try:
            sock = socket.create_connection(self._target, timeout=RELAY_SILENT_AFTER)
        except OSError as exc:
            raise _RelayGone(f"no relay at {where}: {exc}") from exc
        self._sock = sock
        try:
            mine = os.urandom(_NONCE_BYTES)
            sock.sendall(json.dumps({"prefix": ec.b64(self.prefix), "nonce": mine.hex()}).encode() + b"\n")
            # Unbuffered: the relay sends nothing after its proof until it has this end's, so no byte of the
            # stream is read here.
            answer = json.loads(_read_line(sock, _HELLO_LINE) or b"{}")
            theirs = bytes.fromhex(answer["nonce"])
            expected = relay_proof(self._key, b"relay", self.prefix, mine, theirs)
            if not hmac.compare_digest(str(answer.get("proof", "")), expected):
                raise _RelayGone(f"the relay at {where} did not prove it holds the job's secret")
            proof = relay_proof(self._key, b"follower", self.prefix, theirs, mine)
            sock.sendall(json.dumps({"proof": proof}).encode() + b"\n")
            self._session = relay_session(self._key, self.prefix, mine, theirs)
            self._offset = math.inf  # until this link's first clock line
            if self._say is not None and self._announced != self._target:
                self._say(f"following the relay at {where}")
            self._announced = self._target
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _RelayGone(f"no proof from the relay at {where} within {RELAY_SILENT_AFTER:g}s: {exc!r}") from exc
        return sock

    def _follow_relay(self) -> bool:
        """Apply the relay's lines until it ends the connection or is silent for ``RELAY_SILENT_AFTER``; True if
        any arrived. ``_RelayGone`` when there is none (no socket, refused, closed at once, or another prefix)."""
        try:
            lines = self._connect().makefile("rb")
            remote = not isinstance(self.relay, str)
            where = f"{self._target[0]}:{self._target[1]}" if remote and self._target else "this host"
            batch: list[bytes] = []  # over TCP: a batch's lines, applied once its MAC passed
            batches = 0
            heard_any = False
            while not self._stop.is_set():
                try:
                    line = lines.readline(MAX_RELAY_LINE + 1)
                except TimeoutError:
                    # A relay on a starved host is slow, not gone (a gone one refuses the connection): again.
                    return heard_any
                if not line:
                    if heard_any:
                        return True
                    raise _RelayGone("the relay closed the connection at once")
                if len(line) > MAX_RELAY_LINE:
                    raise ValueError("a relay line over the limit")
                if not remote:
                    self._take(json.loads(line))
                elif not line.startswith(b'{"mac":'):
                    batch.append(line)
                    if sum(map(len, batch)) > MAX_RELAY_LINE + BACKLOG_LIMIT:
                        raise ValueError("a relay batch over the limit")
                    continue
                else:
                    assert self._session is not None
                    if not hmac.compare_digest(
                        json.loads(line)["mac"], batch_mac(self._session, batches, b"".join(batch))
                    ):
                        raise _RelayGone(f"a batch from the relay at {where} failed its MAC")
                    batches += 1
                    for taken in batch:
                        self._take(json.loads(taken))
                    batch.clear()
                heard_any = True
            return heard_any
        finally:
            sock, self._sock = self._sock, None  # the connection _connect made, also where its handshake failed
            if sock is not None:
                sock.close()

    def _take(self, change: dict) -> None:
        """Apply one of the relay's lines (``etcd_watch.change_line``)."""
        if "refused" in change:
            raise _RelayGone(str(change["refused"]))
        kind, body = next(iter(change.items()))
        if kind == "lost":
            self._lose()
            return
        if kind == "clock":  # a relay on another host: the batch that follows was sent at its time ``body``
            if isinstance(self.relay, str):
                raise ValueError("a clock line from a relay on this host")
            # The least (receipt - sending time) of the link: a batch held back on the way does not date the state
            # it carries later than the link's quickest batch showed the two clocks to be apart.
            self._offset = min(self._offset, time.monotonic() - float(body))
            return
        if math.isinf(self._offset):
            raise ValueError("a dated relay line before the link's first clock line")
        # On one host one monotonic clock (offset 0); a time ahead of this process's can only be a relay's error.
        heard = min(float(body["heard"]) + self._offset, time.monotonic())
        revision, term = int(body["revision"]), int(body["term"])
        if kind == "snapshot":
            kvs = body["kvs"]
            if len(kvs) > MAX_SYNC_KEYS:
                raise ValueError("a relay snapshot over the view's key limit")
            if revision < self.revision:
                raise ValueError(f"a relay snapshot at revision {revision} after this view applied {self.revision}")
            self._replace(kvs, revision, term, heard)
        elif kind == "events":
            self._apply_events(body["events"], term, heard)
        elif kind == "current":
            with self._cond:
                self._confirmed(revision, term, heard)
        else:
            raise ValueError(f"a relay line of unknown kind {kind!r}")
