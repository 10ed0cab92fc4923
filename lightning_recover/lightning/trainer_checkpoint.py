"""Sharded Trainer checkpoints (``RecoverTrainerStrategy(replica_size=K>1)``): one DCP directory.

``trainer.save_checkpoint(path)`` and ``ModelCheckpoint`` write, and ``fit(ckpt_path=path)`` reads,
one ``torch.distributed.checkpoint`` directory at ``path`` (a ``.ckpt`` name is a directory then, as
with Lightning's ``ModelParallelStrategy``). What is in it (:func:`dcp_state`):

* ``state_dict``: the LightningModule's sharded state (``get_model_state_dict``: DTensor shards),
* ``optimizer_{i}``: each optimizer's sharded state (``get_optimizer_state_dict``: keyed by
  parameter name, so it reshards), absent when the checkpoint is weights-only,
* ``lightning``: everything else of Lightning's checkpoint dict (epoch, global_step, loops,
  callbacks, LR schedulers, precision plugin, hyper-parameters, what ``on_save_checkpoint`` added),
  one ``torch.save`` bytes item per top-level key. ``ModelParallelStrategy`` writes these into a
  separate ``meta.pt`` from rank 0; here they are items of the same directory, so they are part of
  its atomic commit and of its CRC-32C sidecars.

Writing goes through :func:`~lightning_recover.lightning.spread_save.save_over_live_replicas`
(every live replica writes about 1/R of the items, committed once, atomically), like ``fabric.save``.
Reading (:func:`load_trainer_checkpoint`) restores the module and the optimizers in place, every
process its own shards (:func:`~lightning_recover.checkpoint.dcp.sharded_state.load_sharded`), and returns
the rest as Lightning's checkpoint dict, which Lightning then restores (loops, callbacks,
schedulers). Every bytes item is read with torch's ``weights_only`` loader: nothing read from the
directory becomes code; a hyper-parameter of another type is skipped (resuming does not use them).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from typing import Any, Optional

import torch
from fsspec.core import url_to_fs
from torch.nn import Module
from torch.optim import Optimizer

from lightning_recover.checkpoint.dcp.sharded_state import checkpoint_keys, is_dcp_checkpoint, load_full, load_sharded
from lightning_recover.checkpoint.integrity import UnsafeCheckpointError

META_KEY = "lightning"
MODEL_KEY = "state_dict"
# Lightning's hyper-parameter entries: saved, but not needed to resume (fit restores no hparams), so
# one the weights-only loader refuses (an object of any type) is skipped instead of failing the load.
_HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters", "hparams_type", "hparams_name")


_HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(\d+)\.ckpt$")


def hpc_checkpoint_path(root: str | os.PathLike) -> str:
    """The next of Lightning's HPC checkpoints in ``root``: ``hpc_ckpt_N.ckpt``, N one above the highest there.

    Lightning resumes a job from the highest of them by itself under Slurm (a requeued job), and elsewhere with
    ``trainer.fit(..., ckpt_path="hpc")``.
    """
    root = str(root)
    fs, where = url_to_fs(root)
    names = [os.path.basename(str(p).rstrip("/")) for p in fs.ls(where, detail=False)] if fs.exists(where) else []
    numbers = [int(m.group(1)) for m in map(_HPC_CHECKPOINT.match, names) if m]
    return os.path.join(root, f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt")


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def encode(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode(blob: Any, key: str) -> Any:
    """One metadata entry, with torch's ``weights_only`` loader (tensors to the CPU)."""
    if not isinstance(blob, (bytes, bytearray)):
        raise UnsafeCheckpointError(f"the checkpoint's {META_KEY}.{key} entry is not a bytes item")
    try:
        return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        lines = str(exc).splitlines() or [""]
        detail = next((line.strip() for line in lines if "Unsupported global" in line), lines[0])
        raise UnsafeCheckpointError(
            f"the checkpoint's {key!r} entry is not loadable with torch's weights_only loader ({detail}); refusing to "
            "unpickle it. HINT: keep only tensors, numbers, strings and containers of them in what "
            "on_save_checkpoint and the callbacks' state_dict return."
        ) from exc


def dcp_state(checkpoint: dict[str, Any], module: Module, optimizers: list[Optimizer]) -> dict[str, Any]:
    """What a Trainer checkpoint is saved as: the live (sharded) module and optimizers, which
    ``sharded_state_dict`` turns into DCP state dicts when writing, and the rest as bytes items.

    The optimizers are saved only if Lightning's dict holds their states (not ``save_weights_only``);
    Lightning's own ``state_dict``/``optimizer_states`` entries (the same tensors, keyed by
    parameter id for the optimizers, which does not reshard) are replaced by these."""
    state: dict[str, Any] = {MODEL_KEY: module}
    if "optimizer_states" in checkpoint:
        state.update({optimizer_key(i): optimizer for i, optimizer in enumerate(optimizers)})
    meta = {k: encode(v) for k, v in checkpoint.items() if k not in (MODEL_KEY, "optimizer_states")}
    state[META_KEY] = meta
    return state


def lightning_checkpoint(meta: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict (without the module and optimizer states) from the saved bytes items."""
    checkpoint = {}
    for key, blob in meta.items():
        try:
            checkpoint[key] = decode(blob, key)
        except UnsafeCheckpointError:
            if key not in _HPARAM_KEYS:
                raise
    return checkpoint


def trainer_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The Lightning entries of a sharded Trainer checkpoint (epoch, global_step, loops, callbacks...),
    read in one process without a process group."""
    check_trainer_checkpoint(path)
    return lightning_checkpoint(load_full(path, keys={META_KEY}).get(META_KEY, {}))


def check_trainer_checkpoint(path: str | os.PathLike) -> None:
    path = os.fspath(path)
    if os.path.isfile(path):
        raise ValueError(
            f"{path} is a single file; with replica_size>1 the Trainer resumes from the sharded checkpoint "
            "directory that trainer.save_checkpoint/ModelCheckpoint write. HINT: resume from such a directory, or "
            "load a single-file checkpoint into an unsharded model (replica_size=1) first."
        )
    if not is_dcp_checkpoint(path):
        raise FileNotFoundError(f"no sharded checkpoint at {path} (no DCP directory with a .metadata file)")
    if META_KEY not in checkpoint_keys(path):
        raise ValueError(
            f"{path} is a DCP checkpoint but not a Trainer checkpoint (it has no {META_KEY!r} entry). HINT: "
            "a fabric.save checkpoint is read with fabric.load, or in configure_model with load_sharded."
        )


def save_trainer_checkpoint(
    strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
) -> None:
    """Every process of every live replica of ``strategy`` (a sharded ``RecoverTrainerStrategy``):
    write Lightning's ``checkpoint`` as one DCP directory at ``filepath``."""
    from lightning_recover.lightning.spread_save import save_over_live_replicas

    if storage_options is not None:
        name = type(strategy).__name__  # Lightning's wording for a strategy that writes without the CheckpointIO
        raise TypeError(
            f"`{name}.save_checkpoint(..., storage_options=...)` is not supported because"
            f" `{name}` does not use the `CheckpointIO` (with replica_size>1 a checkpoint is a DCP directory)."
        )
    path = str(strategy.broadcast(os.fspath(filepath)))  # the lowest live replica's path, as ModelParallelStrategy
    if os.path.isfile(path):
        raise FileExistsError(
            f"{path} is a file; with replica_size>1 a checkpoint is a directory. HINT: remove it or choose another path"
        )
    save_over_live_replicas(
        strategy.protocol_replica,
        path,
        dcp_state(checkpoint, strategy.lightning_module, strategy.optimizers),
        num_replicas=strategy.num_replicas,
        replica_size=strategy.sharding.replica_size,
        device=strategy.root_device,
    )


def load_trainer_checkpoint(
    path: str | os.PathLike,
    module: Optional[Module],
    optimizers: list[Optimizer],
    weights_only: Optional[bool] = None,
    *,
    strict: Optional[bool] = None,
) -> dict[str, Any]:
    """Every process of the replica: restore the module and optimizers from the directory at ``path``
    (each process its own shards, resharded if the saving job had another K); return Lightning's
    checkpoint dict without ``state_dict``/``optimizer_states`` (already restored). ``strict``
    defaults to the module's ``strict_loading``."""
    path = os.fspath(path)
    strict = getattr(module, "strict_loading", True) if strict is None else strict
    if weights_only is False:
        raise ValueError(
            "sharded Trainer checkpoints are always read with torch's weights_only loader. HINT: leave weights_only "
            "unset (or True)."
        )
    check_trainer_checkpoint(path)  # a path that is no sharded checkpoint is refused first, with a HINT
    if module is None:
        raise RuntimeError("strategy='recover': no LightningModule to restore the sharded checkpoint into")
    saved = checkpoint_keys(path)
    state: dict[str, Any] = {MODEL_KEY: module}
    if optimizers:
        missing = [optimizer_key(i) for i in range(len(optimizers)) if optimizer_key(i) not in saved]
        if missing:
            raise KeyError(
                f"Trying to restore optimizer state but the checkpoint {path} has no {', '.join(missing)} (saved "
                "with weights only, e.g. `ModelCheckpoint(save_weights_only=True)`, or with fewer optimizers)."
            )
        state.update({optimizer_key(i): optimizer for i, optimizer in enumerate(optimizers)})
    extras = load_sharded(path, state, strict=strict)
    return lightning_checkpoint(extras.get(META_KEY, {}))


def remove_checkpoint_dir(path: str | os.PathLike) -> None:
    """Remove a sharded checkpoint (a directory), or a file left at that path."""
    path = os.fspath(path)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
