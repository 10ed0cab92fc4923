"""The integration tier's jobs start from a warm fork server, one per pytest worker.

Each job's launcher would otherwise import torch and Lightning (the test's script, seconds of CPU) and start a
fork server that imports them again for its replicas: most of the tier's CPU on two cores. The server
(``lightning-recover fork-server``) forks the tests' launchers (``jobs.start_job``) and, through
``LIGHTNING_RECOVER_FORK_SERVER`` in their environment, their replicas. A job whose import-time environment
differs from the server's starts as before. The chaos tier (namespaces, Slurm) and test_fork_server.py still
run each job's own fork server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from lightning_recover.env import FORK_SERVER
from tests.jobs import job_environment, log_text, wait_for

READY_TIMEOUT = 180.0  # importing torch and Lightning on a loaded 2-core host


@pytest.fixture(scope="session", autouse=True)
def warm_fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = str(tmp_path_factory.mktemp("fork-server") / "s.sock")
    server_env = job_environment()
    server_env.pop(FORK_SERVER, None)
    cmd = [sys.executable, "-m", "lightning_recover.cli", "fork-server", "--socket", path, "--exit-with-parent"]
    log = path + ".log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=server_env, stdout=out, stderr=subprocess.STDOUT)
    try:
        started = wait_for(lambda: proc.poll() is not None or "warm at" in log_text(log), READY_TIMEOUT)
        assert started and proc.poll() is None, f"the warm fork server did not start:\n{log_text(log)}"
        os.environ[FORK_SERVER] = path
        yield path
    finally:
        os.environ.pop(FORK_SERVER, None)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def relay_dir() -> Iterator[str]:
    """A private directory for watch relays' Unix sockets: their paths are limited to 107 bytes, which pytest's
    tmp_path can pass."""
    short = f"/tmp/lr-relay-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(short, 0o700)
    try:
        yield short
    finally:
        for name in os.listdir(short):
            os.unlink(os.path.join(short, name))
        os.rmdir(short)
