"""A wrong integrity record over intact data, as lazy asynchronous saves with a faulty CRC combine wrote them.

The files are written by the real saver with the combine of the releases that built its operator table lazily,
with the table two threads left behind (an operator appended twice); ``inspect`` must tell them from damaged data.
"""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch

import native_io
from lightning_recover.checkpoint import CheckpointCorruptError, load, read_info, verify_file
from lightning_recover.checkpoint.file import async_io
from lightning_recover.checkpoint.file.record_diagnosis import (
    async_chunk_candidates,
    explain_damaged_records,
    explain_wrong_crc,
)
from lightning_recover.checkpoint.tools import EXIT_DAMAGED, EXIT_RECORD_WRONG, inspect_main
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO

pytestmark = pytest.mark.timeout(300)

_POLY = 0x82F63B78


def _gf2_times(mat: list, vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: list) -> list:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _faulty_combine(duplicated: tuple):
    """The lazily built combine of the faulty releases, its table holding the operators at ``duplicated`` twice
    (what two threads appending the same operator at once left behind)."""
    m = [_POLY] + [1 << n for n in range(31)]
    for _ in range(3):
        m = _gf2_square(m)
    ops = [m]
    while len(ops) < 48:
        ops.append(_gf2_square(ops[-1]))
    table = []
    for j, op in enumerate(ops):
        table += [op] * (1 + duplicated.count(j))

    def combine(crc1: int, crc2: int, len2: int) -> int:
        k = 0
        while len2:
            if len2 & 1:
                crc1 = _gf2_times(table[k], crc1)
            len2 >>= 1
            k += 1
        return crc1 ^ crc2

    return combine


def _inspect(path, capsys, as_json=False):
    rc = inspect_main(argparse.Namespace(checkpoint=str(path), no_verify=False, json=as_json))
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.fixture
def state():
    # the tensor of the CI failure: a 12 MB storage, lazily copied in four chunks and a remainder
    return {"w": torch.arange(3_000_000, dtype=torch.float32), "b": torch.ones(10), "meta": {"k": 3}}


@pytest.mark.parametrize("duplicated", [(0,), (3,), (1, 20)])
def test_inspect_tells_a_wrong_record_over_intact_data_from_damage(tmp_path, monkeypatch, capsys, state, duplicated):
    path = tmp_path / "async.ckpt"
    monkeypatch.setattr(async_io, "crc32c_combine", _faulty_combine(duplicated))
    io = AsyncUringCheckpointIO()
    try:
        io.save_checkpoint(state, path)
        io.wait_until_durable()
    finally:
        io.teardown()
    monkeypatch.undo()

    info, damaged = verify_file(path)
    record = next(t["record"] for t in info.tensors if t["name"] == "w")
    true_crc = native_io.crc32c(state["w"].numpy().tobytes())
    assert [(d["record"], d["actual_crc32c"]) for d in damaged] == [(record, true_crc)]
    assert damaged[0]["expected_crc32c"] != true_crc  # the record is wrong, the bytes right
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
    assert torch.equal(load(path, verify=False)["w"], state["w"])
    with pytest.raises(CheckpointCorruptError):
        load(path)

    rc, out = _inspect(path, capsys)
    assert rc == EXIT_RECORD_WRONG, out
    assert "data consistent with a recomputed checksum, integrity record wrong" in out
    assert "HINT:" in out and "DAMAGED" not in out
    rc, out = _inspect(path, capsys, as_json=True)
    summary = json.loads(out)
    assert rc == EXIT_RECORD_WRONG and summary["record_wrong"] is True and summary["damaged"][0]["record_wrong"]

    # one byte of the data changed as well: now nothing explains the record, it is damaged
    st = read_info(path).index.records[record]
    raw = bytearray(path.read_bytes())
    raw[st.data_offset + st.nbytes // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    rc, out = _inspect(path, capsys)
    assert rc == EXIT_DAMAGED, out
    assert "DAMAGED data" in out and "consistent" not in out


def test_a_correct_async_save_is_not_reported(tmp_path, capsys, state):
    path = tmp_path / "ok.ckpt"
    io = AsyncUringCheckpointIO()
    try:
        io.save_checkpoint(state, path)
        io.wait_until_durable()
    finally:
        io.teardown()
    rc, out = _inspect(path, capsys)
    assert rc == 0 and "OK" in out


@pytest.mark.parametrize("chunk", [4096 * 3, 1 << 16, 300_000 // 4096 * 4096])
@pytest.mark.parametrize("duplicated", [(0,), (5,), (2, 9), (0, 0, 14)])
def test_explain_finds_the_chunking_and_table(chunk, duplicated):
    data = random.Random(chunk).randbytes(300_001)
    faulty = _faulty_combine(duplicated)
    crc = 0
    for off in range(0, len(data), chunk):
        piece = data[off : off + chunk]
        crc = faulty(crc, native_io.crc32c(piece), len(piece))
    assert crc != native_io.crc32c(data)  # the faulty table moves bits of these lengths: the record is wrong
    why = explain_wrong_crc(memoryview(data), crc, [chunk * 2, chunk, 4096])
    assert why is not None and why.chunk_bytes == chunk
    assert explain_wrong_crc(memoryview(data), crc ^ 1, [chunk * 2, chunk, 4096]) is None


def test_chunk_candidates_hold_the_savers_rule():
    # a ring as large as the lazily copied storages (the saver's default): a quarter of it, rounded down to 4096
    sizes = [12_000_000, 40, 4_000_000]
    got = async_chunk_candidates(sizes)
    big, mid, tiny = (-(-n // 4096) * 4096 for n in sizes)
    for lazy in (big, big + mid, big + mid + tiny):  # eager_bytes above 4 MB, above 40 bytes, at most 40 bytes
        assert lazy // 4 // 4096 * 4096 in got
    assert 64 << 20 in got and 1 << 20 in got and got == sorted(set(got))


def test_explain_damaged_records_leaves_headers_and_single_chunks(tmp_path):
    path = tmp_path / "f.bin"
    data = random.Random(3).randbytes(10_000)
    path.write_bytes(data)
    damaged = [
        {"what": "local header", "record": "data/0", "offset": 0, "nbytes": 30, "expected_crc32c": None},
        {"what": "data", "record": "data/1", "offset": 0, "nbytes": 4000, "expected_crc32c": 123},
    ]
    assert explain_damaged_records(str(path), [4000], damaged) == [None, None]
