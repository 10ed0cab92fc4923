"""Format 2's fast pickler (issue 16): the same data.pkl bytes as torch.save, torch's pickler for the rest."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_recover.bench.gpt_state import build_small_tensors_checkpoint, build_state
from lightning_recover.checkpoint import CheckpointCorruptError, load, save
from lightning_recover.checkpoint.file import torch_zip


def _torch_records(obj) -> torch_zip._Collector:
    out = torch_zip._Collector()
    torch.serialization._save(obj, out, pickle, 2, False)
    return out


def _same_records(a: torch_zip._Collector, b: torch_zip._Collector) -> None:
    assert [(r.name, r.nbytes, r.payload) for r in a.records] == [(r.name, r.nbytes, r.payload) for r in b.records]
    assert [s._cdata for s in a.storages] == [s._cdata for s in b.storages]


def _mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g)
    shared = torch.randn(100, generator=g)
    return {
        "state_dict": {
            "w": w,
            "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
            "f8": torch.randn(17, generator=g).to(torch.float8_e4m3fn),  # a v3 dtype: _rebuild_tensor_v3
            "f8b": torch.randn(5, generator=g).to(torch.float8_e5m2),
            "u16": torch.arange(9).to(torch.uint16),
            "i": torch.arange(11),
            "mask": torch.rand(9, generator=g) > 0.5,
            "c": torch.randn(5, dtype=torch.complex64, generator=g),
            "conj": torch.randn(4, dtype=torch.complex64, generator=g).conj(),  # metadata: conj bit
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(3.5),
            "grad": torch.randn(3, generator=g).requires_grad_(),
        },
        "row": w[3],
        "t": w.t(),
        "strided": w[::2, 1::3],
        "again": w,  # the same tensor object twice: memo
        "halves": (shared[:50], shared[50:]),
        "opt": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(3)}},
        "epoch": 3,
        "nested": [{"lr": 0.1, "betas": (0.9, 0.99)}, None, "name", b"raw", {1, 2}],
    }


@pytest.mark.parametrize("kind", ["mixed", "gpt", "llama", "small10k"])
def test_fast_pickler_writes_torchs_bytes(kind):
    obj = _mixed_state() if kind == "mixed" else build_state(kind, 0.005)[0]
    _same_records(torch_zip._fast_save_records(obj), _torch_records(obj))


def _two_dtypes() -> dict:
    a = torch.arange(4, dtype=torch.int32)
    return {"a": a, "b": a.view(torch.float32)}


@pytest.mark.parametrize(
    "odd",
    [
        lambda: {"p": torch.nn.Parameter(torch.randn(3))},
        lambda: {"s": torch.randn(4).untyped_storage()},
        lambda: {"nt": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])},
        lambda: {"sp": torch.randn(3, 3).to_sparse()},
        _two_dtypes,
        lambda: {"meta": torch.empty(3, device="meta")},
    ],
)
def test_anything_else_falls_back_to_torchs_pickler(odd):
    obj = odd()
    with pytest.raises(torch_zip._Fallback):
        torch_zip._fast_save_records(obj)
    try:
        want = _torch_records(obj)
    except RuntimeError:  # e.g. one storage as two dtypes: torch refuses, and so do we
        with pytest.raises(RuntimeError):
            torch_zip._torch_save_records(obj)
        return
    _same_records(torch_zip._torch_save_records(obj), want)


def test_tensor_with_python_state_falls_back():
    t = torch.randn(3)
    t.note = "x"
    with pytest.raises(torch_zip._Fallback):
        torch_zip._fast_save_records({"t": t})
    _same_records(torch_zip._torch_save_records({"t": t}), _torch_records({"t": t}))


def _assert_equal(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        if a.numel():
            x, y = a.detach().resolve_conj().reshape(-1), b.detach().resolve_conj().reshape(-1)
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        assert a.is_conj() == b.is_conj() and a.requires_grad == b.requires_grad
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b


def test_round_trip_and_corruption_detection_through_the_fast_path(tmp_path, monkeypatch):
    calls = []
    real = torch_zip._fast_save_records
    monkeypatch.setattr(torch_zip, "_fast_save_records", lambda obj, *a: calls.append(1) or real(obj, *a))
    obj = _mixed_state()
    # 2,000 small tensors over 64 layers (test_fast_pickler_writes_torchs_bytes[small10k] pickles 10,000: the
    # round trip, the listing and the damage report of this many already take ~1 s)
    obj["small"] = build_small_tensors_checkpoint(0.002, n_tensors=2000)[0]["state_dict"]
    path = tmp_path / "a.ckpt"
    save(obj, path)
    assert calls == [1]
    got = load(path, weights_only=False)
    _assert_equal(obj, got)
    assert got["row"].untyped_storage().data_ptr() == got["state_dict"]["w"].untyped_storage().data_ptr()
    assert got["halves"][0].untyped_storage().data_ptr() == got["halves"][1].untyped_storage().data_ptr()
    _assert_equal(obj, torch.load(path, weights_only=False))
    # flip one byte in the data of one storage: the loader names the damaged record and tensor
    name = "layers.17.ln_1.weight"
    from lightning_recover.checkpoint import read_info

    rows = [t for t in read_info(path).tensors if t["name"].endswith(name)]
    assert len(rows) == 1
    raw = bytearray(path.read_bytes())
    raw[rows[0]["offset"] + 5] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as ei:
        load(path)
    assert rows[0]["record"] in str(ei.value) and name in str(ei.value)


def test_switch_off_gives_the_same_data_pkl(monkeypatch):
    obj = _mixed_state()
    fast = torch_zip._torch_save_records(obj)
    monkeypatch.setattr(torch_zip, "FAST_PICKLER", False)
    _same_records(torch_zip._torch_save_records(obj), fast)
