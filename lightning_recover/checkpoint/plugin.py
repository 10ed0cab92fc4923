"""``UringCheckpointIO``: the Lightning ``CheckpointIO`` plugin on the native engine.

Accepted by both ``Trainer`` and ``Fabric`` (``plugins=[UringCheckpointIO()]``); sync saves go
through :mod:`single_file`, ``async_save=True`` through :mod:`async_io`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional

import torch
from lightning.fabric.plugins import CheckpointIO

from lightning_recover.checkpoint.engine import EngineHandle
from lightning_recover.checkpoint.single_file import load, save

log = logging.getLogger(__name__)


class UringCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing the lightning-recover format through ``native_io``.

    Works with ``Trainer(plugins=[UringCheckpointIO()])`` and ``Fabric(plugins=[UringCheckpointIO()])``.

    Args:
        engine: ``native_io`` engine name ("auto", "uring", "portable").
        block_size, queue_depth: engine tuning, None for ``native_io``'s defaults.
        weights_only: default for :meth:`load_checkpoint` when Lightning passes ``weights_only=None``:
            True loads the non-tensor state with an allowlist unpickler; False allows arbitrary pickles.
        verify: check every extent's crc32c on load.
        async_save: lazy asynchronous saves (see ``docs/checkpointing.md``): ``save_checkpoint`` returns after
            pickling the non-tensor state and copying small tensors; large tensors are copied into a staging
            buffer by a background thread while training continues, and written + fdatasync'ed + renamed by a
            second one. Every ``optimizer.step()`` waits until pending snapshots are complete.
        max_pending_bytes: size of the staging buffer (allocated once, reused) for ``async_save``. None: as big
            as the lazily copied part of the checkpoint, so snapshots never wait for the disk. Smaller values
            bound memory; the snapshot then waits for the disk (back-pressure) and ``optimizer.step`` may block.
        eager_bytes: with ``async_save``, storages smaller than this are copied inside ``save_checkpoint``.
    """

    def __init__(
        self,
        engine: str = "auto",
        block_size: Optional[int] = None,
        queue_depth: Optional[int] = None,
        weights_only: bool = True,
        verify: bool = True,
        *,
        async_save: bool = False,
        max_pending_bytes: Optional[int] = None,
        eager_bytes: int = 1 << 20,
    ) -> None:
        super().__init__()
        self.weights_only = weights_only
        self.verify = verify
        self.async_save = async_save
        self._engine = EngineHandle(engine, block_size, queue_depth)
        self._saver: Any = None
        if async_save:
            from lightning_recover.checkpoint.async_io import AsyncSaver

            self._saver = AsyncSaver(
                EngineHandle(engine, block_size, queue_depth), staging_bytes=max_pending_bytes, eager_bytes=eager_bytes
            )
        self._into: Any = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`: it takes no storage options."
            )
        if self._saver is not None:
            self._saver.submit(checkpoint, path)
        else:
            save(checkpoint, path, engine=self._engine)

    # -------------------------------------------------------------- async control
    def wait_for_snapshot(self) -> float:
        """Block until pending asynchronous saves have copied their tensors (seconds waited).

        ``optimizer.step()`` does this automatically; call it before modifying checkpointed tensors in place
        any other way. Raises :class:`~lightning_recover.checkpoint.AsyncCheckpointError` for a failed save.
        """
        return self._saver.wait_for_snapshot() if self._saver is not None else 0.0

    def wait_until_durable(self) -> float:
        """Block until every save so far is on stable storage under its final name (seconds waited)."""
        return self._saver.wait_until_durable() if self._saver is not None else 0.0

    @property
    def pending_saves(self) -> int:
        return self._saver.pending() if self._saver is not None else 0

    @contextlib.contextmanager
    def restore_into(self, state: Any):  # type: ignore[no-untyped-def]
        """Within the block, loads fill the tensors of ``state`` in place where path, shape and dtype match.

        ``state`` is what ``Fabric.load`` takes (``{"model": module, "optimizer": opt, ...}``) or any nesting of
        tensors/state dicts; modules and optimizers are replaced by their ``state_dict()``. Then Fabric's own
        ``load_state_dict`` copies find source and destination identical and copy nothing::

            with io.restore_into(state):
                fabric.load(path, state)
        """
        prev, self._into = self._into, _state_targets(state)
        try:
            yield self
        finally:
            self._into = prev

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load ``path``; ``map_location=None`` keeps tensors on the CPU (like ``TorchCheckpointIO``)."""
        if weights_only is None:
            weights_only = self.weights_only
        if self._saver is not None and self._saver.pending():
            self._saver.wait_until_durable()
        return load(
            path,
            map_location="cpu" if map_location is None else map_location,
            weights_only=weights_only,
            verify=self.verify,
            engine=self._engine,
            into=self._into,
            strict=False,
        )

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path``; with ``async_save`` only once every earlier save is durable (never if one failed)."""
        path = os.fspath(path)
        if self._saver is not None:
            self._saver.remove(path)
            return
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        log.debug("Removed checkpoint: %s", path)

    def teardown(self) -> None:
        """Wait until pending saves are durable (raising a background error), then free engines and staging."""
        try:
            if self._saver is not None:
                self._saver.close()
        finally:
            self._engine.release()


def _state_targets(state: Any) -> Any:
    if isinstance(state, torch.nn.Module):
        return state.state_dict()
    if isinstance(state, torch.optim.Optimizer):
        return state.state_dict()
    if isinstance(state, dict):
        return {k: _state_targets(v) for k, v in state.items()}
    return state
