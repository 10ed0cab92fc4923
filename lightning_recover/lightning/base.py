"""What the Fabric and the Trainer strategies share: options, launch, the replica, collectives.

Both strategies are thin adapters over :class:`~lightning_recover.protocol.replica.Replica`;
this mixin holds everything that does not depend on which Lightning base class they extend.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Optional

import torch
from lightning.fabric.strategies.launchers.launcher import _Launcher
from typing_extensions import override

from lightning_recover import env
from lightning_recover.lightning.environment import srun_probe_quiet
from lightning_recover.lightning.ranks import ReplicaRanks
from lightning_recover.observe.report import noted_checkpoint
from lightning_recover.protocol.exact import check_exact_layout
from lightning_recover.protocol.faults import check_plan
from lightning_recover.protocol.options import RecoverOptions
from lightning_recover.protocol.replica import Replica
from lightning_recover.protocol.step import StepStats


def build_options(microbatches: Optional[int], options: dict[str, Any], replica_size: int = 1) -> RecoverOptions:
    """``RecoverOptions`` from a strategy's keyword arguments, with a hint for a misspelt name."""
    try:
        built = RecoverOptions(microbatches=microbatches, **options)
    except TypeError as exc:
        names = ", ".join(f for f in RecoverOptions.__dataclass_fields__ if f != "microbatches")
        raise TypeError(f"{exc}. HINT: strategy='recover' takes microbatches and {names}.") from None
    check_exact_layout(built.exact, replica_size)  # refused before any process starts
    return built


def committed_stats(protocol_replica: Replica) -> StepStats:
    """What the step that just committed did (``run_step`` records it before its iterator ends)."""
    stats = protocol_replica.last_step
    if stats is None:
        raise RuntimeError("strategy='recover': a step committed without recording its statistics")
    return stats


class ReplicaLauncher(_Launcher):
    """Inside a replica: run the function. Otherwise: become the supervisor of N replicas."""

    def __init__(self, strategy: Any, command: Callable[[], Sequence[str]]) -> None:
        self._strategy = strategy
        self._command = command

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        if env.in_replica():
            with srun_probe_quiet():  # the Trainer's Slurm probe in fit (environment.py)
                return function(*args, **kwargs)
        from lightning_recover.control_plane.config import control_plane_of
        from lightning_recover.launch.supervisor import supervise

        opts = self._strategy.options
        sharding = getattr(self._strategy, "sharding", None)
        K = sharding.replica_size if sharding is not None else 1
        # Every user input is checked here, before any process starts (a ValueError with a HINT).
        if sharding is not None and K > 1:
            devices = len(self._strategy.parallel_devices or [None])
            sharding.validate(devices, opts.microbatches)
        opts.resolve_microbatches(self._strategy.num_replicas)
        check_plan(os.environ.get(env.INJECT), self._strategy.num_replicas, env.INJECT)
        control_plane = control_plane_of(opts)
        code = supervise(
            self._command(),
            self._strategy.num_replicas,
            heartbeat_timeout=opts.heartbeat_timeout,
            heartbeat_interval=opts.heartbeat_period(etcd=control_plane is not None),
            hang_timeout=opts.hang_timeout,
            restarts=opts.restarts,
            nproc_per_replica=K,
            standby=opts.standby,
            control_plane=control_plane,
            min_replicas=opts.replica_range()[0] if opts.replica_range() else None,
            notice_signal=opts.notice_signal,
            status_address=opts.status_address,
            event_log=opts.event_log,
        )
        # The supervisor never runs the training code itself: its job ends with the replicas'. Its objects
        # move to the collector's permanent generation first, so that the interpreter's exit does not spend
        # 1-3 s of CPU (2 cores, torch and Lightning imported) collecting a heap about to be discarded; the
        # script's finally blocks and atexit handlers still run.
        gc.freeze()
        raise SystemExit(code)

    def kill(self, signum: Any) -> None:
        pass  # the supervisor forwards signals to its replicas and never kills survivors


class RecoverStrategyBase(ReplicaRanks):
    """Mixin for a Lightning ``ParallelStrategy`` driven by one :class:`Replica` (``self.protocol_replica``)."""

    options: RecoverOptions
    protocol_replica: Optional[Replica]

    # ------------------------------------------------------------------ setup
    def _require_replica_process(self, how: str) -> None:
        if not env.in_replica():
            raise RuntimeError(f"strategy='recover' runs each replica in its own process. HINT: {how}")

    def _start_replica(
        self,
        params: Callable[[], list[torch.nn.Parameter]],
        get_state: Callable[[], dict],
        set_state: Callable[[dict], None],
        backend: str = "gloo",
    ) -> Replica:
        self.options.resolve_microbatches(self.num_replicas)
        sharding = getattr(self, "sharding", None)
        tp = sharding.tensor_parallel if sharding is not None else 1
        protocol_replica = self.protocol_replica = Replica.from_env(
            self.options, params, backend=backend, tensor_parallel=tp
        )
        protocol_replica.set_state_hooks(get_state, set_state)
        protocol_replica.start()
        return protocol_replica

    def _started_replica(self) -> Replica:
        """The replica, for a hook Lightning calls only after ``setup_environment`` started it."""
        if self.protocol_replica is None:
            raise RuntimeError(
                "strategy='recover': the replica is not started yet (setup_environment starts it); this hook ran "
                "before the strategy was set up"
            )
        return self.protocol_replica

    def _noted_checkpoint(self, path: Any) -> AbstractContextManager[None]:
        """Around a save to ``path``: its time and size on this replica's heartbeat (``noted_checkpoint``)."""
        if self.protocol_replica is None:
            return noted_checkpoint(None, -1, path)
        return noted_checkpoint(self.protocol_replica.membership.progress, self.protocol_replica.step, path)

    def _replica_mesh(self) -> Any:
        """The replica's K-process device mesh (sharded replicas only: the world is built when K > 1)."""
        world = self._started_replica().world
        if world is None:
            raise RuntimeError("strategy='recover': replica_size > 1 but the replica's K-process world is not built")
        return world.mesh

    # ------------------------------------------------------------------ collectives over live replicas
    def _group_ready(self) -> bool:
        """Whether collectives go to the live replicas (before setup, or while alone: local)."""
        return self.protocol_replica is not None

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Gather ``tensor`` from every live replica (through the store, not differentiable).

        Args:
            tensor: this replica's tensor; every replica passes one of the same shape.
            group, sync_grads: Lightning's arguments, unused (the group is always the live replicas).

        Returns:
            The tensors stacked in rank order (``tensor.unsqueeze(0)`` before the replica is started).
        """
        return self._started_replica().all_gather(tensor) if self._group_ready() else tensor.unsqueeze(0)

    def barrier(self, name: Optional[str] = None) -> None:
        """Wait until every live replica has reached this barrier (no wait before the replica is started).

        Args:
            name: Lightning's argument, unused.
        """
        if self._group_ready():
            self._started_replica().barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from one live replica to all of them.

        Args:
            obj: the object (only the source's is used).
            src: the source's current rank among the live replicas.

        Returns:
            The source's object (``obj`` itself before the replica is started).
        """
        return self._started_replica().broadcast(obj, src) if self._group_ready() else obj

    def _elect_writer(self) -> bool:
        """The checkpoint writer is the lowest replica alive *now*, agreed through the store, so a
        checkpoint is neither lost (the leader died unnoticed) nor written twice."""
        return self.protocol_replica is None or self.protocol_replica.elect_writer()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy="recover"`` as this class in Lightning's ``strategy_registry`` (once)."""
        if "recover" not in strategy_registry:
            strategy_registry.register(
                "recover", cls, description="fault-tolerant data parallel with in-step recovery (lightning-recover)"
            )
