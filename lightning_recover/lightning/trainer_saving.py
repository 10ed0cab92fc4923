"""How the Trainer strategy saves, loads and removes checkpoints.

Unsharded, one writer (the lowest live replica, agreed at the save) writes Lightning's checkpoint dict through
the checkpoint plugin; sharded (``replica_size=K>1``), every live replica writes part of one DCP directory
(trainer_checkpoint.py). A rejoining replica is handed its peers' live state in place of the script's
``ckpt_path``, and writes nothing until its first step. A whole-job notice writes the final checkpoint here:
at ``notice_checkpoint=``, or as Lightning's HPC checkpoint, which Lightning resumes a requeued Slurm job from.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from lightning_recover.lightning.base import RecoverStrategyBase
from lightning_recover.lightning.sharding_config import (
    ShardingConfig,
    load_local_module_state,
    optimizer_state_from_local,
)
from lightning_recover.lightning.trainer_checkpoint import (
    hpc_checkpoint_path,
    load_trainer_checkpoint,
    remove_checkpoint_dir,
    save_trainer_checkpoint,
)
from lightning_recover.protocol.exact import checkpoint_entries, restore_checkpoint_entries


# ReplicaRanks.distributed_sampler_kwargs is None (no sampler): Lightning's Trainer types it Optional and reads it only
# to inject a sampler, which this strategy turns off, but its ParallelStrategy annotates a dict
class TrainerCheckpointing(RecoverStrategyBase, ParallelStrategy):  # type: ignore[misc]
    """The checkpoint side of :class:`~lightning_recover.lightning.trainer.RecoverTrainerStrategy` (its base: it
    uses the strategy's ``protocol_replica``, ``sharding``, ``options`` and rejoin state, set by the strategy's ``__init__``)."""

    sharding: ShardingConfig
    _rejoin_checkpoint: Optional[dict[str, Any]]
    _solo: bool

    def _attached_module(self) -> LightningModule:
        """The LightningModule, for the hooks the Trainer calls only once it attached one."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("strategy='recover': no LightningModule is attached to the strategy yet")
        return module

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self.sharding.enabled  # sharded: a peer's local shards go into the already sharded module

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # sharded: load_checkpoint restored them from the DCP directory (as ModelParallelStrategy), unless rejoining
        return not self.sharding.enabled or self._rejoin_checkpoint is not None

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.sharding.enabled:
            return super().load_model_state_dict(checkpoint, strict=strict)
        if self._rejoin_checkpoint is not None:  # (a ckpt_path was restored by load_checkpoint already)
            load_local_module_state(self._attached_module(), checkpoint["state_dict"])

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self.sharding.enabled:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(optimizer_state_from_local(optimizer, state))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read the checkpoint ``fit(ckpt_path=...)`` resumes from; a rejoining replica gets its peers' live state.

        Args:
            checkpoint_path: the file (a DCP directory with ``replica_size>1``); ignored while rejoining.
            weights_only: as for the checkpoint plugin; with ``replica_size>1`` only None or True.

        Returns:
            Lightning's checkpoint dict. With ``replica_size>1`` the module and the optimizers are restored in place
            already, and the dict holds the rest (loops, callbacks, schedulers, ...).

        Raises:
            FileNotFoundError: with ``replica_size>1``, no sharded checkpoint at ``checkpoint_path``.
            ValueError: with ``replica_size>1``, a single file, a DCP checkpoint not written by the Trainer,
                or ``weights_only=False``.
            KeyError: with ``replica_size>1``, the checkpoint lacks an optimizer's state (saved weights only).
        """
        if self._rejoin_checkpoint is not None:
            # A rejoining replica resumes from the live state of its peers, not from the script's ckpt_path.
            return self._rejoin_checkpoint
        if self.sharding.enabled:  # every process reads its own shards into the sharded module and optimizers
            return load_trainer_checkpoint(checkpoint_path, self.lightning_module, self.optimizers, weights_only)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.protocol_replica is not None:
            restore_checkpoint_entries(self.protocol_replica.protocol.exact, checkpoint)
        return checkpoint

    def _write_notice_checkpoint(self, step: int) -> None:
        """A whole-job notice: every replica saves the final checkpoint together, through the checkpoint plugin,
        at ``notice_checkpoint=`` or else where Lightning resumes a requeued job from (its HPC checkpoint)."""
        trainer = self._attached_module().trainer
        path = self.options.notice_checkpoint
        if path is None:  # the next free hpc_ckpt_N, named by one replica before any of them writes
            first = self._started_replica().rank == 0
            path = self.broadcast(hpc_checkpoint_path(trainer.default_root_dir) if first else None)
        trainer.save_checkpoint(path)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write Lightning's checkpoint dict: the lowest live replica (agreed at the save) through the checkpoint
        plugin; with ``replica_size>1`` every live replica writes part of one DCP directory at ``filepath``. A
        replica still rejoining writes nothing.

        Args:
            checkpoint: Lightning's checkpoint dict.
            filepath: the file (a directory with ``replica_size>1``).
            storage_options: passed to the checkpoint plugin.

        Raises:
            TypeError: ``storage_options`` with ``replica_size>1``.
            FileExistsError: with ``replica_size>1``, ``filepath`` is a file.
        """
        if self._solo:
            return  # a replica still rejoining holds no step of its own to save; the members write
        if self.protocol_replica is not None:
            checkpoint = {**checkpoint, **checkpoint_entries(self.protocol_replica.protocol.exact)}
        noted = self._noted_checkpoint(filepath)
        if self.sharding.enabled:  # one DCP directory at filepath, every live replica writing ~1/R of it
            with noted:
                save_trainer_checkpoint(self, checkpoint, filepath, storage_options)
        elif self._elect_writer():
            with noted:
                if storage_options is None:
                    self.checkpoint_io.save_checkpoint(checkpoint, filepath)
                else:
                    self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint: the global-zero process through the plugin (``replica_size>1``: one process of the
        lowest live replica removes the directory).

        Args:
            filepath: the checkpoint's path.
        """
        if not self.sharding.enabled:
            return super().remove_checkpoint(filepath)
        # one process removes the directory
        if not self._solo and self._elect_writer() and self._started_replica().inner == 0:
            remove_checkpoint_dir(filepath)
