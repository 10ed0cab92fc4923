"""``UringCheckpointIO`` and ``AsyncUringCheckpointIO``: the Lightning ``CheckpointIO`` plugins on the native engine.

Accepted by both ``Trainer`` and ``Fabric``: ``plugins=[UringCheckpointIO()]`` saves synchronously through
:mod:`single_file`; ``plugins=[AsyncUringCheckpointIO(UringCheckpointIO(...))]`` wraps it, as Lightning's
``AsyncCheckpointIO`` wraps an IO, and saves through :mod:`async_io`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any, Optional

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.cloud_io import _atomic_save, get_filesystem
from lightning.fabric.utilities.cloud_io import _load as _fsspec_load
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback

from lightning_recover.checkpoint.engine import EngineHandle
from lightning_recover.checkpoint.file import async_io
from lightning_recover.checkpoint.file.single_file import load, save
from lightning_recover.checkpoint.file.spare_files import SpareFiles
from lightning_recover.checkpoint.snapshot_guard import EAGER_BYTES

log = logging.getLogger(__name__)

_noted_protocols: set = set()


def local_path(path: Any) -> Optional[str]:
    """The local filesystem path of ``path`` (a plain path or a ``file://`` URL), or None for any other URL."""
    s = os.fspath(path)
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    if "://" not in s and "::" not in s:
        return s
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    fs, p = url_to_fs(s)
    return p if isinstance(fs, LocalFileSystem) else None


def _note_remote(path: str) -> None:
    proto = path.split("://", 1)[0] if "://" in path else path.split("::", 1)[0]
    if proto not in _noted_protocols:
        _noted_protocols.add(proto)
        rank_zero_info(
            f"UringCheckpointIO: {proto}:// paths are saved with torch.save and loaded with torch.load through "
            "fsspec (synchronously, like TorchCheckpointIO); the native io_uring path is for local filesystems."
        )


def _refuse_storage_options(io: CheckpointIO, storage_options: Optional[Any]) -> None:
    if storage_options is not None:
        raise TypeError(  # Lightning's own wording (TorchCheckpointIO), which its tests match
            "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
            f" is not supported for `{io.__class__.__name__}`. Please implement your custom `CheckpointIO`"
            " to define how you'd like to use `storage_options`."
        )


class UringCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing the lightning-recover format through ``native_io``, synchronously.

    Works with ``Trainer(plugins=[UringCheckpointIO()])`` and ``Fabric(plugins=[UringCheckpointIO()])``. A drop-in
    for ``TorchCheckpointIO``: picklable (``ddp_spawn``, ``torch.save(trainer)``, ``copy.deepcopy``: the
    configuration is kept, engines are created again in the new process/copy), non-local paths (``s3://``,
    ``memory://``, ...) go through fsspec with ``torch.save``/``torch.load`` like the stock IO,
    ``remove_checkpoint`` removes directories recursively. Wrap it in :class:`AsyncUringCheckpointIO` to save
    asynchronously. ``spares`` holds the files kept for the next saves
    (:class:`~lightning_recover.checkpoint.file.spare_files.SpareFiles`: none unless ``LIGHTNING_RECOVER_RECYCLE=on``).

    Args:
        engine: ``native_io`` engine name ("auto", the default, "uring", "portable").
        block_size: the engine's transfer size in bytes; None for ``native_io``'s default.
        queue_depth: the engine's transfers in flight; None for ``native_io``'s default.
        weights_only: default for :meth:`load_checkpoint` when Lightning passes ``weights_only=None``:
            True (default) loads the non-tensor state with an allowlist unpickler; False allows arbitrary pickles.
        verify: check every record's CRC-32C on load (default True).
    """

    _RUNTIME = ("_engine", "_into", "spares")  # per process / per copy: never pickled

    def __init__(
        self,
        engine: str = "auto",
        block_size: Optional[int] = None,
        queue_depth: Optional[int] = None,
        weights_only: bool = True,
        verify: bool = True,
    ) -> None:
        super().__init__()
        self.weights_only = weights_only
        self.verify = verify
        self._engine_args = (engine, block_size, queue_depth)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._engine = EngineHandle(*self._engine_args)
        self._into: Any = None
        self.spares = SpareFiles()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def new_engine(self) -> EngineHandle:
        """A new engine handle with this plugin's engine settings, for a writer that needs an engine of its own.

        Returns:
            An :class:`~lightning_recover.checkpoint.engine.EngineHandle` (its engine is created on first use);
            the caller releases it.
        """
        return EngineHandle(*self._engine_args)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (a crash leaves the old file or the new one, never a part).

        A local path is written by the native engine (:func:`~lightning_recover.checkpoint.save`); any other URL
        with ``torch.save`` through fsspec.

        Args:
            checkpoint: what ``torch.save`` takes (Lightning's checkpoint dict).
            path: a local path, a ``file://`` URL or any fsspec URL. Parent directories are created.
            storage_options: not supported (None).

        Raises:
            TypeError: ``storage_options`` is given.
        """
        _refuse_storage_options(self, storage_options)
        local = local_path(path)
        if local is None:
            url = str(path)
            _note_remote(url)
            fs = get_filesystem(url)
            fs.makedirs(os.path.dirname(url), exist_ok=True)
            _atomic_save(checkpoint, url)
            return
        save(checkpoint, local, engine=self._engine, spares=self.spares)

    @contextlib.contextmanager
    def restore_into(self, state: Any) -> Iterator[UringCheckpointIO]:
        """Within the block, loads fill the tensors of ``state`` in place where path, shape and dtype match.

        ``state`` is what ``Fabric.load`` takes (``{"model": module, "optimizer": opt, ...}``) or any nesting of
        tensors/state dicts; modules and optimizers are replaced by their ``state_dict()``. Then Fabric's own
        ``load_state_dict`` copies find source and destination identical and copy nothing::

            with io.restore_into(state):
                fabric.load(path, state)

        Args:
            state: the objects whose tensors are filled.

        Yields:
            This plugin.
        """
        prev, self._into = self._into, _state_targets(state)
        try:
            yield self
        finally:
            self._into = prev

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load ``path``; ``map_location=None`` keeps tensors on the CPU (like ``TorchCheckpointIO``).

        Waits for an asynchronous save of ``path`` still in flight in this process (by any plugin instance),
        and only for that one. A plain ``torch.save`` file is read too (unverified); other URLs through fsspec.

        Args:
            path: a local path, a ``file://`` URL or any fsspec URL.
            map_location: like ``torch.load``'s; None: the CPU.
            weights_only: None: the plugin's ``weights_only``; True: an allowlist unpickler; False: any pickle.

        Returns:
            The checkpoint (with :meth:`restore_into`, holding the given tensors where they were filled).

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            CheckpointCorruptError: a record fails its CRC-32C, or the file is no checkpoint (truncated, foreign).
            CheckpointIncompleteError: the file is empty: an asynchronous save to it did not complete.
            UnsafeCheckpointError: with ``weights_only``, the pickle names a global outside the allowlist.
        """
        if weights_only is None:
            weights_only = self.weights_only
        map_location = "cpu" if map_location is None else map_location
        local = local_path(path)
        if local is None:
            url = str(path)
            _note_remote(url)
            if not get_filesystem(url).exists(url):
                raise FileNotFoundError(f"Checkpoint file not found: {url}")
            return _fsspec_load(url, map_location=map_location, weights_only=weights_only)
        return load(
            local,
            map_location=map_location,
            weights_only=weights_only,
            verify=self.verify,
            engine=self._engine,
            into=self._into,
            strict=False,
        )

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` (a directory recursively; a missing path is fine).

        With ``LIGHTNING_RECOVER_RECYCLE=on``, a local checkpoint file on ext4 or XFS is kept under a hidden
        temporary name instead, and the next save in its directory writes over it (docs/checkpointing.md, "Recycled
        files"); :meth:`teardown` removes what is still kept.

        Args:
            path: a local path, a ``file://`` URL or any fsspec URL.
        """
        local = local_path(path)
        if local is None:
            url = str(path)
            fs = get_filesystem(url)
            if fs.exists(url):
                fs.rm(url, recursive=True)
                log.debug("Removed checkpoint: %s", url)
            return
        local = os.path.abspath(local)
        if not self.spares.keep_removed(local):
            async_io.remove_path(local)

    def teardown(self) -> None:
        """Remove the files kept for the next saves, and free the engine and its staging memory (created again by
        the next save or load)."""
        self.spares.discard()
        self._engine.release()


class AsyncUringCheckpointIO(CheckpointIO):
    """Lazy asynchronous saves around a synchronous :class:`UringCheckpointIO` (Lightning's ``AsyncCheckpointIO`` shape).

    ``save_checkpoint`` returns after pickling the non-tensor state and copying small tensors; large tensors are
    copied into a staging buffer by a background thread while training continues, and written + fdatasync'ed +
    renamed by a second one (see ``docs/checkpointing.md``). Every ``optimizer.step()`` waits until pending
    snapshots are complete. The background threads start with the first save. Loads, ``restore_into`` and
    non-local URLs go to the wrapped IO. Works with ``Trainer(plugins=[AsyncUringCheckpointIO()])`` and
    ``Fabric(plugins=[AsyncUringCheckpointIO(UringCheckpointIO(verify=False))])``; picklable and deep-copyable
    (the configuration is kept, the background threads are created again by the copy's first save).

    An error of a background save is raised by the next ``save_checkpoint``, ``load_checkpoint``,
    ``remove_checkpoint``, ``optimizer.step()``, wait or ``teardown`` (like ``AsyncCheckpointIO``'s, by the next
    save or the teardown).

    Args:
        checkpoint_io: the synchronous IO whose engine settings, ``weights_only`` and ``verify`` apply; None: a
            ``UringCheckpointIO()``.
        max_pending_bytes: size of the staging buffer (allocated once, reused). None: as big as the lazily copied
            part of the checkpoint, so snapshots never wait for the disk. Smaller values bound memory; the snapshot
            then waits for the disk (back-pressure) and ``optimizer.step`` may block.
        eager_bytes: storages smaller than this (bytes, default 1 MiB) are copied inside ``save_checkpoint``.
        flush_bytes_per_s: write the staged tensors at most this fast (bytes per second; None: as fast as the disk
            goes). The save becomes durable later, and what the write costs the training steps is spread over more
            of them (see "Pacing the flush" in ``docs/checkpointing.md``).

    Raises:
        TypeError: ``checkpoint_io`` is not a ``UringCheckpointIO``.
        ValueError: ``max_pending_bytes`` under 4096, or ``flush_bytes_per_s`` not positive.
    """

    _RUNTIME = ("_saver", "_guarded")  # per process / per copy: never pickled

    def __init__(
        self,
        checkpoint_io: Optional[UringCheckpointIO] = None,
        *,
        max_pending_bytes: Optional[int] = None,
        eager_bytes: int = EAGER_BYTES,
        flush_bytes_per_s: Optional[float] = None,
    ) -> None:
        super().__init__()
        if checkpoint_io is None:
            checkpoint_io = UringCheckpointIO()
        if not isinstance(checkpoint_io, UringCheckpointIO):
            raise TypeError(f"AsyncUringCheckpointIO wraps a UringCheckpointIO, not {type(checkpoint_io).__name__}")
        if max_pending_bytes is not None and max_pending_bytes < 4096:
            raise ValueError("max_pending_bytes must be at least 4096")
        self._checkpoint_io = checkpoint_io
        self.max_pending_bytes = max_pending_bytes
        self.eager_bytes = eager_bytes
        self.flush_bytes_per_s = async_io.check_flush_rate(flush_bytes_per_s)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._saver: Any = None  # the AsyncSaver, created by the first local save
        self._guarded: weakref.WeakSet = weakref.WeakSet()  # modules whose load_state_dict waits (guard_loads)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    @property
    def checkpoint_io(self) -> UringCheckpointIO:
        """The wrapped synchronous IO (loads, ``restore_into`` and non-local URLs go through it)."""
        return self._checkpoint_io

    def _async_saver(self) -> Any:
        if self._saver is None:
            self._saver = async_io.AsyncSaver(
                self._checkpoint_io.new_engine(),
                staging_bytes=self.max_pending_bytes,
                eager_bytes=self.eager_bytes,
                flush_bytes_per_s=self.flush_bytes_per_s,
                spares=self._checkpoint_io.spares,
            )
        return self._saver

    def _raise_errors(self) -> None:
        if self._saver is not None:
            self._saver.raise_errors()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Start an atomic save of ``checkpoint`` to ``path`` and return once its snapshot is taken or referenced.

        A local path is saved in the background (the lazy snapshot); any other URL goes to the wrapped IO,
        synchronously, after earlier failures are raised.

        Args:
            checkpoint: what ``torch.save`` takes (Lightning's checkpoint dict).
            path: a local path, a ``file://`` URL or any fsspec URL. Parent directories are created.
            storage_options: not supported (None).

        Raises:
            TypeError: ``storage_options`` is given.
            AsyncCheckpointError: an earlier save failed.
        """
        _refuse_storage_options(self, storage_options)
        local = local_path(path)
        if local is None:
            self._raise_errors()
            self._checkpoint_io.save_checkpoint(checkpoint, path)
            return
        _attach_barrier(self)
        self._async_saver().submit(checkpoint, local)

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Raise an earlier save's failure, then load ``path`` with the wrapped IO.

        A save of ``path`` still in flight in this process (by any plugin) is waited for, and only that one.

        Args:
            path: a local path, a ``file://`` URL or any fsspec URL.
            map_location: like ``torch.load``'s; None: the CPU.
            weights_only: None: the wrapped IO's ``weights_only``; True: an allowlist unpickler; False: any pickle.

        Returns:
            The checkpoint, as :meth:`UringCheckpointIO.load_checkpoint` returns it.

        Raises:
            AsyncCheckpointError: an earlier asynchronous save of this plugin failed.
            FileNotFoundError: no checkpoint at ``path``.
            CheckpointCorruptError: a record fails its CRC-32C, or the file is no checkpoint (truncated, foreign).
            CheckpointIncompleteError: the file is empty: an asynchronous save to it did not complete.
            UnsafeCheckpointError: with ``weights_only``, the pickle names a global outside the allowlist.
        """
        self._raise_errors()
        return self._checkpoint_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @contextlib.contextmanager
    def restore_into(self, state: Any) -> Iterator[AsyncUringCheckpointIO]:
        """The wrapped IO's :meth:`UringCheckpointIO.restore_into`: loads fill the tensors of ``state`` in place.

        Args:
            state: the objects whose tensors are filled.

        Yields:
            This plugin.
        """
        with self._checkpoint_io.restore_into(state):
            yield self

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` (a directory recursively; a missing path is fine).

        A local path only once every earlier save is durable (never if one failed); another URL at once.

        Args:
            path: a local path, a ``file://`` URL or any fsspec URL.

        Raises:
            AsyncCheckpointError: an earlier save or removal failed.
        """
        local = local_path(path)
        if local is not None and self._saver is not None:
            self._saver.remove(local)
            return
        self._checkpoint_io.remove_checkpoint(path)

    def wait_for_snapshot(self) -> float:
        """Block until pending asynchronous saves have copied their tensors.

        ``optimizer.step()`` does this automatically; call it before modifying checkpointed tensors in place
        any other way.

        Returns:
            The seconds waited (0.0 before the first save).

        Raises:
            AsyncCheckpointError: an asynchronous save failed.
        """
        return self._saver.wait_for_snapshot() if self._saver is not None else 0.0

    def wait_until_durable(self) -> float:
        """Block until every save so far is on stable storage under its final name.

        Returns:
            The seconds waited (0.0 before the first save).

        Raises:
            AsyncCheckpointError: an asynchronous save failed.
        """
        return self._saver.wait_until_durable() if self._saver is not None else 0.0

    def guard_loads(self, module: torch.nn.Module) -> None:
        """Make ``load_state_dict`` of ``module`` and of each of its submodules wait for pending lazy snapshots.

        ``load_state_dict`` copies into the parameters in place. Lightning's ModelCheckpoint does that right after a
        save under manual optimization (it loads the pre-step state for the save and the current state back right
        after), so a lazy snapshot still copying would see the restored values (``SnapshotRaceError``). The
        ``Trainer`` calls this for its LightningModule at the first asynchronous save; call it for a module that a
        Fabric or plain loop changes with ``load_state_dict`` while a save may be in flight. A hook per module that
        checks for a pending snapshot and returns: no cost on the training step.

        Args:
            module: the module; each of its submodules is guarded once.
        """
        wait = _WaitForSnapshot(self)
        for m in module.modules():
            if m not in self._guarded:
                m.register_load_state_dict_pre_hook(wait)
                self._guarded.add(m)

    @property
    def pending_saves(self) -> int:
        """How many asynchronous saves are not durable yet."""
        return self._saver.pending() if self._saver is not None else 0

    @property
    def history(self) -> list[dict[str, Any]]:
        """Timings of the last finished saves, oldest first (``path``, ``snapshot_s``, ``durable_s``, ``t_submit``,
        ``t_snapshot``, ``t_durable`` on ``time.perf_counter``'s clock, ``direct``, ``unstaged_bytes``, ``error``);
        empty before the first save."""
        return list(self._saver.history) if self._saver is not None else []

    def teardown(self) -> None:
        """Wait until pending saves are durable, stop the background threads, then tear the wrapped IO down.

        Raises:
            AsyncCheckpointError: an asynchronous save failed.
        """
        try:
            if self._saver is not None:
                self._saver.close()
        finally:
            self._checkpoint_io.teardown()


class _SnapshotBarrier(Callback):
    """Waits for pending lazy snapshots before Lightning hooks that may change checkpointed tensors in place.

    Inserted first in ``trainer.callbacks`` by the first asynchronous save of a ``Trainer``, so it runs before
    e.g. ``WeightAveraging``, which swaps the current and averaged weights at ``on_validation_start`` and copies
    the average into the model at ``on_train_end`` through ``param.data`` (invisible to version counters). All
    are once-per-epoch hooks, except ``on_train_batch_end``, where the optimizer step has already waited.
    """

    def __init__(self, io: AsyncUringCheckpointIO) -> None:
        self.io = io

    def _wait(self, *_: Any, **__: Any) -> None:
        self.io.wait_for_snapshot()

    on_train_batch_end = _wait
    on_train_epoch_end = _wait
    on_validation_start = _wait
    on_test_start = _wait
    on_predict_start = _wait
    on_train_end = _wait


class _WaitForSnapshot:
    """A ``load_state_dict`` pre-hook (``guard_loads``): waits for the plugin's pending snapshots.

    Holds the plugin weakly and pickles as a hook that does nothing (a pickled or copied module has no snapshot
    of this process in flight), so modules stay picklable.
    """

    def __init__(self, io: Optional[AsyncUringCheckpointIO] = None) -> None:
        self._io = weakref.ref(io) if io is not None else None

    def __call__(self, *_: Any) -> None:
        io = self._io() if self._io is not None else None
        saver = getattr(io, "_saver", None)
        if saver is not None and saver.snapshot_pending():
            saver.wait_for_snapshot()

    def __reduce__(self) -> tuple:
        return (_WaitForSnapshot, ())


def _attach_barrier(io: AsyncUringCheckpointIO) -> None:
    """If this save comes from ``Trainer.save_checkpoint``, make sure that trainer runs a ``_SnapshotBarrier`` and
    that its LightningModule's ``load_state_dict`` waits for pending snapshots (``guard_loads``)."""
    code = Trainer.save_checkpoint.__code__
    f: Optional[FrameType] = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return
        if f.f_code is code:
            trainer = f.f_locals.get("self")
            cbs = getattr(trainer, "callbacks", None)
            if (
                trainer is not None
                and isinstance(cbs, list)
                and not any(isinstance(c, _SnapshotBarrier) and c.io is io for c in cbs)
            ):
                # a new list: Lightning may be iterating over the current one right now
                trainer.callbacks = [_SnapshotBarrier(io), *cbs]
            module = getattr(trainer, "lightning_module", None)
            if isinstance(module, torch.nn.Module) and module not in io._guarded:
                io.guard_loads(module)
            return
        f = f.f_back


def _state_targets(state: Any) -> Any:
    if isinstance(state, torch.nn.Module):
        return state.state_dict()
    if isinstance(state, torch.optim.Optimizer):
        return state.state_dict()
    if isinstance(state, dict):
        return {k: _state_targets(v) for k, v in state.items()}
    return state
