"""A ``native_io`` storage backend for ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state, storage_writer=UringStorageWriter(path))`` / ``dcp.load(state,
storage_reader=UringStorageReader(path))``. The layout is DCP's own (see ``docs/dcp.md``):

* one ``__<rank>_0.distcp`` per rank, written through ``native_io`` (coalesced, 4 KiB-aligned
  ``O_DIRECT`` extents, ``fdatasync``); every tensor item is a complete ``torch.save`` archive whose
  storage bytes sit at a file offset congruent to the tensor's memory address modulo 4 KiB (so the
  large ones go to the disk from their own memory, uncopied), every bytes item its raw bytes; padding
  between items is invisible to DCP, which locates items by ``(relative_path, offset, length)``;
* ``.metadata`` is exactly what ``FileSystemWriter`` writes (the stock ``FileSystemReader`` loads it);
* ``__<rank>_0.crc.json`` holds the CRC-32C of every extent of every item, verified on load;
* the directory appears atomically: ranks write into ``.<name>.dcp-tmp-<token>`` next to ``path``
  (token chosen by the coordinator and sent with the global plan), and the coordinator's ``finish()``,
  which DCP calls only after every rank's writes completed, writes ``.metadata``, fsyncs, and renames
  the directory onto ``path`` (an atomic exchange when ``path`` already exists).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import errno
import functools
import io
import json
import mmap
import os
import pickle
import secrets
import shutil
import threading
import time
from typing import Any, Optional

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_recover.checkpoint.dcp.snapshot import LazySnapshot
from lightning_recover.checkpoint.engine import open_writer, resolve_engine
from lightning_recover.checkpoint.files import fsync_dir
from lightning_recover.checkpoint.gc_pause import GcPause
from lightning_recover.checkpoint.integrity import CheckpointCorruptError, UnsafeCheckpointError, congruent_offset
from lightning_recover.checkpoint.write_pipeline import WritePipeline

__all__ = [
    "UringStorageWriter",
    "UringStorageReader",
    "verify_dcp_checkpoint",
    "cleanup_dcp_temps",
    "read_dcp_metadata",
    "remove_replaced",
    "wait_for_removals",
    "write_metadata_bytes",
    "write_metadata_file",
]

ALIGN = 4096
SIDECAR_SUFFIX = ".crc.json"
SIDECAR_FORMAT = "lightning-recover-dcp-crc32c"
_TMP_MARK = ".dcp-tmp-"
# hand segments to native_io in batches of about this many bytes: bounds the archives held in memory
_WRITE_BATCH = 64 << 20
# per item, beyond its tensor bytes: archive head + tail (~1.6 KB) and up to 4 KiB of alignment padding
_ITEM_SLACK = 8192
# read contiguous runs of items of at most this many bytes into one staging buffer
_READ_BATCH = 256 << 20
# a hole this large between two wanted items starts a new read run (skip it rather than read it)
_READ_GAP = 1 << 20


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def sidecar_name(relative_path: str) -> str:
    stem = relative_path[: -len(".distcp")] if relative_path.endswith(".distcp") else relative_path
    return stem + SIDECAR_SUFFIX


def temp_dir_for(path: str, token: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}{_TMP_MARK}{token}")


# --------------------------------------------------------------------------------------------------
# tensor archives: the torch.save bytes around the storage are built once per layout


class _ArchiveTemplate:
    """``torch.save`` of a tensor with its storage bytes left out (``skip_data``): head, data offset, tail.

    The archive depends only on dtype, shape and stride, so it is built once per layout and the
    storage bytes are written straight from the tensor's memory between head and tail. The zip
    CRC-32 of the data record is that of the skipped bytes: ``torch.load`` does not check it, our
    CRC-32C sidecar covers the bytes instead.
    """

    __slots__ = ("head", "tail", "nbytes")

    def __init__(self, t: torch.Tensor) -> None:
        buf = io.BytesIO()
        with torch.serialization.skip_data():
            torch.save(t, buf)
        raw = buf.getvalue()
        records = [r for r in torch._C.PyTorchFileReader(io.BytesIO(raw)).get_all_records() if r.startswith("data/")]
        if records != ["data/0"]:  # pragma: no cover - torch changed its archive layout
            raise RuntimeError(f"unexpected torch.save layout {records}; use FileSystemWriter with this torch")
        data_off = torch._C.PyTorchFileReader(io.BytesIO(raw)).get_record_offset("data/0")
        self.nbytes = t.untyped_storage().nbytes()
        self.head = raw[:data_off]
        self.tail = raw[data_off + self.nbytes :]


_TEMPLATES: dict[tuple, _ArchiveTemplate] = {}
_TEMPLATES_LOCK = threading.Lock()


def _template(t: torch.Tensor) -> _ArchiveTemplate:
    key = (t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad)
    tpl = _TEMPLATES.get(key)
    if tpl is None:
        tpl = _ArchiveTemplate(t)
        with _TEMPLATES_LOCK:
            if len(_TEMPLATES) > 65536:  # layouts churn (e.g. varying shapes): keep the cache bounded
                _TEMPLATES.clear()
            _TEMPLATES[key] = tpl
    return tpl


def _size_estimate(items: list) -> int:
    """An upper estimate of a rank's file size from its plan, before any item is resolved (preallocation).

    Tensor items: the chunk's bytes plus its archive head and tail and up to 4 KiB of alignment (bounded by
    ``_ITEM_SLACK``); bytes items are counted as ``_ITEM_SLACK`` (their size is known only once resolved; a
    larger one extends the file past the reservation). The writer truncates to the exact size at close.
    """
    n = 0
    for item in items:
        td = getattr(item, "tensor_data", None)
        if td is not None:
            numel = 1
            for d in td.chunk.sizes:
                numel *= int(d)
            n += numel * td.properties.dtype.itemsize
        n += _ITEM_SLACK
    return n


def _gc_pause(pause_gc: bool | float) -> Optional[GcPause]:
    """The backends' ``pause_gc`` argument: True (the default bound), False, or the bound in seconds."""
    if pause_gc is True:
        return GcPause()
    return GcPause(float(pause_gc)) if pause_gc else None


def _storage_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's storage as bytes, without a copy (any dtype, bf16 included)."""
    u8 = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return memoryview(u8.numpy()).cast("B")


# --------------------------------------------------------------------------------------------------
# writing one rank's file: batches of segments, the next laid out while this one is written (write_pipeline.py)


class _Batch:
    """Segments not handed to ``native_io`` yet, and per item what its sidecar record needs."""

    __slots__ = ("segments", "items", "nbytes")

    def __init__(self) -> None:
        self.segments: list[tuple[int, Any]] = []
        self.items: list[tuple[int, int, str, list[tuple[int, int]], Optional[list]]] = []
        self.nbytes = 0

    def add(self, segments: list, item: tuple) -> None:
        self.segments += segments
        self.items.append(item)
        self.nbytes += item[1]


def _record_batch(records: list[dict], batch: _Batch, crcs: list[int]) -> None:
    """The sidecar records of a written batch, in file order: one CRC-32C per extent (segment)."""
    k = 0
    for off, length, fqn, extents, layout in batch.items:
        n = len(extents)
        rec = {
            "fqn": fqn,
            "offset": off,
            "length": length,
            "extents": [[o, ln, c] for (o, ln), c in zip(extents, crcs[k : k + n])],
        }
        if layout is not None:
            rec["tensor"] = layout  # [dtype, shape, stride, storage_offset] of the archived tensor
        records.append(rec)
        k += n


# --------------------------------------------------------------------------------------------------
# atomic directory commit


def _renameat2_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def commit_dir(tmp: str, path: str) -> None:
    """Make ``tmp`` (complete and durable) visible as ``path`` in one step, then fsync the parent. A previous
    checkpoint at ``path`` is removed in the background (``remove_replaced``)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"{path} exists and is not a checkpoint directory; remove it or choose another path")
        if not _renameat2_exchange(tmp, path):
            # no atomic exchange: move the old one aside first (a crash in between leaves both complete
            # directories, the new one under its temporary name)
            aside = tmp + ".old"
            os.rename(path, aside)
            os.rename(tmp, path)
            fsync_dir(parent)
            remove_replaced(aside, parent)
            return
        fsync_dir(parent)
        remove_replaced(tmp, parent)  # tmp now holds the previous checkpoint
        return
    os.rename(tmp, path)
    fsync_dir(parent)


# A replaced checkpoint is removed off the save's path: rmtree of a 2 GB DCP directory took 0.4 s here, inside
# every save over an existing path. It is first renamed ".<name>.dcp-old-<token>"; a process that ends before
# its removal is done (os._exit skips the wait at exit) leaves it under that name, and the next commit in the
# same directory removes it.
_OLD_MARK = ".dcp-old-"
_REMOVALS: list[threading.Thread] = []
_REMOVALS_LOCK = threading.Lock()


def _remove_all(paths: list[str]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def remove_replaced(old: str, parent: str) -> None:
    """Remove the replaced checkpoint ``old`` (and any left by an earlier process in ``parent``) in a thread."""
    # the checkpoint is committed by now: nothing here may fail the save
    name = os.path.basename(old).lstrip(".").split(_TMP_MARK)[0]
    trash = os.path.join(parent, f".{name}{_OLD_MARK}{secrets.token_hex(6)}")
    try:
        os.rename(old, trash)
    except OSError:
        trash = old
    try:
        found = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(".") and _OLD_MARK in n]
    except OSError:
        found = []
    targets = [trash] + [p for p in found if p != trash]
    t = threading.Thread(target=_remove_all, args=(targets,), name="dcp-remove-replaced", daemon=True)
    with _REMOVALS_LOCK:
        _REMOVALS[:] = [x for x in _REMOVALS if x.is_alive()] + [t]
    t.start()


def wait_for_removals(timeout: Optional[float] = None) -> bool:
    """Wait for the removals of replaced checkpoints started so far; False if ``timeout`` seconds ran out first."""
    with _REMOVALS_LOCK:
        threads = list(_REMOVALS)
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


atexit.register(wait_for_removals, 60.0)


def write_metadata_file(path: str, metadata: Metadata) -> None:
    """``metadata`` pickled to ``path`` as ``FileSystemWriter.finish`` writes ``.metadata`` (``write_metadata_bytes``)."""
    write_metadata_bytes(path, pickle.dumps(metadata))


def write_metadata_bytes(path: str, data: bytes) -> None:
    """``data`` (a pickled ``Metadata``) written as ``FileSystemWriter.finish`` writes ``.metadata``: through
    ``path.tmp``, fsynced, renamed over ``path``, and the directory fsynced."""
    part = path + ".tmp"
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fsync_dir(os.path.dirname(path))


def cleanup_dcp_temps(parent: str) -> list[str]:
    """Remove temporary DCP directories (``.<name>.dcp-tmp-<token>``) left in ``parent`` by failed saves, and
    replaced checkpoints a process ended before removing (``.<name>.dcp-old-<token>``, see ``remove_replaced``).

    Call it when no save into ``parent`` is in progress (e.g. at start-up, before the first save).
    """
    removed = []
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        ours = _TMP_MARK in name or _OLD_MARK in name
        if name.startswith(".") and ours and os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed


# --------------------------------------------------------------------------------------------------
# writer


@dataclasses.dataclass
class UringPrefix(_StoragePrefix):
    """Per-rank storage data of the global plan: file prefix and the temporary directory all ranks share."""

    tmp_token: str = ""


class UringStorageWriter(FileSystemWriter):
    """DCP ``StorageWriter`` writing each rank's items into one file through ``native_io``.

    Subclasses :class:`FileSystemWriter` (planner, staging and ``dcp.async_save`` unchanged). ``engine``:
    None (the shared default engine), an :class:`~lightning_recover.checkpoint.engine.EngineHandle` or a
    ``native_io.IOEngine``. ``overwrite=False`` refuses an existing checkpoint at ``path``.
    ``lazy_snapshot=True``: ``dcp.async_save`` blocks only for tensors under ``eager_bytes`` and copies
    the rest in the background into reused staging buffers (``dcp_snapshot.py``);
    ``cache_staged_state_dict=True`` alone: a blocking copy into the same reused buffers. One save at a
    time per writer instance (wait for a save's ``upload_completion`` before the next through it).
    Needs DCP's collectives (the default): ``use_collectives=False`` gives no coordinator to commit.
    ``pause_gc=True``: Python's cyclic collector is off from this rank's first hook to its last of a save
    run by the main thread (DCP's per-item objects otherwise trigger full collections: ``gc_pause.py``);
    a number: the same, with that many seconds as the bound after the latest hook (default 30).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        engine: Any = None,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
        lazy_snapshot: bool = False,
        eager_bytes: int = 1 << 20,
        pause_gc: bool | float = True,
    ) -> None:
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=True,
            thread_count=1,
            cache_staged_state_dict=False,
            overwrite=overwrite,
            serialization_format=SerializationFormat.TORCH_SAVE,
        )
        self._engine = engine
        self._tmp: Optional[str] = None
        # our own staging whenever it is reused: DCP's cached staging pins memory (fails without a GPU)
        use_ours = lazy_snapshot or cache_staged_state_dict
        self._lazy = LazySnapshot(eager_bytes, lazy=lazy_snapshot) if use_ours else None
        self._gc = _gc_pause(pause_gc)
        self._is_coordinator = False

    # -- staging (dcp.async_save) -----------------------------------------------------------------

    def stage(self, state_dict: dict) -> Any:
        if self._lazy is None:
            return super().stage(state_dict)  # DCP's blocking copy (reused with cache_staged_state_dict)
        return self._lazy.stage(state_dict)

    def wait_for_snapshot(self) -> float:
        """With ``lazy_snapshot=True``: block until the last save's tensors are copied (seconds waited)."""
        return 0.0 if self._lazy is None else self._lazy.wait_for_snapshot()

    @property
    def snapshot_blocked_s(self) -> float:
        """Seconds the last lazy ``stage()`` blocked the caller (0 without ``lazy_snapshot``)."""
        return 0.0 if self._lazy is None else self._lazy.blocked_s

    @property
    def staging_allocations(self) -> int:
        """How many times lazy staging buffers were allocated (a save of the same layout reuses them)."""
        return 0 if self._lazy is None else self._lazy.allocations

    def close(self) -> None:
        if self._lazy is not None:
            self._lazy.close()
        super().close()

    # -- planning ----------------------------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._is_coordinator = is_coordinator
        if self._gc is not None:
            self._gc.pause()  # DCP's first call of a save; resumed after this rank's last (gc_pause.py)
        if self._lazy is not None:
            self._lazy.begin_upload()
        if not self.use_collectives:
            raise ValueError(
                "UringStorageWriter commits the checkpoint directory on the coordinator rank and needs DCP's "
                "collectives: call dcp.save without no_dist/use_collectives=False (or use FileSystemWriter)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        if not self.overwrite and os.path.exists(os.path.join(self.path, ".metadata")):
            raise RuntimeError(f"a checkpoint already exists at {self.path} and overwrite=False; choose a new path")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = secrets.token_hex(6)  # chosen once, on the coordinator, and sent to every rank
        return [dataclasses.replace(p, storage_data=UringPrefix(f"__{i}_", token)) for i, p in enumerate(plans)]

    # -- writing -----------------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        sd = plan.storage_data
        if not isinstance(sd, UringPrefix):
            raise RuntimeError("UringStorageWriter got a plan it did not prepare; use it for every rank of the save")
        self._tmp = tmp = temp_dir_for(str(self.path), sd.tmp_token)
        os.makedirs(tmp, exist_ok=True)
        file_name = f"{sd.prefix}0.distcp"
        fut: Future[list[WriteResult]] = Future()
        done = False
        try:
            if self._lazy is not None:
                self._lazy.check()  # a snapshot raced with an in-place change: fail the save on every rank
            fut.set_result(self._write_file(tmp, file_name, plan, planner))
            done = True
        finally:
            if self._lazy is not None:
                self._lazy.release()
            if self._gc is not None:
                if not done:
                    self._gc.resume()
                elif self._is_coordinator:
                    self._gc.pause()  # its part ends in finish(): the countdown restarts for the wait on the others
                else:
                    self.release_collector_after_exchange()  # no later hook here; DCP still broadcasts the metadata
        return fut

    @staticmethod
    def record_results(metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Set ``metadata``'s version and the storage data of every rank's results, as ``FileSystemWriter.finish``
        does, except that a held dict equal to the new one is kept: with a cached plan's metadata and the same
        layout saved again, the freshly unpickled results then die with this save instead of growing the
        collector's oldest generation (docs/dcp.md, "The collector")."""
        metadata.version = CURRENT_DCP_VERSION
        storage_md = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        if metadata.storage_data != storage_md:
            metadata.storage_data = storage_md

    def release_collector_after_exchange(self) -> None:
        """This rank's last hook of a save has run: the collector comes back after DCP's closing exchange
        (``GcPause.pause_tail``). A subclass that replaces ``finish`` calls it at the end of its own."""
        if self._gc is not None:
            self._gc.pause_tail()

    def _write_file(self, tmp: str, file_name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        results: list[WriteResult] = []
        items_crc: list[dict] = []
        batch = _Batch()
        cursor = 0
        eng, lock = resolve_engine(self._engine)

        # bytes items first, like FileSystemWriter; both kinds keep the plan's order otherwise
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        with lock:
            w = open_writer(eng, os.path.join(tmp, file_name), _size_estimate(items))
            # wait=False: a batch's uncopied transfers run on while the next is submitted (the queue stays
            # full); the writer holds their tensors until close(), before which nothing changes them
            pipe = WritePipeline(lambda b: w.write(b.segments, wait=False), functools.partial(_record_batch, items_crc))
            try:
                for item in items:
                    data = planner.resolve_data(item)
                    layout = None
                    if item.type == WriteItemType.BYTE_IO:
                        if not isinstance(data, io.BytesIO):
                            raise TypeError(f"bytes item {item.index.fqn} resolved to {type(data).__name__}")
                        buf = data.getbuffer()
                        off = _align_up(cursor)
                        segs = [(off, buf)]
                        length = len(buf)
                    else:
                        t = data.detach().cpu()
                        if t.untyped_storage().nbytes() != t.nbytes:
                            t = t.clone()  # a view: save only its bytes, as FileSystemWriter does
                        tpl = _template(t)
                        head = len(tpl.head)
                        off = congruent_offset(cursor + head, t.untyped_storage().data_ptr()) - head
                        segs = [(off, tpl.head)]
                        if tpl.nbytes:
                            segs.append((off + head, _storage_bytes(t)))
                        if tpl.tail:
                            segs.append((off + head + tpl.nbytes, tpl.tail))
                        length = head + tpl.nbytes + len(tpl.tail)
                        if tpl.nbytes:  # lets our reader view the storage bytes in place (extent 1)
                            layout = [str(t.dtype), list(t.shape), list(t.stride()), t.storage_offset()]
                    batch.add(segs, (off, length, item.index.fqn, [(o, len(memoryview(b))) for o, b in segs], layout))
                    cursor = off + length
                    results.append(
                        WriteResult(
                            index=item.index, size_in_bytes=length, storage_data=_StorageInfo(file_name, off, length)
                        )
                    )
                    if batch.nbytes >= _WRITE_BATCH:
                        pipe.send(batch)
                        batch = _Batch()
                if batch.segments:
                    pipe.send(batch)
                pipe.drain()
                w.close(size=cursor)  # truncates the O_DIRECT tail padding, fdatasyncs
            except BaseException:
                pipe.abandon()
                w.close()
                raise
        side = {"format": SIDECAR_FORMAT, "version": 1, "file": file_name, "size": cursor, "items": items_crc}
        side_path = os.path.join(tmp, sidecar_name(file_name))
        with open(side_path, "w") as f:
            f.write(json.dumps(side, separators=(",", ":")))  # one-shot: the C encoder
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)  # this rank's directory entries are durable before it reports success
        return results

    # -- commit ------------------------------------------------------------------------------------

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` exactly as ``FileSystemWriter.finish`` does, into the temporary directory, then
        commit the directory.

        Two differences keep the collector's oldest generation from growing with every save (its growth
        triggers a full collection of the whole heap every few saves: docs/dcp.md, "The collector"): an
        unchanged storage-data dict is kept (``record_results``), and the collector stays paused through DCP's
        broadcast of the metadata that follows (``pause_tail``, as on the other ranks), so the results gathered
        from every rank are freed before it looks at them.
        """
        if self._tmp is None:
            raise RuntimeError("finish() before write_data(): nothing to commit")
        tmp = self._tmp
        try:
            self.record_results(metadata, results)
            metadata.storage_meta = self.storage_meta()
            write_metadata_file(os.path.join(tmp, ".metadata"), metadata)
            commit_dir(tmp, str(self.path))
        except BaseException:
            if self._gc is not None:
                self._gc.resume()
            raise
        self._tmp = None
        self.release_collector_after_exchange()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


# --------------------------------------------------------------------------------------------------
# reader

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _stored_tensor(rec: dict, view: Any) -> Optional[torch.Tensor]:
    """The archived tensor of a sidecar record, viewed in place in the read buffer (no torch.load, no
    copy); None when the record has no layout (empty tensors, older sidecars, bytes items)."""
    layout = rec.get("tensor")
    if not layout or len(rec["extents"]) < 2:
        return None
    dtype_name, shape, stride, storage_offset = layout
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise CheckpointCorruptError(f"item {rec.get('fqn')}: unknown dtype {dtype_name!r} in the checksum sidecar")
    o, ln, _ = rec["extents"][1]  # head, storage bytes, tail
    raw = torch.frombuffer(view(o, o + ln), dtype=torch.uint8)
    return raw.view(dtype).as_strided(shape, stride, storage_offset)


def _whole_target(rec: dict, reqs: list, planner: LoadPlanner) -> Optional[tuple[Any, torch.Tensor]]:
    """``(request, target)`` when one request wants the whole stored tensor into a contiguous CPU target of the
    same dtype and shape: its storage bytes are then read straight into the target (no read buffer, no copy;
    with ``O_DIRECT`` when the target's address agrees with the file offset modulo 4 KiB, as when the saving
    process's allocator placed it like this one's). None otherwise (resharding, dtype change, views).
    """
    layout = rec.get("tensor")
    if not layout or len(rec["extents"]) < 2 or len(reqs) != 1 or reqs[0].type != LoadItemType.TENSOR:
        return None
    req = reqs[0]
    dtype_name, shape, stride, storage_offset = layout
    if storage_offset or any(req.storage_offsets) or list(req.lengths) != list(shape):
        return None
    dtype = _DTYPES.get(dtype_name)
    if dtype is None or list(stride) != list(torch.empty(shape, device="meta").stride()):
        return None
    target = planner.resolve_tensor(req).detach()
    if (
        target.device.type != "cpu"
        or target.dtype != dtype
        or list(target.shape) != list(shape)
        or not target.is_contiguous()
        or target.nbytes != rec["extents"][1][1]
    ):
        return None
    return req, target


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous ``t`` as a writable memoryview (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _load_sidecars(path: str, relative_paths: set[str]) -> dict[str, dict]:
    """Sidecars by relative_path; {} for a stock checkpoint (none at all), an error when only some exist."""
    found: dict[str, dict] = {}
    for rel in sorted(relative_paths):
        p = os.path.join(path, sidecar_name(rel))
        try:
            with open(p) as f:
                side = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise CheckpointCorruptError(
                f"{p}: unreadable checksum sidecar ({e}); the checkpoint is damaged", path=p
            ) from e
        if side.get("format") != SIDECAR_FORMAT or side.get("file") != rel:
            raise CheckpointCorruptError(f"{p}: not a checksum sidecar for {rel}; the checkpoint is damaged", path=p)
        found[rel] = side
    missing = relative_paths - found.keys()
    if found and missing:
        names = ", ".join(sidecar_name(m) for m in sorted(missing))
        raise CheckpointCorruptError(
            f"{path}: checksum sidecar(s) missing: {names}; the checkpoint is incomplete", path=path
        )
    return found


# What a ``.metadata`` pickle may name (measured with torch 2.13: DCP's dataclasses, torch.Size, dtypes,
# the layout decoder, the memory-format enum, the checkpoint path). Anything else is refused.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"DCP .metadata refers to {module}.{name}, which is not a DCP metadata type; refusing to load it"
        )


def read_dcp_metadata(path: str | os.PathLike, file_name: str = ".metadata") -> Metadata:
    """``path/.metadata`` unpickled with an allowlist of DCP's own metadata types (no arbitrary globals).

    Raises :class:`CheckpointCorruptError` when it is missing or unreadable, :class:`UnsafeCheckpointError`
    when it names anything outside the allowlist.
    """
    p = str(path)
    mpath = os.path.join(p, file_name)
    if not os.path.exists(mpath):
        hint = "the directory does not exist" if not os.path.isdir(p) else f"it has no {file_name}"
        raise CheckpointCorruptError(
            f"{p} is not a complete DCP checkpoint: {hint} (a save that did not finish leaves its files under "
            f".{os.path.basename(p)}{_TMP_MARK}*); load the previous checkpoint",
            path=p,
        )
    with open(mpath, "rb") as f:
        try:
            md = _MetadataUnpickler(f).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise CheckpointCorruptError(
                f"{mpath}: unreadable DCP metadata ({type(exc).__name__}: {exc})", path=mpath
            ) from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{mpath}: holds a {type(md).__name__}, not DCP Metadata", path=mpath)
    return md


class UringStorageReader(FileSystemReader):
    """DCP ``StorageReader`` reading through ``native_io`` and verifying CRC-32C sidecars when present.

    Loads checkpoints written by :class:`UringStorageWriter` (verified: a flipped or missing byte raises
    :class:`CheckpointCorruptError` naming the file and item) and by the stock ``FileSystemWriter``
    (no sidecars: loaded unverified, as the stock reader does). ``verify=False`` skips verification.
    ``pause_gc=True``: the cyclic collector is off from planning to the end of ``read_data`` (``gc_pause.py``).
    """

    def __init__(
        self, path: str | os.PathLike, *, engine: Any = None, verify: bool = True, pause_gc: bool | float = True
    ) -> None:
        super().__init__(path)
        self._engine = engine
        self.verify = verify
        self._sidecars: Optional[dict[str, dict]] = None
        self._gc = _gc_pause(pause_gc)

    def set_up_storage_reader(self, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(*args, **kwargs)
        if self._gc is not None:
            self._gc.pause()  # planning and reading of one dcp.load; resumed when read_data ends (gc_pause.py)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._sidecars = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # FileSystemReader.read_metadata is a bare pickle.load; ours allows DCP's metadata types only
        rank = kwargs.get("rank")
        md = read_dcp_metadata(self.path, os.path.basename(self._get_metadata_path(rank)))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _sidecar_index(self) -> dict[str, dict]:
        if self._sidecars is None:
            rels = {sd.relative_path for sd in self.storage_data.values()}
            sides = _load_sidecars(str(self.path), rels) if self.verify else {}
            self._sidecars = {
                rel: {"size": s["size"], "items": {(i["offset"], i["length"]): i for i in s["items"]}}
                for rel, s in sides.items()
            }
        return self._sidecars

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            sinfo: _StorageInfo = self.storage_data[req.storage_index]
            if sinfo.transform_descriptors:
                raise ValueError(f"{sinfo.relative_path}: stream transforms are not supported; use FileSystemReader")
            per_file.setdefault(sinfo.relative_path, []).append(req)
        try:
            sidecars = self._sidecar_index()
            eng, lock = resolve_engine(self._engine)
            for rel, reqs in per_file.items():
                self._read_file(eng, lock, rel, reqs, sidecars.get(rel), planner)
        finally:
            if self._gc is not None:
                self._gc.resume()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, eng: Any, lock: Any, rel: str, reqs: list, side: Optional[dict], planner: LoadPlanner) -> None:
        fpath = os.path.join(str(self.path), rel)
        try:
            size = os.stat(fpath).st_size
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{fpath}: shard file missing; the checkpoint is incomplete", path=fpath
            ) from None
        if side is not None and size != side["size"]:
            raise CheckpointCorruptError(
                f"{fpath}: {size} bytes, its checksum sidecar records {side['size']}: truncated or overwritten shard",
                path=fpath,
            )
        # every distinct (offset, length) once: several read items may come from one saved item
        by_range: dict[tuple[int, int], list] = {}
        for req in reqs:
            s = self.storage_data[req.storage_index]
            by_range.setdefault((s.offset, s.length), []).append(req)
        ranges = sorted(by_range)
        for off, length in ranges:
            if off + length > size:
                fqn = by_range[(off, length)][0].storage_index.fqn
                raise CheckpointCorruptError(
                    f"{fpath}: item {fqn} [{off}, {off + length}) lies past the end of the file ({size} bytes): "
                    "truncated shard",
                    path=fpath,
                    damaged=[{"fqn": fqn, "offset": off, "length": length}],
                )
        # contiguous runs of wanted items, each read into one page-aligned buffer (file offset ≡ buffer offset mod 4 KiB)
        runs: list[list[tuple[int, int]]] = []
        for r in ranges:
            if runs:
                first, last = runs[-1][0], runs[-1][-1]
                if r[0] - (last[0] + last[1]) <= _READ_GAP and r[0] + r[1] - first[0] <= _READ_BATCH:
                    runs[-1].append(r)
                    continue
            runs.append([r])
        spans = [run[-1][0] + run[-1][1] - run[0][0] // ALIGN * ALIGN for run in runs]
        buf = mmap.mmap(-1, max(_align_up(max(spans, default=0)), ALIGN))  # one buffer per file, reused
        with lock:
            reader = eng.open_reader(fpath)
            try:
                for run in runs:
                    base = run[0][0] // ALIGN * ALIGN
                    mv = memoryview(buf)
                    views: list[memoryview] = []  # every slice of buf, released before buf is closed

                    def view(a: int, b: int, mv: memoryview = mv, base: int = base, views: list = views) -> memoryview:
                        v = mv[a - base : b - base]
                        views.append(v)
                        return v

                    try:
                        segs, checks = [], []
                        direct: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
                        for off, length in run:
                            rec = side["items"].get((off, length)) if side is not None else None
                            if side is not None and rec is None:
                                fqn = by_range[(off, length)][0].storage_index.fqn
                                raise CheckpointCorruptError(
                                    f"{fpath}: item {fqn} at {off} has no checksum in {sidecar_name(rel)}: "
                                    "the sidecar does not belong to this checkpoint",
                                    path=fpath,
                                )
                            into = _whole_target(rec, by_range[(off, length)], planner) if rec is not None else None
                            if into is not None:
                                direct[(off, length)] = into
                            extents = rec["extents"] if rec is not None else [[off, length, None]]
                            for i, (o, ln, c) in enumerate(extents):
                                if ln:
                                    # the storage bytes of a whole-tensor read land in the target itself
                                    dest = _tensor_bytes(into[1]) if into is not None and i == 1 else view(o, o + ln)
                                    segs.append((o, dest))
                                    checks.append((c, off, length, o, ln))
                        crcs = reader.read(segs)
                        for got, (want, off, length, o, ln) in zip(crcs, checks):
                            if want is not None and got != want:
                                fqn = by_range[(off, length)][0].storage_index.fqn
                                raise CheckpointCorruptError(
                                    f"{fpath}: item {fqn} (bytes [{o}, {o + ln}) of [{off}, {off + length})) fails its "
                                    f"CRC-32C (stored {want:#010x}, read {got:#010x}): the shard is damaged; load an "
                                    "earlier checkpoint",
                                    path=fpath,
                                    damaged=[{"fqn": fqn, "offset": o, "length": ln, "expected": want, "actual": got}],
                                )
                        for off, length in run:
                            if (off, length) in direct:
                                planner.commit_tensor(*direct[(off, length)])
                                continue
                            rec = side["items"].get((off, length)) if side is not None else None
                            stored = _stored_tensor(rec, view) if rec is not None else None
                            self._deliver(by_range[(off, length)], view(off, off + length), planner, stored)
                            del stored
                    finally:
                        segs = []
                        for v in views:
                            v.release()
                        mv.release()
            finally:
                reader.close()
                buf.close()

    @staticmethod
    def _deliver(reqs: list, data: memoryview, planner: LoadPlanner, tensor: Optional[torch.Tensor]) -> None:
        """``tensor``: the saved tensor viewed in the read buffer (our files), else None (torch.load)."""
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(data)))
                continue
            if tensor is None:
                # torch's weights_only loader, as FileSystemReader does
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            t = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {t.size()}")
            target.copy_(t)
            planner.commit_tensor(req, target)


def verify_dcp_checkpoint(path: str | os.PathLike) -> dict:
    """Check every shard of a DCP checkpoint against its CRC-32C sidecar, reading it through ``native_io``.

    Returns ``{"files": n, "items": n, "bytes": n, "verified": bool}`` (``verified`` False for a
    checkpoint without sidecars, e.g. one written by ``FileSystemWriter``); raises
    :class:`CheckpointCorruptError` naming the file and item on damage.
    """
    path = str(path)
    reader = UringStorageReader(path)
    md = reader.read_metadata()
    reader.storage_data = md.storage_data
    rels = {sd.relative_path for sd in md.storage_data.values()}
    sides = _load_sidecars(path, rels)
    eng, lock = resolve_engine(None)
    n_items = n_bytes = 0
    for rel, side in sides.items():
        fpath = os.path.join(path, rel)
        size = os.stat(fpath).st_size if os.path.exists(fpath) else -1
        if size != side["size"]:
            raise CheckpointCorruptError(f"{fpath}: {size} bytes, its sidecar records {side['size']}", path=fpath)
        with lock:
            with eng.open_reader(fpath) as r:
                for it in side["items"]:
                    for o, ln, c in it["extents"]:
                        if not ln:
                            continue
                        buf = mmap.mmap(-1, _align_up(ln + o % ALIGN))
                        try:
                            with memoryview(buf) as mv:
                                (got,) = r.read([(o, mv[o % ALIGN : o % ALIGN + ln])])
                        finally:
                            buf.close()
                        if got != c:
                            raise CheckpointCorruptError(
                                f"{fpath}: item {it['fqn']} bytes [{o}, {o + ln}) fail their CRC-32C",
                                path=fpath,
                                damaged=[{"fqn": it["fqn"], "offset": o, "length": ln}],
                            )
                    n_items += 1
                    n_bytes += it["length"]
    return {"files": len(rels), "items": n_items, "bytes": n_bytes, "verified": bool(sides)}
