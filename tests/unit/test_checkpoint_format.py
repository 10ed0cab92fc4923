"""Save/load round trips of the checkpoint format (format 2, the torch.save archive): every dtype, sizes around
the layout's boundaries, shared storages and views, parameters, a Lightning-like state, ``into=``, ``map_location``
and the weights_only allowlist. The archive's own layout and records: test_torch_zip.py."""

from __future__ import annotations

import argparse
import collections
import pathlib
import pickle
import warnings

import pytest
import torch

from lightning_recover.checkpoint import load, read_info, save, verify_file
from lightning_recover.checkpoint.file.state_tensors import storage_as_bytes, tensor_paths, whole_tensors
from lightning_recover.checkpoint.integrity import UnsafeCheckpointError


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _byte_dtypes() -> list:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(dir(torch)):
            d = getattr(torch, name, None)
            if not isinstance(d, torch.dtype) or d in out:
                continue
            try:
                x = torch.empty(4, dtype=d)
                x.view(torch.uint8)
                x.clone()
                if x.is_quantized:
                    continue
            except Exception:
                continue
            out.append(d)
    return out


DTYPES = _byte_dtypes()


def _random_tensor(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# ------------------------------------------------------------------------------- the shared helpers


def test_tensor_paths_name_each_tensor_once():
    w = torch.randn(3, 3)
    ck = {
        "state_dict": collections.OrderedDict([("l.weight", w), ("l.bias", torch.zeros(3))]),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}}],
        "again": w,
        "epoch": 3,
    }
    named = {p: t for p, t in tensor_paths(ck).values()}
    assert set(named) == {"state_dict/l.weight", "state_dict/l.bias", "optimizer_states/0/state/0/exp_avg"}
    assert named["state_dict/l.weight"] is w  # the second reference to w is the same tensor, named once
    u8 = storage_as_bytes(w.untyped_storage())
    assert u8.dtype == torch.uint8 and u8.numel() == 36 and u8.data_ptr() == w.data_ptr()


# ------------------------------------------------------------------------------- the allowlist


class _Planted:
    """Unpickling this creates a file: the kind of payload a weights_only load must refuse."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_weights_only_refuses_a_payload(tmp_path):
    marker = tmp_path / "pwned"
    ck = {"x": torch.ones(2), "evil": _Planted(str(marker))}
    save(ck, tmp_path / "e.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="io.open") as ei:
        load(tmp_path / "e.ckpt")
    assert str(tmp_path / "e.ckpt") in str(ei.value)
    assert not marker.exists()
    assert isinstance(ei.value, pickle.UnpicklingError)
    # the explicit opt-out runs the pickle (trusted file)
    out = load(tmp_path / "e.ckpt", weights_only=False)
    assert marker.exists()
    out["evil"].close()


def test_weights_only_allowlist(tmp_path):
    # torch's weights_only unpickler admits these; it cannot fill a dict subclass (Lightning's AttributeDict,
    # which test_lightning_like_checkpoint_roundtrip loads with weights_only=False), take ``list`` as a
    # defaultdict's factory or build a frozenset
    ck = {
        "ns": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "od": collections.OrderedDict(a=1),
        "p": pathlib.Path("/a/b"),
        "pp": pathlib.PurePosixPath("x"),
        "dt": torch.bfloat16,
        "dev": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "c": 1 + 2j,
        "s": {1, 2},
        "b": b"\x00",
        "n": None,
        "t": (1, "a", 2.5, True),
        "big": 2**80,
        "inf": float("inf"),
    }
    out = load((save(ck, tmp_path / "a.ckpt"), tmp_path / "a.ckpt")[1])
    for k, v in ck.items():
        assert out[k] == v and type(out[k]) is type(v), k


def test_torch_safe_globals_are_honoured(tmp_path):
    ck = {"e": _Color(3)}
    save(ck, tmp_path / "c.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="_Color"):
        load(tmp_path / "c.ckpt")
    with torch.serialization.safe_globals([_Color]):
        assert load(tmp_path / "c.ckpt")["e"].v == 3


class _Color:
    def __init__(self, v: int) -> None:
        self.v = v


# ------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=[_dtype_name(d) for d in DTYPES])
def test_roundtrip_every_dtype(tmp_path, dtype):
    ck = {
        "t": _random_tensor([5, 3], dtype),
        "s": _random_tensor([], dtype, 1),
        "e": torch.empty(0, 4, dtype=dtype),
        "nc": _random_tensor([4, 6], dtype, 2)[:, ::2],
    }
    save(ck, tmp_path / "d.ckpt")
    out = load(tmp_path / "d.ckpt")
    for k in ck:
        _same_bits(out[k], ck[k])
    assert out["nc"].storage_offset() == ck["nc"].storage_offset()


@pytest.mark.parametrize(
    "nbytes", [1, 63, 64, 65, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (1 << 20) + 4096 + 3]
)
def test_roundtrip_sizes_around_boundaries(tmp_path, nbytes):
    ck = {
        "a": _random_tensor([nbytes], torch.uint8, nbytes),
        "b": _random_tensor([3], torch.uint8, 1),
        "c": _random_tensor([nbytes], torch.uint8, nbytes + 1),
    }
    save(ck, tmp_path / "s.ckpt")
    info, damaged = verify_file(tmp_path / "s.ckpt")
    assert damaged == [] and len(info.index.storage_records()) == 3
    out = load(tmp_path / "s.ckpt")
    for k in ck:
        _same_bits(out[k], ck[k])


def test_shared_storage_and_views(tmp_path):
    base = torch.randn(8, 8)
    ck = {
        "base": base,
        "row": base[2],
        "col": base[:, 3],
        "t": base.t(),
        "strided": base[::2, 1::3],
        "flat": base.view(-1)[5:20],
        "same": base,
        "other": torch.randn(4),
        "expanded": torch.randn(3, 1).expand(3, 5),
    }
    save(ck, tmp_path / "v.ckpt")
    out = load(tmp_path / "v.ckpt")
    for k, v in ck.items():
        _same_bits(out[k], v)
        assert out[k].storage_offset() == v.storage_offset()
    ptr = out["base"].untyped_storage().data_ptr()
    for k in ("row", "col", "t", "strided", "flat"):
        assert out[k].untyped_storage().data_ptr() == ptr, k
    assert out["same"] is out["base"]
    out["base"][2, 3] = 123.0
    assert out["row"][3] == 123.0 and out["col"][2] == 123.0 and out["t"][3, 2] == 123.0
    assert out["other"].untyped_storage().data_ptr() != ptr
    # a single storage for the 8x8 base and all views
    info = read_info(tmp_path / "v.ckpt")
    assert len(info.index.storage_records()) == 3


def test_conj_and_neg_views_are_materialised(tmp_path):
    z = torch.randn(4, dtype=torch.complex64)
    ck = {"conj": z.conj(), "neg": torch._neg_view(torch.randn(3))}
    save(ck, tmp_path / "c.ckpt")
    out = load(tmp_path / "c.ckpt")
    torch.testing.assert_close(out["conj"], ck["conj"].resolve_conj())
    torch.testing.assert_close(out["neg"], ck["neg"].resolve_neg())


def test_parameters_and_requires_grad(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    ck = {"p": p, "frozen": frozen, "leaf": torch.randn(2).requires_grad_(), "plain": torch.randn(2)}
    save(ck, tmp_path / "p.ckpt")
    out = load(tmp_path / "p.ckpt")
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["leaf"]) is torch.Tensor and out["leaf"].requires_grad
    assert not out["plain"].requires_grad
    for k in ck:
        torch.testing.assert_close(out[k].detach(), ck[k].detach())


def _lightning_like_checkpoint() -> dict:
    from lightning.fabric.utilities.data import AttributeDict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    return {
        "epoch": 2,
        "global_step": 30,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val', 'mode': 'min'}": {
                "best_model_score": torch.tensor(0.25),
                "best_model_path": "/x/epoch=1.ckpt",
                "best_k_models": {"/x/epoch=1.ckpt": torch.tensor(0.25)},
                "dirpath": "/x",
            }
        },
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_progress": {"total": {"ready": 3, "completed": 2}},
                "epoch_loop.state_dict": {"_batches_that_stepped": 30},
            }
        },
        "hparams_name": "kwargs",
        "hyper_parameters": AttributeDict(
            lr=1e-3, hidden=8, args=argparse.Namespace(seed=1), out_dir=pathlib.Path("/tmp/out"), betas=(0.9, 0.999)
        ),
    }


def test_lightning_like_checkpoint_roundtrip(tmp_path):
    ck = _lightning_like_checkpoint()
    save(ck, tmp_path / "l.ckpt")
    out = load(tmp_path / "l.ckpt", weights_only=False)  # the AttributeDict: see test_weights_only_allowlist
    assert out.keys() == ck.keys()
    torch.testing.assert_close(out["state_dict"], ck["state_dict"])
    torch.testing.assert_close(out["optimizer_states"][0]["state"], ck["optimizer_states"][0]["state"])
    assert out["optimizer_states"][0]["param_groups"] == ck["optimizer_states"][0]["param_groups"]
    assert out["lr_schedulers"] == ck["lr_schedulers"]
    assert out["hyper_parameters"] == ck["hyper_parameters"]
    assert type(out["hyper_parameters"]) is type(ck["hyper_parameters"])
    assert out["loops"] == ck["loops"] and out["epoch"] == 2
    cb = next(iter(out["callbacks"].values()))
    torch.testing.assert_close(cb["best_model_score"], torch.tensor(0.25))
    # the loaded optimizer state restores into a fresh optimizer
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.load_state_dict(out["state_dict"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(out["optimizer_states"][0])


def test_load_into_existing_tensors(tmp_path):
    src = {"state_dict": {"w": torch.randn(4, 5), "b": torch.randn(5), "shared": torch.randn(6)}, "step": 7}
    src["state_dict"]["view"] = src["state_dict"]["shared"][1:4]
    save(src, tmp_path / "i.ckpt")
    dest = {"state_dict": {"w": torch.zeros(4, 5), "b": torch.nn.Parameter(torch.zeros(5)), "view": torch.zeros(3)}}
    ptrs = {k: v.data_ptr() for k, v in dest["state_dict"].items()}
    out = load(tmp_path / "i.ckpt", into=dest)
    for k in ("w", "b", "view"):
        assert out["state_dict"][k] is dest["state_dict"][k]
        assert dest["state_dict"][k].data_ptr() == ptrs[k]
        torch.testing.assert_close(dest["state_dict"][k].detach(), src["state_dict"][k])
    torch.testing.assert_close(out["state_dict"]["shared"], src["state_dict"]["shared"])
    assert out["step"] == 7
    with pytest.raises(ValueError, match="state_dict/w"):
        load(tmp_path / "i.ckpt", into={"state_dict": {"w": torch.zeros(5, 4)}})
    out = load(tmp_path / "i.ckpt", into={"state_dict": {"w": torch.zeros(5, 4)}}, strict=False)
    torch.testing.assert_close(out["state_dict"]["w"], src["state_dict"]["w"])


def test_map_location(tmp_path):
    ck = {"a": torch.randn(3), "b": torch.arange(4)}
    save(ck, tmp_path / "m.ckpt")
    out = load(tmp_path / "m.ckpt", map_location="meta")
    assert out["a"].device.type == "meta" and out["b"].shape == (4,)
    out = load(tmp_path / "m.ckpt", map_location={"cpu": "meta"})
    assert out["a"].is_meta
    seen = []
    out = load(tmp_path / "m.ckpt", map_location=lambda storage, loc: seen.append(loc) or storage)
    assert seen == ["cpu", "cpu"] and out["a"].device.type == "cpu"
    torch.testing.assert_close(out["a"], ck["a"])


def test_whole_tensors_lists_the_records_a_load_may_read_straight_into_a_target():
    """One plain, contiguous tensor that is its storage's whole content: listed with its path, dtype and shape.
    A storage two tensors share (tied, or a view beside its base), a slice, a transposed tensor, an empty one and
    a storage no reachable tensor holds are not."""
    w, tied, part = torch.randn(6, 4), torch.randn(5), torch.randn(10)
    state = {
        "sd": {"w": w, "p": torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), "e": torch.empty(0)},
        "tied": [tied, tied.view(5)],
        "slice": part[2:7],
        "t": torch.randn(3, 2).t(),
        "row": w[1],
    }
    storages = [(f"data/{i}", t.untyped_storage()) for i, t in enumerate([w, state["sd"]["p"], state["sd"]["e"]])]
    storages += [("data/3", tied.untyped_storage()), ("data/4", part.untyped_storage())]
    storages += [("data/5", state["t"].untyped_storage()), ("data/6", torch.randn(2).untyped_storage())]
    assert whole_tensors(state, storages) == {"data/1": ["sd/p", "bfloat16", [3]]}
    del state["row"]  # w alone on its storage now
    assert whole_tensors(state, storages)["data/0"] == ["sd/w", "float32", [6, 4]]
