"""Where the tensors of a checkpoint state are, and the bytes of their storages.

Shared by the synchronous save and load (``single_file.py``) and the asynchronous save (``async_io.py``):
:func:`tensor_paths` names every tensor reachable through the state's containers (for the ``into=`` targets
of a load, the list of tensors ``inspect`` prints, and the snapshot guard of an asynchronous save), and
:func:`storage_as_bytes` views a storage as the flat bytes the engine writes or reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

__all__ = ["tensor_paths", "storage_as_bytes"]


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


def storage_as_bytes(storage: Any) -> torch.Tensor:
    """A flat uint8 tensor over the bytes of an ``UntypedStorage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
