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

A job grows by a second batch job of the same name (``--replicas MIN:MAX``): its launcher finds the record
of a running job of that name, starts no coordinator, claims free replica ids from the running job's
coordinator (:mod:`~lightning_recover.protocol.growth`) and starts one replica per node of its own
allocation with them; each is admitted at a commit with the live state. A requeued run of the same Slurm
job finds its own job id in the record and starts afresh.

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
from lightning_recover.control_plane.connect import connect
from lightning_recover.control_plane.embedded import peek
from lightning_recover.errors import RecoverError
from lightning_recover.launch import coordinator_process
from lightning_recover.launch.process_tree import describe_exit
from lightning_recover.launch.user_command import user_command
from lightning_recover.protocol.growth import claim_free_id
from lightning_recover.protocol.messages import JobSecret, Sealer, read_death
from lightning_recover.protocol.notice import EXIT_LEFT_ON_NOTICE

#: Signals the batch process and its coordinator ignore: a replica's notice, which Slurm may also send to
#: the batch step; the control plane must stay up until the replicas' last commit.
IGNORED_IN_BATCH = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


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


def job_running(job_id: str) -> bool:
    """Whether Slurm job ``job_id`` is running (``squeue``); False when squeue cannot tell."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.split() == ["RUNNING"]


def replica_environment(replica: int, coordinator: str, replicas: str, secret_file: str) -> dict:
    """The variables replica ``replica``'s process gets (on top of the batch's environment)."""
    return {
        env.COORDINATOR: coordinator,
        env.REPLICA: str(replica),
        env.REPLICAS: replicas,
        env.SECRET_FILE: secret_file,
        env.OMP_NUM_THREADS: os.environ.get(env.OMP_NUM_THREADS, "1"),
    }


def srun_argv(job: SlurmJob, node: str, command: Sequence[str]) -> list[str]:
    """One job step that runs ``command`` once, on ``node``."""
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--job-name={job.name}",
        "--kill-on-bad-exit=0",
        "--export=ALL",
        *command,
    ]


class SlurmLauncher:
    """The batch process: the coordinator on this node, then one srun step per replica; see the module doc.

    Args:
        job: the batch job (:meth:`SlurmJob.from_env`).
        command: what each replica runs.
        replicas: ``"N"`` or ``"MIN:MAX"`` (default: one per node); a job of MIN:MAX starts one replica per
            node, at most MAX, and later jobs of its name add more.
        heartbeat_timeout: seconds without heartbeat before the coordinator declares a replica dead.
        state_dir: where the job's record lives (default: ``$SLURM_SUBMIT_DIR/.lightning-recover``).
        host: the address the coordinator binds (default: the batch node's).
        port: its port (0: any free one).

    Raises:
        SlurmError: a shape the allocation cannot run, or a name that does not resolve (with a HINT).
    """

    def __init__(
        self,
        job: SlurmJob,
        command: Sequence[str],
        *,
        replicas: Optional[str] = None,
        heartbeat_timeout: float = 5.0,
        state_dir: Optional[str] = None,
        host: Optional[str] = None,
        port: int = 0,
    ) -> None:
        self.job = job
        self.command = list(command)
        try:
            self.least, self.most = env.replica_range(replicas if replicas is not None else str(len(job.nodes)))
        except ValueError as exc:
            raise SlurmError(f"--{exc}") from None
        if self.least == self.most and self.most > len(job.nodes):
            raise SlurmError(
                f"--replicas {self.most} but the allocation has {len(job.nodes)} nodes (one replica per node). "
                f"HINT: sbatch --nodes={self.most}, or fewer --replicas (MIN:MAX to admit more later)"
            )
        self.heartbeat_timeout = heartbeat_timeout
        self.record = JobRecord(state_dir or os.path.join(job.submit_dir, ".lightning-recover"), job.name)
        self.host = host or node_address(job.batch_node)
        self.port = port
        self.steps: dict[int, subprocess.Popen] = {}

    @property
    def replica_range(self) -> str:
        return str(self.most) if self.least == self.most else f"{self.least}:{self.most}"

    def run(self) -> int:
        """Run the job to its end; return 0 if a replica finished, else the replicas' exit code."""
        if os.environ.get(env.CONTROL_PLANE, "embedded").strip() not in ("", "embedded"):
            raise SlurmError(
                f"{env.CONTROL_PLANE}={os.environ[env.CONTROL_PLANE]!r}: this launcher runs the embedded coordinator "
                f"on the batch node. HINT: unset {env.CONTROL_PLANE} in the job's environment"
            )
        for sig in IGNORED_IN_BATCH:  # inherited by the coordinator, which ignores them as well
            signal.signal(sig, signal.SIG_IGN)
        running = self.record.read()
        if running is not None and running.get("slurm_job") != self.job.job_id and job_running(running["slurm_job"]):
            return self._grow(running)
        self.record.prepare()
        coordinator = coordinator_process.start(
            self.most, self.heartbeat_timeout, host=self.host, port=self.port, secret_file=self.record.secret_file
        )
        ids = list(range(min(len(self.job.nodes), self.most)))
        try:
            self.record.write(self.job.job_id, coordinator.addr, self.replica_range)
            _say(
                f"job {self.job.name} (Slurm job {self.job.job_id}, run {self.job.restart_count + 1}): coordinator at "
                f"{coordinator.addr} on {self.job.batch_node}; replicas {ids} on {', '.join(self.job.nodes[: len(ids)])} "
                f"(the job: {self.replica_range})"
            )
            codes = self._run_steps(ids, coordinator.addr, self.replica_range, coordinator)
            if coordinator.running():
                self._outlive_other_replicas(coordinator.addr)
        finally:
            self.record.clear(self.job.job_id)
            self._end_steps()
            coordinator.kill()  # SIGTERM is ignored (see IGNORED_IN_BATCH); it has nothing to finalize
            coordinator.proc.wait()
        return job_exit_code(codes)

    def _grow(self, running: dict[str, Any]) -> int:
        """A later job of the same name: claim free ids from the running job's coordinator, start them here."""
        address, replica_range = running["coordinator"], str(running["replicas"])
        most = env.replica_range(replica_range)[1]
        try:
            store = connect(address, timeout=max(10.0, 2 * self.heartbeat_timeout + 1))
            sealer = Sealer(JobSecret.from_file(self.record.secret_file))
            ids: list[int] = []
            for r in range(most):  # the lowest free ids, one per node of this allocation
                if len(ids) < len(self.job.nodes) and claim_free_id(store, sealer, r):
                    ids.append(r)
        except (OSError, RuntimeError, RecoverError) as exc:
            raise SlurmError(
                f"job {self.job.name}: Slurm job {running['slurm_job']} runs it, but its coordinator at {address} "
                f"did not answer ({exc}). HINT: give this job another --job-name to start a job of its own"
            ) from None
        if not ids:
            raise SlurmError(
                f"job {self.job.name} runs its {most} replicas already (Slurm job {running['slurm_job']}). HINT: "
                "start the job with a larger MAX (--replicas MIN:MAX), or this one under another --job-name"
            )
        _say(
            f"job {self.job.name} runs in Slurm job {running['slurm_job']} (coordinator {address}): this job adds "
            f"replicas {ids} on {', '.join(self.job.nodes[: len(ids)])}"
        )
        try:
            return job_exit_code(self._run_steps(ids, address, replica_range, None))
        finally:
            self._end_steps()

    def _run_steps(self, ids: Sequence[int], address: str, replica_range: str, coordinator: Any) -> dict[int, int]:
        for node, r in zip(self.job.nodes, ids):
            extra = replica_environment(r, address, replica_range, self.record.secret_file)
            self.steps[r] = subprocess.Popen(srun_argv(self.job, node, self.command), env={**os.environ, **extra})
            _say(f"replica {r}: srun on {node} (pid {self.steps[r].pid})")
        nodes = dict(zip(ids, self.job.nodes))
        codes: dict[int, int] = {}
        said_lost = False
        while len(codes) < len(self.steps):
            for r, proc in self.steps.items():
                if r not in codes and proc.poll() is not None:
                    codes[r] = proc.returncode
                    _say(f"replica {r} on {nodes[r]}: {describe_exit(proc.returncode)}")
            if coordinator is not None and not said_lost and not coordinator.running():
                said_lost = True
                _say(f"the coordinator ended ({coordinator.exited()}); the replicas stop within their store timeout")
            time.sleep(0.1)
        return codes

    def _outlive_other_replicas(self, address: str) -> None:
        """Keep the coordinator while replicas that later jobs of this name added still run: until every
        incarnation that started is over (left cleanly, or declared dead by the coordinator's monitor, which
        bounds the wait by its heartbeat and hang timeouts)."""
        try:
            store = connect(address, timeout=10.0)
            sealer = Sealer(JobSecret.from_file(self.record.secret_file))

            def running() -> list[int]:
                started = [(r, int(store.add(f"inc/{r}", 0))) for r in range(self.most)]
                return [r for r, inc in started if read_death(sealer, r, peek(store, f"dead/{r}") or b"") < inc]

            live = running()
            if live:
                _say(
                    f"replicas {live} of later jobs of {self.job.name} still run: the coordinator stays until they end"
                )
            while live:
                time.sleep(0.2)
                live = running()
        except (OSError, RuntimeError, RecoverError) as exc:
            _say(f"cannot read the coordinator ({exc}); ending it")

    def _end_steps(self) -> None:
        for proc in self.steps.values():
            if proc.poll() is None:
                proc.kill()  # srun: Slurm ends the step's tasks
                proc.wait()


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
    command = user_command(
        args.command, "lightning-recover slurm: give the command, e.g. lightning-recover slurm python train.py"
    )
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
        default=None,
        metavar="N|MIN:MAX",
        help="replicas (default: one per node of the allocation); MIN:MAX: a job that a later batch job of the "
        "same --job-name grows up to MAX",
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
