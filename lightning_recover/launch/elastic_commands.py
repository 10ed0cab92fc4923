"""The launcher's options for preemption notices and growth, and ``lightning-recover leave``.

``--replicas MIN:MAX`` (torchrun's ``--nnodes MIN:MAX``), ``--add-replicas N``, ``--notice-signal SIG`` and
``--restart-left`` on ``run`` and ``torchrun``; ``leave --replica N`` asks a running replica to leave at its next
step boundary as its notice signal would (docs/howto.md, "Spot and preemptible nodes", "Growing a job").
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lightning_recover import env
from lightning_recover.control_plane import config
from lightning_recover.control_plane.connect import connect
from lightning_recover.errors import RecoverError
from lightning_recover.launch.control_plane_options import add_job_arguments, job_arguments
from lightning_recover.protocol.messages import JobSecret, Sealer
from lightning_recover.protocol.notice import EXIT_LEFT_ON_NOTICE, parse_signal, request_leave


def replica_range_option(text: str) -> tuple[int, int]:
    """argparse type of ``--replicas``: ``N`` or ``MIN:MAX``, as ``(MIN, MAX)``.

    Raises:
        argparse.ArgumentTypeError: with the option's name and a HINT.
    """
    try:
        return env.replica_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--{exc}") from None


def notice_signal_option(text: str) -> str:
    """argparse type of ``--notice-signal``: a catchable signal's name (SIGTERM, SIGUSR1, ...)."""
    try:
        return parse_signal(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    """``--add-replicas``, ``--notice-signal`` and ``--restart-left`` (``run`` and ``torchrun``)."""
    p.add_argument(
        "--add-replicas",
        type=int,
        default=0,
        metavar="N",
        help="join N newcomers to the running job named by --job (etcd): the control plane assigns their ids; "
        "they are admitted at a commit with live state while fewer than MAX (--replicas MIN:MAX) are live",
    )
    p.add_argument(
        "--notice-signal",
        type=notice_signal_option,
        default=None,
        help=f"the preemption notice (default SIGTERM, ${env.NOTICE_SIGNAL}; Slurm's --signal=USR1@60: SIGUSR1): a "
        f"replica that gets it finishes its step, commits it and leaves (exit code {EXIT_LEFT_ON_NOTICE}); the "
        "launcher forwards it (and SIGTERM) to every replica",
    )
    p.add_argument(
        "--restart-left",
        action="store_true",
        help="restart a replica that left on notice (within --restarts); default: it stays gone",
    )


def elastic_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``replicas=`` (MAX), ``min_replicas=`` and the notice and growth options of :func:`supervise`."""
    least, most = args.replicas
    return {
        "replicas": most,
        "min_replicas": least,
        "add_replicas": args.add_replicas,
        "notice_signal": args.notice_signal,
        "restart_left": args.restart_left,
    }


def _job_store(args: argparse.Namespace) -> tuple[Any, Sealer]:
    """The raw store and sealer of the job ``leave`` names: etcd (--control-plane, --job) or an embedded
    coordinator (--coordinator HOST:PORT); the job's --secret-file either way (etcd never holds it)."""
    settings, secret_file = job_arguments(args)
    if settings is not None:
        if not settings.job or not secret_file:
            raise ValueError(
                f"leave: name the job and its secret. HINT: --job NAME and --secret-file FILE (or {env.JOB} and "
                f"{env.SECRET_FILE}), as its launchers were given"
            )
        store = config.with_job(settings, args.job).store()
        if not store.check(["meta/replicas"]):
            raise ValueError(f"leave: no job {settings.job!r} on {settings.url}. HINT: check --job")
        return store, Sealer(JobSecret.from_file(secret_file))
    addr = args.coordinator or os.environ.get(env.COORDINATOR)
    if not addr or not secret_file:
        raise ValueError(
            "leave: name the job's control plane. HINT: --control-plane etcd://... --job NAME, or --coordinator "
            f"HOST:PORT --secret-file FILE (or {env.COORDINATOR} and {env.SECRET_FILE})"
        )
    return connect(addr, timeout=10.0), Sealer(JobSecret.from_file(secret_file))


def _cmd_leave(args: argparse.Namespace) -> int:
    try:
        store, sealer = _job_store(args)
        incarnation = request_leave(store, sealer, args.replica)
    except (ValueError, OSError, RecoverError) as exc:
        raise SystemExit(f"lightning-recover {exc}") from None
    print(
        f"[lightning-recover] asked replica {args.replica} (incarnation {incarnation}) to leave at its next step "
        "boundary",
        file=sys.stderr,
        flush=True,
    )
    return 0


def add_leave_subcommand(sub: Any, help_line: str) -> None:
    """``lightning-recover leave`` (``help_line``: its line in ``lightning-recover --help``)."""
    p = sub.add_parser(
        "leave",
        help=help_line,
        description="The replica finishes the step it is in, commits it with the others and leaves: nothing is "
        f"recomputed; it exits with code {EXIT_LEFT_ON_NOTICE} and its launcher does not restart it.",
        epilog="example: lightning-recover leave --control-plane etcd://10.0.0.5:2379 --job train-7 --replica 3",
    )
    p.add_argument("--replica", type=int, required=True, help="the replica id to leave")
    p.add_argument("--coordinator", default=None, help=f"embedded: HOST:PORT of the coordinator (${env.COORDINATOR})")
    add_job_arguments(p)
    p.set_defaults(func=_cmd_leave)
