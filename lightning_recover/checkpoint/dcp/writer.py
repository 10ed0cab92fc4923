"""A ``native_io`` storage backend for ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state, storage_writer=UringStorageWriter(path))`` / ``dcp.load(state,
storage_reader=UringStorageReader(path))``. The layout is DCP's own (see ``docs/dcp.md``):

* one ``__<rank>_0.distcp`` per rank, written through ``native_io`` (coalesced, 4 KiB-aligned
  ``O_DIRECT`` extents, ``fdatasync``); every tensor item is a complete ``torch.save`` archive whose
  storage bytes sit at a file offset congruent to the tensor's memory address modulo 4 KiB (so the
  large ones go to the disk from their own memory, uncopied), every bytes item its raw bytes; padding
  between items is invisible to DCP, which locates items by ``(relative_path, offset, length)``;
* ``.metadata`` is exactly what ``FileSystemWriter`` writes (the stock ``FileSystemReader`` loads it);
* ``__<rank>_0.crc.json`` holds the CRC-32C of every extent of every item, verified on load; ``.metadata``
  records that they were written (``storage_meta.modules`` holds ``SIDECARS_RECORDED``), so a checkpoint of ours
  whose sidecars are gone is refused (``reader.SidecarsMissingError``) rather than loaded unverified like a stock one;
* the directory appears atomically: ranks write into ``.<name>.dcp-tmp-<token>`` next to ``path``
  (token chosen by the coordinator and sent with the global plan), and the coordinator's ``finish()``,
  which DCP calls only after every rank's writes completed, writes ``.metadata``, fsyncs, and renames
  the directory onto ``path`` (an atomic exchange when ``path`` already exists).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import pickle
import secrets
import shutil
import threading
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemWriter,
    SerializationFormat,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_recover.checkpoint.dcp.snapshot import LazySnapshot
from lightning_recover.checkpoint.engine import open_writer, resolve_engine
from lightning_recover.checkpoint.files import DIR_TMP_MARK as TMP_MARK
from lightning_recover.checkpoint.files import (
    OLD_MARK,
    commit,
    commit_dir,
    fsync_dir,
    remove_replaced,
    wait_for_removals,
)
from lightning_recover.checkpoint.gc_pause import GcPause
from lightning_recover.checkpoint.integrity import congruent_offset
from lightning_recover.checkpoint.snapshot_guard import EAGER_BYTES
from lightning_recover.checkpoint.write_pipeline import WritePipeline

__all__ = [
    "UringStorageWriter",
    "sidecar_storage_meta",
    "sidecars_recorded",
    "cleanup_dcp_temps",
    "remove_replaced",
    "wait_for_removals",
    "write_metadata_bytes",
    "write_metadata_file",
]

ALIGN = 4096
SIDECAR_SUFFIX = ".crc.json"
SIDECAR_FORMAT = "lightning-recover-dcp-crc32c"
# in ``.metadata``'s ``storage_meta.modules`` (a list of names DCP itself leaves alone): this checkpoint's shards
# have CRC-32C sidecars. Without it a reader cannot tell a checkpoint whose sidecars were deleted from a stock one.
# The value is a tag stored in checkpoints (it names the module that wrote it before the split), not an import path.
SIDECARS_RECORDED = "lightning_recover.checkpoint.dcp:crc32c-sidecars"
# hand segments to native_io in batches of about this many bytes: bounds the archives held in memory
_WRITE_BATCH = 64 << 20
# per item, beyond its tensor bytes: archive head + tail (~1.6 KB) and up to 4 KiB of alignment padding
_ITEM_SLACK = 8192


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def sidecar_storage_meta(checkpoint_id: Any = None, save_id: Optional[str] = None) -> StorageMeta:
    """The ``storage_meta`` of a checkpoint whose shards have sidecars (every writer of ours uses it)."""
    return StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id, modules=[SIDECARS_RECORDED])


def sidecars_recorded(metadata: Metadata) -> bool:
    """Whether ``metadata`` says its checkpoint was written with CRC-32C sidecars."""
    sm = getattr(metadata, "storage_meta", None)
    return SIDECARS_RECORDED in (getattr(sm, "modules", None) or ())


def sidecar_name(relative_path: str) -> str:
    stem = relative_path[: -len(".distcp")] if relative_path.endswith(".distcp") else relative_path
    return stem + SIDECAR_SUFFIX


def temp_dir_for(path: str, token: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}{TMP_MARK}{token}")


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
        reader = torch._C.PyTorchFileReader(io.BytesIO(raw))
        data_off = reader.get_record_offset("data/0")  # type: ignore[attr-defined]  # in torch, not in its stubs
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


def gc_pause_for(pause_gc: bool | float) -> Optional[GcPause]:
    """The backends' ``pause_gc`` argument: True (the default bound), False, or the bound in seconds."""
    if pause_gc is True:
        return GcPause()
    return GcPause(float(pause_gc)) if pause_gc else None


def _storage_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's storage as bytes, without a copy (any dtype, bf16 included)."""
    u8 = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return u8.numpy().data.cast("B")


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
    commit(part, path)


def cleanup_dcp_temps(parent: str) -> list[str]:
    """Remove temporary DCP directories (``.<name>.dcp-tmp-<token>``) left in ``parent`` by failed saves, and
    replaced checkpoints a process ended before removing (``.<name>.dcp-old-<token>``, see ``remove_replaced``).

    Call it when no save into ``parent`` is in progress (e.g. at start-up, before the first save).

    Args:
        parent: the directory the checkpoints are saved in.

    Returns:
        The directories removed.

    Raises:
        FileNotFoundError: ``parent`` does not exist.
    """
    removed = []
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        ours = TMP_MARK in name or OLD_MARK in name
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

    Subclasses :class:`FileSystemWriter` (planner, staging and ``dcp.async_save`` unchanged). One save at a
    time per writer instance (wait for a save's ``upload_completion`` before the next through it).
    Needs DCP's collectives (the default): ``use_collectives=False`` gives no coordinator to commit.
    The ``StorageWriter`` methods implement torch's interface; where they differ, their docstrings say how.

    Args:
        path: the checkpoint directory; it appears complete (renamed into place) or not at all.
        engine: None (the shared default engine), an :class:`~lightning_recover.checkpoint.engine.EngineHandle`
            or a ``native_io.IOEngine``.
        overwrite: False refuses an existing checkpoint at ``path`` (``RuntimeError`` when planning the save).
        cache_staged_state_dict: alone: ``dcp.async_save`` makes a blocking copy into staging buffers reused from
            one save to the next.
        lazy_snapshot: ``dcp.async_save`` blocks only for tensors under ``eager_bytes`` and copies the rest in
            the background into the same reused staging buffers (``snapshot.py``).
        eager_bytes: with ``lazy_snapshot``, tensors smaller than this (bytes, default 1 MiB) are copied at once.
        pause_gc: True: Python's cyclic collector is off from this rank's first hook to its last of a save
            run by the main thread (DCP's per-item objects otherwise trigger full collections: ``gc_pause.py``);
            a number: the same, with that many seconds as the bound after the latest hook (default 30); False: off.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        engine: Any = None,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
        lazy_snapshot: bool = False,
        eager_bytes: int = EAGER_BYTES,
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
        self._gc = gc_pause_for(pause_gc)
        self._is_coordinator = False

    # -- staging (dcp.async_save) -----------------------------------------------------------------

    def stage(self, state_dict: dict) -> Any:
        """Implements torch's ``stage``: the copy ``dcp.async_save`` writes, into reused buffers when asked for."""
        if self._lazy is None:
            return super().stage(state_dict)  # DCP's blocking copy (reused with cache_staged_state_dict)
        return self._lazy.stage(state_dict)

    def wait_for_snapshot(self) -> float:
        """With ``lazy_snapshot=True``: block until the last save's tensors are copied.

        A snapshot that failed (a tensor changed in place while it was copied) does not raise here: its save
        fails, on every rank.

        Returns:
            The seconds waited (0.0 without ``lazy_snapshot``).
        """
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
        """Implements torch's ``close``; also stops the lazy snapshot's thread and frees its staging buffers."""
        if self._lazy is not None:
            self._lazy.close()
        super().close()

    # -- planning ----------------------------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Implements torch's interface; ``ValueError`` without DCP's collectives (nothing could commit)."""
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
        """Implements torch's interface; ``RuntimeError`` for a checkpoint at ``path`` with ``overwrite=False``."""
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        if not self.overwrite and os.path.exists(os.path.join(self.path, ".metadata")):
            raise RuntimeError(f"a checkpoint already exists at {self.path} and overwrite=False; choose a new path")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Implements torch's interface; gives every rank its file prefix and the save's temporary directory."""
        token = secrets.token_hex(6)  # chosen once, on the coordinator, and sent to every rank
        return [dataclasses.replace(p, storage_data=UringPrefix(f"__{i}_", token)) for i, p in enumerate(plans)]

    # -- writing -----------------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Implements torch's interface: this rank's items into one file and its sidecar, synchronously."""
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
        collector's oldest generation (docs/dcp.md, "The collector").

        Args:
            metadata: the save's metadata, changed in place.
            results: every rank's write results, by rank.
        """
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
            # full); the writer holds their tensors until close(), before which nothing changes them. The
            # pipeline's thread outlives those transfers: w.close() runs inside its block
            with WritePipeline(
                lambda b: w.write(b.segments, wait=False), functools.partial(_record_batch, items_crc)
            ) as pipe:
                try:
                    for item in items:
                        data = planner.resolve_data(item)
                        layout = None
                        segs: list[tuple[int, bytes | memoryview]]
                        if item.type == WriteItemType.BYTE_IO:
                            if not isinstance(data, io.BytesIO):
                                raise TypeError(f"bytes item {item.index.fqn} resolved to {type(data).__name__}")
                            buf = data.getbuffer()
                            off = _align_up(cursor)
                            segs = [(off, buf)]
                            length = len(buf)
                        else:
                            if not isinstance(data, torch.Tensor):
                                raise TypeError(f"tensor item {item.index.fqn} resolved to {type(data).__name__}")
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
                        batch.add(
                            segs, (off, length, item.index.fqn, [(o, len(memoryview(b))) for o, b in segs], layout)
                        )
                        cursor = off + length
                        results.append(
                            WriteResult(
                                index=item.index,
                                size_in_bytes=length,
                                storage_data=_StorageInfo(file_name, off, length),
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
        """Implements torch's interface; the metadata also records that the shards have CRC-32C sidecars."""
        return sidecar_storage_meta(self.path, self.save_id)
