"""One checkpoint, one file: ``save``, ``load``, ``read_info`` and ``verify_file`` through ``native_io``.

``save`` encodes the checkpoint (``format.py``), writes the storages as aligned extents with a
crc32c each, then the index, skeleton and footer, into a temporary file made durable and renamed
onto its final name (``files.py``). ``load`` verifies every extent's checksum before building a
tensor from it. :class:`~lightning_recover.lightning.checkpoint_io.UringCheckpointIO` plugs this into
Lightning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from typing import Any, Optional

import torch

from lightning_recover import env
from lightning_recover.checkpoint import format as fmt
from lightning_recover.checkpoint.engine import open_writer, resolve_engine
from lightning_recover.checkpoint.file import async_io, torch_zip
from lightning_recover.checkpoint.file.page_populate import PagePopulator, populate_supported
from lightning_recover.checkpoint.file.storage_reads import StorageDamaged, StorageReads, damaged_record
from lightning_recover.checkpoint.files import cleanup_stale_temps, commit, temp_path_for, unlink_quiet
from lightning_recover.checkpoint.gc_pause import GcPause
from lightning_recover.checkpoint.integrity import CheckpointCorruptError, UnsafeCheckpointError
from lightning_recover.checkpoint.reservation import GrowingReservation
from lightning_recover.checkpoint.write_pipeline import WritePipeline

log = logging.getLogger(__name__)

__all__ = [
    "save",
    "load",
    "read_info",
    "verify_file",
    "plan",
    "write_tail",
    "CheckpointInfo",
    "ArchiveInfo",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
]

# storages living on an accelerator are staged to host memory in batches of at most this many bytes
_DEVICE_STAGING_BYTES = 256 << 20
# format 2 hands storages to the engine in batches of about this many bytes; the first batch's Python work
# is the only part not overlapped with the disk (write_pipeline.py), so batches are not made larger
_WRITE_BATCH_BYTES = 64 << 20


# ------------------------------------------------------------------------------------- save


def _host_bytes(storage: Any) -> Any:
    """A buffer-protocol object over the bytes of a CPU ``UntypedStorage``."""
    return fmt.storage_as_bytes(storage).numpy()


def plan(checkpoint: Any) -> tuple[fmt.EncodedCheckpoint, int]:
    """Encode ``checkpoint`` (skeleton pickled now) and assign file offsets; returns (encoded, data_end)."""
    enc = fmt.encode_checkpoint(checkpoint, meta=fmt.file_meta())
    offsets, data_end = fmt.plan_layout([s.nbytes for s in enc.index.storages])
    for entry, off in zip(enc.index.storages, offsets):
        entry.offset = off
    return enc, data_end


def write_tail(w: Any, enc: fmt.EncodedCheckpoint, data_end: int, file_id: bytes) -> None:
    """Write index, skeleton and footer (extent crcs must be set in ``enc.index``), then close + fdatasync."""
    index_bytes = fmt.encode_index(enc.index)
    index_offset = fmt.align_up(data_end, fmt.SMALL_ALIGN)
    skeleton_offset = index_offset + len(index_bytes)
    meta_crc = fmt.crc32c(enc.skeleton, fmt.crc32c(index_bytes))
    footer = fmt.encode_footer(
        fmt.Footer(
            fmt.FORMAT_VERSION,
            0,
            index_offset,
            len(index_bytes),
            skeleton_offset,
            len(enc.skeleton),
            data_end,
            meta_crc,
            file_id,
        )
    )
    w.write([(index_offset, index_bytes + enc.skeleton + footer)])
    w.close(size=skeleton_offset + len(enc.skeleton) + len(footer))


def save(
    checkpoint: Any,
    path: Any,
    *,
    engine: Any = None,
    format: int = 2,
    zip_crc32: bool = False,
    torch_layout: bool = False,
) -> None:
    """Write ``checkpoint`` (anything ``torch.save`` takes) to ``path`` atomically.

    Format 2 (default) is a ``torch.save`` archive (``torch.load`` and every tool that reads torch checkpoints
    read it) with a CRC-32C integrity record (``torch_zip.py``). Its tensors of 1 MiB or more start at file
    offsets congruent to their memory modulo 4096, so the engine writes them from that memory without a copy;
    ``torch_layout=True`` puts every record where ``torch.save`` with ``storage_alignment=4096`` would instead
    (for ``torch.utils.serialization.config.load.calculate_storage_offsets``), at the price of that copy.
    ``zip_crc32=True`` also fills the ZIP CRC-32 fields (for ``unzip -t``; torch does not check them). ``format=1`` writes the
    older lightning-recover layout. The file is written to a temporary name in the same directory,
    fdatasync'ed, renamed into place and the directory fsync'ed: a crash leaves either the previous file or
    the new one under ``path``, never a partial one. Parent directories are created.
    """
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if format not in (1, 2):
        raise ValueError(f"format must be 1 or 2, got {format!r}")
    with GcPause():  # thousands of small objects per save: no full collections in between (gc_pause.py)
        if format == 1:
            _save_v1(checkpoint, path, engine)
        else:
            _save_zip(checkpoint, path, engine, zip_crc32, congruent=not torch_layout)


def _save_zip(
    checkpoint: Any, path: str, engine: Any, zip_crc32: bool, congruent: bool, fast_pickler: Optional[bool] = None
) -> None:
    directory = os.path.dirname(path)
    cleanup_stale_temps(directory)
    eng, lock = resolve_engine(engine)
    tmp = temp_path_for(path)
    zplan = torch_zip.ZipPlan(meta=fmt.file_meta(), zip_crc32=zip_crc32, congruent=congruent)
    try:
        with lock:
            # the size is known only once the object is pickled: a reservation grows ahead of the placement
            with open_writer(eng, tmp) as raw, _reservation(tmp) as reserve:
                w = torch_zip.PlanWriter(zplan, raw)

                def record(batch: list, crcs: list[int]) -> None:
                    for (i, _, _), crc in zip(batch, crcs):
                        zplan.set_crc32c(i, crc)

                # a batch is written on a second thread while the next is laid out (write_pipeline.py): with the
                # congruent layout, while the pickler is still walking the object. wait=False: the transfers of
                # one batch that read tensors' own memory run on while the next batch is submitted, so the
                # device's queue does not drain between batches (nothing changes the tensors during the save)
                pipe = WritePipeline(lambda batch: w.write([(off, buf) for _, off, buf in batch], wait=False), record)
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
                    pending.append((i, rec.data_offset, _host_bytes(st)))
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
        commit(tmp, path)
    except torch_zip.RestartWithoutStreaming:
        unlink_quiet(tmp)
        # torch's own pickler hands the storages over only once it has pickled everything
        _save_zip(checkpoint, path, engine, zip_crc32, congruent, fast_pickler=False)
        return
    except BaseException:
        unlink_quiet(tmp)
        raise


def _reservation(path: str) -> GrowingReservation:
    """With ``LIGHTNING_RECOVER_PREALLOCATE=on``, the file's space reserved ahead of the save (``reservation.py``);
    by default the writes extend the file themselves (measured faster since the huge-page arena: docs/native_io.md)."""
    return GrowingReservation(path if env.flag(env.PREALLOCATE, "auto") == "on" else None)


def _save_v1(checkpoint: Any, path: str, engine: Any) -> None:
    """Format 1 (``docs/format.md``): kept so files for older readers can still be written, and for tests."""
    directory = os.path.dirname(path)
    enc, data_end = plan(checkpoint)
    cleanup_stale_temps(directory)

    file_id = secrets.token_bytes(16)
    eng, lock = resolve_engine(engine)
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
                write_tail(w, enc, data_end, file_id)
        commit(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise


# ------------------------------------------------------------------------------------- load


class CheckpointInfo:
    """Header, footer, index and skeleton bytes of a checkpoint (no tensor data read)."""

    def __init__(
        self, path: str, size: int, header: fmt.Header, footer: fmt.Footer, index: fmt.Index, skeleton: bytes
    ) -> None:
        self.path, self.size, self.header, self.footer, self.index, self.skeleton = (
            path,
            size,
            header,
            footer,
            index,
            skeleton,
        )


def _open_reader(eng: Any, path: str) -> Any:
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"Checkpoint file not found: {path}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, f"Checkpoint path is a directory: {path}", path)
    return eng.open_reader(path)


_TAIL_BYTES = 8192  # the end records and our comment fit well inside this


def _read_kind(r: Any, path: str) -> tuple[str, Any]:
    """``("v1", None)`` (lightning-recover format 1), ``("zip", end-record facts)`` (format 2, for
    :func:`_read_zip_index`) or ``("torch", None)`` (a plain ``torch.save`` file)."""
    if r.size == 0:
        raise fmt.CheckpointIncompleteError.for_path(path)
    head = bytearray(min(r.size, 8))
    r.read([(0, head)])
    if not torch_zip.is_zip(bytes(head)):
        return "v1", None
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
) -> Any:
    """Unpickle a format-2 file while its storages are read (``storage_reads.py``): the small records first,
    checked, then each storage handed to torch's loader once it is read and checked. A record that is exactly one
    of the ``into=`` targets' storages is read straight into it (:func:`_target_storages`)."""
    small = _read_small_records(r, index, verify)
    data = [(n, rec) for n, rec in index.records.items() if n.startswith("data/")]
    large = _mostly_large_records(data)
    into = _target_storages(index, small, targets) if targets and large else {}
    fresh: list[torch.UntypedStorage] = []

    def storage_for(name: str, nbytes: int) -> torch.UntypedStorage:
        st = into.get(name)
        if st is None:
            st = _new_storage(nbytes)
            fresh.append(st)
        return st

    reads = StorageReads(r, data, verify, storage_for, lambda st: fmt.storage_as_bytes(st).numpy())
    # the fresh storages' pages faulted in beside the reads (page_populate.py); not for many small records,
    # whose load is bound by the unpickler, which a third busy thread would slow down on two cores
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
    return result


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
            f"(+{len(meta)} bytes): damaged index or skeleton",
            path,
        )
    index = fmt.decode_index(bytes(meta[: footer.index_length]), header.data_start, footer.data_end, path)
    return CheckpointInfo(path, size, header, footer, index, bytes(meta[footer.index_length :]))


class ArchiveInfo:
    """Format 2 (a ``torch.save`` archive): its records and the tensors they hold (no tensor data read).

    ``tensors`` rows: name, dtype, shape, stride, bytes, offset (file offset of the first element), record.
    """

    format_version = 2

    def __init__(self, path: str, size: int, index: torch_zip.ArchiveIndex, tensors: list[dict]) -> None:
        self.path, self.size, self.index, self.tensors = path, size, index, tensors

    def tensors_of(self, record: str) -> list[str]:
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


def _meta_tensors(index: torch_zip.ArchiveIndex, small: dict) -> list[tuple[str, torch.Tensor, str]]:
    """``(path, tensor, record)`` of every tensor, sorted by path, from unpickling ``data.pkl`` onto meta storages
    (no data is read); ``[]`` when that cannot be done with the safe unpickler (e.g. a custom class)."""
    by_offset = {rec.data_offset: name for name, rec in index.records.items() if name.startswith("data/")}
    try:
        meta = torch_zip.unpickle(torch_zip.VerifiedArchive(index, small, {}), index.path, "meta", True)
    except Exception as e:
        log.debug("%s: tensors not listed: %s", index.path, e)
        return []
    out = []
    for name, t in sorted(fmt.tensor_paths(meta).values()):
        off = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if off is not None:
            out.append((name, t, by_offset.get(off, "?")))
    return out


def _tensor_rows(index: torch_zip.ArchiveIndex, small: dict) -> list[dict]:
    """Tensor names, shapes and file offsets (``[]``: not listed, see :func:`_meta_tensors`)."""
    rows = []
    for name, t, record in _meta_tensors(index, small):
        rows.append(
            {
                "name": name,
                "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "bytes": t.numel() * t.element_size(),
                "offset": t.untyped_storage()._checkpoint_offset + t.storage_offset() * t.element_size(),
                "record": record,
            }
        )
    return rows


# A file whose records average at least this many bytes is a load bound by its bytes, not by its tensors (the
# Llama-like state: 6.9 MB; small10k: 100 KB, bound by unpickling 10,000 tensors). Only then are the tensors listed
# ahead of the load to read records straight into ``into=`` targets (:func:`_meta_tensors`: ~0.1 ms per tensor,
# torch's pure-Python weights_only unpickler; for small10k 1.1 s, more than it saved: 1.6 s against 0.8 s per load,
# benchmarks/LOG.md), and only then are fresh storages populated on a second thread (``page_populate.py``).
_LARGE_AVERAGE_RECORD = 1 << 20


def _mostly_large_records(records: list) -> bool:
    return sum(rec.nbytes for _, rec in records) >= _LARGE_AVERAGE_RECORD * max(1, len(records))


def _target_storages(
    index: torch_zip.ArchiveIndex, small: dict, targets: dict[str, torch.Tensor]
) -> dict[str, torch.UntypedStorage]:
    """Records to read straight into an ``into=`` target instead of a fresh storage: those holding exactly one
    tensor, contiguous and whole, whose target at the same path is a CPU tensor of the same shape and dtype that is
    its storage's only content. torch then builds the loaded tensor on the target's own storage, and the copy
    into the target (``_fill_targets``, Lightning's ``load_state_dict``) finds both the same and copies nothing:
    no fresh memory to fault in, no second pass over the bytes. A storage is used once (tied targets)."""
    by_record: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t, record in _meta_tensors(index, small):
        by_record.setdefault(record, []).append((name, t))
    out: dict[str, torch.UntypedStorage] = {}
    used: set[int] = set()
    for record, tensors in by_record.items():
        rec = index.records.get(record)
        if rec is None or len(tensors) != 1 or not rec.nbytes:
            continue
        name, t = tensors[0]
        dest = targets.get(name)
        if type(dest) not in (torch.Tensor, torch.nn.Parameter) or dest.device.type != "cpu":
            continue  # (a subclass, e.g. a DTensor, has no storage of its own to read into)
        if dest.dtype != t.dtype or dest.shape != t.shape:
            continue
        st = dest.untyped_storage()
        whole = t.storage_offset() == 0 and t.numel() * t.element_size() == rec.nbytes and t.is_contiguous()
        if not whole or not dest.is_contiguous() or dest.storage_offset() != 0 or st.nbytes() != rec.nbytes:
            continue
        if st.data_ptr() in used:
            continue
        used.add(st.data_ptr())
        out[record] = st
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


def read_info(path: Any, *, engine: Any = None) -> Any:
    """Validate the metadata of ``path`` (no tensor data read): :class:`CheckpointInfo` for format 1,
    :class:`ArchiveInfo` for format 2."""
    path = os.fspath(path)
    eng, lock = resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            kind, found = _read_kind(r, path)
            if kind == "v1":
                return _read_info(r, path)
            return _read_archive_info(r, path, kind, found)
        finally:
            r.close()


def verify_file(path: Any, *, engine: Any = None, batch_bytes: int = 256 << 20) -> tuple[Any, list]:
    """Read every extent of ``path`` and return ``(info, damaged extents)`` (bounded memory)."""
    path = os.fspath(path)
    eng, lock = resolve_engine(engine)
    with lock:
        r = _open_reader(eng, path)
        try:
            kind, found = _read_kind(r, path)
            if kind != "v1":
                return _verify_archive(r, path, kind, found, batch_bytes)
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
_ALIGNED_ALLOC = env.flag(env.ALIGNED_ALLOC) == "on"


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
    slower in wall time (benchmarks/LOG.md, "Checkpoint I/O"), although they save the copy's CPU.
    """
    if nbytes < _ALIGNED_MIN_BYTES or not _ALIGNED_ALLOC:
        return torch.UntypedStorage(nbytes)
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    a = (-raw.data_ptr()) % _PAGE
    return torch.from_numpy(raw[a : a + nbytes].numpy()).untyped_storage()


def _is_contiguous(shape: list, stride: list) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _into_targets(into: Any) -> dict[str, torch.Tensor]:
    return {p: t for p, t in fmt.tensor_paths(into).values()}


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
    async_io.wait_for_path(path)  # an asynchronous save of this path in flight in this process, by any saver
    eng, lock = resolve_engine(engine)
    targets = _into_targets(into) if into is not None else {}
    with lock:
        r = _open_reader(eng, path)
        try:
            kind, found = _read_kind(r, path)
            if kind == "zip":  # unpickled while the storages are read
                result = _load_zip(r, _read_zip_index(r, path, found), verify, map_location, weights_only, targets)
            elif kind == "v1":
                v1 = _read_v1(r, path, targets, strict)
        finally:
            r.close()
    if kind == "torch":
        return _torch_load(path, map_location, weights_only)
    if kind == "zip":
        return _fill_targets(result, targets, strict, path) if targets else result
    return _rebuild_v1(v1, path, map_location, weights_only, verify)


@dataclasses.dataclass
class _V1Read:
    """What :func:`_read_v1` read of a format-1 file, for :func:`_rebuild_v1`."""

    info: CheckpointInfo
    storages: list
    crcs: list
    seg_ids: list
    direct: dict  # storage index -> target tensor filled by the read
    copy_into: dict  # tensor index -> target tensor to copy_ into


def _read_v1(r: Any, path: str, targets: dict, strict: bool) -> _V1Read:
    """Read a format-1 file's extents: straight into ``targets`` where possible, else into fresh storages."""
    info = _read_info(r, path)
    index = info.index
    users = [0] * len(index.storages)
    for t in index.tensors:
        users[t.storage] += 1

    # where each tensor's data goes: direct read into a target, or a fresh storage then copy_
    direct: dict[int, torch.Tensor] = {}  # storage index -> target tensor filled by the read
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
                    f"{dt} {tuple(t.shape)}, target is {dest.dtype} {tuple(dest.shape)}"
                )
            continue
        contiguous_whole = (
            t.storage_offset == 0
            and t.nbytes > 0
            and t.nbytes == index.storages[t.storage].nbytes
            and _is_contiguous(t.shape, t.stride)
        )
        if contiguous_whole and users[t.storage] == 1 and dest.device.type == "cpu" and dest.is_contiguous():
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
    return _V1Read(info, storages, crcs, seg_ids, direct, copy_into)


def _rebuild_v1(v1: _V1Read, path: str, map_location: Any, weights_only: bool, verify: bool) -> Any:
    """Check the extents' checksums, place storages, rebuild tensors and unpickle the skeleton."""
    index = v1.info.index
    if verify:
        bad = fmt.damaged_extents(index, v1.crcs, path, v1.seg_ids)
        if bad:
            raise CheckpointCorruptError(fmt.describe_damage(bad, path), path, bad)

    where = fmt.map_location_fn(map_location)
    placed = []
    for i, (s, st) in enumerate(zip(index.storages, v1.storages)):
        placed.append(st if i in v1.direct else fmt.place_storage(st, s.device, where(s.device)))
    tensors = fmt.rebuild_tensors(index, placed, path)
    for ti, t in enumerate(index.tensors):
        if t.storage in v1.direct:
            tensors[ti] = v1.direct[t.storage]
        elif ti in v1.copy_into:
            with torch.no_grad():
                v1.copy_into[ti].copy_(tensors[ti])
            tensors[ti] = v1.copy_into[ti]
    return fmt.decode_skeleton(v1.info.skeleton, tensors, weights_only=weights_only, path=path)


# ----------------------------------------------------------------------------------- plugin


def _torch_load(path: str, map_location: Any, weights_only: bool) -> Any:
    """A plain ``torch.save`` file (e.g. written by Lightning's ``TorchCheckpointIO``): torch reads it, unverified."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        raise UnsafeCheckpointError(f"{path}: {e}") from None


def _fill_targets(result: Any, targets: dict[str, torch.Tensor], strict: bool, path: str) -> Any:
    """Copy loaded tensors into the ``into=`` targets at the same paths and put the targets in the result."""

    def visit(obj: Any, prefix: str) -> Any:
        if isinstance(obj, torch.Tensor):
            dest = targets.get(prefix)
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
