"""Sharded checkpoints of a training state (modules, optimizers, plain values) as one DCP directory.

``save_sharded(path, state)`` / ``load_sharded(path, state)``: what ``fabric.save`` / ``fabric.load``
do under ``RecoverStrategy(replica_size=K>1)``, usable on their own. Modules and optimizers become
their (sharded) DCP state dicts (``get_model_state_dict`` / ``get_optimizer_state_dict``), objects with
``state_dict``/``load_state_dict`` their state dicts, everything else is saved as it is (DCP writes
non-tensors as bytes items). The collectives run over the default process group (inside a sharded
replica: the replica's own K processes). Writing goes through :class:`UringStorageWriter` (crash-safe
directory commit, CRC-32C sidecars) driven by a :class:`DcpSaver` (saves of an unchanged layout without DCP's
per-item exchange), reading through :class:`UringStorageReader` (verified). Bytes
items are read with torch's ``weights_only`` loader and ``.metadata`` with an allowlist unpickler:
nothing read from disk reaches a plain ``pickle.load``.

``load_full(path)`` rebuilds the whole checkpoint in one process with full (unsharded) tensors, the
logic of torch's ``dcp_to_torch_save`` with the safe loaders (used by ``lightning-recover convert``).
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only

from lightning_recover.checkpoint.dcp.reader import UringStorageReader, read_dcp_metadata
from lightning_recover.checkpoint.dcp.saver import DcpSaver, part_metadata_name
from lightning_recover.checkpoint.dcp.writer import commit_dir, sidecar_storage_meta, temp_dir_for, write_metadata_file
from lightning_recover.checkpoint.files import fsync_dir
from lightning_recover.checkpoint.integrity import CheckpointCorruptError, UnsafeCheckpointError

__all__ = ["save_sharded", "load_sharded", "load_full", "checkpoint_keys", "is_dcp_checkpoint"]


class _WeightsOnlyBytes(DefaultLoadPlanner):
    """DCP's default planners load bytes items with ``torch.load(weights_only=False)``; ours do not."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` that reads bytes items with the ``weights_only`` loader."""


class SafeEmptyLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """torch's planner that loads a whole checkpoint into an empty dict, reading bytes items ``weights_only``."""


@contextmanager
def _unwrap_corruption() -> Iterator[None]:
    """DCP turns a rank's error into ``CheckpointException`` (a ``BaseException``); a damaged checkpoint
    is re-raised as the rank's own :class:`CheckpointCorruptError` naming the file and item."""
    try:
        yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            err = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(err, CheckpointCorruptError):
                raise err from exc
            if isinstance(err, pickle.UnpicklingError):
                raise UnsafeCheckpointError(
                    f"a saved item is not loadable with torch's weights_only loader ({err}); refusing to unpickle it"
                ) from exc
        raise


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a committed DCP checkpoint (a directory with a ``.metadata`` file).

    Args:
        path: the path to look at.

    Returns:
        True for a directory holding ``.metadata``.
    """
    return os.path.isdir(path) and os.path.exists(os.path.join(path, ".metadata"))


def checkpoint_keys(path: str | os.PathLike) -> set[str]:
    """The top-level keys of the state saved at ``path`` (read from ``.metadata``, verified types only).

    Args:
        path: the checkpoint directory.

    Returns:
        The keys.

    Raises:
        CheckpointCorruptError, UnsafeCheckpointError: as for ``read_dcp_metadata``.
    """
    md = read_dcp_metadata(path)
    if md.planner_data:
        return {str(p[0]) for p in md.planner_data.values()}
    return {k.split(".", 1)[0] for k in md.state_dict_metadata}


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _owner(optimizer: Optimizer, modules: dict[str, Module]) -> Module:
    """The module whose parameters the optimizer updates (DCP keys optimizer state by parameter name)."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules.values():
        if ids <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError(
        "a sharded checkpoint keys optimizer state by parameter name, so the optimizer's module must be in the "
        "same state. HINT: fabric.save(path, {'model': model, 'optimizer': optimizer, ...})"
    )


def sharded_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """What is written: modules and optimizers as DCP (sharded) state dicts, stateful objects as their
    state dicts, anything else as it is."""
    modules = {k: v for k, v in state.items() if isinstance(v, Module)}
    out: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, Module):
            out[key] = get_model_state_dict(obj)
        elif isinstance(obj, Optimizer):
            out[key] = get_optimizer_state_dict(_owner(obj, modules), obj)
        elif _is_stateful(obj):
            out[key] = obj.state_dict()
        else:
            out[key] = obj
    return out


# one saver per group size, for the default engine: saves in a loop with the same layout skip DCP's per-item
# exchange of plans, results and metadata (dcp_saver.py); its cache checks rank, group size and layout itself
_SAVERS: dict[int, DcpSaver] = {}


def save_sharded(path: str | os.PathLike, state: dict[str, Any], *, engine: Any = None) -> None:
    """Write ``state`` as one DCP checkpoint directory at ``path`` (every rank of the default process
    group, or this process alone without one, must call it). ``path`` appears complete or not at all;
    a failure raises ``DcpSaveError`` (a ``CheckpointException``) on every rank.

    Args:
        path: the checkpoint directory.
        state: modules, optimizers (with their modules in the same dict), stateful objects and plain values.
        engine: None (the shared default engine and a saver kept per group size), an ``EngineHandle`` or a
            ``native_io.IOEngine``.

    Raises:
        DcpSaveError: the save failed on any rank.
        ValueError: an optimizer's module is not in ``state``.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    saver = _SAVERS.setdefault(world, DcpSaver()) if engine is None else DcpSaver(engine=engine)
    saver.save(sharded_state_dict(state), path)


def load_sharded(path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """Restore ``state`` in place from the DCP checkpoint at ``path``; return the saved entries not asked for.

    Modules and optimizers get their shards (resharded if the checkpoint was written by another number
    of processes), stateful objects their state dicts; a plain value in ``state`` is replaced by the
    saved one. ``strict``: every key of ``state`` must be in the checkpoint, every module/optimizer
    entry complete. Damaged shards raise ``CheckpointCorruptError``; nothing is half-restored then,
    because every value is read and verified before any object is updated.

    Args:
        path: the checkpoint directory.
        state: what to restore, keyed as saved; plain values in it are replaced by the saved ones.
        strict: see above (default True).

    Returns:
        The saved plain entries whose keys are not in ``state``.

    Raises:
        KeyError: with ``strict``, a key of ``state`` is not in the checkpoint.
        CheckpointCorruptError: a shard or the metadata is damaged or missing.
        UnsafeCheckpointError: a saved item is not loadable with torch's ``weights_only`` loader.
    """
    path = str(path)
    saved = checkpoint_keys(path)
    missing = sorted(set(state) - saved)
    if strict and missing:
        raise KeyError(
            f"{path} has no {', '.join(map(repr, missing))} (it holds {', '.join(sorted(saved))}). "
            "HINT: pass strict=False to restore only what the checkpoint holds."
        )
    objs = {k: v for k, v in state.items() if k in saved and (isinstance(v, (Module, Optimizer)) or _is_stateful(v))}
    if objs:
        # copies: the state dicts share storage with parameters and optimizer state, and a shard that fails
        # its checksum after others were copied in must leave the objects untouched
        sd = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), sharded_state_dict(objs))
        with _unwrap_corruption():
            dcp.load(
                sd,
                storage_reader=UringStorageReader(path),
                planner=SafeLoadPlanner(allow_partial_load=not strict),
            )
    plain = saved - set(objs)
    extras: dict[str, Any] = {}
    if plain:
        # dcp.load would load into a copy of the (empty) dict; this is what torch's dcp_to_torch_save calls
        with _unwrap_corruption():
            _load_state_dict(
                extras,
                storage_reader=UringStorageReader(path),
                planner=SafeEmptyLoadPlanner(keys=plain),
                no_dist=not (dist.is_available() and dist.is_initialized()),
            )
    modules = {k: v for k, v in objs.items() if isinstance(v, Module)}
    options = StateDictOptions(strict=strict)
    for key, obj in objs.items():
        if isinstance(obj, Module):
            set_model_state_dict(obj, sd[key], options=options)
        elif isinstance(obj, Optimizer):
            set_optimizer_state_dict(_owner(obj, modules), obj, optim_state_dict=sd[key], options=options)
        else:
            obj.load_state_dict(sd[key])
    for key in list(state):
        if key in extras:
            state[key] = extras.pop(key)
    return extras


def load_full(
    path: str | os.PathLike, keys: Optional[set[str]] = None, *, verify: bool = True, allow_pickle: bool = False
) -> dict[str, Any]:
    """The whole checkpoint (or the top-level ``keys``) in this process, every tensor full size.

    torch's ``dcp_to_torch_save`` logic (the state dict is rebuilt from ``.metadata``), read through
    :class:`UringStorageReader` with the safe loaders; needs no process group.

    Args:
        path: the checkpoint directory.
        keys: the top-level keys to load (None: all).
        verify: check every extent's CRC-32C (default True).
        allow_pickle: read bytes items with torch's full unpickler (only for checkpoints you trust).

    Returns:
        The state, nested as saved, with full-size tensors on the CPU.

    Raises:
        CheckpointCorruptError: a shard or the metadata is damaged or missing.
        UnsafeCheckpointError: a saved item is not loadable with torch's ``weights_only`` loader.
    """
    out: dict[str, Any] = {}
    with _unwrap_corruption():
        _load_state_dict(
            out,
            storage_reader=UringStorageReader(str(path), verify=verify),
            planner=(_EmptyStateDictLoadPlanner if allow_pickle else SafeEmptyLoadPlanner)(keys=keys),
            no_dist=True,
        )
    return out


# ------------------------------------------------------------------ one checkpoint written by several replicas


def _item_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()  # a DTensor's numel is the global one
    return 1024


def assign_parts(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """Split the items into at most ``parts`` non-empty groups of about equal bytes (largest first, each
    to the lightest group); deterministic, so every process computes the same split."""
    groups: list[list[str]] = [[] for _ in range(max(1, min(parts, len(sizes))))]
    load = [0] * len(groups)
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        g = load.index(min(load))
        groups[g].append(key)
        load[g] += sizes[key]
    return groups


def _flat(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(sharded_state_dict(state))


def part_count(state: dict[str, Any], replicas: int) -> int:
    return len(assign_parts({k: _item_bytes(v) for k, v in _flat(state)[0].items()}, replicas))


# one saver per part layout (which part of how many, written by which files, by how many ranks): a replica saving
# the same part of the same layout again skips DCP's per-item exchange (dcp_saver.py); another assignment of parts
# (replicas lost or back) is another saver, whose first save is a full one
_PART_SAVERS: dict[tuple[int, int, int, int], DcpSaver] = {}


def save_part(path: str | os.PathLike, state: dict[str, Any], token: str, part: int, parts: int, base: int) -> None:
    """Write part ``part`` of ``parts`` of ``state`` (every rank of this replica's process group calls it): files
    ``__{base+i}_0.distcp`` in the temporary directory of ``token`` (shared by every replica), and the part's
    metadata left there; nothing is committed (:func:`commit_parts` does, once all parts are in)."""
    flat, _ = _flat(state)
    mine = assign_parts({k: _item_bytes(v) for k, v in flat.items()}, parts)[part]
    world = dist.get_world_size() if dist.is_initialized() else 1
    saver = _PART_SAVERS.setdefault((part, parts, base, world), DcpSaver())
    saver.save_part({k: flat[k] for k in mine}, path, token=token, part=part, base=base)


def commit_parts(path: str | os.PathLike, state: dict[str, Any], token: str, parts: int) -> None:
    """Merge the parts' metadata into one ``.metadata`` and commit the directory (one process calls it)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = str(path)
    tmp = temp_dir_for(path, token)
    mds = [read_dcp_metadata(tmp, part_metadata_name(q)) for q in range(parts)]
    _, mappings = _flat(state)
    md = Metadata(state_dict_metadata={}, storage_data={}, version=mds[0].version)
    for m in mds:
        md.state_dict_metadata.update(m.state_dict_metadata)
        md.storage_data.update(m.storage_data)
    md.planner_data = {k: mappings[k] for k in md.state_dict_metadata}  # nested paths in the whole state
    md.storage_meta = sidecar_storage_meta(path)  # every part was written with sidecars
    write_metadata_file(os.path.join(tmp, ".metadata"), md)
    for q in range(parts):
        os.unlink(os.path.join(tmp, part_metadata_name(q)))
    fsync_dir(tmp)
    commit_dir(tmp, path)


def abandon_parts(path: str | os.PathLike, token: str) -> None:
    shutil.rmtree(temp_dir_for(str(path), token), ignore_errors=True)
