"""Lightning's cluster environment under ``strategy="recover"``: the job's own, whatever scheduler runs it.

Given no cluster environment, Lightning detects one from the process's variables (TorchElastic, then Slurm,
LSF, MPI). Under Slurm that picks ``SLURMEnvironment``, which does not fit a recover job: its detection
warns "The `srun` command is available on your system but is not used" in every process that was not
started by srun (the supervisor, and every replica of ``lightning-recover run`` on a machine where Slurm is
installed); inside srun it takes ranks from ``SLURM_PROCID`` and, under the Trainer, installs a SIGUSR1
handler that saves a checkpoint in every process and requeues the job, where a recover replica takes the
signal as its notice to leave. The strategies therefore bring this environment: the launcher (ours, or
``lightning-recover slurm`` under Slurm) creates the processes, and the ranks are the strategies' own
(``ranks.py``: the live replicas, renumbered on failures), so Lightning never consults the others.

One call remains: the Trainer probes ``SLURMEnvironment.detect()`` in every ``fit`` for a checkpoint of its
own Slurm requeue, whatever the cluster environment, and the probe warns as the detection does. A replica
runs its function under :func:`srun_probe_quiet`, which drops that one message: the process was started by
a recover launcher, not left without srun.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from lightning_recover import env

log = logging.getLogger(__name__)


class RecoverEnvironment(ClusterEnvironment):
    """The cluster environment of a recover job: processes started by its launcher, one per replica process.

    The ranks it reports are the stable ones (replica id x K + position); the strategies answer Lightning's
    rank questions themselves from the live replicas, and never ask this object.
    """

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return env.in_replica()  # inside a replica: its launcher started it; outside: the strategy launches

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get(env.COORDINATOR, "127.0.0.1:0").rsplit(":", 1)[0]

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ.get(env.COORDINATOR, "127.0.0.1:0").rsplit(":", 1)[1])

    @staticmethod
    @override
    def detect() -> bool:
        return env.in_replica()

    @override
    def world_size(self) -> int:
        replicas = os.environ.get(env.REPLICAS, "1").split(":")[-1]  # N, or MAX of MIN:MAX
        return int(replicas) * env.replica_size()

    @override
    def set_world_size(self, size: int) -> None:
        log.debug("RecoverEnvironment.set_world_size(%s) ignored: the launcher sets the replicas", size)

    @override
    def global_rank(self) -> int:
        return int(os.environ.get(env.REPLICA, "0")) * env.replica_size() + env.inner_rank()

    @override
    def set_global_rank(self, rank: int) -> None:
        log.debug("RecoverEnvironment.set_global_rank(%s) ignored: ranks follow the live replicas", rank)

    @override
    def local_rank(self) -> int:
        return self.global_rank()  # one Lightning node, as the strategies number it (ranks.py)

    @override
    def node_rank(self) -> int:
        return 0


#: The start of the warning Lightning's Slurm detection gives where ``srun`` is installed but did not start
#: this process.
SRUN_HINT = "The `srun` command is available on your system but is not used"


@contextmanager
def srun_probe_quiet() -> Iterator[None]:
    """Drop Lightning's "srun is available but not used" warning inside the block (a replica's run)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SRUN_HINT, category=PossibleUserWarning)
        yield
