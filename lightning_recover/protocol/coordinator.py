"""The coordinator (server side): a TCPStore server in its own process, plus a heartbeat monitor.

Replicas never hold a default process group across each other. Everything they must agree on
(generations, commit decisions, who is dead) goes through this store, whose operations are
linearizable: the first ``compare_set`` of a key wins and everyone reads the same value.

Keys (values sealed with the job's MAC, see ``messages.py``, except the two counters):

``inc/{r}``        incarnation counter of replica r (bumped by each (re)start of r; a hint)
``hb/{r}``         heartbeat of replica r: incarnation, beat number and the main thread's progress
                   (step, phase, count), rewritten every ``heartbeat_interval``; ``hb/{r}/i{i}``
                   per process when replicas have K > 1 processes; on etcd beside the job's other keys
                   (``/{job}/hb/``), so that only the monitor's watched view receives them
``dead/{r}``       the incarnation of r declared dead ("0" = none)
``declared/{r}``   the incarnation of r the monitor below declared dead (not one that left cleanly
                   or that the launcher saw exit): the local launchers end it if it keeps running
``events``         bumped on every death and every proposed generation (one cheap read
                   tells a waiting replica whether anything changed; a hint)
``gen/latest``     newest generation that has been proposed
``meta/replicas``  the job's replica count, checked by every replica when it connects
``join/{r}``       the incarnation of a restarted replica r asking to be admitted
``g{G}/...``       the join round of generation G (see ``join_rounds.py``)
``reach/...``      probe addresses, rounds, reports and verdicts of partition detection (``reachability.py``)
``s{S}/g{G}/...``  step S's reduce under generation G: done reports and the commit decision
``g{G}/state``     SHA-256 of the state handed to the joiners admitted into generation G
``vouch``          etcd: the members a step's commit vouches for (``vouches.py``): a beat of each
``tick``           etcd: written by the monitor while nothing else was (a long step): it keeps every
                   process's watched view current (unsealed, read by nobody)

``hb/{r}`` and ``vouch`` are rewritten over time: their values carry a sequence ((incarnation, beat);
(generation, the leader's count)) and readers drop one below what they already read (a replay).
``dead/{r}`` and ``gen/latest`` only grow and are read as the largest value seen; every other sealed
key is written once.

The monitor declares a replica dead when its beat has not moved for ``heartbeat_timeout`` seconds
of the coordinator's own clock (no cross-host clock comparison; a killed or frozen process; a commit
vouching for it counts as a beat and as progress), or
when its main thread made no progress for ``hang_timeout`` seconds while a peer waited on it (a
deadlock the heartbeat thread alone would hide). The launcher also declares a replica dead as soon
as it sees the process exit.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist

from lightning_recover.control_plane.embedded import CoordinatorStore
from lightning_recover.errors import ForgedMessageError
from lightning_recover.observe.board import StatusBoard
from lightning_recover.observe.events import EventLog
from lightning_recover.observe.logs import configure_logging
from lightning_recover.observe.status_server import StatusServer
from lightning_recover.protocol.backend import ControlPlane
from lightning_recover.protocol.messages import Freshness, JobSecret, Sealer, mark_dead, peek, peek_all, read_death
from lightning_recover.protocol.reachability import PartitionJudge, probe_timeout_for
from lightning_recover.protocol.verdicts import Ledger
from lightning_recover.protocol.vouches import VOUCH_KEY, Roster, VouchReader, raw_reader

log = logging.getLogger(__name__)

_STORE_TIMEOUT = datetime.timedelta(seconds=60)
_TICK_MIN = 0.25  # seconds between two ticks at least: a view whose stream is lost is not flooded


def _hb_keys(r: int, replica_size: int) -> list[str]:
    return [f"hb/{r}"] if replica_size == 1 else [f"hb/{r}/i{i}" for i in range(replica_size)]


def init_keys(store: ControlPlane, sealer: Sealer, replicas: int, replica_size: int = 1) -> None:
    for r in range(replicas):
        store.set(f"dead/{r}", sealer.seal(f"dead/{r}", b"0"))
        store.set(f"declared/{r}", sealer.seal(f"declared/{r}", b"0"))
        store.add(f"inc/{r}", 0)
        for key in _hb_keys(r, replica_size):
            store.set(key, sealer.seal(key, json.dumps({"inc": 0}).encode()))
    store.add("events", 0)
    store.set("gen/latest", sealer.seal("gen/latest", b"0"))
    store.set("meta/replicas", sealer.seal("meta/replicas", str(replicas).encode()))
    store.set("meta/replica_size", sealer.seal("meta/replica_size", str(replica_size).encode()))


def run_monitor(
    store: ControlPlane,
    sealer: Sealer,
    replicas: int,
    timeout: float,
    hang_timeout: float,
    stop: threading.Event,
    replica_size: int = 1,
    poll_period: float = 0.02,
    board: Optional[StatusBoard] = None,
) -> None:
    """Declare dead every replica one of whose processes' heartbeats stopped (killed, frozen,
    coordinator unreachable) or made no progress for ``hang_timeout`` while a peer waited on it
    (deadlock). The replica is the failure unit: one process lost takes its replica out.

    Only fresh, genuine heartbeats count: a forged one, or an old genuine one written back (its sequence is
    below the newest seen, :class:`Freshness`), is dropped: neither keeps a stopped replica alive past ``timeout``.

    It looks every ``poll_period`` seconds (at most ``timeout / 10``; on etcd at its watched view, reading
    etcd only to confirm a late or hung replica): a declaration comes at most one period after its bound.
    ``board``: told every pass what the monitor read, and every declaration with its cause (the status page)."""
    procs = [(r, key) for r in range(replicas) for key in _hb_keys(r, replica_size)]
    keys = [k for _, k in procs]
    ledger = Ledger(timeout, hang_timeout)  # who is dead as of a time, from what this loop accepted (verdicts.py)
    fresh = Freshness("[coordinator]")
    poll = min(poll_period, timeout / 10)
    # A declaration rests on heartbeats read from the store itself, ordered like a write (etcd: one
    # transaction through the Raft log for all of them, ``peek_all``): a read that blocks as long as the
    # replicas' heartbeat writes do is how the stall allowance below sees that etcd could not take writes.
    # With a watched view the other polls look at the view (no request): only when it shows a replica
    # late or hung is that read made, and the replica judged again on it. A view alone was tried: it
    # declared every replica dead in about half the runs of test_etcd_leader_sigkill_mid_training (an
    # election's silence looks like missed beats), and so does a read that comes just after the election,
    # before the replicas' retried beats: a grown Raft term forgives what came before it.
    # Where commits vouch for their members (vouches.py), the vouch is read after the heartbeats, as the last key.
    read_keys = keys + [VOUCH_KEY] if store.transactions and replica_size == 1 else keys
    term = 0
    # A watched view stops answering once its stream was silent for a while (etcd_watch.STALE_AFTER), and with
    # the heartbeats beside the job's keys nothing else may be written while a long step runs. The monitor's own
    # view hears what every view hears: when it says quiet, a tick keeps them all current. With every beat in a
    # lease (etcd_liveness.py) the heartbeats' own view hears nothing while replicas live: a tick there too.
    ticks, ticked, ticked_beside = 0, 0.0, 0.0
    last_read = time.monotonic()
    # Members that reach the coordinator but not each other (an asymmetric partition): see reachability.py.
    judge = PartitionJudge(store, sealer, timeout, probe_timeout_for(timeout), log=_judge_said)
    opened: dict[str, bytes] = {}  # key -> the raw value last opened (the view answers the same one many polls)
    vouches = VouchReader(sealer, Roster(sealer, raw_reader(store)))  # a vouch names its generation
    vouched_at = 0.0  # when the newest vouch was read: progress of the whole generation it names

    def observe(raws: list, now: float) -> None:
        nonlocal term, vouched_at
        vouch = vouches.newer(raws[-1]) if len(raws) > len(keys) else None
        for (r, key), raw in zip(procs, raws):
            ledger.found(key, raw is not None)
            if raw is None or opened.get(key) == raw:
                continue  # deleted (judged on its last fresh heartbeat), or already read
            opened[key] = raw
            try:
                seq, payload = sealer.open_sequenced(key, raw)
                hb = json.loads(payload)
            except (ForgedMessageError, ValueError):
                continue  # a forged heartbeat is no heartbeat
            if fresh.accept(key, seq):  # a replayed heartbeat is none either
                ledger.heard(key, r, hb)
        if vouch is not None:
            ledger.vouch(vouch.incarnations, now)
            vouched_at = now
        seen = store.raft_term()
        if seen > term and term:
            ledger.forgive(0.0, until=now)  # a leader election since the last look: nobody could beat during it
        term = max(term, seen)

    while not stop.wait(poll):
        now = time.monotonic()
        # A read that came late means the control plane itself stalled (an etcd leader election, a
        # CPU-starved coordinator): no replica could beat meanwhile, so that time does not count
        # against anyone. Only the excess over the usual poll is forgiven.
        stalled = now - last_read - poll
        last_read = now
        if stalled > 2 * poll:
            ledger.forgive(stalled)
        # Non-waiting reads: a heartbeat key deleted by an outside client must not stall the monitor.
        cached = store.cached_each(keys)  # None without a current view; a leased beat's key is absent once expired
        read_from_store = cached is None
        raws = peek_all(store, read_keys) if cached is None else cached
        if not read_from_store and len(read_keys) > len(keys):
            hit, raw = store.cached(VOUCH_KEY)  # absent until the first commit
            raws.append(raw if hit else None)
        observe(raws, now)
        late = ledger.verdicts(now)
        if late and not read_from_store:
            # The view says a replica is late or hung: judge it again on a read ordered like a write.
            began = time.monotonic()
            raws = peek_all(store, read_keys)
            now = last_read = time.monotonic()
            if now - began > 2 * poll:
                ledger.forgive(now - began)
            observe(raws, now)
            late = ledger.verdicts(now)
        for key, verdict in late.items():
            why = f"({key}) {verdict.why}" if replica_size > 1 else verdict.why
            r = verdict.replica
            ledger.settle(r, _declare(store, sealer, r, verdict.incarnation, why, verdict.cause, board))
        fenced = judge.observe(now, ledger.heartbeats, progressed_at=vouched_at)
        if board is not None:  # its time is no stall
            last_read += _tell_board(board, fenced, now, store, sealer, ledger.heartbeats, ledger.beats)
        if now - ticked > _TICK_MIN and store.quiet():
            ticks, ticked = ticks + 1, now
            store.set("tick", str(ticks))
        if now - ticked_beside > _TICK_MIN and store.quiet_beside():
            ticked_beside = now
            store.set("hb/tick", str(ticks))
    if board is not None:
        _last_look(board, store, sealer, read_keys, observe, ledger)


def _last_look(
    board: StatusBoard,
    store: ControlPlane,
    sealer: Sealer,
    read_keys: list[str],
    observe: Callable[[list, float], None],
    ledger: Ledger,
) -> None:
    """The job ended (the loop was stopped): the replicas' last heartbeats are still in the store and may carry
    what no pass read yet (a leave reported in the job's last steps). One more read, so that the board and the
    event log end complete whatever the timing of the end."""
    now = time.monotonic()
    try:
        observe(peek_all(store, read_keys), now)
    except (OSError, RuntimeError) as exc:  # the control plane went first: what was read stands
        log.warning("no last look at the heartbeats: %s", exc)
        return
    _tell_board(board, [], now, store, sealer, ledger.heartbeats, ledger.beats)


def _judge_said(line: str) -> None:
    log.warning("%s", line.removeprefix("[coordinator] "))


def _declare(
    store: ControlPlane, sealer: Sealer, r: int, inc: int, why: str, cause: str, board: Optional[StatusBoard]
) -> int:
    """Declare incarnation ``inc`` of replica ``r`` dead unless it is; return the incarnation known dead."""
    dead = read_death(sealer, r, peek(store, f"dead/{r}") or b"")
    if dead < inc and mark_dead(store, sealer, r, inc):
        store.set(f"declared/{r}", sealer.seal(f"declared/{r}", str(inc).encode()))
        log.warning("replica %d (incarnation %d) %s: declared dead", r, inc, why)
        if board is not None:
            board.declared(r, inc, cause, why)
        dead = inc
    return dead


def _tell_board(
    board: StatusBoard, fenced: list[int], now: float, store: ControlPlane, sealer: Sealer, hbs: dict, beats: dict
) -> float:
    """One pass of the monitor for the status board: the replicas the partition judge fenced, then what the
    monitor read. Returns the seconds it took (the monitor's stall allowance must not count them)."""
    began = time.monotonic()
    for r in fenced:
        board.declared(r, None, "partition", "cut off from its peers (network partition)")
    board.poll(now, store, sealer, hbs, beats)
    return time.monotonic() - began


def listen_socket(host: str, port: int, what: str = "the coordinator") -> socket.socket:
    """A listening socket bound to ``host`` only (``what``: the server, for the errors).

    TCPStore given a host still listens on every interface (``*:PORT``, IPv4 and IPv6); handing it
    a socket bound here (``master_listen_fd``, works with libuv in torch 2.13) keeps the control
    plane on loopback by default, and on the one address a multi-host job names.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(
            f"cannot bind {what} to {host!r}: {exc}. HINT: --host takes an address "
            "of this machine (127.0.0.1 for one-machine jobs)."
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "::" must not add IPv4 too
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno,
            f"cannot bind {what} to {host}:{port}: {exc.strerror}. "
            "HINT: pick another --port (0 = any free port) or an address of this machine.",
        ) from None
    return sock


def serve_store(host: str, port: int, timeout: datetime.timedelta, what: str = "the coordinator") -> dist.TCPStore:
    """A TCPStore server listening on ``host`` only (:func:`listen_socket`)."""
    listener = listen_socket(host, port, what)
    try:
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            use_libuv=True,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    # The store's server now owns the socket and closes it when the store is destroyed. Closing it here
    # too (when the socket object is collected) closed the number twice: in a process that goes on (the
    # in-process tests) the second close hit whatever another thread had opened under it meanwhile.
    listener.detach()
    return store


class Coordinator:
    """The store server and its heartbeat monitor; :func:`serve` runs one until SIGTERM.

    In-process use (tests): ``c = Coordinator("127.0.0.1", 0, replicas, 1.0, JobSecret.generate())``, then
    ``threading.Thread(target=c.monitor, args=(stop_event,))``; ``c.addr`` is what replicas connect to.
    """

    def __init__(
        self,
        host: str,
        port: int,
        replicas: int,
        heartbeat_timeout: float,
        secret: JobSecret,
        hang_timeout: float = 60.0,
        replica_size: int = 1,
    ) -> None:
        self.host = host
        self.replicas = replicas
        self.replica_size = replica_size
        self.heartbeat_timeout = heartbeat_timeout
        self.hang_timeout = hang_timeout
        self.sealer = Sealer(secret)
        self.store: Any = serve_store(host, port, _STORE_TIMEOUT)  # torch's stubs lack TCPStore.clone
        init_keys(CoordinatorStore(self.store), self.sealer, replicas, replica_size)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.store.port}"

    def monitor(self, stop: threading.Event, board: Optional[StatusBoard] = None) -> None:
        """Declare dead every replica whose heartbeat stopped, until ``stop`` is set (telling ``board``)."""
        run_monitor(
            CoordinatorStore(self.store.clone()),
            self.sealer,
            self.replicas,
            self.heartbeat_timeout,
            self.hang_timeout,
            stop,
            self.replica_size,
            board=board,
        )


def serve(
    host: str,
    port: int,
    replicas: int,
    heartbeat_timeout: float,
    ready_fd: int | None = None,
    hang_timeout: float = 60.0,
    secret_file: str | None = None,
    replica_size: int = 1,
    status_address: Optional[str] = None,
    event_log: Optional[str] = None,
) -> None:
    """Run a coordinator until SIGTERM or SIGINT; ``status_address``: serve the job's status page there
    (:mod:`~lightning_recover.observe.status_server`), ``event_log``: append the job's events to that file."""
    configure_logging("coordinator")
    secret = JobSecret.from_file(secret_file) if secret_file else JobSecret.from_env()
    coordinator = Coordinator(host, port, replicas, heartbeat_timeout, secret, hang_timeout, replica_size)
    board = server = None
    line = f"LISTENING {coordinator.addr}"
    if status_address is not None or event_log is not None:
        board = StatusBoard(replicas, replica_size, "embedded", EventLog(event_log))
    if status_address is not None:
        server = StatusServer(status_address, board)
        line += f" STATUS {server.url}"
    if ready_fd is not None:
        os.write(ready_fd, f"{line}\n".encode())
        os.close(ready_fd)
    log.info("%s replicas=%d heartbeat_timeout=%ss", line, replicas, heartbeat_timeout)
    if server is not None:
        log.info("status page of the job: %s (metrics: %smetrics)", server.url, server.url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        coordinator.monitor(stop, board)
    except Exception as exc:  # a store failure here means the server itself is broken
        log.error("monitor stopped: %s", exc)
        raise
    finally:
        if server is not None:
            server.close()
        if board is not None:
            board.events_log.close()
