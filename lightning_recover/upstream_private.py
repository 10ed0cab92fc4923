"""Every private name of torch or Lightning the package uses, and why no public API does the job.

A private name can change in any release. Each one is listed here with its reason and, where it is called,
the parameters the package passes it; ``tests/unit/test_upstream_private.py`` resolves every entry in the installed
torch and Lightning and checks those parameters, so an upgrade that moves or reshapes one fails that test by
name instead of a checkpoint or a launch somewhere later. ``tests/unit/test_layout.py`` checks that the package uses
no private torch or Lightning name this module does not list.
"""

from __future__ import annotations

from typing import NamedTuple


class PrivateName(NamedTuple):
    """A private upstream name: where it is used, why, and the parameters the package relies on."""

    used_in: str
    why: str
    parameters: tuple[str, ...] = ()


#: Dotted name (module path, then attributes; ``Class()`` marks an attribute of an instance) -> what the package
#: relies on.
PRIVATE_NAMES: dict[str, PrivateName] = {
    "torch.serialization._save": PrivateName(
        "checkpoint/file/torch_zip.py",
        "torch.save's record writer over a zip writer of ours: the exact archive torch.save makes, streamed "
        "through native_io (torch.save takes only a path or a file object)",
        ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"),
    ),
    "torch.serialization._load": PrivateName(
        "checkpoint/file/torch_zip.py",
        "torch.load's record reader over records already read and CRC-verified (torch.load reads them again)",
        ("zip_file", "map_location", "pickle_module"),
    ),
    "torch.serialization._serialization_tls": PrivateName(
        "checkpoint/file/torch_zip.py, fast_unpickle.py",
        "skip_data / fake-tensor saves must take torch's own path; no public getter exists",
    ),
    "torch._weights_only_unpickler": PrivateName(
        "checkpoint/file/torch_zip.py, fast_unpickle.py",
        "the weights_only unpickler itself and its allowlist (_get_allowed_globals, _get_user_allowed_globals): "
        "the fast path takes no global torch's list does not hold",
    ),
    "torch._weights_only_unpickler._get_allowed_globals": PrivateName("checkpoint/file/fast_unpickle.py", "as above"),
    "torch._weights_only_unpickler._get_user_allowed_globals": PrivateName(
        "checkpoint/file/fast_unpickle.py", "add_safe_globals' entries, honoured by the fast path as by torch"
    ),
    "torch._utils._rebuild_tensor_v2": PrivateName(
        "checkpoint/file/torch_zip.py, fast_unpickle.py",
        "the rebuilder torch.save names in data.pkl: the fast pickler writes the same global",
        ("storage", "storage_offset", "size", "stride", "requires_grad", "backward_hooks"),
    ),
    "torch._utils._rebuild_tensor_v3": PrivateName(
        "checkpoint/file/torch_zip.py", "the rebuilder torch.save names for the newer dtypes"
    ),
    "torch._utils._rebuild_parameter": PrivateName(
        "checkpoint/file/fast_unpickle.py", "the Parameter rebuilder torch.save names in data.pkl"
    ),
    "torch._utils._element_size": PrivateName("checkpoint/file/fast_unpickle.py", "a storage's bytes per element"),
    "torch._utils.set_tensor_metadata": PrivateName(
        "checkpoint/file/fast_unpickle.py", "the tensor metadata torch.save records, restored as torch.load does"
    ),
    "torch._C._get_tensor_metadata": PrivateName(
        "checkpoint/file/torch_zip.py", "the tensor metadata torch.save records, written the same way"
    ),
    "torch._C.PyTorchFileReader": PrivateName(
        "checkpoint/dcp/writer.py", "record offsets inside an archive (no public reader gives them)"
    ),
    "torch._guards.detect_fake_mode": PrivateName(
        "checkpoint/file/fast_unpickle.py", "a load under fake mode must take torch's own path"
    ),
    "torch.storage._new_dtypes": PrivateName(
        "checkpoint/file/torch_zip.py", "which dtypes torch.save writes with _rebuild_tensor_v3"
    ),
    "torch.storage._dtype_to_storage_type_map": PrivateName(
        "checkpoint/file/torch_zip.py", "the legacy storage type torch.save names for each dtype"
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo": PrivateName(
        "checkpoint/dcp/saver.py", "DCP's storage_data entries of a cached plan, written as FileSystemWriter does"
    ),
    "torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner": PrivateName(
        "checkpoint/dcp/sharded_state.py",
        "loads a checkpoint whole without a state to load into (what dcp_to_torch_save does), with its keys",
        ("keys",),
    ),
    "torch.distributed.checkpoint.filesystem._StoragePrefix": PrivateName(
        "checkpoint/dcp/writer.py", "the storage_data a FileSystemWriter plan carries, so DCP's reader takes ours"
    ),
    "torch.distributed.checkpoint._traverse.set_element": PrivateName(
        "checkpoint/dcp/sharded_state.py", "puts a loaded leaf back at its path in a nested state"
    ),
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict": PrivateName(
        "checkpoint/dcp/sharded_state.py",
        "a load with a planner and no process group of its own (load() requires the default group)",
        ("state_dict", "storage_reader", "process_group", "coordinator_rank", "no_dist", "planner"),
    ),
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict": PrivateName(
        "checkpoint/dcp/sharded_state.py", "DCP's own flattening of a nested state, so keys match its metadata"
    ),
    "torch.distributed._shard._utils.narrow_tensor_by_index": PrivateName(
        "checkpoint/dcp/reader.py", "the slice of a stored chunk a read request names, as DCP's reader takes it"
    ),
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": PrivateName(
        "bench/dcp_ranks.py", "a DTensor shard's shape and offset, to size the benchmark's buffers"
    ),
    "torch.utils._pytree.tree_map_only": PrivateName(
        "checkpoint/dcp/sharded_state.py", "maps the tensors of a nested state, as DCP does"
    ),
    "lightning.fabric.strategies.launchers.subprocess_script._basic_subprocess_cmd": PrivateName(
        "lightning/fabric.py, lightning/trainer.py",
        "the command that re-runs the user's script (python -m, a console script or a path) as Lightning does",
    ),
    "lightning.fabric.strategies.launchers.launcher._Launcher": PrivateName(
        "lightning/base.py", "the base class Lightning's strategies accept as a launcher"
    ),
    "lightning.pytorch.strategies.launchers.launcher._Launcher": PrivateName(
        "lightning/trainer.py", "the launcher base the Trainer's strategies take (Fabric's, with kill)"
    ),
    "lightning.fabric.utilities.cloud_io._atomic_save": PrivateName(
        "lightning/checkpoint_io.py", "the stock IO's save for remote (fsspec) paths, kept as Lightning does it"
    ),
    "lightning.fabric.utilities.cloud_io._load": PrivateName(
        "lightning/checkpoint_io.py", "the stock IO's load for remote (fsspec) paths"
    ),
    "lightning.pytorch.Trainer()._accelerator_connector.use_distributed_sampler": PrivateName(
        "lightning/trainer.py",
        "the strategy hands out microbatches itself: Lightning's distributed sampler must not be injected",
    ),
    "lightning.pytorch.loggers.TensorBoardLogger()._version": PrivateName(
        "lightning/step_logs.py, lightning/trainer_rejoin.py (logger._version)",
        "one log directory for the run whichever live replica writes it (Lightning broadcasts it over its own "
        "default group, which this strategy does not have)",
    ),
}
