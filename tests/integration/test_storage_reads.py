"""Storages read on a second thread while data.pkl is unpickled (checkpoint/file/storage_reads.py)."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

import native_io
from lightning_recover.checkpoint import CheckpointCorruptError, UnsafeCheckpointError, load, read_info, save


def _state(n: int = 24) -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(2000 + 997 * i, generator=g) for i in range(n)}


class _SlowEngine:
    """An IOEngine of small transfers one at a time (the storages land one after another while the unpickler
    runs) whose readers sleep before each read, and can fail the ``fail_at``-th read before it begins."""

    def __init__(self, delay: float = 0.01, fail_at: int = 0, build=native_io, before_storage_read=None) -> None:
        self._eng = build.IOEngine(block_size=64 << 10, queue_depth=1)
        self.delay, self.fail_at, self.reads = delay, fail_at, 0
        self.before_storage_read = before_storage_read
        self.storage_reads: list[int] = []  # the segments of each read that reports its progress

    def open_reader(self, path):
        outer, inner = self, self._eng.open_reader(path)

        class Reader:
            size = inner.size

            def read(self, segs, progress=None):
                outer.reads += 1
                if outer.fail_at and outer.reads == outer.fail_at:
                    raise OSError(5, "injected read error")
                time.sleep(outer.delay)
                if progress is not None:
                    outer.storage_reads.append(len(segs))
                    if outer.before_storage_read:
                        outer.before_storage_read()
                return inner.read(segs, progress=progress)

            def new_progress(self):
                return inner.new_progress()

            def close(self):
                inner.close()

        return Reader()


def _no_read_thread_left() -> bool:
    return not [t for t in threading.enumerate() if t.name == "checkpoint-read"]


def test_torch_sees_every_storage_complete(tmp_path):
    """Every storage in one read of small transfers behind a slow start; map_location (called by torch with each
    storage as the unpickler gets it) checks the bytes are already all there."""
    ck = _state()
    path = tmp_path / "c.ckpt"
    save(ck, path)
    expected = {t.untyped_storage().nbytes(): bytes(t.numpy().tobytes()) for t in ck.values()}
    seen = []

    def check(storage, location):
        data = bytes(torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes())
        seen.append(data == expected[storage.nbytes()])
        return storage

    eng = _SlowEngine()
    out = load(path, map_location=check, engine=eng)
    assert len(seen) == len(ck) and all(seen)
    assert eng.storage_reads == [len(ck)]  # one read of every storage, its progress followed
    assert all(torch.equal(out[k], v) for k, v in ck.items()) and _no_read_thread_left()


def test_every_damaged_storage_reported_by_tensor_name(tmp_path):
    ck = _state()
    path = tmp_path / "c.ckpt"
    save(ck, path)
    info = read_info(path)
    recs = {t["name"]: info.index.records[t["record"]] for t in info.tensors}
    data = bytearray(path.read_bytes())
    for name in ("t2", "t20"):
        data[recs[name].data_offset + 8] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as ei:
        load(path, engine=_SlowEngine(delay=0.0))
    assert [d["tensors"] for d in ei.value.damaged] == [["t2"], ["t20"]]  # both, in file order
    assert "t2" in str(ei.value) and "(and 1 more)" in str(ei.value) and _no_read_thread_left()
    assert torch.equal(load(path, verify=False)["t5"], ck["t5"])  # verify=False still loads


@pytest.mark.parametrize("where", ["before the read began", "in the native read"])
def test_read_error_reaches_the_caller(tmp_path, where):
    path = tmp_path / "c.ckpt"
    save(_state(), path)
    if where == "before the read began":
        # read 1: the file's head, 2: its tail, 3: index and central directory, 4: the small records, 5: storages
        with pytest.raises(OSError, match="injected read error"):
            load(path, engine=_SlowEngine(delay=0.0, fail_at=5))
    else:
        nt = pytest.importorskip("native_io._native_io_testing", reason="fault injection lives in the test build")
        try:  # the third transfer of the storages' read fails with EIO, with storages still to come
            eng = _SlowEngine(delay=0.0, build=nt, before_storage_read=lambda: nt._inject_faults(eio_at=3))
            with pytest.raises(OSError) as ei:
                load(path, engine=eng)
        finally:
            nt._inject_faults()
        assert ei.value.errno == errno.EIO and eng.storage_reads == [24]
    assert _no_read_thread_left()


def test_a_read_progress_reports_each_leading_segment_once_landed(tmp_path):
    """native_io.ReadProgress: wait(n) returns once n leading segments are read, crc(i) is then their CRC-32C;
    a progress follows one read; an ended read wakes its waiters; cancel() stops a read with ECANCELED."""
    data = torch.randint(0, 255, (5 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).numpy()
    path = tmp_path / "f"
    data.tofile(path)
    eng = native_io.IOEngine(block_size=256 << 10, queue_depth=1)
    segs = [
        (o, torch.empty(min(300_000, data.size - o), dtype=torch.uint8).numpy()) for o in range(0, data.size, 300_000)
    ]
    progress = native_io.ReadProgress()
    seen = []

    def consume():
        for i, (off, buf) in enumerate(segs):
            seen.append(progress.wait(i + 1) > i and bytes(buf) == data[off : off + len(buf)].tobytes())
            seen.append(progress.crc(i) == native_io.crc32c(data[off : off + len(buf)]))

    consumer = threading.Thread(target=consume)
    consumer.start()
    with eng.open_reader(path) as r:
        crcs = r.read(segs, progress=progress)
        consumer.join(timeout=60)
        assert not consumer.is_alive() and all(seen) and len(seen) == 2 * len(segs)
        assert progress.ended and progress.done == len(segs) and crcs == [progress.crc(i) for i in range(len(segs))]
        with pytest.raises(ValueError, match="follows one read"):
            r.read(segs, progress=progress)
        cancelled = native_io.ReadProgress()
        cancelled.cancel()
        with pytest.raises(OSError, match="cancelled") as ei:
            r.read(segs, progress=cancelled)
        assert ei.value.errno == errno.ECANCELED and cancelled.ended and cancelled.done < len(segs)
        assert r.read(segs) == crcs  # the reader goes on after a cancelled read
    unused = native_io.ReadProgress()
    unused.end()  # a read that failed before it began: its waiters return
    assert unused.wait(1) == 0
    with pytest.raises(ValueError, match="n must be >= 0"):
        unused.wait(-1)
    with pytest.raises(IndexError, match="not read yet"):
        unused.crc(0)


class _Opaque:
    def __init__(self) -> None:
        self.x = 1


def test_refused_unpickle_waits_for_the_reads_in_flight(tmp_path):
    """weights_only refuses a class while storages are still being read: the reads stop, the thread is gone."""
    path = tmp_path / "c.ckpt"
    save({"w": _state(), "o": _Opaque()}, path)
    with pytest.raises(UnsafeCheckpointError):
        load(path, engine=_SlowEngine(delay=0.02))
    assert _no_read_thread_left()
