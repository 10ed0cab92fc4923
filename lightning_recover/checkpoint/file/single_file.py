"""One checkpoint, one file: ``save``, ``load``, ``read_info`` and ``verify_file`` through ``native_io``.

``save`` lays the checkpoint out as a ``torch.save`` archive (``torch_zip.py``, format 2, the only format) and
writes its records, each with a CRC-32C, into a temporary file made durable and renamed onto its final name
(``files.py``). ``load`` verifies every record's checksum before torch's loader builds a tensor from it.
:class:`~lightning_recover.lightning.checkpoint_io.UringCheckpointIO` plugs this into Lightning.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from lightning_recover import env
from lightning_recover.checkpoint.engine import open_writer, resolve_engine
from lightning_recover.checkpoint.file import async_io, torch_zip
from lightning_recover.checkpoint.file.page_populate import PagePopulator, populate_supported
from lightning_recover.checkpoint.file.spare_files import SpareFiles, writer_over
from lightning_recover.checkpoint.file.state_tensors import covers_storage, storage_span, tensor_paths
from lightning_recover.checkpoint.file.storage_reads import StorageDamaged, StorageReads, damaged_record
from lightning_recover.checkpoint.files import cleanup_stale_temps, commit, temp_path_for, unlink_quiet
from lightning_recover.checkpoint.gc_pause import GcPause
from lightning_recover.checkpoint.integrity import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    UnsafeCheckpointError,
)
from lightning_recover.checkpoint.reservation import GrowingReservation
from lightning_recover.checkpoint.write_pipeline import WritePipeline

log = logging.getLogger(__name__)

__all__ = [
    "save",
    "load",
    "read_info",
    "verify_file",
    "ArchiveInfo",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
]

# format 2 hands storages to the engine in batches of about this many bytes; the first batch's Python work
# is the only part not overlapped with the disk (write_pipeline.py), so batches are not made larger
_WRITE_BATCH_BYTES = 64 << 20


# ------------------------------------------------------------------------------------- save


def save(
    checkpoint: Any,
    path: Any,
    *,
    engine: Any = None,
    format: int = 2,
    zip_crc32: bool = False,
    torch_layout: bool = False,
    spares: Optional[SpareFiles] = None,
) -> None:
    """Write ``checkpoint`` (anything ``torch.save`` takes) to ``path`` atomically.

    Format 2 (default) is a ``torch.save`` archive (``torch.load`` and every tool that reads torch checkpoints
    read it) with a CRC-32C integrity record (``torch_zip.py``). Its tensors of 1 MiB or more start at file
    offsets congruent to their memory modulo 4096, so the engine writes them from that memory without a copy;
    ``torch_layout=True`` puts every record where ``torch.save`` with ``storage_alignment=4096`` would instead
    (for ``torch.utils.serialization.config.load.calculate_storage_offsets``), at the price of that copy.
    ``zip_crc32=True`` also fills the ZIP CRC-32 fields (for ``unzip -t``; torch does not check them). The file
    is written to a temporary name in the same directory, fdatasync'ed, renamed into place and the directory
    fsync'ed: a crash leaves either the previous file or the new one under ``path``, never a partial one. Parent
    directories are created. ``format`` is 2, the only format written (format 1 is gone: :func:`check_format`).

    Args:
        checkpoint: what to save: anything ``torch.save`` takes.
        path: the file to write.
        engine: None (the shared default engine), an ``EngineHandle`` or a ``native_io.IOEngine``.
        format: 2, the only format written.
        zip_crc32: also fill the ZIP CRC-32 fields (default False).
        torch_layout: place the records as ``torch.save(..., storage_alignment=4096)`` would (default False).
        spares: files kept from removed or replaced checkpoints (``spare_files.py``): the save writes over the one
            kept in ``path``'s directory, if any, and keeps the file it replaces. None: neither.

    Raises:
        ValueError: ``format`` is not 2.
        TypeError: ``engine`` is an engine name (pass it to ``UringCheckpointIO(engine=...)`` instead).
    """
    check_format(format)
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with GcPause():  # thousands of small objects per save: no full collections in between (gc_pause.py)
        _save_zip(checkpoint, path, engine, zip_crc32, congruent=not torch_layout, spares=spares)


# How to turn a format-1 file (the lightning-recover layout of 0.1.0 before the torch.save archive) into one this
# version reads: the last version that read it converts it to a plain torch.save file.
FORMAT1_HINT = (
    "HINT: convert a format-1 file with lightning-recover at commit e45c159 or earlier: "
    "`lightning-recover convert OLD.ckpt NEW.ckpt` writes a torch.save file, which this version and torch.load read"
)


def check_format(format: Any) -> None:
    """Refuse any format but 2, the ``torch.save`` archive (format 1 is neither written nor read any more)."""
    if format == 1:
        raise ValueError(
            "format=1 is no longer supported: lightning-recover writes only format 2 (a torch.save archive with a "
            "CRC-32C integrity record) and no longer reads format 1. Drop the format argument to write format 2.\n"
            + FORMAT1_HINT
        )
    if format != 2:
        raise ValueError(f"format must be 2 (the torch.save archive), got {format!r}")


def _save_zip(
    checkpoint: Any,
    path: str,
    engine: Any,
    zip_crc32: bool,
    congruent: bool,
    fast_pickler: Optional[bool] = None,
    spares: Optional[SpareFiles] = None,
) -> None:
    directory = os.path.dirname(path)
    cleanup_stale_temps(directory)
    eng, lock = resolve_engine(engine)
    zplan = torch_zip.ZipPlan(meta=torch_zip.file_meta(), zip_crc32=zip_crc32, congruent=congruent)
    spare = spares.take(directory) if spares is not None else None
    tmp = spare[0] if spare is not None else temp_path_for(path)
    try:
        with lock:
            # the size is known only once the object is pickled: a reservation grows ahead of the placement
            with _open_temp(eng, tmp, spare) as raw, _reservation(tmp) as reserve:
                w = torch_zip.PlanWriter(zplan, raw)

                def record(batch: list, crcs: list[int]) -> None:
                    for (i, _, _), crc in zip(batch, crcs):
                        zplan.set_crc32c(i, crc)

                # a batch is written on a second thread while the next is laid out (write_pipeline.py): with the
                # congruent layout, while the pickler is still walking the object. wait=False: the transfers of
                # one batch that read tensors' own memory run on while the next batch is submitted, so the
                # device's queue does not drain between batches (nothing changes the tensors during the save)
                # w.finish() runs inside the block: the pipeline's thread outlives the transfers it submitted
                with WritePipeline(
                    lambda batch: w.write([(off, buf) for _, off, buf in batch], wait=False), record
                ) as pipe:
                    pending: list = []
                    staged = 0

                    def placed(i: int, st: torch.UntypedStorage) -> None:
                        nonlocal pending, staged
                        rec = zplan.storage_record[i]
                        if rec.nbytes == 0:
                            return
                        reserve.ensure(rec.data_end)
                        if staged + rec.nbytes > _WRITE_BATCH_BYTES and pending:
                            pipe.send(pending)
                            pending, staged = [], 0
                        pending.append((i, rec.data_offset, storage_span(st)))
                        staged += rec.nbytes

                    try:
                        zplan.lay_out(checkpoint, placed, fast_pickler)
                        if pending:
                            pipe.send(pending)
                        pipe.drain()
                    except BaseException:
                        pipe.abandon()
                        raise
                    w.finish()
        if spares is not None:
            spares.keep_replaced(path)
        commit(tmp, path)
    except torch_zip.RestartWithoutStreaming:
        unlink_quiet(tmp)
        # torch's own pickler hands the storages over only once it has pickled everything
        _save_zip(checkpoint, path, engine, zip_crc32, congruent, fast_pickler=False, spares=spares)
        return
    except BaseException:
        unlink_quiet(tmp)
        raise


def _open_temp(eng: Any, tmp: str, spare: Optional[tuple[str, int]]) -> Any:
    """The writer of the save's temporary file: a new file, or the kept file ``spare`` (its path and an open
    descriptor, closed here) written over in place."""
    return open_writer(eng, tmp) if spare is None else writer_over(eng, spare)


def _reservation(path: str) -> GrowingReservation:
    """With ``LIGHTNING_RECOVER_PREALLOCATE=on``, the file's space reserved ahead of the save (``reservation.py``);
    by default the writes extend the file themselves (measured faster since the huge-page arena: docs/native_io.md)."""
    return GrowingReservation(path if env.flag(env.PREALLOCATE, "auto") == "on" else None)


# ------------------------------------------------------------------------------------- load


def _open_reader(eng: Any, path: str) -> Any:
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"Checkpoint file not found: {path}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, f"Checkpoint path is a directory: {path}", path)
    return eng.open_reader(path)


_TAIL_BYTES = 8192  # the end records and our comment fit well inside this


# the first bytes of a format-1 file (recognised only to say how to convert it)
_FORMAT1_MAGIC = b"\x89LRCKPT\n"


def _not_an_archive(head: bytes, size: int, path: str) -> CheckpointCorruptError:
    """The error for a file that does not start as a ZIP archive does, from what its first bytes look like."""
    if head[:8] == _FORMAT1_MAGIC:
        why = f"a lightning-recover format-1 checkpoint, which this version no longer reads.\n{FORMAT1_HINT}"
    elif size < 8:
        why = f"file too small ({size} bytes) to be a checkpoint (truncated?)"
    elif head[:1] == b"\x80":
        why = "a pickle stream (legacy torch.save format?), not a lightning-recover checkpoint"
    elif not any(head):
        why = "zero-filled where the archive should start (incompletely written or damaged)"
    else:
        why = "not a lightning-recover checkpoint (no ZIP archive signature)"
    return CheckpointCorruptError(f"{path}: {why}", path)


def _read_kind(r: Any, path: str) -> tuple[str, Any]:
    """``("zip", end-record facts)`` (format 2, for :func:`_read_zip_index`) or ``("torch", None)`` (a plain
    ``torch.save`` file); anything else raises :class:`CheckpointCorruptError` saying what it looks like."""
    if r.size == 0:
        raise CheckpointIncompleteError.for_path(path)
    head = bytearray(min(r.size, 4096))
    r.read([(0, head)])
    if not torch_zip.is_zip(bytes(head[:8])):
        raise _not_an_archive(bytes(head), r.size, path)
    n = min(r.size, _TAIL_BYTES)
    tail = bytearray(n)
    r.read([(r.size - n, tail)])
    found = torch_zip.parse_tail(bytes(tail), r.size, path)
    return ("zip", found) if found is not None else ("torch", None)


def _read_zip_index(r: Any, path: str, found: tuple) -> torch_zip.ArchiveIndex:
    """Integrity record and central directory of a format-2 file, checked (``found``: from :func:`_read_kind`)."""
    io_off, io_len, _, cd_off, cd_end, _ = found
    integrity, central = bytearray(io_len), bytearray(cd_end - cd_off)
    r.read([(io_off, integrity), (cd_off, central)])
    return torch_zip.parse_archive(path, r.size, found, bytes(integrity), bytes(central))


def _read_small_records(r: Any, index: torch_zip.ArchiveIndex, verify: bool) -> dict[str, bytes]:
    """Read every record but the storages (``data.pkl`` and the rest), checksums verified."""
    in_file_order = sorted(index.records.items(), key=lambda kv: kv[1].data_offset)
    small = {n: rec for n, rec in in_file_order if not n.startswith("data/")}
    bufs = {n: bytearray(rec.nbytes) for n, rec in small.items()}
    names = [n for n, rec in small.items() if rec.nbytes]
    crcs = r.read([(small[n].data_offset, bufs[n]) for n in names]) if names else []
    if verify:
        bad = [damaged_record(n, small[n], int(c)) for n, c in zip(names, crcs) if int(c) != small[n].crc32c]
        if bad:
            _raise_zip_damage(bad, index, {n: bytes(b) for n, b in bufs.items()})
    return {n: bytes(b) for n, b in bufs.items()}


def _load_zip(
    r: Any,
    index: torch_zip.ArchiveIndex,
    verify: bool,
    map_location: Any,
    weights_only: bool,
    targets: dict[str, torch.Tensor],
) -> tuple[Any, dict[int, str]]:
    """Unpickle a format-2 file while its storages are read (``storage_reads.py``): the small records first,
    checked, then each storage handed to torch's loader once it is read and checked. A record that is exactly one
    of the ``into=`` targets' storages is read straight into it (:func:`_target_storages`). Returns the result and
    the address of each target storage read into -> the path of the tensor it was read for."""
    small = _read_small_records(r, index, verify)
    data = [(n, rec) for n, rec in index.records.items() if n.startswith("data/")]
    large = _mostly_large_records(data)
    into = _target_storages(index, small, targets, slow_listing=large) if targets else {}
    fresh: list[torch.UntypedStorage] = []

    def storage_for(name: str, nbytes: int) -> torch.UntypedStorage:
        st = into[name][1] if name in into else None
        if st is None:
            st = _new_storage(nbytes)
            fresh.append(st)
        return st

    reads = StorageReads(r, data, verify, storage_for, storage_span)
    # the fresh storages' pages faulted in beside the reads (page_populate.py); not for many small records, whose
    # load it did not make faster (measured in a new process: benchmarks/resume_loads.py)
    populate = PagePopulator(fresh) if large and fresh and populate_supported() else None
    try:
        result = torch_zip.unpickle(
            torch_zip.VerifiedArchive(index, small, reads), index.path, map_location, weights_only
        )
    except StorageDamaged:
        result = None  # reported below, with every damaged record
    except BaseException:
        reads.abandon()
        raise
    finally:
        if populate is not None:
            populate.close()
    bad = reads.finish()
    if bad:
        _raise_zip_damage(bad, index, small)
    return result, {st.data_ptr(): name for name, st in into.values()}


def _raise_zip_damage(bad: list, index: torch_zip.ArchiveIndex, small: dict) -> None:
    rows = _tensor_rows(index, small) if "data.pkl" in small else []
    for d in bad:
        d["tensors"] = [t["name"] for t in rows if t["record"] == d["record"]]
    raise CheckpointCorruptError(_describe_zip_damage(bad, index.path), index.path, bad)


def _describe_zip_damage(bad: list, path: str) -> str:
    first = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    names = f" (tensors: {', '.join(first['tensors'])})" if first.get("tensors") else ""
    return (
        f"{path}: checksum mismatch in record {first['record']!r}{names} at offset {first['offset']} "
        f"(+{first['nbytes']} bytes){more}: the file is damaged"
    )


class ArchiveInfo:
    """Format 2 (a ``torch.save`` archive): its records and the tensors they hold (no tensor data read).

    ``tensors`` rows: name, dtype, shape, stride, bytes, offset (file offset of the first element), record.
    :func:`read_info` and :func:`verify_file` make it.

    Args:
        path: the file.
        size: its size in bytes.
        index: its records (``index.records``: name to record, with offsets and CRC-32C).
        tensors: the tensor rows above (``[]`` when they cannot be listed with the safe unpickler).
    """

    format_version = 2

    def __init__(self, path: str, size: int, index: torch_zip.ArchiveIndex, tensors: list[dict]) -> None:
        self.path, self.size, self.index, self.tensors = path, size, index, tensors

    def tensors_of(self, record: str) -> list[str]:
        """The names of the tensors stored in ``record``.

        Args:
            record: a record's name (``data/N``).

        Returns:
            Their names, in the order of ``tensors``.
        """
        return [t["name"] for t in self.tensors if t["record"] == record]


def _read_archive_info(r: Any, path: str, kind: str, found: Any) -> ArchiveInfo:
    """Records and tensors of a format-2 file; a plain ``torch.save`` file has nothing to verify."""
    if kind == "torch":
        raise CheckpointCorruptError(
            f"{path}: a plain torch.save file (no lightning-recover integrity record): nothing to verify; "
            "torch.load reads it",
            path,
        )
    index = _read_zip_index(r, path, found)
    small = _read_small_records(r, index, verify=True)
    return ArchiveInfo(path, r.size, index, _tensor_rows(index, small))


def _meta_tensors(index: torch_zip.ArchiveIndex, small: dict, slow: bool = True) -> list[tuple[str, torch.Tensor, str]]:
    """``(path, tensor, record)`` of every tensor, sorted by path, from unpickling ``data.pkl`` onto meta storages
    (no data is read); ``[]`` when that cannot be done with the safe unpickler (e.g. a custom class), or, with
    ``slow`` False, with the restricted fast one (``torch_zip.unpickle_on_meta``)."""
    by_offset = {rec.data_offset: name for name, rec in index.records.items() if name.startswith("data/")}
    try:
        meta = torch_zip.unpickle_on_meta(torch_zip.VerifiedArchive(index, small, {}), index.path, slow)
    except Exception as e:
        log.debug("%s: tensors not listed: %s", index.path, e)
        return []
    out = []
    for name, t in sorted(tensor_paths(meta).values()):
        off = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if off is not None:
            out.append((name, t, by_offset.get(off, "?")))
    return out


def _tensor_rows(index: torch_zip.ArchiveIndex, small: dict) -> list[dict]:
    """Tensor names, shapes and file offsets (``[]``: not listed, see :func:`_meta_tensors`)."""
    rows = []
    for name, t, record in _meta_tensors(index, small):
        base = t.untyped_storage()._checkpoint_offset
        if base is None:  # _meta_tensors lists only the tensors torch gave a file offset
            raise RuntimeError(f"{index.path}: tensor {name} has no offset in the file")
        rows.append(
            {
                "name": name,
                "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "bytes": t.numel() * t.element_size(),
                "offset": base + t.storage_offset() * t.element_size(),
                "record": record,
            }
        )
    return rows


# A file whose records average at least this many bytes is a load bound by its bytes, not by its tensors (the
# Llama-like state: 6.9 MB; small10k: 100 KB). Only for such a file is it worth listing the tensors ahead of the
# load with torch's pure-Python weights_only unpickler, to read records straight into ``into=`` targets
# (:func:`_meta_tensors`; ~0.1 ms per tensor, for small10k 1.1 s, more than it saved: 1.6 s against 0.8 s per load,
# benchmarks/LOG.md). The restricted fast unpickler lists any file's tensors for less than the reads save. Fresh
# storages are populated on a second thread (``page_populate.py``) only for such a file too.
_LARGE_AVERAGE_RECORD = 1 << 20


def _mostly_large_records(records: list) -> bool:
    return sum(rec.nbytes for _, rec in records) >= _LARGE_AVERAGE_RECORD * max(1, len(records))


def _target_storages(
    index: torch_zip.ArchiveIndex, small: dict, targets: dict[str, torch.Tensor], slow_listing: bool = True
) -> dict[str, tuple[str, torch.UntypedStorage]]:
    """``record -> (path, storage)``: the records to read straight into an ``into=`` target instead of a fresh
    storage: those holding exactly one tensor, contiguous and whole, whose target at the same path is a CPU tensor
    of the same shape and dtype that is its storage's only content. torch then builds the loaded tensor on the
    target's own storage, and the copy into the target (``_fill_targets``, Lightning's ``load_state_dict``) finds
    both the same and copies nothing: no fresh memory to fault in, no second pass over the bytes. A storage is used
    once (tied targets). The records are those the integrity record lists (``index.whole_tensors``); for a file
    written before it listed them, the tensors are listed from ``data.pkl`` unpickled onto meta storages, with
    torch's own unpickler too where ``slow_listing`` and the fast one does not take the pickle."""
    listed = (
        index.whole_tensors if index.whole_tensors is not None else _whole_tensors_of_pickle(index, small, slow_listing)
    )
    out: dict[str, tuple[str, torch.UntypedStorage]] = {}
    used: set[int] = set()
    for record, (name, dtype, shape) in listed.items():
        rec = index.records.get(record)
        dest = targets.get(name)
        if rec is None or not rec.nbytes or dest is None or dest.device.type != "cpu":
            continue
        if type(dest) not in (torch.Tensor, torch.nn.Parameter):
            continue  # (a subclass, e.g. a DTensor, has no storage of its own to read into)
        if str(dest.dtype).removeprefix("torch.") != dtype or list(dest.shape) != shape:
            continue
        st = dest.untyped_storage()
        if not covers_storage(dest, rec.nbytes) or st.nbytes() != rec.nbytes:
            continue
        if st.data_ptr() in used:
            continue
        used.add(st.data_ptr())
        out[record] = (name, st)
    return out


def _whole_tensors_of_pickle(index: torch_zip.ArchiveIndex, small: dict, slow: bool) -> dict[str, tuple]:
    """``record -> (path, dtype, shape)`` as ``state_tensors.whole_tensors`` lists them, from ``data.pkl``
    unpickled onto meta storages (:func:`_meta_tensors`)."""
    by_record: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t, record in _meta_tensors(index, small, slow):
        by_record.setdefault(record, []).append((name, t))
    out = {}
    for record, tensors in by_record.items():
        rec = index.records.get(record)
        if rec is None or len(tensors) != 1:
            continue
        name, t = tensors[0]
        if covers_storage(t, rec.nbytes):
            out[record] = (name, str(t.dtype).removeprefix("torch."), list(t.shape))
    return out


def _verify_archive(r: Any, path: str, kind: str, found: Any, batch_bytes: int) -> tuple[ArchiveInfo, list]:
    """Read every record and local header of a format-2 file; returns ``(info, damaged records)``."""
    info = _read_archive_info(r, path, kind, found)
    index = info.index
    bad: list = []
    recs = sorted(index.records.values(), key=lambda rec: rec.data_offset)
    batch: list = []
    total = 0

    def run() -> None:
        nonlocal batch, total
        if batch:
            for rec, crc in zip(batch, r.read([(rec.data_offset, bytearray(rec.nbytes)) for rec in batch])):
                if int(crc) != rec.crc32c:
                    bad.append(_damage(info, rec, rec.data_offset, rec.nbytes, rec.crc32c, int(crc)))
        batch, total = [], 0

    for rec in recs:
        if not rec.nbytes:
            continue
        if total and total + rec.nbytes > batch_bytes:
            run()
        batch.append(rec)
        total += rec.nbytes
    run()
    heads = {rec.name: bytearray(rec.data_offset - rec.header_offset) for rec in recs}
    r.read([(rec.header_offset, heads[rec.name]) for rec in recs])
    for name in torch_zip.check_local_headers({n: bytes(b) for n, b in heads.items()}, index):
        rec = index.records[name]
        bad.append(_damage(info, rec, rec.header_offset, rec.data_offset - rec.header_offset, None, None))
    return info, bad


def _damage(info: ArchiveInfo, rec: Any, offset: int, nbytes: int, expected: Any, actual: Any) -> dict:
    return {
        "record": rec.name,
        "offset": offset,
        "nbytes": nbytes,
        "expected_crc32c": expected,
        "actual_crc32c": actual,
        "what": "data" if expected is not None else "local header",
        "tensors": info.tensors_of(rec.name),
    }


def read_info(path: Any, *, engine: Any = None) -> ArchiveInfo:
    """Validate the metadata of ``path`` (no tensor data read): its records and the tensors they hold.

    Args:
        path: the checkpoint file.
        engine: None (the shared default engine), an ``EngineHandle`` or a ``native_io.IOEngine``.

    Returns:
        The file's records and tensors.

    Raises:
        FileNotFoundError: no file at ``path``.
        IsADirectoryError: ``path`` is a directory.
        CheckpointCorruptError: the metadata is damaged, the file is no checkpoint, or it is a plain ``torch.save``
            file (no integrity record to read).
    """
    path = os.fspath(path)
    eng, lock = resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            kind, found = _read_kind(r, path)
            return _read_archive_info(r, path, kind, found)
        finally:
            r.close()


def verify_file(path: Any, *, engine: Any = None, batch_bytes: int = 256 << 20) -> tuple[ArchiveInfo, list]:
    """Read every record of ``path`` and return ``(info, damaged records)`` (bounded memory).

    Args:
        path: the checkpoint file.
        engine: None (the shared default engine), an ``EngineHandle`` or a ``native_io.IOEngine``.
        batch_bytes: the most bytes read at a time (default 256 MiB).

    Returns:
        ``(info, damaged)``: the file's :class:`ArchiveInfo`, and one dict per damaged record or local header
        (``record``, ``offset``, ``nbytes``, ``expected_crc32c``, ``actual_crc32c``, ``what``, ``tensors``);
        an empty list for an intact file.

    Raises:
        FileNotFoundError: no file at ``path``.
        IsADirectoryError: ``path`` is a directory.
        CheckpointCorruptError: as for :func:`read_info` (damaged metadata is raised, not listed).
    """
    path = os.fspath(path)
    eng, lock = resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            kind, found = _read_kind(r, path)
            return _verify_archive(r, path, kind, found, batch_bytes)
        finally:
            r.close()


# Opt-in: fresh storages of at least _ALIGNED_MIN_BYTES allocated 4096-aligned (see _new_storage).
_ALIGNED_MIN_BYTES = 1 << 20
_PAGE = 4096
_ALIGNED_ALLOC = env.flag(env.ALIGNED_ALLOC) == "on"


def _new_storage(nbytes: int) -> torch.UntypedStorage:
    """A fresh CPU storage of exactly ``nbytes`` to read a record into.

    ``torch.UntypedStorage(n)`` memory sits at 64 mod 4096 (the CPU allocator's alignment is 64), so
    ``native_io``'s reader cannot read it with ``O_DIRECT`` straight into it and stages every byte
    through its arena plus a copy. With ``LIGHTNING_RECOVER_ALIGNED_ALLOC=on`` storages of >= 1 MiB
    are instead carved 4096-aligned out of a torch allocation over-sized by 4096 bytes, so the
    reader's zero-copy path is taken: the storage starts at the aligned address, has ``nbytes()`` ==
    ``nbytes`` and keeps the allocation alive (released with the storage); it cannot grow (``resize_``
    to a larger size raises, as for ``torch.load(mmap=True)`` or safetensors storages).

    Off by default: on the benchmark VM (virtio disk, max_segments 254) the zero-copy reads into
    scattered 4 KiB user pages reach the device as smaller requests than the arena's and measured
    slower in wall time (benchmarks/LOG.md, "Checkpoint I/O"), although they save the copy's CPU.
    """
    if nbytes < _ALIGNED_MIN_BYTES or not _ALIGNED_ALLOC:
        return torch.UntypedStorage(nbytes)
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    a = (-raw.data_ptr()) % _PAGE
    return torch.from_numpy(raw[a : a + nbytes].numpy()).untyped_storage()


def _into_targets(into: Any) -> dict[str, torch.Tensor]:
    return {p: t for p, t in tensor_paths(into).values()}


def load(
    path: Any,
    map_location: Any = None,
    *,
    weights_only: bool = True,
    verify: bool = True,
    into: Any = None,
    strict: bool = True,
    engine: Any = None,
) -> Any:
    """Load a checkpoint written by :func:`save`.

    Args:
        path: the checkpoint file.
        map_location: like ``torch.load``: None (the saved devices), a device/str, a dict
            ``{saved: target}`` or a callable ``(storage, location) -> storage``.
        weights_only: True (default) unpickles with torch's weights_only unpickler and an allowlist
            (``torch_zip.SAFE_GLOBALS``; no arbitrary code runs); False allows any pickled object: only for
            checkpoints you trust.
        verify: compare every record with its CRC-32C (raises :class:`CheckpointCorruptError`).
        into: a nested structure like the checkpoint (e.g. ``{"state_dict": model.state_dict()}``); tensors at
            the same paths with the same shape and dtype are filled in place (read straight into them when
            possible) and returned in the result instead of new tensors. With ``strict``, a shape/dtype
            mismatch raises ``ValueError``; otherwise a new tensor is loaded for that path. With ``verify``
            a checksum error is raised after the data has landed in those tensors.
        strict: see ``into`` (default True).
        engine: None (the shared default engine), an ``EngineHandle`` or a ``native_io.IOEngine``.

    Returns:
        The checkpoint, as ``torch.load`` returns it. A plain ``torch.save`` file (no integrity record) is read by
        ``torch.load``, unverified.

    Raises:
        FileNotFoundError: no file at ``path``.
        IsADirectoryError: ``path`` is a directory.
        CheckpointCorruptError: a record fails its checksum, or the file is no checkpoint (truncated, foreign).
        CheckpointIncompleteError: the file is empty: an asynchronous save to it did not complete.
        UnsafeCheckpointError: with ``weights_only``, the pickle names a global outside the allowlist.
        ValueError: with ``into`` and ``strict``, a tensor's shape or dtype differs from its target's.
    """
    path = os.fspath(path)
    async_io.wait_for_path(path)  # an asynchronous save of this path in flight in this process, by any saver
    eng, lock = resolve_engine(engine)
    # thousands of small objects per load (records, storages, tensors): no full collections in between (gc_pause.py)
    with lock, GcPause():
        targets = _into_targets(into) if into is not None else {}
        r = _open_reader(eng, path)
        try:
            kind, found = _read_kind(r, path)
            if kind == "zip":  # unpickled while the storages are read
                index = _read_zip_index(r, path, found)
                result, read_into = _load_zip(r, index, verify, map_location, weights_only, targets)
        finally:
            r.close()
    if kind == "torch":
        return _torch_load(path, map_location, weights_only)
    if not targets:
        return result
    _check_read_into(result, targets, read_into, path)
    return _fill_targets(result, targets, strict, read_into, path)


def _torch_load(path: str, map_location: Any, weights_only: bool) -> Any:
    """A plain ``torch.save`` file (e.g. written by Lightning's ``TorchCheckpointIO``): torch reads it, unverified."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        raise UnsafeCheckpointError(f"{path}: {e}") from None


def _check_read_into(result: Any, targets: dict[str, torch.Tensor], read_into: dict[int, str], path: str) -> None:
    """Each target storage a record was read into (``read_into``: address -> path) must hold the loaded tensor at
    that path, viewed as its target views it, and no other loaded tensor: else the file's list of whole tensors
    disagrees with its pickle (a writer's error the checksums cannot see). The loaded tensors are found as the
    writer listed them (``tensor_paths``, first path of each); one a ``map_location`` moved off the CPU is left out."""
    if not read_into:
        return
    for name, t in tensor_paths(result).values():
        meant = read_into.get(t.untyped_storage().data_ptr()) if t.is_cpu else None
        if meant is not None and (name != meant or not _same_view(t, targets[meant])):
            raise CheckpointCorruptError(
                f"{path}: the integrity record lists the storage of {meant!r} as one whole tensor, but the pickle "
                f"puts {name!r} ({t.dtype} {tuple(t.shape)}) on it: the file is damaged",
                path,
            )


def _fill_targets(
    result: Any, targets: dict[str, torch.Tensor], strict: bool, read_into: dict[int, str], path: str
) -> Any:
    """Copy loaded tensors into the ``into=`` targets at the same paths and put the targets in the result; a
    tensor loaded straight into its target (``read_into``, checked by :func:`_check_read_into`) is its target."""

    def visit(obj: Any, prefix: str) -> Any:
        if isinstance(obj, torch.Tensor):
            dest = targets.get(prefix)
            if read_into and obj.is_cpu and read_into.get(obj.untyped_storage().data_ptr()) == prefix:
                return dest  # read straight into it: nothing to copy
            if dest is None:
                return obj
            if list(dest.shape) != list(obj.shape) or dest.dtype != obj.dtype:
                if strict:
                    raise ValueError(
                        f"{path}: cannot load {prefix!r} into the given tensor: checkpoint has "
                        f"{obj.dtype} {tuple(obj.shape)}, target is {dest.dtype} {tuple(dest.shape)}"
                    )
                return obj
            with torch.no_grad():
                dest.copy_(obj)
            return dest
        if isinstance(obj, dict):
            for k in list(obj.keys()):
                obj[k] = visit(obj[k], f"{prefix}/{k}" if prefix else str(k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                obj[i] = visit(v, f"{prefix}/{i}" if prefix else str(i))
        return obj

    return visit(result, "")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b``, on one storage, view the same elements the same way."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )
