"""Lazy asynchronous checkpoints: snapshot consistency, guard, back-pressure, durability, errors, restore."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import native_io
from lightning_recover.checkpoint import AsyncCheckpointError, CheckpointIncompleteError, files, load, read_info
from lightning_recover.checkpoint.file import async_io
from lightning_recover.checkpoint.file.async_io import _Ring, crc32c_combine
from lightning_recover.checkpoint.file.torch_zip import ALIGN, PlanWriter
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO, UringCheckpointIO
from tests.jobs import ROOT, bounded

pytestmark = pytest.mark.timeout(120)


def _temps(d) -> list:
    return [p for p in os.listdir(d) if files.is_temp_name(p)]


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _assert_same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.cpu(), b.cpu()), f"tensor {path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


@pytest.fixture
def faults(monkeypatch):
    """``_inject_faults`` of the test build, whose engine the checkpoint code then uses.

    Fault injection exists only in ``native_io._native_io_testing`` (separate globals), so the
    engines the plugin creates lazily (``native_io.IOEngine``) come from that build here.
    """
    nt = pytest.importorskip(
        "native_io._native_io_testing",
        reason="fault injection lives only in the test build native_io._native_io_testing",
    )
    monkeypatch.setattr(native_io, "IOEngine", nt.IOEngine)
    nt._inject_faults()
    yield nt._inject_faults
    nt._inject_faults()


def _model(seed=0):
    torch.manual_seed(seed)
    # 2 large weights (lazy, several chunks with small staging), small biases and BN buffers (eager)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 512))


def _train_step(model, opt, x, closure=False):
    def fwd_bwd():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    if closure:
        opt.step(fwd_bwd)
    else:
        fwd_bwd()
        opt.step()


# ------------------------------------------------------------------------------------------- pieces


def test_crc32c_combine_matches_native():
    import random

    rng = random.Random(0)
    for n1, n2 in [(0, 5), (5, 0), (1, 1), (4096, 64 << 20 >> 8), (12345, 777777)]:
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        assert crc32c_combine(native_io.crc32c(a), native_io.crc32c(b), len(b)) == native_io.crc32c(a + b)


def test_ring_fifo_wraps_and_backpressure():
    A = ALIGN  # regions start on ALIGN boundaries: the flusher writes them with O_DIRECT as they are
    r = _Ring()
    r.ensure(10 * A)
    assert r.buf.data_ptr() % A == 0
    assert r.reserve(4 * A, lambda: False) == 0
    assert r.reserve(4 * A - 100, lambda: False) == 4 * A  # rounded up to 4 * A
    got = []
    t = threading.Thread(target=lambda: got.append(r.reserve(3 * A, lambda: False)), daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive()  # 2 * A free at the end, none at the start: waits
    r.release()  # frees [0, 4 * A)
    t.join(5)
    assert got == [0]  # wrapped to the start
    assert r.reserve(1, lambda: False) == 3 * A  # one byte takes the whole page left before the oldest region
    assert r.reserve(1, lambda: True) is None  # full: it would wait; cancelled


# --------------------------------------------------------------------------------------- consistency


@pytest.mark.parametrize(
    "staging,closure",
    # one variant in the fast suite, the other three (5-6 s each of training beside the save) in the slow one
    [(None, False)]
    + [pytest.param(s, c, marks=pytest.mark.slow) for s, c in ((None, True), (1 << 20, False), (1 << 20, True))],
)
def test_snapshot_equals_state_at_save_time_while_training_continues(tmp_path, closure, staging):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(64, 512)
    io = AsyncUringCheckpointIO(max_pending_bytes=staging)
    expected = {}
    for step in range(6):
        _train_step(model, opt, x, closure)
        ck = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
        expected[step] = _clone(ck)
        io.save_checkpoint(ck, tmp_path / f"s{step}.ckpt")
        # training goes on immediately: forward mutates BN buffers, step mutates params and AdamW state
    _train_step(model, opt, x, closure)
    io.teardown()
    assert _temps(tmp_path) == []
    for step, ref in expected.items():
        got = load(tmp_path / f"s{step}.ckpt")
        _assert_same(ref, got)
    # the last save really was lazy: the live params moved on after it
    assert not torch.equal(model[0].weight, expected[5]["model"]["0.weight"])


def test_step_waits_for_snapshot_with_small_staging(tmp_path):
    big = torch.nn.Parameter(torch.randn(4_000_000))  # 16 MB through a 1 MiB ring: many chunks, back-pressure
    opt = torch.optim.SGD([big], lr=1.0)
    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20)
    ref = big.detach().clone()
    io.save_checkpoint({"w": big}, tmp_path / "a.ckpt")
    big.grad = torch.ones_like(big)
    opt.step()  # the global pre-hook blocks until the snapshot is complete
    assert torch.equal(big.detach(), ref - 1)
    io.wait_until_durable()
    assert torch.equal(load(tmp_path / "a.ckpt")["w"], ref)
    assert io.history[-1]["error"] is None
    info = read_info(tmp_path / "a.ckpt")
    assert info.index.records["data/0"].nbytes == 16_000_000  # written in 1 MiB chunks, checksummed whole
    if io.history[-1]["direct"]:  # every aligned page went to the disk straight from the staging ring
        assert io.history[-1]["unstaged_bytes"] == 16_000_000 // ALIGN * ALIGN
    io.teardown()


def test_paced_flush_writes_no_faster_than_asked_and_the_same_bytes(tmp_path):
    """``flush_bytes_per_s`` spreads the write over time (a lower bound: sleeps, not the machine's speed)."""
    big = torch.randn(4 * 1024 * 1024)  # 16 MiB in 1 MiB chunks, paced at 32 MiB/s: at least ~0.47 s
    rate = 32 * 1024 * 1024
    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20, flush_bytes_per_s=rate)
    io.save_checkpoint({"w": big}, tmp_path / "a.ckpt")
    io.wait_for_snapshot()
    io.wait_until_durable()
    h = io.history[-1]
    assert h["error"] is None
    assert h["durable_s"] >= (big.numel() * 4 - (1 << 20)) / rate  # every chunk but the first waited its turn
    assert torch.equal(load(tmp_path / "a.ckpt")["w"], big)
    io.teardown()
    with pytest.raises(ValueError, match="flush_bytes_per_s"):
        AsyncUringCheckpointIO(flush_bytes_per_s=0)


def test_wrapper_refuses_what_it_cannot_run():
    from lightning.fabric.plugins import TorchCheckpointIO

    with pytest.raises(ValueError, match="max_pending_bytes"):
        AsyncUringCheckpointIO(max_pending_bytes=1024)
    with pytest.raises(TypeError, match="wraps a UringCheckpointIO, not TorchCheckpointIO"):
        AsyncUringCheckpointIO(TorchCheckpointIO())
    with pytest.raises(TypeError):
        UringCheckpointIO(async_save=True)  # one way to save asynchronously: the wrapper


def test_explicit_wait_for_snapshot_and_pending(tmp_path):
    w = torch.randn(3_000_000)
    io = AsyncUringCheckpointIO()
    io.save_checkpoint({"w": w}, tmp_path / "a.ckpt")
    ref = w.clone()
    io.wait_for_snapshot()
    w.zero_()  # mutation outside an optimizer: allowed after wait_for_snapshot
    io.wait_until_durable()
    assert io.pending_saves == 0
    assert torch.equal(load(tmp_path / "a.ckpt")["w"], ref)
    io.teardown()


def _gated_tail(monkeypatch):
    """Hold every save's last step (tail, fdatasync, rename) until the returned event is set."""
    gate = threading.Event()
    gate.entered = threading.Event()  # a save reached its tail: every data record is written
    real = PlanWriter.finish

    def slow_tail(*a, **kw):
        gate.entered.set()
        gate.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(PlanWriter, "finish", slow_tail)
    return gate


@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "named-temp"])
def test_final_name_appears_only_when_durable(tmp_path, monkeypatch, unnamed):
    if not unnamed:  # a filesystem without O_TMPFILE: the data goes to a hidden temporary name
        monkeypatch.setattr(async_io, "_open_unnamed_writer", lambda engine, job: None)
    gate = _gated_tail(monkeypatch)
    io = AsyncUringCheckpointIO()
    io.save_checkpoint({"w": torch.randn(1_000_000)}, tmp_path / "a.ckpt")
    io.wait_for_snapshot()
    assert gate.entered.wait(20)  # the flusher wrote every record and waits before fdatasync + commit
    # the name is reserved by an empty placeholder (ModelCheckpoint sees it as taken); the data is in an unnamed
    # file (nothing else listed: Lightning's exact-listing checks hold) or, without O_TMPFILE, in the temp
    assert (tmp_path / "a.ckpt").stat().st_size == 0
    assert len(_temps(tmp_path)) == (0 if unnamed else 1) and len(os.listdir(tmp_path)) == (1 if unnamed else 2)
    with pytest.raises(CheckpointIncompleteError, match="did not complete"):
        read_info(tmp_path / "a.ckpt")  # a reader that does not wait (another process, say) sees a named error
    gate.set()
    io.wait_until_durable()
    assert (tmp_path / "a.ckpt").stat().st_size > 0 and _temps(tmp_path) == []
    io.teardown()


def test_load_waits_for_pending_save(tmp_path):
    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20)
    w = torch.randn(2_000_000)
    io.save_checkpoint({"w": w}, tmp_path / "a.ckpt")
    out = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(out["w"], w)
    io.teardown()


# ------------------------------------------------------------------------------------------- removal


def test_removal_is_deferred_until_newer_save_is_durable(tmp_path, monkeypatch):
    io = AsyncUringCheckpointIO()
    io.save_checkpoint({"k": 1, "w": torch.randn(1_000_000)}, tmp_path / "old.ckpt")
    io.wait_until_durable()
    gate = _gated_tail(monkeypatch)
    io.save_checkpoint({"k": 2, "w": torch.randn(1_000_000)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")  # what ModelCheckpoint(save_top_k=1) does right after saving
    assert (tmp_path / "old.ckpt").exists()  # the only durable checkpoint is kept
    gate.set()
    io.wait_until_durable()
    assert not (tmp_path / "old.ckpt").exists() and load(tmp_path / "new.ckpt")["k"] == 2
    io.teardown()


def _durable_old_then_failing_new(tmp_path, faults):
    """An async plugin with a durable ``old.ckpt`` (k=1) and a save of ``new.ckpt`` (k=2) whose first write fails."""
    io = AsyncUringCheckpointIO()
    io.save_checkpoint({"k": 1, "w": torch.randn(1_000_000)}, tmp_path / "old.ckpt")
    io.wait_until_durable()
    faults(eio_at=1)
    io.save_checkpoint({"k": 2, "w": torch.randn(1_000_000)}, tmp_path / "new.ckpt")
    return io


def test_removal_skipped_when_newer_save_fails(tmp_path, faults):
    io = _durable_old_then_failing_new(tmp_path, faults)
    io.remove_checkpoint(tmp_path / "old.ckpt")
    with pytest.raises(AsyncCheckpointError, match="new.ckpt") as ei:
        io.wait_until_durable()
    assert isinstance(ei.value.__cause__, OSError)
    faults()
    assert load(tmp_path / "old.ckpt")["k"] == 1
    assert not (tmp_path / "new.ckpt").exists() and _temps(tmp_path) == []
    io.teardown()


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("surface", ["save", "step", "teardown"])
def test_background_error_surfaces_at_next_call(tmp_path, surface, faults):
    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20)
    p = torch.nn.Parameter(torch.randn(2_000_000))
    opt = torch.optim.SGD([p], lr=0.1)
    io.save_checkpoint({"w": p, "k": 1}, tmp_path / "c.ckpt")
    io.wait_until_durable()
    faults(eio_at=1)
    io.save_checkpoint({"w": p, "k": 2}, tmp_path / "c.ckpt")
    # wait (without raising) until the background failure happened
    assert async_io.wait_for_path(tmp_path / "c.ckpt", timeout=30)
    faults()
    with pytest.raises(AsyncCheckpointError, match="c.ckpt") as ei:
        if surface == "save":
            io.save_checkpoint({"w": p, "k": 3}, tmp_path / "d.ckpt")
        elif surface == "step":
            p.grad = torch.ones_like(p)
            opt.step()
        else:
            io.teardown()
    assert "Input/output error" in str(ei.value) or "EIO" in str(ei.value) or "I/O" in str(ei.value)
    assert load(tmp_path / "c.ckpt")["k"] == 1  # previous checkpoint intact
    assert _temps(tmp_path) == []
    io.save_checkpoint({"w": p, "k": 4}, tmp_path / "c.ckpt")  # reported once; saving works again
    io.teardown()
    assert load(tmp_path / "c.ckpt")["k"] == 4


# ------------------------------------------------------------------------------------------ Lightning


def _bn_module_cls():
    import lightning.pytorch as pl

    class BN(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model(1)
            self.saved = {}

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).square().mean()

        def on_save_checkpoint(self, checkpoint):
            # the state at save time (Lightning calls this while building the checkpoint dict)
            self.saved[self.global_step] = {
                "state_dict": _clone(self.state_dict()),
                "opt": _clone(self.trainer.optimizers[0].state_dict()["state"]),
            }

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

        def train_dataloader(self):
            x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)

    return BN


def _quiet_cpu_trainer(tmp_path, **kwargs):
    """A Trainer on the CPU in ``tmp_path``, without logger, progress bar or model summary."""
    from lightning.pytorch import Trainer

    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.slow  # a Trainer fit
def test_trainer_async_modelcheckpoint(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    BN = _bn_module_cls()
    model = BN()
    io = AsyncUringCheckpointIO()
    mc = ModelCheckpoint(
        dirpath=tmp_path / "ck", save_top_k=1, every_n_train_steps=1, save_last=True, filename="{step}"
    )
    trainer = _quiet_cpu_trainer(
        tmp_path,
        max_steps=6,
        callbacks=[mc],
        plugins=[io],
    )
    trainer.fit(model)  # teardown waits for durability
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == ["last.ckpt", "step=6.ckpt"], files  # top-1 removal ran after the newer save was durable
    for name in files:
        ck = load(tmp_path / "ck" / name)
        ref = model.saved[ck["global_step"]]
        _assert_same(ref["state_dict"], ck["state_dict"])
        _assert_same(ref["opt"], ck["optimizer_states"][0]["state"])
    # resume from the async checkpoint
    model2 = BN()
    t2 = _quiet_cpu_trainer(
        tmp_path,
        max_steps=7,
        enable_checkpointing=False,
        plugins=[AsyncUringCheckpointIO()],
    )
    t2.fit(model2, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert t2.global_step == 7


@pytest.mark.slow  # a Trainer fit
def test_trainer_consistency_mid_training(tmp_path):
    """Checkpoints taken every step while training mutates the state equal the state at save time."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    BN = _bn_module_cls()
    model = BN()
    io = AsyncUringCheckpointIO(max_pending_bytes=1 << 20)  # forces back-pressure
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    trainer = _quiet_cpu_trainer(
        tmp_path,
        max_steps=5,
        callbacks=[mc],
        plugins=[io],
    )
    trainer.fit(model)
    for step in range(1, 6):
        ck = load(tmp_path / f"step={step}.ckpt")
        _assert_same(model.saved[step]["state_dict"], ck["state_dict"])
        _assert_same(model.saved[step]["opt"], ck["optimizer_states"][0]["state"])


def test_fabric_async_save_and_in_place_restore(tmp_path):
    from lightning.fabric import Fabric

    io = AsyncUringCheckpointIO()
    fabric = Fabric(plugins=[io], accelerator="cpu", devices=1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    x = torch.randn(32, 512)
    _train_step(model, opt, x)
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "step": 1})
    ref_model = _clone(model.state_dict())
    ref_opt = _clone(opt.state_dict()["state"])
    for _ in range(2):
        _train_step(model, opt, x)  # optimizer.step waits for the snapshot, then mutates
    io.wait_until_durable()

    model2 = _model(5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    _train_step(model2, opt2, x)  # optimizer state exists: it is filled in place too
    ptrs = [p.data_ptr() for p in model2.parameters()] + [t.data_ptr() for s in opt2.state.values() for t in s.values()]
    with io.restore_into({"model": model2, "optimizer": opt2}):
        rest = fabric.load(tmp_path / "f.ckpt", {"model": model2, "optimizer": opt2})
    assert rest == {"step": 1}
    _assert_same(ref_model, model2.state_dict())
    _assert_same(ref_opt, opt2.state_dict()["state"])
    assert ptrs == [p.data_ptr() for p in model2.parameters()] + [
        t.data_ptr() for s in opt2.state.values() for t in s.values()
    ]
    io.teardown()


# ------------------------------------------------------------------------ drop-in for TorchCheckpointIO


def _bounded(fn, timeout: float = 30.0):
    return bounded(fn, timeout)


def test_async_remove_directory_deferred(tmp_path, monkeypatch):
    io = AsyncUringCheckpointIO()
    d = tmp_path / "old_dir"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x").write_bytes(b"1")
    gate = _gated_tail(monkeypatch)
    io.save_checkpoint({"w": torch.randn(1_000_000)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(d)  # deferred behind the pending save
    io.remove_checkpoint(tmp_path / "missing_dir")  # deferred too; missing is fine
    assert d.exists()
    gate.set()
    _bounded(io.wait_until_durable)
    assert not d.exists()
    io.remove_checkpoint(tmp_path / "missing_dir")  # immediate path, missing is fine
    io.teardown()


def test_in_flight_name_is_reserved_and_failed_save_releases_it(tmp_path, faults):
    io = _durable_old_then_failing_new(tmp_path, faults)
    assert (tmp_path / "new.ckpt").exists()  # taken from submit on (an empty placeholder until durable)
    with pytest.raises(AsyncCheckpointError, match="new.ckpt"):
        _bounded(io.wait_until_durable)
    faults()
    assert not (tmp_path / "new.ckpt").exists() and _temps(tmp_path) == []  # placeholder removed
    assert load(tmp_path / "old.ckpt")["k"] == 1  # the previous checkpoint (other name) stays loadable
    io.teardown()


def test_placeholder_is_a_named_error(tmp_path):
    (tmp_path / "crashed.ckpt").write_bytes(b"")  # what a crash mid-save leaves at a name never saved before
    with pytest.raises(CheckpointIncompleteError, match="did not complete"):
        load(tmp_path / "crashed.ckpt")
    with pytest.raises(CheckpointIncompleteError, match="crashed.ckpt"):
        UringCheckpointIO().load_checkpoint(tmp_path / "crashed.ckpt")


def test_load_by_another_instance_waits_for_that_path_only(tmp_path, monkeypatch):
    a, b = AsyncUringCheckpointIO(), UringCheckpointIO()
    a.save_checkpoint({"k": 1, "w": torch.zeros(1_000_000)}, tmp_path / "c.ckpt")
    a.save_checkpoint({"k": 1}, tmp_path / "other.ckpt")
    a.wait_until_durable()
    gate = _gated_tail(monkeypatch)
    a.save_checkpoint({"k": 2, "w": torch.ones(1_000_000)}, tmp_path / "c.ckpt")
    got = []
    t = threading.Thread(target=lambda: got.append(b.load_checkpoint(tmp_path / "c.ckpt")), daemon=True)
    t.start()
    assert _bounded(lambda: b.load_checkpoint(tmp_path / "other.ckpt"))["k"] == 1  # not blocked by c.ckpt
    t.join(0.5)
    assert t.is_alive() and not got  # waits for the in-flight save of c.ckpt
    gate.set()
    t.join(30)
    assert got and got[0]["k"] == 2 and bool((got[0]["w"] == 1).all())  # the new contents
    assert load(tmp_path / "c.ckpt")["k"] == 2  # the module-level load waits the same way
    a.teardown()


def test_failed_deferred_removal_keeps_flusher_alive(tmp_path, monkeypatch):
    io = AsyncUringCheckpointIO()
    io.save_checkpoint({"k": 1}, tmp_path / "old.ckpt")
    io.wait_until_durable()
    real_remove = async_io.remove_path

    def failing_remove(path):
        raise PermissionError(13, "injected", path)

    monkeypatch.setattr(async_io, "remove_path", failing_remove)
    gate = _gated_tail(monkeypatch)
    io.save_checkpoint({"k": 2, "w": torch.randn(1_000_000)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")  # deferred; fails in the flusher
    gate.set()
    with pytest.raises(AsyncCheckpointError, match="removal of checkpoint .*old.ckpt") as ei:
        _bounded(io.wait_until_durable)
    assert isinstance(ei.value.__cause__, PermissionError)
    monkeypatch.setattr(async_io, "remove_path", real_remove)
    io.save_checkpoint({"k": 3, "w": torch.randn(1_000_000)}, tmp_path / "newer.ckpt")  # the flusher is alive
    _bounded(io.wait_until_durable)
    assert load(tmp_path / "newer.ckpt")["k"] == 3 and load(tmp_path / "new.ckpt")["k"] == 2
    assert load(tmp_path / "old.ckpt")["k"] == 1
    _bounded(io.teardown)


def test_failed_deferred_removal_surfaces_at_next_save(tmp_path, monkeypatch):
    io = AsyncUringCheckpointIO()
    monkeypatch.setattr(async_io, "remove_path", lambda path: (_ for _ in ()).throw(OSError(5, "injected", path)))
    gate = _gated_tail(monkeypatch)
    io.save_checkpoint({"k": 2, "w": torch.randn(1_000_000)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")
    gate.set()
    deadline = time.monotonic() + 30
    while not io._saver._errors and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(AsyncCheckpointError, match="old.ckpt"):
        _bounded(lambda: io.save_checkpoint({"k": 3}, tmp_path / "x.ckpt"))
    io.save_checkpoint({"k": 4}, tmp_path / "x.ckpt")  # reported once
    _bounded(io.teardown)
    assert load(tmp_path / "x.ckpt")["k"] == 4


def _slow_copier(monkeypatch, seconds=0.3):
    real = async_io.AsyncSaver._snapshot

    def slow(self, job, fq):
        time.sleep(seconds)
        return real(self, job, fq)

    monkeypatch.setattr(async_io.AsyncSaver, "_snapshot", slow)


def test_in_place_change_before_lazy_copy_fails_the_save(tmp_path, monkeypatch):
    io = AsyncUringCheckpointIO()
    w = torch.nn.Parameter(torch.zeros(1_000_000))
    io.save_checkpoint({"k": 1, "w": w}, tmp_path / "a.ckpt")
    io.wait_until_durable()
    _slow_copier(monkeypatch)
    io.save_checkpoint({"k": 2, "w": w}, tmp_path / "a.ckpt")
    io.save_checkpoint({"k": 2, "w": w}, tmp_path / "b.ckpt")
    with torch.no_grad():
        w.add_(1.0)  # e.g. an EMA update outside optimizer.step(), before the lazy copy ran
    with pytest.raises(AsyncCheckpointError, match="changed in place") as ei:
        _bounded(io.wait_until_durable)
    assert isinstance(ei.value.__cause__, async_io.snapshot_guard.SnapshotRaceError)
    assert "2 more" not in str(ei.value) and "1 more" in str(ei.value)  # both saves failed, none committed
    assert load(tmp_path / "a.ckpt")["k"] == 1 and bool((load(tmp_path / "a.ckpt")["w"] == 0).all())
    assert not (tmp_path / "b.ckpt").exists() and _temps(tmp_path) == []
    io.teardown()


def _ema_module_cls():
    import lightning.pytorch as pl

    class EMA(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8))
            self.saved = {}

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch, batch_idx):
            self.log("v", self.net(batch[0]).square().mean())

        def on_save_checkpoint(self, checkpoint):  # runs last: the dict as it is handed to the plugin
            keys = ("state_dict", "current_model_state")
            self.saved[checkpoint["global_step"]] = {k: _clone(checkpoint[k]) for k in keys if k in checkpoint}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)

        val_dataloader = train_dataloader

    return EMA


@pytest.mark.slow  # a Trainer fit
def test_trainer_weight_averaging_async_checkpoints_hold_save_time_state(tmp_path, monkeypatch):
    """EMAWeightAveraging swaps weights for validation and copies the average into the model at the end of
    training through ``param.data`` (no version bump): the snapshot barrier makes the lazy copies happen first."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

    _slow_copier(monkeypatch)
    EMA = _ema_module_cls()
    model = EMA()
    trainer = _quiet_cpu_trainer(
        tmp_path,
        max_steps=6,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[
            EMAWeightAveraging(decay=0.5),
            ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=1, filename="{step}"),
        ],
        plugins=[AsyncUringCheckpointIO()],
    )
    trainer.fit(model)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == [f"step={s}.ckpt" for s in range(1, 7)], names
    for name in names:
        ck = load(tmp_path / "ck" / name)
        ref = model.saved[ck["global_step"]]
        assert set(ref) == {"state_dict", "current_model_state"}
        for k in ref:
            _assert_same(ref[k], ck[k], f"{name}:{k}")


@pytest.mark.slow  # a Trainer fit
def test_trainer_in_flight_name_gets_version_suffix(tmp_path, monkeypatch):
    """ModelCheckpoint's ``-vN`` versioning sees a name whose async save is still in flight as taken."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    real = PlanWriter.finish

    def slow_tail(*a, **kw):
        time.sleep(0.3)
        return real(*a, **kw)

    monkeypatch.setattr(PlanWriter, "finish", slow_tail)

    class Logged(_bn_module_cls()):
        def training_step(self, batch, batch_idx):
            self.log("m", float(self.global_step))
            return super().training_step(batch, batch_idx)

    model = Logged()
    trainer = _quiet_cpu_trainer(
        tmp_path,
        max_steps=3,
        callbacks=[
            ModelCheckpoint(
                dirpath=tmp_path / "ck", save_top_k=-1, monitor="m", mode="max", every_n_train_steps=1, filename="fixed"
            )
        ],
        plugins=[AsyncUringCheckpointIO()],
    )
    trainer.fit(model)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed.ckpt"], names
    for name, step in [("fixed.ckpt", 1), ("fixed-v1.ckpt", 2), ("fixed-v2.ckpt", 3)]:
        ck = load(tmp_path / "ck" / name)
        assert ck["global_step"] == step, name
        _assert_same(model.saved[step]["state_dict"], ck["state_dict"])


@pytest.mark.slow  # a Trainer fit
def test_trainer_in_place_change_after_save_is_detected(tmp_path, monkeypatch):
    """A LightningModule hook runs after ModelCheckpoint saved and changes a weight in place before the (slowed)
    lazy copy: that save fails loudly instead of holding a value that never existed at save time."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _slow_copier(monkeypatch)

    class Meddling(_ema_module_cls()):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.global_step == 2:
                with torch.no_grad():
                    self.net[0].weight.add_(0.5)  # e.g. a hand-written EMA/clipping outside optimizer.step()

    model = Meddling()
    trainer = _quiet_cpu_trainer(
        tmp_path,
        max_steps=4,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=1, filename="{step}")],
        plugins=[AsyncUringCheckpointIO()],
    )
    with pytest.raises(AsyncCheckpointError, match="changed in place"):
        _bounded(lambda: trainer.fit(model), timeout=60)
    assert not (tmp_path / "ck" / "step=2.ckpt").exists()  # nothing committed for the raced save
    ck = load(tmp_path / "ck" / "step=1.ckpt")
    _assert_same(model.saved[1]["state_dict"], ck["state_dict"])


def test_idle_saver_holds_no_threads(tmp_path):
    """The copier and flusher exit once the last save is durable and start again with the next save."""

    def ours():
        return [t for t in threading.enumerate() if t.name.startswith("lr-ckpt-")]

    io = AsyncUringCheckpointIO()
    for k in range(3):
        io.save_checkpoint({"w": torch.full((300_000,), float(k)), "k": k}, tmp_path / f"{k}.ckpt")
        io.wait_until_durable()
        deadline = time.monotonic() + 10
        while ours() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ours() == []
        assert load(tmp_path / f"{k}.ckpt")["k"] == k
    io.save_checkpoint({"w": torch.ones(300_000), "k": 9}, tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "0.ckpt")  # queued behind the save, done before the threads retire
    io.teardown()
    assert not (tmp_path / "0.ckpt").exists() and load(tmp_path / "a.ckpt")["k"] == 9


@pytest.mark.parametrize("how", ["bare", "closure", "fabric"])
def test_every_way_of_stepping_waits_and_an_idle_hook_is_disarmed(tmp_path, monkeypatch, how):
    """Issue 34 item 2: the step waits for the lazy snapshot however it is called (a bare ``torch.optim`` optimizer,
    with a closure, Fabric's optimizer wrapper; Lightning's ``LightningOptimizer`` in test_lightning_compat), so the
    checkpoint holds the values at save time; once nothing is pending the global hook is disarmed (one flag test per
    step) and re-armed by the next save."""
    from lightning.fabric import Fabric

    from lightning_recover.checkpoint import snapshot_guard

    _slow_copier(monkeypatch, seconds=0.3)
    w = torch.nn.Parameter(torch.ones(1_000_000))
    opt = torch.optim.SGD([w], lr=1.0)
    if how == "fabric":
        fabric = Fabric(accelerator="cpu", devices=1)
        opt = fabric.setup_optimizers(opt)
    io = AsyncUringCheckpointIO(eager_bytes=0)
    for round_ in range(2):
        before = w.detach().clone()
        io.save_checkpoint({"w": w}, tmp_path / f"r{round_}.ckpt")
        assert snapshot_guard.hook_state() == "armed" and io._saver.snapshot_pending()
        w.grad = torch.ones_like(w)
        if how == "closure":
            opt.step(lambda: None)
        else:
            opt.step()
        assert not io._saver.snapshot_pending()  # the step waited for the copy before changing w
        assert torch.equal(w.detach(), before - 1)
        opt.step()  # nothing pending: this step disarms the hook
        assert snapshot_guard.hook_state() == "disarmed"
        io.wait_until_durable()
        assert torch.equal(load(tmp_path / f"r{round_}.ckpt")["w"], before)
    io.teardown()


def test_guarded_load_state_dict_waits_for_the_snapshot(tmp_path, monkeypatch):
    """Issue 34 item 2: ``load_state_dict`` copies into the parameters in place; on a module passed to ``guard_loads``
    (the Trainer does it for its LightningModule) it waits for a pending lazy snapshot instead of failing that save
    with ``SnapshotRaceError``. The guarded module still pickles and deep-copies."""
    import copy
    import io as bytes_io
    import pickle

    _slow_copier(monkeypatch, seconds=0.3)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8))
    io = AsyncUringCheckpointIO(eager_bytes=0)
    io.guard_loads(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    io.save_checkpoint({"state_dict": model.state_dict()}, tmp_path / "a.ckpt")
    assert io._saver.snapshot_pending()
    model[0].load_state_dict({k: torch.zeros_like(v) for k, v in model[0].state_dict().items()})  # a submodule
    io.wait_until_durable()
    _assert_same(before, load(tmp_path / "a.ckpt")["state_dict"])
    assert float(model[0].weight.abs().sum()) == 0.0
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        clone.load_state_dict(model.state_dict())  # the copies' hooks do nothing
    torch.save(model, bytes_io.BytesIO())
    io.teardown()


_EXIT_WITH_A_SAVE_IN_FLIGHT = """
import sys, time, torch
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO
io = AsyncUringCheckpointIO(flush_bytes_per_s=16e6)  # ~0.75 s of paced flushing for 12 MB
io.save_checkpoint({"w": torch.full((3_000_000,), 7.0), "k": 7}, sys.argv[1])
io.wait_for_snapshot()
print(f"exiting {time.monotonic()}", flush=True)  # no wait_until_durable, no teardown: the exit handler drains
"""


@pytest.mark.slow  # starts an interpreter (house30's rule: what starts processes is slow)
def test_interpreter_exit_drains_a_save_in_flight(tmp_path):
    """A script that saves asynchronously and simply ends: the saver's exit handler (``_drain_at_exit``)
    finishes the save, so the checkpoint is complete under its name and the interpreter took the flush's
    time to exit (its threads are daemon threads, which exit alone would abandon)."""
    import subprocess
    import sys

    path = tmp_path / "last.ckpt"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_SAVE_IN_FLIGHT, str(path)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-3000:]
    exiting = float(proc.stdout.split("exiting ")[1])
    assert ended - exiting >= 0.3, "the interpreter exited before the paced flush could have finished"
    assert _temps(tmp_path) == []
    state = load(path)
    assert state["k"] == 7 and torch.equal(state["w"], torch.full((3_000_000,), 7.0))


def _smaps_entry(address: int) -> dict:
    """The ``/proc/self/smaps`` fields of the mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        entry: dict = {}
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    return entry
                inside = lo <= address < hi
                entry = {"flags": line.split()[1]}
            elif inside:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert inside, f"no mapping holds {address:#x}"
    return entry


def test_the_staging_ring_memory_is_private_and_eligible_for_transparent_huge_pages():
    # the flusher writes O_DIRECT from the ring: from 4 KiB pages virtio-blk splits each write into ~1 MiB
    # requests; a shared anonymous mapping (shmem) never gets transparent huge pages
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off on this machine (enabled: never)")
    from lightning_recover.checkpoint.engine import huge_page_bytes

    ring = async_io._host_staging(8 << 20)
    entry = _smaps_entry(ring.data_ptr())
    assert entry["flags"].endswith("p"), entry  # private, not shmem
    assert entry["THPeligible"] == "1", entry
    # a forked DataLoader worker does not inherit it: the saver's writes copy no page on the child's account
    assert "dc" in entry["VmFlags"].split(), entry
    inherited = huge_page_bytes(8 << 20)
    assert "dc" not in _smaps_entry(inherited.data_ptr())["VmFlags"].split()


def _reap(pid: int, timeout: float):
    """The child's wait status once it exits; None (and the child killed) if it has not within ``timeout``."""
    done = threading.Event()
    out: list = []

    def wait() -> None:
        out.append(os.waitpid(pid, 0)[1])
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    if done.wait(timeout):
        return out[0]
    os.kill(pid, 9)
    done.wait(10)
    return None


def test_a_forked_child_does_not_inherit_the_ring_nor_wait_for_the_parents_save(tmp_path):
    """A process forked while a save is in flight (a DataLoader worker, a user's ``os.fork()``): the child's
    teardown returns at once, with no error (the save and the threads are the parent's; it neither waits for them
    nor reports them lost) and without touching the ring it did not inherit; the parent's save, written into the
    ring while the child lives, is whole."""
    big = torch.randn(2 * 1024 * 1024)  # 8 MiB: copied lazily, through the ring
    io = AsyncUringCheckpointIO(flush_bytes_per_s=4 * 1024 * 1024)  # paced: in flight for ~2 s
    io.save_checkpoint({"w": big}, tmp_path / "a.ckpt")
    io.wait_for_snapshot()
    assert io.history == []  # still in flight when the child is forked
    pid = os.fork()
    if pid == 0:  # the child ends as a Trainer's teardown would, then runs the exit handler
        status = 1
        try:
            io.teardown()
            async_io._drain_at_exit()
            status = 0
        finally:
            os._exit(status)
    status = _reap(pid, 60)
    assert status is not None, "the forked child's teardown hung, waiting for the parent's save"
    # 1: its teardown raised (the parent's save called lost); -11: it touched the ring (SIGSEGV)
    assert os.waitstatus_to_exitcode(status) == 0
    io.wait_until_durable()
    assert io.history[-1]["error"] is None
    assert torch.equal(load(tmp_path / "a.ckpt")["w"], big)
    io.teardown()
