"""The lightning-recover checkpoint format and its Lightning ``CheckpointIO`` plugin.

``save(checkpoint, path)`` / ``load(path, map_location=None, weights_only=True, verify=True, into=None)``
write and read the format described in ``docs/format.md``; :class:`UringCheckpointIO` plugs it into
``Trainer``/``Fabric``.
"""

import os as _os

from lightning_recover.checkpoint import single_file as _single_file
from lightning_recover.checkpoint.async_io import AsyncCheckpointError, CheckpointIncompleteError
from lightning_recover.checkpoint.async_io import check_not_placeholder as _check_not_placeholder
from lightning_recover.checkpoint.async_io import wait_for_path as _wait_for_path
from lightning_recover.checkpoint.dcp import (
    UringStorageReader,
    UringStorageWriter,
    cleanup_dcp_temps,
    verify_dcp_checkpoint,
)
from lightning_recover.checkpoint.files import cleanup_stale_temps
from lightning_recover.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointCorruptError,
    UnsafeCheckpointError,
)
from lightning_recover.checkpoint.plugin import UringCheckpointIO
from lightning_recover.checkpoint.single_file import CheckpointInfo, read_info, save, verify_file


def load(path, *args, **kwargs):  # type: ignore[no-untyped-def]
    """:func:`single_file.load` that first waits for an asynchronous save of ``path`` in flight in this process
    and rejects the empty placeholder of an unfinished save (:class:`CheckpointIncompleteError`)."""
    if isinstance(path, (str, bytes, _os.PathLike)):
        _wait_for_path(path)
        _check_not_placeholder(_os.fspath(path))
    return _single_file.load(path, *args, **kwargs)


__all__ = [
    "AsyncCheckpointError",
    "CheckpointIncompleteError",
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointInfo",
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
