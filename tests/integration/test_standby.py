"""Warm standbys (``lightning-recover run --standby S``), end to end: real processes on gloo.

Each fault is started only once the standby it should meet is ready (the replicas hold before the
fault's step until the test opens a gate file), so a takeover never depends on how fast this
machine starts a process; after the fault they hold again until the standby that took the place
asked to join, so the next commit admits it before the run ends. Every run is compared in float64
with the failure-free run of the same script (its single-process reference mode).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_recover.launch.standby_pool import StandbyPool
from lightning_recover.protocol.options import RecoverOptions, check_standby
from lightning_recover.protocol.replica_env import read_replica_env
from tests.compare import max_relative_difference
from tests.jobs import (
    FABRIC_SCRIPT,
    JobResult,
    join_request,
    kill_group,
    log_text,
    start_job,
    wait_for,
)
from tests.scripts.fabric_train import reference_state

TOL = 1e-12  # float64: the same sums in another order
M = 6
READY = re.compile(r"standby (\d+) \(pid (\d+)\): ready")


def _standby_job(
    tmp_path,
    *,
    replicas: int,
    steps: int,
    inject: str,
    holds: dict[int, str],
    restarts: int = 1,
    extra=(),
    torchrun: bool = False,
    exact_dtype: str | None = None,
):
    """Start ``cli run --standby 1`` (or ``cli torchrun``: one torchrun job per replica and per
    standby) on fabric_train.py; ``holds`` = {step: name}: the replicas wait before ``step`` until the gate
    file ``name`` exists (:func:`_open_gate`, :func:`_open_when_asked`)."""
    out = str(tmp_path / "job")
    hold = ",".join(f"{step}:{tmp_path}/{name}" for step, name in holds.items())
    cmd = [
        sys.executable,
        "-m",
        "lightning_recover.cli",
        "torchrun" if torchrun else "run",
        "--replicas",
        str(replicas),
    ]
    cmd += ["--max-restarts" if torchrun else "--restarts", str(restarts), "--standby", "1"]
    # torchrun starts every worker as a new interpreter (no warm fork server): on 2 loaded cores one can miss
    # 0.5 s of beats while another imports torch, so those jobs get 2 s.
    heartbeat_timeout = "2" if torchrun else "0.5"
    cmd += ["--heartbeat-timeout", heartbeat_timeout, "--"] + ([] if torchrun else [sys.executable])
    cmd += [FABRIC_SCRIPT, out, "--replicas", str(replicas), "--steps", str(steps), "--microbatches", str(M)]
    # exact mode (exact_dtype given): float32 or bf16 parameters, compared bitwise; else float64 within TOL
    dtype = ["--dtype", exact_dtype, "--exact"] if exact_dtype else ["--dtype", "float64"]
    cmd += ["--heartbeat-timeout", heartbeat_timeout, *dtype, "--hold", hold, *extra]
    return start_job(cmd, out, env={"LIGHTNING_RECOVER_INJECT": inject})


def _ready_standbys(log: str) -> dict[int, int]:
    """Standby id -> pid of every standby that said it is ready."""
    return {int(s): int(pid) for s, pid in READY.findall(open(log).read())}


def _open_gate(tmp_path, log: str, proc: subprocess.Popen, k: int) -> None:
    """Open ``gate{k}`` once standby k is ready."""
    assert wait_for(lambda: k in _ready_standbys(log) or proc.poll() is not None, timeout=150), open(log).read()[-3000:]
    open(tmp_path / f"gate{k}", "w").close()


def _open_when_asked(tmp_path, log: str, proc: subprocess.Popen, name: str, replica, times: int = 1) -> None:
    """Open the gate file ``name`` once replica ``replica()`` asked to join ``times`` times in the job (a standby
    that took its place asks as a restarted replica does)."""

    def asked() -> bool:
        r = replica()
        return proc.poll() is not None or (r is not None and log_text(log).count(join_request(r)) >= times)

    assert wait_for(asked, timeout=150), log_text(log)[-3000:]
    open(tmp_path / name, "w").close()


def _open_all(tmp_path, names) -> None:
    """Every gate open: the replicas never stay held when a test fails."""
    for name in names:
        open(tmp_path / name, "w").close()


def _finish(proc: subprocess.Popen, log: str, out: str, steps: int, exact_dtype: str | None = None) -> JobResult:
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"job did not finish within 240 s:\n{open(log).read()[-4000:]}") from None
    finally:
        kill_group(proc)
    result = JobResult(proc.returncode, open(log).read(), out)
    assert result.returncode == 0, result.output[-4000:]
    reference = reference_state(steps, M, dtype=exact_dtype or "float64", exact=exact_dtype is not None)
    for r, data in result.states().items():
        diff = max_relative_difference(data["state"], reference)
        assert diff <= TOL, f"replica {r} diverged from the failure-free run: {diff}"
        if exact_dtype:
            differ = [k for k, v in reference.items() if not torch.equal(data["state"][k], v)]
            assert not differ, f"replica {r}: {differ} not bitwise equal to the exact failure-free run ({diff})"
    return result


# ---------------------------------------------------------------------------- fast: options and pool


def test_standby_needs_restarts_and_one_process_replicas():
    assert check_standby(2, restarts=1) == 2
    with pytest.raises(ValueError, match="counts as one of its restarts"):
        RecoverOptions(standby=1)
    with pytest.raises(ValueError, match="integer >= 0"):
        check_standby(-1, restarts=1)


def test_standby_environment_has_no_replica_id_until_assigned():
    base = {"LIGHTNING_RECOVER_COORDINATOR": "127.0.0.1:1234", "LIGHTNING_RECOVER_REPLICAS": "3"}
    found = read_replica_env(dict(base, LIGHTNING_RECOVER_STANDBY="4"))
    assert (found.replica, found.standby) == (-1, 4)
    assert read_replica_env(dict(base, LIGHTNING_RECOVER_STANDBY="4", LIGHTNING_RECOVER_REPLICA="2")).replica == 2
    with pytest.raises(ValueError, match="must be >= 0"):
        read_replica_env(dict(base, LIGHTNING_RECOVER_STANDBY="-1"))


def test_pool_hands_out_only_ready_standbys_and_replaces_dead_ones():
    lines: list[str] = []
    started: list[subprocess.Popen] = []

    def spawn(s: int) -> list[subprocess.Popen]:
        started.append(subprocess.Popen(["sleep", "60"]))
        return [started[-1]]

    pool = StandbyPool(1, spawn, budget=3, say=lines.append)
    try:
        pool.fill()
        assert list(pool.waiting) == [0]
        assert pool.take(lambda ids: []) is None, "a standby still starting is not handed out"
        os.kill(started[0].pid, signal.SIGKILL)
        started[0].wait()
        pool.reap()
        assert "standby 0 exited while waiting (killed by SIGKILL)" in lines
        assert list(pool.waiting) == [1], "a dead standby is replaced"
        s, (proc,) = pool.take(lambda ids: ids)
        assert (s, proc) == (1, started[1]) and not pool.waiting
        pool.fill()
        assert list(pool.waiting) == [2]
        proc.kill()
        proc.wait()
        pool.take(lambda ids: ids)
        pool.fill()
        assert not pool.waiting, "the budget of standby processes is spent"
    finally:
        pool.end()
        for p in started:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------- slow: real jobs

PHASE_PLAN = [  # (replica, step, phase, incarnation): each takeover meets the fault after it
    (1, 2, "forward", 1),
    (2, 5, "backward", 1),
    (0, 8, "reduce", 1),
    (1, 11, "commit", 2),
    (2, 14, "optimizer", 2),
]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_standby_takes_over_a_kill_in_every_phase(tmp_path):
    """3 replicas and one standby. The first standby is SIGKILLed while it waits: the launcher
    replaces it. Then five kills, one per phase, each met by a ready standby (the one started after
    the previous takeover). Every replica ends bitwise equal to the failure-free run (exact mode, bf16
    parameters)."""
    steps = 20
    inject = ",".join(f"kill:replica={r}:step={s}:phase={p}:incarnation={i}" for r, s, p, i in PHASE_PLAN)
    # Before each fault's step until its standby is ready (standby 0 is killed while waiting), and before the
    # next step until the standby that took the place asked to join.
    holds = {s: f"gate{k + 1}" for k, (_, s, _, _) in enumerate(PHASE_PLAN)}
    holds.update({s + 1: f"asked{k + 1}" for k, (_, s, _, _) in enumerate(PHASE_PLAN)})
    proc, log = _standby_job(
        tmp_path, replicas=3, steps=steps, inject=inject, holds=holds, restarts=2, exact_dtype="bfloat16"
    )
    out = str(tmp_path / "job")
    try:
        assert wait_for(lambda: 0 in _ready_standbys(log) or proc.poll() is not None, timeout=150), open(log).read()
        os.kill(_ready_standbys(log)[0], signal.SIGKILL)
        for k, (r, _, _, _) in enumerate(PHASE_PLAN):
            _open_gate(tmp_path, log, proc, k + 1)
            takeovers = [p[0] for p in PHASE_PLAN[: k + 1]].count(r)  # replica r's join requests so far
            _open_when_asked(tmp_path, log, proc, f"asked{k + 1}", lambda r=r: r, takeovers)
    finally:
        _open_all(tmp_path, holds.values())
        result = _finish(proc, log, out, steps, exact_dtype="bfloat16")
    assert "standby 0 exited while waiting (killed by SIGKILL)" in result.output, result.output[-3000:]
    for k, (r, _, _, _) in enumerate(PHASE_PLAN):
        taken = rf"replica {r}: standby {k + 1} \(pid \d+\) takes its place"
        assert re.search(taken, result.output), result.output[-3000:]
    assert "restarting replica" not in result.output, "every death was met by a standby"
    assert sorted(result.states()) == [0, 1, 2], result.output[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_deaths_with_one_standby(tmp_path):
    """Two replicas die in the same step with one standby: one takeover, and the other replica restarts
    in place as without standbys (the standby started after the takeover is held until the end, so it is
    not ready when the second death is handled)."""
    steps = 6
    inject = "kill:replica=1:step=2:phase=backward,kill:replica=2:step=2:phase=backward"
    holds = {2: "gate0", 3: "asked"}
    extra = ["--standby-hold", f"1:{tmp_path}/standby1"]
    proc, log = _standby_job(tmp_path, replicas=3, steps=steps, inject=inject, holds=holds, extra=extra)
    out = str(tmp_path / "job")

    def taken() -> int | None:
        found = re.search(r"replica (\d): standby 0 \(pid \d+\) takes its place", log_text(log))
        return int(found.group(1)) if found else None

    try:
        _open_gate(tmp_path, log, proc, 0)
        _open_when_asked(tmp_path, log, proc, "asked", taken)
    finally:
        _open_all(tmp_path, [*holds.values(), "standby1"])
        result = _finish(proc, log, out, steps)
    takeovers = re.findall(r"replica (\d): standby 0 \(pid \d+\) takes its place", result.output)
    restarted = re.findall(r"restarting replica (\d) \(1/1\)", result.output)
    assert len(takeovers) == 1 and len(restarted) == 1 and {*takeovers, *restarted} == {"1", "2"}, result.output[-3000:]
    # the replica restarted in place rejoins only if it starts before the run's end (seconds here)
    assert {0, int(takeovers[0])} <= set(result.states()), result.output[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_standby_job_takes_the_place_of_a_replica(tmp_path):
    """``lightning-recover torchrun --standby 1``: the standby is a torchrun job of its own. When a
    replica's worker is killed, its agent is ended before it restarts the worker and the standby
    job becomes the replica."""
    steps = 6
    inject = "kill:replica=1:step=2:phase=backward"
    holds = {2: "gate0", 3: "asked"}
    proc, log = _standby_job(
        tmp_path, replicas=2, steps=steps, inject=inject, holds=holds, torchrun=True, exact_dtype="float32"
    )
    out = str(tmp_path / "job")
    try:
        _open_gate(tmp_path, log, proc, 0)
        _open_when_asked(tmp_path, log, proc, "asked", lambda: 1)
    finally:
        _open_all(tmp_path, holds.values())
        result = _finish(proc, log, out, steps, exact_dtype="float32")
    assert "replica 1: its worker exited; " in result.output, result.output[-3000:]
    assert re.search(r"replica 1: standby 0 \(pid \d+\) takes its place \(1/1\)", result.output), result.output[-3000:]
    assert sorted(result.states()) == [0, 1], result.output[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_standby_takes_the_place_of_a_replica_of_two(tmp_path):
    """2 replicas of 2 processes (FSDP2) and one standby of 2, which builds its own 2-process world
    before it waits. Process 1 of replica 1 is killed: the replica is ended whole and the standby's
    two processes take its place, each receiving its shards from the same position of replica 0."""
    from tests.scripts import sharded_train

    steps, microbatches = 6, 8
    out = str(tmp_path / "job")
    script = [os.path.join(os.path.dirname(FABRIC_SCRIPT), "sharded_train.py"), out, "--replicas", "2"]
    script += ["--replica-size", "2", "--steps", str(steps), "--microbatches", str(microbatches)]
    # before the fault's step until the standby is ready, before the next one until it asked to join
    script += ["--hold", f"2:{tmp_path}/gate0,3:{tmp_path}/asked"]
    cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "2", "--nproc-per-replica", "2"]
    cmd += ["--restarts", "1", "--standby", "1", "--heartbeat-timeout", "2", "--", sys.executable, *script]
    proc, log = start_job(cmd, out, env={"LIGHTNING_RECOVER_INJECT": "kill:replica=1:inner=1:step=2:phase=backward"})
    both_ready = re.compile(r"standby 0( process 1)? \(pid \d+\): ready")
    try:
        assert wait_for(lambda: len(both_ready.findall(open(log).read())) == 2 or proc.poll() is not None, 300)
        open(tmp_path / "gate0", "w").close()
        _open_when_asked(tmp_path, log, proc, "asked", lambda: 1)
        proc.wait(timeout=300)
    finally:
        _open_all(tmp_path, ["gate0", "asked"])
        kill_group(proc)
    result = JobResult(proc.returncode, open(log).read(), out)
    assert result.returncode == 0, result.output[-4000:]
    assert re.search(r"replica 1: standby 0 \(pids \[\d+, \d+\]\) takes its place", result.output), result.output[
        -3000:
    ]
    ref_dir = tmp_path / "ref"
    args = SimpleNamespace(out=str(ref_dir), steps=steps, microbatches=microbatches, batch_size=4, dtype="float64")
    sharded_train.reference(args)
    reference = torch.load(ref_dir / "reference.pt")["state"]
    states = result.states()
    assert sorted(states) == [0, 1], result.output[-3000:]
    for r, data in states.items():
        assert max_relative_difference(data["state"], reference) <= 1e-9, f"replica {r} diverged"
    assert 2 < states[1]["stats"][0]["step"] < steps, "the standby took its place mid-run"
