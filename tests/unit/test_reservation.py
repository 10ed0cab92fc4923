"""GrowingReservation: space and size reserved ahead of a streaming writer (checkpoint/reservation.py)."""

from __future__ import annotations

import errno
import os

import pytest

import native_io
from lightning_recover.checkpoint import reservation
from lightning_recover.checkpoint.reservation import GrowingReservation

MiB = 1 << 20


@pytest.fixture
def small_steps(monkeypatch):
    monkeypatch.setattr(reservation, "FIRST_BYTES", 4 * MiB)
    monkeypatch.setattr(reservation, "AHEAD_BYTES", 2 * MiB)


def test_grows_geometrically_ahead_of_the_placement(tmp_path, small_steps):
    path = tmp_path / "f"
    path.write_bytes(b"")
    with GrowingReservation(path) as r:
        r.ensure(1)
        assert r.reserved == 4 * MiB and os.path.getsize(path) == 4 * MiB  # size set, not only blocks
        assert os.stat(path).st_blocks * 512 >= 4 * MiB
        r.ensure(4 * MiB)  # inside: nothing asked
        assert r.calls == 1
        r.ensure(4 * MiB + 1)
        assert r.reserved == 8 * MiB  # doubled
        r.ensure(30 * MiB)
        assert r.reserved == 32 * MiB and r.calls == 3  # at least AHEAD_BYTES past the end
    assert os.path.getsize(path) == 32 * MiB


def test_refused_headroom_falls_back_to_the_placed_bytes(tmp_path, small_steps, monkeypatch):
    """The filesystem refuses the headroom (ENOSPC past 4 MiB here): exactly the placed bytes are reserved."""
    real = native_io.reserve

    def tight_disk(fd, offset, length):
        if offset + length > 4 * MiB:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(native_io, "reserve", tight_disk)
    path = tmp_path / "f"
    path.write_bytes(b"")
    with GrowingReservation(path) as r:
        r.ensure(3 * MiB)
        assert r.reserved == 3 * MiB and r.error is None and os.path.getsize(path) == 3 * MiB
        r.ensure(6 * MiB)  # even the placed bytes are refused: it stops, the writes extend the file
        assert r.error is not None and r.error.errno == errno.ENOSPC
        r.ensure(7 * MiB)
        assert r.reserved == 3 * MiB


def test_real_refusal_stops_reserving(tmp_path):
    """A range past the filesystem's largest file: the kernel refuses (EFBIG), nothing is reserved."""
    path = tmp_path / "f"
    path.write_bytes(b"")
    with GrowingReservation(path) as r:
        r.ensure(1 << 62)
        assert r.reserved == 0 and isinstance(r.error, OSError)
    assert os.path.getsize(path) == 0


def test_disabled_reserves_nothing(tmp_path):
    with GrowingReservation(None) as r:
        r.ensure(1 << 30)
        assert (r.reserved, r.calls) == (0, 0)


def test_native_reserve_rejects_bad_arguments(tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        for args in ((-1, 0, 1), (fd, -1, 1), (fd, 0, 0)):
            with pytest.raises(ValueError):
                native_io.reserve(*args)
        with pytest.raises(OSError) as e:
            native_io.reserve(9999, 0, 4096)  # not an open file
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_reserve_size_sets_the_size_or_says_why_not(tmp_path):
    from lightning_recover.checkpoint.reservation import reserve_size

    path = tmp_path / "f"
    path.write_bytes(b"")
    assert reserve_size(path, 3 * MiB) is None
    assert os.path.getsize(path) == 3 * MiB and os.stat(path).st_blocks * 512 >= 3 * MiB
    err = reserve_size(path, 1 << 62)  # past the filesystem's largest file
    assert isinstance(err, OSError) and os.path.getsize(path) == 3 * MiB


@pytest.mark.parametrize("prealloc", ["on", "auto", "off"])
def test_engine_open_writer_reserves_the_estimate_and_close_cuts_it(tmp_path, monkeypatch, prealloc):
    """The DCP writer's and the async saver's way, when asked for (``on``): the estimate reserved at open, the
    exact size at close."""
    from lightning_recover.checkpoint.engine import open_writer

    monkeypatch.setenv("LIGHTNING_RECOVER_PREALLOCATE", prealloc)
    path = tmp_path / "w.bin"
    data = os.urandom(3 * 4096 + 100)
    with native_io.IOEngine() as eng:
        w = open_writer(eng, path, 8 * MiB)
        assert os.path.getsize(path) == (8 * MiB if prealloc == "on" else 0)
        w.write([(0, data)])
        w.close(size=len(data))
    assert path.read_bytes() == data
