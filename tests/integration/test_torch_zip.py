"""Format 2: our files are torch.save archives, written by the native engine, with an integrity record."""

from __future__ import annotations

import argparse
import os
import struct
import zipfile
from collections import Counter

import pytest
import torch

from lightning_recover.checkpoint import CheckpointCorruptError, UnsafeCheckpointError, load, read_info, save
from lightning_recover.checkpoint.file import torch_zip
from lightning_recover.checkpoint.file.single_file import verify_file


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    ck = {
        "state_dict": {
            "w": w,
            "b": torch.randn(7, generator=g),
            "h": torch.randn(64, generator=g).to(torch.bfloat16),
            "f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
            "i": torch.arange(11),
            "mask": torch.rand(9, generator=g) > 0.5,
            "c": torch.randn(5, dtype=torch.complex64, generator=g),
            "empty": torch.empty(0, 4),
            "big": torch.randn(1 << 19, generator=g),  # 2 MiB
        },
        "row": w[3],  # a view sharing w's storage
        "t": w.t(),  # non-contiguous
        "epoch": 3,
        "nested": [{"lr": 0.1, "betas": (0.9, 0.99)}, None, "name"],
    }
    return ck


def _assert_same(a, b) -> None:
    assert a["epoch"] == b["epoch"] and a["nested"] == b["nested"]
    for k, v in a["state_dict"].items():
        assert v.dtype == b["state_dict"][k].dtype and torch.equal(
            v.view(torch.uint8), b["state_dict"][k].view(torch.uint8)
        )
    assert torch.equal(a["row"], b["row"]) and torch.equal(a["t"], b["t"])


def test_stock_readers_read_our_file(tmp_path):
    ck = _state()
    path = tmp_path / "a.ckpt"
    save(ck, path)
    for out in (
        load(path),
        torch.load(path, weights_only=True),
        torch.load(path, weights_only=True, mmap=True),
    ):
        _assert_same(ck, out)
        # a view still shares its base's storage, like torch.load of a torch.save file
        assert out["row"].untyped_storage().data_ptr() == out["state_dict"]["w"].untyped_storage().data_ptr()
    names = zipfile.ZipFile(path).namelist()
    assert names[0] == "archive/data.pkl" and names[-1] == "archive/" + torch_zip.INTEGRITY_RECORD
    info = read_info(path)
    big = info.index.records[next(t["record"] for t in info.tensors if t["name"] == "state_dict/big")]
    assert big.data_offset % 4096 == ck["state_dict"]["big"].data_ptr() % 4096  # congruent: written uncopied
    for rec in info.index.storage_records():
        assert rec is big or rec.data_offset % 4096 == 0  # the small ones stay 4096-aligned
    assert {t["name"] for t in info.tensors} >= {"state_dict/w", "state_dict/big", "row", "t"}


def test_torch_layout_is_torch_saves_own(tmp_path):
    """With torch_layout=True record offsets equal torch.save's at storage_alignment=4096, so torch's offset
    arithmetic holds too."""
    from torch.utils.serialization import config

    ck = _state()
    save(ck, tmp_path / "ours.ckpt", torch_layout=True)
    old = config.save.storage_alignment, config.save.compute_crc32
    config.save.storage_alignment, config.save.compute_crc32 = 4096, False
    try:
        torch.save(ck, tmp_path / "archive")  # torch names the archive after the file: same name length
    finally:
        config.save.storage_alignment, config.save.compute_crc32 = old
    ours = zipfile.ZipFile(tmp_path / "ours.ckpt").infolist()
    ref = zipfile.ZipFile(tmp_path / "archive").infolist()
    assert [(i.filename, i.header_offset, i.file_size) for i in ours[: len(ref)]] == [
        (i.filename, i.header_offset, i.file_size) for i in ref
    ]
    assert "archive/.format_version" in [i.filename for i in ours]
    _stock_loads_with_offset_arithmetic_asked_for(tmp_path / "ours.ckpt")  # torch's arithmetic finds every record


def _stock_loads_with_offset_arithmetic_asked_for(path) -> None:
    """torch.load (mmap and meta) with torch's opt-in offset arithmetic and its debug check of every offset
    (torch reads ``TORCH_SERIALIZATION_DEBUG`` at each load, so this runs in this process, both settings restored)."""
    from torch.utils.serialization import config

    old_env, old_calc = os.environ.get("TORCH_SERIALIZATION_DEBUG"), config.load.calculate_storage_offsets
    os.environ["TORCH_SERIALIZATION_DEBUG"] = "1"
    config.load.calculate_storage_offsets = True
    try:
        torch.load(path, weights_only=True, mmap=True)
        torch.load(path, weights_only=True, map_location="meta")
    finally:
        config.load.calculate_storage_offsets = old_calc
        if old_env is None:
            del os.environ["TORCH_SERIALIZATION_DEBUG"]
        else:
            os.environ["TORCH_SERIALIZATION_DEBUG"] = old_env


def test_default_layout_storages_first_and_congruent(tmp_path):
    """The default layout: storages first (written while the rest is pickled), the large ones congruent to their
    memory; data.pkl after them but first in the central directory; no .format_version, so torch reads every
    offset from the local headers even when asked for its offset arithmetic."""
    ck = _state()
    path = tmp_path / "c.ckpt"
    save(ck, path)
    info = read_info(path)
    in_file = [n for n, _ in sorted(info.index.records.items(), key=lambda kv: kv[1].data_offset)]
    storages = [n for n in in_file if n.startswith("data/")]
    assert in_file[: len(storages)] == storages and in_file[len(storages)] == "data.pkl"
    assert ".format_version" not in in_file
    names = zipfile.ZipFile(path).namelist()
    assert names[0] == "archive/data.pkl" and names[1:3] == ["archive/.storage_alignment", "archive/byteorder"]
    for name in ("big", "w"):
        rec = info.index.records[next(t["record"] for t in info.tensors if t["name"] == f"state_dict/{name}")]
        address = ck["state_dict"][name].data_ptr() % 4096
        assert rec.data_offset % 4096 == (address if name == "big" else 0)  # w (240 KB) is under 1 MiB
    _assert_same(ck, torch.load(path, weights_only=True, mmap=True))
    _stock_loads_with_offset_arithmetic_asked_for(path)


def test_storages_are_written_while_the_object_is_pickled(tmp_path, monkeypatch):
    from lightning_recover.checkpoint.file import single_file

    monkeypatch.setattr(single_file, "_WRITE_BATCH_BYTES", 1 << 20)
    events: list = []
    real_write = torch_zip.PlanWriter.write
    monkeypatch.setattr(
        torch_zip.PlanWriter, "write", lambda self, segs, **kw: events.append("write") or real_write(self, segs, **kw)
    )
    real_dump = torch_zip._FastPickler.dump
    monkeypatch.setattr(
        torch_zip._FastPickler, "dump", lambda self, obj: real_dump(self, obj) or events.append("pickled")
    )
    ck = {f"t{i}": torch.randn(1 << 19) for i in range(8)}  # 2 MiB each
    save(ck, tmp_path / "s.ckpt")
    assert "pickled" in events and events.index("write") < events.index("pickled")
    out = load(tmp_path / "s.ckpt")
    assert all(torch.equal(out[k], v) for k, v in ck.items())


def test_fast_pickler_giving_up_midway_restarts_the_save_unstreamed(tmp_path, monkeypatch):
    """A Parameter after plain tensors: the fast pickler has streamed storages when it gives up; the save starts
    again with torch's pickler, and the file is exactly what torch would pickle."""
    from lightning_recover.checkpoint.file import single_file

    calls: list = []
    real = single_file._save_zip
    monkeypatch.setattr(single_file, "_save_zip", lambda *a, **k: calls.append(k.get("fast_pickler")) or real(*a, **k))
    ck = {"a": torch.randn(1 << 19), "b": torch.randn(5), "p": torch.nn.Parameter(torch.randn(1 << 19))}
    save(ck, tmp_path / "p.ckpt")
    assert calls == [None, False]
    for out in (load(tmp_path / "p.ckpt", weights_only=False), torch.load(tmp_path / "p.ckpt", weights_only=True)):
        assert isinstance(out["p"], torch.nn.Parameter) and all(torch.equal(out[k], v) for k, v in ck.items())
    assert verify_file(tmp_path / "p.ckpt")[1] == []
    assert not [p for p in os.listdir(tmp_path) if p != "p.ckpt"]  # the abandoned temporary file is gone


def test_zip_crc32_option_gives_a_fully_valid_zip(tmp_path):
    save(_state(), tmp_path / "z.ckpt", zip_crc32=True)
    assert zipfile.ZipFile(tmp_path / "z.ckpt").testzip() is None
    _assert_same(_state(), load(tmp_path / "z.ckpt"))
    save(_state(), tmp_path / "n.ckpt")  # default: CRC-32 fields zero, as torch.save with compute_crc32=False
    assert zipfile.ZipFile(tmp_path / "n.ckpt").testzip() is not None


def test_zip64_records(tmp_path, monkeypatch):
    """Files past 4 GiB need zip64 fields; forced here on a small file, read by torch and by us."""
    monkeypatch.setattr(torch_zip, "ZIP64_LIMIT", 5000)
    ck = _state()
    save(ck, tmp_path / "z64.ckpt")
    _assert_same(ck, torch.load(tmp_path / "z64.ckpt", weights_only=True))
    _assert_same(ck, load(tmp_path / "z64.ckpt"))
    assert verify_file(tmp_path / "z64.ckpt")[1] == []


def test_async_save_writes_format_2(tmp_path):
    from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO

    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20)  # the 2 MiB tensor goes in chunks
    ck = _state()
    io.save_checkpoint(ck, tmp_path / "a.ckpt")
    io.teardown()
    _assert_same(ck, torch.load(tmp_path / "a.ckpt", weights_only=True))
    assert verify_file(tmp_path / "a.ckpt")[1] == []


# ----------------------------------------------------------------------------------- damage


def _rewrite(path, fn) -> None:
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(fn(data)))


def _flip(at: int, mask: int = 0x04):
    def f(d):
        d[at] ^= mask
        return d

    return f


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "c.ckpt"
    save(_state(), path)
    return path


def test_bitflip_in_tensor_data_names_tensor(saved):
    info = read_info(saved)
    rec = info.index.records[next(t["record"] for t in info.tensors if t["name"] == "state_dict/big")]
    _rewrite(saved, _flip(rec.data_offset + 1000))
    with pytest.raises(CheckpointCorruptError) as ei:
        load(saved)
    msg = str(ei.value)
    assert str(saved) in msg and "state_dict/big" in msg and f"offset {rec.data_offset}" in msg
    assert verify_file(saved)[1][0]["tensors"] == ["state_dict/big"]
    assert not torch.equal(load(saved, verify=False)["state_dict"]["big"], _state()["state_dict"]["big"])


@pytest.mark.parametrize("where", ["data.pkl", "central directory", "integrity record", "end comment"])
def test_bitflip_in_metadata_rejected(saved, where):
    info = read_info(saved)
    size = saved.stat().st_size
    at = {
        "data.pkl": info.index.records["data.pkl"].data_offset + 20,
        "central directory": info.index.central_offset + 50,
        "integrity record": info.index.integrity_offset + 30,
        "end comment": size - 5,
    }[where]
    _rewrite(saved, _flip(at))
    with pytest.raises(CheckpointCorruptError) as ei:
        load(saved)
    assert str(saved) in str(ei.value)


def test_damaged_local_header_found_by_verify(saved):
    """Our loader reads records from verified offsets; torch follows local headers: verify checks them."""
    info = read_info(saved)
    rec = info.index.records["data/0"]
    _rewrite(saved, _flip(rec.header_offset + 31))  # a byte of the record name
    bad = verify_file(saved)[1]
    assert [d["what"] for d in bad] == ["local header"] and bad[0]["record"] == "data/0"


@pytest.mark.parametrize("cut", [1, 100, 5000, "half", "most"])
def test_truncated_file_rejected(saved, cut):
    size = saved.stat().st_size
    keep = {"half": size // 2, "most": 10}[cut] if isinstance(cut, str) else size - cut
    _rewrite(saved, lambda d: d[:keep])
    with pytest.raises(CheckpointCorruptError):
        load(saved)


def test_trailing_bytes_and_empty_and_foreign(tmp_path, saved):
    _rewrite(saved, lambda d: d + b"junk")
    with pytest.raises(CheckpointCorruptError, match="stray bytes"):
        load(saved)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="did not complete"):
        load(empty)
    plain = tmp_path / "plain.pt"  # what Lightning's TorchCheckpointIO writes: loaded by torch, unverified
    torch.save(_state(), plain)
    _assert_same(_state(), load(plain))
    with pytest.raises(CheckpointCorruptError, match="plain torch.save"):
        read_info(plain)


def test_inspect_format_2(saved, capsys):
    from lightning_recover.checkpoint.tools import inspect_main

    ns = argparse.Namespace(checkpoint=str(saved), no_verify=False, json=False)
    assert inspect_main(ns) == 0
    out = capsys.readouterr().out
    assert "format version 2" in out and "state_dict/w" in out and "OK" in out
    info = read_info(saved)
    rec = info.index.records["data/0"]
    _rewrite(saved, _flip(rec.data_offset + 7))
    assert inspect_main(ns) == 1
    assert "DAMAGED" in capsys.readouterr().out


# ------------------------------------------------------------------------------ what torch.load allows


class _Point:
    def __init__(self, x: int) -> None:
        self.x = x


def test_weights_only_is_torch_loads_allowlist(tmp_path):
    path = tmp_path / "g.ckpt"
    save({"p": _Point(3), "w": torch.ones(2)}, path)
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        load(path)
    with torch.serialization.safe_globals([_Point]):
        assert load(path)["p"].x == 3
    assert load(path, weights_only=False)["p"].x == 3


def test_nested_tensor_and_parameter_roundtrip(tmp_path):
    nt = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    p = torch.nn.Parameter(torch.randn(4))
    save({"nt": nt, "p": p}, tmp_path / "n.ckpt")
    out = load(tmp_path / "n.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(out["nt"].unbind(), nt.unbind()))
    assert isinstance(out["p"], torch.nn.Parameter) and torch.equal(out["p"], p)


def test_map_location_and_into(tmp_path):
    ck = _state()
    save(ck, tmp_path / "m.ckpt")
    meta = load(tmp_path / "m.ckpt", map_location="meta")
    assert meta["state_dict"]["w"].device.type == "meta" and meta["state_dict"]["w"].shape == (300, 200)
    target = torch.zeros(300, 200)
    out = load(tmp_path / "m.ckpt", into={"state_dict": {"w": target}})
    assert out["state_dict"]["w"] is target and torch.equal(target, ck["state_dict"]["w"])


def _count_fresh_storages(monkeypatch, listing_min_average: int = 0) -> list[int]:
    """Sizes of the fresh storages loads allocate; records of any average size are read into targets (unless
    ``listing_min_average`` says otherwise): the test states' records are small."""
    from lightning_recover.checkpoint.file import single_file

    monkeypatch.setattr(single_file, "_LARGE_AVERAGE_RECORD", listing_min_average)
    sizes: list[int] = []
    fresh = single_file._new_storage
    monkeypatch.setattr(single_file, "_new_storage", lambda n: (sizes.append(n), fresh(n))[1])
    return sizes


def _record_sizes(path) -> list[int]:
    return [r.nbytes for n, r in read_info(path).index.records.items() if n.startswith("data/")]


def test_load_into_reads_records_straight_into_the_targets(tmp_path, monkeypatch):
    """A record holding exactly one whole tensor whose target matches is read into the target's own storage: no
    fresh storage, and the result's tensor is the target. Views, slices, tied targets and mismatches take fresh
    storages and are copied as before; every value arrives."""
    ck = _state()
    ck["state_dict"]["tied_a"] = torch.randn(1000)
    ck["state_dict"]["tied_b"] = torch.randn(1000)
    save(ck, tmp_path / "i.ckpt")
    sd = ck["state_dict"]
    tied = torch.zeros(1000)
    into = {
        "state_dict": {
            "w": torch.zeros(300, 200),
            "big": torch.nn.Parameter(torch.zeros(1 << 19)),
            "h": torch.zeros(64, dtype=torch.bfloat16),
            "f8": torch.zeros(33, dtype=torch.float8_e4m3fn),
            "i": torch.zeros(7, dtype=torch.int64),  # another shape: a fresh storage (strict=False)
            "b": torch.zeros(10)[2:9],  # a slice of a larger storage: fresh, then copied in
            "tied_a": tied,
            "tied_b": tied.view(1000),  # tied_a's storage: read into once, the second record fresh
        },
        "t": torch.zeros(200, 300),  # w's storage holds w, row and t: fresh
    }
    ptrs = {k: v.data_ptr() for k, v in into["state_dict"].items()}
    sizes = _count_fresh_storages(monkeypatch)
    out = load(tmp_path / "i.ckpt", into=into, strict=False)

    straight = Counter(sd[k].numel() * sd[k].element_size() for k in ("big", "h", "f8", "tied_a"))
    assert Counter(sizes) == Counter(_record_sizes(tmp_path / "i.ckpt")) - straight
    for k in ("w", "big", "h", "f8", "b", "tied_a"):
        assert out["state_dict"][k] is into["state_dict"][k] and into["state_dict"][k].data_ptr() == ptrs[k], k
    for k in ("big", "h", "f8", "b"):
        assert torch.equal(into["state_dict"][k].detach(), sd[k]), k
    assert torch.equal(tied, sd["tied_b"])  # tied_b's record, copied in last (as when every record was fresh)
    assert torch.equal(out["state_dict"]["i"], sd["i"]) and out["state_dict"]["i"] is not into["state_dict"]["i"]
    assert torch.equal(out["t"], sd["w"].t()) and torch.equal(out["row"], sd["w"][3])
    assert out["epoch"] == 3 and out["nested"] == ck["nested"]


def _as_written_before_the_list(monkeypatch) -> None:
    """Files saved from here on carry no list of whole tensors in their integrity record, as before the writer
    wrote one: a load lists the tensors from ``data.pkl`` instead."""
    monkeypatch.setattr(torch_zip, "whole_tensors", lambda obj, storages: None)


@pytest.mark.parametrize("listed_by", ["file", "fast unpickler"])
def test_load_into_small_records_are_read_straight(tmp_path, monkeypatch, listed_by):
    """Records that average under ``_LARGE_AVERAGE_RECORD`` are read straight into their targets when the file
    lists its whole tensors, or, in a file written before it did, when the restricted fast unpickler lists them
    (cheap): no fresh storage at all."""
    from lightning_recover.checkpoint.file import single_file

    if listed_by != "file":
        _as_written_before_the_list(monkeypatch)
    ck = {f"t{i}": torch.randn(100) for i in range(20)}
    save(ck, tmp_path / "s.ckpt")
    assert (read_info(tmp_path / "s.ckpt").index.whole_tensors is None) == (listed_by != "file")
    sizes = _count_fresh_storages(monkeypatch, single_file._LARGE_AVERAGE_RECORD)
    into = {k: torch.zeros(100) for k in ck}
    out = load(tmp_path / "s.ckpt", into=into)
    assert sizes == []
    assert all(out[k] is into[k] and torch.equal(into[k], ck[k]) for k in ck)


@pytest.mark.parametrize("written", ["now", "before the list"])
def test_load_into_small_records_beside_a_custom_class(tmp_path, monkeypatch, written):
    """A pickle the restricted fast unpickler does not take (here a custom class): the file's list of whole tensors
    still reads the records straight into their targets. A file written before the list was: small records are not
    worth listing with torch's slower unpickler, so they are read into fresh storages and copied in."""
    from lightning_recover.checkpoint.file import single_file

    if written != "now":
        _as_written_before_the_list(monkeypatch)
    ck = {f"t{i}": torch.randn(100) for i in range(20)}
    save({**ck, "p": _Point(3)}, tmp_path / "s.ckpt")
    sizes = _count_fresh_storages(monkeypatch, single_file._LARGE_AVERAGE_RECORD)
    into = {k: torch.zeros(100) for k in ck}
    out = load(tmp_path / "s.ckpt", into=into, weights_only=False)
    assert sorted(sizes) == ([] if written == "now" else sorted(_record_sizes(tmp_path / "s.ckpt")))
    assert all(out[k] is into[k] and torch.equal(into[k], ck[k]) for k in ck)
    assert out["p"].x == 3


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda t: {"a": t, "b": t}, id="one tensor at two paths"),
        pytest.param(lambda t: {"x": (t,), "y": t}, id="its first path inside a tuple"),
    ],
)
def test_a_tensor_reachable_twice_is_read_into_its_first_path_target(tmp_path, layout):
    """The file lists a tensor by its first path; the same tensor at another path is not a disagreement with the
    pickle: its target there is filled by a copy, as every value arrives."""
    t = torch.randn(100)
    save(layout(t), tmp_path / "twice.ckpt")
    into = layout(torch.zeros(100))
    into = {k: (torch.zeros(100),) if isinstance(v, tuple) else torch.zeros(100) for k, v in into.items()}
    out = load(tmp_path / "twice.ckpt", into=into)
    for k, v in out.items():
        assert torch.equal(v[0] if isinstance(v, tuple) else v, t), k
    first = next(iter(into))
    assert (into[first][0] if isinstance(into[first], tuple) else into[first]).equal(t)


def test_a_list_of_whole_tensors_that_disagrees_with_the_pickle_is_named(tmp_path, monkeypatch):
    """A file whose integrity record lists a record as another path's whole tensor (its checksums all right: a
    writer's error, not the disk's) is refused once the pickle shows it, not loaded with a tensor's bytes in
    another's target."""
    real = torch_zip.whole_tensors

    def swapped(obj, storages):
        listed = real(obj, storages)
        a, b = sorted(listed)[:2]
        listed[a][0], listed[b][0] = listed[b][0], listed[a][0]
        return listed

    monkeypatch.setattr(torch_zip, "whole_tensors", swapped)
    ck = {"a": torch.randn(100), "b": torch.randn(100)}
    save(ck, tmp_path / "x.ckpt")
    with pytest.raises(CheckpointCorruptError, match="lists the storage of '(a|b)' as one whole tensor"):
        load(tmp_path / "x.ckpt", into={"a": torch.zeros(100), "b": torch.zeros(100)})
    assert all(torch.equal(load(tmp_path / "x.ckpt")[k], ck[k]) for k in ck)  # a load without targets is right


def test_load_into_a_damaged_record_still_raises(tmp_path, monkeypatch):
    """A record read straight into its target is checked like any other: the load raises and names the tensor
    (the target holds what was read, as documented for ``into=``)."""
    save(_state(), tmp_path / "d.ckpt")
    info = read_info(tmp_path / "d.ckpt")
    rec = info.index.records[next(t["record"] for t in info.tensors if t["name"] == "state_dict/big")]
    _rewrite(tmp_path / "d.ckpt", _flip(rec.data_offset + 1000))
    sizes = _count_fresh_storages(monkeypatch)
    target = torch.zeros(1 << 19)
    with pytest.raises(CheckpointCorruptError, match="state_dict/big"):
        load(tmp_path / "d.ckpt", into={"state_dict": {"big": target}})
    assert rec.nbytes not in sizes  # it was read into the target


def test_load_into_without_a_safe_listing_reads_fresh(tmp_path, monkeypatch):
    """In a file written before the list of whole tensors, when ``data.pkl`` needs the full unpickler (a custom
    class), its tensors cannot be listed safely ahead of the load: every record gets a fresh storage and is
    copied into its target afterwards."""
    _as_written_before_the_list(monkeypatch)
    w = torch.randn(64, 32)
    save({"p": _Point(3), "w": w}, tmp_path / "p.ckpt")
    sizes = _count_fresh_storages(monkeypatch)
    target = torch.zeros(64, 32)
    out = load(tmp_path / "p.ckpt", into={"w": target}, weights_only=False)
    assert out["w"] is target and torch.equal(target, w) and out["p"].x == 3
    assert sizes == [w.numel() * 4]


def test_format_1_is_neither_written_nor_read(tmp_path):
    """Format 1 is gone: asking for it, or loading one of its files, says so and how to convert."""
    ck = _state()
    with pytest.raises(ValueError, match="format=1 is no longer supported") as ei:
        save(ck, tmp_path / "v1.ckpt", format=1)
    assert "HINT: convert" in str(ei.value) and "lightning-recover convert" in str(ei.value)
    assert not (tmp_path / "v1.ckpt").exists()
    with pytest.raises(ValueError, match="format must be 2"):
        save(ck, tmp_path / "x.ckpt", format=3)
    from lightning_recover.bench.checkpoint import parse_methods

    with pytest.raises(SystemExit, match="uring-v1 is gone.*HINT"):  # the benchmark's format-1 method
        parse_methods("uring,uring-v1")
    old = tmp_path / "old.ckpt"  # a format-1 file starts with its header magic
    old.write_bytes(b"\x89LRCKPT\n" + bytes(8192))
    for read in (load, read_info):
        with pytest.raises(CheckpointCorruptError, match="format-1 checkpoint, which this version no longer reads"):
            read(old)


def test_mixed_dtype_views_refused_like_torch_save(tmp_path):
    base = torch.zeros(8)
    with pytest.raises(RuntimeError, match="different types"):
        save({"a": base, "b": base.view(torch.int32)}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def test_header_struct_sizes():
    """The ZIP structures are the sizes the format requires (guards a struct format typo)."""
    assert (torch_zip._LOCAL.size, torch_zip._CENTRAL.size, torch_zip._EOCD.size) == (30, 46, 22)
    assert (torch_zip._EOCD64.size, torch_zip._LOCATOR.size) == (56, 20)
    assert struct.calcsize("<IIII") == 16


@pytest.mark.slow  # Trainer fits
def test_lightning_reads_our_checkpoints_without_the_plugin(tmp_path):
    """The most common Lightning flows on a file the plugin wrote: load_from_checkpoint, resume with stock IO."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_recover.lightning.checkpoint_io import UringCheckpointIO

    class WithHparams(BoringModel):
        def __init__(self, lr: float = 0.1, name: str = "x") -> None:
            super().__init__()
            self.save_hyperparameters()  # Lightning stores them as a plain dict: weights_only loads them

    kw = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    model = WithHparams(lr=0.5, name="run")
    trainer = Trainer(max_steps=3, default_root_dir=tmp_path, plugins=[UringCheckpointIO()], **kw)
    trainer.fit(model)
    path = tmp_path / "ours.ckpt"
    trainer.save_checkpoint(path)
    restored = WithHparams.load_from_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(restored.parameters(), model.parameters()))
    assert restored.hparams.lr == 0.5 and restored.hparams.name == "run"
    assert torch.load(path, weights_only=True)["global_step"] == 3
    stock = Trainer(max_steps=5, default_root_dir=tmp_path, **kw)  # Lightning's own TorchCheckpointIO
    stock.fit(WithHparams(), ckpt_path=path)
    assert stock.global_step == 5
    stock.save_checkpoint(tmp_path / "stock.ckpt")
    back = Trainer(max_steps=6, default_root_dir=tmp_path, plugins=[UringCheckpointIO()], **kw)
    back.fit(BoringModel(), ckpt_path=tmp_path / "stock.ckpt")  # and ours resumes from a stock file
    assert back.global_step == 6
