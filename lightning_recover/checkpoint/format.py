"""The lightning-recover checkpoint file format (version 1): pure logic, no I/O engine, no Lightning.

See ``docs/format.md`` for the byte-level description. In short::

    [0, 4096)                       header: magic, format version, flags, file id, crc32c
    [4096, data_end)                storage extents, each aligned to 64 bytes (4096 if >= 1 MiB)
    [index_offset, +index_length)   index: UTF-8 JSON (storages with offset/length/crc32c, tensors)
    [skeleton_offset, +length)      skeleton: pickle of the nested state, tensors as persistent ids
    [size - 128, size)              footer: magic, version, offsets/lengths, crc32c of index+skeleton

This module knows how to plan the layout, encode/decode header, footer, index and skeleton, rebuild
tensors from raw storages, and check extents against their checksums. The I/O lives in
``file/single_file.py``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from lightning_recover.checkpoint.integrity import (
    LARGE_ALIGN,
    LARGE_EXTENT,
    SMALL_ALIGN,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    UnsafeCheckpointError,
    align_up,
    congruent_offset,
    crc32c,
    extent_alignment,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "FOOTER_SIZE",
    "SMALL_ALIGN",
    "LARGE_ALIGN",
    "LARGE_EXTENT",
    "CheckpointCorruptError",
    "CheckpointIncompleteError",
    "UnsafeCheckpointError",
    "Header",
    "Footer",
    "StorageEntry",
    "TensorEntry",
    "Index",
    "EncodedCheckpoint",
    "align_up",
    "congruent_offset",
    "extent_alignment",
    "plan_layout",
    "encode_header",
    "decode_header",
    "encode_footer",
    "decode_footer",
    "encode_index",
    "decode_index",
    "encode_checkpoint",
    "decode_skeleton",
    "rebuild_tensors",
    "damaged_extents",
    "tensor_paths",
    "SAFE_GLOBALS",
]

FORMAT_VERSION = 1
HEADER_SIZE = 4096
FOOTER_SIZE = 128

HEADER_MAGIC = b"\x89LRCKPT\n"
FOOTER_MAGIC = b"\x89LRFOOT\n"
# Flag bits 0..15 are "must understand": a reader refuses a file with an unknown one.
# Bits 16..31 are informational and may be ignored. Version 1 defines none.
KNOWN_REQUIRED_FLAGS = 0
_REQUIRED_FLAG_MASK = 0xFFFF

# header: magic, version, flags, header_size, data_start, file_id  (+ crc32c u32)
_HEADER = struct.Struct("<8sIIQQ16s")
# footer: magic, version, flags, index_offset, index_length, skeleton_offset, skeleton_length,
#         data_end, meta_crc32c, file_id  (+ reserved zeros, crc32c u32 at 116, tail magic at 120)
_FOOTER = struct.Struct("<8sIIQQQQQI16s")
_FOOTER_CRC_AT = 116
_PICKLE_PROTOCOL = 4


# --------------------------------------------------------------------------------------- layout


def plan_layout(sizes: Sequence[int], data_start: int = HEADER_SIZE) -> tuple[list[int], int]:
    """File offsets for extents of ``sizes`` bytes, in order, and the end of the data area.

    Empty extents get the current cursor as offset and occupy nothing.
    """
    offsets = []
    cursor = data_start
    for n in sizes:
        if n < 0:
            raise ValueError(f"negative extent size {n}")
        if n == 0:
            offsets.append(cursor)
            continue
        off = align_up(cursor, extent_alignment(n))
        offsets.append(off)
        cursor = off + n
    return offsets, cursor


# ------------------------------------------------------------------------------- header/footer


@dataclasses.dataclass
class Header:
    version: int
    flags: int
    header_size: int
    data_start: int
    file_id: bytes


@dataclasses.dataclass
class Footer:
    version: int
    flags: int
    index_offset: int
    index_length: int
    skeleton_offset: int
    skeleton_length: int
    data_end: int
    meta_crc32c: int
    file_id: bytes


def encode_header(file_id: bytes, flags: int = 0) -> bytes:
    fixed = _HEADER.pack(HEADER_MAGIC, FORMAT_VERSION, flags, HEADER_SIZE, HEADER_SIZE, file_id)
    buf = bytearray(HEADER_SIZE)
    buf[: len(fixed)] = fixed
    struct.pack_into("<I", buf, len(fixed), crc32c(fixed))
    return bytes(buf)


def _describe_foreign(buf: bytes) -> str:
    if buf[:4] == b"PK\x03\x04":
        return "a zip archive (torch.save format?), not a lightning-recover checkpoint"
    if buf[:1] == b"\x80":
        return "a pickle stream (legacy torch.save format?), not a lightning-recover checkpoint"
    if not any(buf):
        return "zero-filled where the header should be"
    return "not a lightning-recover checkpoint (bad header magic)"


def decode_header(buf: bytes, path: str = "<buffer>") -> Header:
    if len(buf) < _HEADER.size + 4:
        raise CheckpointCorruptError(f"{path}: file too small to be a checkpoint", path)
    if buf[:8] != HEADER_MAGIC:
        raise CheckpointCorruptError(f"{path}: {_describe_foreign(bytes(buf[:HEADER_SIZE]))}", path)
    fixed = bytes(buf[: _HEADER.size])
    (crc,) = struct.unpack_from("<I", buf, _HEADER.size)
    if crc32c(fixed) != crc:
        raise CheckpointCorruptError(f"{path}: header checksum mismatch (damaged header at offset 0)", path)
    _, version, flags, header_size, data_start, file_id = _HEADER.unpack(fixed)
    if version > FORMAT_VERSION or version < 1:
        raise CheckpointCorruptError(
            f"{path}: unsupported checkpoint format version {version} (this reader supports <= {FORMAT_VERSION})",
            path,
        )
    if flags & _REQUIRED_FLAG_MASK & ~KNOWN_REQUIRED_FLAGS:
        raise CheckpointCorruptError(f"{path}: unsupported required flags {flags:#x} in header", path)
    if header_size != HEADER_SIZE or data_start < HEADER_SIZE:
        raise CheckpointCorruptError(f"{path}: inconsistent header (header_size={header_size})", path)
    return Header(version, flags, header_size, data_start, file_id)


def encode_footer(footer: Footer) -> bytes:
    fixed = _FOOTER.pack(
        FOOTER_MAGIC,
        footer.version,
        footer.flags,
        footer.index_offset,
        footer.index_length,
        footer.skeleton_offset,
        footer.skeleton_length,
        footer.data_end,
        footer.meta_crc32c,
        footer.file_id,
    )
    buf = bytearray(FOOTER_SIZE)
    buf[: len(fixed)] = fixed
    struct.pack_into("<I", buf, _FOOTER_CRC_AT, crc32c(bytes(buf[:_FOOTER_CRC_AT])))
    buf[FOOTER_SIZE - 8 :] = FOOTER_MAGIC
    return bytes(buf)


def decode_footer(buf: bytes, file_size: int, header: Header, path: str = "<buffer>") -> Footer:
    """Decode and validate the footer (the last FOOTER_SIZE bytes of a file of ``file_size`` bytes)."""
    if len(buf) != FOOTER_SIZE or buf[:8] != FOOTER_MAGIC or buf[FOOTER_SIZE - 8 :] != FOOTER_MAGIC:
        raise CheckpointCorruptError(
            f"{path}: footer missing or damaged at offset {file_size - FOOTER_SIZE} "
            "(file truncated, incompletely written, or damaged)",
            path,
        )
    (crc,) = struct.unpack_from("<I", buf, _FOOTER_CRC_AT)
    if crc32c(bytes(buf[:_FOOTER_CRC_AT])) != crc:
        raise CheckpointCorruptError(
            f"{path}: footer checksum mismatch at offset {file_size - FOOTER_SIZE} (damaged footer)", path
        )
    f = Footer(*_FOOTER.unpack_from(buf, 0)[1:])
    if f.version != header.version or f.file_id != header.file_id:
        raise CheckpointCorruptError(f"{path}: header and footer do not belong to the same file", path)
    meta_end = file_size - FOOTER_SIZE
    if not (
        header.data_start <= f.data_end <= f.index_offset
        and f.index_offset + f.index_length == f.skeleton_offset
        and f.skeleton_offset + f.skeleton_length == meta_end
    ):
        raise CheckpointCorruptError(
            f"{path}: footer offsets inconsistent with the file size {file_size} (truncated or extended file?)",
            path,
        )
    return f


# ------------------------------------------------------------------------------------- index


_DTYPES: dict[str, torch.dtype] = {}
for _name in dir(torch):
    _obj = getattr(torch, _name, None)
    if isinstance(_obj, torch.dtype):
        _DTYPES.setdefault(str(_obj).replace("torch.", ""), _obj)
        _DTYPES.setdefault(_name, _obj)  # aliases (float == float32) resolve too


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (not available in torch {torch.__version__})") from None


@dataclasses.dataclass
class StorageEntry:
    offset: int
    nbytes: int
    crc32c: int
    device: str = "cpu"


@dataclasses.dataclass
class TensorEntry:
    name: str
    storage: int
    dtype: str
    shape: list
    stride: list
    storage_offset: int
    requires_grad: bool = False
    parameter: bool = False

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * dtype_from_name(self.dtype).itemsize

    def file_offset(self, storages: Sequence[StorageEntry]) -> int:
        return storages[self.storage].offset + self.storage_offset * dtype_from_name(self.dtype).itemsize


@dataclasses.dataclass
class Index:
    storages: list
    tensors: list
    meta: dict = dataclasses.field(default_factory=dict)

    def tensors_of_storage(self, i: int) -> list:
        return [t.name for t in self.tensors if t.storage == i]


def encode_index(index: Index) -> bytes:
    doc = {
        "format_version": FORMAT_VERSION,
        "meta": index.meta,
        "storages": [[s.offset, s.nbytes, s.crc32c, s.device] for s in index.storages],
        "tensors": [
            [
                t.name,
                t.storage,
                t.dtype,
                list(t.shape),
                list(t.stride),
                t.storage_offset,
                int(t.requires_grad) | (2 if t.parameter else 0),
            ]
            for t in index.tensors
        ],
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_index(buf: bytes, data_start: int, data_end: int, path: str = "<buffer>") -> Index:
    def bad(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: invalid index ({why})", path)

    try:
        doc = json.loads(bytes(buf).decode("utf-8"))
        storages = [StorageEntry(int(o), int(n), int(c), str(d)) for o, n, c, d in doc["storages"]]
        tensors = [
            TensorEntry(
                str(nm),
                int(si),
                str(dt),
                [int(x) for x in shp],
                [int(x) for x in st],
                int(so),
                bool(fl & 1),
                bool(fl & 2),
            )
            for nm, si, dt, shp, st, so, fl in doc["tensors"]
        ]
        meta = doc.get("meta", {})
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise bad(str(e)) from None
    for i, s in enumerate(storages):
        if s.nbytes < 0 or s.offset < data_start or s.offset + s.nbytes > data_end:
            raise bad(f"storage {i} extent [{s.offset}, +{s.nbytes}) outside the data area")
    for t in tensors:
        if not 0 <= t.storage < len(storages):
            raise bad(f"tensor {t.name!r} refers to missing storage {t.storage}")
        try:
            dt = dtype_from_name(t.dtype)
        except ValueError as e:
            raise bad(str(e)) from None
        if len(t.shape) != len(t.stride) or any(x < 0 for x in t.shape) or t.storage_offset < 0:
            raise bad(f"tensor {t.name!r} has an invalid shape/stride")
        if all(x > 0 for x in t.shape):
            last = t.storage_offset + sum((x - 1) * st for x, st in zip(t.shape, t.stride))
            if any(st < 0 for st in t.stride) or (last + 1) * dt.itemsize > storages[t.storage].nbytes:
                raise bad(f"tensor {t.name!r} exceeds its storage")
    return Index(storages, tensors, meta)


# ------------------------------------------------------------------------------ tensor naming


def _children(obj: Any) -> Optional[Iterable[tuple[str, Any]]]:
    if isinstance(obj, dict):
        return ((str(k), v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return ((str(i), v) for i, v in enumerate(obj))
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and not isinstance(obj, (type, torch.nn.Module)):
        return ((str(k), v) for k, v in d.items())
    return None


def tensor_paths(obj: Any) -> dict[int, tuple[str, torch.Tensor]]:
    """Map ``id(tensor) -> (path, tensor)`` for tensors reachable through containers (first path wins).

    Paths join keys with ``/``: ``state_dict/layer.weight``, ``optimizer_states/0/state/3/exp_avg``.
    """
    out: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.setdefault(id(o), (path, o))
            continue
        if isinstance(o, (str, bytes, int, float, bool, type(None))) or id(o) in seen:
            continue
        seen.add(id(o))
        kids = _children(o)
        if kids is None:
            continue
        items = list(kids)
        for k, v in reversed(items):
            stack.append((f"{path}/{k}" if path else k, v))
    return out


# ---------------------------------------------------------------------------------- encoding


@dataclasses.dataclass
class EncodedCheckpoint:
    """The result of taking a checkpoint apart: skeleton bytes, tensor entries and the distinct storages.

    ``storages[i]`` is a ``torch.UntypedStorage`` (on any device) whose bytes go to extent ``i``;
    ``index.storages[i]`` has offset/crc32c still unset (0) until the layout is planned and written.
    """

    skeleton: bytes
    index: Index
    storages: list


class _Collector:
    def __init__(self, names: dict[int, tuple[str, torch.Tensor]]) -> None:
        self._names = names
        self._by_id: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps ids stable while pickling
        self._storage_keys: dict[tuple, int] = {}
        self.storages: list = []
        self.storage_entries: list[StorageEntry] = []
        self.tensors: list[TensorEntry] = []

    def add(self, t: torch.Tensor) -> int:
        key = id(t)
        if key in self._by_id:
            return self._by_id[key]
        name = self._names.get(key, (f"<unnamed:{len(self.tensors)}>",))[0]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"cannot save tensor {name!r} of type {type(t).__qualname__} (only plain tensors)")
        if t.layout != torch.strided:
            raise TypeError(f"cannot save tensor {name!r} with layout {t.layout} (only strided tensors)")
        if t.is_quantized or t.device.type == "meta":
            raise TypeError(f"cannot save tensor {name!r} (quantized or meta tensors are not supported)")
        self._keep.append(t)
        data = t
        if t.is_conj() or t.is_neg():
            data = t.resolve_conj().resolve_neg()
            self._keep.append(data)
        st = data.untyped_storage()
        nbytes = st.nbytes()
        if nbytes > 0:
            skey = (data.device.type, data.device.index, st.data_ptr(), nbytes)
        else:
            skey = ("empty", len(self.storages))
        si = self._storage_keys.get(skey)
        if si is None:
            si = len(self.storages)
            self._storage_keys[skey] = si
            self.storages.append(st)
            self.storage_entries.append(StorageEntry(0, nbytes, 0, str(data.device)))
        self.tensors.append(
            TensorEntry(
                name=name,
                storage=si,
                dtype=dtype_name(data.dtype),
                shape=list(data.shape),
                stride=list(data.stride()),
                storage_offset=data.storage_offset(),
                requires_grad=bool(t.requires_grad),
                parameter=isinstance(t, torch.nn.Parameter),
            )
        )
        idx = len(self.tensors) - 1
        self._by_id[key] = idx
        return idx


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file: Any, collector: _Collector) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self._collector = collector

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return ("tensor", self._collector.add(obj))
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            raise TypeError("bare torch storages cannot be saved in a lightning-recover checkpoint; save a tensor")
        return None


def encode_checkpoint(checkpoint: Any, meta: Optional[dict] = None) -> EncodedCheckpoint:
    """Split ``checkpoint`` into a pickled skeleton (tensors as persistent ids) and its distinct storages."""
    collector = _Collector(tensor_paths(checkpoint))
    buf = io.BytesIO()
    _SkeletonPickler(buf, collector).dump(checkpoint)
    index = Index(collector.storage_entries, collector.tensors, dict(meta or {}))
    return EncodedCheckpoint(buf.getvalue(), index, collector.storages)


# ---------------------------------------------------------------------------------- decoding


def _safe_global_names() -> set[tuple[str, str]]:
    return {
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
    } | {
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


SAFE_GLOBALS: frozenset = frozenset(_safe_global_names())

#: Allowed globals whose call builds an object as large as its arguments say, not as large as the
#: pickle bytes that describe it: ``bytes(1 << 29)``, ``list(range(1 << 30))``, ``str(x)`` of a
#: structure sharing references (its repr doubles per level), ``PosixPath(*[s] * n)``, or any
#: copy of one big object repeated. The unpickler hands out bounded stand-ins for these that
#: charge the size of each call to a budget derived from the skeleton's length.
SIZED_CONSTRUCTORS: frozenset = frozenset(
    {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray")}
    | {("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")}
    | {("torch", "Size")}
    | {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")}
    | {
        ("lightning.fabric.utilities.data", "AttributeDict"),
        ("lightning.pytorch.utilities.parsing", "AttributeDict"),
        ("lightning_fabric.utilities.data", "AttributeDict"),
        ("pytorch_lightning.utilities.parsing", "AttributeDict"),
    }
)


def skeleton_budget(nbytes: int) -> int:
    """Elements/bytes the constructor calls of an ``nbytes`` skeleton may build in total.

    Pickle opcodes alone build at most a few objects per byte; legitimate constructor calls
    (``torch.Size((3, 4))``, ``Counter({...})``, ``PosixPath('/', 'a')``) take arguments that the
    same pickle spelled out, so a small multiple of its length bounds them.
    """
    return 4 * nbytes + (64 << 10)


def _call_cost(real: Any, args: tuple, kwargs: dict) -> int:
    """Size of what ``real(*args, **kwargs)`` builds, judged before calling it."""
    cost = 0
    for a in (*args, *kwargs.values()):
        if isinstance(a, bool):
            continue
        if isinstance(a, int):
            if real is bytes or real is bytearray:  # bytes(n): n zero bytes
                cost += max(a, 0)
        elif isinstance(a, range):
            try:
                cost += len(a)
            except OverflowError:
                return 1 << 62
        elif not isinstance(a, type) and hasattr(a, "__len__"):
            cost += len(a)  # a copy (list(x), Counter(d)) or a join (PosixPath(*parts))
    return cost


def _torch_registered_safe_globals() -> set[str]:
    """Globals the user allowed with ``torch.serialization.add_safe_globals`` (honoured here too)."""
    names: set[str] = set()
    try:
        entries = torch.serialization.get_safe_globals()
    except AttributeError:  # pragma: no cover - old torch
        return names
    for e in entries:
        if isinstance(e, tuple):
            names.add(e[1])
        else:
            names.add(f"{getattr(e, '__module__', '')}.{getattr(e, '__qualname__', getattr(e, '__name__', ''))}")
    return names


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for skeletons: tensors come from ``tensors``; globals only from the allowlist.

    With ``allow_all=True`` it is a plain unpickler (arbitrary code may run).
    """

    def __init__(
        self,
        file: Any,
        tensors: Sequence[Any],
        allow_all: bool = False,
        path: str = "<buffer>",
        extra_safe_globals: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(file)
        self._tensors = tensors
        self._allow_all = allow_all
        self._path = path
        self._extra = set(extra_safe_globals)
        self._bounded: dict[tuple[str, str], Any] = {}
        self._real_of: dict[type, Any] = {}
        self._spent = 0
        try:
            nbytes = len(file.getbuffer())
        except AttributeError:
            nbytes = 0
        self.budget = skeleton_budget(nbytes)

    def _charge(self, name: str, real: Any, args: tuple, kwargs: dict) -> None:
        if real is str and any(not isinstance(a, (str, bytes, bytearray, int, float)) for a in args):
            # str(obj) is repr(obj): exponential in a pickle that shares references
            raise UnsafeCheckpointError(
                f"{self._path}: refused to call '{name}' on a container while loading the skeleton", name
            )
        self._spent += _call_cost(real, args, kwargs)
        if self._spent > self.budget:
            raise UnsafeCheckpointError(
                f"{self._path}: the skeleton's constructor calls ('{name}', ...) would build more than "
                f"{self.budget} elements, far more than its own size allows; refusing a crafted or "
                "corrupt checkpoint",
                name,
            )

    def _bounded_constructor(self, module: str, name: str, real: Any) -> Any:
        """A stand-in for ``real`` that charges each call (REDUCE and NEWOBJ) to the budget first."""
        charge, qualname, real_of = self._charge, f"{module}.{name}", self._real_of

        class Bounded:
            __slots__ = ()

            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                # a stand-in passed as an argument is the type itself: defaultdict(list)
                args = tuple(real_of.get(a, a) if isinstance(a, type) else a for a in args)
                charge(qualname, real, args, kwargs)
                return real(*args, **kwargs)

        Bounded.__name__ = Bounded.__qualname__ = f"bounded_{name}"
        real_of[Bounded] = real
        return Bounded

    def find_class(self, module: str, name: str) -> Any:
        if self._allow_all:
            return super().find_class(module, name)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) in SIZED_CONSTRUCTORS:
            key = (module, name)
            if key not in self._bounded:
                self._bounded[key] = self._bounded_constructor(module, name, super().find_class(module, name))
            return self._bounded[key]
        if (
            (module, name) in SAFE_GLOBALS
            or (module, name) in self._extra
            or f"{module}.{name}" in _torch_registered_safe_globals()
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._path}: refused to load global '{module}.{name}' from the checkpoint (weights_only=True "
            "allows only containers, primitives, torch dtypes/devices/Size, Namespace/AttributeDict, paths). "
            "If you trust this file, load it with weights_only=False, or allow the type with "
            "torch.serialization.add_safe_globals.",
            f"{module}.{name}",
        )

    def persistent_load(self, pid: Any) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 2
            and pid[0] == "tensor"
            and isinstance(pid[1], int)
            and 0 <= pid[1] < len(self._tensors)
        ):
            return self._tensors[pid[1]]
        raise CheckpointCorruptError(f"{self._path}: skeleton refers to unknown tensor {pid!r}", self._path)


def _declared_length_exceeds(buf: bytes) -> bool:
    import pickletools

    try:
        for _ in pickletools.genops(io.BytesIO(buf)):
            pass
    except ValueError:
        return True
    return False


def decode_skeleton(
    buf: bytes,
    tensors: Sequence[Any],
    weights_only: bool = True,
    path: str = "<buffer>",
    extra_safe_globals: Iterable[tuple[str, str]] = (),
) -> Any:
    up = RestrictedUnpickler(
        io.BytesIO(buf), tensors, allow_all=not weights_only, path=path, extra_safe_globals=extra_safe_globals
    )
    try:
        return up.load()
    except (UnsafeCheckpointError, CheckpointCorruptError):
        raise
    except MemoryError:
        # the C unpickler allocates a counted bytes/str before reading it: a declared length
        # beyond the end of the skeleton is corruption (or an attack), not a lack of memory
        if weights_only and _declared_length_exceeds(buf):
            raise CheckpointCorruptError(
                f"{path}: invalid skeleton (an object's declared length runs past its end)", path
            ) from None
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError) as e:
        if not weights_only:
            raise
        raise CheckpointCorruptError(f"{path}: invalid skeleton ({type(e).__name__}: {e})", path) from None


def rebuild_tensors(index: Index, storages: Sequence[Any], path: str = "<buffer>") -> list:
    """Tensors of ``index`` as views of ``storages`` (``torch.UntypedStorage``, one per index storage)."""
    out = []
    for t in index.tensors:
        st = storages[t.storage]
        dt = dtype_from_name(t.dtype)
        try:
            x = torch.empty(0, dtype=dt, device=st.device).set_(st, t.storage_offset, t.shape, t.stride)
        except RuntimeError as e:
            raise CheckpointCorruptError(f"{path}: cannot rebuild tensor {t.name!r}: {e}", path) from None
        if t.parameter:
            x = torch.nn.Parameter(x, requires_grad=t.requires_grad)
        elif t.requires_grad and (dt.is_floating_point or dt.is_complex):
            x.requires_grad_(True)
        out.append(x)
    return out


def damaged_extents(
    index: Index, crcs: Sequence[int], path: str = "<buffer>", which: Optional[Sequence[int]] = None
) -> list[dict]:
    """Compare per-extent ``crcs`` (in the order of ``which``, default all storages) with the index."""
    which = range(len(index.storages)) if which is None else which
    bad = []
    for i, crc in zip(which, crcs):
        s = index.storages[i]
        if s.nbytes and crc != s.crc32c:
            bad.append(
                {
                    "storage": i,
                    "offset": s.offset,
                    "nbytes": s.nbytes,
                    "expected_crc32c": s.crc32c,
                    "actual_crc32c": crc,
                    "tensors": index.tensors_of_storage(i),
                }
            )
    return bad


def describe_damage(bad: Sequence[dict], path: str) -> str:
    parts = []
    for b in bad[:8]:
        names = ", ".join(b["tensors"][:4]) + (", ..." if len(b["tensors"]) > 4 else "")
        parts.append(f"extent {b['storage']} at offset {b['offset']} (+{b['nbytes']} bytes; tensors: {names})")
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    return f"{path}: checksum mismatch in " + "; ".join(parts) + more


def map_location_fn(map_location: Any) -> Callable[[str], Any]:
    """Turn a torch.load-style ``map_location`` into ``saved_device_str -> target`` (device or callable)."""
    if map_location is None:
        return lambda loc: torch.device(loc)
    if isinstance(map_location, (str, torch.device)):
        dev = torch.device(map_location)
        return lambda loc: dev
    if isinstance(map_location, dict):
        return lambda loc: torch.device(map_location.get(loc, loc))
    if callable(map_location):
        return lambda loc: map_location
    raise TypeError(f"unsupported map_location {map_location!r}")


def place_storage(storage: Any, saved_device: str, target: Any) -> Any:
    """Move a CPU ``UntypedStorage`` to where ``target`` (from :func:`map_location_fn`) says."""
    if callable(target) and not isinstance(target, torch.device):
        res = target(storage, saved_device)
        if res is None:
            target = torch.device(saved_device)
        else:
            return (
                res.untyped_storage()
                if hasattr(res, "untyped_storage") and not isinstance(res, torch.UntypedStorage)
                else res
            )
    if target.type == "cpu":
        return storage
    u8 = torch.empty(0, dtype=torch.uint8).set_(storage)
    return u8.to(target).untyped_storage()


def storage_as_bytes(storage: Any) -> torch.Tensor:
    """A flat uint8 tensor over the bytes of an ``UntypedStorage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def file_meta() -> dict:
    return {"created_by": "lightning-recover", "torch_version": torch.__version__, "host": os.uname().nodename}
