"""``lightning-recover etcd up/down`` as a user runs them: up -> down -> up on one directory, down twice,
down where nothing ever ran (real etcd members, the real command line in subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_recover.control_plane import config
from tests.etcd_cluster_fixtures import need_etcd

pytestmark = pytest.mark.slow


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_recover.cli", "etcd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _exports(stdout: str) -> dict[str, str]:
    return dict(line[len("export ") :].split("=", 1) for line in stdout.splitlines() if line.startswith("export "))


@pytest.mark.timeout(400)
def test_up_down_up_down_on_one_directory(tmp_path):
    need_etcd()
    d = str(tmp_path / "cluster")
    first = _cli("up", "--dir", d)
    try:
        assert first.returncode == 0, first.stderr
        settings = config.with_job(config.parse(None, environ=_exports(first.stdout)), "cycle")
        client = settings.client()
        client.put(b"/cycle/first", b"1")
        client.close()
    finally:
        gone = _cli("down", "--dir", d)
    assert gone.returncode == 0, gone.stderr
    # It says what it removed and what it kept, and did so.
    assert "removed their data" in gone.stdout and "private keys" in gone.stdout and "kept the logs" in gone.stdout
    left = sorted(os.listdir(d))
    assert left == ["m0.log", "m1.log", "m2.log"], left

    again = _cli("down", "--dir", d)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert again.stderr.strip().count("\n") == 0 and "no cluster in" in again.stderr and "HINT" in again.stderr
    nowhere = _cli("down", "--dir", str(tmp_path / "never"))
    assert nowhere.returncode == 1 and "Traceback" not in nowhere.stderr and "HINT" in nowhere.stderr

    second = _cli("up", "--dir", d)  # a fresh cluster on the same directory: a leader, none of the old keys
    try:
        assert second.returncode == 0, second.stderr
        settings = config.with_job(config.parse(None, environ=_exports(second.stdout)), "cycle")
        client = settings.client()
        assert client.get(b"/cycle/first")[0] is None
        client.put(b"/cycle/second", b"2")
        assert client.get(b"/cycle/second")[0] == b"2"
        client.close()
    finally:
        assert _cli("down", "--dir", d).returncode == 0
