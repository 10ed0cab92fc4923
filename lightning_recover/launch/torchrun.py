"""One torchrun job per replica: torchrun's restarts stay inside one replica.

torchrun's agent restarts its whole local group when one worker dies (measured); running one agent
per replica under the tolerant launcher keeps that restart local to the failed replica.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_recover.errors import RecoverError
from lightning_recover.launch.control_plane_options import control_plane_arguments
from lightning_recover.launch.elastic_commands import elastic_arguments
from lightning_recover.launch.supervisor import supervise
from lightning_recover.launch.user_command import user_command

# The job's fork server imports what torchrun's agent needs, not Lightning (the workers are new interpreters that
# import it themselves): ready no later than a new agent would be. A warm server that also imported Lightning fits.
AGENT_PRELOAD = ("torch", "torch.distributed")


def torchrun_command(script: Sequence[str], nproc_per_replica: int = 1, max_restarts: int = 0) -> list[str]:
    """One torchrun agent per replica: its restarts touch only that replica's workers."""
    if nproc_per_replica < 1:
        raise ValueError(f"--nproc-per-replica must be >= 1, got {nproc_per_replica}")
    return [
        sys.executable,
        "-m",
        "lightning_recover.launch.torchrun_agent",  # torch.distributed.run, tidier and quieter
        "--standalone",
        f"--nproc-per-node={nproc_per_replica}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        *script,
    ]


def cmd_torchrun(args: argparse.Namespace) -> int:
    script = user_command(
        args.command, "lightning-recover torchrun: give the script after --, e.g. -- train.py --lr 1e-3"
    )
    try:
        command = torchrun_command(script, args.nproc_per_replica, args.max_restarts)
        # Each worker's torchrun RANK is its position inside the replica (env.inner_rank).
        return supervise(
            command,
            heartbeat_timeout=args.heartbeat_timeout,
            inject=args.inject,
            host=args.host,
            watch_workers=True,
            nproc_per_replica=args.nproc_per_replica,
            # standby jobs: a takeover replaces one of a replica's agent restarts, at most --max-restarts
            standby=args.standby,
            restarts=args.max_restarts if args.standby else 0,
            preload=AGENT_PRELOAD,
            **control_plane_arguments(args),
            **elastic_arguments(args),
        )
    except (ValueError, RecoverError) as exc:  # a bad option: say how to fix it, no traceback
        raise SystemExit(f"lightning-recover torchrun: {exc}") from None
