"""``Trainer(strategy="recover")``: the Trainer side of lightning-recover.

A thin adapter around :class:`~lightning_recover.core.RecoverCore` (the same engine as the Fabric
strategy); it contains no protocol code. How one optimizer step maps onto Lightning's loop:

* ``process_dataloader`` turns the training DataLoader into a :class:`StepLoader`: one element
  (a :class:`StepBatch` token) per optimizer step, ``len`` = steps per epoch. Microbatch ``(s, j)``
  is built from the DataLoader's dataset by :class:`~lightning_recover.data.MicrobatchSource`;
  the step index ``s`` is ``trainer.global_step`` when the step runs, so a resumed run (any
  replica count, same ``microbatches``) reads exactly the data an uninterrupted run would have.
* Lightning's automatic optimization runs ``optimizer.step(closure)``; the closure calls the
  strategy's :meth:`training_step` once per step. It iterates ``core.run_step(s)``: for each
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
import inspect
import numbers
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_recover import launcher
from lightning_recover.core import RecoverCore, RecoverOptions
from lightning_recover.data import MicrobatchSource
from lightning_recover.errors import RecoverError
from lightning_recover.ranks import ReplicaRanks
from lightning_recover.strategy import _RecoverLauncher

_HINT_ACCUMULATE = (
    "HINT: remove `accumulate_grad_batches` and use `RecoverTrainerStrategy(microbatches=M)` instead: one optimizer "
    "step is M DataLoader batches (microbatches), spread over the replicas."
)


class StepBatch:
    """What the Trainer sees as one training "batch": a token for one optimizer step.

    The step's index is ``trainer.global_step`` when it runs; its microbatches are built inside
    the strategy's ``training_step``. Callbacks' ``on_train_batch_start/end`` receive this token.
    """

    __slots__ = ("loader", "position")

    def __init__(self, loader: StepLoader, position: int) -> None:
        self.loader = loader
        self.position = position  # position within the Trainer's epoch (informational)

    def __repr__(self) -> str:
        return f"StepBatch(position={self.position}, microbatches={self.loader.source.M})"


class StepLoader:
    """The training DataLoader seen as one :class:`StepBatch` per optimizer step.

    Stateful for Lightning (``state_dict``/``load_state_dict``): the checkpoint records the
    microbatch layout, and resuming with a different one is refused (the data position would not
    mean the same samples).
    """

    def __init__(self, dataloader: DataLoader, microbatches: int, seed: int,
                 resume_position: Optional[Callable[[], int]] = None) -> None:
        check_train_dataloader(dataloader)
        self.dataloader = dataloader
        self.source = MicrobatchSource.from_dataloader(dataloader, microbatches, seed=seed)
        self._resume_position = resume_position  # where in the epoch a resumed run continues
        self._resuming = False

    def __len__(self) -> int:
        return self.source.steps_per_epoch

    def __iter__(self) -> Iterator[StepBatch]:
        # After a resume (checkpoint or rejoin) the first iteration continues mid-epoch, so that the
        # tokens left in it (and Lightning's ``is_last_batch``) match the steps left in the epoch.
        start = 0
        if self._resuming:
            self._resuming = False
            start = self._resume_position() if self._resume_position is not None else 0
        for position in range(start, len(self)):
            yield StepBatch(self, position)

    @property
    def samples_per_step(self) -> int:
        return self.source.b * self.source.M

    def _layout(self) -> dict[str, int]:
        return {"microbatches": self.source.M, "microbatch_size": self.source.b,
                "samples": len(self.source.dataset), "seed": self.source.seed,  # type: ignore[arg-type]
                "shuffle": int(self.source.shuffle)}

    def state_dict(self) -> dict[str, Any]:
        return {"lightning_recover": self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resuming = True  # Lightning restores loader states only when it resumes a fit
        saved = state.get("lightning_recover") if isinstance(state, dict) else None
        if saved is None:
            return
        now = self._layout()
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in diff.items())
            raise ValueError(
                f"the checkpoint was written with a different microbatch layout ({detail}). The step number only "
                "names the same samples under the same layout. HINT: resume with the same "
                "RecoverTrainerStrategy(microbatches=..., seed=...), DataLoader batch_size, shuffle and dataset; "
                "the replica count may differ."
            )


def check_train_dataloader(dataloader: Any) -> None:
    """Refuse training loaders that cannot be cut into numbered microbatches, saying what to do."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"strategy='recover' needs a torch DataLoader for training, got {type(dataloader).__name__}. "
            "HINT: return `DataLoader(map_style_dataset, batch_size=microbatch_size, shuffle=...)` from "
            "train_dataloader(); one batch is one microbatch."
        )
    if isinstance(dataloader.dataset, IterableDataset) or not hasattr(dataloader.dataset, "__len__"):
        raise TypeError(
            "strategy='recover' cannot train on an IterableDataset: microbatch (step, j) must be addressable so a "
            "survivor can recompute a dead replica's share. HINT: use a map-style dataset "
            "(__len__/__getitem__), e.g. by materialising or indexing the stream."
        )
    if dataloader.batch_size is None:
        raise ValueError(
            "strategy='recover' needs the training DataLoader's batch_size (one batch = one microbatch); custom "
            "batch samplers are not supported. HINT: DataLoader(dataset, batch_size=b, shuffle=True)."
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


class _RecoverTrainerLauncher(_RecoverLauncher, _Launcher):
    """The Fabric launcher's behaviour with the Trainer's ``launch(function, *args, trainer=...)`` API."""

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            model = args[0] if args and hasattr(args[0], "automatic_optimization") else None
            check_trainer(trainer, model)  # fail in the supervisor, before starting N processes
        self._strategy.options.validate(self._strategy.num_replicas)
        return super().launch(function, *args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        pass  # the supervisor forwards signals to its replicas and never kills survivors


class _LogCapture:
    """Collects ``self.log`` calls of the module during one step; logs the aggregate once at the end."""

    _REDUCE = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "amax": "max", "min": "min", "amin": "min"}

    def __init__(self, module: Any) -> None:
        self.module = module
        self.original = module.log
        self._signature = inspect.signature(self.original)
        self.values: dict[str, list[float]] = {}  # name -> [sum, count, max, min]
        self.kwargs: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> _LogCapture:
        self.module.log = self._log
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.module.__dict__.get("log") == self._log:
            del self.module.log

    def _log(self, *args: Any, **kwargs: Any) -> None:
        bound = self._signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        name, value = arguments.pop("name"), arguments.pop("value")
        if isinstance(value, Tensor):
            if value.numel() != 1:
                return self.original(*args, **kwargs)  # let Lightning raise its own error
            number = float(value.detach().float().cpu())
        elif isinstance(value, numbers.Number):
            number = float(value)  # type: ignore[arg-type]
        else:  # a torchmetrics Metric (or anything else): Lightning handles it per call
            return self.original(*args, **kwargs)
        fx = arguments.get("reduce_fx", "mean")
        fx_name = fx if isinstance(fx, str) else getattr(fx, "__name__", "")
        if fx_name not in self._REDUCE:
            raise ValueError(f"self.log({name!r}, reduce_fx={fx!r}) inside training_step is not supported by "
                             "strategy='recover'. HINT: use reduce_fx='mean', 'sum', 'max' or 'min'.")
        arguments["reduce_fx"] = self._REDUCE[fx_name]
        entry = self.values.get(name)
        if entry is None:
            self.values[name] = [number, 1.0, number, number]
        else:
            entry[0] += number
            entry[1] += 1
            entry[2] = max(entry[2], number)
            entry[3] = min(entry[3], number)
        self.kwargs[name] = arguments
        return None


class RecoverTrainerStrategy(ReplicaRanks, ParallelStrategy):
    """``Trainer(strategy="recover")``: fault-tolerant data parallelism with in-step recovery.

    One DataLoader batch is one microbatch; one optimizer step is ``microbatches`` (``M``) of them,
    computed by the live replicas. The options are those of
    :class:`lightning_recover.RecoverStrategy` (validated by :class:`RecoverOptions`).

    Args:
        microbatches: ``M``, global microbatches per optimizer step (default: the replica count).
        quota: ``"equal"`` or ``"throughput"``.
        heartbeat_interval, heartbeat_timeout, join_timeout, collective_timeout, startup_timeout:
            failure-detection and waiting limits, in seconds.
        restarts: how many times the launcher restarts a failed replica.
        seed: seed of the per-epoch sample permutation (the same on every replica).
        checkpoint_io: defaults to :class:`lightning_recover.checkpoint.UringCheckpointIO`.
    """

    strategy_name = "recover"

    def __init__(
        self,
        microbatches: Optional[int] = None,
        quota: str = "equal",
        heartbeat_interval: float = 0.1,
        heartbeat_timeout: float = 1.0,
        join_timeout: float = 60.0,
        collective_timeout: float = 60.0,
        startup_timeout: float = 300.0,
        restarts: int = 0,
        seed: int = 0,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.options = RecoverOptions(
            microbatches=microbatches, quota=quota, heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout, join_timeout=join_timeout,
            collective_timeout=collective_timeout, startup_timeout=startup_timeout, restarts=restarts, seed=seed,
        )
        self.core: Optional[RecoverCore] = None
        self._committed: Optional[list[tuple[torch.nn.Parameter, Optional[Tensor]]]] = None
        # A restarted replica (rejoin): the Lightning checkpoint received from a live peer, the step
        # it resumes at, and whether it still runs alone (Lightning's start-of-fit collectives are
        # local until its first step: the members passed those points long ago).
        self._rejoin_checkpoint: Optional[dict[str, Any]] = None
        self._rejoin_loggers: list[Any] = []
        self._rejoin_step: Optional[int] = None
        self._solo = False
        if launcher.in_replica():  # until the group forms, the replica id is the rank: one banner, not N
            self._sync_rank_zero(int(os.environ[launcher.ENV_REPLICA]))

    @property
    def is_distributed(self) -> bool:
        return True  # so that `self.log(..., sync_dist=True)` outside training_step reaches `reduce`

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            from lightning_recover.checkpoint import UringCheckpointIO

            self._checkpoint_io = UringCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        self._launcher = _RecoverTrainerLauncher(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if not launcher.in_replica():
            raise RuntimeError(
                "strategy='recover' runs each replica in its own process. HINT: run the script directly (the "
                "Trainer starts the replicas) or with `lightning-recover run --replicas N -- python script.py`."
            )
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.core is None:  # one core per process, kept across fit/validate/test calls
            self.options.validate(self.num_replicas)
            self.core = RecoverCore.from_env(self.options, self._trainable_parameters)
            self.core.set_state_hooks(self._state_for_joiner, self._receive_state)
            self.core.start()
            if self.core.joining:
                self._rejoin(trainer)
        self._sync_rank_zero()
        if trainer is not None:
            check_trainer(trainer, self.lightning_module)
            # A DistributedSampler must never be injected: the step plan decides what each replica reads.
            trainer._accelerator_connector.use_distributed_sampler = False
            if not self._solo:
                self._share_logger_versions(trainer)

    # ------------------------------------------------------------------ rejoin
    def _state_for_joiner(self) -> dict[str, Any]:
        """Members (at the start of step s, inside ``run_step``, before any microbatch of s ran): the
        Trainer's full checkpoint at that step boundary, handed to a rejoining replica."""
        module = self.lightning_module
        if module is None or module._trainer is None or module.trainer.state.fn != TrainerFn.FITTING:
            raise RecoverError("a replica can only be admitted while the Trainer is fitting")
        trainer = module.trainer
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        # Taken inside the step: the epoch loop has started the step's batch but not run it, which
        # Lightning restores like a checkpoint saved mid-batch. Only the logging step differs: the
        # loop already counted step s as stepped, and restoring from mid-batch counts it once more.
        epoch_loop = checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]
        epoch_loop["_batches_that_stepped"] = epoch_loop.get("_batches_that_stepped", 0) - 1
        return {"checkpoint": checkpoint, "logger_versions": [logger.version for logger in trainer.loggers]}

    def _receive_state(self, state: dict[str, Any]) -> None:
        self._rejoin_checkpoint = state["checkpoint"]
        self._rejoin_loggers = list(state.get("logger_versions", []))

    def _rejoin(self, trainer: Any) -> None:
        """A restarted replica: receive the live state from a peer before the fit loop starts.

        The received checkpoint is restored by Lightning exactly like ``fit(ckpt_path=...)``: it is
        pre-loaded into the checkpoint connector (and :meth:`load_checkpoint` returns it instead of
        reading a file, should the script pass a ``ckpt_path``), so modules, callbacks, optimizers,
        LR schedulers and the loops' progress all come from the peer's state at step ``s``.
        """
        replica = self.core.group.replica
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            fn = getattr(getattr(trainer, "state", None), "fn", None)
            raise RuntimeError(
                f"replica {replica} was restarted while the job runs and must rejoin inside `trainer.fit`, but its "
                f"first Trainer call is {getattr(fn, 'value', fn)!r}. HINT: call trainer.fit(...) first in the "
                "training script (evaluate after fit), or use restarts=0."
            )
        self._solo = True
        step = self.core.rejoin()
        checkpoint = self._rejoin_checkpoint
        if checkpoint is None or checkpoint.get("global_step") != step:
            raise RecoverError(
                f"replica {replica} received a state for step {None if checkpoint is None else checkpoint.get('global_step')} "
                f"but the group resumes at step {step}"
            )
        self._rejoin_step = step
        for logger, version in zip(trainer.loggers, self._rejoin_loggers):
            if "_version" in vars(logger):
                logger._version = version  # the run's log directory, whoever writes it later
        trainer._checkpoint_connector._loaded_checkpoint = checkpoint

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self._rejoin_checkpoint is not None:
            # A rejoining replica resumes from the live state of its peers, not from the script's ckpt_path.
            return self._rejoin_checkpoint
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def on_train_start(self) -> None:
        self._rejoin_checkpoint = None  # restored by now; free the memory
        super().on_train_start()

    def _share_logger_versions(self, trainer: Any) -> None:
        # Whichever replica is the lowest live one writes the logs: all must agree on the directory.
        for logger in trainer.loggers:
            if "_version" in vars(logger) and logger._version is None:
                version = logger.version if self.is_global_zero else None
                logger._version = self.broadcast(version)

    def _sync_rank_zero(self, rank: Optional[int] = None) -> None:
        rank = self.global_rank if rank is None else rank
        rank_zero_only.rank = utils_rank_zero_only.rank = fabric_rank_zero_only.rank = rank

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        module = self.lightning_module
        return [p for p in module.parameters() if p.requires_grad] if module is not None else []

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            loader = StepLoader(dataloader, self.core.M, self.options.seed)  # type: ignore[arg-type]
            loader._resume_position = lambda: self._epoch_position(trainer, len(loader))
            return loader
        return dataloader  # evaluation: the full loader on every replica

    @staticmethod
    def _epoch_position(trainer: Any, steps_per_epoch: int) -> int:
        """The step within the epoch a resumed fit continues at (microbatch data is a function of the step)."""
        limit = trainer.limit_train_batches
        if (isinstance(limit, float) and limit == 1.0) or (isinstance(limit, int) and limit >= steps_per_epoch):
            return trainer.global_step % steps_per_epoch
        return 0  # limit_train_batches: the Trainer's epochs are not data epochs; iterate from the start

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
            raise RuntimeError("strategy='recover' expected its own step token as the training batch; the training "
                               "DataLoader was not processed by the strategy.")
        module = self.lightning_module
        trainer = module.trainer
        core = self.core
        source = token.loader.source
        step = trainer.global_step
        if self._solo:  # a rejoined replica's first step: from here on it runs in step with the members
            if step != self._rejoin_step:
                raise RecoverError(f"replica {self.replica} rejoined at step {self._rejoin_step} but its fit loop "
                                   f"resumed at step {step}")
            self._solo = False
            self._rejoin_checkpoint = None
        first = (step % source.steps_per_epoch) * source.M
        with _LogCapture(module) as capture:
            for j in core.run_step(step):
                core.seed_microbatch(step, j)
                batch = trainer.precision_plugin.convert_input(source.batch(step, j))
                batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
                batch = super().batch_to_device(batch, dataloader_idx=0)
                core.fire("forward")
                output = super().training_step(batch, first + j)
                loss = output.get("loss") if isinstance(output, dict) else output
                if not isinstance(loss, Tensor):
                    raise RuntimeError(
                        "training_step must return the microbatch loss (a Tensor or a dict with 'loss') under "
                        "strategy='recover'; skipping a microbatch would change the step for every replica."
                    )
                core.before_backward(loss)
                self.precision_plugin.backward(loss, module, None)
        # The step has committed: grads hold the mean over all M microbatches on every live replica.
        params = self._trainable_parameters()
        self._committed = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None  # out of reach of the closure's zero_grad; `backward` puts them back
        self._sync_rank_zero()
        self._log_step(capture, token.loader.samples_per_step)
        stats = core.protocol.last
        return torch.tensor(stats.loss if stats.loss is not None else float("nan"), device=self.root_device)

    def _log_step(self, capture: _LogCapture, batch_size: int) -> None:
        stats = self.core.protocol.last
        local = {"logs": capture.values, "kwargs": capture.kwargs, "recomputed": stats.recomputed,
                 "recoveries": stats.recoveries, "recovery_seconds": stats.recovery_seconds}
        gathered = list(self.core.group.exchange(local).values())
        log = capture.original
        names: dict[str, dict[str, Any]] = {}
        for item in gathered:
            for name, kw in item["kwargs"].items():
                names.setdefault(name, kw)
        for name in sorted(names):
            entries = [item["logs"][name] for item in gathered if name in item["logs"]]
            kw = dict(names[name])
            fx = kw["reduce_fx"]
            if fx == "sum":
                value = sum(e[0] for e in entries)
            elif fx == "max":
                value = max(e[2] for e in entries)
            elif fx == "min":
                value = min(e[3] for e in entries)
            else:
                value = sum(e[0] for e in entries) / sum(e[1] for e in entries)
            kw["sync_dist"] = False  # already the value over all replicas
            if kw.get("batch_size") is None:
                kw["batch_size"] = batch_size
            log(name, torch.tensor(value, dtype=torch.float32), **kw)
        metrics = {
            "recover/loss": stats.loss if stats.loss is not None else float("nan"),
            "recover/live_replicas": stats.live_replicas,
            "recover/generation": stats.generation,
            "recover/recoveries": max(item["recoveries"] for item in gathered),
            "recover/recomputed": sum(item["recomputed"] for item in gathered),
            "recover/recovery_seconds": max(item["recovery_seconds"] for item in gathered),
        }
        for name, value in metrics.items():
            log(name, float(value), on_step=True, on_epoch=False, logger=True, batch_size=batch_size,
                prog_bar=name in ("recover/loss", "recover/live_replicas"))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """The closure's backward: restore the committed (reduced) gradients instead of back-propagating."""
        committed, self._committed = self._committed, None
        if committed is None:
            raise RuntimeError(
                "strategy='recover' back-propagates each microbatch inside its training_step; a second backward in "
                "the same step is not supported (manual optimization or a custom closure?)."
            )
        module = self.lightning_module
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
            self.core.fire("optimizer")  # after the commit, before the parameters change
            return result

        return super().optimizer_step(optimizer, closure_then_fault, model, **kwargs)

    # ------------------------------------------------------------------ collectives over live replicas
    def _evaluating(self) -> bool:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer is not None and trainer.state.stage in (
            RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING, RunningStage.PREDICTING)

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[Any, str]] = "mean") -> Union[Tensor, Any]:
        if not isinstance(tensor, Tensor) or self.core is None or self._solo:
            return tensor
        if self._evaluating():
            return tensor  # every replica evaluated the full loaders: it already holds the global value
        return self.core.all_reduce(tensor, reduce_op or "mean")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.core is None or self._solo:
            return decision
        values = self.core.group.exchange(bool(decision)).values()
        return builtins.all(values) if all else any(values)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return self.core.all_gather(tensor) if self.core is not None and not self._solo else tensor.unsqueeze(0)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if self.core is not None and not self._solo:
            self.core.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.core.broadcast(obj, src) if self.core is not None and not self._solo else obj

    @override
    def block_backward_sync(self) -> Any:
        return nullcontext()

    @override
    def model_sharded_context(self) -> AbstractContextManager:
        return nullcontext()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # The writer is the lowest replica alive *now*, agreed through the store: never lost, never twice.
        if self._solo:
            return  # a replica still rejoining holds no step of its own to save; the members write
        if self.core is None or self.core.elect_writer():
            if storage_options is None:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath)
            else:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def teardown(self) -> None:
        # The core stays: the same script may call trainer.test() next; it leaves the group at exit.
        self._committed = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "recover", cls, description="fault-tolerant data parallel with in-step recovery (lightning-recover)"
        )

