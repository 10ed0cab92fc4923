"""Ranks and sizes as Lightning sees them under ``strategy="recover"``, shared by both strategies.

Lightning's convention is one rank per process, and both strategies (``Trainer`` and ``Fabric``) answer it
the same way, from the current generation. With ``K`` processes per replica (``replica_size``):

* ``global_rank`` = this replica's rank among the live replicas x K + this process's position in its
  replica (``inner``): 0 is process 0 of the lowest live replica, the only ``is_global_zero`` process;
* ``world_size`` = live replicas x K;
* ``local_rank`` = ``global_rank`` and ``node_rank`` = 0: the job is one Lightning "node" (how the
  ``Trainer``'s ``devices=replicas x K`` on one node is numbered).

These change when a replica fails or rejoins (the live ranks are renumbered). What stays the same across
failures is ``replica`` (the replica id, ``0 <= replica < replicas``, kept by a restarted replica) and the
inner position: use them for anything that must name the same process for the whole run.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from lightning_recover import env
from lightning_recover.protocol.replica import Replica


class ReplicaRanks:
    """Mixin for a Lightning ``ParallelStrategy`` that owns a ``protocol_replica`` (a ``Replica``, or None before setup)."""

    protocol_replica: Optional[Replica]
    parallel_devices: Optional[list[torch.device]]

    @property
    def num_replicas(self) -> int:
        """The replicas the job runs: ``devices // replica_size``, or MAX of ``replicas="MIN:MAX"``."""
        if env.REPLICAS in os.environ:
            return env.replica_range(os.environ[env.REPLICAS])[1]  # MAX: the ids 0..MAX-1
        devices = len(self.parallel_devices) if self.parallel_devices else 1
        sharding = getattr(self, "sharding", None)
        return devices // sharding.replica_size if sharding is not None else devices

    @property
    def root_device(self) -> torch.device:
        """This process's device: on GPUs, visible device ``replica x K + inner`` (modulo the count)."""
        devices = self.parallel_devices or [torch.device("cpu")]
        device = devices[0]
        if device.type == "cuda":
            # One GPU per process: process i of replica r uses visible device r*K + i (modulo the count).
            return torch.device("cuda", env.device_slot() % max(1, torch.cuda.device_count()))
        return device

    @property
    def _replica_size(self) -> int:
        sharding = getattr(self, "sharding", None)
        return sharding.replica_size if sharding is not None else 1

    @property
    def global_rank(self) -> int:
        """The live replica's rank x K + the inner position (renumbered when replicas fail or rejoin)."""
        if self.protocol_replica is None:
            return 0
        if not self.protocol_replica.joined:
            # A restarted replica before it rejoins has no live rank yet: its replica id stands in (stable,
            # in range); is_global_zero stays False until it is a member again.
            return self.protocol_replica.replica * self._replica_size + getattr(self.protocol_replica, "inner", 0)
        return self.protocol_replica.rank * self._replica_size + getattr(self.protocol_replica, "inner", 0)

    @property
    def local_rank(self) -> int:
        return self.global_rank  # one Lightning node: local and global ranks coincide

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        """Live replicas x K (renumbered when replicas fail or rejoin)."""
        replicas = (
            self.protocol_replica.size
            if self.protocol_replica is not None and self.protocol_replica.joined
            else self.num_replicas
        )
        return replicas * self._replica_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0 and (self.protocol_replica is None or self.protocol_replica.joined)

    @property
    def distributed_sampler_kwargs(self) -> Optional[dict[str, Any]]:
        return None  # microbatch ids, not a DistributedSampler, decide what each replica reads

    @property
    def replica(self) -> int:
        """This process's replica id (stable across generations, unlike ``global_rank``)."""
        return self.protocol_replica.replica if self.protocol_replica is not None else 0


def set_rank_zero(rank: int) -> None:
    """Point Lightning's ``rank_zero_only`` (all three copies of it) at this replica's current rank,
    so that the lowest live replica prints and logs, whichever that is now."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    # Lightning documents setting ``rank_zero_only.rank``; its typing of the decorator does not declare the attribute
    rank_zero_only.rank = utils_rank_zero_only.rank = fabric_rank_zero_only.rank = rank  # type: ignore[attr-defined]
