"""The tolerant local launcher for sharded replicas: K processes per replica, the replica fails whole.

Like :func:`~lightning_recover.launch.supervisor.supervise`, survivors are never touched. What
changes with K processes per replica: when one process of replica r exits with an error, or the
coordinator declares r dead (a process stopped heartbeating: hung), the launcher tells the
coordinator and SIGKILLs the other processes of r by pid — they are stuck in intra-replica
collectives and would only fail at the gloo timeout. A replica succeeded when all K exited 0.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_recover import env
from lightning_recover.launch.fork_server import Process, ProcessStarter
from lightning_recover.launch.process_tree import describe_exit, is_stopped, kill_tree
from lightning_recover.launch.standby_pool import StandbyPool
from lightning_recover.protocol.messages import Sealer, mark_dead, read_death
from lightning_recover.protocol.standby import assign as assign_standby
from lightning_recover.protocol.standby import is_ready as standby_is_ready


@dataclass
class _Replica:
    replica: int
    procs: list[Process]
    codes: dict[int, int] = field(default_factory=dict)  # inner -> exit code
    failed: bool = False
    history: list[str] = field(default_factory=list)
    restarts: int = 0
    first_incarnation: int = 1  # the scan ignores deaths of older incarnations (before a restart bumps it)

    def running(self) -> list[Process]:
        return [p for i, p in enumerate(self.procs) if i not in self.codes]

    @property
    def done(self) -> bool:
        return len(self.codes) == len(self.procs)

    @property
    def ok(self) -> bool:
        return self.done and not self.failed and all(c == 0 for c in self.codes.values())


def supervise_sharded(
    argv: Callable[[int], Sequence[str]],
    replicas: int,
    nproc: int,
    store: Any,
    sealer: Sealer,
    child_env: dict[str, str],
    say: Callable[[str], Any],
    finish_grace: float,
    starter: ProcessStarter,
    restarts: int = 0,
    standby: int = 0,
) -> int:
    """Run ``nproc`` processes of ``argv(r)`` per replica; end a replica whole when one fails, and
    start it again (all ``nproc`` processes, a new incarnation that rejoins) up to ``restarts`` times.
    With ``standby`` = S, S standbys of ``nproc`` processes each wait; a ready one takes a failed
    replica's place instead of a restart (see :mod:`~lightning_recover.protocol.standby`). Processes
    are started by ``starter`` (forked by the job's fork server, or new processes)."""

    def spawn(r: int, i: int) -> Process:
        process_env = dict(child_env, **{env.REPLICA: str(r), env.INNER: str(i), env.REPLICA_SIZE: str(nproc)})
        return starter.start(argv(r), process_env, wait=True)

    def spawn_standby(s: int) -> Optional[list[Process]]:
        extra = {env.STANDBY: str(s), env.REPLICA_SIZE: str(nproc)}
        procs: list[Process] = []
        for i in range(nproc):
            process_env = dict(child_env, **extra, **{env.INNER: str(i)})
            # None: the fork server is still importing; the first process decides, the others wait
            proc = starter.start(argv(0), process_env, wait=bool(procs))
            if proc is None:
                return None  # start this standby later
            procs.append(proc)
        return procs

    group = [_Replica(r, [spawn(r, i) for i in range(nproc)]) for r in range(replicas)]
    standbys = StandbyPool(standby, spawn_standby, standby + replicas * restarts, say) if standby else None
    if standbys is not None:
        standbys.fill()
    say(
        f"started {replicas} replicas x {nproc} processes"
        + (f" and {standby} standby x {nproc}" if standby else "")
        + f": {' '.join(argv(0))}"
    )
    interrupted = False
    finished_at: float | None = None
    next_scan = 0.0

    def end_replica(rep: _Replica, why: str) -> None:
        rep.failed = True
        try:
            mark_dead(store, sealer, rep.replica)
        except Exception:
            pass  # the coordinator is gone; the replicas notice on their own
        pids = [p.pid for p in rep.running() if p.poll() is None]
        for p in rep.running():
            kill_tree(p.pid)  # SIGKILL ends a SIGSTOPped process too
        for i, p in enumerate(rep.procs):
            if i not in rep.codes:
                p.wait()
                rep.codes[i] = p.returncode
        rep.history.append(why + (f"; killed its other processes {pids}" if pids else ""))
        say(f"replica {rep.replica} failed ({why}); ended its processes {pids}")
        if rep.restarts < restarts and not interrupted:
            restart(rep)

    def restart(rep: _Replica) -> None:
        # The old incarnation is declared dead by now (end_replica): the new processes' incarnation
        # is the next one, and they rejoin with state from the live replicas.
        try:
            previous = int(store.add(f"inc/{rep.replica}", 0))
        except Exception:
            return  # the coordinator is gone: nothing to rejoin
        rep.restarts += 1
        rep.first_incarnation = previous + 1
        taken = (
            standbys.take(lambda ids: [s for s in ids if standby_is_ready(store, sealer, s, nproc)])
            if standbys
            else None
        )
        if taken is not None:
            s, rep.procs = taken
            assign_standby(store, sealer, s, rep.replica)
            rep.history.append(f"standby {s} took its place")
            say(
                f"replica {rep.replica}: standby {s} (pids {[p.pid for p in rep.procs]}) takes its place "
                f"({rep.restarts}/{restarts})"
            )
            standbys.fill()  # a new standby starts in the background
        else:
            say(f"restarting replica {rep.replica} ({rep.restarts}/{restarts}): {nproc} new processes")
            rep.procs = [spawn(rep.replica, i) for i in range(nproc)]
        rep.codes, rep.failed = {}, False

    def _forward(signum: int, _frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        for rep in group:
            for p in rep.running():
                p.send_signal(signum)

    old = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            for rep in group:
                if rep.done:
                    continue
                for i, p in enumerate(rep.procs):
                    if i in rep.codes:
                        continue
                    code = p.poll()
                    if code is None:
                        continue
                    rep.codes[i] = code
                    if code != 0 and not rep.failed:
                        end_replica(rep, f"process {i} (pid {p.pid}) {describe_exit(code)}")
                        break
                if rep.ok:
                    finished_at = finished_at or time.monotonic()
                    rep.history.append(f"all {nproc} processes finished")
            if time.monotonic() >= next_scan:
                # A hung process: the coordinator declared its replica dead; end the rest of it.
                next_scan = time.monotonic() + 0.05
                for rep in group:
                    if rep.done or rep.failed:
                        continue
                    try:
                        inc = int(store.add(f"inc/{rep.replica}", 0))
                        dead = (
                            inc >= rep.first_incarnation
                            and read_death(sealer, rep.replica, store.get(f"dead/{rep.replica}")) >= inc
                        )
                        left = dead and store.check([f"left/{rep.replica}/{inc}"])
                    except Exception:
                        continue
                    if dead and not left:
                        end_replica(rep, "declared dead by the coordinator (a process hung or stopped heartbeating)")
            running = sum(1 for rep in group for p in rep.running() if not is_stopped(p.pid))
            if running == 0 or (finished_at is not None and time.monotonic() - finished_at > finish_grace):
                break
            if standbys is not None and finished_at is None:
                standbys.reap()
            time.sleep(0.01)
        for rep in group:
            if not rep.done:
                end_replica(rep, "hung at the end of the run")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if standbys is not None:
            standbys.end()
        for rep in group:
            for p in rep.procs:
                if p.poll() is None:
                    kill_tree(p.pid)
                    p.wait()
    say(
        "done: "
        + ", ".join(
            f"replica {rep.replica}: {'; '.join(rep.history) or 'exit codes ' + str(rep.codes)}" for rep in group
        )
    )
    return 0 if any(rep.ok for rep in group) and not interrupted else 1
