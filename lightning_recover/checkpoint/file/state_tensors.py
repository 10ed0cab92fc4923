"""Where the tensors of a checkpoint state are, and the bytes of their storages.

Shared by the synchronous save and load (``single_file.py``) and the asynchronous save (``async_io.py``):
:func:`tensor_paths` names every tensor reachable through the state's containers (for the ``into=`` targets
of a load, the list of tensors ``inspect`` prints, and the snapshot guard of an asynchronous save),
:func:`whole_tensors` the storage records a load may read straight into an ``into=`` target,
:func:`storage_as_bytes` views a storage as flat bytes (a tensor), and :func:`storage_span` gives the engine a
CPU storage's bytes to write from or read into.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

import native_io

__all__ = ["tensor_paths", "whole_tensors", "covers_storage", "storage_as_bytes", "storage_span"]


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


def whole_tensors(obj: Any, storages: list[tuple[str, torch.UntypedStorage]]) -> dict[str, list]:
    """``record -> [path, dtype, shape]`` for each of ``storages`` (``(record name, storage)``, as pickled) that
    holds exactly one tensor reachable through ``obj``'s containers (:func:`tensor_paths`), a plain tensor that is
    contiguous and its storage's whole content: the records a load may read straight into an ``into=`` target of
    that path, shape and dtype. A storage is known by its address; storages that share one are left out."""
    by_address: dict[int, Optional[str]] = {}
    for name, st in storages:
        if st.nbytes() and st.data_ptr():
            by_address[st.data_ptr()] = None if st.data_ptr() in by_address else name
    holders: dict[str, int] = {}
    found: dict[str, list] = {}
    for path, t in tensor_paths(obj).values():
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue  # no storage of its own (sparse, nested, some subclasses)
        name = by_address.get(st.data_ptr())
        if name is None:
            continue
        holders[name] = holders.get(name, 0) + 1
        plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_nested
        if plain and covers_storage(t, st.nbytes()):
            found[name] = [path, str(t.dtype).removeprefix("torch."), list(t.shape)]
    return {name: row for name, row in found.items() if holders[name] == 1}


def covers_storage(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t`` is contiguous from the start of its storage and exactly ``nbytes`` long: a whole record."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == nbytes


def storage_as_bytes(storage: Any) -> torch.Tensor:
    """A flat uint8 tensor over the bytes of an ``UntypedStorage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_span(storage: torch.UntypedStorage) -> native_io.Span:
    """A CPU storage's bytes as a buffer the engine writes from or reads into (it keeps the storage alive): a tenth
    of the cost of a NumPy view, paid per tensor before a load's first read."""
    if storage.device.type != "cpu":
        raise TypeError(
            f"a {storage.device.type} storage has no host bytes to hand the engine: copy it to the CPU first"
        )
    return native_io.Span(storage, storage.data_ptr(), storage.nbytes())
