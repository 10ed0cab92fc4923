"""Every example runs (briefly), so that none of them can rot."""

from __future__ import annotations

import os
import sys

import pytest

from tests.jobs import ROOT, run_job

pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(ROOT, "examples")


def test_fabric_gpt_with_a_kill(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(EXAMPLES, "fabric_gpt.py"),
        "--replicas",
        "2",
        "--steps",
        "3",
        "--microbatches",
        "4",
    ]
    res = run_job(
        cmd, str(tmp_path), timeout=400, env={"LIGHTNING_RECOVER_INJECT": "kill:replica=1:step=1:phase=backward"}
    )
    assert res.returncode == 0, res.output[-4000:]
    assert "step   2  loss" in res.output
    assert "replica 1 failed (killed by SIGKILL)" in res.output


def test_trainer_gpt(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(EXAMPLES, "trainer_gpt.py"),
        "--replicas",
        "2",
        "--steps",
        "3",
        "--microbatches",
        "4",
    ]
    res = run_job(cmd, str(tmp_path), timeout=400)
    assert res.returncode == 0, res.output[-4000:]
    assert res.output.count("GPU available:") == 1, res.output[-4000:]  # the supervisor's banner, not again
    assert "no logger configured" not in res.output, res.output[-4000:]  # recover/* metrics: no logger, no warning


def test_checkpoint_plugin_save_and_resume(tmp_path):
    out = str(tmp_path / "ckpt")
    script = os.path.join(EXAMPLES, "checkpoint_plugin.py")
    res = run_job([sys.executable, script, "--steps", "10", "--out", out], str(tmp_path / "a"), timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    assert os.path.exists(os.path.join(out, "last.ckpt"))
    res = run_job([sys.executable, script, "--steps", "12", "--out", out, "--resume"], str(tmp_path / "b"), timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    assert "trained to step 12" in res.output


def test_torchrun_replica_script(tmp_path):
    res = run_job(
        ["bash", os.path.join(EXAMPLES, "torchrun_replica.sh")],
        str(tmp_path),
        timeout=400,
        # The script runs `python`: this interpreter's, as `make test` (which puts .venv/bin first) would.
        env={"REPLICAS": "2", "STEPS": "3", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]},
    )
    assert res.returncode == 0, res.output[-4000:]
    assert "step   2  loss" in res.output
