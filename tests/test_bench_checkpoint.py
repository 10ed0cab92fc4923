"""Smoke test of ``lightning-recover bench checkpoint`` on a tiny state (no timing assertions)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shutil

import pytest
import torch

from lightning_recover.bench import checkpoint as bench
from lightning_recover.bench.gpt_state import build_checkpoint, config_for_size, iter_tensors, tensor_stats


def _uring_available() -> bool:
    try:
        mod = importlib.import_module("lightning_recover.checkpoint")
        return hasattr(mod, "UringCheckpointIO")
    except Exception:
        return False


def test_config_hits_size_and_is_gpt_shaped():
    for gb in (0.02, 0.5, 2.0):
        cfg = config_for_size(gb * 1e9)
        got = cfg.n_params() * 12 / 1e9
        assert abs(got - gb) / gb < 0.15, (gb, cfg, got)
        assert cfg.n_layer >= 1 and cfg.d_model % 64 == 0
    assert config_for_size(2e9).vocab_size == 50257


def test_state_is_lightning_like_with_many_small_tensors():
    ckpt, cfg = build_checkpoint(0.02)
    assert {"epoch", "global_step", "state_dict", "optimizer_states", "loops", "hyper_parameters"} <= ckpt.keys()
    opt = ckpt["optimizer_states"][0]
    assert len(opt["state"]) == len(ckpt["state_dict"]) == 4 + 12 * cfg.n_layer
    assert opt["state"][0]["step"].dim() == 0
    stats = tensor_stats(ckpt)
    assert stats["tensors"] == 4 * len(ckpt["state_dict"])
    assert stats["tensors_lt_1mib"] > stats["tensors"] // 2
    # every tensor owns its storage
    ptrs = [t.untyped_storage().data_ptr() for _, t in iter_tensors(ckpt)]
    assert len(set(ptrs)) == len(ptrs)


def test_safetensors_flatten_roundtrip_clones_shared():
    w = torch.randn(4, 3)
    obj = {"a": w, "tied": w, "view": w[1], "n": {1: [torch.tensor(2.0), (0.9, 0.95)]}, "s": "x", "none": None}
    tensors, meta = bench.safetensors_flatten(obj)
    ptrs = [t.untyped_storage().data_ptr() for t in tensors.values()]
    assert len(set(ptrs)) == len(ptrs)
    back = bench.safetensors_unflatten(tensors, meta)
    assert torch.equal(back["tied"], w) and torch.equal(back["view"], w[1])
    assert back["n"][1][1] == (0.9, 0.95) and back["s"] == "x" and back["none"] is None
    assert float(back["n"][1][0]) == 2.0


@pytest.mark.slow
def test_bench_checkpoint_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = argparse.Namespace(
        size_gb=0.02, repeat=1, dir=str(tmp_path / "work"), methods=None, json=str(out), cache="fadvise"
    )  # fadvise: leave the machine's page cache alone
    rc = bench.main(args)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "save GB/s" in printed and "cache: fadvise" in printed

    records = json.loads(out.read_text())
    methods = [r["method"] for r in records]
    expected = {"lightning", "torch.save", "dcp", "safetensors"}
    if shutil.which("fio"):
        expected.add("fio")
    if _uring_available():
        expected.add("uring")
    assert expected <= set(methods), methods
    for r in records:
        assert r["error"] is None, r
        for key in ("save_s", "save_gbps", "load_s", "load_gbps"):
            assert isinstance(r[key], float) and r[key] > 0 and math.isfinite(r[key]), (r["method"], key, r[key])
        assert r["bytes"] > 0 and r["tensors"] > 0 and r["repeat"] == 1 and r["cache"] == "fadvise"
        if r["method"] != "fio":
            # loaded back and compared tensor-by-tensor against the saved state
            assert r["verified"] is True, r["method"]
            assert r["file_bytes"] >= r["bytes"]
    if "uring" in methods:
        assert all(r["save_vs_uring"] is not None for r in records)
    # the work dir is cleaned up
    assert not any((tmp_path / "work").iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_sharded_dcp_smoke(tmp_path, capsys):
    """`bench checkpoint --ranks 1`: save, cold load (values compared), async and fio rows, tiny sizes."""
    from lightning_recover.bench import dcp_ranks

    args = argparse.Namespace(
        ranks="1", size_gb=0.01, repeat=1, small=32, dir=str(tmp_path / "work"), json=str(tmp_path / "r.json")
    )
    args.no_torchsnapshot = True
    assert dcp_ranks.main(args) == 0
    printed = capsys.readouterr().out
    rounds = json.loads((tmp_path / "r.json").read_text())["1"]
    for kind in ("gpt", "small"):
        (r,) = rounds[kind]["rounds"]
        for key in ("save/uring", "save/fsw_t1", "save/fsw_t4", "load/uring", "load/fsr"):
            assert r[key] > 0 and math.isfinite(r[key]), (kind, key)
        if shutil.which("fio"):
            assert r["save/fio"] > 0 and r["load/fio"] > 0
    assert rounds["small"]["tensors"] == 32
    gpt = rounds["gpt"]["rounds"][0]
    for name in dcp_ranks.ASYNC:
        assert gpt[f"async_blocked_s_per_gb/{name}"] > 0 and gpt[f"async_durable_s/{name}"] > 0
    assert "| 1 | save |" in printed and "| 1 | load |" in printed and "uring_lazy" in printed


def test_parse_methods():
    assert bench.parse_methods(None) == bench.ALL_METHODS
    assert bench.parse_methods("fio, dcp") == ["fio", "dcp"]
    with pytest.raises(SystemExit):
        bench.parse_methods("nope")
