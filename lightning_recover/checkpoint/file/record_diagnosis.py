"""Telling a wrong integrity record from damaged data, for records written by the lazy asynchronous saver.

The lazy saver checksums a large storage chunk by chunk while it copies it (``async_io``) and records the CRC-32C
of the whole storage combined from the chunks' CRCs (``crc32c_combine``). A combine whose table of GF(2) operators
was built by two threads at once held an operator twice, shifting every later one; the recorded CRC was then
wrong although the bytes written were right. Every operator in that table appends ``2**j`` zero bytes for some
``j``, so a faulty table still appends zeros, only the wrong number of them: the faulty combine of a chunk of
``m`` bytes is the true combine with a length ``m'`` made of the same bits moved to the duplicated positions.

:func:`explain_wrong_crc` recomputes the CRC-32C of every chunk of the bytes on disk, for each chunk size the saver
may have used, and combines them again through every table with up to :data:`MAX_EXTRA` duplicated operators. If
one of those reproduces the recorded value, the recorded value was computed from exactly these bytes and only the
combine was wrong: the data is intact. Otherwise nothing is claimed (the record stays "damaged"). A damaged record
matches by coincidence with a probability of about ``hypotheses / 2**32`` (``Explanation.hypotheses``).
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
from collections.abc import Iterable, Sequence
from typing import Optional

import native_io
from lightning_recover.checkpoint.file.async_io import crc32c_combine

__all__ = [
    "Explanation",
    "MAX_CHUNKS",
    "MAX_EXTRA",
    "async_chunk_candidates",
    "explain_damaged_records",
    "explain_wrong_crc",
]

ALIGN = 4096
MAX_EXTRA = 3  # duplicated operators considered (each a step where two threads appended the same one)
_USED_BITS = 40  # operator positions a chunk length can use (chunks are far below 2**40 bytes)
_SAVER_CHUNK_BYTES = 64 << 20  # AsyncSaver's default chunk_bytes: the largest chunk it writes by default
MAX_CHUNKS = 1024  # chunk sizes cutting a record into more chunks are not tried (the search's time grows with them)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """How the recorded CRC-32C follows from the bytes on disk: chunks of ``chunk_bytes`` (the last one
    ``last_bytes``), combined as if they had ``faulty_lengths`` (chunk, last) bytes; ``hypotheses``: how many
    (chunking, faulty lengths) were tried before, this one included."""

    chunk_bytes: int
    last_bytes: int
    faulty_lengths: tuple[int, int]
    hypotheses: int


def async_chunk_candidates(storage_nbytes: Iterable[int]) -> list[int]:
    """The chunk sizes the lazy saver may have cut the storages of one file into, smallest first.

    The saver's rule: ``min(chunk_bytes, max(4096, ring // 4))`` rounded down to 4096, where ``ring`` (the staging
    ring) is at least the aligned size of the storages copied lazily (those of ``eager_bytes`` or more). Taken
    here for every ``eager_bytes`` threshold the file's storage sizes allow (the ring as large as this file's lazy
    part), and for rings of every power of two (a larger ring: an earlier, larger save, or ``max_pending_bytes``).
    """
    sizes = sorted((int(n) for n in storage_nbytes if n > 0), reverse=True)
    out = {_SAVER_CHUNK_BYTES}
    lazy = 0
    for n in sizes:  # eager_bytes just above each smaller size: the storages so far are the lazy ones
        lazy += -(-n // ALIGN) * ALIGN
        out.add(min(_SAVER_CHUNK_BYTES, max(ALIGN, lazy // 4)) // ALIGN * ALIGN)
    out.update(1 << k for k in range(12, 26))
    return sorted(out)


def _faulty_lengths(lengths: Sequence[int], max_extra: int) -> list[tuple[int, ...]]:
    """Every distinct tuple of lengths a table with up to ``max_extra`` duplicated operators makes of ``lengths``.

    A table holding operators twice maps its index ``b`` to the true operator ``b - shift(b)``, with ``shift``
    nondecreasing in ``b``, never above ``b`` nor ``max_extra``. Only the bits set in ``lengths`` matter, so the
    shifts are enumerated on those bits alone: ``max_extra`` thresholds among them, each adding one from there on.
    """
    bits = sorted({b for m in lengths for b in range(m.bit_length()) if m >> b & 1})
    out: set = set()
    for thresholds in itertools.combinations_with_replacement(range(len(bits) + 1), max_extra):
        moved = {}
        for i, b in enumerate(bits):
            shift = sum(1 for t in thresholds if t <= i)
            moved[b] = 1 << max(0, b - shift)
        out.add(tuple(sum(moved[b] for b in range(m.bit_length()) if m >> b & 1) for m in lengths))
    return sorted(out)


def explain_wrong_crc(
    data: memoryview, recorded: int, chunk_sizes: Iterable[int], max_extra: int = MAX_EXTRA
) -> Optional[Explanation]:
    """Whether ``recorded`` is what a faulty chunked combine computes from ``data`` (one storage's bytes).

    Args:
        data: the storage record's bytes as on disk.
        recorded: the CRC-32C its integrity record holds (not the CRC-32C of ``data``).
        chunk_sizes: the chunk sizes to try (:func:`async_chunk_candidates`); sizes that cut ``data`` into more
            than :data:`MAX_CHUNKS` chunks are skipped.
        max_extra: the most duplicated operators a table is assumed to hold.

    Returns:
        The chunking and faulty lengths that reproduce ``recorded``, or None if none does (the data may be damaged).
    """
    n = len(data)
    tried = 0
    for size in sorted(set(chunk_sizes)):
        if size <= 0 or size >= n or -(-n // size) > MAX_CHUNKS:
            continue  # one chunk: its CRC is recorded as it is, no combine can make it wrong
        crcs = [native_io.crc32c(data[off : off + size]) for off in range(0, n, size)]
        last = n - (len(crcs) - 1) * size
        # The combine folds chunk after chunk: crc = Z^m' crc ^ c, with Z^L "append L zero bytes". Every chunk
        # but the last has ``size`` bytes, so the result is c_last ^ Z^last' (fold of the others with size').
        folds: dict[int, int] = {}
        for size_f, last_f in _faulty_lengths((size, last), max_extra):
            tried += 1
            if size_f not in folds:
                crc = 0
                for c in crcs[:-1]:
                    crc = crc32c_combine(crc, c, size_f)
                folds[size_f] = crc
            if crc32c_combine(folds[size_f], crcs[-1], last_f) == recorded:
                return Explanation(size, last, (size_f, last_f), tried)
    return None


def explain_damaged_records(path: str, storage_nbytes: Iterable[int], damaged: Sequence[dict]) -> list:
    """:func:`explain_wrong_crc` for every damaged storage record ``verify_file`` reported for ``path``.

    Args:
        path: the checkpoint file.
        storage_nbytes: the sizes of all its storage records (they bound the chunk sizes the saver used).
        damaged: ``verify_file``'s damaged records.

    Returns:
        One :class:`Explanation` or None per entry of ``damaged`` (None: a local header, a record the lazy saver
        writes whole, or data the recorded CRC-32C does not follow from).
    """
    candidates = async_chunk_candidates(storage_nbytes)
    out: list = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mem:
        view = memoryview(mem)
        try:
            for d in damaged:
                explained = None
                end = d["offset"] + d["nbytes"]
                if d["what"] == "data" and d["record"].startswith("data/") and end <= len(mem):
                    explained = explain_wrong_crc(view[d["offset"] : end], d["expected_crc32c"], candidates)
                out.append(explained)
        finally:
            view.release()
    return out
