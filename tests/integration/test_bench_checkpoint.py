"""Smoke test of ``lightning-recover bench checkpoint`` on a tiny state (no timing assertions)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil

import pytest
import torch

from lightning_recover.bench import checkpoint as bench
from lightning_recover.bench.block_device import BlockDevice, measured
from lightning_recover.bench.gpt_state import build_checkpoint, config_for_size, iter_tensors, tensor_stats
from tests import needs


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
@pytest.mark.parametrize("plan_cache", [False, True])
def test_bench_sharded_dcp_smoke(tmp_path, capsys, plan_cache):
    """`bench checkpoint --ranks 1 [--plan-cache]`: save, cold load (values compared), async and fio rows, tiny
    sizes."""
    from lightning_recover.bench import dcp_ranks

    args = argparse.Namespace(
        ranks="1", size_gb=0.01, repeat=1, small=32, dir=str(tmp_path / "work"), json=str(tmp_path / "r.json")
    )
    args.no_torchsnapshot = True
    args.plan_cache = plan_cache
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
    (floor,) = rounds["floor"]["rounds"]
    assert all(floor[f"floor_s/{name}"] > 0 for name in dcp_ranks.WRITERS)
    assert "per-item floor" in printed and "ceiling on ours/fio" in printed
    gpt = rounds["gpt"]["rounds"][0]
    for name in dcp_ranks.ASYNC:
        assert gpt[f"async_blocked_s_per_gb/{name}"] > 0 and gpt[f"async_durable_s/{name}"] > 0
    assert "| 1 | save |" in printed and "| 1 | load |" in printed and "uring_lazy" in printed
    assert gpt["save/spread"] > 0 and "save/spread" not in rounds["small"]["rounds"][0]  # the spread save: GPT
    assert "spread save (GPT state)" in printed


def test_parse_methods():
    assert bench.parse_methods(None) == bench.ALL_METHODS
    assert bench.parse_methods("fio, dcp") == ["fio", "dcp"]
    with pytest.raises(SystemExit):
        bench.parse_methods("nope")


# ------------------------------------------------------------------------------------------------
# issue 16: states and the pairing with fio


def test_llama_state_is_mixed_precision():
    from lightning_recover.bench.gpt_state import build_llama_checkpoint, llama_config_for_size

    cfg = llama_config_for_size(2e9)
    assert abs(cfg.n_params() * 14 / 2e9 - 1) < 0.15 and cfg.vocab_size == 32000
    ckpt, cfg = build_llama_checkpoint(0.02)
    sd = ckpt["state_dict"]
    params = [k for k in sd if not k.endswith("inv_freq")]
    ropes = [k for k in sd if k.endswith("rotary_emb.inv_freq")]
    assert len(ropes) == cfg.n_layer and all(sd[k].dtype == torch.float32 and sd[k].dim() == 1 for k in ropes)
    assert all(sd[k].dtype == torch.bfloat16 for k in params)
    opt = ckpt["optimizer_states"][0]["state"]
    assert len(opt) == len(params)
    for i, k in enumerate(params):
        st = opt[i]
        assert {st["exp_avg"].dtype, st["exp_avg_sq"].dtype, st["master_param"].dtype} == {torch.float32}
        assert st["master_param"].shape == sd[k].shape and st["step"].dim() == 0
        # the bf16 parameter is the rounded master copy
        assert torch.equal(st["master_param"].to(torch.bfloat16), sd[k])
    assert any(k.endswith("norm.weight") and sd[k].dim() == 1 for k in params)
    stats = tensor_stats(ckpt)
    assert abs(stats["bytes"] / 0.02e9 - 1) < 0.2


def test_small10k_state_has_10k_tensors():
    from lightning_recover.bench.gpt_state import build_state

    ckpt, desc = build_state("small10k", 0.05)
    stats = tensor_stats(ckpt)
    assert stats["tensors"] == 10000 and desc["config"]["n_layer"] == 64
    # the bytes are in the 6 matrices per layer; everything else is small
    big = [t for _, t in iter_tensors(ckpt) if t.dim() == 2]
    assert len(big) == 6 * 64
    small = [t for _, t in iter_tensors(ckpt) if t.dim() < 2]
    assert all(t.numel() * t.element_size() <= 4 * 4 * desc["config"]["d_model"] for t in small)
    assert sum(t.numel() * t.element_size() for t in big) > 0.8 * stats["bytes"]
    ptrs = [t.untyped_storage().data_ptr() for _, t in iter_tensors(ckpt)]
    assert len(set(ptrs)) == len(ptrs)
    assert len({p for p, _ in iter_tensors(ckpt)}) == 10000


def test_run_pairs_pairs_each_run_with_its_neighbour_and_reports_paired_ratios():
    """Injected timings: ratios are per pair, the order alternates, the median and spread are of the ratios."""
    calls = []
    ours_s = {("uring", 0): (1.0, 2.0), ("uring", 1): (2.0, 2.0), ("uring", 2): (1.0, 1.0)}
    fio_s = {("uring", 0): (0.5, 1.0), ("uring", 1): (2.0, 4.0), ("uring", 2): (0.9, 1.0)}

    def run_ours(m, rep):
        calls.append(("ours", m, rep))
        save, load = ours_s[(m, rep)]
        return {"save_s": save, "load_s": load, "bytes": 1000}

    def run_fio(m, rep):
        calls.append(("fio", m, rep))
        w, r = fio_s[(m, rep)]
        return {"write_s": w, "read_s": r, "bytes": 2000, "cmd": "x"}

    pairs, errors = bench.run_pairs(["uring"], 3, run_ours, run_fio, log=lambda _: None)
    assert errors == {}
    assert calls == [
        ("ours", "uring", 0),
        ("fio", "uring", 0),
        ("fio", "uring", 1),
        ("ours", "uring", 1),
        ("ours", "uring", 2),
        ("fio", "uring", 2),
    ]
    p = pairs["uring"]
    assert [x["first"] for x in p] == ["ours", "fio", "ours"]
    # ratio = (1000 B / ours s) / (2000 B / fio s)
    assert [x["save_ratio"] for x in p] == pytest.approx([0.25, 0.5, 0.45])
    assert [x["load_ratio"] for x in p] == pytest.approx([0.25, 1.0, 0.5])
    assert p[1]["fio_cmd"] == "x" and p[1]["fio_write_s"] == 2.0
    s = bench.summarize_pairs(p)
    assert s["pairs"] == 3
    assert s["save"]["ratio_median"] == pytest.approx(0.45)
    assert (s["save"]["ratio_min"], s["save"]["ratio_max"]) == pytest.approx((0.25, 0.5))
    assert s["load"]["ratio_median"] == pytest.approx(0.5)
    assert s["save"]["ours_s_median"] == 1.0 and s["save"]["fio_s_median"] == 0.9
    assert s["save"]["ours_gbps_median"] == pytest.approx(1000 / 1.0 / 1e9)
    assert s["save"]["fio_gbps_median"] == pytest.approx(2000 / 0.9 / 1e9)
    # the median of paired ratios is not the ratio of medians
    assert s["save"]["ratio_of_medians"] == pytest.approx((1000 / 1.0) / (2000 / 0.9))
    targets = bench.paired_targets("llama", {"uring": s})
    save_t = next(t for t in targets if "save" in t["what"])
    assert save_t["target"] == 0.95 and save_t["met"] is False and save_t["spread"] == pytest.approx([0.25, 0.5])
    table = bench.format_paired([{"method": "uring", "summary": s}], {})
    assert "0.45x [0.25-0.50]" in table and "0.25 0.50 0.45" in table


def test_run_pairs_two_methods_rotate_and_failures_are_recorded():
    order = []

    def run_ours(m, rep):
        order.append(m)
        if m == "bad":
            raise OSError("boom")
        return {"save_s": 1.0, "load_s": 1.0, "bytes": 10}

    def run_fio(m, rep):
        return {"write_s": 1.0, "read_s": 2.0, "bytes": 10}

    pairs, errors = bench.run_pairs(["a", "bad"], 2, run_ours, run_fio, log=lambda _: None)
    assert order == ["a", "bad", "a"]  # rep 1 starts with the second method; a failed method is not retried
    assert "boom" in errors["bad"] and pairs["bad"] == []
    assert [x["load_ratio"] for x in pairs["a"]] == [2.0, 2.0]


def _paired_args(tmp_path, methods: str, out) -> argparse.Namespace:
    """``bench checkpoint --paired`` of a 10 MB Llama-like state, twice, against fio at depths 1 and 4."""
    return argparse.Namespace(
        size_gb=0.01,
        repeat=2,
        dir=str(tmp_path / "work"),
        methods=methods,
        json=str(out),
        cache="fadvise",
        state="llama",
        paired=True,
        fio_iodepth="1,4",
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_checkpoint_paired_smoke(tmp_path, capsys):
    if shutil.which("fio") is None:
        needs.missing("the paired save against fio", "fio is not installed", "fio")
    out = tmp_path / "paired.json"
    rc = bench.main(_paired_args(tmp_path, "uring", out))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert (
        "paired ratios" in printed and "the durable-save target" in printed and "vs fio at each depth: qd1" in printed
    )
    doc = json.loads(out.read_text())
    assert doc["meta"]["mode"] == "paired" and doc["meta"]["fio_iodepths"] == [1, 4]
    (rec,) = doc["records"]
    assert rec["method"] == "uring" and rec["error"] is None and len(rec["pairs"]) == 2
    for p in rec["pairs"]:
        assert set(p["fio_by_depth"]) == {"1", "4"}
        assert p["fio_write_s"] >= p["fio_write_runtime_s"] > 0 and p["save_s"] > 0
        assert math.isfinite(p["save_ratio"]) and math.isfinite(p["load_ratio"])
        # each pair's fio side is its best depth: no single depth was faster
        assert p["fio_write_s"] == min(r["write_s"] for r in p["fio_by_depth"].values())
        assert p["fio_read_s"] == min(r["read_s"] for r in p["fio_by_depth"].values())
    assert set(rec["summary"]["save"]["by_iodepth"]) == {"1", "4"}
    assert all(p["fio_first_touch_s"] > 0 for p in rec["pairs"])  # the fresh-tensor load's other floor
    assert len(rec["summary"]["load"]["vs_read_or_first_touch"]["ratios"]) == 2 and "first touch" in printed
    assert isinstance(doc["meta"]["machine"]["free_page_reporting"], bool)
    if doc["meta"]["block_device_unread"] is None:  # the disk's counters saw every byte each side moved
        for p in rec["pairs"]:
            assert p["save_disk"]["write_bytes"] >= p["bytes"] and p["load_disk"]["read_bytes"] >= p["bytes"]
            assert p["fio_write_disk"]["write_bytes"] >= p["fio_bytes"]
            assert p["fio_read_disk"]["read_bytes"] >= p["fio_bytes"]
            assert p["save_disk"]["device"] == doc["meta"]["block_device"]
    assert not any((tmp_path / "work").iterdir())


def test_a_paired_ratio_is_split_by_the_disk_counters_of_each_side():
    """Every pair's ratio is the product of the device's busy share of our time, the pace it moved our bytes at
    against fio's, and fio's time over its busy time; each factor is reported with its median and spread."""
    ours = [(1.0, 0.9), (1.0, 0.95), (2.0, 1.0)]  # (our seconds, the device busy during them)
    theirs = [(0.8, 0.8), (1.0, 0.9), (1.0, 1.0)]

    def run_ours(m, rep):
        s, busy = ours[rep]
        return {"save_s": s, "load_s": s, "bytes": 1000, "save_disk": {"busy_s": busy}, "load_disk": {"busy_s": busy}}

    def run_fio(m, rep):
        s, busy = theirs[rep]
        return {"write_s": s, "read_s": s, "bytes": 1000, "write_disk": {"busy_s": busy}, "read_disk": {"busy_s": busy}}

    pairs, _ = bench.run_pairs(["uring"], 3, run_ours, run_fio, log=lambda _: None)
    s = bench.summarize_pairs(pairs["uring"])
    f = s["save"]["disk_factors"]
    assert f["ours_busy_share"]["all"] == pytest.approx([0.9, 0.95, 0.5])
    assert f["device_pace"]["all"] == pytest.approx([0.8 / 0.9, 0.9 / 0.95, 1.0])
    assert f["ref_time_per_busy"]["all"] == pytest.approx([1.0, 1.0 / 0.9, 1.0])
    for i, ratio in enumerate(s["save"]["ratios"]):
        assert math.prod(f[k]["all"][i] for k in ("ours_busy_share", "device_pace", "ref_time_per_busy")) == (
            pytest.approx(ratio)
        )
    assert f["ours_idle_s_all"] == pytest.approx([0.1, 0.05, 1.0]) and f["ours_busy_share"]["median"] == 0.9
    # against the device's time for fio's bytes: (1000 B / 1 s) / (1000 B / fio's busy s), our idle time included
    assert f["vs_fio_busy"]["all"] == pytest.approx([0.8, 0.9, 0.5])
    assert "busy 90% [50%-95%] of our time x our bytes at 0.95x [0.89-1.00] fio's pace" in (
        bench.format_paired_depths([{"method": "uring", "summary": s}])
    )
    # a pair the counters did not measure leaves the ratios unsplit
    unmeasured, _ = bench.run_pairs(
        ["uring"], 1, lambda m, rep: run_ours(m, rep) | {"save_disk": {}}, run_fio, log=lambda _: None
    )
    assert "disk_factors" not in bench.summarize_pairs(unmeasured["uring"])["save"]


def test_the_disk_under_a_directory_is_measured_and_tmpfs_says_why_not(tmp_path):
    """A directory on a block device: what the device wrote while a file was written and synced is counted; on
    tmpfs, or with no device asked for, nothing is read and the block still runs."""
    dev = BlockDevice.under(str(tmp_path))
    if dev.why_not is None:
        with dev.measure() as u:
            (tmp_path / "f").write_bytes(b"x" * 4096)
            os.sync()
        # the file's block reached the device within the interval (the sync waits for it)
        assert u["device"] == dev.name and u["write_bytes"] >= 4096 and u["write_requests"] >= 1
    else:
        assert "no block device behind" in dev.why_not
    if os.path.isdir("/dev/shm"):
        shm = BlockDevice.under("/dev/shm")
        assert shm.stat_path is None and "tmpfs" in shm.why_not
        with shm.measure() as nothing:
            pass
        assert nothing == {}
    with measured(None) as unmeasured:  # no device asked for: the block runs, nothing is read
        pass
    assert unmeasured == {}


def test_paired_fio_side_is_the_best_depth_of_each_pair_and_each_depth_is_reported():
    """With fio at several depths per pair, a pair's ratio is against the fastest fio write and the fastest read
    of that pair (possibly from different depths); the summary also gives the paired ratios against each depth."""

    def fio_run(write_s, read_s, depth):
        return {
            "write_s": write_s,
            "read_s": read_s,
            "write_runtime_s": write_s / 2,
            "read_runtime_s": read_s / 2,
            "bytes": 2000,
            "read_cmd": f"read qd{depth}",
            "iodepth": depth,
        }

    fio_by_rep = [
        {"1": fio_run(2.0, 1.0, 1), "4": fio_run(1.0, 1.5, 4), "16": fio_run(1.25, 2.0, 16)},
        {"1": fio_run(4.0, 1.0, 1), "4": fio_run(2.0, 2.0, 4), "16": fio_run(1.0, 2.0, 16)},
        {"1": fio_run(2.0, 0.5, 1), "4": fio_run(1.0, 1.0, 4), "16": fio_run(2.0, 1.0, 16)},
    ]
    best = bench.best_of_depths(fio_by_rep[0])
    assert (best["write_s"], best["write_iodepth"], best["read_s"], best["read_iodepth"]) == (1.0, 4, 1.0, 1)
    assert best["read_cmd"] == "read qd1" and set(best["by_depth"]) == {"1", "4", "16"}

    pairs, errors = bench.run_pairs(
        ["uring"],
        3,
        lambda m, rep: {"save_s": 1.0, "load_s": 1.0, "bytes": 1000},
        lambda m, rep: bench.best_of_depths(fio_by_rep[rep]),
        log=lambda _: None,
    )
    assert errors == {}
    # (1000 B / 1 s) / (2000 B / best fio s): best writes 1.0, 1.0, 1.0 s; best reads 1.0, 1.0, 0.5 s
    assert [p["save_ratio"] for p in pairs["uring"]] == [0.5, 0.5, 0.5]
    assert [p["load_ratio"] for p in pairs["uring"]] == [0.5, 0.5, 0.25]
    s = bench.summarize_pairs(pairs["uring"])
    assert s["save"]["fio_best_iodepth_per_pair"] == [4, 16, 4]
    assert s["load"]["fio_best_iodepth_per_pair"] == [1, 1, 1]
    per = s["save"]["by_iodepth"]
    assert per["1"]["ratios"] == [1.0, 2.0, 1.0] and per["16"]["ratios"] == [0.625, 0.5, 1.0]
    # the best depth per pair is never slower than any one depth, so its ratio is the lowest
    for d in per:
        assert all(b <= x for b, x in zip(s["save"]["ratios"], per[d]["ratios"]))
    assert s["save"]["fio_best_median_iodepth"] == 4  # medians 2.0 / 1.0 / 1.25 s
    # against fio's own runtime (here half its wall time) at the best depth: half the wall-clock ratios
    assert s["save"]["vs_fio_runtime"]["ratios"] == [0.25, 0.25, 0.25]
    assert bench.parse_depths(None) == (1, 4, 16) and bench.parse_depths("2") == (2,)
    with pytest.raises(SystemExit):
        bench.parse_depths("0,4")


def test_a_load_is_also_paired_with_the_first_touch_of_fresh_memory():
    """A load into fresh tensors has two floors, the device's read and the first touch of as many bytes of fresh
    memory: its ratio against the longer of the two, pair by pair."""
    touches = [0.5, 2.0, 4.0]
    pairs, _ = bench.run_pairs(
        ["uring"],
        3,
        lambda m, rep: {"save_s": 1.0, "load_s": 2.0, "bytes": 1000},
        lambda m, rep: {"write_s": 1.0, "read_s": 1.0, "bytes": 1000, "first_touch_s": touches[rep]},
        log=lambda _: None,
    )
    s = bench.summarize_pairs(pairs["uring"])
    ft = s["load"]["vs_read_or_first_touch"]
    assert ft["ratios"] == [0.5, 1.0, 2.0] and ft["ratio_median"] == 1.0 and ft["first_touch_s_median"] == 2.0
    assert s["load"]["ratios"] == [0.5, 0.5, 0.5]  # against the read alone, as before
    assert "first touch of fresh memory 2.000 s): 1.00x [0.50-2.00]" in bench.format_paired_depths(
        [{"method": "uring", "summary": s}]
    )


@pytest.mark.slow  # a run of the bench (~9 s)
def test_async_checkpoint_bench_pairs_each_save_with_the_steps_just_before(tmp_path):
    """The async benchmark times steps with no checkpoint activity right before each save and reports the ratio
    of the steps after the save to them (the flush's cost to training), per repetition and as a median."""
    from lightning_recover.bench import async_checkpoint, fio

    methods = ["uring-async", "uring-sync", "uring-async-paced"] + (["fio-write"] if fio.available() else [])
    res = async_checkpoint.run(0.02, str(tmp_path), methods, 2, 2, 0.01, False, log=lambda _: None, flush_mbps=50)
    assert [r["rep"] for r in res["records"]] == [0] * len(methods) + [1] * len(methods)
    for rec in res["records"]:
        assert rec["baseline_step_s"] > 0 and len(rec["step_times"]) == 2
        assert rec["step_ratio"] == pytest.approx(rec["step_s"] / rec["baseline_step_s"])
        assert rec["first_step_ratio"] == pytest.approx(rec["step_times"][0] / rec["baseline_step_s"])
        assert rec["later_step_ratio"] == pytest.approx(rec["step_times"][1] / rec["baseline_step_s"])
        assert rec["durable_s"] > 0
        assert "steal_s" in rec and "baseline_steal_s" in rec  # NaN where /proc/stat has no steal column
    assert set(res["summary"]) == set(methods)  # (the pacing itself: test_async_checkpoint.py)
    ours = res["summary"]["uring-async"]
    if fio.available():  # fio's buffers are said: on huge pages where reserved (as the saver's ring), else malloc
        assert res["machine"]["fio_write_iomem"] in ("shmhuge", "malloc")
        # each save's step ratio over fio's in the same repetition, and the target read from their median
        assert ours["step_ratios_vs_fio"] == async_checkpoint.step_ratios_vs(res["records"], "uring-async", "fio-write")
        assert len(ours["step_ratios_vs_fio"]) == 2
        assert res["targets"]["step_during_flush_le_fio"] == (ours["step_ratio_vs_fio"] <= 1.0)
    assert len(ours["step_ratios"]) == 2 and min(ours["step_ratios"]) <= ours["step_ratio"] <= max(ours["step_ratios"])
    assert "step_during_flush_le_1.05x" in res["targets"]
    assert "paired step ratio" in async_checkpoint.format_table(res)


@pytest.mark.slow  # runs a research benchmark (benchmarks/)
def test_bench_async_saves_in_a_row_smoke(tmp_path):
    """Each save is timed from its call: the snapshot before durability, and nothing is left behind."""
    import json

    from benchmarks import async_saves_in_a_row

    out = tmp_path / "row.json"
    assert (
        async_saves_in_a_row.main(["--size-gb", "0.02", "--saves", "2", "--dir", str(tmp_path), "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["saves"]
    assert [r["save"] for r in rows] == [0, 1]
    assert all(0 < r["call_s"] <= r["snapshot_s"] <= r["durable_s"] for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["row.json"]


@pytest.mark.slow  # runs a research benchmark (benchmarks/)
def test_bench_unstaged_smoke(tmp_path, capsys):
    """The three ways of writing each item size run to the end and leave nothing behind (no timing is checked)."""
    from benchmarks import unstaged

    assert unstaged.main(["--size-gb", "0.02", "--items", "256K,4M", "--repeat", "1", "--dir", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "KiB" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["256 KiB", "4096 KiB"]
    assert list(tmp_path.iterdir()) == []


def test_fio_uses_huge_pages_only_when_reserved():
    """fio gets hugetlb buffers (``--iomem=shmhuge``) exactly when enough reserved huge pages are free."""
    from lightning_recover.bench import fio

    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = rest.split()
    free = int(info.get("HugePages_Free", ["0"])[0]) * int(info.get("Hugepagesize", ["2048"])[0]) * 1024
    assert fio.huge_iomem(0) == ("shmhuge" if free >= 2 << 20 else None)
    assert fio.huge_iomem(free + 1) is None
    assert fio._command("n", "/p", "write", 1 << 20, "io_uring", 4, iomem="shmhuge")[-1] == "--iomem=shmhuge"
    assert not any(a.startswith("--iomem") for a in fio._command("n", "/p", "write", 1 << 20, "io_uring", 4))


@pytest.mark.slow  # runs fio and a research benchmark's reads (benchmarks/)
def test_load_into_limit_reads_every_record_into_its_tensor_and_fio_reads_the_same_file(tmp_path):
    """The benchmark's reads are a load's: each storage record of the file into its tensor of the state, in file
    order (checked by the bytes landing where they belong); fio reads the same file's whole blocks."""
    import native_io
    from benchmarks import load_into_limit
    from lightning_recover.bench import fio
    from lightning_recover.checkpoint.file import single_file

    if not fio.available():
        needs.missing("the load benchmark's fio read", "fio is not installed", "fio")
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(1000, generator=g), "b": {"c": torch.randn(5 << 20, generator=g)}, "n": 3}
    path = str(tmp_path / "ckpt.pt")
    single_file.save(state, path)
    targets = {"a": torch.zeros(1000), "b": {"c": torch.zeros(5 << 20)}, "n": 3}
    segments = load_into_limit.target_segments(path, targets)
    assert [len(b) for _, b in segments] == [4000, 20 << 20]
    engine = native_io.IOEngine()
    try:
        row = load_into_limit.timed_read(path, segments, engine)
    finally:
        engine.close()
    assert torch.equal(targets["a"], state["a"]) and torch.equal(targets["b"]["c"], state["b"]["c"])
    assert row["straight_bytes"] + row["staged_bytes"] >= 4000 + (20 << 20)
    assert fio.read(path, (20 << 20) + 4000, 1)["io_bytes"] == 16 << 20  # whole 16 MiB blocks of it


@pytest.mark.slow  # runs fio alone, beside a busy process and beside a copy loop (benchmarks/)
def test_device_beside_work_reads_the_file_and_ends_what_it_starts_beside_fio(tmp_path):
    """The engine's two read paths land the file's bytes where they belong; fio beside a busy process or a copy
    loop ends both with its run; the summary compares every case with fio alone."""
    import subprocess
    import threading

    import numpy as np

    import native_io
    from benchmarks import device_beside_work
    from lightning_recover.bench import fio

    if not fio.available():
        needs.missing("the disk benchmark's fio reads", "fio is not installed", "fio")
    data = np.random.default_rng(0).integers(0, 256, 2 * fio.BLOCK, dtype=np.uint8)
    path = tmp_path / "file.bin"
    path.write_bytes(data.tobytes())
    engine = native_io.IOEngine()
    try:
        for straight in (False, True):
            dest = np.zeros(len(data), dtype=np.uint8)
            assert device_beside_work.engine_read(engine, str(path), dest, straight)() > 0
            assert np.array_equal(dest, data)
    finally:
        engine.close()

    def yes_processes() -> set[str]:
        return set(subprocess.run(["pgrep", "-x", "yes"], capture_output=True, text=True).stdout.split())

    before = yes_processes()
    for beside in (None, "busy", "copy"):
        assert device_beside_work.fio_beside(str(path), len(data), None, beside)() > 0
    assert yes_processes() <= before  # the busy process ended with the run
    assert not any(t.name == "copy-loop" for t in threading.enumerate())
    samples = {
        "fio_qd2_alone": [{"s": 1.0, "disk": {}}, {"s": 1.2, "disk": {}}, {"s": 0.8, "disk": {}}],
        "load_into": [{"s": 2.0, "disk": {"busy_s": 1.0, "read_bytes": 3e9, "mean_in_flight": 7.0}}],
    }
    summary = device_beside_work.summarize(samples, 2_000_000_000)
    assert summary["fio_qd2_alone"]["vs_fio_alone"] == 1.0 and "device_gbps_while_busy" not in summary["fio_qd2_alone"]
    assert summary["load_into"]["vs_fio_alone"] == 0.5 and summary["load_into"]["gbps"] == 1.0
    assert summary["load_into"]["device_gbps_while_busy"] == 3.0 and summary["load_into"]["mean_in_flight"] == 7.0


@pytest.mark.slow  # runs a research benchmark (benchmarks/)
def test_profile_save_smoke(tmp_path):
    """profile_save runs the real save through its timing proxies (they must accept what the save passes)."""
    from benchmarks import profile_save

    out = profile_save.profile("small10k", 0.01, str(tmp_path), 1, 0)
    assert out["runs"] and out["runs"][0]["total_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_unpaired_targets_also_give_ratios_paired_by_repetition():
    """`bench checkpoint` (all methods): besides the ratio of the medians, each target gives uring's ratio to the
    reference repetition by repetition; against fio, each repetition's fastest depth."""
    uring = {"method": "uring", "bytes": 1000, "save_s_all": [1.0, 2.0, 1.0], "load_s_all": [1.0, 1.0, 1.0]}
    dcp = {"method": "dcp", "bytes": 1000, "save_s_all": [2.0, 2.0, 3.0], "load_s_all": [4.0, 1.0, 2.0]}
    fio = {
        "method": "fio",
        "bytes": 2000,
        "fio_depths": {
            "1": {"save_s_all": [2.0, 2.0, 4.0], "load_s_all": [1.0, 1.0, 1.0]},
            "4": {"save_s_all": [1.0, 4.0, 2.0], "load_s_all": [2.0, 2.0, 2.0]},
        },
    }
    assert bench.repetition_ratios(uring, dcp, "save") == [2.0, 1.0, 3.0]
    # fio's fastest depth per repetition: 1.0, 2.0, 2.0 s for 2000 B
    assert bench.repetition_ratios(uring, fio, "save") == [0.5, 0.5, 1.0]
    assert bench.repetition_ratios(uring, fio, "load") == [0.5, 0.5, 0.5]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_checkpoint_paired_recycled_saves_write_over_a_kept_file_against_fio_overwriting(
    tmp_path, capsys, monkeypatch
):
    if shutil.which("fio") is None:
        needs.missing("the paired save against fio", "fio is not installed", "fio")
    monkeypatch.setenv("LIGHTNING_RECOVER_RECYCLE", "any")  # whatever filesystem tmp_path is on
    out = tmp_path / "paired.json"
    rc = bench.main(_paired_args(tmp_path, "uring-recycled", out))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "uring-recycled save vs fio writing over a file of its own (best depth): wall" in printed
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["error"] is None and rec["recycled_saves"] == 2  # every timed save wrote over the kept file
    for p in rec["pairs"]:
        assert p["fio_over_write_s"] >= p["fio_over_write_runtime_best_s"] > 0
        assert p["fio_over_write_s"] == min(r["over_write_s"] for r in p["fio_by_depth"].values())
    ov = rec["summary"]["save"]["vs_fio_overwrite"]
    assert set(ov) == {"wall", "runtime"} and len(ov["wall"]["ratios"]) == 2
    assert not any((tmp_path / "work").iterdir())
