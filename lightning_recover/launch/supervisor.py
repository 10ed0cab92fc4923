"""The tolerant local launcher: replicas of K processes (K = 1 the common case), survivors never killed.

Lightning's stock launcher kills every rank when one dies, and torchrun's agent restarts its
whole group. :class:`Supervisor` instead starts the coordinator and the processes of every replica,
tells the coordinator at once when a replica process exits (so survivors need not wait for
heartbeats), ends the rest of a replica whose process failed, optionally restarts it (or lets a warm
standby take its place), and ends a replica the coordinator declared dead (hung) that still runs (a
deadlocked process never exits by itself). When the survivors are done it ends what is left (a
SIGSTOPped replica stays stopped until then). Its exit code is 0 when at least one replica finished
successfully. The subcommands that use it are parsed in :mod:`~lightning_recover.launch.commands`.

``Supervisor(command, replicas, ...)``: ``command`` is the argv of every replica process, or a
function of the replica id returning it (the torchrun mode wraps each replica in its own torchrun
agent). Once one replica has finished successfully the job is done: replicas still running
``finish_grace`` seconds later are killed. ``nproc_per_replica`` = K > 1: the replica shards its
model; the launcher starts its K processes and the replica fails whole (one process exits with an
error, or the coordinator declares the replica dead: the others, stuck in intra-replica collectives
until the gloo timeout, are SIGKILLed); it succeeded when all K exited 0. ``watch_workers`` (torchrun
mode: each child is an agent that starts the K workers and restarts them itself): the death of a
child's worker is declared to the coordinator at once, as the exit of a direct child is.
``restarts``: a failed replica is started again (all K processes, a new incarnation that rejoins) up
to that many times; under torchrun it bounds the standby takeovers. ``standby`` = S > 0: S warm
standbys (of K processes each) wait; a ready one takes a failed replica's place instead of a restart
(it counts as one) and a new one starts in its stead (see :mod:`~lightning_recover.protocol.standby`).
``fork``: processes (under torchrun, the agents) are forked by a fork server that imported ``preload`` once
(see :mod:`~lightning_recover.launch.fork_server`).

Preemption notices and growth (:mod:`~lightning_recover.protocol.notice`, docs/howto.md "Spot and
preemptible nodes", "Growing a job"): a replica that left on notice exits with ``EXIT_LEFT_ON_NOTICE`` (75) and
is not restarted (``restart_left``: it is); SIGTERM (or the ``notice_signal``) to the launcher is forwarded to
every replica as the notice signal, a whole-job notice; a job all of whose replicas left on notice exits 75.
``min_replicas`` < ``replicas`` (``--replicas MIN:MAX``): the replicas' ids are ``0..MAX-1``, training starts
once MIN are in, and this launcher starts MIN of them unless told which (``local_replicas``);
``add_replicas`` = N: a launcher of a running job (etcd) starts N newcomers whose ids the control plane
assigns (:mod:`~lightning_recover.protocol.growth`).

Nothing of the job outlives it: the coordinator and the replicas get a parent-death signal; if the
coordinator dies or stops answering for ``max(5, 2 x heartbeat_timeout + 1)`` seconds, the replicas
are ended and the exit code is ``EXIT_COORDINATOR_LOST``; a command that cannot be started ends what
was started and returns ``EXIT_SPAWN_FAILED``.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_recover import env
from lightning_recover.control_plane.config import EtcdSettings
from lightning_recover.control_plane.connect import connect
from lightning_recover.control_plane.etcd_job import EtcdCoordinator, MonitorRole, forget_job, join_job
from lightning_recover.control_plane.priority import check_nice_permitted, control_nice, set_thread_nice
from lightning_recover.control_plane.rack_relay import RackRelayRole
from lightning_recover.control_plane.watch_relay import RelayPathTooLong, WatchRelay
from lightning_recover.launch import coordinator_process, name_lookup
from lightning_recover.launch.fork_server import DEFAULT_PRELOAD, Process, ProcessStarter
from lightning_recover.launch.host_relay import RelayPlacement, relay_placement, start_host_relay
from lightning_recover.launch.job_dir import JobDir
from lightning_recover.launch.process_tree import (
    children_of,
    children_of_each,
    describe_exit,
    is_stopped,
    kill_tree,
    libc,
    set_parent_death_signal,
)
from lightning_recover.launch.standby_pool import StandbyPool
from lightning_recover.protocol.faults import check_plan
from lightning_recover.protocol.growth import claim_free_id, claim_replica_ids
from lightning_recover.protocol.messages import (
    JobSecret,
    Sealer,
    mark_dead,
    read_death,
    read_declared,
    recent_many,
)
from lightning_recover.protocol.notice import EXIT_LEFT_ON_NOTICE, parse_signal
from lightning_recover.protocol.options import (
    DEFAULT_HEARTBEAT_INTERVAL,
    check_heartbeat_timeout,
    check_seconds,
    check_standby,
)
from lightning_recover.protocol.silence import MAX_TURN, OwnTime
from lightning_recover.protocol.standby import assign as assign_standby
from lightning_recover.protocol.standby import is_ready as standby_is_ready

#: Exit code of a job whose coordinator died or stopped answering (its replicas were ended).
EXIT_COORDINATOR_LOST = 3
#: Exit code of a job whose command could not be started (as a shell's "command not found").
EXIT_SPAWN_FAILED = 127


class _CoordinatorLost(Exception):
    pass


class _Link:
    """The launcher's connection to the coordinator, on a thread of its own.

    A store client has no receive timeout: a frozen (SIGSTOPped) coordinator blocks any call
    forever (measured: > 60 s with ``timeout=2s``). So the main loop never calls the store itself:
    this thread does, probes it every ``period`` seconds, and the main loop only compares the time
    of its last answer with a bound.
    """

    def __init__(self, addr: str, period: float, store: Any = None) -> None:
        self._store = store if store is not None else connect(addr, timeout=10.0)
        self._period = period
        self._requests: queue.Queue = queue.Queue()
        self.last_ok = time.monotonic()
        self._own_time = OwnTime(MAX_TURN)  # the launcher's main thread's: silence is judged in it
        self.error: BaseException | None = None
        self.asking: tuple[str, float] | None = None  # the request waiting for its answer, and since when
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lr-coordinator-probe", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop probing (before the coordinator is stopped: a probe then would log a torch error)."""
        self._closed = True
        self._requests.put(None)
        # A probe stuck on a frozen coordinator returns once the caller has killed it (the connection
        # resets); should it not, within the second, the daemon thread is left behind.
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while self.error is None:
            try:
                item = self._requests.get(timeout=self._period)
            except queue.Empty:
                item = None
            if self._closed:
                return
            try:
                if item is None:
                    self.asking = ("probe", time.monotonic())
                    self._store.check(["meta/replicas"])
                else:
                    fn, box, done = item
                    self.asking = (getattr(fn, "__name__", "request"), time.monotonic())
                    box.append(fn(self._store))
                    done.set()
                self.asking = None
                self.last_ok = time.monotonic()
            except Exception as exc:  # a reset connection: the coordinator died
                self.error = exc
                if item is not None:
                    item[2].set()

    def call(self, fn: Callable[[Any], Any], timeout: float) -> Any:
        """``fn(store)`` on the link's thread; ``_CoordinatorLost`` if it fails or takes > ``timeout``."""
        box: list = []
        done = threading.Event()
        self._requests.put((fn, box, done))
        deadline = time.monotonic() + timeout
        # Sliced: once the thread has failed it serves no more requests, so do not wait out the bound.
        # A link already silent for the bound (stuck on a frozen coordinator) does not get the bound
        # again: the loss counts from the coordinator's last answer, not from this call.
        while (
            not done.wait(0.05) and self.error is None and time.monotonic() < deadline and self.silent_for() <= timeout
        ):
            pass
        if not box:
            raise _CoordinatorLost(
                f"no answer within {timeout:g}s" if self.error is None else f"the connection failed ({self.error})"
            )
        return box[0]

    def submit(self, fn: Callable[[Any], Any]) -> tuple[list, threading.Event]:
        """``fn(store)`` on the link's thread, without waiting: the event is set once ``box`` holds
        the result (or the link failed, ``box`` empty). A failed link serves no more requests."""
        box: list = []
        done = threading.Event()
        self._requests.put((fn, box, done))
        return box, done

    def silent_for(self) -> float:
        """Seconds since the coordinator last answered, in the launcher's own running time (``silence.py``): a
        stretch in which the launcher did not run is not the coordinator's silence. Called by the main thread
        only (each call is a turn of its loop)."""
        if self.error is not None:
            return float("inf")
        self._own_time.turn()
        return self._own_time.since(self.last_ok)

    def describe_silence(self) -> str:
        """What the link was doing while the coordinator was silent: a request still unanswered, or none sent (the
        link's thread did not run)."""
        asking = self.asking
        if asking is None:
            return "no request of the launcher was waiting (its link's thread did not run)"
        return f"the launcher's {asking[0]} request waited {time.monotonic() - asking[1]:.1f}s for its answer"


def _replica_preexec(launcher_pid: int, nice: int) -> Callable[[], None]:
    """What a process the launcher starts runs before its command: it dies with the launcher, and it runs at
    ``nice`` (the launcher's own before it took the control plane's, ``control_plane/priority.py``)."""
    libc()  # loaded here: a library loaded between fork and exec can deadlock on a lock another thread held

    def preexec() -> None:
        # A replica must not outlive a SIGKILLed launcher (its coordinator dies with it too).
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except PermissionError:  # a launcher set above its own (a positive value) without the right to come back
            pass

    return preexec


@dataclass
class _ReplicaProcesses:
    """One replica as the launcher sees it: the K processes it started for it (K = 1: one process, or
    under torchrun one agent, which starts the replica's workers itself)."""

    replica: int
    procs: list[Process]
    restarts: int = 0
    history: list[str] = field(default_factory=list)
    codes: dict[int, int] = field(default_factory=dict)  # inner position -> exit code (current processes)
    failed: bool = False  # K > 1: ended whole after one of its processes failed or hung
    handled: int = 0  # declarations of incarnations up to this one concern processes already ended
    declared_at: float | None = None  # when the launcher first saw it declared dead while it ran
    first_incarnation: int = 1  # K > 1: deaths of older incarnations (before a restart) are not this one's

    @property
    def proc(self) -> Process:
        """K = 1: the replica's process."""
        return self.procs[0]

    def running(self) -> list[Process]:
        return [p for i, p in enumerate(self.procs) if i not in self.codes]

    @property
    def done(self) -> bool:
        return len(self.codes) == len(self.procs)

    def describe(self) -> str:
        return f"replica {self.replica}: {'; '.join(self.history) or 'exit codes ' + str(self.codes)}"

    def end(self) -> list[int]:
        """SIGKILL the processes still running (a SIGSTOPped one too), wait for them, record their exit
        codes; the pids it ended."""
        pids = [p.pid for p in self.running() if p.poll() is None]
        for p in self.running():
            kill_tree(p.pid)
        for i, p in enumerate(self.procs):
            if i not in self.codes:
                p.wait()
                self.codes[i] = p.returncode
        return pids

    @property
    def ok(self) -> bool:
        return self.done and not self.failed and all(c == 0 for c in self.codes.values())


class _DeathReader:
    """Which replicas the coordinator declared dead, read on the link's thread (a frozen coordinator
    never blocks the launcher's loop). K = 1: what its monitor declared (``declared/{r}``); K > 1: the
    death notices (``dead/{r}``) and whether that incarnation left cleanly."""

    def __init__(self, link: _Link, sealer: Sealer, replicas: int, k: int) -> None:
        self.link, self.sealer, self.replicas, self.k = link, sealer, replicas, k
        self._pending: tuple[list, threading.Event] | None = None
        self._next = 0.0

    def take(self) -> dict[int, tuple] | None:
        """The last reading, once it is there (then None until the next one)."""
        if self._pending is None or not self._pending[1].is_set():
            return None
        box, self._pending = self._pending[0], None
        return box[0] if box else None

    def request(self) -> None:
        """Start the next reading: every 0.1 s (K > 1: 0.05 s), one at a time."""
        if self._pending is None and time.monotonic() >= self._next:
            self._next = time.monotonic() + (0.1 if self.k == 1 else 0.05)
            self._pending = self.link.submit(self._declarations if self.k == 1 else self._deaths)

    def _declarations(self, store: Any) -> dict[int, tuple[int, int]]:
        """Replica -> (current incarnation, incarnation the coordinator's monitor declared dead)."""
        n = self.replicas
        raw = recent_many(store, [f"inc/{r}" for r in range(n)] + [f"declared/{r}" for r in range(n)])
        out = {}
        for r in range(n):
            try:
                out[r] = (int(raw[r]), read_declared(self.sealer, r, raw[n + r]))
            except ValueError:
                out[r] = (0, 0)
        return out

    def _deaths(self, store: Any) -> dict[int, tuple[int, int, bool]]:
        """Replica -> (current incarnation, incarnation declared dead, whether it left cleanly)."""
        n = self.replicas
        raw = recent_many(store, [f"inc/{r}" for r in range(n)] + [f"dead/{r}" for r in range(n)])
        out = {}
        for r in range(n):
            try:
                inc = int(raw[r])
                dead = read_death(self.sealer, r, raw[n + r])
            except ValueError:
                continue
            out[r] = (inc, dead, dead >= inc and store.check([f"left/{r}/{inc}"]))
        return out


class _WorkerWatch:
    """torchrun mode: notices when the worker under a replica's agent exits. Only a worker that lived
    >= 1 s counts: no transient helper process of the agent."""

    def __init__(self) -> None:
        self.first_seen: dict[int, dict[int, float]] = {}  # replica -> {worker pid under its agent: first seen}
        self._next = 0.0

    def lost(self, group: list[_ReplicaProcesses]) -> list[_ReplicaProcesses]:
        """The running replicas whose agent lost a worker since the last look (every 0.05 s at most)."""
        if time.monotonic() < self._next:
            return []
        self._next = time.monotonic() + 0.05
        now_t = time.monotonic()
        children = children_of_each([c.proc.pid for c in group if not c.done])
        out = []
        for c in group:
            seen = self.first_seen.setdefault(c.replica, {})
            now = set(children[c.proc.pid]) if not c.done else set()
            lost = [pid for pid, t in seen.items() if pid not in now and now_t - t >= 1.0]
            for pid in set(seen) - now:
                del seen[pid]
            for pid in now:
                seen.setdefault(pid, now_t)
            if lost and c.proc.poll() is None:
                out.append(c)
        return out


class _Job:
    """What a job's replicas run on, started and ended together: the job's secret, its control plane (a
    coordinator process, or on etcd this launcher's candidacy for the monitor role), the launcher's link
    to it, and the starter of the replicas' processes (the fork server)."""

    def __init__(
        self,
        argv: Callable[[int], Sequence[str]],
        k: int,
        say: Callable[[str], Any],
        control_plane: EtcdSettings | None,
        only_launcher: bool,
    ) -> None:
        self.argv, self.k, self.say = argv, k, say
        self.control_plane, self.only_launcher = control_plane, only_launcher
        self.job_dir = JobDir.create()  # removed when the job ends, even if this process is SIGKILLed
        self.secret_dir = self.job_dir.path
        self.secret: JobSecret | None = None
        self.secret_file = ""
        self.sealer: Sealer | None = None
        self.child_env: dict[str, str] = {}
        self.starter: ProcessStarter | None = None
        self.coord: Any = None
        self.link: _Link | None = None
        self.relay: WatchRelay | None = None
        self.rack_role: RackRelayRole | None = None

    def start(
        self,
        *,
        replicas: int,
        nproc: int,
        extra_env: dict[str, str] | None,
        inject: str | None,
        fork: bool,
        replica_range: str,
        notice_signal: str,
        preload: Sequence[str],
        heartbeat_timeout: float,
        watch_relay: RelayPlacement = RelayPlacement(),
        **coordinator: Any,
    ) -> None:
        # This thread, and the threads started from it (the coordinator link, the etcd monitor role), run at the
        # control plane's priority; the processes the launcher starts go back to its own (their preexec).
        own_nice = os.getpriority(os.PRIO_PROCESS, 0)
        nice = control_nice()
        if nice is not None:
            set_thread_nice(nice)
        try:
            # One secret per job, in a private 0600 file: it authenticates every control message. On etcd it is
            # never stored there: the launchers of one job are given the same one (etcd_job.launcher_secret).
            cp = self.control_plane
            self.secret = join_job(cp, replicas, nproc) if cp is not None else JobSecret.generate()
        except BaseException:
            self.job_dir.remove()
            raise
        self.secret_file = self.secret.write_file(self.secret_dir)
        self.sealer = Sealer(self.secret)
        child_env = dict(os.environ, **(extra_env or {}))
        child_env[env.SECRET_FILE] = self.secret_file
        child_env[env.JOB_DIR] = self.secret_dir
        child_env.pop(env.SECRET, None)
        child_env[env.REPLICAS] = replica_range  # N, or MIN:MAX
        child_env[env.NOTICE_SIGNAL] = notice_signal
        child_env.setdefault(env.OMP_NUM_THREADS, "1")  # spinning OpenMP threads make gloo 20x slower on small machines
        # c10d writes two WARNING lines each time a store wait times out, and the replicas wait in slices of
        # polling.SLICE on purpose (to look for failures between them): hundreds of lines a job, nothing to act
        # on. torch has no switch for c10d alone: its C++ warnings are off in the replicas unless the user set one.
        child_env.setdefault(env.TORCH_CPP_LOG_LEVEL, "ERROR")
        if inject:
            child_env[env.INJECT] = inject
        if nproc > 1:
            child_env[env.REPLICA_SIZE] = str(nproc)
        if self.control_plane is not None:
            child_env.update(self.control_plane.environment())
        self.child_env = child_env
        try:
            # The fork server imports while the coordinator starts (each takes seconds); it needs no address: every
            # process it forks gets its own environment. Under torchrun it forks the agents, which start the workers.
            self.starter = ProcessStarter(
                list(self.argv(0)),
                child_env,
                self.say,
                fork=fork,
                preload=preload,
                preexec=_replica_preexec(os.getpid(), own_nice),
            )
            # Beside the start: a resolver that drops reverse lookups stalls every TCPStore connection (name_lookup).
            name_lookup.check_in_background(coordinator.get("host", "127.0.0.1"), self.say)
            self.coord = self._start_control_plane(replicas, nproc, heartbeat_timeout, **coordinator)
            child_env[env.COORDINATOR] = self.coord.addr
            if self.control_plane is not None:
                # One watch of the job's keys for this host's processes: etcd sends each change once per host
                # (once per upstream relay where this host's relay follows one).
                path = os.path.join(self.secret_dir, "watch-relay")
                try:
                    self.relay, self.rack_role = start_host_relay(
                        self.control_plane,
                        self.secret.key,
                        path,
                        watch_relay,
                        say=lambda line: self.say(f"this host's watch relay: {line}"),
                    )
                    child_env[env.WATCH_RELAY] = path
                except RelayPathTooLong as exc:
                    self.say(f"watch relay off, so each process watches etcd itself: {exc}")
            store = self.control_plane.store() if self.control_plane is not None else None
            self.link = _Link(self.coord.addr, period=min(1.0, heartbeat_timeout / 2), store=store)
        except BaseException:
            self.close()
            raise

    def _start_control_plane(
        self,
        replicas: int,
        nproc: int,
        heartbeat_timeout: float,
        *,
        hang_timeout: float,
        local: list[int],
        status_address: str | None = None,
        event_log: str | None = None,
        **coordinator: Any,
    ) -> Any:
        """A coordinator process, or on etcd this launcher's candidacy for the job's monitor role."""
        if self.control_plane is None:
            return coordinator_process.start(
                replicas,
                heartbeat_timeout,
                secret_file=self.secret_file,
                replica_size=nproc,
                hang_timeout=hang_timeout,
                status_address=status_address,
                event_log=event_log,
                **coordinator,
            )
        role = MonitorRole(
            self.control_plane,
            self.secret,
            replicas,
            heartbeat_timeout,
            hang_timeout,
            nproc,
            f"launcher {socket.gethostname()}/{os.getpid()} (replicas {local})",
            self.say,
            status_address=status_address,
            event_log=event_log,
        )
        return EtcdCoordinator(self.control_plane, role.start())

    def _process_env(self, extra: dict[str, str], inner: int) -> dict[str, str]:
        out = dict(self.child_env, **extra)
        if self.k > 1:
            out[env.INNER] = str(inner)
        return out

    def spawn(self, r: int) -> list[Process]:
        """The K processes of replica ``r`` (a replica starts whole or not at all)."""
        procs: list[Process] = []
        try:
            for i in range(self.k):
                procs.append(self.starter.start(self.argv(r), self._process_env({env.REPLICA: str(r)}, i), wait=True))
        except BaseException:
            for p in procs:
                kill_tree(p.pid)
                p.wait()
            raise
        return procs

    def spawn_standby(self, s: int) -> list[Process] | None:
        procs: list[Process] = []
        for i in range(self.k):
            # None: the fork server is still importing; the first process decides, the others wait
            proc = self.starter.start(self.argv(0), self._process_env({env.STANDBY: str(s)}, i), wait=bool(procs))
            if proc is None:
                return None  # start this standby later
            procs.append(proc)
        return procs

    def nap(self, timeout: float) -> None:
        """The main loop's pause: ``timeout`` seconds, or less when a replica process exits."""
        if self.starter is not None:
            self.starter.nap(timeout)
        else:
            time.sleep(timeout)

    def close(self, coordinator_lost: bool = False) -> None:
        if self.starter is not None:
            self.starter.close()
        if self.coord is not None and (coordinator_lost or self.coord.frozen()):
            # A frozen coordinator would never handle SIGTERM. Killed before the link is closed: the
            # kill resets the connection the link's thread is stuck on, so the thread ends now
            # instead of inside torch's store code while the interpreter exits (which aborts it).
            self.coord.kill()
        if self.link is not None:
            self.link.close()
        if self.rack_role is not None:
            # Before the relay: its followers, whose connections end with it, then find the rack's key gone
            # and elect another at once (rather than finding this address refused and watching etcd a while).
            self.rack_role.close()
        if self.relay is not None:
            self.relay.close()
            self.say(f"watch relay: {self.relay.served} processes of this host followed it")
        if self.coord is not None:
            self.coord.stop()
        self.job_dir.remove()
        if self.control_plane is not None and self.only_launcher and self.secret is not None:
            forget_job(self.control_plane)  # the only launcher of the job: nobody else needs its keys


def _check_options(
    replicas: Any,
    restarts: Any,
    nproc_per_replica: Any,
    inject: str | None,
    standby: int,
    finish_grace: float,
    extra_env: dict[str, str] | None,
) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    check_seconds("finish_grace", finish_grace)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be an integer >= 0, got {restarts!r}")
    # Validate before starting anything; a plan in the environment reaches every replica too.
    environ = dict(os.environ, **(extra_env or {}))
    if inject:
        check_plan(inject, replicas, environ=environ)
    else:
        check_plan(environ.get(env.INJECT), replicas, env.INJECT, environ)
    if isinstance(nproc_per_replica, bool) or not isinstance(nproc_per_replica, int) or nproc_per_replica < 1:
        raise ValueError(f"nproc_per_replica must be an integer >= 1, got {nproc_per_replica!r}")
    check_standby(standby, restarts)
    nice = control_nice()
    if nice is not None:
        check_nice_permitted(nice)


def _check_added(add: Any, local: Sequence[int] | None, control_plane: EtcdSettings | None) -> int:
    """``add_replicas``: newcomers of a running job; their launcher meets the job in etcd."""
    if isinstance(add, bool) or not isinstance(add, int) or add < 0:
        raise ValueError(f"add_replicas must be an integer >= 0, got {add!r}")
    if add and local is not None:
        raise ValueError("--add-replicas N and --local-replicas IDS exclude each other. HINT: give one of them")
    if add and control_plane is None:
        raise ValueError(
            "--add-replicas joins a running job through its control plane. HINT: add --control-plane etcd://... and "
            "the job's --job NAME (or start replicas by hand with the job's variables, docs/howto.md)"
        )
    return add


def _local_replicas(
    replicas: int, local_replicas: Sequence[int] | None, control_plane: EtcdSettings | None, growing: bool = False
) -> list[int]:
    """The replica ids this launcher starts: all, or (several launchers of one job meeting in etcd) its own."""
    local = list(range(replicas)) if local_replicas is None else sorted(set(local_replicas))
    if not local or any(not 0 <= r < replicas for r in local):
        raise ValueError(f"local replicas {list(local_replicas or [])} must be ids in 0..{replicas - 1}")
    if control_plane is None and len(local) != replicas and not growing:
        raise ValueError(
            "--local-replicas needs a shared control plane: the launchers of one job meet in etcd. "
            "HINT: add --control-plane etcd://... (and the same --job on every launcher)"
        )
    return local


class _Replacing:
    """What the launcher does about a replica that failed or hung: restart it, hand its place to a standby, end
    one the coordinator declared dead that still runs. Part of :class:`Supervisor`."""

    group: list[_ReplicaProcesses]
    job: _Job
    link: _Link
    sealer: Sealer
    standbys: StandbyPool | None
    workers: _WorkerWatch
    k: int
    nproc: int
    replicas: int
    min_replicas: int
    restarts: int
    lost_after: float
    interrupted: bool
    watch_workers: bool
    say: Callable[[str], Any]
    _declare_dead: Callable[[_ReplicaProcesses], bool]
    _end_replica: Callable[..., None]

    def _restart(self, rep: _ReplicaProcesses) -> bool:
        """Start failed replica ``rep`` again (its death is declared): a ready standby takes its place,
        else new processes (a new incarnation that rejoins). False when it could not be started."""
        if self.min_replicas < self.replicas and not self.link.call(
            lambda store: claim_free_id(store, self.sealer, rep.replica), timeout=self.lost_after
        ):
            self.say(f"replica {rep.replica}: not restarted, a newcomer of another launcher took its id")
            return False
        if self.k > 1:
            # The new processes' incarnation is the next one: deaths of this one are no longer theirs.
            previous = self.link.call(lambda store: int(store.add(f"inc/{rep.replica}", 0)), timeout=self.lost_after)
            rep.first_incarnation = previous + 1
        if self.standbys is not None and self._take_standby(rep):
            return True
        rep.restarts += 1
        more = f": {self.k} new processes" if self.k > 1 else ""
        self.say(f"restarting replica {rep.replica} ({rep.restarts}/{self.restarts}){more}")
        try:
            rep.procs = self.job.spawn(rep.replica)
        except OSError as exc:
            self.say(f"cannot restart replica {rep.replica}: {exc}")
            return False
        rep.codes, rep.failed = {}, False
        return True

    def _take_standby(self, rep: _ReplicaProcesses, end_agent: bool = False) -> bool:
        """A waiting standby takes failed replica ``rep``'s place (its death is already declared) and
        counts as one of its restarts; ``end_agent``: first end the replica's torchrun agent (and
        any worker it restarted). False (nothing counted) when no standby is ready."""
        taken = self.standbys.take(
            lambda ids: self.link.call(
                lambda store: [s for s in ids if standby_is_ready(store, self.sealer, s, self.nproc)], self.lost_after
            )
        )
        if taken is None:
            return False
        if end_agent:
            kill_tree(rep.proc.pid)
            rep.proc.wait()
        s, rep.procs = taken
        self.link.call(lambda store: assign_standby(store, self.sealer, s, rep.replica), timeout=self.lost_after)
        rep.restarts += 1
        rep.codes, rep.failed = {}, False
        rep.history.append(f"standby {s} took its place")
        pids = f"pid {rep.proc.pid}" if len(rep.procs) == 1 else f"pids {[p.pid for p in rep.procs]}"
        self.say(f"replica {rep.replica}: standby {s} ({pids}) takes its place ({rep.restarts}/{self.restarts})")
        self.standbys.fill()  # a new standby starts in the background
        return True

    # ------------------------------------------------------------------ what the coordinator declared
    def _end_declared(self, seen: dict[int, tuple[int, int]]) -> None:
        """K = 1: end a replica declared dead that still runs ``lost_after`` seconds later."""
        now_t = time.monotonic()
        for c in self.group:
            inc, declared = seen.get(c.replica, (0, 0))
            if (
                c.done
                or c.proc.poll() is not None
                or declared <= c.handled
                or declared < inc
                or is_stopped(c.proc.pid)  # frozen: it cannot act on its exclusion; ended at the end
            ):
                c.declared_at = None
                continue
            if c.declared_at is None:
                c.declared_at = now_t
            elif now_t - c.declared_at > self.lost_after:
                # Under a torchrun agent: end the worker (the agent restarts it or fails), not the agent.
                pids = children_of(c.proc.pid) if self.watch_workers else [c.proc.pid]
                for pid in pids:
                    kill_tree(pid)
                c.handled, c.declared_at = declared, None
                c.history.append("declared dead by the coordinator, still running: killed")
                self.say(
                    f"replica {c.replica} (incarnation {declared}) was declared dead by the coordinator and "
                    f"still ran {self.lost_after:g}s later (hung); killed it (pids {pids})"
                )

    def _end_dead_replicas(self, seen: dict[int, tuple[int, int, bool]]) -> None:
        """K > 1: a process hung (the coordinator declared its replica dead): end the rest of it."""
        for rep in self.group:
            inc, dead, left = seen.get(rep.replica, (0, 0, True))
            if rep.done or rep.failed or inc < rep.first_incarnation or dead < inc or left:
                continue
            self._end_replica(rep, "declared dead by the coordinator (a process hung or stopped heartbeating)")

    def _scan_workers(self) -> None:
        """torchrun mode: a replica whose agent's worker exited is declared dead at once."""
        for c in self.workers.lost(self.group):
            # The agent will restart it; tell the survivors now rather than after heartbeats (unless the
            # coordinator's monitor, which missed its heartbeats, was first).
            if not self._declare_dead(c):
                self.say(f"replica {c.replica}: its worker exited; already declared dead")
                continue
            self.say(f"replica {c.replica}: its worker exited; declared dead")
            if self.standbys is not None and c.restarts < self.restarts and not self.interrupted:
                # A ready standby job instead: the agent is ended before it restarts anything, and
                # the standby's agent becomes the replica's. With none ready, the agent restarts its worker.
                if self._take_standby(c, end_agent=True):
                    self.workers.first_seen[c.replica] = {}


class Supervisor(_Replacing):
    """Runs one job: a fresh coordinator and R replicas of K processes each (``nproc_per_replica``);
    :meth:`run` returns the job's exit code. The options are described in the module's docstring."""

    def __init__(
        self,
        command: Sequence[str] | Callable[[int], Sequence[str]],
        replicas: int,
        *,
        heartbeat_timeout: float = 1.0,
        hang_timeout: float = 60.0,
        inject: str | None = None,
        restarts: int = 0,
        host: str = "127.0.0.1",
        extra_env: dict[str, str] | None = None,
        on_event: Callable[[str], Any] | None = None,
        finish_grace: float = 30.0,
        watch_workers: bool = False,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        nproc_per_replica: int = 1,
        standby: int = 0,
        fork: bool = True,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        control_plane: EtcdSettings | None = None,
        local_replicas: Sequence[int] | None = None,
        status_address: str | None = None,
        event_log: str | None = None,
        min_replicas: int | None = None,
        add_replicas: int = 0,
        notice_signal: str | None = None,
        restart_left: bool = False,
        watch_upstream: str | None = None,
        watch_rack: str | None = None,
        watch_rack_address: str | None = None,
    ) -> None:
        _check_options(replicas, restarts, nproc_per_replica, inject, standby, finish_grace, extra_env)
        placement = relay_placement(watch_upstream, watch_rack, watch_rack_address, etcd=control_plane is not None)
        self.min_replicas = replicas if min_replicas is None else min_replicas
        if not 1 <= self.min_replicas <= replicas:
            raise ValueError(
                f"replicas {self.min_replicas}:{replicas}: MIN must be in 1..MAX. HINT: e.g. --replicas 2:4"
            )
        self.add_replicas = _check_added(add_replicas, local_replicas, control_plane)
        if local_replicas is None and not add_replicas and self.min_replicas < replicas:
            local_replicas = list(range(self.min_replicas))  # a growing job starts with MIN; newcomers add more
        self.control_plane = control_plane
        growing = self.min_replicas < replicas
        self.local = [] if add_replicas else _local_replicas(replicas, local_replicas, control_plane, growing)
        self.notice_signal = parse_signal(notice_signal or os.environ.get(env.NOTICE_SIGNAL) or "SIGTERM")
        self.restart_left = restart_left
        check_heartbeat_timeout(heartbeat_timeout, heartbeat_interval)
        self.argv = command if callable(command) else (lambda r: command)
        self.first = list(self.argv(0))
        if not self.first:
            raise ValueError("the replica command is empty. HINT: give it after --, e.g. -- python train.py")
        self.replicas, self.nproc, self.restarts, self.standby = replicas, nproc_per_replica, restarts, standby
        self.extra_env, self.finish_grace, self.watch_workers = extra_env, finish_grace, watch_workers
        self.job_options = dict(
            replicas=replicas,
            nproc=nproc_per_replica,
            extra_env=extra_env,
            inject=inject,
            fork=fork,
            preload=preload,
            heartbeat_timeout=heartbeat_timeout,
            heartbeat_interval=heartbeat_interval,
            hang_timeout=hang_timeout,
            host=host,
            local=self.local,
            replica_range=str(replicas) if self.min_replicas == replicas else f"{self.min_replicas}:{replicas}",
            notice_signal=self.notice_signal.name,
            status_address=status_address,
            event_log=event_log,
            watch_relay=placement,
        )
        self.say = on_event or (lambda line: print(f"[lightning-recover] {line}", file=sys.stderr, flush=True))
        # The processes this launcher starts per replica: under torchrun one agent starts the K workers.
        self.k = 1 if watch_workers else nproc_per_replica
        # The coordinator's silence that ends the job: the replicas' own bound (RecoverOptions.store_timeout).
        # A replica declared dead that still runs this long afterwards (K = 1) is ended: a deadlocked process
        # never exits by itself, and one wrongly suspected has had the time to notice its exclusion and stop.
        self.lost_after = max(5.0, 2 * heartbeat_timeout + 1.0)
        self.group: list[_ReplicaProcesses] = []
        self.interrupted = self.coordinator_lost = False
        self.finished_at: float | None = None
        self.job: _Job | None = None
        self.standbys: StandbyPool | None = None
        self.deaths: _DeathReader | None = None
        self.workers = _WorkerWatch()

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        # Refuse a command that cannot run before anything is started (the usual typo); spawn errors
        # after this point still end everything started.
        path = (self.extra_env or {}).get("PATH", os.environ.get("PATH"))
        if not os.path.dirname(self.first[0]) and shutil.which(self.first[0], path=path) is None:
            self.say(
                f"cannot start the replicas: command {self.first[0]!r} not found on PATH. HINT: check the command "
                "after --, e.g. -- python train.py"
            )
            return EXIT_SPAWN_FAILED
        self.job = _Job(self.argv, self.k, self.say, self.control_plane, len(self.local) == self.replicas)
        self.job.start(**self.job_options)
        self.link, self.sealer, self.coord = self.job.link, self.job.sealer, self.job.coord
        self.deaths = _DeathReader(self.link, self.sealer, self.replicas, self.k)
        if self.add_replicas:
            try:
                self.local = self.link.call(
                    lambda store: claim_replica_ids(store, self.sealer, self.replicas, self.add_replicas),
                    self.lost_after,
                )
            except BaseException:
                self.job.close()
                raise
            self.say(f"the control plane assigned replica ids {self.local} to this launcher's newcomers")
        old: dict = {}
        try:
            if not self._start_replicas():
                return EXIT_SPAWN_FAILED
            old = {s: signal.signal(s, self._forward) for s in {signal.SIGINT, signal.SIGTERM, self.notice_signal}}
            try:
                self._watch()
                self._end_hung_at_the_end()
            except _CoordinatorLost as exc:
                if not (self.interrupted and not self.coord.running()):
                    return self._coordinator_is_lost(exc)
                # else: Ctrl-C reached the coordinator too: an interruption, not a loss
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._end_job()
        self.say("done: " + ", ".join(rep.describe() for rep in self.group))
        if any(rep.ok for rep in self.group) and not self.interrupted:
            return 0
        left = [rep for rep in self.group if rep.done and set(rep.codes.values()) == {EXIT_LEFT_ON_NOTICE}]
        return EXIT_LEFT_ON_NOTICE if left and len(left) == len(self.group) else 1

    def _start_replicas(self) -> bool:
        if self.standby:
            # One standby per restart the job may still make, at most: never more than needed.
            limit = self.standby + self.replicas * self.restarts
            self.standbys = StandbyPool(self.standby, self.job.spawn_standby, limit, self.say)
        try:
            for r in self.local:
                self.group.append(_ReplicaProcesses(r, self.job.spawn(r)))
        except OSError as exc:
            self.say(
                f"cannot start replica {len(self.group)}: {exc}. Ended the {len(self.group)} replica(s) and the "
                "coordinator already started. HINT: check the command after --, e.g. -- python train.py"
            )
            return False
        if self.standbys is not None:
            self.standbys.fill()  # after the replicas: they are the ones the job waits for
        per = f" x {self.k} processes" if self.k > 1 else ""
        self.say(
            f"{self.coord.describe()}; started {len(self.local)} replicas{per}"
            + (f" and {self.standby} standby{per}" if self.standbys is not None else "")
            + f": {' '.join(self.first)}"
        )
        return True

    def _forward(self, signum: int, _frame: Any) -> None:
        """Ctrl-C reaches every replica; SIGTERM or the notice signal is a whole-job notice: every replica
        gets its notice signal, finishes its step and leaves (with a final checkpoint if configured)."""
        self.interrupted = True
        _send_signal(self.group, signum if signum == signal.SIGINT else self.notice_signal)

    # ------------------------------------------------------------------ the main loop
    def _watch(self) -> None:
        while True:
            running = sum(self._poll(rep) if self.k == 1 else self._poll_group(rep) for rep in self.group)
            seen = self.deaths.take()
            if seen is not None:
                (self._end_declared if self.k == 1 else self._end_dead_replicas)(seen)
            self.deaths.request()
            if self.watch_workers:
                self._scan_workers()
            finished = self.finished_at is not None and time.monotonic() - self.finished_at > self.finish_grace
            if running == 0 or finished:
                return
            if self.standbys is not None and self.finished_at is None:
                self.standbys.reap()
            if self.coord.exited():
                raise _CoordinatorLost(self.coord.exited())
            if self.link.silent_for() > self.lost_after:
                raise _CoordinatorLost(
                    f"it stopped answering for more than {self.lost_after:g}s (frozen or unreachable; "
                    f"{self.link.describe_silence()})"
                    if self.link.error is None
                    else f"the connection failed ({self.link.error})"
                )
            self.job.nap(0.01)

    def _poll(self, c: _ReplicaProcesses) -> int:
        """K = 1: look at the replica's process; 1 if it runs (or was started again), else 0."""
        if c.done:
            return 0
        code = c.proc.poll()
        if code is None:
            return int(not is_stopped(c.proc.pid))
        c.history.append(describe_exit(code) if code != EXIT_LEFT_ON_NOTICE else "left on notice")
        if code == EXIT_LEFT_ON_NOTICE:
            self.say(f"replica {c.replica} left on notice")
            if self.coord.running():
                self._declare_dead(c)  # it marked itself gone already; a notice for a torchrun agent's worker
            if self.restart_left and not self.interrupted and c.restarts < self.restarts and self._restart(c):
                return 1
        elif code != 0:
            newly = self.coord.running() and self._declare_dead(c)
            if newly or not self.watch_workers:  # under torchrun: reported when its worker exited
                self.say(f"replica {c.replica} failed ({describe_exit(code)})")
            # Under torchrun the agent restarts workers itself; `restarts` bounds takeovers only.
            if c.restarts < self.restarts and not self.interrupted and not self.watch_workers and self._restart(c):
                return 1
        c.codes[0] = code
        if code == 0 and self.finished_at is None:
            self.finished_at = time.monotonic()
        return 0

    def _poll_group(self, rep: _ReplicaProcesses) -> int:
        """K > 1: look at the replica's processes (one failed: end it whole); how many of them run."""
        if not rep.done:
            for i, p in enumerate(rep.procs):
                if i in rep.codes:
                    continue
                code = p.poll()
                if code is None:
                    continue
                rep.codes[i] = code
                if code == EXIT_LEFT_ON_NOTICE and i == 0:
                    rep.history.append("left on notice")
                    self.say(f"replica {rep.replica} left on notice")
                if code != 0 and code != EXIT_LEFT_ON_NOTICE and not rep.failed:
                    self._end_replica(rep, f"process {i} (pid {p.pid}) {describe_exit(code)}")
                    break
            if rep.ok:
                self.finished_at = self.finished_at or time.monotonic()
                rep.history.append(f"all {self.k} processes finished")
        return sum(1 for p in rep.running() if not is_stopped(p.pid))

    def _end_replica(self, rep: _ReplicaProcesses, why: str, restart: bool = True) -> None:
        """K > 1: end all of the replica's processes, and start it again if it may."""
        rep.failed = True
        try:
            self._declare_dead(rep)
        except _CoordinatorLost:
            pass  # the coordinator is gone; the replicas notice on their own
        pids = rep.end()
        rep.history.append(why + (f"; killed its other processes {pids}" if pids else ""))
        self.say(f"replica {rep.replica} failed ({why}); ended its processes {pids}")
        if restart and rep.restarts < self.restarts and not self.interrupted:
            self._restart(rep)

    def _declare_dead(self, rep: _ReplicaProcesses) -> bool:
        # Synchronous: a restart must not bump the incarnation before the old one is declared dead.
        def declare(store: Any) -> tuple[bool, int]:
            inc = int(store.add(f"inc/{rep.replica}", 0))  # one read: the notice names this incarnation
            return mark_dead(store, self.sealer, rep.replica, inc), inc

        marked, inc = self.link.call(declare, timeout=self.lost_after)
        rep.handled = max(rep.handled, inc)  # its next incarnation is a new process
        return marked

    # ------------------------------------------------------------------ the end
    def _end_hung_at_the_end(self) -> None:
        for rep in self.group:
            if rep.done:
                continue
            if self.k > 1:
                self._end_replica(rep, "hung at the end of the run", restart=False)
                continue
            rep.end()  # hung replicas (or agents waiting on one): nobody will resume them
            rep.history.append("hung, killed at the end")
            self.say(f"replica {rep.replica} was hung; killed it")

    def _coordinator_is_lost(self, exc: Exception) -> int:
        self.coordinator_lost = True
        self.say(
            f"CoordinatorLostError: the control plane ({self.coord.describe()}) is lost: {exc}. "
            "No step can be agreed without it; ending the job's replicas. "
            "HINT: restart the job from its last checkpoint."
        )
        _wait_for_running(self.group, self.lost_after + 1.0)
        return EXIT_COORDINATOR_LOST

    def _end_job(self) -> None:
        if self.standbys is not None:
            self.standbys.end()
        for rep in self.group:
            for p in rep.procs:
                if p.poll() is None:
                    kill_tree(p.pid)
                    p.wait()
        self.job.close(self.coordinator_lost)


def _send_signal(group: list[_ReplicaProcesses], signum: int) -> None:
    """Forward a signal the launcher got (Ctrl-C, SIGTERM) to every replica process still running."""
    for rep in group:
        for p in rep.procs:
            if p.poll() is None:
                p.send_signal(signum)


def _wait_for_running(group: list[_ReplicaProcesses], seconds: float) -> None:
    """After the coordinator was lost: running replicas notice on their own within the same bound and
    exit with their own named error; give them that long, then the job ends whatever is left. A
    stopped (hung) replica never will: it is not waited for."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(
        p.poll() is None and not is_stopped(p.pid) for rep in group for p in rep.procs
    ):
        time.sleep(0.02)


def supervise(command: Sequence[str] | Callable[[int], Sequence[str]], replicas: int, **options: Any) -> int:
    """Run ``command`` as ``replicas`` replicas under a fresh coordinator (see :class:`Supervisor`
    for the options); return the job's exit code."""
    return Supervisor(command, replicas, **options).run()
