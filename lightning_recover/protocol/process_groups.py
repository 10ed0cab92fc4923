"""The process group of one generation: built among its members, abandoned when it fails.

A failed generation's group is never reused. gloo cannot abort an operation in flight, and
destroying a group that has one blocks until the operation's timeout (then aborts the process), so
an abandoned gloo group stays referenced until this process's operations on it have ended (failed,
or timed out after ``collective_timeout``) and is destroyed then, off the hot path. Destroying it
matters: its sockets may still hold a survivor's data for the failed collective, which no receive
will ever claim, and gloo's event loop spins on that readable socket (measured: 0.5-0.8 of a core
per failure, for as long as the group lives, slowing every later step on a small machine). Closing
the group also ends the peers' own pending operations on it, so they are destroyed in turn; if one
still waits a second later, the group's gloo threads are scheduled SCHED_IDLE until it ends. NCCL
communicators are non-blocking and aborted off the hot path.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_recover.errors import MembershipChanged

_POLL_MIN = 0.0005
_POLL_MAX = 0.005
_REAP_EVERY = 0.2  # seconds between looks at the abandoned groups' operations


def _quiet(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        pass


class ProcessGroups:
    """Builds and abandons the per-generation groups of one replica."""

    def __init__(self, backend: str, collective_timeout: float) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise RuntimeError(
                "backend='nccl' needs a CUDA build of torch with NCCL. HINT: use accelerator='cpu' (gloo)."
            )
        self.backend = backend
        self.collective_timeout = collective_timeout
        self._stuck_builds: list[threading.Thread] = []  # builds given up on; they end with the process
        self._in_flight: dict[int, list] = {}  # id(group) -> the operations last started on it
        self._parts: dict[int, tuple[set, set]] = {}  # id(gloo group) -> its sockets and gloo threads
        self._abandoned: list[_Abandoned] = []  # destroyed once their operations ended
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._ever_abandoned = False
        self._kept_at_exit = False  # a group release() could not let go of: the interpreter's exit would destroy it

    @property
    def abandoned_work(self) -> bool:
        """True once a group was abandoned (or a build given up on, or kept at a clean exit by :meth:`release`):
        the process must then end without running destructors (``os._exit``), as tearing gloo down at
        interpreter exit after a failure aborted the process or hung in the tests, even when the reaper had
        destroyed every abandoned group."""
        return self._ever_abandoned or bool(self._stuck_builds) or self._kept_at_exit

    @property
    def abandoned_alive(self) -> int:
        """How many abandoned groups still wait for their operations to end (not destroyed yet)."""
        with self._lock:
            return len(self._abandoned)

    def started(self, pg: Any, works: list) -> None:
        """Record the operations just started on ``pg``: if it is abandoned, it is destroyed after them."""
        self._in_flight[id(pg)] = list(works)

    def build(
        self,
        store: dist.Store | Callable[[], dist.Store],
        number: int,
        rank: int,
        size: int,
        failure_seen: Callable[[], bool],
    ) -> Any:
        """Build generation ``number``'s group on a thread; raise MembershipChanged if a member fails meanwhile.
        ``store``: the rendezvous store, or what connects to it (on the thread: a connection to a member that
        died meanwhile waits there, not here)."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["pg"] = self._new(store() if callable(store) else store, rank, size)
            except BaseException as exc:  # reported to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=run, name=f"lr-build-g{number}", daemon=True)
        thread.start()
        delay = _POLL_MIN
        try:
            while thread.is_alive():
                if failure_seen():
                    raise MembershipChanged(f"a member of generation {number} failed while it was being built")
                thread.join(delay)
                delay = min(delay * 2, _POLL_MAX)
        except BaseException:
            # Whatever ends the wait (a member failed, or the check itself raised: a forged control value)
            # leaves the build in gloo's connect: the process must then end with os._exit, as destroying
            # the build at interpreter exit aborts the process (SIGABRT, seen in a test).
            self._stuck_builds.append(thread)
            raise
        if "error" in result:
            raise MembershipChanged(f"building generation {number} failed: {result['error']}")
        return result["pg"]

    def _new(self, store: dist.Store, rank: int, size: int) -> Any:
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        if self.backend == "nccl":
            # Non-blocking communicators, so that abort() can end an operation stuck on a dead peer.
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.blocking = 0
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        with _ConstructionWitness() as witness:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        # The sockets and threads gloo started for this group: see abandon().
        self._parts[id(pg)] = (witness.sockets, witness.threads)
        return pg

    def abandon(self, pg: Any) -> None:
        self._ever_abandoned = True
        if self.backend == "nccl":
            # NCCL can abort its communicators: do it off the hot path, then drop the group.
            threading.Thread(target=lambda: _quiet(pg.abort), name="lr-nccl-abort", daemon=True).start()
        else:
            # gloo cannot abort an op in flight and destroying its group blocks until the op ends:
            # keep the group referenced until this process's operations on it have ended.
            works = self._in_flight.pop(id(pg), [])
            sockets, threads = self._parts.pop(id(pg), (set(), set()))
            if not _ended(works):
                # An operation can be stuck behind a survivor's data that it will never receive (gloo
                # reads a connection in order): shutting the group's connections down fails it now,
                # and the peers' operations with it, instead of after collective_timeout.
                _shut_down(sockets)
            with self._lock:
                self._abandoned.append(_Abandoned(pg, works, threads, time.monotonic() + _STUCK_AFTER))
                if self._reaper is None:
                    self._reaper = threading.Thread(target=self._reap, name="lr-pg-reaper", daemon=True)
                    self._reaper.start()

    def release(self, pg: Any) -> bool:
        """Forget ``pg``, a group this replica is done with (a clean exit), unless an operation it started on it
        has not completed (False: it is kept, and the process ends with ``os._exit``: :attr:`abandoned_work`). The
        caller then drops its own reference, so the group's destructor joins gloo's threads on the caller's thread
        while the interpreter runs. Left to the interpreter's exit, a gloo thread that frees the tensors of its
        last operation takes the interpreter lock during finalization, and the process aborts."""
        if not _ended(self._in_flight.get(id(pg), [])):
            self._kept_at_exit = True
            return False
        self._in_flight.pop(id(pg), None)
        self._parts.pop(id(pg), None)
        return True

    def _reap(self) -> None:
        """Destroy abandoned gloo groups whose operations have ended, on this thread (about 20 ms each).

        An operation the shutdown did not end (it can still wait out ``collective_timeout``) keeps its
        group; its gloo threads are then scheduled SCHED_IDLE, so that an event loop spinning on the
        dead connections only uses CPU nobody else wants."""
        while True:
            time.sleep(_REAP_EVERY)
            with self._lock:
                done = [a for a in self._abandoned if _ended(a.works)]
                self._abandoned = [a for a in self._abandoned if not _ended(a.works)]
                if not self._abandoned and not done:
                    self._reaper = None
                    return
                stuck = [a for a in self._abandoned if not a.idled and time.monotonic() > a.stuck_at]
            for a in stuck:
                a.idled = True
                _schedule_idle(a.threads)
            del done  # the last references: the groups' destructors run here, not on the training thread


_STUCK_AFTER = 1.0  # seconds an abandoned group's operation may take to fail after the shutdown


class _Abandoned:
    """An abandoned gloo group, the operations this process started on it, and gloo's threads for it."""

    def __init__(self, pg: Any, works: list, threads: set[int], stuck_at: float) -> None:
        self.pg, self.works, self.threads, self.stuck_at = pg, works, threads, stuck_at
        self.idled = False


def _ended(works: list) -> bool:
    return all(w.is_completed() for w in works)


def _threads() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _is_gloo_thread(tid: int) -> bool:
    """``gloo_tcp_loop`` or ``pt_gloo_runloop``; False for any other thread (or one that ended)."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return "gloo" in f.read()
    except OSError:
        return False


def _schedule_idle(threads: set[int]) -> None:
    idle = getattr(os, "SCHED_IDLE", None)
    for tid in threads:
        try:
            if idle is not None and _is_gloo_thread(tid):  # never a thread another module started meanwhile
                os.sched_setscheduler(tid, idle, os.sched_param(0))
        except OSError:
            pass  # ended meanwhile, or not permitted here: the thread keeps its priority


class _ConstructionWitness:
    """What this process gained during a group's construction: ``sockets`` (fd, 'socket:[inode]') and
    ``threads`` (thread ids; gloo names its threads only once they run, so they are told apart later).

    Known only when no other construction overlapped it: an embedding that runs several replicas in
    one process (the in-process tests) builds their groups at once, and then both are empty.
    """

    _lock = threading.Lock()
    _active: dict[int, bool] = {}  # id(witness) -> whether another construction overlapped it

    def __enter__(self) -> _ConstructionWitness:
        with self._lock:
            for other in self._active:
                self._active[other] = True
            self._active[id(self)] = bool(self._active)
        self._before = _open_sockets()
        self._threads_before = _threads()
        self.sockets: set[tuple[int, str]] = set()
        self.threads: set[int] = set()
        return self

    def __exit__(self, *exc: Any) -> None:
        sockets, threads = _open_sockets(), _threads()
        with self._lock:
            overlapped = self._active.pop(id(self))
        if not overlapped:
            self.sockets, self.threads = sockets - self._before, threads - self._threads_before


def _open_sockets() -> set[tuple[int, str]]:
    """This process's open sockets as (fd, 'socket:[inode]'); empty where /proc is not there."""
    found = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found.add((int(name), target))
    return found


def _shut_down(sockets: set[tuple[int, str]]) -> None:
    """shutdown(2) each connection that is still the same socket (never closes: the fds stay gloo's)."""
    for fd, target in sockets:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != target:
                continue  # gloo closed it and the number was reused
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            # Only TCP connections (gloo's transport; not a unix socket another thread opened meanwhile,
            # e.g. a data loader's fd passing), and never the group's listening socket: shutting that
            # down fails gloo's accept(), which aborts the process.
            tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
            if tcp and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down
        finally:
            sock.detach()
