"""Elastic in both directions: replicas that leave on a preemption notice, replicas that join a running job.

Fast tests: the notice signal's and the replica range's parsing, the control plane's id claims (a real
TCPStore), the leave request. Slow tests (real processes, the embedded coordinator and a real 3-member TLS
etcd): a replica told to leave (its notice signal, K = 1 and K = 2 processes) finishes its step, commits it and
leaves: no microbatch recomputed, no step lost, the launcher does not restart it, and the survivors end on the
failure-free trajectory (bitwise in exact mode); a whole-job notice writes a final checkpoint that the next run
resumes from; a job of ``replicas=2:4`` grows to 4 (hand-started newcomers on the embedded coordinator, a
launcher's ``--add-replicas`` on etcd) and shrinks back to 2 by notices and ``lightning-recover leave``,
``torch.equal`` to the failure-free exact-mode run. The newcomer from another network-namespace host is in
tests/chaos/test_elastic_netns.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_recover import env
from lightning_recover.control_plane.embedded import CoordinatorStore
from lightning_recover.launch import coordinator_process
from lightning_recover.launch.elastic_commands import replica_range_option
from lightning_recover.observe.events import read_events
from lightning_recover.protocol.growth import claim_free_id, claim_replica_ids
from lightning_recover.protocol.messages import JobSecret, Sealer, mark_dead
from lightning_recover.protocol.notice import EXIT_LEFT_ON_NOTICE, Notice, parse_signal, request_leave
from tests.jobs import FABRIC_SCRIPT, ROOT, JobResult, kill_group, run_job, start_job, wait_for
from tests.scripts.fabric_train import reference_state

STEPS, M = 6, 6


# ---------------------------------------------------------------------------- fast: parsing and claims


def test_notice_signal_names_and_refusals():
    assert parse_signal("SIGTERM") == signal.SIGTERM
    assert parse_signal("usr1") == signal.SIGUSR1
    assert parse_signal(str(int(signal.SIGUSR2))) == signal.SIGUSR2
    for bad in ("SIGKILL", "STOP", "SIGINT", "nope"):
        with pytest.raises(ValueError, match="HINT"):
            parse_signal(bad)


def test_replica_range_option():
    assert replica_range_option("3") == (3, 3)
    assert replica_range_option("2:4") == (2, 4)
    for bad, message in (("4:2", "at least 1"), ("0", "at least 1"), ("x", "integer"), ("2:", "integer")):
        with pytest.raises(Exception, match=message):
            replica_range_option(bad)
    assert env.replica_range("1:1") == (1, 1)


def test_a_second_notice_is_not_graceful():
    """The first notice sets the event; the second restores the default action (a process without grace left
    ends as a failure does). Only the first part is run here: a signal to this test process would end it."""
    notice = Notice()
    notice.install("SIGUSR2")
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert wait_for(notice.is_set, 5)
        assert notice.source == "SIGUSR2"
    finally:
        notice.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


@pytest.fixture
def store():
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    server = CoordinatorStore(tcp)
    sealer = Sealer(JobSecret.generate())
    for r in range(4):
        server.set(f"dead/{r}", sealer.seal(f"dead/{r}", b"0"))
        server.add(f"inc/{r}", 0)
    yield server, sealer


def test_claims_give_each_free_id_once(store):
    server, sealer = store
    server.add("inc/0", 1)  # replica 0 runs
    assert claim_replica_ids(server, sealer, 4, 2) == [1, 2]
    assert claim_replica_ids(server, sealer, 4, 1) == [3]  # 1 and 2 are claimed for incarnations not started
    with pytest.raises(Exception, match="HINT"):
        claim_replica_ids(server, sealer, 4, 1)
    # Replica 1's process starts (incarnation 1) and dies: its id is free again, for incarnation 2.
    server.add("inc/1", 1)
    assert not claim_free_id(server, sealer, 1)
    mark_dead(server, sealer, 1, 1)
    assert claim_free_id(server, sealer, 1)
    assert not claim_free_id(server, sealer, 1)


def test_racing_claims_never_share_an_id(store):
    server, sealer = store
    won: list[int] = []

    def claim() -> None:
        client = CoordinatorStore(
            dist.TCPStore("127.0.0.1", server.store.port, is_master=False, timeout=timedelta(seconds=10))
        )
        won.extend(r for r in range(4) if claim_free_id(client, sealer, r))

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(won) == [0, 1, 2, 3]


def test_leave_request_names_a_running_incarnation(store):
    server, sealer = store
    with pytest.raises(ValueError, match="not running"):
        request_leave(server, sealer, 2)
    server.add("inc/2", 1)
    assert request_leave(server, sealer, 2) == 1
    assert sealer.open("leave/2", server.get("leave/2")) == b"1"


# ---------------------------------------------------------------------------- slow: real jobs

EXACT = ["--exact", "--dtype", "float32"]


@pytest.fixture(scope="module")
def exact_reference():
    return reference_state(STEPS, M, dtype="float32", exact=True)


def _control_planes():
    return [pytest.param("embedded"), pytest.param("etcd")]


def _plane_env(plane: str, request) -> dict[str, str]:
    return {} if plane == "embedded" else request.getfixturevalue("etcd3").environment()


def _applied(out: str, r: int) -> list[int]:
    path = os.path.join(out, f"steps{r}.log")
    return [int(x) for x in open(path).read().split()] if os.path.exists(path) else []


def _assert_bitwise(states: dict, reference: dict) -> None:
    for r, data in states.items():
        for key, ref in reference.items():
            assert torch.equal(data["state"][key], ref), f"replica {r}: {key} differs from the failure-free run"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("plane", _control_planes())
def test_graceful_leave_of_one_process_replicas(tmp_path, request, plane, exact_reference):
    """3 replicas, exact mode; replica 1 gets its notice signal (SIGTERM) in step 2's backward: it commits step
    2 with the others and leaves. Nothing is recomputed, no step is lost, it is not restarted (--restarts 1),
    and the survivors end bitwise equal to the failure-free run. The job's event log shows a leave, no recovery."""
    out = str(tmp_path / "run")
    env_ = dict(_plane_env(plane, request), LIGHTNING_RECOVER_INJECT="notice:replica=1:step=2:phase=backward")
    cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "3", "--restarts", "1"]
    cmd += ["--event-log", str(tmp_path / "events.jsonl")]
    cmd += ["--heartbeat-timeout", "0.5", "--", sys.executable, FABRIC_SCRIPT, out, "--replicas", "3"]
    cmd += ["--steps", str(STEPS), "--microbatches", str(M), "--heartbeat-timeout", "0.5", *EXACT]
    result = run_job(cmd, out, timeout=300, env=env_)
    assert result.returncode == 0, result.output[-4000:]
    assert "replica 1 left on notice" in result.output and "restarting replica 1" not in result.output
    states = result.states()
    assert sorted(states) == [0, 2], result.output[-3000:]
    _assert_bitwise(states, exact_reference)
    assert _applied(out, 1) == [0, 1, 2]  # it applied the step it got the notice in, and no other
    for r, data in states.items():
        assert _applied(out, r) == list(range(STEPS))
        assert [s["recomputed"] for s in data["stats"]] == [0] * STEPS
        assert [s["recoveries"] for s in data["stats"]] == [0] * STEPS  # no failure was handled
        assert [s["live_replicas"] for s in data["stats"]] == [3, 3, 3, 2, 2, 2]
        assert data["stats"][2]["left"] == [1]
    events = read_events(str(tmp_path / "events.jsonl"))
    assert [e["replica"] for e in events if e["kind"] == "leave"] == [1]
    assert "replica 1 left on notice" in [e for e in events if e["kind"] == "leave"][0]["what"]
    assert not [e for e in events if e["kind"] == "recovery"], events


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_too_little_grace_ends_as_a_failure(tmp_path, exact_reference):
    """Replica 1 gets its notice in step 2's backward and is SIGKILLed before its reduce (the grace period ran
    out): the others recompute its microbatches inside step 2, as for any death, and end bitwise equal."""
    out = str(tmp_path / "run")
    inject = "notice:replica=1:step=2:phase=backward,kill:replica=1:step=2:phase=reduce"
    cmd = [sys.executable, FABRIC_SCRIPT, out, "--replicas", "3", "--steps", str(STEPS), "--microbatches", str(M)]
    result = run_job(cmd + ["--heartbeat-timeout", "0.5", *EXACT], out, timeout=600, env={env.INJECT: inject})
    assert result.returncode == 0, result.output[-4000:]
    assert "replica 1 failed" in result.output and "left on notice" not in result.output
    states = result.states()
    assert sorted(states) == [0, 2]
    _assert_bitwise(states, exact_reference)
    # its quota of step 2 (M / 3 microbatches), recomputed by the two survivors
    assert sum(s["recomputed"] for data in states.values() for s in data["stats"]) == M // 3
    for data in states.values():
        assert [s["live_replicas"] for s in data["stats"]] == [3, 3, 2, 2, 2, 2]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("plane", "cli"), [("embedded", "run"), ("etcd", "torchrun")])
def test_graceful_leave_of_two_process_replicas(tmp_path, request, plane, cli):
    """Replicas of K = 2 processes (FSDP2 inside): the notice reaches process 0 of replica 1 only; the whole
    replica leaves at the commit, nothing is recomputed, it is not restarted (``run --restarts 1``, torchrun
    ``--max-restarts 1``: its agent exits 75 instead of restarting the workers), and the survivor ends equal to
    the unsharded failure-free run.

    Process 1 of replica 1 is paused before it reads the step's decision, until process 0 says it waits for it:
    process 0 must not mark the replica gone before its mate read the decision (the mate would read the mark as
    the replica's death and stop as excluded, and its launcher would restart the replica)."""
    from types import SimpleNamespace

    from tests.integration.test_sharded import check, sharded_job
    from tests.scripts import sharded_train

    steps = 4
    gate = str(tmp_path / "gate")
    ref_dir = str(tmp_path / "reference")
    sharded_train.reference(SimpleNamespace(out=ref_dir, steps=steps, microbatches=8, batch_size=4, dtype="float64"))
    reference = torch.load(os.path.join(ref_dir, "reference.pt"))["state"]
    env_ = _plane_env(plane, request)
    result, pids = sharded_job(
        str(tmp_path / "run"),
        replicas=2,
        microbatches=8,
        inject="notice:replica=1:step=1:phase=backward,pause:replica=1:inner=1:step=1:phase=commit",
        cli=cli,
        steps=steps,
        env=dict(env_, **{env.PAUSE_GATE: gate}),
        restarts=1,
        gate=(gate, lambda log: "replica 1 process 0: waits for the replica's other processes to leave" in log),
    )
    assert "replica 1 left on notice" in result.output, result.output[-4000:]
    assert "restarting replica 1" not in result.output and "Restarting worker" not in result.output
    states = check(result, pids, reference, [0], replicas=2, steps=steps)
    stats = states[0]["stats"]
    assert [s["recomputed"] for s in stats] == [0] * steps
    assert [s["live_replicas"] for s in stats] == [2, 2, 1, 1]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_whole_job_notice_writes_a_final_checkpoint_and_the_next_run_resumes(tmp_path, exact_reference):
    """SIGTERM to the launcher: every replica gets its notice, they leave together at one step boundary after a
    final checkpoint (the plugin's save), the job exits 75; the same command run again resumes from it and ends
    bitwise equal to the failure-free run."""
    out = str(tmp_path / "run")
    ckpt = str(tmp_path / "notice.ckpt")
    gate = str(tmp_path / "gate")
    cmd = [sys.executable, FABRIC_SCRIPT, out, "--replicas", "2", "--steps", str(STEPS), "--microbatches", str(M)]
    cmd += ["--heartbeat-timeout", "0.5", "--notice-checkpoint", ckpt, *EXACT]
    proc, log = start_job(cmd + ["--hold", f"3:{gate}"], out)
    try:
        assert wait_for(lambda: _applied(out, 0) == [0, 1, 2] and _applied(out, 1) == [0, 1, 2], 240), open(log).read()
        os.kill(proc.pid, signal.SIGTERM)  # the launcher (Fabric's own): a whole-job notice, forwarded
        # The launcher forwards it on its own time: open the gate once it reached both held replicas (each marks
        # notice{r}), else they could finish the run before their notice.
        noticed = [os.path.join(out, f"notice{r}") for r in range(2)]
        assert wait_for(lambda: all(map(os.path.exists, noticed)), 120), open(log).read()
        open(gate, "w").close()
        proc.wait(timeout=120)
    finally:
        kill_group(proc)
    first = JobResult(proc.returncode, open(log).read(), out)
    assert first.returncode == EXIT_LEFT_ON_NOTICE, first.output[-3000:]
    assert "final checkpoint written" in first.output and os.path.exists(ckpt)
    # Each replica left at the boundary after the step it got the notice in; the last to leave saved.
    left_after = max(_applied(out, 0)[-1], _applied(out, 1)[-1])
    assert left_after < STEPS - 1, first.output[-3000:]
    again = run_job(cmd, str(tmp_path / "again"), timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert f"resumed from the notice checkpoint {ckpt}: step {left_after + 1}" in again.output
    _assert_bitwise(JobResult(0, "", out).states(), exact_reference)


def _replica_env(addr: str, secret_file: str, r: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    out = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out.pop("LIGHTNING_RECOVER_INJECT", None)
    out.update({env.COORDINATOR: addr, env.SECRET_FILE: secret_file, env.REPLICAS: "2:4", env.REPLICA: str(r)})
    out.update(extra or {})
    return out


# Nobody dies in the grow tests (the leaves are graceful): a timeout no healthy replica misses on a loaded host,
# where four replicas start beside two running ones.
GROW_HEARTBEAT_TIMEOUT = 2.0


def _grow_args(out: str, gate: str) -> list[str]:
    """devices=MAX (4); steps 0-1 with 2 replicas; before step 2 the members wait for the newcomers to ask to
    join, before step 4 for the leave request to arrive."""
    holds = f"2:{gate}.grow,4:{gate}.shrink"
    args = [sys.executable, FABRIC_SCRIPT, out, "--replicas", "4", "--steps", "7", "--microbatches", "8"]
    return args + ["--heartbeat-timeout", str(GROW_HEARTBEAT_TIMEOUT), "--hold", holds, *EXACT]


def _check_grown_and_shrunk(out: str, logs: dict[int, str]) -> None:
    reference = reference_state(7, 8, dtype="float32", exact=True)
    states = JobResult(0, "", out).states()
    assert sorted(states) == [0, 1], "\n".join(open(p).read()[-2000:] for p in logs.values())
    _assert_bitwise(states, reference)
    for r in (0, 1):
        stats = states[r]["stats"]
        assert [s["live_replicas"] for s in stats] == [2, 2, 2, 4, 4, 2, 2]
        assert [s["recomputed"] for s in stats] == [0] * 7
        assert _applied(out, r) == list(range(7))
    for r in (2, 3):  # admitted at step 2's commit: their first step is 3, they left after step 4
        assert _applied(out, r) == [3, 4], open(logs[r]).read()[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_job_grows_from_two_to_four_and_shrinks_back_embedded(tmp_path):
    """A hand-started job of replicas=2:4 on the embedded coordinator: 0 and 1 start training; 2 and 3 start
    later, are admitted at step 2's commit with live state and compute their share from step 3; then replica 2
    gets its notice signal and replica 3 an operator's `lightning-recover leave` during step 4, and both leave at
    its commit. Bitwise equal to the failure-free run (exact mode: any replica count commits the same bits)."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    gate = str(tmp_path / "gate")
    secret = JobSecret.generate()
    secret_file = secret.write_file(str(tmp_path))
    coord = coordinator_process.start(4, GROW_HEARTBEAT_TIMEOUT, secret_file=secret_file)
    procs: dict[int, subprocess.Popen] = {}
    logs = {r: os.path.join(out, f"r{r}.log") for r in range(4)}

    # Replica 2 gets its notice signal in step 4 (injected: the process signals itself), replica 3 an operator's
    # leave request while the job waits before step 4.
    inject = {env.INJECT: "notice:replica=2:step=4:phase=backward"}

    def start(r: int) -> None:
        with open(logs[r], "wb") as f:
            procs[r] = subprocess.Popen(
                _grow_args(out, gate),
                env=_replica_env(coord.addr, secret_file, r, inject),
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    try:
        start(0)
        start(1)
        assert wait_for(lambda: _applied(out, 0) == [0, 1], 240), open(logs[0]).read()[-3000:]
        start(2)
        start(3)
        asked = lambda r: "asks to join" in open(logs[r]).read()  # noqa: E731
        assert wait_for(lambda: asked(2) and asked(3), 540), open(logs[2]).read()[-3000:]
        open(gate + ".grow", "w").close()
        assert wait_for(lambda: 3 in _applied(out, 2) and 3 in _applied(out, 3), 120), open(logs[2]).read()[-3000:]
        leave = [sys.executable, "-m", "lightning_recover.cli", "leave", "--replica", "3"]
        done = subprocess.run(
            leave + ["--coordinator", coord.addr, "--secret-file", secret_file],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        assert done.returncode == 0, done.stderr
        assert wait_for(lambda: "told to leave (leave request)" in open(logs[3]).read(), 30)
        open(gate + ".shrink", "w").close()
        for r in range(4):
            procs[r].wait(timeout=240)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        coord.stop()
    assert [procs[r].returncode for r in range(4)] == [0, 0, EXIT_LEFT_ON_NOTICE, EXIT_LEFT_ON_NOTICE]
    _check_grown_and_shrunk(out, logs)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_job_grows_from_two_to_four_and_shrinks_back_on_etcd(tmp_path, etcd3):
    """The same on etcd with launchers: `run --replicas 2:4` starts replicas 0 and 1; a second launcher with
    `--add-replicas 2` gets ids 2 and 3 from the control plane; they are admitted at step 2's commit; then one
    leaves by its notice signal (injected) and the other by `lightning-recover leave --job`."""
    out = str(tmp_path / "run")
    gate = str(tmp_path / "gate")
    job = f"grow-{os.getpid()}-{time.monotonic_ns()}"
    # The launchers of one job share its secret (never in etcd), and so does the operator's leave request.
    plane_env = dict(etcd3.environment(), LIGHTNING_RECOVER_SECRET_FILE=JobSecret.generate().write_file(str(tmp_path)))
    base = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "2:4"]
    base += ["--heartbeat-timeout", str(GROW_HEARTBEAT_TIMEOUT)]
    base += ["--job", job]
    script = ["--", *_grow_args(out, gate)]
    a, log_a = start_job(base + script, str(tmp_path / "a"), plane_env)
    b = None
    try:
        assert wait_for(lambda: _applied(out, 0) == [0, 1], 240), open(log_a).read()[-3000:]
        inject = {"LIGHTNING_RECOVER_INJECT": "notice:replica=2:step=4:phase=backward"}
        b_env = {**plane_env, **inject}
        b, log_b = start_job(base + ["--add-replicas", "2"] + script, str(tmp_path / "b"), b_env)
        assert wait_for(lambda: open(log_b).read().count("asks to join") == 2, 540), open(log_b).read()[-3000:]
        assert "assigned replica ids [2, 3]" in open(log_b).read()
        open(gate + ".grow", "w").close()
        assert wait_for(lambda: 3 in _applied(out, 3), 120), open(log_b).read()[-3000:]
        leave = [sys.executable, "-m", "lightning_recover.cli", "leave", "--replica", "3", "--job", job]
        leave_env = dict(os.environ, PYTHONPATH=ROOT, **plane_env)
        done = subprocess.run(leave, capture_output=True, text=True, timeout=60, env=leave_env)
        assert done.returncode == 0, done.stderr
        assert wait_for(lambda: "told to leave (leave request)" in open(log_b).read(), 30)
        open(gate + ".shrink", "w").close()
        b.wait(timeout=240)
        a.wait(timeout=240)
    finally:
        kill_group(a)
        if b is not None:
            kill_group(b)
    assert a.returncode == 0, open(log_a).read()[-3000:]
    assert b.returncode == EXIT_LEFT_ON_NOTICE, open(log_b).read()[-3000:]  # both its replicas left on notice
    _check_grown_and_shrunk(out, {0: log_a, 1: log_a, 2: log_b, 3: log_b})


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_graceful_leave_under_the_trainer(tmp_path):
    """The Trainer strategy: replica 1 gets its notice in step 2 (the Trainer's own SIGTERM handler, which
    would end the fit after the batch with status 0, is replaced by the strategy's); it leaves at step 2's
    commit, nothing is recomputed, the survivors end bitwise equal to the exact single-process run."""
    from tests.integration.test_trainer_strategy import _single_process, assert_parameters
    from tests.jobs import trainer_job

    steps, batch_size = 7, 16
    truth = _single_process(steps=steps, batch_size=batch_size, exact=True)
    result = trainer_job(
        str(tmp_path),
        steps=steps,
        inject="notice:replica=1:step=2:phase=backward",
        extra=["--batch-size", str(batch_size), "--exact"],
    )
    assert result.returncode == 0, result.output[-4000:]
    assert "replica 1 left on notice" in result.output
    states = assert_parameters(result, truth["state"], survivors=[0, 2], steps=steps, exact=True)
    for data in states.values():
        assert [s["recomputed"] for s in data["stats"]] == [0] * steps
        assert [s["live_replicas"] for s in data["stats"]] == [3, 3, 3, 2, 2, 2, 2]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_whole_job_notice_under_the_trainer_writes_lightnings_hpc_checkpoint(tmp_path):
    """Every replica of a Trainer job gets its notice in step 2: they commit it and leave together after the final
    checkpoint, Lightning's HPC checkpoint in default_root_dir (written through the strategy's save), and the job
    exits 75. The next run, under the variables by which Lightning knows a Slurm job, resumes from it by Lightning's
    own rule for a requeued job (``fit`` without a ``ckpt_path``) and ends bitwise equal to the exact
    single-process run."""
    from tests.integration.test_trainer_strategy import _single_process, assert_parameters
    from tests.jobs import trainer_job

    steps, batch_size = 6, 16
    truth = _single_process(steps=steps, batch_size=batch_size, exact=True)
    first = str(tmp_path / "first")
    notices = ",".join(f"notice:replica={r}:step=2:phase=backward" for r in range(3))
    args = ["--batch-size", str(batch_size), "--exact"]
    result = trainer_job(first, steps=steps, inject=notices, extra=args)
    assert result.returncode == EXIT_LEFT_ON_NOTICE, result.output[-4000:]
    assert "the whole job left, final checkpoint written" in result.output, result.output[-4000:]
    assert sorted(n for n in os.listdir(first) if n.startswith("hpc_ckpt_")) == ["hpc_ckpt_1.ckpt"]
    saved = torch.load(os.path.join(first, "hpc_ckpt_1.ckpt"), map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3, saved["global_step"]  # steps 0-2 applied, none after
    slurm = {"SLURM_NTASKS": "3", "SLURM_JOB_NAME": "requeued"}  # what SLURMEnvironment.detect() reads
    again = trainer_job(str(tmp_path / "again"), steps=steps, extra=args + ["--root-dir", first], env=slurm)
    assert again.returncode == 0, again.output[-4000:]
    assert "Restored all states from the checkpoint" in again.output
    states = assert_parameters(again, truth["state"], survivors=[0, 1, 2], steps=steps, exact=True)
    for data in states.values():
        assert [s["step"] for s in data["stats"]] == [3, 4, 5] and data["stats"][0]["redone"] == 0
