"""A new user's first hour (issue 35): inputs refused in one line before anything starts, commands that
explain themselves, optional parts that fail like optional parts, and no leftovers in /tmp."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

from lightning_recover import RecoverStrategy, cli, env, simulate
from lightning_recover.launch.job_dir import JobDir
from lightning_recover.protocol.faults import check_plan
from tests.jobs import ROOT, _env, kill_group, run_job, start_job, wait_for

CLI = [sys.executable, "-m", "lightning_recover.cli"]
EXAMPLES = os.path.join(ROOT, "examples")
BAD_PLAN = "explode:replica=1:step=3:phase=backward"


def _refused(*args: str) -> str:
    """The message of ``lightning-recover ARGS``, run in this process, that must refuse them in one line."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(args))
    message = str(exc.value.code)
    assert "\n" not in message and "HINT: " in message, message
    return message


def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["inspect", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------- validation before start


def test_a_bad_fault_plan_names_its_source_and_the_form():
    with pytest.raises(ValueError, match=r"^LIGHTNING_RECOVER_INJECT: fault 'explode.*HINT: a fault is KIND:replica="):
        check_plan(BAD_PLAN, 4, env.INJECT)
    with pytest.raises(ValueError, match=r"^--inject: .*replicas 0\.\.1, so replica=5.*HINT: name a replica below 2"):
        check_plan("kill:replica=5:step=1:phase=forward", 2)
    assert [str(f) for f in check_plan("hang:replica=1:step=2:phase=reduce", 2)] == [
        "hang:replica=1:step=2:phase=reduce"
    ]


def test_fabric_launch_refuses_a_bad_inject_variable_before_starting_anything(monkeypatch):
    monkeypatch.setenv(env.INJECT, BAD_PLAN)
    for name in (env.REPLICA, env.STANDBY):
        monkeypatch.delenv(name, raising=False)
    fabric = L.Fabric(strategy=RecoverStrategy(microbatches=4), devices=2, accelerator="cpu")
    children = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    before = set(open(children).read().split())  # an earlier test's process may still be ending
    started = time.monotonic()
    with pytest.raises(ValueError, match="LIGHTNING_RECOVER_INJECT: fault 'explode.*HINT"):
        fabric.launch()
    # No coordinator, fork server or replica: none of them can start in this time, and none is a child.
    assert time.monotonic() - started < 1.0
    assert not set(open(children).read().split()) - before


def test_run_refuses_a_bad_inject_variable_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv(env.INJECT, BAD_PLAN)
    message = _refused("run", "--replicas", "2", "--", sys.executable, "-c", "pass")
    assert "LIGHTNING_RECOVER_INJECT: fault 'explode" in message
    assert "coordinator" not in capsys.readouterr().err  # nothing was started


def test_demo_refuses_a_bad_inject_in_one_line():
    assert "--inject: fault 'explode" in _refused("demo", "--inject", BAD_PLAN)
    assert "names step 99" in _refused("demo", "--inject", "kill:replica=1:step=99:phase=forward")


def test_checkpoint_plugin_resume_with_nothing_to_resume_says_so(tmp_path):
    script = os.path.join(EXAMPLES, "checkpoint_plugin.py")
    r = subprocess.run(
        [sys.executable, script, "--resume", "--out", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(None),
    )
    assert r.returncode == 2 and "nothing to resume" in r.stderr and "HINT" in r.stderr, r
    assert not (tmp_path / "none").exists()  # it did not train from scratch


# ---------------------------------------------------------------------------- inspect


def test_inspect_a_missing_path_says_so_once(capsys):
    code, _, err = _inspect(capsys, "/nonexistent/x.ckpt")
    assert code == 2 and err.count("/nonexistent/x.ckpt") == 1 and "no such file" in err and "HINT" in err, err


def test_inspect_a_plain_directory_is_not_told_to_load_a_previous_checkpoint(tmp_path, capsys):
    (tmp_path / "a.pt").write_bytes(b"x")
    code, _, err = _inspect(capsys, str(tmp_path))
    assert code == 2 and "is a directory, not a sharded checkpoint" in err, err
    assert "a.pt" in err and "previous checkpoint" not in err


def test_inspect_lists_a_plain_torch_save_file_like_the_demos(tmp_path, capsys):
    path = tmp_path / "replica0.pt"  # what the demo writes: torch.save of a state dict
    torch.save({"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float64)}, path)
    code, out, _ = _inspect(capsys, str(path))
    assert code == 0 and "torch.save file" in out and "(2, 3)" in out and "float64" in out and "not verified" in out
    code, out, _ = _inspect(capsys, "--json", str(path))
    assert json.loads(out)["tensors"][0] == {"name": "w", "dtype": "float32", "shape": [2, 3], "bytes": 24}


@pytest.mark.slow
def test_inspect_under_head_ends_without_a_broken_pipe(tmp_path):
    path = tmp_path / "many.pt"
    torch.save({f"t{i}": torch.zeros(1) for i in range(5000)}, path)
    proc = subprocess.Popen(
        CLI + ["inspect", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(None), cwd=ROOT
    )
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "BrokenPipeError" not in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------- the CLI explains itself


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*args])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_shows_descriptions_defaults_and_no_markup(capsys):
    top = _help(capsys, "--help")
    assert "``" not in top and "COMMAND" in top
    run = _help(capsys, "run", "--help")
    assert "Start a coordinator and one process per replica" in run
    assert "data-parallel replicas" in run and "after --: what each replica runs" in run
    assert "(default: 0)" in run and "(default: 127.0.0.1)" in run
    assert _help(capsys, "--version").startswith("lightning-recover ")


@pytest.mark.parametrize("example", ["fabric_gpt.py", "trainer_gpt.py", "checkpoint_plugin.py"])
def test_example_help_does_not_import_torch(example):
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{example!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({os.path.join(EXAMPLES, example)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env(None))
    assert "(default:" in r.stdout and r.stdout.rstrip().endswith("TORCH_NOT_IMPORTED"), r


# ---------------------------------------------------------------------------- optional parts


def test_simulate_without_matplotlib_skips_the_plot_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    assert simulate.cli(["--out", str(tmp_path), "--trials", "1"]) == 0
    err = capsys.readouterr().err
    assert "plot (simulate.png) skipped: matplotlib is not installed. HINT: pip install matplotlib" in err
    assert (tmp_path / "simulate.json").exists() and not (tmp_path / "simulate.png").exists()


# ---------------------------------------------------------------------------- leftovers


@pytest.mark.slow  # a child interpreter (imports torch, ~1.5 s CPU) killed with SIGKILL
def test_job_dir_is_removed_by_its_janitor_when_the_owner_dies(tmp_path):
    code = (
        "import os, sys, time\n"
        "from lightning_recover.launch.job_dir import JobDir\n"
        "d = JobDir.create()\n"
        "open(os.path.join(d.path, 'job.secret'), 'w').close()\n"
        "print(d.path, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env=_env({"TMPDIR": str(tmp_path)}),
        start_new_session=True,
    )
    try:
        path = proc.stdout.readline().strip()
        assert os.path.exists(os.path.join(path, "job.secret")) and path.startswith(str(tmp_path))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_for(lambda: not os.path.exists(path), timeout=10), os.listdir(path)
    finally:
        kill_group(proc)
    d = JobDir.create()  # and when its owner lives: removed at once, the janitor gone
    d.remove()
    assert not os.path.exists(d.path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkilled_launcher_leaves_nothing_in_tmp(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = CLI + ["run", "--replicas", "2", "--start", "exec", "--", "sleep", "600"]
    proc, log = start_job(cmd, str(tmp_path / "job"), env={"TMPDIR": str(tmp)})
    try:
        assert wait_for(lambda: "started 2 replicas" in open(log).read(), timeout=120), open(log).read()
        made = os.listdir(tmp)
        assert any(n.startswith("lightning-recover-") for n in made), made  # the job dir, with job.secret
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_for(lambda: not os.listdir(tmp), timeout=15), os.listdir(tmp)
    finally:
        kill_group(proc)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_torchrun_injected_kill_is_reported_once_and_leaves_nothing_in_tmp(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = os.path.join(ROOT, "tests", "scripts", "replica_steps.py")
    res = run_job(
        CLI + ["torchrun", "--replicas", "2", "--inject", "kill:replica=1:step=2:phase=backward", "--", script, "6"],
        str(tmp_path / "job"),
        timeout=450,
        env={"TMPDIR": str(tmp)},
    )
    assert res.returncode == 0, res.output[-4000:]
    assert "ChildFailedError" not in res.output and "Traceback" not in res.output, res.output[-4000:]
    assert res.output.count("replica 1: its worker exited; declared dead") == 1, res.output[-4000:]
    assert "replica 1 failed" not in res.output, res.output[-4000:]  # the same death, not reported again
    assert not os.listdir(tmp), os.listdir(tmp)  # no torchelastic_*, no job dir
