"""A restricted fast path for ``weights_only`` loads of plain tensor checkpoints: the C unpickler, fewer globals.

torch's ``weights_only`` loader interprets ``data.pkl`` opcode by opcode in Python and rebuilds every tensor
through its general machinery (fake-mode detection three times, a typed-storage wrapper, a restore-location
call): for a checkpoint of many small tensors that, not the reading, bounds the load. This path unpickles with
Python's C unpickler instead, which calls :meth:`find_class` for every global it meets (also for the old
``INST`` opcode and for extension codes) and :meth:`persistent_load` for every storage.

What keeps the ``weights_only`` guarantees: ``find_class`` returns only objects of :data:`FAST_GLOBALS`, each one
that torch's own ``weights_only`` allowlist holds under the same name (checked against torch's list at every
load), and nothing else; any other global ends the fast path and the whole load is done again by torch's loader,
which accepts, or refuses, exactly what it always does. Pickle has no opcode that reads an attribute, so the only
callables the data can reach are those globals: the constructors of containers, ``torch.Size``, ``bytes`` from
``_codecs.encode``, the dtypes, and torch's tensor and parameter rebuilders. Extension codes are only looked up
when ``copyreg`` has none registered nor cached (else torch's loader runs). The result equals ``torch.load``'s
(``tests/unit/test_fast_unpickle.py``), views of one storage sharing it as there.
"""

from __future__ import annotations

import _compat_pickle
import copyreg
import io
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import _weights_only_unpickler as wou

__all__ = ["FAST_GLOBALS", "NotFast", "fast_path_usable", "unpickle_fast"]


class NotFast(Exception):
    """The pickle needs something the fast path does not take; torch's own loader must do this load."""


class _Storage:
    """What a storage's persistent id stands for here: its bytes and the dtype its tensors read them as."""

    __slots__ = ("untyped", "dtype")

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype) -> None:
        self.untyped, self.dtype = untyped, dtype


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: int,
    size: tuple,
    stride: tuple,
    requires_grad: bool,
    backward_hooks: Any,
    metadata=None,
) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v2`` for a CPU (or meta) storage outside fake mode (checked once per load)."""
    if type(storage) is not _Storage:
        raise NotFast("a tensor rebuilt from something other than a storage")
    untyped = storage.untyped
    t = torch.empty((0,), dtype=storage.dtype, device=untyped.device).set_(untyped, storage_offset, size, stride)
    if requires_grad:
        t.requires_grad = True
    if metadata:
        torch._utils.set_tensor_metadata(t, metadata)
    t._backward_hooks = backward_hooks  # as torch does (an empty OrderedDict in every torch.save file)
    return t


#: Full name -> the object ``find_class`` returns for it (torch's own, but for the tensor rebuilder). Storage
#: classes are added per load, as torch's allowlist has them (``StorageType`` stand-ins carrying the dtype).
FAST_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": OrderedDict,
    "builtins.set": set,
    "builtins.complex": complex,
    "builtins.bytearray": bytearray,
    "_codecs.encode": None,  # torch's own object (its allowlist's), taken at each load
    "torch.Size": torch.Size,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": torch._utils._rebuild_parameter,
}


def fast_path_usable(map_location: Any, archive: Any) -> bool:
    """Whether a load may try the fast path: CPU results, no fake mode, native byte order, no copyreg extensions.

    Args:
        map_location: the load's ``map_location``.
        archive: the records (``has_record``/``get_record``, as torch's zip reader has them).
    """
    if not (map_location is None or map_location == "cpu" or map_location == torch.device("cpu")):
        return False
    if torch._guards.detect_fake_mode(None) is not None or getattr(
        torch.serialization._serialization_tls, "skip_data", False
    ):
        return False
    if copyreg._inverted_registry or copyreg._extension_cache:  # extension codes could bypass find_class
        return False
    return not archive.has_record("byteorder") or archive.get_record("byteorder").decode() == sys.byteorder


def _allowed() -> dict[str, Any]:
    """:data:`FAST_GLOBALS` that torch's ``weights_only`` allowlist holds too, its storage types and dtypes, and
    the globals allowed in this thread by ``torch.serialization.add_safe_globals`` / ``safe_globals``."""
    torch_allowed = wou._get_allowed_globals()
    out = {}
    for name, obj in FAST_GLOBALS.items():
        if name in torch_allowed:
            out[name] = torch_allowed[name] if obj is None else obj
    for name, obj in torch_allowed.items():
        if isinstance(obj, (torch.serialization.StorageType, torch.dtype)) or obj is torch.UntypedStorage:
            out[name] = obj
    for name, obj in wou._get_user_allowed_globals().items():
        out.setdefault(name, obj)
    return out


class _FastUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storage: Callable[[str, int], torch.UntypedStorage], allowed: dict) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._storage = storage
        self._allowed = allowed
        self._loaded: dict[str, _Storage] = {}
        self.storage_error: Optional[BaseException] = None  # what giving a storage raised (damage, a short record)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _compat_pickle.NAME_MAPPING:  # protocol 2 names from Python 2 (torch.save's protocol)
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        obj = self._allowed.get(f"{module}.{name}")
        if obj is None:
            raise NotFast(f"{module}.{name}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise NotFast("a persistent id torch.save does not write")
        storage_type, key, location, numel = pid[1:]
        if location != "cpu" or type(key) is not str or type(numel) is not int:
            raise NotFast("a storage not saved from the CPU")
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        elif isinstance(storage_type, torch.serialization.StorageType):
            dtype = storage_type.dtype
        else:
            raise NotFast("an unknown storage type")
        st = self._loaded.get(key)
        if st is None:
            nbytes = numel * torch._utils._element_size(dtype)
            try:
                untyped = self._storage(f"data/{key}", nbytes)
            except BaseException as e:
                self.storage_error = e
                raise
            st = self._loaded[key] = _Storage(untyped, dtype)
        return st


def unpickle_fast(data: bytes, storage: Callable[[str, int], torch.UntypedStorage]) -> Any:
    """``data.pkl`` unpickled with the restricted C unpickler; ``storage(record, nbytes)`` gives each storage.

    Raises:
        NotFast: the pickle holds something outside the fast path, or is malformed (load with torch's loader
            instead: it gives its own error then).
        Exception: what ``storage`` raised (a damaged or short record), as it is.
    """
    unpickler = _FastUnpickler(data, storage, _allowed())
    try:
        return unpickler.load()
    except NotFast:
        raise
    except Exception as e:
        if unpickler.storage_error is not None:
            raise unpickler.storage_error from None
        raise NotFast(f"{type(e).__name__}: {e}") from e
