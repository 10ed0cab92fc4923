"""``Trainer(strategy="recover")``: the Trainer side of lightning-recover.

A thin adapter around :class:`~lightning_recover.protocol.replica.Replica` (the same engine as the
Fabric strategy); it contains no protocol code. How one optimizer step maps onto Lightning's loop:

* ``process_dataloader`` turns the training DataLoader into a :class:`StepLoader`: one element
  (a :class:`StepBatch` token) per optimizer step, ``len`` = steps per epoch. Microbatch ``(s, j)``
  is built from the DataLoader's dataset by :class:`~lightning_recover.data.MicrobatchSource`;
  the step index ``s`` is ``trainer.global_step`` when the step runs, so a resumed run (any
  replica count, same ``microbatches``) reads exactly the data an uninterrupted run would have.
* Lightning's automatic optimization runs ``optimizer.step(closure)``; the closure calls the
  strategy's :meth:`training_step` once per step. It iterates ``protocol_replica.run_step(s)``: for each
  microbatch id it builds the batch, calls the module's ``training_step(batch, batch_idx)`` (one
  microbatch) and back-propagates its loss. When the iterator ends the step has committed: every
  ``param.grad`` holds the average gradient of the ``M`` microbatches on every live replica.
* The closure then calls ``zero_grad`` and ``backward`` with the returned (detached) mean loss.
  So that ``zero_grad`` cannot wipe the reduced gradients, :meth:`training_step` moves them aside
  (``param.grad = None``) and :meth:`backward` puts them back instead of back-propagating; the
  ``on_before_backward``/``on_after_backward`` hooks run there, once per step, and see the mean
  loss and the reduced gradients. Lightning then clips the (identical) gradients and steps.
* ``self.log`` calls made inside the module's ``training_step`` are captured per microbatch and
  logged once per step with the value aggregated over all ``M`` microbatches of all replicas
  (``reduce_fx`` mean/sum/max/min; one store exchange per step), so ``self.log("loss", loss)``
  logs the mean loss of the step, with or without ``sync_dist``.
* Validation/test/predict run the full loaders on every live replica (no sampler is injected):
  the metrics are exact, identical everywhere (``ModelCheckpoint(monitor=...)`` agrees across
  replicas) and a replica dying during validation loses nothing. ``sync_dist`` there is the
  identity, since every replica already holds the global value.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.launcher import _Launcher as _PLLauncher
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from typing_extensions import override

from lightning_recover import env
from lightning_recover.errors import RecoverError
from lightning_recover.lightning.base import ReplicaLauncher, build_options, committed_stats
from lightning_recover.lightning.environment import RecoverEnvironment
from lightning_recover.lightning.loader import StepBatch, StepLoader, epoch_position
from lightning_recover.lightning.ranks import set_rank_zero
from lightning_recover.lightning.sharding_config import ShardingConfig, local_shards
from lightning_recover.lightning.step_logs import StepLogCapture, log_step, share_logger_versions
from lightning_recover.lightning.trainer_rejoin import adopt_checkpoint, check_rejoin_inside_fit, checkpoint_for_joiner
from lightning_recover.lightning.trainer_saving import TrainerCheckpointing
from lightning_recover.protocol.replica import Replica

_HINT_ACCUMULATE = (
    "HINT: remove `accumulate_grad_batches` and use `RecoverTrainerStrategy(microbatches=M)` instead: one optimizer "
    "step is M DataLoader batches (microbatches), spread over the replicas."
)


def check_trainer(trainer: Any, model: Any = None) -> None:
    """Unsupported Trainer/module combinations, refused before anything starts."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported with "
            f"strategy='recover'. {_HINT_ACCUMULATE}"
        )
    precision = trainer.precision_plugin
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise ValueError(
            f"precision={trainer.precision!r} (with a gradient scaler) is not supported by strategy='recover'. "
            "HINT: use precision='bf16-mixed' or '32-true'."
        )
    if model is not None and not getattr(model, "automatic_optimization", True):
        raise ValueError(
            "manual optimization (self.automatic_optimization = False) is not supported by strategy='recover': the "
            "strategy drives forward/backward/reduce of each step. HINT: use automatic optimization, or Fabric with "
            "RecoverStrategy for a hand-written loop."
        )


def _script_command() -> Sequence[str]:
    from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd

    return _basic_subprocess_cmd()


class _TrainerLauncher(ReplicaLauncher, _PLLauncher):
    """The replica launcher with the Trainer's ``launch(function, *args, trainer=...)`` API (and its ``kill``)."""

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            model = args[0] if args and hasattr(args[0], "automatic_optimization") else None
            check_trainer(trainer, model)  # fail before starting N processes
        return super().launch(function, *args, **kwargs)


#: What ``Trainer(...)`` prints while it is built: the supervisor has printed it, its replicas need not.
_BANNER = ("GPU available:", "TPU available:", "HPU available:", "💡 Tip:")


def _not_the_supervisors_banner(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BANNER)


def _replica_banner() -> None:
    """In a replica, until the group forms, the replica id (x K + inner) is the rank: one banner, not N (a
    standby's slot is past every replica's: it prints nothing). And not even that one for what the supervisor
    printed already: Trainer(...)'s device lines and tips."""
    set_rank_zero(env.device_slot())
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_not_the_supervisors_banner)


class RecoverTrainerStrategy(TrainerCheckpointing):  # on RecoverStrategyBase and Lightning's ParallelStrategy
    """``Trainer(strategy="recover")``: fault-tolerant data parallelism with in-step recovery.

    One DataLoader batch is one microbatch; one optimizer step is ``microbatches`` (``M``) of them,
    computed by the live replicas. The options are those of :class:`lightning_recover.RecoverStrategy`, which
    says each one's meaning and default (validated by :class:`RecoverOptions`: ``ValueError``, or ``TypeError``
    for an unknown name); what differs for the Trainer is said here.

    Args:
        microbatches: ``M``, global microbatches per optimizer step (default: the replica count).
        accelerator, parallel_devices, precision_plugin: Lightning's plugins; the Trainer passes them.
        quota: ``"equal"`` or ``"throughput"``.
        heartbeat_interval, heartbeat_timeout, hang_timeout, join_timeout, collective_timeout, startup_timeout:
            failure-detection and waiting limits, in seconds.
        restarts, standby: how many times the launcher restarts a failed replica; warm standby processes.
        seed: seed of the per-epoch sample permutation (the same on every replica).
        control_plane, status_address, event_log, notice_signal, replicas: as for ``RecoverStrategy``.
        notice_checkpoint: where a whole-job notice writes the final checkpoint (``trainer.save_checkpoint``).
            Default: Lightning's next HPC checkpoint in ``default_root_dir``, which a requeued Slurm job resumes
            from by itself (elsewhere ``fit(ckpt_path="hpc")``).
        exact: bitwise reproducible steps, whatever fails (replica_size=1; docs/protocol.md "Exact mode").
        checkpoint_io: defaults to :class:`lightning_recover.lightning.checkpoint_io.UringCheckpointIO`.
        replica_size: ``K``, processes per replica (default 1). With K > 1 each replica shards the
            LightningModule with FSDP2 over its K processes (``devices`` is ``replicas x K``): the
            strategy calls ``configure_model``, then shards, then ``configure_optimizers``.
            Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fit(ckpt_path=...)``) are
            then one DCP directory, written by all live replicas (lightning/trainer_checkpoint.py).
        parallelize_fn: ``fn(module, mesh) -> module`` sharding the LightningModule over the replica's
            mesh (dimension ``"shard"``), as with Lightning's ModelParallelStrategy.
        shard: ``"fsdp"``: shorthand that fully_shards every block and each top-level submodule.
        tensor_parallel: a tensor-parallel dimension inside each replica (default 1; divides K; needs
            ``parallelize_fn``), as for ``RecoverStrategy``.
    """

    strategy_name = "recover"

    def __init__(
        self,
        microbatches: Optional[int] = None,
        *,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        **options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=RecoverEnvironment(),  # not Lightning's detection: environment.py says why
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.sharding = ShardingConfig.from_options(options)
        self.options = build_options(microbatches, options, self.sharding.replica_size)
        self.protocol_replica: Optional[Replica] = None
        self._committed: Optional[list[tuple[torch.nn.Parameter, Optional[Tensor]]]] = None
        # A restarted replica (rejoin): the Lightning checkpoint received from a live peer, the step
        # it resumes at, and whether it still runs alone (Lightning's start-of-fit collectives are
        # local until its first step: the members passed those points long ago).
        self._rejoin_checkpoint: Optional[dict[str, Any]] = None
        self._received: dict[str, Any] = {}  # what a peer handed this rejoining replica (checkpoint, loggers)
        self._rejoin_step: Optional[int] = None
        self._solo = False
        if env.in_replica():
            _replica_banner()

    @property
    def is_distributed(self) -> bool:
        return True  # so that `self.log(..., sync_dist=True)` outside training_step reaches `reduce`

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint plugin: the one given, else a :class:`UringCheckpointIO` made on first use."""
        if self._checkpoint_io is None:
            from lightning_recover.lightning.checkpoint_io import UringCheckpointIO

            self._checkpoint_io = UringCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        self._launcher = _TrainerLauncher(self, _script_command)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._require_replica_process(
            "run the script directly (the Trainer starts the replicas) or with "
            "`lightning-recover run --replicas N -- python script.py`."
        )
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.protocol_replica is None:  # one replica per process, kept across fit/validate/test calls
            protocol_replica = self._start_replica(
                self._trainable_parameters, self._state_for_joiner, self._receive_state
            )
            if protocol_replica.joining:
                self._rejoin(trainer)
        set_rank_zero(self.global_rank)
        if trainer is not None:
            check_trainer(trainer, self.lightning_module)
            # A DistributedSampler must never be injected: the step plan decides what each replica reads.
            trainer._accelerator_connector.use_distributed_sampler = False
            if not self._solo:  # the K processes of a replica write the same value (store collectives are per replica)
                share_logger_versions(trainer, self._started_replica().rank == 0, self.broadcast)

    # ------------------------------------------------------------------ rejoin (lightning/trainer_rejoin.py)
    def _state_for_joiner(self) -> dict[str, Any]:
        state = checkpoint_for_joiner(self.lightning_module)
        # Sharded: this process's local shards, for the joiner's process at the same inner position.
        return local_shards(state) if self.sharding.enabled else state

    def _receive_state(self, state: dict[str, Any]) -> None:
        self._received = state

    def _rejoin(self, trainer: Any) -> None:
        """A restarted replica: receive the live state from a peer before the fit loop starts; it is
        restored like ``fit(ckpt_path=...)`` (and :meth:`load_checkpoint` returns it instead of
        reading a file, should the script pass a ``ckpt_path``)."""
        protocol_replica = self._started_replica()
        check_rejoin_inside_fit(trainer, protocol_replica.replica)
        self._solo = True
        step = protocol_replica.rejoin()
        self._rejoin_checkpoint = adopt_checkpoint(trainer, self._received, step, protocol_replica.replica)
        self._received = {}
        self._rejoin_step = step

    @override
    def on_train_start(self) -> None:
        self._rejoin_checkpoint = None  # restored by now; free the memory
        if self.protocol_replica is not None:
            # The Trainer registered its own SIGTERM handler after setup (it would end the fit after the batch,
            # exit status 0, on any rank): the notice is this strategy's, handled at the step boundary.
            self.protocol_replica.notice.install(self.options.resolve_notice_signal())
            self.protocol_replica.set_final_checkpoint(self._write_notice_checkpoint)
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.protocol_replica is not None:
            self.protocol_replica.leave_if_told()  # a notice: this replica leaves here, at the step boundary
        super().on_train_batch_start(batch, batch_idx)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        module = self.lightning_module
        return [p for p in module.parameters() if p.requires_grad] if module is not None else []

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """After ``configure_model``, before ``configure_optimizers``: shard the module inside the replica."""
        if self.sharding.enabled:
            model = self.sharding.parallelize(model, self._replica_mesh(), shard_root=False)
        return super()._setup_model(model)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            loader = StepLoader(
                dataloader,
                self._started_replica().M,
                self.options.seed,
                resume_position=lambda: epoch_position(trainer, len(loader)),
            )
            return loader
        return dataloader  # evaluation: the full loader on every replica

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, StepBatch):
            return batch  # microbatches are moved when they are built, in training_step
        return super().batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        token = args[0] if args else kwargs.get("batch")
        if not isinstance(token, StepBatch):
            raise RuntimeError(
                "strategy='recover' expected its own step token as the training batch; the training "
                "DataLoader was not processed by the strategy."
            )
        module = self._attached_module()
        trainer = module.trainer
        protocol_replica = self._started_replica()
        source = token.loader.source
        step = trainer.global_step
        if self._solo:  # a rejoined replica's first step: from here on it runs in step with the members
            if step != self._rejoin_step:
                raise RecoverError(
                    f"replica {self.replica} rejoined at step {self._rejoin_step} but its fit loop "
                    f"resumed at step {step}"
                )
            self._solo = False
            self._rejoin_checkpoint = None
        first = (step % source.steps_per_epoch) * source.M
        fsdp_modules = [module] if self.sharding.enabled else []
        with StepLogCapture(module) as capture:
            for j in protocol_replica.run_step(step):
                capture.skip = protocol_replica.zero_slot  # a zero-contribution slot repeats a microbatch: not logged
                protocol_replica.seed_microbatch(step, j)
                batch = trainer.precision_plugin.convert_input(source.batch(step, j))
                batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
                batch = super().batch_to_device(batch, dataloader_idx=0)
                protocol_replica.fire("forward")
                output = super().training_step(batch, first + j)
                loss = output.get("loss") if isinstance(output, dict) else output
                if not isinstance(loss, Tensor):
                    raise RuntimeError(
                        "training_step must return the microbatch loss (a Tensor or a dict with 'loss') under "
                        "strategy='recover'; skipping a microbatch would change the step for every replica."
                    )
                protocol_replica.before_backward(loss)
                loss = self.sharding.prepare_backward(
                    protocol_replica, loss, fsdp_modules
                )  # zero slot, K-fold scale, sync
                self.precision_plugin.backward(loss, module, None)
        # The step has committed: grads hold the mean over all M microbatches on every live replica.
        params = self._trainable_parameters()
        self._committed = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None  # out of reach of the closure's zero_grad; `backward` puts them back
        set_rank_zero(self.global_rank)
        stats = committed_stats(protocol_replica)
        if (
            protocol_replica.world is not None
        ):  # the K processes computed different microbatches: one capture per replica
            capture.merge_in_replica(protocol_replica.world.group)
        log_step(capture, stats, protocol_replica.exchange, token.loader.samples_per_step, bool(module.loggers))
        return torch.tensor(stats.loss if stats.loss is not None else float("nan"), device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """The closure's backward: restore the committed (reduced) gradients instead of back-propagating."""
        committed, self._committed = self._committed, None
        if committed is None:
            raise RuntimeError(
                "strategy='recover' back-propagates each microbatch inside its training_step; a second backward in "
                "the same step is not supported (manual optimization or a custom closure?)."
            )
        module = self._attached_module()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward(mean loss)
        for p, grad in committed:
            p.grad = grad
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_fault() -> Any:
            result = closure()
            self._started_replica().fire("optimizer")  # after the commit, before the parameters change
            return result

        return super().optimizer_step(optimizer, closure_then_fault, model, **kwargs)

    # ------------------------------------------------------------------ collectives over live replicas
    def _evaluating(self) -> bool:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer is not None and trainer.state.stage in (
            RunningStage.VALIDATING,
            RunningStage.TESTING,
            RunningStage.SANITY_CHECKING,
            RunningStage.PREDICTING,
        )

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Union[Tensor, Any]:
        """``tensor`` reduced over the live replicas; unchanged when evaluating (each replica ran the full loaders)."""
        if not isinstance(tensor, Tensor) or not self._group_ready():
            return tensor
        if self._evaluating():
            return tensor  # every replica evaluated the full loaders: it already holds the global value
        return self._started_replica().all_reduce(tensor, reduce_op or "mean")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self._group_ready():
            return decision
        values = self._started_replica().exchange(bool(decision)).values()
        return builtins.all(values) if all else any(values)

    def _group_ready(self) -> bool:
        # A rejoining replica runs Lightning's start-of-fit collectives alone: the members passed them long ago.
        return self.protocol_replica is not None and not self._solo

    @override
    def block_backward_sync(self) -> Any:
        return nullcontext()

    @override
    def teardown(self) -> None:
        # The protocol replica stays: the same script may call trainer.test() next; it leaves the group at exit.
        self._committed = None
        super().teardown()


# Registered at the end of this module's import (see the end of lightning/fabric.py).
RecoverTrainerStrategy.register_strategies(StrategyRegistry)
