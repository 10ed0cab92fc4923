"""The data plane of the scale harness, stood in for: the job's groups and all-reduces meet in memory.

What it stands in for is gloo: a generation's process group (its build waits until every member came, as a
rendezvous does) and its collectives (an all-reduce completes once every member of the group started it,
with the sum of their tensors in each). A member killed by the harness fails every operation of every group
it belongs to at once, as its closed sockets fail gloo's; a member that stops without being killed (hung)
leaves the others' operations waiting, as gloo does, until the control plane tells them (a death notice).

Why a stand-in: gloo's full mesh among N members of one process is N x (N - 1) sockets and a thread pool per
member; at the harness's hundreds of replicas on 2 cores that measures gloo, not the control plane. Everything
the control plane does around it (the generation's membership, the barrier's place in the commit rule, the
failure checks between slices of a wait) runs unchanged: :class:`StandInGroups` is what
``Membership.groups`` holds instead of a ``ProcessGroups``.

Across processes: the harness's process holds the job's :class:`StandInDataPlane` in a
:class:`DataPlaneServer` (TCP on 127.0.0.1); each worker process of replica threads holds one
:class:`DataPlaneClient`, which offers :class:`StandInGroups` what the plane itself offers (a build, an
all-reduce, a kill), over one connection multiplexed by request id. A frame is a length-prefixed JSON header
and, for a tensor, its raw bytes, of a dtype from :data:`DTYPES`: nothing read from the socket is unpickled or
otherwise turned into code. A worker whose connection closes without a goodbye died: its replicas are killed
on the plane, as their closed sockets would fail gloo's operations.
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from lightning_recover.errors import MembershipChanged

_SLICE = 0.005  # seconds a build waits between two looks for a failure of the generation


class PeerClosed(RuntimeError):
    """A member of the group died: what gloo raises when a peer's sockets close."""


class _Work:
    """One started collective: a torch future, completed by the last member to start it."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> bool:
        self.future.wait()  # raises the operation's error
        return True


class _Meeting:
    """Generation ``number``'s group: who came (rank -> replica), its operations in start order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ranks: dict[int, int] = {}
        self.ops: dict[int, dict[int, tuple[torch.Tensor, _Work]]] = {}  # op index -> rank -> (tensor, work)
        self.first_arrival: dict[int, float] = {}  # op index -> when its first member started it (monotonic)
        self.started: dict[int, int] = {}  # rank -> operations it started
        self.broken: str | None = None


class StandInDataPlane:
    """The data plane every replica thread of one job shares."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._meetings: dict[int, _Meeting] = {}
        self._dead: set[int] = set()
        self.operations = 0  # collectives completed (a check that the reduce ran)
        #: (when, seconds from its first member's start to its last's) of each completed collective: how long the
        #: first member waited for the others to come, which a real all-reduce cannot shorten either
        self.arrival_spreads: list[tuple[float, float]] = []

    def kill(self, replica: int) -> None:
        """``replica``'s process died: every operation of a group it belongs to fails now, and later ones at once."""
        failed: list[_Work] = []
        why = f"replica {replica} died (its connections closed)"
        with self._lock:
            self._dead.add(replica)
            for meeting in self._meetings.values():
                if replica in meeting.ranks.values() and meeting.broken is None:
                    meeting.broken = why
                    failed += [work for op in meeting.ops.values() for _, work in op.values()]
                    meeting.ops.clear()
                    meeting.first_arrival.clear()
            self._lock.notify_all()
        for work in failed:
            if not work.future.done():
                work.future.set_exception(PeerClosed(f"stand-in gloo: {why}"))

    def wake(self) -> None:
        """Have every waiting build look at its ``failure_seen`` now (one it depends on just changed)."""
        with self._lock:
            self._lock.notify_all()

    def build(
        self,
        replica: int,
        number: int,
        rank: int,
        size: int,
        failure_seen: Callable[[], bool],
        slice_s: float = _SLICE,
    ) -> _Meeting:
        """Wait until all ``size`` members of generation ``number`` came; MembershipChanged if one fails first
        (``failure_seen`` is asked every ``slice_s`` seconds, and on every :meth:`wake`)."""
        with self._lock:
            meeting = self._meetings.setdefault(number, _Meeting(size))
            meeting.ranks[rank] = replica
            self._lock.notify_all()
            while len(meeting.ranks) < size and meeting.broken is None:
                gone = self._dead & set(meeting.ranks.values())
                if gone:
                    meeting.broken = f"replica {min(gone)} died before the group was built"
                    break
                self._lock.wait(slice_s)
                self._lock.release()
                try:
                    seen = failure_seen()
                finally:
                    self._lock.acquire()
                if seen:
                    raise MembershipChanged(f"a member of generation {number} failed while it was being built")
            if meeting.broken is not None:
                raise MembershipChanged(f"building generation {number} failed: {meeting.broken}")
            # Groups of generations before the newest this member built are never used again: forget them.
            for old in [n for n in self._meetings if n < number - 2]:
                del self._meetings[old]
            return meeting

    def allreduce(self, meeting: _Meeting, rank: int, tensor: torch.Tensor) -> _Work:
        """Start this member's part of the group's next all-reduce (a sum, in place)."""
        work = _Work()
        done: list[tuple[torch.Tensor, _Work]] = []
        with self._lock:
            index = meeting.started.get(rank, 0)
            meeting.started[rank] = index + 1
            if meeting.broken is not None:
                error: BaseException | None = PeerClosed(f"stand-in gloo: {meeting.broken}")
            else:
                error = None
                op = meeting.ops.setdefault(index, {})
                now = time.monotonic()
                first = meeting.first_arrival.setdefault(index, now)
                op[rank] = (tensor, work)
                if len(op) == meeting.size:
                    done = list(meeting.ops.pop(index).values())
                    del meeting.first_arrival[index]
                    self.operations += 1
                    self.arrival_spreads.append((now, now - first))
        if error is not None:
            work.future.set_exception(error)
            return work
        if done:
            total = torch.stack([t for t, _ in done]).sum(0)
            for t, w in done:
                t.copy_(total)
                w.future.set_result([t])
        return work


class _Group:
    """What ``Generation.pg`` holds: this member's handle on its generation's meeting."""

    def __init__(self, plane: Any, meeting: Any, rank: int) -> None:
        self._plane, self._meeting, self._rank = plane, meeting, rank

    def allreduce(self, tensors: Sequence[torch.Tensor], *_: Any) -> _Work:
        (tensor,) = tensors
        return self._plane.allreduce(self._meeting, self._rank, tensor)

    def size(self) -> int:
        return self._meeting.size

    def rank(self) -> int:
        return self._rank


class StandInGroups:
    """What one replica's ``Membership.groups`` holds instead of a ``ProcessGroups``: builds meet on ``plane``,
    the job's :class:`StandInDataPlane` or a :class:`DataPlaneClient` of it (the same three calls)."""

    def __init__(self, plane: Any, replica: int) -> None:
        self._plane, self._replica = plane, replica

    @property
    def abandoned_work(self) -> bool:
        return False  # nothing of gloo's to end without destructors

    @property
    def abandoned_alive(self) -> int:
        return 0

    def started(self, pg: Any, works: list) -> None:
        """Nothing to remember: an abandoned stand-in group holds no threads or sockets."""

    def abandon(self, pg: Any) -> None:
        """Nothing to tear down (see :meth:`started`)."""

    def release(self, pg: Any) -> bool:
        """Nothing to tear down: the group may be dropped (see :meth:`started`)."""
        return True

    def build(self, store: Any, number: int, rank: int, size: int, failure_seen: Callable[[], bool]) -> _Group:
        """Generation ``number``'s group, once all its members came (``store``, the rendezvous, is not used)."""
        meeting = self._plane.build(self._replica, number, rank, size, failure_seen)
        return _Group(self._plane, meeting, rank)


# ---------------------------------------------------------------------- across processes
#: the dtypes a frame may carry, by name; a frame naming any other is refused
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_FRAME = struct.Struct(">II")  # the JSON header's length, the payload's length
_MAX_HEADER = 1 << 16  # a header is a handful of fields: anything longer is not one of ours
_MAX_PAYLOAD = 1 << 31
#: the errors a reply may name; a name outside these is raised as a RuntimeError
#: a served build needs no polling: a cancel wakes it (and an arrival, a kill); the slice is a safety net only,
#: since hundreds of builds waking every few milliseconds would spend the server's process on nothing
_SERVED_SLICE = 0.5
_ERRORS: dict[str, type[Exception]] = {"MembershipChanged": MembershipChanged, "PeerClosed": PeerClosed}


def send_frame(sock: socket.socket, lock: threading.Lock, header: dict, payload: bytes = b"") -> None:
    """Send one frame: the header (JSON) and ``payload`` (raw bytes), each length-prefixed."""
    data = json.dumps(header, separators=(",", ":")).encode()
    with lock:
        sock.sendall(_FRAME.pack(len(data), len(payload)) + data + payload)


def _read_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Optional[tuple[dict, bytes]]:
    """The next frame's header and payload; None once the peer closed; ValueError for a malformed frame."""
    prefix = _read_exact(sock, _FRAME.size)
    if prefix is None:
        return None
    size, length = _FRAME.unpack(prefix)
    if size > _MAX_HEADER or length > _MAX_PAYLOAD:
        raise ValueError(f"a frame of {size} header and {length} payload bytes is not one of the data plane's")
    raw = _read_exact(sock, size)
    payload = _read_exact(sock, length) if length else b""
    if raw is None or payload is None:
        return None
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("a frame's header is not a JSON object")
    return header, payload


def tensor_frame(tensor: torch.Tensor) -> tuple[dict, bytes]:
    """A CPU tensor as header fields (dtype, shape) and its raw bytes."""
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"the stand-in data plane carries no {tensor.dtype}")
    flat = tensor.detach().contiguous().reshape(-1)
    return {"dtype": name, "shape": list(tensor.shape)}, flat.view(torch.uint8).numpy().tobytes()


def frame_tensor(header: dict, payload: bytes) -> torch.Tensor:
    """The tensor a frame carries; ValueError unless its dtype is one of :data:`DTYPES` and its shape fits the
    payload exactly."""
    name, shape = header.get("dtype"), header.get("shape")
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one the data plane carries")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"bad shape {shape!r}")
    dtype = DTYPES[name]
    if math.prod(shape) * torch.empty(0, dtype=dtype).element_size() != len(payload):
        raise ValueError(f"{len(payload)} bytes do not hold a {name} tensor of shape {shape}")
    if not payload:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


def _error(header: dict) -> Optional[Exception]:
    name = header.get("error")
    if name is None:
        return None
    kind = _ERRORS.get(name, RuntimeError) if isinstance(name, str) else RuntimeError
    return kind(str(header.get("message", name)))


class DataPlaneServer:
    """The job's :class:`StandInDataPlane`, served on 127.0.0.1 to the worker processes' clients."""

    def __init__(self, plane: StandInDataPlane) -> None:
        self.plane = plane
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._meetings: dict[int, _Meeting] = {}  # handle -> meeting (a reference held: ids stay unique)
        self._handles: dict[int, int] = {}  # id(meeting) -> handle
        self._connections: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="stand-in-data-plane", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.append(conn)
            threading.Thread(target=_Served(self, conn).serve, name="stand-in-data-plane-conn", daemon=True).start()

    def handle(self, meeting: _Meeting) -> int:
        """The number a client names ``meeting`` by."""
        with self._lock:
            found = self._handles.get(id(meeting))
            if found is None:
                found = self._handles[id(meeting)] = len(self._meetings) + 1
                self._meetings[found] = meeting
            return found

    def meeting(self, handle: int) -> _Meeting:
        with self._lock:
            return self._meetings[handle]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class _Served:
    """One worker process's connection, as the server serves it."""

    def __init__(self, server: DataPlaneServer, sock: socket.socket) -> None:
        self.server, self.sock = server, sock
        self.plane = server.plane
        self.send_lock = threading.Lock()
        self.cancelled: set[int] = set()  # builds whose member saw a failure: their waits end
        self.replicas: set[int] = set()  # the replicas that built groups over this connection
        self.goodbye = False

    def serve(self) -> None:
        try:
            while (frame := recv_frame(self.sock)) is not None:
                self.dispatch(*frame)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a broken or malformed connection ends as a closed one does
        finally:
            if not self.goodbye:  # the worker died: its replicas' sockets closed with it
                for replica in sorted(self.replicas):
                    self.plane.kill(replica)
            self.sock.close()

    def dispatch(self, header: dict, payload: bytes) -> None:
        op, rid = header.get("op"), int(header["id"])
        if op == "build":
            self.replicas.add(int(header["replica"]))
            threading.Thread(target=self.build, args=(rid, header), name="stand-in-build", daemon=True).start()
        elif op == "cancel":
            self.cancelled.add(rid)
            self.plane.wake()
        elif op == "allreduce":
            self.allreduce(rid, header, payload)
        elif op == "kill":
            self.plane.kill(int(header["replica"]))
            self.reply(rid, {})
        elif op == "bye":
            self.goodbye = True
        else:
            raise ValueError(f"unknown operation {op!r}")

    def build(self, rid: int, header: dict) -> None:
        try:
            meeting = self.plane.build(
                int(header["replica"]),
                int(header["number"]),
                int(header["rank"]),
                int(header["size"]),
                lambda: rid in self.cancelled,
                _SERVED_SLICE,
            )
        except MembershipChanged as exc:
            self.reply(rid, {"error": "MembershipChanged", "message": str(exc)})
            return
        finally:
            self.cancelled.discard(rid)
        self.reply(rid, {"handle": self.server.handle(meeting), "size": meeting.size})

    def allreduce(self, rid: int, header: dict, payload: bytes) -> None:
        meeting = self.server.meeting(int(header["handle"]))
        tensor = frame_tensor(header, payload)
        work = self.plane.allreduce(meeting, int(header["rank"]), tensor)

        def done(future: torch.futures.Future) -> None:
            try:
                future.value()
            except PeerClosed as exc:
                self.reply(rid, {"error": "PeerClosed", "message": str(exc)})
                return
            fields, data = tensor_frame(tensor)
            self.reply(rid, fields, data)

        work.future.add_done_callback(done)

    def reply(self, rid: int, fields: dict, payload: bytes = b"") -> None:
        try:
            send_frame(self.sock, self.send_lock, {"id": rid, **fields}, payload)
        except OSError:
            pass  # the worker is gone: nobody waits for the answer


class RemoteMeeting:
    """A client's handle on a generation's meeting in the server's plane."""

    def __init__(self, handle: int, size: int) -> None:
        self.handle, self.size = handle, size


class DataPlaneClient:
    """One worker process's connection to the harness's :class:`DataPlaneServer`: the three calls of a
    :class:`StandInDataPlane` (build, all-reduce, kill), for every replica thread of the process."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        host, port = address.rsplit(":", 1)
        self.timeout = timeout
        self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Callable[[dict, bytes], None]] = {}
        self._ids = itertools.count(1)
        self._gone: Optional[str] = None
        self._reader = threading.Thread(target=self._read, name="stand-in-data-plane-client", daemon=True)
        self._reader.start()

    def _request(self, header: dict, payload: bytes, on_reply: Callable[[dict, bytes], None]) -> int:
        rid = next(self._ids)
        with self._lock:
            if self._gone is not None:
                raise PeerClosed(f"stand-in gloo: {self._gone}")
            self._pending[rid] = on_reply
        try:
            send_frame(self._sock, self._send_lock, {**header, "id": rid}, payload)
        except OSError as exc:
            with self._lock:
                self._pending.pop(rid, None)
            raise PeerClosed(f"stand-in gloo: the data plane's server is gone ({exc})") from exc
        return rid

    def _read(self) -> None:
        why = "the data plane's server closed the connection"
        try:
            while (frame := recv_frame(self._sock)) is not None:
                header, payload = frame
                with self._lock:
                    on_reply = self._pending.pop(header.get("id"), None)  # type: ignore[arg-type]
                if on_reply is not None:
                    on_reply(header, payload)
        except (OSError, ValueError, TypeError) as exc:
            why = f"the connection to the data plane's server broke ({exc})"
        with self._lock:
            self._gone = why
            pending = list(self._pending.values())
            self._pending.clear()
        for on_reply in pending:
            on_reply({"error": "PeerClosed", "message": f"stand-in gloo: {why}"}, b"")

    def _call(self, header: dict, failure_seen: Callable[[], bool], failed: str) -> dict:
        """Send a request and wait for its reply, in slices: if ``failure_seen()`` between two (or it raises),
        the request is cancelled at the server and MembershipChanged(``failed``) raised (or what it raised)."""
        answered = threading.Event()
        box: dict = {}

        def on_reply(reply: dict, _: bytes) -> None:
            box["reply"] = reply
            answered.set()

        rid = self._request(header, b"", on_reply)
        try:
            while not answered.wait(_SLICE):
                if failure_seen():
                    raise MembershipChanged(failed)
        except BaseException:
            with self._lock:
                self._pending.pop(rid, None)
            try:
                send_frame(self._sock, self._send_lock, {"op": "cancel", "id": rid})
            except OSError:
                pass
            raise
        error = _error(box["reply"])
        if error is not None:
            raise error
        return box["reply"]

    def build(self, replica: int, number: int, rank: int, size: int, failure_seen: Callable[[], bool]) -> RemoteMeeting:
        """Wait until all ``size`` members of generation ``number`` came; MembershipChanged if one fails first."""
        header = {"op": "build", "replica": replica, "number": number, "rank": rank, "size": size}
        reply = self._call(header, failure_seen, f"a member of generation {number} failed while it was being built")
        return RemoteMeeting(int(reply["handle"]), int(reply["size"]))

    def allreduce(self, meeting: RemoteMeeting, rank: int, tensor: torch.Tensor) -> _Work:
        """Start this member's part of the group's next all-reduce (a sum, in place)."""
        work = _Work()

        def on_reply(reply: dict, payload: bytes) -> None:
            error = _error(reply)
            if error is None:
                try:
                    tensor.copy_(frame_tensor(reply, payload).reshape(tensor.shape))
                except (ValueError, RuntimeError) as exc:
                    error = PeerClosed(f"stand-in gloo: a malformed reply ({exc})")
            if error is not None:
                work.future.set_exception(error)
            else:
                work.future.set_result([tensor])

        fields, data = tensor_frame(tensor)
        try:
            self._request({"op": "allreduce", "handle": meeting.handle, "rank": rank, **fields}, data, on_reply)
        except PeerClosed as exc:
            work.future.set_exception(exc)
        return work

    def kill(self, replica: int) -> None:
        """``replica`` died: the server fails its groups' operations; returns once it did."""
        deadline = time.monotonic() + self.timeout

        def late() -> bool:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the data plane's server did not answer the kill of replica {replica}")
            return False

        self._call({"op": "kill", "replica": replica}, late, "")

    def close(self) -> None:
        """Leave without failing anyone (a connection closed without this means the worker died)."""
        try:
            send_frame(self._sock, self._send_lock, {"op": "bye", "id": 0})
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(self.timeout)
        self._sock.close()
