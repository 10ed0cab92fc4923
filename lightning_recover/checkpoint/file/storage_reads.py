"""A format-2 file's storages read on a second thread while ``data.pkl`` is unpickled.

A load spends about as long in torch's pure-Python ``weights_only`` unpickler, per tensor, as in reading the
storages: 0.7 and 0.8 s for the 10,000 tensors of the small10k state. So :class:`StorageReads` reads the
storage records in file order, in batches of about ``BATCH_BYTES``, on a thread. ``native_io``'s
``Reader.read`` runs without the GIL, so the caller unpickles meanwhile.

The unpickler asks for each storage by name (``torch_zip.VerifiedArchive.get_storage_from_record``). ``reads[name]``
waits until that record is read and its CRC-32C checked. torch therefore never holds a storage whose bytes are
not all there and verified; its ``map_location`` copies, byte swaps and sparse-tensor checks read them. A
damaged record raises :class:`StorageDamaged` to the unpickler. The caller then waits for the rest
(:meth:`StorageReads.finish`) and reports every damaged record at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

BATCH_BYTES = 64 << 20


def damaged_record(name: str, rec: Any, crc: int) -> dict:
    """What a load reports of a record whose CRC-32C (``crc``, read) differs from the one written (``rec``)."""
    return {
        "record": name,
        "offset": rec.data_offset,
        "nbytes": rec.nbytes,
        "expected_crc32c": rec.crc32c,
        "actual_crc32c": crc,
    }


class StorageDamaged(Exception):
    """A storage record's CRC-32C did not match: the load stops and reports (see :meth:`StorageReads.finish`)."""


class StorageReads:
    """Reads ``records`` (``[(name, record)]``, each with ``data_offset``, ``nbytes`` and ``crc32c``) into the
    storages from ``new_storage(name, nbytes)`` on a thread; ``reads[name]`` is the storage once read and checked."""

    def __init__(
        self,
        reader: Any,
        records: list,
        verify: bool,
        new_storage: Callable[[str, int], torch.UntypedStorage],
        as_bytes: Callable[[torch.UntypedStorage], Any],
    ) -> None:
        self._reader = reader
        self._verify = verify
        self._records = sorted(records, key=lambda nr: nr[1].data_offset)
        self._position = {name: i for i, (name, _) in enumerate(self._records)}
        self.storages = {name: new_storage(name, rec.nbytes) for name, rec in self._records}
        self._buffers = [as_bytes(self.storages[name]) for name, _ in self._records]
        self.bad: list[dict] = []  # damaged records, in file order
        self._bad_names: set[str] = set()
        self._read_upto = 0  # records [0, _read_upto) are read and checked
        self._error: Optional[BaseException] = None
        self._cancelled = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i, n = 0, len(self._records)
        try:
            while i < n and not self._cancelled:
                j, nbytes = i, 0
                while j < n and (j == i or nbytes + self._records[j][1].nbytes <= BATCH_BYTES):
                    nbytes += self._records[j][1].nbytes
                    j += 1
                segs = [(self._records[k][1].data_offset, self._buffers[k]) for k in range(i, j)]
                live = [k for k in range(i, j) if self._records[k][1].nbytes]
                crcs = self._reader.read([segs[k - i] for k in live]) if live else []
                with self._cond:
                    for k, crc in zip(live, crcs):
                        name, rec = self._records[k]
                        if self._verify and int(crc) != rec.crc32c:
                            self._bad_names.add(name)
                            self.bad.append(damaged_record(name, rec, int(crc)))
                    self._read_upto = i = j
                    self._cond.notify_all()
        except BaseException as e:  # raised in the caller's thread by [] and finish()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def __contains__(self, name: str) -> bool:
        return name in self.storages

    def __getitem__(self, name: str) -> torch.UntypedStorage:
        i = self._position[name]
        if self._read_upto > i and name not in self._bad_names:
            # already read and checked: the reader adds a damaged name before it moves ``_read_upto`` past it,
            # so no lock is needed (a load of many small records asks this once per record)
            return self.storages[name]
        with self._cond:
            while self._read_upto <= i and self._error is None:
                self._cond.wait()
            if self._read_upto <= i:
                raise self._error  # type: ignore[misc]
            if name in self._bad_names:
                raise StorageDamaged(name)
        return self.storages[name]

    def finish(self) -> list[dict]:
        """Wait for every read; returns the damaged records (raises the reader's error, if it had one)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.bad

    def abandon(self) -> None:
        """Stop after the batch in flight and wait for it (the reader may then be closed)."""
        self._cancelled = True
        self._thread.join()
