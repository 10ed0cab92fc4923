"""Fresh storages' pages faulted in on a second thread while a load reads into them.

A load into new tensors (``single_file.load`` without ``into=``) writes every byte into memory that nobody has
touched yet, so each of its pages is faulted in on first write: by the reader thread, one page after the other,
between the reads. On the benchmark VM that first touch costs more than the reading (a new process writing 2 GB of
fresh memory: 1.7-5.1 s, and 0.17-0.26 s the second time; benchmarks/LOG.md, "Ninth paired run"), and on any
machine it is half a million page faults per 2 GB. :class:`PagePopulator` asks the kernel to map the storages'
pages (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+, one call per storage, without the GIL) in file order on a
thread of its own, so that the faults run beside the reads instead of between them. The reader may reach a page
first; it then faults it as before, and populating a present page does nothing. Nothing is written to the
memory, so the two never disagree on its contents.

A storage that spans whole 2 MiB pages is first marked ``MADV_HUGEPAGE`` over them (where transparent huge pages
are ``madvise``-only, as on the benchmark VM; a no-op where they are off): one fault maps 2 MiB instead of 4 KiB,
so populating 2 GB takes ~1,000 faults instead of ~500,000. The load reads every byte of the storage, so no memory
is mapped that would not be touched anyway (benchmarks/LOG.md has the measurements).
"""

from __future__ import annotations

import ctypes
import errno
import sys
import threading
from collections.abc import Callable
from typing import Optional

import torch

from lightning_recover import env

__all__ = ["PagePopulator", "populate_supported"]

_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_POPULATE_WRITE = 23
_PAGE = 4096
_HUGE_PAGE = 2 << 20


def _madvise() -> Optional[Callable[[int, int, int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()
# until the kernel says otherwise (EINVAL: older than 5.14); LIGHTNING_RECOVER_POPULATE=off turns it off
_supported = _madvise_fn is not None and env.flag(env.POPULATE, "on") != "off"


def populate_supported() -> bool:
    """Whether loads populate fresh storages (Linux 5.14+, not turned off by ``LIGHTNING_RECOVER_POPULATE``)."""
    return _supported


class PagePopulator:
    """Populates the whole pages of ``storages`` (CPU storages, in the order given) on a daemon thread."""

    def __init__(self, storages: list[torch.UntypedStorage]) -> None:
        self._storages = storages
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-populate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        global _supported
        for st in self._storages:
            if self._stop or not _supported:
                return
            start, end = st.data_ptr(), st.data_ptr() + st.nbytes()
            lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
            if hi <= lo:
                continue
            huge_lo, huge_hi = -(-lo // _HUGE_PAGE) * _HUGE_PAGE, hi // _HUGE_PAGE * _HUGE_PAGE
            if huge_hi > huge_lo:
                _madvise_fn(huge_lo, huge_hi - huge_lo, _MADV_HUGEPAGE)  # (refused: 4 KiB pages, as before)
            if _madvise_fn(lo, hi - lo, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
                _supported = False  # (other errors, e.g. ENOMEM, leave the faults to the reader for this one)

    def wait(self) -> None:
        """Wait until every storage is populated."""
        self._thread.join()

    def close(self) -> None:
        """Stop after the storage in progress and wait for the thread."""
        self._stop = True
        self._thread.join()
        self._storages = []
