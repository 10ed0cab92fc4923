"""The tolerant local launcher: one process per replica, survivors are never killed.

Lightning's stock launcher kills every rank when one dies, and torchrun's agent restarts its
whole group. This supervisor instead starts the coordinator and one process per replica, tells
the coordinator at once when a replica process exits (so survivors need not wait for heartbeats),
optionally restarts it, and when the survivors are done ends what is left (a hung replica stays
SIGSTOPped until then). Its exit code is 0 when at least one replica finished successfully.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_recover import env
from lightning_recover.launch import coordinator_process
from lightning_recover.protocol import coordinator
from lightning_recover.protocol.faults import parse_faults
from lightning_recover.protocol.messages import connect, mark_dead


@dataclass
class _Child:
    replica: int
    proc: subprocess.Popen
    restarts: int = 0
    exit_code: int | None = None
    history: list[str] = field(default_factory=list)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (a torchrun agent and its workers), by pid."""
    children = _children_map()
    stack, order = [pid], []
    while stack:
        p = stack.pop()
        order.append(p)
        stack.extend(children.get(p, []))
    for p in order:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def supervise(
    command: Sequence[str] | Callable[[int], Sequence[str]],
    replicas: int,
    *,
    heartbeat_timeout: float = 1.0,
    inject: str | None = None,
    restarts: int = 0,
    host: str = "127.0.0.1",
    extra_env: dict[str, str] | None = None,
    on_event: Callable[[str], Any] | None = None,
    finish_grace: float = 30.0,
    watch_workers: bool = False,
    nproc_per_replica: int = 1,
) -> int:
    """Run ``command`` once per replica under a fresh coordinator; return the job's exit code.

    ``command`` is the argv of every replica, or a function of the replica id returning it (the
    torchrun mode wraps each replica in its own torchrun agent). Once one replica has finished
    successfully the job is done: replicas still running ``finish_grace`` seconds later (hung, or
    under an agent that waits for a hung worker) are killed. With ``watch_workers`` (torchrun mode:
    each child is an agent that restarts its worker itself), the death of a child's worker process
    is declared to the coordinator at once, as the exit of a direct child is.

    ``nproc_per_replica`` = K > 1: sharded replicas. Locally the launcher starts K processes per
    replica (see :mod:`~lightning_recover.launch.sharded`); in torchrun mode each agent starts them.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if heartbeat_timeout <= 0:
        raise ValueError(f"heartbeat_timeout must be > 0 seconds, got {heartbeat_timeout}")
    parse_faults(inject)  # validate before starting anything
    if nproc_per_replica < 1:
        raise ValueError(f"nproc_per_replica must be >= 1, got {nproc_per_replica}")
    if nproc_per_replica > 1 and restarts:
        raise ValueError(
            f"restarts={restarts} with {nproc_per_replica} processes per replica: rejoining a sharded replica is not "
            "supported yet. HINT: use restarts=0 (the survivors finish the run without the failed replica)."
        )
    say = on_event or (lambda line: print(f"[lightning-recover] {line}", file=sys.stderr, flush=True))
    coord = coordinator_process.start(replicas, heartbeat_timeout, host=host, replica_size=nproc_per_replica)
    store = connect(coord.addr)
    child_env = dict(os.environ, **(extra_env or {}))
    child_env[env.COORDINATOR] = coord.addr
    child_env[env.REPLICAS] = str(replicas)
    child_env.setdefault(env.OMP_NUM_THREADS, "1")  # spinning OpenMP threads make gloo 20x slower on small machines
    if inject:
        child_env[env.INJECT] = inject

    argv = command if callable(command) else (lambda r: command)
    if nproc_per_replica > 1:
        child_env[env.REPLICA_SIZE] = str(nproc_per_replica)
        if not watch_workers:
            from lightning_recover.launch.sharded import supervise_sharded

            say(f"coordinator at {coord.addr} (pid {coord.proc.pid})")
            try:
                return supervise_sharded(argv, replicas, nproc_per_replica, store, child_env, say, finish_grace)
            finally:
                coord.stop()

    def spawn(r: int) -> subprocess.Popen:
        return subprocess.Popen(list(argv(r)), env=dict(child_env, **{env.REPLICA: str(r)}))

    children = [_Child(r, spawn(r)) for r in range(replicas)]
    say(f"coordinator at {coord.addr} (pid {coord.proc.pid}); started {replicas} replicas: {' '.join(argv(0))}")
    finished_at: float | None = None
    first_seen: dict[int, dict[int, float]] = {}  # replica -> {worker pid under its agent: first seen}
    next_scan = 0.0
    interrupted = False
    coordinator_gone = False

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
                    running += not _stopped(c.proc.pid)
                    continue
                c.history.append(_describe(code))
                if code != 0:
                    try:
                        mark_dead(store, c.replica)
                    except Exception:
                        pass  # the coordinator itself is gone; replicas notice on their own
                    say(f"replica {c.replica} failed ({_describe(code)})")
                    if c.restarts < restarts and not interrupted:
                        c.restarts += 1
                        say(f"restarting replica {c.replica} ({c.restarts}/{restarts})")
                        c.proc = spawn(c.replica)
                        running += 1
                        continue
                c.exit_code = code
                if code == 0 and finished_at is None:
                    finished_at = time.monotonic()
            if watch_workers and time.monotonic() >= next_scan:
                next_scan = time.monotonic() + 0.05
                tree, now_t = _children_map(), time.monotonic()
                for c in children:
                    seen = first_seen.setdefault(c.replica, {})
                    now = set(tree.get(c.proc.pid, [])) if c.exit_code is None else set()
                    # Only a worker that lived >= 1 s counts: no transient helper process of the agent.
                    lost = [pid for pid, t in seen.items() if pid not in now and now_t - t >= 1.0]
                    for pid in set(seen) - now:
                        del seen[pid]
                    for pid in now:
                        seen.setdefault(pid, now_t)
                    if lost and c.proc.poll() is None:
                        # The agent will restart it; tell the survivors now rather than after heartbeats.
                        try:
                            if mark_dead(store, c.replica):
                                say(f"replica {c.replica}: its worker exited; declared dead")
                        except Exception:
                            pass
            if running == 0 or (finished_at is not None and time.monotonic() - finished_at > finish_grace):
                break
            if coord.proc.poll() is not None and not interrupted and not coordinator_gone:
                coordinator_gone = True
                say(f"the coordinator exited ({_describe(coord.proc.returncode)}); replicas will stop")
            time.sleep(0.01)
        for c in children:
            if c.exit_code is None:  # hung replicas (or agents waiting on one): nobody will resume them
                _kill_tree(c.proc.pid)
                c.proc.wait()
                c.exit_code = c.proc.returncode
                c.history.append("hung, killed at the end")
                say(f"replica {c.replica} was hung; killed it")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for c in children:
            if c.proc.poll() is None:
                _kill_tree(c.proc.pid)
                c.proc.wait()
        coord.stop()
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
    return supervise(command, args.replicas, heartbeat_timeout=args.heartbeat_timeout, inject=args.inject,
                     restarts=args.restarts, host=args.host, nproc_per_replica=args.nproc_per_replica)


def _cmd_coordinator(args: argparse.Namespace) -> int:
    coordinator.serve(args.host, args.port, args.replicas, args.heartbeat_timeout, replica_size=args.replica_size)
    return 0


def add_subcommands(sub: Any) -> None:
    from lightning_recover.launch import torchrun

    p = sub.add_parser("run", help="run a script once per replica under a tolerant launcher")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--nproc-per-replica", type=int, default=1,
                   help="processes per replica (K > 1: the replica shards its model with FSDP2)")
    p.add_argument("--inject", default=None, help="faults, e.g. kill:replica=2:step=5:phase=backward")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--restarts", type=int, default=0, help="restart a failed replica up to K times")
    p.add_argument("--host", default="127.0.0.1", help="coordinator bind address")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("torchrun", help="one torchrun job per replica (restarts stay inside a replica)")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--nproc-per-replica", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of a failed replica")
    p.add_argument("--inject", default=None, help="faults, e.g. kill:replica=2:step=5:phase=backward")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--host", default="127.0.0.1", help="coordinator bind address")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=torchrun.cmd_torchrun)

    p = sub.add_parser("coordinator", help="run only the coordinator (multi-node jobs)")
    coordinator_process.add_arguments(p)
    p.set_defaults(func=_cmd_coordinator)
