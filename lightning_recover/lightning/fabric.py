"""``Fabric(strategy="recover")``: data-parallel training that survives dead and hung replicas.

Usage (one DataLoader batch is one microbatch; one optimizer step is ``M`` microbatches)::

    fabric = L.Fabric(strategy=RecoverStrategy(microbatches=8), devices=4, accelerator="cpu")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for step in fabric.strategy.steps(loader, max_steps=100):
        for batch in step:                 # this replica's quota, then any lost microbatches
            fabric.backward(loss_fn(model(batch)))
        optimizer.step()
        optimizer.zero_grad()

When ``for batch in step`` ends, the step has committed: every live replica holds the same
averaged gradient of all ``M`` microbatches, whatever died meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_recover.data import MicrobatchSource
from lightning_recover.lightning.base import RecoverStrategyBase, ReplicaLauncher, build_options, committed_stats
from lightning_recover.lightning.environment import RecoverEnvironment
from lightning_recover.lightning.ranks import set_rank_zero
from lightning_recover.lightning.sharding_config import (
    ShardingConfig,
    load_local_module_state,
    local_shards,
    optimizer_state_from_local,
)
from lightning_recover.lightning.step_logs import log_recovery_metrics
from lightning_recover.protocol.exact import checkpoint_entries, restore_checkpoint_entries
from lightning_recover.protocol.replica import Replica
from lightning_recover.protocol.step import StepStats


class Step:
    """One optimizer step: iterate it to get this replica's microbatches (already on device).

    :meth:`RecoverStrategy.steps` makes them; ``index`` is the step's index and ``committed`` turns True when the
    iteration ends, that is when every live replica holds the step's averaged gradient.

    Args:
        strategy: the strategy whose replica runs the step.
        source: the microbatches of the DataLoader, by step and microbatch id.
        index: the step's index.
        loggers: where the committed step's ``recover/*`` metrics are logged (by the lowest live replica).
    """

    def __init__(
        self, strategy: RecoverStrategy, source: MicrobatchSource, index: int, loggers: Sequence[Any] = ()
    ) -> None:
        self._strategy = strategy
        self._source = source
        self.index = index
        self.committed = False
        self._loggers = loggers

    def __iter__(self) -> Iterator[Any]:
        protocol_replica = self._strategy._started_replica()
        for j in protocol_replica.run_step(self.index):
            protocol_replica.seed_microbatch(self.index, j)
            yield self._strategy.batch_to_device(self._source.batch(self.index, j))
        self.committed = True
        set_rank_zero(self._strategy.global_rank)  # the live replicas may have been renumbered in this step
        log_recovery_metrics(
            self._loggers, committed_stats(protocol_replica), self.index, self._strategy.is_global_zero
        )

    @property
    def stats(self) -> Optional[StepStats]:
        """What happened in this step (generation, live replicas, recoveries, mean loss)."""
        return self._strategy._started_replica().last_step

    @property
    def loss(self) -> Optional[float]:
        """Mean loss over the step's M microbatches (those passed to ``fabric.backward``)."""
        return committed_stats(self._strategy._started_replica()).loss if self.committed else None


class RecoverStrategy(RecoverStrategyBase, ParallelStrategy):
    """Fault-tolerant data parallelism with in-step recovery.

    Every keyword but the Lightning plugins is a :class:`RecoverOptions` field, validated when the strategy is
    built (``ValueError`` for a bad value, ``TypeError`` with the valid names for an unknown one).

    Args:
        microbatches: ``M``, global microbatches per optimizer step (default: the replica count).
            Must be at least the number of replicas.
        accelerator, parallel_devices, checkpoint_io, precision: Lightning's plugins; Fabric passes them from its
            own arguments (``accelerator``, ``devices``, ``plugins``, ``precision``).
        quota: ``"equal"`` (default) or ``"throughput"`` (quotas proportional to each replica's
            measured microbatch speed, for heterogeneous or straggling replicas).
        heartbeat_interval: seconds between heartbeats of a replica (default: 0.1 on the embedded
            coordinator; ``heartbeat_timeout / 4`` on etcd, where each beat is a Raft write).
        heartbeat_timeout: seconds without heartbeat after which a replica is declared dead (default 1; how
            fast a *frozen* replica is dropped; killed ones are noticed at once).
        hang_timeout: seconds a replica's main thread may make no progress while its peers wait on
            it (a deadlock with a live heartbeat thread) before it is declared hung (default 60).
        join_timeout: longest wait, in seconds, for a live-looking member to join a new generation (default 60).
        collective_timeout: seconds a single collective may take before it counts as failed (default 60).
        startup_timeout: seconds replicas wait for each other at start (default 300).
        restarts: how many times the local launcher restarts a failed replica (default 0).
        standby: warm standby processes that take a failed replica's place (default 0; needs ``restarts >= 1``).
        seed: seed of the per-epoch sample permutation (the same on every replica; default 0).
        control_plane: ``"etcd://HOST:PORT,..."`` to keep the job's control plane in etcd (no coordinator
            process; TLS files from ``LIGHTNING_RECOVER_ETCD_CACERT/_CERT/_KEY``; docs/control_plane.md).
            Default: ``LIGHTNING_RECOVER_CONTROL_PLANE``, else the embedded coordinator.
        exact: ``True``: every step's gradient is bitwise a function of the parameters and its ``M``
            microbatch ids alone, whatever fails and on any replica count (fixed-point reduction,
            docs/protocol.md "Exact mode"); needs ``replica_size=1``. Default ``False``.
        status_address: ``[HOST:]PORT`` where the monitor serves the status page, ``/status`` and ``/metrics``
            (loopback unless a host is given; ``0``: any free port). Default None: off.
        event_log: a file the job's events (deaths, recoveries, joins) are appended to, one JSON object a line.
        notice_signal: the signal taken as a preemption notice: the replica finishes its step and leaves.
            Default: ``LIGHTNING_RECOVER_NOTICE_SIGNAL``, else ``"SIGTERM"``.
        replicas: ``"MIN:MAX"`` (or ``(MIN, MAX)``): start once MIN replicas are in and admit later ones up to
            MAX (``devices`` stays MAX). Default: ``LIGHTNING_RECOVER_REPLICAS``, else a fixed count.
        notice_checkpoint: a path where a whole-job notice writes a final checkpoint (through ``save_checkpoint``)
            and from which :meth:`steps` resumes when the script starts again. Default None: none is written.
        replica_size: ``K``, processes per replica (default 1). With K > 1 each replica shards
            its model with FSDP2 over its K processes; ``devices`` is then ``replicas x K``. Set up
            the module first (``fabric.setup_module``), then build and set up the optimizer.
        parallelize_fn: ``fn(module, mesh) -> module`` sharding the model over the replica's mesh
            (dimension ``"shard"``), as with Lightning's ModelParallelStrategy.
        shard: ``"fsdp"``: shorthand that fully_shards every block (instead of parallelize_fn).
        tensor_parallel: ``tp``, a tensor-parallel dimension inside each replica (default 1; tp
            divides K; needs ``parallelize_fn``). The mesh becomes ``("shard", "tp")`` of shape
            ``(K // tp, tp)``; the tp processes of one data position compute the same microbatch.
    """

    strategy_name = "recover"

    def __init__(
        self,
        microbatches: Optional[int] = None,
        *,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        **options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=RecoverEnvironment(),  # not Lightning's detection: environment.py says why
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self.sharding = ShardingConfig.from_options(options)
        self.options = build_options(microbatches, options, self.sharding.replica_size)
        self.protocol_replica: Optional[Replica] = None
        self._modules: list[Module] = []
        self._optimizers: list[Optimizer] = []

    # ------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        self._launcher = ReplicaLauncher(self, _basic_subprocess_cmd)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._require_replica_process(
            "call `fabric.launch()` (or start the script with "
            "`lightning-recover run --replicas N -- python script.py`)."
        )
        backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.root_device)
        self._start_replica(self._trainable_parameters, self._training_state, self._load_training_state, backend)
        set_rank_zero(self.global_rank)  # Lightning's rank_zero_* helpers follow global_rank, as under the Trainer

    def _training_state(self) -> dict:
        state = {
            "modules": [m.state_dict() for m in self._modules],
            "optimizers": [o.state_dict() for o in self._optimizers],
        }
        # Sharded: this process's local shards, for the joiner's process at the same position.
        return local_shards(state) if self.sharding.enabled else state

    def _load_training_state(self, state: dict) -> None:
        for module, sd in zip(self._modules, state["modules"]):
            if self.sharding.enabled:
                load_local_module_state(module, sd)
            else:
                module.load_state_dict(sd)
        for optimizer, sd in zip(self._optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state_from_local(optimizer, sd) if self.sharding.enabled else sd)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        params = []
        for module in self._modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        if self.sharding.enabled:
            raise RuntimeError(
                "with replica_size>1 the model is sharded first, then the optimizer is built over the sharded "
                "parameters. HINT: `model = fabric.setup_module(model)`, then "
                "`optimizer = fabric.setup_optimizers(AdamW(model.parameters()))`."
            )
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_module(self, module: Module) -> Module:
        if self.sharding.enabled:
            module = self.sharding.parallelize(module, self._replica_mesh())
        self._modules.append(module)
        module.register_forward_pre_hook(lambda *_: self._started_replica().fire("forward"))
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizers.append(optimizer)
        return optimizer

    @override
    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        return dataloader

    # ------------------------------------------------------------------ the step loop
    def steps(
        self, dataloader: DataLoader, max_steps: int, start_step: int = 0, loggers: Sequence[Any] = ()
    ) -> Iterator[Step]:
        """Yield steps ``start_step .. max_steps-1``; each covers exactly ``M`` microbatches.

        A restarted replica first rejoins: it receives model, optimizer state and the step to
        resume at from a live peer, and its steps start there. A replica told to leave (a preemption notice)
        leaves after the step it is in, with ``SystemExit``.

        Args:
            dataloader: the training DataLoader (Fabric's wrapper or not); one of its batches is one microbatch.
            max_steps: the index after the last step.
            start_step: the first step's index (a rejoining replica, or one resuming, starts where it resumes).
            loggers: e.g. ``fabric.loggers``: each committed step's ``recover/*`` metrics are logged there at its
                index, by the lowest live replica.

        Yields:
            One :class:`Step` per optimizer step: iterate it to its end before ``optimizer.step()``.

        Raises:
            RuntimeError: a step was not iterated to its end.
        """
        loader = getattr(dataloader, "_dataloader", dataloader)  # unwrap Fabric's wrapper
        protocol_replica = self._started_replica()
        source = MicrobatchSource.from_dataloader(loader, protocol_replica.M, seed=self.options.seed)
        if protocol_replica.joining:
            start_step = protocol_replica.rejoin()
        else:
            start_step = self._resume_after_notice(start_step)
        for index in range(start_step, max_steps):
            step = Step(self, source, index, loggers)
            yield step
            if not step.committed:
                raise RuntimeError(
                    f"step {index} was not iterated to its end. HINT: run `for batch in step: ...` fully "
                    "before calling optimizer.step()."
                )
            if protocol_replica.told_to_leave:  # a notice: this replica leaves here, at the step boundary
                for logger in loggers:
                    logger.finalize("success")  # what its writer still holds reaches the files first
            protocol_replica.leave_if_told()

    # ------------------------------------------------------------------ preemption notices
    def _notice_state(self, step: int) -> dict:
        """What the final checkpoint of a whole-job notice holds: every module and optimizer, and the step."""
        state: dict[str, Any] = {"step": step}
        for i, module in enumerate(self._modules):
            state["model" if i == 0 else f"model{i}"] = module
        for i, optimizer in enumerate(self._optimizers):
            state["optimizer" if i == 0 else f"optimizer{i}"] = optimizer
        return state

    def _write_notice_checkpoint(self, step: int) -> None:
        self.save_checkpoint(self.options.notice_checkpoint, self._notice_state(step))

    def _resume_after_notice(self, start_step: int) -> int:
        """A job started again after a whole-job notice (a requeue) resumes from the final checkpoint it wrote."""
        path = self.options.notice_checkpoint
        if path is None:
            return start_step
        protocol_replica = self._started_replica()
        protocol_replica.set_final_checkpoint(self._write_notice_checkpoint)
        if not os.path.exists(path):
            return start_step
        state = self._notice_state(-1)
        self.load_checkpoint(path, state)  # modules and optimizers in place; "step" read back into ``state``
        resumed = int(state["step"]) + 1
        protocol_replica.say(f"resumed from the notice checkpoint {path}: step {resumed}")
        return max(start_step, resumed)

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        protocol_replica = self._started_replica()
        protocol_replica.before_backward(tensor)
        # the zero slot, the K-fold scale, the sync
        tensor = self.sharding.prepare_backward(protocol_replica, tensor, self._modules)
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._started_replica().fire("optimizer")
        return super().optimizer_step(optimizer, **kwargs)

    # ------------------------------------------------------------------ collectives over live replicas
    @override
    def all_reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        """A new tensor: ``tensor`` reduced over the live replicas ("mean", "sum", "max" or "min"; ``group`` unused)."""
        return self._started_replica().all_reduce(tensor, reduce_op)

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()  # gradients are only ever reduced at the end of a step

    def module_sharded_context(self) -> AbstractContextManager:
        return nullcontext()

    @override
    def save_checkpoint(
        self, path: Any, state: dict, storage_options: Optional[Any] = None, filter: Optional[dict] = None
    ) -> None:
        """``fabric.save``: one replica, the lowest alive now (agreed through the store), writes through the
        checkpoint plugin; with ``replica_size>1`` every live replica writes part of one DCP directory at ``path``.

        Args:
            path: the file (a directory with ``replica_size>1``).
            state: what to save; modules and optimizers are saved as their state dicts.
            storage_options, filter: passed to the checkpoint plugin and Lightning (unsharded only).

        Raises:
            NotImplementedError: ``storage_options`` or ``filter`` given with ``replica_size>1``.
        """
        noted = self._noted_checkpoint(path)
        if self.sharding.enabled:
            if storage_options is not None or filter is not None:
                raise NotImplementedError(
                    "fabric.save with replica_size>1 writes a sharded DCP checkpoint directory and takes no "
                    "storage_options or filter. HINT: put only what you want saved into `state`."
                )
            with noted:
                self._save_sharded(str(path), state)
            return
        if self._elect_writer():
            if self.protocol_replica is not None:
                state = {**state, **checkpoint_entries(self.protocol_replica.protocol.exact)}
            with noted:
                super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def _save_sharded(self, path: str, state: dict) -> None:
        from lightning_recover.lightning.spread_save import save_over_live_replicas

        save_over_live_replicas(
            self._started_replica(),
            path,
            state,
            num_replicas=self.num_replicas,
            replica_size=self.sharding.replica_size,
            device=self.root_device,
        )

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``fabric.load``: restore ``state`` in place from ``path`` (with ``replica_size>1``: each process its shards).

        Args:
            path: the checkpoint file (directory with ``replica_size>1``).
            state: a module, an optimizer or a dict of them and plain values; None: load everything.
            strict: every key of ``state`` must be in the checkpoint (``KeyError`` otherwise when sharded).
            weights_only: Lightning's meaning; with ``replica_size>1`` only None or True.

        Returns:
            The checkpoint's entries not restored into ``state`` (all of them when ``state`` is empty).

        Raises:
            ValueError: with ``replica_size>1``, ``path`` is a single file, or ``weights_only=False``.
            TypeError: with ``replica_size>1``, ``state`` is not a dict.
        """
        if not self.sharding.enabled:
            remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
            if self.protocol_replica is not None:
                restore_checkpoint_entries(self.protocol_replica.protocol.exact, remainder)
            return remainder
        from lightning_recover.checkpoint.dcp.sharded_state import is_dcp_checkpoint, load_full, load_sharded

        if not is_dcp_checkpoint(path) and os.path.isfile(path):
            raise ValueError(
                f"{path} is a single file; with replica_size>1 fabric.load reads the sharded checkpoint directory "
                "that fabric.save writes. HINT: convert it, or load it into an unsharded model first."
            )
        if weights_only is False:
            raise ValueError("sharded checkpoints are always loaded with torch's weights_only loader")
        if not state:
            return load_full(path)  # every tensor full size, in every process
        if not isinstance(state, dict):
            raise TypeError(
                "with replica_size>1 fabric.load restores a dict of objects. HINT: fabric.load(path, {'model': model})"
            )
        # every process of every replica reads its own shards (DCP over the replica's process group)
        return load_sharded(path, state, strict=strict)

    @override
    def teardown(self) -> None:
        if self.protocol_replica is not None:
            self.protocol_replica.close()
        super().teardown()


# Registered at the end of this module's import: whether ``import lightning_recover``'s hook imported it once
# Lightning was loaded, or this module's own imports brought Lightning in (the hook then found it half-built).
RecoverStrategy.register_strategies(STRATEGY_REGISTRY)
