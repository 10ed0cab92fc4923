"""A sharded checkpoint written by every live replica: one DCP directory, each replica ~1/R of it.

What ``fabric.save`` does under ``RecoverStrategy(replica_size=K>1)``. The replicas hold identical
shards, so the items are split by size over the Q live replicas (deterministically, the same split
everywhere); replica q's K processes write part q with ``dcp.save`` over the replica's own process
group into one shared temporary directory. Once every part is reported written, the lowest live
replica merges the parts' metadata and commits the directory with one rename (``commit_parts``).
Who is live is agreed per inner position through the store, then intersected inside each replica
(``all_reduce(MIN)``), so every process of every replica sees the same set; the temporary name is
the lowest live replica's random token. A part lost with its replica means no commit and a new
round among the survivors; an error is raised on every replica. Never a partial directory.

A replica lost during the save is never waited for beyond the protocol's bounds: the store
exchanges return without a replica once the coordinator declared it dead (a killed process at
once, through the launcher or ``heartbeat_timeout``; a stuck one after ``hang_timeout``), and its
replica-mates end themselves (``ReplicaWorld``'s watchdog). The save forms no new generation: the
next step's reduce notices the death and the survivors recompute its microbatches as usual.
"""

from __future__ import annotations

import secrets
import sys

import torch
import torch.distributed as dist

from lightning_recover.checkpoint.dcp import sharded_state as dcp_state
from lightning_recover.protocol.replica import Replica


def save_over_live_replicas(
    protocol_replica: Replica, path: str, state: dict, *, num_replicas: int, replica_size: int, device: torch.device
) -> None:
    """Called by every process of every live replica; ``protocol_replica`` is the protocol's façade (exchange
    over live replicas, fire), the default process group is the replica's own."""

    stale: list[str] = []  # tokens of failed rounds: the next committer removes what is left of them
    while True:
        # An exchange returns each replica's process-0 value; the value is agreed inside the replica
        # first, so all K processes contribute the same one.
        mine = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
        dist.broadcast(mine, src=0)
        seen = protocol_replica.exchange(int(mine.item()))
        members = torch.tensor([int(r in seen) for r in range(num_replicas)], device=device)
        dist.all_reduce(members, op=dist.ReduceOp.MIN)  # inside this replica only
        live = [r for r in range(num_replicas) if members[r]]
        token = f"{seen[live[0]]:016x}"
        parts = dcp_state.part_count(state, len(live))
        q = live.index(protocol_replica.replica)
        error = None
        if q < parts:
            try:
                dcp_state.save_part(path, state, token, q, parts, base=q * replica_size)
            except Exception as exc:
                error = exc
        # Fault injection (phase "save"): this part is on disk but not reported; the other replicas
        # may still be writing theirs or already wait for the reports.
        protocol_replica.fire("save")
        failed_here = torch.tensor([int(error is not None)], device=device)
        dist.all_reduce(failed_here, op=dist.ReduceOp.MAX)
        reports = protocol_replica.exchange(("error" if failed_here.item() else "ok") if q < parts else None)
        if error is not None:
            raise error
        failed = sorted(r for r, s in reports.items() if s == "error")
        if failed:
            raise RuntimeError(
                f"replica {failed[0]} failed to write its part of the sharded checkpoint {path} (its own "
                "processes raised the cause)"
            )
        complete = torch.tensor([int(all(reports.get(r) == "ok" for r in live[:parts]))], device=device)
        dist.all_reduce(complete, op=dist.ReduceOp.MIN)
        # The committer is the lowest replica that took part in the reports (the same on every
        # process): live[0] when every part is in, else a survivor, so that a failed round's
        # temporary directory is removed even when live[0] is the replica that was lost.
        committer = min(reports)
        outcome = torch.tensor([0], device=device)  # committer: 1 committed, 2 failed
        if protocol_replica.replica == committer and protocol_replica.inner == 0:
            try:
                for old in stale:  # a committer lost after the reports left its round's directory
                    dcp_state.abandon_parts(path, old)
                if complete.item():
                    dcp_state.commit_parts(path, state, token, parts)
                    outcome[0] = 1
                else:
                    dcp_state.abandon_parts(path, token)
            except Exception as exc:
                outcome[0], error = 2, exc
        dist.broadcast(outcome, src=0)
        done = protocol_replica.exchange(int(outcome.item()) if protocol_replica.replica == committer else None)
        if error is not None:
            raise error
        result = done.get(committer)
        if result == 2:
            raise RuntimeError(f"replica {committer} failed to commit the sharded checkpoint {path}")
        if result == 1:
            return
        stale.append(token)
        lost = sorted(set(live) - set(done))
        if protocol_replica.replica == min(done) and protocol_replica.inner == 0:  # Replica.say stays silent while the
            # generation's lowest member is the one lost (the save does not form a new generation)
            print(
                f"[lightning-recover] replica(s) {lost} writing {path} were lost before the checkpoint was "
                "committed; writing it again over the survivors",
                file=sys.stderr,
                flush=True,
            )
