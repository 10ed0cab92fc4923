"""The lightning-recover checkpoint format: layout, header/footer/index encoding, skeleton, round trips."""

from __future__ import annotations

import argparse
import collections
import io
import os
import pathlib
import pickle
import struct
import warnings

import pytest
import torch

from lightning_recover.checkpoint import format as fmt
from lightning_recover.checkpoint import load
from lightning_recover.checkpoint import save as _save
from lightning_recover.checkpoint.integrity import CheckpointCorruptError, UnsafeCheckpointError


def save(checkpoint, path, **kw):
    """These tests pin format 1 (its index, skeleton and allowlist unpickler); format 2: test_torch_zip.py."""
    return _save(checkpoint, path, format=1, **kw)


def _byte_dtypes() -> list:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(fmt._DTYPES):
            d = fmt._DTYPES[name]
            if d in out:
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


# ------------------------------------------------------------------------------------- pure parts


def test_plan_layout_alignment_and_order():
    mib = 1 << 20
    sizes = [1, 63, 64, 65, 0, 4095, 4096, 4097, mib - 1, mib, mib + 1, 0, 7]
    offsets, end = fmt.plan_layout(sizes)
    cursor = fmt.HEADER_SIZE
    for n, off in zip(sizes, offsets):
        assert off >= cursor
        if n:
            assert off % (4096 if n >= mib else 64) == 0
            assert off - cursor < (4096 if n >= mib else 64)
            cursor = off + n
    assert end == cursor
    assert offsets[0] == fmt.HEADER_SIZE
    assert fmt.plan_layout([]) == ([], fmt.HEADER_SIZE)
    with pytest.raises(ValueError):
        fmt.plan_layout([-1])


def test_header_roundtrip_and_rejections():
    fid = os.urandom(16)
    h = fmt.encode_header(fid)
    assert len(h) == fmt.HEADER_SIZE
    dec = fmt.decode_header(h, "f")
    assert (dec.version, dec.file_id, dec.data_start) == (fmt.FORMAT_VERSION, fid, fmt.HEADER_SIZE)
    with pytest.raises(CheckpointCorruptError, match="zip archive"):
        fmt.decode_header(b"PK\x03\x04" + bytes(4092), "f.pt")
    with pytest.raises(CheckpointCorruptError, match="zero-filled"):
        fmt.decode_header(bytes(4096), "f")
    flipped = bytearray(h)
    flipped[20] ^= 1
    with pytest.raises(CheckpointCorruptError, match="header checksum"):
        fmt.decode_header(bytes(flipped), "f")
    # a newer version is refused with a clear message (re-crc'ed so only the version differs)
    newer = bytearray(h)
    newer[8:12] = (fmt.FORMAT_VERSION + 1).to_bytes(4, "little")
    newer[fmt._HEADER.size : fmt._HEADER.size + 4] = fmt.crc32c(bytes(newer[: fmt._HEADER.size])).to_bytes(4, "little")
    with pytest.raises(CheckpointCorruptError, match="unsupported checkpoint format version"):
        fmt.decode_header(bytes(newer), "f")


def test_footer_roundtrip_and_consistency():
    fid = os.urandom(16)
    header = fmt.decode_header(fmt.encode_header(fid))
    f = fmt.Footer(1, 0, 8192, 100, 8292, 50, 8000, 1234, fid)
    size = 8292 + 50 + fmt.FOOTER_SIZE
    buf = fmt.encode_footer(f)
    assert len(buf) == fmt.FOOTER_SIZE
    assert fmt.decode_footer(buf, size, header) == f
    with pytest.raises(CheckpointCorruptError, match="inconsistent"):
        fmt.decode_footer(buf, size + 1, header)
    other = fmt.decode_header(fmt.encode_header(os.urandom(16)))
    with pytest.raises(CheckpointCorruptError, match="same file"):
        fmt.decode_footer(buf, size, other)
    bad = bytearray(buf)
    bad[30] ^= 0x10
    with pytest.raises(CheckpointCorruptError, match="footer checksum"):
        fmt.decode_footer(bytes(bad), size, header)


def test_index_roundtrip_and_validation():
    idx = fmt.Index(
        [fmt.StorageEntry(4096, 400, 7, "cpu"), fmt.StorageEntry(4544, 0, 0, "cuda:0")],
        [
            fmt.TensorEntry("a/b", 0, "float32", [10, 10], [10, 1], 0, True, True),
            fmt.TensorEntry("c", 0, "bfloat16", [3], [2], 4, False, False),
        ],
        {"k": "v"},
    )
    dec = fmt.decode_index(fmt.encode_index(idx), 4096, 4600)
    assert dec == idx
    bad = fmt.Index([fmt.StorageEntry(4096, 400, 7)], [fmt.TensorEntry("x", 0, "float32", [11, 10], [10, 1], 0)])
    with pytest.raises(CheckpointCorruptError, match="exceeds its storage"):
        fmt.decode_index(fmt.encode_index(bad), 4096, 4496)
    with pytest.raises(CheckpointCorruptError, match="outside the data area"):
        fmt.decode_index(fmt.encode_index(idx), 4096, 4100)
    with pytest.raises(CheckpointCorruptError, match="invalid index"):
        fmt.decode_index(b"{not json", 4096, 5000)


def test_tensor_paths_and_skeleton_roundtrip():
    w = torch.randn(3, 3)
    ck = {
        "state_dict": collections.OrderedDict([("l.weight", w), ("l.bias", torch.zeros(3))]),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}}],
        "again": w,
        "epoch": 3,
    }
    paths = {p for p, _ in fmt.tensor_paths(ck).values()}
    assert paths == {"state_dict/l.weight", "state_dict/l.bias", "optimizer_states/0/state/0/exp_avg"}
    enc = fmt.encode_checkpoint(ck)
    assert [t.name for t in enc.index.tensors][0] == "state_dict/l.weight"
    assert len(enc.index.tensors) == 3  # the second reference to w is the same tensor
    tensors = [object() for _ in enc.index.tensors]
    out = fmt.decode_skeleton(enc.skeleton, tensors)
    assert out["again"] is out["state_dict"]["l.weight"] is tensors[0]
    assert type(out["state_dict"]) is collections.OrderedDict and out["epoch"] == 3


class _Planted:
    """Unpickling this creates a file: the kind of payload the restricted unpickler must refuse."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_restricted_unpickler_refuses_payload(tmp_path):
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


def test_restricted_unpickler_allowlist(tmp_path):
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.utilities.parsing import AttributeDict as PLAttributeDict

    ck = {
        "ns": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "ad": AttributeDict(a=1),
        "pad": PLAttributeDict(b=2),
        "od": collections.OrderedDict(a=1),
        "dd": collections.defaultdict(list, {"k": [1]}),
        "p": pathlib.Path("/a/b"),
        "pp": pathlib.PurePosixPath("x"),
        "dt": torch.bfloat16,
        "dev": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "c": 1 + 2j,
        "s": {1, 2},
        "fs": frozenset([3]),
        "b": b"\x00",
        "n": None,
        "t": (1, "a", 2.5, True),
        "big": 2**80,
        "inf": float("inf"),
    }
    out = load((save(ck, tmp_path / "a.ckpt"), tmp_path / "a.ckpt")[1])
    for k, v in ck.items():
        assert out[k] == v and type(out[k]) is type(v), k
    assert out["dd"]["new"] == []


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


@pytest.mark.parametrize("dtype", DTYPES, ids=[fmt.dtype_name(d) for d in DTYPES])
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
    info = __import__("lightning_recover.checkpoint", fromlist=["read_info"]).read_info(tmp_path / "s.ckpt")
    for s in info.index.storages:
        assert s.offset % fmt.extent_alignment(s.nbytes) == 0
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
        "int_view": base.view(torch.int32),
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
    for k in ("row", "col", "t", "strided", "int_view", "flat"):
        assert out[k].untyped_storage().data_ptr() == ptr, k
    assert out["same"] is out["base"]
    out["base"][2, 3] = 123.0
    assert out["row"][3] == 123.0 and out["col"][2] == 123.0 and out["t"][3, 2] == 123.0
    assert out["other"].untyped_storage().data_ptr() != ptr
    # a single storage for the 8x8 base and all views
    info = __import__("lightning_recover.checkpoint", fromlist=["read_info"]).read_info(tmp_path / "v.ckpt")
    assert len(info.index.storages) == 3


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
    out = load(tmp_path / "l.ckpt")
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


def test_meta_device_tensor_saves_elsewhere_refused(tmp_path):
    with pytest.raises(TypeError, match="meta"):
        save({"m": torch.empty(3, device="meta")}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_skeleton_is_not_needed_for_pickle_free_scalars(tmp_path):
    # plain pickle stream of the skeleton must contain no tensor data (tensors are persistent ids)
    enc = fmt.encode_checkpoint({"w": torch.zeros(1000)})
    assert len(enc.skeleton) < 200
    ops = [op.name for op, _, _ in __import__("pickletools").genops(io.BytesIO(enc.skeleton))]
    assert "BINPERSID" in ops and "GLOBAL" not in ops and "STACK_GLOBAL" not in ops


# ------------------------------------------------------------------ crafted skeletons (issue 11)


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n) if n < 1 << 31 else b"\x8a\x08" + struct.pack("<q", n)


def _nested_str_bomb(levels: int = 40) -> bytes:
    # x0 = "aaaa"; x(k+1) = [xk, xk]: 40 levels of shared references, repr is 2**40 * 6 chars
    body = b"\x8c\x04aaaa\x940"
    for i in range(levels):
        body += b"(h" + bytes([i]) + b"h" + bytes([i]) + b"l\x940"
    return _g("builtins", "str") + body + b"h" + bytes([levels]) + b"\x85R"


def _repeated_copies(calls: int = 1000) -> bytes:
    # one 2000-byte object copied by bytearray(...) again and again: quadratic in the file size
    body = _g("builtins", "bytearray") + b"\x94" + b"B" + struct.pack("<I", 2000) + b"x" * 2000 + b"\x94("
    body += b"h\x00h\x01\x85R" * calls
    return body + b"l"


def _path_join(n: int = 1500) -> bytes:
    return _g("pathlib", "PosixPath") + b"X" + struct.pack("<I", 2000) + b"p" * 2000 + b"\x940(" + b"h\x00" * n + b"tR"


CRAFTED_SKELETONS = {
    "bytearray(512MiB)": _g("builtins", "bytearray") + _int(512 << 20) + b"\x85R",
    "bytes(512MiB) via NEWOBJ": _g("builtins", "bytes") + _int(512 << 20) + b"\x85\x81",
    "list(range(2**30))": _g("builtins", "list") + _g("builtins", "range") + _int(1 << 30) + b"\x85R\x85R",
    "tuple(range(2**62)) via NEWOBJ": _g("builtins", "tuple")
    + _g("builtins", "range")
    + _int(1 << 62)
    + b"\x85R\x85\x81",
    "torch.Size(range(2**28))": _g("torch", "Size") + _g("builtins", "range") + _int(1 << 28) + b"\x85R\x85R",
    "Counter(range(2**28))": _g("collections", "Counter") + _g("builtins", "range") + _int(1 << 28) + b"\x85R\x85R",
    "str(shared nested lists)": _nested_str_bomb(),
    "bytearray(copy) x1000": _repeated_copies(),
    "PosixPath(*[s] * 1500)": _path_join(),
}
DECLARED_LENGTH_SKELETONS = {
    "BINBYTES8 of 512MiB": b"\x8e" + struct.pack("<Q", 512 << 20) + b"x" * 100,
    "BINUNICODE8 of 2**60": b"\x8d" + struct.pack("<Q", 1 << 60) + b"x" * 100,
    "BYTEARRAY8 of 2**62": b"\x96" + struct.pack("<Q", 1 << 62) + b"x" * 100,
}


def _save_with_skeleton(monkeypatch, path, skeleton: bytes) -> None:
    real = fmt.encode_checkpoint

    def crafted(checkpoint, meta=None):
        enc = real(checkpoint, meta)
        enc.skeleton = b"\x80\x04" + skeleton + b"."
        return enc

    monkeypatch.setattr(fmt, "encode_checkpoint", crafted)
    save({"w": torch.ones(4)}, path)
    monkeypatch.undo()
    assert os.path.getsize(path) < 64 << 10


@pytest.mark.parametrize("name", list(CRAFTED_SKELETONS))
def test_crafted_skeleton_refused_with_bounded_memory(tmp_path, monkeypatch, name):
    """A few KiB of pickle must not make the weights_only load build hundreds of MiB."""
    import time
    import tracemalloc

    p = tmp_path / "crafted.ckpt"
    _save_with_skeleton(monkeypatch, p, CRAFTED_SKELETONS[name])
    t0 = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises((UnsafeCheckpointError, CheckpointCorruptError)) as ei:
            load(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{name}: peak {peak >> 20} MiB"
    assert time.monotonic() - t0 < 10
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("name", list(DECLARED_LENGTH_SKELETONS))
def test_declared_length_past_end_is_corrupt(tmp_path, monkeypatch, name):
    """Counted opcodes whose length runs past the skeleton: corrupt, quickly, RSS bounded."""
    import resource
    import time

    p = tmp_path / "crafted.ckpt"
    _save_with_skeleton(monkeypatch, p, DECLARED_LENGTH_SKELETONS[name])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorruptError, match="invalid skeleton"):
        load(p)
    assert time.monotonic() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB


def test_skeleton_budget_admits_legitimate_constructor_calls(tmp_path):
    """What the pickler writes for allowed types stays far inside the budget; defaultdict keeps its factory."""
    ck = {
        "dd": collections.defaultdict(list, {"k": [1]}),
        "ba": bytearray(b"\x01" * 100_000),
        "size": [torch.Size([i, 3]) for i in range(2000)],
        "paths": [pathlib.Path("/data/run", str(i)) for i in range(2000)],
        "ctr": collections.Counter({str(i): i for i in range(5000)}),
        "dq": collections.deque(range(100), maxlen=200),
        "fs": frozenset(range(1000)),
        "rng": range(10**12),
    }
    save(ck, tmp_path / "ok.ckpt")
    out = load(tmp_path / "ok.ckpt")
    for k, v in ck.items():
        assert out[k] == v and type(out[k]) is type(v), k
    assert out["dd"].default_factory is list
    up = fmt.RestrictedUnpickler(io.BytesIO(b"\x80\x04N."), [])
    assert up.budget == fmt.skeleton_budget(4)
