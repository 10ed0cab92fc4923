"""The tolerant local launcher: one process per replica, survivors are never killed.

Lightning's stock launcher kills every rank when one dies, and torchrun's agent restarts its
whole group. This supervisor instead starts the coordinator and one process per replica, tells
the coordinator at once when a replica process exits (so survivors need not wait for heartbeats),
optionally restarts it, and ends a replica the coordinator declared dead (hung) that still runs
after a grace period (a deadlocked process never exits by itself). When the survivors are done it
ends what is left (a SIGSTOPped replica stays stopped until then). Its exit code is 0 when at least one replica finished successfully.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_recover import env
from lightning_recover.errors import RecoverError
from lightning_recover.launch import coordinator_process
from lightning_recover.launch.fork_server import DEFAULT_PRELOAD, Process, ProcessStarter
from lightning_recover.launch.process_tree import children_map, describe_exit, is_stopped, kill_tree
from lightning_recover.launch.standby_pool import StandbyPool
from lightning_recover.protocol import coordinator
from lightning_recover.protocol.faults import parse_faults
from lightning_recover.protocol.messages import JobSecret, Sealer, connect, mark_dead, read_declared
from lightning_recover.protocol.options import (
    DEFAULT_HEARTBEAT_INTERVAL,
    check_heartbeat_timeout,
    check_seconds,
    check_standby,
)
from lightning_recover.protocol.standby import assign as assign_standby
from lightning_recover.protocol.standby import is_ready as standby_is_ready


@dataclass
class _Child:
    replica: int
    proc: Process
    restarts: int = 0
    exit_code: int | None = None
    history: list[str] = field(default_factory=list)
    handled: int = 0  # declarations of incarnations up to this one concern processes already ended
    declared_at: float | None = None  # when the launcher first saw it declared dead while it ran


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

    def __init__(self, addr: str, period: float) -> None:
        self._store = connect(addr, timeout=10.0)
        self._period = period
        self._requests: queue.Queue = queue.Queue()
        self.last_ok = time.monotonic()
        self.error: BaseException | None = None
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
                    self._store.check(["meta/replicas"])
                else:
                    fn, box, done = item
                    box.append(fn(self._store))
                    done.set()
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
        return float("inf") if self.error is not None else time.monotonic() - self.last_ok


def _replica_preexec(launcher_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        # A replica must not outlive a SIGKILLed launcher (its coordinator dies with it too).
        coordinator_process.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def supervise(
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
) -> int:
    """Run ``command`` once per replica under a fresh coordinator; return the job's exit code.

    ``command`` is the argv of every replica, or a function of the replica id returning it (the
    torchrun mode wraps each replica in its own torchrun agent). Once one replica has finished
    successfully the job is done: replicas still running ``finish_grace`` seconds later (hung, or
    under an agent that waits for a hung worker) are killed. With ``watch_workers`` (torchrun mode:
    each child is an agent that restarts its worker itself), the death of a child's worker process
    is declared to the coordinator at once, as the exit of a direct child is.

    Nothing of the job outlives it: the coordinator and the replicas get a parent-death signal; if
    the coordinator dies or stops answering for ``max(5, 2 x heartbeat_timeout + 1)`` seconds, the
    replicas are ended and the exit code is ``EXIT_COORDINATOR_LOST``; a command that cannot be
    started ends what was started and returns ``EXIT_SPAWN_FAILED``.

    ``nproc_per_replica`` = K > 1: sharded replicas. Locally the launcher starts K processes per
    replica (see :mod:`~lightning_recover.launch.sharded`); in torchrun mode each agent starts them.

    ``standby`` = S > 0: S warm standbys run the command ahead of need and wait; a failed replica's
    restart is then a standby taking its place (it still counts as one of its ``restarts``), and a
    new standby is started in its stead (see :mod:`~lightning_recover.protocol.standby`). Under
    torchrun (``watch_workers``) a standby is a torchrun job of its own; ``restarts`` then bounds
    the takeovers per replica only (the agents restart workers themselves).

    ``fork`` (not under torchrun): replicas, restarted replicas and standbys are forked by a fork
    server that imported ``preload`` once (see :mod:`~lightning_recover.launch.fork_server`), so
    none of them imports torch and Lightning again; a command that cannot be forked starts new
    processes.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    check_heartbeat_timeout(heartbeat_timeout, heartbeat_interval)
    check_seconds("finish_grace", finish_grace)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be an integer >= 0, got {restarts!r}")
    parse_faults(inject, replicas)  # validate before starting anything
    if isinstance(nproc_per_replica, bool) or not isinstance(nproc_per_replica, int) or nproc_per_replica < 1:
        raise ValueError(f"nproc_per_replica must be an integer >= 1, got {nproc_per_replica!r}")
    check_standby(standby, restarts)
    say = on_event or (lambda line: print(f"[lightning-recover] {line}", file=sys.stderr, flush=True))
    argv = command if callable(command) else (lambda r: command)
    first = list(argv(0))
    if not first:
        raise ValueError("the replica command is empty. HINT: give it after --, e.g. -- python train.py")
    # Refuse a command that cannot run before anything is started (the usual typo); spawn errors
    # after this point still end everything started.
    path = (extra_env or {}).get("PATH", os.environ.get("PATH"))
    if not os.path.dirname(first[0]) and shutil.which(first[0], path=path) is None:
        say(
            f"cannot start the replicas: command {first[0]!r} not found on PATH. HINT: check the command "
            "after --, e.g. -- python train.py"
        )
        return EXIT_SPAWN_FAILED
    # One secret per job, in a private 0600 file: it authenticates every control message.
    secret_dir = tempfile.mkdtemp(prefix="lightning-recover-")
    secret = JobSecret.generate()
    secret_file = secret.write_file(secret_dir)
    sealer = Sealer(secret)
    child_env = dict(os.environ, **(extra_env or {}))
    child_env[env.SECRET_FILE] = secret_file
    child_env.pop(env.SECRET, None)
    child_env[env.REPLICAS] = str(replicas)
    child_env.setdefault(env.OMP_NUM_THREADS, "1")  # spinning OpenMP threads make gloo 20x slower on small machines
    if inject:
        child_env[env.INJECT] = inject
    starter: ProcessStarter | None = None
    try:
        # The fork server imports while the coordinator starts (each takes seconds); it needs no address: every
        # process it forks gets its own environment. torchrun's replicas and standbys are agents: not forked.
        starter = ProcessStarter(
            first,
            child_env,
            say,
            fork=fork and not watch_workers,
            preload=preload,
            preexec=_replica_preexec(os.getpid()),
        )
        coord = coordinator_process.start(
            replicas,
            heartbeat_timeout,
            host=host,
            heartbeat_interval=heartbeat_interval,
            hang_timeout=hang_timeout,
            secret_file=secret_file,
            replica_size=nproc_per_replica,
        )
    except BaseException:
        if starter is not None:
            starter.close()
        shutil.rmtree(secret_dir, ignore_errors=True)
        raise
    child_env[env.COORDINATOR] = coord.addr
    children: list[_Child] = []
    # The coordinator's silence that ends the job: the replicas' own bound (RecoverOptions.store_timeout).
    lost_after = max(5.0, 2 * heartbeat_timeout + 1.0)
    interrupted = coordinator_lost = False
    old: dict = {}
    link: _Link | None = None
    standbys: StandbyPool | None = None
    try:
        link = _Link(coord.addr, period=min(1.0, heartbeat_timeout / 2))
        if nproc_per_replica > 1:
            child_env[env.REPLICA_SIZE] = str(nproc_per_replica)
            if not watch_workers:
                from lightning_recover.launch.sharded import supervise_sharded

                say(f"coordinator at {coord.addr} (pid {coord.proc.pid})")
                return supervise_sharded(
                    argv,
                    replicas,
                    nproc_per_replica,
                    connect(coord.addr),
                    sealer,
                    child_env,
                    say,
                    finish_grace,
                    restarts=restarts,
                    standby=standby,
                    starter=starter,
                )

        def spawn(r: int) -> Process:
            return starter.start(argv(r), dict(child_env, **{env.REPLICA: str(r)}), wait=True)

        def spawn_standby(s: int) -> list[Process] | None:
            proc = starter.start(argv(0), dict(child_env, **{env.STANDBY: str(s)}))
            return None if proc is None else [proc]  # None: the fork server is still importing

        # One standby process per restart the job may still make, at most: never more than needed.
        standbys = StandbyPool(standby, spawn_standby, standby + replicas * restarts, say) if standby else None

        try:
            for r in range(replicas):
                children.append(_Child(r, spawn(r)))
        except OSError as exc:
            say(
                f"cannot start replica {len(children)}: {exc}. Ended the {len(children)} replica(s) and the "
                "coordinator already started. HINT: check the command after --, e.g. -- python train.py"
            )
            return EXIT_SPAWN_FAILED
        if standbys is not None:
            standbys.fill()  # after the replicas: they are the ones the job waits for
        say(
            f"coordinator at {coord.addr} (pid {coord.proc.pid}); started {replicas} replicas"
            + (f" and {standby} standby" if standbys is not None else "")
            + f": {' '.join(first)}"
        )
        finished_at: float | None = None
        first_seen: dict[int, dict[int, float]] = {}  # replica -> {worker pid under its agent: first seen}
        next_scan = 0.0
        # A replica the coordinator declared dead (hung: no progress while peers waited, or no heartbeat)
        # that still runs this long afterwards is ended: a deadlocked process never exits by itself, and
        # one wrongly suspected has had the time to notice its exclusion and stop with its own error.
        declared_grace = lost_after
        declarations: tuple[list, threading.Event] | None = None
        next_declarations = 0.0

        def read_declarations(store: Any) -> dict[int, tuple[int, int]]:
            """Replica -> (current incarnation, incarnation the coordinator's monitor declared dead)."""
            raw = store.multi_get([f"inc/{r}" for r in range(replicas)] + [f"declared/{r}" for r in range(replicas)])
            out = {}
            for r in range(replicas):
                try:
                    out[r] = (int(raw[r]), read_declared(sealer, r, raw[replicas + r]))
                except ValueError:
                    out[r] = (0, 0)
            return out

        def declare_dead(r: int) -> bool:
            # Synchronous: a restart must not bump the incarnation before the old one is declared dead.
            marked, inc = link.call(
                lambda store: (mark_dead(store, sealer, r), int(store.add(f"inc/{r}", 0))), timeout=lost_after
            )
            children[r].handled = max(children[r].handled, inc)  # its next incarnation is a new process
            return marked

        def take_standby(c: _Child, end_agent: bool = False) -> bool:
            """A waiting standby takes failed replica ``c``'s place (its death is already declared) and
            counts as one of its restarts; ``end_agent``: first end the replica's torchrun agent (and
            any worker it restarted). False (nothing counted) when no standby is ready."""
            taken = standbys.take(
                lambda ids: link.call(
                    lambda store: [s for s in ids if standby_is_ready(store, sealer, s, nproc_per_replica)], lost_after
                )
            )
            if taken is None:
                return False
            if end_agent:
                kill_tree(c.proc.pid)
                c.proc.wait()
            s, (proc,) = taken
            link.call(lambda store: assign_standby(store, sealer, s, c.replica), timeout=lost_after)
            c.restarts += 1
            c.proc = proc
            c.history.append(f"standby {s} took its place")
            say(f"replica {c.replica}: standby {s} (pid {proc.pid}) takes its place ({c.restarts}/{restarts})")
            standbys.fill()  # a new standby starts in the background
            return True

        def end_declared(seen: dict[int, tuple[int, int]]) -> None:
            now_t = time.monotonic()
            for c in children:
                inc, declared = seen.get(c.replica, (0, 0))
                if (
                    c.exit_code is not None
                    or c.proc.poll() is not None
                    or declared <= c.handled
                    or declared < inc
                    or is_stopped(c.proc.pid)  # frozen: it cannot act on its exclusion; ended at the end
                ):
                    c.declared_at = None
                    continue
                if c.declared_at is None:
                    c.declared_at = now_t
                elif now_t - c.declared_at > declared_grace:
                    # Under a torchrun agent: end the worker (the agent restarts it or fails), not the agent.
                    pids = children_map().get(c.proc.pid, []) if watch_workers else [c.proc.pid]
                    for pid in pids:
                        kill_tree(pid)
                    c.handled, c.declared_at = declared, None
                    c.history.append("declared dead by the coordinator, still running: killed")
                    say(
                        f"replica {c.replica} (incarnation {declared}) was declared dead by the coordinator and "
                        f"still ran {declared_grace:g}s later (hung); killed it (pids {pids})"
                    )

        def _forward(signum: int, _frame: Any) -> None:
            nonlocal interrupted
            interrupted = True
            for c in children:
                if c.proc.poll() is None:
                    c.proc.send_signal(signum)

        old = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                running = 0
                for c in children:
                    if c.exit_code is not None:
                        continue
                    code = c.proc.poll()
                    if code is None:
                        running += not is_stopped(c.proc.pid)
                        continue
                    c.history.append(describe_exit(code))
                    if code != 0:
                        if coord.proc.poll() is None:
                            declare_dead(c.replica)
                        say(f"replica {c.replica} failed ({describe_exit(code)})")
                        # Under torchrun the agent restarts workers itself; `restarts` bounds takeovers only.
                        if c.restarts < restarts and not interrupted and not watch_workers:
                            if standbys is not None and take_standby(c):
                                running += 1
                                continue
                            c.restarts += 1
                            say(f"restarting replica {c.replica} ({c.restarts}/{restarts})")
                            try:
                                c.proc = spawn(c.replica)
                            except OSError as exc:
                                say(f"cannot restart replica {c.replica}: {exc}")
                            else:
                                running += 1
                                continue
                    c.exit_code = code
                    if code == 0 and finished_at is None:
                        finished_at = time.monotonic()
                if declarations is not None and declarations[1].is_set():
                    if declarations[0]:
                        end_declared(declarations[0][0])
                    declarations = None
                if declarations is None and time.monotonic() >= next_declarations:
                    next_declarations = time.monotonic() + 0.1
                    declarations = link.submit(read_declarations)
                if watch_workers and time.monotonic() >= next_scan:
                    next_scan = time.monotonic() + 0.05
                    tree, now_t = children_map(), time.monotonic()
                    for c in children:
                        seen = first_seen.setdefault(c.replica, {})
                        now = set(tree.get(c.proc.pid, [])) if c.exit_code is None else set()
                        # Only a worker that lived >= 1 s counts: no transient helper process of the agent.
                        lost = [pid for pid, t in seen.items() if pid not in now and now_t - t >= 1.0]
                        for pid in set(seen) - now:
                            del seen[pid]
                        for pid in now:
                            seen.setdefault(pid, now_t)
                        if lost and c.proc.poll() is None and declare_dead(c.replica):
                            # The agent will restart it; tell the survivors now rather than after heartbeats.
                            say(f"replica {c.replica}: its worker exited; declared dead")
                            if standbys is not None and c.restarts < restarts and not interrupted:
                                # A ready standby job instead: the agent is ended before it restarts
                                # anything, and the standby's agent becomes the replica's. With none
                                # ready, the agent restarts its worker.
                                if take_standby(c, end_agent=True):
                                    first_seen[c.replica] = {}
                if running == 0 or (finished_at is not None and time.monotonic() - finished_at > finish_grace):
                    break
                if standbys is not None and finished_at is None:
                    standbys.reap()
                if coord.proc.poll() is not None:
                    raise _CoordinatorLost(f"it exited ({describe_exit(coord.proc.returncode)})")
                if link.silent_for() > lost_after:
                    raise _CoordinatorLost(
                        f"it stopped answering for more than {lost_after:g}s (frozen or unreachable)"
                        if link.error is None
                        else f"the connection failed ({link.error})"
                    )
                time.sleep(0.01)
            for c in children:
                if c.exit_code is None:  # hung replicas (or agents waiting on one): nobody will resume them
                    kill_tree(c.proc.pid)
                    c.proc.wait()
                    c.exit_code = c.proc.returncode
                    c.history.append("hung, killed at the end")
                    say(f"replica {c.replica} was hung; killed it")
        except _CoordinatorLost as exc:
            if interrupted and coord.proc.poll() is not None:
                pass  # Ctrl-C reached the coordinator too: an interruption, not a loss
            else:
                coordinator_lost = True
                say(
                    f"CoordinatorLostError: the coordinator (pid {coord.proc.pid}, {coord.addr}) is lost: {exc}. "
                    "No step can be agreed without it; ending the job's replicas. "
                    "HINT: restart the job from its last checkpoint."
                )
                # Running replicas notice on their own within the same bound and exit with their own
                # named error; give them that long, then end whatever is left (finally below). A
                # stopped (hung) replica never will: it is not waited for.
                deadline = time.monotonic() + lost_after + 1.0
                while time.monotonic() < deadline and any(
                    c.proc.poll() is None and not is_stopped(c.proc.pid) for c in children
                ):
                    time.sleep(0.02)
                return EXIT_COORDINATOR_LOST
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if standbys is not None:
            standbys.end()
        for c in children:
            if c.proc.poll() is None:
                kill_tree(c.proc.pid)
                c.proc.wait()
        if starter is not None:
            starter.close()
        if coordinator_lost or is_stopped(coord.proc.pid):
            # A frozen coordinator would never handle SIGTERM. Killed before the link is closed: the
            # kill resets the connection the link's thread is stuck on, so the thread ends now
            # instead of inside torch's store code while the interpreter exits (which aborts it).
            coord.proc.kill()
        if link is not None:
            link.close()
        coord.stop()
        shutil.rmtree(secret_dir, ignore_errors=True)
    ok = [c.replica for c in children if c.exit_code == 0]
    say("done: " + ", ".join(f"replica {c.replica}: {'; '.join(c.history)}" for c in children))
    return 0 if ok and not interrupted else 1


# ---------------------------------------------------------------------------- CLI


def _cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("lightning-recover run: give the command after --, e.g. -- python train.py")
    try:
        return supervise(
            command,
            args.replicas,
            heartbeat_timeout=args.heartbeat_timeout,
            inject=args.inject,
            restarts=args.restarts,
            host=args.host,
            nproc_per_replica=args.nproc_per_replica,
            standby=args.standby,
            fork=args.start == "fork",
            preload=[*DEFAULT_PRELOAD, *(m for m in args.preload.split(",") if m)],
        )
    except ValueError as exc:  # a bad option: say how to fix it, no traceback
        raise SystemExit(f"lightning-recover run: {exc}") from None


def _cmd_coordinator(args: argparse.Namespace) -> int:
    try:
        coordinator.serve(
            args.host,
            args.port,
            args.replicas,
            args.heartbeat_timeout,
            hang_timeout=args.hang_timeout,
            secret_file=args.secret_file,
            replica_size=args.replica_size,
        )
    except (ValueError, OSError, RecoverError) as exc:
        raise SystemExit(f"lightning-recover coordinator: {exc}") from None
    return 0


def add_subcommands(sub: Any) -> None:
    from lightning_recover.launch import torchrun

    replicas, seconds = coordinator_process.replica_count, coordinator_process.heartbeat_timeout_seconds
    p = sub.add_parser("run", help="run a script once per replica under a tolerant launcher")
    p.add_argument("--replicas", type=replicas, required=True)
    p.add_argument(
        "--nproc-per-replica",
        type=replicas,
        default=1,
        help="processes per replica (K > 1: the replica shards its model with FSDP2)",
    )
    p.add_argument("--inject", default=None, help="faults, e.g. kill:replica=2:step=5:phase=backward")
    p.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=1.0,
        help="seconds without heartbeat before a replica is declared dead (> 0.2)",
    )
    p.add_argument(
        "--restarts",
        type=coordinator_process.non_negative_int,
        default=0,
        help="restart a failed replica up to K times",
    )
    p.add_argument(
        "--standby",
        type=coordinator_process.non_negative_int,
        default=0,
        help="keep S warm standby processes that take a failed replica's place (each counts as a restart)",
    )
    p.add_argument(
        "--start",
        choices=("fork", "exec"),
        default="fork",
        help="fork: replicas, restarts and standbys are forked by a server that imported torch and Lightning "
        "once (when the command is `python script.py` or `python -m module`); exec: each is a new interpreter",
    )
    p.add_argument(
        "--preload",
        default="",
        help="more modules the fork server imports once for every process, comma-separated (e.g. transformers)",
    )
    p.add_argument("--host", default="127.0.0.1", help="coordinator bind address (only this one is bound)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("torchrun", help="one torchrun job per replica (restarts stay inside a replica)")
    p.add_argument("--replicas", type=replicas, required=True)
    p.add_argument("--nproc-per-replica", type=int, default=1)
    p.add_argument(
        "--max-restarts",
        type=coordinator_process.non_negative_int,
        default=0,
        help="torchrun restarts of a failed replica",
    )
    p.add_argument("--inject", default=None, help="faults, e.g. kill:replica=2:step=5:phase=backward")
    p.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=1.0,
        help="seconds without heartbeat before a replica is declared dead (> 0.2)",
    )
    p.add_argument(
        "--standby",
        type=coordinator_process.non_negative_int,
        default=0,
        help="keep S warm standby torchrun jobs that take a failed replica's place (each counts as a restart)",
    )
    p.add_argument("--host", default="127.0.0.1", help="coordinator bind address (only this one is bound)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=torchrun.cmd_torchrun)

    p = sub.add_parser("coordinator", help="run only the coordinator (multi-node jobs)")
    coordinator_process.add_arguments(p)
    p.set_defaults(func=_cmd_coordinator, check=lambda args, p=p: coordinator_process.check_arguments(p, args))
