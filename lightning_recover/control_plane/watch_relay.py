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
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import threading
import time
from typing import Optional

from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.etcd_watch import MAX_SYNC_KEYS, STALE_AFTER, WatchView

#: Bytes a follower may have waiting in the relay before it is dropped (it reconnects and gets a snapshot).
BACKLOG_LIMIT = 64 << 20
#: Seconds a follower waits for a relay's next line before it connects again: longer than the relay's quietest
#: healthy gap (its view hears etcd at least every ``STALE_AFTER``, or confirms).
RELAY_SILENT_AFTER = 4 * STALE_AFTER
#: The longest line a follower reads: a snapshot of ``MAX_SYNC_KEYS`` keys of the job's size.
MAX_RELAY_LINE = 1 << 30
#: The longest path a Unix socket can be bound at (Linux: 108 bytes with the terminating zero).
MAX_SOCKET_PATH = 107
_RETRY_MIN, _RETRY_MAX = 0.02, 0.5


def past_backlog(queued: int, head: Optional[int], line: int, limit: int) -> bool:
    """Whether a follower whose queue holds ``queued`` bytes, ``head`` of them its first line (None: empty), is
    dropped rather than given a ``line`` more. The backlog is what waits behind the line being sent: the batch in
    flight and the head of the queue (the next batch's first line) do not count, so a snapshot larger than the
    limit is delivered even when changes arrive before the follower's thread has taken it."""
    return head is not None and queued - head + line > limit


class RelayPathTooLong(ValueError):
    """The relay's socket path is longer than a Unix socket can be bound at."""


class _RelayGone(Exception):
    """No relay answered at the path: the follower watches etcd itself."""


class _Follower:
    """One local process following the relay's view: its lines wait in a queue a thread of its own sends."""

    def __init__(self, conn: socket.socket, on_end) -> None:
        self.conn = conn
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
                self.conn.sendall(batch)
        except OSError:
            pass  # the follower went away
        finally:
            self.conn.close()
            self._on_end(self)


class WatchRelay:
    """A host's watch of ``prefix`` on etcd, served over the Unix socket at ``path`` to every local process whose
    :class:`RelayedView` names it. ``client`` is the relay's own (its stream and its re-reads)."""

    def __init__(self, client: ec.EtcdClient, prefix: bytes, path: str, stale_after: float = STALE_AFTER) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise RelayPathTooLong(
                f"the watch relay's socket path {path} is over {MAX_SOCKET_PATH} bytes. "
                "HINT: set TMPDIR to a shorter directory"
            )
        self.path = path
        self.view = WatchView(client, prefix, stale_after)
        self._lock = threading.Lock()
        self._followers: list[_Follower] = []
        self.served = 0  # followers that connected (load figures)
        self._closed = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a relay of an earlier run on this host left it (its directory is the job's)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(128)
        self._accepting = threading.Thread(target=self._accept, name="lr-watch-relay", daemon=True)

    def start(self) -> WatchRelay:
        self.view.start()
        self._accepting.start()
        return self

    @property
    def followers(self) -> int:
        with self._lock:
            return len(self._followers)

    def close(self) -> None:
        """Stop serving (followers then watch etcd themselves) and stop the view."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepting.join(2.0)
        with self._lock:
            followers, self._followers = list(self._followers), []
        for follower in followers:
            self.view.unfollow(follower.push)
            follower.end()
        for follower in followers:
            follower.join(2.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.view.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._greet, args=(conn,), name="lr-watch-relay-greet", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        """Read the follower's hello (the prefix it wants); serve it if that is this relay's prefix."""
        try:
            conn.settimeout(RELAY_SILENT_AFTER)
            hello = json.loads(conn.makefile("rb").readline(4096) or b"{}")
            conn.settimeout(None)
            wanted = ec.unb64(hello.get("prefix")) if isinstance(hello, dict) else b""
            if wanted != self.view.prefix:
                refusal = f"this relay serves {self.view.prefix!r}, not {wanted!r}"
                conn.sendall(json.dumps({"refused": refusal}).encode() + b"\n")
                conn.close()
                return
        except (OSError, ValueError):
            conn.close()
            return
        follower = _Follower(conn, self._ended)
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._followers.append(follower)
            self.served += 1
            self.view.follow(follower.push)
        follower.start()

    def _ended(self, follower: _Follower) -> None:
        self.view.unfollow(follower.push)
        with self._lock:
            if follower in self._followers:
                self._followers.remove(follower)


class RelayedView(WatchView):
    """A :class:`WatchView` fed by the host's :class:`WatchRelay` at ``relay_path`` instead of a watch stream of
    its own; where no relay answers, it watches etcd through ``client`` as a ``WatchView`` does."""

    def __init__(self, relay_path: str, client: ec.EtcdClient, prefix: bytes, stale_after: float = STALE_AFTER):
        super().__init__(client, prefix, stale_after)
        self.relay_path = relay_path
        self.relayed = True  # False once it watches etcd itself
        self._sock: Optional[socket.socket] = None

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
            except _RelayGone:
                self.relayed = False
                super()._run()
                return
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a relay dropped this follower, or sent what it should not: reconnect
            self._lose()
            self._stop.wait(delay)
            delay = min(delay * 2, _RETRY_MAX)

    def _follow_relay(self) -> bool:
        """Apply the relay's lines until it ends the connection or is silent for ``RELAY_SILENT_AFTER``; True if
        any arrived. ``_RelayGone`` when there is none (no socket, refused, closed at once, or another prefix)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = sock
        try:
            sock.settimeout(RELAY_SILENT_AFTER)
            try:
                sock.connect(self.relay_path)
            except OSError as exc:
                raise _RelayGone(str(exc)) from exc
            sock.sendall(json.dumps({"prefix": ec.b64(self.prefix)}).encode() + b"\n")
            lines = sock.makefile("rb")
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
                self._take(json.loads(line))
                heard_any = True
            return heard_any
        finally:
            self._sock = None
            sock.close()

    def _take(self, change: dict) -> None:
        """Apply one of the relay's lines (``etcd_watch.change_line``)."""
        if "refused" in change:
            raise _RelayGone(str(change["refused"]))
        kind, body = next(iter(change.items()))
        if kind == "lost":
            self._lose()
            return
        # One host, one monotonic clock; a time ahead of this process's can only be a relay's error.
        heard = min(float(body["heard"]), time.monotonic())
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
