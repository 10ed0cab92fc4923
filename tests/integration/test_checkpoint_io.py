"""Checkpoint I/O: corruption detection, crash-safe commit, the Lightning plugin, inspect/convert."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lightning_recover.checkpoint import (
    CheckpointCorruptError,
    cleanup_stale_temps,
    engine,
    files,
    load,
    read_info,
    save,
)
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO, UringCheckpointIO
from tests.compare import checkpoint_io_config


def _state(k: int = 0, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(k)
    return {
        "k": k,
        "state_dict": {
            "w": torch.randn(n, generator=g),
            "b": torch.randn(7, generator=g),
            "big": torch.full((300_000,), float(k)),
        },
        "meta": {"name": "x", "epoch": k},
    }


def _assert_state(out: dict, k: int) -> None:
    assert out["k"] == k and out["meta"]["epoch"] == k
    torch.testing.assert_close(out["state_dict"]["w"], _state(k)["state_dict"]["w"])
    assert bool((out["state_dict"]["big"] == float(k)).all())


def _temps(d) -> list:
    return [p for p in os.listdir(d) if files.is_temp_name(p)]


# ------------------------------------------------------------------------------------ corruption


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "c.ckpt"
    save(_state(1), path)
    return path


def _rewrite(path, fn) -> None:
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(fn(data)))


@pytest.mark.parametrize("keep", [0, 5, 4095, 4096, 5000, "half", "minus1", "minus_end_record"])
def test_truncated_rejected(saved, keep):
    size = saved.stat().st_size
    n = {"half": size // 2, "minus1": size - 1, "minus_end_record": size - 22}.get(keep, keep)
    _rewrite(saved, lambda d: d[:n])
    with pytest.raises(CheckpointCorruptError) as ei:
        load(saved)
    assert str(saved) in str(ei.value)


def test_zero_filled_and_foreign_rejected(tmp_path, saved):
    """Damage to the records themselves: test_torch_zip.py; here, files that are no archive at all."""
    size = saved.stat().st_size
    saved.write_bytes(bytes(size))
    with pytest.raises(CheckpointCorruptError, match="zero-filled"):
        load(saved)
    rnd = tmp_path / "random.bin"
    rnd.write_bytes(b"\x00garbage" + os.urandom(100_000))
    with pytest.raises(CheckpointCorruptError, match="not a lightning-recover checkpoint"):
        load(rnd)
    legacy = tmp_path / "legacy.pt"  # torch.save's pre-zip pickle stream
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointCorruptError, match="pickle stream"):
        load(legacy)
    tiny = tmp_path / "tiny.ckpt"
    tiny.write_bytes(b"PK")
    with pytest.raises(CheckpointCorruptError, match="too small"):
        load(tiny)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="did not complete"):  # the placeholder of an unfinished save
        load(empty)
    # a good file with trailing garbage: the end record no longer at the end
    extended = tmp_path / "ext.ckpt"
    save(_state(1), extended)
    _rewrite(extended, lambda d: d + b"junk")
    with pytest.raises(CheckpointCorruptError):
        load(extended)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        load(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        UringCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


# ----------------------------------------------------------------------------- crash-safe commit


def test_rename_failure_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    save(_state(1), path)
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError(28, "No space left on device (simulated)", src)

    monkeypatch.setattr(files.os, "rename", boom)
    with pytest.raises(OSError, match="simulated"):
        save(_state(2), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _temps(tmp_path) == []
    _assert_state(load(path), 1)


def test_failure_mid_write_keeps_previous_and_no_final_file(tmp_path, monkeypatch):
    real = engine.EngineHandle.get

    class FailingWriter:
        def __init__(self, w):
            self.w, self.calls = w, 0

        def write(self, segs, wait=True):
            self.calls += 1
            if self.calls == 2:  # after the data, before index/footer
                raise OSError(5, "Input/output error (simulated)")
            return self.w.write(segs, wait=wait)

        def close(self, size=None):
            return self.w.close(size)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.w.__exit__(*exc)

    class FailingEngine:
        def __init__(self, eng):
            self.eng = eng

        def open_writer(self, p, **kw):
            return FailingWriter(self.eng.open_writer(p, **kw))

        def open_reader(self, p):
            return self.eng.open_reader(p)

    fresh = tmp_path / "fresh.ckpt"
    path = tmp_path / "c.ckpt"
    save(_state(1), path)
    monkeypatch.setattr(engine.EngineHandle, "get", lambda self: FailingEngine(real(self)))
    with pytest.raises(OSError, match="simulated"):
        save(_state(2), path)
    with pytest.raises(OSError, match="simulated"):
        save(_state(2), fresh)
    monkeypatch.undo()
    assert not fresh.exists()
    assert _temps(tmp_path) == []
    _assert_state(load(path), 1)


def test_failure_while_encoding_touches_nothing(tmp_path):
    path = tmp_path / "c.ckpt"
    save(_state(1), path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle me")

    with pytest.raises(RuntimeError, match="cannot pickle me"):
        save({"x": torch.ones(3), "bad": Unpicklable()}, path)
    _assert_state(load(path), 1)
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _letters(pid: int) -> str:
    return str(pid).translate(str.maketrans("0123456789", "abcdefghij"))


def test_temp_names_add_no_digits(tmp_path):
    """Lightning numbers ``hpc_ckpt_<N>.ckpt`` from the digits of every name containing ``ckpt_``: a temporary
    in flight must not make up a version."""
    name = os.path.basename(files.temp_path_for(str(tmp_path / "hpc_ckpt_33.ckpt")))
    assert files.is_temp_name(name) and re.sub("[^0-9]", "", name.split("ckpt_")[-1]) == "33"


@pytest.mark.parametrize("style", ["letters", "digits (earlier versions)"])
def test_temps_without_a_host_are_never_removed(tmp_path, style):
    """Names of earlier versions carry no host: on a shared file system their pid says nothing here, so cleanup
    leaves them (they are still recognised as temporaries, e.g. hidden from version scans)."""
    spell = _letters if style == "letters" else str
    tag = "deadbeef" if style != "letters" else "qwertyui"
    dead = tmp_path / f".c.ckpt.tmp-{spell(_dead_pid())}-{tag}"
    dead.write_bytes(b"partial")
    assert files.is_temp_name(dead.name)
    assert cleanup_stale_temps(str(tmp_path)) == [] and dead.exists()


def _temp_of(directory, host: str, pid: int, tag: str = "qwertyui"):
    """The temporary name a save by process ``pid`` on the host with identity tag ``host`` uses."""
    return directory / f".c.ckpt.tmp-{host}-{_letters(pid)}-{tag}"


def test_two_hosts_on_a_shared_directory_remove_only_their_own_temps(tmp_path):
    """Issue 34 item 6: on a shared file system a temporary whose pid is not alive *here* may be another host's save
    in progress. Each host removes only temporaries named with its own identity (hostname, boot, pid namespace:
    ``files.host_tag``), passed here as ``cleanup_stale_temps(..., host=)`` to play two hosts in one directory."""
    a = files.host_tag(hostname="node-a", boot_id="boot-1", pid_namespace="pid:[1]")
    b = files.host_tag(hostname="node-b", boot_id="boot-1", pid_namespace="pid:[1]")
    a_rebooted = files.host_tag(hostname="node-a", boot_id="boot-2", pid_namespace="pid:[1]")
    assert len({a, b, a_rebooted}) == 3 and all(re.fullmatch("[a-z]{12}", t) for t in (a, b, a_rebooted))
    assert files.host_tag() == files.host_tag()  # this host's own is stable within a boot
    dead = _dead_pid()  # not alive on this machine: alive or not on the other host, nobody here can tell
    a_save = _temp_of(tmp_path, a, dead, "aaaaaaaa")
    b_save = _temp_of(tmp_path, b, dead, "bbbbbbbb")
    for p in (a_save, b_save):
        p.write_bytes(b"partial")
    assert cleanup_stale_temps(str(tmp_path), host=b) == [str(b_save)]  # B removes its own dead save only
    assert a_save.exists()
    assert cleanup_stale_temps(str(tmp_path), host=a_rebooted) == []  # another boot cannot judge A's pids either
    assert cleanup_stale_temps(str(tmp_path), host=a) == [str(a_save)]
    # the default identity is this host's; a save names its temporary with it and removes nothing of A's
    assert f".tmp-{files.host_tag()}-" in files.temp_path_for(str(tmp_path / "c.ckpt"))
    a_save.write_bytes(b"partial")
    save(_state(1), tmp_path / "c.ckpt")
    assert a_save.exists()
    _assert_state(load(tmp_path / "c.ckpt"), 1)


def test_stale_temp_cleanup(tmp_path):
    here = files.host_tag()
    dead = _temp_of(tmp_path, here, _dead_pid(), "deadbeef")
    mine = _temp_of(tmp_path, here, os.getpid(), "abcdabcd")
    live = _temp_of(tmp_path, here, os.getppid(), "abcdefgh")
    unrelated = tmp_path / ".c.ckpt.tmp-notours"
    for p in (dead, mine, live, unrelated):
        p.write_bytes(b"partial")
    os.utime(live, (time.time() + 5, time.time() + 5))  # a live writer's file, newer than this process
    save(_state(1), tmp_path / "c.ckpt")
    assert not dead.exists()
    assert mine.exists() and live.exists() and unrelated.exists()
    # a live pid's file older than this process is also stale (pid reuse after a crash)
    os.utime(live, (1_000_000, 1_000_000))
    assert cleanup_stale_temps(str(tmp_path)) == [str(live)]
    _assert_state(load(tmp_path / "c.ckpt"), 1)


# One helper process imports torch once, then forks a writer per round on request (so each round does not pay
# for a fresh interpreter); the test SIGKILLs the writer by pid at a random moment.
_FORKER = textwrap.dedent("""
    import os, sys, torch
    from lightning_recover.checkpoint import save
    path = sys.argv[1]
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "go":
            pid = os.fork()
            if pid == 0:
                k = 100 + int.from_bytes(os.urandom(2), "little")
                while True:
                    save({"k": k, "w": torch.full((1_000_000,), float(k)), "v": torch.full((1000,), float(k))}, path)
                    k += 1
            print(pid, flush=True)
        elif cmd.startswith("reap"):
            os.waitpid(int(cmd.split()[1]), 0)
            print("reaped", flush=True)
        else:
            break
""")


def _readline(proc, timeout=60.0) -> bytes:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "helper process did not answer"
    return proc.stdout.readline().strip()


@pytest.mark.slow
def test_sigkill_mid_save_leaves_previous_loadable(tmp_path):
    path = tmp_path / "k.ckpt"
    save({"k": 0, "w": torch.full((1_000_000,), 0.0), "v": torch.full((1000,), 0.0)}, path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    rng = random.Random(1234)
    dead_pids = []
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert _readline(proc, 120) == b"ready"
        for _ in range(4):
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            pid = int(_readline(proc))
            time.sleep(rng.uniform(0.02, 0.5))
            os.kill(pid, signal.SIGKILL)
            proc.stdin.write(f"reap {pid}\n".encode())
            proc.stdin.flush()
            assert _readline(proc) == b"reaped"
            dead_pids.append(pid)
            out = load(path)
            k = out["k"]
            assert bool((out["w"] == float(k)).all()) and bool((out["v"] == float(k)).all())
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdin.close()
        proc.stdout.close()
    # temporaries of the killed writers are ignored by the loader and removed by the next save
    save({"k": -1}, path)
    assert not [n for n in _temps(tmp_path) if any(f"-{pid}-" in n for pid in dead_pids)]
    assert load(path) == {"k": -1}


# ---------------------------------------------------------------------------------------- plugin


def test_plugin_contract(tmp_path):
    io = UringCheckpointIO()
    path = tmp_path / "deep" / "dir" / "p.ckpt"
    io.save_checkpoint(_state(3), path)
    _assert_state(io.load_checkpoint(path), 3)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_state(3), path, storage_options={"x": 1})
    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # removing twice is fine
    io.teardown()
    io.save_checkpoint(_state(4), path)  # the engine is recreated lazily after teardown
    _assert_state(io.load_checkpoint(path, map_location="cpu"), 4)


def test_plugin_weights_only(tmp_path):
    path = tmp_path / "w.ckpt"
    UringCheckpointIO().save_checkpoint({"obj": _Custom(5)}, path)
    with pytest.raises(Exception, match="_Custom"):
        UringCheckpointIO().load_checkpoint(path)
    assert UringCheckpointIO().load_checkpoint(path, weights_only=False)["obj"].v == 5
    assert UringCheckpointIO(weights_only=False).load_checkpoint(path)["obj"].v == 5
    with pytest.raises(Exception, match="_Custom"):
        UringCheckpointIO(weights_only=False).load_checkpoint(path, weights_only=True)


class _Custom:
    def __init__(self, v):
        self.v = v


def test_plugin_accepted_by_trainer_and_fabric():
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer

    io = UringCheckpointIO()
    trainer = Trainer(
        plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    assert trainer.strategy.checkpoint_io is io
    fabric = Fabric(plugins=[UringCheckpointIO()], accelerator="cpu")
    assert isinstance(fabric.strategy.checkpoint_io, UringCheckpointIO)


def test_fabric_save_load(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(plugins=[UringCheckpointIO()], accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "step": 11})
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters())
    rest = fabric.load(tmp_path / "f.ckpt", {"model": model2, "optimizer": opt2})
    assert rest == {"step": 11}
    torch.testing.assert_close(model2.state_dict(), model.state_dict())
    torch.testing.assert_close(opt2.state_dict()["state"], opt.state_dict()["state"])
    full = fabric.load(tmp_path / "f.ckpt")
    assert full["step"] == 11 and set(full) == {"model", "optimizer", "step"}


def _tiny_module_cls():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float = 0.05, hidden: int = 8):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("step_metric", float(self.global_step))
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(32, 4, generator=g)
            ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
            return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)

    return Tiny


def _trainer(tmp_path, max_epochs, callbacks=(), io=None):
    from lightning.pytorch import Trainer

    return Trainer(
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        plugins=[io or UringCheckpointIO()],
        deterministic=True,
    )


def test_trainer_modelcheckpoint_and_resume(tmp_path):
    from lightning.pytorch import seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    Tiny = _tiny_module_cls()
    seed_everything(7)
    ref = Tiny()
    _trainer(tmp_path / "ref", 4, io=UringCheckpointIO()).fit(ref)

    seed_everything(7)
    first = Tiny()
    ckdir = tmp_path / "ck"
    mc = ModelCheckpoint(
        dirpath=ckdir, save_top_k=2, monitor="step_metric", mode="max", every_n_train_steps=2, save_last=True
    )
    _trainer(tmp_path / "a", 2, [mc]).fit(first)
    files = sorted(p for p in os.listdir(ckdir) if not p.startswith("."))
    assert "last.ckpt" in files
    assert len([f for f in files if f != "last.ckpt"]) == 2, files  # save_top_k removed the older ones
    assert _temps(ckdir) == []
    ck = load(ckdir / "last.ckpt", map_location="cpu")
    assert ck["global_step"] == 8 and ck["hyper_parameters"]["lr"] == 0.05

    seed_everything(7)
    resumed = Tiny()
    mc2 = ModelCheckpoint(
        dirpath=ckdir, save_top_k=2, monitor="step_metric", mode="max", every_n_train_steps=2, save_last=True
    )
    trainer = _trainer(tmp_path / "b", 4, [mc2])
    trainer.fit(resumed, ckpt_path=str(ckdir / "last.ckpt"))
    assert trainer.global_step == 16
    torch.testing.assert_close(resumed.state_dict(), ref.state_dict())
    files = sorted(p for p in os.listdir(ckdir) if not p.startswith("."))
    assert len([f for f in files if f != "last.ckpt"]) == 2, files


# ------------------------------------------------------------------------------------- inspect/convert


def _ns(**kw):
    return argparse.Namespace(**kw)


def test_inspect_json_and_unreadable(tmp_path, capsys):
    """``inspect`` of a good file as JSON, and of a file that is no checkpoint (text output: test_torch_zip.py)."""
    from lightning_recover.checkpoint.tools import inspect_main

    path = tmp_path / "i.ckpt"
    save(_state(1), path)
    assert inspect_main(_ns(checkpoint=str(path), no_verify=False, json=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["format_version"] == 2 and doc["num_tensors"] == 3
    assert {t["name"] for t in doc["tensors"]} >= {"state_dict/big"}
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\x00garbage" + os.urandom(10_000))
    assert inspect_main(_ns(checkpoint=str(bad), no_verify=False, json=False)) == 2


def test_convert_to_torch_save(tmp_path, capsys):
    from lightning_recover.checkpoint.tools import convert_main

    path = tmp_path / "c.ckpt"
    ck = {"state_dict": {"w": torch.randn(3, 3)}, "epoch": 1}
    ck["state_dict"]["v"] = ck["state_dict"]["w"][1]
    save(ck, path)
    out = tmp_path / "sub" / "c.pt"
    assert convert_main(_ns(checkpoint=str(path), output=str(out), unsafe_pickle=False)) == 0
    loaded = torch.load(out, weights_only=False)
    torch.testing.assert_close(loaded["state_dict"], ck["state_dict"])
    assert (
        loaded["state_dict"]["v"].untyped_storage().data_ptr() == loaded["state_dict"]["w"].untyped_storage().data_ptr()
    )

    save({"obj": _Custom(1)}, path)
    assert convert_main(_ns(checkpoint=str(path), output=str(out), unsafe_pickle=False)) == 3
    assert "--unsafe-pickle" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_subprocess(tmp_path):
    from lightning.pytorch import Trainer

    path = tmp_path / "c.ckpt"
    Tiny = _tiny_module_cls()
    model = Tiny()
    trainer = Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        plugins=[UringCheckpointIO()],
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    trainer.save_checkpoint(path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run(
        [sys.executable, "-m", "lightning_recover.cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "net.0.weight" in r.stdout and "OK" in r.stdout
    out = tmp_path / "c.pt"
    from lightning_recover.cli import main

    assert main(["convert", str(path), str(out)]) == 0
    # the converted file is a regular Lightning checkpoint
    restored = Tiny.load_from_checkpoint(out, weights_only=False)
    torch.testing.assert_close(restored.state_dict(), model.state_dict())


# ------------------------------------------------------------------------------- drop-in for TorchCheckpointIO


@pytest.mark.parametrize("wrapped", [False, True], ids=["sync", "async"])
def test_plugin_pickle_and_deepcopy(tmp_path, wrapped):
    import copy
    import pickle

    base = UringCheckpointIO(queue_depth=8, weights_only=False, verify=False)
    io = (
        AsyncUringCheckpointIO(base, max_pending_bytes=1 << 20, eager_bytes=4096, flush_bytes_per_s=1e12)
        if wrapped
        else base
    )

    assert (base.new_engine().kwargs["queue_depth"], base.weights_only, base.verify) == (8, False, False)
    for clone in (pickle.loads(pickle.dumps(io)), copy.deepcopy(io)):  # fresh plugin: nothing started yet
        assert checkpoint_io_config(clone) == checkpoint_io_config(io)
    io.save_checkpoint(_state(1), tmp_path / "a.ckpt")  # engine, saver and threads now exist
    for i, clone in enumerate((pickle.loads(pickle.dumps(io)), copy.deepcopy(io))):
        assert checkpoint_io_config(clone) == checkpoint_io_config(io)
        if wrapped:
            assert clone._saver is None and clone.pending_saves == 0  # created lazily by the copy's first save
            assert clone.checkpoint_io is not base
        clone.save_checkpoint(_state(2 + i), tmp_path / f"c{i}.ckpt")
        _assert_state(clone.load_checkpoint(tmp_path / f"c{i}.ckpt"), 2 + i)
        _assert_state(clone.load_checkpoint(tmp_path / "a.ckpt"), 1)
        if wrapped:
            assert [h["path"] for h in clone.history] == [str(tmp_path / f"c{i}.ckpt")]  # saved by its own saver
        clone.teardown()
    io.teardown()


def test_async_wrapper_saves_in_the_background_for_trainer_and_fabric(tmp_path):
    """``Trainer(plugins=[AsyncUringCheckpointIO()])`` and ``Fabric(plugins=[AsyncUringCheckpointIO(...)])`` take the
    wrapper as their IO, save through its background saver and load back what was saved."""
    from lightning.fabric import Fabric
    from lightning.pytorch.callbacks import ModelCheckpoint

    Tiny = _tiny_module_cls()
    io = AsyncUringCheckpointIO()
    model = Tiny()
    trainer = _trainer(tmp_path, 1, [ModelCheckpoint(dirpath=tmp_path / "ck", filename="last")], io=io)
    assert trainer.strategy.checkpoint_io is io and isinstance(io.checkpoint_io, UringCheckpointIO)
    trainer.fit(model)  # the epoch-end save is the last change; fit's teardown waits until it is durable
    assert [os.path.basename(h["path"]) for h in io.history] == ["last.ckpt"] and io.pending_saves == 0
    back = io.load_checkpoint(tmp_path / "ck" / "last.ckpt")
    assert back["state_dict"].keys() == model.state_dict().keys()
    assert all(torch.equal(back["state_dict"][k], v) for k, v in model.state_dict().items())

    io = AsyncUringCheckpointIO(UringCheckpointIO(verify=False))
    fabric = Fabric(plugins=[io], accelerator="cpu", devices=1)
    assert fabric.strategy.checkpoint_io is io and io.checkpoint_io.verify is False
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    fabric.save(tmp_path / "f.ckpt", {"model": net, "optimizer": opt, "step": 11})
    ref = {k: v.detach().clone() for k, v in net.state_dict().items()}
    net(torch.randn(2, 4)).sum().backward()
    opt.step()  # waits for the snapshot, then changes the parameters
    io.wait_until_durable()
    assert [h["path"] for h in io.history] == [str(tmp_path / "f.ckpt")]
    net2 = torch.nn.Linear(4, 3)
    rest = fabric.load(tmp_path / "f.ckpt", {"model": net2})
    assert rest["step"] == 11
    assert all(torch.equal(net2.state_dict()[k], v) for k, v in ref.items())
    io.teardown()


def test_trainer_with_plugin_can_be_pickled(tmp_path):
    import io as _io
    import pickle

    from lightning.pytorch.callbacks import ModelCheckpoint

    Tiny = _tiny_module_cls()
    plugin = AsyncUringCheckpointIO()
    trainer = _trainer(tmp_path, 1, [ModelCheckpoint(dirpath=tmp_path / "ck")], io=plugin)
    buf = _io.BytesIO()
    torch.save(trainer, buf)  # before fit (what ddp_spawn needs of the strategy)
    buf.seek(0)
    t2 = torch.load(buf, weights_only=False)
    assert isinstance(t2.strategy.checkpoint_io, AsyncUringCheckpointIO)
    assert isinstance(t2.strategy.checkpoint_io.checkpoint_io, UringCheckpointIO)
    trainer.fit(Tiny())  # the async saver ran (and the snapshot barrier was added to the callbacks)
    barriers = [c for c in trainer.callbacks if type(c).__name__ == "_SnapshotBarrier"]
    assert len(barriers) == 1 and barriers[0].io is plugin and trainer.callbacks[0] is barriers[0]
    io2, barrier2 = pickle.loads(pickle.dumps((plugin, barriers[0])))
    assert barrier2.io is io2 and isinstance(io2, AsyncUringCheckpointIO) and io2._saver is None


def test_remote_paths_go_through_fsspec(tmp_path, monkeypatch, caplog):
    import fsspec

    from lightning_recover.lightning import checkpoint_io as plugin_mod

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plugin_mod, "_noted_protocols", set())
    fs = fsspec.filesystem("memory")
    for i, io in enumerate((UringCheckpointIO(), AsyncUringCheckpointIO())):
        url = f"memory://bucket/run{i}/e.ckpt"
        with caplog.at_level("INFO"):
            io.save_checkpoint(_state(5), url)
        assert fs.exists(url)
        with fs.open(url, "rb") as f:
            assert f.read(2) == b"PK"  # a torch.save zip
        _assert_state(io.load_checkpoint(url), 5)
        with pytest.raises(FileNotFoundError):
            io.load_checkpoint(f"memory://bucket/run{i}/missing.ckpt")
        io.remove_checkpoint(f"memory://bucket/run{i}")  # a directory, recursively
        assert not fs.exists(url)
        io.remove_checkpoint(url)  # missing: fine
        io.teardown()
    assert os.listdir(tmp_path) == []  # nothing named like the URL on the local disk
    assert sum("local filesystems" in r.getMessage() for r in caplog.records) == 1  # noted once


def test_file_url_is_local_native(tmp_path):
    io = UringCheckpointIO()
    url = f"file://{tmp_path}/u/f.ckpt"
    io.save_checkpoint(_state(3), url)
    assert read_info(tmp_path / "u" / "f.ckpt").tensors  # the native format (with integrity record), locally
    _assert_state(io.load_checkpoint(url), 3)
    io.remove_checkpoint(url)
    assert not (tmp_path / "u" / "f.ckpt").exists()


def test_remove_checkpoint_directory(tmp_path):
    io = UringCheckpointIO()
    d = tmp_path / "dcp_dir"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x").write_bytes(b"1")
    (d / ".metadata").write_bytes(b"2")
    io.remove_checkpoint(d)
    assert not d.exists()
    io.remove_checkpoint(d)  # missing: no error
