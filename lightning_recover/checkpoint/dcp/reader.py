"""The reader of a ``native_io`` DCP checkpoint: :class:`UringStorageReader` (every extent's CRC-32C
checked against its sidecar, reads batched into staging buffers and, where a request is a whole tensor,
straight into the target), ``read_dcp_metadata`` (``.metadata`` through an allowlist unpickler) and
``verify_dcp_checkpoint``. The files are written by :mod:`~lightning_recover.checkpoint.dcp.writer`."""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
from typing import Any, Optional

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.futures import Future

from lightning_recover.checkpoint.dcp.writer import (
    ALIGN,
    SIDECAR_FORMAT,
    TMP_MARK,
    gc_pause_for,
    sidecar_name,
    sidecars_recorded,
)
from lightning_recover.checkpoint.engine import resolve_engine
from lightning_recover.checkpoint.integrity import (
    CheckpointCorruptError,
    UnsafeCheckpointError,
    align_up,
)

__all__ = ["SidecarsMissingError", "UringStorageReader", "read_dcp_metadata", "verify_dcp_checkpoint"]

# read contiguous runs of items of at most this many bytes into one staging buffer
_READ_BATCH = 256 << 20
# a hole this large between two wanted items starts a new read run (skip it rather than read it)
_READ_GAP = 1 << 20

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
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


class SidecarsMissingError(CheckpointCorruptError):
    """``.metadata`` records CRC-32C sidecars for this checkpoint, but some or all of them are missing."""


def _load_sidecars(path: str, relative_paths: set[str], recorded: bool) -> dict[str, dict]:
    """Sidecars by relative_path; {} for a stock checkpoint (none at all, none ``recorded`` in its metadata), an
    error when only some exist or when the metadata records sidecars and any is missing."""
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
    if recorded and missing:
        names = ", ".join(sidecar_name(m) for m in sorted(missing))
        raise SidecarsMissingError(
            f"{path}: checksum sidecar(s) missing: {names}; its .metadata says they were written with this checkpoint,"
            " so its data cannot be verified. HINT: restore the .crc.json files from where the checkpoint was copied"
            " from; to load it unverified anyway, pass verify=False (UringStorageReader(path, verify=False))",
            path=path,
        )
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

    Args:
        path: the checkpoint directory.
        file_name: the metadata file's name in it.

    Returns:
        The checkpoint's DCP ``Metadata``.

    Raises:
        CheckpointCorruptError: the file is missing or unreadable, or holds no ``Metadata``.
        UnsafeCheckpointError: it names a global outside the allowlist.
    """
    p = str(path)
    mpath = os.path.join(p, file_name)
    if not os.path.exists(mpath):
        hint = "the directory does not exist" if not os.path.isdir(p) else f"it has no {file_name}"
        raise CheckpointCorruptError(
            f"{p} is not a complete DCP checkpoint: {hint} (a save that did not finish leaves its files under "
            f".{os.path.basename(p)}{TMP_MARK}*); load the previous checkpoint",
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
    (no sidecars: loaded unverified, as the stock reader does). A checkpoint whose ``.metadata`` records sidecars
    and lacks some is refused with :class:`SidecarsMissingError`. ``.metadata`` is read with an allowlist
    unpickler, a stock checkpoint's tensors with torch's ``weights_only`` loader; bytes items go to the planner
    (``SafeLoadPlanner`` reads them ``weights_only``). The ``StorageReader`` methods implement torch's interface.

    Args:
        path: the checkpoint directory.
        engine: None (the shared default engine), an :class:`~lightning_recover.checkpoint.engine.EngineHandle`
            or a ``native_io.IOEngine``.
        verify: False skips the CRC-32C verification (default True).
        pause_gc: True: the cyclic collector is off from planning to the end of ``read_data`` (``gc_pause.py``);
            a number: the same, with that many seconds as the bound; False: off.
    """

    def __init__(
        self, path: str | os.PathLike, *, engine: Any = None, verify: bool = True, pause_gc: bool | float = True
    ) -> None:
        super().__init__(path)
        self._engine = engine
        self.verify = verify
        self._sidecars: Optional[dict[str, dict]] = None
        self._sidecars_recorded = False
        self._gc = gc_pause_for(pause_gc)

    def set_up_storage_reader(self, *args: Any, **kwargs: Any) -> None:
        """Implements torch's interface (and pauses the collector with ``pause_gc``)."""
        super().set_up_storage_reader(*args, **kwargs)
        metadata = kwargs["metadata"] if "metadata" in kwargs else args[0]
        self._sidecars_recorded = sidecars_recorded(metadata)
        if self._gc is not None:
            self._gc.pause()  # planning and reading of one dcp.load; resumed when read_data ends (gc_pause.py)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Implements torch's interface (the sidecars are read again for the next load)."""
        super().reset(checkpoint_id)
        self._sidecars = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Implements torch's interface with an allowlist unpickler (``read_dcp_metadata``: what it raises)."""
        # FileSystemReader.read_metadata is a bare pickle.load; ours allows DCP's metadata types only
        rank = kwargs.get("rank")
        md = read_dcp_metadata(self.path, os.path.basename(self._get_metadata_path(rank)))
        meta: Optional[StorageMeta] = getattr(md, "storage_meta", None)
        if meta is None:
            meta = md.storage_meta = StorageMeta()
        meta.load_id = self.load_id
        return md

    def _sidecar_index(self) -> dict[str, dict]:
        if self._sidecars is None:
            rels = {sd.relative_path for sd in self.storage_data.values()}
            sides = _load_sidecars(str(self.path), rels, self._sidecars_recorded) if self.verify else {}
            self._sidecars = {
                rel: {"size": s["size"], "items": {(i["offset"], i["length"]): i for i in s["items"]}}
                for rel, s in sides.items()
            }
        return self._sidecars

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Implements torch's interface, synchronously; ``CheckpointCorruptError`` names a damaged file and item."""
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
        buf = mmap.mmap(-1, max(align_up(max(spans, default=0), ALIGN), ALIGN))  # one buffer per file, reused
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

    Args:
        path: the checkpoint directory.

    Returns:
        ``{"files": n, "items": n, "bytes": n, "verified": bool}`` (``verified`` False for a
        checkpoint without sidecars, e.g. one written by ``FileSystemWriter``).

    Raises:
        CheckpointCorruptError: on damage, naming the file and item; also for a missing or unreadable
            ``.metadata`` (:func:`read_dcp_metadata`).
        SidecarsMissingError: ``.metadata`` records sidecars and some are missing.
        UnsafeCheckpointError: ``.metadata`` names a global outside the allowlist.
    """
    path = str(path)
    reader = UringStorageReader(path)
    md = reader.read_metadata()
    reader.storage_data = md.storage_data
    rels = {sd.relative_path for sd in md.storage_data.values()}
    sides = _load_sidecars(path, rels, sidecars_recorded(md))
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
                        buf = mmap.mmap(-1, align_up(ln + o % ALIGN, ALIGN))
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
