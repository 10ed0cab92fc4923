"""A format-2 file's storages read on a second thread while ``data.pkl`` is unpickled.

A load spends about as long in torch's pure-Python ``weights_only`` unpickler, per tensor, as in reading the
storages: 0.7 and 0.8 s for the 10,000 tensors of the small10k state. So :class:`StorageReads` reads every
storage record, in file order, in one ``native_io`` ``Reader.read`` on a thread (without the GIL), and the
caller unpickles meanwhile. One call keeps the device's queue full from the first byte to the last: reads in
batches drained the queue at the end of every batch. A ``native_io.ReadProgress`` (``reader.new_progress()``)
tells the caller which leading records have landed.

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
        ordered = sorted(records, key=lambda nr: nr[1].data_offset)
        self.storages = {name: new_storage(name, rec.nbytes) for name, rec in ordered}
        # only records with bytes are read: ``_segment[name]`` is a record's index among them, and ``_needed[name]``
        # how many leading ones must have landed before it is complete (an empty record needs none of its own)
        self._live = [(name, rec) for name, rec in ordered if rec.nbytes]
        self._segment = {name: i for i, (name, _) in enumerate(self._live)}
        self._needed: dict[str, int] = {}
        landed = 0
        for name, rec in ordered:
            if rec.nbytes:
                landed += 1
            self._needed[name] = landed
        self._segments = [(rec.data_offset, as_bytes(self.storages[name])) for name, rec in self._live]
        self._progress = reader.new_progress()
        self._error: Optional[BaseException] = None
        self._bad: Optional[list[dict]] = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._reader.read(self._segments, progress=self._progress)
        except BaseException as e:  # raised in the caller's thread by [] and finish()
            self._error = e
        finally:
            self._progress.end()  # also when the read failed before it began: nobody waits for it then

    def _damaged(self, i: int) -> Optional[dict]:
        """The report of live record ``i`` (landed) when its CRC-32C differs from the one written, else None."""
        name, rec = self._live[i]
        crc = self._progress.crc(i)
        return damaged_record(name, rec, crc) if self._verify and crc != rec.crc32c else None

    def __contains__(self, name: str) -> bool:
        return name in self.storages

    def __getitem__(self, name: str) -> torch.UntypedStorage:
        needed = self._needed[name]
        if self._progress.wait(needed) < needed:  # the read ended before this record: it failed
            self._thread.join()
            raise self._error  # type: ignore[misc]
        i = self._segment.get(name)
        if i is not None and self._damaged(i) is not None:
            raise StorageDamaged(name)
        return self.storages[name]

    def finish(self) -> list[dict]:
        """Wait for every read; returns the damaged records in file order (raises the reader's error, if it had
        one)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._bad is None:
            self._bad = [d for d in map(self._damaged, range(len(self._live))) if d is not None]
        return self._bad

    def abandon(self) -> None:
        """Stop the read once its transfers in flight have landed, and wait for it (the reader may then be
        closed)."""
        self._progress.cancel()
        self._thread.join()
