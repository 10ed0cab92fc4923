"""Helpers to run real multi-process jobs from tests: bounded in time, every process ended."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_recover.env import CONTROL_NICE, FORK_SERVER
from lightning_recover.launch.fork_server import ForkServer, Process, forkable
from lightning_recover.launch.process_tree import proc_stat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FABRIC_SCRIPT = os.path.join(ROOT, "tests", "scripts", "fabric_train.py")


@dataclass
class JobResult:
    returncode: int
    output: str
    out_dir: str

    def states(self) -> dict[int, dict]:
        """Final results of every replica that finished, by replica id."""
        results = {}
        for path in sorted(glob.glob(os.path.join(self.out_dir, "replica*.pt"))):
            data = torch.load(path, weights_only=False)
            results[data["replica"]] = data
        return results


def job_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test's job starts in: this one, the repository importable, ``extra`` on top."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # What the launchers set for their replicas: the same import-time environment lets one warm fork server
    # serve both a test's launcher and its replicas (tests/integration/conftest.py).
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if os.geteuid() == 0:  # as the test etcd members: the coordinator and launcher run before the replicas' compute
        env.setdefault(CONTROL_NICE, "-10")
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    env.update(extra or {})
    return env


def kill_group(proc: Process) -> None:
    """End the job's whole process group (supervisor, coordinator, replicas), by the leader's pid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    session = _sessions.pop(proc.pid, None)
    if session is not None:
        session.close()


def gloo_threads() -> set[str]:
    """The ids of this process's gloo threads (``gloo_tcp_loop``, ``pt_gloo_runloop``)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if "gloo" in f.read():
                    found.add(tid)
        except OSError:
            pass  # ended between the listing and the read
    return found


def two_rank_tensors() -> dict[str, torch.Tensor]:
    """The full tensors the two-rank scripts (:func:`two_rank_script`) shard, rebuilt the same in any process."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(10, generator=g).to(torch.bfloat16)}


# The start of a script for :func:`gloo_ranks` with two ranks (:func:`two_rank_script`).
_TWO_RANKS_START = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard
    from tests.jobs import two_rank_tensors
    rank, arg, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    full = two_rank_tensors()
    """
)

# Its end: gloo's worker threads outlive destroy_process_group, and one may still be freeing the
# last collective's work, whose tensors need the GIL to drop their Python objects: if the interpreter is finalizing
# by then, CPython ends that thread with pthread_exit inside a C++ destructor -> std::terminate, SIGABRT. Everything
# is checked and durable by then: leave without finalizing (as tests/conftest.py and Replica._at_exit do).
_TWO_RANKS_EXIT = textwrap.dedent(
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def two_rank_script(body: str) -> str:
    """A script for :func:`gloo_ranks` with two ranks: ``body`` (dedented) runs with ``rank``, ``arg`` and ``store``
    from argv, the gloo group joined, ``mesh`` (both ranks, CPU), ``full`` (:func:`two_rank_tensors`) and ``os``,
    ``sys``, ``torch``, ``dist``, ``distribute_tensor``, ``Shard`` imported; then the group is left and the process
    exits without finalizing."""
    return _TWO_RANKS_START + textwrap.dedent(body) + _TWO_RANKS_EXIT


@contextmanager
def gloo_ranks(script_text: str, tmp_path: Path, arg: str | Path, world: int = 2, **popen) -> Iterator[list]:
    """``world`` processes of ``script_text`` (argv: rank, ``arg``, a file store in ``tmp_path`` for
    ``init_process_group``); any still running on leaving is killed, by pid."""
    script = tmp_path / "ranks.py"
    script.write_text(script_text)
    argv = [sys.executable, str(script)]
    procs = [
        subprocess.Popen(
            [*argv, str(r), str(arg), str(tmp_path / "store")], env=job_environment(None), cwd=ROOT, **popen
        )
        for r in range(world)
    ]
    try:
        yield procs
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()


# A job's launcher forked by the warm fork server keeps that server's session open until the test ends it.
_sessions: dict[int, ForkServer] = {}


def _start_warm(cmd: list[str], log: str, job_env: dict[str, str]) -> Process | None:
    """``cmd`` forked by the warm fork server the integration tier runs (tests/integration/conftest.py), as
    :func:`start_job` would start it (its own session, output into ``log``); None where there is none or it
    does not fit the job (the launcher's message is then not wanted: the job starts as a new process)."""
    path = job_env.get(FORK_SERVER)
    if not path or forkable(cmd) is not None:
        return None
    server = ForkServer.attach(path, job_env, lambda line: None)
    if server is None:
        return None
    open(log, "wb").close()  # there at once, as with a new process (the child appends to it)
    proc = server.spawn([cmd[0], "-m", "tests.forked_job", log, *cmd[1:]], job_env, ROOT)
    if proc is None:
        server.close()
        return None
    _sessions[proc.pid] = server
    # Returned once the child leads its own session, as a new process does at once: a test may end the job by
    # its process group from then on.
    assert wait_for(lambda: _leads_a_session(proc.pid) or proc.poll() is not None, 60), "the job did not start"
    return proc


def _leads_a_session(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and int(fields[3]) == pid


def start_job(
    cmd: list[str], out_dir: str, env: dict[str, str] | None = None, *, warm: bool = True
) -> tuple[Process, str]:
    """Start a job's launcher in its own session, its output into ``out_dir``/job.log: forked by the warm fork
    server where the tier runs one, else as a new process. ``warm=False``: a new process, with the job's own fork
    server, so that every process of the job is in the launcher's session (the tests of its process tree)."""
    log = os.path.join(out_dir, "job.log")
    os.makedirs(out_dir, exist_ok=True)
    job_env = job_environment(env)
    if not warm:
        job_env.pop(FORK_SERVER, None)
    proc = _start_warm(cmd, log, job_env)
    if proc is None:
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=job_env, cwd=ROOT, start_new_session=True
            )
    return proc, log


def run_job(cmd: list[str], out_dir: str, *, timeout: float = 120, env: dict[str, str] | None = None) -> JobResult:
    proc, log = start_job(cmd, out_dir, env)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError(f"job did not finish within {timeout}s:\n{open(log).read()[-4000:]}") from None
    finally:
        kill_group(proc)  # stray children of a finished job, if any
    return JobResult(proc.returncode, open(log).read(), out_dir)


def join_request(replica: int) -> str:
    """The line a restarted replica (or a standby that took its place) prints once it asked to be admitted."""
    return f"[lightning-recover] replica {replica}: asks to join at the next commit"


def log_text(log: str) -> str:
    with open(log, errors="replace") as f:
        return f.read()


def run_gated_job(
    cmd: list[str],
    out_dir: str,
    gate: str,
    opens_on,
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run a job whose replicas hold before a step until the file ``gate`` exists (the scripts' ``--hold``), and
    create it once ``opens_on(log text)`` is true (or the job ended). Gating on a restarted replica's
    :func:`join_request` makes its rejoin deterministic: the held step's commit admits it, so the run cannot
    end before it is back, however slowly this machine starts a process."""
    deadline = time.monotonic() + timeout
    proc, log = start_job(cmd, out_dir, env)
    try:
        seen = wait_for(lambda: proc.poll() is not None or opens_on(log_text(log)), timeout)
        open(gate, "w").close()
        assert seen, f"the gate's event did not come within {timeout}s:\n{log_text(log)[-4000:]}"
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"job did not finish within {timeout}s:\n{log_text(log)[-4000:]}") from None
    finally:
        open(gate, "w").close()  # never leave the replicas holding
        kill_group(proc)
    return JobResult(proc.returncode, log_text(log), out_dir)


def fabric_job(
    out_dir: str,
    *,
    replicas: int = 3,
    steps: int = 4,
    microbatches: int = 6,
    inject: str | None = None,
    heartbeat_timeout: float = 0.5,
    extra: list[str] | None = None,
    timeout: float = 120,
) -> JobResult:
    cmd = [
        sys.executable,
        FABRIC_SCRIPT,
        out_dir,
        "--replicas",
        str(replicas),
        "--steps",
        str(steps),
        "--microbatches",
        str(microbatches),
        "--heartbeat-timeout",
        str(heartbeat_timeout),
    ] + (extra or [])
    env = {"LIGHTNING_RECOVER_INJECT": inject} if inject else None
    return run_job(cmd, out_dir, timeout=timeout, env=env)


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def bounded(fn, timeout: float):
    """Run ``fn`` in a thread; fail instead of hanging if it does not return within ``timeout``."""
    out: dict = {}

    def run():
        try:
            out["v"] = fn()
        except BaseException as e:
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} did not return within {timeout}s"
    if "e" in out:
        raise out["e"]
    return out.get("v")


TRAINER_SCRIPT = os.path.join(ROOT, "tests", "scripts", "trainer_train.py")


def trainer_job(
    out_dir: str,
    *,
    replicas: int = 3,
    steps: int = 6,
    microbatches: int = 6,
    inject: str | None = None,
    heartbeat_timeout: float = 0.5,
    extra: list[str] | None = None,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run tests/scripts/trainer_train.py (the Trainer with strategy='recover') as one bounded job (``env``: more
    variables for it)."""
    cmd = [
        sys.executable,
        TRAINER_SCRIPT,
        out_dir,
        "--replicas",
        str(replicas),
        "--steps",
        str(steps),
        "--microbatches",
        str(microbatches),
        "--heartbeat-timeout",
        str(heartbeat_timeout),
    ] + (extra or [])
    env = {**(env or {}), **({"LIGHTNING_RECOVER_INJECT": inject} if inject else {})}
    return run_job(cmd, out_dir, timeout=timeout, env=env or None)
