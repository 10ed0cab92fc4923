"""The inside of a sharded replica: its own K-process world, and the watchdog that ends it.

A replica of K processes shards its model with stock FSDP2 over a world of its own: each replica
*incarnation* gets a default process group over ``PrefixStore(f"rep{r}/inc{n}", coordinator)``
(rank = inner position, size = K) and a 1-D device mesh ``("shard",)``, or, with a tensor-parallel
degree tp > 1, a 2-D mesh ``("shard", "tp")`` of shape ``(K // tp, tp)``: row-major, so the tp
processes of one data position are consecutive inner ranks (position d = inner // tp). Never one
world of all R*K processes: ``new_group`` needs every process, so it cannot run after a death, and
a restarted process cannot join a fixed-size world. Nothing inside a replica talks to another replica; the
replicate dimension is the survivor groups of :class:`Membership` (one per inner position).

The replica is the failure unit. A process whose mate died is stuck in an intra-replica
collective (a SIGSTOPped mate only fails it at the gloo timeout), so each process runs a
watchdog: once the coordinator declares its replica incarnation dead, and the death is not a
clean leave at the end of the run, the process exits at once.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_recover.errors import CoordinatorLostError
from lightning_recover.protocol.membership import Membership

WATCH_INTERVAL = 0.05  # how often a process checks whether its replica was declared dead


def left_key(replica: int, incarnation: int) -> str:
    return f"left/{replica}/{incarnation}"


@dataclass
class ReplicaWorld:
    """The default process group and device mesh of one replica incarnation."""

    replica: int  # -1 / 0 until watch(): a standby's world belongs to no replica yet
    incarnation: int
    inner: int
    size: int
    mesh: Any
    tensor_parallel: int
    _membership: Membership
    _stop: threading.Event
    _store: Any = None

    @classmethod
    def start(
        cls, membership: Membership, size: int, inner: int, device_type: str = "cpu", tensor_parallel: int = 1
    ) -> ReplicaWorld:
        """The world of this replica incarnation, watched for the replica's death."""
        prefix = f"rep{membership.replica}/inc{membership.incarnation}"
        world = cls.build(membership, size, inner, prefix, device_type, tensor_parallel)
        world.watch()
        return world

    @classmethod
    def build(
        cls,
        membership: Membership,
        size: int,
        inner: int,
        prefix: str,
        device_type: str = "cpu",
        tensor_parallel: int = 1,
    ) -> ReplicaWorld:
        """The K-process group and mesh over the store keys under ``prefix``, not watched yet: a
        sharded standby builds its world before it knows which replica it will be."""
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized():
            raise RuntimeError(
                "a default process group already exists in this process; a sharded replica builds its own. "
                "HINT: do not call init_process_group yourself under strategy='recover' with replica_size>1."
            )
        backend = "nccl" if device_type == "cuda" else "gloo"
        # Keep the store object alive as long as the world: it is a Python dist.Store subclass, and once
        # it is garbage collected every later new_group over the default store (the 2-D mesh's
        # per-dimension groups) fails with "INTERNAL ASSERT FAILED ... Not implemented" (torch 2.13).
        store = membership.store.prefixed(prefix)
        dist.init_process_group(
            backend,
            store=store,
            rank=inner,
            world_size=size,
            timeout=datetime.timedelta(seconds=membership.collective_timeout),
        )
        tp = tensor_parallel
        if tp == 1:
            mesh = init_device_mesh(device_type, (size,), mesh_dim_names=("shard",))
        else:  # row-major: inner = d * tp + t, so mesh["tp"] is the tp consecutive ranks of position d
            mesh = init_device_mesh(device_type, (size // tp, tp), mesh_dim_names=("shard", "tp"))
        return cls(-1, 0, inner, size, mesh, tp, membership, threading.Event(), store)

    def watch(self) -> None:
        """From now on this world is replica ``membership.replica``'s current incarnation: exit at
        once when the coordinator declares it dead (a mate died or hung)."""
        self.replica, self.incarnation = self._membership.replica, self._membership.incarnation
        name = f"lr-watchdog-{self.replica}.{self.inner}"
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    @property
    def group(self) -> Any:
        return dist.group.WORLD

    def leave(self, together: bool = False) -> None:
        """A clean end of this process: say so before the replica is marked gone.

        ``together`` (the replica leaves on notice, every process at the same commit): first wait until every
        process of the replica got here. A process is otherwise free to end as soon as it applied the commit, and
        the replica's mark would reach a mate still reading that commit as the replica's death. The wait is
        bounded by the group's collective timeout; a mate that dies meanwhile ends it with an error, or this
        process through the watchdog."""
        if self._stop.is_set():
            return  # left already
        if together and dist.is_initialized():
            self._wait_for_mates()
        self._stop.set()
        try:
            self._membership.store.set(left_key(self.replica, self.incarnation), "1")
        except Exception:
            pass  # the coordinator is gone: nobody is left to misread the exit

    def _wait_for_mates(self) -> None:
        where = f"[lightning-recover] replica {self.replica} process {self.inner}"
        try:
            arrived = dist.barrier(group=self.group, async_op=True)
            if not arrived.is_completed():
                print(f"{where}: waits for the replica's other processes to leave with it", file=sys.stderr, flush=True)
            arrived.wait()
        except RuntimeError as exc:  # a mate ended first without leaving (its replica ends as a death)
            print(
                f"{where}: the replica's other processes did not all leave with it: {exc}", file=sys.stderr, flush=True
            )

    def _watch(self) -> None:
        store = self._membership.store.clone()
        while not self._stop.wait(WATCH_INTERVAL):
            try:
                if declared_dead(store, self.replica, self.incarnation):
                    print(
                        f"[lightning-recover] replica {self.replica} process {self.inner}: the replica was "
                        "declared dead (one of its processes died or hung); this process exits",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)
            except CoordinatorLostError:
                return  # the coordinator is gone: the heartbeat reports it to the main thread


def declared_dead(store: Any, replica: int, incarnation: int) -> bool:
    """True when ``replica``'s ``incarnation`` was declared dead and did not leave cleanly.

    Reads that never wait and never take a forged value: a death notice deleted or forged by a client
    without the secret counts as none (it used to end the watchdog for good), and a planted "left"
    key does not hide a real death (only a sealed one counts).
    """
    if store.deaths([replica])[replica] < incarnation:
        return False
    return store.get_genuine(left_key(replica, incarnation)) is None


def is_sharded(param: Any) -> bool:
    return hasattr(param, "to_local") and hasattr(param, "placements")
