"""Slurm as a launcher: one replica per node of an allocation, the job's shape from SLURM_* variables.

    sbatch --nodes=4 examples/slurm/recover.sbatch python train.py --lr 1e-3
    # the batch script runs: lightning-recover slurm python train.py --lr 1e-3

``lightning-recover slurm`` runs on the batch node (the first node of the allocation, where Lightning's
``SLURMEnvironment`` puts its main address too). It starts the job's coordinator there, bound to that
node's address, and one ``srun`` job step per node, each running COMMAND as one replica: the replica id is
the node's position in ``SLURM_JOB_NODELIST`` (the ``SLURM_NODEID`` it has in the allocation). One step
per replica rather than one step of N tasks, so that each replica is a step of its own: its exit code is
its own (the job succeeds when a replica finished, as under ``lightning-recover run``), a node's loss ends
only that node's step, and ``scancel --signal=SIG JOBID.STEP`` reaches one replica (a notice to that
replica alone) while ``scancel --signal=SIG JOBID`` and ``sbatch --signal=SIG@GRACE`` reach them all. The
allocation must say ``--no-kill`` (the example does): without it Slurm cancels the whole job when a node
fails, survivors included.

The job's record lives in a directory named after the job (``SLURM_JOB_NAME``) under the submit directory
(``.lightning-recover/NAME``, 0700; ``--state-dir`` moves it): the job secret and the coordinator's
address. The nodes read the secret from there, so that directory must be on a file system every node
sees (the submit directory usually is).

The batch process ignores the notice signals a replica takes (SIGTERM, SIGUSR1, ...) and its coordinator the
user signals: Slurm's ``--signal=B:USR1@GRACE`` and ``scancel --batch`` signal the whole batch step, whose
``srun`` processes forward the signal to the replicas, and the control plane must outlive their last step.
(A SIGTERM to the batch step is Slurm's hard end: ``srun`` then kills its tasks at once.) The batch process
ends the coordinator when every step has ended.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_recover import env
from lightning_recover.launch import coordinator_process
from lightning_recover.launch.process_tree import describe_exit

#: Signals the batch process and its coordinator ignore: a replica's notice, which Slurm may also send to
#: the batch step; the control plane must stay up until the replicas' last commit.
IGNORED_IN_BATCH = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
#: Exit code of a replica that left on a preemption notice (protocol/notice.py): not a failure.
EXIT_LEFT_ON_NOTICE = 75


class SlurmError(ValueError):
    """Not inside a Slurm batch job, or its variables do not describe one; the message has a HINT."""


def _say(line: str) -> None:
    print(f"[lightning-recover slurm] {line}", file=sys.stderr, flush=True)


def expand_node_list(node_list: str) -> list[str]:
    """Slurm's compact node list (``n[0-3],gpu7``) as names, in the allocation's order (``scontrol show
    hostnames``, so every form Slurm writes is understood as Slurm understands it)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", node_list], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SlurmError(
            f"cannot expand SLURM_JOB_NODELIST={node_list!r} with `scontrol show hostnames` ({exc}). HINT: run "
            "inside a Slurm job, on a node where Slurm's client commands are installed"
        ) from None
    return out.split()


@dataclass(frozen=True)
class SlurmJob:
    """What a batch job's SLURM_* variables say about it."""

    job_id: str
    name: str
    nodes: tuple[str, ...]  # in the allocation's order: node i runs replica i
    batch_node: str
    submit_dir: str
    restart_count: int  # how often Slurm requeued it (0: the first run)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> SlurmJob:
        """Read the job from ``environ``.

        Raises:
            SlurmError: outside a Slurm batch job, with a HINT on how to start one.
        """
        missing = [v for v in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST") if not environ.get(v)]
        if missing:
            raise SlurmError(
                f"not inside a Slurm batch job ({' and '.join(missing)} unset). HINT: submit it: "
                "sbatch --nodes=N examples/slurm/recover.sbatch python train.py"
            )
        nodes = tuple(expand_node_list(environ["SLURM_JOB_NODELIST"]))
        if not nodes:
            raise SlurmError(f"SLURM_JOB_NODELIST={environ['SLURM_JOB_NODELIST']!r} names no node")
        return cls(
            job_id=environ["SLURM_JOB_ID"],
            name=environ.get("SLURM_JOB_NAME") or f"job-{environ['SLURM_JOB_ID']}",
            nodes=nodes,
            batch_node=environ.get("SLURMD_NODENAME") or nodes[0],
            submit_dir=environ.get("SLURM_SUBMIT_DIR") or os.getcwd(),
            restart_count=int(environ.get("SLURM_RESTART_COUNT") or 0),
        )


class JobRecord:
    """A job name's directory: the job secret and, while a batch job runs its coordinator, where it listens.

    A later batch job of the same name reads it (a job that grows); a requeued run of the same Slurm job
    finds its own id there and starts afresh.
    """

    def __init__(self, state_dir: str, name: str) -> None:
        self.dir = os.path.join(os.path.abspath(state_dir), name)
        self.secret_file = os.path.join(self.dir, "job.secret")
        self.path = os.path.join(self.dir, "coordinator.json")

    def prepare(self) -> None:
        """Make the directory (0700) and a fresh secret (0600), replacing an older one atomically."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        tmp = f"{self.secret_file}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
        os.replace(tmp, self.secret_file)

    def read(self) -> Optional[dict[str, Any]]:
        try:
            with open(self.path) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def write(self, job_id: str, coordinator: str, replicas: str) -> None:
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"slurm_job": job_id, "coordinator": coordinator, "replicas": replicas}, f)
        os.replace(tmp, self.path)

    def clear(self, job_id: str) -> None:
        """Remove the coordinator's address if ``job_id`` wrote it (the job's coordinator is gone)."""
        found = self.read()
        if found is not None and found.get("slurm_job") == job_id:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def node_address(node: str) -> str:
    """The IPv4 address ``node`` resolves to (the batch node's, for the coordinator to bind)."""
    try:
        return socket.gethostbyname(node)
    except OSError as exc:
        raise SlurmError(
            f"the node name {node!r} does not resolve ({exc}). HINT: give the address to bind with --host"
        ) from None


def replica_environment(job: SlurmJob, replica: int, coordinator: str, replicas: str, secret_file: str) -> dict:
    """The variables a replica process on node ``job.nodes[replica]`` gets (on top of the batch's environment)."""
    return {
        env.COORDINATOR: coordinator,
        env.REPLICA: str(replica),
        env.REPLICAS: replicas,
        env.SECRET_FILE: secret_file,
        env.OMP_NUM_THREADS: os.environ.get(env.OMP_NUM_THREADS, "1"),
    }


def srun_argv(job: SlurmJob, replica: int, command: Sequence[str]) -> list[str]:
    """One job step that runs ``command`` once, on the replica's node."""
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={job.nodes[replica]}",
        f"--job-name={job.name}",
        "--kill-on-bad-exit=0",
        "--export=ALL",
        *command,
    ]


class SlurmLauncher:
    """The batch process: the coordinator on this node, then one srun step per replica; see the module doc."""

    def __init__(
        self,
        job: SlurmJob,
        command: Sequence[str],
        *,
        replicas: Optional[int] = None,
        heartbeat_timeout: float = 5.0,
        state_dir: Optional[str] = None,
        host: Optional[str] = None,
        port: int = 0,
    ) -> None:
        self.job = job
        self.command = list(command)
        self.replicas = replicas if replicas is not None else len(job.nodes)
        if self.replicas > len(job.nodes):
            raise SlurmError(
                f"--replicas {self.replicas} but the allocation has {len(job.nodes)} nodes (one replica per node). "
                f"HINT: sbatch --nodes={self.replicas}, or fewer --replicas"
            )
        self.heartbeat_timeout = heartbeat_timeout
        self.record = JobRecord(state_dir or os.path.join(job.submit_dir, ".lightning-recover"), job.name)
        self.host = host or node_address(job.batch_node)
        self.port = port
        self.steps: dict[int, subprocess.Popen] = {}

    def run(self) -> int:
        """Run the job to its end; return 0 if a replica finished, else the replicas' exit code."""
        if os.environ.get(env.CONTROL_PLANE, "embedded").strip() not in ("", "embedded"):
            raise SlurmError(
                f"{env.CONTROL_PLANE}={os.environ[env.CONTROL_PLANE]!r}: this launcher runs the embedded coordinator "
                f"on the batch node. HINT: unset {env.CONTROL_PLANE} in the job's environment"
            )
        for sig in IGNORED_IN_BATCH:  # inherited by the coordinator, which ignores them as well
            signal.signal(sig, signal.SIG_IGN)
        self.record.prepare()
        coordinator = coordinator_process.start(
            self.replicas, self.heartbeat_timeout, host=self.host, port=self.port, secret_file=self.record.secret_file
        )
        try:
            self.record.write(self.job.job_id, coordinator.addr, str(self.replicas))
            _say(
                f"job {self.job.name} (Slurm job {self.job.job_id}, run {self.job.restart_count + 1}): coordinator at "
                f"{coordinator.addr} on {self.job.batch_node}, {self.replicas} replicas on {', '.join(self.job.nodes)}"
            )
            codes = self._run_steps(coordinator.addr, coordinator)
        finally:
            self.record.clear(self.job.job_id)
            for proc in self.steps.values():
                if proc.poll() is None:
                    proc.kill()  # srun: Slurm ends the step's tasks
                    proc.wait()
            coordinator.kill()  # SIGTERM is ignored (see IGNORED_IN_BATCH); it has nothing to finalize
            coordinator.proc.wait()
        return job_exit_code(codes)

    def _run_steps(self, address: str, coordinator: Any) -> dict[int, int]:
        for r in range(self.replicas):
            extra = replica_environment(self.job, r, address, str(self.replicas), self.record.secret_file)
            self.steps[r] = subprocess.Popen(srun_argv(self.job, r, self.command), env={**os.environ, **extra})
            _say(f"replica {r}: srun on {self.job.nodes[r]} (pid {self.steps[r].pid})")
        codes: dict[int, int] = {}
        said_lost = False
        while len(codes) < len(self.steps):
            for r, proc in self.steps.items():
                if r not in codes and proc.poll() is not None:
                    codes[r] = proc.returncode
                    _say(f"replica {r} on {self.job.nodes[r]}: {describe_exit(proc.returncode)}")
            if not said_lost and not coordinator.running():
                said_lost = True
                _say(f"the coordinator ended ({coordinator.exited()}); the replicas stop within their store timeout")
            time.sleep(0.1)
        return codes


def job_exit_code(codes: Mapping[int, int]) -> int:
    """0 when a replica finished; :data:`EXIT_LEFT_ON_NOTICE` when every replica left on a notice (a requeue
    resumes from the final checkpoint); else the first failure's code."""
    values = list(codes.values())
    if any(c == 0 for c in values):
        return 0
    if values and all(c == EXIT_LEFT_ON_NOTICE for c in values):
        return EXIT_LEFT_ON_NOTICE
    failed = [c for c in values if c != EXIT_LEFT_ON_NOTICE]
    return next((c if c > 0 else 128 - c for c in failed), 1)


def cmd_slurm(args: argparse.Namespace) -> int:
    """``lightning-recover slurm``: see :func:`add_subcommand`."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("lightning-recover slurm: give the command, e.g. lightning-recover slurm python train.py")
    try:
        launcher = SlurmLauncher(
            SlurmJob.from_env(),
            command,
            replicas=args.replicas,
            heartbeat_timeout=args.heartbeat_timeout,
            state_dir=args.state_dir,
            host=args.host,
            port=args.port,
        )
        return launcher.run()
    except SlurmError as exc:
        raise SystemExit(f"lightning-recover slurm: {exc}") from None


def add_subcommand(sub: Any) -> None:
    """Register ``lightning-recover slurm`` with the CLI's subparsers."""
    p = sub.add_parser(
        "slurm",
        help="inside a Slurm batch job: the coordinator here, one replica per node (srun)",
        description="Run COMMAND as one replica per node of this Slurm allocation: the coordinator on the batch "
        "node, one srun step per node. Submit it with examples/slurm/recover.sbatch (#SBATCH --no-kill). Exit "
        f"code 0 when a replica finished, {EXIT_LEFT_ON_NOTICE} when all left on a notice (requeue to resume).",
        epilog="example: sbatch --nodes=4 examples/slurm/recover.sbatch python train.py",
    )
    p.add_argument(
        "--replicas",
        type=coordinator_process.replica_count,
        default=None,
        help="replicas (default: one per node of the allocation)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=coordinator_process.heartbeat_timeout_seconds,
        default=5.0,
        help="seconds without heartbeat before a replica is declared dead (across nodes: several seconds)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        help="where the job's record and secret live, on a file system every node sees "
        "(default: $SLURM_SUBMIT_DIR/.lightning-recover)",
    )
    p.add_argument("--host", default=None, help="the address the coordinator binds (default: the batch node's)")
    p.add_argument("--port", type=coordinator_process.port_number, default=0, help="its port (0 = any free port)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="what each replica runs, e.g. python train.py")
    p.set_defaults(func=cmd_slurm)
