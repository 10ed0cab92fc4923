"""The launcher's fork server (``launch/fork_server.py``): real server processes, real forks.

These servers preload one small standard-library module (the server itself imports torch through
the package), so each test takes seconds; the
standby jobs in ``test_standby.py`` run the real thing (torch and Lightning preloaded) end to end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from lightning_recover.launch.fork_server import ForkedProcess, ForkServer, ProcessStarter, forkable

# every test here starts a fork server or forks replicas: real processes
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys
    preloaded = "wave" in sys.modules  # nothing else imports it: only the server's preload
    import json, os
    out = sys.argv[1]
    with open(out + ".tmp", "w") as f:
        json.dump({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "path0": sys.path[0],
                   "var": os.environ.get("FORK_TEST_VAR"), "pid": os.getpid(), "ppid": os.getppid(),
                   "preloaded": preloaded}, f)
    os.replace(out + ".tmp", out)  # whole, for the test that waits for it
    if len(sys.argv) > 2 and sys.argv[2] == "sleep":
        import time
        time.sleep(60)
    raise SystemExit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    """
)


# what the launcher gives its children: with more OpenMP threads, importing torch (which the server's
# own module does) starts OpenMP's pool, and a process with threads must not fork
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _wait_ready(server: ForkServer, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while server.current_state() == "starting" and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.current_state()


@pytest.fixture
def server():
    lines: list[str] = []
    srv = ForkServer.start(ENV, lines.append, preload=("wave",))
    srv.lines = lines
    try:
        assert _wait_ready(srv) == "ready", lines
        yield srv
    finally:
        srv.close()
        if srv.proc.poll() is None:
            srv.proc.kill()


def _sleeping_child(server: ForkServer, argv: list[str], out, env=None) -> ForkedProcess:
    """Fork ``argv`` (a script that writes ``out`` and then sleeps) and wait until it has written it."""
    proc = server.spawn(argv, dict(env or ENV), str(out.parent))
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert out.exists(), "the forked child did not start"
    return proc


def _script(tmp_path) -> str:
    path = tmp_path / "child_script.py"
    path.write_text(SCRIPT)
    return str(path)


def test_forked_child_runs_the_script_as_main_with_its_own_environment(server, tmp_path):
    out = tmp_path / "out.json"
    env = dict(ENV, FORK_TEST_VAR="standby-7")
    proc = server.spawn([sys.executable, _script(tmp_path), str(out), "3"], env, cwd=str(tmp_path))
    assert isinstance(proc, ForkedProcess)
    assert proc.wait(timeout=30) == 3, "the script's exit code is the child's"
    seen = json.loads(out.read_text())
    assert seen["argv"] == [_script(tmp_path), str(out), "3"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path)
    assert seen["var"] == "standby-7" and seen["pid"] == proc.pid and seen["ppid"] == server.proc.pid
    assert seen["preloaded"], "the preloaded module is already imported in the child"
    assert "replicas start from a fork server" in server.lines[0]


def test_forked_module_and_signal_exit(server, tmp_path):
    pkg = tmp_path / "forkpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "entry.py").write_text(SCRIPT)
    out = tmp_path / "m.json"
    proc = _sleeping_child(server, [sys.executable, "-m", "forkpkg.entry", str(out), "sleep"], out)
    assert json.loads(out.read_text())["name"] == "__main__"
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL, "a killed child reports the signal, as Popen does"


def test_children_die_with_the_server_and_are_reported_killed(server, tmp_path):
    out = tmp_path / "o.json"
    proc = _sleeping_child(server, [sys.executable, _script(tmp_path), str(out), "sleep"], out)
    os.kill(server.proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{proc.pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{proc.pid}"), "the child did not outlive its server"
    assert server.current_state() == "failed"
    assert server.spawn([sys.executable, _script(tmp_path), str(out)], dict(ENV)) is None


def test_a_server_with_threads_refuses_to_fork_and_standbys_start_as_new_processes(tmp_path):
    (tmp_path / "threaded_mod.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    lines: list[str] = []
    env = dict(ENV, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, _script(tmp_path)]
    starter = ProcessStarter(command, env, lines.append, preload=("threaded_mod",))
    try:
        assert _wait_ready(starter.server) == "failed"
        assert "2 threads after importing ['threaded_mod'] (fork needs one)" in lines[0], lines
        out = tmp_path / "p.json"
        proc = starter.start([*command, str(out), "5"], env)
        assert not isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 5
    finally:
        starter.close()


def test_starter_waits_for_the_server_and_knows_what_it_cannot_fork(tmp_path):
    lines: list[str] = []
    starter = ProcessStarter(["bash", "-c", "true"], dict(ENV), lines.append)
    assert starter.server is None and "cannot be forked" in lines[0]
    assert forkable([sys.executable, "-u", "x.py"]) == "interpreter option '-u'"
    assert forkable([sys.executable, "-m"]) == "-m without a module"
    assert forkable([sys.executable, "train.py", "--lr", "1"]) is None
    starter = ProcessStarter([sys.executable, _script(tmp_path)], dict(ENV), lines.append, preload=("json",))
    try:
        first = starter.start([sys.executable, _script(tmp_path), str(tmp_path / "s.json")], dict(ENV))
        assert first is None, "while the server imports, the standby is started later"
        assert _wait_ready(starter.server) == "ready"
        proc = starter.start([sys.executable, _script(tmp_path), str(tmp_path / "s.json")], dict(ENV))
        assert isinstance(proc, ForkedProcess) and proc.wait(timeout=30) == 0
    finally:
        starter.close()
    assert starter.server.proc.poll() is not None, "close ends the server"


def test_ctrl_c_ends_the_children_not_the_server(server, tmp_path):
    """Ctrl-C reaches the whole process group: the server ignores it (its death would kill every
    child), a child handles it as a new interpreter does (KeyboardInterrupt)."""
    out = tmp_path / "c.json"
    proc = _sleeping_child(server, [sys.executable, _script(tmp_path), str(out), "sleep"], out)
    os.kill(server.proc.pid, signal.SIGINT)
    time.sleep(0.3)
    assert server.proc.poll() is None and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == -signal.SIGINT, "an uncaught KeyboardInterrupt, as `python script.py`"
    assert server.current_state() == "ready"


def test_ps_shows_each_child_its_own_command_line_and_environment(server, tmp_path):
    """/proc/PID/cmdline and /proc/PID/environ (ps, and tools that find a replica by its environment)
    show the child's argv and environment, not the server's."""
    out = tmp_path / "ps.json"
    argv = [sys.executable, _script(tmp_path), str(out), "sleep"]
    proc = _sleeping_child(server, argv, out, env=dict(ENV, FORK_TEST_VAR="replica-3"))
    try:
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().rstrip(b"\0").split(b"\0")
        assert cmdline == [os.fsencode(a) for a in argv]
        environ = open(f"/proc/{proc.pid}/environ", "rb").read()
        assert b"\0FORK_TEST_VAR=replica-3\0" in b"\0" + environ and b"FORK_ROOM" not in environ
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert open(f"/proc/{server.proc.pid}/cmdline", "rb").read().startswith(b"lightning-recover fork server\0")


def test_an_exit_wakes_the_launcher_and_children_hold_no_descriptor_of_their_siblings(server, tmp_path):
    """The server waits on each child's pidfd, so an exit is reported as it happens and a launcher's
    ``wait_for_exit`` (its main loop's pause) returns then, not at its timeout. The descriptors are the
    server's own: a child forked later must not hold its older siblings' (it would keep nothing alive,
    but a child's descriptors are its program's)."""
    first_out, second_out = tmp_path / "a.json", tmp_path / "b.json"
    first = _sleeping_child(server, [sys.executable, _script(tmp_path), str(first_out), "sleep"], first_out)
    second = _sleeping_child(server, [sys.executable, _script(tmp_path), str(second_out), "sleep"], second_out)

    def pidfds(pid: int) -> int:
        return sum("pidfd" in os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))

    assert pidfds(server.proc.pid) == 2 and pidfds(second.pid) == 0
    began = time.monotonic()
    threading.Timer(0.5, first.kill).start()
    server.wait_for_exit(30.0)
    assert time.monotonic() - began < 15.0, "woken by the exit, not by the timeout"
    assert first.poll() == -signal.SIGKILL and second.poll() is None
    second.kill()
    assert second.wait(timeout=30) == -signal.SIGKILL
