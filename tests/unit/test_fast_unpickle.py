"""The restricted fast path of ``weights_only`` loads: the same result as ``torch.load``, and nothing more allowed."""

from __future__ import annotations

import argparse
import collections
import copyreg
import datetime
import pathlib
import pickle

import pytest
import torch

from lightning_recover.checkpoint import UnsafeCheckpointError, load, read_info, save
from lightning_recover.checkpoint.file import fast_unpickle
from lightning_recover.checkpoint.file.torch_zip import _extra_safe_globals

pytestmark = pytest.mark.timeout(120)


def _state() -> dict:
    base = torch.arange(24.0)
    return {
        "state_dict": collections.OrderedDict(
            w=base, view=base[2:14].view(3, 4), strided=base[::3], t=base.view(4, 6).t(), a=torch.ones(3)
        ),
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, dtype=torch.bfloat16)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "amsgrad": False}],
            }
        ],
        "set": {1, 2},
        "bytes": b"xy\x00",
        "complex": 1 + 2j,
        "bytearray": bytearray(b"q"),
        "param": torch.nn.Parameter(torch.ones(2)),
        "size": torch.Size([2, 3]),
        "dtypes": [torch.int8, torch.float16],
        "ints": torch.tensor([1, -2], dtype=torch.int8),
        "bool": torch.tensor([True, False]),
        "leaf": torch.ones(2, requires_grad=True),
        "empty": torch.empty(0, 5),
        "hparams": argparse.Namespace(lr=1e-3),
        "date": datetime.date(2026, 12, 2),
        "path": pathlib.PurePosixPath("/data"),
        "none": None,
    }


def _assert_same(x, y, where="") -> None:
    assert type(x) is type(y), (where, type(x), type(y))
    if isinstance(x, torch.Tensor):
        assert (x.dtype, x.shape, x.stride(), x.storage_offset(), x.requires_grad) == (
            y.dtype,
            y.shape,
            y.stride(),
            y.storage_offset(),
            y.requires_grad,
        ), where
        assert torch.equal(x, y), where
    elif isinstance(x, dict):
        assert list(x) == list(y), where
        for k in x:
            _assert_same(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same(u, v, f"{where}.{i}")
    else:
        assert x == y, (where, x, y)


def _records(path) -> tuple[bytes, dict]:
    """``data.pkl`` and every storage of a saved file, as the loader hands them over."""
    info = read_info(path)
    raw = path.read_bytes()
    out = {}
    for name, rec in info.index.records.items():
        out[name.split("/", 1)[1] if name.startswith("archive/") else name] = raw[
            rec.data_offset : rec.data_offset + rec.nbytes
        ]
    storages = {
        n: torch.frombuffer(bytearray(b), dtype=torch.uint8).untyped_storage() if b else torch.UntypedStorage(0)
        for n, b in out.items()
        if n.startswith("data/")
    }
    return out["data.pkl"], storages


def test_fast_path_rebuilds_what_torch_load_does(tmp_path):
    path = tmp_path / "s.ckpt"
    save(_state(), path)
    data, storages = _records(path)
    with torch.serialization.safe_globals(_extra_safe_globals()):
        fast = fast_unpickle.unpickle_fast(data, lambda name, nbytes: storages[name])  # the fast path, no fallback
        reference = torch.load(path, weights_only=True)
    _assert_same(fast, reference)
    sd = fast["state_dict"]
    assert sd["view"].untyped_storage().data_ptr() == sd["w"].untyped_storage().data_ptr()  # views share, as there
    _assert_same(load(path), reference)


def test_anything_beyond_the_fast_globals_goes_to_torch(tmp_path):
    # a global torch allows only when asked (add_safe_globals): not taken by the fast path, loaded by torch's
    path = tmp_path / "c.ckpt"
    save({"counter": collections.Counter(a=2), "w": torch.ones(3)}, path)
    data, storages = _records(path)
    with pytest.raises(fast_unpickle.NotFast, match="Counter"):
        fast_unpickle.unpickle_fast(data, lambda name, nbytes: storages[name])
    assert load(path)["counter"] == collections.Counter(a=2)


class _Planted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("protocol", [2, 4])
def test_payloads_never_run(tmp_path, protocol):
    marker = tmp_path / "pwned"
    payloads = [
        pickle.dumps(_Planted(str(marker)), protocol=protocol),  # GLOBAL / STACK_GLOBAL + REDUCE
        b"(S'" + str(marker).encode() + b"'\nS'w'\nio\nopen\n.",  # INST: a class looked up by name, then called
        b"\x80\x02cbuiltins\neval\nX\x03\x00\x00\x001+1\x85R.",  # eval through a global
    ]
    for data in payloads:
        with pytest.raises(fast_unpickle.NotFast):
            fast_unpickle.unpickle_fast(data, lambda name, nbytes: None)
    assert not marker.exists()
    # a whole file with the payload: the fast path hands over, torch's loader refuses, nothing ran
    path = tmp_path / "p.ckpt"
    save({"w": torch.ones(3), "evil": _Planted(str(marker))}, path)
    with pytest.raises(UnsafeCheckpointError):
        load(path)
    assert not marker.exists()


def test_extension_codes_only_through_find_class(tmp_path):
    marker = tmp_path / "pwned"
    code = 0x7FF0
    copyreg.add_extension("io", "open", code)
    try:
        payload = b"\x80\x02\x83\xf0\x7fX" + len(str(marker)).to_bytes(4, "little") + str(marker).encode()
        payload += b"X\x01\x00\x00\x00w\x86R."  # EXT2 (io.open), path, "w", TUPLE2, REDUCE
        with pytest.raises(fast_unpickle.NotFast, match="io.open"):
            fast_unpickle.unpickle_fast(payload, lambda name, nbytes: None)
        # and a registered extension (possibly cached by another unpickler) keeps loads off the fast path
        assert not fast_unpickle.fast_path_usable(None, _NoRecords())
    finally:
        copyreg.remove_extension("io", "open", code)
    assert fast_unpickle.fast_path_usable(None, _NoRecords())
    assert not marker.exists()


class _NoRecords:
    def has_record(self, name: str) -> bool:
        return False


def test_only_cpu_loads_outside_fake_mode_take_the_fast_path():
    assert fast_unpickle.fast_path_usable("cpu", _NoRecords())
    assert fast_unpickle.fast_path_usable(torch.device("cpu"), _NoRecords())
    assert not fast_unpickle.fast_path_usable("meta", _NoRecords())
    assert not fast_unpickle.fast_path_usable({"cuda:0": "cpu"}, _NoRecords())
    assert not fast_unpickle.fast_path_usable(lambda s, loc: s, _NoRecords())


def test_a_damaged_storage_is_reported_not_retried(tmp_path):
    from lightning_recover.checkpoint import CheckpointCorruptError

    path = tmp_path / "d.ckpt"
    save({"w": torch.arange(1000.0), "b": torch.ones(3)}, path)
    rec = read_info(path).index.records["data/0"]
    raw = bytearray(path.read_bytes())
    raw[rec.data_offset + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        load(path)


def test_the_listing_on_meta_storages_matches_torchs_and_takes_the_fast_path(tmp_path, monkeypatch):
    """What a load into existing tensors lists before its reads start (``torch_zip.unpickle_on_meta``): every
    tensor's path, dtype, shape, stride, offset and file offset as torch's own meta load gives them."""
    from lightning_recover.checkpoint.file import torch_zip
    from lightning_recover.checkpoint.file.state_tensors import tensor_paths

    path = tmp_path / "m.ckpt"
    save(_state(), path)
    index = read_info(path).index
    raw = path.read_bytes()
    small = {
        n: raw[r.data_offset : r.data_offset + r.nbytes] for n, r in index.records.items() if not n.startswith("data/")
    }
    archive = torch_zip.VerifiedArchive(index, small, {})
    by_torch = torch_zip.unpickle(archive, str(path), "meta", True)

    def no_slow_path(*args, **kwargs):
        raise AssertionError("torch's loader was used")

    monkeypatch.setattr(torch_zip, "unpickle", no_slow_path)
    fast = torch_zip.unpickle_on_meta(archive, str(path))

    def rows(obj):
        return sorted(
            (
                name,
                t.dtype,
                tuple(t.shape),
                t.stride(),
                t.storage_offset(),
                t.device.type,
                t.untyped_storage()._checkpoint_offset,
            )
            for name, t in tensor_paths(obj).values()
        )

    def skeleton(obj):  # the rest of the checkpoint, tensors left out (meta tensors cannot be compared)
        if isinstance(obj, torch.Tensor):
            return type(obj)
        if isinstance(obj, dict):
            return type(obj), [(k, skeleton(v)) for k, v in obj.items()]
        if isinstance(obj, (list, tuple)):
            return type(obj), [skeleton(v) for v in obj]
        return obj

    assert rows(fast) == rows(by_torch) and len(rows(fast)) == 12
    assert skeleton(fast) == skeleton(by_torch)
