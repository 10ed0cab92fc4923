"""Fresh storages' pages populated beside a load's reads (checkpoint/file/page_populate.py)."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

from lightning_recover.checkpoint import load, save
from lightning_recover.checkpoint.file import page_populate, single_file

needs_populate = pytest.mark.skipif(not page_populate.populate_supported(), reason="no madvise(MADV_POPULATE_WRITE)")


_libc = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _whole_pages(storage: torch.UntypedStorage) -> tuple[int, int]:
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    return -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE


def _resident_pages(storage: torch.UntypedStorage) -> tuple[int, int]:
    """(pages of the storage's whole pages in memory, those pages): mincore(2) over exactly its range.

    Not the process's RSS: under memory pressure the kernel may drop other (file-backed) pages of the
    process while these are populated (CI once saw RSS grow by one storage's size for two)."""
    lo, hi = _whole_pages(storage)
    pages = (hi - lo) // _PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec), pages


@needs_populate
def test_populate_maps_the_pages_of_fresh_storages():
    n = 64 << 20
    storages = [torch.UntypedStorage(n) for _ in range(2)]
    for st in storages:  # fresh whatever the allocator reused: MADV_DONTNEED drops the pages (contents unset anyway)
        lo, hi = _whole_pages(st)
        assert _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4) == 0
    fresh = [_resident_pages(st) for st in storages]
    page_populate.PagePopulator(storages).wait()
    if not page_populate.populate_supported():
        pytest.skip("the kernel refused MADV_POPULATE_WRITE (older than 5.14)")
    after = [_resident_pages(st) for st in storages]
    assert all(present == pages for present, pages in after), (fresh, after)
    assert all(present == 0 for present, _ in fresh), fresh  # the populator did it


def _advised_huge(lo: int, hi: int) -> list[bool]:
    """For each mapping of /proc/self/smaps that overlaps [lo, hi): whether it is advised MADV_HUGEPAGE ("hg")."""
    out, overlaps = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                overlaps = start < hi and end > lo
            elif head == "VmFlags:" and overlaps:
                out.append("hg" in line.split()[1:])
    return out


@needs_populate
def test_populated_storages_are_advised_huge_pages_over_their_whole_2_mib_pages():
    st = torch.UntypedStorage(64 << 20)
    lo, hi = _whole_pages(st)
    huge_lo, huge_hi = -(-lo // (2 << 20)) * (2 << 20), hi // (2 << 20) * (2 << 20)
    assert _advised_huge(huge_lo, huge_hi) == [False]
    page_populate.PagePopulator([st]).wait()
    assert _advised_huge(huge_lo, huge_hi) == [True]  # the whole 2 MiB pages, one mapping
    assert not any(_advised_huge(lo, huge_lo)) and not any(_advised_huge(huge_hi, hi))  # not the ragged ends


@needs_populate
def test_populate_leaves_written_bytes_alone():
    t = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB, written
    page_populate.PagePopulator([t.untyped_storage()]).wait()
    assert torch.equal(t, torch.arange(3 << 20, dtype=torch.float32))


def test_a_kernel_without_populate_is_remembered(monkeypatch):
    calls = []

    def refused(addr, length, advice):
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(page_populate, "_madvise_fn", refused)
    monkeypatch.setattr(page_populate, "_supported", True)
    page_populate.PagePopulator([torch.UntypedStorage(1 << 20) for _ in range(3)]).wait()
    assert calls == [23] and not page_populate.populate_supported()  # tried once, then left to the reader


def test_loads_of_large_records_populate_their_fresh_storages(tmp_path, monkeypatch):
    """A file of large records (a load bound by its bytes) gets a populator over exactly its fresh storages; the
    targets of ``into=`` are not among them; every value arrives."""
    g = torch.Generator().manual_seed(0)
    ck = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(700_000, generator=g).to(torch.bfloat16)}
    ck["c"] = torch.randn(600_000, generator=g)
    save(ck, tmp_path / "l.ckpt")
    seen: list[list[int]] = []
    real = page_populate.PagePopulator

    def recording(storages):
        seen.append([st.nbytes() for st in storages])
        return real(storages)

    monkeypatch.setattr(single_file, "PagePopulator", recording)
    monkeypatch.setattr(single_file, "populate_supported", lambda: True)
    out = load(tmp_path / "l.ckpt")
    assert all(torch.equal(out[k], ck[k]) for k in ck)
    assert sorted(seen[0]) == sorted(t.nbytes for t in ck.values())
    target = torch.zeros(1 << 20)
    out = load(tmp_path / "l.ckpt", into={"a": target})
    assert out["a"] is target and torch.equal(target, ck["a"]) and torch.equal(out["c"], ck["c"])
    assert sorted(seen[1]) == sorted(ck[k].nbytes for k in ("b", "c"))


def test_loads_of_many_small_records_do_not_populate(tmp_path, monkeypatch):
    ck = {f"t{i}": torch.randn(1000) for i in range(50)}
    save(ck, tmp_path / "s.ckpt")
    monkeypatch.setattr(single_file, "PagePopulator", lambda storages: pytest.fail("populated"))
    out = load(tmp_path / "s.ckpt")
    assert all(torch.equal(out[k], ck[k]) for k in ck)
