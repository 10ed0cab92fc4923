"""A new user's first hour: inputs refused in one line before anything starts, commands that explain
themselves (fast: no torch import to print help), optional parts that fail like optional parts, no leftovers
in /tmp, a bare ``python`` that means the launcher's interpreter, and a demo that fits any replica count."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

from lightning_recover import RecoverStrategy, cli, demo, env, simulate
from lightning_recover.checkpoint.tools import fit_name
from lightning_recover.launch.commands import own_interpreter
from lightning_recover.launch.job_dir import JobDir
from lightning_recover.protocol.faults import check_plan
from tests.jobs import ROOT, job_environment, kill_group, run_job, start_job, wait_for

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
        env=job_environment(None),
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
        CLI + ["inspect", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=job_environment(None),
        cwd=ROOT,
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
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=job_environment(None)
    )
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
        env=job_environment({"TMPDIR": str(tmp_path)}),
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
    # the agents are forked too: the tests' warm server imported Lightning as well, more than a torchrun job preloads
    assert "replicas start from the warm fork server" in res.output, res.output[-4000:]
    assert "ChildFailedError" not in res.output and "Traceback" not in res.output, res.output[-4000:]
    assert res.output.count("replica 1: its worker exited; ") == 1, res.output[-4000:]
    assert "replica 1 failed" not in res.output, res.output[-4000:]  # the same death, not reported again
    assert not os.listdir(tmp), os.listdir(tmp)  # no torchelastic_*, no job dir


# ---------------------------------------------------------------------------- second pass: one-line errors


def _cli_error(*args: str, code: int = 2) -> str:
    """The stderr of ``lightning-recover ARGS`` run as a new process, which must fail in one line, no traceback."""
    r = subprocess.run(
        CLI + list(args), capture_output=True, text=True, timeout=120, env=job_environment(None), cwd=ROOT
    )
    assert r.returncode == code and "Traceback" not in r.stderr and not r.stdout, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "HINT: " in lines[0], r.stderr
    return lines[0]


def test_demo_with_no_replica_is_refused_in_one_line():
    assert _cli_error("demo", "--replicas", "0", code=1) == (
        "lightning-recover demo: --replicas must be at least 1, got 0. HINT: e.g. --replicas 4"
    )
    assert _cli_error("demo", "--replicas", "9", code=1) == (
        "lightning-recover demo: --microbatches (8) is smaller than --replicas (9): some replica would have nothing "
        "to compute. HINT: pass --microbatches 9 or more"
    )


def test_run_with_no_replica_is_refused_in_one_line():
    line = _cli_error("run", "--replicas", "0", "--", "python", "train.py")
    # The wording is --replicas' own (N or MIN:MAX): this checks the form, one line naming the option and the bound.
    assert line.startswith("lightning-recover run: error: ") and "--replicas" in line, line
    assert "at least 1 replica" in line, line


def test_a_missing_option_is_one_line_that_points_to_help():
    assert _cli_error("run", "--", "python", "train.py") == (
        "lightning-recover run: error: the following arguments are required: --replicas. "
        "HINT: see `lightning-recover run --help`"
    )


def test_a_watch_relay_without_its_job_is_refused_in_one_line(monkeypatch):
    for name in ("LIGHTNING_RECOVER_CONTROL_PLANE", "LIGHTNING_RECOVER_JOB", "LIGHTNING_RECOVER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    line = _cli_error("watch-relay", "--listen", "127.0.0.1:0", code=1)
    assert line.startswith("lightning-recover watch-relay: name the job's etcd, the job and its secret.") and (
        "--control-plane etcd://HOST:PORT --job NAME --secret-file FILE" in line
    ), line
    line = _cli_error(
        "run", "--replicas", "2", "--watch-upstream", "10.0.1.1:7400", "--", sys.executable, "t.py", code=1
    )
    assert (
        "lightning-recover run: --watch-upstream: a watch relay serves etcd's keys. HINT: use it with --control-plane "
        "etcd://..., or drop it (and unset LIGHTNING_RECOVER_WATCH_UPSTREAM)"
    ) == line, line
    line = _cli_error("run", "--replicas", "2", "--watch-rack", "r1", "--", sys.executable, "t.py", code=1)
    assert line.startswith("lightning-recover run: --watch-rack: a watch relay serves etcd's keys. HINT:"), line


def test_convert_of_a_missing_file_says_so_once(tmp_path):
    assert _cli_error("convert", "nope.ckpt", str(tmp_path / "out.pt")) == (
        "error: nope.ckpt: no such file or directory. HINT: give a checkpoint file (.ckpt, .pt) or a sharded (DCP) "
        "checkpoint directory."
    )
    assert not os.listdir(tmp_path)  # nothing written


# ---------------------------------------------------------------------------- the demo's default plan


@pytest.mark.parametrize(
    "replicas, steps, plan",
    [
        (4, 40, demo.DEFAULT_INJECT),
        (3, 40, "kill:replica=2:step=12:phase=backward,hang:replica=0:step=27:phase=reduce"),
        (2, 40, "kill:replica=1:step=12:phase=backward"),
        (1, 40, ""),
        (4, 10, "kill:replica=2:step=3:phase=backward,hang:replica=0:step=6:phase=reduce"),
        (4, 3, ""),  # no step to fail in before the last
    ],
)
def test_the_demos_default_plan_fits_the_job(replicas, steps, plan):
    assert demo.default_faults(replicas, steps) == plan
    faults = check_plan(plan, replicas)  # a plan the demo's own checks accept
    assert all(f.step < steps for f in faults) and len({f.replica for f in faults}) < replicas


def test_the_demo_accepts_any_replica_count_without_inject(monkeypatch):
    """Every count from 1 up passes the demo's checks with the default plan (nothing started: supervise raises)."""

    def started(*args, **kwargs):
        raise RuntimeError(f"started with inject={kwargs['inject']!r}")

    monkeypatch.setattr("lightning_recover.launch.supervisor.supervise", started)
    for replicas in (1, 2, 3, 4, 8):
        with pytest.raises(RuntimeError, match="started with inject="):
            cli.main(["demo", "--replicas", str(replicas), "--microbatches", "8", "--out", "/nonexistent/demo"])


# ---------------------------------------------------------------------------- the launcher's interpreter


def _path_with(tmp_path, name: str, target: str) -> str:
    """A PATH whose first directory holds ``name``, a link to the interpreter ``target``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    os.symlink(target, bin_dir / name)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_a_bare_python_is_the_launchers_interpreter(tmp_path, monkeypatch):
    said: list[str] = []
    monkeypatch.setenv("PATH", _path_with(tmp_path, "python", "/usr/bin/python3"))
    assert own_interpreter(["python", "train.py", "--lr", "1"], said.append) == [
        sys.executable,
        "train.py",
        "--lr",
        "1",
    ]
    assert said == [
        f"'python' in the command runs as this launcher's interpreter, {sys.executable} (the 'python' on PATH is "
        f"{tmp_path / 'bin' / 'python'}). HINT: give an interpreter's path after -- to run another one"
    ]
    said.clear()
    assert own_interpreter(["/usr/bin/python3", "train.py"], said.append) == ["/usr/bin/python3", "train.py"]
    assert own_interpreter(["bash", "run.sh"], said.append) == ["bash", "run.sh"]
    assert not said  # a path, or another program, is run as given


def test_a_bare_python_that_is_this_interpreter_is_left_alone(tmp_path, monkeypatch):
    said: list[str] = []
    monkeypatch.setenv("PATH", _path_with(tmp_path, "python3", sys.executable))
    assert own_interpreter(["python3", "-m", "train"], said.append) == ["python3", "-m", "train"] and not said


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_with_python_of_another_environment_first_on_path_trains(tmp_path):
    """The issue's case: `python` on PATH is the machine's (no torch); the replicas run in the launcher's."""
    if subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("/usr/bin/python3 has torch: it is not another environment here")
    script = os.path.join(ROOT, "tests", "scripts", "replica_steps.py")
    res = run_job(
        CLI + ["run", "--replicas", "2", "--", "python", script, "3"],
        str(tmp_path / "job"),
        timeout=240,
        env={"PATH": _path_with(tmp_path, "python", "/usr/bin/python3")},
    )
    assert res.returncode == 0 and "No module named" not in res.output, res.output[-4000:]
    assert res.output.count("'python' in the command runs as this launcher's interpreter") == 1, res.output[-4000:]
    assert "cannot be forked" not in res.output, res.output[-4000:]  # this interpreter: the fork server starts them


# ---------------------------------------------------------------------------- fast and explained


def test_help_and_version_import_no_torch():
    code = (
        "import sys\n"
        "from lightning_recover import cli\n"
        "for argv in (['--help'], ['--version'], ['demo', '--help'], ['simulate', '--help'], ['inspect', '--help']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=job_environment(None)
    )
    assert r.returncode == 0 and r.stdout.rstrip().endswith("TORCH_NOT_IMPORTED"), r
    assert "lightning-recover 0" in r.stdout and "--mtbf-gpu-hours" in r.stdout


def test_every_command_is_listed_with_its_own_help_line():
    parser = cli.build_parser()  # every command in full
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {a.dest: a.help for a in sub._choices_actions} == cli.COMMANDS


def test_simulate_explains_every_option_and_column(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
    text = _help(capsys, "simulate", "--help")
    assert "(default: 8)" in text and "(default: 600.0)" in text and "Young/Daly" in text
    assert simulate.cli(["--out", str(tmp_path), "--trials", "1", "--gpus", "512", "--no-plot"]) == 0
    out = capsys.readouterr().out
    for column, _ in simulate.LEGEND:
        assert f"{column}: " in out.split("rec/ckpt\n", 1)[1], column  # under the table, one line per column


def test_inspect_elides_a_long_name_in_the_middle(tmp_path, capsys):
    long_key = "ModelCheckpoint{" + ", ".join(f"'option{i}': {i}" for i in range(30)) + "}"
    path = tmp_path / "long.pt"
    torch.save({long_key: torch.zeros(2), "w": torch.zeros(3)}, path)
    code, out, _ = _inspect(capsys, str(path))
    assert code == 0
    row = next(line for line in out.splitlines() if line.strip().startswith("ModelCheckpoint{"))
    name = row[2 : 2 + 60]  # the name column: the key's start and its end around "..."
    assert name.startswith("ModelCheckpoint{'option0'") and "..." in name and name.endswith("'option29': 29}"), row
    code, out, _ = _inspect(capsys, "--json", str(path))
    assert json.loads(out)["tensors"][0]["name"] == long_key  # the machine-readable output keeps it whole
    assert fit_name("x" * 10) == "x" * 10 and len(fit_name("x" * 500)) == 60


# ---------------------------------------------------------------------------- resuming from a damaged checkpoint


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_from_a_damaged_last_ckpt_names_the_checkpoint_before_it(tmp_path):
    script = os.path.join(EXAMPLES, "checkpoint_plugin.py")
    out = tmp_path / "ckpt"

    def example(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, script, "--out", str(out), *args],
            capture_output=True,
            text=True,
            timeout=280,
            env=job_environment(None),
        )

    assert example("--steps", "10").returncode == 0
    assert sorted(os.listdir(out)) == ["epoch=0-step=10.ckpt", "last.ckpt"]
    last = out / "last.ckpt"
    damaged = bytearray(last.read_bytes())
    damaged[len(damaged) // 2 : len(damaged) // 2 + 64] = b"\xff" * 64  # inside the tensor data
    last.write_bytes(bytes(damaged))
    r = example("--steps", "20", "--resume")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-4000:]
    line = r.stderr.splitlines()[-1]
    assert line.startswith(f"checkpoint_plugin.py: --resume: {last}: checksum mismatch in record"), line
    assert line.endswith(
        f"HINT: resume from the newest intact checkpoint ModelCheckpoint kept: --resume '{out / 'epoch=0-step=10.ckpt'}'"
    ), line
    assert last.read_bytes() == bytes(damaged)  # refused, not overwritten
    assert sorted(os.listdir(out)) == ["epoch=0-step=10.ckpt", "last.ckpt"]  # and nothing trained or saved


def test_the_demos_reference_is_reused_for_the_same_configuration(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    tiny = ["--steps", "2", "--microbatches", "2", "--batch-size", "2", "--block-size", "16", "--width", "16"]
    args = parser.parse_args([*tiny, "--layers", "1", "--corpus-bytes", "50000", "--out", str(tmp_path)])
    losses, state = demo.cached_reference(args, train_seconds=1.0)
    assert "replaying the 2 steps in one process" in capsys.readouterr().out
    saved = [n for n in os.listdir(tmp_path) if n.startswith("reference-")]
    assert saved == [f"reference-{demo.reference_key(args)}.pt"]
    args.replicas, args.inject = 3, ""  # not part of the reference
    again_losses, again_state = demo.cached_reference(args, train_seconds=1.0)
    assert "reused" in capsys.readouterr().out
    assert again_losses == losses and all(torch.equal(again_state[k], v) for k, v in state.items())
    args.lr = 1e-2  # part of it: another key, replayed
    assert demo.reference_key(args) != saved[0][len("reference-") : -len(".pt")]


def test_torchrun_refuses_an_interpreter_where_the_script_goes():
    assert _cli_error("torchrun", "--replicas", "2", "--", "/usr/bin/python3", "train.py", code=1) == (
        "lightning-recover torchrun: give the script after --, not an interpreter ('/usr/bin/python3'): torchrun "
        f"runs it with this launcher's, {sys.executable}. HINT: -- train.py --lr 1e-3"
    )
