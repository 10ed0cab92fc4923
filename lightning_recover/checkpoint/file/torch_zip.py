"""Format 2: a ``torch.save`` archive laid out for the native engine, plus an integrity record.

``torch.save`` writes a ZIP of stored (uncompressed) records under one top-level directory. This module
plans and parses that container, the way torch's own writer (miniz) lays it out with
``torch.utils.serialization.config.save.storage_alignment = 4096`` and ``compute_crc32 = False``:

* records in torch's order: ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``,
  ``data/0`` ... ``data/N-1``, ``version``, ``.data/serialization_id``;
* each record is a local header (flags 0x0808: sizes in a data descriptor, UTF-8 name; CRC-32 and
  sizes zero), a ``FB`` extra field of padding so the record's data starts on a 4096-byte boundary, the
  data, and a data descriptor (none after an empty record, as miniz does);
* then central directory, zip64 end record and locator, end record -- always zip64, as torch writes.

That is ``ZipPlan(congruent=False)``. The synchronous save's default, ``congruent=True``, differs in where the
records go, not in what they are: storages first (written while the rest is pickled), large ones at offsets
congruent to their memory, no ``.format_version`` record (see :class:`ZipPlan`, docs/format.md).

So ``torch.load(path)`` (``mmap=True`` included), ``LightningModule.load_from_checkpoint`` and every
tool that reads torch checkpoints read these files. What we add, which torch ignores:

* one more record, ``.data/lightning_recover.json``, after the others: the CRC-32C, offset and size of
  every record (checked by our loader before anything is unpickled);
* the end record's comment, ``lightning-recover 2 <offset> <length> <crc32c> <cd crc32c>``: where the
  integrity record is, its checksum, and the checksum of the central directory and zip64 records.

A file whose end record is missing or whose comment is not ours is a truncated file or a plain
``torch.save`` file; :func:`parse_tail` says which. The ZIP CRC-32 fields are zero unless the writer
is asked to compute them (``zip_crc32=True``): torch reads them unchecked, and CRC-32C covers integrity.
Pure logic: the I/O lives in ``single_file.py`` and ``async_io.py``.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import json
import os
import pickle
import secrets
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

from lightning_recover import env
from lightning_recover.checkpoint.file import fast_unpickle
from lightning_recover.checkpoint.file.state_tensors import whole_tensors
from lightning_recover.checkpoint.integrity import (
    CheckpointCorruptError,
    UnsafeCheckpointError,
    congruent_offset,
    crc32c,
)

__all__ = [
    "ALIGN",
    "ARCHIVE",
    "INTEGRITY_RECORD",
    "Record",
    "ZipPlan",
    "ArchiveIndex",
    "plan_archive",
    "parse_tail",
    "parse_archive",
    "VerifiedArchive",
    "is_zip",
]

ALIGN = 4096
ARCHIVE = "archive"
INTEGRITY_RECORD = ".data/lightning_recover.json"
INTEGRITY_FORMAT = "lightning-recover-zip"
FORMAT_VERSION = 2
COMMENT_TAG = b"lightning-recover 2 "

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature ... extra length (30 bytes)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_SIG_LOCAL, _SIG_CENTRAL, _SIG_DESC = 0x04034B50, 0x02014B50, 0x08074B50
_SIG_EOCD, _SIG_EOCD64, _SIG_LOCATOR = 0x06054B50, 0x06064B50, 0x07064B50
_FLAGS = 0x0808  # bit 3: data descriptor; bit 11: UTF-8 name
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
# a record needs zip64 fields when its size or its header offset reaches this (tests lower it)
ZIP64_LIMIT = _U32
# a congruent plan places CPU storages of at least this many bytes congruent to their memory: the engine
# writes their aligned interior without a copy (native_io's unstaged_min, 2 MiB, decides which it sends so);
# smaller ones stay ALIGN-aligned (padding of up to 4 KiB each is not worth it)
CONGRUENT_MIN = 1 << 20


def is_zip(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"


# ------------------------------------------------------------------------------------------- plan


@dataclasses.dataclass
class Record:
    """One ZIP record: a small payload known at planning time, or a storage written from memory."""

    name: str  # without the archive prefix
    nbytes: int
    header_offset: int = 0
    data_offset: int = 0
    payload: Optional[bytes] = None
    storage: Optional[int] = None  # index into ZipPlan.storages
    zip_crc: int = 0
    crc32c: int = 0

    @property
    def data_end(self) -> int:
        return self.data_offset + self.nbytes

    def big(self) -> bool:
        return self.nbytes >= ZIP64_LIMIT or self.header_offset >= ZIP64_LIMIT

    def end(self) -> int:
        """Where the next local header starts: after the data and its descriptor."""
        return self.data_end + (self.descriptor_size() if self.nbytes else 0)

    def descriptor_size(self) -> int:
        return 24 if self.big() else 16


def _local_zip64(rec: Record, offset: int) -> bytes:
    fields = b""
    if rec.nbytes >= ZIP64_LIMIT:
        fields += struct.pack("<QQ", rec.nbytes, rec.nbytes)
    if offset >= ZIP64_LIMIT:
        fields += struct.pack("<Q", offset)
    return struct.pack("<HH", 1, len(fields)) + fields if fields else b""


def _place(rec: Record, cursor: int, address: Optional[int] = None) -> None:
    """Put ``rec``'s local header at ``cursor`` and its data on the next ``ALIGN`` boundary after it, or, given
    the ``address`` of the bytes it will be written from, on the next offset congruent to it modulo ``ALIGN``."""
    rec.header_offset = cursor
    fixed = cursor + _LOCAL.size + len(_full_name(rec.name)) + len(_local_zip64(rec, cursor)) + 4
    if address is None:
        rec.data_offset = -(-fixed // ALIGN) * ALIGN
    else:
        rec.data_offset = congruent_offset(fixed, address)


def _full_name(name: str) -> bytes:
    return f"{ARCHIVE}/{name}".encode()


def local_header(rec: Record) -> bytes:
    """The local header of ``rec`` with its padding: exactly ``data_offset - header_offset`` bytes."""
    name = _full_name(rec.name)
    z64 = _local_zip64(rec, rec.header_offset)
    pad = rec.data_offset - rec.header_offset - _LOCAL.size - len(name) - len(z64)
    extra = z64 + struct.pack("<HH", 0x4246, pad - 4) + b"Z" * (pad - 4)  # "FB" padding, as torch writes
    return _LOCAL.pack(_SIG_LOCAL, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def descriptor(rec: Record) -> bytes:
    if not rec.nbytes:
        return b""
    if rec.big():
        return struct.pack("<IIQQ", _SIG_DESC, rec.zip_crc, rec.nbytes, rec.nbytes)
    return struct.pack("<IIII", _SIG_DESC, rec.zip_crc, rec.nbytes, rec.nbytes)


def _central_entry(rec: Record) -> bytes:
    name = _full_name(rec.name)
    fields = b""
    size32 = rec.nbytes
    off32 = rec.header_offset
    if rec.nbytes >= ZIP64_LIMIT:
        fields += struct.pack("<QQ", rec.nbytes, rec.nbytes)
        size32 = _U32
    if rec.header_offset >= ZIP64_LIMIT:
        fields += struct.pack("<Q", rec.header_offset)
        off32 = _U32
    extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
    return (
        _CENTRAL.pack(
            _SIG_CENTRAL, 0, 0, _FLAGS, 0, 0, 0, rec.zip_crc, size32, size32, len(name), len(extra), 0, 0, 0, 0, off32
        )
        + name
        + extra
    )


class _Collector:
    """Stands in for torch's zip writer in ``torch.serialization._save``: keeps the records in torch's order.

    ``on_storage(record, storage)``, if given, is called as each storage record arrives (during pickling, from
    :class:`_FastPickler`), so its bytes can go to the disk while the rest of the object is still pickled.
    """

    def __init__(self, on_storage: Optional[Callable[[Record, torch.UntypedStorage], None]] = None) -> None:
        self.small: list[Record] = []  # data.pkl, .format_version, .storage_alignment, byteorder
        self.storage_records: list[Record] = []
        self.storages: list[torch.UntypedStorage] = []
        self.on_storage = on_storage

    @property
    def records(self) -> list[Record]:
        return self.small + self.storage_records

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, torch.UntypedStorage):
            rec = Record(name, nbytes, storage=len(self.storages))
            self.storage_records.append(rec)
            self.storages.append(data)
            if self.on_storage is not None:
                self.on_storage(rec, data)
        else:
            payload = data.encode() if isinstance(data, str) else bytes(data)
            if name == ".storage_alignment":  # what torch's offset arithmetic must assume: our alignment
                payload = str(ALIGN).encode()
            self.small.append(Record(name, len(payload), payload=payload))

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # pragma: no cover - skip_data saves
        raise RuntimeError("torch.serialization.skip_data() is not supported by the lightning-recover writer")


class RestartWithoutStreaming(Exception):
    """The fast pickler handed storages to ``on_storage`` and then gave up on the object (see :class:`_Fallback`):
    what was written from them may not match torch's pickling. The save starts again without streaming."""


class _Fallback(Exception):
    """Raised inside :class:`_FastPickler` for anything it does not reproduce: torch's pickler takes over."""


class _StorageRef:
    """What :class:`_FastPickler` pickles in place of the ``TypedStorage`` torch would create per tensor."""

    __slots__ = ("storage", "dtype", "legacy")

    def __init__(self, storage: torch.UntypedStorage, dtype: torch.dtype, legacy: bool) -> None:
        self.storage, self.dtype, self.legacy = storage, dtype, legacy


_PLAIN_TYPES = frozenset({int, float, str, bytes, bool, type(None), tuple, list, dict})


class _FastPickler(pickle.Pickler):
    """Writes the same ``data.pkl`` bytes as ``torch.serialization._save`` for plain dense CPU tensors.

    torch's pickler asks a Python ``persistent_id`` about every object (with two slow ``isinstance``
    checks against storage classes) and reduces every tensor through ``Tensor.__reduce_ex__``, which builds
    a ``TypedStorage`` per tensor: about 0.1 ms per tensor, i.e. 1 s for a state of 10,000 tensors, spent
    before the first byte can be written (``data.pkl`` comes first in the file). This pickler emits the
    identical opcodes (``_rebuild_tensor_v2`` with a legacy storage, ``_rebuild_tensor_v3`` for the newer
    dtypes; the same persistent ids, storage keys and memo pattern) for exact ``torch.Tensor`` instances on
    the CPU with a strided layout and no Python state or hooks; anything else (subclasses such as
    ``Parameter``, other devices, sparse, quantized and nested tensors, bare storages, one storage viewed
    with two dtypes) raises :class:`_Fallback` and the whole pickle is redone by torch.
    ``tests/unit/test_fast_pickler.py`` compares the bytes with torch's.
    """

    def __init__(self, file: Any, on_storage: Optional[Callable[[str, torch.UntypedStorage], None]] = None) -> None:
        super().__init__(file, protocol=2)
        self.storages: dict[str, torch.UntypedStorage] = {}
        self.on_storage = on_storage  # called with each new storage's key as the pickler meets it
        self._keys: dict[int, str] = {}
        self._dtypes: dict[int, torch.dtype] = {}
        self._v3 = torch.storage._new_dtypes()
        self._legacy = {d: getattr(torch, n) for d, n in torch.storage._dtype_to_storage_type_map().items()}
        self._v2 = torch._utils._rebuild_tensor_v2
        self._v3fn = torch._utils._rebuild_tensor_v3
        self._meta = torch._C._get_tensor_metadata

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is _StorageRef:
            st = obj.storage
            if obj.legacy:
                dtype, storage_type, numel = obj.dtype, self._legacy[obj.dtype], st.nbytes() // obj.dtype.itemsize
            else:
                dtype, storage_type, numel = torch.uint8, torch.UntypedStorage, st.nbytes()
            ptr = st.data_ptr()
            if ptr != 0:
                if self._dtypes.setdefault(ptr, dtype) != dtype:
                    raise _Fallback("one storage viewed with two dtypes")
            key = self._keys.get(st._cdata)
            if key is None:
                key = self._keys[st._cdata] = str(len(self._keys))
                self.storages[key] = st
                if self.on_storage is not None:
                    self.on_storage(key, st)
            return ("storage", storage_type, key, "cpu", numel)
        if t in _PLAIN_TYPES:
            return None
        if isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
            raise _Fallback("a bare storage")
        return None

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor:
            if isinstance(obj, torch.Tensor):
                raise _Fallback(f"tensor subclass {type(obj).__name__}")
            return NotImplemented
        if (
            not obj.is_cpu
            or obj.layout is not torch.strided
            or obj.is_quantized
            or obj.is_nested
            or obj.__dict__
            or obj._backward_hooks
            or getattr(obj, "_post_accumulate_grad_hooks", None)
        ):
            raise _Fallback("not a plain dense CPU tensor")
        legacy = obj.dtype not in self._v3
        args: tuple = (
            _StorageRef(obj.untyped_storage(), obj.dtype, legacy),
            obj.storage_offset(),
            tuple(obj.size()),
            obj.stride(),
            obj.requires_grad,
            OrderedDict(),
        )
        if not legacy:
            args = args + (obj.dtype,)
        metadata = self._meta(obj)
        if metadata:
            args = args + (metadata,)
        return (self._v2 if legacy else self._v3fn, args)


# Off (LIGHTNING_RECOVER_FAST_PICKLER=off): every save pickles through torch.serialization._save.
FAST_PICKLER = env.flag(env.FAST_PICKLER, "on") != "off"


def _fast_save_records(obj: Any, out: Optional[_Collector] = None) -> _Collector:
    """``torch.serialization._save``'s records, pickled by :class:`_FastPickler` (raises :class:`_Fallback`).

    Storage records reach ``out`` (and its ``on_storage``) as the pickler meets them, before ``data.pkl``."""
    import sys

    from torch.serialization import _serialization_tls

    if _serialization_tls.skip_data or getattr(_serialization_tls, "materialize_fake_tensors", False):
        raise _Fallback("skip_data")
    out = _Collector() if out is None else out
    buf = io.BytesIO()
    p = _FastPickler(buf, lambda key, st: out.write_record(f"data/{key}", st, st.nbytes()))
    p.dump(obj)
    data = buf.getvalue()
    out.write_record("data.pkl", data, len(data))
    out.write_record(".format_version", "1", 1)
    out.write_record(".storage_alignment", str(ALIGN), len(str(ALIGN)))
    out.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    return out


def _torch_save_records(
    obj: Any,
    on_storage: Optional[Callable[[Record, torch.UntypedStorage], None]] = None,
    fast_pickler: Optional[bool] = None,
) -> _Collector:
    """The records ``torch.save(obj)`` would write, with storages referenced, not copied.

    Plain dense CPU tensors (the usual checkpoint) are pickled by :class:`_FastPickler`, which writes the
    bytes torch would; anything else runs torch's own pickling (``torch.serialization._save``), so tensor
    subclasses, nested and sparse tensors, storages and ``persistent_id`` keys are exactly torch's.
    ``on_storage`` sees each storage record as it arrives: during pickling on the fast path, after it on
    torch's. Raises :class:`RestartWithoutStreaming` when the fast path gives up after it has seen some.
    """
    if FAST_PICKLER if fast_pickler is None else fast_pickler:
        out = _Collector(on_storage)
        try:
            return _fast_save_records(obj, out)
        except _Fallback:
            if out.storages and on_storage is not None:
                raise RestartWithoutStreaming() from None
    save = getattr(torch.serialization, "_save", None)
    if save is None:  # pragma: no cover - torch changed its internals
        raise RuntimeError(f"torch {torch.__version__} has no torch.serialization._save")
    out = _Collector(on_storage)
    save(obj, out, pickle, 2, False)
    return out


class ZipPlan:
    """Where every record of one checkpoint goes; the bytes around the storages are produced here.

    :meth:`lay_out` pickles the object and places its records. A writer writes, in increasing offsets: for each
    non-empty storage ``i``, :meth:`lead` (the bytes between the previous storage's data and this one's:
    descriptors, small records, local headers) and then the storage's bytes at ``records[...].data_offset``;
    finally :meth:`tail`. :class:`PlanWriter` does this bookkeeping for a ``native_io`` writer.

    Two layouts, both ``torch.load``-able:

    * ``congruent=False``: exactly ``torch.save``'s at ``storage_alignment=4096`` (records in torch's order,
      every record's data 4096-aligned), so torch's offset arithmetic holds too;
    * ``congruent=True``: the storages come first, in the order the pickler meets them, so each can be written
      while the rest is pickled; ``data.pkl`` and the small records follow them. CPU storages of at least
      ``CONGRUENT_MIN`` bytes start at an offset congruent to their memory modulo ``ALIGN``, the rest on an
      ``ALIGN`` boundary. The central directory lists the records in torch's order (``data.pkl`` first: torch
      names the archive after its first entry). There is no ``.format_version`` record: torch then reads every
      record's offset from its local header, as for files written before torch 2.3.
    """

    def __init__(self, meta: Optional[dict] = None, zip_crc32: bool = False, congruent: bool = False) -> None:
        self.zip_crc32 = zip_crc32
        self.meta = meta or {}
        self.congruent = congruent
        self.file_id = secrets.token_hex(16)
        self.records: list[Record] = []  # in file order
        self.central: list[Record] = []  # in central-directory order
        self.storages: list[torch.UntypedStorage] = []
        #: record -> [path, dtype, shape] of the records a load may read straight into an ``into=`` target
        self.whole_tensors: dict[str, list] = {}
        self.storage_record: dict[int, Record] = {}
        self.storage_starts: dict[int, Record] = {}  # data offset -> non-empty storage record
        self.storage_offsets: list[int] = []  # their data offsets, increasing
        self.data_end = 0  # where the next record's header goes; after lay_out, the integrity record's
        self._written_upto = 0  # file offset up to which bytes have been produced (lead or storage)
        self._pos = 0  # next record whose header has not been produced
        self._prev: Optional[Record] = None  # last storage handed out: its descriptor comes next

    def lay_out(
        self,
        obj: Any,
        on_storage: Optional[Callable[[int, torch.UntypedStorage], None]] = None,
        fast_pickler: Optional[bool] = None,
    ) -> None:
        """Pickle ``obj`` and place every record. ``on_storage(i, storage)`` is called once each storage is placed:
        with ``congruent``, during pickling. Raises :class:`RestartWithoutStreaming` (see there)."""

        def placed(rec: Record, st: torch.UntypedStorage) -> None:
            big = self.congruent and st.device.type == "cpu" and rec.nbytes >= CONGRUENT_MIN
            self._append(rec, st.data_ptr() if big else None)
            if on_storage is not None:
                on_storage(rec.storage, st)  # type: ignore[arg-type]

        if self.congruent:
            c = _torch_save_records(obj, placed, fast_pickler)
            small = [r for r in c.small if r.name != ".format_version"]
        else:
            c = _torch_save_records(obj, None, fast_pickler)
            small = c.small
        self.storages = c.storages
        self.whole_tensors = whole_tensors(obj, [(r.name, st) for r, st in zip(c.storage_records, c.storages)])
        sid = str(secrets.randbits(128)).zfill(40).encode()
        trailer = [Record("version", 2, payload=b"3\n"), Record(".data/serialization_id", len(sid), payload=sid)]
        if self.congruent:
            for rec in small + trailer:
                self._append(rec)
        else:
            for rec in small:
                self._append(rec)
            for rec, st in zip(c.storage_records, c.storages):
                placed(rec, st)
            for rec in trailer:
                self._append(rec)
        self.central = small + c.storage_records + trailer

    def _append(self, rec: Record, address: Optional[int] = None) -> None:
        _place(rec, self.data_end, address)
        if rec.payload is not None:
            rec.crc32c = crc32c(rec.payload)
            if self.zip_crc32:
                rec.zip_crc = zlib.crc32(rec.payload)
        self.data_end = rec.end()
        self.records.append(rec)
        if rec.storage is not None:
            self.storage_record[rec.storage] = rec
            if rec.nbytes:
                self.storage_starts[rec.data_offset] = rec
                self.storage_offsets.append(rec.data_offset)

    def set_crc32c(self, storage: int, crc: int) -> None:
        self.storage_record[storage].crc32c = int(crc)

    @property
    def storage_bytes(self) -> int:
        return sum(r.nbytes for r in self.storage_record.values())

    def size_estimate(self) -> int:
        """An upper estimate of the file size, known before any byte is written (for preallocation).

        Exact up to ``data_end``; the tail (integrity record, central directory, end records) is bounded
        from the record names and counts. The writer truncates to the exact size at close.
        """
        names = sum(len(r.name) for r in self.records)
        n = len(self.records) + 1
        return self.data_end + 4096 + 2 * names + 160 * n

    def lead(self, storage: int) -> tuple[int, bytes]:
        """``(offset, bytes)`` to write just before storage ``storage``'s data (its predecessors are done)."""
        rec = self.storage_record[storage]
        at = self._written_upto
        out = bytearray(descriptor(self._prev) if self._prev is not None else b"")
        while True:
            r = self.records[self._pos]
            self._pos += 1
            if r is rec:
                out += local_header(r)
                break
            if r.storage is not None and r.nbytes:
                raise ValueError(f"storages must be written in file order: {r.name} comes before {rec.name}")
            out += local_header(r) + (r.payload or b"") + descriptor(r)
        self._written_upto, self._prev = rec.data_end, rec
        return at, bytes(out)

    def tail(self) -> tuple[int, bytes, int]:
        """``(offset, bytes, file size)``: the rest after the last storage (record checksums must be set)."""
        at = self._written_upto
        out = bytearray(descriptor(self._prev) if self._prev is not None else b"")
        for r in self.records[self._pos :]:
            if r.storage is not None and r.nbytes:
                raise ValueError(f"storage record {r.name} was never written")
            out += local_header(r) + (r.payload or b"") + descriptor(r)
        self._pos = len(self.records)
        integrity = json.dumps(
            {
                "format": INTEGRITY_FORMAT,
                "version": FORMAT_VERSION,
                "file_id": self.file_id,
                "align": ALIGN,
                "meta": self.meta,
                "records": [[r.name, r.data_offset, r.nbytes, r.crc32c] for r in self.records],
                "whole_tensors": self.whole_tensors,
            },
            separators=(",", ":"),
        ).encode()
        irec = Record(INTEGRITY_RECORD, len(integrity), payload=integrity)
        _place(irec, self.data_end)
        irec.crc32c = crc32c(integrity)
        if self.zip_crc32:
            irec.zip_crc = zlib.crc32(integrity)
        out += local_header(irec) + integrity + descriptor(irec)
        cd_offset = irec.end()
        central = b"".join(_central_entry(r) for r in self.central + [irec])
        n = len(self.records) + 1
        eocd64_offset = cd_offset + len(central)
        z64 = _EOCD64.pack(_SIG_EOCD64, 44, 0, 0, 0, 0, n, n, len(central), cd_offset)
        z64 += _LOCATOR.pack(_SIG_LOCATOR, 0, eocd64_offset, 1)
        comment = COMMENT_TAG + (
            f"{irec.data_offset} {irec.nbytes} {irec.crc32c:08x} {crc32c(central + z64):08x}".encode()
        )
        end = _EOCD.pack(
            _SIG_EOCD, 0, 0, min(n, _U16), min(n, _U16), min(len(central), _U32), min(cd_offset, _U32), len(comment)
        )
        out += central + z64 + end + comment
        return at, bytes(out), at + len(out)


def plan_archive(obj: Any, meta: Optional[dict] = None, zip_crc32: bool = False) -> ZipPlan:
    """The plan of ``obj`` in torch's own layout (see :class:`ZipPlan`), all records placed."""
    plan = ZipPlan(meta, zip_crc32)
    plan.lay_out(obj)
    return plan


class PlanWriter:
    """Wraps a ``native_io`` writer: writes each storage's lead bytes before its data, the tail at the end.

    ``write(segments)`` takes storage bytes at their data offsets, in file order, possibly in chunks;
    it returns their CRC-32C values like the engine does (one per segment). ``finish()`` writes the
    tail and closes (fdatasync). ``ZipPlan.records[...].crc32c`` must be set before ``finish``.
    """

    def __init__(self, plan: ZipPlan, writer: Any) -> None:
        self.plan = plan  # may still be laying out (a congruent plan streams): its storages are looked up late
        self.writer = writer
        self._led: set[int] = set()  # data offsets of the storages whose lead is written

    def write(self, segments: list, wait: bool = True) -> list[int]:
        """``wait=False``: see ``native_io``'s ``Writer.write`` (the buffers must not change before ``finish``)."""
        out: list = []
        want: list = []
        for off, buf in segments:
            lead = self._lead_before(off, buf)
            if lead is not None:
                out.append(lead)
                want.append(False)
            out.append((off, buf))
            want.append(True)
        crcs = self.writer.write(out, wait=wait) if out else []
        return [int(c) for c, w in zip(crcs, want) if w]

    def write_unstaged(self, off: int, buf: Any, crc: Optional[int] = None) -> int:
        """One chunk of storage bytes at ``off`` through ``Writer.write_unstaged`` (sent to the device from
        ``buf``'s own memory when it is aligned, the storage's lead bytes staged before it); returns its CRC-32C."""
        lead = self._lead_before(off, buf)
        if lead is not None:
            self.writer.write([lead])
        return int(self.writer.write_unstaged(off, buf, crc))

    def _lead_before(self, off: int, buf: Any) -> Optional[tuple]:
        """``(offset, bytes)`` of the lead (local header) to write before the storage starting at ``off``, if
        any; also folds ``buf`` into the storage's zip CRC-32 when the plan keeps one."""
        lead = None
        rec = self.plan.storage_starts.get(off)
        if rec is not None and off not in self._led:
            self._led.add(off)
            lead_at, data = self.plan.lead(rec.storage)  # type: ignore[arg-type]
            if data:
                lead = (lead_at, data)
        if self.plan.zip_crc32:
            owner = self._owner(off)
            owner.zip_crc = zlib.crc32(buf, owner.zip_crc if off != owner.data_offset else 0)
        return lead

    def _owner(self, off: int) -> Record:
        offsets = self.plan.storage_offsets
        r = self.plan.storage_starts[offsets[bisect.bisect_right(offsets, off) - 1]]
        if not r.data_offset <= off < r.data_end:  # pragma: no cover - a caller bug
            raise ValueError(f"offset {off} is not inside a storage record")
        return r

    def close(self) -> None:
        """Close without finishing (a failed save: the temporary file is removed by the caller)."""
        self.writer.close()

    def finish(self) -> None:
        at, data, size = self.plan.tail()
        self.writer.write([(at, data)])
        self.writer.close(size=size)


# ------------------------------------------------------------------------------------------- parse


@dataclasses.dataclass
class ArchiveIndex:
    """What the end record, central directory and integrity record of a format-2 file say."""

    path: str
    size: int
    file_id: str
    meta: dict
    records: dict[str, Record]  # name (without prefix) -> record, in file order
    integrity_offset: int
    integrity_length: int
    central_offset: int
    #: record -> (path, dtype, shape) of the records holding one whole tensor (``state_tensors.whole_tensors``);
    #: None for a file written before the writer listed them
    whole_tensors: Optional[dict[str, tuple[str, str, list[int]]]] = None

    def storage_records(self) -> list[Record]:
        return [r for n, r in self.records.items() if n.startswith("data/")]


def parse_tail(tail: bytes, size: int, path: str) -> Optional[tuple[int, int, int, int, int, int]]:
    """From the last bytes of a ZIP: ``(integrity offset, length, crc32c, cd offset, cd end, cd crc32c)``.

    None for a valid ZIP end record without our comment (a plain ``torch.save`` file). Raises
    :class:`CheckpointCorruptError` when there is no end record (truncated, or not a ZIP).
    """
    at = tail.rfind(struct.pack("<I", _SIG_EOCD))
    if at < 0 or len(tail) - at < _EOCD.size:
        raise CheckpointCorruptError(
            f"{path}: no ZIP end record in the last {len(tail)} bytes: the file is truncated or not a checkpoint",
            path,
        )
    _, _, _, _, _, cd_size, cd_off, clen = _EOCD.unpack_from(tail, at)
    comment = tail[at + _EOCD.size : at + _EOCD.size + clen]
    if not comment.startswith(COMMENT_TAG):
        return None
    if at + _EOCD.size + clen != len(tail):
        raise CheckpointCorruptError(
            f"{path}: {len(tail) - at - _EOCD.size - clen} stray bytes after the end record", path
        )
    try:
        off, length, crc, cd_crc = comment[len(COMMENT_TAG) :].split()
        io_off, io_len, io_crc, c_crc = int(off), int(length), int(crc, 16), int(cd_crc, 16)
    except ValueError:
        raise CheckpointCorruptError(
            f"{path}: damaged lightning-recover end-record comment {comment!r}", path
        ) from None
    eocd_at = size - (len(tail) - at)
    loc_at = at - _LOCATOR.size
    if loc_at < 0:
        raise CheckpointCorruptError(f"{path}: zip64 locator missing before the end record (truncated?)", path)
    sig, _, eocd64_offset, _ = _LOCATOR.unpack_from(tail, loc_at)
    if sig != _SIG_LOCATOR or not io_off + io_len <= eocd64_offset < eocd_at:
        raise CheckpointCorruptError(f"{path}: damaged zip64 locator at offset {size - (len(tail) - loc_at)}", path)
    z64 = bytes(_EOCD64.size)
    z64_at = eocd64_offset - (size - len(tail))
    if z64_at >= 0:
        z64 = tail[z64_at : z64_at + _EOCD64.size]
    cd_offset = cd_off if cd_off != _U32 else _EOCD64.unpack(z64)[9] if z64_at >= 0 else -1
    if not io_off + io_len <= cd_offset <= eocd64_offset:
        raise CheckpointCorruptError(f"{path}: damaged end records (central directory at {cd_offset})", path)
    return io_off, io_len, io_crc, cd_offset, eocd_at, c_crc


def parse_archive(path: str, size: int, found: tuple, integrity: bytes, central_and_z64: bytes) -> ArchiveIndex:
    """Check the integrity record and central directory (already read, where ``found`` -- from
    :func:`parse_tail` -- says) against their checksums and each other."""
    io_off, io_len, io_crc, central_offset, _, cd_crc = found
    if crc32c(integrity) != io_crc:
        raise CheckpointCorruptError(f"{path}: integrity record checksum mismatch: damaged file", path)
    if crc32c(central_and_z64) != cd_crc:
        raise CheckpointCorruptError(f"{path}: central directory checksum mismatch: damaged file", path)
    try:
        doc = json.loads(integrity)
        if doc.get("format") != INTEGRITY_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"version {doc.get('version')!r} (this build reads {FORMAT_VERSION})")
        records = {}
        for name, off, n, crc in doc["records"]:
            records[str(name)] = Record(str(name), int(n), data_offset=int(off), crc32c=int(crc))
        whole = _parse_whole_tensors(doc.get("whole_tensors"), records)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointCorruptError(f"{path}: unreadable integrity record: {e}", path) from None
    central = _parse_central(central_and_z64, path)
    for name, rec in records.items():
        entry = central.get(f"{ARCHIVE}/{name}")
        if entry is None:
            raise CheckpointCorruptError(f"{path}: record {name!r} is missing from the central directory", path)
        rec.header_offset, rec.zip_crc = entry[0], entry[2]
        if entry[1] != rec.nbytes or not 0 < rec.data_offset - rec.header_offset <= ALIGN + 1024:
            raise CheckpointCorruptError(f"{path}: central directory and integrity record disagree on {name!r}", path)
        if rec.data_end > central_offset:
            raise CheckpointCorruptError(f"{path}: record {name!r} extends past the data area", path)
    return ArchiveIndex(
        path,
        size,
        str(doc.get("file_id", "")),
        dict(doc.get("meta") or {}),
        records,
        io_off,
        io_len,
        central_offset,
        whole,
    )


def _parse_whole_tensors(listed: Any, records: dict[str, Record]) -> Optional[dict[str, tuple[str, str, list[int]]]]:
    """The integrity record's ``whole_tensors``, checked for shape (``ValueError``/``TypeError`` otherwise)."""
    if listed is None:
        return None
    if not isinstance(listed, dict):
        raise TypeError("whole_tensors is not a mapping")
    out = {}
    for record, (path, dtype, shape) in listed.items():
        if record not in records or not isinstance(path, str) or not isinstance(dtype, str):
            raise ValueError(f"whole_tensors names {record!r} wrongly")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"whole_tensors gives {record!r} the shape {shape!r}")
        out[record] = (path, dtype, shape)
    return out


def _parse_central(buf: bytes, path: str) -> dict[str, tuple[int, int, int]]:
    """``name -> (local header offset, size, zip crc)`` from central directory bytes."""
    out: dict[str, tuple[int, int, int]] = {}
    at = 0
    while at + 4 <= len(buf) and struct.unpack_from("<I", buf, at)[0] == _SIG_CENTRAL:
        if at + _CENTRAL.size > len(buf):
            break
        f = _CENTRAL.unpack_from(buf, at)
        crc, usize, nlen, elen, clen, off = f[7], f[9], f[10], f[11], f[12], f[16]
        name = buf[at + _CENTRAL.size : at + _CENTRAL.size + nlen].decode("utf-8", "replace")
        extra = buf[at + _CENTRAL.size + nlen : at + _CENTRAL.size + nlen + elen]
        if usize == _U32 or off == _U32:
            vals = list(struct.unpack_from(f"<{(len(extra) - 4) // 8}Q", extra, 4)) if len(extra) >= 12 else []
            if usize == _U32 and vals:
                usize = vals.pop(0)
                vals.pop(0) if vals else None  # compressed size
            if off == _U32 and vals:
                off = vals.pop(0)
        out[name] = (off, usize, crc)
        at += _CENTRAL.size + nlen + elen + clen
    if not out:
        raise CheckpointCorruptError(f"{path}: empty or unreadable central directory", path)
    return out


def check_local_headers(headers: dict[str, bytes], index: ArchiveIndex) -> list[str]:
    """Names of records whose local header (bytes from header offset to data offset) is not what torch expects."""
    bad = []
    for name, raw in headers.items():
        rec = index.records[name]
        full = _full_name(name)
        ok = len(raw) >= _LOCAL.size + len(full) and struct.unpack_from("<I", raw)[0] == _SIG_LOCAL
        if ok:
            f = _LOCAL.unpack_from(raw)
            ok = f[9] == len(full) and raw[_LOCAL.size : _LOCAL.size + len(full)] == full
            ok = ok and _LOCAL.size + f[9] + f[10] == rec.data_offset - rec.header_offset
        if not ok:
            bad.append(name)
    return bad


# -------------------------------------------------------------------------------------------- load


class StorageLookup(Protocol):
    """Where :class:`VerifiedArchive` finds a record's storage: a dict, or ``StorageReads`` (waits for each read)."""

    def __contains__(self, name: str) -> bool: ...

    def __getitem__(self, name: str) -> torch.UntypedStorage: ...


class VerifiedArchive:
    """Stands in for torch's zip reader in ``torch.serialization._load``, over records already read and verified."""

    def __init__(self, index: ArchiveIndex, small: dict[str, bytes], storages: StorageLookup):
        self._index = index
        self._small = small
        self._storages = storages

    def has_record(self, name: str) -> bool:
        return name in self._small or name in self._storages

    def get_record(self, name: str) -> bytes:
        return self._small[name]

    def get_storage_from_record(self, name: str, nbytes: int, _type: Any) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8).set_(self.storage(name, nbytes))

    def storage(self, name: str, nbytes: int) -> torch.UntypedStorage:
        """The verified storage of record ``name``, which the pickle says holds ``nbytes`` bytes."""
        st = self._storages[name]
        if st.nbytes() != nbytes:
            raise CheckpointCorruptError(
                f"{self._index.path}: record {name!r} holds {st.nbytes()} bytes, the pickle expects {nbytes}",
                self._index.path,
            )
        return st

    def serialization_id(self) -> str:
        return self._small.get(".data/serialization_id", b"").decode()

    def get_record_offset(self, name: str) -> int:
        return self._index.records[name].data_offset

    def get_record_header_offset(self, name: str) -> int:
        return self._index.records[name].header_offset

    def get_record_offset_no_read(self, header_offset: int, name: str, nbytes: int, alignment: int) -> int:
        return self._index.records[name].data_offset


def file_meta() -> dict:
    """What the integrity record says about the file's origin (``inspect`` shows it)."""
    return {"created_by": "lightning-recover", "torch_version": torch.__version__, "host": os.uname().nodename}


#: Classes beyond torch's own that ``weights_only=True`` loads admit: they only hold data, and Lightning
#: checkpoints carry them (hyper-parameters as AttributeDict or Namespace, paths, dates). Only modules already
#: imported are looked up (:func:`_extra_safe_globals`).
SAFE_GLOBALS: frozenset = frozenset(
    {
        ("builtins", n)
        for n in (
            "dict",
            "list",
            "tuple",
            "set",
            "frozenset",
            "int",
            "float",
            "complex",
            "str",
            "bytes",
            "bytearray",
            "bool",
            "slice",
            "range",
            "object",
        )
    }
    | {
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        ("collections", "Counter"),
        ("torch", "Size"),
        ("torch", "device"),
        ("argparse", "Namespace"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("datetime", "datetime"),
        ("datetime", "date"),
        ("datetime", "time"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("lightning.fabric.utilities.data", "AttributeDict"),
        ("lightning.pytorch.utilities.parsing", "AttributeDict"),
        ("lightning_fabric.utilities.data", "AttributeDict"),
        ("pytorch_lightning.utilities.parsing", "AttributeDict"),
    }
)


def _extra_safe_globals() -> list:
    """The :data:`SAFE_GLOBALS` classes of modules already imported (Lightning's AttributeDict, Namespace, ...)."""
    import sys

    out = []
    for module, name in sorted(SAFE_GLOBALS):
        # only modules already imported: importing one here (a whole second Lightning, say) would hold the
        # import lock for seconds, and a process whose heartbeat thread needs it would look hung
        cls = getattr(sys.modules.get(module), name, None) if module != "builtins" else None
        if cls is not None:
            out.append(cls)
    return out


def unpickle(archive: VerifiedArchive, path: str, map_location: Any, weights_only: bool) -> Any:
    """Rebuild the checkpoint with torch's own loader, so the result equals ``torch.load``'s."""
    load = getattr(torch.serialization, "_load", None)
    if load is None:  # pragma: no cover - torch changed its internals
        raise RuntimeError(f"torch {torch.__version__} has no torch.serialization._load")
    if not weights_only:
        return load(archive, map_location, pickle, encoding="utf-8")
    from torch import _weights_only_unpickler

    try:
        with torch.serialization.safe_globals(_extra_safe_globals()):
            if fast_unpickle.fast_path_usable(map_location, archive):
                try:
                    return fast_unpickle.unpickle_fast(archive.get_record("data.pkl"), archive.storage)
                except fast_unpickle.NotFast:
                    pass  # torch's loader does the whole load: it accepts, or refuses, what it always does
            return load(archive, map_location, _weights_only_unpickler, encoding="utf-8")
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: weights_only load refused: {e}. Load with weights_only=False only if you trust the file, "
            "or allow the global with torch.serialization.add_safe_globals([...])."
        ) from None


def unpickle_on_meta(archive: VerifiedArchive, path: str, slow: bool = True) -> Any:
    """The checkpoint rebuilt on meta storages (no data read), each carrying its record's file offset as
    ``_checkpoint_offset`` (as torch's loader sets it for ``map_location="meta"``): with the restricted fast
    unpickler where it takes the pickle (a load into existing tensors waits for this listing before its reads
    start, and torch's pure-Python unpickler is the slower one), else with torch's loader; with ``slow`` False,
    raises :class:`~lightning_recover.checkpoint.file.fast_unpickle.NotFast` instead."""
    if fast_unpickle.fast_path_usable("cpu", archive):  # "cpu": the storages were saved from the CPU

        def meta_storage(name: str, nbytes: int) -> torch.UntypedStorage:
            st = torch.UntypedStorage(nbytes, device="meta")
            st._checkpoint_offset = archive.get_record_offset(name)
            return st

        try:
            with torch.serialization.safe_globals(_extra_safe_globals()):
                return fast_unpickle.unpickle_fast(archive.get_record("data.pkl"), meta_storage)
        except (fast_unpickle.NotFast, KeyError):  # KeyError: a storage without a record
            pass
    if not slow:
        raise fast_unpickle.NotFast("the tensors cannot be listed with the fast unpickler")
    return unpickle(archive, path, "meta", True)
