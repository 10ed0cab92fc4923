"""Sharded replicas (FSDP2 inside a replica, fault-tolerant replicate dimension), end to end.

Every run is compared with a single-process, unsharded float64 reference that sums the same M
microbatches per step (tests/scripts/sharded_train.py --reference): relative difference <= 1e-9.
Faults hit one process of one replica; the whole replica must leave, every one of its processes
must be gone at the end, and the survivors must still equal the reference.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest
import torch

from tests.jobs import ROOT, max_relative_difference, run_job

SCRIPT = os.path.join(ROOT, "tests", "scripts", "sharded_train.py")
TOL = 1e-9
STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[int, dict] = {}

    def get(microbatches: int, dtype: str = "float64") -> dict:
        if (microbatches, dtype) not in cache:
            out = str(tmp_path_factory.mktemp(f"ref{microbatches}{dtype}"))
            result = run_job(
                [
                    sys.executable,
                    SCRIPT,
                    out,
                    "--reference",
                    "--steps",
                    str(STEPS),
                    "--microbatches",
                    str(microbatches),
                    "--dtype",
                    dtype,
                ],
                out,
                timeout=120,
            )
            assert result.returncode == 0, result.output[-3000:]
            cache[microbatches, dtype] = torch.load(os.path.join(out, "reference.pt"))["state"]
        return cache[microbatches, dtype]

    return get


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sharded_job(
    out: str,
    replicas: int,
    microbatches: int,
    inject: str | None = None,
    cli: str | None = None,
    timeout: float = 400,
    dtype: str = "float64",
):
    script = [
        SCRIPT,
        out,
        "--replicas",
        str(replicas),
        "--replica-size",
        "2",
        "--steps",
        str(STEPS),
        "--microbatches",
        str(microbatches),
        "--dtype",
        dtype,
    ]
    if cli == "run":
        cmd = [
            sys.executable,
            "-m",
            "lightning_recover.cli",
            "run",
            "--replicas",
            str(replicas),
            "--nproc-per-replica",
            "2",
            "--heartbeat-timeout",
            "2",
            "--",
            sys.executable,
            *script,
        ]
    elif cli == "torchrun":  # one torchrun job of 2 workers per replica; RANK is the inner position
        cmd = [
            sys.executable,
            "-m",
            "lightning_recover.cli",
            "torchrun",
            "--replicas",
            str(replicas),
            "--nproc-per-replica",
            "2",
            "--heartbeat-timeout",
            "2",
            "--",
            *script,
        ]
    else:
        cmd = [sys.executable, *script]
    result = run_job(cmd, out, timeout=timeout, env={"LIGHTNING_RECOVER_INJECT": inject} if inject else None)
    pids = {os.path.basename(p): int(open(p).read()) for p in glob.glob(os.path.join(out, "pid.*"))}
    return result, pids


def check(result, pids, reference_state, survivors, replicas, tol=TOL):
    assert result.returncode == 0, result.output[-4000:]
    assert len(pids) == 2 * replicas, f"every process starts: {sorted(pids)}"
    left = [name for name, pid in pids.items() if _pid_alive(pid)]
    assert not left, f"processes still alive after the job: {left}"
    states = result.states()
    assert sorted(states) == survivors, f"finished replicas {sorted(states)}\n{result.output[-3000:]}"
    for r, data in states.items():
        diff = max_relative_difference(data["state"], reference_state)
        assert diff <= tol, f"replica {r} differs from the unsharded reference by {diff}"
        assert len(data["stats"]) == STEPS
    return states


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_replicas_of_two_failure_free(tmp_path, reference):
    result, pids = sharded_job(str(tmp_path), replicas=2, microbatches=8)
    states = check(result, pids, reference(8), survivors=[0, 1], replicas=2)
    for data in states.values():
        assert all(s["live_replicas"] == 2 and s["recoveries"] == 0 for s in data["stats"])
        # the mean loss of the step is known (K processes' losses summed inside the replica)
        assert all(s["loss"] is not None for s in data["stats"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_float32_sharded_replicas(tmp_path, reference):
    """float32 takes another FSDP2 reduce path on gloo (set_gradient_divide_factor(1) would ask
    gloo for PREMUL_SUM and fail): the K-fold loss scale must hold there too."""
    result, pids = sharded_job(str(tmp_path), replicas=2, microbatches=6, dtype="float32")
    check(result, pids, reference(6, "float32"), survivors=[0, 1], replicas=2, tol=1e-5)


# M=10 over 3 replicas of 2: quotas 4, 3, 3, so two replicas run a zero-contribution slot.
# case: (faults, survivors, in-step recoveries seen by the survivors)
FAULTS = {
    "kill-backward": ("kill:replica=1:inner=1:step=1:phase=backward", [0, 2], 1),
    "kill-reduce": ("kill:replica=0:inner=0:step=2:phase=reduce", [1, 2], 1),
    "kill-commit": ("kill:replica=2:inner=1:step=1:phase=commit", [0, 1], 1),
    "raise-optimizer": ("raise:replica=1:inner=0:step=1:phase=optimizer", [0, 2], 1),
    "hang-forward": ("hang:replica=2:inner=0:step=1:phase=forward", [0, 1], 1),
    # two replicas lost in one step, the second while it recomputes the first one's microbatches
    "kill-then-kill-recompute": (
        "kill:replica=1:inner=1:step=1:phase=backward," "kill:replica=2:inner=0:step=1:phase=recompute",
        [0],
        2,
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(FAULTS))
def test_three_replicas_of_two_lose_processes(tmp_path, reference, case):
    inject, survivors, recoveries = FAULTS[case]
    result, pids = sharded_job(str(tmp_path), replicas=3, microbatches=10, inject=inject)
    states = check(result, pids, reference(10), survivors=survivors, replicas=3)
    stats = states[survivors[0]]["stats"]
    assert stats[0]["live_replicas"] == 3 and stats[-1]["live_replicas"] == len(survivors)
    assert sum(s["recoveries"] for s in stats) == recoveries, [s["recoveries"] for s in stats]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_run_nproc_per_replica(tmp_path, reference):
    result, pids = sharded_job(str(tmp_path), replicas=2, microbatches=8, cli="run")
    check(result, pids, reference(8), survivors=[0, 1], replicas=2)
    assert "2 replicas x 2 processes" in result.output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_nproc_per_replica_with_a_kill(tmp_path, reference):
    result, pids = sharded_job(
        str(tmp_path),
        replicas=3,
        microbatches=10,
        cli="torchrun",
        inject="kill:replica=1:inner=1:step=1:phase=backward",
    )
    states = check(result, pids, reference(10), survivors=[0, 2], replicas=3)
    assert states[0]["stats"][-1]["live_replicas"] == 2
