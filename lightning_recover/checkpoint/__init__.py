"""The lightning-recover checkpoint format and its Lightning ``CheckpointIO`` plugin.

``save(checkpoint, path)`` / ``load(path, map_location=None, weights_only=True, verify=True, into=None)``
write and read the format described in ``docs/format.md``; :class:`UringCheckpointIO` plugs it into
``Trainer``/``Fabric``.
"""

from lightning_recover.checkpoint.async_io import AsyncCheckpointError
from lightning_recover.checkpoint.dcp import (
    UringStorageReader,
    UringStorageWriter,
    cleanup_dcp_temps,
    verify_dcp_checkpoint,
)
from lightning_recover.checkpoint.dcp_plan_cache import CachingSavePlanner
from lightning_recover.checkpoint.dcp_saver import DcpSaveError, DcpSaver
from lightning_recover.checkpoint.files import cleanup_stale_temps
from lightning_recover.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    UnsafeCheckpointError,
)
from lightning_recover.checkpoint.plugin import UringCheckpointIO
from lightning_recover.checkpoint.single_file import CheckpointInfo, load, read_info, save, verify_file

__all__ = [
    "AsyncCheckpointError",
    "CachingSavePlanner",
    "CheckpointIncompleteError",
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointInfo",
    "DcpSaveError",
    "DcpSaver",
    "UnsafeCheckpointError",
    "UringCheckpointIO",
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
