"""Slurm as a launcher (``lightning-recover slurm``, examples/slurm/recover.sbatch), on a real Slurm cluster:
slurmctld and one slurmd per network-namespace node (tests/slurm_cluster.py), one cluster for the whole file.

Each job runs tests/scripts/fabric_train.py in exact mode, one replica per node, and every replica that
finishes must hold parameters ``torch.equal`` to the failure-free run computed here. The fast tests check
the SLURM_* handling and Lightning's cluster environment without a cluster.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from lightning_recover.launch import slurm
from tests.jobs import FABRIC_SCRIPT, ROOT
from tests.jobs import wait_for as wait_until
from tests.slurm_cluster import SlurmCluster

SBATCH = os.path.join(ROOT, "examples", "slurm", "recover.sbatch")
NODES = ["n0", "n1", "n2"]
M = 6
HEARTBEAT_TIMEOUT = 2.0


# ---------------------------------------------------------------------------- without a cluster


def test_job_exit_code_says_whether_a_replica_finished():
    assert slurm.job_exit_code({0: 0, 1: -9}) == 0  # a replica finished: the job did
    assert slurm.job_exit_code({0: 75, 1: 75}) == slurm.EXIT_LEFT_ON_NOTICE  # all left on a notice: requeue
    assert slurm.job_exit_code({0: 75, 1: -9}) == 128 + 9  # one left, the other was killed: a failure
    assert slurm.job_exit_code({0: 3, 1: 75}) == 3


def test_outside_a_batch_job_the_launcher_says_how_to_submit(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(slurm.SlurmError, match=r"not inside a Slurm batch job .* HINT: submit it: sbatch --nodes=N"):
        slurm.SlurmJob.from_env()


def test_replica_variables_and_step_of_each_node(tmp_path):
    job = slurm.SlurmJob("17", "llm", ("n4", "n7"), "n4", str(tmp_path), 0)
    variables = slurm.replica_environment(1, "10.0.0.4:4000", "2", "/shared/job.secret")
    assert variables["LIGHTNING_RECOVER_REPLICA"] == "1"
    assert variables["LIGHTNING_RECOVER_COORDINATOR"] == "10.0.0.4:4000"
    assert variables["LIGHTNING_RECOVER_REPLICAS"] == "2"
    argv = slurm.srun_argv(job, "n7", ["python", "train.py"])
    assert argv[0] == "srun" and "--nodelist=n7" in argv and "--ntasks=1" in argv
    assert argv[-2:] == ["python", "train.py"]
    with pytest.raises(slurm.SlurmError, match="HINT: sbatch --nodes=3"):
        slurm.SlurmLauncher(job, ["python"], replicas="3", host="127.0.0.1")
    growing = slurm.SlurmLauncher(job, ["python"], replicas="2:4", host="127.0.0.1")  # later jobs add the rest
    assert growing.replica_range == "2:4" and (growing.least, growing.most) == (2, 4)
    with pytest.raises(slurm.SlurmError, match="HINT: e.g. 4, or 2:4"):
        slurm.SlurmLauncher(job, ["python"], replicas="4:2", host="127.0.0.1")


def test_a_requeued_run_replaces_its_own_record_and_a_later_job_reads_it(tmp_path):
    record = slurm.JobRecord(str(tmp_path), "llm")
    record.prepare()
    assert oct(os.stat(record.dir).st_mode & 0o777) == "0o700"
    assert oct(os.stat(record.secret_file).st_mode & 0o777) == "0o600"
    record.write("17", "10.0.0.4:4000", "2")
    assert slurm.JobRecord(str(tmp_path), "llm").read()["coordinator"] == "10.0.0.4:4000"
    record.clear("18")  # another job's end leaves it
    assert record.read() is not None
    record.clear("17")
    assert record.read() is None


def test_strategies_bring_their_cluster_environment_and_no_srun_warning(tmp_path, monkeypatch):
    """Where srun is installed, Lightning's own detection warns in a process srun did not start; the recover
    strategies bring their cluster environment, so neither Fabric nor the Trainer detects Slurm's."""
    import lightning as L
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    from lightning_recover import RecoverStrategy, RecoverTrainerStrategy
    from lightning_recover.lightning.environment import SRUN_HINT, RecoverEnvironment

    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    for each in (fabric_rank_zero_only, rank_zero_only, utils_rank_zero_only):  # ranks.set_rank_zero's three
        monkeypatch.setattr(each, "rank", 0)  # Lightning warns on rank 0 only; an earlier test may have moved it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Fabric(strategy="ddp", devices=2, accelerator="cpu")  # the warning, where srun is installed
    assert any(SRUN_HINT in str(w.message) for w in seen), "the check must see a warning Lightning gives here"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fabric = L.Fabric(strategy=RecoverStrategy(microbatches=4), devices=2, accelerator="cpu")
        trainer = L.Trainer(strategy=RecoverTrainerStrategy(microbatches=4), devices=2, accelerator="cpu", logger=False)
    assert not [w for w in seen if issubclass(w.category, PossibleUserWarning) and SRUN_HINT in str(w.message)]
    assert isinstance(fabric.strategy.cluster_environment, RecoverEnvironment)
    assert isinstance(trainer.strategy.cluster_environment, RecoverEnvironment)


# ---------------------------------------------------------------------------- on a real cluster


@pytest.mark.slow
def test_slurm_harness_runs_tasks_in_the_nodes_and_leaves_nothing(tmp_path):
    """A one-node cluster: srun runs a task inside the node's namespace (its hostname, its address, names from
    the cluster's /etc/hosts, a name outside them failing at once); afterwards no namespace, link, daemon or
    munge socket of it is left."""
    import subprocess

    with SlurmCluster(["solo"], str(tmp_path / "c")) as made:
        assert made.node_states() == {"solo": "idle"}
        script = "hostname; getent hosts ctl; getent hosts no-such-host || echo missing"
        out = made.run(["srun", "-N1", "-n1", "sh", "-c", script], timeout=60).stdout.split()
        assert out[0] == "solo" and out[1:3] == [made.hosts.addr["ctl"], "ctl"] and out[-1] == "missing", out
        tag, work, sock = made.hosts.tag, made.dir, made.sock_dir
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if work.encode() in cmdline or sock.encode() in cmdline:
            left.append(pid)
    assert not left, f"processes of the cluster left: {left}"
    assert not os.path.exists(sock)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with SlurmCluster(NODES, str(tmp_path_factory.mktemp("slurm"))) as made:
        yield made


class SlurmJobRun:
    """One batch job of examples/slurm/recover.sbatch running tests/scripts/fabric_train.py."""

    def __init__(
        self, cluster: SlurmCluster, out: str, name: str, nodes: int, steps: int, extra=(), env=None, **options
    ):
        """``options``: ``sbatch`` (more sbatch arguments), ``launcher`` (more ``lightning-recover slurm``
        arguments), ``devices`` (the script's replicas, default ``nodes``)."""
        self.cluster, self.out, self.name, self.steps = cluster, out, name, steps
        os.makedirs(out, exist_ok=True)
        venv_bin = os.path.dirname(sys.executable)
        self.env = cluster.env(
            PATH=f"{venv_bin}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {})
        )
        args = [f"--nodes={nodes}", f"--job-name={name}", f"--output={out}/slurm-%j.out", f"--chdir={out}"]
        args += [*options.get("sbatch", ()), SBATCH, *options.get("launcher", ())]
        args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--state-dir", os.path.join(out, "state")]
        devices = options.get("devices", nodes)
        args += [sys.executable, FABRIC_SCRIPT, out, "--replicas", str(devices), "--steps", str(steps)]
        args += ["--microbatches", str(M), "--exact", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), *extra]
        self.id = cluster.sbatch(args, env=self.env)

    def output(self) -> str:
        path = os.path.join(self.out, f"slurm-{self.id}.out")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def applied(self, r: int) -> int:
        path = os.path.join(self.out, f"steps{r}.log")
        return len(open(path).read().split()) if os.path.exists(path) else 0

    def wait_end(self, timeout: float) -> dict[str, str]:
        self.cluster.wait_state(self.id, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT"}, timeout)
        return self.cluster.job(self.id)

    def dump(self) -> str:
        return f"----- job {self.id}\n{self.output()[-5000:]}\n----- slurmctld\n{self.cluster.log('slurmctld.log')[-2000:]}"


def _assert_equal_to_reference(out: str, replicas: list[int], steps: int, dump: str = "") -> list[dict]:
    import torch

    from tests.scripts.fabric_train import reference_state

    reference = reference_state(steps, M, exact=True)
    results = []
    for r in replicas:
        path = os.path.join(out, f"replica{r}.pt")
        assert os.path.exists(path), f"replica {r} did not finish\n{dump}"
        data = torch.load(path, weights_only=False)
        for key, value in reference.items():
            assert torch.equal(data["state"][key], value), f"replica {r}'s {key} differs from the failure-free run"
        results.append(data)
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_job_of_two_nodes_equals_the_failure_free_run(cluster, tmp_path):
    """sbatch --nodes=2 examples/slurm/recover.sbatch python train.py: the coordinator on the batch node, one
    replica per node in a step of its own; both finish on the failure-free trajectory and the job COMPLETES."""
    steps = 6
    job = SlurmJobRun(cluster, str(tmp_path / "job"), f"plain{os.getpid()}", nodes=2, steps=steps)
    record = job.wait_end(300)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", job.dump()
    output = job.output()
    assert "coordinator at" in output and "replicas [0, 1] on n0, n1 (the job: 2)" in output, job.dump()
    assert "The `srun` command is available" not in output, "no spurious srun warning in the replicas"
    for data in _assert_equal_to_reference(job.out, [0, 1], steps):
        assert all(s["live_replicas"] == 2 for s in data["stats"]), "both replicas trained every step"
    assert not os.path.exists(os.path.join(job.out, "state", job.name, "coordinator.json")), "record cleared"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_node_loss_survivors_go_on(cluster, tmp_path):
    """Three nodes; once every replica applied step 3, node n2 is lost: every process in its namespace (its
    slurmd, job step and replica) SIGKILLed and the node set DOWN. The allocation says --no-kill, so Slurm
    keeps the job; the survivors recompute n2's microbatches and finish equal to the failure-free run."""
    steps = 10
    gate = str(tmp_path / "go")
    job = SlurmJobRun(cluster, str(tmp_path / "job"), f"loss{os.getpid()}", 3, steps, extra=["--hold", f"4:{gate}"])
    assert wait_until(lambda: all(job.applied(r) >= 4 for r in range(3)), 300, 0.1), job.dump()
    cluster.lose_node("n2")
    open(gate, "w").close()
    try:
        record = job.wait_end(300)
        assert record["JobState"] == "COMPLETED", job.dump()
        assert "replica 2 on n2" in job.output(), job.dump()
        survivors = _assert_equal_to_reference(job.out, [0, 1], steps)
        live = [s["live_replicas"] for s in survivors[0]["stats"]]
        assert live[:4] == [3] * 4 and live[-1] == 2, f"three replicas, then two after the loss: {live}"
        assert any(s["recomputed"] for s in survivors[0]["stats"]), "n2's microbatches were recomputed"
    finally:
        cluster.revive_node("n2")  # the next test has three nodes again


def _step_of_node(cluster: SlurmCluster, job: str, node: str) -> str:
    """The id (JOB.STEP) of the job step running on ``node`` (one replica per step)."""
    out = cluster.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %N"]).stdout
    found = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [node] and "batch" not in line]
    assert len(found) == 1, f"one step of job {job} on {node}: {out}"
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_notice_to_one_step_is_a_graceful_leave(cluster, tmp_path):
    """`scancel --signal=TERM JOBID.STEP` (the notice signal SIGTERM for this job) reaches replica 2 alone,
    while it waits before step 4: it finishes step 4 with the others and leaves (exit code 75); steps 5.. are
    planned without it; nothing is recomputed, and the survivors end equal to the failure-free run."""
    steps = 8
    gate = str(tmp_path / "go")
    job = SlurmJobRun(
        cluster,
        str(tmp_path / "job"),
        f"notice{os.getpid()}",
        3,
        steps,
        extra=["--hold", f"4:{gate}"],
        env={"LIGHTNING_RECOVER_NOTICE_SIGNAL": "SIGTERM"},
    )
    assert wait_until(lambda: all(job.applied(r) >= 4 for r in range(3)), 300, 0.1), job.dump()
    step = _step_of_node(cluster, job.id, "n2")
    # Slurm 22.05's scancel delivers a step's signal, then reports "Invalid job id" for the step: its exit
    # code says nothing here; what the replica does with the signal is what is checked below.
    cluster.run(["scancel", "--signal=TERM", step], check=False)
    open(gate, "w").close()
    record = job.wait_end(300)
    assert record["JobState"] == "COMPLETED", job.dump()
    assert "replica 2 on n2: exit code 75" in job.output(), job.dump()
    survivors = _assert_equal_to_reference(job.out, [0, 1], steps)
    stats = survivors[0]["stats"]
    assert [s["live_replicas"] for s in stats] == [3] * 5 + [2] * 3, "replica 2 took part in step 4, then left"
    assert not any(s["recomputed"] for s in stats), "a notice recomputes nothing"
    assert job.applied(2) == 5, "replica 2 applied steps 0..4"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_whole_job_notice_then_requeue_resumes_from_the_final_checkpoint(cluster, tmp_path):
    """Two nodes. `scancel --signal=USR1 JOBID` (what `#SBATCH --signal=USR1@120` sends before the time limit)
    reaches every replica while they wait before step 3: they finish step 3 together, write the final
    checkpoint and exit 75, and so does the batch step. `scontrol requeue` runs the job again; its replicas
    resume from that checkpoint at step 4 and finish equal to the failure-free run."""
    steps = 7
    gate = str(tmp_path / "go")
    checkpoint = str(tmp_path / "notice.ckpt")
    job = SlurmJobRun(
        cluster,
        str(tmp_path / "job"),
        f"requeue{os.getpid()}",
        2,
        steps,
        extra=["--hold", f"3:{gate}", "--notice-checkpoint", checkpoint],
    )
    assert wait_until(lambda: all(job.applied(r) >= 3 for r in range(2)), 300, 0.1), job.dump()
    cluster.run(["scancel", "--signal=USR1", job.id])
    # slurmd delivers the signal on its own time: open the gate once it reached both (else one takes step 3 alone)
    noticed = [os.path.join(job.out, f"notice{r}") for r in range(2)]
    assert wait_until(lambda: all(map(os.path.exists, noticed)), 120, 0.05), job.dump()
    open(gate, "w").close()
    record = job.wait_end(300)
    assert record["ExitCode"] == "75:0", f"the job left on notice: {record}\n{job.dump()}"
    assert os.path.exists(checkpoint), job.dump()
    assert all(job.applied(r) == 4 for r in range(2)), "both applied steps 0..3, then left"
    cluster.run(["scontrol", "requeue", job.id])
    # Slurm starts the requeued job once its nodes no longer refuse the first run's revoked credential
    # (cred_expire); forcing an earlier start makes it fail with "Job credential revoked".
    record = job.wait_end(300)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", f"{record}\n{job.dump()}"
    assert "resumed from the notice checkpoint" in job.output(), job.dump()
    for data in _assert_equal_to_reference(job.out, [0, 1], steps):
        assert data["stats"][0]["step"] == 4, "the requeued run started after the checkpoint's step"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_second_job_of_the_same_name_grows_the_job(cluster, tmp_path):
    """`--replicas 2:3`: a job of two nodes trains; a second batch job of the same name on the third node finds
    the first one's record, claims the free replica id 2 from its coordinator and starts it there; the newcomer
    is admitted at a commit with the live state, and all three finish equal to the failure-free run."""
    steps = 8
    gate = str(tmp_path / "go")
    out, name = str(tmp_path / "job"), f"grow{os.getpid()}"
    # Before step 6 the members wait until the newcomer applied a step of its own (its steps log exists): they
    # must not finish the run while it is being admitted (it asks before step 3, so commits 3..5 can admit it).
    holds = f"3:{gate},6:{tmp_path / 'job' / 'steps2.log'}"
    common = dict(extra=["--hold", holds], launcher=["--replicas", "2:3"], devices=3)
    first = SlurmJobRun(cluster, out, name, 2, steps, sbatch=["--nodelist=n0,n1"], **common)
    assert wait_until(lambda: all(first.applied(r) >= 3 for r in range(2)), 300, 0.1), first.dump()
    second = SlurmJobRun(cluster, out, name, 1, steps, sbatch=["--nodelist=n2"], **common)
    asked = "replica 2: asks to join at the next commit"
    assert wait_until(lambda: asked in second.output(), 300, 0.1), second.dump()
    assert "this job adds replicas [2] on n2" in second.output(), second.dump()
    open(gate, "w").close()
    for job in (first, second):
        record = job.wait_end(300)
        assert record["JobState"] == "COMPLETED", job.dump()
    states = _assert_equal_to_reference(out, [0, 1, 2], steps, first.dump() + second.dump())
    live = [s["live_replicas"] for s in states[0]["stats"]]
    assert live[0] == 2 and live[-1] == 3, f"two replicas, then three after the newcomer's admission: {live}"
    assert states[2]["stats"][0]["step"] > 0, "the newcomer started mid-run, from the live state"
