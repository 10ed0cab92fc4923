"""``bench resilience``'s straggler scenario (``--straggler``), and the ``torchft`` mode that
``benchmarks/torchft_resilience.py`` adds to it from outside the package.

The fast tests check the argument parsing, the slowdown schedule and the arithmetic of the ideal
throughput; the ``slow`` ones run tiny real comparisons (bounded by timeouts; every job runs in its
own process group, which the driver kills at the end; ports are free ones chosen by the OS).
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from benchmarks import torchft_resilience
from benchmarks.torchft_train import parse_kills
from lightning_recover.bench import resilience
from lightning_recover.bench.resilience import (
    STRAGGLER_MODES,
    ideal_mb_per_s,
    mb_times,
    planned_mb_per_s,
)
from lightning_recover.bench.resilience_train import parse_slow, slow_factor
from lightning_recover.cli import build_parser
from lightning_recover.launch.process_tree import proc_stat


def test_slow_spec_parsing_and_schedule():
    assert parse_slow("") == {}
    assert parse_slow("1:2.0") == {1: (2.0, 0)}
    assert parse_slow("1:2.0@10, 3:1.5") == {1: (2.0, 10), 3: (1.5, 0)}
    slow = parse_slow("1:2.0@10")
    assert [slow_factor(slow, 1, s) for s in (0, 9, 10, 39)] == [1.0, 1.0, 2.0, 2.0]
    assert slow_factor(slow, 0, 20) == 1.0
    for bad in ("1", "1:x", "1:0.5", "-1:2", "1:2@-3", "1:2,1:3", "1:inf", "1:2:3"):
        with pytest.raises(ValueError, match="--slow"):
            parse_slow(bad)
    assert parse_kills("1:5,2:16") == {1: 5, 2: 16} and parse_kills("") == {}


def test_ideal_and_plan_arithmetic():
    slow = parse_slow("1:2.0")
    # 4 replicas, one at 2x: ideal (3 + 0.5) / T; an equal split is bound by the slow one: 4 x 0.5 / T
    assert ideal_mb_per_s(4, 0.1, slow, 40, 12) == pytest.approx(35.0)
    assert planned_mb_per_s(4, 0.1, slow, 40, 12, "equal") == pytest.approx(20.0)
    assert mb_times(4, 0.1, slow, 0) == pytest.approx([0.1, 0.2, 0.1, 0.1])
    # whole microbatches: M=12 cannot be split 3.43/1.71/3.43/3.43; the best is a 0.4 s step (30 mb/s),
    # and step 0 runs before any rate is measured (equal quotas, 0.6 s)
    assert planned_mb_per_s(4, 0.1, slow, 40, 12, "throughput") == pytest.approx(40 * 12 / (0.6 + 39 * 0.4))
    # M=28 splits exactly (8/4/8/8): only the first, unmeasured step falls short of the ideal
    assert planned_mb_per_s(4, 0.1, slow, 40, 28, "throughput") == pytest.approx(40 * 28 / (1.4 + 39 * 0.8))
    # slow from step 10 on: 10 steps at 40 mb/s, 30 at 35 (ideal), and the plan lags one step
    mid = parse_slow("1:2.0@10")
    assert ideal_mb_per_s(4, 0.1, mid, 40, 12) == pytest.approx(40 * 12 / (10 * 0.3 + 30 * 12 / 35))
    assert planned_mb_per_s(4, 0.1, mid, 40, 12, "throughput") == pytest.approx(40 * 12 / (10 * 0.3 + 0.6 + 29 * 0.4))
    assert planned_mb_per_s(4, 0.1, {}, 40, 12, "equal") == pytest.approx(40.0)


def test_resilience_ratios_are_paired_by_repetition():
    """The headline throughput ratios (of failure-free, vs checkpoint-and-restart) divide repetition i of a mode
    by repetition i of its reference; their median is not the ratio of the medians."""

    def reps(*rates):
        return [{"effective_mb_per_s": r, "median_takeover_commit_s": None} for r in rates]

    runs = {"recover-standby": reps(30.0, 34.0, 33.0), "failure-free": reps(32.0, 35.0, 40.0), "ddp-torch": reps(8.0)}
    paired = resilience.paired_ratios(runs, ("failure-free", "ddp-torch"))
    v = paired["recover-standby"]["failure-free"]
    assert v["ratios"] == pytest.approx([30 / 32, 34 / 35, 33 / 40])
    assert (
        v["median"] == pytest.approx(30 / 32)
        and v["min"] == pytest.approx(33 / 40)
        and v["max"] == pytest.approx(34 / 35)
    )
    assert v["median"] != pytest.approx(33 / 35)  # the ratio of the medians
    assert "ddp-torch" not in paired["recover-standby"]  # a different number of repetitions: no pairing
    assert "failure-free" not in paired.get("failure-free", {})


def _args(tmp_path, **kw) -> argparse.Namespace:
    argv = ["bench", "resilience", "--dir", str(tmp_path / "work"), "--json", str(tmp_path / "out.json")]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return build_parser().parse_args(argv)


def test_cli_selects_the_scenario_and_modes(tmp_path, monkeypatch, capsys):
    args = _args(tmp_path, straggler="1:2.0@10", microbatches=28)
    assert args.straggler == "1:2.0@10" and args.microbatches == 28 and args.heartbeat_timeout is None
    assert resilience._select_modes(args, args.straggler, 1) == list(STRAGGLER_MODES)
    assert resilience._select_modes(_args(tmp_path), None, 1) == list(resilience.MODES)
    with pytest.raises(SystemExit, match="unknown mode"):
        resilience._select_modes(_args(tmp_path, modes="recover,torchft"), "1:2", 1)
    with pytest.raises(SystemExit, match="only 4 replicas"):
        resilience.main(_args(tmp_path, straggler="4:2.0"))
    with pytest.raises(SystemExit, match="--straggler"):
        resilience.main(_args(tmp_path, straggler="1:0.5"))
    # the package has no torchft mode; the benchmark adds it, and skips it with a message when torchft is absent
    with pytest.raises(SystemExit, match="unknown mode"):
        resilience._select_modes(_args(tmp_path, modes="recover,torchft"), None, 1)
    monkeypatch.setattr(
        torchft_resilience, "torchft_available", lambda: "ModuleNotFoundError: No module named 'torchft'"
    )
    args = _args(tmp_path, modes="recover,torchft,failure-free")
    extra = torchft_resilience.select_torchft(args)
    assert extra == {} and resilience._select_modes(args, None, 1, extra) == ["recover", "failure-free"]
    assert "skipping the torchft mode" in capsys.readouterr().out
    monkeypatch.setattr(torchft_resilience, "torchft_available", lambda: None)
    extra = torchft_resilience.select_torchft(_args(tmp_path, modes="recover,torchft"))
    assert resilience._select_modes(_args(tmp_path, modes="recover,torchft"), None, 1, extra) == ["recover", "torchft"]


def test_a_mode_added_from_outside_runs_and_reports(tmp_path, capsys):
    """An ExtraMode (how benchmarks/ adds a peer) is run with the schedule and its own table is reported."""
    seen = {}

    def run(out, **cfg):
        seen.update(cfg, out=out)
        return {
            "wall_s": 1.0,
            "effective_mb_per_s": 2.0,
            "lost_steps": 0,
            "recomputed_microbatches": 0,
            "min_live": 4,
            "faults": 0,
            "recoveries": [],
            "median_fault_to_commit_s": 0.0,
        }

    extra = {"peer": resilience.ExtraMode(run=run, table=lambda rows, cfg: f"peer table of {sorted(rows)}")}
    assert resilience.main(_args(tmp_path, modes="peer"), extra) == 0
    assert seen["replicas"] == 4 and seen["kills"] and seen["out"].endswith("peer-0")
    result = json.load(open(tmp_path / "out.json"))
    assert result["table"].endswith("peer table of ['peer']") and "peer" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_straggler_comparison(tmp_path):
    """2 replicas, replica 1 at 2x: throughput quotas give it fewer microbatches (the speed-up itself
    is measured by the benchmark, not asserted here) and the run ends on the failure-free trajectory."""
    args = _args(
        tmp_path,
        replicas=2,
        steps=6,
        microbatches=6,
        straggler="1:2.0",
        modes="recover-throughput,failure-free",  # equal quotas are what every other job runs
    )
    assert resilience.main(args) == 0
    result = json.load(open(tmp_path / "out.json"))
    rows = result["rows"]
    assert result["ideal_mb_per_s"] == pytest.approx(15.0)  # (1 + 0.5) / 0.1
    tput = rows["recover-throughput"]
    assert tput["mb_by_replica"]["1"] < tput["mb_by_replica"]["0"], tput["mb_by_replica"]
    assert sum(tput["mb_by_replica"].values()) == 6 * 6
    assert tput["param_diff"] <= 1e-5 and tput["param_absdiff"] <= 1e-8
    assert "fraction of ideal" in result["table"]


def _live_processes_of(out: str) -> list[int]:
    pids = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        fields = proc_stat(pid)
        if fields is not None and fields[0] != "Z" and out.encode() in cmdline:
            pids.append(pid)
    return pids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchft_mode_under_a_kill(tmp_path, monkeypatch):
    """torchft 0.2.0 with 2 replicas, replica 1 killed at step 3 and restarted: the run completes,
    the dropped step is recomputed, the batch shrinks while replica 1 is out, no process is left."""
    monkeypatch.setenv("RUST_LOG", os.environ.get("RUST_LOG", "warn"))  # before torchft's import sets up its log
    pytest.importorskip(
        "torchft", reason="not tested: the torchft peer, because torchft is not installed (pip install torchft==0.2.0)"
    )
    assert torchft_resilience.torchft_available() is None
    out = str(tmp_path / "torchft")
    r = torchft_resilience.run_torchft(
        out, replicas=2, steps=12, microbatches=6, mb_seconds=0.1, kills=[(1, 3)], heartbeat_timeout=1.0, timeout=300
    )
    assert r["faults"] == 1 and r["exit_codes"][1][0] == -9, r["exit_codes"]
    assert r["samples_per_step"]["min"] < r["samples_per_step"]["max"], "the batch shrinks while a replica is out"
    assert r["min_live"] == 1 and r["degraded_steps"] >= 1
    assert r["recoveries"][0]["fault_to_commit_s"] is not None
    assert os.path.exists(os.path.join(out, "final.pt"))
    state = torch.load(os.path.join(out, "final.pt"))
    assert all(v.dtype == torch.float64 for v in state.values() if v.is_floating_point())
    assert _live_processes_of(out) == [], "the driver ended every replica process"
