"""The lightning-recover checkpoint engine: single-file checkpoints and sharded DCP checkpoints.

``save(checkpoint, path)`` / ``load(path, map_location=None, weights_only=True, verify=True, into=None)``
write and read the format described in ``docs/format.md``; ``UringStorageWriter``/``UringStorageReader``
and ``DcpSaver`` the DCP side (``docs/dcp.md``). Importing it does not import Lightning: the Lightning
``CheckpointIO`` plugins are :class:`lightning_recover.lightning.checkpoint_io.UringCheckpointIO` and its
asynchronous wrapper ``AsyncUringCheckpointIO`` (also ``lightning_recover.UringCheckpointIO`` and
``lightning_recover.AsyncUringCheckpointIO``).
"""

from lightning_recover.checkpoint.dcp.plan_cache import CachingSavePlanner
from lightning_recover.checkpoint.dcp.reader import UringStorageReader, verify_dcp_checkpoint
from lightning_recover.checkpoint.dcp.saver import DcpSaveError, DcpSaver
from lightning_recover.checkpoint.dcp.writer import UringStorageWriter, cleanup_dcp_temps
from lightning_recover.checkpoint.file.async_io import AsyncCheckpointError
from lightning_recover.checkpoint.file.single_file import ArchiveInfo, load, read_info, save, verify_file
from lightning_recover.checkpoint.file.torch_zip import FORMAT_VERSION
from lightning_recover.checkpoint.files import cleanup_stale_temps
from lightning_recover.checkpoint.integrity import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    UnsafeCheckpointError,
)

__all__ = [
    "ArchiveInfo",
    "AsyncCheckpointError",
    "CachingSavePlanner",
    "CheckpointIncompleteError",
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "DcpSaveError",
    "DcpSaver",
    "UnsafeCheckpointError",
    "UringStorageReader",
    "UringStorageWriter",
    "cleanup_dcp_temps",
    "cleanup_stale_temps",
    "load",
    "read_info",
    "save",
    "verify_dcp_checkpoint",
    "verify_file",
]
