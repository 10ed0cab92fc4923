"""Storages read on a second thread while data.pkl is unpickled (checkpoint/file/storage_reads.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import native_io
from lightning_recover.checkpoint import CheckpointCorruptError, UnsafeCheckpointError, load, read_info, save
from lightning_recover.checkpoint.file import storage_reads


def _state(n: int = 24) -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(2000 + 997 * i, generator=g) for i in range(n)}


class _SlowEngine:
    """An IOEngine whose readers sleep before each read, and can fail the ``fail_at``-th: the unpickler would run
    ahead of the reads if it did not wait for them."""

    def __init__(self, delay: float = 0.01, fail_at: int = 0) -> None:
        self._eng = native_io.IOEngine()
        self.delay, self.fail_at, self.reads = delay, fail_at, 0

    def open_reader(self, path):
        outer, inner = self, self._eng.open_reader(path)

        class Reader:
            size = inner.size

            def read(self, segs):
                outer.reads += 1
                if outer.fail_at and outer.reads == outer.fail_at:
                    raise OSError(5, "injected read error")
                time.sleep(outer.delay)
                return inner.read(segs)

            def close(self):
                inner.close()

        return Reader()


def _no_read_thread_left() -> bool:
    return not [t for t in threading.enumerate() if t.name == "checkpoint-read"]


def test_torch_sees_every_storage_complete(tmp_path, monkeypatch):
    """Many small batches behind a slow reader; map_location (called by torch with each storage as the unpickler
    gets it) checks the bytes are already all there."""
    monkeypatch.setattr(storage_reads, "BATCH_BYTES", 16 << 10)
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
    assert eng.reads > len(ck) // 4  # the storages came in several batches
    assert all(torch.equal(out[k], v) for k, v in ck.items()) and _no_read_thread_left()


def test_every_damaged_storage_reported_by_tensor_name(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_reads, "BATCH_BYTES", 16 << 10)
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


def test_read_error_reaches_the_caller(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_reads, "BATCH_BYTES", 16 << 10)
    path = tmp_path / "c.ckpt"
    save(_state(), path)
    # read 1: the file's head, 2: its tail, 3: index and central directory, 4: the small records, 5...: storages
    with pytest.raises(OSError, match="injected read error"):
        load(path, engine=_SlowEngine(delay=0.0, fail_at=7))
    assert _no_read_thread_left()


class _Opaque:
    def __init__(self) -> None:
        self.x = 1


def test_refused_unpickle_waits_for_the_reads_in_flight(tmp_path, monkeypatch):
    """weights_only refuses a class while storages are still being read: the reads stop, the thread is gone."""
    monkeypatch.setattr(storage_reads, "BATCH_BYTES", 16 << 10)
    path = tmp_path / "c.ckpt"
    save({"w": _state(), "o": _Opaque()}, path)
    with pytest.raises(UnsafeCheckpointError):
        load(path, engine=_SlowEngine(delay=0.02))
    assert _no_read_thread_left()
