"""``lightning-recover torchrun`` on the etcd control plane: one torchrun job of K = 2 workers per replica
(FSDP2 inside the replica), the job's keys in a real 3-member TLS etcd on loopback, no coordinator process.

A worker of replica 1 is SIGKILLed mid-step: its replica is declared dead by the launcher holding the
monitor role (through etcd), its mate is ended, and replicas 0 and 2 finish equal to the unsharded
float64 run (<= 1e-9) with every step applied once. The multi-host variant (K = 2 on two
network-namespace hosts) runs on the embedded coordinator in tests/chaos/test_netns.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.integration.test_sharded import check, sharded_job
from tests.scripts import sharded_train

pytestmark = pytest.mark.slow

REPLICAS, STEPS, M = 3, 4, 6


@pytest.mark.timeout(600)
def test_torchrun_replicas_of_two_on_etcd_lose_a_worker(etcd3, tmp_path):
    out = str(tmp_path / "job")
    result, pids = sharded_job(
        out,
        replicas=REPLICAS,
        microbatches=M,
        inject="kill:replica=1:inner=1:step=1:phase=backward",
        cli="torchrun",
        steps=STEPS,
        env=etcd3.environment(),
    )
    assert "monitor role taken" in result.output, "the monitor ran through etcd, not a coordinator"
    assert "etcd control plane" in result.output, result.output[-3000:]

    ref_dir = str(tmp_path / "reference")
    sharded_train.reference(SimpleNamespace(out=ref_dir, steps=STEPS, microbatches=M, batch_size=4, dtype="float64"))
    reference = torch.load(os.path.join(ref_dir, "reference.pt"))["state"]
    states = check(result, pids, reference, survivors=[0, 2], replicas=REPLICAS, steps=STEPS)
    assert [s["step"] for s in states[0]["stats"]] == list(range(STEPS))
    assert states[0]["stats"][1]["recoveries"] == 1 and states[0]["stats"][-1]["live_replicas"] == 2
