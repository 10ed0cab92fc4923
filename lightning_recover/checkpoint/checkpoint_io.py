"""Saving and loading lightning-recover checkpoints through ``native_io``, and the Lightning plugin.

``save``/``load`` are the functional API; :class:`UringCheckpointIO` is the
``lightning.fabric.plugins.CheckpointIO`` plugin (accepted by both ``Trainer`` and ``Fabric``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
import time
from typing import Any, Optional

import torch
from lightning.fabric.plugins import CheckpointIO

from lightning_recover.checkpoint import format as fmt
from lightning_recover.checkpoint.format import CheckpointCorruptError, UnsafeCheckpointError

log = logging.getLogger(__name__)

__all__ = [
    "UringCheckpointIO",
    "save",
    "load",
    "read_info",
    "verify_file",
    "CheckpointInfo",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
]

# storages living on an accelerator are staged to host memory in batches of at most this many bytes
_DEVICE_STAGING_BYTES = 256 << 20
# temporary files: ".<final name>.tmp-<pid>-<8 hex>" in the destination directory
_TMP_RE = re.compile(r"^\..+\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


# ------------------------------------------------------------------------------------ engines


class _Engine:
    """A lazily created ``native_io.IOEngine`` (its staging arena is reused) and a lock serialising its use."""

    def __init__(self, engine: str = "auto", block_size: Optional[int] = None,
                 queue_depth: Optional[int] = None, direct: bool = True) -> None:
        self.kwargs: dict[str, Any] = {"engine": engine, "direct": direct}
        if block_size is not None:
            self.kwargs["block_size"] = block_size
        if queue_depth is not None:
            self.kwargs["queue_depth"] = queue_depth
        self._engine: Any = None
        self.lock = threading.RLock()

    def get(self) -> Any:
        if self._engine is None:
            import native_io

            self._engine = native_io.IOEngine(**self.kwargs)
        return self._engine

    def release(self) -> None:
        """Free the engine (and its staging arena); the next use creates a new one."""
        with self.lock:
            eng, self._engine = self._engine, None
            if eng is not None and hasattr(eng, "close"):
                eng.close()


_default = _Engine()


def _resolve_engine(engine: Any) -> tuple[Any, Any]:
    """(IOEngine, lock) for ``engine``: None (shared default), an ``_Engine`` or an ``IOEngine`` instance."""
    if engine is None:
        engine = _default
    if isinstance(engine, _Engine):
        return engine.get(), engine.lock
    if isinstance(engine, str):
        raise TypeError("pass an IOEngine instance (or None), not an engine name; use UringCheckpointIO(engine=...)")
    return engine, threading.RLock()


# ------------------------------------------------------------------------------- temp files


def _process_start_time() -> float:
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except Exception:  # pragma: no cover - non-Linux
        return _IMPORT_TIME


_IMPORT_TIME = time.time()
_PROCESS_START = _process_start_time()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_path_for(path: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    return _TMP_RE.match(name) is not None


def cleanup_stale_temps(directory: str) -> list[str]:
    """Remove our own temporary files left in ``directory`` by crashed saves.

    Only names matching ``.NAME.tmp-<pid>-<8 hex>`` are touched, never those of this process, and only
    when their pid is dead or the file is older than this process.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me = os.getpid()
    for name in names:
        m = _TMP_RE.match(name)
        if m is None:
            continue
        pid = int(m.group("pid"))
        if pid == me:
            continue
        full = os.path.join(directory, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if not (os.path.isfile(full) and not os.path.islink(full)):
            continue
        if _pid_alive(pid) and st.st_mtime >= _PROCESS_START:
            continue
        try:
            os.unlink(full)
            removed.append(full)
            log.info("removed stale temporary checkpoint file %s", full)
        except OSError:
            pass
    return removed


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------- save


def _host_bytes(storage: Any) -> Any:
    """A buffer-protocol object over the bytes of a CPU ``UntypedStorage``."""
    return fmt.storage_as_bytes(storage).numpy()


def _plan(checkpoint: Any) -> tuple[fmt.EncodedCheckpoint, int]:
    """Encode ``checkpoint`` (skeleton pickled now) and assign file offsets; returns (encoded, data_end)."""
    enc = fmt.encode_checkpoint(checkpoint, meta=fmt.file_meta())
    offsets, data_end = fmt.plan_layout([s.nbytes for s in enc.index.storages])
    for entry, off in zip(enc.index.storages, offsets):
        entry.offset = off
    return enc, data_end


def _write_tail(w: Any, enc: fmt.EncodedCheckpoint, data_end: int, file_id: bytes) -> None:
    """Write index, skeleton and footer (extent crcs must be set in ``enc.index``), then close + fdatasync."""
    index_bytes = fmt.encode_index(enc.index)
    index_offset = fmt.align_up(data_end, fmt.SMALL_ALIGN)
    skeleton_offset = index_offset + len(index_bytes)
    meta_crc = fmt._crc32c(enc.skeleton, fmt._crc32c(index_bytes))
    footer = fmt.encode_footer(fmt.Footer(
        fmt.FORMAT_VERSION, 0, index_offset, len(index_bytes), skeleton_offset, len(enc.skeleton),
        data_end, meta_crc, file_id,
    ))
    w.write([(index_offset, index_bytes + enc.skeleton + footer)])
    w.close(size=skeleton_offset + len(enc.skeleton) + len(footer))


def _commit(tmp: str, path: str) -> None:
    """Rename a durable temporary onto ``path`` and fsync the directory."""
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def save(checkpoint: Any, path: Any, *, engine: Any = None) -> None:
    """Write ``checkpoint`` (any nesting of containers, primitives and tensors) to ``path`` atomically.

    The file is written to a temporary name in the same directory, fdatasync'ed, renamed into place and the
    directory fsync'ed: a crash leaves either the previous file or the new one under ``path``, never a
    partial one. Parent directories are created.
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    enc, data_end = _plan(checkpoint)
    cleanup_stale_temps(directory)

    file_id = secrets.token_bytes(16)
    eng, lock = _resolve_engine(engine)
    tmp = temp_path_for(path)
    try:
        with lock:
            with eng.open_writer(tmp) as w:
                pending: list = [(0, fmt.encode_header(file_id))]
                pending_ids: list = [None]
                staged = 0

                def flush() -> None:
                    nonlocal pending, pending_ids, staged
                    if pending:
                        crcs = w.write(pending)
                        for i, crc in zip(pending_ids, crcs):
                            if i is not None:
                                enc.index.storages[i].crc32c = int(crc)
                    pending, pending_ids, staged = [], [], 0

                for i, (st, entry) in enumerate(zip(enc.storages, enc.index.storages)):
                    if entry.nbytes == 0:
                        continue
                    if st.device.type != "cpu":
                        if staged + entry.nbytes > _DEVICE_STAGING_BYTES:
                            flush()
                        st = st.cpu()
                        staged += entry.nbytes
                    pending.append((entry.offset, _host_bytes(st)))
                    pending_ids.append(i)
                flush()
                _write_tail(w, enc, data_end, file_id)
        os.rename(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    _fsync_dir(directory)


# ------------------------------------------------------------------------------------- load


class CheckpointInfo:
    """Header, footer, index and skeleton bytes of a checkpoint (no tensor data read)."""

    def __init__(self, path: str, size: int, header: fmt.Header, footer: fmt.Footer, index: fmt.Index,
                 skeleton: bytes) -> None:
        self.path, self.size, self.header, self.footer, self.index, self.skeleton = (
            path, size, header, footer, index, skeleton)


def _open_reader(eng: Any, path: str) -> Any:
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"Checkpoint file not found: {path}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, f"Checkpoint path is a directory: {path}", path)
    return eng.open_reader(path)


def _read_info(r: Any, path: str) -> CheckpointInfo:
    size = r.size
    if size < fmt.HEADER_SIZE + fmt.FOOTER_SIZE:
        head = bytearray(min(size, fmt.HEADER_SIZE))
        if size:
            r.read([(0, head)])
        if size >= 8 and bytes(head[:8]) != fmt.HEADER_MAGIC:
            fmt.decode_header(bytes(head) + bytes(64), path)  # raises the "foreign" message
        raise CheckpointCorruptError(f"{path}: file too small ({size} bytes) to be a checkpoint (truncated?)", path)
    head = bytearray(fmt.HEADER_SIZE)
    tail = bytearray(fmt.FOOTER_SIZE)
    r.read([(0, head), (size - fmt.FOOTER_SIZE, tail)])
    header = fmt.decode_header(bytes(head), path)
    footer = fmt.decode_footer(bytes(tail), size, header, path)
    meta = bytearray(footer.index_length + footer.skeleton_length)
    (crc,) = r.read([(footer.index_offset, meta)])
    if crc != footer.meta_crc32c:
        raise CheckpointCorruptError(
            f"{path}: index/skeleton checksum mismatch at offset {footer.index_offset} "
            f"(+{len(meta)} bytes): damaged index or skeleton", path)
    index = fmt.decode_index(bytes(meta[: footer.index_length]), header.data_start, footer.data_end, path)
    return CheckpointInfo(path, size, header, footer, index, bytes(meta[footer.index_length:]))


def read_info(path: Any, *, engine: Any = None) -> CheckpointInfo:
    """Validate header/footer/index of ``path`` and return them (tensor data is not read)."""
    path = os.fspath(path)
    eng, lock = _resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            return _read_info(r, path)
        finally:
            r.close()


def verify_file(path: Any, *, engine: Any = None, batch_bytes: int = 256 << 20) -> tuple[CheckpointInfo, list]:
    """Read every extent of ``path`` and return ``(info, damaged extents)`` (bounded memory)."""
    path = os.fspath(path)
    eng, lock = _resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            info = _read_info(r, path)
            bad: list = []
            batch: list = []
            ids: list = []
            total = 0

            def run() -> None:
                nonlocal batch, ids, total
                if batch:
                    bad.extend(fmt.damaged_extents(info.index, r.read(batch), path, ids))
                batch, ids, total = [], [], 0

            for i, s in enumerate(info.index.storages):
                if s.nbytes == 0:
                    continue
                if total and total + s.nbytes > batch_bytes:
                    run()
                batch.append((s.offset, bytearray(s.nbytes)))
                ids.append(i)
                total += s.nbytes
            run()
            return info, bad
        finally:
            r.close()


# Opt-in: fresh storages of at least _ALIGNED_MIN_BYTES allocated 4096-aligned (see _new_storage).
_ALIGNED_MIN_BYTES = 1 << 20
_PAGE = 4096
_ALIGNED_ALLOC = os.environ.get("LIGHTNING_RECOVER_ALIGNED_ALLOC", "off") == "on"


def _new_storage(nbytes: int) -> torch.UntypedStorage:
    """A fresh CPU storage of exactly ``nbytes`` to read an extent into.

    ``torch.UntypedStorage(n)`` memory sits at 64 mod 4096 (the CPU allocator's alignment is 64), so
    ``native_io``'s reader cannot read it with ``O_DIRECT`` straight into it and stages every byte
    through its arena plus a copy. With ``LIGHTNING_RECOVER_ALIGNED_ALLOC=on`` storages of >= 1 MiB
    are instead carved 4096-aligned out of a torch allocation over-sized by 4096 bytes, so the
    reader's zero-copy path is taken: the storage starts at the aligned address, has ``nbytes()`` ==
    ``nbytes`` and keeps the allocation alive (released with the storage); it cannot grow (``resize_``
    to a larger size raises, as for ``torch.load(mmap=True)`` or safetensors storages).

    Off by default: on the benchmark VM (virtio disk, max_segments 254) the zero-copy reads into
    scattered 4 KiB user pages reach the device as smaller requests than the arena's and measured
    slower in wall time (docs/benchmarks.md, "Checkpoint I/O"), although they save the copy's CPU.
    """
    if nbytes < _ALIGNED_MIN_BYTES or not _ALIGNED_ALLOC:
        return torch.UntypedStorage(nbytes)
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    a = (-raw.data_ptr()) % _PAGE
    return torch.from_numpy(raw[a:a + nbytes].numpy()).untyped_storage()


def _is_contiguous(shape: list, stride: list) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _into_targets(into: Any) -> dict[str, torch.Tensor]:
    return {p: t for p, t in fmt.tensor_paths(into).values()}


def load(path: Any, map_location: Any = None, *, weights_only: bool = True, verify: bool = True,
         into: Any = None, strict: bool = True, engine: Any = None) -> Any:
    """Load a checkpoint written by :func:`save`.

    Args:
        path: the checkpoint file.
        map_location: like ``torch.load``: None (the saved devices), a device/str, a dict
            ``{saved: target}`` or a callable ``(storage, location) -> storage``.
        weights_only: True (default) unpickles the skeleton with an allowlist (no arbitrary code runs);
            False allows any pickled object: only for checkpoints you trust.
        verify: compare every extent with its crc32c (raises :class:`CheckpointCorruptError`).
        into: a nested structure like the checkpoint (e.g. ``{"state_dict": model.state_dict()}``); tensors at
            the same paths with the same shape and dtype are filled in place (read straight into them when
            possible) and returned in the result instead of new tensors. With ``strict``, a shape/dtype
            mismatch raises ``ValueError``; otherwise a new tensor is loaded for that path. With ``verify``
            a checksum error is raised after the data has landed in those tensors.
    """
    path = os.fspath(path)
    eng, lock = _resolve_engine(engine)
    targets = _into_targets(into) if into is not None else {}
    with lock:
        r = _open_reader(eng, path)
        try:
            info = _read_info(r, path)
            index = info.index
            users = [0] * len(index.storages)
            for t in index.tensors:
                users[t.storage] += 1

            # where each tensor's data goes: direct read into a target, or a fresh storage then copy_
            direct: dict[int, torch.Tensor] = {}   # storage index -> target tensor filled by the read
            copy_into: dict[int, torch.Tensor] = {}  # tensor index -> target tensor to copy_ into
            for ti, t in enumerate(index.tensors):
                dest = targets.get(t.name)
                if dest is None:
                    continue
                dt = fmt.dtype_from_name(t.dtype)
                if list(dest.shape) != list(t.shape) or dest.dtype != dt:
                    if strict:
                        raise ValueError(
                            f"{path}: cannot load {t.name!r} into the given tensor: checkpoint has "
                            f"{dt} {tuple(t.shape)}, target is {dest.dtype} {tuple(dest.shape)}")
                    continue
                contiguous_whole = (
                    t.storage_offset == 0 and t.nbytes > 0 and t.nbytes == index.storages[t.storage].nbytes
                    and _is_contiguous(t.shape, t.stride))
                if (contiguous_whole and users[t.storage] == 1 and dest.device.type == "cpu"
                        and dest.is_contiguous()):
                    direct[t.storage] = dest
                else:
                    copy_into[ti] = dest

            storages: list = []
            segs: list = []
            seg_ids: list = []
            for i, s in enumerate(index.storages):
                if i in direct:
                    d = direct[i]
                    buf = d.detach().reshape(-1).view(torch.uint8)
                    storages.append(d.untyped_storage())
                else:
                    st = _new_storage(s.nbytes)
                    buf = fmt.storage_as_bytes(st)
                    storages.append(st)
                if s.nbytes:
                    segs.append((s.offset, buf.numpy()))
                    seg_ids.append(i)
            crcs = r.read(segs) if segs else []
        finally:
            r.close()
    if verify:
        bad = fmt.damaged_extents(index, crcs, path, seg_ids)
        if bad:
            raise CheckpointCorruptError(fmt.describe_damage(bad, path), path, bad)

    where = fmt.map_location_fn(map_location)
    placed = []
    for i, (s, st) in enumerate(zip(index.storages, storages)):
        placed.append(st if i in direct else fmt.place_storage(st, s.device, where(s.device)))
    tensors = fmt.rebuild_tensors(index, placed, path)
    for ti, t in enumerate(index.tensors):
        if t.storage in direct:
            tensors[ti] = direct[t.storage]
        elif ti in copy_into:
            with torch.no_grad():
                copy_into[ti].copy_(tensors[ti])
            tensors[ti] = copy_into[ti]
    return fmt.decode_skeleton(info.skeleton, tensors, weights_only=weights_only, path=path)


# ----------------------------------------------------------------------------------- plugin


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

    def __init__(self, engine: str = "auto", block_size: Optional[int] = None, queue_depth: Optional[int] = None,
                 weights_only: bool = True, verify: bool = True, *, async_save: bool = False,
                 max_pending_bytes: Optional[int] = None, eager_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.weights_only = weights_only
        self.verify = verify
        self.async_save = async_save
        self._engine = _Engine(engine, block_size, queue_depth)
        self._saver: Any = None
        if async_save:
            from lightning_recover.checkpoint.async_io import AsyncSaver

            self._saver = AsyncSaver(_Engine(engine, block_size, queue_depth), staging_bytes=max_pending_bytes,
                                     eager_bytes=eager_bytes)
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

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load ``path``; ``map_location=None`` keeps tensors on the CPU (like ``TorchCheckpointIO``)."""
        if weights_only is None:
            weights_only = self.weights_only
        if self._saver is not None and self._saver.pending():
            self._saver.wait_until_durable()
        return load(path, map_location="cpu" if map_location is None else map_location,
                    weights_only=weights_only, verify=self.verify, engine=self._engine, into=self._into,
                    strict=False)

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
