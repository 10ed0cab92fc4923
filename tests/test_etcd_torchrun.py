"""``lightning-recover torchrun`` on the etcd control plane: one torchrun job of K = 2 workers per replica
(FSDP2 inside the replica), the job's keys in a real 3-member TLS etcd on loopback, no coordinator process.

A worker of replica 1 is SIGKILLed mid-step: its replica is declared dead by the launcher holding the
monitor role (through etcd), its mate is ended, and replicas 0 and 2 finish equal to the unsharded
float64 run (<= 1e-9) with every step applied once. The multi-host variant (K = 2 on two
network-namespace hosts) runs on the embedded coordinator in tests/test_netns.py.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.jobs import ROOT, max_relative_difference, run_job
from tests.scripts import sharded_train

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(ROOT, "tests", "scripts", "sharded_train.py")
REPLICAS, K, STEPS, M = 3, 2, 4, 6


@pytest.mark.timeout(600)
def test_torchrun_replicas_of_two_on_etcd_lose_a_worker(etcd3, tmp_path):
    out = str(tmp_path / "job")
    script = [SCRIPT, out, "--replicas", str(REPLICAS), "--replica-size", str(K), "--steps", str(STEPS)]
    script += ["--microbatches", str(M), "--dtype", "float64"]
    cmd = [sys.executable, "-m", "lightning_recover.cli", "torchrun", "--replicas", str(REPLICAS)]
    cmd += ["--nproc-per-replica", str(K), "--heartbeat-timeout", "2", "--", *script]
    env = dict(etcd3.environment(), LIGHTNING_RECOVER_INJECT="kill:replica=1:inner=1:step=1:phase=backward")
    result = run_job(cmd, out, timeout=400, env=env)
    assert result.returncode == 0, result.output[-4000:]
    assert "monitor role taken" in result.output, "the monitor ran through etcd, not a coordinator"
    assert "etcd control plane" in result.output, result.output[-3000:]

    ref_dir = str(tmp_path / "reference")
    sharded_train.reference(SimpleNamespace(out=ref_dir, steps=STEPS, microbatches=M, batch_size=4, dtype="float64"))
    reference = torch.load(os.path.join(ref_dir, "reference.pt"))["state"]
    states = result.states()
    assert sorted(states) == [0, 2], f"finished replicas {sorted(states)}\n{result.output[-3000:]}"
    for r, data in states.items():
        diff = max_relative_difference(data["state"], reference)
        assert diff <= 1e-9, f"replica {r} differs from the unsharded reference by {diff}"
        assert [s["step"] for s in data["stats"]] == list(range(STEPS)), data["stats"]
    assert states[0]["stats"][1]["recoveries"] == 1 and states[0]["stats"][-1]["live_replicas"] == 2
