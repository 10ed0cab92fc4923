"""The launcher's subcommands: ``lightning-recover run``, ``torchrun`` and ``coordinator`` (argument
parsing and dispatch; the work is in :mod:`~lightning_recover.launch.supervisor`,
:mod:`~lightning_recover.launch.torchrun` and :mod:`~lightning_recover.protocol.coordinator`)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lightning_recover.errors import RecoverError
from lightning_recover.launch import coordinator_process, torchrun
from lightning_recover.launch.control_plane_options import add_control_plane_arguments, control_plane_arguments
from lightning_recover.launch.elastic_commands import add_elastic_arguments, elastic_arguments, replica_range_option
from lightning_recover.launch.fork_server import DEFAULT_PRELOAD
from lightning_recover.launch.supervisor import supervise
from lightning_recover.launch.user_command import user_command
from lightning_recover.protocol import coordinator

#: Names that, given bare in a replica's command, mean "a Python interpreter".
BARE_PYTHON = ("python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}")


def own_interpreter(command: Sequence[str], say: Callable[[str], Any]) -> list[str]:
    """``command`` with a bare ``python`` replaced by this interpreter (``sys.executable``), said once.

    The launcher runs in the environment that has torch, Lightning and this package; the ``python`` first
    on PATH may be another one (the machine's own, when the virtual environment is not activated), where
    every replica would fail on its first import. A path (``/usr/bin/python3``, ``.venv/bin/python``) is
    left as given: naming the interpreter is how to run another one.

    Args:
        command: a replica's argv.
        say: prints the launcher's line (once, when the interpreter is replaced).

    Returns:
        The argv to start.
    """
    command = list(command)
    if not command or command[0] not in BARE_PYTHON:
        return command
    found = shutil.which(command[0])
    if found is not None and os.path.realpath(found) == os.path.realpath(sys.executable):
        return command  # already this interpreter: nothing to say
    on_path = f"the {command[0]!r} on PATH is {found}" if found else f"no {command[0]!r} is on PATH"
    say(
        f"{command[0]!r} in the command runs as this launcher's interpreter, {sys.executable} ({on_path}). "
        f"HINT: give an interpreter's path after -- to run another one"
    )
    command[0] = sys.executable
    return command


def _cmd_torchrun(args: argparse.Namespace) -> int:
    script = [a for a in args.command if a != "--"][:1]
    if script and re.fullmatch(r"python(\d+(\.\d+)?)?", os.path.basename(script[0])):  # not python_train.py
        raise SystemExit(
            f"lightning-recover torchrun: give the script after --, not an interpreter ({script[0]!r}): torchrun "
            f"runs it with this launcher's, {sys.executable}. HINT: -- train.py --lr 1e-3"
        )
    return torchrun.cmd_torchrun(args)


def _say(line: str) -> None:
    print(f"[lightning-recover] {line}", file=sys.stderr, flush=True)


def _cmd_run(args: argparse.Namespace) -> int:
    command = user_command(args.command, "lightning-recover run: give the command after --, e.g. -- python train.py")
    command = own_interpreter(command, _say)
    try:
        return supervise(
            command,
            heartbeat_timeout=args.heartbeat_timeout,
            inject=args.inject,
            restarts=args.restarts,
            host=args.host,
            nproc_per_replica=args.nproc_per_replica,
            standby=args.standby,
            fork=args.start == "fork",
            preload=[*DEFAULT_PRELOAD, *(m for m in args.preload.split(",") if m)],
            **control_plane_arguments(args),
            **elastic_arguments(args),
        )
    except (ValueError, RecoverError) as exc:  # a bad option: say how to fix it, no traceback
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
            status_address=args.status_address,
            event_log=args.event_log,
        )
    except (ValueError, OSError, RecoverError) as exc:
        raise SystemExit(f"lightning-recover coordinator: {exc}") from None
    return 0


#: The launchers' default heartbeat timeout: the same as etcd's shortest lease (its TTL is whole seconds, at least
#: 2), so both control planes detect a hung replica in the same time. Shorter ones declare healthy replicas dead
#: on a loaded host, where a heartbeat thread can wait about a second for a CPU while other processes import torch.
DEFAULT_LAUNCHER_HEARTBEAT_TIMEOUT = 2.0


def _add_fault_arguments(p: argparse.ArgumentParser, seconds: Any) -> None:
    """The fault-injection and liveness options ``run`` and ``torchrun`` share."""
    p.add_argument("--inject", default=None, help="faults, e.g. kill:replica=2:step=5:phase=backward")
    p.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=DEFAULT_LAUNCHER_HEARTBEAT_TIMEOUT,
        help="seconds without heartbeat before a replica is declared dead (> 0.2; default: "
        f"{DEFAULT_LAUNCHER_HEARTBEAT_TIMEOUT}). A replica that exits is declared at once whatever this is; "
        "this bounds the detection of a hung or frozen one",
    )


def _add_control_plane_arguments(p: argparse.ArgumentParser) -> None:
    """Where the job's control plane is, for ``run`` and ``torchrun``: the embedded coordinator or etcd."""
    p.add_argument("--host", default="127.0.0.1", help="coordinator bind address (only this one is bound)")
    add_control_plane_arguments(p)


def add_subcommands(sub: Any) -> None:
    seconds = coordinator_process.heartbeat_timeout_seconds
    p = sub.add_parser(
        "run",
        help="run a script once per replica under a tolerant launcher",
        description="Start a coordinator and one process per replica running COMMAND (a script using "
        "strategy='recover'). A replica that dies or hangs is dropped and its microbatches are recomputed by the "
        "survivors inside the same step; the survivors are never killed. Exit code 0 when a replica finished.",
        epilog="example: lightning-recover run --replicas 4 --inject kill:replica=2:step=5:phase=backward "
        "-- python train.py",
    )
    p.add_argument(
        "--replicas",
        type=replica_range_option,
        required=True,
        help="data-parallel replicas (the failure units): N, or MIN:MAX to start with MIN and admit up to MAX",
    )
    add_elastic_arguments(p)
    p.add_argument(
        "--nproc-per-replica",
        type=coordinator_process.replica_count,
        default=1,
        help="processes per replica (K > 1: the replica shards its model with FSDP2)",
    )
    _add_fault_arguments(p, seconds)
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
    _add_control_plane_arguments(p)
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after --: what each replica runs, e.g. python train.py (a bare python is the launcher's own "
        "interpreter, whatever python is first on PATH)",
    )
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "torchrun",
        help="one torchrun job per replica (restarts stay inside a replica)",
        description="Like run, but each replica is a torchrun job of its own (torch.distributed.run), so that "
        "torchrun's restarts touch only the failed replica's processes.",
        epilog="example: lightning-recover torchrun --replicas 2 --max-restarts 1 -- train.py --lr 1e-3",
    )
    p.add_argument(
        "--replicas",
        type=replica_range_option,
        required=True,
        help="data-parallel replicas (the failure units): N, or MIN:MAX (torchrun's --nnodes MIN:MAX convention)",
    )
    add_elastic_arguments(p)
    p.add_argument("--nproc-per-replica", type=int, default=1, help="processes per replica (K > 1: sharded with FSDP2)")
    p.add_argument(
        "--max-restarts",
        type=coordinator_process.non_negative_int,
        default=0,
        help="torchrun restarts of a failed replica",
    )
    _add_fault_arguments(p, seconds)
    p.add_argument(
        "--standby",
        type=coordinator_process.non_negative_int,
        default=0,
        help="keep S warm standby torchrun jobs that take a failed replica's place (each counts as a restart)",
    )
    _add_control_plane_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the script and its arguments")
    p.set_defaults(func=_cmd_torchrun)

    p = sub.add_parser("coordinator", help="run only the coordinator (multi-node jobs)")
    coordinator_process.add_arguments(p)
    p.set_defaults(func=_cmd_coordinator, check=lambda args, p=p: coordinator_process.check_arguments(p, args))
