"""``lightning-recover inspect`` / ``convert`` on sharded (DCP) checkpoint directories (one process, fast).

The multi-rank case (2 shard files, chunks per file) is checked on the real 2 x 2 checkpoint in
tests/integration/test_sharded_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import pytest
import torch

from lightning_recover.checkpoint.dcp.sharded_state import save_sharded
from lightning_recover.checkpoint.tools import EXIT_DAMAGED, EXIT_OK, EXIT_REFUSED, EXIT_UNREADABLE
from lightning_recover.cli import main


@dataclass
class Custom:  # a bytes item only the full unpickler can rebuild
    value: int = 5


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2)).double()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6, dtype=torch.float64)).sum().backward()
    optimizer.step()
    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(path, {"model": model, "optimizer": optimizer, "step": 3, "half": torch.ones(7).half()})
    return path, model


def _inspect(capsys, *args):
    code = main(["inspect", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_inspect_lists_items_files_and_verifies(ckpt, capsys):
    path, model = ckpt
    code, text = _inspect(capsys, path)
    assert code == EXIT_OK, text
    assert "__0_0.distcp" in text and "rank 0" in text and "__0_0.crc.json" in text
    assert "model.0.weight" in text and "float64" in text and "(5, 6)" in text and "float16" in text
    assert "verified the CRC-32C of" in text and "OK" in text
    code, text = _inspect(capsys, path, "--json")
    summary = json.loads(text)
    assert code == EXIT_OK and summary["ok"] and summary["verified"] and summary["format"] == "dcp"
    items = {i["name"]: i for i in summary["items"]}
    assert items["model.0.weight"]["shape"] == [5, 6] and items["model.0.weight"]["nbytes"] == 240
    assert items["step"]["kind"] == "bytes" and items["half"]["dtype"] == "float16"
    assert [f["rank"] for f in summary["files"]] == [0] and summary["files"][0]["sidecar"]


def test_inspect_damaged_truncated_incomplete(ckpt, capsys):
    path, _ = ckpt
    shard = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[-50] ^= 1
    open(shard, "wb").write(bytes(data))
    code, text = _inspect(capsys, path)
    assert code == EXIT_DAMAGED and "DAMAGED" in text and "CRC-32C" in text, text
    assert _inspect(capsys, path, "--no-verify")[0] == EXIT_OK
    open(shard, "wb").write(bytes(data[: len(data) // 2]))
    code, text = _inspect(capsys, path, "--no-verify")
    assert code == EXIT_UNREADABLE and "truncated" in text, text
    os.unlink(os.path.join(path, ".metadata"))
    code, text = _inspect(capsys, path)
    assert code == EXIT_UNREADABLE and "not a complete DCP checkpoint" in text, text


def test_convert_gathers_one_torch_save_file(ckpt, tmp_path, capsys):
    path, model = ckpt
    out = str(tmp_path / "out.pt")
    assert main(["convert", path, out]) == EXIT_OK
    data = torch.load(out, weights_only=True)
    assert sorted(data) == ["half", "model", "optimizer", "step"] and data["step"] == 3
    for k, v in model.state_dict().items():
        assert torch.equal(data["model"][k], v)
    assert data["optimizer"]["state"]["1.bias"]["exp_avg"].shape == (2,)
    shard = os.path.join(path, "__0_0.distcp")
    raw = bytearray(open(shard, "rb").read())
    raw[-50] ^= 1
    open(shard, "wb").write(bytes(raw))
    assert main(["convert", path, str(tmp_path / "bad.pt")]) == EXIT_DAMAGED
    assert not os.path.exists(tmp_path / "bad.pt")


def test_convert_refuses_pickled_objects_unless_asked(tmp_path, capsys):
    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(path, {"w": torch.arange(4.0), "obj": Custom(7)})
    assert main(["convert", path, str(tmp_path / "a.pt")]) == EXIT_REFUSED
    assert "--unsafe-pickle" in capsys.readouterr().err
    assert main(["convert", path, str(tmp_path / "a.pt"), "--unsafe-pickle"]) == EXIT_OK
    assert torch.load(str(tmp_path / "a.pt"), weights_only=False)["obj"] == Custom(7)


def test_stock_filesystem_writer_checkpoint(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "stock")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "n": 4}, storage_writer=FileSystemWriter(path))
    code, text = _inspect(capsys, path)
    assert code == EXIT_OK and "no checksum sidecars" in text, text
    assert main(["convert", path, str(tmp_path / "s.pt")]) == EXIT_OK
    data = torch.load(str(tmp_path / "s.pt"), weights_only=True)
    assert torch.equal(data["w"], torch.arange(6.0).reshape(2, 3)) and data["n"] == 4
