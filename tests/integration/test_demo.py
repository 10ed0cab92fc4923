"""Smoke test of ``lightning-recover demo`` with tiny settings (a kill and a hang, then the summary).

It runs in exact mode with float32 parameters (``--exact --precision 32-true``): the survivor's
parameters must equal the single-process reference bitwise (difference 0)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.jobs import run_job

pytestmark = pytest.mark.slow


def test_demo_tiny(tmp_path):
    out = str(tmp_path / "demo")
    cmd = [
        sys.executable,
        "-m",
        "lightning_recover.demo",
        "--replicas",
        "3",
        "--steps",
        "6",
        "--microbatches",
        "6",
        "--batch-size",
        "4",
        "--block-size",
        "32",
        "--width",
        "32",
        "--layers",
        "1",
        "--corpus-bytes",
        "200000",
        "--heartbeat-timeout",
        "1.0",
        "--out",
        out,
        "--inject",
        "kill:replica=2:step=2:phase=backward,hang:replica=0:step=4:phase=reduce",
        "--exact",
        "--precision",
        "32-true",
    ]
    result = run_job(cmd, out, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps_committed"] == 6
    assert [f["kind"] for f in summary["failures"]] == ["kill", "hang"]
    assert summary["final_live_replicas"] == 1
    assert summary["recomputed_microbatches"] >= 2
    assert summary["max_relative_param_difference"] == 0.0, "exact mode: bitwise equal to the reference"
    assert abs(summary["final_loss"] - summary["reference_final_loss"]) < 1e-6
    assert os.path.getsize(os.path.join(out, "demo.png")) > 10_000
    assert "Summary: 6/6 steps committed" in result.output
    assert "replica 1 is now the lowest live replica" in result.output
    for f in summary["failures"]:  # the step's recovery time is its slowest survivor's, each one listed
        if f["recovery_seconds"]:
            assert f["recovery_seconds"] == max(f["recovery_seconds_by_replica"].values()), f
    assert "the slowest survivor's (replica " in result.output
    # A fault's line starts a line of its own, never glued to the progress bar drawn with \r.
    assert result.output.count("\n[lightning-recover] injecting fault") == 2, result.output[-4000:]


def test_demo_two_replicas_without_inject_runs_the_plan_fitted_to_them(tmp_path):
    """`demo --replicas 2` with no --inject: the default plan kills one replica and hangs none (the 4-replica
    plan would leave nobody), and the survivor ends bitwise equal to the reference, which is saved for reuse."""
    out = str(tmp_path / "demo")
    cmd = [sys.executable, "-m", "lightning_recover.demo", "--replicas", "2", "--steps", "5", "--microbatches", "4"]
    cmd += ["--batch-size", "4", "--block-size", "32", "--width", "32", "--layers", "1", "--corpus-bytes", "200000"]
    cmd += ["--heartbeat-timeout", "1.0", "--out", out, "--exact", "--precision", "32-true", "--no-plot"]
    result = run_job(cmd, out, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["inject"] == "kill:replica=1:step=1:phase=backward"
    assert [(f["kind"], f["replica"]) for f in summary["failures"]] == [("kill", 1)]
    assert summary["steps_committed"] == 5 and summary["final_live_replicas"] == 1
    assert summary["max_relative_param_difference"] == 0.0
    assert "[demo] failure-free reference: replaying the 5 steps" in result.output
    assert [n for n in os.listdir(out) if n.startswith("reference-")], os.listdir(out)
