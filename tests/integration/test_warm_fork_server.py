"""The warm fork server (``launch/warm_fork_server.py``): a real server, real sessions, real forks.

Its servers preload one small standard-library module (the server's own modules import torch), so
each takes seconds to start; the integration tier runs its jobs through the real one (conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lightning_recover.env import FORK_SERVER
from lightning_recover.launch.fork_server import ForkedProcess, ForkServer, ProcessStarter
from tests.jobs import job_environment, log_text, wait_for

pytestmark = pytest.mark.slow

ENV = {k: v for k, v in os.environ.items() if k != FORK_SERVER}
ENV["OMP_NUM_THREADS"] = "1"
PRELOAD = ("wave",)

CHILD = textwrap.dedent(
    """
    import os, sys
    print(f"child {os.getpid()} says {os.environ.get('WARM_TEST_VAR')}; preloaded={'wave' in sys.modules}", flush=True)
    if sys.argv[1:] == ["sleep"]:
        import time
        time.sleep(120)
    raise SystemExit(7)
    """
)

# A launcher as the supervisor is one: attaches to the warm server, forks a sleeping child, says its pid.
LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from lightning_recover.launch.fork_server import ForkServer
    server = ForkServer.attach(sys.argv[1], dict(__import__("os").environ), print, preload=("wave",))
    child = server.spawn([sys.executable, sys.argv[2], "sleep"], dict(__import__("os").environ))
    print(f"CHILD {child.pid}", flush=True)
    time.sleep(120)
    """
)


def _start_server(path: str, log: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lightning_recover.cli", "fork-server", "--socket", path, "--preload", "wave"]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd + ["--exit-with-parent"], env=ENV, stdout=out, stderr=subprocess.STDOUT)


def _wait_listening(proc: subprocess.Popen, log: str) -> None:
    assert wait_for(lambda: proc.poll() is not None or "warm at" in log_text(log), 120), log_text(log)
    assert proc.poll() is None, log_text(log)


@pytest.fixture
def warm(tmp_path):
    path, log = str(tmp_path / "warm.sock"), str(tmp_path / "warm.log")
    proc = _start_server(path, log)
    try:
        _wait_listening(proc, log)
        yield path, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _child(tmp_path) -> str:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return str(script)


def test_a_session_forks_with_the_launchers_streams_and_environment(warm, tmp_path, capfd):
    path, server_proc = warm
    lines: list[str] = []
    session = ForkServer.attach(path, dict(ENV), lines.append, preload=PRELOAD)
    assert session is not None, lines
    try:
        assert f"replicas start from the warm fork server at {path}" in lines[0]
        proc = session.spawn([sys.executable, _child(tmp_path)], dict(ENV, WARM_TEST_VAR="replica-2"), str(tmp_path))
        assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 7, "the script's exit code is the child's"
        out = capfd.readouterr().out
        assert f"child {proc.pid} says replica-2; preloaded=True" in out, "the child writes to the launcher's stdout"
        ancestors = open(f"/proc/{session.pid}/status").read()
        assert f"PPid:\t{server_proc.pid}\n" in ancestors, "the session is the warm server's child"
    finally:
        session.close()
    assert wait_for(lambda: not os.path.exists(f"/proc/{session.pid}"), 30), "closing ends the session"


def test_a_forked_child_takes_its_temporary_directory_and_time_zone_from_its_own_environment(
    warm_fork_server, tmp_path, capfd
):
    """The tier's server imported torch and Lightning, which fixed its temporary directory; a child's are its own."""
    session = ForkServer.attach(warm_fork_server, job_environment(), lambda line: None)
    assert session is not None
    try:
        code = "import tempfile, time; print('TMP', tempfile.gettempdir(), 'TZ', time.tzname[0], flush=True)"
        script = tmp_path / "where.py"
        script.write_text(code)
        env = job_environment({"TMPDIR": str(tmp_path), "TZ": "JST-9"})
        proc = session.spawn([sys.executable, str(script)], env, str(tmp_path))
        assert proc is not None and proc.wait(timeout=60) == 0
    finally:
        session.close()
    assert f"TMP {tmp_path} TZ JST" in capfd.readouterr().out


def test_a_job_that_does_not_fit_says_why_and_starts_its_own_server(warm, tmp_path):
    path, _ = warm
    lines: list[str] = []
    other = dict(ENV, PYTHONPATH=str(tmp_path), **{FORK_SERVER: path})
    starter = ProcessStarter([sys.executable, _child(tmp_path)], other, lines.append, preload=PRELOAD)
    try:
        assert "it differs from this job in environment PYTHONPATH): the job starts its own" in lines[0], lines
        assert starter.server is not None and starter.server.proc is not None, "the job's own fork server"
    finally:
        starter.close()
    lines.clear()
    assert ForkServer.attach(path, dict(ENV), lines.append, preload=("json",)) is None
    assert "preload" in lines[0], lines


def test_the_children_die_with_their_launcher(warm, tmp_path):
    path, _ = warm
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    log = str(tmp_path / "launcher.log")
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, str(script), path, _child(tmp_path)], env=ENV, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        assert wait_for(lambda: "CHILD " in log_text(log) or launcher.poll() is not None, 60), log_text(log)
        child = int(log_text(log).split("CHILD ")[1].split()[0])
        assert os.path.exists(f"/proc/{child}")
        launcher.kill()
        launcher.wait()
        assert wait_for(lambda: not os.path.exists(f"/proc/{child}"), 30), "the child outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


REPLICA = textwrap.dedent(
    """
    import os, sys, time
    pid_file = os.path.join(sys.argv[1], f"replica{os.environ['LIGHTNING_RECOVER_REPLICA']}.pid")
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)  # the test reads it as soon as it exists: never empty
    time.sleep(600)
    """
)


def test_a_sigkilled_launcher_takes_its_warm_forked_coordinator_and_replicas_with_it(warm_fork_server, tmp_path):
    """The tier's warm server (conftest.py: the launcher's default preload) forks the whole job."""
    path = warm_fork_server
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    log = str(tmp_path / "job.log")
    cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "2"]
    cmd += ["--", sys.executable, str(script), str(tmp_path)]
    with open(log, "wb") as out:
        launcher = subprocess.Popen(cmd, env=job_environment(), stdout=out, stderr=subprocess.STDOUT)
    pids = [str(tmp_path / f"replica{r}.pid") for r in (0, 1)]
    try:
        started = wait_for(lambda: launcher.poll() is not None or all(os.path.exists(p) for p in pids), 120)
        assert started and launcher.poll() is None, log_text(log)
        text = log_text(log)
        assert f"replicas start from the warm fork server at {path}" in text, text
        coordinator = int(text.split("coordinator at ")[1].split("(pid ")[1].split(")")[0])
        job = [coordinator] + [int(open(p).read()) for p in pids]
        forkers = {int(open(f"/proc/{pid}/status").read().split("PPid:\t")[1].split()[0]) for pid in job}
        assert launcher.pid not in forkers, "the coordinator and the replicas are forked by the warm server's sessions"
        launcher.kill()
        launcher.wait()
        assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in job), 30), "left behind"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_one_server_per_socket_a_stale_socket_is_replaced_and_sigterm_removes_it(tmp_path):
    path, log = str(tmp_path / "s.sock"), str(tmp_path / "first.log")
    first = _start_server(path, log)
    try:
        _wait_listening(first, log)
        second_log = str(tmp_path / "second.log")
        second = _start_server(path, second_log)
        assert second.wait(timeout=120) == 1
        assert f"a fork server already listens at {path}" in log_text(second_log)
        first.kill()  # leaves its socket file behind
        first.wait()
        assert os.path.exists(path)
        third_log = str(tmp_path / "third.log")
        third = _start_server(path, third_log)
        try:
            _wait_listening(third, third_log)
            assert oct(os.stat(path).st_mode & 0o777) == "0o600", "only its owner may connect"
            third.send_signal(signal.SIGTERM)
            assert third.wait(timeout=30) == 0
            assert not os.path.exists(path), "a stopped server removes its socket"
        finally:
            if third.poll() is None:
                third.kill()
                third.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_the_cli_lists_the_command():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_recover.cli", "fork-server", "--help"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and FORK_SERVER in out.stdout, out.stderr
